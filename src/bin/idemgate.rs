//! `idemgate`: the operator's command line (native only: the wasm build uses `--lib`, and clap
//! is a dependency for non-wasm targets only). It talks to the store the filter uses: Redis
//! behind webdis (`--webdis` or `IDEMGATE_WEBDIS`), or etcd (`--etcd URL[,URL...]` or
//! `IDEMGATE_ETCD`, `etcd_store.rs`), with the credential in `IDEMGATE_STORE_AUTH` as
//! `user:password`, the variable the filter reads, and leaves every rule to the core
//! (`idemgate::admin`, `idemgate::probe`, `idemgate::store`, `idemgate::etcd`).
//!
//!     idemgate key [--config plugin.json] [--namespace N] --scope-header 'authorization: Bearer ...' --authority api.example KEY
//!     idemgate inspect STORAGE_KEY
//!     idemgate list --state outcome-unknown|in-flight|completed [--limit N]
//!     idemgate resolve STORAGE_KEY --release
//!     idemgate resolve STORAGE_KEY --complete --status 201 [--body-file F] [--header 'name: value' ...]
//!     idemgate forget STORAGE_KEY [--force]
//!     idemgate probe URL [--profile draft|stripe|strict] [--count-url U] [--json] ... (docs/probe.md)
//!     idemgate --version
//!
//! Every command takes `--json`: its result (or its failure, `{"ok": false, "error", "exit"}`) as
//! one JSON document on stdout (docs/operating.md, "Machine-readable output").
//!
//! Exit status: 0 done, 1 refused / absent where an action needed a record / a probe violation /
//! a store error, 2 a usage error (for probe also: the target unreachable or failing before any
//! rule), 3 a probe rule inconclusive with --fail-inconclusive.

#![deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "idemgate/etcd_store.rs"]
mod etcd_store;
#[path = "idemgate/probe_cmd.rs"]
mod probe_cmd;
#[path = "idemgate/tls.rs"]
mod tls;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches, Command};
use idemgate::admin::{self, Header, KeyRequest, Settle};
use idemgate::backend::{Backend, Listed, Listing, RawValue};
use idemgate::config::{Anonymous, Config, StoreKind};
use idemgate::etcd::Fence;
use idemgate::probe::Answer;
use idemgate::record::Stage;
use idemgate::scope::StorageKey;
use idemgate::seal::Seal;
use idemgate::store::{self, ReadReply, StoreError, StoreRequest, TransitionReply};

const DEFAULT_WEBDIS: &str = "http://127.0.0.1:7379";
const TIMEOUT: Duration = Duration::from_secs(30);

/// The most bytes of one HTTP answer the CLI reads (`--max-answer-bytes`), headers included: a
/// store's largest answer is one value read whole, at most the largest request the store
/// accepts (webdis's default 128 MiB: `config::WEBDIS_DEFAULT_MAX_REQUEST_BYTES`) in base64
/// (etcd's JSON: 4/3), with room for the framing. A broken or hostile endpoint that sends more
/// (or announces more) ends the command with an error instead of filling memory.
const DEFAULT_MAX_ANSWER_BYTES: u64 = idemgate::config::WEBDIS_DEFAULT_MAX_REQUEST_BYTES / 3 * 4 + (1 << 20);

/// `--max-answer-bytes`, set once by `main` before any request.
static MAX_ANSWER_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(DEFAULT_MAX_ANSWER_BYTES);

fn max_answer_bytes() -> usize {
    usize::try_from(MAX_ANSWER_BYTES.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(usize::MAX)
}

/// `--version`'s long form: the release and the formats it reads and writes.
fn long_version() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| format!("{}\n{}", idemgate::release::VERSION, idemgate::release::formats()))
}

/// `--json` on a subcommand: its result as one JSON document.
fn json_flag() -> Arg {
    Arg::new("json").long("json").action(ArgAction::SetTrue).help("the result (or the failure) as JSON on stdout")
}

/// Prints `doc` as one JSON line.
fn print_json(doc: &serde_json::Value) {
    println!("{}", serde_json::to_string(doc).unwrap_or_default());
}

/// A failure: its message and exit status.
struct Fail(String, u8);

fn fail<T>(msg: impl Into<String>) -> Result<T, Fail> {
    Err(Fail(msg.into(), 1))
}

fn usage<T>(msg: impl Into<String>) -> Result<T, Fail> {
    Err(Fail(msg.into(), 2))
}

