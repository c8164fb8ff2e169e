//! The `agentic` workload: coding-agent sessions, generated from published statistics of real
//! agent traces and kept as a committed trace file (`tests/traces/agentic-coding.jsonl`).
//!
//! **Source.** The University of Washington's SyFI TraceLab public pool of Claude Code and
//! Codex sessions (<https://tracelab.cs.washington.edu/>, snapshot of 2026-06: 4 265
//! sessions, 357 161 agent steps, 432 510 tool calls, 54.9 B input tokens of which 52.6 B
//! were cache reads, 2.34 B appended, 186.9 M output). What the generator takes from it:
//!
//! | TraceLab figure | value there | here |
//! |---|---|---|
//! | requests (user turns) per session (`session_internal_counts`) | p50 1, avg 9.2, p90 18 | log-normal, median 1.5, p90 6, at most 6 |
//! | tool-initiated steps per request | p25 1, p50 2, avg 7.8, p90 20 | log-normal, median 2, p90 20, at most 12 |
//! | input tokens per step | avg 154 k (54.9 B / 357 k) | the history: system and tools + task + every step so far, scaled by 1/4 |
//! | appended tokens per step | avg 6.6 k (2.34 B / 357 k) | a tool result: log-normal, median 400, σ 1.2, at most 6 000 (÷4 as above) |
//! | output tokens per step | avg 523 (186.9 M / 357 k) | log-normal, median 120, σ 0.8, at most 800 |
//! | tool calls per step | p50 1, p90 2 | one result per step |
//!
//! What TraceLab does not give, chosen and labelled as such: each tenant's system prompt and
//! tool schemas (the 10–30 k tokens, ÷4: 5 000), a session's task context (its first
//! request reads code: median 2 000), a tool's run time between steps (log-normal, median
//! 1 s, at most 20 s) and a person's think time between requests (median 15 s, at most 60 s),
//! and subagents: after 6 % of tool steps the agent starts two or three subagents at once,
//! each forking the parent's whole context and running 2–6 steps of its own, and the parent
//! goes on when all have answered (a subagent's answer is the parent's next tool result).
//! Tokens are scaled by 1/4 so that a run fits four simulated H100s' caches and a 2-core
//! machine: the longest sessions reach ~40 k tokens, where TraceLab's steps average 154 k.
//!
//! A trace is deterministic for its parameters (seed included); the committed file holds the
//! parameters on its first line, and a test checks that the generator still writes exactly
//! that file.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// What the generator is asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgenticParams {
    /// The random seed.
    pub seed: u64,
    /// Tenants, each with its own system prompt and tool schemas.
    pub tenants: usize,
    /// Agent sessions, spread over the tenants in turn.
    pub sessions: usize,
    /// Simulated seconds over which sessions start (uniformly at random).
    pub start_span_s: f64,
    /// A tenant's system prompt and tool schemas, in tokens.
    pub system_tokens: usize,
}

impl Default for AgenticParams {
    fn default() -> Self {
        AgenticParams { seed: 46, tenants: 3, sessions: 48, start_span_s: 60.0, system_tokens: 5000 }
    }
}

/// Who sent a step's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// A person's request (the first of a session carries its task context).
    User,
    /// A tool's result, sent on by the agent loop.
    Tool,
}

/// One model call of a session: a message appended to the history, and the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// Who sent the message.
    pub kind: StepKind,
    /// The message's text seed (`crate::workload::document`).
    pub seed: u32,
    /// Its length, in tokens (about one a word).
    pub tokens: usize,
    /// The answer's length (`max_tokens`, `ignore_eos`).
    pub max_tokens: u32,
    /// Simulated milliseconds between the previous answer and this message: a tool's run
    /// time, or a person's think time.
    pub wait_ms: u64,
    /// Subagents started after this step's answer, in parallel, each forking the context so
    /// far; the parent's next step waits for all of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subagents: Vec<Vec<Step>>,
}

/// One agent session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentSession {
    /// Its session id (sent as `x-session-id`).
    pub session: String,
    /// Its tenant (an index into the tenants' system prompts).
    pub tenant: usize,
    /// Simulated milliseconds from the start of the run to its first step.
    pub start_ms: u64,
    /// Its steps, in order.
    pub steps: Vec<Step>,
}

/// A log-normal draw with this median and σ, at most `max`, at least 1.
fn log_normal(rng: &mut StdRng, median: f64, sigma: f64, max: f64) -> f64 {
    // Box–Muller.
    let (u1, u2): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    (median * (sigma * z).exp()).clamp(1.0, max)
}

/// σ of a log-normal whose p90 is `p90` times its median (z₀.₉ = 1.2816).
fn sigma_for(p90_over_median: f64) -> f64 {
    p90_over_median.ln() / 1.281_6
}

/// The generator's state: its random numbers and the next text seed.
struct Generator {
    rng: StdRng,
    next_seed: u32,
}

impl Generator {
    fn seed(&mut self) -> u32 {
        self.next_seed += 1;
        self.next_seed
    }

    fn step(&mut self, kind: StepKind, tokens: usize, wait_s: f64) -> Step {
        let max_tokens = log_normal(&mut self.rng, 120.0, 0.8, 800.0).round() as u32;
        let wait_ms = (wait_s * 1000.0).round() as u64;
        Step { kind, seed: self.seed(), tokens, max_tokens, wait_ms, subagents: Vec::new() }
    }

    fn tool_result(&mut self) -> usize {
        log_normal(&mut self.rng, 400.0, 1.2, 6000.0).round() as usize
    }

    fn tool_wait(&mut self) -> f64 {
        log_normal(&mut self.rng, 1.0, 1.0, 20.0)
    }

