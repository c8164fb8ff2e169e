//! vLLM's KV-event wire format, as published by vLLM 0.32: `[topic, seq_be8, msgpack]` on a
//! ZMQ PUB socket, the payload `[ts, [event…], dp_rank]` with events as tagged maps.

use std::sync::mpsc;
use std::time::{SystemTime, UNIX_EPOCH};

use rmp::encode as mp;

/// A KV-cache event, in vLLM's terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New full blocks committed to the prefix cache.
    BlockStored {
        /// Engine hashes of the new blocks.
        block_hashes: Vec<u64>,
        /// Engine hash of the block before them.
        parent_block_hash: Option<u64>,
        /// The new blocks' tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Blocks evicted.
    BlockRemoved {
        /// Their engine hashes.
        block_hashes: Vec<u64>,
    },
    /// The prefix cache was reset.
    AllBlocksCleared,
}

fn write_str(buf: &mut Vec<u8>, s: &str) {
    // Writing to a Vec cannot fail.
    let _ = mp::write_str(buf, s);
}

fn write_u64s(buf: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    let _ = mp::write_array_len(buf, values.len() as u32);
    for v in values {
        let _ = mp::write_uint(buf, v);
    }
}

/// Encodes one batch exactly as vLLM 0.32's msgspec does (map events, map16 header for
/// `BlockStored`, `group_idx: 0`, `kv_cache_spec_kind: "full_attention"`).
pub fn encode_batch(ts: f64, events: &[Event], dp_rank: u32) -> Vec<u8> {
    let mut buf = Vec::new();
    let _ = mp::write_array_len(&mut buf, 3);
    let _ = mp::write_f64(&mut buf, ts);
    let _ = mp::write_array_len(&mut buf, events.len() as u32);
    for event in events {
        match event {
            Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size } => {
                // msgspec sizes the header by the struct's field count: map16.
                buf.extend_from_slice(&[0xde, 0x00, 11]);
                write_str(&mut buf, "type");
                write_str(&mut buf, "BlockStored");
                write_str(&mut buf, "block_hashes");
                write_u64s(&mut buf, block_hashes.iter().copied());
                write_str(&mut buf, "parent_block_hash");
                match parent_block_hash {
                    Some(h) => drop(mp::write_uint(&mut buf, *h)),
                    None => drop(mp::write_nil(&mut buf)),
                }
                write_str(&mut buf, "token_ids");
                write_u64s(&mut buf, token_ids.iter().map(|t| u64::from(*t)));
                write_str(&mut buf, "block_size");
                let _ = mp::write_uint(&mut buf, u64::from(*block_size));
                write_str(&mut buf, "lora_id");
                let _ = mp::write_nil(&mut buf);
                write_str(&mut buf, "medium");
                write_str(&mut buf, "GPU");
                write_str(&mut buf, "lora_name");
                let _ = mp::write_nil(&mut buf);
                write_str(&mut buf, "extra_keys");
                let _ = mp::write_array_len(&mut buf, block_hashes.len() as u32);
                for _ in block_hashes {
                    let _ = mp::write_nil(&mut buf);
                }
                write_str(&mut buf, "group_idx");
                let _ = mp::write_uint(&mut buf, 0);
                write_str(&mut buf, "kv_cache_spec_kind");
                write_str(&mut buf, "full_attention");
            }
            Event::BlockRemoved { block_hashes } => {
                let _ = mp::write_map_len(&mut buf, 4);
                write_str(&mut buf, "type");
                write_str(&mut buf, "BlockRemoved");
                write_str(&mut buf, "block_hashes");
                write_u64s(&mut buf, block_hashes.iter().copied());
                write_str(&mut buf, "medium");
                write_str(&mut buf, "GPU");
                write_str(&mut buf, "group_idx");
                let _ = mp::write_uint(&mut buf, 0);
            }
            Event::AllBlocksCleared => {
                let _ = mp::write_map_len(&mut buf, 1);
                write_str(&mut buf, "type");
                write_str(&mut buf, "AllBlocksCleared");
            }
        }
    }
    let _ = mp::write_uint(&mut buf, u64::from(dp_rank));
    buf
}

/// A handle to the publisher thread. Each `publish` is one batch with the next seq.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::Sender<Vec<Event>>,
}

impl Publisher {
    /// Binds a PUB socket at `endpoint` and starts the publishing thread.
    pub fn bind(endpoint: &str, topic: String) -> anyhow::Result<Publisher> {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::PUB)?;
        socket.set_sndhwm(100_000)?;
        socket.bind(endpoint)?;
        let (tx, rx) = mpsc::channel::<Vec<Event>>();
        std::thread::Builder::new().name("kv-pub".into()).spawn(move || {
            let _ctx = ctx;
            for (seq, events) in (0u64..).zip(rx) {
                let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                let payload = encode_batch(ts, &events, 0);
                let frames: [&[u8]; 3] = [topic.as_bytes(), &seq.to_be_bytes(), &payload];
                if let Err(e) = socket.send_multipart(frames, 0) {
                    tracing::warn!(error = %e, "KV-event publish failed");
                }
            }
        })?;
        Ok(Publisher { tx })
    }

    /// Queues a batch (dropped if empty, as vLLM publishes only steps with events).
    pub fn publish(&self, events: Vec<Event>) {
        if !events.is_empty() {
            let _ = self.tx.send(events);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// Byte-for-byte the vLLM 0.33 capture of `vllm-kv-events.md` §1.4.
    #[test]
    fn matches_vllms_bytes() {
        let events = vec![
            Event::BlockStored {
                block_hashes: vec![9561501211280363793, 15292913576410714033],
                parent_block_hash: None,
                token_ids: (1..=8).collect(),
                block_size: 4,
            },
            Event::BlockRemoved { block_hashes: vec![9561501211280363793] },
            Event::AllBlocksCleared,
        ];
        let expected = hex(concat!(
            "93",
            "cb41d954fc40200000",
            "93",
            "de000b",
            "a474797065",
            "ab426c6f636b53746f726564",
            "ac626c6f636b5f686173686573",
            "92cf84b146b151d55111cfd43b57df56b58fb1",
            "b1706172656e745f626c6f636b5f68617368",
            "c0",
            "a9746f6b656e5f696473",
            "980102030405060708",
            "aa626c6f636b5f73697a65",
            "04",
            "a76c6f72615f6964",
            "c0",
            "a66d656469756d",
            "a3475055",
            "a96c6f72615f6e616d65",
            "c0",
            "aa65787472615f6b657973",
            "92c0c0",
            "a967726f75705f696478",
            "00",
            "b26b765f63616368655f737065635f6b696e64",
            "ae66756c6c5f617474656e74696f6e",
            "84",
            "a474797065",
            "ac426c6f636b52656d6f766564",
            "ac626c6f636b5f686173686573",
            "91cf84b146b151d55111",
            "a66d656469756d",
            "a3475055",
            "a967726f75705f696478",
            "00",
            "81",
            "a474797065",
            "b0416c6c426c6f636b73436c6561726564",
            "00",
        ));
        assert_eq!(encode_batch(1700000000.5, &events, 0), expected);
        assert!(rmpv::decode::read_value(&mut expected.as_slice()).is_ok());
    }
}
