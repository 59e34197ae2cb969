//! `idemgate probe`: sends the requests, measures executions at the evidence URL, and leaves
//! every verdict to the core (`idemgate::probe`). Options, profiles, verdicts and exit codes:
//! docs/probe.md.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches, Command};
use idemgate::probe::{self, Answer, Executions, Options, Profile, Seen, Step};

use super::{fail, many, s, usage, Fail};

pub fn command() -> Command {
    let flag = |name: &'static str, long: &'static str, help: &'static str| {
        Arg::new(name).long(long).action(ArgAction::SetTrue).help(help)
    };
    let repeat = |name: &'static str, long: &'static str, help: &'static str| {
        Arg::new(name).long(long).action(ArgAction::Append).help(help)
    };
    Command::new("probe")
        .about("Prove an API idempotent in CI: the same call twice, concurrently, changed, judged on evidence (docs/probe.md)")
        .arg(Arg::new("url").required(true).help("http:// or https:// URL of the operation"))
        .arg(Arg::new("method").long("method").default_value("POST"))
        .arg(repeat("header", "header", "'name: value' sent on every request (repeat)"))
        .arg(Arg::new("headers_file").long("headers-file").help("a file of 'name: value' lines sent on every request (# comments)"))
        .arg(repeat("header_env", "header-env",
            "'name: VARIABLE': a header whose value is read from the environment variable (repeat; keeps secrets out of the command line)",
        ))
        .arg(Arg::new("body_file").long("body-file"))
        .arg(Arg::new("key_header").long("key-header").default_value("idempotency-key"))
        .arg(
            Arg::new("profile")
                .long("profile")
                .default_value("draft")
                .help("draft (the IETF draft's rules only), stripe (Stripe's documented behaviour) or strict (idemgate's answers)"),
        )
        .arg(Arg::new("count_url").long("count-url").help(
            "GET URL whose answer counts executions (a number, {\"count\": n}, or a JSON array); read around each step",
        ))
        .arg(Arg::new("list_url").long("list-url").conflicts_with("count_url").help(
            "GET URL listing the resources created (a JSON array's length, else any change of its body)",
        ))
        .arg(
            Arg::new("expect_status")
                .long("expect-status")
                .action(ArgAction::Append)
                .value_parser(clap::value_parser!(u16).range(100..=599))
                .help("the first answer's expected status (repeat; default any 2xx)"),
        )
        .arg(Arg::new("replay_header").long("replay-header").default_value("idempotent-replayed"))
        .arg(repeat("skip", "skip", "a rule not to check, and not to send requests for (repeat or comma-separated)"))
        .arg(repeat("second_caller_header", "second-caller-header",
            "'name: value' of a second caller's credentials (repeat): key A sent as that caller checks the key's scoping",
        ))
        .arg(flag("check_missing_key", "check-missing-key", "send one request without a key (for operations that require one)"))
        .arg(
            Arg::new("concurrency")
                .long("concurrency")
                .default_value("4")
                .value_parser(clap::value_parser!(u64).range(2..=64)),
        )
        .arg(
            Arg::new("timeout_ms")
                .long("timeout-ms")
                .default_value("30000")
                .value_parser(clap::value_parser!(u64).range(1..=600_000))
                .help("connect, write and read timeout of each request"),
        )
        .arg(flag("fail_inconclusive", "fail-inconclusive", "exit 3 when no rule is violated but one is inconclusive"))
        .arg(flag("json", "json", "the report as JSON on stdout"))
        .arg(Arg::new("junit").long("junit").help("also write the verdicts as JUnit XML to this file"))
        .arg(flag("dry_run", "dry-run", "print the requests it would send, send nothing"))
}

/// A parsed URL.
struct Target {
    tls: bool,
    host: String,
    port: u16,
    path: String,
}

fn target(url: &str) -> Result<Target, Fail> {
    let (tls, plain) = match url.strip_prefix("https://") {
        Some(rest) => (true, format!("http://{rest}")),
        None => (false, url.to_string()),
    };
    let (host, mut port, path) = super::parse_url(&plain).or_else(usage)?;
    if tls && !plain.trim_start_matches("http://").split('/').next().unwrap_or_default().contains(':') {
        port = 443;
    }
    Ok(Target { tls, host, port, path })
}

fn header_line(l: &str, what: &str) -> Result<(String, String), Fail> {
    match l.split_once(':') {
        Some((n, v)) if !n.trim().is_empty() => Ok((n.trim().to_ascii_lowercase(), v.trim().to_string())),
        _ => usage(format!("{what} {l:?}: expected 'name: value'")),
    }
}

