//! The store test support works: Redis 7.0 with envoy/redis.conf (AOF; its default user opened,
//! since these tests write keys outside idemgate's prefix), webdis (with and without
//! basic auth), and a Redis Cluster behind Envoy's redis_proxy behind webdis.

use crate::support;

use std::time::Duration;
use support::store::{self, resp, Redis, RedisCluster, Webdis};

#[test]
fn base64_and_percent_encoding_helpers() {
    assert_eq!(store::base64(b""), "");
    assert_eq!(store::base64(b"f"), "Zg==");
    assert_eq!(store::base64(b"fo"), "Zm8=");
    assert_eq!(store::base64(b"foo"), "Zm9v");
    assert_eq!(store::base64(b"user:password"), "dXNlcjpwYXNzd29yZA==");
    assert_eq!(store::base64(&[0xff, 0x00, 0xfe]), "/wD+");
    assert_eq!(store::pct("a.b/c d%'"), "a%2Eb%2Fc%20d%25%27");
    assert_eq!(resp::parse(b"$2\r\nv1\r\n").unwrap(), resp::Value::Bulk(Some(b"v1".to_vec())));
    assert_eq!(resp::parse(b"$-1\r\n").unwrap(), resp::Value::Bulk(None));
}

#[test]
fn webdis_in_front_of_redis_round_trips_text_and_binary_values() {
    let redis = Redis::start_open();
    let webdis = Webdis::start(redis.port);

    let r = webdis.post("SET/k1/v1");
    assert_eq!((r.status, r.json()), (200, serde_json::json!({"SET": [true, "OK"]})), "{}", r.body_text());
    let r = webdis.post("GET/k1.raw");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, b"$2\r\nv1\r\n");

    let value: &[u8] = b"a\x00b\xff\r\n.c/d\x00";
    let r = webdis.request("PUT", "/SET/kb", value).expect("PUT to webdis");
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(redis.get_raw("kb").as_deref(), Some(value));
    let r = webdis.post("GET/kb.raw");
    assert_eq!(resp::parse(&r.body).unwrap(), resp::Value::Bulk(Some(value.to_vec())));

    // Percent-escapes (either case) reach Redis decoded.
    let r = webdis.post(&format!("SET/{}/{}", store::pct("idem:k.2"), store::pct("claim/owner.1")));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(redis.get_raw("idem:k.2").as_deref(), Some(&b"claim/owner.1"[..]));
    webdis.post("SET/k3/a%2eb%2Fc");
    assert_eq!(redis.get_raw("k3").as_deref(), Some(&b"a.b/c"[..]));

    assert_eq!(redis.keys("*"), ["idem:k.2", "k1", "k3", "kb"]);
    assert_eq!(redis.keys("k?"), ["k1", "k3", "kb"]);
    assert_eq!(redis.get_raw("missing"), None);
    let all = redis.dump_all_values();
    assert_eq!(all.len(), 4);
    assert_eq!(all[3], ("kb".to_string(), value.to_vec()));
    assert_eq!(redis.cli(&["GET", "k1"]).trim(), "v1");

    // DEBUG is refused by the ACL.
    let r = webdis.request("GET", "/DEBUG/SLEEP/0", b"").unwrap();
    assert_eq!(r.status, 403);
}

#[test]
fn aof_keeps_a_write_across_kill9_and_restart() {
    let mut redis = Redis::start_open();
    let webdis = Webdis::start(redis.port);
    assert_eq!(webdis.post("SET/durable/yes").status, 200);
    std::thread::sleep(Duration::from_millis(1500));
    redis.kill9();
    let r = webdis.post("GET/durable");
    assert_eq!(r.status, 503, "webdis answers 503 while redis is down: {}", r.body_text());
    redis.restart();
    assert_eq!(redis.get_raw("durable").as_deref(), Some(&b"yes"[..]));
    assert!(redis.dir().join("appendonlydir").is_dir());
    // webdis reconnects by itself.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = webdis.post("GET/durable");
        if r.status == 200 {
            assert_eq!(r.json(), serde_json::json!({"GET": "yes"}));
            break;
        }
        assert!(std::time::Instant::now() < deadline, "webdis did not reconnect: {} {}", r.status, r.body_text());
        std::thread::sleep(Duration::from_millis(50));
    }

    // The same folder and port serve a new Redis after this one is gone.
    let (dir, port) = (redis.dir(), redis.port);
    redis.kill9();
    let again = Redis::start_in(&dir, port);
    assert_eq!(again.get_raw("durable").as_deref(), Some(&b"yes"[..]));
}

