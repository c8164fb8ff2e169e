//! A run's requests replayed in simulated time on a fleet of engines, under placements given
//! and under a clairvoyant greedy one (`kvgate-sim --replay FILE`), for benchmarks that want
//! to know how much a router could have won.
//!
//! Each engine is a [`Scheduler`] with its own clock, driven as the live engine drives it:
//! requests that arrive during a step wait for the next one; an idle engine's clock jumps to
//! the next arrival; a token is out when the step that produced it ends. So one measurement
//! method serves every placement: round robin, the router's own, and the greedy one.
//!
//! The greedy placement knows each engine's exact state when a request arrives (queue, batch,
//! cache) and sends the request where its own first token comes soonest: it tries every
//! engine on a copy and keeps the best. It does not know the arrivals to come, so it is a
//! reference, not a bound: on a tight cache it spreads a prefix's requests and evicts.
//!
//! The floor is a bound: each request's TTFT alone on an idle engine that holds every block
//! of its prompt an infinite cache shared by the fleet would (`Request::best_cached`). No
//! placement does better for any request (a batch step takes longer than its parts alone,
//! and no engine holds more), so no placement's percentiles are lower.

use std::collections::{HashMap, HashSet};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::extra_keys::ExtraKeys;
use crate::scheduler::{Remote, Scheduler, SeqId};

/// What to replay.
#[derive(Debug, Deserialize)]
pub struct Input {
    /// Engines in the fleet.
    pub engines: usize,
    /// The requests, in arrival order.
    pub requests: Vec<Request>,
    /// Placements to replay besides the greedy one: each names an engine per request.
    pub placements: Vec<Placement>,
}

/// One request.
#[derive(Debug, Deserialize)]
pub struct Request {
    /// Arrival, simulated seconds from the start.
    pub at_s: f64,
    /// Its prompt's token ids.
    pub prompt: Vec<u32>,
    /// The tokens it generated (at least one).
    pub output: Vec<u32>,
    /// Prompt tokens an infinite cache shared by the fleet would hold when it arrives, for
    /// the floor: whole blocks, fewer than the prompt's length.
    #[serde(default)]
    pub best_cached: usize,
}

/// A placement: the engine of each request, in the order of [`Input::requests`].
#[derive(Debug, Deserialize)]
pub struct Placement {
    /// Its name in the output.
    pub name: String,
    /// Engine index per request.
    pub engines: Vec<usize>,
}

/// The names of the greedy placement and of the floor in the output.
pub const GREEDY: &str = "greedy";
/// .
pub const FLOOR: &str = "floor";

/// What a placement gave.
#[derive(Debug, Serialize)]
pub struct Replayed {
    /// The placement's name.
    pub name: String,
    /// Engine index per request.
    pub engines: Vec<usize>,
    /// Time to first token per request, simulated seconds (`None`: it could not be served,
    /// for it does not fit an engine's cache).
    pub ttft_s: Vec<Option<f64>>,
    /// Prompt tokens found cached per request.
    pub cached_tokens: Vec<usize>,
}

/// One engine: its scheduler, its clock, which request each of its sequences is, and which
/// of them still wait for their first token.
#[derive(Debug, Clone)]
struct Engine {
    scheduler: Scheduler,
    clock_us: f64,
    requests: HashMap<SeqId, usize>,
    awaiting: HashSet<SeqId>,
}

/// A first token: the request, when, and its cached prompt tokens.
type First = (usize, f64, usize);

impl Engine {
    /// Runs steps while the engine is busy and its clock is before `until_us`; an idle
    /// engine's clock moves to `until_us`. Each first token is passed to `first`.
    fn advance(&mut self, until_us: f64, first: &mut impl FnMut(First)) {
        while self.clock_us < until_us && !self.scheduler.is_idle() && self.step(first) {}
        if until_us.is_finite() {
            self.clock_us = self.clock_us.max(until_us);
        }
    }

    /// Runs one step and passes each first token to `first`; `false` when nothing was
    /// schedulable until something arrives (the live engine then waits).
    fn step(&mut self, first: &mut impl FnMut(First)) -> bool {
        let out = self.scheduler.step();
        if out.duration_us == 0.0 {
            return false;
        }
        self.clock_us += out.duration_us;
        for e in &out.emitted {
            let request = self.requests[&e.id];
            if e.index == 1 {
                self.awaiting.remove(&e.id);
                first((request, self.clock_us, e.cached_tokens));
            }
            if e.finished {
                self.requests.remove(&e.id);
            }
        }
        true
    }

