//! Discovery: which replicas each pool has, kept current while the sidecar runs.
//!
//! Each pool has one source ([`DiscoveryKind`], its `[pools.discovery]` section: `config.rs`):
//! - **static** — the config file's `replicas`. The file is re-read when it changes (checked
//!   every `interval_secs`) or on `SIGHUP`; only replica lists are applied, other changes need
//!   a restart (and are logged as such). A file that no longer loads changes nothing.
//! - **dns** — a name resolved every `interval_secs` ([`dns`]): each address is a replica at
//!   `ip:port`, its events at the `kv_events` template (`tcp://{ip}:5557`).
//! - **envoy** — the hosts of one cluster of the local Envoy, as its admin `/clusters`
//!   reports them, minus those Envoy considers unhealthy ([`envoy`]).
//!
//! A [`Supervisor`] applies each membership to its pool ([`crate::pool::Pool::set_members`]):
//! unchanged replicas keep their index and bookings, replicas that left are emptied and no
//! longer read, new ones are read from. A failed lookup keeps the last
//! membership and counts `kvgate_discovery_errors_total`.
//!
//! Beside membership, [`adapters`] learns which LoRA adapters each replica serves from its
//! engine's `/v1/models`.

pub mod adapters;
mod config;
pub mod dns;
pub mod envoy;

pub use config::{DiscoveryConfig, DiscoveryKind};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crate::events::apply::Applier;
use crate::events::transport::{Ingesters, Readers, Source};
use crate::health::{Health, Worker};
use crate::index::ReplicaIdx;
use crate::metrics::{DiscoveryLabels, Metrics};
use crate::pool::{Pool, PoolConfig, ReplicaConfig};

