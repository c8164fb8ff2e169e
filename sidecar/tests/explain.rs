//! `/debug/explain` through the HTTP API: a decision is found by its request id among as many
//! later ones as the pool keeps (`explain_keep`), and an id no longer kept is a 404 whose JSON
//! says why.

use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::http::{Request, StatusCode};
use kvgate_shared::codec;
use kvgate_shared::hash::SequenceHash;
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::api::{router, AppState};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use serde_json::Value;
use tower::ServiceExt;

const KEEP: usize = 50;

fn state() -> Arc<AppState> {
    let metrics = Arc::new(Metrics::default());
    let replicas = (0..2)
        .map(|i| ReplicaConfig::new(&format!("r{i}"), format!("127.0.0.1:{}", 9000 + i).parse().unwrap(), "tcp://x:1"))
        .collect();
    let config = PoolConfig { explain_keep: KEEP, ..PoolConfig::new("m", "unused", 4, replicas) };
    let pools = [("m".to_owned(), Arc::new(Pool::new(config, Vec::new(), metrics.clone())))].into();
    Arc::new(AppState::new(pools, ScoringConfig::default(), false, metrics))
}

async fn route(state: &Arc<AppState>, id: &str) {
    let req = RouteRequest {
        client_request_id: Some(format!("client-{id}")),
        ..RouteRequest::exact(id, "m", 16, 4, (0..4).map(SequenceHash).collect())
    };
    let request = Request::post("/v1/route").body(Body::from(codec::encode(&req).unwrap())).unwrap();
    assert_eq!(router(state.clone()).oneshot(request).await.unwrap().status(), StatusCode::OK);
}

async fn explain(state: &Arc<AppState>, query: &str) -> (StatusCode, Value) {
    let request = Request::get(format!("/debug/explain?{query}")).body(Body::empty()).unwrap();
    let response = router(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    (status, serde_json::from_slice(&to_bytes(response.into_body(), 1 << 20).await.unwrap()).unwrap())
}

#[tokio::test]
async fn a_decision_is_found_by_request_id_until_the_pool_keeps_it_no_more() {
    let state = state();
    route(&state, "first").await;
    for i in 1..KEEP {
        route(&state, &format!("later-{i}")).await;
    }
    for query in ["request_id=first", "request=first", "request_id=client-first"] {
        let (status, found) = explain(&state, query).await;
        assert_eq!(status, StatusCode::OK, "{query}: {found}");
        let decisions = found["decisions"].as_array().unwrap();
        assert_eq!(decisions.len(), 1, "{query}: {found}");
        assert_eq!(decisions[0]["request_id"], "first", "{query}");
        assert_eq!(decisions[0]["candidates"].as_array().unwrap().len(), 2, "{query}");
    }
    let (_, recent) = explain(&state, "last=1000").await;
    assert_eq!(recent["decisions"].as_array().unwrap().len(), KEEP, "the count bound");

    route(&state, "one-more").await;
    let (status, gone) = explain(&state, "request_id=first").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{gone}");
    let error = gone["error"].as_str().unwrap();
    assert!(error.contains("\"first\"") && error.contains("explain_keep"), "{error}");
    assert_eq!(explain(&state, "request_id=later-1").await.0, StatusCode::OK);
}
