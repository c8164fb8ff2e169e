//! The Helm chart (`charts/kvgate`), checked with Helm's own engine and Kubernetes' schemas,
//! then for what kvgate needs of what it renders.
//!
//! For each value set, `tools/helm/render.py` (in the venv `tools/helm/install.sh` makes,
//! `target/helm-venv`, which `cargo xtask test` installs) validates the values against the
//! chart's `values.schema.json`, runs `helm lint --strict`, renders the chart as `helm install`
//! would (Helm v4 as a library, offline) and validates every object of a built-in kind — and
//! the pod spec the EnvoyProxy's patch adds — against Kubernetes' OpenAPI schema, strictly.
//! Kinds from CRDs (Istio's, Envoy Gateway's, the Gateway API's, the Prometheus Operator's)
//! have no schema offline: their structure is checked here, against the hand-written
//! manifests of `envoy/k8s` and `envoy/gateway-api` they replace, and for agreement with the
//! rest. Every rendered kvgate.toml is loaded with the sidecar's own loader and every filter
//! configuration parsed with the filter's own parser. The chart is also packaged, as `helm
//! package` does it, for what its `.helmignore` leaves out.
//!
//! Without the venv these tests are skipped, with a message, unless `CI` is set.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use kvgate_filter::config::FilterConfig;
use kvgate_sidecar::config::{Config, Env};
use kvgate_sidecar::pool::TransferProtocol;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

mod common;

use common::{find, load_config_with, manifests, removed, repo, template_arrival, SYNC_KEY_DIR};

/// The filter image's digest in every value set.
const DIGEST: &str = "sha256:8d2f4b0c6a1e9f7d3b5a2c4e6f8091a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e4";
/// What a pod's IP is taken to be.
const POD_IP: &str = "10.0.0.7";
/// Kinds defined by CRDs, which Kubernetes' own schemas do not cover.
const CRD_KINDS: [&str; 10] = [
    "EnvoyFilter.networking.istio.io",
    "Telemetry.telemetry.istio.io",
    "PodMonitor.monitoring.coreos.com",
    "PrometheusRule.monitoring.coreos.com",
    "EnvoyProxy.gateway.envoyproxy.io",
    "ClientTrafficPolicy.gateway.envoyproxy.io",
    "EnvoyExtensionPolicy.gateway.envoyproxy.io",
    "EnvoyPatchPolicy.gateway.envoyproxy.io",
    "GatewayClass.gateway.networking.k8s.io",
    "Gateway.gateway.networking.k8s.io",
];

// ---------------------------------------------------------------------------------------------
// Rendering

/// The venv's python, or `None` (the tests skip) when it is not installed and `CI` is unset.
fn python() -> Option<PathBuf> {
    let venv = common::target_dir().join("helm-venv");
    let how = format!(
        "`cargo xtask install` or `bash tools/helm/install.sh {}`; `cargo xtask test` installs them",
        venv.display()
    );
    common::installed(&venv, "the chart's checkers", &how, "tools/helm/requirements.txt")
        .then(|| venv.join("bin/python"))
}

/// What `render.py` printed for one value set.
struct Rendered {
    out: Value,
    namespace: String,
    values: Value,
}

impl Rendered {
    fn objects(&self) -> impl Iterator<Item = &Value> {
        self.out["objects"].as_array().unwrap().iter().map(|o| &o["object"])
    }

    fn all(&self, kind: &str) -> Vec<&Value> {
        self.objects().filter(|o| o["kind"] == kind).collect()
    }

    /// The one object of `kind`.
    fn one(&self, kind: &str) -> &Value {
        let all = self.all(kind);
        assert_eq!(all.len(), 1, "{} objects of kind {kind}", all.len());
        all[0]
    }

    fn named(&self, kind: &str, name: &str) -> &Value {
        self.objects()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    }

    fn istio(&self) -> bool {
        self.values["gateway"]["type"] == "istio"
    }

    fn sync(&self) -> bool {
        self.values["sync"]["enabled"] != false
    }
}

static RENDERS: AtomicU64 = AtomicU64::new(0);

/// Renders the chart for `values` as release `kvgate` in `namespace`; `Err` is render.py's
/// complaint.
fn try_render(python: &Path, values: &Value, namespace: &str) -> Result<Rendered, String> {
    let file = std::env::temp_dir().join(format!(
        "kvgate-chart-{}-{}.json",
        std::process::id(),
        RENDERS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&file, values.to_string()).unwrap();
    let out = Command::new(python)
        .arg(repo().join("tools/helm/render.py"))
        .arg(repo().join("charts/kvgate"))
        .arg(&file)
        .args(["--name", "kvgate", "--namespace", namespace])
        .output()
        .expect("running tools/helm/render.py");
    std::fs::remove_file(&file).unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let out: Value = serde_json::from_slice(&out.stdout).expect("render.py prints JSON");
    Ok(Rendered { out, namespace: namespace.to_owned(), values: values.clone() })
}

fn render(python: &Path, values: &Value, namespace: &str) -> Rendered {
    try_render(python, values, namespace).unwrap_or_else(|e| panic!("{e}\nvalues: {values:#}"))
}

/// `over` merged into `base`, objects key by key.
fn merged(base: Value, over: Value) -> Value {
    match (base, over) {
        (Value::Object(mut a), Value::Object(b)) => {
            for (k, v) in b {
                let old = a.remove(&k).unwrap_or(Value::Null);
                a.insert(k, merged(old, v));
            }
            Value::Object(a)
        }
        (_, over) => over,
    }
}

/// The images every value set needs, and the gateway type.
fn values(gateway: &str, over: Value) -> Value {
    let base = json!({
        "gateway": {"type": gateway},
        "sidecar": {"image": {"repository": "registry.example.com/kvgate-sidecar", "tag": "0.1.0"}},
        "filter": {"image": "registry.example.com/kvgate-filter:0.1.0", "sha256": DIGEST},
    });
    merged(base, over)
}

/// A pool whose tokenizer comes from the Hub, with admission control.
fn hub_pool() -> Value {
    json!({
        "model": "Qwen/Qwen3-8B",
        "block_size": 16,
        "tokenizer": {"hub": {
            "repo": "Qwen/Qwen3-8B",
            "revision": "b968826d9c46dd6066d109eabc6255188de91218",
            "tokenSecret": {"name": "hf-token", "key": "hf_token"},
            "endpoint": "https://hf-mirror.example.com",
        }},
        "discovery": {"name": "qwen3-8b-headless.llm.svc.cluster.local"},
        "engine_metrics_secs": 5,
        "admission": {
            "enabled": true,
            "kv_blocks": 40000,
            "default_class": "batch",
            "classes": [
                {"name": "interactive", "priority": 10, "max_queue_ms": 1000},
                {"name": "batch", "priority": 0, "kv_fraction": 0.7},
            ],
        },
    })
}

/// A pool whose tokenizer is on a volume, found through the gateway's own Envoy.
fn volume_pool() -> Value {
    json!({
        "model": "llama",
        "block_size": 32,
        "policy": "least_load",
        "tokenizer": {"volume": {"persistentVolumeClaim": {"claimName": "tokenizers", "readOnly": true}}, "subPath": "llama-3.2"},
        "discovery": {"kind": "envoy", "name": "outbound|8000||llama.llm.svc.cluster.local", "kv_replay": ""},
        "extraToml": "max_model_len = 32768\n",
    })
}

/// The value sets: name, namespace, values.
fn cases() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        ("istio", "istio-system", values("istio", json!({}))),
        (
            "istio with hub and volume tokenizers, admission, monitoring",
            "istio-system",
            values(
                "istio",
                json!({
                    "pools": [hub_pool(), volume_pool()],
                    "istio": {"engineServices": [
                        {"host": "qwen3-8b.llm.svc.cluster.local", "port": 8000},
                        {"host": "llama.llm.svc.cluster.local", "port": 8000},
                    ]},
                    "monitoring": {"enabled": true, "labels": {"release": "prometheus"}},
                    "sidecar": {"config": {"scoring": {"prefill_load_scale": 4, "duplicate_penalty": 2.5}}},
                    "filter": {"config": {"admission_wait_ms": 2000, "priority_header": "x-kvgate-priority", "breaker_failures": 3}},
                }),
            ),
        ),
        ("istio without sync", "istio-system", values("istio", json!({"sync": {"enabled": false}}))),
        (
            "istio, disaggregated, an existing key",
            "istio-system",
            values(
                "istio",
                json!({
                    "pools": [{
                        "model": "qwen3",
                        "block_size": 16,
                        "tokenizer": {"path": "/models/qwen3-0.6b"},
                        "disaggregation": {"mode": "vllm", "min_remote_prefill_tokens": 256},
                        "discovery": {
                            "name": "vllm-decode-headless.llm.svc.cluster.local",
                            "prefill_name": "vllm-prefill-headless.llm.svc.cluster.local",
                        },
                    }],
                    "istio": {"engineServices": [{"host": "vllm-pd.llm.svc.cluster.local", "port": 8000}]},
                    "sync": {"existingSecret": "gateway-mesh-key"},
                }),
            ),
        ),
        (
            "envoy-gateway, the chart's Gateway",
            "llm",
            values(
                "envoy-gateway",
                json!({
                    "envoyGateway": {"gateway": {"className": "eg"}},
                    "pools": [hub_pool()],
                    "monitoring": {"enabled": true},
                    "tracing": {"collector": {"name": "otel-collector", "namespace": "observability"}, "samplingPercent": 5},
                }),
            ),
        ),
        (
            "envoy-gateway, your Gateway, without sync",
            "llm",
            values(
                "envoy-gateway",
                json!({
                    "envoyGateway": {"gateway": {"name": "inference", "create": false}, "listener": "https", "wasmFilterIndex": 2},
                    "pools": [volume_pool()],
                    "sync": {"enabled": false},
                    "sidecar": {"logFormat": "json"},
                }),
            ),
        ),
        ("every key", "istio-system", maximal()),
    ]
}

