//! The fault suite: each scenario runs a whole gateway (Envoy + filter + sidecar + three
//! simulated engines) under steady load, injects one fault, and measures what clients saw
//! against the promise written in the README's "Failure behaviour" section.
//!
//! [`SCENARIOS`] lists them; `cargo xtask faults` runs them all and writes the table of
//! scenario, expected behaviour and measured result to `target/faults/<time>/report.md`;
//! `tests/tests/faults.rs` runs each as a test (part of `cargo xtask test`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::bench::loadgen::{Outcome, Tags, Target};
use crate::client::{self, post, stream};
use crate::process::wait_for;
use crate::workload::document;
use crate::{Artifacts, Stack, StackOptions};

/// Requests per second of the steady load.
const RATE: f64 = 20.0;

/// One line of the report.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was done.
    pub scenario: &'static str,
    /// The promise.
    pub expected: &'static str,
    /// What happened.
    pub measured: String,
    /// Whether the promise held.
    pub pass: bool,
}

/// A scenario: its name and how to run it.
pub type Scenario = (&'static str, fn(&Artifacts) -> anyhow::Result<Row>);

/// Every scenario, in report order.
pub const SCENARIOS: &[Scenario] = &[
    ("sidecar_killed", sidecar_killed),
    ("engine_restarted", engine_restarted),
    ("events_dropped_with_replay", events_dropped_with_replay),
    ("events_dropped_without_replay", events_dropped_without_replay),
    ("publisher_stalled", publisher_stalled),
    ("engine_died", engine_died),
    ("sidecar_slow", sidecar_slow),
    ("envoy_hot_restarted", envoy_hot_restarted),
];

/// Runs the named scenario.
pub fn run(name: &str, artifacts: &Artifacts) -> anyhow::Result<Row> {
    let (_, scenario) =
        SCENARIOS.iter().find(|(n, _)| *n == name).ok_or_else(|| anyhow::anyhow!("no scenario {name:?}"))?;
    scenario(artifacts)
}

/// The report's table, in Markdown.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from("| scenario | expected | measured | result |\n|---|---|---|---|\n");
    for r in rows {
        let result = if r.pass { "pass" } else { "**FAIL**" };
        out.push_str(&format!("| {} | {} | {} | {result} |\n", r.scenario, r.expected, r.measured));
    }
    out
}

/// Steady open-loop load on the gateway: small chats over a set of shared documents (so
/// routing has prefixes to follow), at a fixed rate, until [`Load::finish`].
pub struct Load {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<Outcome>>,
    started: Instant,
}

impl Load {
    /// Starts sending to `stack`'s gateway: 20 requests per second over 6 documents.
    pub fn start(stack: &Stack) -> anyhow::Result<Load> {
        Load::start_with(stack, RATE, 6)
    }

    /// Starts sending `rate` requests per second, each over one of `documents` documents of
    /// about 200 tokens.
    pub fn start_with(stack: &Stack, rate: f64, documents: u32) -> anyhow::Result<Load> {
        let started = Instant::now();
        let target = Target::new(&stack.gateway(""), 1.0, Duration::from_secs(30))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(r) => r,
                Err(_) => return Vec::new(),
            };
            runtime.block_on(async move {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
                let mut running = Vec::new();
                let mut i = 0u32;
                while !flag.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let body = chat(&document(500 + i % documents.max(1), 150), &format!("question {i}"));
                    let target = target.clone();
                    running.push(tokio::spawn(async move {
                        target.send("/v1/chat/completions", body, Tags::default()).await
                    }));
                    i += 1;
                }
                let mut out = Vec::new();
                for r in running {
                    if let Ok(o) = r.await {
                        out.push(o);
                    }
                }
                out
            })
        });
        Ok(Load { stop, handle, started })
    }

    /// Seconds since the load started: the clock of [`Outcome::sent_at`].
    pub fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Stops sending, waits for what is in flight, and returns every outcome.
    pub fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

fn chat(system: &str, question: &str) -> Value {
    json!({"model": "qwen3", "max_tokens": 8, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}]})
}

/// Lets the load run for `d`: the scenario's timeline, not a wait for a condition.
fn run_for(d: Duration) {
    std::thread::sleep(d);
}

/// Whether a request was under way when an engine was killed at `at` (load clock): sent no
/// later than just after the kill began, and not finished before it. Such a request may have
/// reached the engine, so its failure is the dead engine's, as under any balancer.
fn in_flight_at(o: &Outcome, at: f64) -> bool {
    o.sent_at <= at + 0.1 && o.sent_at + o.e2e >= at
}

