//! `envoy` discovery: the replicas are the hosts of one cluster of the local Envoy that Envoy
//! itself would send traffic to, read from its admin API (`GET /clusters?format=json`). So
//! kvgate never picks a host that Envoy's health checks or outlier detection took out.

use std::net::SocketAddr;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

use super::{poll, DiscoveryConfig, DiscoveryKind, Supervisor};
use crate::health::Health;
use crate::pool::ReplicaConfig;

/// How long one admin call may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Health flags that take a host out of Envoy's load balancing (they are absent when false).
const UNHEALTHY_FLAGS: [&str; 5] = [
    "failed_active_health_check",
    "failed_outlier_check",
    "failed_eds_health",
    "pending_dynamic_removal",
    "excluded_via_immediate_hc_fail",
];

/// The addresses of `cluster`'s healthy hosts in an admin `/clusters?format=json` document.
/// Errors if the document has no such cluster (a typo must not look like "no replicas").
///
/// ```
/// let doc = serde_json::json!({"cluster_statuses": [{"name": "vllm", "host_statuses": [
///     {"address": {"socket_address": {"address": "10.0.0.7", "port_value": 8000}},
///      "health_status": {"eds_health_status": "HEALTHY"}},
///     {"address": {"socket_address": {"address": "10.0.0.8", "port_value": 8000}},
///      "health_status": {"eds_health_status": "HEALTHY", "failed_active_health_check": true}}]}]});
/// let hosts = kvgate_sidecar::discovery::envoy::healthy_hosts(&doc, "vllm").unwrap();
/// assert_eq!(hosts, vec!["10.0.0.7:8000".parse().unwrap()]);
/// ```
pub fn healthy_hosts(doc: &Value, cluster: &str) -> Result<Vec<SocketAddr>, String> {
    let clusters = doc["cluster_statuses"].as_array().ok_or("no cluster_statuses in the admin answer")?;
    let c =
        clusters.iter().find(|c| c["name"] == cluster).ok_or_else(|| format!("Envoy has no cluster {cluster:?}"))?;
    let hosts = c["host_statuses"].as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::new();
    for h in hosts {
        let health = &h["health_status"];
        let flagged = UNHEALTHY_FLAGS.iter().any(|f| health[*f] == true);
        let eds_ok = matches!(health["eds_health_status"].as_str(), None | Some("HEALTHY" | "UNKNOWN" | "DEGRADED"));
        if flagged || !eds_ok {
            continue;
        }
        let socket = &h["address"]["socket_address"];
        let (Some(ip), Some(port)) = (socket["address"].as_str(), socket["port_value"].as_u64()) else { continue };
        if let (Ok(ip), Ok(port)) = (ip.parse::<std::net::IpAddr>(), u16::try_from(port)) {
            out.push(SocketAddr::new(ip, port));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// One refresh: asks the admin API and turns the healthy hosts into replicas.
pub fn replicas(config: &DiscoveryConfig, client: &reqwest::blocking::Client) -> Result<Vec<ReplicaConfig>, String> {
    let url = format!("{}/clusters?format=json", config.admin.trim_end_matches('/'));
    let doc: Value = client
        .get(&url)
        .send()
        .and_then(|r| r.error_for_status())
        .and_then(|r| r.json())
        .map_err(|e| format!("{url}: {e}"))?;
    let prefill = match &config.prefill_name {
        Some(cluster) => healthy_hosts(&doc, cluster)?,
        None => Vec::new(),
    };
    Ok(config.replicas(healthy_hosts(&doc, &config.name)?, prefill))
}

/// Polls the admin API every `interval_secs` and applies the result until the sidecar stops.
pub fn spawn(supervisor: Arc<Supervisor>, health: &Arc<Health>) -> std::io::Result<JoinHandle<()>> {
    let config = supervisor.discovery().clone();
    let interval = Duration::from_secs(config.interval_secs);
    // Built on the polling thread: a blocking client must not be created on the runtime.
    let mut client = None;
    poll(&config.name.clone(), interval, health, move || {
        let client = match &client {
            Some(c) => c,
            None => match reqwest::blocking::Client::builder().timeout(ADMIN_TIMEOUT).build() {
                Ok(c) => client.insert(c),
                Err(e) => return supervisor.failed(DiscoveryKind::Envoy, &e),
            },
        };
        supervisor.refresh(DiscoveryKind::Envoy, replicas(&config, client));
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn host(ip: &str, health: Value) -> Value {
        json!({"address": {"socket_address": {"address": ip, "port_value": 8000}}, "health_status": health})
    }

    #[test]
    fn only_hosts_envoy_would_use_count() {
        let doc = json!({"cluster_statuses": [
        {"name": "other", "host_statuses": [host("10.0.0.1", json!({}))]},
        {"name": "vllm", "host_statuses": [
            host("10.0.0.9", json!({"eds_health_status": "HEALTHY"})),
            host("10.0.0.2", json!({})),
            host("10.0.0.3", json!({"failed_outlier_check": true})),
            host("10.0.0.4", json!({"eds_health_status": "DRAINING"})),
            host("10.0.0.5", json!({"pending_dynamic_removal": true})),
            host("not-an-ip", json!({})),
        ]}]});
        let hosts: Vec<String> = healthy_hosts(&doc, "vllm").unwrap().iter().map(ToString::to_string).collect();
        assert_eq!(hosts, ["10.0.0.2:8000", "10.0.0.9:8000"]);
        assert!(healthy_hosts(&doc, "vlm").unwrap_err().contains("no cluster"), "a typo is an error");
        assert!(healthy_hosts(&json!({}), "vllm").is_err());
    }
}
