//! Least privilege on the store as shipped (issue 15 item 1): Redis loads `envoy/redis.conf` and
//! webdis the ACL and Redis credential of `envoy/docker-compose/webdis.json`, exactly as users
//! copy them. Every command idemgate does not send is refused through the store endpoint, with
//! and without webdis's credential, and also from inside a Lua script; idemgate itself still works.

use crate::support;

use std::process::{Command, Stdio};

use support::http;
use support::store::{basic_auth, pct, resp, Redis, Webdis, REDIS_IDEMGATE_PASSWORD};
use support::tls::Pki;
use support::upstream::Upstream;
use support::{envoy_validate, Envoy, EnvoyOptions};

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

/// Redis serving TLS only with the named users of `envoy/redis-acl/redis-acl.conf` (and
/// `envoy/redis.conf` without its `user` lines, as that file says), certificates from `pki`;
/// killed when dropped.
struct TlsRedis {
    port: u16,
    pki_dir: std::path::PathBuf,
    child: std::process::Child,
    _scratch: support::Scratch,
}

impl TlsRedis {
    fn start(pki: &Pki) -> TlsRedis {
        let scratch = support::Scratch::new("redis-acl");
        let root = support::repo_root();
        let base: String = std::fs::read_to_string(root.join("envoy/redis.conf"))
            .expect("read redis.conf")
            .lines()
            .filter(|l| !l.starts_with("user "))
            .map(|l| format!("{l}\n"))
            .collect();
        let acl = std::fs::read_to_string(root.join("envoy/redis-acl/redis-acl.conf"))
            .expect("read redis-acl.conf")
            .replace(REDIS_TLS_DIR, &format!("{}/", pki.dir.display()));
        std::fs::write(scratch.0.join("redis-acl.conf"), acl).expect("write");
        let conf = format!("{base}include {}\n", scratch.0.join("redis-acl.conf").display());
        std::fs::write(scratch.0.join("redis.conf"), conf).expect("write");
        let port = support::free_port();
        let log = std::fs::File::create(scratch.0.join("redis.log")).expect("log");
        let child = Command::new("redis-server")
            .arg(scratch.0.join("redis.conf"))
            .args(["--tls-port", &port.to_string(), "--dir", &scratch.0.display().to_string()])
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("redis-server");
        let r = TlsRedis { port, pki_dir: pki.dir.clone(), child, _scratch: scratch };
        support::wait_for("Redis answering over TLS", 400, || r.admin(&["PING"]).trim() == "PONG");
        r
    }