    /// Queues request `index`; `None` if it does not fit this engine's cache.
    fn add(&mut self, index: usize, request: &Request) -> Option<SeqId> {
        let id = self
            .scheduler
            .add(request.prompt.clone(), request.output.clone(), ExtraKeys::default(), Remote::None)
            .ok()?;
        self.requests.insert(id, index);
        self.awaiting.insert(id);
        Some(id)
    }

    /// When request `index`, queued here now, would get its first token: on a copy
    /// (`None`: it does not fit, or the engine stalls).
    fn first_token_at(&self, index: usize, request: &Request) -> Option<f64> {
        let mut copy = self.clone();
        let id = copy.add(index, request)?;
        copy.first_token(id)
    }

    /// Steps until `id`'s first token is out; returns when it was.
    fn first_token(&mut self, id: SeqId) -> Option<f64> {
        while self.awaiting.contains(&id) {
            if !self.step(&mut |_| {}) {
                return None;
            }
        }
        Some(self.clock_us)
    }

    /// Request `index`'s TTFT alone on this (idle, fresh) engine once it holds the first
    /// `request.best_cached` tokens of its prompt.
    fn alone(mut self, index: usize, request: &Request) -> Option<f64> {
        if request.best_cached > 0 {
            let warm = Request {
                at_s: 0.0,
                prompt: request.prompt[..request.best_cached].to_vec(),
                output: vec![0],
                best_cached: 0,
            };
            let id = self.add(index, &warm)?;
            self.first_token(id)?;
            self.advance(f64::INFINITY, &mut |_| {});
        }
        let start = self.clock_us;
        let id = self.add(index, request)?;
        Some((self.first_token(id)? - start) / 1e6)
    }
}

/// How a replay picks each request's engine.
enum Choice<'a> {
    Given(&'a [usize]),
    Greedy,
}

/// Replays every placement of `input`, then the greedy one, on engines copied from `engine`;
/// then the floor.
pub fn run(input: &Input, engine: Scheduler) -> anyhow::Result<Vec<Replayed>> {
    validate(input)?;
    let fresh = Engine { scheduler: engine, clock_us: 0.0, requests: HashMap::new(), awaiting: HashSet::new() };
    let mut out = Vec::new();
    for p in &input.placements {
        out.push(replay(input, &fresh, &p.name, Choice::Given(&p.engines)));
    }
    out.push(replay(input, &fresh, GREEDY, Choice::Greedy));
    out.push(floor(input, &fresh));
    Ok(out)
}

fn validate(input: &Input) -> anyhow::Result<()> {
    anyhow::ensure!(input.engines > 0, "a fleet needs an engine");
    anyhow::ensure!(input.requests.windows(2).all(|w| w[0].at_s <= w[1].at_s), "requests must be in arrival order");
    for (i, r) in input.requests.iter().enumerate() {
        anyhow::ensure!(r.at_s.is_finite() && r.at_s >= 0.0, "request {i}: arrival must be a time");
        anyhow::ensure!(!r.prompt.is_empty() && !r.output.is_empty(), "request {i}: needs a prompt and an output");
        anyhow::ensure!(r.best_cached < r.prompt.len(), "request {i}: best_cached must be below the prompt's length");
    }
    for p in &input.placements {
        anyhow::ensure!(p.engines.len() == input.requests.len(), "placement {}: an engine per request", p.name);
        anyhow::ensure!(
            p.engines.iter().all(|&e| e < input.engines),
            "placement {}: engines are numbered from 0 to {}",
            p.name,
            input.engines - 1
        );
    }
    Ok(())
}

