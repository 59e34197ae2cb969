//! Least privilege on the store as shipped (issue 15 item 1): Redis loads `envoy/redis.conf` and
//! webdis the ACL and Redis credential of `envoy/docker-compose/webdis.json`, exactly as users
//! copy them. Every command idemgate does not send is refused through the store endpoint, with
//! and without webdis's credential, and also from inside a Lua script; idemgate itself still works.

use crate::support;

use support::http;
use support::store::{basic_auth, pct, Redis, Webdis};
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

/// The webdis configuration users copy.
fn shipped_webdis() -> serde_json::Value {
    let path = support::repo_root().join("envoy/docker-compose/webdis.json");
    serde_json::from_slice(&std::fs::read(path).expect("read webdis.json")).expect("webdis.json is JSON")
}

/// The HTTP basic-auth credential ("user:password") the shipped webdis ACL grants commands to.
fn shipped_credential(webdis: &serde_json::Value) -> Option<String> {
    webdis["acl"].as_array()?.iter().find_map(|a| a["http_basic_auth"].as_str().map(str::to_string))
}

fn send(w: &Webdis, credential: Option<&str>, command: &str) -> http::Response {
    let auth = credential.map(basic_auth);
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    http::request(w.port, "POST", "/", &headers, format!("{command}.raw").as_bytes()).expect("webdis answers")
}

#[test]
fn the_shipped_store_refuses_every_command_idemgate_does_not_send() {
    let shipped = shipped_webdis();
    let credential = shipped_credential(&shipped);
    let redis = Redis::start();
    redis.command(&[b"SET", b"idemgate:v1:victim", b"a record"]);
    let webdis = Webdis::start_shipped(redis.port, &shipped);
    let key = pct("idemgate:v1:victim");
    let commands = [
        "FLUSHALL".to_string(),
        format!("DEL/{key}"),
        format!("SET/{key}/forged"),
        "CONFIG/SET/appendonly/no".to_string(),
        "KEYS/*".to_string(),
        // EVALSHA needs no SCRIPT command: EVAL loads a script Redis lost.
        "SCRIPT/FLUSH".to_string(),
        format!("SCRIPT/LOAD/{}", pct("return 1")),
    ];
    let mut allowed = vec![];
    for command in &commands {
        for (who, cred) in [("without the credential", None), ("with the credential", credential.as_deref())] {
            let r = send(&webdis, cred, command);
            if r.status == 200 {
                allowed.push(format!("{command} {who}: {} {}", r.status, r.body_text()));
            }
        }
        // The same command from a script idemgate's credential may run.
        let name = command.split('/').next().unwrap_or_default();
        let script = match name {
            "FLUSHALL" | "KEYS" => format!("return redis.call('{name}'{})", if name == "KEYS" { ",'*'" } else { "" }),
            "CONFIG" => "return redis.call('CONFIG','SET','appendonly','no')".to_string(),
            "SCRIPT" => "return redis.call('SCRIPT','FLUSH')".to_string(),
            _ => format!("return redis.call('{name}','other:key','x')"),
        };
        let r = send(&webdis, credential.as_deref(), &format!("EVAL/{}/0", pct(&script)));
        if r.status == 200 && !r.body_text().starts_with('-') {
            allowed.push(format!("EVAL {script:?} with the credential: {}", r.body_text()));
        }
    }
    assert!(allowed.is_empty(), "the store endpoint allowed: {allowed:#?}");
    // Nothing was changed: the victim record is still there, AOF still on.
    assert_eq!(redis.get_raw("idemgate:v1:victim"), Some(b"a record".to_vec()));
    assert!(redis.cli(&["CONFIG", "GET", "appendonly"]).contains("yes"));
    // Redis itself refuses a client without a password.
    let anonymous = support::store::resp::command_anonymous(redis.port, &[b"KEYS", b"*"]).expect("redis answers");
    assert!(format!("{anonymous:?}").contains("NOAUTH"), "redis answered an anonymous client: {anonymous:?}");

    // idemgate works through the same store with the credential from the VM's environment.
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000}}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    if let Some(c) = &credential {
        o.vm_host_env.push(("IDEMGATE_STORE_AUTH".into(), c.clone()));
    }
    let e = Envoy::start(&o);
    let h = [("authorization", "Bearer alice"), ("idempotency-key", "acl-1")];
    for _ in 0..2 {
        let r = http::request(e.port, "POST", "/charges", &h, b"{}").expect("request");
        assert_eq!(r.status, 201, "{}", r.body_text());
    }
    assert_eq!(up.executions(), 1);
    assert_eq!(redis.keys("idemgate:v1:*").len(), 2, "the victim and the new record");
    e.assert_no_wasm_panic();
}
