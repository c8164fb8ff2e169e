//! The deployment manifests (`envoy/k8s`, `envoy/gateway-api`) hang together: every file
//! parses, every Kustomize reference exists, every kvgate config validates with the sidecar's
//! own loader and every filter config with the filter's own parser, and the names and ports
//! that must agree across files do. The dashboard only queries metrics kvgate exports.

use std::collections::HashSet;

use kvgate_filter::config::FilterConfig;
use kvgate_sidecar::config::Config;
use kvgate_sidecar::discovery::DiscoveryKind;
use serde_json::Value;

mod common;

use common::{documents, find, load_config, manifests as all, port, removed, repo, walk, SYNC_KEY_DIR};

#[test]
fn every_document_is_a_named_resource_and_kustomize_references_exist() {
    let docs = all();
    assert!(docs.len() >= 20, "found {} documents", docs.len());
    for (path, d) in &docs {
        let kind = d["kind"].as_str().unwrap_or_else(|| panic!("{}: no kind", path.display()));
        assert!(d["apiVersion"].is_string(), "{}: {kind} without apiVersion", path.display());
        if path.file_name().unwrap() == "kustomization.yaml" {
            let dir = path.parent().unwrap();
            let mut refs: Vec<String> = Vec::new();
            for key in ["resources", "components"] {
                refs.extend(d[key].as_array().into_iter().flatten().filter_map(|r| r.as_str().map(str::to_owned)));
            }
            for p in d["patches"].as_array().into_iter().flatten() {
                refs.extend(p["path"].as_str().map(str::to_owned));
            }
            for g in d["configMapGenerator"].as_array().into_iter().flatten() {
                refs.extend(g["files"].as_array().into_iter().flatten().filter_map(|f| f.as_str().map(str::to_owned)));
            }
            for r in refs {
                assert!(dir.join(&r).exists(), "{}: {r} does not exist", path.display());
            }
        } else {
            assert!(d["metadata"]["name"].is_string(), "{}: {kind} without a name", path.display());
        }
    }
}

