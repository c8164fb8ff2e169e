//! The engine: a KV cache, a time model and the event publisher.
//!
//! Time model (simple on purpose; continuous batching comes later):
//! - prefills run one at a time (they are compute-bound) and take
//!   `prefill_us_per_token × uncached prompt tokens`, so a cache hit shortens TTFT and a busy
//!   replica makes newcomers wait;
//! - each output token takes `decode_us_per_token`, concurrently across requests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::kv_cache::{Allocation, KvCache, OutOfBlocks};
use crate::kv_events::Publisher;
use crate::vllm_hash::VllmHasher;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_blocks: usize,
    /// Prefill cost per uncached prompt token.
    pub prefill_us_per_token: u64,
    /// Decode cost per output token.
    pub decode_us_per_token: u64,
    /// vLLM's block hasher.
    pub hasher: VllmHasher,
}

/// Counters in vLLM's terms.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Requests between admission and finish.
    pub running: AtomicU64,
    /// Requests waiting for the prefill lane.
    pub waiting: AtomicU64,
    /// Prompt tokens queried against the prefix cache.
    pub prefix_queries: AtomicU64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hits: AtomicU64,
}

/// One simulated engine.
pub struct Engine {
    config: EngineConfig,
    cache: Mutex<KvCache>,
    prefill_lane: tokio::sync::Mutex<()>,
    publisher: Publisher,
    /// Counters.
    pub stats: EngineStats,
}

/// A request holding KV blocks; they are released when it is dropped (finished or abandoned).
pub struct Running {
    engine: Arc<Engine>,
    alloc: Option<Allocation>,
    /// Prompt and output tokens so far.
    tokens: Vec<u32>,
    /// Prompt tokens that were served from the cache.
    pub cached_tokens: usize,
}

impl Running {
    /// Produces one output token: waits one decode step, then appends it. A block the token
    /// completes is committed and published (`BlockStored`), as vLLM does during decode.
    pub async fn decode(&mut self, token: u32) {
        tokio::time::sleep(Duration::from_micros(self.engine.config.decode_us_per_token)).await;
        self.tokens.push(token);
        let Some(alloc) = self.alloc.as_mut() else { return };
        let mut events = Vec::new();
        {
            let mut cache = self.engine.cache();
            // Out of blocks: vLLM would preempt; the simulator just stops caching the output.
            if self.tokens.len() <= cache.capacity(alloc) || cache.grow(alloc, &mut events).is_ok() {
                cache.commit(alloc, &self.tokens, &mut events);
            }
        }
        self.engine.publisher.publish(events);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(alloc) = self.alloc.take() {
            let mut events = Vec::new();
            self.engine.cache().free(alloc, &mut events);
            self.engine.publisher.publish(events);
        }
        self.engine.stats.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Engine {
    /// A new engine publishing on `publisher`.
    pub fn new(config: EngineConfig, publisher: Publisher) -> Engine {
        Engine {
            cache: Mutex::new(KvCache::new(config.block_size, config.num_blocks, config.hasher.clone())),
            config,
            prefill_lane: tokio::sync::Mutex::new(()),
            publisher,
            stats: EngineStats::default(),
        }
    }

    fn cache(&self) -> MutexGuard<'_, KvCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a prompt and runs its prefill; returns when the first token is due.
    pub async fn prefill(self: &Arc<Self>, tokens: &[u32]) -> Result<Running, OutOfBlocks> {
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let lane = self.prefill_lane.lock().await;
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        let mut events = Vec::new();
        let alloc = self.cache().allocate(tokens, &mut events);
        self.publisher.publish(std::mem::take(&mut events));
        let alloc = alloc?;
        self.stats.running.fetch_add(1, Ordering::Relaxed);
        let cached_tokens = alloc.cached_tokens;
        self.stats.prefix_queries.fetch_add(tokens.len() as u64, Ordering::Relaxed);
        self.stats.prefix_hits.fetch_add(cached_tokens as u64, Ordering::Relaxed);
        let mut running = Running { engine: self.clone(), alloc: Some(alloc), tokens: tokens.to_vec(), cached_tokens };
        let uncached = (tokens.len() - cached_tokens) as u64;
        tokio::time::sleep(Duration::from_micros(uncached * self.config.prefill_us_per_token)).await;
        drop(lane);
        if let Some(alloc) = running.alloc.as_mut() {
            self.cache().commit(alloc, tokens, &mut events);
        }
        self.publisher.publish(events);
        Ok(running)
    }

    /// The event publisher (for fault injection).
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    /// Resets the prefix cache (`AllBlocksCleared`). Fails while requests hold blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut events = Vec::new();
        let ok = self.cache().reset(&mut events);
        self.publisher.publish(events);
        ok
    }

    /// Fraction of KV blocks in use.
    pub fn cache_usage(&self) -> f64 {
        self.cache().usage()
    }
}
