//! How far one sidecar goes as the fleet grows (`cargo xtask bench scale`).
//!
//! For each engine count: one simulator process (`kvgate-sim --fleet-config`) records a busy
//! engine's KV events in simulated time (the `llama8b-h100` preset, a 26 000-block cache, a
//! closed loop of 64 requests over shared system prompts) and publishes them as that many
//! engines, each on its own PUB socket, in real time times `rate_scale`. The sidecar under
//! test (release build, its real config and transport) subscribes to every engine, and this
//! harness asks it for routing decisions at a fixed rate over its HTTP API, each prompt one
//! of the shared system prompts and 1 024 new tokens (so every engine holding that prompt is
//! a match to weigh).
//!
//! The sidecar is pinned to core 0, the publishers and the decisions to core 1: the figures
//! are one core's, which is what the extrapolation to larger fleets divides by.
//!
//! With `gateways` above one, the other gateways are peers (`sidecar/examples/peer_gateways.rs`,
//! pinned beside the publishers) that each decide as many requests a second as the harness
//! asks here and publish their bookings, sealed, over the sync mesh the sidecar dials; the
//! sidecar's sync threads' CPU, what the peers sent and the requests in flight are reported.
//!
//! Measured after a warm-up, over the window: decisions (the sidecar's own
//! `kvgate_route_seconds`, and the round trip seen here), event lag
//! (`kvgate_kv_event_lag_seconds`: the engine's batch time to visible in the index), events
//! applied, dropped and gaps lost, the sidecar's CPU (cores) and memory, and the index size.
//! Histogram quantiles are interpolated within buckets, as Prometheus' `histogram_quantile`.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::wire::{
    LifecycleBatch, LifecycleEvent, LifecycleKind, RouteRequest, CONTENT_TYPE, WIRE_VERSION, WIRE_VERSION_HEADER,
};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::Value;

use super::stats::percentile;
use crate::process::{cpu_seconds, free_port, free_port_run, pin, threads_cpu_seconds, wait_for, Proc};
use crate::stack::metric_sum;
use crate::Artifacts;

/// Tokens per block, the engines' and the pool's.
const BLOCK_SIZE: usize = 16;
/// The engines' cache: Llama-3.1-8B on an 80 GB H100 at vLLM's default 0.9 memory share,
/// less 16 GB of weights and about 4 GB of activations, is about 52 GB of KV at 128 KiB a
/// token: 26 000 blocks of 16 tokens.
const ENGINE_BLOCKS: usize = 26_000;
/// New tokens after the shared prompt, per decided request.
const NEW_TOKENS: usize = 1024;
/// How long a decided request holds its booking before its end is reported (the filter's
/// `Done`), so that about `decisions_per_s` × this many are in flight, as in a busy gateway.
const REQUEST_SECS: f64 = 2.0;
/// How often ends are reported, in one batch, as the filter batches them.
const REPORT_EVERY: Duration = Duration::from_millis(100);
/// The peers' requests' first token, after their booking.
const PEER_FIRST_TOKEN_SECS: f64 = 0.25;
/// The program that plays the other gateways (`sidecar/examples/peer_gateways.rs`).
pub const PEERS: &str = "peer_gateways";

/// One run's settings.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleParams {
    /// Engine counts, one run each.
    pub engines: Vec<usize>,
    /// The engines' event rate as a share of the recorded engine's (per engine count; the
    /// last applies to the rest).
    pub rate_scale: Vec<f64>,
    /// Seconds before the window, while the caches fill.
    pub warmup_s: f64,
    /// The measured window.
    pub window_s: f64,
    /// Routing decisions asked per second.
    pub decisions_per_s: f64,
    /// Publishing threads in the simulator.
    pub publisher_threads: usize,
    /// Gateways in the mesh, the one under test included: one run per engine count and
    /// gateway count. Beyond one, the others are peers publishing their bookings to it
    /// ([`PEERS`]).
    pub gateways: Vec<usize>,
}

