//! Routing decisions while the pool ingests: does a decision wait on event ingestion?
//!
//! A pool of 64 replicas, each fed by its own in-process ZMQ publisher through the sidecar's
//! real transport (reader, ingester, applier), with vLLM's map-format messages: each stores a
//! 16-block prompt and removes the one stored 64 messages earlier, so the index stays the
//! same size. The index also holds, per replica, 64 prompts of the measured size sharing
//! group prefixes (`fleet/mod.rs`, as `decision.rs`), which the decided prompt partly matches.
//!
//! Four phases, each measuring every decision's latency (route + release) on this thread:
//! 1. **idle**: no events.
//! 2. **full-speed ingest**: one thread publishes to all 64 replicas as fast as it can (more
//!    than the transport takes on 2 cores: the rest is dropped, and the gaps lost or replayed).
//!    The publisher stands in for engines on other machines, so it runs at the lowest CPU
//!    priority (nice 19) and takes only what the sidecar leaves.
//! 3. **steady ingest**: 8 000 messages/s in all, a rate the transport keeps up with.
//! 4. **steady ingest + hung replay**: the same, and replica 0's stream skips a sequence
//!    number, so its ingester replays from a socket that never answers (2 s, the replay
//!    timeout).
//!
//! It prints p50 / p99 / p99.9 / max per phase and the events applied per second. Run: `cargo bench -p kvgate-sidecar --bench contention [-- SECONDS]` (default 3
//! per phase).

mod fleet;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::discovery::{DiscoveryConfig, Supervisor};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use rmp::encode as mp;

use fleet::{tokens, BS};

const REPLICAS: usize = 64;
/// Blocks per published message, and how many messages a prompt stays stored.
const MESSAGE_BLOCKS: u64 = 16;
const WINDOW: u64 = 64;
/// Messages per second, all replicas together, that the transport keeps up with on the
/// 2-core machine (unthrottled, about half are dropped and replayed or lost).
const SUSTAINED_RATE: u64 = 8_000;

fn endpoint(kind: &str, r: usize) -> String {
    format!("inproc://bench-{kind}-{r}")
}

/// The pool, with its preloaded prompts.
fn pool(prompt_tokens: usize) -> Arc<Pool> {
    let configs = (0..REPLICAS)
        .map(|i| {
            let address = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1).parse().expect("valid address");
            let mut r = ReplicaConfig::new(&format!("r{i}"), address, &endpoint("pub", i));
            r.kv_replay = (i == 0).then(|| endpoint("replay", i));
            r
        })
        .collect();
    let config = PoolConfig::new("m", "unused", BS as u32, configs);
    let p = Arc::new(Pool::new(config, Vec::new(), Arc::new(Metrics::default())));
    // Engine hashes of the preloaded prompts stay clear of the published ones (bit 62).
    fleet::preload(&p, REPLICAS, prompt_tokens, 1 << 62);
    p
}

fn write_hashes(b: &mut Vec<u8>, hash: impl Fn(u64) -> u64) {
    mp::write_array_len(b, MESSAGE_BLOCKS as u32).unwrap();
    for i in 0..MESSAGE_BLOCKS {
        mp::write_uint(b, hash(i)).unwrap();
    }
}