fn cli() -> Command {
    let key = || Arg::new("storage_key").required(true).help("the storage key: 64 hex digits (or idemgate:v1:<hex>)");
    // The proxies' `store.timeout_ms`: a claim whose lock expired is settled only once its
    // proxy's writes (each retried, then a fallback) cannot land any more.
    let store_timeout = || {
        Arg::new("store_timeout_ms")
            .long("store-timeout-ms")
            .value_parser(clap::value_parser!(u64).range(1..=idemgate::config::MAX_STORE_TIMEOUT_MS))
            .help(
                "the proxies' store.timeout_ms (default: the largest allowed, 60000): a claim whose lock \
                 expired is settled only after its proxy's write retries are over",
            )
    };
    let headers = |help: &'static str| Arg::new("header").long("header").action(ArgAction::Append).help(help);
    Command::new("idemgate")
        .about("See and settle idempotency keys in idemgate's store; prove an API idempotent")
        .version(env!("CARGO_PKG_VERSION"))
        .long_version(long_version())
        .subcommand_required(true)
        .arg_required_else_help(true)
        .arg(
            Arg::new("max_answer_bytes")
                .long("max-answer-bytes")
                .global(true)
                .value_parser(clap::value_parser!(u64).range(1024..))
                .help("the most bytes of one HTTP answer read (default: 172 MiB, a store's largest value)"),
        )
        .arg(Arg::new("webdis").long("webdis").global(true).help(
            "webdis URL (default: $IDEMGATE_WEBDIS or http://127.0.0.1:7379); credential from $IDEMGATE_STORE_AUTH",
        ))
        .arg(Arg::new("etcd").long("etcd").global(true).conflicts_with("webdis").help(
            "the etcd store instead: http://host:port of a member or a load balancer, several comma-separated \
             (tried in order while one does not connect); default $IDEMGATE_ETCD; credential from \
             $IDEMGATE_STORE_AUTH (user:password)",
        ))
        .subcommand(
            Command::new("key")
                .about("The storage key of a request, computed exactly as the filter does")
                .arg(Arg::new("key").required(true).help("the Idempotency-Key header's value as sent"))
                .arg(Arg::new("config").long("config").help("the plugin configuration (JSON) to take the policy from"))
                .arg(Arg::new("method").long("method").default_value("POST").help("with --config: selects the route"))
                .arg(Arg::new("path").long("path").default_value("/").help("with --config: selects the route"))
                .arg(Arg::new("route_name").long("route-name").help("with --config: the Envoy route that matched"))
                .arg(Arg::new("namespace").long("namespace").help("default: idemgate (or the policy's)"))
                .arg(
                    Arg::new("scope_header")
                        .long("scope-header")
                        .action(ArgAction::Append)
                        .help("'name: value' of a scope header the request carried (repeat for each line)"),
                )
                .arg(Arg::new("scope_names").long("scope-names").help(
                    "the configured scope headers, comma-separated, in order (default: the policy's, or the \
                     names given with --scope-header)",
                ))
                .arg(Arg::new("authority").long("authority").help("the request's :authority"))
                .arg(Arg::new("scheme").long("scheme").help(
                    "the request's :scheme (no longer changes the key: ports 80 and 443 are dropped from \
                     the authority whatever the scheme, as the filter does)",
                ))
                .arg(
                    Arg::new("no_authority")
                        .long("no-authority")
                        .action(ArgAction::SetTrue)
                        .help("the policy has scope.include_authority: false"),
                )
                .arg(Arg::new("anonymous_shared").long("anonymous-shared").action(ArgAction::SetTrue))
                .arg(Arg::new("key_max_length").long("key-max-length").value_parser(clap::value_parser!(usize)))
                .arg(json_flag()),
        )
        .subcommand(
            Command::new("inspect")
                .about(
                    "A key's record as JSON, or 'absent'; a value this build cannot read is shown as far as it \
                     can be (state 'unreadable': why, its size, SHA-1, TTL, plain-text phase and lock)",
                )
                .arg(key())
                .arg(json_flag()),
        )
        .subcommand(
            Command::new("list")
                .about("Storage keys in a state (SCAN and ranged reads: never blocks Redis)")
                .arg(Arg::new("state").long("state").required(true).help("outcome-unknown, in-flight or completed"))
                .arg(Arg::new("limit").long("limit").default_value("100").value_parser(clap::value_parser!(usize)))
                .arg(json_flag()),
        )
        .subcommand(
            Command::new("resolve")
                .about("Settle an outcome-unknown key or a stale claim (owner- and phase-checked)")
                .arg(key())
                .arg(Arg::new("release").long("release").action(ArgAction::SetTrue).help("the next retry executes"))
                .arg(
                    Arg::new("complete")
                        .long("complete")
                        .action(ArgAction::SetTrue)
                        .conflicts_with("release")
                        .help("retries replay this response"),
                )
                .arg(Arg::new("status").long("status").value_parser(clap::value_parser!(u16)))
                .arg(Arg::new("body_file").long("body-file"))
                .arg(headers("'name: value' of the stored response (repeat)"))
                .arg(
                    Arg::new("ttl_seconds")
                        .long("ttl-seconds")
                        .default_value("86400")
                        .value_parser(clap::value_parser!(u64))
                        .help("how long the completed record is kept"),
                )
                .arg(store_timeout())
                .arg(json_flag()),
        )
        .subcommand(
            Command::new("forget")
                .about(
                    "Delete a key's record from the store (refused while it is in flight), a value this build \
                     cannot read too. Proxies' local tiers keep their copies: a proxy that holds the key \
                     completed replays it until its copy expires or Envoy restarts",
                )
                .arg(key())
                .arg(store_timeout())
                .arg(Arg::new("force").long("force").action(ArgAction::SetTrue).help(
                    "delete a value this build cannot read whose phase or lock cannot be read either (it may be \
                     another build's live claim: check that no request with the key runs)",
                ))
                .arg(json_flag()),
        )
        .subcommand(probe_cmd::command())
}

