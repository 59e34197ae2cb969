//! Envoy 1.40 loads dist/idemgate.wasm, accepts a good configuration and refuses a bad one
//! with a log line naming the field.

use crate::support;

use support::{http, upstream::Upstream, Envoy, EnvoyOptions, Started};

#[test]
fn envoy_loads_the_module_with_a_good_configuration_and_traffic_flows() {
    let up = Upstream::start();
    let envoy = Envoy::start(&EnvoyOptions::new(r#"{"scope": {"headers": ["authorization"]}}"#, up.port));
    let r = http::request(envoy.port, "GET", "/hello", &[], b"").expect("request through envoy");
    assert_eq!(r.status, 201, "{}", r.body_text());
    assert_eq!(up.executions(), 1);
    assert!(envoy.log().contains("idemgate: configuration accepted"), "{}", envoy.log());
    envoy.assert_no_wasm_panic();
}

#[test]
fn envoy_refuses_to_start_with_a_bad_configuration_and_names_the_field() {
    let cases = [
        (r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 0}"#, "field `ttl_seconds`"),
        (r#"{"scope": {"headers": ["authorization"]}, "colour": "blue"}"#, "field `colour`: unknown field"),
        (r#"{}"#, "field `scope.headers`"),
        (r#"{"scope": "#, "not valid JSON"),
    ];
    for (config, needle) in cases {
        match Envoy::try_start(&EnvoyOptions::new(config, support::free_port())) {
            Started::Ready(envoy) => panic!("envoy started with bad config {config}; log:\n{}", envoy.log()),
            Started::Exited { code, log } => {
                assert_ne!(code, Some(0), "envoy must fail for {config}");
                assert!(log.contains(needle), "log for {config} lacks `{needle}`:\n{log}");
            }
        }
    }
}

/// The configuration is read by serde derive (src/config.rs): a key given twice, which a plain
/// JSON reader resolves by keeping the last one, is refused; a wrong type deep in a route names
/// its whole path.
#[test]
fn envoy_refuses_a_key_given_twice_and_a_nested_wrong_type_naming_the_path() {
    let cases = [
        (
            r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 0, "ttl_seconds": 100}"#,
            "field `ttl_seconds`: duplicate field",
        ),
        (
            r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/", "forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": "1500"}}]}"#,
            "field `routes[0].upstream.timeout_ms`: invalid type: string",
        ),
    ];
    for (config, needle) in cases {
        match Envoy::try_start(&EnvoyOptions::new(config, support::free_port())) {
            Started::Ready(envoy) => panic!("envoy started with bad config {config}; log:\n{}", envoy.log()),
            Started::Exited { code, log } => {
                assert_ne!(code, Some(0), "envoy must fail for {config}");
                assert!(log.contains(needle), "log for {config} lacks `{needle}`:\n{log}");
            }
        }
    }
}

#[test]
fn envoy_refuses_a_detached_upstream_timeout_that_outlives_the_lock_or_the_record() {
    let cases = [
        // The default timeout (30 s) with a 3 s record and a 2 s lock.
        r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 3, "lock_ttl_seconds": 2, "forwarding": "detached", "upstream": {"cluster": "upstream"}}"#,
        r#"{"scope": {"headers": ["authorization"]}, "lock_ttl_seconds": 5, "forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": 5000}}"#,
        r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/", "lock_ttl_seconds": 1, "forwarding": "detached", "upstream": {"cluster": "upstream", "timeout_ms": 1500}}]}"#,
    ];
    for config in cases {
        match Envoy::try_start(&EnvoyOptions::new(config, support::free_port())) {
            Started::Ready(envoy) => panic!("envoy started with {config}; log:\n{}", envoy.log()),
            Started::Exited { code, log } => {
                assert_ne!(code, Some(0), "envoy must fail for {config}");
                assert!(log.contains("upstream.timeout_ms`"), "log for {config} names no field:\n{log}");
                assert!(log.contains("lock_ttl_seconds"), "log for {config} does not say why:\n{log}");
            }
        }
    }
}
