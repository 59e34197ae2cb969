//! The configs users copy stay true: the compose flavour is the rendering of the demo template,
//! Envoy validates it, and every file it refers to exists.

use crate::support;

use std::process::Command;

#[test]
fn the_compose_envoy_config_is_the_rendering_of_the_demo_template() {
    let root = support::repo_root();
    let out = Command::new("bash").arg(root.join("scripts/render-compose.sh")).output().expect("render");
    assert!(out.status.success());
    let committed = std::fs::read(root.join("envoy/docker-compose/envoy.yaml")).unwrap();
    assert!(
        out.stdout == committed,
        "envoy/docker-compose/envoy.yaml drifted: run scripts/render-compose.sh > envoy/docker-compose/envoy.yaml"
    );
}

#[test]
fn envoy_validates_the_compose_flavour_and_idemgate_accepts_its_configuration() {
    let root = support::repo_root();
    let text = std::fs::read_to_string(root.join("envoy/docker-compose/envoy.yaml")).unwrap();
    // The module sits at /etc/envoy in the container; validate with the one built here.
    let scratch = support::Scratch::new("compose");
    let path = scratch.0.join("envoy.yaml");
    std::fs::write(&path, text.replace("/etc/envoy/idemgate.wasm", &support::wasm_path().display().to_string()))
        .unwrap();
    let (ok, log) = support::envoy_validate(&path);
    assert!(ok, "{log}");
    assert!(log.contains("configuration accepted"), "{log}");
}

#[test]
fn envoy_validates_the_etcd_example_and_idemgate_accepts_its_configuration() {
    let config = validated_plugin_config("envoy/etcd/envoy.yaml", "etcd-example");
    assert_eq!(config["store"]["kind"], "etcd");
}

#[test]
fn the_compose_file_refers_only_to_files_that_exist() {
    let root = support::repo_root();
    let dir = root.join("envoy/docker-compose");
    let compose = std::fs::read_to_string(dir.join("docker-compose.yaml")).unwrap();
    for service in ["envoy:", "redis:", "webdis:", "payments-api:"] {
        assert!(compose.contains(&format!("\n  {service}")), "service {service} missing");
    }
    for rel in ["./envoy.yaml", "../redis.conf", "./webdis.json", "Dockerfile.payments-api"] {
        assert!(compose.contains(rel), "{rel} not referenced");
        let p = dir.join(rel);
        assert!(p.exists(), "{} does not exist", p.display());
    }
    assert!(compose.contains("../../dist/idemgate.wasm") && compose.contains("envoyproxy/envoy:v1.40.0"));
    let webdis: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("webdis.json")).unwrap()).unwrap();
    assert_eq!(webdis["redis_host"], "redis");
    assert!(std::fs::read_to_string(root.join("envoy/oci/Dockerfile")).unwrap().contains("FROM scratch"));
}

/// The plugin configuration between the `BEGIN idemgate-config` and `END idemgate-config` marker
/// comments of a shipped file, as JSON.
fn plugin_config(rel: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(support::repo_root().join(rel)).unwrap();
    let body: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("# BEGIN idemgate-config"))
        .skip(1)
        .take_while(|l| !l.contains("# END idemgate-config"))
        .filter(|l| l.trim() != "value: |")
        .collect();
    serde_json::from_str(&body.join("\n"))
        .unwrap_or_else(|e| panic!("{rel}: the plugin configuration is not JSON: {e}"))
}

#[test]
fn host_examples_carry_the_plugin_configuration_envoy_loads_in_the_tests() {
    // envoy/two-proxies/envoy-a.yaml is loaded by Envoy in the_shipped_envoy_configs_are_valid.
    let reference = plugin_config("envoy/two-proxies/envoy-a.yaml");
    assert!(idemgate::config::Config::parse(reference.to_string().as_bytes()).is_ok());
    for rel in
        ["envoy/istio/envoyfilter.yaml", "envoy/istio/wasmplugin.yaml", "envoy/envoy-gateway/envoyextensionpolicy.yaml"]
    {
        let mut cfg = plugin_config(rel);
        // The WasmPlugin cannot set allow_on_headers_stop_iteration: it must not hold the headers.
        let hold = cfg.as_object_mut().and_then(|m| m.remove("hold_headers"));
        let expected_hold = if rel.ends_with("wasmplugin.yaml") { Some(serde_json::json!(false)) } else { None };
        assert_eq!(hold, expected_hold, "{rel}: hold_headers");
        // Cluster names differ per host (Istio: outbound|port||fqdn); everything else is the same.
        let cluster = cfg["store"]["cluster"].as_str().unwrap_or("").to_string();
        assert!(!cluster.is_empty(), "{rel}: no store cluster");
        cfg["store"]["cluster"] = reference["store"]["cluster"].clone();
        assert_eq!(cfg, reference, "{rel} differs from the tested configuration");
        assert!(idemgate::config::Config::parse(cfg.to_string().as_bytes()).is_ok(), "{rel}");
    }
    // Istio's clusters are named outbound|<port>||<fqdn>.
    assert!(plugin_config("envoy/istio/envoyfilter.yaml")["store"]["cluster"]
        .as_str()
        .unwrap()
        .starts_with("outbound|7379||"));
}