fn main() -> ExitCode {
    let m = cli().get_matches();
    if let Some(n) = m.get_one::<u64>("max_answer_bytes") {
        MAX_ANSWER_BYTES.store(*n, std::sync::atomic::Ordering::Relaxed);
    }
    // `probe --json` writes its own report, failures included.
    let json = matches!(m.subcommand(), Some((name, a)) if name != "probe" && a.get_flag("json"));
    match run(&m) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(msg, code)) => {
            if json {
                print_json(&serde_json::json!({"ok": false, "error": msg, "exit": code}));
            }
            eprintln!("idemgate: {msg}");
            ExitCode::from(code)
        }
    }
}

fn run(m: &ArgMatches) -> Result<(), Fail> {
    // etcd when asked for (`--etcd`, or `IDEMGATE_ETCD` without `--webdis`); else webdis.
    let etcd_url = m.get_one::<String>("etcd").cloned().or_else(|| {
        std::env::var("IDEMGATE_ETCD").ok().filter(|v| !v.is_empty() && m.get_one::<String>("webdis").is_none())
    });
    // The only place that asks which store it is.
    let store = || -> Result<Store, Fail> {
        if let Some(url) = &etcd_url {
            return Ok(Store {
                backend: Backend::of(StoreKind::Etcd, None),
                link: Box::new(etcd_store::Etcd::connect(url)?),
            });
        }
        let url = m
            .get_one::<String>("webdis")
            .cloned()
            .or_else(|| std::env::var("IDEMGATE_WEBDIS").ok())
            .unwrap_or_else(|| DEFAULT_WEBDIS.to_string());
        Ok(Store { backend: Backend::of(StoreKind::Redis, None), link: Box::new(Webdis::new(&url)?) })
    };
    match m.subcommand() {
        Some(("key", a)) => key(a),
        Some(("inspect", a)) => inspect(&store()?, a),
        Some(("list", a)) => list(&store()?, a),
        Some(("resolve", a)) => resolve(&store()?, a),
        Some(("forget", a)) => forget(&store()?, a),
        Some(("probe", a)) => probe_cmd::run(a),
        _ => usage("a subcommand is needed (see --help)"),
    }
}

fn s<'a>(a: &'a ArgMatches, name: &str) -> Option<&'a String> {
    a.get_one::<String>(name)
}

fn many(a: &ArgMatches, name: &str) -> Vec<String> {
    a.get_many::<String>(name).map(|v| v.cloned().collect()).unwrap_or_default()
}

fn storage_key(a: &ArgMatches) -> Result<idemgate::scope::StorageKey, Fail> {
    admin::parse_storage_key(s(a, "storage_key").map_or("", |v| v.as_str())).or_else(usage)
}

fn key(a: &ArgMatches) -> Result<(), Fail> {
    let lines: Vec<(String, String)> = many(a, "scope_header")
        .iter()
        .map(|l| l.split_once(':').map(|(n, v)| (n.trim().to_ascii_lowercase(), v.to_string())))
        .collect::<Option<_>>()
        .map_or_else(|| usage("--scope-header: expected 'name: value'"), Ok)?;
    let mut req = KeyRequest { lines, key: s(a, "key").cloned().unwrap_or_default(), ..KeyRequest::default() };
    let mut include_authority = !a.get_flag("no_authority");
    req.namespace = "idemgate".into();
    req.key_max_length = 255;
    if let Some(path) = s(a, "config") {
        let text = std::fs::read(path).or_else(|e| usage(format!("{path}: {e}")))?;
        let cfg = Config::parse(&text).or_else(|e| usage(format!("{path}: {e}")))?;
        let (method, p) = (s(a, "method").map_or("POST", |v| v.as_str()), s(a, "path").map_or("/", |v| v.as_str()));
        let route = s(a, "route_name").map(|r| r.as_str());
        let Some(policy) = cfg.policy_index_for_route(method, p, route).and_then(|i| cfg.policy_at(i)) else {
            return usage(format!("{path}: no policy protects {method} {p}"));
        };
        req.namespace = policy.namespace.clone();
        req.scope_names = policy.scope.headers.clone();
        req.global = policy.scope.global;
        req.anonymous_shared = policy.scope.anonymous == Anonymous::Shared;
        req.key_max_length = policy.key_max_length;
        req.key_syntax = policy.key_syntax;
        include_authority &= policy.scope.include_authority;
    }
    if let Some(n) = s(a, "namespace") {
        req.namespace = n.clone();
    }
    if let Some(names) = s(a, "scope_names") {
        req.scope_names = names.split(',').map(|n| n.trim().to_ascii_lowercase()).filter(|n| !n.is_empty()).collect();
    } else if req.scope_names.is_empty() && !req.global {
        for (n, _) in &req.lines {
            if !req.scope_names.contains(n) {
                req.scope_names.push(n.clone());
            }
        }
    }
    req.anonymous_shared |= a.get_flag("anonymous_shared");
    if let Some(n) = a.get_one::<usize>("key_max_length") {
        req.key_max_length = *n;
    }
    req.scheme = s(a, "scheme").cloned().unwrap_or_default();
    req.authority = match (include_authority, s(a, "authority")) {
        (true, Some(auth)) => Some(auth.clone()),
        (true, None) => {
            return usage("--authority is needed (the scope includes it unless the policy says include_authority: false; then pass --no-authority)")
        }
        (false, _) => None,
    };
    let k = admin::storage_key_for(&req).or_else(usage)?;
    if let Some(why) = &k.refused {
        eprintln!("idemgate: note: {why}");
    }
    if a.get_flag("json") {
        print_json(&serde_json::json!({"ok": true, "storage_key": k.storage_key.hex(), "refused": k.refused}));
    } else {
        println!("{}", k.storage_key.hex());
    }
    Ok(())
}

