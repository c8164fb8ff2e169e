//! The ZMQ transport against a publisher in the test: gaps are replayed from a ROUTER, a
//! publisher restart clears the replica, garbage is counted and survived, without replay a gap
//! leaves the replica degraded, a dropped connection withholds cache credit until the engine
//! is back, and more replicas than ingest workers are each ingested whole and in order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::discovery::{DiscoveryConfig, Supervisor};
use kvgate_sidecar::index::ReplicaIdx;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};

mod common;

use common::{block, free_port, store, store_sized, wait_for, Engine, BS};

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
        let supervisor =
            Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics.clone()).unwrap();
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
    assert!(rig.pool.trusted(ReplicaIdx::new(0)));

    // The engine dies: its socket closes, and its blocks stop counting at once.
    drop(engine);
    wait_for("the disconnection", || rig.pool.state().replicas[0].disconnected);
    assert!(!rig.pool.trusted(ReplicaIdx::new(0)), "no credit while the engine may be restarting");
    assert!(rig.metrics.render().contains("reason=\"disconnected\"} 1"));

    // It comes back empty, counting from 0: the replica is cleared and trusted again.
    let engine = Engine::start(&ctx, pub_port, Some(replay_port));
    rig.handshake(&engine, &store(2, 0));
    assert_eq!(rig.depth(1, 2), 0, "what the old engine held is gone");
    assert_eq!(rig.depth(2, 1), 1);
    assert!(!rig.pool.state().replicas[0].disconnected);
    assert!(rig.pool.trusted(ReplicaIdx::new(0)));
}

/// Replica `r` of a pool whose engines publish on `ports`.
fn replica(r: usize, ports: &[u16]) -> ReplicaConfig {
    ReplicaConfig {
        kv_events_topic: "topic".into(),
        ..ReplicaConfig::new(
            &format!("r{r}"),
            format!("127.0.0.1:{}", r + 1).parse().unwrap(),
            &format!("tcp://127.0.0.1:{}", ports[r]),
        )
    }
}

/// Sends each engine's seq 0 (block 0) until its subscriber has it: ZMQ drops what a
/// subscriber that is still joining would have received.
fn connect_all(pool: &Pool, engines: &[Engine]) {
    for (r, engine) in engines.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.state().replicas[r].last_seq != Some(0) {
            assert!(Instant::now() < deadline, "subscriber {r} never connected");
            engine.restart();
            engine.send(0, &store(r as u32, 0), false);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
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
    let replicas = (0..REPLICAS as usize).map(|r| replica(r, &ports)).collect();
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(PoolConfig::new("m", "unused", BS as u32, replicas), Vec::new(), metrics.clone()));
    let supervisor = Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics).unwrap();
    connect_all(&pool, &engines);
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

/// More replicas than one ZMQ context has sockets for (1 023, three a replica): every
/// replica is subscribed and read.
#[test]
fn more_replicas_than_a_zmq_context_holds_are_all_read() {
    const REPLICAS: usize = 400;
    let ctx = zmq::Context::new();
    // Below the ephemeral range, none picked twice (`free_port`).
    let ports: Vec<u16> = (0..REPLICAS).map(|_| free_port()).collect();
    let engines: Vec<Engine> = ports.iter().map(|p| Engine::start(&ctx, *p, None)).collect();
    let replicas = (0..REPLICAS).map(|r| replica(r, &ports)).collect();
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(PoolConfig::new("m", "unused", BS as u32, replicas), Vec::new(), metrics.clone()));
    let supervisor = Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics).unwrap();
    // Each engine sends its first block until its subscriber has it (ZMQ's slow joiner).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = pool.state();
        let waiting: Vec<usize> = (0..REPLICAS).filter(|r| state.replicas[*r].last_seq != Some(0)).collect();
        if waiting.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "{} replicas never read, the first {}", waiting.len(), waiting[0]);
        for r in waiting {
            engines[r].restart();
            engines[r].send(0, &store(r as u32, 0), false);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, engine) in engines.iter().enumerate() {
        engine.send(1, &store(r as u32, 1), false);
    }
    wait_for("every replica's second message", || pool.state().replicas.iter().all(|r| r.last_seq == Some(1)));
    supervisor.shutdown();
}

/// One reader serves every replica: a replica that leaves the pool is unsubscribed (its
/// engine sees the connection close), and the one that stays goes on being read.
#[test]
fn a_replica_that_leaves_is_unsubscribed_and_the_others_go_on() {
    let ctx = zmq::Context::new();
    let ports = [free_port(), free_port()];
    let engines = ports.map(|p| Engine::start(&ctx, p, None));
    let closed = ctx.socket(zmq::PAIR).unwrap();
    engines[1].publisher.monitor("inproc://leaving-engine", zmq::SocketEvent::DISCONNECTED.to_raw().into()).unwrap();
    closed.connect("inproc://leaving-engine").unwrap();
    let metrics = Arc::new(Metrics::default());
    // No grace period: a replica that leaves is retired at once.
    let config = PoolConfig {
        leave_grace_secs: 0,
        ..PoolConfig::new("m", "unused", BS as u32, vec![replica(0, &ports), replica(1, &ports)])
    };
    let pool = Arc::new(Pool::new(config, Vec::new(), metrics.clone()));
    let supervisor = Supervisor::start(ctx.clone(), pool.clone(), DiscoveryConfig::default(), metrics).unwrap();
    connect_all(&pool, &engines);

    supervisor.apply(&[replica(0, &ports)]);
    closed.set_rcvtimeo(10_000).unwrap();
    let event = closed.recv_multipart(0).expect("the engine that left sees its subscriber go");
    assert_eq!(u16::from_le_bytes([event[0][0], event[0][1]]), zmq::SocketEvent::DISCONNECTED.to_raw());
    engines[0].send(1, &store(0, 1), false);
    wait_for("the staying replica's next message", || pool.state().replicas[0].last_seq == Some(1));
    supervisor.shutdown();
}
