//! The filter ↔ sidecar codec must never panic, and never allocate past its limit, whatever
//! bytes arrive as any of the wire messages.
#![no_main]
use kvgate_shared::codec::decode;
use kvgate_shared::wire::{LifecycleBatch, ModelBundle, ModelList, RouteBodyRequest, RouteRequest, RouteResponse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode::<RouteRequest>(data);
    let _ = decode::<RouteBodyRequest<'_>>(data);
    let _ = decode::<RouteResponse>(data);
    let _ = decode::<LifecycleBatch>(data);
    let _ = decode::<ModelList>(data);
    let _ = decode::<ModelBundle>(data);
});