/// Message `k` of replica `r`: store prompt `k`, remove prompt `k - WINDOW`.
fn message(r: usize, k: u64) -> Vec<u8> {
    let hash = |k: u64, b: u64| (r as u64) << 40 | (k % (2 * WINDOW)) << 8 | b;
    let mut b = Vec::new();
    mp::write_array_len(&mut b, 3).unwrap();
    mp::write_f64(&mut b, 1.0).unwrap();
    mp::write_array_len(&mut b, if k >= WINDOW { 2 } else { 1 }).unwrap();
    mp::write_map_len(&mut b, 7).unwrap();
    mp::write_str(&mut b, "type").unwrap();
    mp::write_str(&mut b, "BlockStored").unwrap();
    mp::write_str(&mut b, "block_hashes").unwrap();
    write_hashes(&mut b, |i| hash(k, i));
    mp::write_str(&mut b, "parent_block_hash").unwrap();
    mp::write_nil(&mut b).unwrap();
    mp::write_str(&mut b, "token_ids").unwrap();
    let t = tokens(7_000_000 + r as u64 * 10_000 + k % (2 * WINDOW), MESSAGE_BLOCKS as usize * BS);
    mp::write_array_len(&mut b, t.len() as u32).unwrap();
    for id in t {
        mp::write_uint(&mut b, u64::from(id)).unwrap();
    }
    mp::write_str(&mut b, "block_size").unwrap();
    mp::write_uint(&mut b, BS as u64).unwrap();
    mp::write_str(&mut b, "lora_id").unwrap();
    mp::write_nil(&mut b).unwrap();
    mp::write_str(&mut b, "medium").unwrap();
    mp::write_str(&mut b, "GPU").unwrap();
    if k >= WINDOW {
        mp::write_map_len(&mut b, 3).unwrap();
        mp::write_str(&mut b, "type").unwrap();
        mp::write_str(&mut b, "BlockRemoved").unwrap();
        mp::write_str(&mut b, "block_hashes").unwrap();
        write_hashes(&mut b, |i| hash(k - WINDOW, i));
        mp::write_str(&mut b, "medium").unwrap();
        mp::write_str(&mut b, "GPU").unwrap();
    }
    mp::write_uint(&mut b, 0).unwrap();
    b
}

/// Publishes to every replica, round robin, while `run` is set: as fast as it can, or at
/// `rate` messages per second in all. Replica 0 skips one sequence number whenever `skip` is
/// set (and clears it).
struct Publisher {
    run: Arc<AtomicBool>,
    rate: Arc<AtomicU64>,
    skip: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
}

fn publish(ctx: &zmq::Context, p: &Publisher, stop: &AtomicBool) {
    // The engines publish from other machines: here they share the gateway's two cores, so
    // the publisher runs at the lowest priority, taking what the sidecar leaves.
    kvgate_sidecar::niceness::lower_this_thread(19).expect("a thread may lower its own priority");
    let sockets: Vec<zmq::Socket> = (0..REPLICAS)
        .map(|r| {
            let s = ctx.socket(zmq::PUB).unwrap();
            s.set_sndhwm(100_000).unwrap();
            s.bind(&endpoint("pub", r)).unwrap();
            s
        })
        .collect();
    // Messages are encoded once: from WINDOW on, message k and k + 2·WINDOW are the same.
    let messages: Vec<Vec<Vec<u8>>> = (0..REPLICAS).map(|r| (0..3 * WINDOW).map(|k| message(r, k)).collect()).collect();
    let mut seq = vec![0u64; REPLICAS];
    let mut k = 0u64;
    let mut next_round = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if !p.run.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        let rate = p.rate.load(Ordering::Relaxed);
        if rate > 0 {
            next_round = next_round.max(Instant::now() - Duration::from_millis(10));
            next_round += Duration::from_secs_f64(REPLICAS as f64 / rate as f64);
            std::thread::sleep(next_round.saturating_duration_since(Instant::now()));
        }
        for (r, socket) in sockets.iter().enumerate() {
            if r == 0 && p.skip.swap(false, Ordering::Relaxed) {
                seq[0] += 1;
            }
            let i = if k < 3 * WINDOW { k } else { WINDOW + (k - WINDOW) % (2 * WINDOW) };
            let payload = &messages[r][i as usize];
            let frames: [&[u8]; 3] = [b"", &seq[r].to_be_bytes(), payload];
            socket.send_multipart(frames, 0).unwrap();
            seq[r] += 1;
        }
        k += 1;
        p.sent.fetch_add(REPLICAS as u64, Ordering::Relaxed);
    }
}