#[test]
fn kvgate_configs_and_filter_configs_validate_and_agree_with_the_engines() {
    let docs = all();
    let k8s = repo().join("envoy/k8s");
    let mut configs = vec![
        std::fs::read_to_string(k8s.join("base/kvgate.toml")).unwrap(),
        std::fs::read_to_string(k8s.join("overlays/envoy-discovery/kvgate.toml")).unwrap(),
    ];
    configs.push(find(&docs, "ConfigMap", "kvgate-config")["data"]["kvgate.toml"].as_str().unwrap().to_owned());
    // The disaggregated example's, whose discovery names the headless Service of each role.
    let pd = find(&docs, "ConfigMap", "kvgate-config-pd")["data"]["kvgate.toml"].as_str().unwrap().to_owned();
    let pd_config = load_config(&pd);
    let discovery = &pd_config.pools[0].discovery;
    for (service, name) in
        [("vllm-decode-headless", Some(&discovery.name)), ("vllm-prefill-headless", discovery.prefill_name.as_ref())]
    {
        assert!(name.is_some_and(|n| n.starts_with(&format!("{service}.llm."))), "{service} is discovered");
        find(&docs, "Service", service);
    }
    let configs: Vec<Config> = configs.iter().map(|t| load_config(t)).collect();

    // The engines, as examples/vllm.yaml runs them.
    let vllm = find(&docs, "Deployment", "vllm-engines");
    let args: Vec<&str> = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let arg = |name: &str| args.iter().find_map(|a| a.strip_prefix(&format!("--{name}="))).unwrap();
    let events: Value = serde_json::from_str(arg("kv-events-config")).unwrap();
    assert!(args.contains(&"--enable-prefix-caching"));
    let events_port = events["endpoint"].as_str().unwrap().rsplit(':').next().unwrap().to_owned();
    let replay_port = events["replay_endpoint"].as_str().unwrap().rsplit(':').next().unwrap().to_owned();
    let headless = find(&docs, "Service", "vllm-engines-headless");
    assert_eq!(headless["spec"]["clusterIP"], "None", "dns discovery needs one record per pod");
    let svc = find(&docs, "Service", "vllm-engines");
    let svc_host = format!("vllm-engines.{}.svc.cluster.local", svc["metadata"]["namespace"].as_str().unwrap());
    let svc_port = svc["spec"]["ports"][0]["port"].as_u64().unwrap();

    for c in &configs {
        assert!(c.listen.ip().is_loopback(), "the filter's API stays on loopback");
        let (pool, d) = (&c.pools[0].pool, &c.pools[0].discovery);
        assert_eq!(pool.model, arg("served-model-name"));
        assert_eq!(pool.block_size.to_string(), arg("block-size"));
        assert!(d.kv_events.ends_with(&format!(":{events_port}")), "events port {}", d.kv_events);
        assert!(d.kv_replay.as_deref().unwrap().ends_with(&format!(":{replay_port}")));
        match d.kind {
            DiscoveryKind::Dns => {
                assert_eq!(
                    d.name,
                    format!(
                        "vllm-engines-headless.{}.svc.cluster.local",
                        headless["metadata"]["namespace"].as_str().unwrap()
                    )
                );
                assert_eq!(u64::from(d.port), svc_port);
            }
            DiscoveryKind::Envoy => {
                assert_eq!(d.name, format!("outbound|{svc_port}||{svc_host}"), "Istio's cluster name")
            }
            DiscoveryKind::Static => panic!("the manifests discover engines"),
        }
    }
    let base = &configs[0];

    // Every filter config parses with the filter's own validator and names the sidecar cluster.
    let mut filter_configs = Vec::new();
    let mut values = Vec::new();
    for (_, d) in &docs {
        walk(d, &mut values);
    }
    for v in &values {
        if v["@type"] == "type.googleapis.com/google.protobuf.StringValue"
            && v["value"].as_str().is_some_and(|s| s.contains("sidecar_cluster"))
        {
            filter_configs.push(v["value"].as_str().unwrap().to_owned());
        }
    }
    filter_configs.push(find(&docs, "WasmPlugin", "kvgate")["spec"]["pluginConfig"].to_string());
    filter_configs.push(find(&docs, "EnvoyExtensionPolicy", "kvgate")["spec"]["wasm"][0]["config"].to_string());
    assert_eq!(filter_configs.len(), 3);
    for text in &filter_configs {
        let fc = FilterConfig::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(fc.sidecar_cluster, "kvgate-sidecar");
    }

    // The sidecar cluster points at the sidecar's listen address, in both gateways.
    let sidecar_clusters: Vec<&&Value> =
        values.iter().filter(|v| v["name"] == "kvgate-sidecar" && v["type"] == "STATIC").collect();
    assert_eq!(sidecar_clusters.len(), 2);
    for c in sidecar_clusters {
        let addr = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"];
        assert_eq!(addr["address"], "127.0.0.1");
        assert_eq!(addr["port_value"].as_u64(), Some(port(&base.listen)));
    }

    // override_host reads the header the filter sets, on the engines' cluster.
    let overrides: Vec<&&Value> = values.iter().filter(|v| v["override_host_sources"].is_array()).collect();
    assert_eq!(overrides.len(), 2);
    for o in overrides {
        assert_eq!(o["override_host_sources"][0]["header"], kvgate_shared::wire::DESTINATION_HEADER);
    }
    let cluster_patch = &find(&docs, "EnvoyFilter", "kvgate-cluster")["spec"]["configPatches"][0]["match"]["cluster"];
    assert_eq!(
        (cluster_patch["service"].as_str().unwrap(), cluster_patch["portNumber"].as_u64().unwrap()),
        (svc_host.as_str(), svc_port)
    );
    let vs = &find(&docs, "VirtualService", "llm")["spec"]["http"][0]["route"][0]["destination"];
    assert_eq!((vs["host"].as_str().unwrap(), vs["port"]["number"].as_u64().unwrap()), (svc_host.as_str(), svc_port));

    // The sidecar container: config mount, probes and metrics on metrics_listen. No readiness
    // probe (the gateway pod stays Ready whatever the sidecar's state); liveness on /livez,
    // which a degraded sidecar still answers.
    let patch = documents(&k8s.join("components"));
    let spec = &patch[0].1["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let metrics_port = port(&base.metrics_listen.unwrap());
    let eg_sidecar = &find(&docs, "EnvoyProxy", "kvgate")["spec"]["provider"]["kubernetes"]["envoyDeployment"]["patch"]
        ["value"]["spec"]["template"]["spec"]["containers"][0];
    for c in [container, eg_sidecar] {
        assert!(
            c["readinessProbe"].is_null(),
            "{}: a readiness probe ties the gateway's readiness to the sidecar",
            c["name"]
        );
        assert_eq!(c["livenessProbe"]["httpGet"]["port"].as_u64(), Some(metrics_port));
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
    }
    assert_eq!(container["ports"][0]["containerPort"].as_u64(), Some(metrics_port));
    assert_eq!(
        container["args"][1],
        format!("{}/kvgate.toml", container["volumeMounts"][0]["mountPath"].as_str().unwrap())
    );
    assert_eq!(spec["volumes"][0]["configMap"]["name"], "kvgate-config");
    let sync = base.sync.as_ref().expect("the base shares bookings between gateway pods");
    let sync_port: u64 = sync.listen.rsplit(':').next().unwrap().parse().unwrap();
    let sync_svc = find(&docs, "Service", "kvgate-sync");
    assert_eq!(sync.peers_dns.as_deref(), Some("kvgate-sync.istio-system.svc.cluster.local"));
    assert_eq!(sync_svc["spec"]["clusterIP"], "None");
    assert_eq!(sync_svc["spec"]["ports"][0]["port"].as_u64(), Some(sync_port));
    assert!(container["ports"].as_array().unwrap().iter().any(|p| p["containerPort"].as_u64() == Some(sync_port)));
    // A starting sidecar asks its peers for their view on the sync port + 1.
    assert_eq!(sync_svc["spec"]["ports"][1]["port"].as_u64(), Some(sync_port + 1));
    assert!(container["ports"].as_array().unwrap().iter().any(|p| p["containerPort"].as_u64() == Some(sync_port + 1)));
    // The mesh binds the pod's own IP and is sealed with the Secret's key.
    assert_eq!(sync.listen, "tcp://10.0.0.7:9913", "KVGATE_SYNC_LISTEN wins over the file's loopback");
    let env = container["env"].as_array().unwrap();
    let var = |name: &str| env.iter().find(|e| e["name"] == name).unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(var("POD_IP")["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");
    assert_eq!(var("KVGATE_SYNC_LISTEN")["value"], format!("tcp://$(POD_IP):{sync_port}"));
    let mount = container["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == SYNC_KEY_DIR).unwrap();
    let volume = spec["volumes"].as_array().unwrap().iter().find(|v| v["name"] == mount["name"]).unwrap();
    assert_eq!(volume["secret"]["secretName"], "kvgate-sync-key");
    for text in [std::fs::read_to_string(k8s.join("base/kvgate.toml")).unwrap(), pd] {
        assert!(text.contains(&format!("key_file = \"{SYNC_KEY_DIR}/key\"")), "every [sync] is sealed");
    }
    // Only gateway pods reach the sync and handover ports; every other port stays open.
    let policy = &find(&docs, "NetworkPolicy", "kvgate-sync")["spec"];
    assert_eq!(policy["podSelector"]["matchLabels"], sync_svc["spec"]["selector"]);
    let rules = policy["ingress"].as_array().unwrap();
    assert_eq!(rules[0]["from"][0]["podSelector"]["matchLabels"], sync_svc["spec"]["selector"]);
    let ports: Vec<u64> = rules[0]["ports"].as_array().unwrap().iter().map(|p| p["port"].as_u64().unwrap()).collect();
    assert_eq!(ports, [sync_port, sync_port + 1]);
    for rule in &rules[1..] {
        for p in rule["ports"].as_array().unwrap().iter().filter(|p| p["protocol"] == "TCP") {
            let (from, to) =
                (p["port"].as_u64().unwrap(), p["endPort"].as_u64().unwrap_or(p["port"].as_u64().unwrap()));
            assert!(to < sync_port || from > sync_port + 1, "{from}-{to} would open the mesh's ports to all");
        }
    }
    let monitor = find(&docs, "PodMonitor", "kvgate");
    let ports: HashSet<&str> =
        monitor["spec"]["podMetricsEndpoints"].as_array().unwrap().iter().filter_map(|e| e["port"].as_str()).collect();
    assert!(ports.contains(container["ports"][0]["name"].as_str().unwrap()));
    // Tracing selects the same pods.
    let telemetry = find(&docs, "Telemetry", "kvgate");
    assert_eq!(telemetry["spec"]["selector"], monitor["spec"]["selector"]);
    assert_eq!(telemetry["spec"]["tracing"][0]["providers"][0]["name"], "otel");
}

/// The Envoy Gateway manifest traces as the chart does: Envoy's spans and the sidecar's go to
/// the same collector (OTLP/gRPC for Envoy, OTLP/HTTP for the sidecar), sampled alike, and the
/// sidecar follows the parent's sampling so that a trace is whole or absent.
#[test]
fn envoy_gateway_traces_envoy_and_the_sidecar_to_one_collector() {
    let docs = documents(&repo().join("envoy/gateway-api"));
    let proxy = &find(&docs, "EnvoyProxy", "kvgate")["spec"];
    let tracing = &proxy["telemetry"]["tracing"];
    assert_eq!(tracing["provider"]["type"], "OpenTelemetry");
    let backend = &tracing["provider"]["backendRefs"][0];
    let containers = proxy["provider"]["kubernetes"]["envoyDeployment"]["patch"]["value"]["spec"]["template"]["spec"]
        ["containers"]
        .as_array()
        .unwrap();
    let sidecar = containers.iter().find(|c| c["name"] == "kvgate-sidecar").unwrap();
    let env = |name: &str| {
        sidecar["env"].as_array().unwrap().iter().find(|e| e["name"] == name).map(|e| e["value"].as_str().unwrap())
    };
    let endpoint = env("OTEL_EXPORTER_OTLP_ENDPOINT").unwrap();
    let collector =
        format!("http://{}.{}.svc:", backend["name"].as_str().unwrap(), backend["namespace"].as_str().unwrap());
    assert!(endpoint.starts_with(&collector), "{endpoint} is not the collector Envoy sends to ({collector}…)");
    assert_ne!(endpoint.rsplit(':').next().unwrap(), backend["port"].to_string(), "the sidecar speaks OTLP/HTTP");
    assert_eq!(env("OTEL_TRACES_SAMPLER"), Some("parentbased_traceidratio"));
    let ratio: f64 = env("OTEL_TRACES_SAMPLER_ARG").unwrap().parse().unwrap();
    assert!((ratio * 100.0 - tracing["samplingRate"].as_f64().unwrap()).abs() < 1e-9, "sampled alike");
}

#[test]
fn the_dashboard_queries_only_exported_metrics() {
    let known = common::exported_metrics();
    assert!(known.contains("kvgate_decisions_total") && known.contains("kvgate_requests_total"));
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("envoy/k8s/monitoring/grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 10);
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            let names =
                expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("kvgate_"));
            for name in names {
                assert!(known.contains(name), "panel {:?} queries {name}, which kvgate does not export", p["title"]);
            }
        }
    }
}

#[test]
fn every_deploy_path_removes_routing_headers_on_arrival_and_buffers_bodies_as_the_template_does() {
    let (want, limit) = common::template_arrival();

    // Istio: an EnvoyFilter of its own (the WasmPlugin overlay deletes the filter's).
    let docs = all();
    let istio = &find(&docs, "EnvoyFilter", "kvgate-gateway")["spec"]["configPatches"];
    let patch = |to: &str| istio.as_array().unwrap().iter().find(|p| p["applyTo"] == to).unwrap()["patch"].clone();
    let hcm = patch("NETWORK_FILTER");
    assert_eq!(hcm["operation"], "MERGE");
    assert_eq!(removed(&hcm["value"]["typed_config"]["early_header_mutation_extensions"][0]["typed_config"]), want);
    assert_eq!(patch("VIRTUAL_HOST")["value"]["request_body_buffer_limit"].as_u64(), Some(limit));
    let overlay = std::fs::read_to_string(repo().join("envoy/k8s/overlays/wasmplugin/kustomization.yaml")).unwrap();
    assert!(!overlay.contains("kvgate-gateway"), "no overlay deletes it");

    // Envoy Gateway: a ClientTrafficPolicy on the Gateway.
    let ctp = &find(&docs, "ClientTrafficPolicy", "kvgate")["spec"];
    let eg_removed: HashSet<String> = ctp["headers"]["earlyRequestHeaders"]["remove"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(eg_removed, want);
    let quantity = ctp["connection"]["bufferLimit"].as_str().unwrap();
    let mib: u64 = quantity.strip_suffix("Mi").unwrap().parse().unwrap();
    assert_eq!(mib << 20, limit, "{quantity}");
    assert_eq!(ctp["targetRefs"][0]["name"], find(&docs, "Gateway", "eg")["metadata"]["name"]);
}

#[test]
fn every_deploy_path_turns_the_filters_tags_into_labels_as_the_template_does() {
    // The template: one Istio-form regex per tag the filter's metrics carry.
    let stats = common::template()["stats_config"].clone();
    let tags: Vec<(String, String)> = stats["stats_tags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["tag_name"].as_str().unwrap().to_owned(), t["regex"].as_str().unwrap().to_owned()))
        .collect();
    let names: Vec<&str> = tags.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["model", "outcome", "vm"]);
    for (name, regex) in &tags {
        assert_eq!(regex, &format!("({name}=\\.=(.*?);\\.;)"), "Istio's form, which its extraStatTags generate");
    }
    let filter_src = std::fs::read_to_string(repo().join("filter/src/metrics.rs")).unwrap();
    for name in &names {
        assert!(filter_src.contains(&format!("(\"{name}\", ")), "the filter tags a metric with {name}");
    }

    // Envoy Gateway: the EnvoyProxy's bootstrap merges the same stats_config, in both paths.
    let chart = std::fs::read_to_string(repo().join("charts/kvgate/templates/envoy-gateway/envoyproxy.yaml")).unwrap();
    let docs = all();
    let eg = find(&docs, "EnvoyProxy", "kvgate")["spec"]["bootstrap"].clone();
    assert_eq!(eg["type"], "Merge");
    let merged: Value = serde_norway::from_str(eg["value"].as_str().unwrap()).unwrap();
    assert_eq!(merged["stats_config"], stats, "the Envoy Gateway bootstrap's stats_config is the template's");
    let value = eg["value"].as_str().unwrap();
    let indented: String = value.lines().map(|l| format!("      {l}\n")).collect();
    assert!(chart.contains(&indented), "the chart's EnvoyProxy carries the same bootstrap");

    // Istio: the gateway pod's proxy config asks for the same tags.
    for path in
        ["envoy/k8s/components/gateway-sidecar/gateway-sidecar.yaml", "charts/kvgate/templates/istio/deployment.yaml"]
    {
        let text = std::fs::read_to_string(repo().join(path)).unwrap();
        assert!(text.contains(r#"extraStatTags: ["model", "outcome", "vm"]"#), "{path} asks Istio for the tags");
    }
}

#[test]
fn the_autoscaling_example_scales_the_engines_on_signals_the_sidecar_exports() {
    let docs = all();
    let scaled = find(&docs, "ScaledObject", "vllm-engines");
    let engines = find(&docs, "Deployment", "vllm-engines");
    assert_eq!(scaled["spec"]["scaleTargetRef"]["name"], engines["metadata"]["name"]);
    assert_eq!(scaled["metadata"]["namespace"], engines["metadata"]["namespace"]);
    let exported = common::exported_metrics();
    let config = load_config(&std::fs::read_to_string(repo().join("envoy/k8s/base/kvgate.toml")).unwrap());
    let model = format!("model=\"{}\"", config.pools[0].pool.model);
    let triggers = scaled["spec"]["triggers"].as_array().unwrap();
    assert!(triggers.len() >= 2);
    for t in triggers {
        assert_eq!(t["type"], "prometheus");
        let query = t["metadata"]["query"].as_str().unwrap();
        assert!(query.contains(&model), "{query} asks about the pool's model");
        let metric = query.split(['(', '{']).nth(1).unwrap();
        assert!(exported.contains(metric), "{query}: kvgate exports no {metric}");
        assert!(t["metadata"]["threshold"].as_str().unwrap().parse::<f64>().unwrap() > 0.0);
    }
}
