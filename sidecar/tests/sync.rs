//! Two sidecars (two gateway pods), one view of the load: what one books shows up in the
//! other's load table (every sequence of it) and shifts its choices, and leaves with its
//! lifecycle; nobody counts its own bookings twice; a peer of another release is counted and
//! ignored.

use std::sync::Arc;
use std::time::Duration;

mod common;

use kvgate_e2e::process::{free_port, free_port_run, wait_for};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::health::Health;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::score::ScoringConfig;
use kvgate_sidecar::sync::SyncConfig;

const WAIT: Duration = Duration::from_secs(10);

fn request(id: &str, seed: u32, session: Option<&str>) -> RouteRequest {
    let tokens: Vec<u32> = (0..64).map(|t| seed * 1000 + t).collect();
    RouteRequest { session: session.map(str::to_owned), ..common::request(id, &tokens) }
}

/// Two gateways' pools, each with its side of the mesh started (stopped by its own health),
/// and the number of probes booked on A until B saw one (booked, not ended).
struct Pair {
    a: Arc<Pool>,
    b: Arc<Pool>,
    threads_a: Vec<std::thread::JoinHandle<()>>,
    threads_b: Vec<std::thread::JoinHandle<()>>,
    probes: u32,
}

fn linked_pair(stop_a: &Arc<Health>, stop_b: &Arc<Health>, ctx: &zmq::Context) -> Pair {
    // Each sync port and the next (the handover).
    let first = free_port_run(4).unwrap();
    let (port_a, port_b) = (first, first + 2);
    let sync = |id: &str, own: u16, peer: u16| SyncConfig {
        id: Some(id.into()),
        listen: format!("tcp://127.0.0.1:{own}"),
        peers: vec![format!("tcp://127.0.0.1:{peer}")],
        ..SyncConfig::new("", Vec::new())
    };
    let (a, b) = (common::session_pool(), common::session_pool());
    let threads_a = common::start_mesh(&sync("a", port_a, port_b), &a, Arc::new(Metrics::default()), ctx, stop_a);
    let threads_b = common::start_mesh(&sync("b", port_b, port_a), &b, Arc::new(Metrics::default()), ctx, stop_b);
    // ZMQ subscriptions take a moment: book probes on A until B sees one.
    let mut probes = 0;
    wait_for("the sync link", WAIT, || {
        a.route(&request(&format!("probe{probes}"), 900 + probes, Some("s")), &ScoringConfig::default());
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
        (common::active(&b).iter().sum::<u64>() > 0).then_some(())
    })
    .unwrap();
    Pair { a, b, threads_a, threads_b, probes }
}

#[test]
fn bookings_reach_the_other_gateway_and_leave_with_their_lifecycle() {
    let (stop, ctx) = (Health::new(), zmq::Context::new());
    let Pair { a, b, threads_a, threads_b, probes } = linked_pair(&stop, &stop, &ctx);
    let cfg = ScoringConfig::default();
    for i in 0..probes {
        a.lifecycle(&format!("probe{i}").into(), false);
    }
    wait_for("probes ended on B", WAIT, || (common::active(&b).iter().sum::<u64>() == 0).then_some(())).unwrap();

    // A burst through gateway A, one session: all on one replica.
    let hot = (0..8).map(|i| a.route(&request(&format!("burst{i}"), i, Some("s")), &cfg)).collect::<Vec<_>>();
    let hot_replica = hot[0].replica.clone().unwrap();
    assert!(hot.iter().all(|r| r.replica.as_deref() == Some(hot_replica.as_str())));
    let slot: usize = hot_replica[1..].parse().unwrap();
    wait_for("B sees A's burst", WAIT, || (common::active(&b)[slot] == 8).then_some(())).unwrap();
    assert_eq!(common::active(&a)[slot], 8, "A does not count its own bookings twice");

    // Gateway B now steers its own traffic away from the replica A loaded.
    for i in 0..4 {
        let r = b.route(&request(&format!("b{i}"), 100 + i, None), &cfg);
        assert_ne!(r.replica.as_deref(), Some(hot_replica.as_str()), "request {i} through B avoids A's hot replica");
    }

    // The burst's lifecycle travels too.
    for i in 0..8 {
        assert!(a.lifecycle(&format!("burst{i}").into(), true));
        assert!(a.lifecycle(&format!("burst{i}").into(), false));
    }
    wait_for("A's burst ended on B", WAIT, || (common::active(&b)[slot] == 0).then_some(())).unwrap();

    // A request for three samples is three sequences on B too.
    let sampled = RouteRequest { samples: 3, ..request("sampled", 7, Some("s")) };
    let r = a.route(&sampled, &cfg);
    let slot: usize = r.replica.unwrap()[1..].parse().unwrap();
    wait_for("B books all three sequences", WAIT, || (common::active(&b)[slot] == 3).then_some(())).unwrap();
    assert!(a.lifecycle(&"sampled".into(), false));
    wait_for("and releases them", WAIT, || (common::active(&b)[slot] == 0).then_some(())).unwrap();

    stop.stop();
    for t in threads_a.into_iter().chain(threads_b) {
        t.join().unwrap();
    }
}

#[test]
fn a_gateway_that_stops_still_tells_its_peers_what_ended() {
    // Each gateway stops on its own.
    let (stop_a, stop_b, ctx) = (Health::new(), Health::new(), zmq::Context::new());
    let Pair { a, b, threads_a, threads_b, probes } = linked_pair(&stop_a, &stop_b, &ctx);
    wait_for("every probe on B", WAIT, || (common::active(&b).iter().sum::<u64>() == u64::from(probes)).then_some(()))
        .unwrap();

    // A's last requests end, and A stops at once: their ends have no booking to ride with.
    for i in 0..probes {
        assert!(a.lifecycle(&format!("probe{i}").into(), false));
    }
    stop_a.stop();
    for t in threads_a {
        t.join().unwrap();
    }
    wait_for("A's last ends on B", WAIT, || (common::active(&b).iter().sum::<u64>() == 0).then_some(())).unwrap();
    stop_b.stop();
    for t in threads_b {
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
    let b = common::session_pool();
    let metrics = Arc::new(Metrics::default());
    let config = SyncConfig {
        id: Some("b".into()),
        listen: format!("tcp://127.0.0.1:{port_b}"),
        peers: vec![format!("tcp://127.0.0.1:{port_old}")],
        ..SyncConfig::new("", Vec::new())
    };
    let stop = Health::new();
    let threads = common::start_mesh(&config, &b, metrics.clone(), &ctx, &stop);
    // The release before: topic "kvgate-sync", any payload (it cannot be read as ours).
    wait_for("the old peer's messages counted", WAIT, || {
        old.send_multipart([&b"kvgate-sync"[..], b"an older batch"], 0).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        (metrics.sync_mismatches.get() > 0).then_some(())
    })
    .unwrap();
    assert_eq!(common::active(&b).iter().sum::<u64>(), 0, "nothing booked from it");
    stop.stop();
    for t in threads {
        t.join().unwrap();
    }
}
