//! Bookings and their lifecycle through the HTTP API: each report reaches only the pool of
//! its model, so no pool's bookkeeping grows with another pool's traffic; large bodies are
//! accepted up to the documented cap.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use kvgate_shared::codec;
use kvgate_shared::hash::SequenceHash;
use kvgate_shared::ids::ModelName;
use kvgate_shared::wire::{LifecycleBatch, LifecycleEvent, LifecycleKind, RouteRequest, RouteResponse, MAX_BODY_BYTES};
use kvgate_sidecar::api::{router, AppState};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use tower::ServiceExt;

const MODELS: [&str; 2] = ["Qwen/Qwen3-8B", "meta-llama/Llama-3.2-1B-Instruct"];

fn state() -> Arc<AppState> {
    let metrics = Arc::new(Metrics::default());
    let pools = MODELS
        .iter()
        .enumerate()
        .map(|(p, model)| {
            let replicas = (0..2)
                .map(|i| {
                    let endpoint = format!("127.0.0.1:{}", 9000 + 10 * p + i).parse().unwrap();
                    ReplicaConfig::new(&format!("p{p}r{i}"), endpoint, "tcp://127.0.0.1:1")
                })
                .collect();
            let config = PoolConfig::new(model, "unused", 4, replicas);
            ((*model).to_owned(), Arc::new(Pool::new(config, Vec::new(), metrics.clone())))
        })
        .collect();
    Arc::new(AppState::new(pools, ScoringConfig::default(), false, metrics))
}

async fn post(state: &Arc<AppState>, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let request = Request::post(path).body(Body::from(body)).unwrap();
    let response = router(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    (status, to_bytes(response.into_body(), 1 << 20).await.unwrap().to_vec())
}

fn route_request(model: &str, id: &str, client_id: &str) -> RouteRequest {
    RouteRequest {
        client_request_id: Some(client_id.into()),
        ..RouteRequest::exact(id, model, 64, 4, (0..16).map(SequenceHash).collect())
    }
}

fn bookkeeping(state: &AppState) -> HashMap<String, (usize, usize, u64)> {
    state
        .pools
        .iter()
        .map(|(model, pool)| {
            let s = pool.state();
            let active = s.replicas.iter().map(|r| r.active_requests).sum();
            (model.clone(), (s.bookings, s.ended_early, active))
        })
        .collect()
}

#[tokio::test]
async fn reports_reach_only_their_pool_and_nothing_grows() {
    let state = state();
    for round in 0..100 {
        let mut batch = LifecycleBatch::default();
        for i in 0..100 {
            let model = MODELS[i % 2];
            // Every request reuses one client id: only the booking key tells them apart.
            let id = format!("vm-{round}-{i}");
            let body = codec::encode(&route_request(model, &id, "same-client-id")).unwrap();
            let (status, answer) = post(&state, "/v1/route", body).await;
            assert_eq!(status, StatusCode::OK);
            assert!(codec::decode::<RouteResponse>(&answer).unwrap().endpoint.is_some());
            for kind in [LifecycleKind::FirstToken { ttft_us: Some(900) }, LifecycleKind::Done] {
                batch.events.push(LifecycleEvent { model: model.into(), request_id: id.as_str().into(), kind });
            }
        }
        let booked = bookkeeping(&state);
        assert!(booked.values().all(|b| *b == (50, 0, 50)), "each request booked on its own: {booked:?}");
        let (status, _) = post(&state, "/v1/lifecycle", codec::encode(&batch).unwrap()).await;
        assert_eq!(status, StatusCode::NO_CONTENT);
    }
    let after = bookkeeping(&state);
    assert!(after.values().all(|b| *b == (0, 0, 0)), "10 000 requests, all released, nothing kept: {after:?}");
    // A report for one pool's request names that pool: another pool never remembers it.
    let stray = LifecycleBatch {
        events: vec![LifecycleEvent {
            model: MODELS[0].into(),
            request_id: "never-booked".into(),
            kind: LifecycleKind::Done,
        }],
    };
    post(&state, "/v1/lifecycle", codec::encode(&stray).unwrap()).await;
    let after = bookkeeping(&state);
    assert_eq!(after[MODELS[0]].1, 1, "an end before its booking is remembered by its own pool");
    assert_eq!(after[MODELS[1]].1, 0, "and by no other");
}

#[tokio::test]
async fn reports_are_counted_by_kind_and_whether_they_found_their_booking() {
    let state = state();
    let model = MODELS[0];
    let (status, _) = post(&state, "/v1/route", codec::encode(&route_request(model, "booked", "c")).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    let event = |id: &str, kind| LifecycleEvent { model: model.into(), request_id: id.into(), kind };
    let events = vec![
        event("booked", LifecycleKind::FirstToken { ttft_us: Some(900) }),
        event("booked", LifecycleKind::Done),
        event("never-booked", LifecycleKind::Done),
    ];
    let (status, _) = post(&state, "/v1/lifecycle", codec::encode(&LifecycleBatch { events }).unwrap()).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let text = state.metrics.render();
    for line in [
        r#"kvgate_lifecycle_events_total{kind="first_token",known="true"} 1"#,
        r#"kvgate_lifecycle_events_total{kind="done",known="true"} 1"#,
        r#"kvgate_lifecycle_events_total{kind="done",known="false"} 1"#,
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
    assert!(!text.contains(r#"="""#), "no family has an empty label:\n{text}");
}

#[tokio::test]
async fn a_lifecycle_batch_as_large_as_envoy_buffers_is_accepted() {
    let state = state();
    let mut batch = LifecycleBatch::default();
    let model = ModelName::new("m".repeat(200));
    while codec::encode(&batch).unwrap().len() < 4 << 20 {
        for _ in 0..1000 {
            let event =
                LifecycleEvent { model: model.clone(), request_id: "x".repeat(64).into(), kind: LifecycleKind::Done };
            batch.events.push(event);
        }
    }
    let body = codec::encode(&batch).unwrap();
    assert!(body.len() > 2 << 20 && body.len() < MAX_BODY_BYTES, "past axum's default limit, under the cap");
    let (status, _) = post(&state, "/v1/lifecycle", body).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = post(&state, "/v1/lifecycle", vec![0; MAX_BODY_BYTES + (1 << 20)]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "past the cap");
}

#[tokio::test]
async fn a_panic_in_one_requests_handling_leaves_the_sidecar_serving() {
    let state = state();
    // A handler with a bug, served beside the API the way axum serves every route.
    let bug = || async {
        if std::hint::black_box(true) {
            panic!("a bug in one request");
        }
        StatusCode::OK
    };
    let app = router(state.clone()).route("/bug", axum::routing::get(bug));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    assert!(client.get(format!("http://{addr}/bug")).send().await.is_err(), "that request fails");
    let body = codec::encode(&route_request(MODELS[0], "after", "c")).unwrap();
    let answer = client.post(format!("http://{addr}/v1/route")).body(body).send().await.unwrap();
    assert_eq!(answer.status().as_u16(), 200, "the next one is routed");
    let decision: RouteResponse = codec::decode(&answer.bytes().await.unwrap()).unwrap();
    assert!(decision.endpoint.is_some());
}
