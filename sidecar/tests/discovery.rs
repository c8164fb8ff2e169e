//! Discovery end to end: DNS answers (from a stub resolver) and config-file edits (in the
//! real binary) change a pool's replicas while it runs; failures keep the last membership; a
//! replica that leaves takes its gauge series along.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvgate_e2e::process::{free_port, wait_for, Proc};
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::discovery::dns::{self, Resolver};
use kvgate_sidecar::discovery::Supervisor;
use kvgate_sidecar::discovery::{DiscoveryConfig, DiscoveryKind};
use kvgate_sidecar::health::Health;
use kvgate_sidecar::load::EngineReport;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::msg::ingest::{Outcome, Progress};
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::PoolConfig;
use kvgate_sidecar::score::ScoringConfig;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(10);

/// Answers whatever the test last set.
#[derive(Clone)]
struct Stub(Arc<Mutex<std::io::Result<Vec<SocketAddr>>>>);

impl Stub {
    fn answer(&self, answer: std::io::Result<Vec<&str>>) {
        *self.0.lock().unwrap() = answer.map(|a| a.iter().map(|s| s.parse().unwrap()).collect());
    }
}

impl Resolver for Stub {
    fn lookup(&mut self, name: &str, _port: u16) -> std::io::Result<Vec<SocketAddr>> {
        assert_eq!(name, "vllm.test");
        match &*self.0.lock().unwrap() {
            Ok(a) => Ok(a.clone()),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}

fn ids(pool: &Pool) -> Vec<String> {
    pool.state().replicas.into_iter().map(|r| r.id).collect()
}

/// DNS discovery of `vllm.test`, every second.
fn dns_discovery() -> DiscoveryConfig {
    DiscoveryConfig {
        kind: DiscoveryKind::Dns,
        name: "vllm.test".into(),
        port: 8000,
        kv_events: "tcp://{ip}:1".into(),
        interval_secs: 1,
        ..DiscoveryConfig::default()
    }
}

#[test]
fn dns_answers_become_the_pool() {
    let discovery = dns_discovery();
    let config = PoolConfig::new("m", "unused", 16, Vec::new());
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(config, Vec::new(), metrics.clone()));
    let supervisor =
        Arc::new(Supervisor::start(zmq::Context::new(), pool.clone(), discovery, metrics.clone()).unwrap());
    let stub = Stub(Arc::new(Mutex::new(Ok(Vec::new()))));
    stub.answer(Ok(vec!["127.0.0.2:8000", "127.0.0.3:8000"]));
    let stop = Health::new();
    let poller = dns::spawn(supervisor.clone(), stub.clone(), &stop).unwrap();

    wait_for("two replicas", WAIT, || (ids(&pool) == ["127.0.0.2:8000", "127.0.0.3:8000"]).then_some(())).unwrap();
    let errors = || metrics.render().lines().filter(|l| l.starts_with("kvgate_discovery_errors_total{")).count();
    stub.answer(Err(std::io::Error::other("SERVFAIL")));
    wait_for("a failed lookup is counted", WAIT, || (errors() > 0).then_some(())).unwrap();
    assert_eq!(ids(&pool), ["127.0.0.2:8000", "127.0.0.3:8000"], "a failed lookup keeps the replicas");
    stub.answer(Ok(vec!["127.0.0.3:8000", "127.0.0.4:8000"]));
    wait_for("the new answer", WAIT, || (ids(&pool) == ["127.0.0.3:8000", "127.0.0.4:8000"]).then_some(())).unwrap();
    assert!(metrics.render().contains("kvgate_replicas{model=\"m\",kind=\"dns\"} 2"));
    stub.answer(Ok(Vec::new()));
    wait_for("an empty answer empties the pool", WAIT, || ids(&pool).is_empty().then_some(())).unwrap();

    stop.stop();
    poller.join().unwrap();
    supervisor.shutdown();
}

/// The per-replica gauges, as `/metrics` names them.
const REPLICA_GAUGES: [&str; 7] = [
    "kvgate_replica_degraded",
    "kvgate_kv_last_event_timestamp_seconds",
    "kvgate_index_blocks",
    "kvgate_active_requests",
    "kvgate_prefill_tokens",
    "kvgate_external_requests",
    "kvgate_engine_reports_cached_tokens",
];

/// The per-replica gauges `/metrics` has a series of for `replica`, in `REPLICA_GAUGES` order.
fn gauges_of(metrics: &Metrics, replica: &str) -> Vec<&'static str> {
    let text = metrics.render();
    let label = format!("replica=\"{replica}\"");
    let has = |name: &str| text.lines().any(|l| l.starts_with(&format!("{name}{{")) && l.contains(&label));
    REPLICA_GAUGES.into_iter().filter(|name| has(name)).collect()
}

