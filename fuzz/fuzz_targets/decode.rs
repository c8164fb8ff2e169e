//! The KV-event decoder must never panic, whatever a publisher sends.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvgate_sidecar::events::decode::decode_batch(data);
});