/// A value set that sets every key the schema types for kvgate.
fn maximal() -> Value {
    let scoring = json!({
        "prefill_load_scale": 4.0, "kv_overlap_credit": 1.0, "kv_overlap_credit_decay": 0.0,
        "active_request_weight": 0.0, "host_cache_hit_weight": 0.75, "disk_cache_hit_weight": 0.25,
        "temperature": 0.0, "duplicate_penalty": 4.0,
    });
    let discovery = json!({
        "kind": "dns",
        "name": "sglang-decode-headless.llm.svc.cluster.local",
        "port": 30000,
        "admin": "http://127.0.0.1:15000",
        "kv_events": "tcp://{ip}:5557",
        "kv_replay": "tcp://{ip}:5558",
        "kv_events_topic": "kv-events",
        "interval_secs": 5,
        "data_parallel_size": 2,
        "prefill_name": "sglang-prefill-headless.llm.svc.cluster.local",
        "bootstrap_port": 8998,
    });
    let admission = json!({
        "enabled": true,
        "kv_blocks": 40000,
        "kv_fraction": 0.9,
        "max_prefill_tokens": 8192,
        "engine_signals": true,
        "max_engine_waiting": 8,
        "max_queue_ms": 2000,
        "max_queued": 256,
        "retry_after_secs": 1,
        "default_class": "batch",
        "fair_headroom": 0.5,
        // No SLO: the pool below is disaggregated, which refuses one.
        "ttft_slo_ms": 0,
        "itl_slo_ms": 0,
        "sheddable": false,
        "classes": [
            {"name": "interactive", "priority": 10, "max_queue_ms": 1000, "max_queued": 64,
             "kv_fraction": 0.9, "max_prefill_tokens": 8192, "ttft_slo_ms": 0, "itl_slo_ms": 0,
             "sheddable": false},
            {"name": "batch", "priority": 0},
        ],
    });
    let pool = json!({
        "model": "qwen3",
        "tokenizer": {"path": "/models/qwen3-0.6b"},
        "block_size": 16,
        "chat_template_content_format": "auto",
        "policy": "kv_aware",
        "affinity_ttl_secs": 120,
        "affinity_blocks": 262144,
        "inflight_credit_secs": 10,
        "leave_grace_secs": 30,
        "prefill_tokens_per_sec": 8000,
        "max_model_len": 32768,
        "tokenizer_mode": "hf",
        "engine_metrics_secs": 5,
        "adapters": ["sql-lora"],
        "adapters_poll_secs": 10,
        "explain_keep": 4096,
        "explain_max_age_secs": 300,
        "extraToml": "",
        "discovery": discovery,
        "admission": admission,
        "disaggregation": {
            "mode": "sglang",
            "min_remote_prefill_tokens": 256,
            "max_prefill_backlog_tokens": 65536,
            "prefill_policy": "kv_aware",
        },
        "sessions": {"ttl_secs": 600, "stickiness_blocks": 64.0, "max_sessions": 100000},
    });
    let filter = json!({
        "sidecar_authority": "kvgate-sidecar",
        "route_timeout_ms": 25,
        "offload_timeout_ms": 1000,
        "fetch_timeout_ms": 10000,
        "retry_ms": 1000,
        "models_refresh_ms": 10000,
        "max_tokenize_bytes": 1048576,
        "offload_bytes": 16384,
        "envoy_tokenizers": ["Qwen/Qwen3-0.6B"],
        "debug_headers": false,
        "segment_cache_bytes": 16777216,
        "forward_tokens": false,
        "forward_chat_tokens": false,
        "decode_progress": true,
        "request_usage": true,
        "admission_wait_ms": 2000,
        "priority_header": "x-kvgate-priority",
        "tenant_header": "x-kvgate-tenant",
        "ttft_slo_header": "x-kvgate-ttft-slo-ms",
        "itl_slo_header": "x-kvgate-itl-slo-ms",
        "session_header": "x-session-id",
        "prefill_cluster": "outbound|30000||sglang.llm.svc.cluster.local",
        "prefill_timeout_ms": 60000,
        "client_transfer_fields": false,
        "breaker_failures": 5,
        "breaker_open_ms": 1000,
        "breaker_max_open_ms": 30000,
    });
    values(
        "istio",
        json!({
            "sidecar": {"logFormat": "json", "config": {
                "request_expiry_secs": 300,
                "stall_timeout_secs": 30,
                "allow_request_overrides": false,
                "offload_queue_bytes": 67108864,
                "offload_threads": 2,
                "offload_spread_threads": 2,
                "state_save_secs": 5,
                "scoring": scoring,
            }},
            "sync": {"config": {"handover_timeout_ms": 5000, "handover_burst": 4, "handover_refill_ms": 5000}},
            "pools": [pool],
            "filter": {"config": filter},
            "istio": {"engineServices": [{"host": "sglang.llm.svc.cluster.local", "port": 30000}]},
            "monitoring": {"enabled": true, "interval": "30s", "labels": {"release": "prometheus"}, "prometheusRule": {"enabled": true}},
            "tracing": {
                "collector": {"name": "otel-collector", "namespace": "monitoring", "grpcPort": 14317, "httpPort": 14318},
                "samplingPercent": 10,
                "istioProvider": "otel-tracing",
            },
        }),
    )
}

// ---------------------------------------------------------------------------------------------
// What every rendering must hold

/// The container's environment: its `env` values, `$(VAR)` expanded, the pod's IP for
/// `status.podIP`.
struct ContainerEnv(BTreeMap<String, String>);

impl ContainerEnv {
    fn of(container: &Value) -> ContainerEnv {
        let mut vars = BTreeMap::<String, String>::new();
        for e in container["env"].as_array().into_iter().flatten() {
            let value = if e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" {
                POD_IP.to_owned()
            } else {
                let mut v = e["value"].as_str().unwrap_or_default().to_owned();
                for (name, value) in &vars {
                    v = v.replace(&format!("$({name})"), value.as_str());
                }
                v
            };
            vars.insert(e["name"].as_str().unwrap().to_owned(), value);
        }
        ContainerEnv(vars)
    }
}

impl Env for ContainerEnv {
    fn var(&self, key: &str) -> Option<String> {
        self.0.get(key).cloned()
    }
}

/// What a rendering gives kvgate, once checked.
struct Gateway<'a> {
    /// The gateway pods' spec (Istio: the Deployment's; Envoy Gateway: what the EnvoyProxy's
    /// patch adds).
    pod: &'a Value,
    /// The labels that select the gateway pods.
    selector: Value,
    /// The namespace they run in.
    pod_namespace: String,
    sidecar: &'a Value,
    config: Config,
    filter: FilterConfig,
    /// The generated sync key (hex), if the chart made one.
    generated_key: Option<String>,
}

fn by_name<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array().into_iter().flatten().find(|x| x["name"] == name).unwrap_or_else(|| panic!("no {name} in {list}"))
}

fn str_set(v: &Value) -> BTreeSet<String> {
    v.as_array().unwrap().iter().map(|x| x.as_str().unwrap().to_owned()).collect()
}