impl Default for ScaleParams {
    fn default() -> Self {
        ScaleParams {
            engines: vec![64, 256, 1000],
            rate_scale: vec![1.0],
            warmup_s: 20.0,
            window_s: 20.0,
            decisions_per_s: 200.0,
            publisher_threads: 1,
            gateways: vec![1],
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    /// Engines subscribed to.
    pub engines: usize,
    /// Gateways in the mesh, this one included.
    pub gateways: usize,
    /// Their event rate, a share of the recorded engine's.
    pub rate_scale: f64,
    /// Blocks stored and removed per second that the fleet published in the window.
    pub published_blocks_per_s: f64,
    /// KV events (one store or removal of some blocks) the sidecar applied per second.
    pub events_applied_per_s: f64,
    /// Events or messages dropped in the window, by reason.
    pub events_dropped: BTreeMap<String, u64>,
    /// Sequence gaps that could not be closed.
    pub gaps_lost: u64,
    /// Event lag, ms: p50 and p99 over the window.
    pub lag_p50_ms: f64,
    /// See `lag_p50_ms`.
    pub lag_p99_ms: f64,
    /// Decision time inside the sidecar (`kvgate_route_seconds`), µs.
    pub decide_p50_us: f64,
    /// See `decide_p50_us`.
    pub decide_p99_us: f64,
    /// The round trip of a decision over HTTP on loopback, µs.
    pub rtt_p50_us: f64,
    /// See `rtt_p50_us`.
    pub rtt_p99_us: f64,
    /// Decisions answered in the window.
    pub decisions: usize,
    /// The sidecar's CPU over the window, in cores.
    pub sidecar_cores: f64,
    /// Its resident memory at the end, MiB.
    pub sidecar_rss_mib: f64,
    /// Blocks in its index at the end, all replicas.
    pub index_blocks: u64,
    /// The recorded engine's rates (per simulated second), as the simulator reported them.
    pub recorded: Value,
    /// The publishers' CPU over the window, in cores: near 1, they (not the sidecar) were
    /// short of CPU.
    pub publisher_cores: f64,
    /// The peers' traffic to this sidecar, and what it cost; `None` with one gateway.
    pub sync: Option<SyncRow>,
}

/// What the peers sent the sidecar under test over the window (by their clock), and its CPU
/// for the mesh.
#[derive(Debug, Clone, Serialize)]
pub struct SyncRow {
    /// Requests the peers booked per second, all of them.
    pub peer_requests_per_s: f64,
    /// Sync messages (sealed batches) and events sent per second.
    pub messages_per_s: f64,
    /// See `messages_per_s`.
    pub events_per_s: f64,
    /// Sealed bytes sent per second.
    pub bytes_per_s: f64,
    /// How far the peers' schedule had slipped at the end, s: above a few ms, they were short
    /// of CPU and sent less than asked.
    pub peers_behind_s: f64,
    /// The sidecar's sync threads (`sync-sub`: open, decode, apply; `sync-pub`: seal and
    /// publish its own bookings), in cores. Reading the peers' sockets is the ZMQ I/O
    /// thread's work, shared with the engines' sockets, and not counted here.
    pub sync_cores: f64,
    /// The peers' process, in cores.
    pub peer_cores: f64,
    /// Sync messages the sidecar refused (another version, not sealed with the key, stale):
    /// 0 if the measurement is what it says.
    pub refused: u64,
    /// Requests in flight on the pool at the end (`kvgate_pool_active_requests`): its own and
    /// the peers' bookings.
    pub active_requests: f64,
}

/// One bucketed histogram or counter set as scraped: `(le, cumulative count)`, sum, count.
#[derive(Debug, Clone, Default, PartialEq)]
struct Histogram {
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// `name`'s buckets in a Prometheus text page, summed over every label set.
    fn scrape(text: &str, name: &str) -> Histogram {
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        let prefix = format!("{name}_bucket{{");
        for line in text.lines().filter(|l| l.starts_with(&prefix)) {
            let Some((labels, value)) = line.rsplit_once(' ') else { continue };
            let Some(le) = labels.split("le=\"").nth(1).and_then(|r| r.split('"').next()) else { continue };
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            let count: f64 = value.parse().unwrap_or(0.0);
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += count;
        }
        let mut buckets: Vec<(f64, f64)> = by_le.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }

    /// What was observed between `before` and `self`.
    fn since(&self, before: &Histogram) -> Histogram {
        let earlier = |le: f64| before.buckets.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, c)| *c);
        Histogram { buckets: self.buckets.iter().map(|(le, c)| (*le, c - earlier(*le))).collect() }
    }

