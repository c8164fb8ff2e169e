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
//!
//! Prefill/decode disaggregation ([`Remote`]), as vLLM's scheduler runs a KV connector:
//! - a sequence decoded elsewhere keeps its blocks when it finishes: they are held under a
//!   [`HoldKey`] until [`Scheduler::release`] (its decoder read them) or
//!   [`Scheduler::expire`];
//! - a sequence prefilled elsewhere is admitted without compute budget or a running slot: it
//!   gets blocks for its whole prompt past the local prefix hit and waits, outside the queue
//!   (vLLM's `WAITING_FOR_REMOTE_KVS`), while the engine loads them ([`Load`]); then
//!   [`Scheduler::finish_load`] caches the loaded blocks and puts it back at the head of the
//!   queue to compute what is left.

use std::collections::{HashMap, VecDeque};

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
    /// Remote prefills admitted this step, for the engine to load.
    pub loads: Vec<Load>,
    /// Finished sequences whose blocks are now held for their remote decoder.
    pub held: Vec<Held>,
}

/// Where a request's KV comes from or goes to, under prefill/decode disaggregation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Remote {
    /// Prefilled and decoded here.
    None,
    /// Decoded elsewhere (vLLM's `do_remote_decode`, an SGLang prefill server's request): when
    /// it finishes, its blocks are held under the key for the decoder to read.
    Decode(HoldKey),
    /// Prefilled elsewhere (vLLM's `do_remote_prefill`, an SGLang decode server's request):
    /// the prompt past the local prefix hit is loaded, not computed.
    Prefill(LoadMode),
}

/// What finished blocks are held under until their decoder reads them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HoldKey {
    /// vLLM: the prefill request's id (`remote_request_id`).
    Request(String),
    /// SGLang: the bootstrap room.
    Room(u64),
}

/// How a decoder carries on once a remote prefill is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// vLLM (`Scheduler._update_waiting_for_remote_kv`): the loaded prompt counts as computed
    /// but for its last token, which the decoder computes to sample its own first token.
    RecomputeLast,
    /// SGLang (`decode.py`): the whole prompt is loaded with the first token the prefill
    /// sampled, and decoding goes on from there without a prefill pass.
    WithFirstToken,
}

/// A remote prefill to load: the engine fetches it, then calls [`Scheduler::finish_load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// The sequence.
    pub id: SeqId,
    /// Prompt tokens found locally (GPU or CPU tier): not loaded.
    pub local_tokens: usize,
    /// Prompt tokens to load.
    pub tokens: usize,
    /// The blocks they fill (the last one may be partial).
    pub blocks: usize,
}

/// A finished sequence's blocks, held for its remote decoder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// The sequence.
    pub id: SeqId,
    /// What they are held under.
    pub key: HoldKey,
    /// The block ids, in sequence order (vLLM's `remote_block_ids`).
    pub block_ids: Vec<usize>,
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
    /// Of the prompt tokens, those computed here (vLLM's `local_compute` source).
    pub prompt_computed: u64,
    /// Those found in the GPU prefix cache (`local_cache_hit`).
    pub prompt_local_hits: u64,
    /// Those loaded: from the CPU tier or a remote prefill (`external_kv_transfer`).
    pub prompt_external: u64,
    /// Those not computed (`vllm:prompt_tokens_cached`).
    pub prompt_cached: u64,
    /// Cached tokens computed anyway: a whole prompt cached but its last token, which a
    /// request always computes (`vllm:prompt_tokens_recomputed`).
    pub prompt_recomputed: u64,
}

