//! Tests of `decode`.

use super::*;

fn hex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn expected(dp_rank: i64) -> EventBatch {
    EventBatch {
        ts: 1700000000.5,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(9561501211280363793), EngineHash(15292913576410714033)],
                parent_block_hash: None,
                token_ids: (1..=8).collect(),
                block_size: 4,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: Some(vec![None, None]),
                cache_salt: None,
                locality: None,
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(9561501211280363793)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }),
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(dp_rank),
    }
}

/// The positional (vLLM 0.22) hex example from the spec, §1.4.
#[test]
fn decodes_positional_spec_example() {
    let payload = hex(include_str!("../../../../testdata/kv-events/vllm-0.22-positional.hex"));
    assert_eq!(decode_batch(&payload).unwrap(), expected(0));
}

/// The map (vLLM 0.33) example from the spec, §1.4, assembled from its annotated hex.
#[test]
fn decodes_map_spec_example() {
    let payload = hex(include_str!("../../../../testdata/kv-events/vllm-0.33-map.hex"));
    assert_eq!(decode_batch(&payload).unwrap(), expected(0));
}

#[test]
fn short_arrays_signed_and_binary_hashes() {
    // vLLM 0.9: [ts, [["BlockStored", [-1], nil, [1,2], 2, nil]]] — 2-element batch, 6-element event.
    let payload = hex("92cb3ff000000000000091 96ab426c6f636b53746f72656491ffc0920102 02c0".replace(' ', "").as_str());
    let batch = decode_batch(&payload).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else { panic!() };
    assert_eq!((s.block_hashes[0], s.medium.as_deref(), batch.data_parallel_rank), (EngineHash(u64::MAX), None, None));
    // bin hash: last 8 bytes big-endian.
    let payload = hex("92cb3ff00000000000009192ac426c6f636b52656d6f76656491c40a0000000000000000002a");
    let KvEvent::BlockRemoved(r) = &decode_batch(&payload).unwrap().events[0] else { panic!() };
    assert_eq!(r.block_hashes, [EngineHash(42)]);
}

/// SGLang 0.5.23: map events with `cache_salt`, signed hashes, one event per page.
#[test]
fn decodes_sglang_maps() {
    let mut b = Vec::new();
    let w = &mut b;
    rmp::encode::write_array_len(w, 3).unwrap();
    rmp::encode::write_f64(w, 2.0).unwrap();
    rmp::encode::write_array_len(w, 1).unwrap();
    rmp::encode::write_map_len(w, 7).unwrap();
    for (k, v) in [("type", "BlockStored"), ("medium", "CPU_PINNED"), ("cache_salt", "tenant-7")] {
        rmp::encode::write_str(w, k).unwrap();
        rmp::encode::write_str(w, v).unwrap();
    }
    rmp::encode::write_str(w, "block_hashes").unwrap();
    rmp::encode::write_array_len(w, 1).unwrap();
    rmp::encode::write_sint(w, -5).unwrap();
    rmp::encode::write_str(w, "parent_block_hash").unwrap();
    rmp::encode::write_sint(w, -6).unwrap();
    rmp::encode::write_str(w, "token_ids").unwrap();
    rmp::encode::write_array_len(w, 1).unwrap();
    rmp::encode::write_uint(w, 42).unwrap();
    rmp::encode::write_str(w, "block_size").unwrap();
    rmp::encode::write_uint(w, 1).unwrap();
    rmp::encode::write_sint(w, 3).unwrap(); // attn_dp_rank
    let batch = decode_batch(&b).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!(s.block_hashes, [EngineHash(-5i64 as u64)]);
    assert_eq!(s.parent_block_hash, Some(EngineHash(-6i64 as u64)));
    assert_eq!((s.cache_salt.as_deref(), s.medium.as_deref()), (Some("tenant-7"), Some("CPU_PINNED")));
    assert_eq!(batch.data_parallel_rank, Some(3));
}

