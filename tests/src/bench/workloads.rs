//! The benchmark's workloads: `shared-prefix`, `mooncake-conversation`, `multi-turn`,
//! `cache-pressure` and `agentic` (its generator: [`super::agentic`]).
//!
//! Each is deterministic for a seed: the same run twice sends the same bytes at the same
//! (simulated) times.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use super::agentic::{self, AgentSession};
use super::loadgen::{Conversation, Planned, Tags, OUTSIDE};
use crate::workload::document;

/// The model name the fleet serves.
pub const MODEL: &str = "qwen3";

/// inference-perf's `shared_prefix`: `groups` system prompts of `system_tokens`, each with
/// `prompts_per_group` questions of `question_tokens`, shuffled and sent as Poisson arrivals.
#[derive(Debug, Clone, Serialize)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub groups: usize,
    /// Questions per system prompt.
    pub prompts_per_group: usize,
    /// System prompt length (about one token per word).
    pub system_tokens: usize,
    /// Question length.
    pub question_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: u32,
}

/// The Mooncake FAST'25 conversation trace, replayed on its own timestamps.
#[derive(Debug, Clone, Serialize)]
pub struct Mooncake {
    /// Rows to replay (from the start of the trace).
    pub requests: usize,
    /// Trace time is divided by this (on top of the engines' speedup).
    pub time_compression: f64,
    /// Prompts are cut to this many tokens.
    pub max_input_tokens: usize,
    /// Outputs are cut to this many tokens.
    pub max_output_tokens: u32,
}

/// LMCache's multi-round QA: users with a shared system prompt and a growing history.
#[derive(Debug, Clone, Serialize)]
pub struct MultiTurn {
    /// Concurrent users.
    pub users: usize,
    /// Questions per user.
    pub rounds: usize,
    /// Shared system prompt length.
    pub system_tokens: usize,
    /// Per-user context prepended to the first question (a document the user talks about).
    pub context_tokens: usize,
    /// Question length.
    pub question_tokens: usize,
    /// Answer length.
    pub output_tokens: u32,
    /// Simulated seconds between users' first questions.
    pub user_spacing_s: f64,
    /// Simulated seconds a user thinks between rounds.
    pub think_s: f64,
}

/// Caches much smaller than the working set: `documents` long documents, each read
/// `reads_per_document` times (a different question each), among `one_offs` prompts read
/// once, all shuffled and sent as Poisson arrivals. The fleet's KV cache holds 1/`pressure`
/// of the working set, so between two reads of a document the one-offs evict it wherever it
/// is not kept warm: a router that guesses where documents are (an approximate tree) sends
/// reads to where they were evicted; one that reads the engines' events knows.
#[derive(Debug, Clone, Serialize)]
pub struct CachePressure {
    /// Shared documents.
    pub documents: usize,
    /// Reads of each document.
    pub reads_per_document: usize,
    /// Document length.
    pub document_tokens: usize,
    /// Prompts read once.
    pub one_offs: usize,
    /// Their length.
    pub one_off_tokens: usize,
    /// Question length (after a document).
    pub question_tokens: usize,
    /// Output tokens per request.
    pub output_tokens: u32,
    /// Working set over the fleet's KV capacity.
    pub pressure: f64,
}

/// Coding-agent sessions replayed from a trace file written by [`agentic::generate`]: tenants'
/// system prompts and tool schemas, conversations growing by tool results, think times,
/// subagents forking from their parent's context, each session's id in `x-session-id`.
#[derive(Debug, Clone, Serialize)]
pub struct Agentic {
    /// The trace file (`tests/traces/agentic-coding.jsonl`).
    pub trace: PathBuf,
}

/// A workload, ready to plan.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Workload {
    /// See [`SharedPrefix`].
    SharedPrefix(SharedPrefix),
    /// See [`Mooncake`].
    MooncakeConversation(Mooncake),
    /// See [`MultiTurn`].
    MultiTurn(MultiTurn),
    /// See [`CachePressure`].
    CachePressure(CachePressure),
    /// See [`Agentic`].
    Agentic(Agentic),
}

