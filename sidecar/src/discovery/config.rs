//! `[pools.discovery]`: where a pool's replicas come from at run time (`crate::discovery`).

use std::net::SocketAddr;

use serde::Deserialize;

use crate::pool::{EventsMode, ReplicaConfig, Role};

/// How a pool finds its replicas.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `static` (default), `dns` or `envoy`.
    #[serde(default)]
    pub kind: DiscoveryKind,
    /// `dns`: the name to resolve (a headless Service: one A/AAAA record per ready pod);
    /// `envoy`: the Envoy cluster whose healthy hosts are the replicas.
    #[serde(default)]
    pub name: String,
    /// `dns`: the engines' HTTP port (the port Envoy's cluster has for them).
    #[serde(default)]
    pub port: u16,
    /// `envoy`: the admin address of the Envoy in this pod (Istio's is `127.0.0.1:15000`).
    #[serde(default = "default_admin")]
    pub admin: String,
    /// The KV-events endpoint of a discovered replica, with `{ip}` filled in, e.g.
    /// `tcp://{ip}:5557` (pods); `{port}`, `{port+N}` and `{port-N}` give a port relative to
    /// its HTTP port (several engines per host, e.g. `tcp://{ip}:{port-2443}`).
    #[serde(default)]
    pub kv_events: String,
    /// Its replay endpoint, e.g. `tcp://{ip}:5558`.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Topic prefix filter.
    #[serde(default)]
    pub kv_events_topic: String,
    /// How often to look again (`dns`, `envoy`), or to check the file for changes (`static`).
    #[serde(default = "default_discovery_interval")]
    pub interval_secs: u64,
    /// Data-parallel ranks of every discovered engine (see [`ReplicaConfig::data_parallel_size`]).
    #[serde(default = "one")]
    pub data_parallel_size: u32,
    /// A disaggregated pool's prefill workers: a second name (`dns`) or cluster (`envoy`),
    /// found the same way; `name`'s engines are then its decode workers.
    #[serde(default)]
    pub prefill_name: Option<String>,
    /// SGLang's bootstrap port of every discovered prefill worker (`sglang` mode).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// A discovery source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryKind {
    /// The config file's `replicas`, reloaded when the file changes or on SIGHUP.
    #[default]
    Static,
    /// A DNS name's addresses.
    Dns,
    /// The healthy hosts of a cluster of the local Envoy (its admin `/clusters`).
    Envoy,
}

impl DiscoveryKind {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            DiscoveryKind::Static => "static",
            DiscoveryKind::Dns => "dns",
            DiscoveryKind::Envoy => "envoy",
        }
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            kind: DiscoveryKind::Static,
            name: String::new(),
            port: 0,
            admin: default_admin(),
            kv_events: String::new(),
            kv_replay: None,
            kv_events_topic: String::new(),
            interval_secs: default_discovery_interval(),
            data_parallel_size: 1,
            prefill_name: None,
            bootstrap_port: None,
        }
    }
}

impl DiscoveryConfig {
    /// The replicas found at `name` and, in a disaggregated pool, at `prefill_name`
    /// (`prefill` those, `decode` the others); an address found at both is a prefill worker.
    pub fn replicas(&self, found: Vec<SocketAddr>, prefill: Vec<SocketAddr>) -> Vec<ReplicaConfig> {
        let main = if self.prefill_name.is_some() { Role::Decode } else { Role::Both };
        let mut by_addr = std::collections::BTreeMap::new();
        by_addr.extend(found.into_iter().map(|a| (a, main)));
        by_addr.extend(prefill.into_iter().map(|a| (a, Role::Prefill)));
        by_addr
            .into_iter()
            .map(|(addr, role)| ReplicaConfig {
                role,
                bootstrap_port: self.bootstrap_port.filter(|_| role == Role::Prefill),
                ..self.replica(addr)
            })
            .collect()
    }

    /// The replica at `addr` (its HTTP address): id and endpoint `ip:port`, event endpoints
    /// from the templates.
    pub fn replica(&self, addr: SocketAddr) -> ReplicaConfig {
        let ip = match addr.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        };
        let fill = |t: &str| fill_ports(&t.replace("{ip}", &ip), addr.port());
        ReplicaConfig {
            id: addr.to_string(),
            endpoint: addr,
            kv_events: fill(&self.kv_events),
            kv_events_mode: EventsMode::Connect,
            kv_events_topic: self.kv_events_topic.clone(),
            kv_replay: self.kv_replay.as_deref().map(fill),
            data_parallel_size: self.data_parallel_size,
            role: Role::Both,
            bootstrap_port: None,
        }
    }
}

/// Replaces `{port}`, `{port+N}` and `{port-N}` with `port` (plus or minus N). A placeholder
/// that does not parse, or a result outside 0..=65535, is left as written (the endpoint is then
/// invalid and ZMQ says so).
fn fill_ports(template: &str, port: u16) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(at) = rest.find("{port") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let Some(end) = rest.find('}') else { break };
        let spec = &rest["{port".len()..end];
        let offset = match spec.as_bytes().first() {
            None => Some(0),
            Some(b'+') => spec[1..].parse::<i64>().ok(),
            Some(b'-') => spec[1..].parse::<i64>().ok().map(|n| -n),
            _ => None,
        };
        match offset.map(|o| i64::from(port) + o).filter(|p| (0..=65535).contains(p)) {
            Some(p) => out.push_str(&p.to_string()),
            None => out.push_str(&rest[..=end]),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn default_discovery_interval() -> u64 {
    5
}

fn default_admin() -> String {
    "http://127.0.0.1:15000".into()
}

/// The serde default of counts that are 1 unless set.
fn one() -> u32 {
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_endpoints_can_be_relative_to_the_http_port() {
        let d = DiscoveryConfig {
            kv_events: "tcp://{ip}:{port+1}".into(),
            kv_replay: Some("tcp://{ip}:{port-2443}".into()),
            ..DiscoveryConfig::default()
        };
        let r = d.replica("10.1.2.3:8000".parse().unwrap());
        assert_eq!(
            (r.kv_events.as_str(), r.kv_replay.as_deref()),
            ("tcp://10.1.2.3:8001", Some("tcp://10.1.2.3:5557"))
        );
        assert_eq!(fill_ports("{port}/{port+x}/{port-9000}/{port", 8000), "8000/{port+x}/{port-9000}/{port");
    }
}