    /// The `q` quantile, interpolated linearly within its bucket; the highest finite bound if
    /// it falls in `+Inf`; `None` when nothing was observed.
    fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let share = if count > below { (rank - below) / (count - below) } else { 1.0 };
                return Some(lower + (le - lower) * share);
            }
            (lower, below) = (le, count);
        }
        Some(lower)
    }
}

/// Counter `name` summed by its `reason` label.
fn by_reason(text: &str, name: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with(&format!("{name}{{"))) {
        let reason = line.split("reason=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or("");
        let value: f64 = line.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()).unwrap_or(0.0);
        *sums.entry(reason.to_owned()).or_insert(0.0) += value;
    }
    sums
}

/// Series of `name` whose value is above 0.
fn positive_series(text: &str, name: &str) -> usize {
    let prefix = format!("{name}{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()).is_some_and(|v| v > 0.0))
        .count()
}

/// A fleet publisher process and what it said about its recording.
struct Fleet {
    proc: Proc,
    recorded: Value,
    prefixes: Vec<Vec<u32>>,
}

fn start_fleet(
    artifacts: &Artifacts,
    log: &Path,
    engines: usize,
    base_port: u16,
    rate_scale: f64,
    seconds: f64,
    threads: usize,
) -> anyhow::Result<Fleet> {
    let config = serde_json::json!({
        "engines": engines,
        "base_port": base_port,
        "seconds": seconds,
        "record_seconds": (seconds * rate_scale + 5.0).max(30.0),
        "rate_scale": rate_scale,
        "threads": threads,
    });
    let mut cmd = Command::new(&artifacts.sim);
    cmd.args(["--preset", "llama8b-h100", "--block-size", &BLOCK_SIZE.to_string()])
        .args(["--num-gpu-blocks-override", &ENGINE_BLOCKS.to_string()])
        .args(["--fleet-config", &config.to_string()]);
    let mut proc = Proc::spawn("fleet", cmd, log)?;
    let first: Value = wait_for("the fleet's recording", Duration::from_secs(120), || {
        let text = std::fs::read_to_string(log).ok()?;
        text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v.get("recorded").is_some())
    })?;
    proc.check_alive()?;
    let prefixes = serde_json::from_value(first["prefixes"].clone()).context("the shared prompts")?;
    Ok(Fleet { proc, recorded: first["recorded"].clone(), prefixes })
}

fn sidecar_config(port: u16, model_dir: &Path, engines: usize, base_port: u16, mesh: Option<&Mesh>) -> String {
    let mut toml = format!(
        "listen = \"127.0.0.1:{port}\"\n\n[[pools]]\nmodel = \"m\"\ntokenizer = {:?}\nblock_size = {BLOCK_SIZE}\npolicy = \"kv_aware\"\n",
        model_dir.display().to_string()
    );
    for i in 0..engines {
        // The engines' HTTP endpoints are never called: decisions are asked, not served.
        toml += &format!(
            "\n[[pools.replicas]]\nid = \"e{i}\"\nendpoint = \"127.0.0.{}:{}\"\nkv_events = \"tcp://127.0.0.1:{}\"\n",
            1 + i / 60_000,
            8000 + i % 60_000,
            usize::from(base_port) + i
        );
    }
    if let Some(mesh) = mesh {
        let peers: Vec<String> = (0..mesh.peers).map(|i| format!("tcp://127.0.0.1:{}", mesh.peer_port(i))).collect();
        toml += &format!(
            "\n[sync]\nid = \"under-test\"\nlisten = \"tcp://127.0.0.1:{}\"\npeers = {peers:?}\nkey_file = {:?}\n",
            mesh.listen_port,
            mesh.key_file.display().to_string()
        );
    }
    toml
}