/// What a workload sends.
pub enum Plan {
    /// Independent requests at fixed times.
    OpenLoop(Vec<Planned>),
    /// Conversations whose turns wait for the previous answer.
    Conversations(Vec<Conversation>),
    /// Agent sessions (closed loop, subagents in parallel), with each tenant's system prompt.
    Agents(Vec<AgentSession>, Vec<String>),
}

impl Workload {
    /// The workload's name in reports.
    pub fn name(&self) -> &'static str {
        match self {
            Workload::SharedPrefix(_) => "shared-prefix",
            Workload::MooncakeConversation(_) => "mooncake-conversation",
            Workload::MultiTurn(_) => "multi-turn",
            Workload::CachePressure(_) => "cache-pressure",
            Workload::Agentic(_) => "agentic",
        }
    }

    /// A one-line description for reports.
    pub fn describe(&self) -> String {
        match self {
            Workload::SharedPrefix(w) => format!(
                "{} groups × {} prompts, system {} + question {} tokens, output {}",
                w.groups, w.prompts_per_group, w.system_tokens, w.question_tokens, w.output_tokens
            ),
            Workload::MooncakeConversation(w) => format!(
                "first {} rows, trace time ÷ {}, input ≤ {} tokens, output ≤ {}",
                w.requests, w.time_compression, w.max_input_tokens, w.max_output_tokens
            ),
            Workload::MultiTurn(w) => format!(
                "{} users × {} rounds, system {} + context {} + question {} tokens, output {}, think {} s",
                w.users, w.rounds, w.system_tokens, w.context_tokens, w.question_tokens, w.output_tokens, w.think_s
            ),
            Workload::CachePressure(w) => format!(
                "{} documents × {} reads of {} + {} tokens, {} one-offs of {} tokens, output {}, working set {:.1}× the fleet's KV cache",
                w.documents,
                w.reads_per_document,
                w.document_tokens,
                w.question_tokens,
                w.one_offs,
                w.one_off_tokens,
                w.output_tokens,
                w.pressure
            ),
            Workload::Agentic(w) => match agentic::read_trace(&w.trace) {
                Ok((p, sessions)) => format!(
                    "{} coding-agent sessions of {} tenants ({} model calls, subagents included), system and tools {} tokens, longest history ~{} tokens, trace {}",
                    sessions.len(),
                    p.tenants,
                    sessions.iter().map(agentic::calls).sum::<usize>(),
                    p.system_tokens,
                    sessions.iter().map(|s| agentic::longest_context(s, p.system_tokens)).max().unwrap_or(0),
                    w.trace.file_name().unwrap_or_default().to_string_lossy()
                ),
                Err(e) => format!("agentic trace unreadable: {e}"),
            },
        }
    }

    /// Whether `qps` drives arrivals (the trace and the conversations have their own).
    pub fn uses_qps(&self) -> bool {
        matches!(self, Workload::SharedPrefix(_) | Workload::CachePressure(_))
    }

    /// Builds the plan. `qps` is in simulated time; `trace` is the Mooncake file.
    pub fn plan(&self, qps: f64, seed: u64, trace: &Path) -> anyhow::Result<Plan> {
        let mut rng = StdRng::seed_from_u64(seed);
        Ok(match self {
            Workload::SharedPrefix(w) => Plan::OpenLoop(w.plan(qps, &mut rng)),
            Workload::MooncakeConversation(w) => Plan::OpenLoop(w.plan(trace)?),
            Workload::MultiTurn(w) => Plan::Conversations(w.plan()),
            Workload::CachePressure(w) => Plan::OpenLoop(w.plan(qps, &mut rng)),
            Workload::Agentic(w) => {
                let (params, sessions) = agentic::read_trace(&w.trace)?;
                let systems = (0..params.tenants).map(|t| tenant_system(t, params.system_tokens)).collect();
                Plan::Agents(sessions, systems)
            }
        })
    }
}

