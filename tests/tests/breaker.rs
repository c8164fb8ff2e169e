//! End-to-end: the filter's circuit breaker in a real Envoy, in front of a sidecar that hangs.
//!
//! This needs the built wasm, binaries and Envoy, so it is `#[ignore]`d in a plain
//! `cargo test`; `cargo xtask test` builds and installs everything and runs it.

use std::time::{Duration, Instant};

use kvgate_e2e::bench::stats::{median, percentile};
use kvgate_e2e::client::client;
use kvgate_e2e::process::wait_for;
use kvgate_e2e::{Artifacts, Stack, StackOptions};
use reqwest::blocking::Client;
use serde_json::json;

/// The filter's `breaker_failures` default: failed calls in a row that open the breaker.
const FAILURES: usize = 5;
/// The filter's `route_timeout_ms` default.
const ROUTE_TIMEOUT: Duration = Duration::from_millis(25);
/// Requests timed through each gateway once the breaker is open, per round.
const MEASURED: usize = 300;
/// Rounds timed at most; the first that meets the bound ends the test.
const ROUNDS: usize = 3;

/// POSTs a small chat to `url` on the kept-alive `client`: its status, its
/// `x-kvgate-routed-to` header and how long it took to the end of its body.
fn timed(client: &Client, url: &str, i: usize) -> (u16, String, Duration) {
    let body = json!({"model": "qwen3", "max_tokens": 1,
        "messages": [{"role": "user", "content": format!("question {i} while the sidecar hangs")}]});
    let started = Instant::now();
    let reply = client.post(url).header("content-type", "application/json").body(body.to_string()).send().unwrap();
    let status = reply.status().as_u16();
    let routed_to = reply.headers().get("x-kvgate-routed-to").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    reply.bytes().unwrap();
    (status, routed_to, started.elapsed())
}

/// One round of requests timed through each gateway, in turns, in ms.
struct Round {
    kvgate: Vec<f64>,
    alone: Vec<f64>,
}

impl Round {
    fn p99(samples: &[f64]) -> f64 {
        percentile(samples, 99.0).expect("a round times requests")
    }

