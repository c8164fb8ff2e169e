//! The engine: one [`Scheduler`] per data-parallel rank, each driven by its own task in
//! (optionally sped-up) wall-clock time, publishing its KV events after every step.
//!
//! A rank's loop: take new requests, run a step, sleep until the step's simulated end
//! (`duration / speedup` of wall time, against an absolute deadline so timer slack does not
//! accumulate), publish the step's events, hand each produced token to its request. A
//! request whose client went away is aborted and its blocks freed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::extra_keys::ExtraKeys;
use crate::histogram::Histogram;
use crate::kv_cache::KvCache;
use crate::kv_events::Publisher;
use crate::scheduler::{blocks_needed, Emitted, Limits, Scheduler, SeqId};
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

enum Command {
    Submit {
        prompt: Vec<u32>,
        output: Vec<u32>,
        keys: ExtraKeys,
        arrived: Instant,
        reply: mpsc::UnboundedSender<Emitted>,
    },
    Reset(oneshot::Sender<bool>),
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
}

impl Engine {
    /// Starts one loop per publisher (one per rank). Must run inside a tokio runtime.
    pub fn start(config: EngineConfig, publishers: Vec<Publisher>) -> Engine {
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
                let scheduler = Scheduler::new(config.limits, config.cost, cache);
                tokio::spawn(run(scheduler, rx, publisher.clone(), stats.clone(), config.speedup));
                Rank { commands: tx, publisher, stats }
            })
            .collect();
        Engine { config, ranks, next: AtomicUsize::new(0) }
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
    pub fn pick(&self, requested: Option<usize>) -> Option<&Rank> {
        match requested {
            Some(r) => self.ranks.get(r),
            None => self.ranks.get(self.next.fetch_add(1, Ordering::Relaxed) % self.ranks.len()),
        }
    }

    /// Queues a request on `rank`, under a LoRA adapter if given; its tokens arrive on the
    /// returned channel.
    pub fn submit(
        &self,
        rank: &Rank,
        prompt: Vec<u32>,
        output: Vec<u32>,
        keys: ExtraKeys,
    ) -> Result<mpsc::UnboundedReceiver<Emitted>, SubmitError> {
        let needed = blocks_needed(prompt.len(), output.len(), self.config.block_size);
        if needed > self.config.num_gpu_blocks {
            return Err(SubmitError::TooLong { needed, available: self.config.num_gpu_blocks });
        }
        let (reply, rx) = mpsc::unbounded_channel();
        rank.commands
            .send(Command::Submit { prompt, output, keys, arrived: Instant::now(), reply })
            .map_err(|_| SubmitError::Stopped)?;
        Ok(rx)
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
}

impl Rank {
    /// The rank's event publisher (for fault injection).
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }
}

/// A request in flight: where its tokens go, and when it arrived.
struct Client {
    reply: mpsc::UnboundedSender<Emitted>,
    arrived: Instant,
}

/// Steps later than this behind the simulated clock restart it rather than run back to back.
const MAX_LAG: Duration = Duration::from_millis(5);

async fn run(
    mut scheduler: Scheduler,
    mut commands: mpsc::UnboundedReceiver<Command>,
    publisher: Publisher,
    stats: Arc<RankStats>,
    speedup: f64,
) {
    let mut clients: HashMap<SeqId, Client> = HashMap::new();
    // Wall-clock instant at which the current busy period's simulated time would be 0.
    let mut epoch: Option<Instant> = None;
    let mut simulated = Duration::ZERO;
    loop {
        if scheduler.is_idle() {
            epoch = None;
            match commands.recv().await {
                Some(c) => handle(c, &mut scheduler, &mut clients, &publisher),
                None => return,
            }
        }
        while let Ok(c) = commands.try_recv() {
            handle(c, &mut scheduler, &mut clients, &publisher);
        }
        let out = scheduler.step();
        if out.duration_us == 0.0 {
            // Nothing schedulable: wait for the next command rather than spin.
            publisher.publish(out.events);
            match commands.recv().await {
                Some(c) => handle(c, &mut scheduler, &mut clients, &publisher),
                None => return,
            }
            continue;
        }
        let now = Instant::now();
        let start = epoch.get_or_insert_with(|| {
            simulated = Duration::ZERO;
            now
        });
        let step = Duration::from_secs_f64(out.duration_us / 1e6 / speedup);
        simulated += step;
        let mut deadline = *start + simulated;
        if now > deadline + MAX_LAG {
            // The host fell behind (a slow step, a busy machine): carry on from now.
            deadline = now + step;
            *start = deadline.checked_sub(simulated).unwrap_or(now);
        }
        tokio::time::sleep_until(deadline).await;
        publisher.publish(out.events);
        let mut events = Vec::new();
        for e in out.emitted {
            let Some(client) = clients.get(&e.id) else { continue };
            if e.index == 1 {
                let ttft = client.arrived.elapsed().as_secs_f64() * speedup;
                stats.ttft.lock().unwrap_or_else(|p| p.into_inner()).observe(ttft);
            }
            if client.reply.send(e).is_err() {
                events.extend(scheduler.abort(e.id));
                clients.remove(&e.id);
            } else if e.finished {
                clients.remove(&e.id);
            }
        }
        publisher.publish(events);
        let c = scheduler.counters();
        stats.running.store(scheduler.num_running() as u64, Ordering::Relaxed);
        stats.waiting.store(scheduler.num_waiting() as u64, Ordering::Relaxed);
        stats.usage_bits.store(scheduler.cache_usage().to_bits(), Ordering::Relaxed);
        stats.cached_blocks.store(scheduler.cached_blocks() as u64, Ordering::Relaxed);
        stats.prefix_queries.store(c.prefix_queries, Ordering::Relaxed);
        stats.prefix_hits.store(c.prefix_hits, Ordering::Relaxed);
        stats.preemptions.store(c.preemptions, Ordering::Relaxed);
        stats.prompt_tokens.store(c.prompt_tokens, Ordering::Relaxed);
        stats.generation_tokens.store(c.generation_tokens, Ordering::Relaxed);
    }
}

fn handle(c: Command, scheduler: &mut Scheduler, clients: &mut HashMap<SeqId, Client>, publisher: &Publisher) {
    match c {
        Command::Submit { prompt, output, keys, arrived, reply } => {
            // Size was checked by `Engine::submit`; a refusal here just closes the channel.
            if let Ok(id) = scheduler.add(prompt, output, keys) {
                clients.insert(id, Client { reply, arrived });
            }
        }
        Command::Reset(done) => {
            let (ok, events) = scheduler.reset_prefix_cache();
            publisher.publish(events);
            let _ = done.send(ok);
        }
    }
}