fn failed(outcomes: &[Outcome]) -> Vec<&Outcome> {
    outcomes.iter().filter(|o| !o.ok()).collect()
}

fn options(name: &str) -> StackOptions {
    StackOptions { name: format!("fault-{name}"), ..Default::default() }
}

/// Whether a request through the gateway is routed by kvgate (not failing open).
fn routed_by_kvgate(stack: &Stack) -> bool {
    let reply = post(&stack.gateway("/v1/chat/completions"), chat("probe", "ping").to_string(), &[]);
    reply.is_ok_and(|r| r.status == 200 && !matches!(r.header("x-kvgate-routed-to"), "" | "fallback"))
}

/// The sidecar's replicas in `/debug/state`.
fn replicas(stack: &Stack) -> Vec<Value> {
    let state = stack.sidecar_state().unwrap_or_default();
    state["pools"][0]["replicas"].as_array().cloned().unwrap_or_default()
}

/// A counter of the sidecar's `/metrics`, summed over label sets.
fn sidecar_metric(stack: &Stack, name: &str) -> f64 {
    let text = client::client().get(stack.sidecar_url("/metrics")).send().and_then(|r| r.text()).unwrap_or_default();
    let prefix = format!("{name}{{");
    text.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

fn chaos(stack: &Stack, id: &str, body: Value) -> anyhow::Result<()> {
    let reply = post(&stack.sim(id).url("/_chaos/events"), body.to_string(), &[])?;
    anyhow::ensure!(reply.status == 200, "chaos on {id}: {}", reply.body);
    Ok(())
}

/// Kill the sidecar under load, start it again.
pub fn sidecar_killed(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let mut stack = Stack::start(&options("sidecar"), artifacts)?;
    let load = Load::start(&stack)?;
    run_for(Duration::from_secs(2));
    stack.kill_sidecar();
    run_for(Duration::from_secs(3));
    let restarted = Instant::now();
    stack.restart_sidecar()?;
    let restored = wait_for("kvgate routing again", Duration::from_secs(20), || {
        routed_by_kvgate(&stack).then(|| restarted.elapsed())
    })?;
    run_for(Duration::from_secs(3));
    let outcomes = load.finish();
    let failures = failed(&outcomes).len();
    let indexed: u64 = replicas(&stack).iter().filter_map(|r| r["blocks_indexed"].as_u64()).sum();
    let not_asked = stack.filter_stat("kvgate.requests_total", &[("outcome", "breaker_open")])?;
    // The dead sidecar's calls fail at once, so the filter's circuit breaker opens; each
    // failed probe doubles its window (1 s, 2 s, 4 s: in a 3 s outage it reaches 4 s), and
    // routing comes back at the first probe after the restart.
    let bound = Duration::from_secs(2 + 4);
    Ok(Row {
        scenario: "kill the sidecar, restart it",
        expected: "0 failed requests (fail open; after 5 failed calls the filter's circuit breaker stops asking the sidecar); routing restored at the breaker's first probe after the restart, within its window (4 s after a 3 s outage) + 2 s; the index rebuilt from replay and live events",
        measured: format!(
            "{} requests, {failures} failed, {not_asked} not asked while the breaker was open; routed by kvgate {:.2} s after the restart; {indexed} blocks indexed again",
            outcomes.len(),
            restored.as_secs_f64()
        ),
        pass: failures == 0 && restored <= bound && indexed > 0,
    })
}

/// Restart one engine (a new process on the same ports: empty cache, event seq from 0).
pub fn engine_restarted(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let mut stack = Stack::start(&options("restart"), artifacts)?;
    let load = Load::start(&stack)?;
    // A prefix only b holds.
    let doc = document(900, 600);
    let warm = post(&stack.sim("b").url("/v1/chat/completions"), chat(&doc, "warm").to_string(), &[])?;
    anyhow::ensure!(warm.status == 200, "warming b: {}", warm.body);
    let blocks = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0) / 16;
    stack.wait_indexed("b", blocks)?;
    run_for(Duration::from_secs(1));
    let killed_at = load.elapsed();
    stack.restart_sim("b")?;
    // The next decision for that prefix: nobody holds it any more.
    let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, "after the restart"))?;
    let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap_or(u64::MAX);
    run_for(Duration::from_secs(2));
    let outcomes = load.finish();
    let failures = failed(&outcomes);
    let by_b = failures.iter().filter(|o| o.replica == "b" || in_flight_at(o, killed_at)).count();
    let others = failures.len() - by_b;
    Ok(Row {
        scenario: "restart one engine (seq back to 0, empty cache)",
        expected: "its blocks earn no credit from the moment it goes down; the next request for a prefix it lost is not credited there; no client errors beyond its own in-flight requests",
        measured: format!(
            "prefix of {blocks} blocks asked again after the restart: routed to {}, {overlap} blocks credited; {} requests, {by_b} cut on b, {others} other failures",
            reply.header("x-kvgate-routed-to"),
            outcomes.len()
        ),
        pass: overlap == 0 && reply.status == 200 && others == 0,
    })
}

