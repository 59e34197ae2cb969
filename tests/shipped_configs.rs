//! The configs users copy stay true: the compose flavour is the rendering of the demo template,
//! Envoy validates it, and every file it refers to exists.

mod support;

use std::process::Command;

#[test]
fn the_compose_envoy_config_is_the_rendering_of_the_demo_template() {
    let root = support::repo_root();
    let out = Command::new("bash").arg(root.join("scripts/render-compose.sh")).output().expect("render");
    assert!(out.status.success());
    let committed = std::fs::read(root.join("envoy/docker-compose/envoy.yaml")).unwrap();
    assert!(
        out.stdout == committed,
        "envoy/docker-compose/envoy.yaml drifted: run scripts/render-compose.sh > envoy/docker-compose/envoy.yaml"
    );
}

#[test]
fn envoy_validates_the_compose_flavour_and_idemgate_accepts_its_configuration() {
    let root = support::repo_root();
    let text = std::fs::read_to_string(root.join("envoy/docker-compose/envoy.yaml")).unwrap();
    // The module sits at /etc/envoy in the container; validate with the one built here.
    let scratch = support::Scratch::new("compose");
    let path = scratch.0.join("envoy.yaml");
    std::fs::write(&path, text.replace("/etc/envoy/idemgate.wasm", &support::wasm_path().display().to_string()))
        .unwrap();
    let (ok, log) = support::envoy_validate(&path);
    assert!(ok, "{log}");
    assert!(log.contains("configuration accepted"), "{log}");
}

#[test]
fn the_compose_file_refers_only_to_files_that_exist() {
    let root = support::repo_root();
    let dir = root.join("envoy/docker-compose");
    let compose = std::fs::read_to_string(dir.join("docker-compose.yaml")).unwrap();
    for service in ["envoy:", "redis:", "webdis:", "payments-api:"] {
        assert!(compose.contains(&format!("\n  {service}")), "service {service} missing");
    }
    for rel in ["./envoy.yaml", "../redis.conf", "./webdis.json", "Dockerfile.payments-api"] {
        assert!(compose.contains(rel), "{rel} not referenced");
        let p = dir.join(rel);
        assert!(p.exists(), "{} does not exist", p.display());
    }
    assert!(compose.contains("../../dist/idemgate.wasm") && compose.contains("envoyproxy/envoy:v1.40.0"));
    let webdis: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("webdis.json")).unwrap()).unwrap();
    assert_eq!(webdis["redis_host"], "redis");
    assert!(std::fs::read_to_string(root.join("envoy/oci/Dockerfile")).unwrap().contains("FROM scratch"));
}
