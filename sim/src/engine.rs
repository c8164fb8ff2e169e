//! The engine: one [`Scheduler`] per data-parallel rank, each driven by its own task in
//! (optionally sped-up) wall-clock time, publishing its KV events after every step.
//!
//! A rank's loop: take new requests, run a step, sleep until the step's simulated end
//! (`duration / speedup` of wall time, against an absolute deadline so timer slack does not
//! accumulate), publish the step's events, hand each produced token to its request. A
//! request whose client went away is aborted and its blocks freed.
//!
//! Under prefill/decode disaggregation ([`Transfer`]) the loop also moves KV: a remote
//! prefill the scheduler admits is loaded by a task of its own ([`Puller`]), which reports
//! back to the loop; blocks held for a remote decoder are freed when it reads them
//! ([`Engine::release`]) or when the hold times out; and a request's [`Ending`] tells its
//! client what became of its blocks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

use crate::extra_keys::ExtraKeys;
use crate::histogram::Histogram;
use crate::kv_cache::KvCache;
use crate::kv_events::{Event, Publisher};
use crate::kv_transfer::{FailurePolicy, Puller, Source};
use crate::scheduler::{blocks_needed, Emitted, Held, HoldKey, Limits, Load, Remote, Scheduler, SeqId};
use crate::time_model::StepCost;
use crate::vllm_hash::VllmHasher;

/// Engine settings (per rank: every rank gets the same).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// GPU blocks per rank.
    pub num_gpu_blocks: usize,
    /// CPU offload blocks per rank (0: no CPU tier).
    pub cpu_offload_blocks: usize,
    /// Batch limits.
    pub limits: Limits,
    /// The step-time model.
    pub cost: StepCost,
    /// Simulated time runs this many times faster than the wall clock.
    pub speedup: f64,
    /// vLLM's block hasher.
    pub hasher: VllmHasher,
    /// How KV moves between engines, with disaggregation on.
    pub transfer: Option<TransferSetup>,
}

/// How an engine moves KV to and from other engines.
#[derive(Debug, Clone)]
pub struct TransferSetup {
    /// Loads remote prefills.
    pub puller: Puller,
    /// What a remote prefill that cannot be loaded does.
    pub on_failure: FailurePolicy,
    /// How long blocks wait for their remote decoder (wall time).
    pub hold: Duration,
}

/// A rank's live numbers, for `/metrics`.
#[derive(Debug, Default)]
pub struct RankStats {
    /// Sequences running.
    pub running: AtomicU64,
    /// Sequences waiting.
    pub waiting: AtomicU64,
    /// GPU cache usage, as `f64` bits.
    pub usage_bits: AtomicU64,
    /// Blocks in the GPU prefix cache.
    pub cached_blocks: AtomicU64,
    /// Prompt tokens looked up.
    pub prefix_queries: AtomicU64,
    /// Prompt tokens found.
    pub prefix_hits: AtomicU64,
    /// Preemptions.
    pub preemptions: AtomicU64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: AtomicU64,
    /// Output tokens produced.
    pub generation_tokens: AtomicU64,
    /// Prompt tokens computed here.
    pub prompt_computed: AtomicU64,
    /// Prompt tokens found in the GPU prefix cache.
    pub prompt_local_hits: AtomicU64,
    /// Prompt tokens loaded (CPU tier, remote prefill).
    pub prompt_external: AtomicU64,
    /// Prompt tokens not computed.
    pub prompt_cached: AtomicU64,
    /// Cached prompt tokens computed anyway (a prompt's last token).
    pub prompt_recomputed: AtomicU64,
    /// Requests decoded here after a remote prefill was loaded (decode side).
    pub remote_prefills: AtomicU64,
    /// Requests whose blocks were held for a remote decoder (prefill side).
    pub remote_decodes: AtomicU64,
    /// Prompt tokens loaded from remote prefills.
    pub transferred_tokens: AtomicU64,
    /// Remote prefills that could not be loaded.
    pub transfer_failures: AtomicU64,
    /// Holds whose decoder did not come in time.
    pub expired_holds: AtomicU64,
    /// Blocks held for remote decoders now.
    pub held_blocks: AtomicU64,
    /// SGLang prefill requests whose decoder never joined their room.
    pub bootstrap_failures: AtomicU64,
    /// Wall time the steps were given (their simulated durations over the speedup), µs.
    pub step_wall_us: AtomicU64,
    /// Wall time the loop fell behind the simulated clock and did not catch up (the clock
    /// was restarted from now: simulated time ran slow by that much), µs. Near zero when the
    /// host keeps up; a benchmark whose engines lose time here measures the host.
    pub clock_lost_us: AtomicU64,
    /// How often the simulated clock was restarted because the loop fell behind.
    pub clock_resets: AtomicU64,
    /// Time to first token, in simulated seconds.
    pub ttft: Mutex<Histogram>,
}