/// Latencies of decisions made for `secs`, sorted.
fn decide_for(pool: &Pool, request: &RouteRequest, secs: f64) -> Vec<Duration> {
    let scoring = ScoringConfig::default();
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let mut times = Vec::new();
    while Instant::now() < until {
        let started = Instant::now();
        let decision = pool.route(request, &scoring);
        pool.lifecycle(&request.request_id, false);
        times.push(started.elapsed());
        assert!(decision.endpoint.is_some());
    }
    times.sort_unstable();
    times
}

fn applied(pool: &Pool) -> u64 {
    pool.state().replicas.iter().map(|r| r.events_applied).sum()
}

/// Events applied per second since `started`, when `before` had been.
fn rate_since(pool: &Pool, before: u64, started: Instant) -> f64 {
    (applied(pool) - before) as f64 / started.elapsed().as_secs_f64()
}

fn row(phase: &str, prompt_tokens: usize, t: &[Duration], rate: Option<f64>) {
    let q = |f: f64| t[((t.len() as f64 * f) as usize).min(t.len() - 1)].as_secs_f64() * 1e6;
    let rate = rate.map_or("—".to_owned(), |r| format!("{:.0}k events/s", r / 1e3));
    println!(
        "| {phase} | {prompt_tokens} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {rate} |",
        t.len(),
        q(0.5),
        q(0.99),
        q(0.999),
        q(1.0)
    );
}

fn main() {
    let secs: f64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(3.0);
    println!("| phase | prompt tokens | decisions | p50 | p99 | p99.9 | max | events applied |");
    println!("|---|---|---|---|---|---|---|---|");
    for prompt_tokens in [1024usize, 8192] {
        let ctx = zmq::Context::new();
        // The replay socket of replica 0 never answers.
        let hung = ctx.socket(zmq::ROUTER).unwrap();
        hung.bind(&endpoint("replay", 0)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let publisher =
            Publisher { run: Arc::default(), rate: Arc::default(), skip: Arc::default(), sent: Arc::default() };
        let (run, rate, skip) = (publisher.run.clone(), publisher.rate.clone(), publisher.skip.clone());
        let publishing = {
            let (ctx, stop) = (ctx.clone(), stop.clone());
            std::thread::spawn(move || publish(&ctx, &publisher, &stop))
        };
        std::thread::sleep(Duration::from_millis(200));
        let p = pool(prompt_tokens);
        let supervisor =
            Supervisor::start(ctx.clone(), p.clone(), DiscoveryConfig::default(), Arc::new(Metrics::default()))
                .unwrap();
        let request = fleet::request(prompt_tokens, 42);
        row("idle", prompt_tokens, &decide_for(&p, &request, secs), None);
        run.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(500));
        let (before, started) = (applied(&p), Instant::now());
        let times = decide_for(&p, &request, secs);
        row("full-speed ingest", prompt_tokens, &times, Some(rate_since(&p, before, started)));
        // A rate the transport keeps up with, so replica 0 sees the skipped number at once;
        // its replay then hangs for the replay timeout.
        rate.store(SUSTAINED_RATE, Ordering::Relaxed);
        std::thread::sleep(Duration::from_secs(2));
        let (before, started) = (applied(&p), Instant::now());
        row("steady ingest", prompt_tokens, &decide_for(&p, &request, secs), Some(rate_since(&p, before, started)));
        let degraded_before = p.state().replicas[0].degraded;
        skip.store(true, Ordering::Relaxed);
        let (before, started) = (applied(&p), Instant::now());
        let times = decide_for(&p, &request, 2.5);
        row("steady ingest + hung replay", prompt_tokens, &times, Some(rate_since(&p, before, started)));
        let hung = p.state().replicas[0].degraded && !degraded_before;
        eprintln!("replica 0's replay hung and failed during the last phase: {hung}");
        stop.store(true, Ordering::Relaxed);
        supervisor.shutdown();
        publishing.join().unwrap();
    }
}
