//! The load generator: open-loop arrivals, or closed-loop conversations, over streaming SSE.
//!
//! Times are **simulated**: the engines run `speedup`× faster than the wall clock, so a plan's
//! offsets are divided by `speedup` before sleeping, and engine-side durations are multiplied
//! back. What happens before the engine answers (Envoy, the kvgate filter, the sidecar) is real
//! wall time and is not scaled: a response's headers arrive when the engine has accepted the
//! request, so for a request sent at 0 with headers at `h` and its first token at `f`,
//! `TTFT = h + (f − h) × speedup`. The same holds for inter-token and end-to-end latency.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::time::Instant;

use kvgate_shared::wire::SESSION_HEADER;

use super::agentic::{AgentSession, Step, StepKind};
use crate::workload::document;

/// The header a request names its priority class in (the flow-control policy's
/// `priority_header`).
pub const PRIORITY_HEADER: &str = "x-kvgate-priority";
/// The header a request names its tenant in (the flow-control policy's `tenant_header`).
pub const TENANT_HEADER: &str = "x-kvgate-tenant";

/// Who a request is from, for admission control: sent as [`PRIORITY_HEADER`] and
/// [`TENANT_HEADER`], and reported per value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Tags {
    /// Priority class.
    pub priority: Option<&'static str>,
    /// Tenant.
    pub tenant: Option<&'static str>,
}

/// [`Tags`] as read back from a finished cell ([`super::cells`]).
#[derive(Deserialize)]
struct TagNames {
    priority: Option<String>,
    tenant: Option<String>,
}

impl<'de> Deserialize<'de> for Tags {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Tags, D::Error> {
        let names = TagNames::deserialize(d)?;
        Ok(Tags { priority: names.priority.map(interned), tenant: names.tenant.map(interned) })
    }
}

/// `name`, kept once for the life of the process whatever the times it is read, as the
/// names a [`super::workloads::Mix`] tags with are.
fn interned(name: String) -> &'static str {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&known) = names.iter().find(|n| **n == name) {
        return known;
    }
    let name: &'static str = Box::leak(name.into_boxed_str());
    names.push(name);
    name
}

/// One request to send at a planned time.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Simulated offset from the start of the run.
    pub at: Duration,
    /// Path on the gateway (`/v1/chat/completions` or `/v1/completions`).
    pub path: &'static str,
    /// The body (streaming is switched on by the sender).
    pub body: Value,
    /// Its class and tenant, if the run mixes them.
    pub tags: Tags,
}

/// A conversation: its turns go one after another, each with the history so far.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Simulated offset of the first turn.
    pub start: Duration,
    /// The shared system prompt.
    pub system: String,
    /// The user's questions, one per round.
    pub questions: Vec<String>,
    /// Simulated pause between an answer and the next question.
    pub think: Duration,
    /// `max_tokens` of each answer.
    pub max_tokens: u32,
}

/// What happened to one request. Latencies are in simulated seconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Outcome {
    /// Which request of the workload it was, the same under every policy: its position in an
    /// open-loop plan (`"17"`), or a conversation's user and turn (`"u3.t2"`).
    pub request: String,
    /// HTTP status (0: no response).
    pub status: u16,
    /// The engine that served it (`x-kvgate-replica`).
    pub replica: String,
    /// Where kvgate routed it (`x-kvgate-routed-to` when the filter's debug headers are on:
    /// a replica id, or "fallback" when Envoy's own balancing chose).
    pub routed_to: String,
    /// How long the filter's routing decision took, µs (`x-kvgate-decision-us`).
    pub decision_us: Option<u64>,
    /// The part of it spent rendering and tokenizing the prompt, µs (`x-kvgate-tokenize-us`).
    pub tokenize_us: Option<u64>,
    /// When it was sent, from the start of the run.
    pub sent_at: f64,
    /// Time to first token.
    pub ttft: Option<f64>,
    /// Mean inter-token latency.
    pub itl_mean: Option<f64>,
    /// End to end.
    pub e2e: f64,
    /// Output tokens received.
    pub output_tokens: u64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Transport or protocol error.
    pub error: Option<String>,
    /// The class and tenant it was sent as.
    pub tags: Tags,
    /// The key kvgate booked it under (`x-kvgate-booking-id`): what joins it to its decision.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub booking: String,
    /// The TTFT and mean ITL kvgate predicted for it on the replica it chose, in simulated
    /// seconds (kvgate's prediction times the speedup): `None` when kvgate did not route it
    /// or its replica's model did not predict yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_ttft: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_itl: Option<f64>,
    /// What kvgate's TTFT and ITL models were given for it there (its `/debug/explain`'s
    /// `ttft_inputs` and `itl_inputs`, in tokens and sequences): why a prediction missed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_inputs: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub itl_inputs: Option<Value>,
    /// The generated text (for conversation history; not written out).
    #[serde(skip)]
    pub text: String,
    /// The request's path and body, kept for what the run computes from its prompts
    /// afterwards (the cache ceiling, the replayed placements; not written out). `None` in
    /// outcomes not built by [`Target::send`].
    #[serde(skip)]
    pub body: Option<(String, Value)>,
}

