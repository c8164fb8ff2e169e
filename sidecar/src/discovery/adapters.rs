//! LoRA adapters learned from the engines themselves.
//!
//! vLLM lists the adapters it serves in `/v1/models`, each with `parent` = the base model
//! (adapters come with `--lora-modules` or, at run time, `/v1/load_lora_adapter`). Every
//! `adapters_poll_secs` this poller reads each active engine's list and records it on the
//! engine's slots ([`Pool::set_adapters`]); a request for a learned adapter then routes in the
//! pool, among the replicas that list it only. An engine that cannot be read keeps its last
//! list (it may be restarting; discovery and health checks decide whether it is gone).

use std::collections::{BTreeSet, HashSet};

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::health::Health;
use crate::pool::Pool;

/// How long one `/v1/models` call may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// The adapters of `base` in an OpenAI `/v1/models` answer: the entries whose `parent` is
/// `base`.
///
/// ```
/// let body = br#"{"object":"list","data":[
///     {"id":"qwen3","object":"model","parent":null},
///     {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"qwen3"},
///     {"id":"other-lora","object":"model","parent":"llama"}]}"#;
/// let adapters = kvgate_sidecar::discovery::adapters::listed_adapters(body, "qwen3").unwrap();
/// assert_eq!(adapters.into_iter().collect::<Vec<_>>(), ["sql-lora"]);
/// ```
pub fn listed_adapters(body: &[u8], base: &str) -> Result<BTreeSet<String>, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body)?;
    Ok(list.data.into_iter().filter(|e| e.parent.as_deref() == Some(base) && e.id != base).map(|e| e.id).collect())
}

/// Polls every active engine of `pool` every `interval` until the sidecar stops.
pub fn spawn(pool: Arc<Pool>, interval: Duration, health: &Arc<Health>) -> std::io::Result<JoinHandle<()>> {
    crate::poll::every(format!("adapters-{}", pool.config().model), interval, FETCH_TIMEOUT, health, move |client| {
        // Data-parallel ranks share an endpoint: one call per engine.
        let endpoints: HashSet<String> = pool.active_targets().iter().map(|t| t.endpoint.to_string()).collect();
        for endpoint in endpoints {
            let url = format!("http://{endpoint}/v1/models");
            let body = client.get(&url).send().and_then(|r| r.error_for_status()).and_then(|r| r.bytes());
            match body.map(|b| listed_adapters(&b, &pool.config().model)) {
                Ok(Ok(adapters)) => {
                    pool.set_adapters(&endpoint, &adapters);
                }
                Ok(Err(e)) => tracing::debug!(%url, error = %e, "unreadable model list"),
                Err(e) => tracing::debug!(%url, error = %e, "model list unavailable"),
            }
        }
    })
}
