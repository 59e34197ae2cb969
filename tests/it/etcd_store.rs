//! `store.kind: "etcd"`: two Envoy 1.40 instances sharing a real three-member etcd cluster
//! (Debian `etcd-server` 3.4), in front of one counting upstream. Every test asserts how many
//! times the upstream executed. The failure tests (`etcd_fault_*`) kill, hang and resume members;
//! `make test` skips them and `make test-faults` runs them.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::etcd::EtcdCluster;
use support::http::{self, Response};
use support::tls;
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// The fault and security cases (`make test-faults`).
mod faults;

const TOKEN: &str = "Bearer alice-secret-token";

fn cfg() -> String {
    r#"{"scope": {"headers": ["authorization"]}, "store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}}"#
        .to_string()
}

struct Pair {
    up: Upstream,
    a: Envoy,
    b: Envoy,
}

impl Pair {
    fn new(etcd: &EtcdCluster) -> Pair {
        Pair::with(etcd, &cfg(), None, true)
    }

    /// Two proxies with plugin configuration `config`, `IDEMGATE_STORE_AUTH` set to `auth` in
    /// their VMs' environment, waiting for their leases if `leases`.
    fn with(etcd: &EtcdCluster, config: &str, auth: Option<&str>, leases: bool) -> Pair {
        Pair::reaching(config, auth, leases, |o| o.etcd_ports = etcd.client_ports())
    }

    /// `with`, the store cluster set by `store`.
    fn reaching(config: &str, auth: Option<&str>, leases: bool, store: impl FnOnce(&mut EnvoyOptions)) -> Pair {
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(config, up.port);
        store(&mut o);
        if let Some(a) = auth {
            o.vm_env.push(("IDEMGATE_STORE_AUTH".into(), a.into()));
        }
        let a = Envoy::start(&o);
        let b = Envoy::start(&o);
        if leases {
            support::etcd::wait_leases(&a, o.concurrency);
            support::etcd::wait_leases(&b, o.concurrency);
        }
        Pair { up, a, b }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.a.assert_no_wasm_panic();
            self.b.assert_no_wasm_panic();
        }
    }
}