    /// `redis-cli` over TLS (with the proxy's client certificate) as `user`, or as no one.
    fn cli_as(&self, user: Option<(&str, &str)>, args: &[&str]) -> String {
        let d = &self.pki_dir;
        let mut c = Command::new("redis-cli");
        c.args(["-p", &self.port.to_string(), "--tls", "--no-auth-warning"])
            .arg("--cacert")
            .arg(d.join("ca.crt"))
            .arg("--cert")
            .arg(d.join("proxy.crt"))
            .arg("--key")
            .arg(d.join("proxy.key"));
        if let Some((u, p)) = user {
            c.args(["--user", u, "--pass", p]);
        }
        let out = c.args(args).output().expect("redis-cli");
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    fn admin(&self, args: &[&str]) -> String {
        self.cli_as(Some(support::store::REDIS_ADMIN), args)
    }

    /// How many idemgate keys Redis holds.
    fn keys_held(&self) -> usize {
        self.admin(&["--scan", "--pattern", "idemgate:v1:*"]).lines().count()
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the shipped Redis TLS files read their certificates.
const REDIS_TLS_DIR: &str = "/etc/idemgate/redis-tls/";

/// The Envoy `redis_proxy` of `envoy/redis-acl/redis-proxy.yaml` in front of `redis`, rendered
/// with `edit` applied; killed when dropped.
struct RedisProxy {
    port: u16,
    admin_port: u16,
    child: std::process::Child,
    scratch: support::Scratch,
}

impl RedisProxy {
    fn start(redis: &TlsRedis, edit: impl Fn(String) -> String) -> RedisProxy {
        let scratch = support::Scratch::new("redis-proxy");
        let (port, admin_port) = (support::free_port(), support::free_port());
        let values = [
            ("LISTEN_PORT", port.to_string()),
            ("ADMIN_PORT", admin_port.to_string()),
            ("REDIS_ADDRESS", "127.0.0.1".to_string()),
            ("REDIS_PORT", redis.port.to_string()),
        ];
        let text = support::tls::render(
            &support::tls::shipped("envoy/redis-acl/redis-proxy.yaml"),
            &values,
            "redis-proxy.yaml",
        )
        .replace(REDIS_TLS_DIR, &format!("{}/", redis.pki_dir.display()));
        let path = scratch.0.join("redis-proxy.yaml");
        std::fs::write(&path, edit(text)).expect("write");
        let (ok, out) = envoy_validate(&path);
        assert!(ok, "envoy --mode validate refused redis-proxy.yaml:\n{out}");
        let log = std::fs::File::create(scratch.0.join("envoy.log")).expect("log");
        let child = Command::new(support::envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--concurrency", "1", "--disable-hot-restart"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("envoy");
        let p = RedisProxy { port, admin_port, child, scratch };
        support::wait_for("the redis_proxy Envoy ready", 1200, || {
            http::get(admin_port, "/ready").is_ok_and(|r| r.status == 200)
        });
        p
    }

    /// One command through the proxy after webdis's `AUTH <password>`.
    fn command(&self, args: &[&[u8]]) -> String {
        use std::io::{BufReader, Write};
        let s = std::net::TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
        let mut bytes = resp::encode(&[b"AUTH", REDIS_IDEMGATE_PASSWORD.as_bytes()]);
        bytes.extend_from_slice(&resp::encode(args));
        (&s).write_all(&bytes).expect("write");
        let mut r = BufReader::new(&s);
        let auth = resp::read(&mut r).expect("AUTH answered");
        assert_eq!(auth, resp::Value::Status("OK".into()), "AUTH");
        format!("{:?}", resp::read(&mut r).expect("an answer"))
    }

    fn stat(&self, name: &str) -> u64 {
        let r = http::get(self.admin_port, "/stats").expect("stats");
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter_map(|l| l.split_once(": "))
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.scratch.0.join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for RedisProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 42 item 4: idemgate's proxies reach Redis as the named ACL user `idemgate` over Redis's
/// own TLS, through the shipped Envoy `redis_proxy` beside the shipped webdis (which can only send
/// `AUTH <password>` in plain text). Redis has no plain port and its default user is off. A key
/// executes once across two proxies; every command outside the user's grant is refused by Redis
/// (through the same path, and from a script); the same hop authenticating as `default` (no user
/// name) gets nothing, and idemgate answers 503 without forwarding.
#[test]
fn a_named_acl_user_over_redis_tls_protects_and_is_refused_everything_else() {
    let pki = Pki::generate_for("redis-acl", "redis.idemgate.internal");
    let redis = TlsRedis::start(&pki);
    redis.admin(&["SET", "idemgate:v1:victim", "a record"]);
    redis.admin(&["SET", "other:key", "not idemgate's"]);
    let proxy = RedisProxy::start(&redis, |t| t);
    let shipped = shipped_webdis();
    let credential = shipped_credential(&shipped).expect("the shipped webdis has a credential");
    assert_eq!(shipped["redis_auth"].as_str(), Some(REDIS_IDEMGATE_PASSWORD), "webdis's redis_auth");
    let webdis = Webdis::start_shipped(proxy.port, &shipped);

    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 2000}}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    o.vm_host_env.push(("IDEMGATE_STORE_AUTH".into(), credential.clone()));
    let (a, b) = (Envoy::start(&o), Envoy::start(&o));
    let h = [("authorization", "Bearer alice"), ("idempotency-key", "acl-named-1")];
    let first = http::request(a.port, "POST", "/charges", &h, b"{}").expect("request");
    assert_eq!(first.status, 201, "{}\nredis_proxy log:\n{}", first.body_text(), proxy.log());
    support::wait_writes_settled(&[&a], 200);
    let again = http::request(b.port, "POST", "/charges", &h, b"{}").expect("request");
    assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    assert_eq!(up.executions(), 1);
    for e in [&a, &b] {
        e.assert_no_wasm_panic();
    }
    // Redis saw idemgate's connections as the user `idemgate`, over TLS (no plain port exists).
    let clients = redis.admin(&["CLIENT", "LIST"]);
    assert!(clients.lines().any(|l| l.contains("user=idemgate ")), "no client as idemgate:\n{clients}");
    assert!(redis.admin(&["CONFIG", "GET", "port"]).lines().any(|l| l.trim() == "0"), "a plain port is open");
    assert_eq!(redis.keys_held(), 2, "the victim and the new record: {}", redis.admin(&["KEYS", "idemgate:v1:*"]));

    // Outside the grant: refused by Redis (NOPERM), through the same hop, by command, by key, and
    // from a script; nothing changed.
    let key = b"idemgate:v1:victim".as_slice();
    let refused: [(&str, Vec<&[u8]>); 7] = [
        ("FLUSHALL", vec![b"FLUSHALL"]),
        ("CONFIG SET", vec![b"CONFIG", b"SET", b"appendonly", b"no"]),
        ("SCRIPT FLUSH", vec![b"SCRIPT", b"FLUSH"]),
        ("GET of another key", vec![b"GET", b"other:key"]),
        ("SCAN", vec![b"SCAN", b"0"]),
        ("INFO", vec![b"INFO"]),
        ("FLUSHALL from a script", vec![b"EVAL", b"return redis.call('FLUSHALL')", b"1", key]),
    ];
    let mut allowed = vec![];
    for (what, args) in &refused {
        // An error (Envoy sums up a refused SCAN as "finished with 1 error(s)"); Redis's ACL log
        // below says it was Redis that refused, and why.
        let answer = proxy.command(args);
        if !answer.starts_with("Error(") {
            allowed.push(format!("{what}: {answer}"));
        }
    }
    assert!(allowed.is_empty(), "the named user was allowed: {allowed:#?}");
    let acl_log = redis.admin(&["ACL", "LOG", "50"]);
    for object in ["flushall", "config|set", "script|flush", "other:key", "scan", "info"] {
        assert!(acl_log.lines().any(|l| l == object), "Redis's ACL log has no refusal of {object}:\n{acl_log}");
    }
    assert!(acl_log.lines().any(|l| l == "idemgate"), "refusals not of the user idemgate:\n{acl_log}");
    assert!(!acl_log.lines().any(|l| l == "default"), "the default user tried:\n{acl_log}");
    // And within the grant, the same path answers (so the refusals above are Redis's ACL).
    let record = format!("{:?}", resp::Value::Bulk(Some(b"a record".to_vec())));
    assert_eq!(proxy.command(&[b"GET", key]), record, "GET of idemgate's key refused");
    assert!(redis.admin(&["CONFIG", "GET", "appendonly"]).contains("yes"));
    assert_eq!(redis.admin(&["GET", "other:key"]).trim(), "not idemgate's");
    // The default user is off: webdis's own password, sent straight to Redis, is refused.
    let direct = redis.cli_as(Some(("default", REDIS_IDEMGATE_PASSWORD)), &["GET", "idemgate:v1:victim"]);
    assert!(!direct.contains("a record"), "the default user reached Redis: {direct}");
    assert!(proxy.stat("cluster.redis.ssl.handshake") >= 1, "no TLS handshake to Redis");

    // The same hop without the user name (`AUTH <password>` as `default`): Redis refuses it, and
    // idemgate answers 503 and forwards nothing.
    let nameless = RedisProxy::start(&redis, |t| {
        let start = t.find("        auth_username:").expect("the shipped hop names a user");
        let end = t[start..].find("        auth_password:").expect("then its password") + start;
        format!("{}{}", &t[..start], &t[end..])
    });
    let webdis_default = Webdis::start_shipped(nameless.port, &shipped);
    let mut o2 = o.clone();
    o2.store_port = Some(webdis_default.port);
    let c = Envoy::start(&o2);
    let h2 = [("authorization", "Bearer alice"), ("idempotency-key", "acl-named-2")];
    let r = http::request(c.port, "POST", "/charges", &h2, b"{}").expect("request");
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{}", r.body_text());
    assert_eq!(up.executions(), 1, "forwarded without the store");
    c.assert_no_wasm_panic();
}
