//! Many engines' KV-event streams from one process, for measuring a router at fleet scale
//! (`--fleet-config`). No HTTP API and no requests: the events are what a fleet sends a
//! router, so that is all this makes.
//!
//! 1. **Record** (in simulated time, as fast as the CPU goes): one engine — this process's
//!    scheduler, time model and paged cache, from the same flags as a served engine — kept
//!    busy by a closed loop of `concurrency` requests. Each request is one of `prefixes`
//!    shared system prompts of `prefix_tokens`, then new tokens, then an answer; lengths are
//!    drawn uniformly from the configured ranges. Every step's events become one message, as
//!    vLLM publishes one batch per step with events.
//! 2. **Publish**: `engines` PUB sockets (ports `base_port..`), each replaying the recording
//!    in real time (scaled by `rate_scale`) from its own random phase. Each engine's copy is
//!    its own: its engine hashes are mixed with the engine's number, and so are the token ids
//!    of everything but the shared system prompts (drawn from [`SHARED_TOKENS`]). So every
//!    engine holds the shared prompts, as a real fleet does, and otherwise its own blocks: the
//!    router indexes `engines` different caches, not one cache many times over.
//!
//! It prints one JSON line with the recording's rates and the shared prompts (a benchmark
//! decides requests that start with them), and one when publishing ends with what
//! was sent and how late the publishers ran. No replay socket: a message a router misses is a
//! gap it cannot close.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use rand::{Rng, SeedableRng};

use crate::extra_keys::ExtraKeys;
use crate::kv_cache::KvCache;
use crate::kv_events::{encode_batch, Encoding, Event};
use crate::scheduler::{Limits, Remote, Scheduler};
use crate::time_model::StepCost;

/// Token ids of the shared system prompts; the rest of a prompt is drawn above them.
pub const SHARED_TOKENS: std::ops::Range<u32> = 1000..50_000;
/// Token ids of everything else.
const OWN_TOKENS: std::ops::Range<u32> = 50_000..150_000;

/// `--fleet-config`: what to record and how to publish it.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Engines published.
    pub engines: usize,
    /// The first engine's PUB port (on 127.0.0.1); engine `i` is at `base_port + i`.
    pub base_port: u16,
    /// Simulated seconds recorded: the longest a run can publish at `rate_scale` 1.
    pub record_seconds: f64,
    /// Wall seconds to publish.
    pub seconds: f64,
    /// The recording's speed: 1 replays it in real time, 0.1 ten times slower.
    pub rate_scale: f64,
    /// Publishing threads (each owns every `threads`-th engine).
    pub threads: usize,
    /// Requests kept in the recorded engine.
    pub concurrency: usize,
    /// Shared system prompts.
    pub prefixes: usize,
    /// Tokens of each shared system prompt.
    pub prefix_tokens: usize,
    /// New prompt tokens per request after the system prompt: `[min, max]`.
    pub new_tokens: [usize; 2],
    /// Answer tokens per request: `[min, max]`.
    pub output_tokens: [usize; 2],
    /// Seeds the workload and the engines' phases.
    pub seed: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            engines: 64,
            base_port: 20_000,
            record_seconds: 120.0,
            seconds: 30.0,
            rate_scale: 1.0,
            threads: 1,
            concurrency: 64,
            prefixes: 16,
            prefix_tokens: 2048,
            new_tokens: [256, 4096],
            output_tokens: [64, 512],
            seed: 48,
        }
    }
}

impl FleetConfig {
    /// Refuses what cannot run.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.engines > 0 && self.threads > 0 && self.concurrency > 0, "counts must be positive");
        anyhow::ensure!(
            usize::from(self.base_port) + self.engines <= usize::from(u16::MAX),
            "engines do not fit in the ports above base_port"
        );
        anyhow::ensure!(self.engines < 1 << 14, "at most 16 383 engines (token ids are shifted per engine)");
        anyhow::ensure!(
            self.engines.div_ceil(self.threads) <= 1000,
            "at most 1 000 engines a publishing thread (each has a ZMQ context, of at most 1 023 sockets)"
        );
        let positive = [self.record_seconds, self.seconds, self.rate_scale];
        anyhow::ensure!(
            positive.iter().all(|v| v.is_finite() && *v > 0.0),
            "durations and rate_scale must be positive"
        );
        anyhow::ensure!(self.prefixes > 0 && self.prefix_tokens > 0, "a shared prefix needs tokens");
        for [lo, hi] in [self.new_tokens, self.output_tokens] {
            anyhow::ensure!(0 < lo && lo <= hi, "token ranges must be [min, max] with 0 < min <= max");
        }
        Ok(())
    }
}

