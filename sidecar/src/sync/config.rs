//! `[sync]`: sharing bookings with the other gateways' sidecars (`crate::sync`).

use serde::Deserialize;

/// Several gateways: where this sidecar publishes its bookings and whose it reads
/// (see [`crate::sync`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// This sidecar's id in the mesh (default: the pod's `HOSTNAME`).
    #[serde(default)]
    pub id: Option<String>,
    /// The ZMQ endpoint to publish on, e.g. `tcp://0.0.0.0:9913`.
    pub listen: String,
    /// Peers' endpoints, e.g. `tcp://10.0.0.12:9913`.
    #[serde(default)]
    pub peers: Vec<String>,
    /// A name whose addresses are the peers (a headless Service over the gateway pods),
    /// dialled on the `listen` port and re-resolved every 5 s.
    #[serde(default)]
    pub peers_dns: Option<String>,
    /// How long a starting sidecar waits for a peer to hand its view over (on the port after
    /// the sync port) before it rebuilds the index from the engines instead (default 5000;
    /// peers that do not accept connections are not waited for).
    #[serde(default = "default_handover_timeout_ms")]
    pub handover_timeout_ms: u64,
}

fn default_handover_timeout_ms() -> u64 {
    5_000
}