impl Counters {
    /// Counts a request's prompt once what it need not compute is known (`cached`, of which
    /// `external` was loaded), by source as vLLM's `PromptTokenStats.update_from_output` does.
    fn prompt(&mut self, len: usize, cached: usize, external: usize) {
        let recomputed = usize::from(cached + 1 == len);
        self.prompt_tokens += len as u64;
        self.prompt_computed += (len - cached) as u64;
        self.prompt_external += external as u64;
        self.prompt_local_hits += (cached + recomputed).saturating_sub(external) as u64;
        self.prompt_cached += cached as u64;
        self.prompt_recomputed += recomputed as u64;
    }
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
    /// Where its KV comes from or goes to.
    remote: Remote,
    /// Prompt tokens loaded rather than computed (CPU tier, remote prefill).
    external: usize,
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
    /// Remote prefills being loaded, with how they carry on.
    loading: Vec<(LoadMode, Seq)>,
    /// Blocks of finished sequences held for remote decoders, with the sequence they were.
    held: HashMap<HoldKey, (SeqId, Allocation)>,
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
            loading: Vec::new(),
            held: HashMap::new(),
            next_id: 0,
            counters: Counters::default(),
        }
    }

    /// Queues a request that will produce `output` (at least one token), with its extra keys
    /// (LoRA adapter, `cache_salt`) and where its KV comes from or goes to.
    pub fn add(
        &mut self,
        prompt: Vec<u32>,
        output: Vec<u32>,
        keys: ExtraKeys,
        remote: Remote,
    ) -> Result<SeqId, TooLong> {
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
            remote,
            external: 0,
        });
        Ok(id)
    }

    /// Drops a request (its client went away, or its remote prefill could not be loaded),
    /// freeing its blocks. Returns the events.
    pub fn abort(&mut self, id: SeqId) -> Vec<Event> {
        let mut events = Vec::new();
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else if let Some(i) = self.loading.iter().position(|(_, s)| s.id == id) {
            Some(self.loading.remove(i).1)
        } else {
            self.waiting.iter().position(|s| s.id == id).and_then(|i| self.waiting.remove(i))
        };
        if let Some(alloc) = seq.and_then(|s| s.alloc) {
            self.cache.free(alloc, &mut events);
        }
        events
    }

    /// Whether nothing is queued, loading or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.loading.is_empty()
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting (including preempted ones, and remote prefills being loaded, which
    /// vLLM keeps in its waiting queue).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.loading.len()
    }

    /// A remote load is over. Loaded, the prompt counts as computed (but for its last token
    /// with [`LoadMode::RecomputeLast`]) and its full blocks are cached, with `BlockStored`,
    /// as vLLM caches the blocks a connector loaded; with [`LoadMode::WithFirstToken`] the
    /// prefill's first token is emitted now. Not loaded, the sequence computes its prompt
    /// past the local prefix hit (vLLM's `recompute` policy). Either way it is local from now
    /// on (a preemption recomputes it) and goes back to the head of the queue. `None` if the
    /// sequence is gone (aborted meanwhile).
    pub fn finish_load(&mut self, id: SeqId, loaded: bool) -> Option<(Vec<Event>, Option<Emitted>)> {
        let i = self.loading.iter().position(|(_, s)| s.id == id)?;
        let (mode, mut seq) = self.loading.remove(i);
        let mut events = Vec::new();
        let len = seq.tokens.len();
        if !loaded {
            seq.cached_tokens = Some(seq.computed);
            self.counters.prompt(len, seq.computed, seq.external);
            self.waiting.push_front(seq);
            return Some((events, None));
        }
        seq.external += len - seq.computed;
        seq.computed = match mode {
            LoadMode::RecomputeLast => len - 1,
            LoadMode::WithFirstToken => len,
        };
        let alloc = seq.alloc.as_mut().expect("loading sequences hold blocks");
        self.cache.commit(alloc, &seq.tokens[..seq.computed], &mut events);
        seq.cached_tokens = Some(seq.computed);
        self.counters.prompt(len, seq.computed, seq.external);
        if mode == LoadMode::RecomputeLast {
            self.waiting.push_front(seq);
            return Some((events, None));
        }
        let token = seq.output[0];
        seq.generated = 1;
        self.counters.generation_tokens += 1;
        let finished = seq.output.len() == 1;
        let first = Emitted { id, token, index: 1, cached_tokens: len, finished };
        if finished {
            if let Some(alloc) = seq.alloc.take() {
                self.cache.free(alloc, &mut events);
            }
        } else {
            seq.tokens.push(token);
            self.waiting.push_front(seq);
        }
        Some((events, Some(first)))
    }

    /// A decoder read the blocks held under `key`: they are freed (and stay in the prefix
    /// cache, findable, until evicted). Returns their ids, or `None` if nothing is held under
    /// the key.
    pub fn release(&mut self, key: &HoldKey, events: &mut Vec<Event>) -> Option<Vec<usize>> {
        let (_, alloc) = self.held.remove(key)?;
        let ids = alloc.block_ids().to_vec();
        self.cache.free(alloc, events);
        Some(ids)
    }

    /// The hold of sequence `id` under `key` timed out: its blocks are freed. False if they
    /// were read meanwhile (the key may hold a later sequence's blocks by then).
    pub fn expire(&mut self, key: &HoldKey, id: SeqId, events: &mut Vec<Event>) -> bool {
        if self.held.get(key).is_none_or(|(held, _)| *held != id) {
            return false;
        }
        self.release(key, events);
        true
    }

    /// Blocks held for remote decoders (a block two holds share counts twice).
    pub fn held_blocks(&self) -> usize {
        self.held.values().map(|(_, alloc)| alloc.block_ids().len()).sum()
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
            charge(&mut out.work, seq, n);
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

    /// Admits waiting sequences while budget, slots and blocks allow. A remote prefill takes
    /// blocks for its whole prompt but neither budget nor a slot, and goes to be loaded.
    fn schedule_waiting(&mut self, budget: &mut usize, out: &mut StepOutcome) {
        while *budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else { break };
            if let Some(alloc) = seq.alloc.as_mut() {
                // Back from a remote load: its blocks are taken and its prefix is computed.
                let n = (seq.tokens.len() - seq.computed).min(*budget);
                let target = seq.computed + n;
                if self.cache.ensure(alloc, target, &mut out.events).is_err() {
                    break;
                }
                self.cache.commit(alloc, &seq.tokens[..target], &mut out.events);
                charge(&mut out.work, seq, n);
                seq.scheduled = n;
                *budget -= n;
                let seq = self.waiting.pop_front().expect("front exists");
                self.running.push(seq);
                continue;
            }
            let load = match seq.remote {
                Remote::Prefill(mode) => Some(mode),
                _ => None,
            };
            let take = if load.is_some() { seq.tokens.len() } else { *budget };
            let Ok(mut alloc) = self.cache.allocate(&seq.tokens, &seq.keys, take, &mut out.events) else {
                break;
            };
            let computed = alloc.computed_tokens();
            self.counters.prefix_queries += seq.tokens.len() as u64;
            self.counters.prefix_hits += computed as u64;
            out.work.cpu_blocks_loaded += (alloc.loaded_tokens / self.cache.block_size()) as u64;
            seq.external = alloc.loaded_tokens;
            seq.computed = computed;
            if let Some(mode) = load {
                let block_size = self.cache.block_size();
                out.loads.push(Load {
                    id: seq.id,
                    local_tokens: computed,
                    tokens: seq.tokens.len() - computed,
                    blocks: seq.tokens.len().div_ceil(block_size) - computed / block_size,
                });
                seq.alloc = Some(alloc);
                let seq = self.waiting.pop_front().expect("front exists");
                self.loading.push((mode, seq));
                continue;
            }
            if seq.cached_tokens.is_none() {
                seq.cached_tokens = Some(computed);
                self.counters.prompt(seq.prompt_len, computed, seq.external);
            }
            let n = (seq.tokens.len() - computed).min(*budget);
            self.cache.commit(&mut alloc, &seq.tokens[..computed + n], &mut out.events);
            out.work.prefill(computed, n);
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
                    match seq.remote {
                        Remote::Decode(key) => self.hold(seq.id, key, alloc, out),
                        _ => self.cache.free(alloc, &mut out.events),
                    }
                }
            } else {
                i += 1;
            }
        }
    }

    /// Keeps a finished sequence's blocks for its remote decoder.
    fn hold(&mut self, id: SeqId, key: HoldKey, alloc: Allocation, out: &mut StepOutcome) {
        out.held.push(Held { id, key: key.clone(), block_ids: alloc.block_ids().to_vec() });
        if let Some((_, replaced)) = self.held.insert(key, (id, alloc)) {
            // The key was reused before its decoder came: nobody can read the older blocks.
            self.cache.free(replaced, &mut out.events);
        }
    }
}