#[test]
fn a_replica_dropped_by_discovery_takes_its_gauges_along() {
    let discovery = dns_discovery();
    // Emptied at once: no grace period to wait out.
    let config = PoolConfig { leave_grace_secs: 0, ..PoolConfig::new("m", "unused", 16, Vec::new()) };
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(config, Vec::new(), metrics.clone()));
    let supervisor =
        Arc::new(Supervisor::start(zmq::Context::new(), pool.clone(), discovery, metrics.clone()).unwrap());
    let (gone, kept) = ("127.0.0.2:8000", "127.0.0.3:8000");
    let stub = Stub(Arc::new(Mutex::new(Ok(Vec::new()))));
    stub.answer(Ok(vec![gone, kept]));
    let stop = Health::new();
    let poller = dns::spawn(supervisor.clone(), stub.clone(), &stop).unwrap();
    wait_for("two replicas", WAIT, || (ids(&pool) == [gone, kept]).then_some(())).unwrap();

    // Every gauge of both: events applied, a dropped publisher, an engine's report, and a
    // request routed to each whose usage came back.
    for target in pool.active_targets() {
        pool.after_ingest(target.slot, Progress { last_seq: Some(1), degraded: false }, &Outcome::default());
        pool.publisher_disconnected(target.slot);
        pool.observe_engine(target.slot, EngineReport { requests: 2, waiting: 1, ..Default::default() });
    }
    let mut served = std::collections::BTreeSet::new();
    for i in 0..16 {
        let id = format!("req-{i}");
        let hashes = prompt_block_hashes(&[i; 32], 16, Salt::NONE);
        let routed = pool.route(&RouteRequest::exact(&id, "m", 32, 16, hashes), &ScoringConfig::default());
        if served.insert(routed.replica.expect("a replica")) {
            assert!(pool.engine_usage(&id.as_str().into(), 32, Some(0)));
        }
    }
    assert_eq!(served.len(), 2, "requests spread over both replicas");
    assert_eq!(gauges_of(&metrics, gone), REPLICA_GAUGES);
    assert_eq!(gauges_of(&metrics, kept), REPLICA_GAUGES);

    stub.answer(Ok(vec![kept]));
    wait_for("the replica's gauges go", WAIT, || gauges_of(&metrics, gone).is_empty().then_some(())).unwrap();
    assert_eq!(ids(&pool), [kept]);
    assert_eq!(gauges_of(&metrics, kept), REPLICA_GAUGES, "the remaining replica keeps its gauges");
    let text = metrics.render();
    assert!(
        text.contains(&format!("kvgate_replica_degraded{{model=\"m\",replica=\"{kept}\",reason=\"disconnected\"}} 1")),
        "{text}"
    );
    // The load timer visits every slot, the emptied one too: it brings no series back.
    pool.expire(Duration::from_secs(3600));
    assert!(gauges_of(&metrics, gone).is_empty(), "{}", metrics.render());

    stop.stop();
    poller.join().unwrap();
    supervisor.shutdown();
}

fn config(port: u16, metrics_port: u16, replicas: &[(&str, u16)]) -> String {
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    let mut toml = format!(
        "listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n[[pools]]\nmodel = \"qwen3\"\ntokenizer = {:?}\nblock_size = 16\n\
         [pools.discovery]\ninterval_secs = 1\n",
        tokenizer.display().to_string()
    );
    for (id, p) in replicas {
        toml += &format!(
            "[[pools.replicas]]\nid = \"{id}\"\nendpoint = \"127.0.0.1:{p}\"\nkv_events = \"tcp://127.0.0.1:{p}\"\n"
        );
    }
    toml
}

#[test]
fn config_file_edits_apply_without_a_restart() {
    let dir = std::env::temp_dir().join(format!("kvgate-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvgate.toml");
    let (port, metrics_port) = (free_port().unwrap(), free_port().unwrap());
    std::fs::write(&path, config(port, metrics_port, &[("a", 9001), ("b", 9002)])).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"));
    cmd.arg("--config").arg(&path);
    let _sidecar = Proc::spawn("sidecar", cmd, &dir.join("sidecar.log")).unwrap();
    let client = reqwest::blocking::Client::new();
    let get = |path: &str| client.get(format!("http://127.0.0.1:{port}{path}")).send().ok()?.text().ok();
    let replicas = || -> Option<Vec<String>> {
        let state: Value = serde_json::from_str(&get("/debug/state")?).ok()?;
        let rs = state["pools"][0]["replicas"].as_array()?;
        Some(rs.iter().map(|r| r["id"].as_str().unwrap_or_default().to_owned()).collect())
    };
    wait_for("the sidecar", WAIT, || (replicas()? == ["a", "b"]).then_some(())).unwrap();
    let metrics_only =
        |path: &str| client.get(format!("http://127.0.0.1:{metrics_port}{path}")).send().unwrap().status();
    assert_eq!(metrics_only("/metrics"), 200);
    assert_eq!(metrics_only("/healthz"), 200);
    assert_eq!(metrics_only("/debug/state"), 404, "the metrics listener serves nothing else");

    std::fs::write(&path, config(port, metrics_port, &[("a", 9001), ("c", 9003)])).unwrap();
    wait_for("b leaves, c joins", WAIT, || (replicas()? == ["a", "c"]).then_some(())).unwrap();

    std::fs::write(&path, "this is not toml").unwrap();
    wait_for("a broken file is counted", WAIT, || {
        get("/metrics")?.contains("kvgate_discovery_errors_total").then_some(())
    })
    .unwrap();
    assert_eq!(replicas().unwrap(), ["a", "c"], "a broken file changes nothing");

    std::fs::write(&path, config(port, metrics_port, &[("b", 9002), ("a", 9001), ("c", 9003)])).unwrap();
    wait_for("b is back", WAIT, || (replicas()? == ["a", "b", "c"]).then_some(())).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