/// The mesh of a run with more than one gateway: the peers' ports and the key.
struct Mesh {
    peers: usize,
    /// Peer `i` publishes on `base_port + 2 i` (the port after is its handover port, left
    /// closed: the sidecar under test finds no view to take over there, at once).
    base_port: u16,
    /// The sidecar's own sync port (and its handover port after it).
    listen_port: u16,
    key_file: std::path::PathBuf,
}

impl Mesh {
    fn peer_port(&self, i: usize) -> usize {
        usize::from(self.base_port) + 2 * i
    }
}

/// The peers' totals so far, from the last line they printed.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
struct PeersSent {
    seconds: f64,
    behind: f64,
    messages: f64,
    events: f64,
    bytes: f64,
    requests: f64,
}

impl PeersSent {
    fn last(log: &Path) -> Option<PeersSent> {
        let text = std::fs::read_to_string(log).ok()?;
        text.lines().rev().find_map(|l| serde_json::from_str::<PeersSent>(l).ok())
    }
}

/// The peers' process, their mesh, and the log they print their totals to.
struct Peers {
    proc: Proc,
    mesh: Mesh,
    log: std::path::PathBuf,
}

/// Starts the peers: `gateways - 1` of them, each deciding `rate` requests a second over the
/// fleet's shared prompts, sealed with a key written here.
fn start_peers(
    artifacts: &Artifacts,
    dir: &Path,
    fleet: &Fleet,
    engines: usize,
    gateways: usize,
    rate: f64,
    seconds: f64,
) -> anyhow::Result<Peers> {
    let peers = gateways - 1;
    let program = &artifacts.peer_gateways;
    anyhow::ensure!(
        program.exists(),
        "{} is missing: cargo build --release -p kvgate-sidecar --example {PEERS}",
        program.display()
    );
    let key_file = dir.join("sync.key");
    let key: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
    std::fs::write(&key_file, key)?;
    let prefixes_file = dir.join("prefixes.json");
    std::fs::write(&prefixes_file, serde_json::to_vec(&fleet.prefixes)?)?;
    let mesh = Mesh {
        peers,
        base_port: free_port_run(u16::try_from(2 * peers).context("too many gateways")?)?,
        listen_port: free_port_run(2)?,
        key_file,
    };
    let config = serde_json::json!({
        "peers": peers,
        "base_port": mesh.base_port,
        "decisions_per_s": rate,
        "key_file": mesh.key_file,
        "prefixes_file": prefixes_file,
        "model": "m",
        "engines": engines,
        "new_tokens": NEW_TOKENS,
        "block_size": BLOCK_SIZE,
        "first_token_secs": PEER_FIRST_TOKEN_SECS,
        "request_secs": REQUEST_SECS,
        "seconds": seconds,
        "seed": engines as u64 * 1000 + gateways as u64,
    });
    let mut cmd = Command::new(program);
    cmd.arg(config.to_string());
    let log = dir.join(format!("peers-{engines}x{gateways}.log"));
    let mut proc = Proc::spawn("peers", cmd, &log)?;
    wait_for("the peers' sockets", Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.lines().any(|l| l.contains("\"bound\"")).then_some(())
    })?;
    proc.check_alive()?;
    Ok(Peers { proc, mesh, log })
}

fn post(client: &reqwest::blocking::Client, url: &str, body: Vec<u8>) -> anyhow::Result<()> {
    let reply = client
        .post(url)
        .header("content-type", CONTENT_TYPE)
        .header(WIRE_VERSION_HEADER, WIRE_VERSION)
        .body(body)
        .send()
        .with_context(|| format!("calling {url}"))?;
    anyhow::ensure!(reply.status().is_success(), "{url} answered {}", reply.status());
    reply.bytes()?;
    Ok(())
}

