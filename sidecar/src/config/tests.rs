//! The configuration: parsing, defaults, environment overrides and validation.

use std::collections::HashMap;
use std::path::PathBuf;

use super::*;
use crate::discovery::DiscoveryKind;

struct MapEnv(HashMap<&'static str, &'static str>);
impl Env for MapEnv {
    fn var(&self, key: &str) -> Option<String> {
        self.0.get(key).map(|v| v.to_string())
    }
}

const BASE: &str = r#"
    [[pools]]
    model = "m"
    tokenizer = "tok"
    block_size = 16
    [[pools.replicas]]
    id = "a"
    endpoint = "127.0.0.1:8001"
    kv_events = "tcp://127.0.0.1:5557"
"#;

fn load(text: &str, env: &[(&'static str, &'static str)]) -> anyhow::Result<Config> {
    let dir = std::env::temp_dir().join(format!("kvgate-config-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("kvgate.toml");
    std::fs::write(&path, text)?;
    let result = Config::load(&path, &MapEnv(env.iter().copied().collect()));
    std::fs::remove_dir_all(&dir)?;
    result
}

#[test]
fn policy_names_are_the_configured_ones() {
    let all = [
        Policy::KvAware,
        Policy::LeastLoad,
        Policy::RoundRobin,
        Policy::ConsistentHash,
        Policy::PrefixAffinity,
        Policy::PredictedLatency,
    ];
    for p in all {
        let parsed: Policy = serde_json::from_value(serde_json::Value::from(p.name())).unwrap();
        assert_eq!(parsed, p, "{}", p.name());
    }
}

#[test]
fn tokenizer_modes_kvgate_cannot_reproduce_are_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kvgate-mode-{}-{}", std::process::id(), rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |mode: Option<&str>| {
        let mode = mode.map(|m| format!("tokenizer_mode = {m:?}\n")).unwrap_or_default();
        BASE.replace("tokenizer = \"tok\"", &format!("tokenizer = {:?}\n{mode}", dir.display().to_string()))
    };
    assert!(load(&config(None), &[]).is_ok(), "an ordinary directory: auto is hf");
    let named = load(&config(Some("mistral")), &[]).unwrap_err().to_string();
    assert!(named.contains("\"mistral\"") && named.contains("tokenizer_mode = \"hf\""), "{named}");
    std::fs::write(dir.join("tekken.json"), "{}").unwrap();
    let auto = load(&config(None), &[]).unwrap_err().to_string();
    assert!(auto.contains("\"mistral\""), "auto picks mistral for a Mistral repository: {auto}");
    assert!(load(&config(Some("hf")), &[]).is_ok(), "engines run with --tokenizer-mode hf");
    std::fs::remove_file(dir.join("tekken.json")).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"architectures": ["DeepseekV32ForCausalLM"]}"#).unwrap();
    assert!(load(&config(None), &[]).unwrap_err().to_string().contains("deepseek_v32"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn admission_needs_a_saturation_criterion() {
    let with = |keys: &str| BASE.replace("block_size = 16", &format!("block_size = 16\nadmission = {{ {keys} }}"));
    assert!(!load(BASE, &[]).unwrap().pools[0].pool.admission.enabled, "off by default");
    let none = load(&with("enabled = true"), &[]).unwrap_err().to_string();
    assert!(none.contains("kv_blocks or max_prefill_tokens"), "{none}");
    assert!(load(&with("enabled = true, engine_signals = true, kv_blocks = 1"), &[]).is_err(), "signals need polling");
    let learned =
        BASE.replace("block_size = 16", "block_size = 16\nengine_metrics_secs = 1\nadmission = { enabled = true }");
    assert!(load(&learned, &[]).is_ok(), "capacity learned from the engines");
    assert!(load(&with("enabled = true, kv_blocks = 100, kv_fraction = 1.5"), &[]).is_err());
    assert!(load(&with("enabled = true, kv_blocks = 100, fair_headroom = -0.1"), &[]).is_err());
    let nameless = load(&with("enabled = true, kv_blocks = 100, classes = [{ name = \"\" }]"), &[]).unwrap_err();
    assert!(nameless.to_string().contains("needs a name"), "{nameless}");
    let ok = load(&with("enabled = true, kv_blocks = 100"), &[]).unwrap();
    let a = &ok.pools[0].pool.admission;
    assert_eq!((a.kv_fraction, a.max_queue_ms, a.max_queued, a.retry_after_secs), (0.9, 2000, 256, 1));
    assert_eq!(a.fair_headroom, 0.5);
    assert_eq!((a.ttft_slo_ms, a.sheddable), (0, false));
    assert!(load(&with("enabled = true, ttft_slo_ms = 500"), &[]).is_ok(), "a TTFT SLO is a criterion of its own");
    let blind = load(&with("enabled = true, kv_blocks = 100, sheddable = true"), &[]).unwrap_err().to_string();
    assert!(blind.contains("ttft_slo_ms"), "{blind}");
    let class = "enabled = true, kv_blocks = 100, classes = [{ name = \"batch\", sheddable = true }]";
    let error = load(&with(class), &[]).unwrap_err().to_string();
    assert!(error.contains("\"batch\"") && error.contains("ttft_slo_ms"), "{error}");
    let inherited = "enabled = true, ttft_slo_ms = 500, classes = [{ name = \"batch\", sheddable = true }]";
    assert!(load(&with(inherited), &[]).is_ok(), "the class inherits the pool's SLO");
}

#[test]
fn explanations_are_kept_by_count_and_age() {
    let with = |keys: &str| BASE.replace("block_size = 16", &format!("block_size = 16\n{keys}"));
    let pool = &load(BASE, &[]).unwrap().pools[0].pool;
    assert_eq!((pool.explain_keep, pool.explain_max_age_secs), (4096, 300));
    let set = load(&with("explain_keep = 100000\nexplain_max_age_secs = 3600"), &[]).unwrap();
    assert_eq!((set.pools[0].pool.explain_keep, set.pools[0].pool.explain_max_age_secs), (100_000, 3600));
    for bad in ["explain_keep = 0", "explain_keep = 1048577", "explain_max_age_secs = 0"] {
        let error = load(&with(bad), &[]).unwrap_err().to_string();
        assert!(error.contains(bad.split(' ').next().unwrap()), "{bad}: {error}");
    }
}

#[test]
fn sessions_are_bound_only_where_the_operator_says_and_under_kv_aware() {
    let with = |keys: &str| BASE.replace("block_size = 16", &format!("block_size = 16\n{keys}"));
    assert_eq!(load(BASE, &[]).unwrap().pools[0].pool.sessions, None, "off unless configured");
    let set = load(&with("[pools.sessions]\nttl_secs = 60"), &[]).unwrap();
    let sessions = set.pools[0].pool.sessions.clone().unwrap();
    assert_eq!((sessions.ttl_secs, sessions.stickiness_blocks, sessions.max_sessions), (60, 64.0, 100_000));
    for bad in ["ttl_secs = 0", "stickiness_blocks = -1", "max_sessions = 0", "max_sessions = 10000001"] {
        let error = load(&with(&format!("[pools.sessions]\n{bad}")), &[]).unwrap_err().to_string();
        assert!(error.contains(bad.split(' ').next().unwrap()), "{bad}: {error}");
    }
    let hashed = with("policy = \"consistent_hash\"\n[pools.sessions]");
    let error = load(&hashed, &[]).unwrap_err().to_string();
    assert!(error.contains("consistent_hash") && error.contains("kv_aware"), "{error}");
}

#[test]
fn defaults_are_loopback_and_dynamos() {
    let c = load(BASE, &[]).unwrap();
    assert_eq!(c.listen, "127.0.0.1:9911".parse().unwrap());
    assert_eq!(c.scoring, ScoringConfig::default());
    assert!(c.pools[0].pool.tokenizer.ends_with("tok"));
    assert_ne!(c.pools[0].pool.tokenizer, PathBuf::from("tok"), "resolved against the config's directory");
}

#[test]
fn a_non_loopback_api_needs_the_explicit_flag() {
    let open = BASE.replace("[[pools]]", "listen = \"0.0.0.0:9911\"\n\n[[pools]]");
    let err = load(&open, &[]).unwrap_err().to_string();
    assert!(err.contains("allow_non_loopback_api"), "{err}");
    assert!(load(&BASE.replace("[[pools]]", "allow_non_loopback_api = true\n\n[[pools]]"), &[]).is_ok());
    let allowed = open.replace("[[pools]]", "allow_non_loopback_api = true\n\n[[pools]]");
    assert_eq!(load(&allowed, &[]).unwrap().listen, "0.0.0.0:9911".parse().unwrap());
    assert!(load(BASE, &[("KVGATE_LISTEN", "10.0.0.1:9911")]).is_err(), "the environment too");
    assert!(load(&BASE.replace("[[pools]]", "listen = \"[::1]:9911\"\n\n[[pools]]"), &[]).is_ok());
}

#[test]
fn constructors_match_a_minimal_toml() {
    let c = load(BASE, &[]).unwrap();
    let replica = ReplicaConfig::new("a", "127.0.0.1:8001".parse().unwrap(), "tcp://127.0.0.1:5557");
    assert_eq!(c.pools[0].pool, PoolConfig::new("m", c.pools[0].pool.tokenizer.clone(), 16, vec![replica]));
}

#[test]
fn env_overrides_with_both_names() {
    let c = load(
        BASE,
        &[
            ("KVGATE_LISTEN", "127.0.0.1:1"),
            ("DYN_ROUTER_PREFILL_LOAD_SCALE", "2.5"),
            ("KVGATE_ACTIVE_REQUEST_WEIGHT", "1"),
        ],
    )
    .unwrap();
    assert_eq!(c.listen.port(), 1);
    assert_eq!((c.scoring.prefill_load_scale, c.scoring.active_request_weight), (2.5, 1.0));
    let ours_wins = load(BASE, &[("KVGATE_PREFILL_LOAD_SCALE", "3"), ("DYN_ROUTER_PREFILL_LOAD_SCALE", "2")]).unwrap();
    assert_eq!(ours_wins.scoring.prefill_load_scale, 3.0);
    let penalty = load(BASE, &[("KVGATE_DUPLICATE_PENALTY", "0")]).unwrap();
    assert_eq!(penalty.scoring.duplicate_penalty, 0.0);
    assert!(load(BASE, &[("KVGATE_DUPLICATE_PENALTY", "-1")]).is_err(), "negative values are refused");
    assert!(load(BASE, &[("KVGATE_KV_OVERLAP_CREDIT", "x")]).is_err());
    assert!(load(BASE, &[("KVGATE_KV_OVERLAP_CREDIT", "-1")]).is_err());
}

#[test]
fn shipped_example_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kvgate.example.toml");
    let c = Config::load(&path, &MapEnv(HashMap::new())).unwrap();
    assert_eq!(c.pools[0].pool.replicas.len(), 2);
    assert!(c.pools[0].pool.tokenizer.join("tokenizer.json").exists(), "the example points at the vendored model");
}

#[test]
fn invalid_configs_are_rejected() {
    assert!(load("pools = []", &[]).is_err());
    assert!(load(&BASE.replace("block_size = 16", "block_size = 0"), &[]).is_err());
    assert!(load(
        &format!("{BASE}\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:8002\"\nkv_events = \"tcp://x:1\""),
        &[]
    )
    .is_err());
    assert!(load(&BASE.replace("tcp://", "http://"), &[]).is_err());
    assert!(load(&format!("bogus = 1\n{BASE}"), &[]).is_err(), "unknown keys are errors");
    assert!(
        load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"m\"]"), &[]).is_err(),
        "adapter named like a model"
    );
    assert!(load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"a\", \"a\"]"), &[]).is_err());
    assert!(load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"a\"]"), &[]).is_ok());
    assert!(load(&BASE.replace("127.0.0.1:8001", "not-an-address"), &[]).is_err());
    let dp = |n: u32, events: &str| {
        BASE.replace(
            "kv_events = \"tcp://127.0.0.1:5557\"",
            &format!("kv_events = \"{events}\"\ndata_parallel_size = {n}"),
        )
    };
    assert!(load(&dp(4, "tcp://127.0.0.1:5557"), &[]).is_ok());
    assert!(load(&dp(2, "ipc:///tmp/kv"), &[]).is_err(), "ipc endpoints cannot be offset per rank");
    assert!(load(&dp(0, "tcp://127.0.0.1:5557"), &[]).is_err());
}