/// Adds `n` scheduled tokens of `seq` to the step's work: one token of a sequence past its
/// prompt is a decode, anything else a prefill chunk.
fn charge(work: &mut StepWork, seq: &Seq, n: usize) {
    if seq.generated > 0 && seq.computed >= seq.prompt_len && n == 1 {
        work.decode(seq.computed + n);
    } else {
        work.prefill(seq.computed, n);
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
        let id = s.add(prompt(100, 1), output(5), ExtraKeys::default(), Remote::None).unwrap();
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
        s.add(prompt(1300, 1), output(2), ExtraKeys::default(), Remote::None).unwrap();
        let chunks: Vec<u64> = (0..3).map(|_| s.step().work.prefill_tokens).collect();
        assert_eq!(chunks, vec![512, 512, 276]);
    }

    #[test]
    fn a_decode_shares_the_step_with_a_prefill_chunk() {
        let mut s = scheduler(1024, Limits { max_num_seqs: 256, max_num_batched_tokens: 256 });
        s.add(prompt(32, 1), output(10), ExtraKeys::default(), Remote::None).unwrap();
        s.step();
        s.add(prompt(1000, 2), output(2), ExtraKeys::default(), Remote::None).unwrap();
        let mixed = s.step();
        assert_eq!((mixed.work.decode_seqs, mixed.work.prefill_tokens), (1, 255), "decode first, then a chunk");
    }

    #[test]
    fn prefix_hits_shorten_ttft_and_are_counted() {
        let mut s = scheduler(1024, roomy());
        let p = prompt(4000, 1);
        s.add(p.clone(), output(1), ExtraKeys::default(), Remote::None).unwrap();
        let (cold, _, _) = run(&mut s);
        let mut warm_prompt = p.clone();
        warm_prompt.extend(prompt(50, 9));
        s.add(warm_prompt, output(1), ExtraKeys::default(), Remote::None).unwrap();
        let (warm, _, outcomes) = run(&mut s);
        assert_eq!(outcomes[0].emitted[0].cached_tokens, 4000 / BS * BS);
        assert!(warm * 5.0 < cold, "warm TTFT {warm} µs vs cold {cold} µs");
        let c = s.counters();
        assert_eq!((c.prefix_queries, c.prefix_hits), (8050, 4000));
        assert_eq!((c.prompt_tokens, c.generation_tokens), (8050, 2));
    }

    #[test]
    fn children_of_one_prompt_compute_it_once_and_find_its_blocks() {
        // vLLM's parallel sampling (n = 3): three requests with one prompt, queued together.
        // The first caches the prompt's full blocks as it is scheduled; the others, scheduled
        // after it in the same step, find them (up to len − 1 tokens) and compute the rest.
        let mut s = scheduler(64, roomy());
        let p = prompt(100, 1);
        let ids: Vec<SeqId> = (0..3)
            .map(|c| {
                let output = (0..2).map(|i| 5000 + 10 * c + i).collect();
                s.add(p.clone(), output, ExtraKeys::default(), Remote::None).unwrap()
            })
            .collect();
        let first = s.step();
        assert_eq!(first.work.prefill_tokens, 100 + 4 + 4, "the prompt once, then each child's last 4 tokens");
        let emitted: Vec<(SeqId, usize)> = first.emitted.iter().map(|e| (e.id, e.cached_tokens)).collect();
        assert_eq!(emitted, vec![(ids[0], 0), (ids[1], 96), (ids[2], 96)], "in the order they were queued");
        assert_eq!(stored(&first.events), 6, "the prompt's 6 full blocks, stored once");
        assert_eq!(s.cache_usage(), 9.0 / 64.0, "6 shared blocks, and a tail block each");
        let c = s.counters();
        assert_eq!((c.prompt_tokens, c.prompt_computed, c.prompt_local_hits), (300, 108, 192));
        assert_eq!((c.prefix_queries, c.prefix_hits), (300, 192));
        let (_, _, rest) = run(&mut s);
        assert_eq!(rest.len(), 1, "the second tokens, decoded together");
        assert_eq!(rest[0].work.decode_seqs, 3);
        assert_eq!(s.cache_usage(), 0.0);
    }

    #[test]
    fn max_num_seqs_caps_the_batch_and_throughput_saturates() {
        // Throughput (output tokens per simulated second) grows with offered concurrency up
        // to max_num_seqs, then stays flat: the extra requests only wait.
        let throughput = |concurrency: usize| {
            let mut s = scheduler(100_000, Limits { max_num_seqs: 8, max_num_batched_tokens: 8192 });
            for i in 0..concurrency {
                s.add(prompt(64, i as u32), output(64), ExtraKeys::default(), Remote::None).unwrap();
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
            s.add(prompt(1000, i), output(1), ExtraKeys::default(), Remote::None).unwrap();
        }
        let (_, _, outcomes) = run(&mut s);
        assert!(outcomes.iter().all(|o| o.work.prefill_tokens <= 1024));
        assert_eq!(outcomes.iter().map(|o| o.work.prefill_tokens).sum::<u64>(), 10_000);
    }

    #[test]
    fn out_of_blocks_preempts_the_newest_and_recomputes_it() {
        // 20 blocks of 16: two requests of 120 prompt + 100 output tokens cannot both finish.
        let mut s = scheduler(20, roomy());
        let a = s.add(prompt(120, 1), output(100), ExtraKeys::default(), Remote::None).unwrap();
        let b = s.add(prompt(120, 2), output(100), ExtraKeys::default(), Remote::None).unwrap();
        let (_, _, outcomes) = run(&mut s);
        assert!(s.counters().preemptions > 0);
        let tokens = |id| outcomes.iter().flat_map(|o| &o.emitted).filter(|e| e.id == id).count();
        assert_eq!((tokens(a), tokens(b)), (100, 100), "both complete, every token once");
        assert_eq!(s.cache_usage(), 0.0, "all blocks returned");
    }

    #[test]
    fn a_prompt_larger_than_the_cache_is_refused() {
        let mut s = scheduler(4, roomy());
        assert!(s.add(prompt(100, 1), output(1), ExtraKeys::default(), Remote::None).is_err());
    }

    #[test]
    fn decode_completed_blocks_are_stored_and_all_blocks_freed_at_the_end() {
        let mut s = scheduler(64, roomy());
        s.add(prompt(40, 1), output(30), ExtraKeys::default(), Remote::None).unwrap();
        let (_, _, outcomes) = run(&mut s);
        let events: Vec<Event> = outcomes.into_iter().flat_map(|o| o.events).collect();
        // 40 + 29 computed tokens = 4 full blocks of 16.
        assert_eq!(stored(&events), 4);
        assert_eq!(s.cache_usage(), 0.0);
    }

    #[test]
    fn abort_frees_the_blocks() {
        let mut s = scheduler(64, roomy());
        let id = s.add(prompt(100, 1), output(50), ExtraKeys::default(), Remote::None).unwrap();
        s.step();
        assert!(s.cache_usage() > 0.0);
        s.abort(id);
        assert!(s.is_idle());
        assert_eq!(s.cache_usage(), 0.0);
    }

    fn key(name: &str) -> HoldKey {
        HoldKey::Request(name.into())
    }

    fn remote_decode(s: &mut Scheduler, p: Vec<u32>, name: &str) -> (SeqId, Held) {
        let id = s.add(p, output(1), ExtraKeys::default(), Remote::Decode(key(name))).unwrap();
        let (_, _, outcomes) = run(s);
        let held: Vec<Held> = outcomes.into_iter().flat_map(|o| o.held).collect();
        assert_eq!(held.len(), 1);
        (id, held[0].clone())
    }

    #[test]
    fn a_remote_decode_holds_its_blocks_until_its_decoder_reads_them() {
        let mut s = scheduler(64, roomy());
        let (id, held) = remote_decode(&mut s, prompt(100, 1), "r1");
        assert_eq!((held.id, held.key.clone(), held.block_ids.len()), (id, key("r1"), 7), "100 tokens fill 7 blocks");
        assert!(s.is_idle(), "nothing left to run");
        assert_eq!((s.held_blocks(), s.cache_usage()), (7, 7.0 / 64.0), "held blocks stay in use");
        let cached = s.cached_blocks();
        let mut events = Vec::new();
        assert_eq!(s.release(&key("r1"), &mut events), Some(held.block_ids));
        assert_eq!((s.held_blocks(), s.cache_usage(), s.cached_blocks()), (0, 0.0, cached), "freed, still cached");
        assert_eq!(s.release(&key("r1"), &mut events), None, "read once");
    }

    #[test]
    fn a_hold_expires_unless_read_and_only_its_own() {
        let mut s = scheduler(64, roomy());
        let (first, _) = remote_decode(&mut s, prompt(40, 1), "r");
        let (second, _) = remote_decode(&mut s, prompt(40, 2), "r");
        assert_eq!(s.held_blocks(), 3, "the reused key dropped the first hold");
        let mut events = Vec::new();
        assert!(!s.expire(&key("r"), first, &mut events), "the first one's timer finds the second's blocks");
        assert!(s.expire(&key("r"), second, &mut events));
        assert_eq!((s.held_blocks(), s.cache_usage()), (0, 0.0));
        assert!(!s.expire(&key("r"), second, &mut events), "gone");
    }

    #[test]
    fn a_vllm_remote_prefill_is_loaded_then_computes_only_its_last_token() {
        let mut s = scheduler(64, roomy());
        // 64 tokens of the prompt are cached locally.
        let p = prompt(100, 1);
        s.add(p[..70].to_vec(), output(1), ExtraKeys::default(), Remote::None).unwrap();
        run(&mut s);
        let before = s.counters();
        let id = s.add(p.clone(), output(3), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
        let admitted = s.step();
        assert_eq!(admitted.loads, vec![Load { id, local_tokens: 64, tokens: 36, blocks: 3 }]);
        assert!(admitted.work.is_empty() && admitted.duration_us == 0.0, "a load takes no compute");
        assert_eq!((s.num_waiting(), s.num_running(), s.is_idle()), (1, 0, false));
        assert!(s.step().work.is_empty(), "nothing to do while it loads");
        let (events, first) = s.finish_load(id, true).unwrap();
        assert_eq!(first, None);
        // 99 tokens count as computed: blocks 5 and 6 (of 16 tokens) are stored now.
        assert_eq!(stored(&events), 2);
        let (_, _, outcomes) = run(&mut s);
        assert_eq!(outcomes[0].work.prefill_tokens, 1, "the last prompt token");
        assert!(outcomes[1..].iter().all(|o| o.work.prefill_tokens == 0 && o.work.decode_seqs == 1));
        let emitted: Vec<&Emitted> = outcomes.iter().flat_map(|o| &o.emitted).collect();
        assert_eq!(emitted.len(), 3);
        assert_eq!(emitted[0].cached_tokens, 99, "vLLM reports the loaded prompt as cached");
        let c = s.counters();
        let d = |f: fn(&Counters) -> u64| f(&c) - f(&before);
        let by_source = (d(|c| c.prompt_computed), d(|c| c.prompt_local_hits), d(|c| c.prompt_external));
        assert_eq!(by_source, (1, 64, 36));
        assert_eq!((d(|c| c.prompt_cached), d(|c| c.prompt_recomputed), d(|c| c.prompt_tokens)), (99, 1, 100));
        assert_eq!(s.cache_usage(), 0.0);
    }

    #[test]
    fn an_sglang_remote_prefill_arrives_with_its_first_token() {
        let mut s = scheduler(64, roomy());
        let id =
            s.add(prompt(100, 1), output(3), ExtraKeys::default(), Remote::Prefill(LoadMode::WithFirstToken)).unwrap();
        let load = s.step().loads[0];
        assert_eq!((load.local_tokens, load.tokens, load.blocks), (0, 100, 7));
        let (events, first) = s.finish_load(id, true).unwrap();
        assert_eq!(stored(&events), 6);
        assert_eq!(first, Some(Emitted { id, token: 5000, index: 1, cached_tokens: 100, finished: false }));
        let (_, _, outcomes) = run(&mut s);
        assert_eq!(outcomes.len(), 2, "two more tokens, decoded");
        assert!(outcomes.iter().all(|o| o.work.prefill_tokens == 0 && o.work.decode_seqs == 1));
        let c = s.counters();
        assert_eq!((c.prompt_computed, c.prompt_external, c.prompt_cached, c.generation_tokens), (0, 100, 100, 3));
        // A one-token request finishes with its load.
        let id =
            s.add(prompt(20, 2), output(1), ExtraKeys::default(), Remote::Prefill(LoadMode::WithFirstToken)).unwrap();
        s.step();
        let (_, first) = s.finish_load(id, true).unwrap();
        assert!(first.unwrap().finished);
        assert!(s.is_idle());
        assert_eq!(s.cache_usage(), 0.0);
    }

    #[test]
    fn a_failed_load_computes_the_prompt_here() {
        let mut s = scheduler(64, Limits { max_num_seqs: 256, max_num_batched_tokens: 64 });
        let id =
            s.add(prompt(100, 1), output(2), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
        s.step();
        let (_, first) = s.finish_load(id, false).unwrap();
        assert_eq!(first, None);
        let (_, _, outcomes) = run(&mut s);
        let chunks: Vec<u64> = outcomes.iter().map(|o| o.work.prefill_tokens).filter(|n| *n > 0).collect();
        assert_eq!(chunks, vec![64, 36], "chunked prefill of the whole prompt");
        assert_eq!(outcomes.iter().flat_map(|o| &o.emitted).next().unwrap().cached_tokens, 0);
        let c = s.counters();
        assert_eq!((c.prompt_computed, c.prompt_external, c.prompt_cached), (100, 0, 0));
        assert_eq!(s.finish_load(id, true), None, "unknown once it left the loading set");
    }

    #[test]
    fn aborting_a_loading_request_frees_its_blocks() {
        let mut s = scheduler(64, roomy());
        let id =
            s.add(prompt(100, 1), output(2), ExtraKeys::default(), Remote::Prefill(LoadMode::RecomputeLast)).unwrap();
        s.step();
        assert!(s.cache_usage() > 0.0, "blocks are taken for the load");
        s.abort(id);
        assert!(s.is_idle());
        assert_eq!(s.cache_usage(), 0.0);
        assert_eq!(s.finish_load(id, true), None);
    }
}
