//! Two sidecars (two gateway pods), one view of the load: what one books shows up in the
//! other's load table (every sequence of it) and shifts its choices, and leaves with its
//! lifecycle; nobody counts its own bookings twice; a peer of another release is counted and
//! ignored.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use kvgate_e2e::process::{free_port, free_port_run, wait_for};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{Policy, PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use kvgate_sidecar::sync::SyncConfig;

const WAIT: Duration = Duration::from_secs(10);

fn pool() -> Arc<Pool> {
    let replicas = (0..3)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig { policy: Policy::ConsistentHash, ..PoolConfig::new("m", "unused", 4, replicas) };
    Arc::new(Pool::new(config, Vec::new(), Arc::new(Metrics::default())))
}

fn request(id: &str, seed: u32, session: Option<&str>) -> RouteRequest {
    let tokens: Vec<u32> = (0..64).map(|t| seed * 1000 + t).collect();
    RouteRequest { session: session.map(str::to_owned), ..common::request(id, &tokens) }
}

fn active(pool: &Pool) -> Vec<u64> {
    pool.state().replicas.iter().map(|r| r.active_requests).collect()
}

#[test]
fn bookings_reach_the_other_gateway_and_leave_with_their_lifecycle() {
    // Each sync port and the next (the handover).
    let first = free_port_run(4).unwrap();
    let (port_a, port_b) = (first, first + 2);
    let sync = |id: &str, own: u16, peer: u16| SyncConfig {
        id: Some(id.into()),
        listen: format!("tcp://127.0.0.1:{own}"),
        peers: vec![format!("tcp://127.0.0.1:{peer}")],
        peers_dns: None,
        handover_timeout_ms: 5_000,
    };
    let (a, b) = (pool(), pool());
    let stop = Arc::new(AtomicBool::new(false));
    let ctx = zmq::Context::new();
    let mut threads = kvgate_sidecar::sync::start(
        &sync("a", port_a, port_b),
        &HashMap::from([("m".into(), a.clone())]),
        Arc::new(Metrics::default()),
        &ctx,
        stop.clone(),
    )
    .unwrap();
    threads.extend(
        kvgate_sidecar::sync::start(
            &sync("b", port_b, port_a),
            &HashMap::from([("m".into(), b.clone())]),
            Arc::new(Metrics::default()),
            &ctx,
            stop.clone(),
        )
        .unwrap(),
    );
    let cfg = ScoringConfig::default();

    // ZMQ subscriptions take a moment: book probes on A until B sees one, then end them.
    let mut probes = 0;
    wait_for("the sync link", WAIT, || {
        a.route(&request(&format!("probe{probes}"), 900 + probes, Some("s")), &cfg);
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
        (active(&b).iter().sum::<u64>() > 0).then_some(())
    })
    .unwrap();
    for i in 0..probes {
        a.lifecycle(&format!("probe{i}"), false);
    }
    wait_for("probes ended on B", WAIT, || (active(&b).iter().sum::<u64>() == 0).then_some(())).unwrap();

    // A burst through gateway A, one session: all on one replica.
    let hot = (0..8).map(|i| a.route(&request(&format!("burst{i}"), i, Some("s")), &cfg)).collect::<Vec<_>>();
    let hot_replica = hot[0].replica.clone().unwrap();
    assert!(hot.iter().all(|r| r.replica.as_deref() == Some(hot_replica.as_str())));
    let slot: usize = hot_replica[1..].parse().unwrap();
    wait_for("B sees A's burst", WAIT, || (active(&b)[slot] == 8).then_some(())).unwrap();
    assert_eq!(active(&a)[slot], 8, "A does not count its own bookings twice");

    // Gateway B now steers its own traffic away from the replica A loaded.
    for i in 0..4 {
        let r = b.route(&request(&format!("b{i}"), 100 + i, None), &cfg);
        assert_ne!(r.replica.as_deref(), Some(hot_replica.as_str()), "request {i} through B avoids A's hot replica");
    }

    // The burst's lifecycle travels too.
    for i in 0..8 {
        assert!(a.lifecycle(&format!("burst{i}"), true));
        assert!(a.lifecycle(&format!("burst{i}"), false));
    }
    wait_for("A's burst ended on B", WAIT, || (active(&b)[slot] == 0).then_some(())).unwrap();

    // A request for three samples is three sequences on B too.
    let sampled = RouteRequest { samples: 3, ..request("sampled", 7, Some("s")) };
    let r = a.route(&sampled, &cfg);
    let slot: usize = r.replica.unwrap()[1..].parse().unwrap();
    wait_for("B books all three sequences", WAIT, || (active(&b)[slot] == 3).then_some(())).unwrap();
    assert!(a.lifecycle("sampled", false));
    wait_for("and releases them", WAIT, || (active(&b)[slot] == 0).then_some(())).unwrap();

    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
}

/// A peer of another release publishes under another sync topic: its messages are counted and
/// dropped, never booked.
#[test]
fn a_peer_of_another_release_is_counted_not_booked() {
    let (port_old, port_b) = (free_port().unwrap(), free_port_run(2).unwrap());
    let ctx = zmq::Context::new();
    let old = ctx.socket(zmq::PUB).unwrap();
    old.bind(&format!("tcp://127.0.0.1:{port_old}")).unwrap();
    let b = pool();
    let metrics = Arc::new(Metrics::default());
    let config = SyncConfig {
        id: Some("b".into()),
        listen: format!("tcp://127.0.0.1:{port_b}"),
        peers: vec![format!("tcp://127.0.0.1:{port_old}")],
        peers_dns: None,
        handover_timeout_ms: 5_000,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let threads = kvgate_sidecar::sync::start(
        &config,
        &HashMap::from([("m".into(), b.clone())]),
        metrics.clone(),
        &ctx,
        stop.clone(),
    )
    .unwrap();
    // The release before: topic "kvgate-sync", any payload (it cannot be read as ours).
    wait_for("the old peer's messages counted", WAIT, || {
        old.send_multipart([&b"kvgate-sync"[..], b"an older batch"], 0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        (metrics.sync_mismatches.get() > 0).then_some(())
    })
    .unwrap();
    assert_eq!(active(&b).iter().sum::<u64>(), 0, "nothing booked from it");
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
}