const DNS: &str = r#"
    [[pools]]
    model = "m"
    tokenizer = "tok"
    block_size = 16
    [pools.discovery]
    kind = "dns"
    name = "vllm.llm.svc.cluster.local"
    port = 8000
    kv_events = "tcp://{ip}:5557"
    kv_replay = "tcp://{ip}:5558"
"#;

#[test]
fn sync_needs_tcp_endpoints_and_peers() {
    let with = |sync: &str| load(&format!("{sync}\n{BASE}"), &[]);
    let ok = with("[sync]\nlisten = \"tcp://127.0.0.1:9913\"\npeers_dns = \"gw.ns.svc.cluster.local\"").unwrap();
    assert_eq!(ok.sync.unwrap().peers_dns.as_deref(), Some("gw.ns.svc.cluster.local"));
    assert!(with("[sync]\nlisten = \"tcp://0.0.0.0:9913\"").is_err(), "no peers");
    assert!(with("[sync]\nlisten = \"ipc:///x\"\npeers = [\"tcp://a:1\"]").is_err());
    assert!(load(BASE, &[]).unwrap().sync.is_none(), "off by default");
    let clash = load(&format!("metrics_listen = \"0.0.0.0:9914\"\n[sync]\nlisten = \"tcp://127.0.0.1:9913\"\npeers = [\"tcp://a:1\"]\n{BASE}"), &[]);
    assert!(clash.unwrap_err().to_string().contains("port + 1"), "the handover's port is taken");
}