impl Outcome {
    /// A successful, complete response.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.ttft.is_some()
    }
}

#[cfg(test)]
impl Outcome {
    /// A request served by `replica` in `ttft` (10 output tokens, 2 s end to end), for tests.
    pub(crate) fn served(request: &str, replica: &str, ttft: f64) -> Outcome {
        Outcome {
            request: request.into(),
            status: 200,
            replica: replica.into(),
            routed_to: replica.into(),
            decision_us: None,
            tokenize_us: None,
            sent_at: 0.0,
            ttft: Some(ttft),
            itl_mean: Some(0.01),
            e2e: 2.0,
            output_tokens: 10,
            prompt_tokens: 0,
            cached_tokens: 0,
            error: None,
            tags: Tags::default(),
            booking: String::new(),
            predicted_ttft: None,
            predicted_itl: None,
            ttft_inputs: None,
            itl_inputs: None,
            text: String::new(),
            body: None,
        }
    }
}

/// The tenant of requests sent straight to the engines ([`Target::with_engines`]).
pub const OUTSIDE: &str = "outside";

/// How the generator reaches the gateways.
#[derive(Clone)]
pub struct Target {
    client: reqwest::Client,
    bases: Arc<[String]>,
    /// The engines; requests of tenant [`OUTSIDE`] go to the first: traffic the routers do
    /// not see, all on one engine (a batch job or a client pinned to one pod).
    engines: Arc<[String]>,
    /// Requests sent so far: each goes to a gateway picked by a hash of its number.
    sent: Arc<AtomicU64>,
    speedup: f64,
    start: Instant,
    timeout: Duration,
}

impl Target {
    /// A target at `base` (`http://127.0.0.1:port`), with the engines' speedup. Only loopback
    /// addresses are accepted: the benchmark never sends traffic off the machine.
    pub fn new(base: &str, speedup: f64, timeout: Duration) -> anyhow::Result<Target> {
        Target::spread(&[base.to_owned()], speedup, timeout)
    }

    /// A target spread over several gateways as an L4 balancer would: each request (each turn
    /// of a conversation too) goes to one of `bases` at random, nothing pinned.
    pub fn spread(bases: &[String], speedup: f64, timeout: Duration) -> anyhow::Result<Target> {
        anyhow::ensure!(!bases.is_empty(), "no gateway to send to");
        for base in bases {
            anyhow::ensure!(
                base.starts_with("http://127.0.0.1:") || base.starts_with("http://localhost:"),
                "the load generator only targets loopback, not {base}"
            );
        }
        let client = reqwest::Client::builder().pool_max_idle_per_host(1024).tcp_nodelay(true).build()?;
        Ok(Target {
            client,
            bases: bases.into(),
            engines: Arc::new([]),
            sent: Arc::default(),
            speedup,
            start: Instant::now(),
            timeout,
        })
    }

    /// Sends requests of tenant [`OUTSIDE`] to the first of `engines` (loopback only), around
    /// every gateway; without engines they go through the gateways like the rest.
    pub fn with_engines(mut self, engines: &[String]) -> anyhow::Result<Target> {
        for base in engines {
            anyhow::ensure!(
                base.starts_with("http://127.0.0.1:"),
                "the load generator only targets loopback, not {base}"
            );
        }
        self.engines = engines.into();
        Ok(self)
    }

    /// The gateway the next request goes to: uniform over the bases (splitmix64 of how many
    /// were sent before it), the same sequence of gateways every run, in the order requests
    /// are sent.
    fn next_base(&self) -> &str {
        let n = self.sent.fetch_add(1, Ordering::Relaxed);
        let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        &self.bases[(z % self.bases.len() as u64) as usize]
    }

    fn wall(&self, simulated: Duration) -> Instant {
        self.start + simulated.div_f64(self.speedup)
    }

    /// Sends one request and reads its stream to the end.
    pub async fn send(&self, path: &str, body: Value, tags: Tags) -> Outcome {
        self.send_in_session(path, body, tags, None).await
    }