#[test]
fn hostile_sizes_and_depths_fail_fast() {
    // An array declaring 2^32-1 events, with nothing behind it.
    assert!(decode_batch(b"\x92\xcb\0\0\0\0\0\0\0\0\xdd\xff\xff\xff\xff").is_err());
    // A string declaring 4 GiB.
    assert!(decode_batch(b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x92\xdb\xff\xff\xff\xff").is_err());
    // 100k nested arrays.
    let mut deep = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    deep.extend(std::iter::repeat_n(0x91, 100_000));
    assert!(decode_batch(&deep).is_err());
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for bad in
        [&b""[..], b"\xc1", b"\x93\x01", b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x81\xa4type\xa3Foo", b"\xdd\xff\xff\xff\xff"]
    {
        assert!(decode_batch(bad).is_err(), "{bad:?}");
    }
}

/// Writes `event` as vLLM or SGLang would: positional (trailing absent fields cut at
/// random) or a map (keys shuffled, the tag anywhere, an unknown key added); each hash as
/// an unsigned, a signed or a bytes value, chosen by `seed`.
fn encode_event(w: &mut Vec<u8>, event: &KvEvent, positional: bool, seed: u64) {
    use rmp::encode as mp;
    // Each field is encoded to its own bytes first (`None` = absent), then laid out.
    let bytes = |put: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        put(&mut b);
        b
    };
    let hash = |w: &mut Vec<u8>, h: EngineHash| match (h.0 ^ seed) % 3 {
        0 => drop(mp::write_uint(w, h.0)),
        1 => drop(mp::write_sint(w, h.0 as i64)),
        _ => drop(mp::write_bin(w, &[&[7u8; 4][..], &h.0.to_be_bytes()].concat())),
    };
    let hashes = |hs: &[EngineHash]| {
        bytes(&|w| {
            mp::write_array_len(w, hs.len() as u32).unwrap();
            hs.iter().for_each(|h| hash(w, *h));
        })
    };
    let int = |i: i64| bytes(&|w| drop(mp::write_sint(w, i)));
    let text = |s: &String| bytes(&|w| mp::write_str(w, s).unwrap());
    let key = |w: &mut Vec<u8>, k: &ExtraKey| match k {
        ExtraKey::Str(s) => mp::write_str(w, s).unwrap(),
        ExtraKey::Int(i) => drop(mp::write_sint(w, *i)),
        _ => unreachable!("not generated"),
    };
    // A field's name and its encoded value (`None` = absent).
    type Field = (&'static str, Option<Vec<u8>>);
    let (tag, fields): (&str, Vec<Field>) = match event {
        KvEvent::BlockStored(s) => (
            "BlockStored",
            vec![
                ("block_hashes", Some(hashes(&s.block_hashes))),
                ("parent_block_hash", s.parent_block_hash.map(|h| bytes(&|w| hash(w, h)))),
                (
                    "token_ids",
                    Some(bytes(&|w| {
                        mp::write_array_len(w, s.token_ids.len() as u32).unwrap();
                        s.token_ids.iter().for_each(|t| drop(mp::write_uint(w, u64::from(*t))));
                    })),
                ),
                ("block_size", Some(int(i64::from(s.block_size)))),
                ("lora_id", s.lora_id.map(int)),
                ("medium", s.medium.as_ref().map(text)),
                ("lora_name", s.lora_name.as_ref().map(text)),
                (
                    "extra_keys",
                    s.extra_keys.as_ref().map(|per_block| {
                        bytes(&|w| {
                            mp::write_array_len(w, per_block.len() as u32).unwrap();
                            for keys in per_block {
                                match keys {
                                    None => drop(mp::write_nil(w)),
                                    Some(keys) => {
                                        mp::write_array_len(w, keys.len() as u32).unwrap();
                                        keys.iter().for_each(|k| key(w, k));
                                    }
                                }
                            }
                        })
                    }),
                ),
                ("group_idx", s.group_idx.map(int)),
                ("kv_cache_spec_kind", s.kv_cache_spec_kind.as_ref().map(text)),
                ("cache_salt", s.cache_salt.as_ref().map(text)),
                ("locality", s.locality.as_ref().map(text)),
            ],
        ),
        KvEvent::BlockRemoved(r) => (
            "BlockRemoved",
            vec![
                ("block_hashes", Some(hashes(&r.block_hashes))),
                ("medium", r.medium.as_ref().map(text)),
                ("group_idx", r.group_idx.map(int)),
            ],
        ),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared", vec![]),
    };
    if positional {
        // Map-only fields are not generated for this layout.
        let mut fields: Vec<_> = fields.into_iter().filter(|(n, _)| !matches!(*n, "cache_salt" | "locality")).collect();
        while fields.last().is_some_and(|(_, v)| v.is_none()) && seed.is_multiple_of(2) {
            fields.pop();
        }
        let nil = bytes(&|w| drop(mp::write_nil(w)));
        mp::write_array_len(w, 1 + fields.len() as u32).unwrap();
        mp::write_str(w, tag).unwrap();
        fields.iter().for_each(|(_, v)| w.extend_from_slice(v.as_ref().unwrap_or(&nil)));
    } else {
        let mut pairs: Vec<(&str, Vec<u8>)> = fields.into_iter().filter_map(|(n, v)| Some((n, v?))).collect();
        pairs.push(("type", bytes(&|w| mp::write_str(w, tag).unwrap())));
        pairs.push((
            "not_a_field",
            bytes(&|w| {
                mp::write_array_len(w, 2).unwrap();
                mp::write_map_len(w, 1).unwrap();
                mp::write_str(w, "token_ids").unwrap();
                mp::write_str(w, "ignored").unwrap();
                mp::write_bin(w, b"x").unwrap();
            }),
        ));
        pairs.sort_by_key(|(n, _)| n.bytes().fold(seed, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))));
        mp::write_map_len(w, pairs.len() as u32).unwrap();
        for (name, value) in pairs {
            mp::write_str(w, name).unwrap();
            w.extend_from_slice(&value);
        }
    }
}

fn arb_event(positional: bool) -> impl Strategy<Value = KvEvent> {
    let name = || prop::option::of(prop::sample::select(vec!["GPU".to_owned(), "CPU_PINNED".into(), "ü".into()]));
    let hashes = prop::collection::vec(any::<u64>().prop_map(EngineHash), 0..12);
    let key = prop_oneof![any::<i64>().prop_map(ExtraKey::Int), "[a-z]{0,6}".prop_map(ExtraKey::Str)];
    let extra = prop::option::of(prop::collection::vec(prop::option::of(prop::collection::vec(key, 0..3)), 0..4));
    let stored = (
        (
            hashes.clone(),
            prop::option::of(any::<u64>().prop_map(EngineHash)),
            prop::collection::vec(any::<u32>(), 0..40),
        ),
        (any::<u32>(), prop::option::of(any::<i64>()), name(), name(), extra),
        (prop::option::of(any::<i64>()), name(), name(), name()),
    )
        .prop_map(
            move |(
                (block_hashes, parent_block_hash, token_ids),
                (block_size, lora_id, medium, lora_name, extra_keys),
                (group_idx, kind, salt, locality),
            )| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    cache_salt: salt.filter(|_| !positional),
                    locality: locality.filter(|_| !positional),
                    group_idx,
                    kv_cache_spec_kind: kind,
                })
            },
        );
    let removed = (hashes, name(), prop::option::of(any::<i64>())).prop_map(|(block_hashes, medium, group_idx)| {
        KvEvent::BlockRemoved(BlockRemoved { block_hashes, medium, group_idx })
    });
    prop_oneof![stored, removed, Just(KvEvent::AllBlocksCleared)]
}

use proptest::prelude::*;

proptest! {
    /// Whatever the layout, key order, hash encoding or unknown keys, a batch decodes to
    /// exactly the events that were written.
    #[test]
    fn every_layout_decodes_to_what_was_written(
        (positional, events) in any::<bool>().prop_flat_map(|p| (Just(p), prop::collection::vec(arb_event(p), 0..5))),
        rank in prop::option::of(any::<i64>()),
        seed in any::<u64>(),
    ) {
        let mut w = Vec::new();
        rmp::encode::write_array_len(&mut w, if rank.is_some() { 3 } else { 2 }).unwrap();
        rmp::encode::write_f64(&mut w, seed as f64).unwrap();
        rmp::encode::write_array_len(&mut w, events.len() as u32).unwrap();
        for (i, event) in events.iter().enumerate() {
            encode_event(&mut w, event, positional, seed.rotate_left(i as u32));
        }
        if let Some(rank) = rank {
            rmp::encode::write_sint(&mut w, rank).unwrap();
        }
        let expected = EventBatch { ts: seed as f64, events, data_parallel_rank: rank };
        prop_assert_eq!(decode_batch(&w), Ok(expected));
    }
}
