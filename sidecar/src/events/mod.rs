//! KV-cache events from the engines.
//!
//! - [`decode`]: one msgpack payload → an [`decode::EventBatch`], for every vLLM layout from
//!   0.9 (positional arrays) to 0.33 (tagged maps), and SGLang's.
//! - [`ingest`]: one replica's stream → index [`ingest::Change`]s: sequence numbers, replay of
//!   gaps, restarts, degraded state, tiers, salts, KV-group filtering. Pure, unit-tested.
//! - [`transport`]: per replica, the ZMQ sockets and an inbox bounded in bytes; per pool, one
//!   reader thread waiting on every replica's SUB socket (socket → inbox) and one ingest
//!   worker per core that runs each replica's stream in turns (decode and replay, no lock
//!   held → jobs).
//! - [`apply`]: per pool, the one thread that writes the index: jobs applied in bounded
//!   batches to the standby copy of the index, each made live when it ends.
//!
//! Writes flow one way: socket → reader → inbox → ingester → applier → index. Routing only
//! reads the index's live copy, and never waits for the applier.

pub mod apply;
pub mod decode;
pub mod ingest;
pub mod transport;
