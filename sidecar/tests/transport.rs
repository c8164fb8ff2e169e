//! The ZMQ transport against a publisher in the test: gaps are replayed from a ROUTER, a
//! publisher restart clears the replica, garbage is counted and survived, without replay a gap
//! leaves the replica degraded, a dropped connection withholds cache credit until the engine
//! is back, and more replicas than ingest workers are each ingested whole and in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::config::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::discovery::Supervisor;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use rmp::encode as mp;

const BS: usize = 4;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Tokens of block `b` of a conversation `conv`.
fn block(conv: u32, b: u32) -> Vec<u32> {
    (0..BS as u32).map(|i| conv * 1000 + b * 10 + i).collect()
}

/// A vLLM map-format batch storing block `b` of `conv` (engine hash = conv*100 + b).
fn store(conv: u32, b: u32) -> Vec<u8> {
    store_sized(conv, b, BS)
}

/// The same, claiming (and carrying tokens for) block size `bs`.
fn store_sized(conv: u32, b: u32, bs: usize) -> Vec<u8> {
    let mut buf = Vec::new();
    mp::write_array_len(&mut buf, 3).unwrap();
    mp::write_f64(&mut buf, 1.0).unwrap();
    mp::write_array_len(&mut buf, 1).unwrap();
    mp::write_map_len(&mut buf, 6).unwrap();
    mp::write_str(&mut buf, "type").unwrap();
    mp::write_str(&mut buf, "BlockStored").unwrap();
    mp::write_str(&mut buf, "block_hashes").unwrap();
    mp::write_array_len(&mut buf, 1).unwrap();
    mp::write_uint(&mut buf, u64::from(conv * 100 + b)).unwrap();
    mp::write_str(&mut buf, "parent_block_hash").unwrap();
    if b == 0 {
        mp::write_nil(&mut buf).unwrap();
    } else {
        mp::write_uint(&mut buf, u64::from(conv * 100 + b - 1)).unwrap();
    }
    mp::write_str(&mut buf, "token_ids").unwrap();
    mp::write_array_len(&mut buf, bs as u32).unwrap();
    for t in block(conv, b).into_iter().cycle().take(bs) {
        mp::write_uint(&mut buf, u64::from(t)).unwrap();
    }
    mp::write_str(&mut buf, "block_size").unwrap();
    mp::write_uint(&mut buf, bs as u64).unwrap();
    mp::write_str(&mut buf, "medium").unwrap();
    mp::write_str(&mut buf, "GPU").unwrap();
    mp::write_uint(&mut buf, 0).unwrap();
    buf
}

/// Published messages kept for replay: `(seq, payload)`.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A fake engine: PUB for live events, ROUTER answering replay requests from its buffer with
/// vLLM 0.26+'s reply layout.
struct Engine {
    publisher: zmq::Socket,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
}

impl Engine {
    fn start(ctx: &zmq::Context, pub_port: u16, replay_port: Option<u16>) -> Engine {
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
        Engine { publisher, buffer, stop }
    }

    /// Records the message for replay and, unless `drop`, publishes it.
    fn send(&self, seq: u64, payload: &[u8], drop: bool) {
        self.buffer.lock().unwrap().push((seq, payload.to_vec()));
        if !drop {
            self.publisher.send_multipart([&b"topic"[..], &seq.to_be_bytes(), payload], 0).unwrap();
        }
    }