/// The configured store: the interface that builds its requests and reads its answers
/// (`backend::Backend`, every rule of the store there) and the link that carries them.
struct Store {
    backend: Backend,
    link: Box<dyn Link>,
}

/// What carries a store's requests: webdis, or etcd's members (`etcd_store.rs`).
trait Link {
    /// Sends `r`; a refusal of the request itself (authentication, permission) is a clear failure.
    fn call(&self, r: &StoreRequest) -> Result<(Option<u16>, Vec<u8>), Fail>;
}

/// How many times the CLI asks a read again whose answer was not its own (`nonce`).
const READ_ATTEMPTS: usize = 3;

/// A new value for a read's answer to echo (a process-random hash of a counter and the clock):
/// an answer echoing another is another request's.
fn nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u64(local_now_ms());
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// This machine's clock in ms since the epoch.
fn local_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Store {
    /// The time an operator's judgement uses (`local_now_ms`: this machine's clock, read before
    /// the value was): the store's clock where locks are judged by it (Redis's `TIME`, a read: an
    /// answer that is not this request's, which webdis 0.1.9 can hand a new connection (another
    /// client's late answer: docs/stores.md), is asked again with a new nonce, three times at
    /// most), else this machine's as the filter judges it.
    fn now(&self, local_now_ms: u64) -> Result<u64, Fail> {
        if self.backend.clock_request("").is_none() {
            return Ok(self.backend.judged_now(local_now_ms));
        }
        let mut last = String::new();
        for _ in 0..READ_ATTEMPTS {
            let nonce = nonce();
            let Some(request) = self.backend.clock_request(&nonce) else { break };
            let (status, body) = self.link.call(&request)?;
            match self.backend.parse_clock(status, &body, &nonce) {
                Ok(ms) => return Ok(ms),
                Err(StoreError::Garbled(why)) => {
                    eprintln!("idemgate: note: asked again: {why}");
                    last = why
                }
                Err(e) => return fail(format!("store: {e}")),
            }
        }
        fail(last)
    }

    /// The page of keys from `cursor`: an answer that is not this request's (see `now`) is asked
    /// again, three times at most.
    fn list_page(&self, cursor: Option<&[u8]>) -> Result<Listing, Fail> {
        let mut last = String::new();
        for _ in 0..READ_ATTEMPTS {
            let nonce = nonce();
            let (status, body) = self.link.call(&self.backend.list_request(cursor, &nonce))?;
            match self.backend.parse_list(status, &body, cursor, &nonce) {
                Ok(page) => return Ok(page),
                Err(StoreError::Garbled(why)) => {
                    eprintln!("idemgate: note: asked again: {why}");
                    last = why
                }
                Err(e) => return fail(format!("store: {e}")),
            }
        }
        fail(format!("store: {last}"))
    }

    /// The value of `skey` and, where the store has one, what it was read as (`Fence`), judged
    /// at `local_now_ms`; a value this build cannot read comes as stored too (`RawValue`).
    fn read(&self, skey: &StorageKey, local_now_ms: u64) -> Result<KeyRead, Fail> {
        let (status, body) = self.link.call(&self.backend.read_request(skey))?;
        let (reply, fence) = self
            .backend
            .parse_fenced_read(status, &body, skey, &record_seal()?, local_now_ms)
            .or_else(|e| fail(format!("store: {e}")))?;
        let raw = match &reply {
            ReadReply::Unreadable(_) => {
                self.backend.parse_raw_read(status, &body, skey).or_else(|e| fail(format!("store: {e}")))?
            }
            _ => None,
        };
        Ok(KeyRead { reply, fence, raw })
    }

    /// What can be read of `raw`, a value of `skey` this build cannot open (etcd: one more read,
    /// of its owner mark).
    fn unsealed(&self, skey: &StorageKey, raw: &RawValue) -> Result<admin::Unsealed, Fail> {
        let mark = match self.backend.raw_phase_request(skey) {
            Some(r) => Some(self.link.call(&r)?),
            None => None,
        };
        self.backend
            .unsealed(raw, skey, mark.as_ref().map(|(status, body)| (*status, body.as_slice())))
            .or_else(|e| fail(format!("store: {e}")))
    }

    /// The store's own fields of `skey` (`Backend::store_fields`: Redis's `PTTL`, etcd's fence).
    fn store_fields(
        &self,
        skey: &StorageKey,
        fence: Option<&Fence>,
    ) -> Result<Vec<(&'static str, serde_json::Value)>, Fail> {
        let answer = match self.backend.inspect_request(skey) {
            Some(r) => Some(self.link.call(&r)?),
            None => None,
        };
        self.backend
            .store_fields(fence, answer.as_ref().map(|(status, body)| (*status, body.as_slice())))
            .or_else(|e| fail(format!("store: {e}")))
    }
}