/// Decodes standard base64 (a Secret's data).
fn base64(text: &str) -> Vec<u8> {
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let (mut out, mut acc, mut bits) = (Vec::new(), 0u32, 0);
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = alphabet.iter().position(|&a| a == c).expect("base64") as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// Every check that holds whatever the values; returns what was found, for the tests' own.
fn check(r: &Rendered) -> Gateway<'_> {
    // Helm and Kubernetes: lint clean (render.py fails on warnings and errors), every object of
    // a built-in kind validated, only CRD kinds left over.
    for m in r.out["lint"].as_array().unwrap() {
        assert!(m["severity"].as_u64().unwrap() < 2, "helm lint: {m}");
    }
    let crd_groups = [
        "networking.istio.io",
        "telemetry.istio.io",
        "monitoring.coreos.com",
        "gateway.envoyproxy.io",
        "gateway.networking.k8s.io",
    ];
    let builtin = r
        .objects()
        .filter(|o| !crd_groups.contains(&o["apiVersion"].as_str().unwrap().split('/').next().unwrap()))
        .count();
    let patch_pod = u64::from(!r.istio());
    assert_eq!(r.out["validated"].as_u64(), Some(builtin as u64 + patch_pod), "every built-in object validated");
    for kind in str_set(&r.out["not_validated"]) {
        assert!(CRD_KINDS.contains(&kind.as_str()), "{kind} is neither built in nor expected");
    }

    // The gateway pods.
    let (pod, selector, pod_namespace) = if r.istio() {
        let d = r.one("Deployment");
        let selector = d["spec"]["selector"]["matchLabels"].clone();
        let labels = &d["spec"]["template"]["metadata"]["labels"];
        for (k, v) in selector.as_object().unwrap() {
            assert_eq!(&labels[k], v, "the Deployment selects its own pods");
        }
        // Istio's gateway injection, as envoy/k8s/overlays/injected-gateway has it.
        assert_eq!(labels["sidecar.istio.io/inject"], "true");
        assert_eq!(d["spec"]["template"]["metadata"]["annotations"]["inject.istio.io/templates"], "gateway");
        let proxy = by_name(&d["spec"]["template"]["spec"]["containers"], "istio-proxy");
        assert_eq!(proxy["image"], "auto");
        assert_eq!(d["metadata"]["namespace"], r.namespace.as_str());
        let sa = &d["spec"]["template"]["spec"]["serviceAccountName"];
        assert_eq!(r.one("ServiceAccount")["metadata"]["name"], *sa);
        let svc = r.named("Service", d["metadata"]["name"].as_str().unwrap());
        assert_eq!(svc["spec"]["selector"], selector, "the gateway's Service reaches its pods");
        (&d["spec"]["template"]["spec"], selector, r.namespace.clone())
    } else {
        let proxy = r.one("EnvoyProxy");
        let deployment = &proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"];
        assert_eq!(deployment["patch"]["type"], "StrategicMerge");
        let gateway = r.values["envoyGateway"]["gateway"]["name"].as_str().unwrap_or("eg");
        // The labels Envoy Gateway gives the Envoy pods of a Gateway.
        let selector = json!({
            "app.kubernetes.io/name": "envoy",
            "app.kubernetes.io/component": "proxy",
            "app.kubernetes.io/managed-by": "envoy-gateway",
            "gateway.envoyproxy.io/owning-gateway-name": gateway,
            "gateway.envoyproxy.io/owning-gateway-namespace": r.namespace,
        });
        let namespace = r.values["envoyGateway"]["proxyNamespace"].as_str().unwrap_or("envoy-gateway-system");
        (&deployment["patch"]["value"]["spec"]["template"]["spec"], selector, namespace.to_owned())
    };
    let sidecar = by_name(&pod["containers"], "kvgate-sidecar");
    let volumes = &pod["volumes"];
    let mounts = &sidecar["volumeMounts"];

    // The sidecar's config: the ConfigMap its pods mount, in their namespace.
    let config_mount = by_name(mounts, "kvgate-config")["mountPath"].as_str().unwrap();
    assert_eq!(sidecar["args"], json!(["--config", format!("{config_mount}/kvgate.toml")]));
    let config_map = r.named("ConfigMap", by_name(volumes, "kvgate-config")["configMap"]["name"].as_str().unwrap());
    assert_eq!(config_map["metadata"]["namespace"], pod_namespace.as_str());
    let toml = config_map["data"]["kvgate.toml"].as_str().unwrap();

    // The sync key: generated (64 hex digits) or the named Secret, mounted where key_file says.
    let mut generated_key = None;
    let key = if r.sync() {
        let mount = by_name(mounts, "kvgate-sync-key");
        assert_eq!(mount["mountPath"], SYNC_KEY_DIR);
        assert_eq!(mount["readOnly"], true);
        let secret_name = by_name(volumes, "kvgate-sync-key")["secret"]["secretName"].as_str().unwrap();
        match r.values["sync"]["existingSecret"].as_str().filter(|s| !s.is_empty()) {
            Some(existing) => {
                assert_eq!(secret_name, existing);
                assert!(r.all("Secret").is_empty(), "no Secret of the chart's beside {existing}");
                common::TEST_KEY.to_owned()
            }
            None => {
                let secret = r.named("Secret", secret_name);
                assert_eq!(secret["metadata"]["namespace"], pod_namespace.as_str());
                let key = String::from_utf8(base64(secret["data"]["key"].as_str().unwrap())).unwrap();
                assert!(
                    key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
                    "{key:?}"
                );
                generated_key = Some(key.clone());
                key
            }
        }
    } else {
        assert!(mounts.as_array().unwrap().iter().all(|m| m["name"] != "kvgate-sync-key"));
        assert!(r.all("Secret").is_empty() && r.all("NetworkPolicy").is_empty());
        common::TEST_KEY.to_owned()
    };
    let env = ContainerEnv::of(sidecar);
    let config = load_config_with(toml, &key, &env);

    // Its log format: KVGATE_LOG_FORMAT, left out for the sidecar's default, text.
    let log_format = r.values["sidecar"]["logFormat"].as_str().unwrap_or("text");
    assert_eq!(env.var("KVGATE_LOG_FORMAT").as_deref(), (log_format != "text").then_some(log_format));

    check_tracing(r, &env, &selector);

    // The API on loopback, reached through the sidecar cluster; metrics and the probe on
    // metrics_listen; no readiness probe (the gateway pod stays Ready whatever the sidecar's
    // state), liveness on /livez.
    assert!(config.listen.ip().is_loopback());
    let metrics = u64::from(config.metrics_listen.expect("metrics_listen").port());
    assert_eq!(by_name(&sidecar["ports"], "kvgate-metrics")["containerPort"].as_u64(), Some(metrics));
    assert!(sidecar["readinessProbe"].is_null(), "a readiness probe ties the gateway's readiness to the sidecar");
    assert!(sidecar["startupProbe"].is_null());
    assert_eq!(sidecar["livenessProbe"]["httpGet"], json!({"path": "/livez", "port": metrics}));

    // The sync mesh: the pod's own IP, peers found through the headless Service over exactly
    // the gateway pods, and a NetworkPolicy admitting only those pods to its two ports.
    let policies = r.all("NetworkPolicy");
    match &config.sync {
        Some(sync) => {
            let sync_port: u64 = sync.listen.rsplit(':').next().unwrap().parse().unwrap();
            assert_eq!(sync.listen, format!("tcp://{POD_IP}:{sync_port}"), "KVGATE_SYNC_LISTEN binds the pod's IP");
            assert!(sync.key_file.is_some(), "the mesh is sealed");
            let ports: Vec<u64> =
                [by_name(&sidecar["ports"], "tcp-kvgate-sync"), by_name(&sidecar["ports"], "tcp-kvgate-handover")]
                    .iter()
                    .map(|p| p["containerPort"].as_u64().unwrap())
                    .collect();
            assert_eq!(ports, [sync_port, sync_port + 1]);
            let peers = sync.peers_dns.as_deref().expect("peers_dns");
            let (service_name, rest) = peers.split_once('.').unwrap();
            let service = r.named("Service", service_name);
            assert_eq!(rest, format!("{}.svc.cluster.local", service["metadata"]["namespace"].as_str().unwrap()));
            assert_eq!(service["metadata"]["namespace"], pod_namespace.as_str());
            assert_eq!(service["spec"]["clusterIP"], "None");
            assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
            assert_eq!(service["spec"]["selector"], selector, "the sync Service selects the gateway pods");
            let service_ports: Vec<u64> =
                service["spec"]["ports"].as_array().unwrap().iter().map(|p| p["port"].as_u64().unwrap()).collect();
            assert_eq!(service_ports, [sync_port, sync_port + 1]);
            assert_eq!(policies.len(), 1);
            check_network_policy(&policies[0]["spec"], &selector, sync_port);
            assert_eq!(policies[0]["metadata"]["namespace"], pod_namespace.as_str());
        }
        None => assert!(policies.is_empty() && sidecar["ports"].as_array().unwrap().len() == 1),
    }

    // Tokenizers: in the image, on a volume, or fetched by an init container into an emptyDir.
    let chart_default = json!([{"tokenizer": {"path": "/models/qwen3-0.6b"}}]);
    let pools = r.values.get("pools").unwrap_or(&chart_default);
    for (i, pool) in config.pools.iter().enumerate() {
        let dir = pool.pool.tokenizer.to_str().unwrap();
        let spec = &pools[i]["tokenizer"];
        let mounted = mounts.as_array().unwrap().iter().find(|m| m["mountPath"] == dir);
        if let Some(path) = spec["path"].as_str() {
            assert_eq!(dir, path, "pool {i}: the image's directory");
            assert!(mounted.is_none());
            continue;
        }
        let mount = mounted.unwrap_or_else(|| panic!("pool {i}: nothing mounted at {dir}"));
        assert_eq!(mount["readOnly"], true);
        let volume = by_name(volumes, mount["name"].as_str().unwrap());
        if spec["hub"].is_object() {
            assert_eq!(volume["emptyDir"], json!({}));
            let init = pod["initContainers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["volumeMounts"][0]["name"] == volume["name"])
                .unwrap_or_else(|| panic!("pool {i}: no init container fills {dir}"));
            assert_eq!(init["volumeMounts"][0]["mountPath"], dir);
            assert!(init["args"].as_array().unwrap().windows(2).any(|w| w[0] == "--dest" && w[1] == dir));
        } else {
            let mut source = volume.clone();
            source.as_object_mut().unwrap().remove("name");
            assert_eq!(source, spec["volume"], "pool {i}: the volume as given");
            assert_eq!(mount["subPath"], spec["subPath"]);
        }
    }

    // A config change rolls the pods.
    let annotations = if r.istio() {
        &r.one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    } else {
        &r.one("EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]["spec"]["template"]
            ["metadata"]["annotations"]
    };
    let digest = format!("{:x}", Sha256::digest(toml.strip_suffix('\n').unwrap_or(toml)));
    assert_eq!(annotations["checksum/kvgate-config"], digest.as_str());

    // The filter, its sidecar cluster and the engines' override_host.
    let filter =
        if r.istio() { check_istio_filter(r, &selector, &config) } else { check_envoy_gateway_filter(r, &config) };

    // Routing headers removed on arrival and 16 MiB bodies, as the tested template does.
    let (want, limit) = template_arrival();
    if r.istio() {
        let patches = &r.named("EnvoyFilter", "kvgate-gateway")["spec"]["configPatches"];
        let patch = |to: &str| &patches.as_array().unwrap().iter().find(|p| p["applyTo"] == to).unwrap()["patch"];
        let hcm = patch("NETWORK_FILTER");
        assert_eq!(hcm["operation"], "MERGE");
        assert_eq!(removed(&hcm["value"]["typed_config"]["early_header_mutation_extensions"][0]["typed_config"]), want);
        assert_eq!(patch("VIRTUAL_HOST")["value"]["request_body_buffer_limit"].as_u64(), Some(limit));
    } else {
        let ctp = &r.one("ClientTrafficPolicy")["spec"];
        let removed: HashSet<String> = str_set(&ctp["headers"]["earlyRequestHeaders"]["remove"]).into_iter().collect();
        assert_eq!(removed, want);
        let mib: u64 = ctp["connection"]["bufferLimit"].as_str().unwrap().strip_suffix("Mi").unwrap().parse().unwrap();
        assert_eq!(mib << 20, limit);
    }

    // Prometheus scrapes both halves of kvgate on the gateway pods.
    if let Some(monitor) = r.all("PodMonitor").first() {
        assert_eq!(monitor["spec"]["selector"]["matchLabels"], selector);
        let ports: BTreeSet<&str> = monitor["spec"]["podMetricsEndpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["port"].as_str().unwrap())
            .collect();
        let envoy_port = if r.istio() { "http-envoy-prom" } else { "metrics" };
        assert_eq!(ports, BTreeSet::from(["kvgate-metrics", envoy_port]));
        if r.istio() {
            let proxy = by_name(&pod["containers"], "istio-proxy");
            assert_eq!(by_name(&proxy["ports"], "http-envoy-prom")["containerPort"], 15090);
        }
    }

    Gateway { pod, selector, pod_namespace, sidecar, config, filter, generated_key }
}

/// The sync and handover ports only from the gateway pods, every other port from anyone.
/// With a collector, the sidecar exports its spans to it over OTLP/HTTP, sampled as the gateway
/// samples, and the gateway's Envoy traces to it (Envoy Gateway: the EnvoyProxy's tracer;
/// Istio: a Telemetry resource on the gateway pods); without one, nothing is traced.
fn check_tracing(r: &Rendered, env: &ContainerEnv, selector: &Value) {
    let tracing = &r.values["tracing"];
    let collector = &tracing["collector"];
    let percent = tracing["samplingPercent"].as_u64().unwrap_or(1);
    let envoy_proxy = (!r.istio()).then(|| &r.one("EnvoyProxy")["spec"]["telemetry"]);
    let Some(name) = collector["name"].as_str().filter(|n| !n.is_empty()) else {
        assert_eq!(env.var("OTEL_EXPORTER_OTLP_ENDPOINT"), None);
        assert!(r.all("Telemetry").is_empty());
        assert!(envoy_proxy.is_none_or(Value::is_null), "{envoy_proxy:?}");
        return;
    };
    let namespace = collector["namespace"].as_str().unwrap_or("monitoring");
    let http_port = collector["httpPort"].as_u64().unwrap_or(4318);
    assert_eq!(
        env.var("OTEL_EXPORTER_OTLP_ENDPOINT"),
        Some(format!("http://{name}.{namespace}.svc:{http_port}")),
        "the sidecar's collector"
    );
    assert_eq!(env.var("OTEL_TRACES_SAMPLER").as_deref(), Some("parentbased_traceidratio"));
    let ratio: f64 = env.var("OTEL_TRACES_SAMPLER_ARG").unwrap().parse().unwrap();
    assert!((ratio - percent as f64 / 100.0).abs() < 1e-9, "sampler ratio {ratio} for {percent}%");
    match envoy_proxy {
        None => {
            let telemetry = r.one("Telemetry");
            assert_eq!(telemetry["metadata"]["namespace"], r.namespace.as_str());
            assert_eq!(
                telemetry["spec"]["selector"]["matchLabels"], *selector,
                "the Telemetry selects the gateway pods"
            );
            let provider = tracing["istioProvider"].as_str().unwrap_or("otel");
            let want = json!([{"providers": [{"name": provider}], "randomSamplingPercentage": percent}]);
            assert_eq!(telemetry["spec"]["tracing"], want);
        }
        Some(telemetry) => {
            let grpc_port = collector["grpcPort"].as_u64().unwrap_or(4317);
            let want = json!({
                "samplingRate": percent,
                "provider": {"type": "OpenTelemetry", "backendRefs": [{"name": name, "namespace": namespace, "port": grpc_port}]},
            });
            assert_eq!(telemetry["tracing"], want);
        }
    }
}

fn check_network_policy(policy: &Value, selector: &Value, sync_port: u64) {
    assert_eq!(policy["podSelector"]["matchLabels"], *selector);
    assert_eq!(policy["policyTypes"], json!(["Ingress"]));
    let rules = policy["ingress"].as_array().unwrap();
    assert_eq!(rules[0]["from"], json!([{"podSelector": {"matchLabels": selector}}]));
    assert_eq!(
        rules[0]["ports"],
        json!([{"protocol": "TCP", "port": sync_port}, {"protocol": "TCP", "port": sync_port + 1}])
    );
    let mut open = BTreeMap::<&str, Vec<(u64, u64)>>::new();
    for rule in &rules[1..] {
        assert!(rule["from"].is_null(), "from anyone");
        for p in rule["ports"].as_array().unwrap() {
            let from = p["port"].as_u64().unwrap();
            open.entry(p["protocol"].as_str().unwrap())
                .or_default()
                .push((from, p["endPort"].as_u64().unwrap_or(from)));
        }
    }
    assert_eq!(open["TCP"], [(1, sync_port - 1), (sync_port + 2, 65535)], "every TCP port but the mesh's is open");
    assert_eq!(open["UDP"], [(1, 65535)]);
}

/// Istio: the three EnvoyFilters on the gateway pods, as envoy/k8s/base has them.
fn check_istio_filter(r: &Rendered, selector: &Value, config: &Config) -> FilterConfig {
    let filters = r.all("EnvoyFilter");
    assert_eq!(filters.len(), 3);
    for f in &filters {
        assert_eq!(
            f["spec"]["workloadSelector"]["labels"], *selector,
            "{} applies to the chart's gateway",
            f["metadata"]["name"]
        );
        assert_eq!(f["metadata"]["namespace"], r.namespace.as_str());
    }
    // The filter as an ECDS extension config, before the router.
    let wasm = &r.named("EnvoyFilter", "kvgate-wasm")["spec"]["configPatches"];
    let ecds = &wasm[0];
    assert_eq!(
        (ecds["applyTo"].as_str(), ecds["patch"]["operation"].as_str()),
        (Some("EXTENSION_CONFIG"), Some("ADD"))
    );
    let ext = &ecds["patch"]["value"];
    let wasm_config = &ext["typed_config"]["config"];
    assert_eq!(ext["typed_config"]["@type"], "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm");
    assert_eq!(wasm_config["allow_on_headers_stop_iteration"], true, "without it the paused request deadlocks");
    assert_eq!(wasm_config["failure_policy"], "FAIL_OPEN");
    let remote = &wasm_config["vm_config"]["code"]["remote"];
    assert_eq!(remote["http_uri"]["uri"], format!("oci://{}", r.values["filter"]["image"].as_str().unwrap()));
    assert_eq!(remote["sha256"], DIGEST.trim_start_matches("sha256:"));
    assert_eq!(wasm_config["configuration"]["@type"], "type.googleapis.com/google.protobuf.StringValue");
    let text = wasm_config["configuration"]["value"].as_str().unwrap();
    let filter = FilterConfig::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{e}: {text}"));
    let http = &wasm[1];
    assert_eq!(http["applyTo"], "HTTP_FILTER");
    assert_eq!(http["patch"]["operation"], "INSERT_BEFORE");
    assert_eq!(http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"], "envoy.filters.http.router");
    assert_eq!(http["patch"]["value"]["name"], ext["name"], "the HTTP filter is the extension config");
    assert_eq!(
        http["patch"]["value"]["config_discovery"]["type_urls"],
        json!(["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"])
    );

    // The sidecar cluster the filter calls, at the sidecar's listen address; override_host on
    // every engine Service's cluster, reading the header the filter sets.
    let patches = r.named("EnvoyFilter", "kvgate-cluster")["spec"]["configPatches"].as_array().unwrap();
    let (added, merged): (Vec<&Value>, Vec<&Value>) = patches.iter().partition(|p| p["patch"]["operation"] == "ADD");
    assert_eq!(added.len(), 1);
    check_sidecar_cluster(&added[0]["patch"]["value"], &filter, config);
    let engines: Vec<(String, u64)> = merged
        .iter()
        .map(|p| {
            let lb = &p["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
            check_override_host(lb);
            let c = &p["match"]["cluster"];
            (c["service"].as_str().unwrap().to_owned(), c["portNumber"].as_u64().unwrap())
        })
        .collect();
    let default = json!([{"host": "vllm-engines.llm.svc.cluster.local", "port": 8000}]);
    let wanted: Vec<(String, u64)> = r.values["istio"]["engineServices"]
        .as_array()
        .unwrap_or_else(|| default.as_array().unwrap())
        .iter()
        .map(|s| (s["host"].as_str().unwrap().to_owned(), s["port"].as_u64().unwrap()))
        .collect();
    assert_eq!(engines, wanted);
    if let Some(prefill) = &filter.prefill_cluster {
        let istio_names: Vec<String> = engines.iter().map(|(h, p)| format!("outbound|{p}||{h}")).collect();
        assert!(istio_names.contains(prefill), "prefill legs go to {prefill}, a cluster with override_host");
    }
    filter
}

/// Envoy Gateway: the extension policy's filter, the patch policy's clusters and flag.
fn check_envoy_gateway_filter(r: &Rendered, config: &Config) -> FilterConfig {
    let gateway = r.values["envoyGateway"]["gateway"]["name"].as_str().unwrap_or("eg");
    let target = json!({"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway});
    let ext = &r.one("EnvoyExtensionPolicy")["spec"];
    assert_eq!(ext["targetRefs"], json!([target]));
    assert_eq!(r.one("ClientTrafficPolicy")["spec"]["targetRefs"], json!([target]));
    let wasm = &ext["wasm"][0];
    assert_eq!((wasm["rootID"].as_str(), wasm["failOpen"].as_bool()), (Some("kvgate"), Some(true)));
    assert_eq!(
        wasm["code"],
        json!({"type": "Image", "image": {"url": r.values["filter"]["image"], "sha256": DIGEST.trim_start_matches("sha256:")}})
    );
    let filter = FilterConfig::parse(wasm["config"].to_string().as_bytes()).unwrap();

    let patch = &r.one("EnvoyPatchPolicy")["spec"];
    assert_eq!(patch["targetRef"], target);
    assert_eq!(patch["type"], "JSONPatch");
    let patches = patch["jsonPatches"].as_array().unwrap();
    let sidecar = patches.iter().find(|p| p["operation"]["path"] == "").expect("the sidecar cluster");
    check_sidecar_cluster(&sidecar["operation"]["value"], &filter, config);
    let overridden: Vec<&str> = patches
        .iter()
        .filter(|p| p["operation"]["path"] == "/load_balancing_policy")
        .map(|p| {
            check_override_host(&p["operation"]["value"]["policies"][0]["typed_extension_config"]);
            p["name"].as_str().unwrap()
        })
        .collect();
    let default = json!([{"namespace": "llm", "name": "llm", "rule": 0}]);
    let routes: Vec<String> = r.values["envoyGateway"]["engineRoutes"]
        .as_array()
        .unwrap_or_else(|| default.as_array().unwrap())
        .iter()
        .map(|e| {
            format!("httproute/{}/{}/rule/{}", e["namespace"].as_str().unwrap(), e["name"].as_str().unwrap(), e["rule"])
        })
        .collect();
    assert_eq!(overridden, routes);
    let listener = r.values["envoyGateway"]["listener"].as_str().unwrap_or("http");
    let flag = patches.iter().find(|p| p["type"] == "type.googleapis.com/envoy.config.listener.v3.Listener").unwrap();
    assert_eq!(flag["name"], format!("{}/{gateway}/{listener}", r.namespace));
    assert!(flag["operation"]["path"]
        .as_str()
        .unwrap()
        .ends_with("/typed_config/config/allow_on_headers_stop_iteration"));
    assert_eq!(flag["operation"]["value"], true);
    if let Some(prefill) = &filter.prefill_cluster {
        assert!(routes.contains(prefill), "prefill legs go to {prefill}, a cluster with override_host");
    }
    filter
}

fn check_sidecar_cluster(cluster: &Value, filter: &FilterConfig, config: &Config) {
    assert_eq!(cluster["name"], filter.sidecar_cluster.as_str(), "the filter calls the cluster the chart adds");
    assert_eq!(cluster["type"], "STATIC");
    let addr = &cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
    assert_eq!(addr["address"], "127.0.0.1");
    assert_eq!(addr["port_value"].as_u64(), Some(u64::from(config.listen.port())));
}

fn check_override_host(lb: &Value) {
    assert_eq!(lb["name"], "envoy.load_balancing_policies.override_host");
    assert_eq!(
        lb["typed_config"]["override_host_sources"],
        json!([{"header": kvgate_shared::wire::DESTINATION_HEADER}])
    );
}

// ---------------------------------------------------------------------------------------------
// The tests

#[test]
fn every_value_set_passes_helm_and_kubernetes_and_loads_in_kvgate() {
    let Some(python) = python() else { return };
    for (name, namespace, values) in cases() {
        let r = render(&python, &values, namespace);
        let g = check(&r);
        eprintln!(
            "{name}: {} objects, {} validated against Kubernetes {} (kubernetes-validate {}), Helm {} (helm-python-sdk {}); \
             {} pools, sync {}",
            r.objects().count(),
            r.out["validated"],
            r.out["kubernetes"],
            r.out["kubernetes_validate"],
            r.out["helm"],
            r.out["helm_python_sdk"],
            g.config.pools.len(),
            g.config.sync.is_some(),
        );
        assert_eq!(g.config.pools.len(), values["pools"].as_array().map_or(1, Vec::len));
    }
}

#[test]
fn the_istio_gateway_does_what_the_kustomize_manifests_do() {
    let Some(python) = python() else { return };
    let monitoring = json!({"monitoring": {"enabled": true, "prometheusRule": {"enabled": true}}});
    let r = render(&python, &values("istio", monitoring), "istio-system");
    let g = check(&r);
    let docs = manifests();
    let k8s = common::repo().join("envoy/k8s");

    // The same sidecar configuration as base/kvgate.toml.
    let base = common::load_config(&std::fs::read_to_string(k8s.join("base/kvgate.toml")).unwrap());
    assert_eq!(g.config.pools, base.pools);
    assert_eq!((g.config.listen, g.config.metrics_listen), (base.listen, base.metrics_listen));
    assert_eq!(g.config.state_file, base.state_file);
    let mut sync = g.config.sync.clone().unwrap();
    sync.key_file = base.sync.as_ref().unwrap().key_file.clone();
    assert_eq!(Some(sync), base.sync);

    // The sidecar container of components/gateway-sidecar, but its image.
    let component = common::documents(&k8s.join("components"));
    let spec = &component[0].1["spec"]["template"];
    let mut want = spec["spec"]["containers"][0].clone();
    let mut got = g.sidecar.clone();
    for c in [&mut want, &mut got] {
        c.as_object_mut().unwrap().remove("image");
    }
    assert_eq!(got, want, "the sidecar container as the component has it");
    // The manifest's mode reads 0444 as YAML 1.1 (Kubernetes, Helm) does: octal.
    let mut volumes = spec["spec"]["volumes"].clone();
    let mode = &mut volumes[1]["secret"]["defaultMode"];
    *mode = json!(u64::from_str_radix(mode.as_str().unwrap(), 8).unwrap());
    assert_eq!(g.pod["volumes"], volumes, "its volumes");
    let annotations = &r.one("Deployment")["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["proxy.istio.io/config"], spec["metadata"]["annotations"]["proxy.istio.io/config"]);
    let overlay = common::documents(&k8s.join("overlays/injected-gateway"));
    let injected = &find(&overlay, "Deployment", "istio-ingressgateway")["spec"]["template"];
    assert_eq!(
        annotations["inject.istio.io/templates"],
        injected["metadata"]["annotations"]["inject.istio.io/templates"]
    );
    let labels = &r.one("Deployment")["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["sidecar.istio.io/inject"], injected["metadata"]["labels"]["sidecar.istio.io/inject"]);
    let proxy = by_name(&g.pod["containers"], "istio-proxy");
    assert_eq!(proxy["image"], injected["spec"]["containers"][0]["image"]);

    // The base's EnvoyFilters, on the chart's gateway pods: the same patches, but the filter's
    // URL and digest (placeholders there) and its config, which parses the same.
    let istio_selector = json!({"istio": "ingressgateway"});
    for name in ["kvgate-wasm", "kvgate-cluster", "kvgate-gateway"] {
        let want = find(&docs, "EnvoyFilter", name);
        assert_eq!(want["spec"]["workloadSelector"]["labels"], istio_selector);
        let mut got = r.named("EnvoyFilter", name)["spec"]["configPatches"].clone();
        let mut want = want["spec"]["configPatches"].clone();
        if name == "kvgate-wasm" {
            let [got_config, want_config] = [&mut got, &mut want].map(|p| {
                let config = &mut p[0]["patch"]["value"]["typed_config"]["config"];
                config["vm_config"]["code"]["remote"]["http_uri"]["uri"].take();
                config["vm_config"]["code"]["remote"]["sha256"].take();
                config["configuration"]["value"].take()
            });
            let parse = |v: Value| FilterConfig::parse(v.as_str().unwrap().as_bytes()).unwrap();
            assert_eq!(parse(got_config), parse(want_config));
        }
        assert_eq!(got, want, "{name}");
    }

    // The sync Service and the NetworkPolicy of the base, on the chart's gateway pods.
    for (kind, selector) in [("Service", "/selector"), ("NetworkPolicy", "/podSelector/matchLabels")] {
        let mut want = find(&docs, kind, "kvgate-sync")["spec"].clone();
        assert_eq!(*want.pointer(selector).unwrap(), istio_selector);
        *want.pointer_mut(selector).unwrap() = g.selector.clone();
        if kind == "NetworkPolicy" {
            want["ingress"][0]["from"][0]["podSelector"]["matchLabels"] = g.selector.clone();
        }
        assert_eq!(r.named(kind, "kvgate-sync")["spec"], want, "{kind} kvgate-sync");
    }

    // The default image tags: the release's, as `cargo xtask package` tags the images.
    let chart = std::fs::read_to_string(repo().join("charts/kvgate/Chart.yaml")).unwrap();
    assert!(chart.contains(&format!("appVersion: \"{}\"", env!("CARGO_PKG_VERSION"))), "{chart}");

    // The PodMonitor and the alerts of envoy/k8s/monitoring.
    let monitor = find(&docs, "PodMonitor", "kvgate");
    assert_eq!(r.one("PodMonitor")["spec"]["podMetricsEndpoints"], monitor["spec"]["podMetricsEndpoints"]);
    assert_eq!(r.one("PrometheusRule")["spec"], find(&docs, "PrometheusRule", "kvgate")["spec"]);
}

#[test]
fn the_envoy_gateway_variant_does_what_its_manifest_does() {
    let Some(python) = python() else { return };
    // The manifest traces to `otel-collector` in `monitoring`, at 1 %.
    let tracing = json!({"collector": {"name": "otel-collector"}});
    let r = render(
        &python,
        &values("envoy-gateway", json!({"envoyGateway": {"gateway": {"className": "eg"}}, "tracing": tracing})),
        "llm",
    );
    let g = check(&r);
    let docs = manifests();
    let policies = ["ClientTrafficPolicy", "EnvoyPatchPolicy", "EnvoyExtensionPolicy"];
    for kind in policies {
        let mut want = find(&docs, kind, "kvgate")["spec"].clone();
        let mut got = r.one(kind)["spec"].clone();
        if kind == "EnvoyExtensionPolicy" {
            for spec in [&mut got, &mut want] {
                spec["wasm"][0]["code"]["image"].take();
                let config = spec["wasm"][0]["config"].take();
                assert_eq!(FilterConfig::parse(config.to_string().as_bytes()).unwrap(), g.filter);
            }
        }
        assert_eq!(got, want, "{kind}");
        assert_eq!(r.one(kind)["metadata"]["namespace"], "llm");
    }
    let class = r.one("GatewayClass");
    assert_eq!(class["spec"], find(&docs, "GatewayClass", "eg")["spec"]);
    assert_eq!(r.one("Gateway")["spec"], find(&docs, "Gateway", "eg")["spec"]);
    assert_eq!(r.one("EnvoyProxy")["metadata"]["name"], class["spec"]["parametersRef"]["name"]);
    assert_eq!(
        r.one("EnvoyProxy")["spec"]["telemetry"],
        find(&docs, "EnvoyProxy", "kvgate")["spec"]["telemetry"],
        "Envoy's tracer"
    );

    // The same sidecar as in the Istio gateway, with the sync mesh the manifest lacks: all the
    // manifest's container has, it has.
    let want = &find(&docs, "EnvoyProxy", "kvgate")["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]
        ["value"]["spec"]["template"]["spec"]["containers"][0];
    for (k, v) in want.as_object().unwrap() {
        match k.as_str() {
            "image" => {}
            "ports" | "volumeMounts" | "env" => {
                for item in v.as_array().unwrap() {
                    assert!(g.sidecar[k].as_array().unwrap().contains(item), "{k}: {item}");
                }
            }
            "livenessProbe" => assert_eq!(g.sidecar[k]["httpGet"], v["httpGet"]),
            _ => assert_eq!(&g.sidecar[k], v, "{k}"),
        }
    }
    let istio = render(&python, &values("istio", json!({"tracing": tracing})), "llm");
    let mut istio_sidecar =
        by_name(&istio.one("Deployment")["spec"]["template"]["spec"]["containers"], "kvgate-sidecar").clone();
    istio_sidecar["image"] = g.sidecar["image"].clone();
    assert_eq!(*g.sidecar, istio_sidecar);
    assert_eq!(g.pod_namespace, "envoy-gateway-system");
}

#[test]
fn the_sync_key_is_generated_once_per_install_or_taken_from_an_existing_secret() {
    let Some(python) = python() else { return };
    let generated = render(&python, &values("istio", json!({})), "istio-system");
    let g = check(&generated);
    let key = g.generated_key.clone().expect("a generated key");
    // The sidecar read it: `check` loaded the config with it in key_file, and loading parses
    // the key.
    assert!(g.config.sync.as_ref().unwrap().key_file.is_some());
    // Offline, `lookup` finds no Secret: every render is an install and makes a new key. On an
    // upgrade the template reads the one in the cluster back instead.
    let again = check(&render(&python, &values("istio", json!({})), "istio-system")).generated_key.unwrap();
    assert_ne!(key, again, "a key per install");
    let source = std::fs::read_to_string(repo().join("charts/kvgate/templates/sync-key-secret.yaml")).unwrap();
    assert!(source.contains(r#"lookup "v1" "Secret" $namespace $name"#), "an upgrade keeps the key in the cluster");

    let existing = render(&python, &values("istio", json!({"sync": {"existingSecret": "mesh-key"}})), "istio-system");
    let g = check(&existing);
    assert!(g.generated_key.is_none());
    assert_eq!(by_name(&g.pod["volumes"], "kvgate-sync-key")["secret"]["secretName"], "mesh-key");
}

#[test]
fn hub_and_volume_tokenizers_reach_the_sidecar() {
    let Some(python) = python() else { return };
    for (gateway, namespace) in [("istio", "istio-system"), ("envoy-gateway", "llm")] {
        let r = render(&python, &values(gateway, json!({"pools": [hub_pool(), volume_pool()]})), namespace);
        let g = check(&r);
        let (hub, volume) = (&g.config.pools[0].pool, &g.config.pools[1].pool);
        assert_eq!((hub.model.as_str(), volume.model.as_str()), ("Qwen/Qwen3-8B", "llama"));
        assert_eq!(volume.max_model_len, Some(32768), "extraToml reaches the pool");

        // The Hub: the sidecar's image fetches the files before the sidecar starts, with the
        // token from the named Secret and the mirror's address.
        let inits = g.pod["initContainers"].as_array().unwrap();
        assert_eq!(inits.len(), 1, "only the hub pool needs one");
        let init = &inits[0];
        assert_eq!(init["image"], g.sidecar["image"]);
        let dir = hub.tokenizer.to_str().unwrap();
        assert_eq!(
            init["args"],
            json!([
                "fetch-tokenizer",
                "--repo",
                "Qwen/Qwen3-8B",
                "--revision",
                "b968826d9c46dd6066d109eabc6255188de91218",
                "--dest",
                dir
            ])
        );
        assert_eq!(
            by_name(&init["env"], "HF_TOKEN")["valueFrom"],
            json!({"secretKeyRef": {"name": "hf-token", "key": "hf_token"}})
        );
        assert_eq!(by_name(&init["env"], "HF_ENDPOINT")["value"], "https://hf-mirror.example.com");
        assert_eq!(init["securityContext"], g.sidecar["securityContext"]);
        assert_eq!(init["volumeMounts"], json!([{"name": "tokenizer-0", "mountPath": dir}]));

        // The volume: mounted read-only where the pool looks.
        let mount = by_name(&g.sidecar["volumeMounts"], "tokenizer-1");
        assert_eq!(mount["mountPath"], volume.tokenizer.to_str().unwrap());
        assert_eq!(
            by_name(&g.pod["volumes"], "tokenizer-1")["persistentVolumeClaim"],
            json!({"claimName": "tokenizers", "readOnly": true})
        );
    }

    // Without a token Secret, no token; tokenizerHub's settings for every pool, a pool's own
    // first.
    let mut bare = hub_pool();
    bare["model"] = json!("Qwen/Qwen3-0.6B");
    bare["tokenizer"]["hub"].as_object_mut().unwrap().retain(|k, _| k == "repo" || k == "revision");
    let r = render(&python, &values("istio", json!({"pools": [bare.clone()]})), "istio-system");
    let init = &check(&r).pod["initContainers"][0];
    assert!(init["env"].is_null(), "{init}");
    let shared = json!({"tokenSecret": {"name": "shared-hf-token"}, "endpoint": "https://hub.internal"});
    let r =
        render(&python, &values("istio", json!({"pools": [bare, hub_pool()], "tokenizerHub": shared})), "istio-system");
    let g = check(&r);
    let env = |i: usize| g.pod["initContainers"][i]["env"].clone();
    assert_eq!(
        (
            by_name(&env(0), "HF_TOKEN")["valueFrom"]["secretKeyRef"].clone(),
            by_name(&env(0), "HF_ENDPOINT")["value"].clone()
        ),
        (json!({"name": "shared-hf-token", "key": "token"}), json!("https://hub.internal"))
    );
    assert_eq!(
        (
            by_name(&env(1), "HF_TOKEN")["valueFrom"]["secretKeyRef"]["name"].clone(),
            by_name(&env(1), "HF_ENDPOINT")["value"].clone()
        ),
        (json!("hf-token"), json!("https://hf-mirror.example.com"))
    );
}

#[test]
fn admission_and_disaggregation_reach_the_sidecar_and_the_filter() {
    let Some(python) = python() else { return };
    let r = render(&python, &cases()[1].2, "istio-system");
    let g = check(&r);
    let admission = &g.config.pools[0].pool.admission;
    assert!(admission.enabled);
    assert_eq!(admission.kv_blocks, 40000);
    let classes: Vec<(&str, i32, Option<f64>)> =
        admission.classes.iter().map(|c| (c.name.as_str(), c.priority, c.kv_fraction)).collect();
    assert_eq!(classes, [("interactive", 10, None), ("batch", 0, Some(0.7))]);
    assert_eq!(admission.default_class.as_deref(), Some("batch"));
    assert_eq!((g.filter.admission_wait_ms, g.filter.priority_header.as_deref()), (2000, Some("x-kvgate-priority")));
    assert_eq!(g.filter.breaker_failures, 3);
    assert_eq!((g.config.scoring.prefill_load_scale, g.config.scoring.duplicate_penalty), (4.0, 2.5));
    assert!(g.config.pools[1].discovery.kv_replay.is_none(), "an empty string leaves a key out");

    // Disaggregated: the decode and prefill workers' names, and the filter's prefill legs on
    // the engines' cluster (with override_host), named by the chart when the values do not.
    let r = render(&python, &cases()[3].2, "istio-system");
    let g = check(&r);
    let pool = &g.config.pools[0];
    let d = pool.pool.disaggregation.as_ref().expect("disaggregation");
    assert_eq!((d.mode, d.min_remote_prefill_tokens), (TransferProtocol::Vllm, 256));
    assert_eq!(pool.discovery.prefill_name.as_deref(), Some("vllm-prefill-headless.llm.svc.cluster.local"));
    assert_eq!(g.filter.prefill_cluster.as_deref(), Some("outbound|8000||vllm-pd.llm.svc.cluster.local"));
    let eg = render(&python, &values("envoy-gateway", json!({"pools": cases()[3].2["pools"].clone()})), "llm");
    assert_eq!(check(&eg).filter.prefill_cluster.as_deref(), Some("httproute/llm/llm/rule/0"));
    // A named one wins.
    let named = json!({"filter": {"config": {"prefill_cluster": "outbound|8000||vllm-prefill.llm.svc.cluster.local"}}});
    let r = render(&python, &merged(cases()[3].2.clone(), named), "istio-system");
    assert_eq!(
        FilterConfig::parse(
            r.named("EnvoyFilter", "kvgate-wasm")["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]
                ["config"]["configuration"]["value"]
                .as_str()
                .unwrap()
                .as_bytes()
        )
        .unwrap()
        .prefill_cluster
        .as_deref(),
        Some("outbound|8000||vllm-prefill.llm.svc.cluster.local")
    );
}

#[test]
fn rendering_twice_differs_only_in_the_generated_key() {
    let Some(python) = python() else { return };
    for (name, namespace, values) in cases() {
        let strip = |r: Rendered| -> Value {
            let mut out = r.out;
            for o in out["objects"].as_array_mut().unwrap() {
                if o["object"]["kind"] == "Secret" {
                    o["object"]["data"]["key"].take();
                }
            }
            out
        };
        let (a, b) = (render(&python, &values, namespace), render(&python, &values, namespace));
        let keys = |r: &Rendered| r.all("Secret").iter().map(|s| s["data"]["key"].clone()).collect::<Vec<_>>();
        let (ka, kb) = (keys(&a), keys(&b));
        assert!(ka.iter().zip(&kb).all(|(x, y)| x != y), "{name}: a fresh key each install");
        assert_eq!(strip(a), strip(b), "{name}");
    }
}

#[test]
fn the_packaged_chart_ships_its_templates_and_alerts_but_not_their_tests() {
    let Some(python) = python() else { return };
    // `helm package` (Helm v4 as a library), which applies the chart's .helmignore.
    let dest = std::env::temp_dir().join(format!("kvgate-chart-package-{}", std::process::id()));
    std::fs::create_dir_all(&dest).unwrap();
    let script = "import helm_python as helm, json, sys, tarfile\n\
                  archive = helm.package(sys.argv[1], destination=sys.argv[2])\n\
                  print(json.dumps(tarfile.open(archive).getnames()))";
    let chart = repo().join("charts/kvgate");
    let out = Command::new(python).args(["-c", script]).arg(&chart).arg(&dest).output().expect("running helm package");
    std::fs::remove_dir_all(&dest).unwrap();
    assert!(out.status.success(), "helm package: {}", String::from_utf8_lossy(&out.stderr));
    let packaged: BTreeSet<String> = serde_json::from_slice(&out.stdout).expect("the archive's names");

    // promtool's unit tests of the alerts (xtask/tests/alerts.rs) stay in the repository.
    let tests = "files/alerts_test.yaml";
    assert!(chart.join(tests).is_file(), "{tests} moved: update .helmignore and this test");
    assert!(!packaged.contains(&format!("kvgate/{tests}")), "{tests} is packaged: {packaged:?}");
    // Every other file of templates/ and files/ ships: files/alerts.yaml is the PrometheusRule's.
    let mut want = BTreeSet::new();
    let mut dirs = vec![chart.join("templates"), chart.join("files")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                want.insert(format!("kvgate/{}", path.strip_prefix(&chart).unwrap().display()));
            }
        }
    }
    want.remove(&format!("kvgate/{tests}"));
    assert!(want.contains("kvgate/files/alerts.yaml"));
    let missing: Vec<_> = want.difference(&packaged).collect();
    assert!(missing.is_empty(), "left out of the package: {missing:?}");
}

#[test]
fn the_schema_refuses_bad_values() {
    let Some(python) = python() else { return };
    let with_pool = |f: &dyn Fn(&mut Value)| {
        let mut pools = json!([{
            "model": "qwen3", "block_size": 16, "tokenizer": {"path": "/models/qwen3-0.6b"},
            "discovery": {"name": "vllm-engines-headless.llm.svc.cluster.local"},
        }]);
        f(&mut pools[0]);
        values("istio", json!({"pools": pools}))
    };
    let bad: Vec<(&str, Value, &str)> = vec![
        (
            "a model without a block size",
            with_pool(&|p| drop(p.as_object_mut().unwrap().remove("block_size"))),
            "block_size",
        ),
        ("a misspelt pool key", with_pool(&|p| p["blocksize"] = json!(16)), "blocksize"),
        ("a block size of 0", with_pool(&|p| p["block_size"] = json!(0)), "block_size"),
        (
            "a tokenizer from two places",
            with_pool(&|p| p["tokenizer"]["hub"] = json!({"repo": "a/b", "revision": "c"})),
            "tokenizer",
        ),
        (
            "a hub tokenizer without a revision",
            with_pool(&|p| p["tokenizer"] = json!({"hub": {"repo": "Qwen/Qwen3-8B"}})),
            "revision",
        ),
        ("dns discovery without a name", with_pool(&|p| p["discovery"] = json!({"port": 8000})), "name"),
        (
            "a discovered disaggregated pool without prefill workers",
            with_pool(&|p| p["disaggregation"] = json!({"mode": "vllm"})),
            "prefill_name",
        ),
        ("an unknown policy", with_pool(&|p| p["policy"] = json!("fastest")), "policy"),
        (
            "a kv_fraction over 1",
            with_pool(&|p| p["admission"] = json!({"enabled": true, "kv_fraction": 1.5})),
            "kv_fraction",
        ),
        ("an unknown gateway type", values("nginx", json!({})), "type"),
        ("a digest that is not one", values("istio", json!({"filter": {"sha256": "abc"}})), "sha256"),
        (
            "a filter key misspelt",
            values("istio", json!({"filter": {"config": {"route_timeout": 25}}})),
            "route_timeout",
        ),
        (
            "the sidecar cluster, which the chart names",
            values("istio", json!({"filter": {"config": {"sidecar_cluster": "x"}}})),
            "sidecar_cluster",
        ),
        (
            "a zero route timeout",
            values("istio", json!({"filter": {"config": {"route_timeout_ms": 0}}})),
            "route_timeout_ms",
        ),
        (
            "envoy_tokenizers neither a word nor a list",
            values("istio", json!({"filter": {"config": {"envoy_tokenizers": "some"}}})),
            "envoy_tokenizers",
        ),
        (
            "decode progress with no tokenizer in Envoy",
            values("istio", json!({"filter": {"config": {"envoy_tokenizers": "none", "decode_progress": true}}})),
            "decode_progress",
        ),
        (
            "the sync listen address, which the chart owns",
            values("istio", json!({"sync": {"config": {"listen": "tcp://0.0.0.0:9913"}}})),
            "listen",
        ),
        ("a sync port whose handover has no port", values("istio", json!({"sync": {"port": 65535}})), "port"),
        (
            "a scoring weight below 0",
            values("istio", json!({"sidecar": {"config": {"scoring": {"temperature": -1}}}})),
            "temperature",
        ),
        ("an unknown log format", values("istio", json!({"sidecar": {"logFormat": "xml"}})), "logFormat"),
        (
            "a sampling share over 100 %",
            values("istio", json!({"tracing": {"samplingPercent": 101}})),
            "samplingPercent",
        ),
        (
            "a patch the chart writes",
            values("envoy-gateway", json!({"envoyGateway": {"envoyDeployment": {"patch": {}}}})),
            "envoyDeployment",
        ),
    ];
    for (what, values, key) in bad {
        let err = try_render(&python, &values, "istio-system").err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(err.starts_with("values.schema.json"), "{what}: refused by the schema, not later: {err}");
        assert!(err.contains(key), "{what}: the error names {key}: {err}");
    }

    // What the schema cannot say, the templates do, by name.
    for (missing, key) in [("sha256", "filter.sha256"), ("image", "filter.image")] {
        let mut v = values("istio", json!({}));
        v["filter"].as_object_mut().unwrap().remove(missing);
        let err = try_render(&python, &v, "istio-system").err().unwrap();
        assert!(err.contains(key), "{err}");
    }
    let mut v = values("istio", json!({}));
    v["sidecar"]["image"]["repository"] = json!("");
    assert!(try_render(&python, &v, "istio-system").err().unwrap().contains("sidecar.image.repository"));
}

/// The field names of a struct's `{:?}`, its top level only.
fn debug_fields(debug: &str) -> BTreeSet<String> {
    let body = &debug[debug.find('{').expect("a struct") + 1..];
    let (mut depth, mut in_string, mut escaped, mut naming) = (0, false, false, true);
    let (mut fields, mut token) = (BTreeSet::new(), String::new());
    for c in body.chars() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' if depth == 0 => break,
            '}' | ']' | ')' => depth -= 1,
            ',' if depth == 0 => (naming, token) = (true, String::new()),
            ':' if depth == 0 && naming => {
                fields.insert(token.trim().to_owned());
                naming = false;
            }
            _ if depth == 0 && naming => token.push(c),
            _ => {}
        }
    }
    fields
}

/// The keys a schema object types.
fn schema_keys(schema: &Value, pointer: &str) -> BTreeSet<String> {
    let node = schema.pointer(pointer).unwrap_or_else(|| panic!("no {pointer} in the schema"));
    node["properties"].as_object().unwrap().keys().cloned().collect()
}

#[test]
fn the_schema_types_every_key_kvgate_reads() {
    let Some(python) = python() else { return };
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(repo().join("charts/kvgate/values.schema.json")).unwrap())
            .unwrap();
    let v = maximal();
    let r = render(&python, &v, "istio-system");
    let g = check(&r);
    let pool = &g.config.pools[0];
    let admission = &pool.pool.admission;
    let filter = FilterConfig::parse(
        r.named("EnvoyFilter", "kvgate-wasm")["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]
            ["configuration"]["value"]
            .as_str()
            .unwrap()
            .as_bytes(),
    )
    .unwrap();

    // (schema object, the values setting it, the struct kvgate reads it into, what the chart
    // owns or reaches otherwise).
    let sections: Vec<(&str, &Value, String, &[&str])> = vec![
        (
            "/properties/sidecar/properties/config",
            &v["sidecar"]["config"],
            format!("{:?}", g.config),
            &["listen", "metrics_listen", "allow_non_loopback_api", "pools", "sync", "state_file"],
        ),
        (
            "/properties/sidecar/properties/config/properties/scoring",
            &v["sidecar"]["config"]["scoring"],
            format!("{:?}", g.config.scoring),
            &[],
        ),
        (
            "/properties/sync/properties/config",
            &v["sync"]["config"],
            format!("{:?}", g.config.sync.as_ref().unwrap()),
            &["id", "listen", "peers", "peers_dns", "key_file", "allow_unauthenticated"],
        ),
        // `replicas` (static discovery) goes in extraToml.
        ("/definitions/poolKeys", &v["pools"][0], format!("{:?}", pool.pool), &["replicas"]),
        ("/definitions/discovery", &v["pools"][0]["discovery"], format!("{:?}", pool.discovery), &[]),
        ("/definitions/admission", &v["pools"][0]["admission"], format!("{admission:?}"), &[]),
        (
            "/definitions/admission/properties/classes/items",
            &v["pools"][0]["admission"]["classes"][0],
            format!("{:?}", admission.classes[0]),
            &[],
        ),
        (
            "/definitions/disaggregation",
            &v["pools"][0]["disaggregation"],
            format!("{:?}", pool.pool.disaggregation.as_ref().unwrap()),
            &[],
        ),
        (
            "/definitions/sessions",
            &v["pools"][0]["sessions"],
            format!("{:?}", pool.pool.sessions.as_ref().unwrap()),
            &[],
        ),
        ("/properties/filter/properties/config", &v["filter"]["config"], format!("{filter:?}"), &["sidecar_cluster"]),
    ];
    // Chart keys in kvgate's sections: where the tokenizer comes from, and raw TOML.
    let chart_only = ["extraToml", "discovery"];
    for (pointer, set, debug, owned) in sections {
        let typed = schema_keys(&schema, pointer);
        // Every typed key is set above, so that loading the render (kvgate refuses unknown
        // keys) proves each is one of kvgate's.
        let set: BTreeSet<String> = set.as_object().unwrap().keys().cloned().collect();
        assert_eq!(typed, set, "{pointer}: the value set above sets every key the schema types");
        // Every key kvgate reads is typed, or the chart's.
        for field in debug_fields(&debug) {
            assert!(
                typed.contains(&field) || owned.contains(&field.as_str()),
                "kvgate reads {field:?} ({pointer}), which charts/kvgate/values.schema.json does not type: add it \
                 there, or to what the chart owns in this test"
            );
        }
        for key in &typed {
            assert!(
                debug_fields(&debug).contains(key) || chart_only.contains(&key.as_str()),
                "{pointer}: {key:?} is not one of kvgate's keys"
            );
        }
    }
}