/// Runs a stack whose engines drop 5 % of their event messages under 6 s of load.
fn with_dropped_events(opts: &StackOptions, artifacts: &Artifacts) -> anyhow::Result<(Stack, Vec<Outcome>)> {
    let stack = Stack::start(opts, artifacts)?;
    for sim in &stack.sims {
        chaos(&stack, &sim.id, json!({"drop_fraction": 0.05}))?;
    }
    let load = Load::start(&stack)?;
    run_for(Duration::from_secs(6));
    let outcomes = load.finish();
    Ok((stack, outcomes))
}

/// Drop 5 % of event messages, with replay.
pub fn events_dropped_with_replay(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let (stack, outcomes) = with_dropped_events(&options("drops"), artifacts)?;
    let failures = failed(&outcomes).len();
    let replayed = sidecar_metric(&stack, "kvgate_kv_gaps_replayed_total");
    let lost = sidecar_metric(&stack, "kvgate_kv_gaps_lost_total");
    let degraded = replicas(&stack).iter().filter(|r| r["degraded"] == true).count();
    Ok(Row {
        scenario: "drop 5 % of event messages (replay on)",
        expected: "replay closes every gap; no replica degraded; 0 failed requests",
        measured: format!(
            "{replayed} gaps replayed, {lost} lost, {degraded} replicas degraded; {} requests, {failures} failed",
            outcomes.len()
        ),
        pass: replayed > 0.0 && lost == 0.0 && degraded == 0 && failures == 0,
    })
}

/// Drop 5 % of event messages, without replay.
pub fn events_dropped_without_replay(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let opts = StackOptions { replay: false, ..options("drops-noreplay") };
    let (stack, outcomes) = with_dropped_events(&opts, artifacts)?;
    let failures = failed(&outcomes).len();
    let lost = sidecar_metric(&stack, "kvgate_kv_gaps_lost_total");
    let degraded = replicas(&stack).iter().filter(|r| r["degraded"] == true).count();
    let flagged = sidecar_metric(&stack, "kvgate_replica_degraded");
    Ok(Row {
        scenario: "drop 5 % of event messages (replay off)",
        expected: "the replicas that lost events show as degraded (metric and /debug/state) and their blocks from before the loss earn no credit; 0 failed requests",
        measured: format!(
            "{lost} gaps lost, {degraded} replicas degraded (metric: {flagged}); {} requests, {failures} failed",
            outcomes.len()
        ),
        pass: lost > 0.0 && degraded > 0 && flagged > 0.0 && failures == 0,
    })
}

/// The publisher of one engine goes silent while the engine keeps serving.
pub fn publisher_stalled(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let opts = StackOptions { sidecar_toml: "stall_timeout_secs = 1".into(), ..options("stall") };
    let stack = Stack::start(&opts, artifacts)?;
    chaos(&stack, "b", json!({"stall": true}))?;
    // Mostly new documents: every replica, b included, keeps being sent prompts that must
    // store blocks (with six shared documents b could end up holding none of them).
    let load = Load::start_with(&stack, RATE, 400)?;
    let flagged = wait_for("b flagged stalled", Duration::from_secs(15), || {
        replicas(&stack).iter().any(|r| r["id"] == "b" && r["stalled"] == true).then_some(())
    });
    run_for(Duration::from_secs(2));
    let outcomes = load.finish();
    let failures = failed(&outcomes).len();
    let routed = outcomes.iter().filter(|o| !matches!(o.routed_to.as_str(), "" | "fallback")).count();
    Ok(Row {
        scenario: "one engine's publisher stalls, the engine keeps serving",
        expected: "the replica is flagged stalled and earns no cache credit; kvgate keeps routing (on load for it); 0 failed requests",
        measured: format!(
            "b flagged stalled: {}; {} requests, {failures} failed, {routed} routed by kvgate",
            flagged.is_ok(),
            outcomes.len()
        ),
        pass: flagged.is_ok() && failures == 0 && routed == outcomes.len(),
    })
}