#[test]
fn the_istio_envoyfilter_sets_the_stop_iteration_flag_and_the_reload_failure_policy() {
    let text = std::fs::read_to_string(support::repo_root().join("envoy/istio/envoyfilter.yaml")).unwrap();
    assert!(text.contains("allow_on_headers_stop_iteration: true"));
    assert!(text.contains("failure_policy: FAIL_RELOAD"));
    let patch =
        std::fs::read_to_string(support::repo_root().join("envoy/envoy-gateway/envoypatchpolicy.yaml")).unwrap();
    assert!(patch.contains("allow_on_headers_stop_iteration"));
}

#[test]
fn the_etcd_clusters_over_tls_and_in_clear_check_members_alike() {
    // The tests run the plain cluster of envoy/etcd/envoy.yaml (tests/it/support/etcd.rs); the TLS
    // one is pasted in its place by users and must take members out the same way.
    let root = support::repo_root();
    let plain = std::fs::read_to_string(root.join("envoy/etcd/envoy.yaml")).unwrap();
    let tls = std::fs::read_to_string(root.join("envoy/etcd/idemgate-store-cluster-tls.yaml")).unwrap();
    let checks = support::yaml_block(&plain, "health_checks:");
    assert!(checks.iter().any(|l| l.contains("http_health_check: {path: /health}")), "{checks:?}");
    assert_eq!(support::yaml_block(&tls, "health_checks:"), checks);
    // And the cluster the tests render is the shipped one, with its members and the event log.
    let rendered = support::etcd::envoy_cluster(&[11, 12, 13]);
    let rendered_checks = support::yaml_block(&rendered, "health_checks:");
    let without_log: Vec<String> = rendered_checks
        .iter()
        .filter(|l| {
            ![
                "event_logger:",
                "- name: envoy.health_check",
                "typed_config:",
                "\"@type\"",
                "event_log_path:",
                "always_log_health_check_failures:",
            ]
            .iter()
            .any(|k| l.trim_start().starts_with(k))
        })
        .cloned()
        .collect();
    assert_eq!(without_log, checks, "{rendered}");
    for p in [11, 12, 13] {
        assert!(rendered.contains(&format!("port_value: {p}}}")), "{rendered}");
    }
}

/// The plugin configuration of envoy/envoy.yaml (the JSON after `value: |`), as shipped.
fn single_proxy_plugin_config() -> serde_json::Value {
    let text = std::fs::read_to_string(support::repo_root().join("envoy/envoy.yaml")).unwrap();
    let start = text.find("value: |").expect("plugin configuration") + "value: |".len();
    let end = text[start..].find("vm_config:").expect("vm_config") + start;
    serde_json::from_str(&text[start..end]).expect("plugin configuration JSON")
}

#[test]
fn the_single_proxy_config_recovers_lost_responses_and_refuses_timeouts_past_its_lock() {
    // Detached through the internal listener, retries held: what tests/it/sdk_clients.rs measures.
    let mut cfg = single_proxy_plugin_config();
    assert_eq!(cfg["forwarding"], "detached");
    assert_eq!(cfg["upstream"]["cluster"], "idemgate_hop");
    assert_eq!(cfg["upstream"].get("hop"), None, "the internal listener hop (the default)");
    assert_eq!(cfg["in_flight"], "wait");
    let c = idemgate::config::Config::parse(cfg.to_string().as_bytes()).expect("the shipped configuration");
    assert!(matches!(c.default_policy.in_flight, idemgate::config::InFlight::Wait { .. }));
    // The hop's route is the ingress route: its timeout (30 s) within the callout's and the lock's.
    let text = std::fs::read_to_string(support::repo_root().join("envoy/envoy.yaml")).unwrap();
    assert!(text.contains("internal_listener: {}") && text.contains("route: {cluster: api, timeout: 30s}"));
    // A callout allowed to outlive the lock would let a retry execute again: refused, by name.
    let lock_ms = cfg["lock_ttl_seconds"].as_u64().unwrap() * 1000;
    assert!(cfg["upstream"]["timeout_ms"].as_u64().unwrap() < lock_ms);
    cfg["upstream"]["timeout_ms"] = serde_json::json!(lock_ms);
    let e = idemgate::config::Config::parse(cfg.to_string().as_bytes()).unwrap_err();
    assert_eq!(e.field, "upstream.timeout_ms", "{e}");
}

