//! A sealed gateway mesh: sidecars sharing a key share their bookings; someone on the pod
//! network without it reads nothing, gets no handover, and a peer with another key books
//! nothing — each refusal counted. A flood of handover requests is answered at most
//! `handover_burst` times, and the sidecar's memory stays flat.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

mod common;

use kvgate_e2e::process::{free_port, free_port_run, wait_for};
use kvgate_shared::hash::SequenceHash;
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::health::Health;
use kvgate_sidecar::metrics::{Metrics, RefusalLabels};
use kvgate_sidecar::msg::handover::REQUEST;
use kvgate_sidecar::msg::sync::{SyncBatch, SyncEvent};
use kvgate_sidecar::score::ScoringConfig;
use kvgate_sidecar::sync::seal::{Purpose, Sealer, SyncKey};
use kvgate_sidecar::sync::SyncConfig;

const WAIT: Duration = Duration::from_secs(10);
const KEY: &str = "6b76676174652d746573742d6b65792d6f6e6c792d6e65766572207573652121";
const OTHER_KEY: &str = "0000000000000000000000000000000000000000000000000000000000000001";
/// The topic of this release's sync messages.
const TOPIC: &[u8] = b"kvgate-sync/4";

fn key_file(name: &str, key: &str) -> PathBuf {
    static FILES: AtomicUsize = AtomicUsize::new(0);
    let n = FILES.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("kvgate-sync-key-{}-{n}-{name}", std::process::id()));
    std::fs::write(&path, format!("{key}\n")).unwrap();
    path
}

fn request(id: &str, seed: u32) -> RouteRequest {
    let tokens: Vec<u32> = (0..64).map(|t| seed * 1000 + t).collect();
    RouteRequest { session: Some("s".into()), ..common::request(id, &tokens) }
}

fn refused(
    family: &prometheus_client::metrics::family::Family<RefusalLabels, prometheus_client::metrics::counter::Counter>,
    reason: &str,
) -> u64 {
    family.get_or_create(&RefusalLabels { reason: reason.into() }).get()
}

fn sealed_config(id: &str, port: u16, peers: &[u16], key: &str) -> SyncConfig {
    SyncConfig {
        id: Some(id.into()),
        key_file: Some(key_file(id, key)),
        ..SyncConfig::new(
            &format!("tcp://127.0.0.1:{port}"),
            peers.iter().map(|p| format!("tcp://127.0.0.1:{p}")).collect(),
        )
    }
}

/// A peer's booking of request `id` on replica `target`.
fn booking(id: &str, target: &str) -> Vec<u8> {
    let event = SyncEvent::Booked {
        model: "m".into(),
        target: target.into(),
        request_id: id.into(),
        prefill_tokens: 64,
        hashes: vec![SequenceHash(7)],
        held_blocks: 0,
        total_blocks: 16,
        sequences: 1,
        session: None,
    };
    kvgate_shared::codec::encode(&SyncBatch { origin: "d".into(), events: vec![event] }).unwrap()
}

#[test]
fn a_sealed_mesh_shares_bookings_and_nobody_without_the_key_reads_or_writes_it() {
    // Sync ports A, B (each with its handover port next), and an intruder D.
    let first = free_port_run(4).unwrap();
    let (port_a, port_b, port_d) = (first, first + 2, free_port().unwrap());
    let ctx = zmq::Context::new();
    let intruder = ctx.socket(zmq::PUB).unwrap();
    intruder.bind(&format!("tcp://127.0.0.1:{port_d}")).unwrap();
    let (a, b) = (common::session_pool(), common::session_pool());
    let b_metrics = Arc::new(Metrics::default());
    let stop = Health::new();
    let a_config = sealed_config("a", port_a, &[port_b], KEY);
    let mut threads = common::start_mesh(&a_config, &a, Arc::new(Metrics::default()), &ctx, &stop);
    let b_config = sealed_config("b", port_b, &[port_a, port_d], KEY);
    threads.extend(common::start_mesh(&b_config, &b, b_metrics.clone(), &ctx, &stop));
    // Someone on the pod network listens to A's sync port.
    let spy = ctx.socket(zmq::SUB).unwrap();
    spy.set_subscribe(b"").unwrap();
    spy.connect(&format!("tcp://127.0.0.1:{port_a}")).unwrap();

    // Bookings cross the sealed link: book probes on A until B sees one.
    let cfg = ScoringConfig::default();
    let mut probes = 0;
    wait_for("the sealed sync link", WAIT, || {
        a.route(&request(&format!("probe-{probes}"), 900 + probes), &cfg);
        probes += 1;
        std::thread::sleep(Duration::from_millis(20));
        (common::active(&b).iter().sum::<u64>() > 0).then_some(())
    })
    .unwrap();

    // The spy got A's messages, and can read none of them.
    let mut heard = Vec::new();
    while let Ok(frames) = spy.recv_multipart(zmq::DONTWAIT) {
        heard.push(frames);
    }
    assert!(!heard.is_empty(), "the spy is connected and hears traffic");
    for frames in &heard {
        let payload = frames.last().unwrap();
        assert!(kvgate_shared::codec::decode::<SyncBatch>(payload).is_err(), "a sync message is not readable");
        assert!(!payload.windows(6).any(|w| w == b"probe-"), "no request id shows");
    }

    // An intruder publishing bookings on r0, unsealed or sealed with another key: refused, counted.
    let wrong = Sealer::new(Some(&SyncKey::parse(OTHER_KEY).unwrap()));
    let mut n = 0;
    wait_for("B counts the intruder's messages", WAIT, || {
        let forged = wrong.seal(Purpose::Sync, booking(&format!("forged-{n}"), "r0"), SystemTime::now());
        intruder.send_multipart([TOPIC, &forged[..]], 0).unwrap();
        intruder.send_multipart([TOPIC, &booking(&format!("plain-{n}"), "r0")[..]], 0).unwrap();
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
        (refused(&b_metrics.sync_rejected, "unauthenticated") >= 2).then_some(())
    })
    .unwrap();
    // The same publisher with the mesh's key books on r1: the link works, only the key differed.
    let right = Sealer::new(Some(&SyncKey::parse(KEY).unwrap()));
    let before = common::active(&b);
    let mut k = 0;
    wait_for("B books the keyed message", WAIT, || {
        let sealed = right.seal(Purpose::Sync, booking(&format!("keyed-{k}"), "r1"), SystemTime::now());
        intruder.send_multipart([TOPIC, &sealed[..]], 0).unwrap();
        k += 1;
        std::thread::sleep(Duration::from_millis(20));
        (common::active(&b)[1] > before[1]).then_some(())
    })
    .unwrap();
    assert_eq!(common::active(&b)[0], before[0], "nothing the intruder sent without the key was booked");

    stop.stop();
    for t in threads {
        t.join().unwrap();
    }
}

