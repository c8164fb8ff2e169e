//! vLLM v1's scheduler, in simulated time: continuous batching, chunked prefill, preemption.
//!
//! Each [`Scheduler::step`] builds one batch the way vLLM's `Scheduler.schedule()` does:
//! 1. Running sequences first, in arrival order, each taking the tokens it still has to
//!    compute (a whole prompt chunk, or the one token a decode needs), within the
//!    `max_num_batched_tokens` budget. A sequence that cannot get KV blocks preempts the
//!    newest running one (recompute: its blocks are freed, it goes back to the head of the
//!    queue, and later finds its own freed blocks in the prefix cache if they survived).
//! 2. If nothing was preempted, waiting sequences are admitted while there is budget and
//!    fewer than `max_num_seqs` run: a prefix-cache lookup, then a first chunk.
//!
//! The step's duration comes from [`StepCost`]. When the step completes, every sequence that
//! has computed all its tokens samples one (the first token ends the prefill), and sequences
//! that reached their `max_tokens` finish and free their blocks. The scheduler is pure: no
//! clock, no I/O, so tests drive it step by step.

use std::collections::VecDeque;

use crate::extra_keys::ExtraKeys;
use crate::kv_cache::{Allocation, KvCache};
use crate::kv_events::Event;
use crate::time_model::{StepCost, StepWork};

/// Batch limits, as vLLM's flags of the same names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `--max-num-seqs`: sequences running at once.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens`: tokens computed per step (the chunked-prefill budget).
    pub max_num_batched_tokens: usize,
}

/// A request's id inside one scheduler.
pub type SeqId = u64;

/// A token a step produced for a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Emitted {
    /// The sequence.
    pub id: SeqId,
    /// The token.
    pub token: u32,
    /// Output tokens produced so far, this one included (1 for the first token).
    pub index: usize,
    /// Prompt tokens served from the cache (GPU or CPU tier) at the first admission.
    pub cached_tokens: usize,
    /// Whether this was the last token.
    pub finished: bool,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Simulated duration, in microseconds (0 when there was nothing to do).
    pub duration_us: f64,
    /// The batch.
    pub work: StepWork,
    /// Tokens produced.
    pub emitted: Vec<Emitted>,
    /// KV events of the step, in order.
    pub events: Vec<Event>,
}

/// A prompt that can never fit in the cache.
#[derive(Debug, thiserror::Error)]
#[error("the prompt needs {needed} KV blocks but the cache has {available}")]
pub struct TooLong {
    needed: usize,
    available: usize,
}

/// Cumulative counters, in vLLM's terms.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Of those, tokens found (GPU or CPU tier).
    pub prefix_hits: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Prompt tokens of admitted requests (once per request).
    pub prompt_tokens: u64,
    /// Output tokens produced.
    pub generation_tokens: u64,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    /// Prompt, then the output tokens sampled so far except the last one.
    tokens: Vec<u32>,
    /// The output tokens this request will produce (its `max_tokens`).
    output: Vec<u32>,
    generated: usize,
    computed: usize,
    scheduled: usize,
    prompt_len: usize,
    alloc: Option<Allocation>,
    cached_tokens: Option<usize>,
    /// Its LoRA adapter and `cache_salt`.
    keys: ExtraKeys,
}

/// KV blocks a request holds at its longest: the prompt plus every output token but the last
/// (the last one is sampled, never computed into the cache).
pub fn blocks_needed(prompt_len: usize, output_len: usize, block_size: usize) -> usize {
    (prompt_len + output_len.saturating_sub(1)).div_ceil(block_size)
}

/// One engine's (one data-parallel rank's) scheduler and KV cache.
#[derive(Debug)]
pub struct Scheduler {
    limits: Limits,
    cost: StepCost,
    cache: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_id: SeqId,
    counters: Counters,
}

impl Scheduler {
    /// A scheduler over `cache`.
    pub fn new(limits: Limits, cost: StepCost, cache: KvCache) -> Scheduler {
        Scheduler {
            limits,
            cost,
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            counters: Counters::default(),
        }
    }