impl Store {
    /// The keys of a listing's page with their stage, lock expiry and the time they are judged
    /// at: a key read with its header (Redis) at `now`; a name alone (etcd) by reading its value,
    /// `etcd::READ_MANY_MAX` keys a request. Tombstones and absent values are left out; values
    /// this build cannot read (a Redis header it does not know, an etcd value it cannot open) are
    /// counted in `unreadable`.
    fn judge_page(
        &self,
        found: Vec<Listed>,
        now: u64,
        unreadable: &mut usize,
    ) -> Result<Vec<(String, Stage, u64, u64)>, Fail> {
        let mut out = vec![];
        let mut names = vec![];
        for f in found {
            match f {
                Listed::Header { hex, header: Header::Value { state, lock_expires_at_ms, .. } } => {
                    out.push((hex, state, lock_expires_at_ms, now))
                }
                Listed::Header { header: Header::Unreadable, .. } => *unreadable += 1,
                Listed::Header { header: Header::Tombstone, .. } => {}
                Listed::Key(skey) => names.push(skey),
            }
        }
        let seal = if names.is_empty() { None } else { Some(record_seal()?) };
        for chunk in names.chunks(idemgate::etcd::READ_MANY_MAX) {
            let (Some(request), Some(seal)) = (self.backend.read_many_request(chunk), seal.as_ref()) else { break };
            let local = local_now_ms();
            let (status, body) = self.link.call(&request)?;
            let reads = self
                .backend
                .parse_read_many(status, &body, chunk, seal, local)
                .or_else(|e| fail(format!("store: {e}")))?;
            for (skey, read) in chunk.iter().zip(reads) {
                match read {
                    ReadReply::Found(v) => {
                        out.push((skey.hex(), v.phase, v.lock_expires_at_ms, self.backend.judged_now(local)))
                    }
                    ReadReply::Absent => {}
                    ReadReply::Unreadable(_) => *unreadable += 1,
                }
            }
        }
        Ok(out)
    }
}

/// A read of one key (`Store::read`).
struct KeyRead {
    reply: ReadReply,
    fence: Option<Fence>,
    /// The value as stored when this build cannot read it (`ReadReply::Unreadable`).
    raw: Option<RawValue>,
}

fn inspect(st: &Store, a: &ArgMatches) -> Result<(), Fail> {
    let skey = storage_key(a)?;
    let json = a.get_flag("json");
    let local = local_now_ms();
    let now = st.now(local)?;
    let read = st.read(&skey, local)?;
    let mut report = match (&read.reply, &read.raw) {
        (ReadReply::Absent, _) => {
            if json {
                print_json(&serde_json::json!({"ok": true, "storage_key": skey.hex(), "state": "absent"}));
            } else {
                println!("absent");
            }
            return Ok(());
        }
        (ReadReply::Found(v), _) => admin::report(&skey, v, now),
        // Shown as far as it can be: what it is not, its size, what is plain text in it.
        (ReadReply::Unreadable(why), Some(raw)) => {
            eprintln!("idemgate: note: the key holds a value this build cannot read: {why}");
            admin::raw_report(&skey, &why.to_string(), &raw.bytes, &st.unsealed(&skey, raw)?, now)
        }
        (ReadReply::Unreadable(why), None) => {
            return fail(format!("the key holds a value this build cannot read: {why}"))
        }
    };
    let mut fields = st.store_fields(&skey, read.fence.as_ref())?;
    if let Some(rev) = read.raw.as_ref().and_then(|r| r.revision) {
        fields.push(("store_mod_revision", rev.into()));
    }
    if let Some(o) = report.as_object_mut() {
        for (name, value) in fields {
            o.insert(name.into(), value);
        }
        if json {
            o.insert("ok".into(), true.into());
        }
    }
    if json {
        print_json(&report);
    } else {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    }
    Ok(())
}