    /// [`Target::send`], with the request's session id in [`SESSION_HEADER`].
    pub async fn send_in_session(&self, path: &str, mut body: Value, tags: Tags, session: Option<&str>) -> Outcome {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let sent = Instant::now();
        let mut outcome = Outcome {
            request: String::new(),
            status: 0,
            replica: String::new(),
            routed_to: String::new(),
            decision_us: None,
            tokenize_us: None,
            sent_at: (sent - self.start).as_secs_f64() * self.speedup,
            ttft: None,
            itl_mean: None,
            e2e: 0.0,
            output_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            error: None,
            tags,
            booking: String::new(),
            predicted_ttft: None,
            predicted_itl: None,
            ttft_inputs: None,
            itl_inputs: None,
            text: String::new(),
            body: None,
        };
        let streamed = self.stream(path, &body, (tags, session), sent, &mut outcome);
        match tokio::time::timeout(self.timeout, streamed).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => outcome.error = Some(e.to_string()),
            Err(_) => outcome.error = Some(format!("timed out after {:?}", self.timeout)),
        }
        outcome.body = Some((path.to_owned(), body));
        outcome
    }

    async fn stream(
        &self,
        path: &str,
        body: &Value,
        (tags, session): (Tags, Option<&str>),
        sent: Instant,
        o: &mut Outcome,
    ) -> anyhow::Result<()> {
        let base = match tags.tenant {
            Some(OUTSIDE) if !self.engines.is_empty() => &self.engines[0],
            _ => self.next_base(),
        };
        let mut request = self.client.post(format!("{base}{path}")).json(body);
        if let Some(class) = tags.priority {
            request = request.header(PRIORITY_HEADER, class);
        }
        if let Some(tenant) = tags.tenant {
            request = request.header(TENANT_HEADER, tenant);
        }
        if let Some(session) = session {
            request = request.header(SESSION_HEADER, session);
        }
        let response = request.send().await?;
        let headers_at = sent.elapsed().as_secs_f64();
        let scale = |t: f64| headers_at + (t - headers_at) * self.speedup;
        o.status = response.status().as_u16();
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        o.replica = header("x-kvgate-replica");
        o.routed_to = header("x-kvgate-routed-to");
        o.decision_us = header("x-kvgate-decision-us").parse().ok();
        o.tokenize_us = header("x-kvgate-tokenize-us").parse().ok();
        o.booking = header("x-kvgate-booking-id");
        if o.status != 200 {
            o.e2e = scale(sent.elapsed().as_secs_f64());
            return Ok(());
        }
        let mut buf = Vec::new();
        let mut token_times = Vec::new();
        let mut chunks = response.bytes_stream();
        while let Some(chunk) = chunks.next().await {
            buf.extend_from_slice(&chunk?);
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                let line = String::from_utf8_lossy(&event);
                let Some(data) = line.trim().strip_prefix("data: ") else { continue };
                if data == "[DONE]" {
                    continue;
                }
                let v: Value = serde_json::from_str(data)?;
                if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
                    o.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                    o.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                }
                let Some(choice) = v["choices"].get(0) else { continue };
                if choice["delta"].get("role").is_some() {
                    continue; // the chat stream's opening chunk carries no token
                }
                let piece = choice["delta"]["content"].as_str().or_else(|| choice["text"].as_str()).unwrap_or("");
                o.text.push_str(piece);
                token_times.push(sent.elapsed().as_secs_f64());
            }
        }
        o.e2e = scale(sent.elapsed().as_secs_f64());
        o.output_tokens = token_times.len() as u64;
        if let Some(first) = token_times.first() {
            o.ttft = Some(scale(*first));
        }
        if let [first, .., last] = token_times[..] {
            o.itl_mean = Some((last - first) * self.speedup / (token_times.len() - 1) as f64);
        }
        Ok(())
    }

    /// Fires every planned request at its time, whatever the system's state (open loop), and
    /// stops starting new ones after `duration` (simulated). Waits for all to finish.
    pub async fn open_loop(&self, plan: Vec<Planned>, duration: Duration) -> Vec<Outcome> {
        let mut running = Vec::new();
        for (i, p) in plan.into_iter().take_while(|p| p.at <= duration).enumerate() {
            tokio::time::sleep_until(self.wall(p.at)).await;
            let target = self.clone();
            running.push(tokio::spawn(async move {
                Outcome { request: i.to_string(), ..target.send(p.path, p.body, p.tags).await }
            }));
        }
        let mut out = Vec::new();
        for r in running {
            if let Ok(o) = r.await {
                out.push(o);
            }
        }
        out
    }

    /// Runs conversations: each user's turns are sequential (the next question carries the
    /// previous answers), users overlap. Turns not started by `duration` are skipped.
    pub async fn conversations(
        &self,
        conversations: Vec<Conversation>,
        model: &str,
        duration: Duration,
    ) -> Vec<Outcome> {
        let mut users = Vec::new();
        for (user, c) in conversations.into_iter().enumerate() {
            let target = self.clone();
            let model = model.to_owned();
            users.push(tokio::spawn(async move {
                let mut outcomes = Vec::new();
                tokio::time::sleep_until(target.wall(c.start)).await;
                let mut history = vec![json!({"role": "system", "content": c.system})];
                for (turn, question) in c.questions.into_iter().enumerate() {
                    if target.start.elapsed().mul_f64(target.speedup) > duration {
                        break;
                    }
                    history.push(json!({"role": "user", "content": question}));
                    let body = json!({"model": model, "messages": history, "max_tokens": c.max_tokens});
                    let o = target.send("/v1/chat/completions", body, Tags::default()).await;
                    let o = Outcome { request: format!("u{user}.t{turn}"), ..o };
                    history.push(json!({"role": "assistant", "content": o.text}));
                    outcomes.push(o);
                    tokio::time::sleep(c.think.div_f64(target.speedup)).await;
                }
                outcomes
            }));
        }
        joined(users).await
    }
}