impl RankStats {
    /// GPU cache usage in [0, 1].
    pub fn usage(&self) -> f64 {
        f64::from_bits(self.usage_bits.load(Ordering::Relaxed))
    }
}

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The prompt (plus its output) can never fit in the cache.
    #[error("the request needs {needed} KV blocks but the cache has {available}")]
    TooLong {
        /// Blocks needed.
        needed: usize,
        /// Blocks in the cache.
        available: usize,
    },
    /// The rank's loop is gone (the process is shutting down).
    #[error("the engine is shutting down")]
    Stopped,
}

/// What a request asks of KV transfer.
#[derive(Debug)]
pub enum Transfer {
    /// Nothing: prefilled and decoded here.
    None,
    /// Prefill for a remote decoder: when done, hold the blocks under the key.
    Hold(HoldKey),
    /// Decode after a remote prefill: load the prompt from the source.
    Load(Source),
}

/// How a request ended, beyond its tokens.
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    /// Its blocks are held for its remote decoder: their ids.
    Held(Vec<usize>),
    /// Its remote prefill could not be loaded, and it failed: why.
    TransferFailed(String),
}

/// One engine request: a prompt and the output tokens it will produce, its extra keys and KV
/// transfer. An API request is one or more of them (a completion's prompts, `n` children each).
#[derive(Debug)]
pub struct Sequence {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// The output tokens it produces (its `max_tokens`).
    pub output: Vec<u32>,
    /// Its LoRA adapter and `cache_salt`.
    pub keys: ExtraKeys,
    /// What it asks of KV transfer.
    pub transfer: Transfer,
}

/// A token one of a request's sequences produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Produced {
    /// The sequence: its place in the request's [`Engine::submit`] list.
    pub seq: usize,
    /// The token.
    pub emitted: Emitted,
}

/// A request on its way: its sequences' tokens, then, if anything, its first sequence's
/// [`Ending`] (the sender is dropped otherwise).
pub struct Submitted {
    /// The tokens its sequences produce, in the order the engine produced them (a step's in
    /// batch order, as vLLM's output processor sees them). Closed once every sequence ended.
    pub tokens: mpsc::UnboundedReceiver<Produced>,
    /// How its first sequence ended.
    pub ending: oneshot::Receiver<Ending>,
}

/// A sequence for a rank.
struct Submission {
    seq: usize,
    sequence: Sequence,
    arrived: Instant,
    reply: mpsc::UnboundedSender<Produced>,
    ending: Option<oneshot::Sender<Ending>>,
}

enum Command {
    /// Sequences to queue, in order, before the next step.
    Submit(Vec<Submission>),
    Reset(oneshot::Sender<bool>),
    /// A remote prefill's load is over (`tokens` were loaded, on success).
    Loaded {
        id: SeqId,
        tokens: usize,
        result: Result<(), String>,
    },
    /// A decoder reads the blocks held under a key.
    Release {
        key: HoldKey,
        reply: oneshot::Sender<Option<Vec<usize>>>,
    },
    /// A hold timed out.
    Expire {
        key: HoldKey,
        id: SeqId,
    },
}

/// One data-parallel rank.
pub struct Rank {
    commands: mpsc::UnboundedSender<Command>,
    publisher: Publisher,
    /// Live numbers.
    pub stats: Arc<RankStats>,
}

/// The engine: its ranks and the round-robin cursor over them.
pub struct Engine {
    config: EngineConfig,
    ranks: Vec<Rank>,
    next: AtomicUsize,
    holds_changed: Arc<Notify>,
    slowdown: Arc<Slowdown>,
}

/// How many times slower than its time model every rank's steps run from now on (1: as
/// modelled): a replica slowed behind the router's back, for tests of what the router notices.
#[derive(Debug)]
pub struct Slowdown(AtomicU64);