/// Pages of the store's keys (`Backend::list_request`: never a command that blocks the store,
/// never an unbounded range), each judged by the header read with it or, where the page holds
/// names only (etcd), by one read of its value, until `--limit` are shown.
fn list(st: &Store, a: &ArgMatches) -> Result<(), Fail> {
    let want = admin::parse_state(s(a, "state").map_or("", |v| v.as_str())).or_else(usage)?;
    let limit = a.get_one::<usize>("limit").copied().unwrap_or(100);
    let json = a.get_flag("json");
    let mut listed = vec![];
    let mut pages = 0u64;
    // Whether the store's listing ended, and whether `--limit` left keys of a page unjudged.
    let (mut ended, mut cut) = (false, false);
    let now = st.now(local_now_ms())?;
    let mut cursor: Option<Vec<u8>> = None;
    let mut seen = std::collections::HashSet::new();
    let mut shown = 0;
    let mut unreadable = 0;
    while shown < limit {
        let page = st.list_page(cursor.as_deref())?;
        pages += 1;
        for (hex, state, lock_expires_at_ms, now) in st.judge_page(page.found, now, &mut unreadable)? {
            if shown >= limit {
                cut = true;
                break;
            }
            if state != want {
                continue;
            }
            let name = admin::state_name(state);
            if json {
                let mut entry = serde_json::json!({"storage_key": hex, "state": name});
                if state == Stage::Forwarded {
                    let live = lock_expires_at_ms > now;
                    entry["lock"] = (if live { "live" } else { "expired" }).into();
                    entry["lock_expires_in_ms"] = lock_expires_at_ms.saturating_sub(now).into();
                }
                listed.push(entry);
            } else {
                match state {
                    Stage::Forwarded if lock_expires_at_ms > now => {
                        println!("{hex}\t{name}\tlock live {} ms", lock_expires_at_ms - now)
                    }
                    Stage::Forwarded => println!("{hex}\t{name}\tlock expired"),
                    _ => println!("{hex}\t{name}"),
                }
            }
            shown += 1;
        }
        match page.next {
            // A store whose cursor comes back to one already read would list for ever.
            Some(next) if !seen.insert(next.clone()) => {
                return fail(format!(
                    "the store's listing came back to cursor {} already read: stopped after {shown} key(s) shown",
                    String::from_utf8_lossy(&next)
                ))
            }
            Some(next) => cursor = Some(next),
            None => {
                ended = true;
                break;
            }
        }
    }
    if unreadable > 0 {
        eprintln!("idemgate: note: {unreadable} value(s) this build cannot read (another record key?) were skipped");
    }
    if json {
        print_json(&serde_json::json!({
            "ok": true,
            "state": admin::state_name(want),
            "keys": listed,
            "shown": shown,
            "limit": limit,
            // Whether the listing went through the whole store (else `--limit` stopped it).
            "complete": ended && !cut,
            "pages": pages,
            "unreadable_skipped": unreadable,
        }));
    }
    Ok(())
}

fn resolve(st: &Store, a: &ArgMatches) -> Result<(), Fail> {
    let (skey, action, done) = settlement(a)?;
    let name = if action == Settle::Release { "released" } else { "completed" };
    let read = st.read(&skey, local_now_ms())?;
    settle(st, &skey, read, &action, write_window(a))?;
    done_message(a, &skey, name, done);
    Ok(())
}

/// What a settlement prints once done: `message`, or with `--json` `{"ok", "storage_key",
/// "result": result, "message"}`.
fn done_message(a: &ArgMatches, skey: &StorageKey, result: &str, message: &str) {
    if a.get_flag("json") {
        print_json(&serde_json::json!({"ok": true, "storage_key": skey.hex(), "result": result, "message": message}));
    } else {
        println!("{message}");
    }
}

/// `forget`: the record deleted by the owner- and phase-checked transition of `admin::plan`, or,
/// when this build cannot read the value, deleted only if it is still exactly the value read
/// (`Backend::forget_raw_request`), after `admin::plan_raw_forget` judged what could be read of
/// it (a claim whose lock is live is refused as for any value).
fn forget(st: &Store, a: &ArgMatches) -> Result<(), Fail> {
    let skey = storage_key(a)?;
    let local = local_now_ms();
    let read = st.read(&skey, local)?;
    let Some(raw) = read.raw.clone() else {
        settle(st, &skey, read, &Settle::Forget, write_window(a))?;
        done_message(a, &skey, "forgotten", admin::FORGOTTEN);
        return Ok(());
    };
    let seen = st.unsealed(&skey, &raw)?;
    let now = st.now(local)?;
    admin::plan_raw_forget(&seen, now, write_window(a), a.get_flag("force")).or_else(|r| fail(r.to_string()))?;
    let nonce = nonce();
    let (status, body) = st.link.call(&st.backend.forget_raw_request(&skey, &raw, &nonce))?;
    match st.backend.parse_forget_raw(status, &body, &nonce) {
        Ok(TransitionReply::Changed) => {
            done_message(a, &skey, "forgotten", &format!("unreadable value deleted: {}", admin::FORGOTTEN));
            Ok(())
        }
        Ok(_) => fail("refused: the value changed since it was read (or is gone); inspect it again"),
        Err(e) => fail(format!("store: {e}")),
    }
}

