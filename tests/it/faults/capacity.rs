//! Capacity (issue 14): the default settings carry real traffic, and a full table is a decision
//! (evict a record older than the protection floor, or 503 `capacity-exhausted`), not an outage.
//! The long case runs in `make test-faults`.

use crate::support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{http, Stack};

/// Polls a gauge until `ok` holds or the background sweep has passed over the whole table a few
/// more times (each worker's root sums the gauges from the buckets its sweep reads, 512 a second,
/// layout v4), bounded by count: the counter `local_sweep_passes`, never a duration.
fn gauge_until(s: &Stack, name: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let passes = s.envoy.stat("idemgate.local_sweep_passes");
    let mut v = s.envoy.stat(name);
    for _ in 0..3000 {
        // Every root (2 workers and the main thread) passing twice more: each one's figures
        // were read after the traffic.
        if ok(v) || s.envoy.stat("idemgate.local_sweep_passes") >= passes + 6 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        v = s.envoy.stat(name);
    }
    s.envoy.stat(name)
}

fn post(s: &Stack, key: &str) -> http::Response {
    let h = [("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    http::request(s.envoy.port, "POST", "/charges", &h, b"{\"amount\":1}").expect("request")
}

/// Drives `threads * per_thread` unique keys through wrk (keep-alive, 32 connections per thread),
/// bounded by count: each thread stops once every one of its keys was answered and leaves a marker file;
/// once every thread has, wrk is interrupted (SIGINT: it prints its report and runs `done`).
/// Returns wrk's report.
fn wrk_unique_keys(port: u16, threads: u64, per_thread: u64, body_bytes: u64, progress: impl Fn() -> u64) -> String {
    let dir = support::Scratch::new("capacity");
    let lua = dir.0.join("keys.lua");
    let marker = dir.0.join("done-");
    std::fs::write(
        &lua,
        format!(
            r#"local threads = {{}}
setup = function(thread)
  table.insert(threads, thread)
  thread:set("tid", tostring(#threads))
end
n = 0
answered = 0
refused = 0
other = 0
request = function()
  if n >= {per_thread} then
    return wrk.format("GET", "/health", {{["Host"] = "t", ["x-up-status"] = "200"}})
  end
  n = n + 1
  if n == {per_thread} then
    local f = io.open("{marker}sent-" .. tid, "w")
    if f then f:close() end
  end
  return wrk.format("POST", "/charges", {{["Host"] = "t", ["authorization"] = "Bearer cap",
    ["content-type"] = "application/json", ["x-up-body-bytes"] = "{body_bytes}",
    ["idempotency-key"] = "cap-" .. tid .. "-" .. n}}, "{{\"amount\":1}}")
end
-- 200 answers the GETs sent past the quota; every POST answer is 201, 503 or another status.
response = function(status, headers, body)
  if status == 200 then return end
  answered = answered + 1
  if status == 503 then refused = refused + 1 elseif status ~= 201 then other = other + 1 end
  if answered == {per_thread} then
    local f = io.open("{marker}" .. tid, "w")
    if f then f:close() end
    wrk.thread:stop()
  end
end
done = function(summary, latency, requests)
  for _, t in ipairs(threads) do
    io.write(string.format("thread %s: sent %d answered %d refused %d other %d\n",
      t:get("tid"), t:get("n"), t:get("answered"), t:get("refused"), t:get("other")))
  end
end
"#,
            marker = marker.display()
        ),
    )
    .expect("lua");
    // The duration is only a safety net: every thread stops at its quota.
    let mut child = Command::new("wrk")
        .args([format!("-t{threads}").as_str(), &format!("-c{}", 32 * threads), "-d1500s", "--timeout", "30s", "-s"])
        .arg(&lua)
        .arg(format!("http://127.0.0.1:{port}"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("wrk (installed by make test-faults)");
    let finished = |t: u64| dir.0.join(format!("done-{t}")).exists();
    let sent = |t: u64| dir.0.join(format!("done-sent-{t}")).exists();
    // A key whose connection failed is never answered (wrk sends the next one on the new
    // connection): once every key was sent, stop when the upstream's count stops moving.
    let (mut last, mut still) = (0, 0);
    for _ in 0..7_200 {
        if (1..=threads).all(finished) || !matches!(child.try_wait(), Ok(None)) {
            break;
        }
        if (1..=threads).all(sent) {
            let now = progress();
            still = if now == last { still + 1 } else { 0 };
            last = now;
            if still >= 10 {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
    let out = child.wait_with_output().expect("wrk output");
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn field(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with("thread "))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let at = words.iter().position(|w| *w == name)?;
            words.get(at + 1)?.parse::<u64>().ok()
        })
        .sum()
}

#[test]
fn capacity_default_config_carries_200000_unique_keys_without_a_503() {
    // Defaults, only the scope set, no store: the configuration a new user starts with.
    const THREADS: u64 = 2;
    let keys: u64 = std::env::var("IDEMGATE_CAPACITY_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    let body: u64 = std::env::var("IDEMGATE_CAPACITY_BODY_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let cfg = std::env::var("IDEMGATE_CAPACITY_CONFIG")
        .unwrap_or_else(|_| r#"{"scope": {"headers": ["authorization"]}}"#.to_string());
    let s = Stack::new(&cfg);
    let rss_0 = s.envoy.rss_bytes();
    // A few more keys than the target: a key lost to a client-side socket error is never sent.
    let text = wrk_unique_keys(s.envoy.port, THREADS, keys / THREADS + 100, body, || s.envoy.stat("idemgate.claimed"));
    let (sent, answered, refused, other) =
        (field(&text, "sent"), field(&text, "answered"), field(&text, "refused"), field(&text, "other"));
    let claimed = s.envoy.stat("idemgate.claimed");
    let occupancy = gauge_until(&s, "idemgate.local_occupancy", |v| v >= claimed);
    let rss_1 = s.envoy.rss_bytes();
    println!(
        "capacity: {sent} keys ({body}-byte responses), {answered} answers, {refused} refused, {other} other; \
         envoy rss {} KiB -> {} KiB; local_occupancy {occupancy}, local_capacity {}, local_record_bytes {}, \
         local_index_bytes {}",
        rss_0 / 1024,
        rss_1 / 1024,
        s.envoy.stat("idemgate.local_capacity"),
        s.envoy.stat("idemgate.local_record_bytes"),
        s.envoy.stat("idemgate.local_index_bytes"),
    );
    assert_eq!(sent, keys + 100 * THREADS, "wrk sent every key: {text}");
    assert_eq!(refused, 0, "503s: {text} (local_full {})", s.envoy.stat("idemgate.local_full"));
    assert_eq!(other, 0, "answers other than 201: {text}");
    assert_eq!(s.envoy.stat("idemgate.local_full"), 0);
    assert_eq!(s.envoy.stat("idemgate.local_evictions"), 0, "nothing evicted below capacity");
    // State: every key executed exactly once (the upstream also counts the unkeyed GETs).
    let log = s.up.log();
    let keyed: Vec<_> = log.into_iter().filter_map(|x| x.key).collect();
    let executed = keyed.len() as u64;
    assert!(executed >= keys, "{executed} keys executed, fewer than {keys}: {text}");
    assert_eq!(keyed.iter().collect::<std::collections::HashSet<_>>().len() as u64, executed, "a key executed twice");
    assert_eq!(s.envoy.stat("idemgate.claimed"), executed);
    assert_eq!(occupancy, executed, "every record is held");
}

#[test]
fn capacity_a_full_table_refuses_under_the_protection_floor_and_evicts_records_older_than_it() {
    // 32 records, a 5 s floor: short settings so the test is about state, not about waiting, and a
    // floor the fill is measured against (a machine too slow to send 33 requests within it fails
    // saying so, never with a wrong verdict).
    const FLOOR: Duration = Duration::from_secs(5);
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 32, "min_protection_seconds": 5}}"#,
    );
    let filled_from = Instant::now();
    for n in 0..32 {
        assert_eq!(post(&s, &format!("k-{n}")).status, 201, "k-{n}");
    }
    // Every record is younger than the floor: the documented 503, nothing forgotten or executed.
    let r = post(&s, "k-32");
    let fill = filled_from.elapsed();
    assert!(fill < FLOOR, "filling 32 records took {fill:?}, not under the {FLOOR:?} floor: too slow to judge");
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(r.json()["type"].as_str(), Some("urn:idemgate:problem:capacity-exhausted"));
    assert!(r.header("retry-after").is_some());
    assert_eq!(s.up.executions(), 32);
    assert_eq!(s.envoy.stat("idemgate.local_evictions"), 0);
    assert_eq!(gauge_until(&s, "idemgate.local_occupancy", |v| v == 32), 32);
    assert_eq!(s.envoy.stat("idemgate.local_capacity"), 32);
    for n in 0..32 {
        assert_eq!(post(&s, &format!("k-{n}")).header("idempotent-replayed"), Some("true"), "k-{n} kept");
    }
    // Past the floor, the oldest finished records go: k-32 is refused (nothing executed) until the
    // oldest record is older than the floor, then claimed by evicting it. Waited for by asking,
    // bounded by count, not by sleeping a guess; never claimed before the floor (whole seconds:
    // up to 1 s early by our clock).
    // Each of k-32..k-39 waits so for the record it evicts (k-0, then k-1, ...: filled one after
    // the other, each crosses the floor a little later), counting its refusals.
    let claim_past_the_floor = |key: &str| -> u64 {
        for refusals in 0..400 {
            let r = post(&s, key);
            if r.status == 201 {
                return refusals;
            }
            assert_eq!(
                r.json()["type"].as_str(),
                Some("urn:idemgate:problem:capacity-exhausted"),
                "{key}: {}",
                r.body_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{key} still refused after 400 polls ({:?} after the fill began)", filled_from.elapsed());
    };
    let mut refused = 1 + claim_past_the_floor("k-32");
    let claimed_after = filled_from.elapsed();
    assert_eq!(s.up.executions(), 33);
    assert!(claimed_after + Duration::from_secs(1) >= FLOOR, "evicted {claimed_after:?} after the fill began");
    for n in 33..40 {
        refused += claim_past_the_floor(&format!("k-{n}"));
    }
    assert_eq!(s.up.executions(), 40);
    assert_eq!(s.envoy.stat("idemgate.local_evictions"), 8);
    assert_eq!(s.envoy.stat("idemgate.local_full"), refused);
    let age = gauge_until(&s, "idemgate.local_evicted_age_seconds", |v| v >= 5);
    assert!((5..60).contains(&age), "age of the last evicted record: {age} s");
    assert_eq!(gauge_until(&s, "idemgate.local_occupancy", |v| v == 32), 32);
    // The new records are held: their retries replay.
    for n in 32..40 {
        assert_eq!(post(&s, &format!("k-{n}")).header("idempotent-replayed"), Some("true"), "k-{n} kept");
    }
    assert_eq!(s.up.executions(), 40);
}

#[test]
fn capacity_in_flight_records_are_never_evicted_even_past_the_floor() {
    let s = Stack::new(
        r#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 16, "min_protection_seconds": 1}}"#,
    );
    // 16 requests held by a slow upstream fill the table with claims in flight.
    let port = s.envoy.port;
    let held: Vec<_> = (0..16)
        .map(|n| {
            std::thread::spawn(move || {
                let key = format!("slow-{n}");
                let h =
                    [("authorization", "Bearer alice"), ("idempotency-key", key.as_str()), ("x-up-delay-ms", "4000")];
                http::request(port, "POST", "/charges", &h, b"{}").map(|r| r.status).unwrap_or(0)
            })
        })
        .collect();
    // Bounded by count: wait until all 16 reached the upstream.
    for _ in 0..100 {
        if s.up.executions() == 16 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(s.up.executions(), 16);
    std::thread::sleep(Duration::from_millis(1_500)); // past the 1 s floor, still in flight
    let r = post(&s, "another");
    assert_eq!(r.status, 503, "{}", r.body_text());
    assert_eq!(r.json()["type"].as_str(), Some("urn:idemgate:problem:capacity-exhausted"));
    assert_eq!(s.envoy.stat("idemgate.local_evictions"), 0);
    for h in held {
        assert_eq!(h.join().unwrap(), 201);
    }
    assert_eq!(s.up.executions(), 16);
}