impl Slowdown {
    fn new() -> Slowdown {
        Slowdown(AtomicU64::new(1f64.to_bits()))
    }

    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

impl Engine {
    /// Starts one loop per publisher (one per rank). Must run inside a tokio runtime.
    pub fn start(config: EngineConfig, publishers: Vec<Publisher>) -> Engine {
        let holds_changed = Arc::new(Notify::new());
        let slowdown = Arc::new(Slowdown::new());
        let ranks = publishers
            .into_iter()
            .map(|publisher| {
                let (tx, rx) = mpsc::unbounded_channel();
                let stats = Arc::new(RankStats::default());
                let cache = KvCache::new(
                    config.block_size,
                    config.num_gpu_blocks,
                    config.cpu_offload_blocks,
                    config.hasher.clone(),
                );
                let rank = RankLoop {
                    scheduler: Scheduler::new(config.limits, config.cost, cache),
                    commands: rx,
                    to_self: tx.downgrade(),
                    publisher: publisher.clone(),
                    stats: stats.clone(),
                    speedup: config.speedup,
                    slowdown: slowdown.clone(),
                    transfer: config.transfer.clone(),
                    holds_changed: holds_changed.clone(),
                    clients: HashMap::new(),
                    sources: HashMap::new(),
                };
                tokio::spawn(rank.run());
                Rank { commands: tx, publisher, stats }
            })
            .collect();
        Engine { config, ranks, next: AtomicUsize::new(0), holds_changed, slowdown }
    }

    /// Runs every step `factor` times slower than modelled from now on (1: as modelled).
    /// Returns false, changing nothing, for a factor that is not finite and positive.
    pub fn set_slowdown(&self, factor: f64) -> bool {
        if !(factor.is_finite() && factor > 0.0) {
            return false;
        }
        self.slowdown.0.store(factor.to_bits(), Ordering::Relaxed);
        true
    }

    /// The ranks.
    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Picks a rank: the requested one (`X-data-parallel-rank`), or the next in turn.
    pub fn pick(&self, requested: Option<usize>) -> Option<(usize, &Rank)> {
        let i = requested.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed) % self.ranks.len());
        self.ranks.get(i).map(|rank| (i, rank))
    }

    /// Queues a request's sequences, each on its rank; their tokens arrive on one channel,
    /// tagged with their place in `sequences`. A rank gets its sequences together, in order,
    /// so they are scheduled as requests added between two steps are (vLLM's engine core
    /// takes every queued request before it schedules). Nothing is queued if any sequence can
    /// never fit in the cache.
    pub fn submit(&self, sequences: Vec<(&Rank, Sequence)>) -> Result<Submitted, SubmitError> {
        for (_, s) in &sequences {
            let needed = blocks_needed(s.prompt.len(), s.output.len(), self.config.block_size);
            if needed > self.config.num_gpu_blocks {
                return Err(SubmitError::TooLong { needed, available: self.config.num_gpu_blocks });
            }
        }
        let (reply, tokens) = mpsc::unbounded_channel();
        let (ending, ended) = oneshot::channel();
        let mut ending = Some(ending);
        let arrived = Instant::now();
        let mut batches: Vec<(&Rank, Vec<Submission>)> = Vec::new();
        for (seq, (rank, sequence)) in sequences.into_iter().enumerate() {
            let submission = Submission { seq, sequence, arrived, reply: reply.clone(), ending: ending.take() };
            match batches.iter_mut().find(|(r, _)| std::ptr::eq(*r, rank)) {
                Some((_, batch)) => batch.push(submission),
                None => batches.push((rank, vec![submission])),
            }
        }
        for (rank, batch) in batches {
            rank.commands.send(Command::Submit(batch)).map_err(|_| SubmitError::Stopped)?;
        }
        Ok(Submitted { tokens, ending: ended })
    }

    /// Resets every rank's prefix cache; false if any rank has requests holding blocks.
    pub async fn reset_prefix_cache(&self) -> bool {
        let mut ok = true;
        for rank in &self.ranks {
            let (tx, rx) = oneshot::channel();
            ok &= rank.commands.send(Command::Reset(tx)).is_ok() && rx.await.unwrap_or(false);
        }
        ok
    }

    /// A decoder reads the blocks rank `rank` holds under `key`: they are freed. Their ids, or
    /// `None` if none are held (not yet, or any more).
    pub async fn release(&self, rank: usize, key: HoldKey) -> Option<Vec<usize>> {
        let (reply, released) = oneshot::channel();
        self.ranks.get(rank)?.commands.send(Command::Release { key, reply }).ok()?;
        released.await.ok().flatten()
    }

    /// Notified whenever a rank starts holding blocks for a remote decoder.
    pub fn holds_changed(&self) -> &Notify {
        &self.holds_changed
    }
}

impl Rank {
    /// The rank's event publisher (for fault injection).
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }
}

/// A sequence in flight: its place in its request, where its tokens and ending go, and when
/// it arrived.
struct Client {
    seq: usize,
    reply: mpsc::UnboundedSender<Produced>,
    ending: Option<oneshot::Sender<Ending>>,
    arrived: Instant,
}