/// How long after a claim's lock expired its proxy may still land a write, from the proxies'
/// `store.timeout_ms` (`--store-timeout-ms`; by default the largest the configuration allows, so
/// the wait is never too short for any proxy).
fn write_window(a: &ArgMatches) -> u64 {
    let timeout_ms = a.get_one::<u64>("store_timeout_ms").copied().unwrap_or(idemgate::config::MAX_STORE_TIMEOUT_MS);
    idemgate::store::write_window_ms(timeout_ms)
}

/// What `resolve` asks (whichever the store): the key, the action, what to print once done.
fn settlement(a: &ArgMatches) -> Result<(idemgate::scope::StorageKey, Settle, &'static str), Fail> {
    let skey = storage_key(a)?;
    if a.get_flag("release") {
        return Ok((skey, Settle::Release, "released: the next retry executes"));
    }
    if !a.get_flag("complete") {
        return usage("resolve needs --release or --complete");
    }
    let Some(status) = a.get_one::<u16>("status") else { return usage("--complete needs --status") };
    let body = match s(a, "body_file") {
        Some(f) => std::fs::read(f).or_else(|e| usage(format!("{f}: {e}")))?,
        None => vec![],
    };
    let response = admin::operator_response(*status, &many(a, "header"), body).or_else(usage)?;
    let ttl_ms = a.get_one::<u64>("ttl_seconds").copied().unwrap_or(86_400).saturating_mul(1000);
    Ok((skey, Settle::Complete { response, ttl_ms }, "completed: retries replay this response"))
}

/// Reads the value, plans the action (`admin::plan`, judged by `Store::now`), grants the lease
/// a write needs (etcd), and sends the owner- and phase-checked transition, fenced on the value
/// read.
fn settle(st: &Store, skey: &StorageKey, read: KeyRead, action: &Settle, write_window_ms: u64) -> Result<(), Fail> {
    let local = local_now_ms();
    let (value, fence) = match read.reply {
        ReadReply::Found(v) => (v, read.fence),
        ReadReply::Absent => return fail("refused: the key is absent (nothing to settle)"),
        ReadReply::Unreadable(why) => {
            return fail(format!(
                "refused: the key holds a value this build cannot read: {why} (`idemgate inspect` shows what it \
                 can of it; `idemgate forget` deletes it)"
            ))
        }
    };
    let now = st.now(local)?;
    let t = admin::plan(action, &value, now, write_window_ms).or_else(|r| fail(r.to_string()))?;
    let backend = match st.backend.operator_lease_request(&t) {
        Some((request, ttl_seconds)) => {
            let (status, body) = st.link.call(&request)?;
            let lease = st
                .backend
                .parse_lease(status, &body, ttl_seconds)
                .or_else(|e| fail(format!("store: lease grant: {e}")))?;
            st.backend.with_lease(lease)
        }
        None => st.backend,
    };
    let request = backend
        .operator_transition_request(&t, skey, &record_seal()?, local, fence.as_ref())
        .or_else(|why| fail(format!("refused: {why}")))?;
    let (mut status, mut body) = st.link.call(&request)?;
    if let Some(again) = backend.resend(&request, status, &body) {
        (status, body) = st.link.call(&again)?;
    }
    match backend.parse_operator_transition(status, &body, &t, skey) {
        // An operator's transition refuses where the key is absent (`WhereAbsent::Refuse`).
        Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten) => Ok(()),
        // An operator's transition never writes where absent: the key is gone.
        Ok(TransitionReply::Refused | TransitionReply::Absent) => fail(
            "refused: the record changed since it was read (its request or another operator acted); inspect it again",
        ),
        Ok(TransitionReply::NoScript) => fail("store: NOSCRIPT answered to the transition carrying its script"),
        Err(e) => fail(format!("store: {e}")),
    }
}

/// The proxies' record secret (`IDEMGATE_RECORD_KEY`, and `IDEMGATE_RECORD_KEY_PREVIOUS` while
/// rotating): records are verified with it when read and sealed with it when written.
fn record_seal() -> Result<Seal, Fail> {
    Seal::from_env()
        .or_else(|e| fail(format!("{e} (the CLI needs the proxies' record secret to read or settle a key)")))
}

/// webdis over plain HTTP/1.1.
struct Webdis {
    host: String,
    port: u16,
    auth: Option<String>,
}

impl Webdis {
    fn new(url: &str) -> Result<Webdis, Fail> {
        let (host, port, _) = parse_url(url).or_else(usage)?;
        let auth = std::env::var("IDEMGATE_STORE_AUTH").ok().filter(|v| !v.is_empty()).map(|v| store::basic_auth(&v));
        Ok(Webdis { host, port, auth })
    }

