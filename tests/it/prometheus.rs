//! Issue 44: a real Prometheus (Debian's) scrapes a real Envoy with idemgate (a Redis store behind
//! webdis, two named routes) under a short bounded load, with ops/prometheus/idemgate.rules.yml
//! loaded: every recording rule yields data, every series an alert reads exists, the rules are
//! healthy, and every query of ops/grafana/idemgate.json returns data. The rules' logic is
//! unit-tested by `promtool test rules` (ops/prometheus/idemgate.test.yml, in `make test`).

use crate::support::{self, free_port, http, store::Redis, store::Webdis, upstream::Upstream, Envoy, EnvoyOptions};

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A Prometheus on loopback, stopped when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    _scratch: support::Scratch,
}

impl Prometheus {
    /// Scrapes Envoy's admin `/stats/prometheus` at `admin_port` every second, evaluating the
    /// shipped rules every second.
    fn start(admin_port: u16) -> Prometheus {
        Prometheus::start_with(admin_port, "")
    }

    /// As `start`, with `job` (YAML lines of the scrape job, indented by 2) added to the job.
    fn start_with(admin_port: u16, job: &str) -> Prometheus {
        let scratch = support::Scratch::new("prometheus");
        let rules = support::repo_root().join("ops/prometheus/idemgate.rules.yml");
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: ['{}']\nscrape_configs:\n- job_name: envoy\n  metrics_path: /stats/prometheus\n  static_configs:\n  - targets: ['127.0.0.1:{admin_port}']\n{job}",
            rules.display()
        );
        std::fs::write(scratch.0.join("prometheus.yml"), config).unwrap();
        let port = free_port();
        let log = std::fs::File::create(scratch.0.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", scratch.0.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", scratch.0.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus (scripts/install-deps.sh prometheus)");
        let p = Prometheus { child, port, _scratch: scratch };
        for _ in 0..300 {
            if http::get(port, "/-/ready").is_ok_and(|r| r.status == 200) {
                return p;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "prometheus not ready: {}",
            std::fs::read_to_string(p._scratch.0.join("prometheus.log")).unwrap_or_default()
        );
    }

    fn api(&self, path: &str) -> serde_json::Value {
        let r = http::get(self.port, path).expect("prometheus api");
        let v = r.json();
        assert_eq!(v["status"], "success", "{path}: {}", r.body_text());
        v["data"].clone()
    }

    /// The instant query's result (a vector).
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        let q: String = expr
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        self.api(&format!("/api/v1/query?query={q}"))["result"].as_array().cloned().unwrap_or_default()
    }

