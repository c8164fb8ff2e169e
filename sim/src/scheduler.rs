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

#[derive(Debug, Clone)]
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
#[derive(Debug, Clone)]
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
mod tests;