fn post(e: &Envoy, key: &str, body: &str, extra: &[(&str, &str)]) -> Response {
    let mut h: Vec<(&str, &str)> = vec![("authorization", TOKEN), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(e.port, "POST", "/charges", &h, body.as_bytes()).expect("request")
}

/// `post`, sent again (at most 20 times, 250 ms apart) while it is answered 503
/// store-unavailable, as a client honouring `retry-after` would: a member just killed stays in
/// Envoy's rotation until its health check fails (within about a second), and a claim sent to it
/// is refused, never forwarded.
fn post_until_answered(e: &Envoy, key: &str, body: &str) -> (Response, u32) {
    let mut unavailable = 0;
    loop {
        let r = post(e, key, body, &[]);
        if r.status != 503 || r.problem() != "store-unavailable" || unavailable == 20 {
            return (r, unavailable);
        }
        unavailable += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits (at most 400 looks, 50 ms apart) until `e`'s root contexts have landed `n` store writes.
fn wait_writes(e: &Envoy, n: u64) {
    for _ in 0..400 {
        if e.stat("idemgate.store_writes") >= n {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("store writes: {} of {n} landed", e.stat("idemgate.store_writes"));
}

/// `key` sent to `e` until it is no longer in flight (409) or refused for the store (503), at most
/// 80 times, 250 ms apart: the answer once the first attempt's completion has landed. Every try
/// is a duplicate, so none may execute (the callers assert executions).
fn replayed_on(e: &Envoy, key: &str, body: &str) -> Response {
    for _ in 0..80 {
        let r = post(e, key, body, &[]);
        match (r.status, r.problem().as_str()) {
            (409, "request-in-flight") | (503, "store-unavailable") => std::thread::sleep(Duration::from_millis(250)),
            _ => return r,
        }
    }
    panic!("{key}: still in flight or unavailable after 80 tries");
}

#[test]
fn etcd_replay_across_two_proxies_executes_once() {
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let first = post(&p.a, "k-replay", r#"{"amount":5}"#, &[]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    wait_writes(&p.a, 1);
    let again = post(&p.b, "k-replay", r#"{"amount":5}"#, &[]);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")));
    assert_eq!(again.body, first.body);
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn etcd_forty_concurrent_duplicates_split_across_two_proxies_execute_once() {
    let etcd = EtcdCluster::start();
    let p = Arc::new(Pair::new(&etcd));
    let handles: Vec<_> = (0..40)
        .map(|i| {
            let p = p.clone();
            std::thread::spawn(move || {
                let e = if i % 2 == 0 { &p.a } else { &p.b };
                post(e, "k-forty", r#"{"amount":40}"#, &[("x-up-delay-ms", "300")]).status
            })
        })
        .collect();
    let statuses: Vec<u16> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
    assert_eq!(p.up.executions(), 1, "statuses {statuses:?}");
    // 503 (store-unavailable, never forwarded) when an answer took longer than timeout_ms: seen
    // 2 of 40 times with three such tests running at once on a loaded 2-core machine.
    assert!(statuses.iter().all(|s| [201, 409, 503].contains(s)), "{statuses:?}");
    assert!(statuses.contains(&201), "{statuses:?}");
}

#[test]
fn etcd_another_body_with_the_same_key_is_422_on_the_other_proxy() {
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    assert_eq!(post(&p.a, "k-422", r#"{"amount":1}"#, &[]).status, 201);
    wait_writes(&p.a, 1);
    let other = post(&p.b, "k-422", r#"{"amount":2}"#, &[]);
    assert_eq!((other.status, other.problem().as_str()), (422, "key-reused"));
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn etcd_an_expired_key_is_claimed_anew_on_the_other_proxy_and_executes_once_more() {
    // Past its record's expiry the value is still in etcd (its lease outlives it) and judged free:
    // the other proxy claims it with a take-over transaction (compared on the value's owner mark
    // and on the new owner's tombstone), forwards once, and both proxies then replay the new answer.
    let etcd = EtcdCluster::start();
    let config = cfg().replace(r#""scope""#, r#""ttl_seconds": 3, "lock_ttl_seconds": 1, "scope""#);
    let p = Pair::with(&etcd, &config, None, true);
    assert_eq!(post(&p.a, "k-expired", r#"{"amount":1}"#, &[]).status, 201);
    wait_writes(&p.a, 1);
    // The record's 3 s, the readers' clock tolerance, and a margin.
    std::thread::sleep(Duration::from_millis(3000 + idemgate::etcd::CLOCK_SKEW_TOLERANCE_MS + 500));
    assert!(!etcd.all().is_empty(), "the expired value is still in etcd, under its lease");
    let anew = post(&p.b, "k-expired", r#"{"amount":1}"#, &[]);
    assert_eq!((anew.status, anew.header("idempotent-replayed")), (201, None), "{}", anew.body_text());
    assert_eq!(p.up.executions(), 2);
    wait_writes(&p.b, 1);
    for e in [&p.b, &p.a] {
        let again = replayed_on(e, "k-expired", r#"{"amount":1}"#);
        assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    }
    assert_eq!(p.up.executions(), 2);
}

#[test]
fn etcd_holds_no_raw_key_or_credential() {
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let raw_key = "raw-key-8f1c2e7a-visible";
    assert_eq!(post(&p.a, raw_key, r#"{"amount":3}"#, &[]).status, 201);
    wait_writes(&p.a, 1);
    let all = etcd.all();
    assert!(!all.is_empty());
    let contains = |hay: &[u8], needle: &str| hay.windows(needle.len()).any(|w| w == needle.as_bytes());
    for (k, v) in &all {
        assert!(k.starts_with(idemgate::etcd::KEY_PREFIX.as_bytes()), "{}", String::from_utf8_lossy(k));
        for secret in [raw_key, "alice-secret-token", support::RECORD_KEY] {
            assert!(!contains(k, secret) && !contains(v, secret), "{secret} stored in etcd");
        }
    }
    // The value, its owner mark: nothing else (no tombstone, no stray key).
    assert_eq!(
        all.len(),
        2,
        "{:?}",
        all.iter().map(|(k, _)| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>()
    );
}

/// Envoy's view of each `idemgate_store` member: (port, health flags), from `/clusters`.
fn store_health(e: &Envoy) -> Vec<(u16, String)> {
    let r = http::get(e.admin_port, "/clusters").expect("admin /clusters");
    r.body_text()
        .lines()
        .filter_map(|l| l.strip_prefix("idemgate_store::127.0.0.1:"))
        .filter_map(|l| l.split_once("::health_flags::"))
        .filter_map(|(port, flags)| Some((port.parse().ok()?, flags.to_string())))
        .collect()
}

/// Polls (at most 100 looks, 100 ms apart) until `want` holds of `e`'s view of the members.
fn wait_health(e: &Envoy, what: &str, want: impl Fn(&[(u16, String)]) -> bool) {
    for _ in 0..100 {
        if want(&store_health(e)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: Envoy sees {:?}", store_health(e));
}

#[test]
fn etcd_envoy_health_checks_keep_live_members_in_rotation_and_take_a_killed_one_out() {
    let mut etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let ports = etcd.client_ports();
    // Every live member healthy (the shipped checks once left all three failed for a minute
    // after a slow start, and Envoy then spread requests over every member, dead ones included).
    for e in [&p.a, &p.b] {
        wait_health(e, "all three healthy", |h| h.len() == 3 && h.iter().all(|(_, f)| f == "healthy"));
    }
    // A follower (a leader's death adds an election, whose own refusals are another test's).
    let victim = (etcd.wait_leader() + 1) % 3;
    etcd.kill(victim);
    for e in [&p.a, &p.b] {
        wait_health(e, "the killed member out, the others in", |h| {
            h.iter().all(|(port, f)| (*port == ports[victim]) != (f == "healthy"))
        });
    }
    let panics = p.a.stat("cluster.idemgate_store.lb_healthy_panic");
    // Requests now go to live members only, never in panic mode (Envoy spreading them over every
    // member because none is healthy). A worker may take a moment to see the change the admin
    // endpoint shows: a request refused meanwhile is retried, as a client would.
    for i in 0..12 {
        let (r, _) = post_until_answered(&p.a, &format!("k-health-{i}"), r#"{"amount":1}"#);
        assert_eq!(r.status, 201, "{i}: {}", r.body_text());
    }
    assert_eq!(p.up.executions(), 12);
    let routed_in_panic = p.a.stat("cluster.idemgate_store.lb_healthy_panic") - panics;
    // Panic mode is the health checker's verdict, not the load balancer's choice: if a live member
    // failed two checks in a row after the kill (each given a second; a loaded machine can be
    // slower), Envoy rightly took it out, and with two of three out it spreads requests over all
    // three. The assertion holds whenever the checker saw the live members alive, as it does on a
    // machine that answers a check within its second. Its event log is flushed at exit.
    let mut p = p;
    p.a.stop();
    let events = p.a.file(support::etcd::STORE_HEALTH_EVENTS);
    let ejected =
        |port: u16, l: &str| l.contains("eject_unhealthy_event") && l.contains(&format!("\"port_value\":{port},"));
    let kill = events.lines().position(|l| ejected(ports[victim], l));
    let kill = kill.unwrap_or_else(|| panic!("the killed member's ejection is not in the health events:\n{events}"));
    let live_ejections: Vec<&str> =
        events.lines().skip(kill).filter(|l| (0..3).any(|i| i != victim && ejected(ports[i], l))).collect();
    if live_ejections.is_empty() {
        assert_eq!(routed_in_panic, 0, "requests routed in panic mode; health events:\n{events}");
    } else {
        eprintln!("a live member failed its checks ({routed_in_panic} routed in panic mode): {live_ejections:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// etcd's authentication: the proxy trades `IDEMGATE_STORE_AUTH` (user:password, from the VM's
// environment) for a token, renewed ahead of need and at once when etcd refuses it.

const ETCD_USER: &str = "idemgate";
const ETCD_PASSWORD: &str = "etcd-pw-5b7e0f19";

fn etcd_auth() -> String {
    format!("{ETCD_USER}:{ETCD_PASSWORD}")
}

#[test]
fn etcd_auth_a_proxy_trades_its_environments_password_for_a_token_and_replays_across_proxies() {
    let mut etcd = EtcdCluster::start();
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    // etcd refuses a client without a token: auth is really on.
    let anonymous =
        http::request(etcd.members[0].client_port, "POST", "/v3/kv/range", &[], br#"{"key":"YQ=="}"#).expect("etcd");
    assert_eq!(anonymous.status, 400, "{}", anonymous.body_text());
    let p = Pair::with(&etcd, &cfg(), Some(&etcd_auth()), true);
    let first = post(&p.a, "k-auth", r#"{"amount":5}"#, &[]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    wait_writes(&p.a, 1);
    // Sent again while answered 503 store-unavailable (never forwarded): with auth on, etcd checks
    // the token on every call, and on a loaded 2-core machine one read took longer than the 1 s
    // `timeout_ms` (seen once, stop 51). The execution count below is what must hold.
    let again = replayed_on(&p.b, "k-auth", r#"{"amount":5}"#);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(p.up.executions(), 1);
    for e in [&p.a, &p.b] {
        assert!(e.stat("idemgate.store_authentications") >= 1);
        assert_eq!(e.stat("idemgate.store_token_refused"), 0);
        assert!(!e.log().contains(ETCD_PASSWORD), "the password reached a log line");
    }
    let contains = |hay: &[u8], needle: &str| hay.windows(needle.len()).any(|w| w == needle.as_bytes());
    for (k, v) in etcd.all() {
        assert!(!contains(&k, ETCD_PASSWORD) && !contains(&v, ETCD_PASSWORD), "the password is stored in etcd");
    }
}

#[test]
fn etcd_auth_a_wrong_password_is_503_and_forwards_nothing() {
    let mut etcd = EtcdCluster::start();
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    let p = Pair::with(&etcd, &cfg(), Some(&format!("{ETCD_USER}:not-the-password")), false);
    for _ in 0..200 {
        if p.a.log().contains("etcd authentication failed") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(p.a.log().contains("invalid user ID or password"), "{}", p.a.log());
    for i in 0..5 {
        let r = post(&p.a, &format!("k-wrong-{i}"), r#"{"amount":1}"#, &[]);
        assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{}", r.body_text());
    }
    assert_eq!(p.up.executions(), 0);
    assert_eq!(p.a.stat("idemgate.store_authentications"), 0);
}

/// Two proxies on `etcd` (auth on) whose tokens are refreshed only every hour; `invalidate` makes
/// etcd refuse their tokens. The next key must be served once they take a new one at once (not an
/// hour later), executed once, and replayed by the other proxy (whose token is as old).
fn a_refused_token_is_replaced_at_once(etcd: &EtcdCluster, key: &str, invalidate: impl FnOnce()) {
    let config = cfg().replace(r#""timeout_ms": 1000"#, r#""timeout_ms": 1000, "token_refresh_seconds": 3600"#);
    let p = Pair::with(etcd, &config, Some(&etcd_auth()), true);
    assert_eq!(post(&p.a, &format!("{key}-before"), r#"{"amount":1}"#, &[]).status, 201);
    wait_writes(&p.a, 1);
    let before = p.a.stat("idemgate.store_authentications");
    invalidate();
    let (r, refused) = post_until_answered(&p.a, key, r#"{"amount":2}"#);
    assert_eq!(r.status, 201, "after {refused} refusals: {}", r.body_text());
    assert!(p.a.stat("idemgate.store_token_refused") >= 1, "etcd never refused the old token");
    assert!(p.a.stat("idemgate.store_authentications") > before);
    wait_writes(&p.a, 2);
    // The refused attempts forwarded nothing; the key executed once, and replays on the other proxy.
    assert_eq!(p.up.executions(), 2);
    let again = replayed_on(&p.b, key, r#"{"amount":2}"#);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(p.up.executions(), 2);
}

#[test]
fn etcd_auth_a_token_etcd_refuses_is_renewed_at_once_and_nothing_executes_twice() {
    let mut etcd = EtcdCluster::start();
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    // A password change (to the same password) makes etcd forget every token of the user (401).
    a_refused_token_is_replaced_at_once(&etcd, "k-after", || etcd.change_password(ETCD_USER, ETCD_PASSWORD));
}

#[test]
fn etcd_auth_a_jwt_older_than_etcds_auth_store_is_replaced_at_once_and_nothing_executes_twice() {
    // etcd's JWTs carry the auth store's revision: a role added anywhere in etcd makes every token
    // issued before it refused (400 "revision of auth store is old") until a new one is taken.
    let keys = support::Scratch::new("etcd-jwt");
    tls::openssl(&keys.0, &["genrsa", "-out", "jwt.key", "2048"]);
    tls::openssl(&keys.0, &["rsa", "-in", "jwt.key", "-pubout", "-out", "jwt.pub"]);
    let jwt = format!(
        "jwt,pub-key={},priv-key={},sign-method=RS256,ttl=10m",
        keys.0.join("jwt.pub").display(),
        keys.0.join("jwt.key").display()
    );
    let mut etcd = EtcdCluster::start_with(&["--auth-token", &jwt]);
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    a_refused_token_is_replaced_at_once(&etcd, "k-jwt-after", || etcd.add_role("auditors"));
}

#[test]
fn etcd_auth_a_token_refreshed_below_etcds_ttl_never_lapses_while_idle() {
    // etcd forgets a token unused for 3 s; the proxies authenticate again every second.
    let mut etcd = EtcdCluster::start_with(&["--auth-token-ttl", "3"]);
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    let config = cfg().replace(r#""timeout_ms": 1000"#, r#""timeout_ms": 1000, "token_refresh_seconds": 1"#);
    let p = Pair::with(&etcd, &config, Some(&etcd_auth()), true);
    assert_eq!(post(&p.a, "k-idle-1", r#"{"amount":1}"#, &[]).status, 201);
    // Idle for longer than etcd's token TTL.
    std::thread::sleep(Duration::from_secs(5));
    let r = post(&p.a, "k-idle-2", r#"{"amount":1}"#, &[]);
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(p.a.stat("idemgate.store_token_refused"), 0);
    assert_eq!(p.up.executions(), 2);
}

// ---------------------------------------------------------------------------------------------
// etcd over TLS with client certificates, through the shipped cluster
// `envoy/etcd/idemgate-store-cluster-tls.yaml`: the certificate decides who may connect, the
// token (etcd's JSON gateway takes no user from a certificate) what it may do.

const ETCD_NAME: &str = "etcd.idemgate.internal";

/// The shipped TLS cluster for `etcd`'s HTTPS ports, with `pki`'s files (`with_certificate`:
/// false removes the proxy's certificate).
fn etcd_tls_cluster(etcd: &EtcdCluster, pki: &tls::Pki, with_certificate: bool) -> String {
    let mut text = tls::shipped("envoy/etcd/idemgate-store-cluster-tls.yaml");
    if !with_certificate {
        let cut = [
            "        tls_certificates:\n",
            "        - certificate_chain: {filename: /etc/idemgate/store-tls/proxy.crt}\n",
            "          private_key: {filename: /etc/idemgate/store-tls/proxy.key}\n",
        ];
        for line in cut {
            assert!(text.contains(line), "the shipped cluster changed: {line}");
            text = text.replace(line, "");
        }
    }
    let values: Vec<(String, String)> = etcd
        .tls_ports()
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            [
                (format!("ETCD_ADDRESS_{}", i + 1), "127.0.0.1".to_string()),
                (format!("ETCD_PORT_{}", i + 1), p.to_string()),
            ]
        })
        .collect();
    let values: Vec<(&str, String)> = values.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    pki.place(&tls::render(&text, &values, "idemgate-store-cluster-tls.yaml"))
}

fn tls_pair(cluster: String, leases: bool) -> Pair {
    Pair::reaching(&cfg(), Some(&etcd_auth()), leases, |o| o.extra_clusters = vec![cluster])
}

#[test]
fn etcd_tls_client_certificates_through_envoys_cluster_and_a_token_replay_across_proxies() {
    let pki = tls::Pki::generate_for("etcd", ETCD_NAME);
    let mut etcd = EtcdCluster::start_tls(&pki.dir);
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    // The members' client port speaks TLS only.
    let plain =
        http::request_timeout(etcd.members[0].tls_port, "POST", "/v3/kv/range", &[], b"{}", Duration::from_secs(2));
    assert!(plain.as_ref().map_or(true, |r| r.status != 200), "plain HTTP answered on the TLS port");
    let p = tls_pair(etcd_tls_cluster(&etcd, &pki, true), true);
    let first = post(&p.a, "k-tls", r#"{"amount":5}"#, &[]);
    assert_eq!(first.status, 201, "{}", first.body_text());
    wait_writes(&p.a, 1);
    let again = post(&p.b, "k-tls", r#"{"amount":5}"#, &[]);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(p.up.executions(), 1);
    assert!(p.a.stat("cluster.idemgate_store.ssl.handshake") >= 1, "no TLS handshake with etcd");
}

#[test]
fn etcd_tls_a_proxy_without_a_certificate_or_with_another_cas_is_refused_and_forwards_nothing() {
    let pki = tls::Pki::generate_for("etcd", ETCD_NAME);
    let stranger = tls::Pki::generate_for("stranger", ETCD_NAME);
    let mut etcd = EtcdCluster::start_tls(&pki.dir);
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    for (what, cluster) in [
        ("no client certificate", etcd_tls_cluster(&etcd, &pki, false)),
        ("another CA's certificates", etcd_tls_cluster(&etcd, &stranger, true)),
    ] {
        let p = tls_pair(cluster, false);
        for _ in 0..200 {
            if p.a.stat("idemgate.store_errors") >= 1 {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(p.a.stat("idemgate.store_errors") >= 1, "{what}: etcd was never refused");
        for i in 0..3 {
            let r = post(&p.a, &format!("k-refused-{i}"), r#"{"amount":1}"#, &[]);
            assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{what}: {}", r.body_text());
        }
        assert_eq!(p.up.executions(), 0, "{what}");
        assert_eq!(p.a.stat("idemgate.store_authentications"), 0, "{what}: authenticated without a trusted link");
    }
}

/// Sends `key` on `e` with a 2.5 s upstream delay in a thread.
fn in_flight(e: &Envoy, key: String) -> std::thread::JoinHandle<u16> {
    let port = e.port;
    std::thread::spawn(move || {
        let h = [("authorization", TOKEN), ("idempotency-key", key.as_str()), ("x-up-delay-ms", "2500")];
        http::request(port, "POST", "/charges", &h, br#"{"amount":9}"#).map_or(0, |r| r.status)
    })
}

/// What a first request costs through Envoy with each store, on this machine: 60 unique keys in a
/// row (a bounded loop, one client), then a replay of each on the other proxy (a local miss: one
/// store read). Prints the medians and the 95th percentiles; asserts executions only.
#[test]
fn etcd_cost_first_request_and_replay_after_local_miss_beside_redis() {
    use support::store::{Redis, Webdis};
    fn measure(a: &Envoy, b: &Envoy, prefix: &str) -> (Vec<f64>, Vec<f64>) {
        let (mut first, mut replay) = (vec![], vec![]);
        for i in 0..60 {
            let k = format!("{prefix}-{i}");
            let t = Instant::now();
            assert_eq!(post(a, &k, "{}", &[]).status, 201);
            first.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        wait_writes(a, 60);
        for i in 0..60 {
            let t = Instant::now();
            assert_eq!(post(b, &format!("{prefix}-{i}"), "{}", &[]).header("idempotent-replayed"), Some("true"));
            replay.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        (first, replay)
    }
    fn pct(v: &mut [f64], q: f64) -> f64 {
        v.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
        v[((v.len() as f64 - 1.0) * q).round() as usize]
    }
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let (mut ef, mut er) = measure(&p.a, &p.b, "cost-etcd");
    assert_eq!(p.up.executions(), 60);
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000}}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    let (ra, rb) = (Envoy::start(&o), Envoy::start(&o));
    let (mut rf, mut rr) = measure(&ra, &rb, "cost-redis");
    assert_eq!(up.executions(), 60);
    let line = format!(
        "first request: etcd median {:.2} ms p95 {:.2} ms, redis median {:.2} ms p95 {:.2} ms; replay after a local miss: etcd median {:.2} ms p95 {:.2} ms, redis median {:.2} ms p95 {:.2} ms",
        pct(&mut ef, 0.5), pct(&mut ef, 0.95), pct(&mut rf, 0.5), pct(&mut rf, 0.95),
        pct(&mut er, 0.5), pct(&mut er, 0.95), pct(&mut rr, 0.5), pct(&mut rr, 0.95)
    );
    eprintln!("{line}");
    let dir = support::repo_root().join("target/faults");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("etcd_cost.md"), format!("{line}\n"));
}

/// Issue 23, item 5: a response of exactly the default `max_response_body_bytes` (1 MiB) through
/// etcd with its default `--max-request-bytes` (1.5 MiB): stored by proxy a, replayed byte-exact
/// by proxy b, one execution. (A completion that carried the record twice, in its put and in a
/// nested where-absent put, was refused by etcd, 400 "request is too large", on every attempt.)
#[test]
fn etcd_a_response_of_exactly_max_response_body_bytes_is_replayed_on_the_other_proxy() {
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let size = "1048576";
    let first = post(&p.a, "k-large", "{}", &[("x-up-body-bytes", size)]);
    assert_eq!((first.status, first.body.len()), (201, 1_048_576));
    let again = replayed_on(&p.b, "k-large", "{}");
    assert_eq!(p.up.executions(), 1);
    assert_eq!(
        (again.status, again.problem()),
        (201, String::new()),
        "{}",
        &again.body_text()[..200.min(again.body.len())]
    );
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(p.a.stat("idemgate.store_writes_too_large"), 0);
}

/// Issue 23, item 5: a store that still refuses a completion as too large (here etcd's
/// `--max-request-bytes` set below what `store.max_request_bytes` claims) ends the key as
/// "executed, response not stored" on the other proxy, never outcome-unknown; one execution.
#[test]
fn etcd_a_completion_refused_as_too_large_is_stored_without_its_body() {
    let etcd = EtcdCluster::start_with(&["--max-request-bytes", "262144"]);
    // The default local tier: a 400 KB body is over its bucket's share (24 KiB) and is kept on
    // the table-wide pool (docs/local-tier.md).
    let config = r#"{"scope": {"headers": ["authorization"]}, "store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}}"#;
    let p = Pair::with(&etcd, config, None, true);
    let first = post(&p.a, "k-refused", "{}", &[("x-up-body-bytes", "400000")]);
    assert_eq!((first.status, first.body.len()), (201, 400_000));
    let again = replayed_on(&p.b, "k-refused", "{}");
    assert_eq!(p.up.executions(), 1);
    assert_eq!((again.status, again.problem()), (201, "response-not-stored".to_string()), "{}", again.body_text());
    // Counted by a's root when etcd's refusal comes back, handed to /stats on its next tick: b's
    // replay can come first (bounded by count: the tick is 100 ms).
    let counted = (0..200).any(|_| {
        p.a.stat("idemgate.store_writes_too_large") == 1 || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            false
        }
    });
    assert!(counted, "too-large refusals counted: {}", p.a.stat("idemgate.store_writes_too_large"));
    // Proxy a keeps the whole response in its local tier.
    let local = post(&p.a, "k-refused", "{}", &[]);
    assert_eq!(local.body, first.body);
    assert_eq!(p.up.executions(), 1);
}

/// Issue 23, item 5: the completion's where-absent write is now a second transaction (the record
/// once per transaction). The store loses the key while its request runs (every idemgate key
/// deleted, as a lapsed lease or an operator would): the completion finds no claim, reads that the
/// key is absent, writes the record there in its second transaction
/// (`store_claim_gone_rewritten`), and proxy b replays it; one execution.
#[test]
fn etcd_a_completion_whose_claim_is_gone_writes_its_record_in_a_second_transaction() {
    let etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let port = p.a.port;
    let first = std::thread::spawn(move || {
        let h = [("authorization", TOKEN), ("idempotency-key", "k-gone"), ("x-up-delay-ms", "1500")];
        http::request(port, "POST", "/charges", &h, b"{}").expect("request")
    });
    // Bounded by count: wait until the request reached the upstream, then empty the store.
    for _ in 0..200 {
        if p.up.executions() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(p.up.executions(), 1);
    let prefix = idemgate::etcd::KEY_PREFIX.as_bytes();
    let mut end = prefix.to_vec();
    *end.last_mut().unwrap() += 1;
    let del = serde_json::json!({"key": idemgate::base64::b64(prefix), "range_end": idemgate::base64::b64(&end)});
    let leader = etcd.wait_leader();
    assert!(etcd.call(leader, "/v3/kv/deleterange", &del).is_some());
    let first = first.join().unwrap();
    assert_eq!(first.status, 201, "{}", first.body_text());
    for _ in 0..400 {
        if p.a.stat("idemgate.store_claim_gone_rewritten") >= 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(p.a.stat("idemgate.store_claim_gone_rewritten"), 1);
    let again = replayed_on(&p.b, "k-gone", "{}");
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(p.up.executions(), 1);
}
