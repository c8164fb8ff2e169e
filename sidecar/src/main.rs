//! `kvgate-sidecar`: one per gateway pod. Subscribes to every engine's KV events, keeps the KV
//! index and the load table, and answers the filter's routing calls on loopback.
//!
//! ```text
//! kvgate-sidecar --config kvgate.toml
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Parser;
use kvgate_shared::codec;
use kvgate_shared::wire::ModelBundle;

use kvgate_sidecar::config::{Config, ProcessEnv};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::{api, events};

/// KV-cache-aware routing sidecar for Envoy.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The TOML configuration file.
    #[arg(long, short, env = "KVGATE_CONFIG", default_value = "kvgate.toml")]
    config: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    let config = Config::load(&cli.config, &ProcessEnv)?;
    let metrics = Arc::new(Metrics::default());

    let mut pools = HashMap::new();
    for pool_config in &config.pools {
        let bundle = ModelBundle::from_dir(&pool_config.model, &pool_config.tokenizer, pool_config.block_size)
            .with_context(|| format!("loading the tokenizer of {:?}", pool_config.model))?;
        let bundle = codec::encode(&bundle)?;
        let pool = Arc::new(Pool::new(pool_config.clone(), bundle, metrics.clone()));
        pools.insert(pool_config.model.clone(), pool);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let zmq_ctx = zmq::Context::new();
    let mut subscribers = Vec::new();
    for pool in pools.values() {
        for replica in 0..pool.config.replicas.len() {
            subscribers.push(events::subscriber::spawn(
                zmq_ctx.clone(),
                pool.clone(),
                replica,
                metrics.clone(),
                stop.clone(),
            )?);
        }
    }

    let expiry = Duration::from_secs(config.request_expiry_secs);
    let expiring: Vec<Arc<Pool>> = pools.values().cloned().collect();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            for pool in &expiring {
                let n = pool.expire(expiry);
                if n > 0 {
                    tracing::warn!(model = %pool.config.model, n, "released bookings whose end was never reported");
                }
            }
        }
    });

    let state = Arc::new(api::AppState { pools, scoring: config.scoring.clone(), metrics });
    let listener =
        tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    tracing::info!(listen = %config.listen, "kvgate-sidecar ready");
    axum::serve(listener.tap_io(no_delay), api::router(state)).with_graceful_shutdown(shutdown_signal()).await?;

    stop.store(true, Ordering::Relaxed);
    for s in subscribers {
        let _ = s.join();
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

/// Small writes (a routing answer, an SSE chunk) must not wait for Nagle + delayed ACK (~40 ms).
fn no_delay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
}
