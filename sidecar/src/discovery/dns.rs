//! `dns` discovery: every address of a name is a replica (a Kubernetes headless Service has
//! one record per ready pod).

use std::collections::BTreeSet;
use std::net::{SocketAddr, ToSocketAddrs};

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{poll, DiscoveryConfig, DiscoveryKind, Supervisor};
use crate::health::Health;
use crate::pool::ReplicaConfig;

/// Resolves a name to addresses (the system resolver in production, a stub in tests).
pub trait Resolver: Send + 'static {
    /// The addresses of `name`, with `port`.
    fn lookup(&mut self, name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>>;
}

/// The system resolver (`getaddrinfo`: `/etc/hosts`, search domains, the cluster DNS).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn lookup(&mut self, name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
        Ok((name, port).to_socket_addrs()?.collect())
    }
}

/// One refresh: the replicas at `config.name`'s addresses, sorted and deduplicated. An error
/// (including "no such name") means "unknown", not "no replicas".
pub fn replicas(config: &DiscoveryConfig, resolver: &mut dyn Resolver) -> std::io::Result<Vec<ReplicaConfig>> {
    let addrs: BTreeSet<SocketAddr> = resolver.lookup(&config.name, config.port)?.into_iter().collect();
    let prefill = match &config.prefill_name {
        Some(name) => resolver.lookup(name, config.port)?,
        None => Vec::new(),
    };
    Ok(config.replicas(addrs.into_iter().collect(), prefill))
}

/// Resolves the pool's name every `interval_secs` and applies the result until the sidecar
/// stops.
pub fn spawn(
    supervisor: Arc<Supervisor>,
    mut resolver: impl Resolver,
    health: &Arc<Health>,
) -> std::io::Result<JoinHandle<()>> {
    let config = supervisor.discovery().clone();
    let interval = Duration::from_secs(config.interval_secs);
    poll(&config.name.clone(), interval, health, move || {
        let found = replicas(&config, &mut resolver).map_err(|e| format!("resolving {}: {e}", config.name));
        supervisor.refresh(DiscoveryKind::Dns, found);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers from a script, one answer per lookup.
    pub struct Scripted(pub Vec<std::io::Result<Vec<SocketAddr>>>);

    impl Resolver for Scripted {
        fn lookup(&mut self, _name: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
            assert_eq!(port, 8000);
            self.0.remove(0)
        }
    }

    fn config() -> DiscoveryConfig {
        DiscoveryConfig {
            kind: DiscoveryKind::Dns,
            name: "vllm.default.svc.cluster.local".into(),
            port: 8000,
            kv_events: "tcp://{ip}:5557".into(),
            kv_replay: Some("tcp://{ip}:5558".into()),
            ..DiscoveryConfig::default()
        }
    }

    #[test]
    fn addresses_become_replicas_with_templated_event_endpoints() {
        let a: SocketAddr = "10.0.0.7:8000".parse().unwrap();
        let b: SocketAddr = "[fd00::5]:8000".parse().unwrap();
        let mut resolver = Scripted(vec![Ok(vec![b, a, a])]);
        let found = replicas(&config(), &mut resolver).unwrap();
        assert_eq!(found.len(), 2, "deduplicated");
        assert_eq!(found[0].id, "10.0.0.7:8000");
        assert_eq!(found[0].endpoint, a);
        assert_eq!(found[0].kv_events, "tcp://10.0.0.7:5557");
        assert_eq!(found[0].kv_replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!(found[1].kv_events, "tcp://[fd00::5]:5557", "IPv6 in brackets");
    }

    #[test]
    fn a_second_name_gives_a_disaggregated_pools_prefill_workers() {
        use crate::pool::Role;
        let (d, p): (SocketAddr, SocketAddr) = ("10.0.0.7:8000".parse().unwrap(), "10.0.0.9:8000".parse().unwrap());
        let config = DiscoveryConfig { prefill_name: Some("prefill".into()), bootstrap_port: Some(8998), ..config() };
        let found = replicas(&config, &mut Scripted(vec![Ok(vec![d]), Ok(vec![p])])).unwrap();
        let roles: Vec<_> = found.iter().map(|r| (r.endpoint, r.role, r.bootstrap_port)).collect();
        assert_eq!(roles, [(d, Role::Decode, None), (p, Role::Prefill, Some(8998))]);
        let failed = replicas(&config, &mut Scripted(vec![Ok(vec![d]), Err(std::io::ErrorKind::NotFound.into())]));
        assert!(failed.is_err(), "half a fleet is not the fleet: the last membership is kept");
    }

    #[test]
    fn the_system_resolver_resolves_localhost() {
        let found = SystemResolver.lookup("localhost", 8000).unwrap();
        assert!(found.iter().any(|a| a.ip().is_loopback() && a.port() == 8000));
    }
}
