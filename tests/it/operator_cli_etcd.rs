//! The operator's command line (`idemgate --etcd`, src/bin/idemgate/etcd_store.rs) against
//! records two real Envoys wrote with `store.kind: "etcd"` into a real three-member etcd (Debian
//! `etcd-server` 3.4), in front of one counting upstream. Every settlement test asserts how many
//! times the upstream executed and what etcd holds; every wait is a bounded count of looks.

use crate::support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Output;
use std::time::Duration;

use serde_json::json;
use support::etcd::EtcdCluster;
use support::http::{self, Response};
use support::operator::{text, OperatorCli};
use support::upstream::Upstream;
use support::{free_port, Envoy, EnvoyOptions, Scratch};

const CALLER: &str = "Bearer alice-secret-token";
const ETCD_USER: &str = "idemgate";
const ETCD_PASSWORD: &str = "etcd-pw-cli-71c2";

fn plugin() -> String {
    r#"{"scope": {"headers": ["authorization"]}, "store": {"kind": "etcd", "cluster": "idemgate_store", "timeout_ms": 1000}}"#
        .to_string()
}

struct Stack {
    up: Upstream,
    /// The proxy the tests send to first.
    a: Envoy,
    /// A second proxy on the same etcd, whose local tier never saw the first one's keys.
    b: Envoy,
    /// `IDEMGATE_STORE_AUTH` of the proxies and of the CLI (etcd's auth on), if any.
    auth: Option<String>,
    /// `--etcd` for the CLI: every member, comma-separated.
    urls: String,
}

