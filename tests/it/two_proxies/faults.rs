//! The fault and security cases of the two-proxy suite (the store down, slow or killed, a proxy
//! killed mid-request, store writes lost or failing, no raw key in the store): `make test-faults`
//! runs them (every module named `faults`), `make test-native` skips them.

use super::*;

#[test]
fn the_store_holds_no_raw_key_and_no_raw_credential() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    post(&p.a, "raw-key-7f3a9c", "{}", &[]);
    completed_in_store(&redis, &cfg(""), "raw-key-7f3a9c");
    let all = redis.dump_all_values();
    assert_eq!(all.len(), 1, "{:?}", all.iter().map(|(k, _)| k).collect::<Vec<_>>());
    for (k, v) in &all {
        assert!(k.starts_with("idemgate:v1:") && k.len() == "idemgate:v1:".len() + 64, "{k}");
        for secret in ["raw-key-7f3a9c", "alice-secret-token", "Bearer"] {
            assert!(!k.contains(secret));
            assert!(!v.windows(secret.len()).any(|w| w == secret.as_bytes()), "{secret} found in the stored value");
        }
    }
}

#[test]
fn redis_down_gives_503_and_no_execution_then_protection_resumes() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    redis.kill9();
    let r = post(&p.a, "k-down", "{}", &[]);
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(problem_type(&r), "urn:idemgate:problem:store-unavailable");
    assert!(r.header("retry-after").is_some());
    assert_eq!(p.up.executions(), 0);
    redis.restart();
    let mut ok = None;
    for _ in 0..50 {
        let r = post(&p.a, "k-down", "{}", &[]);
        if r.status == 201 {
            ok = Some(r);
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(ok.is_some(), "protection resumes without restarting Envoy");
    completed_in_store(&redis, &cfg(""), "k-down");
    assert_eq!(post(&p.b, "k-down", "{}", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_completed_key_survives_a_redis_kill_and_restart_with_aof() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, &cfg(""));
    let first = post(&p.a, "k-aof", "{}", &[]);
    std::thread::sleep(Duration::from_millis(1500)); // appendfsync everysec
    redis.kill9();
    redis.restart();
    // b's local tier never saw the key: the replay comes from Redis's AOF.
    let mut again = None;
    for _ in 0..50 {
        let r = post(&p.b, "k-aof", "{}", &[]);
        if r.status != 503 {
            again = Some(r);
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let again = again.expect("store back");
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_proxy_killed_mid_request_leaves_a_claim_no_retry_executes_again() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let mut p = Pair::new(
        webdis.port,
        r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 1, "store": {"cluster": "idemgate_store", "timeout_ms": 500}}"#,
    );
    let port = p.a.port;
    let t = std::thread::spawn(move || {
        let h =
            [("authorization", "Bearer alice-secret-token"), ("idempotency-key", "k-crash"), ("x-up-delay-ms", "1000")];
        http::request_timeout(port, "POST", "/charges", &h, b"{}", Duration::from_secs(5))
    });
    // a forwarded the request (so its claim is in the store): the upstream runs.
    assert!(eventually(Duration::from_secs(20), || p.up.executions() == 1), "the first attempt never executed");
    p.a.kill();
    let _ = t.join();
    std::thread::sleep(Duration::from_millis(1200)); // past lock_ttl_seconds
    for _ in 0..3 {
        let r = post(&p.b, "k-crash", "{}", &[]);
        assert_eq!(r.status, 409, "{}", r.body_text());
        assert_eq!(problem_type(&r), "urn:idemgate:problem:outcome-unknown");
    }
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_completion_write_during_a_short_store_outage_lands_when_the_store_returns() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, WRITE_FAIL_CFG);
    let first = first_attempt_outliving_redis(p.a.port, &mut redis, "k-wshort");
    assert_eq!(first.status, 201, "the client still gets its response");
    assert!(eventually(Duration::from_secs(10), || p.a.stat("idemgate.store_write_retries") >= 1));
    redis.restart();
    // The write is retried with backoff (0.2 .. 3.2 s) and lands once the store is back.
    assert!(eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_writes") >= 1), "the write never landed");
    assert_eq!(p.a.stat("idemgate.store_write_failures"), 0);
    let r = post(&p.b, "k-wshort", "{}", &[]);
    assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")), "{}", r.body_text());
    assert_eq!(r.body, first.body);
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_claim_whose_answer_was_lost_is_released_so_a_retry_executes() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, WRITE_FAIL_CFG);
    // Redis holds write commands for 1.2 s: the claim is answered after idemgate's 300 ms store
    // timeout, but it does land.
    redis.cli(&["CLIENT", "PAUSE", "1200", "WRITE"]);
    let r = post(&p.a, "k-lost", "{}", &[]);
    assert_eq!(
        (r.status, problem_type(&r).as_str()),
        (503, "urn:idemgate:problem:store-unavailable"),
        "{}",
        r.body_text()
    );
    assert_eq!(p.up.executions(), 0);
    std::thread::sleep(Duration::from_millis(1300)); // Redis runs again: the claim has landed
                                                     // The owner-checked release, sent after it and retried by the root, removes it.
                                                     // (A retry of the release that runs after the claim was deleted leaves a release tombstone,
                                                     // which holds no record and reads as a free key.)
    let no_claim = || redis.keys("*").iter().all(|k| redis.get_raw(k).is_none_or(|v| v.starts_with(b"IGS1R")));
    assert!(eventually(Duration::from_secs(20), no_claim), "the lost claim is still in the store");
    let retry = post(&p.b, "k-lost", "{}", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_store_write_failing_after_forwarding_ends_in_outcome_unknown() {
    let mut redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let p = Pair::new(webdis.port, WRITE_FAIL_CFG);
    let first = first_attempt_outliving_redis(p.a.port, &mut redis, "k-wfail");
    assert_eq!(first.status, 201, "the client still gets its response");
    // Every retry of the completion fails (about 6 s), then the outcome-unknown fallback is tried.
    assert!(eventually(Duration::from_secs(20), || p.a.stat("idemgate.store_write_failures") >= 1));
    redis.restart();
    // Until webdis has reconnected, b answers 503 store-unavailable (and forwards nothing).
    let mut r = post(&p.b, "k-wfail", "{}", &[]);
    for _ in 0..50 {
        if r.status != 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        r = post(&p.b, "k-wfail", "{}", &[]);
    }
    // Whether the fallback landed (unknown) or not (a claim whose lock expired): outcome unknown.
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(problem_type(&r), "urn:idemgate:problem:outcome-unknown");
    // The proxy that saw the response still replays it from memory.
    assert_eq!(post(&p.a, "k-wfail", "{}", &[]).header("idempotent-replayed"), Some("true"));
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn the_write_after_forwarding_lands_even_when_the_client_has_left() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    // A long lock: only the outcome-unknown write, made by the root context after the client
    // left, can turn b's answer from "in flight" into "outcome unknown".
    let p = Pair::new(
        webdis.port,
        r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 60, "store": {"cluster": "idemgate_store", "timeout_ms": 500}}"#,
    );
    let h = [("authorization", "Bearer alice-secret-token"), ("idempotency-key", "k-left"), ("x-up-delay-ms", "1500")];
    let gone = http::request_timeout(p.a.port, "POST", "/charges", &h, b"{}", Duration::from_millis(300));
    assert!(gone.is_err());
    std::thread::sleep(Duration::from_millis(500));
    let r = post(&p.b, "k-left", "{}", &[]);
    assert_eq!(r.status, 409, "{}", r.body_text());
    assert_eq!(problem_type(&r), "urn:idemgate:problem:outcome-unknown");
    assert_eq!(p.up.executions(), 1);
}

#[test]
fn a_store_slower_than_its_timeout_is_unavailable() {
    // A listener that accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let p = Pair::new(port, &cfg(""));
    let started = std::time::Instant::now();
    let r = post(&p.a, "k-slow-store", "{}", &[]);
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(problem_type(&r), "urn:idemgate:problem:store-unavailable");
    // Hung, it would hold the request until the client gives up (20 s); 10 s leaves room for a
    // loaded machine.
    assert!(started.elapsed() < Duration::from_secs(10), "answered after the 2 s store timeout, not hung");
    assert_eq!(p.up.executions(), 0);
    drop(silent);
}
