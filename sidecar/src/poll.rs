//! Background pollers of the engines' HTTP endpoints: one thread, one HTTP client, one round
//! every `interval` until the sidecar stops (asked every 50 ms while waiting, each ask a
//! heartbeat: see `crate::health`).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::health::Health;

/// Starts a thread named `name` that runs `round` with an HTTP client (each call timing out
/// after `timeout`) every `interval` until the sidecar stops.
pub fn every(
    name: String,
    interval: Duration,
    timeout: Duration,
    health: &Arc<Health>,
    mut round: impl FnMut(&reqwest::blocking::Client) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    // A round calls each engine in turn, each call up to `timeout`.
    let worker = health.worker(&name, interval + (timeout * 32).max(Duration::from_secs(60)));
    std::thread::Builder::new().name(name.clone()).spawn(move || {
        let client = match reqwest::blocking::Client::builder().timeout(timeout).build() {
            Ok(c) => c,
            Err(e) => return tracing::error!(poller = %name, error = %e, "no HTTP client"),
        };
        while !worker.stopping() {
            let started = Instant::now();
            round(&client);
            while started.elapsed() < interval && !worker.stopping() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
}