impl Stack {
    fn start(etcd: &EtcdCluster, auth: Option<&str>) -> Stack {
        let up = Upstream::start();
        let mut o = EnvoyOptions::new(&plugin(), up.port);
        o.etcd_ports = etcd.client_ports();
        // Held requests (`x-up-hold`) stay in flight until released, not until a route timeout.
        o.route_timeout_ms = 60_000;
        if let Some(a) = auth {
            o.vm_env.push(("IDEMGATE_STORE_AUTH".into(), a.into()));
        }
        let a = Envoy::start(&o);
        let b = Envoy::start(&o);
        for e in [&a, &b] {
            support::etcd::wait_leases(e, o.concurrency);
        }
        let urls = etcd.client_ports().iter().map(|p| format!("http://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
        Stack { up, a, b, auth: auth.map(str::to_string), urls }
    }

    fn post_to(&self, e: &Envoy, key: &str, extra: &[(&str, &str)]) -> Response {
        let mut h: Vec<(&str, &str)> = vec![("authorization", CALLER), ("idempotency-key", key)];
        h.extend_from_slice(extra);
        http::request(e.port, "POST", "/charges", &h, br#"{"amount":5}"#).expect("request")
    }

    /// `idemgate --etcd <every member> ARGS`, with the stack's credential.
    fn cli(&self, args: &[&str]) -> Output {
        self.ops().run(args)
    }

    fn ops(&self) -> OperatorCli {
        OperatorCli::etcd(&self.urls, self.auth.as_deref())
    }

    fn storage_key(&self, key: &str) -> String {
        self.ops().storage_key(CALLER, key)
    }

    fn listed(&self, state: &str) -> Vec<String> {
        self.ops().listed(state)
    }

    fn wait_listed(&self, state: &str, skey: &str) {
        self.ops().wait_listed(state, skey, || format!("store_writes={}", self.a.stat("idemgate.store_writes")))
    }

    fn inspect(&self, skey: &str) -> serde_json::Value {
        self.ops().inspect(skey)
    }

    /// A key whose request executed but whose answer was lost (the upstream reset after running
    /// it): outcome-unknown in etcd, 409 on a retry, executed once.
    fn outcome_unknown(&self, key: &str) -> String {
        let before = self.up.executions();
        let r = self.post_to(&self.a, key, &[("x-up-reset", "before-headers")]);
        assert!(r.status >= 500, "{}: {}", r.status, r.body_text());
        let skey = self.storage_key(key);
        self.wait_listed("outcome-unknown", &skey);
        let again = self.post_to(&self.a, key, &[]);
        assert_eq!((again.status, again.problem().as_str()), (409, "outcome-unknown"), "{}", again.body_text());
        assert_eq!(self.up.executions(), before + 1);
        skey
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.a.assert_no_wasm_panic();
            self.b.assert_no_wasm_panic();
        }
    }
}

/// The etcd keys under `idemgate/v1/<skey>` (value, owner mark, tombstones), as text.
fn etcd_keys_of(etcd: &EtcdCluster, skey: &str) -> Vec<String> {
    let prefix = format!("{}{skey}", idemgate::etcd::KEY_PREFIX);
    etcd.all()
        .into_iter()
        .map(|(k, _)| String::from_utf8_lossy(&k).into_owned())
        .filter(|k| k.starts_with(&prefix))
        .collect()
}

/// The lease a key was put with and its TTL left (s), as etcd reports them.
fn lease_of(etcd: &EtcdCluster, key: &str) -> (i64, i64) {
    let l = etcd.wait_leader();
    let r = etcd.call(l, "/v3/kv/range", &json!({"key": idemgate::base64::b64(key.as_bytes())})).expect("etcd range");
    let id: i64 = r["kvs"][0]["lease"].as_str().unwrap_or("0").parse().expect("lease id");
    let ttl = etcd.call(l, "/v3/lease/timetolive", &json!({"ID": id.to_string()})).expect("lease ttl");
    (id, ttl["TTL"].as_str().unwrap_or("-1").parse().expect("ttl"))
}

#[test]
fn etcd_cli_inspects_and_lists_completed_in_flight_and_outcome_unknown_keys() {
    let etcd = EtcdCluster::start();
    let s = Stack::start(&etcd, None);
    let done = s.post_to(&s.a, "k-done", &[]);
    assert_eq!(done.status, 201, "{}", done.body_text());
    let done_key = s.storage_key("k-done");
    s.wait_listed("completed", &done_key);
    let rec = s.inspect(&done_key);
    assert_eq!((rec["state"].as_str(), rec["status"].as_u64()), (Some("completed"), Some(201)), "{rec}");
    assert_eq!(rec["storage_key"], done_key.as_str());
    assert!(rec["store_expires_at_ms"].as_u64().is_some_and(|e| e > rec["now_ms"].as_u64().unwrap_or(0)), "{rec}");
    let unknown_key = s.outcome_unknown("k-unknown");
    // In flight: held by the upstream until released.
    let port = s.a.port;
    let held = std::thread::spawn(move || {
        let h = [("authorization", CALLER), ("idempotency-key", "k-busy"), ("x-up-hold", "1")];
        http::request(port, "POST", "/charges", &h, br#"{"amount":5}"#).expect("request")
    });
    let busy_key = s.storage_key("k-busy");
    s.wait_listed("in-flight", &busy_key);
    let out = s.cli(&["list", "--state", "in-flight"]);
    let line = text(&out.stdout).lines().find(|l| l.starts_with(&busy_key)).map(str::to_string).unwrap_or_default();
    assert!(line.contains("lock live"), "{line}");
    let rec = s.inspect(&busy_key);
    assert_eq!((rec["state"].as_str(), rec["lock"].as_str()), (Some("in-flight"), Some("live")), "{rec}");
    // Each key in its own state only.
    assert_eq!(s.listed("completed"), vec![done_key.clone()]);
    assert_eq!(s.listed("outcome-unknown"), vec![unknown_key.clone()]);
    assert_eq!(s.listed("in-flight"), vec![busy_key.clone()]);
    // Nothing settles a live claim: its request may still be running.
    for args in [
        &["resolve", &busy_key, "--release"][..],
        &["resolve", &busy_key, "--complete", "--status", "200"],
        &["forget", &busy_key],
    ] {
        let out = s.cli(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out.stdout));
        assert!(text(&out.stderr).contains("in flight"), "{args:?}: {}", text(&out.stderr));
    }
    assert_eq!(s.inspect(&busy_key)["state"], "in-flight", "etcd still holds the claim");
    s.up.release_holds();
    assert_eq!(held.join().expect("held request").status, 201);
    s.wait_listed("completed", &busy_key);
    assert_eq!(s.up.executions(), 3, "k-done, k-unknown, k-busy: once each");
    // A member that does not answer is skipped for the next one in the list.
    let dead = format!("http://127.0.0.1:{},{}", free_port(), s.urls);
    let out = OperatorCli::etcd(&dead, None).run(&["inspect", &done_key]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // `--limit` bounds the listing; an absent key is "absent".
    let out = s.cli(&["list", "--state", "completed", "--limit", "1"]);
    assert_eq!(text(&out.stdout).lines().count(), 1);
    let absent = "0".repeat(64);
    assert_eq!(text(&s.cli(&["inspect", &absent]).stdout).trim(), "absent");
}

#[test]
fn etcd_cli_releases_an_outcome_unknown_key_and_the_retry_executes_once() {
    let etcd = EtcdCluster::start();
    let s = Stack::start(&etcd, None);
    let skey = s.outcome_unknown("k-release");
    assert_eq!(etcd_keys_of(&etcd, &skey).len(), 2, "value and owner mark");
    let out = s.cli(&["resolve", &skey, "--release"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(etcd_keys_of(&etcd, &skey), Vec::<String>::new(), "value and owner mark deleted");
    assert_eq!(text(&s.cli(&["inspect", &skey]).stdout).trim(), "absent");
    // The proxy that saw the outcome go unknown keeps its own record (an absent store key is no
    // proof the key never ran): still 409 there.
    let origin = s.post_to(&s.a, "k-release", &[]);
    assert_eq!((origin.status, origin.problem().as_str()), (409, "outcome-unknown"));
    assert_eq!(s.up.executions(), 1);
    // The client's retry on the other proxy executes, once.
    let retry = s.post_to(&s.b, "k-release", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(s.up.executions(), 2, "the released key executes once more, on the retry");
    s.wait_listed("completed", &skey);
    for e in [&s.b, &s.a] {
        let again = s.post_to(e, "k-release", &[]);
        assert_eq!((again.status, again.header("idempotent-replayed")), (201, Some("true")), "{}", again.body_text());
    }
    assert_eq!(s.up.executions(), 2);
    // Released twice? The key is completed now: refused.
    let out = s.cli(&["resolve", &skey, "--release"]);
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn etcd_cli_completes_an_outcome_unknown_key_under_a_lease_and_retries_replay_it() {
    let etcd = EtcdCluster::start();
    let s = Stack::start(&etcd, None);
    let skey = s.outcome_unknown("k-complete");
    let scratch = Scratch::new("operator-cli-etcd");
    let body = scratch.0.join("found.json");
    std::fs::write(&body, br#"{"id":"ch_found_upstream"}"#).expect("write body");
    let body = body.to_str().expect("path");
    let args = ["resolve", &skey, "--complete", "--status", "201", "--body-file", body];
    let out = s.cli(&[&args[..], &["--header", "content-type: application/json", "--ttl-seconds", "3600"]].concat());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rec = s.inspect(&skey);
    assert_eq!(
        (rec["state"].as_str(), rec["status"].as_u64(), rec["body_bytes"].as_u64()),
        (Some("completed"), Some(201), Some(26)),
        "{rec}"
    );
    // Put with a lease the CLI granted: the record's hour plus the margin, never without one.
    let value_key = format!("{}{skey}", idemgate::etcd::KEY_PREFIX);
    let (lease, ttl) = lease_of(&etcd, &value_key);
    assert!(lease != 0, "the completion was put without a lease");
    assert!((3600..=3630).contains(&ttl), "lease TTL {ttl} s");
    assert_eq!(lease_of(&etcd, &format!("{value_key}/o")).0, lease, "the owner mark under the same lease");
    // Both proxies replay it, the one that held the key outcome-unknown too (it asks etcd).
    for e in [&s.b, &s.a, &s.b] {
        let r = s.post_to(e, "k-complete", &[]);
        assert_eq!(r.status, 201, "{}", r.body_text());
        assert_eq!(r.body_text(), r#"{"id":"ch_found_upstream"}"#);
        assert_eq!(r.header("idempotent-replayed"), Some("true"));
        assert_eq!(r.header("content-type"), Some("application/json"));
    }
    assert_eq!(s.up.executions(), 1, "the operator's completion is replayed, never executed again");
    let forget = s.cli(&["forget", &skey]);
    assert!(forget.status.success(), "{}", text(&forget.stderr));
    assert_eq!(etcd_keys_of(&etcd, &skey), Vec::<String>::new());
}

/// A one-shot HTTP relay in front of etcd member `port`: before it relays the first transaction
/// (`/v3/kv/txn`) it runs `meanwhile`, so the CLI's write arrives after someone else changed the
/// record it read. Serves at most `n` connections (the CLI closes each after one exchange).
fn relay_changing_the_record_before_the_write(port: u16, n: usize, meanwhile: impl FnOnce() + Send + 'static) -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind relay");
    let relay_port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut meanwhile = Some(meanwhile);
        for conn in listener.incoming().take(n) {
            let Ok(mut client) = conn else { continue };
            let request = read_request(&mut client);
            if request.windows(11).any(|w| w == b"/v3/kv/txn ") {
                if let Some(f) = meanwhile.take() {
                    f();
                }
            }
            let Ok(mut etcd) = TcpStream::connect(("127.0.0.1", port)) else { continue };
            let _ = etcd.write_all(&request);
            let mut answer = vec![];
            let _ = etcd.read_to_end(&mut answer);
            let _ = client.write_all(&answer);
        }
    });
    relay_port
}

/// One whole HTTP/1.1 request (headers and `content-length` body).
fn read_request(c: &mut TcpStream) -> Vec<u8> {
    let mut buf = vec![];
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return buf;
            }
        }
        match http::read_some(c, &mut chunk) {
            Ok(0) | Err(_) => return buf,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[test]
fn etcd_cli_refuses_a_record_changed_between_its_read_and_its_write() {
    let etcd = EtcdCluster::start();
    let s = Stack::start(&etcd, None);
    let skey = s.outcome_unknown("k-race");
    // Operator one releases; between its read and its write, operator two completes the key.
    let scratch = Scratch::new("operator-cli-etcd-race");
    let body = scratch.0.join("found.json");
    std::fs::write(&body, br#"{"id":"ch_other_operator"}"#).expect("write body");
    let (direct, key, file) = (s.urls.clone(), skey.clone(), body.to_str().expect("path").to_string());
    let completed = std::sync::Arc::new(std::sync::Mutex::new(None));
    let seen = completed.clone();
    let relay = relay_changing_the_record_before_the_write(etcd.client_ports()[0], 2, move || {
        let out = OperatorCli::etcd(&direct, None).run(&[
            "resolve",
            &key,
            "--complete",
            "--status",
            "201",
            "--body-file",
            &file,
        ]);
        *seen.lock().expect("lock") = Some(out);
    });
    let out = OperatorCli::etcd(&format!("http://127.0.0.1:{relay}"), None).run(&["resolve", &skey, "--release"]);
    let other = completed.lock().expect("lock").take().expect("the other operator ran before the write");
    assert!(other.status.success(), "the other operator: {}", text(&other.stderr));
    assert_eq!(out.status.code(), Some(1), "released a record it did not read: {}", text(&out.stdout));
    assert!(text(&out.stderr).contains("the record changed since it was read"), "{}", text(&out.stderr));
    // etcd holds the other operator's completion, and retries replay it: executed once.
    let rec = s.inspect(&skey);
    assert_eq!((rec["state"].as_str(), rec["status"].as_u64()), (Some("completed"), Some(201)), "{rec}");
    assert_eq!(etcd_keys_of(&etcd, &skey).len(), 2, "value and owner mark");
    let r = s.post_to(&s.b, "k-race", &[]);
    assert_eq!((r.status, r.body_text().as_str()), (201, r#"{"id":"ch_other_operator"}"#));
    assert_eq!(s.up.executions(), 1);
}

#[test]
fn etcd_cli_with_etcd_auth_works_with_the_right_credential_and_fails_clearly_with_a_wrong_one() {
    let mut etcd = EtcdCluster::start();
    etcd.enable_auth(ETCD_USER, ETCD_PASSWORD);
    let cred = format!("{ETCD_USER}:{ETCD_PASSWORD}");
    let s = Stack::start(&etcd, Some(&cred));
    let skey = s.outcome_unknown("k-auth");
    let rec = s.inspect(&skey);
    assert_eq!(rec["state"], "outcome-unknown", "{rec}");
    // A wrong password, and no credential at all: a clear message, exit 1, nothing changed.
    let wrong = OperatorCli::etcd(&s.urls, Some(&format!("{ETCD_USER}:not-the-password"))).run(&[
        "resolve",
        &skey,
        "--release",
    ]);
    assert_eq!(wrong.status.code(), Some(1), "{}", text(&wrong.stdout));
    let msg = text(&wrong.stderr);
    assert!(msg.contains("etcd refused IDEMGATE_STORE_AUTH") && msg.contains("invalid user ID or password"), "{msg}");
    assert!(!msg.contains("not-the-password"), "the password reached the message: {msg}");
    let none = OperatorCli::etcd(&s.urls, None).run(&["inspect", &skey]);
    assert_eq!(none.status.code(), Some(1), "{}", text(&none.stdout));
    assert!(text(&none.stderr).contains("set IDEMGATE_STORE_AUTH"), "{}", text(&none.stderr));
    assert_eq!(etcd_keys_of(&etcd, &skey).len(), 2, "nothing changed");
    // The right one: the key is settled and the retry on the other proxy executes once.
    let out = s.cli(&["resolve", &skey, "--release"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(etcd_keys_of(&etcd, &skey), Vec::<String>::new());
    let retry = s.post_to(&s.b, "k-auth", &[]);
    assert_eq!(retry.status, 201, "{}", retry.body_text());
    assert_eq!(s.up.executions(), 2);
    s.wait_listed("completed", &skey);
}

/// `list` at store scale on etcd: 100,000 keys under `idemgate/v1/` written straight into etcd
/// (values sealed as a proxy writes them, with owner marks and release tombstones between some of
/// them; written in transactions of 2,000 operations, so the members take up to 2,048), listed in
/// hundreds of pages of at most `etcd::LIST_PAGE_MAX` names, each page's values read
/// `etcd::READ_MANY_MAX` to a transaction. Every outcome-unknown key is listed exactly once; owner
/// marks, tombstones and completed keys are not. Before, each value was read on its own
/// connection (one request per key).
#[test]
fn etcd_cli_lists_100000_keys_across_pages_each_once() {
    use idemgate::fingerprint::Fingerprint;
    use idemgate::owner::OwnerToken;
    use idemgate::record::{Creator, Record, Stage, State, UnknownReason};
    use idemgate::scope::StorageKey;
    use idemgate::store::StoredValue;
    use std::collections::BTreeSet;
    let etcd = EtcdCluster::start_with(&["--max-txn-ops", "2048", "--max-request-bytes", "16777216"]);
    let seal = support::record_seal();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let (unknown, completed) = (90_000usize, 10_000usize);
    let written = std::time::Instant::now();
    let mut expected = BTreeSet::new();
    // Each transaction's body written as text (no JSON tree), sent with a bound of 60 s (etcd
    // applies 2,000 puts well within it even on a loaded machine).
    let mut ops = String::new();
    let mut count = 0;
    let leader = etcd.client_ports()[etcd.wait_leader()];
    let b64 = |b: &[u8]| idemgate::base64::b64(b);
    let flush = |ops: &mut String, count: &mut usize| {
        if *count > 0 {
            let body = format!(r#"{{"success":[{ops}]}}"#);
            // Sent again (at most 3 times: puts of the same values) when the exchange fails
            // (once: connect interrupted by a signal, EINTR, in a loaded run).
            let send =
                || http::request_timeout(leader, "POST", "/v3/kv/txn", &[], body.as_bytes(), Duration::from_secs(60));
            let r = send().or_else(|_| send()).or_else(|_| send()).expect("etcd txn");
            assert_eq!((r.status, r.json()["succeeded"].as_bool()), (200, Some(true)), "{}", r.body_text());
            ops.clear();
            *count = 0;
        }
    };
    let put = |ops: &mut String, count: &mut usize, key: &[u8], value: &[u8]| {
        if *count > 0 {
            ops.push(',');
        }
        ops.push_str(&format!(r#"{{"request_put":{{"key":"{}","value":"{}"}}}}"#, b64(key), b64(value)));
        *count += 1;
    };
    for i in 0..unknown + completed {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
        k[31] = 1;
        let skey = StorageKey(k);
        let state = if i < unknown {
            expected.insert(skey.hex());
            State::OutcomeUnknown { reason: UnknownReason::UpstreamReset }
        } else {
            State::Completed(idemgate::record::StoredResponse { status: 201, headers: vec![], body: b"{}".to_vec() })
        };
        let phase = if i < unknown { Stage::Unknown } else { Stage::Completed };
        let record = Record {
            fingerprint: Fingerprint([7; 32]),
            created_at_ms: now,
            expires_at_ms: now + 3_600_000,
            creator: Creator { request_id: format!("r-{i}"), log_values: vec![] },
            state,
        };
        let v = StoredValue { phase, owner: OwnerToken([9; 16]), lock_expires_at_ms: 0, record };
        let value = idemgate::etcd::encode_value(&v, now + 3_600_000, &skey, &seal);
        let key = idemgate::etcd::etcd_key(&skey);
        put(&mut ops, &mut count, key.as_bytes(), &value);
        // Names the listing skips: an owner mark and a release tombstone beside some values.
        if i % 10 == 0 {
            put(&mut ops, &mut count, format!("{key}/o").as_bytes(), b"x");
            put(&mut ops, &mut count, format!("{key}/r/{}", "ab".repeat(16)).as_bytes(), b"x");
        }
        if count >= 1998 {
            flush(&mut ops, &mut count);
        }
    }
    flush(&mut ops, &mut count);
    eprintln!("wrote 100000 values in {:?}", written.elapsed());
    let urls = etcd.client_ports().iter().map(|p| format!("http://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let cli = OperatorCli::etcd(&urls, None);
    let started = std::time::Instant::now();
    let lines = cli.listed_at_most("outcome-unknown", 1_000_000);
    eprintln!("listed {} of 100000 keys in {:?}", lines.len(), started.elapsed());
    let listed: BTreeSet<String> = lines.iter().cloned().collect();
    assert_eq!(lines.len(), listed.len(), "a key listed twice");
    assert_eq!(listed.len(), unknown);
    assert!(listed == expected, "listed keys differ from the outcome-unknown keys written");
    assert_eq!(cli.listed_at_most("completed", 100).len(), 100);
}

/// Values this build cannot read, planted straight into etcd: garbage bytes (no owner mark), an
/// outcome-unknown value sealed with another record key (its owner mark in plain text beside it),
/// and a claim sealed so. `inspect` shows each (size, SHA-1, `mod_revision`, the owner mark's
/// phase) instead of refusing; `forget` deletes the outcome-unknown one with its owner mark,
/// refuses the claim (its lock is inside the seal: it may be live) and the garbage until
/// `--force`; a retry through Envoy then executes. Before, both refused every such value.
#[test]
fn etcd_inspect_and_forget_reach_values_this_build_cannot_read() {
    use idemgate::record::Stage;
    let etcd = EtcdCluster::start();
    let s = Stack::start(&etcd, None);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let leader = etcd.wait_leader();
    let b64 = |b: &[u8]| idemgate::base64::b64(b);
    let put = |key: &str, value: &[u8]| {
        let r = etcd.call(leader, "/v3/kv/put", &json!({"key": b64(key.as_bytes()), "value": b64(value)}));
        assert!(r.is_some(), "etcd put {key}");
    };
    let plant = |key: &str, phase: Stage| -> String {
        let skey = s.storage_key(key);
        let (sk, v, other) = support::operator::foreign_value(&skey, phase, now + 3_600_000, now);
        put(&idemgate::etcd::etcd_key(&sk), &idemgate::etcd::encode_value(&v, now + 3_600_000, &sk, &other));
        put(&idemgate::etcd::owner_key(&sk), &idemgate::etcd::owner_mark(phase, &v.owner));
        skey
    };
    let unknown = plant("k-foreign-unknown", Stage::Unknown);
    let claim = plant("k-foreign-claim", Stage::Forwarded);
    let garbage = s.storage_key("k-garbage");
    let garbage_value = b"\x00\xffnot an idemgate value";
    put(&format!("{}{garbage}", idemgate::etcd::KEY_PREFIX), garbage_value);
    for (skey, phase) in [(&unknown, Some("outcome-unknown")), (&claim, Some("in-flight")), (&garbage, None)] {
        let out = s.cli(&["inspect", skey, "--json"]);
        assert!(out.status.success(), "{skey}: {}", text(&out.stderr));
        let rec: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rec["state"], "unreadable", "{rec}");
        assert_eq!(rec["phase"].as_str(), phase, "{rec}");
        assert!(rec["raw_bytes"].as_u64().is_some_and(|n| n > 0), "{rec}");
        assert!(rec["store_mod_revision"].as_i64().is_some_and(|r| r > 0), "{rec}");
    }
    assert_eq!(s.inspect(&garbage)["raw_bytes"].as_u64(), Some(garbage_value.len() as u64));
    for (skey, why) in [(&claim, "lock is sealed"), (&garbage, "--force")] {
        let out = s.cli(&["forget", skey]);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
        assert!(text(&out.stderr).contains(why), "{}", text(&out.stderr));
    }
    assert_eq!(etcd_keys_of(&etcd, &garbage).len(), 1, "nothing deleted");
    for args in [&["forget", &unknown][..], &["forget", &garbage, "--force"]] {
        let out = s.cli(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    assert_eq!(etcd_keys_of(&etcd, &unknown), Vec::<String>::new(), "value and owner mark deleted");
    assert_eq!(etcd_keys_of(&etcd, &garbage), Vec::<String>::new());
    assert_eq!(etcd_keys_of(&etcd, &claim).len(), 2, "the claim kept");
    for key in ["k-foreign-unknown", "k-garbage"] {
        let r = s.post_to(&s.a, key, &[]);
        assert_eq!((r.status, r.header("idempotent-replayed")), (201, None), "{key}: {}", r.body_text());
    }
    assert_eq!(s.up.executions(), 2);
    let r = s.post_to(&s.b, "k-foreign-claim", &[]);
    assert_ne!(r.status, 201, "{}", r.body_text());
    assert_eq!(s.up.executions(), 2, "the other build's claim was kept");
}
