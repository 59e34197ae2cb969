//! Hops behind idemgate (docs/hops.md): a second, plain Envoy between the edge
//! (idemgate) and the application, as a sidecar or an internal gateway stands there.
//!
//! - Its retries: idemgate's `x-envoy-max-retries: 0` is consumed by the edge's own router and
//!   never reaches it, so a retry policy there re-sends a keyed request (the failing baseline,
//!   3 executions), unless its route for keyed requests sends them once (envoy/next-hop/envoy.yaml).
//! - Its own failure replies: its 503 for an application it cannot reach is, to the edge's
//!   router, an upstream answer: stored and replayed by default; with `next_hop_failures:
//!   "classify"` and the hop's marks, released as the edge's own connect failure is.
//!
//! Every test counts the application's executions.

use crate::support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::http::{self, Response};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions, Scratch};

/// A plain Envoy (no idemgate) started from a YAML text, killed when dropped.
struct PlainEnvoy {
    child: Child,
    port: u16,
    _scratch: Scratch,
}

impl PlainEnvoy {
    /// Starts `yaml` with `{listen}` and `{admin}` replaced by fresh ports, waits until ready.
    /// A port taken before Envoy binds it: started again on fresh ports, a few times at most.
    fn start(yaml: &str) -> PlainEnvoy {
        for _ in 0..5 {
            let scratch = Scratch::new("next-hop");
            let (port, admin) = (support::free_port(), support::free_port());
            let cfg = scratch.0.join("envoy.yaml");
            std::fs::write(&cfg, yaml.replace("{listen}", &port.to_string()).replace("{admin}", &admin.to_string()))
                .expect("write config");
            let log = std::fs::File::create(scratch.0.join("envoy.log")).expect("log");
            let mut child = Command::new(support::envoy_bin())
                .arg("-c")
                .arg(&cfg)
                .args(["--concurrency", "1", "--disable-hot-restart", "--log-level", "warn"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::from(log))
                .spawn()
                .expect("start envoy");
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut exited = false;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    exited = true;
                    break;
                }
                if http::get(admin, "/ready").is_ok_and(|r| r.status == 200) {
                    return PlainEnvoy { child, port, _scratch: scratch };
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let text = std::fs::read_to_string(scratch.0.join("envoy.log")).unwrap_or_default();
            let _ = child.kill();
            let _ = child.wait();
            assert!(exited && text.contains("Address already in use"), "the next hop did not start:\n{text}");
        }
        panic!("the next hop did not start in 5 tries");
    }
}

impl Drop for PlainEnvoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shipped example (envoy/next-hop/envoy.yaml), its application on `app_port`.
fn shipped_next_hop(app_port: u16) -> String {
    let text = std::fs::read_to_string(support::repo_root().join("envoy/next-hop/envoy.yaml")).expect("example");
    for port in ["port_value: 10001", "port_value: 9902", "port_value: 8080"] {
        assert_eq!(text.matches(port).count(), 1, "{port} in envoy/next-hop/envoy.yaml");
    }
    text.replace("port_value: 10001", "port_value: {listen}")
        .replace("port_value: 9902", "port_value: {admin}")
        .replace("port_value: 8080", &format!("port_value: {app_port}"))
}

/// A next hop WITHOUT the example's keyed route: `/istio` has the retry policy of older Istio
/// releases (their pilot's DefaultPolicy: these conditions, 2 retries, 503 retriable), `/5xx`
/// the common `retry_on: 5xx`.
fn retrying_next_hop(app_port: u16) -> String {
    format!(
        r#"admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {{admin}}}}}}}}
static_resources:
  listeners:
  - address: {{socket_address: {{address: 127.0.0.1, port_value: {{listen}}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: hop
          route_config:
            virtual_hosts:
            - name: app
              domains: ["*"]
              routes:
              - match: {{prefix: "/istio"}}
                route:
                  cluster: app
                  retry_policy:
                    retry_on: "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
                    num_retries: 2
                    retriable_status_codes: [503]
              - match: {{prefix: "/5xx"}}
                route: {{cluster: app, retry_policy: {{retry_on: 5xx, num_retries: 2}}}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: app
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: app
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {app_port}}}}}}}}}]}}]
"#
    )
}

/// idemgate on the edge; `/classify` counts a next hop's marked failures as its own.
const EDGE: &str = r#"{"scope": {"headers": ["authorization"]},
    "routes": [{"prefix": "/classify", "next_hop_failures": "classify"}, {"prefix": "/"}]}"#;

/// The edge Envoy (idemgate, then the router) in front of the next hop.
fn edge(hop: &PlainEnvoy) -> Envoy {
    Envoy::start(&EnvoyOptions::new(EDGE, hop.port))
}

fn post(edge: &Envoy, path: &str, key: Option<&str>, extra: &[(&str, &str)]) -> Response {
    let mut h = vec![("authorization", "Bearer alice")];
    h.extend(key.map(|k| ("idempotency-key", k)));
    h.extend_from_slice(extra);
    http::request(edge.port, "POST", path, &h, b"{}").expect("request")
}

const APP_503: (&str, &str) = ("x-up-status", "503");

