//! Predictions under concurrent load, against real vLLM: clients send through Envoy at once,
//! and every request routed is either checked against what its engine reported — and the
//! check classed by the sidecar (`kvgate_predictions_total{reason}`: exact, in_flight, evicted,
//! cached_since, over, under) — or counted unchecked with its reason
//! (`kvgate_predictions_unchecked_total{reason}`). A request the sidecar neither checked nor
//! counted is "lost". The gateway's outcomes for requests it did not have the sidecar route
//! (`kvgate.requests_total{outcome}` in Envoy: the answer came late, …) and the engines' own
//! preemption counters are read beside.

use std::collections::BTreeMap;
use std::sync::Barrier;
use std::time::Duration;

use serde_json::{json, Value};

use crate::client::{self, post};
use crate::faults::Row;
use crate::process::wait_for;
use crate::stack::metric_sum;
use crate::workload::document;
use crate::Stack;

/// The classes a checked prediction can fall in, as the sidecar labels them.
pub const CLASSES: [&str; 6] = ["exact", "in_flight", "evicted", "cached_since", "over", "under"];
/// Why a routed request was not checked, as the sidecar labels it.
pub const UNCHECKED: [&str; 5] = ["no_cached_tokens", "no_usage", "moved", "estimated", "several_sequences"];
/// The filter's outcomes for a request it did not have the sidecar route, as Envoy labels them.
pub const NOT_ROUTED: [&str; 5] = ["passthrough", "fallback_timeout", "fallback_error", "shed", "breaker_open"];

/// What the clients of a case send.
#[derive(Debug, Clone, Copy)]
pub enum Traffic {
    /// Each client sends `per_client` chats one after another, over `prefixes` shared
    /// ~700-token system prompts in turn.
    Shared {
        /// Distinct shared prefixes.
        prefixes: u32,
        /// Requests per client.
        per_client: usize,
    },
    /// Every client sends one chat with the same new ~700-token prefix, all released at once,
    /// so they reach the engines within a scheduler step or two.
    Burst,
    /// Each client holds a conversation of `turns` turns over a shared prefix: every turn
    /// sends the whole history, with the engine's earlier answers.
    Conversation {
        /// Turns per conversation.
        turns: usize,
    },
}

/// One case of the load check.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// Its name in the report.
    pub name: &'static str,
    /// Concurrent clients.
    pub clients: usize,
    /// What they send.
    pub traffic: Traffic,
    /// Seeds its documents, so no two cases share a prefix.
    pub seed: u32,
    /// Each request's `max_tokens` (the engine's answer is random text).
    pub max_tokens: u32,
    /// Whether its checks count towards the share that must be exact (not where evictions
    /// are the point); in every case each miss must be explained.
    pub exact: bool,
}

/// What the sidecar and the engines counted for one case.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// Requests sent through the gateway.
    pub sent: u64,
    /// Of those, answered with something other than 200.
    pub failed: u64,
    /// Checked predictions by class.
    pub classes: BTreeMap<&'static str, u64>,
    /// Unchecked requests by reason.
    pub unchecked: BTreeMap<&'static str, u64>,
    /// Requests the gateway did not route, by the filter's outcome.
    pub not_routed: BTreeMap<&'static str, u64>,
    /// Prompts the engine counted differently from kvgate.
    pub prompt_mismatches: u64,
    /// Preemptions the engines reported meanwhile.
    pub preemptions: u64,
}

impl Tally {
    /// Checked predictions.
    pub fn checked(&self) -> u64 {
        self.classes.values().sum()
    }

    /// Requests neither checked nor counted unchecked. (A request whose answer came too late
    /// for the gateway is still booked by the sidecar, and counted by it.)
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.checked() + self.unchecked.values().sum::<u64>())
    }

    /// Checks whose miss no reason explains.
    pub fn unexplained(&self) -> u64 {
        self.classes.get("over").copied().unwrap_or(0) + self.classes.get("under").copied().unwrap_or(0)
    }

    /// The share of checks that were exact (1 with none).
    pub fn exact_share(&self) -> f64 {
        match self.checked() {
            0 => 1.0,
            n => self.classes.get("exact").copied().unwrap_or(0) as f64 / n as f64,
        }
    }

    /// Every request checked or counted with its reason, every miss explained, no prompt
    /// counted differently.
    pub fn accounted(&self) -> bool {
        self.lost() + self.unexplained() + self.prompt_mismatches == 0
    }

    /// This tally and `other` together.
    pub fn add(&mut self, other: &Tally) {
        self.sent += other.sent;
        self.failed += other.failed;
        let merge = |into: &mut BTreeMap<&'static str, u64>, from: &BTreeMap<&'static str, u64>| {
            for (k, v) in from {
                *into.entry(k).or_default() += v;
            }
        };
        merge(&mut self.classes, &other.classes);
        merge(&mut self.unchecked, &other.unchecked);
        merge(&mut self.not_routed, &other.not_routed);
        self.prompt_mismatches += other.prompt_mismatches;
        self.preemptions += other.preemptions;
    }

    fn counts(map: &BTreeMap<&'static str, u64>) -> String {
        let parts: Vec<String> = map.iter().filter(|(_, n)| **n > 0).map(|(k, n)| format!("{k} {n}")).collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }

    /// One line for the report.
    pub fn summary(&self) -> String {
        format!(
            "{} sent ({} failed): {} checked, {:.1} % exact ({}); unchecked: {}; not routed: {}; lost {}; {} \
             prompt-token mismatches; {} preemptions in the engines",
            self.sent,
            self.failed,
            self.checked(),
            100.0 * self.exact_share(),
            Self::counts(&self.classes),
            Self::counts(&self.unchecked),
            Self::counts(&self.not_routed),
            self.lost(),
            self.prompt_mismatches,
            self.preemptions
        )
    }
}