/// Asks `base` for decisions at `rate` for `window`, each a shared prompt and new tokens,
/// and reports each request done [`REQUEST_SECS`] later; returns each decision's round trip
/// in µs.
fn decide(base: &str, prefixes: &[Vec<u32>], rate: f64, window: Duration, seed: u64) -> anyhow::Result<Vec<f64>> {
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let (route, lifecycle) = (format!("{base}/v1/route"), format!("{base}/v1/lifecycle"));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (start, mut rtts) = (Instant::now(), Vec::new());
    let mut running: std::collections::VecDeque<(Duration, String)> = std::collections::VecDeque::new();
    let mut reported = Duration::ZERO;
    for n in 0u64.. {
        let due = Duration::from_secs_f64(n as f64 / rate);
        if due >= window {
            break;
        }
        if let Some(wait) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(wait);
        }
        if due >= reported + REPORT_EVERY {
            reported = due;
            let mut batch = LifecycleBatch::default();
            while running.front().is_some_and(|(end, _)| *end <= due) {
                let (_, id) = running.pop_front().expect("checked");
                batch.events.push(LifecycleEvent {
                    model: "m".into(),
                    request_id: id.into(),
                    kind: LifecycleKind::Done,
                });
            }
            post(&client, &lifecycle, kvgate_shared::codec::encode(&batch)?)?;
        }
        let mut tokens = prefixes[rng.random_range(0..prefixes.len())].clone();
        tokens.extend((0..NEW_TOKENS).map(|_| rng.random_range(50_000..150_000u32)));
        let hashes = prompt_block_hashes(&tokens, BLOCK_SIZE, Salt::NONE);
        let id = format!("scale-{n}");
        let request = RouteRequest::exact(&id, "m", tokens.len() as u32, BLOCK_SIZE as u32, hashes);
        let body = kvgate_shared::codec::encode(&request)?;
        let sent = Instant::now();
        post(&client, &route, body)?;
        rtts.push(sent.elapsed().as_secs_f64() * 1e6);
        running.push_back((due + Duration::from_secs_f64(REQUEST_SECS), id));
    }
    Ok(rtts)
}

fn scrape(url: &str) -> anyhow::Result<String> {
    Ok(reqwest::blocking::get(url)?.error_for_status()?.text()?)
}