#[test]
fn sync_beyond_loopback_needs_a_key_or_the_operators_word() {
    let with = |sync: &str, env: &[(&'static str, &'static str)]| {
        load(&format!("[sync]\n{sync}\npeers = [\"tcp://a:1\"]\n{BASE}"), env)
    };
    for listen in ["tcp://0.0.0.0:9913", "tcp://10.0.0.7:9913", "tcp://gw-0:9913"] {
        let e = with(&format!("listen = \"{listen}\""), &[]).unwrap_err().to_string();
        assert!(e.contains("sync.key_file"), "{listen}: {e}");
    }
    for listen in ["tcp://127.0.0.1:9913", "tcp://[::1]:9913", "tcp://localhost:9913"] {
        assert!(with(&format!("listen = \"{listen}\""), &[]).is_ok(), "{listen} is loopback");
    }
    assert!(with("listen = \"tcp://0.0.0.0:9913\"\nallow_unauthenticated = true", &[]).is_ok());
    // In Kubernetes the pod's IP comes through the environment: it is checked the same way.
    let e = with("listen = \"tcp://127.0.0.1:9913\"", &[("KVGATE_SYNC_LISTEN", "tcp://10.0.0.7:9913")]);
    assert!(e.unwrap_err().to_string().contains("sync.key_file"));

    let dir = std::env::temp_dir().join(format!("kvgate-config-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    std::fs::write(&good, "6b76676174652d746573742d6b65792d6f6e6c792d6e65766572207573652121\n").unwrap();
    let bad = dir.join("bad");
    std::fs::write(&bad, "hunter2").unwrap();
    let keyed = |path: &std::path::Path| {
        with(&format!("listen = \"tcp://10.0.0.7:9913\"\nkey_file = {:?}", path.display().to_string()), &[])
    };
    assert!(keyed(&good).is_ok());
    assert!(keyed(&bad).unwrap_err().to_string().contains("64 hex digits"));
    assert!(keyed(&dir.join("missing")).unwrap_err().to_string().contains("reading the sync key"));
    let zero = with("listen = \"tcp://127.0.0.1:9913\"\nhandover_burst = 0", &[]);
    assert!(zero.is_err(), "a zero burst would never hand over");
}

#[test]
fn disaggregated_pools_need_both_roles_and_sglang_bootstrap_ports() {
    let pd = |mode: &str, prefill: &str| {
        format!(
            r#"
            [[pools]]
            model = "m"
            tokenizer = "tok"
            block_size = 16
            disaggregation = {{ mode = "{mode}" }}
            [[pools.replicas]]
            id = "p"
            endpoint = "127.0.0.1:8001"
            kv_events = "tcp://127.0.0.1:5557"
            {prefill}
            [[pools.replicas]]
            id = "d"
            endpoint = "127.0.0.1:8002"
            kv_events = "tcp://127.0.0.1:5567"
            role = "decode"
            "#
        )
    };
    let c = load(&pd("vllm", "role = \"prefill\""), &[]).unwrap();
    let d = c.pools[0].pool.disaggregation.as_ref().unwrap();
    assert_eq!(
        (d.mode, d.min_remote_prefill_tokens, d.max_prefill_backlog_tokens),
        (TransferProtocol::Vllm, 256, None)
    );
    assert_eq!(c.pools[0].pool.replicas[0].role, Role::Prefill);
    assert!(load(&pd("sglang", "role = \"prefill\""), &[]).is_err(), "no bootstrap port");
    assert!(load(&pd("sglang", "role = \"prefill\"\nbootstrap_port = 8998"), &[]).is_ok());
    assert!(load(&pd("vllm", "role = \"decode\""), &[]).is_err(), "nothing prefills");
    assert!(load(&pd("vllm", ""), &[]).is_ok(), "`both` takes vLLM's prefill legs too");
    assert!(load(&pd("sglang", ""), &[]).is_err(), "an SGLang server in neither mode takes no leg");
    assert!(load(&pd("nixl", "role = \"prefill\""), &[]).is_err());
    for policy in ["prefix_affinity", "predicted_latency"] {
        let with = pd("vllm", "role = \"prefill\"")
            .replace("block_size = 16", &format!("block_size = 16\npolicy = \"{policy}\""));
        let refused = load(&with, &[]).unwrap_err().to_string();
        assert!(refused.contains(policy), "{policy}: {refused}");
    }
    let slo = pd("vllm", "role = \"prefill\"")
        .replace("block_size = 16", "block_size = 16\nadmission = { enabled = true, ttft_slo_ms = 500 }");
    let refused = load(&slo, &[]).unwrap_err().to_string();
    assert!(refused.contains("SLO") && refused.contains("disaggregated"), "{refused}");
    let roles_alone =
        BASE.replace("kv_events = \"tcp://127.0.0.1:5557\"", "kv_events = \"tcp://127.0.0.1:5557\"\nrole = \"decode\"");
    assert!(load(&roles_alone, &[]).is_err(), "a role without disaggregation");
    let discovered = DNS.replace("block_size = 16", "block_size = 16\ndisaggregation = { mode = \"vllm\" }");
    assert!(load(&discovered, &[]).is_err(), "no prefill_name: every engine one role");
    let replay = "kv_replay = \"tcp://{ip}:5558\"";
    let named = discovered.replace(replay, &format!("{replay}\nprefill_name = \"prefill.llm.svc\""));
    let c = load(&named, &[]).unwrap();
    let d = &c.pools[0].discovery;
    let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
    let found = d.replicas(vec![addr("10.0.0.1:8000"), addr("10.0.0.2:8000")], vec![addr("10.0.0.2:8000")]);
    let roles: Vec<(String, Role)> = found.into_iter().map(|r| (r.id, r.role)).collect();
    assert_eq!(roles, [("10.0.0.1:8000".into(), Role::Decode), ("10.0.0.2:8000".into(), Role::Prefill)]);
    assert!(load(&named.replace("\"vllm\"", "\"sglang\""), &[]).is_err(), "sglang needs the bootstrap port");
    assert!(load(&DNS.replace(replay, &format!("{replay}\nprefill_name = \"p\"")), &[]).is_err(), "no disaggregation");
}

#[test]
fn prefix_affinity_pools_need_no_event_endpoints() {
    let no_events = BASE.replace("kv_events = \"tcp://127.0.0.1:5557\"", "");
    assert!(load(&no_events, &[]).is_err(), "kv_aware reads events");
    let affinity = no_events.replace("block_size = 16", "block_size = 16\npolicy = \"prefix_affinity\"");
    let c = load(&affinity, &[]).unwrap();
    assert!(!c.pools[0].pool.reads_events());
    assert_eq!((c.pools[0].pool.affinity_ttl_secs, c.pools[0].pool.affinity_blocks), (120, 1 << 18));
}

#[test]
fn discovered_pools_need_a_name_port_and_templates() {
    let c = load(DNS, &[]).unwrap();
    let d = &c.pools[0].discovery;
    assert_eq!((d.kind, d.interval_secs, d.admin.as_str()), (DiscoveryKind::Dns, 5, "http://127.0.0.1:15000"));
    let envoy = DNS.replace("\"dns\"", "\"envoy\"").replace("port = 8000", "admin = \"http://127.0.0.1:9901\"");
    assert_eq!(load(&envoy, &[]).unwrap().pools[0].discovery.kind, DiscoveryKind::Envoy);
    for (broken, why) in [
        (DNS.replace("name = \"vllm.llm.svc.cluster.local\"", ""), "no name"),
        (DNS.replace("port = 8000", ""), "no port"),
        (DNS.replace("tcp://{ip}:5557", "tcp://10.0.0.1:5557"), "events without {ip}"),
        (DNS.replace("tcp://{ip}:5558", "http://{ip}:5558"), "not a ZMQ endpoint"),
        (DNS.replace("kind = \"dns\"", "kind = \"dns\"\ninterval_secs = 0"), "zero interval"),
        (DNS.replace("kind = \"dns\"", "kind = \"consul\""), "unknown kind"),
        (envoy.replace("http://127.0.0.1:9901", "127.0.0.1:9901"), "admin without http://"),
        (
            format!("{DNS}\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:1\"\nkv_events = \"tcp://x:1\""),
            "replicas and dns",
        ),
    ] {
        assert!(load(&broken, &[]).is_err(), "{why} must be rejected");
    }
}

/// The keys a section's type accepts, as serde lists them when it refuses an unknown one.
fn keys<T: serde::de::DeserializeOwned>() -> Vec<String> {
    let refused = toml::from_str::<T>("kvgate_unknown_key = 0").err().map(|e| e.to_string()).unwrap_or_default();
    let listed = refused.split_once("expected").map_or("", |(_, listed)| listed);
    listed.split('`').skip(1).step_by(2).map(str::to_owned).collect()
}

/// Whether `text` names `key` as code: `` `key` ``, `` `key = …` `` or a table `[….key]`.
fn names(text: &str, key: &str) -> bool {
    text.match_indices(key).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + key.len()..].chars().next();
        matches!(before, Some('`' | '[' | '.')) && matches!(after, Some('`' | ' ' | ']'))
    })
}