    /// What kvgate added at p99, in ms (negative if Envoy alone was slower).
    fn added(&self) -> f64 {
        Round::p99(&self.kvgate) - Round::p99(&self.alone)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Until the breaker opens, each request waits out `route_timeout_ms` for the hung sidecar;
/// after `breaker_failures` of them the sidecar is not asked any more, and the latency the
/// filter adds is back under a millisecond at p99, against Envoy alone in front of the same
/// engines, measured in the same run, request for request (the best of up to three rounds).
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_hung_sidecar_costs_nothing_once_the_breaker_opens() {
    let opts = StackOptions {
        name: "breaker".into(),
        replicas: 2,
        route_timeout_ms: ROUTE_TIMEOUT.as_millis() as u64,
        baseline_gateway: true,
        // Engines that answer in well under a millisecond, so the gateways' own time shows.
        sim_args: ["--preset", "test", "--prefill-us-per-token", "1", "--step-base-us", "100"]
            .map(String::from)
            .to_vec(),
        // The window outlasts the test (no probe among the timed requests); the model list is
        // not fetched again meanwhile.
        filter_config:
            json!({"breaker_open_ms": 600_000, "breaker_max_open_ms": 600_000, "models_refresh_ms": 600_000})
                .as_object()
                .cloned()
                .unwrap(),
        ..Default::default()
    };
    let mut stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let (kvgate, alone) = (stack.gateway("/v1/chat/completions"), stack.baseline("/v1/chat/completions").unwrap());
    let hung = stack.hang_sidecar().unwrap();
    let client = client();
    let requests = |outcome: &str| stack.filter_stat("kvgate.requests_total", &[("outcome", outcome)]).unwrap();
    let breaker_state = || stack.filter_stat("kvgate.breaker_state", &[]).unwrap();
    // Envoy answers a call past its timeout with its own 504: either way it fell back. Counted
    // from here: a start-up probe sent while the filter's tokenizer loaded may have fallen back.
    let fell_back_at_start = requests("fallback_timeout") + requests("fallback_error");
    let fell_back = || requests("fallback_timeout") + requests("fallback_error") - fell_back_at_start;

    let mut waited = Vec::new();
    for i in 0..FAILURES {
        let (status, routed_to, took) = timed(&client, &kvgate, i);
        waited.push(format!("{:.1}", ms(took)));
        assert_eq!((status, routed_to.as_str()), (200, "fallback"), "request {i}: Envoy's balancer routes it");
        // Envoy's timers tick in milliseconds: allow one or two early.
        assert!(took >= ROUTE_TIMEOUT * 9 / 10, "request {i} waited for the hung sidecar: {took:?}");
    }
    let route_calls = || hung.paths().iter().filter(|p| p.starts_with("/v1/route")).count();
    wait_for("the hung sidecar to take every call", Duration::from_secs(5), || {
        (route_calls() == FAILURES).then_some(())
    })
    .unwrap();
    assert_eq!(breaker_state(), 1, "open after {FAILURES} timeouts in a row");
    assert_eq!(fell_back(), FAILURES as u64);

    // Warm both gateways' upstream connections, then time the same requests through each, in
    // turns (which goes first alternates), so both see the machine alike.
    for i in 0..10 {
        timed(&client, &alone, i);
        timed(&client, &kvgate, i);
    }
    // A p99 of 300 is the third slowest: one stall of the host in either gateway's turn moves
    // it by milliseconds. A cost the filter adds shows in every round; a stall seldom repeats.
    // So up to `ROUNDS` rounds are timed, and the best must meet the bound.
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        let (mut through_kvgate, mut through_alone) = (Vec::new(), Vec::new());
        for i in 0..MEASURED {
            let order = if i % 2 == 0 { [&kvgate, &alone] } else { [&alone, &kvgate] };
            for url in order {
                let (status, routed_to, took) = timed(&client, url, 100 + i);
                assert_eq!(status, 200, "round {round}, request {i} to {url}");
                if url == &kvgate {
                    assert_eq!(routed_to, "fallback", "round {round}, request {i}: Envoy's balancer routes it");
                    through_kvgate.push(ms(took));
                } else {
                    through_alone.push(ms(took));
                }
            }
        }
        let round = Round { kvgate: through_kvgate, alone: through_alone };
        let met = round.added() < 1.0;
        rounds.push(round);
        if met {
            break;
        }
    }
    assert_eq!(route_calls(), FAILURES, "no request asked the sidecar while the breaker was open");
    let timed_requests = rounds.len() * MEASURED;
    assert_eq!(requests("breaker_open"), (10 + timed_requests) as u64, "each counted");
    assert_eq!(breaker_state(), 1);
    assert_eq!(fell_back(), FAILURES as u64, "none waited for the sidecar");

    let csv: String = rounds
        .iter()
        .enumerate()
        .flat_map(|(r, round)| {
            round
                .kvgate
                .iter()
                .zip(&round.alone)
                .enumerate()
                .map(move |(i, (k, a))| format!("{r},{i},{:.0},{:.0}\n", k * 1000.0, a * 1000.0))
        })
        .collect();
    let samples = stack.dir.join("latency.csv");
    std::fs::write(&samples, format!("round,request,kvgate_us,envoy_alone_us\n{csv}")).unwrap();
    eprintln!("breaker closed, the sidecar hung: {FAILURES} requests took {} ms", waited.join(", "));
    for (r, round) in rounds.iter().enumerate() {
        eprintln!(
            "breaker open, round {r}: p99 {:.3} ms through Envoy + kvgate, {:.3} ms through Envoy alone \
             (added {:.3} ms); medians {:.3} ms and {:.3} ms; {MEASURED} requests each",
            Round::p99(&round.kvgate),
            Round::p99(&round.alone),
            round.added(),
            median(&round.kvgate).expect("a round times requests"),
            median(&round.alone).expect("a round times requests"),
        );
    }
    eprintln!("every request in {}", samples.display());
    let best = rounds.iter().map(Round::added).fold(f64::INFINITY, f64::min);
    assert!(
        best < 1.0,
        "kvgate adds under 1 ms at p99 once its breaker is open: {best:.3} ms added in the best of {} rounds",
        rounds.len()
    );
}
