//! `POST /v1/route_body`: the sidecar tokenizes an offloaded prompt exactly as the filter
//! would, routes it to the replica holding its prefix, and answers bad input with a 4xx (the
//! filter then falls back).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use std::time::Duration;

use axum::body::{to_bytes, Body, Bytes};
use axum::http::{Request, StatusCode};
use kvgate_shared::codec;
use kvgate_shared::hash::{EngineHash, Salt};
use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::{ModelBundle, RouteBodyRequest, RouteResponse};
use kvgate_sidecar::api::{router, AppState};
use kvgate_sidecar::index::{ReplicaIdx, Store, Tier};
use kvgate_sidecar::metrics::{FallbackLabels, Metrics};
use kvgate_sidecar::pool::{OffloadError, Offloaded, Pool};
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use tower::ServiceExt;

const BLOCK: u32 = 16;

fn model_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b")
}

fn state() -> (Arc<AppState>, Arc<Pool>) {
    state_holding(kvgate_sidecar::api::DEFAULT_OFFLOAD_QUEUE_BYTES)
}

/// A sidecar holding at most `queue_bytes` of offloaded bodies at once.
fn state_holding(queue_bytes: usize) -> (Arc<AppState>, Arc<Pool>) {
    let replicas = (0..3)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 9000 + i).parse().unwrap();
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig::new("qwen3", model_dir(), BLOCK, replicas);
    let bundle = codec::encode(&ModelBundle::from_dir("qwen3", &model_dir(), BLOCK).unwrap()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(config, bundle, metrics.clone()));
    let pools = HashMap::from([("qwen3".to_owned(), pool.clone())]);
    let state = AppState::new(pools, ScoringConfig::default(), false, metrics).with_offload_queue_bytes(queue_bytes);
    (Arc::new(state), pool)
}

async fn post(state: Arc<AppState>, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let request = Request::post("/v1/route_body").body(Body::from(body)).unwrap();
    let response = router(state).oneshot(request).await.unwrap();
    let status = response.status();
    (status, to_bytes(response.into_body(), 1 << 20).await.unwrap().to_vec())
}

fn offload(body: &str) -> Vec<u8> {
    offload_to(Endpoint::ChatCompletions, body)
}

fn offload_to(endpoint: Endpoint, body: &str) -> Vec<u8> {
    let request = RouteBodyRequest::of("r1", endpoint, body.as_bytes(), 30_000);
    codec::encode(&request).unwrap()
}

/// Stores on `replica` the full blocks of `body`'s prompt, tokenized as kvgate tokenizes it
/// and named as an engine would report them; returns how many.
fn cache_prompt(pool: &Pool, replica: usize, endpoint: Endpoint, body: &str) -> usize {
    let tokenizer = ModelTokenizer::from_bundle(&ModelBundle::from_dir("qwen3", &model_dir(), BLOCK).unwrap()).unwrap();
    let tokens = tokenizer.prompt_tokens(&parse(endpoint, body.as_bytes()).unwrap()).unwrap();
    let full = tokens.len() / BLOCK as usize;
    let engine_hashes: Vec<EngineHash> = (1..=full as u64).map(EngineHash).collect();
    let store = Store {
        parent: None,
        engine_hashes: &engine_hashes,
        token_ids: &tokens[..full * BLOCK as usize],
        block_size: BLOCK as usize,
        salt: Salt::NONE,
        extra: &[],
        tier: Tier::Device,
    };
    pool.store_blocks(ReplicaIdx::new(replica), store).unwrap();
    full
}

#[tokio::test]
async fn an_offloaded_prompt_follows_its_cached_prefix() {
    let (state, pool) = state();
    let body = format!(
        r#"{{"model":"qwen3","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"and?"}}]}}"#,
        "a long shared system prompt ".repeat(40)
    );
    // Replica r2 holds the prompt's blocks, stored as vLLM would report them.
    let full = cache_prompt(&pool, 2, Endpoint::ChatCompletions, &body);

    let (status, answer) = post(state, offload(&body)).await;
    assert_eq!(status, StatusCode::OK);
    let answer: RouteResponse = codec::decode(&answer).unwrap();
    assert_eq!(answer.replica.as_deref(), Some("r2"));
    assert_eq!(answer.endpoint.as_deref(), Some("127.0.0.1:9002"));
    assert_eq!(answer.overlap_blocks as usize, full, "every full block of the same tokens matched");
}

