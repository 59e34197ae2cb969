//! Issue 27: upgrading the local tier's layout (v3 -> v4) by a hot reload. Both modules run while
//! the old listener drains, and a claim of the old module may still be in flight: the new module
//! must honour the v3 record (409 while it runs, its response once it completes), never execute
//! the request again.

use crate::support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use support::http;
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// A commit of this repository whose local tier is layout v3.
const V3_COMMIT: &str = "56ef236";
const CFG: &str =
    r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 30, "local": {"max_entries": 1000}}"#;

/// The v3 module, built once from this repository's history (`git archive`) in a target
/// directory of its own.
fn v3_module() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = root.join("target/itest/v3-module.wasm");
    if out.exists() {
        return out;
    }
    let src = root.join("target/itest/v3-src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).expect("v3 source dir");
    let archive = Command::new("sh")
        .arg("-c")
        .arg(format!("git -C '{}' archive {V3_COMMIT} | tar -x -C '{}'", root.display(), src.display()))
        .status()
        .expect("git archive");
    assert!(archive.success(), "git archive {V3_COMMIT}");
    // Its own target directory: sharing this checkout's would put the v3 build where
    // `scripts/build-wasm.sh` takes this checkout's module from.
    let built = Command::new("scripts/build-wasm.sh").current_dir(&src).status().expect("build the v3 module");
    assert!(built.success(), "build the v3 module");
    std::fs::copy(src.join("dist/idemgate.wasm"), &out).expect("copy the v3 module");
    out
}

/// Polls `cond` up to `tries` times, 100 ms apart (bounded by count).
fn until(tries: u32, cond: impl Fn() -> bool) -> bool {
    for _ in 0..tries {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    cond()
}

/// A POST; `held`: the upstream holds its answer until `Upstream::release_holds`.
fn post(port: u16, key: &str, held: bool) -> http::Response {
    let mut h = vec![("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    if held {
        h.push(("x-up-hold", "1"));
    }
    http::request(port, "POST", "/charges", &h, b"{\"amount\":1}").expect("request")
}

#[test]
fn a_v3_claim_in_flight_during_a_reload_to_v4_is_never_executed_again() {
    let v3 = v3_module();
    let v4 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("dist/idemgate.wasm");
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(CFG, up.port);
    o.wasm = Some(v3);
    o.lds = true;
    o.drain_time_s = Some(30);
    // The first attempt is held by the upstream until the test lets it answer (not for a guessed
    // time the reload may outlast); the route must not time it out meanwhile.
    o.route_timeout_ms = 60_000;
    let e = Envoy::start(&o);
    let port = e.port;
    // The first attempt, through the v3 module, held at the upstream.
    let first = std::thread::spawn(move || post(port, "k-upgrade", true));
    assert!(until(100, || up.executions() == 1), "the first attempt reached the upstream");
    // Envoy's own stats (`Envoy::stat` reads idemgate's only).
    let envoy_stat = |e: &Envoy, name: &str| e.stats(name).into_iter().find(|(n, _)| n == name).map_or(0, |(_, v)| v);
    let updates = |e: &Envoy| envoy_stat(e, "listener_manager.lds.update_success");
    let before = updates(&e);
    o.wasm = Some(v4);
    e.reload_listener(&o);
    // The new listener active (none warming: new connections go to it), the old one draining
    // with v3's request, and the v4 module configured beside v3's table (its log line).
    support::wait_for("the new listener active", 400, || {
        updates(&e) > before && envoy_stat(&e, "listener_manager.total_listeners_warming") == 0
    });
    support::wait_for("the v4 module configured over v3's table", 400, || {
        e.log().contains("a local table of layout v3 is present")
    });
    // (A filter-chain-only change is made in place: the old filter chain drains, not the listener.)
    let draining = envoy_stat(&e, "listener_manager.total_listeners_draining")
        + envoy_stat(&e, "listener_manager.total_filter_chains_draining");
    assert!(draining >= 1, "the old listener (or filter chain) is not draining: {:?}", e.stats("draining"));
    // A retry on a new connection reaches the v4 module while v3's claim is in flight.
    let retry = post(port, "k-upgrade", false);
    assert_eq!(retry.status, 409, "in flight in v3: {}", retry.body_text());
    assert!(!first.is_finished(), "the first attempt answered before it was released");
    up.release_holds();
    let first = first.join().expect("first attempt");
    assert_eq!(first.status, 201, "{}", first.body_text());
    // Completed by the old module: the new one replays it.
    let again = post(port, "k-upgrade", false);
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(again.body, first.body);
    assert_eq!(up.executions(), 1, "executed once");
    e.assert_no_wasm_panic();
}