/// The counters a tally is the difference of.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counters {
    classes: BTreeMap<&'static str, u64>,
    unchecked: BTreeMap<&'static str, u64>,
    not_routed: BTreeMap<&'static str, u64>,
    mismatches: u64,
    preemptions: u64,
}

impl Counters {
    /// What was counted between `before` and `self`, for `sent` requests of which `failed`
    /// failed.
    fn since(&self, before: &Counters, sent: u64, failed: u64) -> Tally {
        let delta = |after: &BTreeMap<&'static str, u64>, before: &BTreeMap<&'static str, u64>| {
            after.iter().map(|(k, v)| (*k, v - before.get(k).copied().unwrap_or(0))).collect()
        };
        Tally {
            sent,
            failed,
            classes: delta(&self.classes, &before.classes),
            unchecked: delta(&self.unchecked, &before.unchecked),
            not_routed: delta(&self.not_routed, &before.not_routed),
            prompt_mismatches: self.mismatches - before.mismatches,
            preemptions: self.preemptions - before.preemptions,
        }
    }
}

fn counters(stack: &Stack) -> anyhow::Result<Counters> {
    let text = stack.sidecar_metrics()?;
    let by = |metric: &str, reason: &str| metric_sum(&text, metric, &format!("reason=\"{reason}\"")) as u64;
    let mut preemptions = 0;
    for engine in &stack.sims {
        let metrics = client::client().get(engine.url("/metrics")).send()?.text()?;
        preemptions += metric_sum(&metrics, "vllm:num_preemptions_total", "") as u64;
    }
    Ok(Counters {
        classes: CLASSES.iter().map(|c| (*c, by("kvgate_predictions_total", c))).collect(),
        unchecked: UNCHECKED.iter().map(|r| (*r, by("kvgate_predictions_unchecked_total", r))).collect(),
        not_routed: NOT_ROUTED
            .iter()
            .map(|o| Ok((*o, stack.filter_stat_total("kvgate.requests_total", &[("outcome", o)])?)))
            .collect::<anyhow::Result<_>>()?,
        mismatches: metric_sum(&text, "kvgate_prompt_token_mismatches_total", "") as u64,
        preemptions,
    })
}

/// The counters once the previous check's reports have landed: unchanged over three of the
/// filter's report batches (200 ms each in the test stack).
pub fn settled(stack: &Stack) -> anyhow::Result<Counters> {
    let mut last = counters(stack)?;
    wait_for("the previous check's reports to land", Duration::from_secs(15), || {
        std::thread::sleep(Duration::from_millis(600));
        let now = counters(stack).ok()?;
        (now == last).then(|| now.clone()).or_else(|| {
            last = now;
            None
        })
    })
}

/// A chat whose answer is exactly `max_tokens` long (`ignore_eos`, vLLM's extension): a random
/// model could otherwise stop at once, and a case sized to need decode blocks would not.
fn chat(model: &str, messages: Value, max_tokens: u32) -> Value {
    json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true, "messages": messages})
}

/// Sends one body through the gateway; returns the reply's text content (empty if it failed)
/// and whether it succeeded.
fn send(stack: &Stack, body: &Value) -> (String, bool) {
    match post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[]) {
        Ok(reply) if reply.status == 200 => {
            let content = reply.json()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned();
            (content, true)
        }
        _ => (String::new(), false),
    }
}

