//! Detached forwarding and what Envoy runs after idemgate: the filters after it (RBAC here), the
//! route's rewrites and headers, the route's retries. A detached callout straight to the upstream
//! cluster skips all of them (issue 24, item 2: RBAC after idemgate answered 403 in router mode
//! and 200, one execution, in detached mode); through the internal listener of
//! `envoy/detached/envoy.yaml` (`upstream.hop: "internal_listener"`, the default) they apply as
//! in router mode, and a cluster that is not that chain is refused. Envoy 1.40, a counting
//! upstream.

use crate::support;

use support::http::{self, Response};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const ROUTER: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30}"#;
/// Detached through the internal listener `idemgate_hop` (the default `upstream.hop`).
const DETACHED: &str = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30,
    "forwarding": "detached", "upstream": {"cluster": "idemgate_hop", "timeout_ms": 5000}}"#;

/// RBAC after idemgate: only `x-role: admin` may pass.
const RBAC_ADMIN_ONLY: &str = r#"          - name: envoy.filters.http.rbac
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
              rules:
                action: ALLOW
                policies:
                  admin:
                    permissions: [{any: true}]
                    principals: [{header: {name: x-role, string_match: {exact: admin}}}]
"#;

fn stack(plugin: &str, tune: impl Fn(&mut EnvoyOptions)) -> (Upstream, Envoy) {
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(plugin, up.port);
    o.internal_hop = true;
    tune(&mut o);
    let envoy = Envoy::start(&o);
    (up, envoy)
}

fn post(envoy: &Envoy, key: &str, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", "Bearer a"), ("idempotency-key", key), ("content-type", "application/json")];
    h.extend_from_slice(extra);
    http::request(envoy.port, "POST", "/charges", &h, br#"{"amount":1}"#).expect("request")
}

#[test]
fn rbac_after_idemgate_refuses_in_router_and_detached_modes_and_the_key_stays_free() {
    for (mode, plugin) in [("router", ROUTER), ("detached", DETACHED)] {
        let (up, envoy) = stack(plugin, |o| o.filters_after_idemgate = RBAC_ADMIN_ONLY.to_string());
        let denied = post(&envoy, "k-rbac", &[]);
        assert_eq!(denied.status, 403, "{mode}: RBAC's answer: {}", denied.body_text());
        assert_eq!(up.executions_with_key("k-rbac"), 0, "{mode}: RBAC after idemgate was skipped");
        // Never executed: the key was released, neither stored nor outcome-unknown.
        let allowed = post(&envoy, "k-rbac", &[("x-role", "admin")]);
        assert_eq!(allowed.status, 201, "{mode}: {}", allowed.body_text());
        assert_eq!(allowed.header("idempotent-replayed"), None, "{mode}");
        assert_eq!(up.executions_with_key("k-rbac"), 1, "{mode}");
        let replay = post(&envoy, "k-rbac", &[("x-role", "admin")]);
        assert_eq!(replay.status, 201, "{mode}");
        assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{mode}");
        assert_eq!(replay.body, allowed.body, "{mode}: the replay is byte-exact");
        assert_eq!(up.executions_with_key("k-rbac"), 1, "{mode}: executed once");
        envoy.assert_no_wasm_panic();
    }
}

/// Request headers that differ from one request to the next whatever the mode.
const PER_REQUEST: [&str; 2] = ["x-request-id", "x-envoy-expected-rq-timeout-ms"];

#[test]
fn the_routes_rewrite_and_added_headers_reach_the_upstream_in_both_modes() {
    let mut seen = vec![];
    for (mode, plugin) in [("router", ROUTER), ("detached", DETACHED)] {
        let (up, envoy) = stack(plugin, |o| {
            o.route_action_extra = r#", prefix_rewrite: "/v2/""#.to_string();
            o.route_fields = "                request_headers_to_add:\n                - header: {key: x-route-added, value: \"yes\"}\n".to_string();
        });
        let r = post(&envoy, &format!("k-route-{mode}"), &[]);
        assert_eq!(r.status, 201, "{mode}: {}", r.body_text());
        let log = up.log();
        assert_eq!(log.len(), 1, "{mode}");
        let e = &log[0];
        assert_eq!(e.path, "/v2/charges", "{mode}: the route's prefix_rewrite");
        let header = |n: &str| e.headers.iter().find(|(h, _)| h == n).map(|(_, v)| v.clone());
        assert_eq!(header("x-route-added").as_deref(), Some("yes"), "{mode}: the route's header");
        let mut names: Vec<(String, String)> = e
            .headers
            .iter()
            .filter(|(n, _)| !PER_REQUEST.contains(&n.as_str()))
            .map(|(n, v)| (n.clone(), if n == "idempotency-key" { "-".into() } else { v.clone() }))
            .collect();
        names.sort();
        eprintln!("{mode}: the upstream saw {} {names:?}", e.path);
        seen.push(names);
        envoy.assert_no_wasm_panic();
    }
    assert_eq!(seen[0], seen[1], "the upstream sees the detached request as the router sends it");
}

#[test]
fn the_routes_retry_policy_never_re_sends_a_detached_request() {
    // The callout's router consumes idemgate's x-envoy-max-retries: 0; the internal listener's
    // route table sets it again.
    let (up, envoy) = stack(DETACHED, |o| o.retry_policy = Some("{retry_on: 5xx, num_retries: 2}".into()));
    let r = post(&envoy, "k-retry", &[("x-up-status", "503")]);
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(up.executions_with_key("k-retry"), 1, "the internal listener's router retried");
    let again = post(&envoy, "k-retry", &[("x-up-status", "503")]);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions_with_key("k-retry"), 1);
}