/// One step's events, at the simulated time the step ended.
struct Step {
    at_us: f64,
    events: Vec<Event>,
}

/// What the recording holds, per simulated second.
#[derive(Debug, serde::Serialize)]
struct Recorded {
    simulated_seconds: f64,
    steps: usize,
    messages_per_s: f64,
    blocks_stored_per_s: f64,
    blocks_removed_per_s: f64,
    prompt_tokens_per_s: f64,
    cached_prompt_share: f64,
    output_tokens_per_s: f64,
}

/// Records `config.record_seconds` of a busy engine's events.
fn record(
    config: &FleetConfig,
    limits: Limits,
    cost: StepCost,
    cache: KvCache,
) -> anyhow::Result<(Vec<Step>, Recorded, Vec<Vec<u32>>)> {
    let mut scheduler = Scheduler::new(limits, cost, cache);
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed);
    let prefixes: Vec<Vec<u32>> = (0..config.prefixes)
        .map(|_| (0..config.prefix_tokens).map(|_| rng.random_range(SHARED_TOKENS)).collect())
        .collect();
    let request = |rng: &mut rand::rngs::StdRng| {
        let mut prompt = prefixes[rng.random_range(0..prefixes.len())].clone();
        let new = rng.random_range(config.new_tokens[0]..=config.new_tokens[1]);
        prompt.extend((0..new).map(|_| rng.random_range(OWN_TOKENS)));
        let output = rng.random_range(config.output_tokens[0]..=config.output_tokens[1]);
        (prompt, (0..output as u32).map(|i| 5000 + i % 1000).collect::<Vec<u32>>())
    };
    let (mut now_us, mut in_system, mut steps) = (0.0, 0, Vec::new());
    let (mut stored, mut removed, mut outputs) = (0usize, 0usize, 0usize);
    let (mut prompt_tokens, mut cached) = (0usize, 0usize);
    while now_us < config.record_seconds * 1e6 {
        while in_system < config.concurrency {
            let (prompt, output) = request(&mut rng);
            prompt_tokens += prompt.len();
            scheduler
                .add(prompt, output, ExtraKeys::default(), Remote::None)
                .context("a request outgrows the cache")?;
            in_system += 1;
        }
        let out = scheduler.step();
        anyhow::ensure!(out.duration_us > 0.0, "a busy engine made no progress");
        now_us += out.duration_us;
        outputs += out.emitted.len();
        for e in &out.emitted {
            if e.index == 1 {
                cached += e.cached_tokens;
            }
            in_system -= usize::from(e.finished);
        }
        for event in &out.events {
            match event {
                Event::BlockStored { block_hashes, .. } => stored += block_hashes.len(),
                Event::BlockRemoved { block_hashes, .. } => removed += block_hashes.len(),
                Event::AllBlocksCleared => {}
            }
        }
        if !out.events.is_empty() {
            steps.push(Step { at_us: now_us, events: out.events });
        }
    }
    let seconds = now_us / 1e6;
    let recorded = Recorded {
        simulated_seconds: seconds,
        steps: steps.len(),
        messages_per_s: steps.len() as f64 / seconds,
        blocks_stored_per_s: stored as f64 / seconds,
        blocks_removed_per_s: removed as f64 / seconds,
        prompt_tokens_per_s: prompt_tokens as f64 / seconds,
        cached_prompt_share: cached as f64 / prompt_tokens.max(1) as f64,
        output_tokens_per_s: outputs as f64 / seconds,
    };
    Ok((steps, recorded, prefixes))
}