    /// Queues a request that will produce `output` (at least one token), with its extra keys
    /// (LoRA adapter, `cache_salt`).
    pub fn add(&mut self, prompt: Vec<u32>, output: Vec<u32>, keys: ExtraKeys) -> Result<SeqId, TooLong> {
        debug_assert!(!prompt.is_empty() && !output.is_empty());
        let needed = blocks_needed(prompt.len(), output.len(), self.cache.block_size());
        if needed > self.cache.num_blocks() {
            return Err(TooLong { needed, available: self.cache.num_blocks() });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            output,
            generated: 0,
            computed: 0,
            scheduled: 0,
            alloc: None,
            cached_tokens: None,
            keys,
        });
        Ok(id)
    }

    /// Drops a request (its client went away), freeing its blocks. Returns the events.
    pub fn abort(&mut self, id: SeqId) -> Vec<Event> {
        let mut events = Vec::new();
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            self.waiting.iter().position(|s| s.id == id).and_then(|i| self.waiting.remove(i))
        };
        if let Some(alloc) = seq.and_then(|s| s.alloc) {
            self.cache.free(alloc, &mut events);
        }
        events
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting (including preempted ones).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Fraction of GPU blocks in use.
    pub fn cache_usage(&self) -> f64 {
        self.cache.usage()
    }

    /// Blocks in the GPU prefix cache (findable by hash).
    pub fn cached_blocks(&self) -> usize {
        self.cache.cached_blocks()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Resets the prefix cache (`AllBlocksCleared`); fails while requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> (bool, Vec<Event>) {
        let mut events = Vec::new();
        let ok = self.cache.reset(&mut events);
        (ok, events)
    }

    /// Runs one step: schedules a batch, charges its time, samples tokens.
    pub fn step(&mut self) -> StepOutcome {
        let mut out = StepOutcome::default();
        let mut budget = self.limits.max_num_batched_tokens;
        let preempted = self.schedule_running(&mut budget, &mut out);
        if !preempted {
            self.schedule_waiting(&mut budget, &mut out);
        }
        if out.work.is_empty() {
            return out;
        }
        out.duration_us = self.cost.step_us(&out.work);
        self.complete(&mut out);
        out
    }

    /// Schedules the running sequences; returns whether any was preempted.
    fn schedule_running(&mut self, budget: &mut usize, out: &mut StepOutcome) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let seq = &self.running[i];
            let n = (seq.tokens.len() - seq.computed).min(*budget);
            let target = seq.computed + n;
            loop {
                let seq = &mut self.running[i];
                let alloc = seq.alloc.as_mut().expect("running sequences hold blocks");
                if self.cache.ensure(alloc, target, &mut out.events).is_ok() {
                    break;
                }
                // vLLM preempts the lowest-priority request: with FCFS, the newest.
                let victim = self.running.pop().expect("the current sequence is running");
                self.preempt(victim, &mut out.events);
                preempted = true;
                if i == self.running.len() {
                    return preempted;
                }
            }
            let seq = &mut self.running[i];
            let alloc = seq.alloc.as_mut().expect("running sequences hold blocks");
            self.cache.commit(alloc, &seq.tokens[..target], &mut out.events);
            if seq.generated > 0 && seq.computed >= seq.prompt_len && n == 1 {
                out.work.decode(target);
            } else {
                out.work.prefill(seq.computed, n);
            }
            seq.scheduled = n;
            *budget -= n;
            i += 1;
        }
        preempted
    }

    /// Recompute preemption: free the blocks, start over from the head of the queue.
    fn preempt(&mut self, mut seq: Seq, events: &mut Vec<Event>) {
        if let Some(alloc) = seq.alloc.take() {
            self.cache.free(alloc, events);
        }
        seq.computed = 0;
        seq.scheduled = 0;
        self.counters.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Admits waiting sequences while budget, slots and blocks allow.
    fn schedule_waiting(&mut self, budget: &mut usize, out: &mut StepOutcome) {
        while *budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            let Ok(mut alloc) = self.cache.allocate(&seq.tokens, &seq.keys, *budget, &mut out.events) else {
                break;
            };
            let computed = alloc.computed_tokens();
            self.counters.prefix_queries += seq.tokens.len() as u64;
            self.counters.prefix_hits += computed as u64;
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(computed);
                self.counters.prompt_tokens += seq.prompt_len as u64;
            }
            out.work.cpu_blocks_loaded += (alloc.loaded_tokens / self.cache.block_size()) as u64;
            let n = (seq.tokens.len() - computed).min(*budget);
            self.cache.commit(&mut alloc, &seq.tokens[..computed + n], &mut out.events);
            out.work.prefill(computed, n);
            seq.computed = computed;
            seq.scheduled = n;
            seq.alloc = Some(alloc);
            *budget -= n;
            let seq = self.waiting.pop_front().expect("front exists");
            self.running.push(seq);
        }
    }

    /// The step's forward pass is done: advance, sample, finish.
    fn complete(&mut self, out: &mut StepOutcome) {
        for seq in &mut self.running {
            if seq.scheduled == 0 {
                continue;
            }
            seq.computed += seq.scheduled;
            seq.scheduled = 0;
            if seq.computed < seq.tokens.len() {
                continue; // a prefill chunk with more to come
            }
            let token = seq.output[seq.generated];
            seq.generated += 1;
            self.counters.generation_tokens += 1;
            let finished = seq.generated == seq.output.len();
            if !finished {
                seq.tokens.push(token);
            }
            out.emitted.push(Emitted {
                id: seq.id,
                token,
                index: seq.generated,
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                finished,
            });
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].generated == self.running[i].output.len() {
                let seq = self.running.remove(i);
                if let Some(alloc) = seq.alloc {
                    self.cache.free(alloc, &mut out.events);
                }
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_events::Medium;
    use crate::time_model::Preset;
    use crate::vllm_hash::{HashAlgo, VllmHasher};

    const BS: usize = 16;

    fn scheduler(blocks: usize, limits: Limits) -> Scheduler {
        let cache = KvCache::new(BS, blocks, 0, VllmHasher::new(HashAlgo::Sha256, None));
        Scheduler::new(limits, Preset::Llama8bH100.cost(), cache)
    }

    fn roomy() -> Limits {
        Limits { max_num_seqs: 256, max_num_batched_tokens: 8192 }
    }

    fn prompt(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| i.wrapping_mul(31).wrapping_add(salt)).collect()
    }

    fn output(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| 5000 + i).collect()
    }

    /// Steps until every request finished; returns the elapsed simulated time (µs), the
    /// first-token time of each sequence, and all outcomes.
    fn run(s: &mut Scheduler) -> (f64, Vec<(SeqId, f64)>, Vec<StepOutcome>) {
        let mut now = 0.0;
        let mut firsts = Vec::new();
        let mut outcomes = Vec::new();
        for _ in 0..100_000 {
            if s.is_idle() {
                return (now, firsts, outcomes);
            }
            let out = s.step();
            assert!(out.duration_us > 0.0, "a busy scheduler always makes progress");
            now += out.duration_us;
            firsts.extend(out.emitted.iter().filter(|e| e.index == 1).map(|e| (e.id, now)));
            outcomes.push(out);
        }
        panic!("did not finish");
    }

    fn stored(events: &[Event]) -> usize {
        events
            .iter()
            .map(|e| match e {
                Event::BlockStored { block_hashes, medium: Medium::Gpu, .. } => block_hashes.len(),
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn a_request_prefills_then_decodes_one_token_per_step() {
        let mut s = scheduler(1024, roomy());
        let id = s.add(prompt(100, 1), output(5), ExtraKeys::default()).unwrap();
        let first = s.step();
        assert_eq!(first.work.prefill_tokens, 100);
        assert_eq!(first.emitted, vec![Emitted { id, token: 5000, index: 1, cached_tokens: 0, finished: false }]);
        let (_, _, rest) = run(&mut s);
        assert_eq!(rest.len(), 4, "4 more decode steps");
        assert!(rest.iter().all(|o| o.work.decode_seqs == 1 && o.work.prefill_tokens == 0));
        assert!(rest.last().unwrap().emitted[0].finished);
    }

    #[test]
    fn chunked_prefill_splits_a_long_prompt_across_steps() {
        let mut s = scheduler(1024, Limits { max_num_seqs: 256, max_num_batched_tokens: 512 });
        s.add(prompt(1300, 1), output(2), ExtraKeys::default()).unwrap();
        let chunks: Vec<u64> = (0..3).map(|_| s.step().work.prefill_tokens).collect();
        assert_eq!(chunks, vec![512, 512, 276]);
    }

    #[test]
    fn a_decode_shares_the_step_with_a_prefill_chunk() {
        let mut s = scheduler(1024, Limits { max_num_seqs: 256, max_num_batched_tokens: 256 });
        s.add(prompt(32, 1), output(10), ExtraKeys::default()).unwrap();
        s.step();
        s.add(prompt(1000, 2), output(2), ExtraKeys::default()).unwrap();
        let mixed = s.step();
        assert_eq!((mixed.work.decode_seqs, mixed.work.prefill_tokens), (1, 255), "decode first, then a chunk");
    }

    #[test]
    fn prefix_hits_shorten_ttft_and_are_counted() {
        let mut s = scheduler(1024, roomy());
        let p = prompt(4000, 1);
        s.add(p.clone(), output(1), ExtraKeys::default()).unwrap();
        let (cold, _, _) = run(&mut s);
        let mut warm_prompt = p.clone();
        warm_prompt.extend(prompt(50, 9));
        s.add(warm_prompt, output(1), ExtraKeys::default()).unwrap();
        let (warm, _, outcomes) = run(&mut s);
        assert_eq!(outcomes[0].emitted[0].cached_tokens, 4000 / BS * BS);
        assert!(warm * 5.0 < cold, "warm TTFT {warm} µs vs cold {cold} µs");
        let c = s.counters();
        assert_eq!((c.prefix_queries, c.prefix_hits), (8050, 4000));
        assert_eq!((c.prompt_tokens, c.generation_tokens), (8050, 2));
    }

    #[test]
    fn max_num_seqs_caps_the_batch_and_throughput_saturates() {
        // Throughput (output tokens per simulated second) grows with offered concurrency up
        // to max_num_seqs, then stays flat: the extra requests only wait.
        let throughput = |concurrency: usize| {
            let mut s = scheduler(100_000, Limits { max_num_seqs: 8, max_num_batched_tokens: 8192 });
            for i in 0..concurrency {
                s.add(prompt(64, i as u32), output(64), ExtraKeys::default()).unwrap();
            }
            let (t, _, outcomes) = run(&mut s);
            assert!(outcomes.iter().all(|o| o.work.decode_seqs <= 8));
            (concurrency * 64) as f64 / t
        };
        let (t1, t4, t8, t16, t32) = (throughput(1), throughput(4), throughput(8), throughput(16), throughput(32));
        assert!(t4 > 3.0 * t1 && t8 > 1.5 * t4, "scales below the cap: {t1} {t4} {t8}");
        assert!((t16 - t8).abs() / t8 < 0.1 && (t32 - t8).abs() / t8 < 0.1, "flat above the cap: {t8} {t16} {t32}");
    }

    #[test]
    fn the_token_budget_caps_prefill_throughput() {
        let mut s = scheduler(100_000, Limits { max_num_seqs: 256, max_num_batched_tokens: 1024 });
        for i in 0..10 {
            s.add(prompt(1000, i), output(1), ExtraKeys::default()).unwrap();
        }
        let (_, _, outcomes) = run(&mut s);
        assert!(outcomes.iter().all(|o| o.work.prefill_tokens <= 1024));
        assert_eq!(outcomes.iter().map(|o| o.work.prefill_tokens).sum::<u64>(), 10_000);
    }

    #[test]
    fn out_of_blocks_preempts_the_newest_and_recomputes_it() {
        // 20 blocks of 16: two requests of 120 prompt + 100 output tokens cannot both finish.
        let mut s = scheduler(20, roomy());
        let a = s.add(prompt(120, 1), output(100), ExtraKeys::default()).unwrap();
        let b = s.add(prompt(120, 2), output(100), ExtraKeys::default()).unwrap();
        let (_, _, outcomes) = run(&mut s);
        assert!(s.counters().preemptions > 0);
        let tokens = |id| outcomes.iter().flat_map(|o| &o.emitted).filter(|e| e.id == id).count();
        assert_eq!((tokens(a), tokens(b)), (100, 100), "both complete, every token once");
        assert_eq!(s.cache_usage(), 0.0, "all blocks returned");
    }

    #[test]
    fn a_prompt_larger_than_the_cache_is_refused() {
        let mut s = scheduler(4, roomy());
        assert!(s.add(prompt(100, 1), output(1), ExtraKeys::default()).is_err());
    }

    #[test]
    fn decode_completed_blocks_are_stored_and_all_blocks_freed_at_the_end() {
        let mut s = scheduler(64, roomy());
        s.add(prompt(40, 1), output(30), ExtraKeys::default()).unwrap();
        let (_, _, outcomes) = run(&mut s);
        let events: Vec<Event> = outcomes.into_iter().flat_map(|o| o.events).collect();
        // 40 + 29 computed tokens = 4 full blocks of 16.
        assert_eq!(stored(&events), 4);
        assert_eq!(s.cache_usage(), 0.0);
    }

    #[test]
    fn abort_frees_the_blocks() {
        let mut s = scheduler(64, roomy());
        let id = s.add(prompt(100, 1), output(50), ExtraKeys::default()).unwrap();
        s.step();
        assert!(s.cache_usage() > 0.0);
        s.abort(id);
        assert!(s.is_idle());
        assert_eq!(s.cache_usage(), 0.0);
    }
}