    /// A request: a person's message, then the tool steps its agent loop runs.
    fn request(&mut self, first: bool) -> Vec<Step> {
        let message = log_normal(&mut self.rng, 60.0, 1.0, 1000.0).round() as usize;
        let task = if first { log_normal(&mut self.rng, 2000.0, 0.5, 8000.0).round() as usize } else { 0 };
        let wait = if first { 0.0 } else { log_normal(&mut self.rng, 15.0, 1.0, 60.0) };
        let mut steps = vec![self.step(StepKind::User, message + task, wait)];
        let tools = log_normal(&mut self.rng, 2.0, sigma_for(10.0), 12.0).round() as usize;
        for _ in 0..tools {
            let (tokens, wait) = (self.tool_result(), self.tool_wait());
            let mut step = self.step(StepKind::Tool, tokens, wait);
            if self.rng.random_bool(0.06) {
                let n = self.rng.random_range(2..=3);
                step.subagents = (0..n).map(|_| self.subagent()).collect();
            }
            steps.push(step);
        }
        steps
    }

    /// A subagent: its task, then 1–5 tool steps.
    fn subagent(&mut self) -> Vec<Step> {
        let task = log_normal(&mut self.rng, 200.0, 0.5, 1000.0).round() as usize;
        let mut steps = vec![self.step(StepKind::User, task, 0.0)];
        for _ in 0..self.rng.random_range(1..=5) {
            let (tokens, wait) = (self.tool_result(), self.tool_wait());
            steps.push(self.step(StepKind::Tool, tokens, wait));
        }
        steps
    }
}

/// The sessions of a trace, deterministic for `params`.
pub fn generate(params: &AgenticParams) -> Vec<AgentSession> {
    let mut g = Generator { rng: StdRng::seed_from_u64(params.seed), next_seed: 0 };
    (0..params.sessions)
        .map(|i| {
            let start_ms = (g.rng.random_range(0.0..params.start_span_s.max(f64::EPSILON)) * 1000.0).round() as u64;
            let requests = log_normal(&mut g.rng, 1.5, sigma_for(4.0), 6.0).round() as usize;
            let steps = (0..requests).flat_map(|r| g.request(r == 0)).collect();
            AgentSession { session: format!("agent-{i}"), tenant: i % params.tenants.max(1), start_ms, steps }
        })
        .collect()
}

/// The trace file's text: the parameters, then a session a line.
pub fn trace_text(params: &AgenticParams, sessions: &[AgentSession]) -> anyhow::Result<String> {
    let mut text = serde_json::to_string(&serde_json::json!({ "generator": params }))?;
    for s in sessions {
        text.push('\n');
        text.push_str(&serde_json::to_string(s)?);
    }
    text.push('\n');
    Ok(text)
}

/// Reads a trace file: its parameters and sessions.
pub fn read_trace(path: &Path) -> anyhow::Result<(AgenticParams, Vec<AgentSession>)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading the agentic trace {}: {e}", path.display()))?;
    let mut lines = text.lines();
    let header: serde_json::Value = serde_json::from_str(lines.next().unwrap_or_default())?;
    let params: AgenticParams = serde_json::from_value(header["generator"].clone())?;
    let sessions = lines.map(serde_json::from_str).collect::<Result<Vec<AgentSession>, _>>()?;
    Ok((params, sessions))
}

/// Every model call of a session, subagents' included.
pub fn calls(session: &AgentSession) -> usize {
    session.steps.iter().map(|s| 1 + s.subagents.iter().map(Vec::len).sum::<usize>()).sum()
}

/// The longest history a session reaches, in message tokens (answers at their `max_tokens`,
/// system prompt included).
pub fn longest_context(session: &AgentSession, system_tokens: usize) -> usize {
    let own: usize = session.steps.iter().map(|s| s.tokens + s.max_tokens as usize).sum();
    system_tokens + own
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed trace is what the generator writes for the parameters it names.
    #[test]
    fn the_committed_trace_is_the_generators() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/agentic-coding.jsonl");
        let (params, sessions) = read_trace(&path).unwrap();
        assert_eq!(sessions, generate(&params), "regenerate with `cargo xtask bench agentic-trace`");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), trace_text(&params, &sessions).unwrap());
    }

    #[test]
    fn sessions_have_the_shape_the_statistics_give() {
        let params = AgenticParams { sessions: 400, ..AgenticParams::default() };
        let sessions = generate(&params);
        let tools_per_request: Vec<usize> = sessions
            .iter()
            .flat_map(|s| s.steps.split(|st| st.kind == StepKind::User).skip(1).map(<[Step]>::len))
            .collect();
        let mut sorted = tools_per_request.clone();
        sorted.sort_unstable();
        let p50 = sorted[sorted.len() / 2];
        assert!((1..=3).contains(&p50), "tool steps per request, p50 {p50}");
        assert!(sorted.iter().all(|&n| n <= 12));
        let forks = sessions.iter().flat_map(|s| &s.steps).filter(|s| !s.subagents.is_empty()).count();
        assert!(forks > 0, "some steps start subagents");
        assert!(sessions.iter().all(|s| s.steps[0].kind == StepKind::User && s.steps[0].wait_ms == 0));
        let tenants: std::collections::BTreeSet<usize> = sessions.iter().map(|s| s.tenant).collect();
        assert_eq!(tenants.len(), 3);
        let longest = sessions.iter().map(|s| longest_context(s, params.system_tokens)).max().unwrap();
        assert!(longest > 20_000, "some sessions grow long: {longest}");
    }
}