/// How a run's requests are split between priority classes or tenants: sent as headers, read
/// by the `kvgate-kv-aware-flow-control` policy, and reported per value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mix {
    /// No tags.
    #[default]
    None,
    /// A fifth of the requests `interactive`, the rest `batch`.
    Priorities,
    /// Two tenants: `burst` sends ten times as many requests as `steady`.
    Tenants,
    /// Traffic the routers do not see: 30 % of the requests (tenant `outside`) go straight to
    /// one engine (the first), bypassing every gateway, as a batch job or a client pinned to
    /// one pod would.
    Outside,
}

impl Mix {
    /// Every mix.
    pub const ALL: [Mix; 4] = [Mix::None, Mix::Priorities, Mix::Tenants, Mix::Outside];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mix::None => "none",
            Mix::Priorities => "priorities",
            Mix::Tenants => "tenants",
            Mix::Outside => "outside",
        }
    }

    /// The mix with this name.
    pub fn parse(name: &str) -> anyhow::Result<Mix> {
        Mix::ALL.into_iter().find(|m| m.name() == name).ok_or_else(|| anyhow::anyhow!("unknown mix {name}"))
    }

    /// Tags every request of `plan`, the same way for the same seed.
    pub fn tag(self, plan: &mut Plan, seed: u64) {
        let Plan::OpenLoop(requests) = plan else { return };
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6d69_7865);
        for p in requests {
            p.tags = match self {
                Mix::None => Tags::default(),
                Mix::Priorities => {
                    Tags { priority: Some(if rng.random_bool(0.2) { "interactive" } else { "batch" }), tenant: None }
                }
                Mix::Tenants => {
                    Tags { priority: None, tenant: Some(if rng.random_bool(1.0 / 11.0) { "steady" } else { "burst" }) }
                }
                Mix::Outside => Tags { priority: None, tenant: rng.random_bool(0.3).then_some(OUTSIDE) },
            };
        }
    }
}

/// Tenant `t`'s system prompt with its tool schemas.
fn tenant_system(t: usize, tokens: usize) -> String {
    format!("You are a coding agent. Tools follow.\n{}", document(4_000_000 + t as u32, tokens))
}

/// Poisson arrival times at `qps`.
fn poisson(n: usize, qps: f64, rng: &mut StdRng) -> Vec<Duration> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += -u.ln() / qps;
            Duration::from_secs_f64(t)
        })
        .collect()
}