    /// Polls `expr` until it returns data, a number at least once (not only NaN: a quantile of
    /// rates that never rose), bounded by count: 240 polls.
    fn eventually(&self, expr: &str) -> Vec<serde_json::Value> {
        for _ in 0..240 {
            let r = self.query(expr);
            if r.iter().any(|s| s["value"][1].as_str().is_some_and(|v| v.parse::<f64>().is_ok_and(f64::is_finite))) {
                return r;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!("no data for {expr}");
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every `idemgate_*` / `envoy_*` series name an expression reads (histograms by their buckets).
fn series_names(expr: &str) -> Vec<String> {
    let mut out = vec![];
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let rest = &expr[i..];
        let starts = (rest.starts_with("idemgate_") || rest.starts_with("envoy_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':'));
        if starts {
            let n = rest.bytes().take_while(|b| b.is_ascii_alphanumeric() || *b == b'_').count();
            out.push(rest[..n].to_string());
            i += n;
        } else {
            i += 1;
        }
    }
    out.sort();
    out.dedup();
    out
}

fn post(port: u16, path: &str, key: &str, body: &str, extra: &[(&str, &str)]) -> u16 {
    let mut h = vec![("authorization", "Bearer alice"), ("content-type", "application/json"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    http::request(port, "POST", path, &h, body.as_bytes()).expect("request").status
}

/// Every `idemgate_*` / `envoy_*` series name the shipped alert and recording rules and the
/// dashboard's panels read.
fn queried_series() -> Vec<String> {
    let rules = std::fs::read_to_string(support::repo_root().join("ops/prometheus/idemgate.rules.yml")).unwrap();
    let mut names: Vec<String> = rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter(|l| ["summary:", "description:", "runbook:", "record:", "alert:"].iter().all(|k| !l.contains(k)))
        .flat_map(series_names)
        .collect();
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(support::repo_root().join("ops/grafana/idemgate.json")).unwrap())
            .unwrap();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            names.extend(series_names(t["expr"].as_str().unwrap()));
        }
    }
    names.sort();
    names.dedup();
    names
}

/// The series of the Wasm build's dashboard and alerts that a native proxy has no counterpart of
/// (docs/native.md): the wait histogram (this proxy's configuration has no `in_flight: "wait"`) and
/// Envoy's own Wasm VM counter (no Wasm VM in a native proxy).
const NOT_FROM_A_NATIVE_PROXY: &[&str] = &["idemgate_wait_ms_bucket", "envoy_wasm_envoy_wasm_runtime_v8_created"];

/// Issue 45: a real Prometheus scraping a native proxy's Envoy (Redis through webdis, two routes)
/// with docs/native.md's `stats_tags` in Envoy and its `metric_relabel_configs` in the scrape job
/// shows every series the Wasm build's dashboard and alert rules read under the same name and
/// labels (`idemgate_route_replayed{route="charges"}`, `idemgate_build_info{version=...}`), none
/// left under `envoy_dynamicmodulescustom_idemgate_*`, and the rules evaluate on them.
#[test]
fn a_native_proxy_scraped_with_the_documented_relabel_rule_shows_the_dashboards_series() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]},
            "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000},
            "routes": [{"prefix": "/charges", "name": "charges"}, {"prefix": "/"}]}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    // Its stats_config is docs/native.md's (`Build::stats_config`).
    o.build = support::Build::Native;
    let e = Envoy::start(&o);
    let relabel = support::native_doc_block("metric_relabel_configs:");
    let job: String = relabel.lines().map(|l| format!("  {l}\n")).collect();
    let prom = Prometheus::start_with(e.admin_port, &job);
    prom.eventually("idemgate_build_info");
    for i in 0..10 {
        let path = if i % 2 == 0 { "/charges" } else { "/refunds" };
        let key = format!("n-{i}");
        assert_eq!(post(e.port, path, &key, "{}", &[]), 201);
        assert_eq!(post(e.port, path, &key, "{}", &[]), 201);
    }
    assert_eq!(post(e.port, "/charges", "n-0", r#"{"other":1}"#, &[]), 422);
    assert_eq!(up.executions(), 10, "every key executed once");
    assert_eq!(e.stat("idemgate.replayed"), 10);

    // The documented names and labels (histograms once Envoy merged them, on its 5 s flush).
    prom.eventually("idemgate_replayed >= 10");
    prom.eventually("idemgate_route_replayed{route=\"charges\"} >= 5");
    prom.eventually("idemgate_route_replayed{route=\"root\"} >= 5");
    prom.eventually(&format!("idemgate_build_info{{version=\"{}\"}} == 1", env!("CARGO_PKG_VERSION")));
    prom.eventually("idemgate_key_held_ms_count >= 10");
    prom.eventually("idemgate_store_round_trip_ms_count >= 1");
    prom.eventually("idemgate_replay_bytes_count >= 10");
    // Every series the dashboard and the alerts read, but those a native proxy cannot have.
    let queried = queried_series();
    assert!(queried.len() >= 30, "{queried:?}");
    for name in queried.iter().filter(|n| !NOT_FROM_A_NATIVE_PROXY.contains(&n.as_str())) {
        prom.eventually(&format!("count({name})"));
    }
    // Nothing of idemgate's left under Envoy's dynamic-module namespace.
    let left = prom.query("count by (__name__) ({__name__=~\"envoy_dynamicmodulescustom_.*\"})");
    assert!(left.is_empty(), "series left under envoy_dynamicmodulescustom_: {left:?}");
    // The recording rules evaluate on them.
    prom.eventually("idemgate:claimed:rate5m > 0");
    prom.eventually("idemgate_route:replayed:rate5m{route=\"charges\"} > 0");
    prom.eventually("idemgate:store_round_trip_ms:p99_5m >= 0");
}

#[test]
fn prometheus_scrapes_envoy_and_every_rule_and_panel_query_returns_data() {
    let redis = Redis::start();
    let webdis = Webdis::start(redis.port);
    let up = Upstream::start();
    let mut o = EnvoyOptions::new(
        r#"{"scope": {"headers": ["authorization"]}, "in_flight": "wait", "wait_ms": 5000,
            "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 1000},
            "routes": [{"prefix": "/charges", "name": "charges"}, {"prefix": "/"}]}"#,
        up.port,
    );
    o.store_port = Some(webdis.port);
    let e = Envoy::start(&o);
    let prom = Prometheus::start(e.admin_port);
    let began = unix_seconds();
    // Scraped once before the load: the rates below rise from it.
    prom.eventually("idemgate_build_info");

    // The load, bounded, in two waves (Envoy shows a histogram only once it holds a value, so
    // its rates rise from the first wave's counts): 20 keys on two routes, each sent twice
    // (executed, then replayed), one retry held while its first attempt runs, one key reused
    // with another body.
    let wave = |w: usize| {
        for i in 0..10 {
            let path = if i % 2 == 0 { "/charges" } else { "/refunds" };
            let key = format!("k-{w}-{i}");
            assert_eq!(post(e.port, path, &key, "{}", &[]), 201);
            assert_eq!(post(e.port, path, &key, "{}", &[]), 201);
        }
    };
    wave(0);
    let port = e.port;
    let first = std::thread::spawn(move || post(port, "/charges", "k-wait", "{}", &[("x-up-delay-ms", "300")]));
    for _ in 0..200 {
        if up.executions() >= 11 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(post(e.port, "/charges", "k-wait", "{}", &[]), 201);
    assert_eq!(first.join().unwrap(), 201);
    prom.eventually("idemgate_store_round_trip_ms_count > 0");
    prom.eventually("idemgate_wait_ms_count >= 1");
    wave(1);
    assert_eq!(post(e.port, "/charges", "k-0-0", r#"{"other":1}"#, &[]), 422);
    assert_eq!(up.executions(), 21, "every key executed once");
    assert_eq!(e.stat("idemgate.replayed"), 21);

    // Prometheus has the load (histograms once Envoy merged them, on its 5 s flush).
    prom.eventually("idemgate_replayed{} >= 21");
    prom.eventually("idemgate_route_replayed{route=\"charges\"} >= 11");
    prom.eventually("idemgate_key_held_ms_count >= 21");

    // Every rule is loaded and healthy, and every recording rule yields data (the rates above 0).
    let groups = prom.api("/api/v1/rules")["groups"].as_array().cloned().unwrap();
    let rules: Vec<serde_json::Value> = groups.iter().flat_map(|g| g["rules"].as_array().cloned().unwrap()).collect();
    assert!(rules.len() >= 20, "{rules:?}");
    for r in &rules {
        let name = r["name"].as_str().unwrap();
        assert_eq!(r["health"], "ok", "{name}: {r}");
        if r["type"] == "recording" {
            prom.eventually(name);
        } else {
            // An alert fires only on trouble: every series it reads must exist.
            for s in series_names(r["query"].as_str().unwrap()) {
                prom.eventually(&format!("count({s})"));
            }
        }
    }
    prom.eventually("idemgate:claimed:rate5m > 0");
    prom.eventually("idemgate_route:replayed:rate5m{route=\"root\"} > 0");
    prom.eventually("idemgate:store_round_trip_ms:p99_5m >= 0");
    // No alert fires on this healthy stack (IdemgateMissing included).
    let firing: Vec<serde_json::Value> = prom.api("/api/v1/alerts")["alerts"]
        .as_array()
        .cloned()
        .unwrap()
        .into_iter()
        .filter(|a| a["state"] == "firing")
        .collect();
    assert!(firing.is_empty(), "{firing:?}");

    // Every query of the dashboard returns data.
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(support::repo_root().join("ops/grafana/idemgate.json")).unwrap())
            .unwrap();
    let mut queries = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap().replace("$__rate_interval", "1m");
            prom.eventually(&expr);
            queries += 1;
        }
    }
    assert!(queries >= 20, "{queries}");

    // The same queries plotted over the run (docs/dashboard.svg is one such picture): the script
    // fails when a query has no data over the range.
    let dir = support::repo_root().join("target/prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new("python3")
        .arg(support::repo_root().join("scripts/plot-dashboard.py"))
        .arg(format!("http://127.0.0.1:{}", prom.port))
        .arg(format!("{}", began))
        .arg(format!("{}", unix_seconds()))
        .arg(dir.join("dashboard.svg"))
        .arg("15s")
        .output()
        .expect("python3");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    let svg = std::fs::read_to_string(dir.join("dashboard.svg")).unwrap();
    assert!(svg.matches("<polyline").count() >= queries, "{text}");
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// The one mapping between the builds' series in the tests (`support::Envoy::prometheus`):
/// docs/native.md's relabel rule, read from that page, renames the native build's
/// `envoy_dynamicmodulescustom_idemgate_*` (samples with or without labels, `# TYPE` lines) to the
/// Wasm build's names and leaves every other line as it is (the Wasm build's series, Envoy's own,
/// another module's).
#[test]
fn the_documented_relabel_rule_gives_the_native_builds_series_the_wasm_builds_names() {
    let rule = support::RelabelRule::documented();
    let native = "# TYPE envoy_dynamicmodulescustom_idemgate_claimed counter\n\
                  envoy_dynamicmodulescustom_idemgate_claimed{} 1\n\
                  envoy_dynamicmodulescustom_idemgate_route_replayed{route=\"charges\"} 1\n\
                  envoy_dynamicmodulescustom_idemgate_key_held_ms_bucket{le=\"250\"} 0\n\
                  envoy_dynamicmodulescustom_other_claimed{} 2\n";
    assert_eq!(
        rule.apply_to_text(native),
        "# TYPE idemgate_claimed counter\n\
         idemgate_claimed{} 1\n\
         idemgate_route_replayed{route=\"charges\"} 1\n\
         idemgate_key_held_ms_bucket{le=\"250\"} 0\n\
         envoy_dynamicmodulescustom_other_claimed{} 2\n"
    );
    let wasm = "# TYPE idemgate_claimed counter\n\
                idemgate_claimed 1\n\
                idemgate_route_replayed{route=\"charges\"} 1\n\
                envoy_cluster_upstream_rq_completed{envoy_cluster_name=\"upstream\"} 3\n";
    assert_eq!(rule.apply_to_text(wasm), wasm);
}