/// With `offload_spread_threads`, a long offloaded prompt spreads over the tokenizer slots no
/// one is using, and its tokens are still exactly the filter's: every full block matches the
/// blocks an engine reported for the prompt tokenized on one thread. By default it takes none.
#[tokio::test]
async fn a_long_offloaded_prompt_spreads_over_idle_slots_and_matches_every_block() {
    let spare = |state: Arc<AppState>| async move {
        let response = router(state).oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.unwrap();
        let text = String::from_utf8(to_bytes(response.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap();
        text.lines().find_map(|l| l.strip_prefix("kvgate_offload_spare_threads_total ")?.parse::<u64>().ok())
    };
    let (state, pool) = state();
    let state = Arc::new(Arc::into_inner(state).unwrap().with_offload_slots(4).with_offload_spread(4));
    let system: String =
        (0..24_000).map(|i| format!("word{} of the agent's context", i % 97)).collect::<Vec<_>>().join(" ");
    let body = serde_json::json!({"model": "qwen3", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "what next?"},
    ]})
    .to_string();
    let full = cache_prompt(&pool, 1, Endpoint::ChatCompletions, &body);

    let (status, answer) = post(state.clone(), offload(&body)).await;
    assert_eq!(status, StatusCode::OK);
    let answer: RouteResponse = codec::decode(&answer).unwrap();
    assert_eq!(answer.replica.as_deref(), Some("r1"));
    assert_eq!(answer.overlap_blocks as usize, full, "every full block of the same tokens matched");
    assert_eq!(spare(state).await, Some(3), "the three idle slots were lent");

    let (default, _) = state_holding(kvgate_sidecar::api::DEFAULT_OFFLOAD_QUEUE_BYTES);
    let (status, _) = post(default.clone(), offload(&body)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(spare(default).await, Some(0), "no slot lent unless configured");
}

/// An Anthropic Messages body is rendered as the filter renders it: Claude Code's billing
/// header, different on every request, is dropped, so the request finds the prefix an earlier
/// one left.
#[tokio::test]
async fn an_offloaded_messages_body_follows_its_cached_prefix() {
    let (state, pool) = state();
    let body = |billing: &str| {
        serde_json::json!({"model": "qwen3", "max_tokens": 8,
            "system": [{"type": "text", "text": format!("x-anthropic-billing-header: cch={billing}")},
                {"type": "text", "text": "a long shared system prompt ".repeat(40)}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "and?"}]}]})
        .to_string()
    };
    let full = cache_prompt(&pool, 1, Endpoint::Messages, &body("a1"));

    let (status, answer) = post(state, offload_to(Endpoint::Messages, &body("b2"))).await;
    assert_eq!(status, StatusCode::OK);
    let answer: RouteResponse = codec::decode(&answer).unwrap();
    assert_eq!(answer.replica.as_deref(), Some("r1"));
    assert_eq!(answer.overlap_blocks as usize, full, "the billing header is not part of the prompt");
}