/// The README's configuration reference names every key each section of the file accepts.
#[test]
fn the_readme_names_every_configuration_key() {
    use crate::admission::{AdmissionConfig, ClassConfig};
    use crate::discovery::DiscoveryConfig;
    use crate::pool::{DisaggregationConfig, ReplicaConfig};
    use crate::sync::SyncConfig;
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md")).unwrap();
    let sections = [
        ("the top level", keys::<Config>()),
        ("[scoring]", keys::<ScoringConfig>()),
        ("[[pools]]", keys::<PoolConfig>()),
        ("[[pools.replicas]]", keys::<ReplicaConfig>()),
        ("[pools.discovery]", keys::<DiscoveryConfig>()),
        ("[pools.disaggregation]", keys::<DisaggregationConfig>()),
        ("[pools.admission]", keys::<AdmissionConfig>()),
        ("[pools.admission.classes]", keys::<ClassConfig>()),
        ("[pools.sessions]", keys::<crate::pool::SessionConfig>()),
        ("[sync]", keys::<SyncConfig>()),
    ];
    let mut missing = Vec::new();
    for (section, keys) in &sections {
        assert!(keys.len() > 1, "{section}: its keys could not be listed ({keys:?})");
        missing.extend(keys.iter().filter(|k| !names(&readme, k)).map(|k| format!("{section} {k}")));
    }
    assert!(missing.is_empty(), "README.md's configuration reference does not name: {missing:?}");
}