/// Starts and stops one pool's event ingestion as its membership changes: the pool's applier,
/// ingest workers and reader, and each replica's subscription.
pub struct Supervisor {
    pool: Arc<Pool>,
    /// Where the pool's replicas come from.
    discovery: DiscoveryConfig,
    metrics: Arc<Metrics>,
    readers: Readers,
    /// Stops the applier, the ingest workers and the reader (shutdown).
    stop_applier: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Supervisor {
    /// A supervisor for `pool`, whose replicas come from `discovery`; starts its event
    /// threads (applier, ingest workers, reader) and reads its configured replicas.
    pub fn start(
        ctx: zmq::Context,
        pool: Arc<Pool>,
        discovery: DiscoveryConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Supervisor> {
        let stop_applier = Arc::new(AtomicBool::new(false));
        let (applier, thread) = Applier::spawn(pool.clone(), metrics.clone(), stop_applier.clone())?;
        // One ingest worker per core: more would only take CPU from routing decisions.
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        let (ingesters, mut threads) = Ingesters::spawn(&ctx, &pool, &applier, workers, &stop_applier)?;
        let (readers, reader) = Readers::spawn(&ctx, pool.clone(), metrics.clone(), &ingesters, &stop_applier)?;
        threads.extend([thread, reader]);
        let threads = Mutex::new(threads);
        let supervisor = Supervisor { pool, discovery, metrics, readers, stop_applier, threads };
        supervisor.read(supervisor.pool.active());
        Ok(supervisor)
    }

    /// The supervised pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Where its replicas come from.
    pub fn discovery(&self) -> &DiscoveryConfig {
        &self.discovery
    }

    /// Makes `replicas` the pool's membership, reads the events of newcomers and stops reading
    /// those that left.
    pub fn apply(&self, replicas: &[ReplicaConfig]) {
        let start = self.pool.set_members(replicas);
        self.readers.wake();
        self.read(start);
    }

    /// Applies one refresh of a polled source: its replicas, or the reason it has none this
    /// time (which keeps the membership as it was and is counted).
    pub fn refresh(&self, kind: DiscoveryKind, found: Result<Vec<ReplicaConfig>, String>) {
        match found {
            Ok(replicas) => self.apply(&replicas),
            Err(e) => self.failed(kind, &e),
        }
    }

    /// Counts a failed refresh (the membership stays as it was).
    pub fn failed(&self, kind: DiscoveryKind, error: &dyn std::fmt::Display) {
        tracing::warn!(model = %self.pool.config().model, kind = kind.label(), %error, "discovery failed; keeping the replicas we have");
        self.metrics.discovery_errors.get_or_create(&self.labels(kind)).inc();
    }

    fn labels(&self, kind: DiscoveryKind) -> DiscoveryLabels {
        DiscoveryLabels { model: self.pool.config().model.clone(), kind: kind.label().into() }
    }

    /// Reads the events of `sources` (when the pool reads events at all) and exports the
    /// number of active replicas.
    fn read(&self, sources: Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)>) {
        for (replica, config, stop) in sources.into_iter().filter(|_| self.pool.config().reads_events()) {
            self.readers.add(&self.pool, Source { replica, config, stop });
        }
        let active = self.pool.active_targets().len();
        self.metrics.replicas.get_or_create(&self.labels(self.discovery.kind)).set(active as i64);
    }

    /// Stops every event thread and waits for them.
    pub fn shutdown(&self) {
        self.pool.stop_all();
        self.stop_applier.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

/// How long a discovery thread may go without a heartbeat beyond its interval: one refresh
/// (a DNS lookup, an admin API call) may block that long.
const REFRESH_MAY_TAKE: Duration = Duration::from_secs(60);

/// Runs `refresh` every `interval` until the sidecar stops: the loop of the `dns` and `envoy`
/// sources.
pub fn poll(
    name: &str,
    interval: Duration,
    health: &Arc<Health>,
    mut refresh: impl FnMut() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let name = format!("discover-{name}");
    let worker = health.worker(&name, interval + REFRESH_MAY_TAKE);
    std::thread::Builder::new().name(name).spawn(move || {
        while !worker.stopping() {
            refresh();
            sleep_until(Instant::now() + interval, &worker, &AtomicBool::new(false));
        }
    })
}

/// Sleeps until `deadline`, waking early when the sidecar stops or `wake` is set.
fn sleep_until(deadline: Instant, worker: &Worker, wake: &AtomicBool) {
    while Instant::now() < deadline && !worker.stopping() && !wake.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50).min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// The pools as a re-read config file gives them: each one's settings and discovery section.
pub type Reloaded = Vec<(PoolConfig, DiscoveryConfig)>;

/// Watches the config file for the static pools: re-reads it (`load`) when its modification
/// time changes or `reload` is set (SIGHUP), and applies each static pool's replica list.
pub fn watch_file(
    path: PathBuf,
    mut load: impl FnMut() -> anyhow::Result<Reloaded> + Send + 'static,
    interval: Duration,
    supervisors: Vec<Arc<Supervisor>>,
    reload: Arc<AtomicBool>,
    health: &Arc<Health>,
) -> std::io::Result<JoinHandle<()>> {
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let worker = health.worker("discover-file", interval + REFRESH_MAY_TAKE);
    std::thread::Builder::new().name("discover-file".into()).spawn(move || {
        let mut seen: Option<SystemTime> = modified(&path);
        while !worker.stopping() {
            sleep_until(Instant::now() + interval, &worker, &reload);
            let now = modified(&path);
            if !reload.swap(false, Ordering::Relaxed) && now == seen {
                continue;
            }
            seen = now;
            match load() {
                Ok(pools) => apply_static(&pools, &supervisors),
                Err(e) => {
                    for s in &supervisors {
                        s.failed(DiscoveryKind::Static, &format!("{}: {e:#}", path.display()));
                    }
                }
            }
        }
    })
}

/// Applies a re-read config's replica lists to the static pools.
fn apply_static(pools: &Reloaded, supervisors: &[Arc<Supervisor>]) {
    for s in supervisors {
        let current = s.pool().config();
        let Some((new, discovery)) = pools.iter().find(|(p, _)| p.model == current.model) else {
            tracing::warn!(model = %current.model, "pool removed from the config file; restart the sidecar to drop it");
            continue;
        };
        if discovery.kind != DiscoveryKind::Static {
            tracing::warn!(model = %current.model, "discovery kind changed in the config file; restart the sidecar to apply it");
            continue;
        }
        if (&new.tokenizer, new.block_size, &new.adapters, new.policy)
            != (&current.tokenizer, current.block_size, &current.adapters, current.policy)
        {
            tracing::warn!(model = %current.model, "only replica lists are reloaded; restart the sidecar for the other changes");
        }
        s.apply(&new.replicas);
        tracing::info!(model = %current.model, replicas = new.replicas.len(), "config reloaded");
    }
}
