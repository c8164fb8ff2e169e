//! Decoding and applying arbitrary messages (seq from the first 8 bytes) must never panic and
//! must leave the index consistent enough to answer queries.
#![no_main]
use kvgate_sidecar::events::ingest::{apply, Ingest, NoReplay};
use kvgate_sidecar::index::KvIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut index = KvIndex::new(4, 1);
    let mut ingest = Ingest::new(4);
    for chunk in data.split(|b| *b == 0xfe) {
        if chunk.len() < 8 {
            continue;
        }
        let seq = u64::from_be_bytes(chunk[..8].try_into().unwrap()) % 16;
        let planned = ingest.on_message(seq, &chunk[8..], &mut NoReplay);
        apply(0, &planned.changes, &mut index);
    }
    let _ = index.find_matches(&[1, 2, 3]);
});