#[test]
fn webdis_with_basic_auth_refuses_anonymous_clients() {
    let redis = Redis::start_open();
    let mut webdis = Webdis::start_with_auth(redis.port, "idem:s3cret");
    for (path, body) in [("/PING", &b""[..]), ("/GET/k", b"")] {
        let r = support::http::request(webdis.port, "GET", path, &[], body).unwrap();
        assert_eq!(r.status, 403, "anonymous {path}: {}", r.body_text());
    }
    let r = support::http::request(webdis.port, "POST", "/", &[], b"SET/k/v").unwrap();
    assert_eq!(r.status, 403);
    let wrong = format!("Basic {}", store::base64(b"idem:wrong"));
    let r = support::http::request(webdis.port, "GET", "/PING", &[("authorization", &wrong)], b"").unwrap();
    assert_eq!(r.status, 403);
    let good = format!("Basic {}", store::base64(b"idem:s3cret"));
    let r = support::http::request(webdis.port, "POST", "/", &[("authorization", &good)], b"SET/k/v").unwrap();
    assert_eq!((r.status, r.json()), (200, serde_json::json!({"SET": [true, "OK"]})), "{}", r.body_text());
    let r = support::http::request(webdis.port, "GET", "/DEBUG/SLEEP/0", &[("authorization", &good)], b"").unwrap();
    assert_eq!(r.status, 403, "DEBUG stays disabled for the user");
    assert_eq!(redis.get_raw("k").as_deref(), Some(&b"v"[..]));

    // Restart keeps port and configuration.
    let port = webdis.port;
    webdis.kill9();
    assert!(support::http::get(port, "/PING").is_err());
    webdis.restart();
    assert_eq!(webdis.port, port);
    assert_eq!(webdis.post("GET/k").json(), serde_json::json!({"GET": "v"}));
}

#[test]
fn redis_cluster_behind_envoy_behind_webdis_runs_single_key_scripts_on_the_owning_node() {
    let cluster = RedisCluster::start();
    let (ok, out) = support::envoy_validate(cluster.envoy_config_path());
    assert!(ok, "envoy --mode validate failed:\n{out}");

    let script = "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', 60000)";
    let keys: Vec<String> = (0..30).map(|i| format!("idem:smoke:{i}")).collect();
    for key in &keys {
        let r = cluster.webdis.post(&format!("EVAL/{}/1/{}/v.raw", store::pct(script), store::pct(key)));
        assert_eq!((r.status, r.body_text().as_str()), (200, "+OK\r\n"), "first EVAL for {key}");
    }
    for key in &keys {
        let r = cluster.webdis.post(&format!("EVAL/{}/1/{}/v.raw", store::pct(script), store::pct(key)));
        assert_eq!((r.status, r.body_text().as_str()), (200, "$-1\r\n"), "second EVAL for {key}");
        assert_eq!(cluster.get_raw(key).as_deref(), Some(&b"v"[..]));
    }

    let mut used = std::collections::BTreeSet::new();
    for key in &keys {
        let port = cluster.node_of(key);
        assert!(cluster.node_ports().contains(&port));
        used.insert(port);
    }
    let per_node: Vec<usize> = cluster.nodes.iter().map(|n| n.keys("idem:smoke:*").len()).collect();
    assert!(per_node.iter().filter(|&&n| n > 0).count() >= 2, "keys on one node only: {per_node:?}");
    assert_eq!(per_node.iter().sum::<usize>(), 30, "{per_node:?}");
    assert_eq!(used.len(), per_node.iter().filter(|&&n| n > 0).count());
    assert_eq!(cluster.keys("idem:smoke:*").len(), 30);
    assert_eq!(cluster.dump_all_values().len(), 30);

    // SET ... NX GET through the whole chain: claim, then read the existing claim.
    let r = cluster.webdis.post("SET/idem:ng/owner%2e1/NX/PX/60000/GET");
    assert_eq!(r.json(), serde_json::json!({"SET": null}), "{}", r.body_text());
    let r = cluster.webdis.post("SET/idem:ng/owner%2e2/NX/PX/60000/GET");
    assert_eq!(r.json(), serde_json::json!({"SET": "owner.1"}), "{}", r.body_text());
}

/// Issue 39, item 1. A webdis that cannot bind its port (another test's webdis holds it) exits
/// with status 0 after logging "Address already in use"; until it exits, the other webdis
/// answers `GET /PING`. The support took that answer for its own webdis: the test's proxies
/// then claimed and wrote through another test's webdis into another test's Redis, silently
/// (every write landed; nothing logged), and the test's own Redis never saw them, which is how
/// `two_proxies::an_outcome_unknown_record_lives_unknown_outcome_seconds_on_every_proxy` saw
/// "its outcome-unknown write never reached the store". Now the start fails loudly, and nothing
/// written through it can reach the other test's Redis.
#[test]
fn a_webdis_whose_port_another_webdis_holds_never_starts_as_that_one() {
    let (redis_a, redis_b) = (Redis::start_open(), Redis::start_open());
    let webdis_a = Webdis::start(redis_a.port);
    let port = webdis_a.port;
    let started = std::panic::catch_unwind(|| {
        let impostor = Webdis::start_on_port(redis_b.port, port);
        // Before: this returned, and its writes went to redis_a.
        let r = impostor.post("SET/k-impostor/v");
        (r.status, impostor.pid())
    });
    let message = match &started {
        Ok(r) => panic!("a webdis that could not bind its port was taken for started: {r:?}"),
        Err(e) => e.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(message.contains("exited"), "{message}");
    assert_eq!(redis_a.get_raw("k-impostor"), None, "a write meant for redis_b reached redis_a");
    assert_eq!(redis_b.get_raw("k-impostor"), None);
}

/// `free_port` never hands out the same port twice in one process, even while none of them is
/// listening yet (two tests choosing their ports before either starts its server).
#[test]
fn free_port_never_hands_out_a_port_twice() {
    let ports: Vec<u16> = (0..300).map(|_| support::free_port()).collect();
    let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
    assert_eq!(distinct.len(), ports.len());
}