#[test]
fn offload_threads_default_to_the_cores_and_no_spreading_and_refuse_zero() {
    let config = load(BASE, &[]).unwrap();
    assert_eq!((config.offload_threads, config.offload_spread_threads), (None, 1));
    let config = load(&format!("offload_threads = 4\noffload_spread_threads = 2\n{BASE}"), &[]).unwrap();
    assert_eq!((config.offload_threads, config.offload_spread_threads), (Some(4), 2));
    for key in ["offload_threads", "offload_spread_threads"] {
        let err = load(&format!("{key} = 0\n{BASE}"), &[]).unwrap_err().to_string();
        assert!(err.contains(&format!("{key} must be at least 1")), "{err}");
    }
}

#[test]
fn a_replica_id_cannot_name_another_replicas_rank() {
    // `a` with two ranks is targets `a#0` and `a#1`: a replica named `a#0` would be a second.
    let ranked = BASE.replace("id = \"a\"", "id = \"a\"\n    data_parallel_size = 2");
    let text = format!(
        "{ranked}    [[pools.replicas]]\n    id = \"a#0\"\n    endpoint = \"127.0.0.1:8009\"\n    kv_events = \"tcp://127.0.0.1:5567\"\n"
    );
    let err = load(&text, &[]).unwrap_err().to_string();
    assert!(err.contains("\"a#0\" holds '#'"), "{err}");
    assert!(load(&ranked, &[]).is_ok(), "the ranked replica alone is fine");
}