/// Engine `engine`'s copy of an event: its hashes its own, and its tokens too but for the
/// shared prompts'.
fn distinct(event: &Event, engine: usize) -> Event {
    let hash = |h: u64| h ^ (engine as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let token = |t: u32| if SHARED_TOKENS.contains(&t) { t } else { t.wrapping_add((engine as u32) << 18) };
    match event {
        Event::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, keys } => {
            Event::BlockStored {
                block_hashes: block_hashes.iter().map(|h| hash(*h)).collect(),
                parent_block_hash: parent_block_hash.map(hash),
                token_ids: token_ids.iter().map(|t| token(*t)).collect(),
                block_size: *block_size,
                medium: *medium,
                keys: keys.clone(),
            }
        }
        Event::BlockRemoved { block_hashes, medium } => {
            Event::BlockRemoved { block_hashes: block_hashes.iter().map(|h| hash(*h)).collect(), medium: *medium }
        }
        Event::AllBlocksCleared => Event::AllBlocksCleared,
    }
}

/// What the publishers did.
#[derive(Debug, Default, serde::Serialize)]
struct Published {
    messages: u64,
    blocks: u64,
    /// Messages ZMQ would not take (the subscriber's queue was full).
    refused: u64,
    /// How late the publishers sent a message after it was due, at worst and at p99.
    late_max_ms: f64,
    late_p99_ms: f64,
}

/// One publishing thread: its engines' sockets, each at its place in the recording.
fn publish_some(
    config: &FleetConfig,
    steps: &[Step],
    engines: Vec<usize>,
    start: Instant,
) -> anyhow::Result<(Published, Vec<f64>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(config.seed ^ engines.first().copied().unwrap_or(0) as u64);
    // A context of its own: libzmq allows 1 023 sockets a context.
    let ctx = zmq::Context::new();
    let mut sockets = Vec::with_capacity(engines.len());
    for &engine in &engines {
        let socket = ctx.socket(zmq::PUB)?;
        socket.set_sndhwm(100_000)?;
        let endpoint = format!("tcp://127.0.0.1:{}", usize::from(config.base_port) + engine);
        socket.bind(&endpoint).with_context(|| format!("binding {endpoint}"))?;
        sockets.push(socket);
    }
    // (due, socket, next step, seq): each engine starts its recording within its first second.
    let scale = 1.0 / config.rate_scale;
    let mut due: BinaryHeap<Reverse<(Duration, usize, usize)>> = BinaryHeap::new();
    let phases: Vec<f64> = engines.iter().map(|_| rng.random_range(0.0..1.0)).collect();
    let at = |i: usize, step: usize| Duration::from_secs_f64(phases[i] + steps[step].at_us / 1e6 * scale);
    for i in 0..engines.len() {
        due.push(Reverse((at(i, 0), i, 0)));
    }
    let end = Duration::from_secs_f64(config.seconds);
    let (mut done, mut late) = (Published::default(), Vec::new());
    while let Some(Reverse((when, i, step))) = due.pop() {
        if when > end {
            break;
        }
        let now = start.elapsed();
        if when > now {
            std::thread::sleep(when - now);
        }
        late.push(start.elapsed().saturating_sub(when).as_secs_f64() * 1e3);
        let events: Vec<Event> = steps[step].events.iter().map(|e| distinct(e, engines[i])).collect();
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(ts, &events, 0, Encoding::Map);
        let frames: [&[u8]; 3] = [b"", &(step as u64).to_be_bytes(), &payload];
        match sockets[i].send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => {
                done.messages += 1;
                done.blocks += events.iter().map(blocks).sum::<u64>();
            }
            Err(_) => done.refused += 1,
        }
        if step + 1 < steps.len() {
            due.push(Reverse((at(i, step + 1), i, step + 1)));
        }
    }
    Ok((done, late))
}

fn blocks(event: &Event) -> u64 {
    match event {
        Event::BlockStored { block_hashes, .. } | Event::BlockRemoved { block_hashes, .. } => block_hashes.len() as u64,
        Event::AllBlocksCleared => 0,
    }
}