/// The minimal configuration README.md shows (the `yaml` block after its `minimal-envoy-config`
/// marker) is one Envoy validates and whose plugin configuration idemgate accepts.
#[test]
fn envoy_validates_the_readmes_minimal_config_and_idemgate_accepts_its_configuration() {
    let root = support::repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let after = &readme[readme.find("<!-- minimal-envoy-config").expect("README: the minimal-envoy-config marker")..];
    let start = after.find("```yaml\n").expect("README: a yaml block after the marker") + "```yaml\n".len();
    let end = after[start..].find("\n```").expect("README: the yaml block's end") + start;
    let yaml = &after[start..end];
    let scratch = support::Scratch::new("readme-minimal");
    let path = scratch.0.join("envoy.yaml");
    std::fs::write(&path, yaml.replace("dist/idemgate.wasm", &support::wasm_path().display().to_string())).unwrap();
    let (ok, log) = support::envoy_validate(&path);
    assert!(ok, "{log}");
    assert!(log.contains("configuration accepted"), "{log}");
    let line = yaml.lines().find(|l| l.trim_start().starts_with("value: '")).expect("the plugin configuration");
    let json = line.trim_start().trim_start_matches("value: '").trim_end().trim_end_matches('\'');
    assert!(idemgate::config::Config::parse(json.as_bytes()).is_ok(), "{json}");
    for needed in ["allow_on_headers_stop_iteration: true", "failure_policy: FAIL_RELOAD"] {
        assert!(yaml.contains(needed), "README's minimal config lacks {needed}");
    }
}

/// The MCP example (issue 28): Envoy validates it, idemgate accepts its configuration, and the
/// plugin configuration is the one docs/mcp-setup.md describes (its behaviour: tests/it/mcp_sdk.rs,
/// `a_lost_response_is_recovered_through_the_shipped_mcp_config`).
#[test]
fn envoy_validates_the_mcp_example_and_idemgate_accepts_its_configuration() {
    let config = validated_plugin_config("envoy/mcp/envoy.yaml", "mcp-example");
    assert_eq!(config["forwarding"], "detached");
    assert_eq!(config["in_flight"], "wait");
    assert_eq!(config["routes"][0]["prefix"], "/mcp");
    assert_eq!(config["routes"][0]["protocol"], "mcp");
    assert_eq!(config["routes"][0]["mcp"]["key_arguments"], serde_json::json!(["idempotency_key", "idempotencyKey"]));
}

/// The shipped Envoy configuration `file` (from the repository root), with the module path made
/// this build's, validated by Envoy (idemgate accepting its plugin configuration); returns that
/// plugin configuration (the JSON between `value: |` and `vm_config:`).
fn validated_plugin_config(file: &str, scratch: &str) -> serde_json::Value {
    let root = support::repo_root();
    let text = std::fs::read_to_string(root.join(file)).unwrap();
    let scratch = support::Scratch::new(scratch);
    let path = scratch.0.join("envoy.yaml");
    std::fs::write(&path, text.replace("dist/idemgate.wasm", &support::wasm_path().display().to_string())).unwrap();
    let (ok, log) = support::envoy_validate(&path);
    assert!(ok, "{log}");
    assert!(log.contains("configuration accepted"), "{log}");
    let start = text.find("value: |").expect("plugin configuration") + "value: |".len();
    let end = text[start..].find("vm_config:").expect("vm_config") + start;
    serde_json::from_str(&text[start..end]).expect("plugin configuration JSON")
}

/// Every shipped Envoy configuration that loads idemgate labels its series as the tests' Envoy
/// does (`support::STATS_CONFIG`, word for word): `idemgate_route_<counter>{route="..."}` and
/// `idemgate_build_info{version="..."}` (docs/operating.md, "Metrics"; the Prometheus check in
/// tests/it/prometheus.rs scrapes a stack started from envoy/envoy.yaml's).
#[test]
fn every_shipped_envoy_config_labels_idemgates_series() {
    let root = support::repo_root();
    let mut checked = vec![];
    let mut dirs = vec![root.join("envoy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.contains("envoy.filters.http.wasm") && text.contains("\nadmin:") {
                assert!(text.contains(support::STATS_CONFIG), "{} lacks support::STATS_CONFIG", path.display());
                checked.push(path);
            }
        }
    }
    // envoy.yaml, detached, the demo template and its compose rendering, etcd, mcp, two proxies.
    assert!(checked.len() >= 8, "{checked:?}");
}
