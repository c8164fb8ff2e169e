//! A sidecar whose start-up fails does not crash-loop (a container that does takes the whole
//! gateway pod out of its Service): it stays up, answers its liveness probe, says on `/healthz`
//! why it is not running, answers route calls 503 at once (the filter fails open without
//! waiting), and starts for real, in the same process, once the cause is fixed.

use std::process::Command;
use std::time::{Duration, Instant};

use kvgate_e2e::process::{free_port, wait_for, Proc};

fn config(port: u16, metrics_port: u16, tokenizer: &std::path::Path) -> String {
    format!(
        "listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n[[pools]]\nmodel = \"qwen3\"\n\
         tokenizer = {:?}\nblock_size = 16\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:9001\"\n\
         kv_events = \"tcp://127.0.0.1:9001\"\n",
        tokenizer.display().to_string()
    )
}

#[test]
fn a_sidecar_that_cannot_start_serves_degraded_and_starts_once_fixed() {
    let dir = std::env::temp_dir().join(format!("kvgate-degraded-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvgate.toml");
    let (port, metrics_port) = (free_port().unwrap(), free_port().unwrap());
    std::fs::write(&path, config(port, metrics_port, &dir.join("no-such-model"))).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"));
    cmd.arg("--config").arg(&path);
    let mut sidecar = Proc::spawn("sidecar", cmd, &dir.join("sidecar.log")).unwrap();
    let pid = sidecar.pid();
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
    let get = |port: u16, path: &str| {
        let reply = client.get(format!("http://127.0.0.1:{port}{path}")).send().ok()?;
        Some((reply.status().as_u16(), reply.text().ok()?))
    };

    // Up, alive, and saying why it is not running.
    wait_for("the liveness probe", Duration::from_secs(20), || (get(metrics_port, "/livez")?.0 == 200).then_some(()))
        .unwrap();
    let (status, why) = get(metrics_port, "/healthz").unwrap();
    assert_eq!(status, 503);
    assert!(why.contains("startup") && why.contains("tokenizer"), "{why}");
    // A route call is answered at once, so the filter falls back without waiting.
    let asked = Instant::now();
    let route = client.post(format!("http://127.0.0.1:{port}/v1/route")).body(vec![0u8; 8]).send().unwrap();
    assert_eq!(route.status().as_u16(), 503);
    assert!(asked.elapsed() < Duration::from_secs(1), "answered in {:?}", asked.elapsed());
    sidecar.check_alive().expect("the process stays up");

    // The tokenizer is put where the config says: the next try starts it, in the same process.
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    std::fs::write(&path, config(port, metrics_port, &tokenizer)).unwrap();
    wait_for("the sidecar running", Duration::from_secs(30), || {
        (get(metrics_port, "/healthz")? == (200, "ok".into())).then_some(())
    })
    .unwrap();
    let (status, models) = get(port, "/v1/models").unwrap();
    assert_eq!(status, 200, "{models}");
    assert_eq!(sidecar.pid(), pid, "never restarted");
    sidecar.check_alive().unwrap();
}