/// One engine dies under load and stays dead.
pub fn engine_died(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let mut stack = Stack::start(&options("died"), artifacts)?;
    let load = Load::start(&stack)?;
    run_for(Duration::from_secs(2));
    let died_at = load.elapsed();
    stack.kill_sim("c");
    run_for(Duration::from_secs(6));
    let outcomes = load.finish();
    let failures = failed(&outcomes);
    let cut = failures.iter().filter(|o| o.replica == "c" || in_flight_at(o, died_at)).count();
    let others = failures.len() - cut;
    let late_on_c = outcomes.iter().filter(|o| o.replica == "c" && o.sent_at > died_at + 0.1).count();
    Ok(Row {
        scenario: "one engine dies",
        expected: "Envoy's health checks and outlier detection take it out, and a request sent to it before then is retried on another engine (nothing reached it); 0 client errors beyond the requests under way when it died",
        measured: format!(
            "{} requests: {cut} failed that were under way when it died, {others} other failures, {late_on_c} served by it after its death",
            outcomes.len()
        ),
        pass: others == 0,
    })
}

/// The sidecar answers 100 ms late (a proxy delays every request to it).
pub fn sidecar_slow(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let opts = StackOptions { sidecar_delay_ms: 100, route_timeout_ms: 25, ..options("slow") };
    let stack = Stack::start(&opts, artifacts)?;
    let load = Load::start(&stack)?;
    run_for(Duration::from_secs(5));
    let outcomes = load.finish();
    let failures = failed(&outcomes).len();
    let decided: Vec<u64> = outcomes.iter().filter_map(|o| o.decision_us).collect();
    let slowest = decided.iter().copied().max().unwrap_or(u64::MAX);
    let fell_back = outcomes.iter().filter(|o| o.routed_to == "fallback").count();
    let not_asked = stack.filter_stat("kvgate.requests_total", &[("outcome", "breaker_open")])?;
    // The filter's timer fires on Envoy's clock: allow a few ms of dispatch slack.
    let bound_us = 25_000 + 15_000;
    Ok(Row {
        scenario: "the sidecar answers 100 ms late",
        expected: "the filter gives up after its route_timeout_ms (25 ms) and Envoy's balancing routes the request; after 5 in a row its circuit breaker stops asking the sidecar (one probe per window); latency is bounded; 0 failed requests",
        measured: format!(
            "{} requests, {failures} failed, {fell_back} fell back ({not_asked} not asked, the breaker open); slowest routing decision {:.1} ms",
            outcomes.len(),
            slowest as f64 / 1000.0
        ),
        pass: failures == 0 && fell_back == outcomes.len() && !decided.is_empty() && slowest <= bound_us,
    })
}

/// Hot-restart Envoy (how a changed static config is applied) under load.
pub fn envoy_hot_restarted(artifacts: &Artifacts) -> anyhow::Result<Row> {
    let opts = StackOptions { hot_restart: true, ..options("hot-restart") };
    let mut stack = Stack::start(&opts, artifacts)?;
    let load = Load::start(&stack)?;
    run_for(Duration::from_secs(2));
    let restarted = Instant::now();
    stack.hot_restart_envoy()?;
    stack.wait_retired_envoys(Duration::from_secs(20))?;
    let drained = restarted.elapsed();
    // Only the new Envoy is left: its filter loaded the tokenizer again.
    let reloaded = wait_for("the tokenizer in the new Envoy", Duration::from_secs(20), || {
        let reply = post(&stack.gateway("/v1/chat/completions"), chat("probe", "ping").to_string(), &[]).ok()?;
        (reply.status == 200 && !reply.header("x-kvgate-prompt-tokens").is_empty()).then(|| restarted.elapsed())
    });
    run_for(Duration::from_secs(1));
    let outcomes = load.finish();
    let failures = failed(&outcomes).len();
    Ok(Row {
        scenario: "Envoy hot restart (a config reload)",
        expected: "the new Envoy's filter loads its tokenizer from the sidecar again; 0 failed requests while the old one drains",
        measured: format!(
            "old Envoy drained and exited {:.1} s after the restart; tokenizer loaded in the new one: {}; {} requests, {failures} failed",
            drained.as_secs_f64(),
            reloaded.as_ref().map_or("no".to_owned(), |t| format!("yes, {:.1} s after the restart", t.as_secs_f64())),
            outcomes.len()
        ),
        pass: reloaded.is_ok() && failures == 0,
    })
}
