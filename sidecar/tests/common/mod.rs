//! What the sidecar's integration tests share: a fake vLLM engine (a PUB socket publishing
//! map-format KV-event batches, a ROUTER answering replay requests from its buffer) and a
//! routing request for pool `m`.

#![allow(dead_code)] // each test file uses part of it

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::health::Health;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Policy, Pool, PoolConfig, ReplicaConfig};
use kvgate_sidecar::sync::SyncConfig;
use rmp::encode as mp;

/// The block size the tests' pools and engines use.
pub const BS: usize = 4;

/// A free port below the ephemeral range: one the OS hands out (`bind` to port 0) can be taken,
/// between this call and the bind, by an outgoing connection of another test (a ZMQ
/// subscriber's), and then never bound.
pub fn free_port() -> u16 {
    kvgate_e2e::process::free_port().unwrap()
}

pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A streamed request for pool `m` (block size [`BS`]) whose prompt is `tokens`.
pub fn request(id: &str, tokens: &[u32]) -> RouteRequest {
    RouteRequest::exact(id, "m", tokens.len() as u32, BS as u32, prompt_block_hashes(tokens, BS, Salt::NONE))
}

/// Tokens of block `b` of a conversation `conv`.
pub fn block(conv: u32, b: u32) -> Vec<u32> {
    (0..BS as u32).map(|i| conv * 1000 + b * 10 + i).collect()
}

/// A vLLM map-format batch storing block `b` of `conv` (engine hash = conv*100 + b).
pub fn store(conv: u32, b: u32) -> Vec<u8> {
    store_sized(conv, b, BS)
}

/// The same, claiming (and carrying tokens for) block size `bs`.
pub fn store_sized(conv: u32, b: u32, bs: usize) -> Vec<u8> {
    batch("BlockStored", 4, |buf| {
        mp::write_str(buf, "block_hashes").unwrap();
        mp::write_array_len(buf, 1).unwrap();
        mp::write_uint(buf, u64::from(conv * 100 + b)).unwrap();
        mp::write_str(buf, "parent_block_hash").unwrap();
        if b == 0 {
            mp::write_nil(buf).unwrap();
        } else {
            mp::write_uint(buf, u64::from(conv * 100 + b - 1)).unwrap();
        }
        mp::write_str(buf, "token_ids").unwrap();
        mp::write_array_len(buf, bs as u32).unwrap();
        for t in block(conv, b).into_iter().cycle().take(bs) {
            mp::write_uint(buf, u64::from(t)).unwrap();
        }
        mp::write_str(buf, "block_size").unwrap();
        mp::write_uint(buf, bs as u64).unwrap();
    })
}

/// A vLLM map-format batch removing block `b` of `conv`.
pub fn removed(conv: u32, b: u32) -> Vec<u8> {
    batch("BlockRemoved", 1, |buf| {
        mp::write_str(buf, "block_hashes").unwrap();
        mp::write_array_len(buf, 1).unwrap();
        mp::write_uint(buf, u64::from(conv * 100 + b)).unwrap();
    })
}

/// A vLLM map-format batch of one GPU event of `kind`, whose other `fields` key/value pairs
/// `write` puts between its `type` and its `medium`.
fn batch(kind: &str, fields: u32, write: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut buf = Vec::new();
    mp::write_array_len(&mut buf, 3).unwrap();
    mp::write_f64(&mut buf, 1.0).unwrap();
    mp::write_array_len(&mut buf, 1).unwrap();
    mp::write_map_len(&mut buf, fields + 2).unwrap();
    mp::write_str(&mut buf, "type").unwrap();
    mp::write_str(&mut buf, kind).unwrap();
    write(&mut buf);
    mp::write_str(&mut buf, "medium").unwrap();
    mp::write_str(&mut buf, "GPU").unwrap();
    mp::write_uint(&mut buf, 0).unwrap();
    buf
}

/// Published messages kept for replay: `(seq, payload)`.
pub type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A fake engine: PUB for live events, ROUTER answering replay requests from its buffer with
/// vLLM 0.26+'s reply layout.
pub struct Engine {
    pub publisher: zmq::Socket,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
    /// Messages kept for replay, the oldest dropped first (vLLM's `buffer_steps`).
    keep: usize,
}