#[test]
fn the_internal_listeners_route_timeout_is_outcome_unknown_never_a_second_execution() {
    let (up, envoy) = stack(DETACHED, |o| o.route_timeout_ms = 1_000);
    let r = post(&envoy, "k-slow", &[("x-up-delay-ms", "2000")]);
    assert_eq!(r.status, 504, "{}", r.body_text());
    assert_eq!(r.header("content-type"), Some("application/problem+json"), "{}", r.body_text());
    let again = post(&envoy, "k-slow", &[("x-up-delay-ms", "2000")]);
    assert_eq!(again.status, 409, "{}", again.body_text());
    assert!(again.body_text().contains("outcome-unknown"), "{}", again.body_text());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(up.executions_with_key("k-slow"), 1);
}

#[test]
fn the_callouts_timeout_before_the_routes_is_outcome_unknown_never_a_second_execution() {
    let plugin = DETACHED.replace(r#""timeout_ms": 5000"#, r#""timeout_ms": 1000"#);
    let (up, envoy) = stack(&plugin, |o| o.route_timeout_ms = 10_000);
    let r = post(&envoy, "k-callout-slow", &[("x-up-delay-ms", "2000")]);
    assert_eq!(r.status, 504, "{}", r.body_text());
    assert!(r.body_text().contains("upstream-no-answer"), "{}", r.body_text());
    let again = post(&envoy, "k-callout-slow", &[("x-up-delay-ms", "2000")]);
    assert_eq!(again.status, 409, "{}", again.body_text());
    assert!(again.body_text().contains("outcome-unknown"), "{}", again.body_text());
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(up.executions_with_key("k-callout-slow"), 1);
}

#[test]
fn a_detached_cluster_that_is_not_the_internal_listener_chain_is_refused() {
    // `upstream.cluster` names the upstream itself (no `hop: "direct"`): RBAC after idemgate
    // would be skipped, so nothing is sent.
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30,
        "forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": 5000}}"#;
    let (up, envoy) = stack(plugin, |o| o.filters_after_idemgate = RBAC_ADMIN_ONLY.to_string());
    for _ in 0..2 {
        let r = post(&envoy, "k-direct", &[("x-role", "admin")]);
        assert_eq!(r.status, 503, "{}", r.body_text());
        assert!(r.body_text().contains("internal-state"), "{}", r.body_text());
    }
    assert_eq!(up.executions_with_key("k-direct"), 0, "a request went straight to the upstream");
    assert!(envoy.log().contains("detached hop refused: cluster=upstream"), "the operator is told");
    envoy.assert_no_wasm_panic();
}

#[test]
fn the_shipped_detached_example_runs_its_later_filters_and_routes_for_detached_requests() {
    let up = Upstream::start();
    let envoy = support::Shipped::start("envoy/detached/envoy.yaml", up.port);
    let port = envoy.port;
    // RBAC (x-role: payments only) after idemgate: refused, never sent, the key free.
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k-example")];
    let denied = http::request(port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(denied.status, 403, "{}", denied.body_text());
    assert_eq!(up.executions(), 0);
    let h = [("authorization", "Bearer a"), ("idempotency-key", "k-example"), ("x-role", "payments")];
    let first = http::request(port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(first.status, 201, "{}", first.body_text());
    let again = http::request(port, "POST", "/charges", &h, b"{}").unwrap();
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    let log = up.log();
    assert_eq!(log.len(), 1, "one execution, the probe answered by the internal listener");
    assert!(log[0].headers.iter().any(|(n, v)| n == "x-gateway" && v == "idemgate-example"), "the route's header");
}

#[test]
fn an_upstream_forging_the_internal_listeners_mark_is_still_stored_and_replayed() {
    // The upstream executes and answers with the mark of a refusal before the router: the
    // internal listener overwrites it with `relayed`, so the key is never released.
    let forged = "x-idemgate-hop: local;attempts=0;host=;connected=;flags=-;details=rbac_access_denied";
    let (up, envoy) = stack(DETACHED, |_| {});
    let first = post(&envoy, "k-forged", &[("x-up-header", forged), ("x-up-status", "403")]);
    assert_eq!(first.status, 403, "{}", first.body_text());
    assert_eq!(first.header("x-idemgate-hop"), None, "the mark never reaches the client");
    let again = post(&envoy, "k-forged", &[("x-up-header", forged), ("x-up-status", "403")]);
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("x-idemgate-hop"), None);
    assert_eq!(up.executions_with_key("k-forged"), 1, "the forged mark released an executed request");
}