/// Records, then publishes for `config.seconds`; prints both reports.
pub fn run(config: &FleetConfig, limits: Limits, cost: StepCost, cache: KvCache) -> anyhow::Result<()> {
    config.validate()?;
    let (steps, recorded, prefixes) = record(config, limits, cost, cache)?;
    println!("{}", serde_json::json!({ "recorded": recorded, "prefixes": prefixes }));
    anyhow::ensure!(!steps.is_empty(), "the recording holds no events");
    let longest = steps[steps.len() - 1].at_us / 1e6 / config.rate_scale + 1.0;
    anyhow::ensure!(
        config.seconds <= longest,
        "{} s of publishing needs a longer recording: record_seconds of at least {:.0}",
        config.seconds,
        config.seconds * config.rate_scale
    );
    let start = Instant::now();
    let results: Vec<anyhow::Result<(Published, Vec<f64>)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..config.threads)
            .map(|t| {
                let mine: Vec<usize> = (t..config.engines).step_by(config.threads).collect();
                let steps = &steps;
                scope.spawn(move || publish_some(config, steps, mine, start))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a publisher panicked")))).collect()
    });
    let mut total = Published::default();
    let mut late = Vec::new();
    for result in results {
        let (p, l) = result?;
        total.messages += p.messages;
        total.blocks += p.blocks;
        total.refused += p.refused;
        late.extend(l);
    }
    late.sort_by(f64::total_cmp);
    total.late_max_ms = late.last().copied().unwrap_or(0.0);
    total.late_p99_ms = late.get(late.len() * 99 / 100).copied().unwrap_or(0.0);
    println!("{}", serde_json::json!({ "published": total }));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time_model::Preset;
    use crate::vllm_hash::{HashAlgo, VllmHasher};

    fn small() -> FleetConfig {
        FleetConfig { record_seconds: 5.0, concurrency: 8, prefixes: 2, prefix_tokens: 64, ..FleetConfig::default() }
    }

    fn recording(config: &FleetConfig, blocks: usize) -> (Vec<Step>, Recorded, Vec<Vec<u32>>) {
        let cache = KvCache::new(16, blocks, 0, VllmHasher::new(HashAlgo::Sha256, None));
        let limits = Limits { max_num_seqs: 256, max_num_batched_tokens: 8192 };
        record(config, limits, Preset::Llama8bH100.cost(), cache).unwrap()
    }

    #[test]
    fn a_busy_engine_stores_and_once_full_evicts() {
        let (steps, recorded, _) = recording(&small(), 2_000);
        assert!(recorded.simulated_seconds >= 5.0);
        assert!(recorded.blocks_stored_per_s > 0.0 && recorded.blocks_removed_per_s > 0.0, "{recorded:?}");
        assert!(recorded.cached_prompt_share > 0.0, "the shared prompts are found cached: {recorded:?}");
        assert!(steps.windows(2).all(|w| w[0].at_us < w[1].at_us), "steps in time order");
    }

    #[test]
    fn engines_share_the_system_prompts_and_nothing_else() {
        let (steps, _, prefixes) = recording(&small(), 2_000);
        let tokens = |event: Event| match event {
            Event::BlockStored { token_ids, .. } => token_ids,
            _ => Vec::new(),
        };
        let stored: Vec<&Event> =
            steps.iter().flat_map(|s| &s.events).filter(|e| matches!(e, Event::BlockStored { .. })).collect();
        let (a, b) = (tokens(distinct(stored[0], 0)), tokens(distinct(stored[0], 1)));
        assert!(prefixes.iter().any(|p| p.starts_with(&a[..16])), "a prompt starts with a shared prompt");
        assert_eq!(a[..16], b[..16], "which every engine holds alike");
        assert_ne!(a, b, "and then its own tokens");
        assert_eq!(distinct(stored[0], 3), distinct(stored[0], 3), "an engine's copy is the same every time");
    }

    #[test]
    fn configs_that_cannot_run_are_refused() {
        for bad in [
            FleetConfig { engines: 0, ..FleetConfig::default() },
            FleetConfig { rate_scale: 0.0, ..FleetConfig::default() },
            FleetConfig { new_tokens: [10, 5], ..FleetConfig::default() },
            FleetConfig { base_port: 65_000, engines: 1_000, ..FleetConfig::default() },
            FleetConfig { engines: 2_001, threads: 2, ..FleetConfig::default() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(FleetConfig::default().validate().is_ok());
    }
}
