//! TLS on the store link as shipped (issue 15 item 6): `envoy/store-tls/webdis-tls.yaml` (an Envoy
//! terminating mutual TLS in front of webdis, which serves plain HTTP only) and
//! `envoy/store-tls/idemgate-store-cluster.yaml` (idemgate's `idemgate_store` cluster with an
//! `UpstreamTlsContext`), rendered from the shipped files with certificates made at run time.
//! Two proxies share the store over TLS and a key still executes once; a proxy that cannot verify
//! the store, or that the store cannot verify, never forwards a protected request.

use crate::support;

use support::http::{self, Response};
use support::store::{Redis, Webdis};
use support::tls::{store_cluster, Pki, StoreTls};
use support::upstream::Upstream;
use support::{envoy_validate, Envoy, EnvoyOptions};

const PLUGIN: &str = r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#;

fn post(e: &Envoy, key: &str) -> Response {
    let h = [("authorization", "Bearer alice"), ("idempotency-key", key)];
    http::request(e.port, "POST", "/charges", &h, b"{\"amount\": 1}").expect("an answer")
}

/// A proxy whose `idemgate_store` cluster is `cluster` (no plain store cluster).
fn proxy(up: &Upstream, cluster: String) -> Envoy {
    let mut o = EnvoyOptions::new(PLUGIN, up.port);
    o.extra_clusters = vec![cluster];
    Envoy::start(&o)
}

/// Waits (bounded polls) until the proxy's store writes have landed.
fn settled(e: &Envoy) -> bool {
    (0..200).any(|_| {
        e.stat("idemgate.store_writes_pending") == 0 && e.stat("idemgate.store_writes") >= 1 || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            false
        }
    })
}

#[test]
fn two_proxies_share_the_store_over_verified_mutual_tls_and_a_key_executes_once() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let pki = Pki::generate("store");
    let tls = StoreTls::start(webdis.port, &pki);
    let (ok, out) = envoy_validate(&tls.config_path);
    assert!(ok, "envoy --mode validate refused the rendered webdis-tls.yaml:\n{out}");
    let up = Upstream::start();
    let a = proxy(&up, store_cluster(tls.port, &pki));
    let b = proxy(&up, store_cluster(tls.port, &pki));
    let first = post(&a, "k-tls");
    assert_eq!(first.status, 201, "{}", first.body_text());
    assert!(settled(&a), "a's completion never landed through TLS");
    let again = post(&b, "k-tls");
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions(), 1);
    // The proxies spoke TLS, and the terminator verified their certificates.
    for e in [&a, &b] {
        let handshakes: u64 = e.stats("idemgate_store.ssl.handshake").iter().map(|(_, v)| v).sum();
        assert!(handshakes >= 1, "no TLS handshake on the store cluster: {:?}", e.stats("idemgate_store.ssl"));
        e.assert_no_wasm_panic();
    }
    assert!(tls.stat("ssl.handshake") >= 2, "the terminator saw no handshake:\n{}", tls.log());
}

#[test]
fn a_proxy_that_cannot_verify_the_store_or_be_verified_by_it_never_forwards() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let pki = Pki::generate("store");
    let tls = StoreTls::start(webdis.port, &pki);
    let up = Upstream::start();
    // Another CA: the store's certificate does not verify (and this proxy's is not the store's CA's).
    let stranger = Pki::generate("stranger");
    let distrustful = proxy(&up, store_cluster(tls.port, &stranger));
    // The right CA but no client certificate: the terminator refuses the handshake.
    let shipped = store_cluster(tls.port, &pki);
    let anonymous_cluster: String = shipped
        .lines()
        .filter(|l| !["tls_certificates:", "certificate_chain:", "private_key:"].iter().any(|s| l.contains(s)))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(anonymous_cluster, shipped, "the shipped cluster presents a client certificate");
    let anonymous = proxy(&up, anonymous_cluster);
    for (who, e) in [("a proxy distrusting the store", &distrustful), ("a proxy without a certificate", &anonymous)] {
        let r = post(e, &format!("k-{}", e.port));
        assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{who}: {}", r.body_text());
        e.assert_no_wasm_panic();
    }
    assert_eq!(up.executions(), 0, "a request was forwarded without the store");
    // Refused for the right reasons: the proxy could not verify the store's certificate, and the
    // terminator found no client certificate.
    let unverified = distrustful.stats("idemgate_store.ssl.fail_verify_error");
    assert!(unverified.iter().any(|(_, v)| *v >= 1), "{:?}", distrustful.stats("idemgate_store.ssl"));
    assert!(tls.stat("ssl.fail_verify_no_cert") >= 1, "the terminator let a proxy without a certificate in");
}

/// The `transport_socket` of the shipped TLS cluster, from column 0.
fn shipped_transport_socket() -> String {
    let cluster = std::fs::read_to_string(support::repo_root().join("envoy/store-tls/idemgate-store-cluster.yaml"))
        .expect("read idemgate-store-cluster.yaml");
    let start = cluster.find("  transport_socket:").expect("the shipped cluster has a transport socket");
    cluster[start..].lines().map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l))).collect()
}

/// The commented `transport_socket` under a config's `idemgate_store` cluster, uncommented, from
/// column 0.
fn commented_transport_socket(config: &str) -> Option<String> {
    let start = config.find("    # transport_socket:")?;
    let block: String = config[start..]
        .lines()
        .take_while(|l| l.starts_with("    # "))
        .map(|l| format!("{}\n", &l["    # ".len()..]))
        .collect();
    Some(block)
}

#[test]
fn the_shipped_envoy_configs_show_the_tested_tls_transport_socket_and_validate_with_it() {
    let expected = shipped_transport_socket();
    let pki = Pki::generate("configs");
    for rel in [
        "envoy/demo/envoy.yaml.tmpl",
        "envoy/docker-compose/envoy.yaml",
        "envoy/two-proxies/envoy-a.yaml",
        "envoy/two-proxies/envoy-b.yaml",
    ] {
        let config = std::fs::read_to_string(support::repo_root().join(rel)).expect("read config");
        let shown =
            commented_transport_socket(&config).unwrap_or_else(|| panic!("{rel} shows no TLS transport socket"));
        assert_eq!(shown, expected, "{rel}: the commented transport socket differs from the tested one");
    }
    // Uncommented in the two-proxies example (with this run's certificates), Envoy accepts it.
    let rel = "envoy/two-proxies/envoy-a.yaml";
    let config = std::fs::read_to_string(support::repo_root().join(rel)).expect("read config");
    let uncommented = config.replace("    # transport_socket:", "    transport_socket:").replace("    #   ", "      ");
    let uncommented = uncommented.replace("/etc/idemgate/store-tls/", &format!("{}/", pki.dir.display()));
    let path = pki.dir.join("envoy-a-tls.yaml");
    std::fs::write(&path, uncommented).expect("write config");
    let (ok, out) = envoy_validate(&path);
    assert!(ok, "envoy --mode validate refused {rel} with its TLS transport socket:\n{out}");
}
