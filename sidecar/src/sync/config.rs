//! `[sync]`: sharing bookings with the other gateways' sidecars (`crate::sync`).

use std::net::IpAddr;
use std::path::PathBuf;

use anyhow::bail;
use serde::Deserialize;

use super::seal::{Sealer, SyncKey};

/// Several gateways: where this sidecar publishes its bookings and whose it reads
/// (see [`crate::sync`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// This sidecar's id in the mesh (default: the pod's `HOSTNAME`).
    #[serde(default)]
    pub id: Option<String>,
    /// The ZMQ endpoint to publish on, e.g. `tcp://10.0.0.11:9913` (in Kubernetes, the pod's
    /// IP through `KVGATE_SYNC_LISTEN`).
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
    /// The file holding the key every gateway of the mesh shares (64 hex digits, a mounted
    /// Secret): sync messages and handovers are encrypted and authenticated with it, and
    /// anything not sealed with it is refused and counted. Required when `listen` is not a
    /// loopback address, unless `allow_unauthenticated`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Listen beyond the host without a key: anyone who reaches the ports can read every
    /// booking and ask for the whole index (default false).
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Handovers answered at once before the rate limit applies (default 4): each is a
    /// whole export of the index, so a flood of requests must not turn into as many.
    #[serde(default = "default_handover_burst")]
    pub handover_burst: u32,
    /// After the burst, one more handover answer per this many ms (default 5000).
    #[serde(default = "default_handover_refill_ms")]
    pub handover_refill_ms: u64,
}

fn default_handover_timeout_ms() -> u64 {
    5_000
}

fn default_handover_burst() -> u32 {
    4
}

fn default_handover_refill_ms() -> u64 {
    5_000
}

impl SyncConfig {
    /// A mesh on `listen` dialling `peers`, everything else by default (no key: for loopback).
    pub fn new(listen: &str, peers: Vec<String>) -> SyncConfig {
        SyncConfig {
            id: None,
            listen: listen.to_owned(),
            peers,
            peers_dns: None,
            handover_timeout_ms: default_handover_timeout_ms(),
            key_file: None,
            allow_unauthenticated: false,
            handover_burst: default_handover_burst(),
            handover_refill_ms: default_handover_refill_ms(),
        }
    }

    /// The mesh's key, read from `key_file`; `None` without one.
    pub fn key(&self) -> anyhow::Result<Option<SyncKey>> {
        Ok(match &self.key_file {
            Some(path) => Some(SyncKey::read(path)?),
            None => None,
        })
    }

    /// What seals this sidecar's sync and handover traffic: the key read once, for the
    /// publisher, the subscriber, the handover and the asker alike.
    pub fn sealer(&self) -> anyhow::Result<Sealer> {
        Ok(Sealer::new(self.key()?.as_ref()))
    }

    /// Checks the section on its own: endpoints, peers, the key, the limits.
    pub fn validate(&self) -> anyhow::Result<()> {
        for e in std::iter::once(&self.listen).chain(&self.peers) {
            if !e.starts_with("tcp://") {
                bail!("sync endpoints must be tcp://, got {e:?}");
            }
        }
        if self.peers.is_empty() && self.peers_dns.is_none() {
            bail!("sync needs peers or peers_dns");
        }
        let key = self.key()?;
        if key.is_none() && !self.allow_unauthenticated && !self.local() {
            bail!(
                "sync.listen = {:?} reaches beyond this host, and without a key anyone who can connect reads every booking and can ask for the whole index: set sync.key_file (a Secret every gateway mounts; `openssl rand -hex 32`), or sync.allow_unauthenticated = true",
                self.listen
            );
        }
        if self.handover_burst == 0 || self.handover_refill_ms == 0 {
            bail!("sync.handover_burst and sync.handover_refill_ms must be at least 1");
        }
        Ok(())
    }

    /// Whether `listen` is a loopback address (nothing beyond this host can connect).
    fn local(&self) -> bool {
        let host = self.listen.trim_start_matches("tcp://").rsplit_once(':').map_or("", |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
    }
}
