//! Background pollers of the engines' HTTP endpoints: one thread, one HTTP client, one round
//! every `interval` until the stop flag is set (checked every 50 ms while waiting).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Starts a thread named `name` that runs `round` with an HTTP client (each call timing out
/// after `timeout`) every `interval` until `stop`.
pub fn every(
    name: String,
    interval: Duration,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    mut round: impl FnMut(&reqwest::blocking::Client) + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.clone()).spawn(move || {
        let client = match reqwest::blocking::Client::builder().timeout(timeout).build() {
            Ok(c) => c,
            Err(e) => return tracing::error!(poller = %name, error = %e, "no HTTP client"),
        };
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            round(&client);
            while started.elapsed() < interval && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    })
}
