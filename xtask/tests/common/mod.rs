//! What the deployment tests share: the repository's YAML documents, the kvgate config as a
//! gateway pod loads it, and the tested Envoy template's settings every deploy path copies.
//! `manifests.rs` checks the hand-written manifests with it, `chart.rs` the Helm chart.

// Each test crate uses its own part of this module.
#![allow(dead_code)]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kvgate_sidecar::config::{Config, Env};
use serde::Deserialize;
use serde_json::Value;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every YAML document under `dir`, with its file.
pub fn documents(dir: &Path) -> Vec<(PathBuf, Value)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                for doc in serde_norway::Deserializer::from_str(&text) {
                    let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    if !v.is_null() {
                        out.push((path.clone(), v));
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The hand-written manifests: `envoy/k8s` and `envoy/gateway-api`.
pub fn manifests() -> Vec<(PathBuf, Value)> {
    let mut docs = documents(&repo().join("envoy/k8s"));
    docs.extend(documents(&repo().join("envoy/gateway-api")));
    docs
}

pub fn find<'a>(docs: &'a [(PathBuf, Value)], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

/// Every value in a JSON tree.
pub fn walk<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    out.push(v);
    match v {
        Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
        Value::Object(o) => o.values().for_each(|x| walk(x, out)),
        _ => {}
    }
}

/// Where the gateway pods mount the sync key's Secret, and the file the configs name.
pub const SYNC_KEY_DIR: &str = "/etc/kvgate/sync-key";

/// A key for configs whose Secret is not at hand (64 hex digits).
pub const TEST_KEY: &str = "6b76676174652d746573742d6b65792d6f6e6c792d6e65766572207573652121";

/// The environment the manifests give the sidecar, in a pod whose IP is 10.0.0.7.
pub struct PodEnv;

impl Env for PodEnv {
    fn var(&self, key: &str) -> Option<String> {
        (key == "KVGATE_SYNC_LISTEN").then(|| "tcp://10.0.0.7:9913".to_owned())
    }
}

/// Loads a manifest's config as the pod would: its IP bound, the Secret's key in place.
pub fn load_config(text: &str) -> Config {
    load_config_with(text, TEST_KEY, &PodEnv)
}

/// Loads a config with `key` in the sync key's file and `env` as the container's environment.
pub fn load_config_with(text: &str, key: &str, env: &dyn Env) -> Config {
    // A directory per call: tests running at once may load the same text.
    static LOADS: AtomicU64 = AtomicU64::new(0);
    let n = LOADS.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("kvgate-manifest-{}-{n}-{}", std::process::id(), hash(text)));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("key");
    std::fs::write(&key_file, format!("{key}\n")).unwrap();
    let text = text.replace(&format!("{SYNC_KEY_DIR}/key"), key_file.to_str().unwrap());
    let path = dir.join("kvgate.toml");
    std::fs::write(&path, &text).unwrap();
    let config = Config::load(&path, env).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
    std::fs::remove_dir_all(&dir).unwrap();
    config
}

/// FNV-1a, for names unique to a text.
pub fn hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

pub fn port(addr: &std::net::SocketAddr) -> u64 {
    u64::from(addr.port())
}

/// The tested template, rendered with placeholder values, as JSON.
pub fn template() -> Value {
    let text = std::fs::read_to_string(repo().join("envoy/envoy.yaml.tmpl")).unwrap();
    let params = kvgate_e2e::envoy::EnvoyParams {
        admin_port: 1,
        listen_port: 2,
        sidecar_port: 3,
        wasm: Path::new("/kvgate.wasm"),
        filter_config: "{}",
        pool_endpoints: &[],
        with_filter: true,
        fallback: kvgate_e2e::envoy::Fallback::RoundRobin,
        otlp_port: Some(4318),
    };
    let rendered = kvgate_e2e::envoy::render(&text, &params);
    Value::deserialize(serde_norway::Deserializer::from_str(&rendered)).unwrap()
}

/// Headers an early header mutation removes.
pub fn removed(mutation: &Value) -> HashSet<String> {
    mutation["mutations"].as_array().unwrap().iter().filter_map(|m| m["remove"].as_str().map(str::to_owned)).collect()
}

/// What the tested template does as each request arrives and with its body: the headers its
/// early header mutation removes (both routing headers) and its body buffer limit (what the
/// sidecar accepts).
pub fn template_arrival() -> (HashSet<String>, u64) {
    let tmpl = template();
    let mut values = Vec::new();
    walk(&tmpl, &mut values);
    let early = values.iter().find(|v| v["early_header_mutation_extensions"].is_array()).expect("the template's");
    let want = removed(&early["early_header_mutation_extensions"][0]["typed_config"]);
    let routing = [kvgate_shared::wire::DESTINATION_HEADER, kvgate_shared::wire::DP_RANK_HEADER];
    assert_eq!(want, routing.iter().map(|h| h.to_string()).collect(), "the template removes both routing headers");
    let limit = values.iter().find_map(|v| v["request_body_buffer_limit"].as_u64()).expect("the template's body limit");
    assert_eq!(limit as usize, kvgate_shared::wire::MAX_BODY_BYTES, "the sidecar accepts what Envoy buffers");
    (want, limit)
}

/// The metric names kvgate exports: the sidecar's `register("name", …)` calls, with the
/// suffixes Prometheus gives counters and histograms, and the Prometheus names the filter's
/// metrics module lists in its table (a unit test there checks the table against what it
/// defines).
pub fn exported_metrics() -> std::collections::BTreeSet<String> {
    let sidecar = std::fs::read_to_string(repo().join("sidecar/src/metrics.rs")).unwrap();
    let filter = std::fs::read_to_string(repo().join("filter/src/metrics.rs")).unwrap();
    let mut known = std::collections::BTreeSet::new();
    for name in sidecar.split("register(").skip(1).filter_map(|rest| rest.split('"').nth(1)) {
        for suffix in ["", "_total", "_bucket", "_sum", "_count"] {
            known.insert(format!("kvgate_{name}{suffix}"));
        }
    }
    for row in filter.lines().filter_map(|l| l.strip_prefix("//! | `kvgate_")) {
        let name = row.split('`').next().unwrap();
        for suffix in ["", "_bucket", "_sum", "_count"] {
            known.insert(format!("kvgate_{name}{suffix}"));
        }
    }
    known
}

/// The build's target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo().join("target"))
}

/// Whether the test command's install of `what` in `dir` is there, holding the pins in the
/// repository's `pins` file: `false` (the tests skip, and say so once) when it is missing and
/// `CI` is unset; a panic when `CI` is set, or when it holds other pins. `how` says how to
/// install it.
pub fn installed(dir: &Path, what: &str, how: &str, pins: &str) -> bool {
    let Ok(installed) = std::fs::read_to_string(dir.join(".kvgate-installed")) else {
        assert!(std::env::var_os("CI").is_none(), "CI is set, and {what} is not installed in {}: {how}", dir.display());
        // Past libtest's capture, once: a skip must be seen.
        static SKIP: std::sync::Once = std::sync::Once::new();
        SKIP.call_once(|| {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: {what} is not installed in {} ({how})", dir.display());
        });
        return false;
    };
    let want = std::fs::read_to_string(repo().join(pins)).unwrap();
    assert_eq!(installed, want, "{} holds other pins than {pins}: {how}", dir.display());
    true
}
