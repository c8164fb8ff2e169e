//! `kvgate-shared`: the code that every kvgate component must agree on, byte for byte.
//!
//! - [`hash`]: Dynamo-compatible block hashing (xxh3, seed 1337, chained sequence hashes).
//! - [`endpoint`]: vLLM's per-data-parallel-rank ZMQ endpoints.
//! - [`wire`] and [`codec`]: the filter ↔ sidecar messages and their one encoding (bincode 2).
//! - [`ids`]: the request and model names kvgate keys its state by, each its own type.
//! - [`route`]: the one builder of a `RouteRequest` from a parsed request, for both sides.
//! - [`prompt`]: the pure request → token ids pipeline (OpenAI body, chat template, tokenizer)
//!   that the filter, the simulator and the CLI all run, so they can never disagree.

#![forbid(unsafe_code)]

pub mod codec;
pub mod endpoint;
pub mod hash;
pub mod ids;
pub mod prompt;
pub mod route;
pub mod wire;