impl SharedPrefix {
    fn plan(&self, qps: f64, rng: &mut StdRng) -> Vec<Planned> {
        let mut pairs: Vec<(usize, usize)> =
            (0..self.groups).flat_map(|g| (0..self.prompts_per_group).map(move |p| (g, p))).collect();
        pairs.shuffle(rng);
        let times = poisson(pairs.len(), qps, rng);
        pairs
            .into_iter()
            .zip(times)
            .map(|((g, p), at)| {
                let system = document(10_000 + g as u32, self.system_tokens);
                let question = document(1_000_000 + (g * self.prompts_per_group + p) as u32, self.question_tokens);
                let body = json!({"model": MODEL, "max_tokens": self.output_tokens, "ignore_eos": true,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
                Planned { at, path: "/v1/chat/completions", body, tags: Tags::default() }
            })
            .collect()
    }

    /// Tokens the fleet must hold to cache every system prompt and question once.
    pub fn resident_tokens(&self) -> usize {
        self.groups * (self.system_tokens + self.prompts_per_group * self.question_tokens)
    }
}

impl CachePressure {
    fn plan(&self, qps: f64, rng: &mut StdRng) -> Vec<Planned> {
        // `Some((document, read))` or `None` for a one-off; shuffled together.
        let mut items: Vec<Option<(usize, usize)>> = (0..self.documents)
            .flat_map(|d| (0..self.reads_per_document).map(move |r| Some((d, r))))
            .chain((0..self.one_offs).map(|_| None))
            .collect();
        items.shuffle(rng);
        let times = poisson(items.len(), qps, rng);
        let mut one_off = 0u32;
        items
            .into_iter()
            .zip(times)
            .map(|(item, at)| {
                let messages = match item {
                    Some((d, r)) => {
                        let document = document(20_000 + d as u32, self.document_tokens);
                        let question = document_question(d, r, self.reads_per_document, self.question_tokens);
                        json!([{"role": "system", "content": document}, {"role": "user", "content": question}])
                    }
                    None => {
                        one_off += 1;
                        json!([{"role": "user", "content": document(3_000_000 + one_off, self.one_off_tokens)}])
                    }
                };
                let body =
                    json!({"model": MODEL, "max_tokens": self.output_tokens, "ignore_eos": true, "messages": messages});
                Planned { at, path: "/v1/chat/completions", body, tags: Tags::default() }
            })
            .collect()
    }

    /// Tokens of every distinct prompt: what the fleet would need to cache all of them.
    pub fn working_set_tokens(&self) -> usize {
        self.documents * (self.document_tokens + self.reads_per_document * self.question_tokens)
            + self.one_offs * self.one_off_tokens
    }
}

/// The question of read `r` of document `d`.
fn document_question(d: usize, r: usize, reads: usize, tokens: usize) -> String {
    document(2_000_000 + (d * reads + r) as u32, tokens)
}

/// Common English words, each a single token (with its leading space) for Qwen3.
const WORDS: [&str; 64] = [
    "time",
    "year",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "state",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "system",
    "program",
    "question",
    "work",
    "government",
    "number",
    "night",
    "point",
    "home",
    "water",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
];

/// 512 deterministic words (≈ tokens) for a Mooncake `hash_id`. Text, not token ids, so
/// routers that only take string prompts (SGLang's) run the same workload; every block starts
/// at a space, so equal block prefixes tokenize to equal token prefixes.
fn block_words(hash_id: u64) -> impl Iterator<Item = &'static str> {
    let mut rng = StdRng::seed_from_u64(hash_id ^ 0x6d6f_6f6e_6361_6b65);
    (0..512).map(move |_| WORDS[rng.random_range(0..WORDS.len())])
}

impl Mooncake {
    fn plan(&self, trace: &Path) -> anyhow::Result<Vec<Planned>> {
        let text = std::fs::read_to_string(trace)
            .map_err(|e| anyhow::anyhow!("reading the Mooncake trace {}: {e}", trace.display()))?;
        let mut plan = Vec::new();
        for line in text.lines().take(self.requests) {
            let row: Value = serde_json::from_str(line)?;
            let input = (row["input_length"].as_u64().unwrap_or(0) as usize).min(self.max_input_tokens);
            let output = (row["output_length"].as_u64().unwrap_or(1) as u32).clamp(1, self.max_output_tokens);
            let words: Vec<&str> = row["hash_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).flat_map(block_words).take(input).collect())
                .unwrap_or_default();
            if words.is_empty() {
                continue;
            }
            let at = Duration::from_secs_f64(row["timestamp"].as_f64().unwrap_or(0.0) / 1000.0 / self.time_compression);
            let body = json!({"model": MODEL, "prompt": words.join(" "), "max_tokens": output, "ignore_eos": true});
            plan.push(Planned { at, path: "/v1/completions", body, tags: Tags::default() });
        }
        Ok(plan)
    }
}

impl MultiTurn {
    fn plan(&self) -> Vec<Conversation> {
        let system = document(7, self.system_tokens);
        (0..self.users)
            .map(|u| Conversation {
                start: Duration::from_secs_f64(u as f64 * self.user_spacing_s),
                system: system.clone(),
                questions: (0..self.rounds)
                    .map(|r| {
                        let q = document(2_000_000 + (u * 1000 + r) as u32, self.question_tokens);
                        if r == 0 {
                            format!("{}\n\n{q}", document(3_000_000 + u as u32, self.context_tokens))
                        } else {
                            q
                        }
                    })
                    .collect(),
                think: Duration::from_secs_f64(self.think_s),
                max_tokens: self.output_tokens,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_plans_every_prompt_once_at_increasing_times() {
        let w =
            SharedPrefix { groups: 3, prompts_per_group: 4, system_tokens: 20, question_tokens: 5, output_tokens: 7 };
        let plan = w.plan(10.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(plan.len(), 12);
        assert!(plan.windows(2).all(|p| p[0].at < p[1].at));
        let systems: std::collections::HashSet<String> =
            plan.iter().map(|p| p.body["messages"][0]["content"].as_str().unwrap().to_owned()).collect();
        assert_eq!(systems.len(), 3, "one system prompt per group");
        let again = w.plan(10.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(plan[5].body, again[5].body, "deterministic for a seed");
    }

    #[test]
    fn cache_pressure_reads_each_document_several_times_among_one_offs() {
        let w = CachePressure {
            documents: 3,
            reads_per_document: 4,
            document_tokens: 30,
            one_offs: 5,
            one_off_tokens: 20,
            question_tokens: 5,
            output_tokens: 7,
            pressure: 3.0,
        };
        let plan = w.plan(10.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(plan.len(), 3 * 4 + 5);
        assert!(plan.windows(2).all(|p| p[0].at < p[1].at));
        let mut firsts = std::collections::HashMap::<String, usize>::new();
        for p in &plan {
            *firsts.entry(p.body["messages"][0]["content"].as_str().unwrap().to_owned()).or_default() += 1;
        }
        let mut counts: Vec<usize> = firsts.into_values().collect();
        counts.sort_unstable();
        assert_eq!(counts, [1, 1, 1, 1, 1, 4, 4, 4], "five one-offs, three documents read four times");
        assert_eq!(w.working_set_tokens(), 3 * (30 + 4 * 5) + 5 * 20);
    }

    #[test]
    fn the_outside_mix_sends_about_three_tenths_around_the_gateways() {
        let w =
            SharedPrefix { groups: 50, prompts_per_group: 20, system_tokens: 2, question_tokens: 1, output_tokens: 1 };
        let mut plan = Plan::OpenLoop(w.plan(10.0, &mut StdRng::seed_from_u64(1)));
        Mix::Outside.tag(&mut plan, 7);
        let Plan::OpenLoop(requests) = plan else { unreachable!() };
        let outside = requests.iter().filter(|p| p.tags.tenant == Some(OUTSIDE)).count();
        assert!((250..350).contains(&outside), "{outside} of 1000");
        assert!(requests.iter().all(|p| p.tags.priority.is_none() && p.tags.tenant.is_none_or(|t| t == OUTSIDE)));
    }

    #[test]
    fn mooncake_blocks_are_deterministic_per_hash_id() {
        let a: Vec<&str> = block_words(42).collect();
        assert_eq!(a.len(), 512);
        assert_eq!(a, block_words(42).collect::<Vec<_>>());
        assert_ne!(a, block_words(43).collect::<Vec<_>>());
    }

    #[test]
    fn mooncake_rows_become_capped_text_prompts_on_trace_time() {
        let dir = std::env::temp_dir().join(format!("kvgate-mooncake-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("t.jsonl");
        std::fs::write(
            &trace,
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 9000, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 2000, \"input_length\": 700, \"output_length\": 5, \"hash_ids\": [0, 2]}\n",
        )
        .unwrap();
        let w = Mooncake { requests: 10, time_compression: 2.0, max_input_tokens: 600, max_output_tokens: 100 };
        let plan = w.plan(&trace).unwrap();
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[1].at, Duration::from_secs(1));
        let words =
            |i: usize| plan[i].body["prompt"].as_str().unwrap().split(' ').map(str::to_owned).collect::<Vec<_>>();
        let (first, second) = (words(0), words(1));
        assert_eq!((first.len(), second.len()), (600, 600));
        assert_eq!(first[..512], second[..512], "shared block 0, shared words");
        assert_ne!(first[512..], second[512..]);
        assert_eq!(plan[0].body["max_tokens"], 100);
    }
}
