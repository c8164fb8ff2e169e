//! The OpenAI request parser (the filter's, the sidecar's and the simulator's) must never
//! panic, whatever a client sends to either endpoint.
#![no_main]
use kvgate_shared::prompt::openai::{parse, Endpoint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse(Endpoint::Completions, data);
    let _ = parse(Endpoint::ChatCompletions, data);
});