#[test]
fn a_retrying_next_hop_executes_a_keyed_request_three_times_the_failing_baseline() {
    let app = Upstream::start();
    let hop = PlainEnvoy::start(&retrying_next_hop(app.port));
    // The edge as shipped, then one whose route also adds x-envoy-max-retries: 0 itself.
    let mut with_route_header = EnvoyOptions::new(EDGE, hop.port);
    with_route_header.route_fields = "                request_headers_to_add:\n                - header: {key: x-envoy-max-retries, value: \"0\"}\n                  append_action: OVERWRITE_IF_EXISTS_OR_ADD\n".into();
    for (edge, tag) in [(edge(&hop), "idemgate"), (Envoy::start(&with_route_header), "route")] {
        for (path, key) in [("/istio/charges", format!("k-istio-{tag}")), ("/5xx/charges", format!("k-5xx-{tag}"))] {
            let first = post(&edge, path, Some(&key), &[APP_503]);
            assert_eq!(first.status, 503, "{path}: the application's 503");
            assert_eq!(app.executions_with_key(&key), 3, "{path} ({tag}): the next hop re-sent it twice");
        }
        edge.assert_no_wasm_panic();
    }
    // Why: the edge's router consumes the cap (idemgate's and the route's) and sends nothing
    // on. Seen with the application right behind the edge, where no hop could remove it.
    let direct = support::Stack::with(EDGE, |o| o.route_fields = with_route_header.route_fields.clone());
    assert_eq!(post(&direct.envoy, "/charges", Some("k-direct"), &[]).status, 201);
    for log in [direct.up.log(), app.log()] {
        assert!(
            log.iter().all(|x| x.headers.iter().all(|(n, _)| n != "x-envoy-max-retries")),
            "x-envoy-max-retries went past the edge's router"
        );
    }
}

#[test]
fn the_shipped_next_hop_sends_a_keyed_request_once_and_overwrites_an_apps_forged_mark() {
    let app = Upstream::start();
    let hop = PlainEnvoy::start(&shipped_next_hop(app.port));
    let edge = edge(&hop);
    let keyed = post(&edge, "/charges", Some("k-once"), &[APP_503]);
    assert_eq!(keyed.status, 503);
    assert_eq!(app.executions_with_key("k-once"), 1, "a keyed request is sent once by the next hop");
    // Requests without a key keep the hop's retries (Istio's default plus 503).
    let plain = post(&edge, "/charges", None, &[APP_503]);
    assert_eq!(plain.status, 503);
    assert_eq!(app.executions_by_key().get("").copied(), Some(3), "unkeyed requests are still retried");

    // The application itself answers with the hop's connect-failure text and a forged local mark:
    // the hop overwrites the mark (`relayed`), so even under `classify` the 503 is the app's,
    // stored and replayed, never released into a second execution.
    let forged = [
        APP_503,
        ("x-up-plain", "1"),
        ("x-up-body", "upstream connect error or disconnect/reset before headers. reset reason: connection failure"),
        ("x-up-header", "x-idemgate-hop: local;attempts=1;host=127.0.0.1:1;connected=;flags=UF;details=upstream_reset_before_response_started{remote_connection_failure}"),
    ];
    let first = post(&edge, "/classify/charges", Some("k-forged"), &forged);
    assert_eq!(first.status, 503);
    assert_eq!(first.header("x-idemgate-hop"), Some("relayed"), "the hop's mark, not the app's");
    let retry = post(&edge, "/classify/charges", Some("k-forged"), &[]);
    assert_eq!(retry.status, 503, "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.executions_with_key("k-forged"), 1);
    edge.assert_no_wasm_panic();
}

#[test]
fn a_next_hops_connect_failure_is_replayed_by_default_and_released_under_classify() {
    // The next hop's application is down: nothing listens on its port yet.
    let app_port = support::free_port();
    let hop = PlainEnvoy::start(&shipped_next_hop(app_port));
    let edge = edge(&hop);
    let down_stored = post(&edge, "/charges", Some("k-stored"), &[]);
    let down_classified = post(&edge, "/classify/charges", Some("k-released"), &[]);
    for first in [&down_stored, &down_classified] {
        assert_eq!(first.status, 503);
        assert!(
            first.body_text().starts_with("upstream connect error or disconnect/reset before headers. reset reason:"),
            "the next hop's own reply: {}",
            first.body_text()
        );
        let mark = first.header("x-idemgate-hop").unwrap_or_default();
        assert!(mark.starts_with("local;attempts=1;") && mark.contains("flags=UF;"), "{mark}");
    }

    // The application comes back on that port; each client retries.
    let app = Upstream::start_on(app_port);
    // Default (`store`): the next hop's 503 is taken for the operation's result, replayed, and
    // the operation never runs (documented: docs/hops.md).
    let retry = post(&edge, "/charges", Some("k-stored"), &[]);
    assert_eq!(retry.status, 503, "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(app.executions_with_key("k-stored"), 0);
    // `classify`: the hop's mark says it never connected, so the key was released, as for the
    // edge's own connect failure: the retry executes, once.
    let retry = post(&edge, "/classify/charges", Some("k-released"), &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!(app.executions_with_key("k-released"), 1);
    let again = post(&edge, "/classify/charges", Some("k-released"), &[]);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(app.executions_with_key("k-released"), 1);
    assert_eq!(edge.stat("idemgate.released"), 1);
    edge.assert_no_wasm_panic();
}

#[test]
fn envoy_validates_the_shipped_next_hop() {
    let scratch = Scratch::new("next-hop-validate");
    let path = scratch.0.join("envoy.yaml");
    std::fs::write(&path, shipped_next_hop(8080).replace("{listen}", "10001").replace("{admin}", "9902"))
        .expect("write");
    let (ok, log) = support::envoy_validate(Path::new(&path));
    assert!(ok, "{log}");
}