/// One client's requests; returns (sent, failed).
fn client_run(stack: &Stack, model: &str, case: &Case, i: usize, barrier: &Barrier) -> (u64, u64) {
    let (mut sent, mut failed) = (0, 0);
    let mut tally = |ok: bool| {
        sent += 1;
        failed += u64::from(!ok);
    };
    let question = |j: usize| format!("Client {i} asks question {j}: {}", document(case.seed + 1000 + i as u32, 6 + j));
    match case.traffic {
        Traffic::Shared { prefixes, per_client } => {
            for j in 0..per_client {
                let doc = document(case.seed + (i + j) as u32 % prefixes, 700);
                let body = chat(
                    model,
                    json!([{"role": "system", "content": doc}, {"role": "user", "content": question(j)}]),
                    4,
                );
                tally(send(stack, &body).1);
            }
        }
        Traffic::Burst => {
            let body = chat(
                model,
                json!([{"role": "system", "content": document(case.seed, 700)}, {"role": "user", "content": question(0)}]),
                case.max_tokens,
            );
            barrier.wait();
            tally(send(stack, &body).1);
        }
        Traffic::Conversation { turns } => {
            let mut messages = vec![json!({"role": "system", "content": document(case.seed + i as u32 % 4, 300)})];
            for t in 0..turns {
                messages.push(json!({"role": "user", "content": question(t)}));
                let (answer, ok) = send(stack, &chat(model, Value::Array(messages.clone()), case.max_tokens));
                tally(ok);
                messages.push(json!({"role": "assistant", "content": answer}));
            }
        }
    }
    (sent, failed)
}

/// Runs one case through the gateway and returns what was counted for it.
pub fn run_case(stack: &Stack, case: &Case) -> anyhow::Result<Tally> {
    let before = settled(stack)?;
    let barrier = &Barrier::new(case.clients);
    let model = stack.model.as_str();
    let results: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..case.clients).map(|i| s.spawn(move || client_run(stack, model, case, i, barrier))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or((0, 0))).collect()
    });
    let (sent, failed) = results.iter().fold((0, 0), |(s, f), (a, b)| (s + a, f + b));
    tally_since(stack, &before, sent, failed, Duration::from_secs(30))
}

/// What was counted for the `sent` requests since `before` (counters at their start), once
/// every one of them is counted somewhere or `timeout` has passed: the filter reports usage
/// and ends in batches from its root context.
pub fn tally_since(
    stack: &Stack,
    before: &Counters,
    sent: u64,
    failed: u64,
    timeout: Duration,
) -> anyhow::Result<Tally> {
    let settled = wait_for("every request checked or counted", timeout, || {
        counters(stack).ok().map(|c| c.since(before, sent, failed)).filter(|t| t.lost() == 0)
    });
    Ok(match settled {
        Ok(t) => t,
        Err(_) => counters(stack)?.since(before, sent, failed),
    })
}

/// Runs `case` and makes its report row.
pub fn check(stack: &Stack, case: &Case) -> anyhow::Result<(Row, Tally)> {
    let tally = run_case(stack, case)?;
    eprintln!("{}: {}", case.name, tally.summary());
    let pass = tally.failed == 0 && tally.accounted();
    let expected = if case.exact { EXPECT_EXACT } else { EXPECT_EXPLAINED };
    Ok((Row { scenario: case.name, expected, measured: tally.summary(), pass }, tally))
}

/// The share of the load cases' checks that must be exact, together.
pub const MIN_EXACT: f64 = 0.95;

/// The load cases that must be mostly exact, together: their share of exact checks. The
/// target is 99 %. A miss the engines' timing explains depends on how the host schedules the
/// processes — two requests booked on one replica for one new prefix reach the engine in the
/// other order (one counted in flight, the other cached since), or the index is a few events
/// behind — and one such pair in a case of 16 checks is already 87.5 %; so each case fails on
/// any unexplained miss, and the cases together below [`MIN_EXACT`].
pub fn together(name: &'static str, tallies: &[Tally]) -> Row {
    let mut all = Tally::default();
    for t in tallies {
        all.add(t);
    }
    let measured = format!(
        "{} checked, {:.1} % exact ({})",
        all.checked(),
        100.0 * all.exact_share(),
        Tally::counts(&all.classes)
    );
    Row { scenario: name, expected: EXPECT_TOGETHER, measured, pass: all.exact_share() >= MIN_EXACT }
}

/// What each case that must be mostly exact expects.
const EXPECT_EXACT: &str = "every miss explained (in flight, cached since, evicted since); every request checked or \
                            counted with its reason; no prompt counted differently; its exact share counted in 2g";
/// What the cases together expect.
const EXPECT_TOGETHER: &str = "target ≥ 99 % of the checks exact (fails below 95 %)";
/// What a case under eviction expects.
const EXPECT_EXPLAINED: &str = "every miss explained (evicted since, in flight, cached since); every request checked \
                                or counted with its reason; no prompt counted differently";