/// One engine count with one gateway count.
fn run_one(
    artifacts: &Artifacts,
    dir: &Path,
    params: &ScaleParams,
    engines: usize,
    rate_scale: f64,
    gateways: usize,
) -> anyhow::Result<ScaleRow> {
    let base_port = free_port_run(u16::try_from(engines).context("too many engines")?)?;
    let seconds = params.warmup_s + params.window_s + 30.0;
    let name = format!("{engines}x{gateways}");
    let fleet_log = dir.join(format!("fleet-{name}.log"));
    let mut fleet =
        start_fleet(artifacts, &fleet_log, engines, base_port, rate_scale, seconds, params.publisher_threads)?;
    if let Some(pid) = fleet.proc.pid() {
        pin(pid, 1)?;
    }
    // The other gateways, on the publishers' core; they publish until well past the window.
    let mut peers = match gateways > 1 {
        true => Some(start_peers(artifacts, dir, &fleet, engines, gateways, params.decisions_per_s, seconds + 120.0)?),
        false => None,
    };
    if let Some(pid) = peers.as_ref().and_then(|p| p.proc.pid()) {
        pin(pid, 1)?;
    }
    let port = free_port()?;
    let config_path = dir.join(format!("sidecar-{name}.toml"));
    let mesh = peers.as_ref().map(|p| &p.mesh);
    std::fs::write(&config_path, sidecar_config(port, &artifacts.model_dir, engines, base_port, mesh))?;
    let mut cmd = Command::new(&artifacts.sidecar);
    cmd.arg("--config").arg(&config_path);
    let mut sidecar = Proc::spawn("sidecar", cmd, &dir.join(format!("sidecar-{name}.log")))?;
    let pid = sidecar.pid().context("the sidecar's pid")?;
    pin(pid, 0)?;
    let base = format!("http://127.0.0.1:{port}");
    let metrics_url = format!("{base}/metrics");
    wait_for("every engine's events applied", Duration::from_secs(120), || {
        let text = scrape(&metrics_url).ok()?;
        (positive_series(&text, "kvgate_kv_events_applied_total") >= engines).then_some(())
    })?;
    std::thread::sleep(Duration::from_secs_f64(params.warmup_s));
    sidecar.check_alive()?;
    let before = scrape(&metrics_url)?;
    let fleet_pid = fleet.proc.pid().context("the fleet's pid")?;
    let cpu_before = cpu_seconds(pid).context("the sidecar's CPU time")?;
    let fleet_before = cpu_seconds(fleet_pid).context("the fleet's CPU time")?;
    let sync_probe = SyncProbe::start(pid, peers.as_ref())?;
    let started = Instant::now();
    let window = Duration::from_secs_f64(params.window_s);
    let rtts = decide(&base, &fleet.prefixes, params.decisions_per_s, window, engines as u64)?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid).context("the sidecar's CPU time")? - cpu_before;
    let fleet_cpu = cpu_seconds(fleet_pid).context("the fleet's CPU time")? - fleet_before;
    let sync_spent = sync_probe.map(|p| p.stop(pid)).transpose()?;
    fleet.proc.check_alive()?;
    let after = scrape(&metrics_url)?;
    let sync = sync_spent.map(|s| s.row(wall, &before, &after)).transpose()?;
    let rss = crate::process::rss_bytes(pid).unwrap_or(0) as f64 / (1 << 20) as f64;
    sidecar.kill();
    fleet.proc.kill();
    if let Some(p) = peers.as_mut() {
        p.proc.check_alive()?;
        p.proc.kill();
    }
    let hist = |name: &str| Histogram::scrape(&after, name).since(&Histogram::scrape(&before, name));
    let delta = |name: &str| metric_sum(&after, name, "") - metric_sum(&before, name, "");
    let (lag, route) = (hist("kvgate_kv_event_lag_seconds"), hist("kvgate_route_seconds"));
    let recorded_blocks = ["blocks_stored_per_s", "blocks_removed_per_s"]
        .iter()
        .map(|k| fleet.recorded[k].as_f64().unwrap_or(0.0))
        .sum::<f64>();
    Ok(ScaleRow {
        engines,
        gateways,
        rate_scale,
        published_blocks_per_s: recorded_blocks * rate_scale * engines as f64,
        events_applied_per_s: delta("kvgate_kv_events_applied_total") / wall,
        events_dropped: by_reason(&after, "kvgate_kv_events_dropped_total")
            .into_iter()
            .map(|(reason, n)| {
                let before = by_reason(&before, "kvgate_kv_events_dropped_total").get(&reason).copied().unwrap_or(0.0);
                (reason, (n - before) as u64)
            })
            .filter(|(_, n)| *n > 0)
            .collect(),
        gaps_lost: delta("kvgate_kv_gaps_lost_total") as u64,
        lag_p50_ms: lag.quantile(0.5).unwrap_or(f64::NAN) * 1e3,
        lag_p99_ms: lag.quantile(0.99).unwrap_or(f64::NAN) * 1e3,
        decide_p50_us: route.quantile(0.5).unwrap_or(f64::NAN) * 1e6,
        decide_p99_us: route.quantile(0.99).unwrap_or(f64::NAN) * 1e6,
        rtt_p50_us: percentile(&rtts, 50.0).unwrap_or(f64::NAN),
        rtt_p99_us: percentile(&rtts, 99.0).unwrap_or(f64::NAN),
        decisions: rtts.len(),
        sidecar_cores: cpu / wall,
        sidecar_rss_mib: rss,
        index_blocks: metric_sum(&after, "kvgate_index_blocks", "") as u64,
        recorded: fleet.recorded,
        publisher_cores: fleet_cpu / wall,
        sync,
    })
}

/// The mesh's figures at the window's start, to be taken again at its end.
struct SyncProbe {
    log: std::path::PathBuf,
    peers_pid: u32,
    sent: PeersSent,
    sync_cpu: f64,
    peers_cpu: f64,
}

/// The sidecar's threads that carry the mesh.
const SYNC_THREADS: [&str; 2] = ["sync-sub", "sync-pub"];

