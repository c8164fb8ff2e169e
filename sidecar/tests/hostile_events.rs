//! Never-panic checks on the event path, run on every CI run (the `fuzz/` targets go deeper):
//! arbitrary bytes, and valid vLLM payloads with random bytes overwritten, through the decoder
//! and the per-replica state machine.

use kvgate_shared::hash::SequenceHash;
use kvgate_sidecar::events::decode::decode_batch;
use kvgate_sidecar::events::ingest::{apply, Ingest, NoReplay};
use kvgate_sidecar::index::{KvIndex, ReplicaIdx};
use proptest::prelude::*;

/// The vLLM 0.22 (positional) example batch from the spec.
const POSITIONAL: &str = include_str!("../../testdata/kv-events/vllm-0.22-positional.hex");

fn hex(s: &str) -> Vec<u8> {
    let s = s.trim();
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
        let mut index = KvIndex::new(4, 1);
        let planned = Ingest::new(4).on_message(0, &bytes, &mut NoReplay);
        apply(ReplicaIdx::new(0), &planned.changes, &mut index);
    }

    #[test]
    fn corrupted_real_payloads_never_panic(edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), seq in 0u64..4) {
        let mut payload = hex(POSITIONAL);
        for (at, byte) in edits {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        let _ = decode_batch(&payload);
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        for (seq, payload) in [(seq, hex(POSITIONAL)), (seq + 1, payload)] {
            let planned = ingest.on_message(seq, &payload, &mut NoReplay);
            apply(ReplicaIdx::new(0), &planned.changes, &mut index);
        }
        let _ = index.find_matches(&[SequenceHash(1), SequenceHash(2)]);
    }
}
