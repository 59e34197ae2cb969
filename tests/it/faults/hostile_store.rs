//! A store that answers with hostile or lying bytes (a compromised webdis, a wrong service behind
//! the store cluster): idemgate refuses what it cannot verify, never traps, never executes a key
//! twice. The store is `support::store::FakeStore`, answering every request with the same bytes.

use crate::support;

use support::http::{self, Response};
use support::store::FakeStore;
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 3000}}"#;

fn post(envoy: &Envoy, key: &str) -> Response {
    let h = [("authorization", "Bearer alice"), ("idempotency-key", key)];
    http::request(envoy.port, "POST", "/charges", &h, b"{\"amount\": 5}").expect("request")
}

fn problem_type(r: &Response) -> String {
    r.json()["type"].as_str().unwrap_or("").to_string()
}

/// Nine nested RESP array headers claiming 8,000,000 elements each, then 24 MB of bytes: a
/// parser that sizes an allocation from a count it read allocates about 96 bytes per answer
/// byte at every level.
fn nested_array_bomb() -> Vec<u8> {
    let mut b = Vec::new();
    for _ in 0..9 {
        b.extend_from_slice(b"*8000000\r\n");
    }
    b.resize(b.len() + 24_000_000, b'x');
    b
}

#[test]
fn a_store_answering_nested_arrays_of_millions_of_elements_is_refused_without_a_trap() {
    let store = FakeStore::start(nested_array_bomb());
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.store_port = Some(store.port);
    let e = Envoy::start(&o);
    for i in 0..3 {
        let h = [("authorization", "Bearer alice"), ("idempotency-key", "bomb")];
        let r = http::request(e.port, "POST", "/charges", &h, format!("{i}").as_bytes()).unwrap_or_else(|err| {
            let log = e.log();
            let why: Vec<&str> =
                log.lines().filter(|l| l.contains("memory allocation") || l.contains("proxy_on_")).take(3).collect();
            panic!("attempt {i}: no answer ({err}); envoy log: {why:?}")
        });
        assert_eq!(r.status, 503, "attempt {i}: {}", r.body_text());
        assert!(problem_type(&r).ends_with("store-unavailable"), "attempt {i}: {}", r.body_text());
    }
    assert!(store.requests() >= 3, "the store was asked: {}", store.requests());
    assert_eq!(up.executions(), 0, "nothing executes on an answer that could not be understood");
    e.assert_no_wasm_panic();
}

/// A store that answers "claimed" (`{"1", now}`) to every claim-or-read, as a broken proxy, a
/// mock left in place or an attacker on the store link would: two proxies each believe they own
/// the key. The claim reply must echo the claim's owner token; one that does not is refused.
#[test]
fn a_store_that_answers_claimed_to_every_claim_never_lets_a_duplicate_execute() {
    let store = FakeStore::start(b"*2\r\n$1\r\n1\r\n$13\r\n1764000000000\r\n".to_vec());
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.store_port = Some(store.port);
    let a = Envoy::start(&o);
    let b = Envoy::start(&o);
    let mut seen = vec![];
    for (name, e) in [("a", &a), ("b", &b), ("a", &a), ("b", &b)] {
        let r = post(e, "same-key");
        seen.push(format!("{name}: {} {}", r.status, problem_type(&r)));
    }
    assert!(up.executions() <= 1, "executions {} != 1; answers: {seen:?}", up.executions());
    assert_eq!(up.executions(), 0, "a claim reply without the owner's echo is refused; answers: {seen:?}");
    a.assert_no_wasm_panic();
    b.assert_no_wasm_panic();
}
