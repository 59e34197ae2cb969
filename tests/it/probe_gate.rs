//! `idemgate probe` as a CI gate (issue 29), against servers nobody here wrote: small apps on
//! real PyPI idempotency libraries (tests/probe/apps.py, versions pinned in
//! tests/probe/requirements.txt, installed by `scripts/install-deps.sh probe-apps` into
//! target/probe-venv), a plain app, a constant-body app, a broken app that replays answers but
//! executes again, a 404 URL, and idemgate (Envoy + module) in front of each. Every app counts
//! its executions (GET /count), and each verdict is asserted against that count: what the server
//! really did. The file runs in about 65-73 s (17 tests in parallel, bounded by request count).

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{http, repo_root, Envoy, EnvoyOptions, Scratch};

/// One app of tests/probe/apps.py, killed when dropped.
struct App {
    child: Child,
    port: u16,
}

impl App {
    fn start(kind: &str) -> App {
        App::start_with(kind, &[])
    }

    fn start_with(kind: &str, env: &[(&str, String)]) -> App {
        let python = repo_root().join("target/probe-venv/bin/python");
        assert!(python.exists(), "{} is missing: run scripts/install-deps.sh probe-apps", python.display());
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/probe/apps.py"))
            .arg(kind)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the probe app");
        let mut line = String::new();
        let out = child.stdout.take().expect("stdout");
        // The app prints its port once it listens (bounded: the read ends when the app exits).
        BufReader::new(out).read_line(&mut line).expect("read the app's port");
        let port = line.trim().strip_prefix("PORT ").and_then(|p| p.parse().ok());
        let Some(port) = port else {
            let _ = child.kill();
            panic!("{kind}: no port announced ({line:?})");
        };
        let app = App { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http::get(port, "/count").is_err() {
            assert!(Instant::now() < deadline, "{kind}: /count not answering");
            std::thread::sleep(Duration::from_millis(50));
        }
        app
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// HTTP requests the server received so far (this one included).
    fn requests(&self) -> u64 {
        let r = http::get(self.port, "/count").expect("GET /count");
        let v: Value = serde_json::from_slice(&r.body).expect("count JSON");
        v["requests"].as_u64().expect("requests")
    }

    /// Executions so far.
    fn count(&self) -> u64 {
        let r = http::get(self.port, "/count").expect("GET /count");
        let v: Value = serde_json::from_slice(&r.body).expect("count JSON");
        v["count"].as_u64().expect("count")
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn body_file(scratch: &Scratch) -> String {
    let f = scratch.0.join("charge.json");
    std::fs::write(&f, br#"{"amount": 4200, "currency": "eur"}"#).unwrap();
    f.to_str().unwrap().to_string()
}

/// Runs the probe: its output, and its JSON report (Null when it printed none).
fn probe(url: &str, extra: &[&str]) -> (Output, Value) {
    let scratch = Scratch::new("probe-gate");
    let body = body_file(&scratch);
    let mut args = vec!["probe", url, "--json", "--body-file", &body];
    args.extend_from_slice(extra);
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(&args)
        .env_remove("IDEMGATE_ETCD")
        .output()
        .expect("run idemgate probe");
    let report = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out, report)
}

fn rule<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["rules"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["rule"] == name))
        .unwrap_or_else(|| panic!("no rule {name} in {report:#}"))
}

fn verdict(report: &Value, name: &str) -> String {
    rule(report, name)["verdict"].as_str().unwrap_or_default().to_string()
}

fn detail(report: &Value, name: &str) -> String {
    rule(report, name)["detail"].as_str().unwrap_or_default().to_string()
}

/// Before (today's probe): "replay-identical kept: the second call answered 200 with the same
/// body" although the app executed every request (8 executions, exit 1 only for other rules).
/// Now: without evidence the constant answers make replay-identical inconclusive (exit 3 with
/// --fail-inconclusive); with --count-url it is violated, the retry's execution counted.
#[test]
fn a_constant_body_never_passes_replay_identical() {
    let app = App::start("constant");
    let (out, report) = probe(&app.url("/charges"), &["--skip", "mismatch-refused", "--fail-inconclusive"]);
    assert_eq!(verdict(&report, "replay-identical"), "inconclusive", "{report:#}");
    assert!(detail(&report, "replay-identical").contains("fresh key got the same answer"), "{report:#}");
    assert_eq!(out.status.code(), Some(3), "{report:#}\n{}", text(&out.stderr));
    let before = app.count();
    let (out, report) = probe(&app.url("/charges"), &["--count-url", &app.url("/count")]);
    assert_eq!(verdict(&report, "replay-identical"), "violated", "{report:#}");
    assert!(detail(&report, "replay-identical").contains("executed again"), "{report:#}");
    assert_eq!(verdict(&report, "in-flight-409"), "violated", "{report:#}");
    assert_eq!(out.status.code(), Some(1));
    // first, retry, 4 concurrent, the changed body: the app executed every one.
    assert_eq!(app.count() - before, 7);
}

/// Before: idemgate in front of a URL answering 404 exited 0 with every rule kept (and the bare
/// app's 404 exited 1 "violates 5 rules"). Now: exit 2, the first answer named, nothing judged.
#[test]
fn a_404_is_an_error_before_any_rule_with_and_without_idemgate() {
    let app = App::start("plain");
    let envoy = Envoy::start(&EnvoyOptions::new(r#"{"scope": {"headers": ["authorization"]}}"#, app.port));
    for url in [app.url("/missing"), format!("http://127.0.0.1:{}/missing", envoy.port)] {
        let (out, report) = probe(&url, &["--header", "authorization: Bearer ci"]);
        assert_eq!(out.status.code(), Some(2), "{url}: {report:#}");
        assert_eq!(report, Value::Null, "no verdicts printed");
        let err = text(&out.stderr);
        assert!(err.contains("answered 404") && err.contains("nothing else can be judged"), "{err}");
    }
    // --expect-status accepts a documented non-2xx first answer.
    let (out, _) = probe(&app.url("/missing"), &["--expect-status", "404", "--skip", "in-flight-409"]);
    assert_ne!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // Unreachable: exit 2.
    let port = support::free_port();
    let (out, _) = probe(&format!("http://127.0.0.1:{port}/charges"), &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// asgi-idempotency-header 0.2.0 holds concurrent duplicates (1 execution, three 409s as plain
/// JSON) and replays a changed body under the same key. Before: "in-flight-409 violated: a 409
/// that is not an application/problem+json document" (a false failure), and every library failed
/// "expiry-published", a rule the draft does not have. Now, draft profile: replay and in-flight
/// kept, the changed body violated as what it was (a replay, not a refusal).
#[test]
fn asgi_idempotency_header_is_judged_on_what_it_does() {
    let app = App::start("asgi-idempotency-header");
    let (out, report) = probe(&app.url("/charges"), &["--count-url", &app.url("/count")]);
    assert_eq!(verdict(&report, "replay-identical"), "kept", "{report:#}");
    assert_eq!(verdict(&report, "in-flight-409"), "kept", "{report:#}");
    assert!(detail(&report, "in-flight-409").contains("3 answered 409"), "{report:#}");
    assert_eq!(verdict(&report, "mismatch-refused"), "violated", "{report:#}");
    assert!(detail(&report, "mismatch-refused").contains("replay of the first request"), "{report:#}");
    let names: Vec<&str> = report["rules"].as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
    assert!(!names.contains(&"expiry-published") && !names.contains(&"replay-marked"), "{names:?}");
    assert_eq!(rule(&report, "in-flight-409")["section"], "§2.7 Error Scenarios");
    assert_eq!(rule(&report, "in-flight-409")["level"], "SHOULD");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(app.count(), 2, "the first request and one of the concurrent ones");
}

/// fastapi-idempotency-key 0.1.1 executes once, marks replays `Idempotency-Replayed` and answers
/// 422 (plain JSON) to a changed body. Before: replay-marked, in-flight-409 and mismatch-422
/// violated. Now: every draft rule kept (exit 0); Stripe's replay header rule names the header it
/// did send, and is kept with --replay-header.
#[test]
fn fastapi_idempotency_key_keeps_the_draft() {
    let app = App::start("fastapi-idempotency-key");
    let junit = Scratch::new("probe-junit");
    let junit_file = junit.0.join("probe.xml");
    let (out, report) =
        probe(&app.url("/charges"), &["--count-url", &app.url("/count"), "--junit", junit_file.to_str().unwrap()]);
    for r in ["replay-identical", "in-flight-409", "mismatch-refused"] {
        assert_eq!(verdict(&report, r), "kept", "{r}: {report:#}");
    }
    assert_eq!(verdict(&report, "missing-key-400"), "skipped");
    assert_eq!(out.status.code(), Some(0), "{report:#}\n{}", text(&out.stderr));
    let xml = std::fs::read_to_string(&junit_file).unwrap();
    assert!(xml.contains("tests=\"4\" failures=\"0\"") && xml.contains("name=\"in-flight-409\""), "{xml}");
    assert_eq!(app.count(), 2);

    let (out, report) = probe(&app.url("/charges"), &["--count-url", &app.url("/count"), "--profile", "stripe"]);
    assert_eq!(verdict(&report, "replay-marked"), "violated", "{report:#}");
    assert!(detail(&report, "replay-marked").contains("idempotency-replayed"), "{report:#}");
    assert_eq!(out.status.code(), Some(1));
    let (out, report) = probe(
        &app.url("/charges"),
        &["--count-url", &app.url("/count"), "--profile", "stripe", "--replay-header", "Idempotency-Replayed"],
    );
    assert_eq!(verdict(&report, "replay-marked"), "kept", "{report:#}");
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(app.count(), 6, "two executions per run");
}

/// fastapi-idempotency 0.1.1 holds concurrent duplicates and replays them. Before:
/// "in-flight-409 not-observed: the concurrent calls never overlapped (all replays)" although
/// they did overlap. Now: inconclusive, saying what was seen (replays, one execution, no 409);
/// exit 0, or 3 with --fail-inconclusive.
#[test]
fn fastapi_idempotency_held_duplicates_are_inconclusive_and_said_so() {
    let app = App::start("fastapi-idempotency");
    let (out, report) = probe(&app.url("/charges"), &["--list-url", &app.url("/charges"), "--fail-inconclusive"]);
    assert_eq!(verdict(&report, "in-flight-409"), "inconclusive", "{report:#}");
    let d = detail(&report, "in-flight-409");
    assert!(
        d.contains("3 marked as replays") && d.contains("1 execution(s) counted") && !d.contains("never overlapped"),
        "{d}"
    );
    assert_eq!(verdict(&report, "replay-identical"), "kept", "{report:#}");
    assert_eq!(verdict(&report, "mismatch-refused"), "kept", "{report:#}");
    assert_eq!(out.status.code(), Some(3), "{report:#}");
    assert_eq!(app.count(), 2);
}

/// django-idempotency-key 1.3.0 answers a retry 409 with the stored body (no execution), hashes
/// the body into the key (a changed body executes) and, without its lock, runs concurrent
/// duplicates. Before: the retry's message said "with another body". Now: it says the same body,
/// and every execution the probe reports is the app's count. Its middleware requires a key, so
/// the missing-key check is kept; a first answer slower than --timeout-ms is exit 2.
#[test]
fn django_idempotency_key_violations_say_what_happened() {
    let app = App::start("django-idempotency-key");
    let (out, report) = probe(&app.url("/charges"), &["--count-url", &app.url("/count"), "--check-missing-key"]);
    let d = detail(&report, "replay-identical");
    assert_eq!(verdict(&report, "replay-identical"), "violated", "{report:#}");
    assert!(d.contains("409") && d.contains("with the same body") && d.contains("no new execution"), "{d}");
    assert_eq!(verdict(&report, "in-flight-409"), "violated", "{report:#}");
    assert!(detail(&report, "in-flight-409").contains("4 executions counted"), "{report:#}");
    assert_eq!(verdict(&report, "mismatch-refused"), "violated", "{report:#}");
    assert!(detail(&report, "mismatch-refused").contains("changed body executed"), "{report:#}");
    // Its middleware requires a key: 400 with a JSON body, not executed.
    assert_eq!(verdict(&report, "missing-key-400"), "kept", "{report:#}");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(app.count(), 6, "first, 4 concurrent, the changed body");
    // A request that outlives --timeout-ms is an error before any verdict (exit 2).
    let (out, _) = probe(&app.url("/charges"), &["--timeout-ms", "200"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// The plain app executes everything: every rule violated, with evidence or without.
#[test]
fn a_plain_app_violates_every_rule() {
    let app = App::start("plain");
    for extra in [vec![], vec!["--count-url".to_string(), app.url("/count")]] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let (out, report) = probe(&app.url("/charges"), &extra);
        for r in ["replay-identical", "in-flight-409", "mismatch-refused"] {
            assert_eq!(verdict(&report, r), "violated", "{r}: {report:#}");
        }
        assert_eq!(out.status.code(), Some(1));
    }
}

/// idemgate in front of the plain app keeps every strict rule, judged on the app's count: the
/// retry, the concurrent duplicates, the changed body and the malformed key never execute, and
/// the second caller's request with key A is its own (one execution). Credentials come from a
/// headers file and the environment. Before: the probe had no --count-url, --profile,
/// --second-caller-header, --headers-file or --header-env (exit 2, usage).
#[test]
fn idemgate_in_front_of_the_plain_app_keeps_every_strict_rule() {
    let app = App::start("plain");
    let envoy = Envoy::start(&EnvoyOptions::new(r#"{"scope": {"headers": ["authorization"]}}"#, app.port));
    let scratch = Scratch::new("probe-headers");
    let headers = scratch.0.join("headers");
    std::fs::write(&headers, "# CI credentials\nx-tenant: ci\n").unwrap();
    let scratch2 = Scratch::new("probe-gate");
    let body = body_file(&scratch2);
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["probe", &format!("http://127.0.0.1:{}/charges", envoy.port), "--json", "--body-file", &body])
        .args(["--profile", "strict", "--count-url", &app.url("/count")])
        .args(["--headers-file", headers.to_str().unwrap(), "--header-env", "authorization: PROBE_TOKEN"])
        .args(["--second-caller-header", "authorization: Bearer other-caller"])
        .env("PROBE_TOKEN", "Bearer first-caller")
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    for r in [
        "replay-identical",
        "replay-marked",
        "in-flight-409",
        "mismatch-refused",
        "malformed-key-400",
        "other-caller-scoped",
        "expiry-published",
    ] {
        assert_eq!(verdict(&report, r), "kept", "{r}: {report:#}\n{}", text(&out.stderr));
    }
    assert_eq!(verdict(&report, "missing-key-400"), "skipped");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(app.count(), 3, "the first request, one concurrent, the second caller's");
}

/// Fresh keys every run (the malformed one too), the number of requests printed before any is
/// sent, and --dry-run sends nothing. Before: the malformed key was always `"unterminated-é`,
/// and there was no --dry-run (exit 2).
#[test]
fn fresh_keys_every_run_and_a_dry_run_sends_nothing() {
    let app = App::start("asgi-idempotency-header");
    let run = || {
        let (out, _) =
            probe(&app.url("/charges"), &["--dry-run", "--profile", "strict", "--count-url", &app.url("/count")]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        (text(&out.stdout), text(&out.stderr))
    };
    let ((plan1, err1), (plan2, _)) = (run(), run());
    assert!(err1.contains("request(s) to send"), "{err1}");
    let malformed = |p: &str| p.lines().find(|l| l.contains("(malformed)")).map(str::to_string);
    assert!(malformed(&plan1).is_some() && malformed(&plan1) != malformed(&plan2), "{plan1}\n{plan2}");
    let first_line = |p: &str| p.lines().find(|l| l.contains("(the body)")).map(str::to_string);
    assert_ne!(first_line(&plan1), first_line(&plan2));
    assert_eq!(app.count(), 0, "a dry run executes nothing");
    // The announced count is what the server received: the probe's requests and evidence reads
    // (each GET /count counts itself).
    for extra in [vec!["--count-url".to_string(), app.url("/count")], vec![]] {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let before = app.requests();
        let (out, report) = probe(&app.url("/charges"), &extra);
        let received = app.requests() - before - 1;
        let announced: u64 = text(&out.stderr)
            .split("idemgate probe: ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok())
            .expect("the count announced");
        assert_eq!(received, announced, "{extra:?}: {}", text(&out.stderr));
        assert_eq!(report["requests_sent"], announced);
    }
}

/// https:// against a server with a private CA (IDEMGATE_PROBE_CA_FILE), the Starlette app
/// serving TLS itself. Before: "only http:// URLs are supported" (exit 2).
#[test]
fn https_with_a_private_ca() {
    let pki = support::tls::Pki::generate_for("probe-https", "probe.test");
    let env = [
        ("PROBE_APP_TLS_CERT", pki.dir.join("tls.crt").to_str().unwrap().to_string()),
        ("PROBE_APP_TLS_KEY", pki.dir.join("tls.key").to_str().unwrap().to_string()),
    ];
    let app = App::start_with_tls("fastapi-idempotency-key", &env);
    let scratch = Scratch::new("probe-gate");
    let body = body_file(&scratch);
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["probe", &format!("https://127.0.0.1:{}/charges", app.port), "--json", "--body-file", &body])
        .args(["--count-url", &format!("https://127.0.0.1:{}/count", app.port)])
        .env("IDEMGATE_PROBE_CA_FILE", pki.dir.join("ca.crt"))
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert_eq!(out.status.code(), Some(0), "{report:#}\n{}", text(&out.stderr));
    assert_eq!(verdict(&report, "replay-identical"), "kept");
    // Without the CA the certificate is refused: exit 2, nothing sent in the clear.
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["probe", &format!("https://127.0.0.1:{}/charges", app.port), "--body-file", &body])
        .env_remove("IDEMGATE_PROBE_CA_FILE")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

impl App {
    /// The app serving HTTPS: its /count is read over TLS (the CA's file is trusted by curl-free
    /// means: the probe itself), so readiness is its port announcement only.
    fn start_with_tls(kind: &str, env: &[(&str, String)]) -> App {
        let python = repo_root().join("target/probe-venv/bin/python");
        assert!(python.exists(), "{} is missing: run scripts/install-deps.sh probe-apps", python.display());
        let mut child = Command::new(python)
            .arg(repo_root().join("tests/probe/apps.py"))
            .arg(kind)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the probe app");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("read the app's port");
        let port = line.trim().strip_prefix("PORT ").and_then(|p| p.parse().ok()).unwrap_or(0);
        let app = App { child, port };
        assert_ne!(port, 0, "{kind}: no port announced ({line:?})");
        app
    }
}

/// idemgate (Envoy + dist/idemgate.wasm) in front of `kind`, keys scoped to `authorization`.
fn behind_idemgate(kind: &str) -> (App, Envoy) {
    let app = App::start(kind);
    let envoy = Envoy::start(&EnvoyOptions::new(r#"{"scope": {"headers": ["authorization"]}}"#, app.port));
    (app, envoy)
}

/// The probe through idemgate, executions read at the app itself (GET /count on its port).
fn probe_through(app: &App, envoy: &Envoy, extra: &[&str]) -> (Output, Value) {
    let url = format!("http://127.0.0.1:{}/charges", envoy.port);
    let count = app.url("/count");
    let mut args = vec!["--header", "authorization: Bearer ci", "--count-url", count.as_str()];
    args.extend_from_slice(extra);
    probe(&url, &args)
}

/// What idemgate does in front of any app, asserted on the probe's verdicts and the app's count:
/// one execution for the first request, one for the concurrent duplicates (the rest 409
/// problem+json), none for the retry (a replay), the changed body (422) or the malformed key
/// (400). Both the draft and the strict profile keep every rule they judge; 4 executions in all.
fn idemgate_keeps_every_rule_in_front_of(kind: &str) {
    let (app, envoy) = behind_idemgate(kind);
    for profile in ["draft", "strict"] {
        let before = app.count();
        let (out, report) = probe_through(&app, &envoy, &["--profile", profile]);
        let judged: Vec<&str> = match profile {
            "draft" => vec!["replay-identical", "in-flight-409", "mismatch-refused"],
            _ => vec![
                "replay-identical",
                "replay-marked",
                "in-flight-409",
                "mismatch-refused",
                "malformed-key-400",
                "expiry-published",
            ],
        };
        for r in &judged {
            assert_eq!(verdict(&report, r), "kept", "{kind} {profile} {r}: {report:#}\n{}", text(&out.stderr));
        }
        assert_eq!(verdict(&report, "missing-key-400"), "skipped");
        assert!(detail(&report, "in-flight-409").contains("1 execution(s) counted"), "{kind}: {report:#}");
        assert_eq!(out.status.code(), Some(0), "{kind} {profile}: {}", text(&out.stderr));
        assert_eq!(app.count() - before, 2, "{kind} {profile}: the first request and one concurrent");
    }
}

#[test]
fn idemgate_in_front_of_asgi_idempotency_header() {
    idemgate_keeps_every_rule_in_front_of("asgi-idempotency-header");
}

#[test]
fn idemgate_in_front_of_fastapi_idempotency_key() {
    idemgate_keeps_every_rule_in_front_of("fastapi-idempotency-key");
}

#[test]
fn idemgate_in_front_of_fastapi_idempotency() {
    idemgate_keeps_every_rule_in_front_of("fastapi-idempotency");
}

#[test]
fn idemgate_in_front_of_django_idempotency_key() {
    idemgate_keeps_every_rule_in_front_of("django-idempotency-key");
}

#[test]
fn idemgate_in_front_of_the_replay_exec_app() {
    idemgate_keeps_every_rule_in_front_of("replay-exec");
}

/// The constant-body app behind idemgate: with the count every rule is kept (idemgate replays,
/// the app ran twice); without evidence the retry is inconclusive, never kept, since a fresh key
/// gets the same answer too.
#[test]
fn idemgate_in_front_of_the_constant_app() {
    idemgate_keeps_every_rule_in_front_of("constant");
    let (app, envoy) = behind_idemgate("constant");
    let url = format!("http://127.0.0.1:{}/charges", envoy.port);
    let (out, report) = probe(&url, &["--header", "authorization: Bearer ci", "--fail-inconclusive"]);
    assert_eq!(verdict(&report, "replay-identical"), "inconclusive", "{report:#}");
    assert_eq!(verdict(&report, "mismatch-refused"), "kept", "{report:#}");
    assert_eq!(out.status.code(), Some(3), "{report:#}\n{}", text(&out.stderr));
    assert_eq!(app.count(), 3, "the first, the fresh key, one concurrent");
    // The second caller's request with key A executes on its own (counted) and, the app being
    // constant, answers the same bytes as the first caller's: that is not a leak.
    let (out, report) = probe_through(
        &app,
        &envoy,
        &[
            "--second-caller-header",
            "authorization: Bearer other",
            "--skip",
            "in-flight-409,mismatch-refused",
            "--profile",
            "strict",
        ],
    );
    assert_eq!(verdict(&report, "other-caller-scoped"), "kept", "{report:#}");
    assert!(rule(&report, "other-caller-scoped")["executions"].as_str().unwrap().contains("1 execution"), "{report:#}");
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(app.count(), 5, "the first and the second caller's");
}

/// A broken idempotency layer that executes every request and then answers a seen key with the
/// stored answer: indistinguishable from a replay by its answers. With --count-url the retry's
/// execution is counted (violated); without evidence the retry must not be "kept".
#[test]
fn an_app_that_replays_the_answer_but_executes_again_never_passes() {
    let app = App::start("replay-exec");
    let (out, report) = probe(&app.url("/charges"), &["--count-url", &app.url("/count")]);
    assert_eq!(verdict(&report, "replay-identical"), "violated", "{report:#}");
    assert!(detail(&report, "replay-identical").contains("executed again"), "{report:#}");
    assert_eq!(verdict(&report, "in-flight-409"), "violated", "{report:#}");
    assert_eq!(verdict(&report, "mismatch-refused"), "violated", "{report:#}");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(app.count(), 7, "first, retry, 4 concurrent, the changed body");
    let (out, report) =
        probe(&app.url("/charges"), &["--skip", "in-flight-409,mismatch-refused", "--fail-inconclusive"]);
    assert_eq!(verdict(&report, "replay-identical"), "inconclusive", "{report:#}");
    assert_eq!(out.status.code(), Some(3), "{report:#}");
    assert_eq!(app.count(), 10, "first, retry, fresh key: all executed");
}