impl SyncProbe {
    fn start(pid: u32, peers: Option<&Peers>) -> anyhow::Result<Option<SyncProbe>> {
        let Some(Peers { proc, log, .. }) = peers else { return Ok(None) };
        let peers_pid = proc.pid().context("the peers' pid")?;
        Ok(Some(SyncProbe {
            log: log.clone(),
            peers_pid,
            sent: PeersSent::last(log).context("the peers' totals")?,
            sync_cpu: threads_cpu_seconds(pid, &SYNC_THREADS).context("the sync threads' CPU time")?,
            peers_cpu: cpu_seconds(peers_pid).context("the peers' CPU time")?,
        }))
    }

    /// What the peers sent and the sidecar's sync threads and the peers spent since the
    /// start.
    fn stop(self, pid: u32) -> anyhow::Result<SyncSpent> {
        let sync_cpu = threads_cpu_seconds(pid, &SYNC_THREADS).context("the sync threads' CPU time")? - self.sync_cpu;
        anyhow::ensure!(sync_cpu > 0.0, "no CPU time on the sidecar's threads {SYNC_THREADS:?}: were they renamed?");
        let peers_cpu = cpu_seconds(self.peers_pid).context("the peers' CPU time")? - self.peers_cpu;
        let sent = PeersSent::last(&self.log).context("the peers' totals")?;
        Ok(SyncSpent { start: self.sent, end: sent, sync_cpu, peers_cpu })
    }
}

/// [`SyncProbe`]'s figures over the window.
struct SyncSpent {
    start: PeersSent,
    end: PeersSent,
    sync_cpu: f64,
    peers_cpu: f64,
}

impl SyncSpent {
    /// The row: traffic per second of the peers' own clock (their totals are printed every
    /// second), CPU per second of the window (`wall`), refusals and requests in flight from
    /// the sidecar's metrics `before` and `after` it.
    fn row(self, wall: f64, before: &str, after: &str) -> anyhow::Result<SyncRow> {
        let (start, end) = (self.start, self.end);
        let secs = end.seconds - start.seconds;
        anyhow::ensure!(secs > 0.0, "the peers reported nothing over the window");
        let per_s = |a: f64, b: f64| (a - b) / secs;
        let refused = ["kvgate_sync_rejected_total", "kvgate_sync_mismatches_total"]
            .iter()
            .map(|name| metric_sum(after, name, "") - metric_sum(before, name, ""))
            .sum::<f64>();
        Ok(SyncRow {
            peer_requests_per_s: per_s(end.requests, start.requests),
            messages_per_s: per_s(end.messages, start.messages),
            events_per_s: per_s(end.events, start.events),
            bytes_per_s: per_s(end.bytes, start.bytes),
            peers_behind_s: end.behind,
            sync_cores: self.sync_cpu / wall,
            peer_cores: self.peers_cpu / wall,
            refused: refused as u64,
            active_requests: metric_sum(after, "kvgate_pool_active_requests", ""),
        })
    }
}