/// VmRSS of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn handovers_go_only_to_key_holders_and_a_flood_is_rate_limited_with_memory_flat() {
    let port = free_port_run(2).unwrap();
    let ctx = zmq::Context::new();
    // A view worth handing over: 4 000 bookings of 128 blocks (~4 MB an answer).
    let a = common::session_pool();
    let cfg = ScoringConfig::default();
    for i in 0..4_000u32 {
        let tokens: Vec<u32> = (0..512).map(|t| i * 1000 + t).collect();
        a.route(&common::request(&format!("held-{i}"), &tokens), &cfg);
    }
    let metrics = Arc::new(Metrics::default());
    let config =
        SyncConfig { handover_burst: 2, handover_refill_ms: 600_000, ..sealed_config("a", port, &[port + 10], KEY) };
    let stop = Health::new();
    let pools = HashMap::from([("m".to_owned(), a.clone())]);
    let sealer = config.sealer().unwrap();
    let server =
        kvgate_sidecar::sync::state::serve(&config, "a".into(), pools, metrics.clone(), &ctx, &stop, &sealer).unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", port + 1);
    let ask = |frame: &[u8]| {
        let s = ctx.socket(zmq::DEALER).unwrap();
        s.set_linger(0).unwrap();
        s.connect(&endpoint).unwrap();
        s.send_multipart([&b""[..], frame], 0).unwrap();
        s
    };

    // Without the key: a plain request and one sealed with another key are refused, unanswered.
    let plain = ask(REQUEST);
    let wrong = ask(&Sealer::new(Some(&SyncKey::parse(OTHER_KEY).unwrap())).seal(
        Purpose::HandoverRequest,
        REQUEST.to_vec(),
        SystemTime::now(),
    ));
    let refusals = || refused(&metrics.handovers_refused, "unauthenticated");
    wait_for("both refused", WAIT, || (refusals() == 2).then_some(())).unwrap();
    assert_eq!(plain.poll(zmq::POLLIN, 0).unwrap() + wrong.poll(zmq::POLLIN, 0).unwrap(), 0, "no answer");
    assert_eq!(metrics.handovers_served.get(), 0);

    // A key holder starting up gets the view (the real asker).
    let peer = SyncConfig { handover_timeout_ms: 5_000, ..sealed_config("b", port + 10, &[port], KEY) };
    let (from, taken) = kvgate_sidecar::sync::state::recover(
        &peer,
        "b",
        &HashMap::from([("m".to_owned(), common::session_pool())]),
        &ctx,
        &peer.sealer().unwrap(),
    )
    .expect("a handover for the key holder");
    assert_eq!(from, "a");
    assert_eq!(taken[0].1.bookings, 4_000, "every booking handed over");
    let answer_bytes = metrics.handover_bytes.get();
    assert!(answer_bytes > 4_000_000, "an answer of {answer_bytes} bytes");

    // A flood of sealed requests from 20 askers that never read: one more answer (the burst
    // was 2), the rest refused; memory grows by far less than 200 answers would take.
    let rss_before = rss();
    let right = Sealer::new(Some(&SyncKey::parse(KEY).unwrap()));
    let askers: Vec<_> =
        (0..20).map(|_| ask(&right.seal(Purpose::HandoverRequest, REQUEST.to_vec(), SystemTime::now()))).collect();
    for s in &askers {
        for _ in 0..9 {
            s.send_multipart(
                [&b""[..], &right.seal(Purpose::HandoverRequest, REQUEST.to_vec(), SystemTime::now())[..]],
                0,
            )
            .unwrap();
        }
    }
    let handled = || metrics.handovers_served.get() + refused(&metrics.handovers_refused, "rate_limited");
    wait_for("every request of the flood handled", WAIT, || (handled() == 201).then_some(())).unwrap();
    assert_eq!(metrics.handovers_served.get(), 2, "the burst, then the rate limit");
    assert_eq!(refused(&metrics.handovers_refused, "rate_limited"), 199);
    let grown = rss().saturating_sub(rss_before);
    assert!(
        grown < 3 * answer_bytes + (32 << 20),
        "memory grew {grown} bytes over a flood of 200 (an answer is {answer_bytes})"
    );

    stop.stop();
    server.join().unwrap();
    drop(askers);
}
