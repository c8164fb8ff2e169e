//! Tests of `kv_transfer`.

use super::*;

fn nixl() -> Protocol {
    Protocol::Nixl(Nixl::new("engine-a".into(), 1, "127.0.0.1".into(), 8100))
}

fn bootstrap(side: Side) -> Protocol {
    Protocol::Bootstrap(Bootstrap { side, port: 8998, timeout: Duration::from_secs(1), arrivals: Arrivals::default() })
}

fn plan(protocol: &Protocol, body: Value) -> Result<Plan, String> {
    protocol.plan(body.to_string().as_bytes())
}

#[test]
fn the_config_takes_vllms_field_names_and_refuses_other_connectors() {
    let config = KvTransferConfig::parse(
        r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"backends":["UCX"]},"kv_buffer_device":"cuda"}"#,
    )
    .unwrap();
    assert_eq!(
        (config.role(), config.failure_policy(), config.engine_id()),
        (Some(KvRole::Both), FailurePolicy::Fail, None)
    );
    let recompute = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute","engine_id":"d0"}"#;
    let config = KvTransferConfig::parse(recompute).unwrap();
    assert_eq!((config.failure_policy(), config.engine_id()), (FailurePolicy::Recompute, Some("d0")));
    let lmcache = KvTransferConfig::parse(r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#);
    assert!(matches!(lmcache, Err(ConfigError::Unsupported(name)) if name == "LMCacheConnectorV1"));
    assert!(matches!(KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector"}"#), Err(ConfigError::NoRole)));
    assert!(matches!(KvTransferConfig::parse(r#"{"kv_role":"kv_both"}"#), Err(ConfigError::NoConnector)));
    let bad_role = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"kv_prefill"}"#);
    assert!(matches!(bad_role, Err(ConfigError::Json(_))));
    let bad_extra = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":[1]}"#;
    assert!(matches!(KvTransferConfig::parse(bad_extra), Err(ConfigError::Json(_))));
}

#[test]
fn vllm_params_read_as_the_toy_proxy_and_the_prefill_response_write_them() {
    let p = nixl();
    // The proxy's prefill request: the remote fields are nulls.
    let prefill = json!({"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    assert_eq!(plan(&p, prefill), Ok(Plan::RemoteDecode));
    let Protocol::Nixl(n) = &p else { unreachable!() };
    let params = n.prefill_params(0, "cmpl-1", &[4, 5, 6], 32);
    let keys: Vec<&str> = params.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "do_remote_prefill",
            "do_remote_decode",
            "remote_block_ids",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "tp_size",
            "remote_prefill_cached_tokens"
        ]
    );
    // The decode request carries them back, with a chat's forwarded ids beside them.
    let mut decode = params.clone();
    decode["prompt_token_ids"] = json!([1, 2, 3]);
    let expected = Source::Nixl(NixlSource {
        engine_id: "engine-a".into(),
        request_id: "cmpl-1".into(),
        block_ids: vec![4, 5, 6],
        host: "127.0.0.1".into(),
        port: 8100,
        prefill_cached_tokens: Some(32),
    });
    assert_eq!(plan(&p, json!({"kv_transfer_params": decode})), Ok(Plan::RemotePrefill(expected.clone())));
    assert_eq!(expected.mode(), LoadMode::RecomputeLast);
    for local in
        [json!({}), json!({"kv_transfer_params": null}), json!({"kv_transfer_params": {"prompt_token_ids": [1]}})]
    {
        assert_eq!(plan(&p, local), Ok(Plan::Local));
    }
    assert_eq!(plan(&Protocol::Off, json!({"kv_transfer_params": 7})), Ok(Plan::Local), "ignored when off");
}

#[test]
fn malformed_vllm_params_are_refused_with_the_field_named() {
    let p = nixl();
    let good = json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_request_id": "r",
        "remote_block_ids": [1], "remote_host": "h", "remote_port": 1});
    let cases = [
        (json!(7), "`kv_transfer_params` must be an object"),
        (json!({"do_remote_decode": "yes"}), "do_remote_decode` must be a boolean"),
        (json!({"do_remote_decode": true, "do_remote_prefill": true}), "both"),
        (json!({"do_remote_prefill": true}), "remote_block_ids"),
    ];
    for (params, message) in cases {
        let err = plan(&p, json!({"kv_transfer_params": params})).unwrap_err();
        assert!(err.contains(message), "{err}");
    }
    for (field, bad) in [("remote_block_ids", json!([-1])), ("remote_port", json!(70000)), ("remote_host", json!(1))] {
        let mut params = good.clone();
        params[field] = bad;
        let err = plan(&p, json!({"kv_transfer_params": params})).unwrap_err();
        assert!(err.contains(field), "{err}");
    }
    assert!(plan(&p, json!({"kv_transfer_params": good})).is_ok());
}

#[test]
fn sglang_bootstrap_fields_as_the_router_sends_them() {
    let room = (1u64 << 63) - 1;
    let body = json!({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": room});
    assert_eq!(plan(&bootstrap(Side::Prefill), body.clone()), Ok(Plan::BootstrapPrefill(room)));
    let decode = bootstrap(Side::Decode);
    let source = Source::Bootstrap { host: "10.0.0.1".into(), port: 8998, room };
    assert_eq!(plan(&decode, body), Ok(Plan::RemotePrefill(source.clone())));
    assert_eq!(source.mode(), LoadMode::WithFirstToken);
    // mini_lb sends `bootstrap_port: null` for a prefill without one: the decoder's default.
    let no_port = json!({"bootstrap_host": "p", "bootstrap_port": null, "bootstrap_room": 3});
    assert_eq!(
        plan(&decode, no_port),
        Ok(Plan::RemotePrefill(Source::Bootstrap { host: "p".into(), port: 8998, room: 3 }))
    );
    assert_eq!(plan(&decode, json!({"prompt": "x"})), Err(NO_ROOM.into()));
    assert_eq!(plan(&bootstrap(Side::Prefill), json!({"bootstrap_room": null})), Err(NO_ROOM.into()));
    assert!(plan(&decode, json!({"bootstrap_room": "7", "bootstrap_host": "p"}))
        .unwrap_err()
        .contains("bootstrap_room"));
    assert!(plan(&decode, json!({"bootstrap_room": 7})).unwrap_err().contains("bootstrap_host"));
    assert!(plan(&decode, json!({"bootstrap_room": 7, "bootstrap_host": "p", "bootstrap_port": -1}))
        .unwrap_err()
        .contains("bootstrap_port"));
    assert_eq!((room_rank(7, 2), room_rank(7, 1)), (1, 0));
}

#[test]
fn data_parallel_ranks_have_their_own_engine_ids() {
    let one = Nixl::new("e".into(), 1, "h".into(), 1);
    assert_eq!((one.engine_id(0), one.rank_of("e")), ("e".to_owned(), Some(0)));
    let two = Nixl::new("e".into(), 2, "h".into(), 1);
    assert_eq!((two.engine_id(1), two.rank_of("e_dp1"), two.rank_of("e")), ("e_dp1".to_owned(), Some(1), None));
    assert_eq!(host_port("::1", 80), "[::1]:80");
}

#[test]
fn transfer_time_is_bytes_over_bandwidth_over_speedup() {
    let timing = TransferTiming { bytes_per_token: 131_072, gbps: 25.0, speedup: 1.0 };
    // 10 000 tokens of Llama-8B KV: 1.31 GB at 25 GB/s.
    assert_eq!(timing.duration(10_000).as_micros(), 52_428);
    assert_eq!(TransferTiming { speedup: 4.0, ..timing }.duration(10_000).as_micros(), 13_107);
    assert_eq!(timing.duration(0), Duration::ZERO);
}

#[tokio::test]
async fn a_prefill_waits_for_its_rooms_decoder() {
    let arrivals = std::sync::Arc::new(Arrivals::default());
    assert!(!arrivals.wait(1, Duration::from_millis(20)).await, "nobody joined");
    let waiter = tokio::spawn({
        let arrivals = arrivals.clone();
        async move { arrivals.wait(2, Duration::from_secs(10)).await }
    });
    tokio::task::yield_now().await;
    arrivals.arrive(3, Duration::from_secs(60));
    arrivals.arrive(2, Duration::from_secs(60));
    assert!(waiter.await.unwrap(), "woken by its room");
    assert!(!arrivals.wait(2, Duration::ZERO).await, "the mark is taken");
    arrivals.forget(3);
    assert!(!arrivals.wait(3, Duration::ZERO).await, "forgotten");
    arrivals.arrive(4, Duration::ZERO);
    arrivals.arrive(5, Duration::ZERO);
    assert!(!arrivals.wait(4, Duration::ZERO).await, "an old mark is dropped");
}