#[tokio::test]
async fn bad_input_gets_a_clear_4xx() {
    let (state, _) = state();
    let (status, _) = post(state.clone(), b"not bincode".to_vec()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, message) = post(state.clone(), offload("{not json")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{}", String::from_utf8_lossy(&message));
    let (status, message) =
        post(state, offload(r#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8_lossy(&message).contains("other"));
}

/// A body that says its length is read by size: a small one (up to 20 KiB) is parsed on the
/// request's task, a big one decoded, parsed and looked up on a blocking thread. Their answers
/// are the same — a 4xx for what cannot be routed, an estimate for a prompt it cannot read, a
/// route where the prefix is cached for one it can.
#[tokio::test]
async fn small_and_big_bodies_get_the_same_answers() {
    for pad in [String::new(), "x".repeat(40 << 10)] {
        let (state, pool) = state();
        let send = |state: &Arc<AppState>, body: String| {
            let (state, call) = (state.clone(), offload(&body));
            let small = call.len() <= 20 << 10;
            assert_eq!(small, pad.is_empty(), "{} bytes", call.len());
            async move {
                let response = router(state).oneshot(sized(Body::from(call.clone()), call.len())).await.unwrap();
                let status = response.status();
                (status, to_bytes(response.into_body(), 1 << 20).await.unwrap().to_vec())
            }
        };
        let (status, _) = send(&state, format!("{{not json {pad}")).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        let (status, message) =
            send(&state, format!(r#"{{"model":"other","pad":"{pad}","messages":[{{"role":"user","content":"hi"}}]}}"#))
                .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(String::from_utf8_lossy(&message).contains("other"));
        assert_eq!(pool.state().bookings, 0);
        let image = r#"[{"type":"image_url","image_url":{"url":"data:x"}}]"#;
        let (status, answer) = send(
            &state,
            format!(r#"{{"model":"qwen3","pad":"{pad}","messages":[{{"role":"user","content":{image}}}]}}"#),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer));
        assert_eq!(pool.state().bookings, 1, "booked on an estimate");
        assert!(state.metrics.render().contains(r#"kvgate_estimated_requests_total{reason="unparsable"} 1"#));
        // On a pool with nothing booked (the estimate above weighs on its replica).
        let (state, pool) = self::state();
        pool.tokenizer().unwrap();
        let chat = format!(
            r#"{{"model":"qwen3","pad":"{pad}","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "word ".repeat(500)
        );
        let cached = cache_prompt(&pool, 2, Endpoint::ChatCompletions, &chat);
        let (status, answer) = send(&state, chat).await;
        assert_eq!(status, StatusCode::OK);
        let route: RouteResponse = codec::decode(&answer).unwrap();
        assert_eq!(
            route.endpoint.as_deref(),
            Some("127.0.0.1:9002"),
            "where its prefix is cached ({} padded)",
            pad.len()
        );
        assert_eq!(route.overlap_blocks as usize, cached);
    }
}

#[tokio::test]
async fn work_past_the_filters_deadline_is_skipped_and_not_booked() {
    let (state, pool) = state();
    let body = r#"{"model":"qwen3","messages":[{"role":"user","content":"hello"}]}"#;
    let call = offload(body);
    let request: RouteBodyRequest<'_> = codec::decode(&call).unwrap();
    let parsed = parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
    let late = pool.request_for_body(&parsed, &Offloaded::of(&request), std::time::Instant::now(), 1);
    assert!(matches!(late, Err(OffloadError::Late)), "{late:?}");
    assert_eq!(pool.state().bookings, 0, "the filter has gone on without us: nothing booked");
    // Within its budget the same prompt is routed and booked.
    let (status, _) = post(state, offload(body)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(pool.state().bookings, 1);
}

#[tokio::test]
async fn a_body_whose_prompt_cannot_be_read_is_booked_on_an_estimate() {
    let (state, pool) = state();
    let image = r#"{"model":"qwen3","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]}"#;
    let (status, answer) = post(state.clone(), offload(image)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer));
    assert!(codec::decode::<RouteResponse>(&answer).unwrap().endpoint.is_some(), "routed on load");
    assert_eq!(pool.state().bookings, 1, "and booked: its load is real");
    let metrics = state.metrics.render();
    assert!(metrics.contains(r#"kvgate_estimated_requests_total{reason="unparsable"} 1"#), "{metrics}");
}

/// A pool whose tokenizer cannot load (the filter cannot load it either: the same bundle)
/// still books what it is sent, on an estimate, rather than leaving the load uncounted.
#[tokio::test]
async fn a_pool_without_a_tokenizer_books_offloads_on_an_estimate() {
    let replica = ReplicaConfig::new("r0", "127.0.0.1:9000".parse().unwrap(), "tcp://127.0.0.1:1");
    let config = PoolConfig::new("qwen3", model_dir(), BLOCK, vec![replica]);
    let metrics = Arc::new(Metrics::default());
    let pool = Arc::new(Pool::new(config, b"not a bundle".to_vec(), metrics.clone()));
    let pools = HashMap::from([("qwen3".to_owned(), pool.clone())]);
    let state = Arc::new(AppState::new(pools, ScoringConfig::default(), false, metrics));
    let (status, answer) =
        post(state.clone(), offload(r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}]}"#)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&answer));
    assert!(codec::decode::<RouteResponse>(&answer).unwrap().endpoint.is_some(), "routed on load");
    assert_eq!(pool.state().bookings, 1, "and booked");
    let metrics = state.metrics.render();
    assert!(metrics.contains(r#"kvgate_estimated_requests_total{reason="no_tokenizer"} 1"#), "{metrics}");
}

/// A filter of another release is refused by name (409), before its body is misread; the
/// same call with this release's version, or with none (curl), is served.
#[tokio::test]
async fn a_filter_of_another_wire_version_is_refused_by_name() {
    use kvgate_shared::wire::{WIRE_VERSION, WIRE_VERSION_HEADER};
    let (state, _) = state();
    let body = r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}]}"#;
    let call = |version: Option<&str>| {
        let mut request = Request::post("/v1/route_body");
        if let Some(v) = version {
            request = request.header(WIRE_VERSION_HEADER, v);
        }
        router(state.clone()).oneshot(request.body(Body::from(offload(body))).unwrap())
    };
    let refused = call(Some("1")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let said = String::from_utf8(to_bytes(refused.into_body(), 1 << 16).await.unwrap().to_vec()).unwrap();
    assert!(said.contains("speaks 1") && said.contains(WIRE_VERSION), "{said}");
    let metrics = state.metrics.render();
    assert!(metrics.contains("kvgate_wire_mismatches_total 1"), "{metrics}");
    for version in [Some(WIRE_VERSION), None] {
        assert_eq!(call(version).await.unwrap().status(), StatusCode::OK, "{version:?}");
    }
}

/// The call the filter makes: its length declared.
fn sized(body: Body, len: usize) -> Request<Body> {
    Request::post("/v1/route_body").header("content-length", len).body(body).unwrap()
}

#[tokio::test]
async fn offloaded_bodies_held_at_once_are_bounded_in_bytes() {
    let chat = format!(r#"{{"model":"qwen3","messages":[{{"role":"user","content":"{}"}}]}}"#, "word ".repeat(12_000));
    let body = offload(&chat);
    let len = body.len();
    // Room for one such body, not two.
    let (state, _) = state_holding(len + len / 2);
    let held = || state.metrics.offload_bytes_held.get();

    // A first call whose headers came and whose body has not: its room is held meanwhile.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let first = tokio::spawn(router(state.clone()).oneshot(sized(Body::from_stream(stream), len)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while held() != len as i64 {
        assert!(tokio::time::Instant::now() < deadline, "the first body's room is never held: {}", held());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // A second would pass the bound: answered at once, unread, and counted.
    let second = router(state.clone()).oneshot(sized(Body::from(body.clone()), len)).await.unwrap();
    assert_eq!(second.status(), StatusCode::SERVICE_UNAVAILABLE);
    let message = String::from_utf8(to_bytes(second.into_body(), 1 << 20).await.unwrap().to_vec()).unwrap();
    assert!(message.contains("offload_queue_bytes"), "{message}");
    let full = FallbackLabels { reason: "offload_full".into() };
    assert_eq!(state.metrics.route_fallbacks.get_or_create(&full).get(), 1);

    // The first body arrives: it is routed, and its room given back.
    tx.send(Ok(Bytes::from(body.clone()))).await.unwrap();
    drop(tx);
    let answered = first.await.unwrap().unwrap();
    assert_eq!(answered.status(), StatusCode::OK);
    let route: RouteResponse = codec::decode(&to_bytes(answered.into_body(), 1 << 20).await.unwrap()).unwrap();
    assert!(route.endpoint.is_some(), "routed: {route:?}");
    assert_eq!(held(), 0);

    // With room again, the same body is routed.
    let again = router(state.clone()).oneshot(sized(Body::from(body), len)).await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(held(), 0);
}

/// A small body (one the filter sends because it holds no tokenizer for its model) takes no
/// room: big bodies filling `offload_queue_bytes` do not turn it away.
#[tokio::test]
async fn a_small_offload_is_routed_while_big_bodies_fill_the_room() {
    let chat = format!(r#"{{"model":"qwen3","messages":[{{"role":"user","content":"{}"}}]}}"#, "word ".repeat(12_000));
    let big = offload(&chat);
    let (state, pool) = state_holding(big.len());
    pool.tokenizer().unwrap();
    // A big body holds all the room while its bytes have not come.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let first = tokio::spawn(router(state.clone()).oneshot(sized(Body::from_stream(stream), big.len())));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while state.metrics.offload_bytes_held.get() != big.len() as i64 {
        assert!(tokio::time::Instant::now() < deadline, "the big body's room is never held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let small = offload(r#"{"model":"qwen3","messages":[{"role":"user","content":"hello"}]}"#);
    let answered = router(state.clone()).oneshot(sized(Body::from(small.clone()), small.len())).await.unwrap();
    assert_eq!(answered.status(), StatusCode::OK);
    let route: RouteResponse = codec::decode(&to_bytes(answered.into_body(), 1 << 20).await.unwrap()).unwrap();
    assert!(route.endpoint.is_some(), "routed: {route:?}");
    assert_eq!(pool.state().bookings, 1, "the small one, booked");
    tx.send(Ok(Bytes::from(big))).await.unwrap();
    drop(tx);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
}