fn replay(input: &Input, fresh: &Engine, name: &str, choice: Choice) -> Replayed {
    let n = input.requests.len();
    let mut engines = vec![fresh.clone(); input.engines];
    let (mut ttft_s, mut cached_tokens, mut chosen) = (vec![None; n], vec![0; n], Vec::with_capacity(n));
    let mut first = |(request, at_us, cached): First| {
        ttft_s[request] = Some((at_us / 1e6 - input.requests[request].at_s).max(0.0));
        cached_tokens[request] = cached;
    };
    for (i, request) in input.requests.iter().enumerate() {
        let at_us = request.at_s * 1e6;
        for e in engines.iter_mut() {
            e.advance(at_us, &mut first);
        }
        let pick = match &choice {
            Choice::Given(placed) => placed[i],
            Choice::Greedy => greedy(&engines, i, request),
        };
        engines[pick].add(i, request);
        chosen.push(pick);
    }
    for e in engines.iter_mut() {
        e.advance(f64::INFINITY, &mut first);
    }
    Replayed { name: name.into(), engines: chosen, ttft_s, cached_tokens }
}

/// Each request alone on a fresh engine that holds its best-cached prefix: its TTFT there.
fn floor(input: &Input, fresh: &Engine) -> Replayed {
    let alone: Vec<(Option<f64>, usize)> =
        input.requests.iter().enumerate().map(|(i, r)| (fresh.clone().alone(i, r), r.best_cached)).collect();
    Replayed {
        name: FLOOR.into(),
        engines: Vec::new(),
        ttft_s: alone.iter().map(|a| a.0).collect(),
        cached_tokens: alone.iter().map(|a| a.1).collect(),
    }
}

/// The engine where request `index` gets its first token soonest (the first such on a tie).
fn greedy(engines: &[Engine], index: usize, request: &Request) -> usize {
    let at = |e: &Engine| e.first_token_at(index, request).unwrap_or(f64::INFINITY);
    let mut best = (0, f64::INFINITY);
    for (i, e) in engines.iter().enumerate() {
        let t = at(e);
        if t < best.1 {
            best = (i, t);
        }
    }
    best.0
}