/// A fresh random suffix (the standard library's per-process random hash keys, the time and
/// the process id): no two runs share a key.
fn random_suffix() -> String {
    let mut h = RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    format!("{a:016x}{:08x}", h.finish() as u32)
}

struct Client {
    timeout: Duration,
}

impl Client {
    fn send(&self, t: &Target, method: &str, headers: &[(String, String)], body: &[u8]) -> std::io::Result<Answer> {
        use std::net::{TcpStream, ToSocketAddrs};
        let addrs: Vec<_> = (t.host.as_str(), t.port).to_socket_addrs()?.collect();
        let mut last = std::io::Error::other("no address");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.timeout) {
                Ok(mut c) => {
                    c.set_read_timeout(Some(self.timeout))?;
                    c.set_write_timeout(Some(self.timeout))?;
                    let (host, port, path) = (&t.host, t.port, &t.path);
                    if t.tls {
                        let mut tls = super::tls::wrap(c, host)?;
                        return super::exchange_on(&mut tls, host, port, method, path, headers, body);
                    }
                    return super::exchange_on(&mut c, host, port, method, path, headers, body);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// What a run will send, in order (one line each, for the count and `--dry-run`).
struct Plan {
    lines: Vec<String>,
}

impl Plan {
    fn add(&mut self, n: usize, what: String) {
        self.lines.push(if n == 1 { what } else { format!("{n} x {what}") });
    }

    fn total(&self) -> usize {
        self.lines.iter().map(|l| l.split_once(" x ").and_then(|(n, _)| n.parse().ok()).unwrap_or(1)).sum()
    }
}

pub fn run(a: &ArgMatches) -> Result<(), Fail> {
    let url = s(a, "url").cloned().unwrap_or_default();
    let t = target(&url)?;
    let method = s(a, "method").cloned().unwrap_or_else(|| "POST".into()).to_ascii_uppercase();
    let key_header = s(a, "key_header").cloned().unwrap_or_else(|| "idempotency-key".into()).to_ascii_lowercase();
    let profile = Profile::parse(s(a, "profile").map_or("draft", |v| v.as_str())).or_else(usage)?;
    let mut skip = vec![];
    for v in many(a, "skip") {
        for r in v.split(',').map(str::trim).filter(|r| !r.is_empty()) {
            if !probe::RULES.contains(&r) {
                return usage(format!("--skip {r:?}: no such rule (rules: {})", probe::RULES.join(", ")));
            }
            skip.push(r.to_string());
        }
    }
    let o = Options {
        profile,
        replay_header: s(a, "replay_header")
            .cloned()
            .unwrap_or_else(|| "idempotent-replayed".into())
            .to_ascii_lowercase(),
        skip,
    };
    let mut headers = vec![];
    if let Some(f) = s(a, "headers_file") {
        let text = std::fs::read_to_string(f).or_else(|e| usage(format!("--headers-file {f}: {e}")))?;
        for l in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            headers.push(header_line(l, &format!("--headers-file {f}: line"))?);
        }
    }
    for l in many(a, "header") {
        headers.push(header_line(&l, "--header")?);
    }
    for l in many(a, "header_env") {
        let (n, var) = header_line(&l, "--header-env")?;
        let v = std::env::var(&var)
            .or_else(|_| usage(format!("--header-env {n}: the environment variable {var} is not set")))?;
        headers.push((n, v.trim().to_string()));
    }
    let mut second_caller = headers.clone();
    let other: Vec<(String, String)> = many(a, "second_caller_header")
        .iter()
        .map(|l| header_line(l, "--second-caller-header"))
        .collect::<Result<_, _>>()?;
    second_caller.retain(|(n, _)| !other.iter().any(|(o, _)| o == n));
    second_caller.extend(other.iter().cloned());
    let body = match s(a, "body_file") {
        Some(f) => std::fs::read(f).or_else(|e| usage(format!("--body-file {f}: {e}")))?,
        None => vec![],
    };
    let evidence = match (s(a, "count_url"), s(a, "list_url")) {
        (Some(u), _) | (None, Some(u)) => Some((u.clone(), target(u)?)),
        _ => None,
    };
    let expect: Vec<u16> = a.get_many::<u16>("expect_status").map(|v| v.copied().collect()).unwrap_or_default();
    let concurrency = a.get_one::<u64>("concurrency").map_or(4, |n| *n as usize);
    let client = Client { timeout: Duration::from_millis(a.get_one::<u64>("timeout_ms").copied().unwrap_or(30_000)) };
    let run_id = random_suffix();
    let key = |k: &str| format!("idemgate-probe-{run_id}-{k}");
    // Malformed under both key syntaxes (a structured-field string, or any visible ASCII): an
    // unterminated quote and a non-ASCII byte; its random part makes it new on every run.
    let malformed_key = format!("\"unterminated-\u{e9}-{run_id}");

    let want = |r: &str| probe::wanted(&o, r);
    let replay = want("replay-identical") || want("replay-marked") || want("expiry-published");
    let fresh_needed = evidence.is_none() && (replay || want("in-flight-409") || want("other-caller-scoped"));
    let check_missing = a.get_flag("check_missing_key") && want("missing-key-400");
    let check_other = !other.is_empty() && want("other-caller-scoped");
    for (asked, rule) in
        [(a.get_flag("check_missing_key"), "missing-key-400"), (!other.is_empty(), "other-caller-scoped")]
    {
        if asked && probe::clause(o.profile, rule).is_none() {
            eprintln!("idemgate probe: note: the {} profile has no rule {rule}: not checked", o.profile.as_str());
        }
    }
    let path = &t.path;
    let mut plan = Plan { lines: vec![] };
    let read = |p: &mut Plan| {
        if let Some((u, _)) = &evidence {
            p.add(1, format!("GET {u} (evidence)"));
        }
    };
    read(&mut plan);
    plan.add(1, format!("{method} {path} {key_header}: {} (the body)", key("a")));
    read(&mut plan);
    if replay {
        plan.add(1, format!("{method} {path} {key_header}: {} (the same body; repeated up to 5 times while it answers 409 with retry-after)", key("a")));
        read(&mut plan);
    }
    if fresh_needed {
        plan.add(1, format!("{method} {path} {key_header}: {} (the same body under a fresh key)", key("c")));
    }
    if want("in-flight-409") {
        plan.add(concurrency, format!("{method} {path} {key_header}: {} (at once)", key("b")));
        read(&mut plan);
    }
    if want("mismatch-refused") {
        plan.add(1, format!("{method} {path} {key_header}: {} (a changed body)", key("a")));
        read(&mut plan);
    }
    if want("malformed-key-400") {
        plan.add(1, format!("{method} {path} {key_header}: {malformed_key:?} (malformed)"));
        read(&mut plan);
    }
    if check_missing {
        plan.add(1, format!("{method} {path} without {key_header}"));
        read(&mut plan);
    }
    if check_other {
        plan.add(1, format!("{method} {path} {key_header}: {} as the second caller", key("a")));
        read(&mut plan);
    }
    let retries = if replay { " (up to 5 more while the retry is answered 409 with retry-after)" } else { "" };
    eprintln!("idemgate probe: {} request(s) to send{retries}, {} profile", plan.total(), o.profile.as_str());
    if a.get_flag("dry_run") {
        for l in &plan.lines {
            println!("{l}");
        }
        return Ok(());
    }

    let send = |hs: &[(String, String)], k: Option<&str>, b: &[u8]| -> Result<Answer, Fail> {
        let mut h = hs.to_vec();
        if let Some(k) = k {
            h.push((key_header.clone(), k.to_string()));
        }
        client.send(&t, &method, &h, b).map_err(|e| Fail(format!("{url}: {e} (exit 2: no verdict)"), 2))
    };
    let read_evidence = || -> Result<Option<Vec<u8>>, Fail> {
        let Some((u, et)) = &evidence else { return Ok(None) };
        let ans = client.send(et, "GET", &headers, &[]).map_err(|e| Fail(format!("evidence {u}: {e}"), 2))?;
        if !(200..300).contains(&ans.status) {
            return Err(Fail(format!("evidence {u} answered {} (a 2xx is needed)", ans.summary()), 2));
        }
        Ok(Some(ans.body))
    };
    // One step: the evidence before and after its requests (the reading after one step is the
    // reading before the next: the steps run one after the other).
    let last = std::cell::RefCell::new(None);
    let step = |desc: String, f: &dyn Fn() -> Result<Vec<Answer>, Fail>| -> Result<Step, Fail> {
        let before = match last.borrow_mut().take() {
            Some(b) => Some(b),
            None => read_evidence()?,
        };
        let answers = f()?;
        let after = read_evidence()?;
        last.borrow_mut().clone_from(&after);
        let executions = match (before, after) {
            (Some(b), Some(a)) => probe::executions_between(&b, &a),
            _ => Executions::Unknown,
        };
        Ok(Step { request: desc, answers, executions })
    };
    let desc = |k: &str, what: &str| format!("{method} {url} {key_header}: {k} ({what})");

    let ka = key("a");
    let first = step(desc(&ka, "the body"), &|| Ok(vec![send(&headers, Some(&ka), &body)?]))?;
    let first_answer = first.answers.first().cloned().unwrap_or_default();
    let expected = if expect.is_empty() {
        (200..300).contains(&first_answer.status)
    } else {
        expect.contains(&first_answer.status)
    };
    if !expected {
        let want = if expect.is_empty() {
            "a 2xx".to_string()
        } else {
            expect.iter().map(u16::to_string).collect::<Vec<_>>().join(" or ")
        };
        return Err(Fail(
            format!(
                "{url}: the first request answered {}, not {want}: nothing else can be judged (exit 2; --expect-status names another)",
                first_answer.summary()
            ),
            2,
        ));
    }
    if matches!(first.executions, Executions::Counted(0) | Executions::Changed(false)) {
        let (u, _) = evidence.as_ref().map_or((String::new(), ()), |(u, _)| (u.clone(), ()));
        return Err(Fail(
            format!(
                "{u}: the evidence did not change when the first request executed: it cannot count executions (exit 2)"
            ),
            2,
        ));
    }
    let second = if replay {
        Some(step(desc(&ka, "the same body again"), &|| {
            // A client retries a 409 that says when: the first call's record may be a moment from landing.
            let mut second = send(&headers, Some(&ka), &body)?;
            for _ in 0..5 {
                if second.status != 409 || second.header("retry-after").is_none() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
                second = send(&headers, Some(&ka), &body)?;
            }
            Ok(vec![second])
        })?)
    } else {
        None
    };
    let kc = key("c");
    let fresh = if fresh_needed {
        Some(Step::one(
            desc(&kc, "the same body under a fresh key"),
            send(&headers, Some(&kc), &body)?,
            Executions::Unknown,
        ))
    } else {
        None
    };
    let kb = key("b");
    let concurrent = if want("in-flight-409") {
        Some(step(format!("{concurrency} x {} at once", desc(&kb, "the body")), &|| {
            let barrier = std::sync::Barrier::new(concurrency);
            std::thread::scope(|sc| {
                let handles: Vec<_> = (0..concurrency)
                    .map(|_| {
                        sc.spawn(|| {
                            barrier.wait();
                            send(&headers, Some(&kb), &body)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| fail("a probe thread failed")))
                    .collect::<Result<Vec<_>, Fail>>()
            })
        })?)
    } else {
        None
    };
    let changed = probe::changed_body(&body);
    let mismatch = if want("mismatch-refused") {
        Some(step(desc(&ka, "a changed body"), &|| Ok(vec![send(&headers, Some(&ka), &changed)?]))?)
    } else {
        None
    };
    let malformed = if want("malformed-key-400") {
        Some(step(desc(&format!("{malformed_key:?}"), "malformed"), &|| {
            Ok(vec![send(&headers, Some(&malformed_key), &body)?])
        })?)
    } else {
        None
    };
    let missing = if check_missing {
        Some(step(format!("{method} {url} without {key_header}"), &|| Ok(vec![send(&headers, None, &body)?]))?)
    } else {
        None
    };
    let other_caller = if check_other {
        Some(step(desc(&ka, "the body, as the second caller"), &|| Ok(vec![send(&second_caller, Some(&ka), &body)?]))?)
    } else {
        None
    };
    let rules =
        probe::judge(&Seen { first, second, fresh, concurrent, mismatch, malformed, missing, other_caller }, &o);
    let fail_inconclusive = a.get_flag("fail_inconclusive");
    if let Some(f) = s(a, "junit") {
        std::fs::write(f, probe::junit(&url, &o, &rules, fail_inconclusive))
            .map_err(|e| Fail(format!("--junit {f}: {e}"), 2))?;
    }
    if a.get_flag("json") {
        println!(
            "{}",
            serde_json::to_string_pretty(&probe::report(&url, &o, &rules, plan.total())).unwrap_or_default()
        );
    } else {
        for r in &rules {
            println!("{:<20} {:<13} {}", r.name, r.verdict.as_str(), r.detail);
            if let Some(c) = r.clause {
                println!("{:<20} {:<13} {} {}: {}", "", "", c.section, c.level, c.wording);
            }
            if !r.request.is_empty() {
                println!("{:<20} {:<13} request: {}", "", "", r.request);
                for ans in &r.answers {
                    println!("{:<20} {:<13} answer: {ans}", "", "");
                }
                println!("{:<20} {:<13} {}", "", "", r.executions);
            }
        }
    }
    let summary = probe::summary(&url, &o, &rules);
    match probe::exit_code(&rules, fail_inconclusive) {
        0 => {
            eprintln!("idemgate: {summary}");
            Ok(())
        }
        code => Err(Fail(summary, code)),
    }
}