impl Engine {
    pub fn start(ctx: &zmq::Context, pub_port: u16, replay_port: Option<u16>) -> Engine {
        let publisher = ctx.socket(zmq::PUB).unwrap();
        // A restarted engine's ports may still be held by its predecessor for a moment.
        wait_for("the events port", || publisher.bind(&format!("tcp://127.0.0.1:{pub_port}")).is_ok());
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        if let Some(port) = replay_port {
            let router = ctx.socket(zmq::ROUTER).unwrap();
            wait_for("the replay port", || router.bind(&format!("tcp://127.0.0.1:{port}")).is_ok());
            router.set_rcvtimeo(100).unwrap();
            let (buffer, stop) = (buffer.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(frames) = router.recv_multipart(0) else { continue };
                    let [identity, _empty, start] = <[Vec<u8>; 3]>::try_from(frames).unwrap();
                    let start = u64::from_be_bytes(start.try_into().unwrap());
                    for (seq, payload) in buffer.lock().unwrap().iter().filter(|(s, _)| *s >= start) {
                        router.send_multipart([&identity[..], b"", b"topic", &seq.to_be_bytes(), payload], 0).unwrap();
                    }
                    router.send_multipart([&identity[..], b"", b"", &[0xff; 8], b""], 0).unwrap();
                }
            });
        }
        Engine { publisher, buffer, stop, keep: usize::MAX }
    }

    /// Records the message for replay and, unless `drop`, publishes it.
    pub fn send(&self, seq: u64, payload: &[u8], drop: bool) {
        let mut buffer = self.buffer.lock().unwrap();
        buffer.push((seq, payload.to_vec()));
        if buffer.len() > self.keep {
            buffer.remove(0);
        }
        std::mem::drop(buffer);
        if !drop {
            self.publisher.send_multipart([&b"topic"[..], &seq.to_be_bytes(), payload], 0).unwrap();
        }
    }

    /// Keeps only the last `keep` messages for replay, as vLLM keeps `buffer_steps`.
    pub fn keeping(mut self, keep: usize) -> Engine {
        self.keep = keep;
        self
    }

    pub fn restart(&self) {
        self.buffer.lock().unwrap().clear();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A pool `m` (block size [`BS`]) of one replica `e{i}` per engine `(events port, replay
/// port)`, reading each engine's events and replaying from it, and the metrics it counts in.
pub fn pool_reading(engines: &[(u16, u16)]) -> (Arc<Pool>, Arc<Metrics>) {
    let replicas = engines
        .iter()
        .enumerate()
        .map(|(i, (events, replay))| ReplicaConfig {
            kv_events_topic: "topic".into(),
            kv_replay: Some(format!("tcp://127.0.0.1:{replay}")),
            ..ReplicaConfig::new(
                &format!("e{i}"),
                format!("127.0.0.1:{}", 9000 + i).parse().unwrap(),
                &format!("tcp://127.0.0.1:{events}"),
            )
        })
        .collect();
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(PoolConfig::new("m", "unused", BS as u32, replicas), Vec::new(), metrics.clone()));
    (pool, metrics)
}

/// Each engine `i` publishes conversation `i + 1`'s first block until `last_seqs` (a
/// sidecar's view of the streams) shows it heard it (ZMQ's slow joiner), then the rest of
/// its `blocks`; then engine 0 evicts block 20 of its conversation. Returns the sequence
/// number each stream stands at.
pub fn publish_two_conversations(
    engines: &[Engine],
    blocks: u32,
    last_seqs: impl Fn() -> Vec<Option<u64>>,
) -> [u64; 2] {
    wait_for("the sidecar subscribed to both engines", || {
        for (i, e) in engines.iter().enumerate() {
            if last_seqs()[i].is_none() {
                e.restart();
                e.send(0, &store(i as u32 + 1, 0), false);
            }
        }
        std::thread::sleep(Duration::from_millis(30));
        last_seqs().iter().all(Option::is_some)
    });
    for (i, e) in engines.iter().enumerate() {
        for b in 1..blocks {
            e.send(u64::from(b), &store(i as u32 + 1, b), false);
        }
    }
    engines[0].send(u64::from(blocks), &removed(1, 20), false);
    [u64::from(blocks), u64::from(blocks) - 1]
}

/// The first `n` blocks of conversation `conv` ([`block`]), as tokens.
pub fn conversation(conv: u32, n: u32) -> Vec<u32> {
    (0..n).flat_map(|b| block(conv, b)).collect()
}

/// A pool `m` of three replicas `r0`–`r2` (block size [`BS`]) that routes by session
/// (`consistent_hash`): what the sync tests book on.
pub fn session_pool() -> Arc<Pool> {
    let replicas = (0..3)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig { policy: Policy::ConsistentHash, ..PoolConfig::new("m", "unused", BS as u32, replicas) };
    Arc::new(Pool::new(config, Vec::new(), Arc::new(Metrics::default())))
}

/// Requests in flight on each replica of `pool`.
pub fn active(pool: &Pool) -> Vec<u64> {
    pool.state().replicas.iter().map(|r| r.active_requests).collect()
}

/// Starts `config`'s side of the sync mesh for `pool` (as pool `m`), sealed as `config` says.
pub fn start_mesh(
    config: &SyncConfig,
    pool: &Arc<Pool>,
    metrics: Arc<Metrics>,
    ctx: &zmq::Context,
    health: &Arc<Health>,
) -> Vec<std::thread::JoinHandle<()>> {
    let pools = std::collections::HashMap::from([("m".to_owned(), pool.clone())]);
    kvgate_sidecar::sync::start(config, &pools, metrics, ctx, health, &config.sealer().unwrap()).unwrap()
}
