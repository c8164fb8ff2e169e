//! Polls each engine's `/metrics` (with `engine_metrics_secs`) and hands the pool what the
//! engine says of itself; what the page means is `crate::load::engine_metrics`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::health::Health;
use crate::load::engine_metrics::reports_by_engine;
use crate::load::EngineReport;
use crate::pool::{Pool, Target};

/// How long one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Scrapes every active engine of `pool` every `interval` until the sidecar stops, and books
/// what they report beyond kvgate's own bookings as external load.
pub fn spawn(pool: Arc<Pool>, interval: Duration, health: &Arc<Health>) -> std::io::Result<JoinHandle<()>> {
    crate::poll::every(
        format!("engine-metrics-{}", pool.config().model),
        interval,
        SCRAPE_TIMEOUT,
        health,
        move |client| {
            // Data-parallel ranks share an endpoint: one page per engine.
            let mut pages: HashMap<SocketAddr, Option<HashMap<String, EngineReport>>> = HashMap::new();
            for Target { slot, endpoint, rank } in pool.active_targets() {
                let counts = pages.entry(endpoint).or_insert_with(|| {
                    let url = format!("http://{endpoint}/metrics");
                    match client.get(&url).send().and_then(|r| r.error_for_status()).and_then(|r| r.text()) {
                        // A page with no engine figures (unreadable, or not an engine's) says nothing.
                        Ok(page) => {
                            let reports = reports_by_engine(&page);
                            if reports.is_empty() {
                                tracing::debug!(%url, "engine metrics page holds no engine figures");
                            }
                            Some(reports).filter(|reports| !reports.is_empty())
                        }
                        Err(e) => {
                            tracing::debug!(%url, error = %e, "engine metrics unavailable");
                            None
                        }
                    }
                });
                // An engine we cannot read keeps its last figure rather than dropping to zero.
                if let Some(reports) = counts {
                    let report = match rank {
                        Some(r) => reports.get(&r.to_string()).copied().unwrap_or_default(),
                        None => reports.values().fold(EngineReport::default(), |a, b| a.merge(*b)),
                    };
                    pool.observe_engine(slot, report);
                }
            }
        },
    )
}