/// Every engine count, each with every gateway count, in turn.
pub fn run(artifacts: &Artifacts, dir: &Path, params: &ScaleParams) -> anyhow::Result<Vec<ScaleRow>> {
    std::fs::create_dir_all(dir)?;
    let mut rows = Vec::new();
    for (i, &engines) in params.engines.iter().enumerate() {
        let rate_scale = params.rate_scale.get(i).or(params.rate_scale.last()).copied().unwrap_or(1.0);
        for &gateways in &params.gateways {
            eprintln!("scale: {engines} engines at {rate_scale}× the recorded rate, {gateways} gateways");
            let row = run_one(artifacts, dir, params, engines, rate_scale, gateways)?;
            eprintln!("{}", serde_json::to_string(&row)?);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The rows as Markdown tables: the sidecar's figures, then (for runs with peers) the mesh's.
pub fn table(rows: &[ScaleRow]) -> String {
    let mut md = String::from(
        "| engines | gateways | rate | blocks/s published | events applied/s | dropped | gaps lost | lag p50 / p99 ms | decide p50 / p99 µs | round trip p50 / p99 µs | sidecar cores | RSS MiB | index blocks |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let dropped: Vec<String> = r.events_dropped.iter().map(|(reason, n)| format!("{n} {reason}")).collect();
        let dropped = if dropped.is_empty() { "0".to_owned() } else { dropped.join(", ") };
        md += &format!(
            "| {} | {} | {}× | {:.0} | {:.0} | {} | {} | {:.1} / {:.1} | {:.0} / {:.0} | {:.0} / {:.0} | {:.2} | {:.0} | {} |\n",
            r.engines,
            r.gateways,
            r.rate_scale,
            r.published_blocks_per_s,
            r.events_applied_per_s,
            dropped,
            r.gaps_lost,
            r.lag_p50_ms,
            r.lag_p99_ms,
            r.decide_p50_us,
            r.decide_p99_us,
            r.rtt_p50_us,
            r.rtt_p99_us,
            r.sidecar_cores,
            r.sidecar_rss_mib,
            r.index_blocks
        );
    }
    let meshed: Vec<(&ScaleRow, &SyncRow)> = rows.iter().filter_map(|r| Some((r, r.sync.as_ref()?))).collect();
    if !meshed.is_empty() {
        md += "\nWhat the peers sent the sidecar under test, and what it cost:\n\n| engines | gateways | peer requests/s | messages/s | events/s | sealed KiB/s | peers behind, ms | sync threads, cores | peers' process, cores | refused | requests in flight at the end |\n|---|---|---|---|---|---|---|---|---|---|---|\n";
        for (r, m) in meshed {
            md += &format!(
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.3} | {:.2} | {} | {:.0} |\n",
                r.engines,
                r.gateways,
                m.peer_requests_per_s,
                m.messages_per_s,
                m.events_per_s,
                m.bytes_per_s / 1024.0,
                m.peers_behind_s * 1e3,
                m.sync_cores,
                m.peer_cores,
                m.refused,
                m.active_requests
            );
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "\
# TYPE kvgate_route_seconds histogram
kvgate_route_seconds_sum 0.5
kvgate_route_seconds_count 100
kvgate_route_seconds_bucket{le=\"0.00001\"} 10
kvgate_route_seconds_bucket{le=\"0.00002\"} 90
kvgate_route_seconds_bucket{le=\"0.00004\"} 100
kvgate_route_seconds_bucket{le=\"+Inf\"} 100
kvgate_kv_events_applied_total{model=\"m\",replica=\"e0\"} 5
kvgate_kv_events_applied_total{model=\"m\",replica=\"e1\"} 0
kvgate_kv_events_applied_total_created 3
kvgate_kv_events_dropped_total{model=\"m\",replica=\"e0\",reason=\"inbox_full\"} 2
kvgate_kv_events_dropped_total{model=\"m\",replica=\"e1\",reason=\"inbox_full\"} 3
kvgate_sync_mismatches_total 4
";

    #[test]
    fn quantiles_are_interpolated_within_their_bucket() {
        let h = Histogram::scrape(PAGE, "kvgate_route_seconds");
        assert_eq!(h.buckets.len(), 4);
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 0.000015).abs() < 1e-9, "{p50}");
        let p99 = h.quantile(0.99).unwrap();
        assert!((p99 - 0.000038).abs() < 1e-9, "{p99}");
        assert_eq!(h.since(&h).quantile(0.5), None, "nothing observed in between");
    }

    #[test]
    fn counters_are_summed_and_live_series_counted() {
        assert_eq!(metric_sum(PAGE, "kvgate_kv_events_applied_total", ""), 5.0);
        assert_eq!(metric_sum(PAGE, "kvgate_sync_mismatches_total", ""), 4.0, "a counter without labels");
        assert_eq!(positive_series(PAGE, "kvgate_kv_events_applied_total"), 1);
        assert_eq!(by_reason(PAGE, "kvgate_kv_events_dropped_total"), BTreeMap::from([("inbox_full".to_owned(), 5.0)]));
    }
}
