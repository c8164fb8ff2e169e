//! Engines' own `/metrics` pages: real-looking vLLM (0.10+ names and labels) and SGLang pages
//! are read to the numbers they hold, whatever a label value escapes; pages that are not
//! metrics give nothing and never panic; and the poller keeps an engine's last figures when
//! its page says nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::get;
use kvgate_sidecar::health::Health;
use kvgate_sidecar::load::engine_metrics::reports_by_engine;
use kvgate_sidecar::load::EngineReport;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, PoolConfig, ReplicaConfig};
use proptest::prelude::*;

mod common;

/// vLLM 0.10+ with two data-parallel engines, serving a model whose name holds a comma,
/// escaped quotes and braces.
const VLLM: &str = include_str!("engine-metrics/vllm.prom");
/// SGLang with two DP ranks (rank 0 reported by two tensor-parallel schedulers), same model.
const SGLANG: &str = include_str!("engine-metrics/sglang.prom");

fn report(requests: u64, waiting: u64, kv_usage: Option<f64>, kv_blocks: Option<u64>) -> EngineReport {
    EngineReport { requests, waiting, kv_usage, kv_blocks }
}

#[test]
fn a_vllm_page_is_read_whatever_its_model_name_escapes() {
    assert!(VLLM.contains(r#"model_name="org/m,\"x\"{y}""#), "the fixture names the model as intended");
    let reports = reports_by_engine(VLLM);
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert_eq!(reports["0"], report(5, 2, Some(0.5), Some(1024)));
    assert_eq!(reports["1"], report(1, 0, Some(0.125), Some(2048)));
}

#[test]
fn an_sglang_page_is_read_by_dp_rank() {
    let reports = reports_by_engine(SGLANG);
    assert_eq!(reports.len(), 2, "{reports:?}");
    // Rank 0's two tensor-parallel schedulers count the same requests: 4 running + 3 queued.
    assert_eq!(reports["0"], report(7, 3, Some(0.75), None));
    assert_eq!(reports["1"], report(2, 0, Some(0.25), None));
}

#[test]
fn the_rank_is_the_label_not_text_inside_another_label() {
    let page = "# TYPE vllm:num_requests_running gauge\n\
                vllm:num_requests_running{model_name=\"a}b,engine=\\\"9\\\"\",engine=\"2\"} 4\n\
                # TYPE sglang:num_queue_reqs gauge\n\
                sglang:num_queue_reqs{model_name=\"dp_rank=\\\"7\\\",\\n}\",dp_rank=\"3\"} 6\n";
    let reports = reports_by_engine(page);
    assert_eq!(reports.keys().map(String::as_str).collect::<std::collections::BTreeSet<_>>(), ["2", "3"].into());
    assert_eq!(reports["2"], report(4, 0, None, None));
    assert_eq!(reports["3"], report(6, 6, None, None));
}

#[test]
fn pages_that_are_not_metrics_give_nothing() {
    let garbage = [
        "",
        "\n\n",
        "<html><body>502 Bad Gateway</body></html>\n",
        "{\"object\":\"error\",\"message\":\"Not Found\"}",
        "vllm:num_requests_running{engine=\"0\"",
        "vllm:num_requests_running{engine=\"0} 3\n",
        "vllm:num_requests_running{engine=\"0\"} three\n",
        "vllm:num_requests_running{engine=0} 3\n",
        "{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{\n",
        "\u{0}\u{1}\u{fffd}\u{fffd}vllm:\u{7f}",
        // Cut off mid-page, as a scrape that timed out would be.
        &VLLM[..VLLM.find("vllm:num_requests_waiting{").unwrap() + 30],
    ];
    for page in garbage {
        assert!(reports_by_engine(page).is_empty(), "{page:?} gave {:?}", reports_by_engine(page));
    }
}

#[test]
fn a_page_the_parser_cannot_read_gives_no_partial_report() {
    // Sample timestamps are valid text format the parser does not take: the whole page is
    // refused, so no engine is reported idle from half a page.
    let stamped = VLLM.replacen("} 3.0\n", "} 3.0 1733368000000\n", 1);
    assert_ne!(stamped, VLLM);
    assert!(reports_by_engine(&stamped).is_empty());
}

proptest! {
    #[test]
    fn any_text_is_read_without_panicking(page in "[a-z_:{}=\",\\\\ \n#0-9.eE+-]{0,400}") {
        let _ = reports_by_engine(&page);
    }

    #[test]
    fn any_mangled_engine_page_is_read_without_panicking(cut in 0..VLLM.len(), byte in any::<u8>()) {
        let mut page = VLLM.as_bytes().to_vec();
        page[cut] = byte;
        let _ = reports_by_engine(&String::from_utf8_lossy(&page));
    }
}

/// Serves `/metrics` with whatever the test last set, counting the scrapes.
struct Engine {
    page: Arc<Mutex<String>>,
    scrapes: Arc<AtomicUsize>,
    endpoint: std::net::SocketAddr,
}

impl Engine {
    fn start(page: &str) -> Engine {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let endpoint = listener.local_addr().unwrap();
        let page = Arc::new(Mutex::new(page.to_owned()));
        let scrapes = Arc::new(AtomicUsize::new(0));
        let (served, counted) = (page.clone(), scrapes.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let app = axum::Router::new().route(
                    "/metrics",
                    get(move || async move {
                        let page = served.lock().unwrap().clone();
                        counted.fetch_add(1, Ordering::SeqCst);
                        page
                    }),
                );
                axum::serve(tokio::net::TcpListener::from_std(listener).unwrap(), app).await.unwrap();
            });
        });
        Engine { page, scrapes, endpoint }
    }
}

#[test]
fn an_engine_whose_page_says_nothing_keeps_its_last_figures() {
    let engine = Engine::start(VLLM);
    let replica = ReplicaConfig::new("a", engine.endpoint, "tcp://127.0.0.1:1");
    let config = PoolConfig::new("m", "unused", common::BS as u32, vec![replica]);
    let pool = Arc::new(Pool::new(config, Vec::new(), Arc::new(Metrics::default())));
    let health = Health::new();
    let poller = kvgate_sidecar::engine_poller::spawn(pool.clone(), Duration::from_millis(20), &health).unwrap();
    let engine_report = || pool.state().replicas[0].engine;

    // One target without a rank: the page's two engines together.
    common::wait_for("the engine's figures", || engine_report() == Some(report(6, 2, Some(0.5), Some(3072))));
    *engine.page.lock().unwrap() = "<html>upstream connect error</html>\n".into();
    let seen = engine.scrapes.load(Ordering::SeqCst);
    common::wait_for("two scrapes of the broken page", || engine.scrapes.load(Ordering::SeqCst) >= seen + 2);
    assert_eq!(engine_report(), Some(report(6, 2, Some(0.5), Some(3072))), "kept, not zeroed");

    *engine.page.lock().unwrap() = SGLANG.into();
    common::wait_for("the next page's figures", || engine_report() == Some(report(9, 3, Some(0.75), None)));
    health.stop();
    poller.join().unwrap();
}