impl Target {
    /// Runs agent sessions (closed loop): a session's steps go one after another, each with
    /// the history so far and the session's id in [`SESSION_HEADER`]; a step's subagents run
    /// in parallel from a copy of that history, each under a session id of its own, and the
    /// session goes on once all have answered. Steps not started by `duration` are skipped.
    pub async fn agents(
        &self,
        sessions: Vec<AgentSession>,
        systems: Vec<String>,
        model: &str,
        duration: Duration,
    ) -> Vec<Outcome> {
        let mut running = Vec::new();
        for s in sessions {
            let target = self.clone();
            let history = vec![json!({"role": "system", "content": systems[s.tenant % systems.len()]})];
            let model = model.to_owned();
            running.push(tokio::spawn(async move {
                tokio::time::sleep_until(target.wall(Duration::from_millis(s.start_ms))).await;
                target.agent(model, s.session, history, s.steps, duration).await
            }));
        }
        joined(running).await
    }

    /// One agent's steps from `history` (boxed: a step's subagents are agents too).
    fn agent(
        &self,
        model: String,
        session: String,
        mut history: Vec<Value>,
        steps: Vec<Step>,
        duration: Duration,
    ) -> Pin<Box<dyn Future<Output = Vec<Outcome>> + Send + 'static>> {
        let target = self.clone();
        Box::pin(async move {
            let mut outcomes = Vec::new();
            for (i, step) in steps.into_iter().enumerate() {
                tokio::time::sleep(Duration::from_millis(step.wait_ms).div_f64(target.speedup)).await;
                if target.start.elapsed().mul_f64(target.speedup) > duration {
                    break;
                }
                let text = document(step.seed, step.tokens);
                let content = match step.kind {
                    StepKind::User => text,
                    StepKind::Tool => format!("<tool_response>\n{text}\n</tool_response>"),
                };
                history.push(json!({"role": "user", "content": content}));
                let body =
                    json!({"model": model, "messages": history, "max_tokens": step.max_tokens, "ignore_eos": true});
                let path = "/v1/chat/completions";
                let o = target.send_in_session(path, body, Tags::default(), Some(&session)).await;
                history.push(json!({"role": "assistant", "content": o.text}));
                outcomes.push(Outcome { request: format!("{session}.s{i}"), ..o });
                let forks: Vec<_> = step
                    .subagents
                    .into_iter()
                    .enumerate()
                    .map(|(j, sub)| {
                        let id = format!("{session}.s{i}.a{j}");
                        tokio::spawn(target.agent(model.clone(), id, history.clone(), sub, duration))
                    })
                    .collect();
                outcomes.extend(joined(forks).await);
            }
            outcomes
        })
    }
}

/// The outcomes of spawned runs, in the order they were spawned (a run that panicked has none).
async fn joined(runs: Vec<tokio::task::JoinHandle<Vec<Outcome>>>) -> Vec<Outcome> {
    let mut out = Vec::new();
    for run in runs {
        if let Ok(outcomes) = run.await {
            out.extend(outcomes);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_spread_evenly_over_the_gateways() {
        let bases: Vec<String> = (0..4).map(|i| format!("http://127.0.0.1:{}", 9000 + i)).collect();
        let target = Target::spread(&bases, 1.0, Duration::from_secs(1)).unwrap();
        let mut counts = [0usize; 4];
        for _ in 0..4000 {
            let base = target.next_base();
            counts[bases.iter().position(|b| b == base).unwrap()] += 1;
        }
        assert!(counts.iter().all(|&n| (900..=1100).contains(&n)), "{counts:?}");
        let one = Target::new("http://127.0.0.1:9000", 1.0, Duration::from_secs(1)).unwrap();
        assert!((0..10).all(|_| one.next_base() == "http://127.0.0.1:9000"));
        assert!(Target::new("http://10.0.0.1:80", 1.0, Duration::from_secs(1)).is_err(), "loopback only");
    }
}
