//! kvgate's alerts and dashboard, checked with Prometheus' own `promtool`.
//!
//! The rule groups live in `charts/kvgate/files/alerts.yaml` (the chart's PrometheusRule
//! carries them as they are) and are unit-tested by `alerts_test.yaml` beside them; the
//! Kustomize manifest `envoy/k8s/monitoring/alerts.yaml` must carry the same groups. Every
//! alert must have a test where it fires and one where it stays quiet, and every query of
//! the Grafana dashboard must parse.
//!
//! promtool comes from Debian's `prometheus` package, unpacked into `target/prometheus` by
//! `tools/prometheus/install.sh` (which `cargo xtask test` runs). Without it these tests are
//! skipped, with a message, unless `CI` is set.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

mod common;

use common::repo;

/// The canonical rule groups, a Prometheus rules file.
const RULES: &str = "charts/kvgate/files/alerts.yaml";
/// Their unit tests.
const RULE_TESTS: &str = "charts/kvgate/files/alerts_test.yaml";
/// The Kustomize manifest with the same groups.
const MANIFEST: &str = "envoy/k8s/monitoring/alerts.yaml";
const DASHBOARD: &str = "envoy/k8s/monitoring/grafana-dashboard.json";

/// The installed promtool, or `None` (the tests skip) when it is not installed and `CI` is unset.
fn promtool() -> Option<PathBuf> {
    let dir = common::target_dir().join("prometheus");
    let how = format!("`bash tools/prometheus/install.sh {}`; `cargo xtask test` installs it", dir.display());
    common::installed(&dir, "promtool", &how, "tools/prometheus/version").then(|| dir.join("usr/bin/promtool"))
}

/// Runs promtool with `args` in the repository: whether it succeeded, and what it printed.
fn run_promtool(promtool: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(promtool).args(args).current_dir(repo()).output().expect("running promtool");
    let printed = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), printed)
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(repo().join(path)).unwrap();
    Value::deserialize(serde_norway::Deserializer::from_str(&text)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every alerting rule of a rules file, by name.
fn alerts(rules: &Value) -> BTreeMap<String, &Value> {
    let mut out = BTreeMap::new();
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            if let Some(name) = rule["alert"].as_str() {
                assert!(out.insert(name.to_owned(), rule).is_none(), "two alerts named {name}");
            }
        }
    }
    out
}

#[test]
fn the_rules_pass_promtool_and_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let (ok, checked) = run_promtool(&promtool, &["check", "rules", RULES]);
    assert!(ok, "promtool check rules {RULES}:\n{checked}");
    let rules = yaml(RULES);
    let count = rules["groups"].as_array().unwrap().iter().map(|g| g["rules"].as_array().unwrap().len()).sum::<usize>();
    assert!(checked.contains(&format!("SUCCESS: {count} rules found")), "{checked}");
    let (ok, tested) = run_promtool(&promtool, &["test", "rules", RULE_TESTS]);
    assert!(ok && tested.contains("SUCCESS"), "promtool test rules {RULE_TESTS}:\n{tested}");
}

#[test]
fn every_alert_has_a_test_where_it_fires_and_one_where_it_stays_quiet() {
    let rules = yaml(RULES);
    let alerts = alerts(&rules);
    assert!(alerts.len() >= 10, "{} alerts", alerts.len());
    for (name, rule) in &alerts {
        assert!(rule["for"].as_str().is_some_and(|f| f != "0s" && f != "0m"), "{name}: no `for`");
        let severity = rule["labels"]["severity"].as_str();
        assert!(matches!(severity, Some("warning" | "critical")), "{name}: severity {severity:?}");
        for key in ["summary", "description"] {
            assert!(rule["annotations"][key].as_str().is_some_and(|s| !s.is_empty()), "{name}: no {key}");
        }
    }

    let tests = yaml(RULE_TESTS);
    assert_eq!(tests["rule_files"], serde_json::json!(["alerts.yaml"]), "the tests load the rules beside them");
    let (mut fires, mut quiet) = (BTreeSet::new(), BTreeSet::new());
    for group in tests["tests"].as_array().unwrap() {
        for case in group["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            assert!(alerts.contains_key(&name), "a test of {name}, which is no alert of {RULES}");
            let expected = case["exp_alerts"].as_array().map_or(0, Vec::len);
            for alert in case["exp_alerts"].as_array().into_iter().flatten() {
                assert!(alert["exp_labels"]["severity"].is_string(), "{name}: a firing test checks the labels");
            }
            if expected == 0 {
                quiet.insert(name);
            } else {
                fires.insert(name);
            }
        }
    }
    for name in alerts.keys() {
        assert!(fires.contains(name), "{name} has no test in {RULE_TESTS} where it fires");
        assert!(quiet.contains(name), "{name} has no test in {RULE_TESTS} where it stays quiet (exp_alerts: [])");
    }
}

#[test]
fn the_kustomize_manifest_carries_the_charts_rule_groups() {
    let manifest = yaml(MANIFEST);
    assert_eq!(manifest["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(manifest["kind"], "PrometheusRule");
    assert_eq!(manifest["spec"], yaml(RULES), "{MANIFEST}'s spec is {RULES}, verbatim");
}

#[test]
fn the_alerts_query_only_metrics_kvgate_exports() {
    let known = common::exported_metrics();
    assert!(known.contains("kvgate_route_fallbacks_total") && known.contains("kvgate_requests_total"));
    let rules = yaml(RULES);
    for (name, rule) in alerts(&rules) {
        let expr = rule["expr"].as_str().unwrap();
        let words = expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
        for metric in words.filter(|w| w.starts_with("kvgate_")) {
            assert!(known.contains(metric), "{name} queries {metric}, which kvgate does not export");
        }
    }
}

#[test]
fn every_dashboard_query_parses() {
    let Some(promtool) = promtool() else { return };
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(repo().join(DASHBOARD)).unwrap()).unwrap();
    // Each query as a recording rule: `promtool check rules` parses every expression.
    let mut rules = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} queries nothing", panel["title"]);
        for target in targets {
            let record = format!("dashboard:panel_{}:{}", panel["id"], target["refId"].as_str().unwrap());
            rules.push(serde_json::json!({"record": record, "expr": target["expr"]}));
        }
    }
    let file = std::env::temp_dir().join(format!("kvgate-dashboard-rules-{}.json", std::process::id()));
    // JSON is YAML: promtool reads it as a rules file.
    std::fs::write(&file, serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]}).to_string()).unwrap();
    let (ok, printed) = run_promtool(&promtool, &["check", "rules", file.to_str().unwrap()]);
    std::fs::remove_file(&file).unwrap();
    assert!(ok, "a dashboard query does not parse:\n{printed}");
    assert!(printed.contains(&format!("SUCCESS: {} rules found", rules.len())), "{printed}");
}