    fn restart(&self) {
        self.buffer.lock().unwrap().clear();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Rig {
    pool: Arc<Pool>,
    metrics: Arc<Metrics>,
    supervisor: Supervisor,
}

impl Rig {
    fn start(ctx: &zmq::Context, pub_port: u16, replay_port: Option<u16>) -> Rig {
        let replica = ReplicaConfig {
            kv_events_topic: "topic".into(),
            kv_replay: replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
            ..ReplicaConfig::new("a", "127.0.0.1:1".parse().unwrap(), &format!("tcp://127.0.0.1:{pub_port}"))
        };
        let config = PoolConfig::new("m", "unused", BS as u32, vec![replica]);
        let metrics = Arc::new(Metrics::default());
        let pool = Arc::new(Pool::new(config, Vec::new(), metrics.clone()));
        let supervisor = Supervisor::start(ctx.clone(), pool.clone(), metrics.clone()).unwrap();
        Rig { pool, metrics, supervisor }
    }

    fn depth(&self, conv: u32, blocks: u32) -> u32 {
        let tokens: Vec<u32> = (0..blocks).flat_map(|b| block(conv, b)).collect();
        self.pool.find_matches(&prompt_block_hashes(&tokens, BS, Salt::NONE))[0].device
    }

    fn last_seq(&self) -> Option<u64> {
        self.pool.state().replicas[0].last_seq
    }

    /// Sends seq 0 until the subscriber has it (ZMQ's slow joiner drops early messages).
    fn handshake(&self, engine: &Engine, payload: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.last_seq() != Some(0) {
            assert!(Instant::now() < deadline, "subscriber never connected");
            engine.restart();
            engine.send(0, payload, false);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.supervisor.shutdown();
    }
}

#[test]
fn gaps_are_replayed_restarts_clear_and_garbage_is_survived() {
    let ctx = zmq::Context::new();
    let (pub_port, replay_port) = (free_port(), free_port());
    let engine = Engine::start(&ctx, pub_port, Some(replay_port));
    let rig = Rig::start(&ctx, pub_port, Some(replay_port));
    rig.handshake(&engine, &store(1, 0));

    // Messages 1..=3 are lost on the way; 4 arrives: the gap is replayed.
    for b in 1..=3 {
        engine.send(u64::from(b), &store(1, b), true);
    }
    engine.send(4, &store(1, 4), false);
    wait_for("seq 4", || rig.last_seq() == Some(4));
    assert_eq!(rig.depth(1, 5), 5, "the replayed blocks are indexed");
    assert!(!rig.pool.state().replicas[0].degraded);
    assert!(rig.metrics.render().contains("kvgate_kv_gaps_replayed_total{model=\"m\",replica=\"a\"} 1"));
    let last_event = rig.metrics.render();
    let last_event = last_event.lines().find(|l| l.starts_with("kvgate_kv_last_event_timestamp_seconds{")).unwrap();
    let at: u64 = last_event.rsplit(' ').next().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(now.abs_diff(at) < 60, "the last event's time is now: {last_event}");

    // Garbage: a bad payload, a bad seq frame and the wrong frame counts are counted; the
    // stream goes on.
    engine.send(5, b"\xc1 not msgpack", false);
    engine.publisher.send_multipart([&b"topic"[..], b"short", b"x"], 0).unwrap();
    engine.publisher.send_multipart([&b"topic"[..], &6u64.to_be_bytes()], 0).unwrap();
    engine.publisher.send_multipart([&b"topic"[..], &6u64.to_be_bytes(), b"x", b"extra"], 0).unwrap();
    engine.send(6, &store(1, 5), false);
    wait_for("seq 6", || rig.last_seq() == Some(6));
    let metrics = rig.metrics.render();
    assert!(metrics.contains("reason=\"decode\"} 1"), "{metrics}");
    assert!(metrics.contains("reason=\"bad_frames\"} 3"), "{metrics}");
    assert!(rig.pool.state().replicas[0].degraded, "an undecodable batch may have held a removal");
    assert_eq!(rig.depth(1, 1), 0, "so the possibly stale blocks were dropped");
    engine.send(7, &store(5, 0), false);
    wait_for("seq 7", || rig.last_seq() == Some(7));
    assert_eq!(rig.depth(5, 1), 1, "the stream goes on after the garbage");

    // A block size other than the pool's is dropped and counted, never mis-chunked.
    engine.send(8, &store_sized(6, 0, 2 * BS), false);
    wait_for("seq 8", || rig.last_seq() == Some(8));
    assert!(rig.metrics.render().contains("reason=\"block_size_mismatch\"} 1"), "{}", rig.metrics.render());
    assert_eq!(rig.depth(6, 1), 0);

    // The engine restarts: seq back to 0 with an empty cache.
    engine.restart();
    engine.send(0, &store(2, 0), false);
    wait_for("restart seen", || rig.last_seq() == Some(0));
    assert_eq!(rig.depth(5, 1), 0, "the old blocks are gone before the next decision");
    assert_eq!(rig.depth(2, 1), 1);
    assert!(!rig.pool.state().replicas[0].degraded, "a restart starts clean");
}

#[test]
fn without_replay_a_gap_degrades_the_replica() {
    let ctx = zmq::Context::new();
    let pub_port = free_port();
    let engine = Engine::start(&ctx, pub_port, None);
    let rig = Rig::start(&ctx, pub_port, None);
    rig.handshake(&engine, &store(3, 0));
    engine.send(7, &store(4, 0), false);
    wait_for("degraded", || rig.pool.state().replicas[0].degraded);
    assert!(rig
        .metrics
        .render()
        .contains("kvgate_replica_degraded{model=\"m\",replica=\"a\",reason=\"lost_events\"} 1"));
    assert_eq!(rig.depth(3, 1), 0, "blocks from before the loss earn no credit");
    assert_eq!(rig.depth(4, 1), 1, "new events still apply");
}

#[test]
fn a_dropped_connection_withholds_credit_until_the_engine_is_back() {
    let ctx = zmq::Context::new();
    let (pub_port, replay_port) = (free_port(), free_port());
    let engine = Engine::start(&ctx, pub_port, Some(replay_port));
    let rig = Rig::start(&ctx, pub_port, Some(replay_port));
    rig.handshake(&engine, &store(1, 0));
    engine.send(1, &store(1, 1), false);
    wait_for("two blocks", || rig.depth(1, 2) == 2);
    assert!(rig.pool.members()[0].health.trusted());

    // The engine dies: its socket closes, and its blocks stop counting at once.
    drop(engine);
    wait_for("the disconnection", || rig.pool.state().replicas[0].disconnected);
    assert!(!rig.pool.members()[0].health.trusted(), "no credit while the engine may be restarting");
    assert!(rig.metrics.render().contains("reason=\"disconnected\"} 1"));

    // It comes back empty, counting from 0: the replica is cleared and trusted again.
    let engine = Engine::start(&ctx, pub_port, Some(replay_port));
    rig.handshake(&engine, &store(2, 0));
    assert_eq!(rig.depth(1, 2), 0, "what the old engine held is gone");
    assert_eq!(rig.depth(2, 1), 1);
    assert!(!rig.pool.state().replicas[0].disconnected);
    assert!(rig.pool.members()[0].health.trusted());
}

/// More replicas than ingest workers: every replica's stream is ingested whole and in order
/// (each block's parent is the one before, so a message applied early would be refused).
#[test]
fn many_replicas_share_the_ingest_workers_in_order() {
    const REPLICAS: u32 = 12;
    const BLOCKS: u32 = 200;
    let ctx = zmq::Context::new();
    let ports: Vec<u16> = (0..REPLICAS).map(|_| free_port()).collect();
    let engines: Vec<Engine> = ports.iter().map(|p| Engine::start(&ctx, *p, None)).collect();
    let replicas = (0..REPLICAS as usize)
        .map(|r| ReplicaConfig {
            kv_events_topic: "topic".into(),
            ..ReplicaConfig::new(
                &format!("r{r}"),
                format!("127.0.0.1:{}", r + 1).parse().unwrap(),
                &format!("tcp://127.0.0.1:{}", ports[r]),
            )
        })
        .collect();
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(PoolConfig::new("m", "unused", BS as u32, replicas), Vec::new(), metrics.clone()));
    let supervisor = Supervisor::start(ctx.clone(), pool.clone(), metrics).unwrap();
    // Each subscriber has seq 0 (block 0) before the rest is sent: ZMQ drops what a
    // subscriber that is still joining would have received.
    for (r, engine) in engines.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.state().replicas[r].last_seq != Some(0) {
            assert!(Instant::now() < deadline, "subscriber {r} never connected");
            engine.restart();
            engine.send(0, &store(r as u32, 0), false);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for b in 1..BLOCKS {
        for (r, engine) in engines.iter().enumerate() {
            engine.send(u64::from(b), &store(r as u32, b), false);
        }
    }
    let depth = |r: u32| {
        let tokens: Vec<u32> = (0..BLOCKS).flat_map(|b| block(r, b)).collect();
        pool.find_matches(&prompt_block_hashes(&tokens, BS, Salt::NONE))[r as usize].device
    };
    wait_for("every replica's whole chain", || (0..REPLICAS).all(|r| depth(r) == BLOCKS));
    let state = pool.state();
    assert!(state.replicas.iter().all(|r| r.last_seq == Some(u64::from(BLOCKS - 1)) && !r.degraded));
    supervisor.shutdown();
}