/// Steps later than this behind the simulated clock restart it rather than run back to back.
const MAX_LAG: Duration = Duration::from_millis(5);

/// A rank's loop and what it keeps.
struct RankLoop {
    scheduler: Scheduler,
    commands: mpsc::UnboundedReceiver<Command>,
    /// For the loop's own tasks (loads, hold timers), which must not keep it alive.
    to_self: mpsc::WeakUnboundedSender<Command>,
    publisher: Publisher,
    stats: Arc<RankStats>,
    speedup: f64,
    slowdown: Arc<Slowdown>,
    transfer: Option<TransferSetup>,
    holds_changed: Arc<Notify>,
    clients: HashMap<SeqId, Client>,
    /// Where each remote prefill not yet admitted loads from.
    sources: HashMap<SeqId, Source>,
}

impl RankLoop {
    async fn run(mut self) {
        // Wall-clock instant at which the current busy period's simulated time would be 0.
        let mut epoch: Option<Instant> = None;
        let mut simulated = Duration::ZERO;
        loop {
            if self.scheduler.is_idle() {
                epoch = None;
                let Some(c) = self.commands.recv().await else { return };
                self.handle(c);
            }
            while let Ok(c) = self.commands.try_recv() {
                self.handle(c);
            }
            let mut out = self.scheduler.step();
            self.start_loads(std::mem::take(&mut out.loads));
            if out.duration_us == 0.0 {
                // Nothing schedulable: wait for the next command rather than spin.
                self.publisher.publish(out.events);
                self.record();
                let Some(c) = self.commands.recv().await else { return };
                self.handle(c);
                continue;
            }
            let now = Instant::now();
            let start = epoch.get_or_insert_with(|| {
                simulated = Duration::ZERO;
                now
            });
            let step = Duration::from_secs_f64(out.duration_us / 1e6 / self.speedup * self.slowdown.get());
            simulated += step;
            let mut deadline = *start + simulated;
            self.stats.step_wall_us.fetch_add(step.as_micros() as u64, Ordering::Relaxed);
            if now > deadline + MAX_LAG {
                // The host fell behind (a slow step, a busy machine): carry on from now.
                let lost = now - (deadline - step);
                self.stats.clock_lost_us.fetch_add(lost.as_micros() as u64, Ordering::Relaxed);
                self.stats.clock_resets.fetch_add(1, Ordering::Relaxed);
                deadline = now + step;
                *start = deadline.checked_sub(simulated).unwrap_or(now);
            }
            tokio::time::sleep_until(deadline).await;
            self.publisher.publish(out.events);
            self.hold(out.held);
            self.dispatch(out.emitted);
            self.record();
        }
    }

    fn handle(&mut self, c: Command) {
        match c {
            Command::Submit(submissions) => {
                for Submission { seq, sequence, arrived, reply, ending } in submissions {
                    let Sequence { prompt, output, keys, transfer } = sequence;
                    let (remote, source) = match transfer {
                        Transfer::None => (Remote::None, None),
                        Transfer::Hold(key) => (Remote::Decode(key), None),
                        Transfer::Load(source) => (Remote::Prefill(source.mode()), Some(source)),
                    };
                    // Size was checked by `Engine::submit`; a refusal here just drops the sender.
                    if let Ok(id) = self.scheduler.add(prompt, output, keys, remote) {
                        self.clients.insert(id, Client { seq, reply, ending, arrived });
                        if let Some(source) = source {
                            self.sources.insert(id, source);
                        }
                    }
                }
            }
            Command::Reset(done) => {
                let (ok, events) = self.scheduler.reset_prefix_cache();
                self.publisher.publish(events);
                let _ = done.send(ok);
            }
            Command::Loaded { id, tokens, result } => self.loaded(id, tokens, result),
            Command::Release { key, reply } => {
                let mut events = Vec::new();
                let released = self.scheduler.release(&key, &mut events);
                self.publisher.publish(events);
                let _ = reply.send(released);
            }
            Command::Expire { key, id } => {
                let mut events = Vec::new();
                if self.scheduler.expire(&key, id, &mut events) {
                    tracing::info!(?key, "blocks held for a remote decoder expired");
                    self.stats.expired_holds.fetch_add(1, Ordering::Relaxed);
                }
                self.publisher.publish(events);
            }
        }
    }

