//! Envoy's internal redirects (a route's `internal_redirect_policy`): the router follows the
//! upstream's 303/307 itself and re-creates the stream for the target, which runs the filter
//! chain again. idemgate treats the re-created stream as the same request under the same claim:
//! the final answer (after the redirect) is stored and replayed, each hop executes once. A client
//! that sends `x-envoy-original-url` itself gets no part of another request's claim.

use crate::support;

use support::http::{self, Response};
use support::Stack;

const CFG: &str = r#"{"scope": {"headers": ["authorization"]}}"#;
/// Two redirects may be chained (`chained_redirects_are_one_request`); one at a time is the same.
const REDIRECTS: &str = ", internal_redirect_policy: {redirect_response_codes: [303, 307], max_internal_redirects: 2}";

fn stack(internal_clients: bool) -> Stack {
    Stack::with(CFG, |o| {
        o.route_action_extra = REDIRECTS.into();
        o.internal_clients = internal_clients;
    })
}

fn post(s: &Stack, who: &str, path: &str, key: &str, extra: &[(&str, &str)]) -> Response {
    let auth = format!("Bearer {who}");
    let mut h: Vec<(&str, &str)> =
        vec![("authorization", &auth), ("content-type", "application/json"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(s.envoy.port, "POST", path, &h, br#"{"amount":100}"#).expect("request")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// The redirect with `status` (to `/target` on the same host, or on `to_host`): the first
/// answer is the target's, the retry replays it. The stack, for more.
fn redirect_is_one_request(status: &str, target_method: &str, to_host: Option<&str>) -> Stack {
    let s = stack(false);
    let redirect = match to_host {
        Some(host) => format!("{status} http://{host}/target"),
        None => format!("{status} /target"),
    };
    let a = post(&s, "alice", "/charges", "k-redirect", &[("x-up-redirect", &redirect)]);
    assert_eq!(a.status, 201, "{status}: first answer {}", a.body_text());
    assert_eq!(a.header("idempotent-replayed"), None);
    let log = s.up.log();
    let hops: Vec<(String, String)> = log.iter().map(|e| (e.method.clone(), e.path.clone())).collect();
    assert_eq!(
        hops,
        vec![("POST".to_string(), "/charges".to_string()), (target_method.to_string(), "/target".to_string())],
        "{status}: each hop executed once"
    );
    let b = post(&s, "alice", "/charges", "k-redirect", &[("x-up-redirect", &redirect)]);
    assert_eq!(b.status, 201, "{status}: retry {}", b.body_text());
    assert_eq!(b.header("idempotent-replayed"), Some("true"), "{status}: the retry is a replay");
    assert_eq!(b.body, a.body, "{status}: the target's answer, byte-exact");
    assert_eq!(b.header("x-execution"), Some("2"));
    assert_eq!(s.up.executions(), 2, "{status}: the retry executed nothing");
    assert_eq!(s.envoy.stat("idemgate.mismatch"), 0);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
    assert_eq!(s.envoy.stat("idemgate.stored"), 1);
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_followed"), 1);
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_unfollowed"), 0);
    s
}

/// Then, on the same proxy, two redirects chained (`chained_redirects_are_one_request`).
#[test]
fn a_307_redirect_stores_the_targets_answer_and_replays_it() {
    let s = redirect_is_one_request("307", "POST", None);
    chained_redirects_are_one_request(&s);
}

/// Issue 40: a redirect to another host re-creates the stream under another `:authority`, which
/// is part of the caller's scope by default: read afresh, it named another storage key, so the
/// hand-over was never taken (the retry got 409, then outcome-unknown for the key's life). The
/// re-created stream reads its key in the scope of the URL it was redirected from (Envoy's
/// `x-envoy-original-url`, matched to the claim handed over, on the same connection).
#[test]
fn a_307_redirect_to_another_host_is_one_request() {
    redirect_is_one_request("307", "POST", Some("pay.example.test"));
}

#[test]
fn a_303_redirect_stores_the_targets_answer_and_replays_it() {
    redirect_is_one_request("303", "GET", None);
}

/// `x-envoy-original-url` sent by clients (internal ones, whose `x-envoy-*` headers Envoy keeps):
/// no bypass, no other request's claim, no other caller's response.
#[test]
fn a_forged_original_url_neither_bypasses_nor_joins_another_claim() {
    let s = stack(true);
    let forged = ("x-envoy-original-url", "http://idemgate.test/charges");
    // Alice's request completes normally.
    let a = post(&s, "alice", "/charges", "k-forged", &[]);
    assert_eq!(a.status, 201);
    // Bob names Alice's request as his original: his own request, in his own scope.
    let bob = post(&s, "bob", "/target", "k-forged", &[forged]);
    assert_eq!(bob.status, 201, "{}", bob.body_text());
    assert_eq!(bob.header("idempotent-replayed"), None);
    assert_ne!(bob.body, a.body, "never Alice's response");
    assert!(
        s.up.log().iter().any(|e| e.headers.iter().any(|(n, _)| n == "x-envoy-original-url")),
        "the forged header reached the filter chain"
    );
    // Alice herself: another request under her key is still refused.
    let other = post(&s, "alice", "/target", "k-forged", &[forged]);
    assert_eq!(other.status, 422, "{}", other.body_text());
    assert_eq!(problem_type(&other), "urn:idemgate:problem:key-reused");
    // A forged marker on a fresh key is protected like any request: executed once, replayed.
    let f1 = post(&s, "carol", "/target", "k-fresh", &[forged]);
    let f2 = post(&s, "carol", "/target", "k-fresh", &[forged]);
    assert_eq!(f1.status, 201);
    assert_eq!(f2.header("idempotent-replayed"), Some("true"));
    assert_eq!(f2.body, f1.body);
    assert_eq!(s.up.executions(), 3, "alice once, bob once, carol once");
}

/// A request in flight: a forged marker under its key waits its turn like any duplicate.
#[test]
fn a_forged_original_url_meets_an_in_flight_claim_as_a_duplicate() {
    let s = stack(true);
    let port = s.envoy.port;
    let first = std::thread::spawn(move || {
        let h = [
            ("authorization", "Bearer alice"),
            ("content-type", "application/json"),
            ("idempotency-key", "k-held"),
            ("x-up-hold", "1"),
        ];
        http::request(port, "POST", "/charges", &h, br#"{"amount":100}"#).expect("request")
    });
    // Bounded by count: the held request is executing once the upstream has it.
    for _ in 0..2000 {
        if s.up.executions() == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(s.up.executions(), 1);
    let forged = post(&s, "alice", "/charges", "k-held", &[("x-envoy-original-url", "http://idemgate.test/charges")]);
    assert_eq!(forged.status, 409, "{}", forged.body_text());
    s.up.release_holds();
    let a = first.join().expect("first");
    assert_eq!(a.status, 201);
    assert_eq!(s.up.executions(), 1);
}

/// A stack whose redirect target (`/target`) runs without idemgate (disabled on that route), for
/// internal clients (whose `x-envoy-*` headers Envoy keeps): a claim handed over there waits for
/// a stream that never comes.
fn unfollowed_stack() -> Stack {
    Stack::with(CFG, |o| {
        o.route_action_extra = REDIRECTS.into();
        o.internal_clients = true;
        // The filter's name in the chain, per build (the native build's filter is Envoy's
        // dynamic module filter).
        let filter = match o.build {
            support::Build::Wasm => "envoy.filters.http.wasm",
            support::Build::Native => "envoy.filters.http.dynamic_modules",
        };
        let off = format!(
            r#"{{{filter}: {{"@type": type.googleapis.com/envoy.config.route.v3.FilterConfig, disabled: true}}}}"#
        );
        o.named_routes =
            vec![("target".into(), format!("{{prefix: \"/target\"}}\n                typed_per_filter_config: {off}"))];
    })
}

/// The redirect's target route runs without idemgate (disabled on that route): the handed-over
/// claim waits for a stream that never comes. Meanwhile the same internal client's next request
/// **on the same keep-alive connection**, naming the redirected URL (`x-envoy-original-url`)
/// under the same caller and key, cannot take it: only the stream Envoy re-created for the
/// redirect carries the request's mark (Request-life filter state). Before the mark it took the
/// claim on both builds and ran the first hop again (executions 3 for 2, a 201). The same forged on
/// another connection cannot either (409 in flight); when the window ends the claim is
/// outcome-unknown (the first hop executed), never released.
#[test]
fn an_unfollowed_redirect_is_outcome_unknown_and_a_forged_marker_cannot_take_it() {
    let s = unfollowed_stack();
    let mut c = http::Conn::open(s.envoy.port).expect("connect");
    let h = |extra: (&'static str, &'static str)| {
        [
            ("authorization", "Bearer alice"),
            ("content-type", "application/json"),
            ("idempotency-key", "k-unfollowed"),
            extra,
        ]
    };
    let body = br#"{"amount":100}"#;
    let a = c.request("POST", "/charges", &h(("x-up-redirect", "307 /target")), body).expect("request");
    assert_eq!(a.status, 201, "{}", a.body_text());
    assert_eq!(s.up.executions(), 2, "the first hop and the target");
    let forged_marker = ("x-envoy-original-url", "http://idemgate.test/charges");
    let same = c.request("POST", "/charges", &h(forged_marker), body).expect("forged request");
    assert_eq!(
        s.up.executions(),
        2,
        "the first hop executed again under the waiting claim: {} {}",
        same.status,
        same.body_text()
    );
    assert_eq!(same.status, 409, "{}", same.body_text());
    assert_eq!(problem_type(&same), "urn:idemgate:problem:request-in-flight");
    let forged = post(&s, "alice", "/charges", "k-unfollowed", &[forged_marker]);
    assert_eq!(forged.status, 409, "{}", forged.body_text());
    assert_eq!(problem_type(&forged), "urn:idemgate:problem:request-in-flight");
    // Bounded by count: the window (10 s) ends and the next sweep settles it.
    for _ in 0..600 {
        if s.envoy.stat("idemgate.internal_redirects_unfollowed") == 1 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_unfollowed"), 1);
    let retry = post(&s, "alice", "/charges", "k-unfollowed", &[]);
    assert_eq!(retry.status, 409, "{}", retry.body_text());
    assert_eq!(problem_type(&retry), "urn:idemgate:problem:outcome-unknown");
    assert_eq!(s.up.executions(), 2, "never executed again");
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_followed"), 0);
}

/// With a store: the completion written for the handed-over claim is the store's record, and the
/// other proxy replays it.
#[test]
fn through_the_store_the_other_proxy_replays_the_targets_answer() {
    use support::store::{Redis, Webdis};
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = support::upstream::Upstream::start();
    let plugin = r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;
    let mut o = support::EnvoyOptions::new(plugin, up.port);
    o.store_port = Some(webdis.port);
    o.route_action_extra = REDIRECTS.into();
    let a = support::Envoy::start(&o);
    let b = support::Envoy::start(&o);
    let h = [
        ("authorization", "Bearer alice"),
        ("content-type", "application/json"),
        ("idempotency-key", "k-store"),
        ("x-up-redirect", "307 /target"),
    ];
    let first = http::request(a.port, "POST", "/charges", &h, br#"{"amount":100}"#).expect("request");
    assert_eq!(first.status, 201, "{}", first.body_text());
    // Bounded by count: the completion write lands (a retry meanwhile is 409 in flight).
    let mut again = None;
    for _ in 0..100 {
        let r = http::request(b.port, "POST", "/charges", &h, br#"{"amount":100}"#).expect("request");
        if r.status != 409 {
            again = Some(r);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let again = again.expect("a replay");
    assert_eq!(again.status, 201, "{}", again.body_text());
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions(), 2);
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}

/// The target answers a status in `release_on_status` (429 by default): that says nothing about
/// the first hop, which executed, so the key is outcome-unknown, never released for a retry.
/// Then, on the same proxy, a client that leaves while its redirect's target runs
/// (`a_client_leaving_while_the_target_runs_never_releases_the_key`).
#[test]
fn a_targets_release_status_or_its_client_leaving_never_releases_the_first_hop() {
    let s = stack(false);
    let h = [("x-up-redirect", "307 /target"), ("x-up-status", "429")];
    let a = post(&s, "alice", "/charges", "k-429", &h);
    assert_eq!(a.status, 429, "{}", a.body_text());
    assert_eq!(s.up.executions(), 2);
    let retry = post(&s, "alice", "/charges", "k-429", &h);
    assert_eq!(retry.status, 409, "{}", retry.body_text());
    assert_eq!(problem_type(&retry), "urn:idemgate:problem:outcome-unknown");
    assert_eq!(s.up.executions(), 2, "the first hop never ran again");
    a_client_leaving_while_the_target_runs_never_releases_the_key(&s);
}

/// Two redirects chained (`/charges` 307 to `/target`, `/target` 307 to `/target2`, Envoy
/// following both, `max_internal_redirects: 2`), on a proxy that may have served others: the claim is handed over twice, each re-created stream taking it from the one before (Envoy
/// sets `x-envoy-original-url` to the URL each was redirected from). Each hop executes once, the
/// last one's answer is stored and replayed; no stream claims the key anew (which would answer
/// the client 409 or 422 for a request whose hops executed) and none releases it. Natively on
/// main's build (no hand-over) the first answer was 422 for 201.
fn chained_redirects_are_one_request(s: &Stack) {
    let executed = s.up.executions();
    let followed = s.envoy.stat("idemgate.internal_redirects_followed");
    let stored = s.envoy.stat("idemgate.stored");
    let chain = [("x-up-redirect", "307 /target, 307 /target2")];
    let a = post(s, "alice", "/charges", "k-chain", &chain);
    assert_eq!(a.status, 201, "first answer {}", a.body_text());
    assert_eq!(a.json()["path"], "/target2", "the last hop's answer: {}", a.body_text());
    let log = s.up.log();
    let hops: Vec<String> = log.iter().skip(executed as usize).map(|e| format!("{} {}", e.method, e.path)).collect();
    assert_eq!(hops, ["POST /charges", "POST /target", "POST /target2"], "each hop executed once");
    let b = post(s, "alice", "/charges", "k-chain", &chain);
    assert_eq!(b.status, 201, "retry {}", b.body_text());
    assert_eq!(b.header("idempotent-replayed"), Some("true"), "the retry is a replay");
    assert_eq!(b.body, a.body);
    assert_eq!(s.up.executions(), executed + 3, "the retry executed nothing");
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_followed"), followed + 2);
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_unfollowed"), 0);
    assert_eq!(s.envoy.stat("idemgate.unknown_outcome"), 0);
    assert_eq!(s.envoy.stat("idemgate.stored"), stored + 1);
}

/// The client leaves while its redirect's target runs (the first hop answered its 307 at once,
/// the target is held): the re-created stream ends without an answer. Both hops executed, so
/// nothing releases the key: a retry gets 409 (in flight, then outcome-unknown once the stream
/// is settled), never a third execution. On a proxy that may have served others. Natively on
/// main's build (no hand-over) the target was refused (409) and never executed.
fn a_client_leaving_while_the_target_runs_never_releases_the_key(s: &Stack) {
    use std::io::Write;
    let executed = s.up.executions();
    let followed = s.envoy.stat("idemgate.internal_redirects_followed");
    let released = s.envoy.stat("idemgate.released");
    let body = br#"{"amount":100}"#;
    let req = format!(
        "POST /charges HTTP/1.1\r\nhost: idemgate.test\r\nauthorization: Bearer alice\r\ncontent-type: application/json\r\nidempotency-key: k-left\r\nx-up-redirect: 307 /target\r\nx-up-hold-on: /target\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut c = std::net::TcpStream::connect(("127.0.0.1", s.envoy.port)).expect("connect");
    c.write_all(req.as_bytes()).expect("send");
    c.write_all(body).expect("send");
    // Bounded by count: both hops have executed once the target is held.
    for _ in 0..2000 {
        if s.up.executions() == executed + 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(s.up.executions(), executed + 2, "the first hop and the held target");
    let _ = c.shutdown(std::net::Shutdown::Both);
    drop(c);
    // Bounded by count: the re-created stream is settled once Envoy sees its client gone.
    let mut last = String::new();
    for _ in 0..200 {
        let r = post(s, "alice", "/charges", "k-left", &[]);
        assert_eq!(r.status, 409, "the key is never released: {}", r.body_text());
        last = problem_type(&r);
        if last == "urn:idemgate:problem:outcome-unknown" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(last, "urn:idemgate:problem:outcome-unknown");
    s.up.release_holds();
    let r = post(s, "alice", "/charges", "k-left", &[]);
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(s.up.executions(), executed + 2, "never executed again");
    assert_eq!(s.envoy.stat("idemgate.internal_redirects_followed"), followed + 1);
    assert_eq!(s.envoy.stat("idemgate.released"), released);
}