/// Reads `path`, replays it, prints the results as JSON.
pub fn main(path: &std::path::Path, engine: Scheduler) -> anyhow::Result<()> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let input: Input = serde_json::from_slice(&text).with_context(|| format!("{} is not a replay", path.display()))?;
    let out = run(&input, engine)?;
    serde_json::to_writer(std::io::stdout().lock(), &out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvCache;
    use crate::scheduler::Limits;
    use crate::time_model::Preset;
    use crate::vllm_hash::{HashAlgo, VllmHasher};
    use rand::{Rng, SeedableRng};

    fn engine() -> Scheduler {
        let limits = Limits { max_num_seqs: 8, max_num_batched_tokens: 512 };
        let hasher = VllmHasher::new(HashAlgo::Sha256, None);
        Scheduler::new(limits, Preset::Llama8bH100.cost(), KvCache::new(16, 400, 0, hasher))
    }

    fn request(at_s: f64, prompt: std::ops::Range<u32>) -> Request {
        Request { at_s, prompt: prompt.collect(), output: vec![1, 2, 3], best_cached: 0 }
    }

    /// Equal TTFTs, but for rounding.
    fn close(a: &[Option<f64>], b: &[Option<f64>]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(a, b)| (a.unwrap() - b.unwrap()).abs() < 1e-9)
    }

    fn input(requests: Vec<Request>, placements: Vec<(&str, Vec<usize>)>) -> Input {
        let placements = placements.into_iter().map(|(n, e)| Placement { name: n.into(), engines: e }).collect();
        Input { engines: 2, requests, placements }
    }

    #[test]
    fn a_request_behind_another_waits_and_one_on_a_free_engine_does_not() {
        // Two long prompts at once: on one engine the second waits for the first's prefill.
        let requests = vec![request(0.0, 0..2000), request(0.0, 5000..7000)];
        let out = run(&input(requests, vec![("same", vec![0, 0]), ("spread", vec![0, 1])]), engine()).unwrap();
        let [same, spread, greedy, floor] = &out[..] else { panic!("four placements") };
        assert!(close(&floor.ttft_s, &spread.ttft_s), "alone is the floor: {:?}", floor.ttft_s);
        let alone = spread.ttft_s[0].unwrap();
        assert!((spread.ttft_s[1].unwrap() - alone).abs() < 1e-9, "both alone: {:?}", spread.ttft_s);
        assert!(same.ttft_s[1].unwrap() > 1.5 * alone, "queued behind: {:?}", same.ttft_s);
        assert_eq!(greedy.engines, vec![0, 1], "the greedy placement spreads them");
        assert!(close(&greedy.ttft_s, &spread.ttft_s));
    }

    #[test]
    fn the_greedy_placement_follows_the_cache() {
        // The second request shares the first's 1 984-token prefix, long after it finished.
        let mut second = request(10.0, 0..1984);
        second.prompt.extend(9000..9100);
        second.best_cached = 1984;
        let requests = vec![request(0.0, 0..2000), second];
        let out = run(&input(requests, vec![("away", vec![0, 1])]), engine()).unwrap();
        let [away, greedy, floor] = &out[..] else { panic!("three placements") };
        assert!(close(&floor.ttft_s, &greedy.ttft_s), "alone, the second with its prefix: {:?}", floor.ttft_s);
        assert_eq!(greedy.engines, vec![0, 0], "where its prefix is");
        assert_eq!(greedy.cached_tokens[1], 1984);
        assert_eq!(away.cached_tokens[1], 0);
        assert!(greedy.ttft_s[1].unwrap() < away.ttft_s[1].unwrap() / 3.0, "{:?} {:?}", greedy.ttft_s, away.ttft_s);
    }

    /// Whole blocks of `prompt` an infinite cache holds, after `seen` sequences were stored.
    fn best_cached(seen: &HashSet<Vec<u32>>, prompt: &[u32]) -> usize {
        let blocks = (prompt.len() - 1) / 16;
        (1..=blocks).take_while(|&k| seen.contains(&prompt[..k * 16])).last().unwrap_or(0) * 16
    }

    #[test]
    fn no_placement_beats_the_floor_for_any_request() {
        // Busy traffic over four shared prefixes on a tight cache: queues, evictions, hits.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (mut seen, mut requests) = (HashSet::new(), Vec::new());
        for i in 0..60 {
            let mut prompt: Vec<u32> = (0..800).map(|t| t + 10_000 * rng.random_range(0..4)).collect();
            prompt.extend((0..rng.random_range(50..400)).map(|_| rng.random_range(0..50_000)));
            let output: Vec<u32> = (0..rng.random_range(1..40)).collect();
            let best = best_cached(&seen, &prompt);
            let stored = [prompt.as_slice(), output.as_slice()].concat();
            seen.extend((1..=stored.len() / 16).map(|k| stored[..k * 16].to_vec()));
            requests.push(Request { at_s: i as f64 * 0.02, prompt, output, best_cached: best });
        }
        let own = (0..60).map(|i| (i * 7) % 2).collect();
        let rr = (0..60).map(|i| i % 2).collect();
        let out = run(&input(requests, vec![("own", own), ("rr", rr)]), engine()).unwrap();
        let floor = out.iter().find(|r| r.name == FLOOR).unwrap();
        for placed in out.iter().filter(|r| r.name != FLOOR) {
            for (i, (t, f)) in placed.ttft_s.iter().zip(&floor.ttft_s).enumerate() {
                let (t, f) = (t.unwrap(), f.unwrap());
                assert!(f <= t + 1e-9, "{}: request {i} took {t}, below its floor {f}", placed.name);
            }
        }
        let queued = out[0].ttft_s.iter().zip(&floor.ttft_s).filter(|(t, f)| t.unwrap() > f.unwrap() * 1.5).count();
        assert!(queued > 5, "the traffic is busy enough to queue: {queued}");
    }

    #[test]
    fn bad_input_is_refused_with_its_reason() {
        let unordered = input(vec![request(1.0, 0..10), request(0.0, 0..10)], vec![]);
        assert!(run(&unordered, engine()).unwrap_err().to_string().contains("arrival order"));
        let outside = input(vec![request(0.0, 0..10)], vec![("x", vec![2])]);
        assert!(run(&outside, engine()).unwrap_err().to_string().contains("from 0 to 1"));
        let short = input(vec![request(0.0, 0..10)], vec![("x", vec![])]);
        assert!(run(&short, engine()).unwrap_err().to_string().contains("an engine per request"));
    }

    #[test]
    fn a_request_too_long_for_the_cache_is_left_unserved() {
        let requests = vec![request(0.0, 0..100_000), request(0.0, 0..100)];
        let out = run(&input(requests, vec![("rr", vec![0, 1])]), engine()).unwrap();
        for r in &out {
            assert_eq!(r.ttft_s[0], None, "{}", r.name);
            assert!(r.ttft_s[1].is_some(), "{}", r.name);
        }
    }
}
