//! A real Prometheus server (Debian's package, unpacked under `target/prometheus` by the test
//! command) that scrapes a stack, for tests of what operators query.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::client::client;
use crate::process::{free_port, wait_for, Proc};

/// A running Prometheus.
pub struct Prometheus {
    port: u16,
    _proc: Proc,
}

/// One series of a query's answer: its labels and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The series' labels.
    pub labels: serde_json::Map<String, Value>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of `label`, or `""`.
    pub fn label(&self, label: &str) -> &str {
        self.labels.get(label).and_then(Value::as_str).unwrap_or("")
    }
}

/// The Prometheus binary: `KVGATE_PROMETHEUS`, else the test command's.
pub fn binary() -> PathBuf {
    std::env::var_os("KVGATE_PROMETHEUS").map(PathBuf::from).unwrap_or_else(|| {
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| crate::repo_root().join("target"));
        target.join("prometheus/usr/bin/prometheus")
    })
}

impl Prometheus {
    /// Starts Prometheus in `dir`, scraping each `(job, host:port, path)` every second, and
    /// waits until it is ready.
    pub fn start(dir: &Path, targets: &[(&str, String, &str)]) -> anyhow::Result<Prometheus> {
        let bin = binary();
        anyhow::ensure!(bin.exists(), "prometheus not found at {} (run `cargo xtask test`)", bin.display());
        let dir = dir.join("prometheus");
        std::fs::create_dir_all(&dir)?;
        let jobs: String = targets
            .iter()
            .map(|(job, at, path)| {
                format!("- job_name: {job}\n  metrics_path: {path}\n  static_configs: [{{targets: [\"{at}\"]}}]\n")
            })
            .collect();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!("global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nscrape_configs:\n{jobs}"),
        )?;
        let port = free_port()?;
        let mut cmd = Command::new(&bin);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let proc = Proc::spawn("prometheus", cmd, &dir.join("prometheus.log"))?;
        let ready = format!("http://127.0.0.1:{port}/-/ready");
        wait_for("Prometheus ready", Duration::from_secs(60), || {
            client().get(&ready).send().ok().filter(|r| r.status().is_success()).map(|_| ())
        })?;
        Ok(Prometheus { port, _proc: proc })
    }

    /// Each scrape target's last error, by job (for a failing test's message).
    pub fn scrape_errors(&self) -> anyhow::Result<Vec<(String, String)>> {
        let url = format!("http://127.0.0.1:{}/api/v1/targets", self.port);
        let answer: Value = client().get(url).send()?.error_for_status()?.json()?;
        let targets = answer["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
        Ok(targets
            .iter()
            .map(|t| {
                let job = t["labels"]["job"].as_str().unwrap_or("?").to_owned();
                (job, format!("{} {}", t["health"].as_str().unwrap_or("?"), t["lastError"].as_str().unwrap_or("")))
            })
            .collect())
    }

    /// The answer to an instant query.
    pub fn query(&self, promql: &str) -> anyhow::Result<Vec<Sample>> {
        let url = format!("http://127.0.0.1:{}/api/v1/query", self.port);
        let answer: Value = client().get(url).query(&[("query", promql)]).send()?.error_for_status()?.json()?;
        anyhow::ensure!(answer["status"] == "success", "query {promql:?} failed: {answer}");
        let result = answer["data"]["result"].as_array().cloned().unwrap_or_default();
        Ok(result
            .into_iter()
            .filter_map(|s| {
                let labels = s["metric"].as_object()?.clone();
                let value = s["value"][1].as_str()?.parse().ok()?;
                Some(Sample { labels, value })
            })
            .collect())
    }
}