    /// Starts loading the remote prefills the scheduler admitted, each in a task of its own.
    fn start_loads(&mut self, loads: Vec<Load>) {
        for load in loads {
            let source = self.sources.remove(&load.id);
            let (Some(source), Some(setup)) = (source, self.transfer.as_ref()) else {
                self.loaded(load.id, load.tokens, Err("no KV transfer is configured".into()));
                continue;
            };
            let (puller, to_self) = (setup.puller.clone(), self.to_self.clone());
            tokio::spawn(async move {
                let result = puller.pull(&source, &load).await;
                if let Some(tx) = to_self.upgrade() {
                    let _ = tx.send(Command::Loaded { id: load.id, tokens: load.tokens, result });
                }
            });
        }
    }

    /// A remote prefill's load is over: the sequence carries on, or falls back to computing
    /// its prompt, or fails, per the failure policy.
    fn loaded(&mut self, id: SeqId, tokens: usize, result: Result<(), String>) {
        let reason = match result {
            Ok(()) => {
                let Some((events, first)) = self.scheduler.finish_load(id, true) else { return };
                self.stats.remote_prefills.fetch_add(1, Ordering::Relaxed);
                self.stats.transferred_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
                self.publisher.publish(events);
                self.dispatch(first.into_iter().collect());
                return;
            }
            Err(reason) => reason,
        };
        self.stats.transfer_failures.fetch_add(1, Ordering::Relaxed);
        let policy = self.transfer.as_ref().map_or(FailurePolicy::Fail, |t| t.on_failure);
        tracing::warn!(%reason, ?policy, "a remote prefill could not be loaded");
        let events: Vec<Event> = match policy {
            FailurePolicy::Recompute => {
                self.scheduler.finish_load(id, false).map(|(events, _)| events).unwrap_or_default()
            }
            FailurePolicy::Fail => {
                let events = self.scheduler.abort(id);
                if let Some(ending) = self.clients.remove(&id).and_then(|c| c.ending) {
                    let _ = ending.send(Ending::TransferFailed(reason));
                }
                events
            }
        };
        self.publisher.publish(events);
    }

    /// Blocks now held for remote decoders: their requests learn the ids, the holds get their
    /// timers, and whoever waits for a hold is woken.
    fn hold(&mut self, held: Vec<Held>) {
        if held.is_empty() {
            return;
        }
        for Held { id, key, block_ids } in held {
            self.stats.remote_decodes.fetch_add(1, Ordering::Relaxed);
            if let Some(ending) = self.clients.get_mut(&id).and_then(|c| c.ending.take()) {
                let _ = ending.send(Ending::Held(block_ids));
            }
            let wait = self.transfer.as_ref().map_or(Duration::ZERO, |t| t.hold);
            let to_self = self.to_self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                if let Some(tx) = to_self.upgrade() {
                    let _ = tx.send(Command::Expire { key, id });
                }
            });
        }
        self.holds_changed.notify_waiters();
    }

    /// Hands tokens to their sequences; a sequence whose client went away is aborted.
    fn dispatch(&mut self, emitted: Vec<Emitted>) {
        let mut events = Vec::new();
        for e in emitted {
            let Some(client) = self.clients.get(&e.id) else { continue };
            if e.index == 1 {
                let ttft = client.arrived.elapsed().as_secs_f64() * self.speedup;
                self.stats.ttft.lock().unwrap_or_else(|p| p.into_inner()).observe(ttft);
            }
            if client.reply.send(Produced { seq: client.seq, emitted: e }).is_err() {
                events.extend(self.scheduler.abort(e.id));
                self.clients.remove(&e.id);
            } else if e.finished {
                self.clients.remove(&e.id);
            }
        }
        self.publisher.publish(events);
    }

    /// Stores the live numbers for `/metrics`.
    fn record(&self) {
        let (s, stats) = (&self.scheduler, &self.stats);
        let c = s.counters();
        let store = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        store(&stats.running, s.num_running() as u64);
        store(&stats.waiting, s.num_waiting() as u64);
        store(&stats.usage_bits, s.cache_usage().to_bits());
        store(&stats.cached_blocks, s.cached_blocks() as u64);
        store(&stats.held_blocks, s.held_blocks() as u64);
        store(&stats.prefix_queries, c.prefix_queries);
        store(&stats.prefix_hits, c.prefix_hits);
        store(&stats.preemptions, c.preemptions);
        store(&stats.prompt_tokens, c.prompt_tokens);
        store(&stats.generation_tokens, c.generation_tokens);
        store(&stats.prompt_computed, c.prompt_computed);
        store(&stats.prompt_local_hits, c.prompt_local_hits);
        store(&stats.prompt_external, c.prompt_external);
        store(&stats.prompt_cached, c.prompt_cached);
        store(&stats.prompt_recomputed, c.prompt_recomputed);
    }
}