    fn send(&self, r: &StoreRequest) -> Result<(Option<u16>, Vec<u8>), Fail> {
        let headers: Vec<(String, String)> =
            self.auth.iter().map(|a| ("authorization".to_string(), a.clone())).collect();
        match http(&self.host, self.port, r.method, &r.path, &headers, &r.body) {
            Ok(a) => Ok((Some(a.status), a.body)),
            Err(e) => fail(format!("webdis at {}:{}: {e}", self.host, self.port)),
        }
    }
}

impl Link for Webdis {
    fn call(&self, r: &StoreRequest) -> Result<(Option<u16>, Vec<u8>), Fail> {
        let (status, body) = self.send(r)?;
        if status == Some(403) {
            return fail("webdis answered 403: set IDEMGATE_STORE_AUTH to its user:password");
        }
        Ok((status, body))
    }
}

/// `http://host[:port][/path]` -> (host, port, path and query).
fn parse_url(url: &str) -> Result<(String, u16, String), String> {
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "{url}: only http:// URLs are supported (probe an https API through a local TLS-terminating proxy)"
        ));
    };
    let (authority, path) =
        rest.find('/').map_or((rest, "/"), |i| (rest.get(..i).unwrap_or(rest), rest.get(i..).unwrap_or("/")));
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<u16>().map_err(|_| format!("{url}: bad port"))?),
        None => (authority, 80),
    };
    if host.is_empty() {
        return Err(format!("{url}: no host"));
    }
    Ok((host.to_string(), port, path.to_string()))
}

/// One HTTP/1.1 exchange on its own connection (`connection: close`).
fn http(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<Answer> {
    exchange(TcpStream::connect((host, port))?, host, port, method, path, headers, body, TIMEOUT)
}

/// One HTTP/1.1 exchange on the connection `c` to `host:port`.
#[allow(clippy::too_many_arguments)]
fn exchange(
    mut c: TcpStream,
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
) -> std::io::Result<Answer> {
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    exchange_on(&mut c, host, port, method, path, headers, body)
}

/// One HTTP/1.1 exchange on any connection (plain or TLS) whose timeouts are set.
fn exchange_on(
    c: &mut (impl Read + Write),
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<Answer> {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        req.push_str(&format!("{n}: {v}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    c.write_all(&bytes)?;
    // Read until the answer is whole (its length or last chunk), not until the server closes:
    // some servers keep the connection open whatever `connection: close` asked.
    // Never more than `--max-answer-bytes` of it (`too_large`), announced or sent.
    let cap = max_answer_bytes();
    let mut head_end: Option<usize> = None;
    let mut buf = vec![];
    let mut chunk = [0u8; 16384];
    loop {
        // A TLS peer that closes without close_notify: the end of the answer as for a TCP close.
        let n = match c.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            // A stop and continue (Ctrl-Z then `fg`, a paused job) interrupts a receive on a
            // socket with a timeout (EINTR, not restarted on Linux): read on.
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.len().saturating_add(n) > cap {
            return Err(too_large(cap, "sent"));
        }
        // The head's end is looked for in what arrived (and the 3 bytes before it) only.
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if head_end.is_none() {
            head_end = buf.get(from..).and_then(|b| b.windows(4).position(|w| w == b"\r\n\r\n")).map(|i| from + i);
            if head_end.is_some() && announced_length(&buf).is_some_and(|len| len > cap) {
                return Err(too_large(cap, "announced"));
            }
        }
        if n == 0 {
            return parse_response(&buf, true).ok_or_else(|| std::io::Error::other("malformed HTTP response"));
        }
        if head_end.is_some() {
            if let Some(a) = parse_response(&buf, false) {
                return Ok(a);
            }
        }
    }
}

/// An answer longer than `cap` bytes (`--max-answer-bytes`), `how`: announced or sent.
fn too_large(cap: usize, how: &str) -> std::io::Error {
    std::io::Error::other(format!(
        "the answer {how} more than {cap} bytes (--max-answer-bytes): not read (a broken or hostile endpoint?)"
    ))
}

/// The `content-length` of the answer whose head `buf` holds whole, if it announces one.
fn announced_length(buf: &[u8]) -> Option<usize> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(buf.get(..end)?).ok()?;
    head.split("\r\n").skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok()).flatten()
    })
}

/// The answer in `buf` if it is whole (`eof`: the server closed, the body ends here).
fn parse_response(buf: &[u8], eof: bool) -> Option<Answer> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(buf.get(..end)?).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string())))
        .collect();
    let rest = buf.get(end + 4..)?;
    let find = |n: &str| headers.iter().find(|(h, _)| h == n).map(|(_, v)| v.clone());
    let body = if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)?
    } else if let Some(len) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        rest.get(..len)?.to_vec()
    } else if eof {
        rest.to_vec()
    } else {
        return None;
    };
    Some(Answer { status, headers, body })
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = vec![];
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(b.get(..eol)?).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        b = b.get(eol + 2..)?;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}
