//! The plugin configuration: parsed once in `on_configure`, validated into an immutable form.
//!
//! Every error names the field (as a path such as `routes[1].scope.headers`) and the reason;
//! the filter refuses the configuration with that sentence, so Envoy refuses to start (or NACKs
//! the update) with it in its log. Unknown fields are errors, never ignored.
//!
//! Two steps: serde reads the text into raw structs (`RawLevel` and the objects under it: every
//! field optional, unknown fields, wrong types and keys given twice refused, with the path from
//! `serde_path_to_error`), then one validation pass (`Config::parse`) applies them onto the
//! defaults, each route onto the top level's policy, and checks ranges and combinations.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::path::Reading;
use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::error::Category;

/// The whole plugin configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The policy used when `routes` is absent (shared, so a request holds its policy without
    /// copying it: `shared_policy`).
    pub default_policy: Arc<Policy>,
    /// When not empty, only paths matching one of these prefixes are protected (first match wins).
    pub routes: Vec<Route>,
    /// The external store (`None`: local tier only).
    pub store: Option<StoreConfig>,
    pub local: LocalConfig,
    /// Bytes of request bodies one worker VM may hold buffered at once; beyond it protected
    /// requests get a 503 `buffer-budget-exceeded` rather than exhausting the VM.
    pub max_buffered_bytes: u64,
    /// `true` (default): a protected request's headers are held until its claim is made, which
    /// needs the Wasm filter's `allow_on_headers_stop_iteration: true`. `false`, for hosts that
    /// cannot set that flag (Istio's `WasmPlugin`, Envoy Gateway's `wasm` API): the headers go on
    /// at once and the body (so the request's end) is held until the claim; a request refused
    /// then has its upstream stream reset before the upstream saw a complete request.
    pub hold_headers: bool,
}

/// A route: what selects it and its effective policy (the top-level fields with its overrides).
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub select: RouteMatch,
    pub policy: Arc<Policy>,
    /// The route's label in the per-route metrics (`name`, or derived from what selects it:
    /// `route_name_label`): letters, digits, `_` and `-` only, never empty.
    pub name: String,
}

/// The longest route label (`name`).
pub const ROUTE_LABEL_MAX: usize = 64;

/// Whether `name` may label a route's metrics: 1 to `ROUTE_LABEL_MAX` ASCII letters, digits, `_`
/// or `-` (no `.`: Envoy's stat names are split on it, and the label is one segment).
pub fn is_route_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= ROUTE_LABEL_MAX
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The label of a route without `name`: its `route_name`, or its prefix without the slashes at
/// its ends (`/v1/payments` -> `v1_payments`, `/` -> `root`), every other character `_`, cut at
/// `ROUTE_LABEL_MAX`. Routes of one label share their series.
pub fn route_name_label(select: &RouteMatch) -> String {
    let text = match select {
        RouteMatch::Prefix { prefix, .. } => prefix.trim_matches('/'),
        RouteMatch::RouteName(n) => n.as_str(),
    };
    let label: String = text
        .bytes()
        .take(ROUTE_LABEL_MAX)
        .map(|b| if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' { char::from(b) } else { '_' })
        .collect();
    if label.is_empty() {
        "root".to_string()
    } else {
        label
    }
}

/// What selects a route.
#[derive(Clone, Debug, PartialEq)]
pub enum RouteMatch {
    /// A path prefix in normal form (`path::normalize`), compared with every reading of the
    /// request path (`path::Reading`), each with the prefix read the same way; ASCII letters
    /// without regard to case when `case_insensitive` (the default: ASP.NET Core and Express
    /// route without regard to case).
    Prefix { prefix: String, case_insensitive: bool },
    /// The `name` of the Envoy route that matched the request (exact).
    RouteName(String),
}

impl RouteMatch {
    /// Whether this route selects a request whose path, read as `reading`, is `path`.
    fn matches(&self, path: &str, reading: Reading, route_name: Option<&str>) -> bool {
        match self {
            RouteMatch::Prefix { prefix, case_insensitive } => {
                crate::path::has_prefix(path, &reading.of(prefix), *case_insensitive)
            }
            RouteMatch::RouteName(name) => route_name == Some(name.as_str()),
        }
    }
}

/// The route's MCP policy (`mcp` in the route's configuration).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct McpPolicy {
    /// The protected tools; `None`: every tool.
    pub tools: Option<Vec<String>>,
    /// Tool arguments that carry the key, first found wins (after the header and `_meta`).
    pub key_arguments: Vec<String>,
    /// What a round answered `input_required` (2026-07-28) is: an awaiting record (the
    /// default, `"await"`), kept as the call's answer (`"keep"`), or released (`"release"`).
    pub input_required: InputRequired,
}

/// `mcp.input_required` (docs/mcp.md, "Multi-round calls").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InputRequired {
    /// Kept as the call's awaiting record (`record::State::AwaitingInput`): a re-sent round is
    /// replayed its question, the next round (other answers) continues the call once, another
    /// call under the key is refused.
    #[default]
    Await,
    /// Stored and replayed as the call's answer: nothing can run twice, and a multi-round call
    /// cannot go past its first round through idemgate (before 2026-12, the default).
    Keep,
    /// Released: the round that answers it claims the key. Only for tools that act on nothing
    /// before they ask (a re-sent first round runs the tool again).
    Release,
}

/// Everything that decides how one protected request is handled.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Lowercase header name carrying the key.
    pub header: String,
    /// Uppercase methods that are protected.
    pub methods: Vec<String>,
    pub require_key: bool,
    pub namespace: String,
    pub key_max_length: usize,
    /// Which keys are accepted (`key_syntax`: `"strict"`, the default, or `"any"`).
    pub key_syntax: crate::key::KeySyntax,
    pub ttl_seconds: u64,
    pub lock_ttl_seconds: u64,
    pub unknown_outcome_seconds: u64,
    /// How long a completed record's tombstone outlives it (`tombstone_seconds`; 0: none): a
    /// retry of the same request past `ttl_seconds` is refused `key-expired` instead of executing.
    pub tombstone_seconds: u64,
    pub max_request_body_bytes: u64,
    pub max_response_body_bytes: u64,
    pub fingerprint: FingerprintConfig,
    pub scope: ScopeConfig,
    pub release_on_status: Vec<u16>,
    /// The status of `key-reused` (a key back with another request): 422 (the IETF draft) or 409
    /// (the Agentic Commerce Protocol's convention).
    pub mismatch_status: u16,
    /// Request headers logged with each decision and kept with the record (for operators: never
    /// echoed to a client). No credential, no scope header (`check_log_headers`).
    pub log_headers: Vec<String>,
    /// Request headers that carry a credential besides `CREDENTIAL_HEADERS` (lowercase): never
    /// logged nor stored.
    pub credential_headers: Vec<String>,
    /// Response headers never stored nor replayed (lowercase); `set-cookie` by default.
    pub replay_exclude_headers: Vec<String>,
    pub stale_lock: StaleLock,
    /// How a protected request reaches the upstream.
    pub forwarding: Forwarding,
    /// What a request meeting its key in flight gets.
    pub in_flight: InFlight,
    /// Keys derived at the edge for requests that carry none (opt-in).
    pub derive_key: Option<DeriveKey>,
    /// What a gRPC request (`content-type: application/grpc*`) gets.
    pub grpc: GrpcMode,
    /// Router forwarding: whether a next hop's own failure reply, marked by that hop, is
    /// classified as the edge's own would be (`next_hop_failures`).
    pub next_hop_failures: NextHopFailures,
    /// `protocol: "mcp"` (routes only): the MCP policy; `None` for `protocol: "http"`.
    pub mcp: Option<McpPolicy>,
}

/// What a failure reply that an Envoy behind the edge (a sidecar, a gateway) generated itself
/// counts as (docs/hops.md). To the edge's router it is an upstream answer like
/// any other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextHopFailures {
    /// Default: stored and replayed like the upstream's own answer (a 503 included), since
    /// nothing the edge sees proves the hop wrote it: an application can send the same text.
    Store,
    /// An answer carrying the next hop's `x-idemgate-hop: local;...` mark (stamped by the hop's
    /// `local_reply_config`, overwritten with `relayed` on every answer it relays, as in
    /// envoy/next-hop/envoy.yaml) is classified by the facts in the mark, as the edge's own
    /// failure is: released when nothing was sent, outcome-unknown when it may have run. Only
    /// sound when every next hop overwrites the header, or the application could forge a release.
    Classify,
}

/// gRPC on a protected route. A local reply to a gRPC request reaches the client as a
/// trailers-only status (Envoy reshapes it), so a replay cannot carry the first call's message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpcMode {
    /// Default: a gRPC call with a key (sent or derived) is refused before it executes
    /// (`grpc-unsupported`, gRPC status FAILED_PRECONDITION); one without a key is unchanged.
    Refuse,
    /// gRPC calls pass unprotected, with or without a key (counted `grpc_passed_unprotected`).
    Pass,
}

/// How a protected request reaches the upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forwarding {
    /// Default: Envoy's router forwards it (streaming, router retries, per-route timeouts). If the
    /// client leaves, Envoy cancels the upstream call and the outcome is unknown.
    Router,
    /// The filter sends it itself from the root context, through a callout that outlives the
    /// client: the response is stored even if the client left, and a retry gets it.
    Detached { cluster: String, timeout_ms: u64, hop: Hop },
}

/// What stands between a detached callout and the upstream (`upstream.hop`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// Default: `upstream.cluster` is an Envoy internal listener that runs the filters after
    /// idemgate and the route table, then the router, and marks every answer with
    /// `x-idemgate-hop` (docs/agents.md, "Detached forwarding through an internal listener"). The root
    /// proves the chain answers with that mark (a probe) before it sends a request through it,
    /// and classifies each answer by the mark.
    InternalListener,
    /// The callout goes straight to the upstream cluster: no later filter, no route rewrite or
    /// route header applies. Only for chains with nothing after idemgate that matters.
    Direct,
}

/// What a request that finds its key in flight gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFlight {
    /// Default: 409 `request-in-flight` with `retry-after`.
    Conflict,
    /// Held up to `wait_ms` for the first attempt's result, then the replay (or the 409).
    Wait { wait_ms: u64 },
}

/// Derive a key from headers the agent framework already sends (e.g. task and step ids).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeriveKey {
    pub headers: Vec<String>,
    /// Also hash the body into the key (two different bodies in one step are then two operations).
    pub include_body: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FingerprintConfig {
    /// Headers hashed in addition to the operation headers.
    pub headers: Vec<String>,
    pub include_query: bool,
    pub json: JsonMode,
    /// Hash the headers that change what the same bytes mean (`content-type` and the common
    /// method-override headers, `fingerprint::OPERATION_HEADERS`). Default true.
    pub operation_headers: bool,
    /// Hash every request trailer. Default true.
    pub trailers: bool,
    /// How a form body counts. Default raw (its bytes).
    pub forms: FormMode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonMode {
    Raw,
    Canonical,
}

/// How a urlencoded or multipart form body enters the fingerprint (`fingerprint.forms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormMode {
    /// Its bytes, like any body.
    Raw,
    /// Its fields as every form parser of the panel reads them, when they all read it alike
    /// (`form::Reading::Every`): a form rebuilt with a new multipart boundary is the same request.
    Semantic,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeConfig {
    pub headers: Vec<String>,
    pub global: bool,
    pub include_authority: bool,
    /// What a request with a key but none of the scope headers gets.
    pub anonymous: Anonymous,
}

/// A protected request that carries none of the configured scope headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anonymous {
    /// Default: 400 `scope-missing`, nothing forwarded (it would share records with every other
    /// such caller).
    Reject,
    /// Opt-in: every such caller shares one scope (per authority, unless turned off).
    Shared,
}

/// What happens to a lock older than `lock_ttl_seconds` whose request was forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleLock {
    /// Default: its outcome is unknown; retries get a 409 outcome-unknown. At most once.
    Reject,
    /// Opt-in: a retry may execute again. At least once: only for upstreams that deduplicate on
    /// the forwarded key themselves.
    Takeover,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// Which store the cluster reaches: Redis behind webdis (`store.rs`, the default) or etcd v3's
    /// JSON API (`etcd.rs`).
    pub kind: StoreKind,
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub on_unavailable: OnUnavailable,
    /// `store.kind: "etcd"` with a credential: how often each worker authenticates again
    /// (`etcd::Auth`); below etcd's token TTL.
    pub token_refresh_seconds: u64,
    /// The largest request the store accepts (`store.max_request_bytes`): etcd's
    /// `--max-request-bytes` (default 1.5 MiB, counted on the decoded request), webdis's
    /// `http_max_request_size` (default 128 MiB). Every `max_response_body_bytes` must fit in it
    /// with `STORE_WRITE_OVERHEAD_BYTES` to spare (`check_store_request_size`).
    pub max_request_bytes: u64,
}

/// etcd's default `--max-request-bytes`.
pub const ETCD_DEFAULT_MAX_REQUEST_BYTES: u64 = 1_572_864;
/// webdis's default `http_max_request_size`.
pub const WEBDIS_DEFAULT_MAX_REQUEST_BYTES: u64 = 134_217_728;
/// What a completion's store write carries besides the response body: the response headers
/// (Envoy lets an upstream send 60 KiB of them by default), the record's other fields (times,
/// fingerprint, the creator's request id and logged headers), its seal, the value header and
/// owner mark, the keys and the rest of the transaction or webdis request. A write larger than
/// the store accepts anyway (larger headers) is written without its body, never lost
/// (`engine::writes`, too large).
pub const STORE_WRITE_OVERHEAD_BYTES: u64 = 96 * 1024;

/// `store.kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Redis through webdis (the default).
    Redis,
    /// etcd v3 through its JSON gateway (linearizable, replicated by Raft).
    Etcd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnUnavailable {
    /// Default: 503 with `retry-after`, nothing forwarded.
    Reject,
    /// Forward unprotected, counted and logged.
    Pass,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalConfig {
    pub max_entries: u64,
    pub max_bytes: u64,
    pub when_full: WhenFull,
    /// A full table evicts only finished records at least this old (`evict_oldest`).
    pub min_protection_seconds: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhenFull {
    /// Never forget an unexpired record: answer 503 instead (which a retry meets too).
    Reject,
    /// Default: evict the oldest completed or outcome-unknown record older than
    /// `min_protection_seconds` (its protection ends early); 503 only when every record is younger
    /// than that or in flight.
    EvictOldest,
}

/// A configuration error: the field's path and why it was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "idemgate configuration refused: {}", self.reason)
        } else {
            write!(f, "idemgate configuration refused: field `{}`: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            header: "idempotency-key".into(),
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            namespace: "idemgate".into(),
            key_max_length: 255,
            key_syntax: crate::key::KeySyntax::Strict,
            ttl_seconds: 86_400,
            lock_ttl_seconds: 60,
            unknown_outcome_seconds: 86_400,
            tombstone_seconds: 0,
            max_request_body_bytes: 1_048_576,
            max_response_body_bytes: 1_048_576,
            fingerprint: FingerprintConfig {
                headers: vec![],
                include_query: true,
                json: JsonMode::Raw,
                operation_headers: true,
                trailers: true,
                forms: FormMode::Raw,
            },
            scope: ScopeConfig {
                headers: vec![],
                global: false,
                include_authority: true,
                anonymous: Anonymous::Reject,
            },
            release_on_status: vec![429],
            mismatch_status: 422,
            log_headers: vec![],
            credential_headers: vec![],
            replay_exclude_headers: vec!["set-cookie".into()],
            stale_lock: StaleLock::Reject,
            forwarding: Forwarding::Router,
            in_flight: InFlight::Conflict,
            derive_key: None,
            grpc: GrpcMode::Refuse,
            next_hop_failures: NextHopFailures::Store,
            mcp: None,
        }
    }
}

impl Default for LocalConfig {
    fn default() -> LocalConfig {
        LocalConfig {
            max_entries: 262_144,
            max_bytes: 256 * 1024 * 1024,
            when_full: WhenFull::EvictOldest,
            min_protection_seconds: 3_600,
        }
    }
}

/// Request headers that carry a credential whatever the configuration says: never logged nor
/// kept with a record (`log_headers`). `credential_headers` adds to them.
pub const CREDENTIAL_HEADERS: &[&str] =
    &["authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key", "x-auth-token"];

/// Limits that keep a configuration sane (documented in docs/configuration.md).
pub const MAX_KEY_LENGTH: u64 = 4096;
pub const MAX_TTL_SECONDS: u64 = 366 * 86_400;
pub const MAX_BODY_BYTES: u64 = 64 * 1024 * 1024;
pub const MAX_STORE_TIMEOUT_MS: u64 = 60_000;

/// Declares a raw configuration object: every field optional (absent: `None`), `null` refused
/// like any other wrong type (a field whose type is itself an `Option` reads `null` as
/// `Some(None)`), unknown fields and duplicate keys refused.
///
/// serde's derive reads a `Wire` twin whose fields are `Given<T>`: a field with
/// `deserialize_with` would get its own reader type, and so its own copy of the whole
/// value-reading path per field; `Given<T>` shares one per field type (7.4 KB of the module).
macro_rules! raw_object {
    ($(#[$meta:meta])* struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Default)]
        struct $name {
            $($(#[$fmeta])* $field: Option<$ty>,)*
        }

        impl RawObject for $name {
            fn read<'de, D: Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields, expecting = "an object")]
                struct Wire {
                    $(#[serde(default)] $field: Given<$ty>,)*
                }
                let wire = Wire::deserialize(d)?; // the derived reader
                Ok($name { $($field: wire.$field.0,)* })
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                d.deserialize_map(ObjectOnly(PhantomData))
            }
        }
    };
}

/// A raw object's derived reader, which serde's derive would also let read a list (its fields by
/// position): `ObjectOnly` hands it JSON objects only.
trait RawObject: Sized {
    fn read<'de, D: Deserializer<'de>>(d: D) -> Result<Self, D::Error>;
}

struct ObjectOnly<T>(PhantomData<T>);

impl<'de, T: RawObject> Visitor<'de> for ObjectOnly<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
        T::read(MapAccessDeserializer::new(map))
    }
}

/// A field that is present: its value, never read as absent (`null` is a wrong type unless `T`
/// is an `Option`); an absent field is `Given(None)` (`#[serde(default)]`).
struct Given<T>(Option<T>);

impl<T> Default for Given<T> {
    fn default() -> Self {
        Given(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Given<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Given<T>, D::Error> {
        T::deserialize(d).map(|v| Given(Some(v)))
    }
}

raw_object! {
    /// One level as written: the top level or one entry of `routes` (one type, so their policy
    /// fields are one list; `Config::parse` and `parse_routes` refuse the other level's fields).
    struct RawLevel {
        header: String,
        methods: Vec<String>,
        require_key: bool,
        namespace: String,
        key_max_length: u64,
        key_syntax: String,
        ttl_seconds: u64,
        lock_ttl_seconds: u64,
        unknown_outcome_seconds: u64,
        tombstone_seconds: u64,
        max_request_body_bytes: u64,
        max_response_body_bytes: u64,
        fingerprint: RawFingerprint,
        scope: RawScope,
        release_on_status: Vec<u64>,
        mismatch_status: u64,
        log_headers: Vec<String>,
        credential_headers: Vec<String>,
        replay_exclude_headers: Vec<String>,
        stale_lock: String,
        forwarding: String,
        upstream: RawUpstream,
        in_flight: String,
        wait_ms: u64,
        /// `null` removes an inherited derivation.
        derive_key: Option<RawDeriveKey>,
        grpc: String,
        next_hop_failures: String,
        // The top level only (`null`: absent).
        store: Option<RawStore>,
        routes: Option<Vec<RawLevel>>,
        local: Option<RawLocal>,
        max_buffered_bytes: u64,
        hold_headers: bool,
        // Routes only.
        prefix: String,
        case_insensitive: bool,
        route_name: String,
        name: String,
        protocol: String,
        mcp: RawMcp,
    }
}

raw_object! {
    struct RawFingerprint {
        headers: Vec<String>,
        include_query: bool,
        json: String,
        operation_headers: bool,
        trailers: bool,
        forms: String,
    }
}

raw_object! {
    struct RawScope {
        headers: Vec<String>,
        global: bool,
        include_authority: bool,
        anonymous: String,
    }
}

raw_object! {
    struct RawUpstream {
        cluster: String,
        timeout_ms: u64,
        hop: String,
    }
}

raw_object! {
    struct RawDeriveKey {
        headers: Vec<String>,
        include_body: bool,
    }
}

raw_object! {
    /// A route's `mcp` (docs/mcp.md), read by `parse_protocol`.
    struct RawMcp {
        tools: Vec<String>,
        key_arguments: Vec<String>,
        input_required: String,
    }
}

raw_object! {
    struct RawStore {
        kind: String,
        cluster: String,
        authority: String,
        timeout_ms: u64,
        on_unavailable: String,
        token_refresh_seconds: u64,
        max_request_bytes: u64,
    }
}

raw_object! {
    struct RawLocal {
        max_entries: u64,
        max_bytes: u64,
        when_full: String,
        min_protection_seconds: u64,
    }
}

/// The text as raw structs: an empty text is `{}`; a syntax error names no field, any other
/// error the path serde was reading (`routes[1].upstream.timeout_ms`).
fn read(text: &[u8]) -> Result<RawLevel, ConfigError> {
    let trimmed = text.trim_ascii();
    if trimmed.is_empty() {
        return Ok(RawLevel::default());
    }
    let mut de = serde_json::Deserializer::from_slice(trimmed);
    let raw = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." { "" } else { &path };
        let e = e.into_inner();
        // serde refuses a key given twice (serde_json itself would keep the last one silently)
        // in the object's reader, so the path ends at the object: the field is named in the text.
        let twice =
            e.to_string().strip_prefix("duplicate field `").and_then(|t| t.split('`').next().map(str::to_string));
        match twice {
            Some(name) => refusal(&join(path, &name), e),
            None => refusal(path, e),
        }
    })?;
    de.end().map_err(|e| refusal("", e))?;
    Ok(raw)
}

fn refusal(field: &str, e: serde_json::Error) -> ConfigError {
    match e.classify() {
        Category::Data => err(field, e.to_string()),
        Category::Syntax | Category::Eof | Category::Io => err("", format!("not valid JSON: {e}")),
    }
}

impl Config {
    /// Parses and validates the plugin configuration (a JSON object; empty means `{}`): serde
    /// reads it into the raw structs below (`RawLevel`: unknown fields, wrong types and duplicate
    /// keys refused, naming the path), then one validation pass builds the checked form.
    pub fn parse(text: &[u8]) -> Result<Config, ConfigError> {
        let top = read(text)?;
        for (name, set) in [
            ("case_insensitive", top.case_insensitive.is_some()),
            ("mcp", top.mcp.is_some()),
            ("prefix", top.prefix.is_some()),
            ("protocol", top.protocol.is_some()),
            ("route_name", top.route_name.is_some()),
            ("name", top.name.is_some()),
        ] {
            if set {
                return Err(err(name, "a route's field: it can only be set in an entry of routes"));
            }
        }

        let mut default_policy = Policy::default();
        apply_policy_fields(&top, "", &mut default_policy)?;

        let store = match &top.store {
            None | Some(None) => None,
            Some(Some(s)) => Some(parse_store(s)?),
        };
        let local = match &top.local {
            None | Some(None) => LocalConfig::default(),
            Some(Some(l)) => parse_local(l)?,
        };
        let max_buffered_bytes = match top.max_buffered_bytes {
            None => 64 * 1024 * 1024,
            Some(n) => range(n, "max_buffered_bytes", 1024, 16 * 1024 * 1024 * 1024)?,
        };
        let hold_headers = top.hold_headers.unwrap_or(true);
        let routes = match &top.routes {
            None | Some(None) => vec![],
            Some(Some(r)) => parse_routes(r, &default_policy, top.release_on_status.is_some())?,
        };
        if routes.is_empty() {
            if let Some(Some(_)) = top.routes {
                return Err(err(
                    "routes",
                    "an empty list would protect nothing; remove the field to protect every path",
                ));
            }
            validate_policy(&default_policy, "")?;
        }
        let default_policy = Arc::new(default_policy);
        let config = Config { default_policy, routes, store, local, max_buffered_bytes, hold_headers };
        if config.store.as_ref().is_some_and(|s| s.kind == StoreKind::Etcd) {
            check_etcd_clocks(&config)?;
        }
        check_detached_with_store(&config)?;
        check_store_request_size(&config)?;
        // Without held headers, Envoy's router has already started the upstream request when the
        // claim is made: a detached callout would be a second one.
        if !hold_headers && config.policies().any(|p| matches!(p.forwarding, Forwarding::Detached { .. })) {
            return Err(err(
                "hold_headers",
                "false cannot be combined with forwarding \"detached\" (Envoy's router would have started its own upstream request)",
            ));
        }
        Ok(config)
    }

    /// The policy protecting a request, if any: when routes are configured, the first route (in
    /// order) whose prefix matches any reading of the path (`path::Reading::ALL`: the normal
    /// form, the path as sent, as servlet containers and decoding servers read it), so a path
    /// that any mainstream origin routes to a protected prefix is protected by the route its
    /// canonical spelling selects, not by a catch-all after it; and only for the policy's methods.
    /// Routes selected by an Envoy route name need `policy_index_for_route`.
    pub fn policy_for(&self, method: &str, path: &str) -> Option<&Policy> {
        self.policy_index_for(method, path).and_then(|i| self.policy_at(i))
    }

    /// `policy_for` as an index for `policy_at`, so a request can keep which policy is its own.
    pub fn policy_index_for(&self, method: &str, path: &str) -> Option<usize> {
        self.policy_index_for_route(method, path, None)
    }

    /// `policy_index_for` knowing the name of the Envoy route that matched the request (if it
    /// has one): the first route, in order, whose prefix or route name matches and whose
    /// `methods` hold the request's method. A route for other methods does not hide the routes
    /// after it: `[{prefix: "/v1/orders", methods: ["PUT"]}, {prefix: "/"}]` protects a POST to
    /// /v1/orders by the second.
    ///
    /// A path whose readings select routes that would store its key apart (another namespace,
    /// key header, scope or key rule: `Policy::same_storage`) is selected by none: it would be
    /// one key in two tables, executed once under each. `select_route` tells it apart.
    pub fn policy_index_for_route(&self, method: &str, path: &str, route_name: Option<&str>) -> Option<usize> {
        match self.select_route(method, path, route_name) {
            Selection::Policy(i) => Some(i),
            Selection::Unprotected | Selection::Ambiguous { .. } => None,
        }
    }

    /// The route of a request, its path read every way a backend may read it
    /// (`path::Reading::ALL`): for each reading, the first route (in order) whose prefix or
    /// route name matches it and whose `methods` hold the method. The first of those routes in
    /// order is the request's, if every one of them stores keys as it does
    /// (`Policy::same_storage`); otherwise the request is `Ambiguous` (`/v1/payments/../orders`
    /// with a route for /v1/payments in one namespace and one for / in another: a backend runs it
    /// as /v1/orders, which the second route protects, while one reading selects the first).
    pub fn select_route(&self, method: &str, path: &str, route_name: Option<&str>) -> Selection {
        // Without regard to ASCII case: Envoy forwards an HTTP/2 `:method` of `Post`, which
        // Werkzeug and Django run as POST (found by the boundary oracle, issue 41).
        let protects = |p: &Policy| p.methods.iter().any(|m| m.eq_ignore_ascii_case(method));
        if self.routes.is_empty() {
            return match protects(&self.default_policy) {
                true => Selection::Policy(0),
                false => Selection::Unprotected,
            };
        }
        let mut chosen: Vec<usize> = vec![];
        for reading in Reading::ALL {
            let read = reading.of(path);
            let first =
                self.routes.iter().position(|r| protects(&r.policy) && r.select.matches(&read, reading, route_name));
            if let Some(i) = first {
                if !chosen.contains(&i) {
                    chosen.push(i);
                }
            }
        }
        let Some(&first) = chosen.iter().min() else { return Selection::Unprotected };
        let policy = |i: usize| self.routes.get(i).map(|r| &r.policy);
        match chosen.iter().find(|&&i| !policy(i).zip(policy(first)).is_some_and(|(a, b)| a.same_storage(b))) {
            Some(&other) => Selection::Ambiguous { first, other },
            None => Selection::Policy(first),
        }
    }

    /// Whether a route is selected by an Envoy route name (so the filter reads it).
    pub fn uses_route_names(&self) -> bool {
        self.routes.iter().any(|r| matches!(r.select, RouteMatch::RouteName(_)))
    }

    /// The policy at an index of `policies()`.
    pub fn policy_at(&self, i: usize) -> Option<&Policy> {
        if self.routes.is_empty() {
            (i == 0).then_some(&*self.default_policy)
        } else {
            self.routes.get(i).map(|r| &*r.policy)
        }
    }

    /// The policy at an index of `policies()`, shared: what a request carries once its route is
    /// selected, so its policy cannot go missing later (no copy is made).
    pub fn shared_policy(&self, i: usize) -> Option<Arc<Policy>> {
        if self.routes.is_empty() {
            (i == 0).then(|| Arc::clone(&self.default_policy))
        } else {
            self.routes.get(i).map(|r| Arc::clone(&r.policy))
        }
    }

    /// Whether any policy protects `method` (ASCII case aside, as `select_route`): unprotected
    /// methods are let through after reading one header.
    pub fn protects_method(&self, method: &str) -> bool {
        self.policies().any(|p| p.methods.iter().any(|m| m.eq_ignore_ascii_case(method)))
    }

    /// Every policy in force: the default one, or one per route.
    pub fn policies(&self) -> impl Iterator<Item = &Policy> {
        let default = self.routes.is_empty().then_some(&*self.default_policy);
        default.into_iter().chain(self.routes.iter().map(|r| &*r.policy))
    }
}

/// The route a request falls under (`Config::select_route`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// No route protects it (or its method).
    Unprotected,
    /// The route (or default policy) at this index of `policies()`.
    Policy(usize),
    /// Readings of its path select routes that store keys apart: refused, never forwarded as
    /// either (one key would be stored, and executed, once under each).
    Ambiguous { first: usize, other: usize },
}

impl Policy {
    /// Whether a request's key is stored under the same storage key by both policies: the same
    /// namespace, key header, key rule and length, requirement, derivation and caller scope.
    /// Two such routes share every record, so a request selected by either meets one record.
    /// The MCP policy too: an MCP route reads its key from the body (`_meta`, a named argument)
    /// where a plain route reads none, so a spelling read as both would pass the MCP call
    /// unprotected under the plain one.
    pub fn same_storage(&self, other: &Policy) -> bool {
        self.mcp == other.mcp
            && self.namespace == other.namespace
            && self.header == other.header
            && self.key_syntax == other.key_syntax
            && self.key_max_length == other.key_max_length
            && self.require_key == other.require_key
            && self.derive_key == other.derive_key
            && self.scope == other.scope
    }
}

fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.to_string(), reason: reason.into() }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

// `range` and `choice` are called at about fifteen sites each: out of line (and `choice`'s refusal
// written once for every type of choice), they are one copy each in the module.
#[inline(never)]
fn range(n: u64, field: &str, min: u64, max: u64) -> Result<u64, ConfigError> {
    match (min..=max).contains(&n) {
        true => Ok(n),
        false => Err(err(field, format!("expected a whole number from {min} to {max}, got {n}"))),
    }
}

fn choice<T: Copy>(s: &str, field: &str, choices: &[(&str, T)]) -> Result<T, ConfigError> {
    match choices.iter().find(|(name, _)| *name == s) {
        Some(&(_, t)) => Ok(t),
        None => Err(not_a_choice(s, field, &mut choices.iter().map(|(n, _)| *n))),
    }
}

#[inline(never)]
fn not_a_choice(s: &str, field: &str, names: &mut dyn Iterator<Item = &str>) -> ConfigError {
    let names: Vec<String> = names.map(|n| format!("\"{n}\"")).collect();
    err(field, format!("expected one of {}, got \"{s}\"", names.join(", ")))
}

fn is_token(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(crate::key::is_tchar)
}

/// A header name: an RFC 9110 token, stored lowercase. Pseudo headers are refused.
fn header_name(s: &str, field: &str) -> Result<String, ConfigError> {
    if !is_token(s) {
        return Err(err(field, format!("\"{s}\" is not a valid header name")));
    }
    Ok(s.to_ascii_lowercase())
}

fn header_list(list: &[String], field: &str) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = vec![];
    for (i, item) in list.iter().enumerate() {
        let name = header_name(item, &format!("{field}[{i}]"))?;
        if out.contains(&name) {
            return Err(err(&format!("{field}[{i}]"), format!("\"{name}\" is listed twice")));
        }
        out.push(name);
    }
    Ok(out)
}

/// Applies the policy fields present in `l` onto `p` (so a route inherits what it leaves out),
/// checking each in the order of their names.
fn apply_policy_fields(l: &RawLevel, prefix: &str, p: &mut Policy) -> Result<(), ConfigError> {
    let f = |n: &str| join(prefix, n);
    apply_agent_fields(l, prefix, p)?;
    // A route adds to the credentials it inherits, never replaces them: a route naming one more
    // must not make the top level's loggable (found by an adversarial review).
    if let Some(list) = &l.credential_headers {
        for h in header_list(list, &f("credential_headers"))? {
            if !p.credential_headers.contains(&h) {
                p.credential_headers.push(h);
            }
        }
    }
    if let Some(m) = &l.fingerprint {
        let fi = |n: &str| join(&f("fingerprint"), n);
        if let Some(h) = &m.headers {
            p.fingerprint.headers = header_list(h, &fi("headers"))?;
        }
        p.fingerprint.include_query = m.include_query.unwrap_or(p.fingerprint.include_query);
        if let Some(j) = &m.json {
            p.fingerprint.json = choice(j, &fi("json"), &[("raw", JsonMode::Raw), ("canonical", JsonMode::Canonical)])?;
        }
        if let Some(v) = &m.forms {
            p.fingerprint.forms = choice(v, &fi("forms"), &[("raw", FormMode::Raw), ("semantic", FormMode::Semantic)])?;
        }
        p.fingerprint.operation_headers = m.operation_headers.unwrap_or(p.fingerprint.operation_headers);
        p.fingerprint.trailers = m.trailers.unwrap_or(p.fingerprint.trailers);
    }
    if let Some(g) = &l.grpc {
        p.grpc = choice(g, &f("grpc"), &[("refuse", GrpcMode::Refuse), ("pass", GrpcMode::Pass)])?;
    }
    if let Some(h) = &l.header {
        p.header = header_name(h, &f("header"))?;
    }
    if let Some(n) = l.key_max_length {
        p.key_max_length = usize::try_from(range(n, &f("key_max_length"), 1, MAX_KEY_LENGTH)?).unwrap_or(255);
    }
    if let Some(s) = &l.key_syntax {
        use crate::key::KeySyntax;
        p.key_syntax = choice(s, &f("key_syntax"), &[("strict", KeySyntax::Strict), ("any", KeySyntax::Any)])?;
    }
    if let Some(n) = l.lock_ttl_seconds {
        p.lock_ttl_seconds = range(n, &f("lock_ttl_seconds"), 1, MAX_TTL_SECONDS)?;
    }
    if let Some(h) = &l.log_headers {
        p.log_headers = header_list(h, &f("log_headers"))?;
    }
    if let Some(n) = l.max_request_body_bytes {
        p.max_request_body_bytes = range(n, &f("max_request_body_bytes"), 0, MAX_BODY_BYTES)?;
    }
    if let Some(n) = l.max_response_body_bytes {
        p.max_response_body_bytes = range(n, &f("max_response_body_bytes"), 0, MAX_BODY_BYTES)?;
    }
    if let Some(list) = &l.methods {
        let mut methods = vec![];
        for (i, s) in list.iter().enumerate() {
            if !is_token(s) {
                return Err(err(&format!("{}[{i}]", f("methods")), format!("\"{s}\" is not a valid HTTP method")));
            }
            methods.push(s.to_ascii_uppercase());
        }
        if methods.is_empty() {
            return Err(err(&f("methods"), "an empty list would protect nothing"));
        }
        p.methods = methods;
    }
    if let Some(n) = l.mismatch_status {
        if n != 422 && n != 409 {
            return Err(err(
                &f("mismatch_status"),
                format!("expected 422 (the IETF draft) or 409 (the Agentic Commerce Protocol), got {n}"),
            ));
        }
        p.mismatch_status = u16::try_from(n).unwrap_or(422);
    }
    if let Some(s) = &l.namespace {
        if s.is_empty() || s.len() > 128 || !s.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(err(&f("namespace"), "expected 1 to 128 visible ASCII characters"));
        }
        p.namespace = s.clone();
    }
    if let Some(n) = &l.next_hop_failures {
        p.next_hop_failures = choice(
            n,
            &f("next_hop_failures"),
            &[("store", NextHopFailures::Store), ("classify", NextHopFailures::Classify)],
        )?;
    }
    if let Some(list) = &l.release_on_status {
        let mut codes = vec![];
        for (i, &code) in list.iter().enumerate() {
            if !(400..=599).contains(&code) {
                return Err(err(
                    &format!("{}[{i}]", f("release_on_status")),
                    format!("expected an error status from 400 to 599 (releasing a success would allow a second execution), got {code}"),
                ));
            }
            codes.push(u16::try_from(code).unwrap_or(0));
        }
        p.release_on_status = codes;
    }
    if let Some(h) = &l.replay_exclude_headers {
        p.replay_exclude_headers = header_list(h, &f("replay_exclude_headers"))?;
    }
    p.require_key = l.require_key.unwrap_or(p.require_key);
    if let Some(m) = &l.scope {
        let fi = |n: &str| join(&f("scope"), n);
        if let Some(a) = &m.anonymous {
            p.scope.anonymous =
                choice(a, &fi("anonymous"), &[("reject", Anonymous::Reject), ("shared", Anonymous::Shared)])?;
        }
        p.scope.global = m.global.unwrap_or(p.scope.global);
        if let Some(h) = &m.headers {
            p.scope.headers = header_list(h, &fi("headers"))?;
        }
        p.scope.include_authority = m.include_authority.unwrap_or(p.scope.include_authority);
        if m.anonymous.is_some() && p.scope.global {
            return Err(err(
                &fi("anonymous"),
                "only used with scope.headers: with scope.global every caller already shares one scope",
            ));
        }
    }
    if let Some(s) = &l.stale_lock {
        p.stale_lock =
            choice(s, &f("stale_lock"), &[("reject", StaleLock::Reject), ("takeover", StaleLock::Takeover)])?;
    }
    if let Some(n) = l.ttl_seconds {
        p.ttl_seconds = range(n, &f("ttl_seconds"), 1, MAX_TTL_SECONDS)?;
    }
    if let Some(n) = l.unknown_outcome_seconds {
        p.unknown_outcome_seconds = range(n, &f("unknown_outcome_seconds"), 1, MAX_TTL_SECONDS)?;
    }
    if let Some(n) = l.tombstone_seconds {
        p.tombstone_seconds = range(n, &f("tombstone_seconds"), 0, MAX_TTL_SECONDS)?;
    }
    Ok(())
}

/// `forwarding` + `upstream`, `in_flight` + `wait_ms`, `derive_key`.
fn apply_agent_fields(l: &RawLevel, prefix: &str, p: &mut Policy) -> Result<(), ConfigError> {
    let f = |n: &str| join(prefix, n);
    let detached = match &l.forwarding {
        None => matches!(p.forwarding, Forwarding::Detached { .. }),
        Some(s) => choice(s, &f("forwarding"), &[("router", false), ("detached", true)])?,
    };
    match (detached, &l.upstream) {
        (true, Some(u)) => {
            let Some(cluster) = u.cluster.clone() else {
                return Err(err(&f("upstream.cluster"), "missing: name the Envoy cluster of the upstream"));
            };
            if cluster.is_empty() {
                return Err(err(&f("upstream.cluster"), "must not be empty"));
            }
            let timeout_ms = match u.timeout_ms {
                Some(t) => range(t, &f("upstream.timeout_ms"), 1, 600_000)?,
                None => 30_000,
            };
            let hop = match &u.hop {
                Some(h) => choice(
                    h,
                    &f("upstream.hop"),
                    &[("internal_listener", Hop::InternalListener), ("direct", Hop::Direct)],
                )?,
                None => Hop::InternalListener,
            };
            p.forwarding = Forwarding::Detached { cluster, timeout_ms, hop };
        }
        (true, None) if !matches!(p.forwarding, Forwarding::Detached { .. }) => {
            return Err(err(
                &f("upstream"),
                "missing: forwarding \"detached\" needs {\"cluster\": ..., \"timeout_ms\": ...}",
            ));
        }
        (true, None) => {}
        (false, Some(_)) => return Err(err(&f("upstream"), "only used with forwarding: \"detached\"")),
        (false, None) => p.forwarding = Forwarding::Router,
    }
    let wait = match &l.in_flight {
        None => matches!(p.in_flight, InFlight::Wait { .. }),
        Some(s) => choice(s, &f("in_flight"), &[("conflict", false), ("wait", true)])?,
    };
    let current_wait = match p.in_flight {
        InFlight::Wait { wait_ms } => wait_ms,
        InFlight::Conflict => 5_000,
    };
    let wait_ms = match l.wait_ms {
        Some(n) => range(n, &f("wait_ms"), 1, 60_000)?,
        None => current_wait,
    };
    if !wait && l.wait_ms.is_some() {
        return Err(err(&f("wait_ms"), "only used with in_flight: \"wait\""));
    }
    p.in_flight = if wait { InFlight::Wait { wait_ms } } else { InFlight::Conflict };
    match &l.derive_key {
        None => {}
        Some(None) => p.derive_key = None,
        Some(Some(d)) => {
            let headers = match &d.headers {
                Some(h) => header_list(h, &f("derive_key.headers"))?,
                None => vec![],
            };
            if headers.is_empty() {
                return Err(err(
                    &f("derive_key.headers"),
                    "name the headers that identify one operation, e.g. [\"x-agent-task-id\", \"x-agent-step-id\"]",
                ));
            }
            p.derive_key = Some(DeriveKey { headers, include_body: d.include_body.unwrap_or(false) });
        }
    }
    Ok(())
}

/// `ttl_seconds` must exceed `lock_ttl_seconds` by at least this much (issue 13, item 2).
pub const TTL_OVER_LOCK_MARGIN_SECONDS: u64 = 1;
/// How far apart the proxies' clocks may be, with etcd (it has no clock a transaction can read):
/// every reader judges locks and expiries with its clock taken this far behind
/// (`etcd::judged_now`), and a record must outlive its lock by this too (`check_etcd_clocks`).
pub const CLOCK_SKEW_TOLERANCE_MS: u64 = 1_000;
/// `store.token_refresh_seconds` by default: well below etcd's default token TTL (300 s, simple
/// tokens; JWT tokens default to 5 minutes too).
pub const DEFAULT_TOKEN_REFRESH_SECONDS: u64 = 60;

/// Every policy in force with the field prefix its errors name: "" for the one policy without
/// routes, `routes[i]` for each route's.
fn labelled_policies(c: &Config) -> impl Iterator<Item = (&Policy, String)> {
    let routed = !c.routes.is_empty();
    c.policies().enumerate().map(move |(i, p)| (p, if routed { format!("routes[{i}]") } else { String::new() }))
}

/// With etcd, locks and record expiries are judged by the proxies' clocks, read
/// `CLOCK_SKEW_TOLERANCE_MS` behind (etcd has no clock a transaction can read): a
/// record must then outlive its lock by that tolerance too, on every proxy's clock.
fn check_etcd_clocks(c: &Config) -> Result<(), ConfigError> {
    let skew_s = CLOCK_SKEW_TOLERANCE_MS.div_ceil(1000);
    let margin = TTL_OVER_LOCK_MARGIN_SECONDS.saturating_add(skew_s);
    for (p, prefix) in labelled_policies(c) {
        if p.ttl_seconds < p.lock_ttl_seconds.saturating_add(margin) {
            return Err(err(
                &join(&prefix, "ttl_seconds"),
                format!(
                    "{} does not exceed lock_ttl_seconds ({}) by at least {margin} s: with store.kind \"etcd\" locks are judged by the proxies' clocks with a {skew_s} s skew tolerance, and a record must outlive its lock by that too; raise ttl_seconds or lower lock_ttl_seconds",
                    p.ttl_seconds, p.lock_ttl_seconds
                ),
            ));
        }
    }
    Ok(())
}

/// A response the configuration promises to keep (up to `max_response_body_bytes`) must fit in
/// one store write (`store.max_request_bytes`, with `STORE_WRITE_OVERHEAD_BYTES` for the rest):
/// otherwise every such completion would be refused by the store.
fn check_store_request_size(c: &Config) -> Result<(), ConfigError> {
    let Some(limit) = c.store.as_ref().map(|s| s.max_request_bytes) else { return Ok(()) };
    for (p, prefix) in labelled_policies(c) {
        if p.max_response_body_bytes.saturating_add(STORE_WRITE_OVERHEAD_BYTES) > limit {
            return Err(err(
                &join(&prefix, "max_response_body_bytes"),
                format!(
                    "{} does not fit in one store write: store.max_request_bytes is {limit} (the store's request limit: etcd's --max-request-bytes, webdis's http_max_request_size) and a record needs {STORE_WRITE_OVERHEAD_BYTES} bytes besides its body; lower max_response_body_bytes to at most {} or raise the store's limit and store.max_request_bytes",
                    p.max_response_body_bytes,
                    limit.saturating_sub(STORE_WRITE_OVERHEAD_BYTES)
                ),
            ));
        }
    }
    Ok(())
}

/// With a store, a detached request is forwarded once the store answers its claim, which may take
/// up to `store.timeout_ms`, and then runs for up to `upstream.timeout_ms`: both within the lock,
/// or a retry could find the lock stale while the request still runs (an answer later than that
/// is never used: `Lifetimes::answer_in_time`).
fn check_detached_with_store(c: &Config) -> Result<(), ConfigError> {
    let Some(store_ms) = c.store.as_ref().map(|s| s.timeout_ms) else { return Ok(()) };
    for (p, prefix) in labelled_policies(c) {
        let Forwarding::Detached { timeout_ms, .. } = p.forwarding else { continue };
        if timeout_ms.saturating_add(store_ms) >= p.lock_ttl_seconds.saturating_mul(1000) {
            return Err(err(
                &join(&prefix, "upstream.timeout_ms"),
                format!(
                    "{timeout_ms} ms plus store.timeout_ms ({store_ms} ms) is not below lock_ttl_seconds ({} s): a claim the store answers at its timeout, then an upstream running to its own, would outlive the lock, and a retry could execute again; lower either or raise lock_ttl_seconds",
                    p.lock_ttl_seconds
                ),
            ));
        }
    }
    Ok(())
}

fn validate_policy(p: &Policy, prefix: &str) -> Result<(), ConfigError> {
    if p.derive_key.is_some() && p.scope.headers.is_empty() {
        return Err(err(
            &join(prefix, "derive_key"),
            "needs a caller scope (scope.headers): a derived key from task and step ids alone could collide across callers",
        ));
    }
    if p.scope.headers.is_empty() && !p.scope.global {
        return Err(err(
            &join(prefix, "scope.headers"),
            "empty: name the headers that identify the caller (for example [\"authorization\"], or a header your auth filter sets), \
             or set scope.global: true if keys are deliberately shared by all callers (a guessed key would then replay another caller's response)",
        ));
    }
    if !p.scope.headers.is_empty() && p.scope.global {
        return Err(err(&join(prefix, "scope.global"), "true cannot be combined with scope.headers; choose one"));
    }
    if p.ttl_seconds < p.lock_ttl_seconds.saturating_add(TTL_OVER_LOCK_MARGIN_SECONDS) {
        return Err(err(
            &join(prefix, "ttl_seconds"),
            format!(
                "{} does not exceed lock_ttl_seconds ({}) by at least {TTL_OVER_LOCK_MARGIN_SECONDS} s: a record must outlive its lock, so no claim's record ends the instant its lock goes stale; raise ttl_seconds or lower lock_ttl_seconds",
                p.ttl_seconds, p.lock_ttl_seconds
            ),
        ));
    }
    if p.scope.headers.contains(&p.header) {
        return Err(err(&join(prefix, "scope.headers"), format!("\"{}\" is the key header itself", p.header)));
    }
    check_log_headers(p, prefix)?;
    if p.grpc == GrpcMode::Pass && p.require_key {
        return Err(err(
            &join(prefix, "grpc"),
            "\"pass\" cannot be combined with require_key: true (gRPC calls would pass without the key that require_key asks of every request); give gRPC its own route",
        ));
    }
    if p.mcp.is_some() {
        if p.grpc == GrpcMode::Pass {
            return Err(err(
                &join(prefix, "grpc"),
                "\"pass\" cannot be combined with protocol \"mcp\": an MCP tool call must never pass unprotected by its content-type",
            ));
        }
        if !p.methods.iter().any(|m| m == "POST") {
            return Err(err(
                &join(prefix, "methods"),
                "must include POST with protocol \"mcp\" (MCP sends every tool call as a POST)",
            ));
        }
    }
    if p.next_hop_failures == NextHopFailures::Classify && matches!(p.forwarding, Forwarding::Detached { .. }) {
        return Err(err(
            &join(prefix, "next_hop_failures"),
            "\"classify\" is only used with forwarding \"router\" (a detached callout's answers are classified by upstream.hop)",
        ));
    }
    // Detached forwarding knows its upstream's timeout: the lock (and so the record, which
    // outlives it) must outlast it, or a retry while the upstream still works would find the key
    // stale or expired and execute it again.
    if let Forwarding::Detached { timeout_ms, .. } = p.forwarding {
        let lock_ms = p.lock_ttl_seconds.saturating_mul(1000);
        if timeout_ms >= lock_ms {
            return Err(err(
                &join(prefix, "upstream.timeout_ms"),
                format!(
                    "{timeout_ms} ms is not below lock_ttl_seconds ({} s, ttl_seconds {} s): a retry while the upstream still works could execute again; lower it or raise lock_ttl_seconds",
                    p.lock_ttl_seconds, p.ttl_seconds
                ),
            ));
        }
    }
    Ok(())
}

/// A logged value is written to the proxy's log and kept with the record (in the store too): a
/// credential or a caller's scope there would be one caller's secret in clear beside every
/// other caller's records. Refused, naming the entry.
fn check_log_headers(p: &Policy, prefix: &str) -> Result<(), ConfigError> {
    for (i, h) in p.log_headers.iter().enumerate() {
        let field = format!("{}[{i}]", join(prefix, "log_headers"));
        if CREDENTIAL_HEADERS.contains(&h.as_str()) || p.credential_headers.contains(h) {
            return Err(err(
                &field,
                format!("\"{h}\" carries a credential: a logged value is kept with the record (in the store too) and written to the log; log a header that names the run instead (e.g. x-agent-run-id)"),
            ));
        }
        if *h == p.header {
            return Err(err(
                &field,
                format!("\"{h}\" is the key header: records hold no raw key, only its hash; log another header"),
            ));
        }
        if p.scope.headers.contains(h) {
            return Err(err(
                &field,
                format!("\"{h}\" is a scope header (scope.headers), which identifies the caller and may be its credential: the record is addressed by its hash, never by the value; log another header"),
            ));
        }
    }
    Ok(())
}

/// What an MCP route releases when neither it nor the top level sets `release_on_status`: the
/// statuses the Streamable HTTP transport answers before it dispatches a message (400 a request it
/// cannot read or a missing session, 404 a session it no longer knows, 405, 406, 415), and 429;
/// 5xx stays stored. At revision 2026-07-28 the Python SDK answers a tool's error with 400 or 404
/// too, carrying the call's JSON-RPC response: such an answer is never released
/// (`engine::settle`: only an answer without a JSON-RPC response with an id releases; docs/mcp.md,
/// "What releases a key").
pub const MCP_RELEASE_ON_STATUS: [u16; 6] = [400, 404, 405, 406, 415, 429];

fn parse_routes(raw: &[RawLevel], base: &Policy, top_release_set: bool) -> Result<Vec<Route>, ConfigError> {
    let mut routes = vec![];
    for (i, r) in raw.iter().enumerate() {
        let f = format!("routes[{i}]");
        for (name, set) in [
            ("store", r.store.is_some()),
            ("routes", r.routes.is_some()),
            ("local", r.local.is_some()),
            ("max_buffered_bytes", r.max_buffered_bytes.is_some()),
            ("hold_headers", r.hold_headers.is_some()),
        ] {
            if set {
                return Err(err(&join(&f, name), "can only be set at the top level, not in a route"));
            }
        }
        let select = parse_route_match(r, &f)?;
        let mut policy = base.clone();
        apply_policy_fields(r, &f, &mut policy)?;
        policy.mcp = parse_protocol(r, &f)?;
        if policy.mcp.is_some() && r.release_on_status.is_none() && !top_release_set {
            policy.release_on_status = MCP_RELEASE_ON_STATUS.to_vec();
        }
        validate_policy(&policy, &f)?;
        let name = match &r.name {
            None => route_name_label(&select),
            Some(n) if is_route_label(n) => n.clone(),
            Some(_) => {
                return Err(err(&join(&f, "name"), "labels metrics: 1 to 64 ASCII letters, digits, _ or - (no dot)"))
            }
        };
        routes.push(Route { select, policy: Arc::new(policy), name });
    }
    Ok(routes)
}

/// A route's `protocol` (`"http"`, the default, or `"mcp"`) and its `mcp` policy (docs/mcp.md).
fn parse_protocol(r: &RawLevel, f: &str) -> Result<Option<McpPolicy>, ConfigError> {
    let mcp = match &r.protocol {
        None => false,
        Some(s) => choice(s, &join(f, "protocol"), &[("http", false), ("mcp", true)])?,
    };
    let Some(o) = &r.mcp else {
        return Ok(mcp.then(McpPolicy::default));
    };
    let fm = join(f, "mcp");
    if !mcp {
        return Err(err(&fm, "only used with \"protocol\": \"mcp\""));
    }
    let names = |list: &Option<Vec<String>>, field: &str| -> Result<(), ConfigError> {
        let fi = join(&fm, field);
        match list.iter().flatten().position(String::is_empty) {
            Some(i) => Err(err(&format!("{fi}[{i}]"), "an empty name names nothing")),
            None => Ok(()),
        }
    };
    names(&o.tools, "tools")?;
    if o.tools.as_ref().is_some_and(Vec::is_empty) {
        return Err(err(
            &join(&fm, "tools"),
            "an empty list would protect no tool; leave it out to protect every tool",
        ));
    }
    names(&o.key_arguments, "key_arguments")?;
    let input_required = match &o.input_required {
        None => InputRequired::Await,
        Some(s) => choice(
            s,
            &join(&fm, "input_required"),
            &[("await", InputRequired::Await), ("keep", InputRequired::Keep), ("release", InputRequired::Release)],
        )?,
    };
    Ok(Some(McpPolicy {
        tools: o.tools.clone(),
        key_arguments: o.key_arguments.clone().unwrap_or_default(),
        input_required,
    }))
}

/// A route's selector: `prefix` (with `case_insensitive`) or `route_name`, exactly one.
fn parse_route_match(r: &RawLevel, f: &str) -> Result<RouteMatch, ConfigError> {
    let prefix = match (&r.prefix, &r.route_name) {
        (Some(_), Some(_)) => {
            return Err(err(&join(f, "route_name"), "cannot be combined with prefix; a route has one or the other"))
        }
        (None, Some(name)) => {
            if name.is_empty() {
                return Err(err(&join(f, "route_name"), "must not be empty: name the Envoy route (its `name`)"));
            }
            if r.case_insensitive.is_some() {
                return Err(err(&join(f, "case_insensitive"), "applies to prefix only; a route name matches exactly"));
            }
            return Ok(RouteMatch::RouteName(name.clone()));
        }
        (Some(prefix), None) => prefix,
        (None, None) => {
            return Err(err(
                &join(f, "prefix"),
                "missing: every route needs a path prefix such as \"/payments\" or a route_name",
            ))
        }
    };
    if !prefix.starts_with('/') {
        return Err(err(&join(f, "prefix"), format!("\"{prefix}\" must start with \"/\"")));
    }
    // Requests are matched on their normal form: a prefix in any other form would never match.
    let normal = crate::path::normalize(prefix);
    if normal != *prefix {
        return Err(err(
            &join(f, "prefix"),
            format!(
                "\"{prefix}\" is not in normal form (one slash between segments, no backslash, no . or .. segments, \
                 no escaped letters, digits or -._~, uppercase escapes, no query); write \"{normal}\""
            ),
        ));
    }
    Ok(RouteMatch::Prefix { prefix: prefix.clone(), case_insensitive: r.case_insensitive.unwrap_or(true) })
}

fn parse_store(s: &RawStore) -> Result<StoreConfig, ConfigError> {
    let kind = match &s.kind {
        Some(k) => choice(k, "store.kind", &[("redis", StoreKind::Redis), ("etcd", StoreKind::Etcd)])?,
        None => StoreKind::Redis,
    };
    let Some(cluster) = s.cluster.clone() else {
        return Err(err("store.cluster", "missing: name the Envoy cluster that reaches the store"));
    };
    if cluster.is_empty() {
        return Err(err("store.cluster", "must not be empty"));
    }
    let authority = s.authority.clone().unwrap_or_else(|| cluster.clone());
    let timeout_ms = match s.timeout_ms {
        Some(t) => range(t, "store.timeout_ms", 1, MAX_STORE_TIMEOUT_MS)?,
        None => 250,
    };
    let on_unavailable = match &s.on_unavailable {
        Some(o) => {
            choice(o, "store.on_unavailable", &[("reject", OnUnavailable::Reject), ("pass", OnUnavailable::Pass)])?
        }
        None => OnUnavailable::Reject,
    };
    let token_refresh_seconds = match (s.token_refresh_seconds, kind) {
        (Some(_), StoreKind::Redis) => {
            return Err(err(
                "store.token_refresh_seconds",
                "only for store.kind \"etcd\" (webdis takes its credential in every request)",
            ))
        }
        (Some(t), StoreKind::Etcd) => range(t, "store.token_refresh_seconds", 1, 3600)?,
        (None, _) => DEFAULT_TOKEN_REFRESH_SECONDS,
    };
    let max_request_bytes = match s.max_request_bytes {
        Some(b) => range(b, "store.max_request_bytes", 65_536, 1 << 32)?,
        None => match kind {
            StoreKind::Etcd => ETCD_DEFAULT_MAX_REQUEST_BYTES,
            StoreKind::Redis => WEBDIS_DEFAULT_MAX_REQUEST_BYTES,
        },
    };
    Ok(StoreConfig { kind, cluster, authority, timeout_ms, on_unavailable, token_refresh_seconds, max_request_bytes })
}

fn parse_local(raw: &RawLocal) -> Result<LocalConfig, ConfigError> {
    let mut l = LocalConfig::default();
    if let Some(n) = raw.max_bytes {
        l.max_bytes = range(n, "local.max_bytes", 4096, 16 * 1024 * 1024 * 1024)?;
    }
    if let Some(n) = raw.max_entries {
        l.max_entries = range(n, "local.max_entries", 16, 1_000_000)?;
    }
    if let Some(n) = raw.min_protection_seconds {
        l.min_protection_seconds = range(n, "local.min_protection_seconds", 0, MAX_TTL_SECONDS)?;
    }
    if let Some(w) = &raw.when_full {
        l.when_full =
            choice(w, "local.when_full", &[("reject", WhenFull::Reject), ("evict_oldest", WhenFull::EvictOldest)])?;
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s.as_bytes())
    }

    fn refused(s: &str) -> ConfigError {
        match parse(s) {
            Ok(c) => panic!("accepted {s}: {c:?}"),
            Err(e) => e,
        }
    }

    const MINIMAL: &str = r#"{"scope": {"headers": ["authorization"]}}"#;

    #[test]
    fn mcp_protocol_is_a_route_field_with_its_policy() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/mcp", "protocol": "mcp", "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}}, {"prefix": "/all", "protocol": "mcp"}, {"prefix": "/h", "protocol": "http"}]}"#,
        )
        .unwrap();
        let mcp = c.policy_for("POST", "/mcp").and_then(|p| p.mcp.clone()).unwrap();
        assert_eq!(mcp.tools, Some(vec!["charge".to_string()]));
        assert_eq!(mcp.key_arguments, vec!["idempotency_key".to_string()]);
        assert_eq!(c.policy_for("POST", "/all").and_then(|p| p.mcp.clone()), Some(McpPolicy::default()));
        assert_eq!(c.policy_for("POST", "/h").map(|p| p.mcp.is_none()), Some(true));
        for (text, field) in [
            (r#"{"scope": {"headers": ["a"]}, "protocol": "mcp"}"#, "protocol"),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "grpc"}]}"#,
                "routes[0].protocol",
            ),
            (r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "mcp": {}}]}"#, "routes[0].mcp"),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "mcp", "mcp": {"tools": []}}]}"#,
                "routes[0].mcp.tools",
            ),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "mcp", "mcp": {"tool": ["x"]}}]}"#,
                "routes[0].mcp.tool",
            ),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "mcp", "mcp": {"key_arguments": [""]}}]}"#,
                "routes[0].mcp.key_arguments[0]",
            ),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "mcp", "grpc": "pass"}]}"#,
                "routes[0].grpc",
            ),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/m", "protocol": "mcp", "methods": ["PUT"]}]}"#,
                "routes[0].methods",
            ),
        ] {
            assert_eq!(refused(text).field, field, "{text}");
        }
    }

    #[test]
    fn key_syntax_is_chosen_per_route() {
        use crate::key::KeySyntax;
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/stripe", "key_syntax": "any"}, {"prefix": "/strict", "key_syntax": "strict"}]}"#,
        )
        .unwrap();
        assert_eq!(c.policy_for("POST", "/stripe/v1").map(|p| p.key_syntax), Some(KeySyntax::Any));
        assert_eq!(c.policy_for("POST", "/strict/v1").map(|p| p.key_syntax), Some(KeySyntax::Strict));
        let all_any = parse(r#"{"scope": {"headers": ["a"]}, "key_syntax": "any"}"#).unwrap();
        assert_eq!(all_any.default_policy.key_syntax, KeySyntax::Any);
    }

    #[test]
    fn tombstone_seconds_is_set_per_route_and_inherited_and_zero_turns_it_off() {
        let c = parse(
            r#"{"scope": {"global": true}, "tombstone_seconds": 3600,
            "routes": [{"prefix": "/off", "tombstone_seconds": 0}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        assert_eq!(c.policy_for("POST", "/off/x").map(|p| p.tombstone_seconds), Some(0));
        assert_eq!(c.policy_for("POST", "/on").map(|p| p.tombstone_seconds), Some(3600));
        let e = parse(r#"{"scope": {"global": true}, "tombstone_seconds": 40000000}"#).unwrap_err();
        assert!(e.to_string().contains("tombstone_seconds"), "{e}");
    }

    #[test]
    fn minimal_config_takes_every_documented_default() {
        let c = parse(MINIMAL).unwrap();
        let p = &c.default_policy;
        assert_eq!(p.header, "idempotency-key");
        assert_eq!(p.methods, vec!["POST", "PATCH"]);
        assert!(!p.require_key);
        assert_eq!(p.namespace, "idemgate");
        assert_eq!(p.key_max_length, 255);
        assert_eq!(p.key_syntax, crate::key::KeySyntax::Strict);
        assert_eq!((p.ttl_seconds, p.lock_ttl_seconds, p.unknown_outcome_seconds), (86_400, 60, 86_400));
        assert_eq!(p.tombstone_seconds, 0, "tombstones are off unless asked for");
        assert_eq!((p.max_request_body_bytes, p.max_response_body_bytes), (1_048_576, 1_048_576));
        assert_eq!(
            p.fingerprint,
            FingerprintConfig {
                headers: vec![],
                include_query: true,
                json: JsonMode::Raw,
                operation_headers: true,
                trailers: true,
                forms: FormMode::Raw
            }
        );
        assert_eq!(
            p.scope,
            ScopeConfig {
                headers: vec!["authorization".into()],
                global: false,
                include_authority: true,
                anonymous: Anonymous::Reject
            }
        );
        assert_eq!(p.release_on_status, vec![429]);
        assert_eq!(p.replay_exclude_headers, vec!["set-cookie"]);
        assert_eq!(p.stale_lock, StaleLock::Reject);
        assert_eq!(c.store, None);
        assert_eq!(c.local, LocalConfig::default());
        assert_eq!(c.max_buffered_bytes, 64 * 1024 * 1024);
        assert!(c.routes.is_empty());
    }

    #[test]
    fn full_config_is_read_field_by_field() {
        let c = parse(
            r#"{
              "header": "X-Idempotency-Key", "methods": ["post", "PUT"], "require_key": true,
              "namespace": "payments", "key_max_length": 64, "ttl_seconds": 3600, "lock_ttl_seconds": 30,
              "unknown_outcome_seconds": 600, "max_request_body_bytes": 1000, "max_response_body_bytes": 2000,
              "fingerprint": {"headers": ["X-Tenant"], "include_query": false, "json": "canonical",
                              "operation_headers": false, "trailers": false, "forms": "semantic"},
              "scope": {"headers": ["authorization", "x-user"], "include_authority": false, "anonymous": "shared"},
              "store": {"cluster": "idemgate_store", "authority": "webdis", "timeout_ms": 50, "on_unavailable": "pass"},
              "release_on_status": [429, 503], "log_headers": ["x-agent-run-id"],
              "replay_exclude_headers": ["set-cookie", "x-trace"], "stale_lock": "takeover",
              "local": {"max_entries": 100, "max_bytes": 1048576, "when_full": "evict_oldest"},
              "max_buffered_bytes": 2097152
            }"#,
        )
        .unwrap();
        let p = &c.default_policy;
        assert_eq!(p.header, "x-idempotency-key");
        assert_eq!(p.methods, vec!["POST", "PUT"]);
        assert!(p.require_key);
        assert_eq!(p.namespace, "payments");
        assert_eq!(p.key_max_length, 64);
        assert_eq!((p.ttl_seconds, p.lock_ttl_seconds, p.unknown_outcome_seconds), (3600, 30, 600));
        assert_eq!((p.max_request_body_bytes, p.max_response_body_bytes), (1000, 2000));
        assert_eq!(
            p.fingerprint,
            FingerprintConfig {
                headers: vec!["x-tenant".into()],
                include_query: false,
                json: JsonMode::Canonical,
                operation_headers: false,
                trailers: false,
                forms: FormMode::Semantic
            }
        );
        assert_eq!(p.scope.headers, vec!["authorization", "x-user"]);
        assert!(!p.scope.include_authority);
        assert_eq!(p.scope.anonymous, Anonymous::Shared);
        assert_eq!(p.release_on_status, vec![429, 503]);
        assert_eq!(p.log_headers, vec!["x-agent-run-id"]);
        assert_eq!(p.replay_exclude_headers, vec!["set-cookie", "x-trace"]);
        assert_eq!(p.stale_lock, StaleLock::Takeover);
        assert_eq!(
            c.store,
            Some(StoreConfig {
                kind: StoreKind::Redis,
                cluster: "idemgate_store".into(),
                authority: "webdis".into(),
                timeout_ms: 50,
                on_unavailable: OnUnavailable::Pass,
                token_refresh_seconds: 60,
                max_request_bytes: WEBDIS_DEFAULT_MAX_REQUEST_BYTES
            })
        );
        assert_eq!(
            c.local,
            LocalConfig {
                max_entries: 100,
                max_bytes: 1_048_576,
                when_full: WhenFull::EvictOldest,
                min_protection_seconds: 3_600
            }
        );
        assert_eq!(c.max_buffered_bytes, 2_097_152);
    }

    /// Issue 23, item 5: a response the configuration may keep must fit in one store write.
    #[test]
    fn max_response_body_bytes_must_fit_the_stores_request_limit() {
        let etcd = parse(r#"{"scope": {"global": true}, "store": {"kind": "etcd", "cluster": "s"}}"#).unwrap();
        assert_eq!(etcd.store.map(|s| s.max_request_bytes), Some(ETCD_DEFAULT_MAX_REQUEST_BYTES));
        // The largest body etcd's default takes, and one byte more.
        let fits = ETCD_DEFAULT_MAX_REQUEST_BYTES - STORE_WRITE_OVERHEAD_BYTES;
        let cfg = |n: u64| {
            format!(
                r#"{{"scope": {{"global": true}}, "max_response_body_bytes": {n}, "store": {{"kind": "etcd", "cluster": "s"}}}}"#
            )
        };
        assert!(parse(&cfg(fits)).is_ok());
        let e = parse(&cfg(fits + 1)).unwrap_err();
        assert_eq!(e.field, "max_response_body_bytes", "{e:?}");
        assert!(e.reason.contains("store.max_request_bytes"), "{e:?}");
        // Routes name their own field; a raised limit admits a larger body.
        let routed = r#"{"scope": {"global": true}, "routes": [{"prefix": "/a"}, {"prefix": "/b", "max_response_body_bytes": 4194304}], "store": {"kind": "etcd", "cluster": "s"}}"#;
        assert_eq!(parse(routed).unwrap_err().field, "routes[1].max_response_body_bytes");
        let raised = r#"{"scope": {"global": true}, "max_response_body_bytes": 4194304, "store": {"kind": "etcd", "cluster": "s", "max_request_bytes": 8388608}}"#;
        assert!(parse(raised).is_ok());
        // webdis's default (128 MiB) takes the largest body idemgate keeps (64 MiB).
        let redis = format!(
            r#"{{"scope": {{"global": true}}, "max_response_body_bytes": {MAX_BODY_BYTES}, "store": {{"cluster": "s"}}}}"#
        );
        assert!(parse(&redis).is_ok());
        let small = r#"{"scope": {"global": true}, "store": {"cluster": "s", "max_request_bytes": 1048576}}"#;
        assert_eq!(parse(small).unwrap_err().field, "max_response_body_bytes");
        assert_eq!(
            parse(r#"{"scope": {"global": true}, "store": {"cluster": "s", "max_request_bytes": 10}}"#)
                .unwrap_err()
                .field,
            "store.max_request_bytes"
        );
    }

    #[test]
    fn store_defaults_authority_to_cluster_and_rejects_when_unavailable() {
        let c = parse(r#"{"scope": {"global": true}, "store": {"cluster": "redis"}}"#).unwrap();
        assert_eq!(
            c.store,
            Some(StoreConfig {
                kind: StoreKind::Redis,
                cluster: "redis".into(),
                authority: "redis".into(),
                timeout_ms: 250,
                on_unavailable: OnUnavailable::Reject,
                token_refresh_seconds: 60,
                max_request_bytes: WEBDIS_DEFAULT_MAX_REQUEST_BYTES
            })
        );
    }

    #[test]
    fn store_kind_is_redis_by_default_or_etcd_and_etcd_needs_ttl_over_lock_by_the_skew_tolerance() {
        let c = parse(r#"{"scope": {"global": true}, "store": {"cluster": "s"}}"#).unwrap();
        assert_eq!(c.store.unwrap().kind, StoreKind::Redis);
        let c = parse(r#"{"scope": {"global": true}, "store": {"kind": "etcd", "cluster": "s"}}"#).unwrap();
        assert_eq!(c.store.unwrap().kind, StoreKind::Etcd);
        let e = parse(r#"{"scope": {"global": true}, "store": {"kind": "zk", "cluster": "s"}}"#).unwrap_err();
        assert_eq!(e.field, "store.kind");
        // ttl = lock + 1 is enough for Redis (one clock), not for etcd (the proxies' clocks).
        let tight = r#"{"scope": {"global": true}, "ttl_seconds": 11, "lock_ttl_seconds": 10, "store": {"kind": "KIND", "cluster": "s"}}"#;
        assert!(parse(&tight.replace("KIND", "redis")).is_ok());
        let e = parse(&tight.replace("KIND", "etcd")).unwrap_err();
        assert_eq!(e.field, "ttl_seconds");
        assert!(e.reason.contains("skew tolerance"), "{}", e.reason);
        assert!(parse(&tight.replace("KIND", "etcd").replace("\"ttl_seconds\": 11", "\"ttl_seconds\": 12")).is_ok());
        // The etcd token's refresh: etcd only, 1 s to an hour.
        let refresh =
            r#"{"scope": {"global": true}, "store": {"kind": "KIND", "cluster": "s", "token_refresh_seconds": N}}"#;
        let c = parse(&refresh.replace("KIND", "etcd").replace('N', "20")).unwrap();
        assert_eq!(c.store.unwrap().token_refresh_seconds, 20);
        for bad in
            [refresh.replace("KIND", "redis").replace('N', "20"), refresh.replace("KIND", "etcd").replace('N', "0")]
        {
            assert_eq!(parse(&bad).unwrap_err().field, "store.token_refresh_seconds", "{bad}");
        }
    }

    #[test]
    fn every_refusal_names_its_field() {
        let table: &[(&str, &str)] = &[
            (r#"{}"#, "scope.headers"),
            (r#"{"scope": {"headers": []}}"#, "scope.headers"),
            (r#"{"scope": {"headers": ["a"], "global": true}}"#, "scope.global"),
            (r#"{"scope": {"headers": ["a"]}, "ttl": 5}"#, "ttl"),
            (r#"{"scope": {"headers": ["a"], "bogus": 1}}"#, "scope.bogus"),
            (r#"{"scope": {"headers": ["a b"]}}"#, "scope.headers[0]"),
            (r#"{"scope": {"headers": ["a", "A"]}}"#, "scope.headers[1]"),
            (r#"{"scope": {"headers": ["idempotency-key"]}}"#, "scope.headers"),
            (r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 0}"#, "ttl_seconds"),
            (r#"{"scope": {"headers": ["a"]}, "ttl_seconds": "60"}"#, "ttl_seconds"),
            (r#"{"scope": {"headers": ["a"]}, "ttl_seconds": -5}"#, "ttl_seconds"),
            (r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 1.5}"#, "ttl_seconds"),
            (r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 30, "lock_ttl_seconds": 60}"#, "ttl_seconds"),
            (r#"{"scope": {"headers": ["a"]}, "methods": []}"#, "methods"),
            (r#"{"scope": {"headers": ["a"]}, "methods": ["PO ST"]}"#, "methods[0]"),
            (r#"{"scope": {"headers": ["a"]}, "header": ""}"#, "header"),
            (r#"{"scope": {"headers": ["a"]}, "require_key": "yes"}"#, "require_key"),
            (r#"{"scope": {"headers": ["a"]}, "namespace": ""}"#, "namespace"),
            (r#"{"scope": {"headers": ["a"]}, "key_max_length": 0}"#, "key_max_length"),
            (r#"{"scope": {"headers": ["a"]}, "key_syntax": "stripe"}"#, "key_syntax"),
            (r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p", "key_syntax": 1}]}"#, "routes[0].key_syntax"),
            (r#"{"scope": {"headers": ["a"]}, "max_request_body_bytes": 1e12}"#, "max_request_body_bytes"),
            (r#"{"scope": {"headers": ["a"]}, "fingerprint": {"json": "sorted"}}"#, "fingerprint.json"),
            (r#"{"scope": {"headers": ["a"]}, "fingerprint": {"forms": "fields"}}"#, "fingerprint.forms"),
            (r#"{"scope": {"headers": ["a"]}, "fingerprint": {"body": true}}"#, "fingerprint.body"),
            (r#"{"scope": {"headers": ["a"]}, "fingerprint": {"trailers": "yes"}}"#, "fingerprint.trailers"),
            (
                r#"{"scope": {"headers": ["a"]}, "fingerprint": {"operation_headers": 1}}"#,
                "fingerprint.operation_headers",
            ),
            (r#"{"scope": {"headers": ["a"], "anonymous": "pool"}}"#, "scope.anonymous"),
            (r#"{"scope": {"headers": ["a"], "anonymous": true}}"#, "scope.anonymous"),
            (r#"{"scope": {"global": true, "anonymous": "shared"}}"#, "scope.anonymous"),
            (
                r#"{"scope": {"global": true}, "routes": [{"prefix": "/p", "scope": {"anonymous": "reject"}}]}"#,
                "routes[0].scope.anonymous",
            ),
            (r#"{"scope": {"headers": ["a"]}, "release_on_status": [200]}"#, "release_on_status[0]"),
            (r#"{"scope": {"headers": ["a"]}, "stale_lock": "steal"}"#, "stale_lock"),
            (r#"{"scope": {"headers": ["a"]}, "store": {}}"#, "store.cluster"),
            (r#"{"scope": {"headers": ["a"]}, "store": {"cluster": "c", "password": "x"}}"#, "store.password"),
            (r#"{"scope": {"headers": ["a"]}, "store": {"cluster": "c", "timeout_ms": 0}}"#, "store.timeout_ms"),
            (
                r#"{"scope": {"headers": ["a"]}, "store": {"cluster": "c", "on_unavailable": "open"}}"#,
                "store.on_unavailable",
            ),
            (r#"{"scope": {"headers": ["a"]}, "local": {"when_full": "drop"}}"#, "local.when_full"),
            (r#"{"scope": {"headers": ["a"]}, "local": {"max_entries": 5000000}}"#, "local.max_entries"),
            (
                r#"{"scope": {"headers": ["a"]}, "local": {"min_protection_seconds": -1}}"#,
                "local.min_protection_seconds",
            ),
            (r#"{"scope": {"headers": ["a"]}, "max_buffered_bytes": 10}"#, "max_buffered_bytes"),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p", "max_buffered_bytes": 5000}]}"#,
                "routes[0].max_buffered_bytes",
            ),
            (r#"{"scope": {"headers": ["a"]}, "routes": []}"#, "routes"),
            (r#"{"scope": {"headers": ["a"]}, "routes": [{}]}"#, "routes[0].prefix"),
            (r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "pay"}]}"#, "routes[0].prefix"),
            (r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p", "store": null}]}"#, "routes[0].store"),
            (
                r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p", "ttl_seconds": 0}]}"#,
                "routes[0].ttl_seconds",
            ),
            (r#"{"routes": [{"prefix": "/p"}]}"#, "routes[0].scope.headers"),
            (r#"[1, 2]"#, ""),
            (r#"{"scope": "#, ""),
        ];
        for (text, field) in table {
            let e = refused(text);
            assert_eq!(e.field, *field, "config {text} gave {e}");
            assert!(!e.reason.is_empty());
            if !field.is_empty() {
                assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
            }
        }
    }

    #[test]
    fn agent_fields_are_read_and_checked() {
        let c = parse(
            r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached", "upstream": {"cluster": "api", "timeout_ms": 2000},
                "in_flight": "wait", "wait_ms": 3000, "derive_key": {"headers": ["X-Agent-Task-Id", "x-agent-step-id"], "include_body": true}}"#,
        )
        .unwrap();
        let p = &c.default_policy;
        assert_eq!(
            p.forwarding,
            Forwarding::Detached { cluster: "api".into(), timeout_ms: 2000, hop: Hop::InternalListener }
        );
        let direct = parse(
            r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached", "upstream": {"cluster": "api", "hop": "direct"}}"#,
        )
        .unwrap();
        assert!(matches!(direct.default_policy.forwarding, Forwarding::Detached { hop: Hop::Direct, .. }));
        let bad = r#"{"scope": {"headers": ["authorization"]}, "forwarding": "detached", "upstream": {"cluster": "api", "hop": "none"}}"#;
        assert!(parse(bad).unwrap_err().to_string().contains("upstream.hop"), "the error names the field");
        assert_eq!(p.in_flight, InFlight::Wait { wait_ms: 3000 });
        assert_eq!(
            p.derive_key,
            Some(DeriveKey { headers: vec!["x-agent-task-id".into(), "x-agent-step-id".into()], include_body: true })
        );
        let d = parse(MINIMAL).unwrap().default_policy;
        assert_eq!((&d.forwarding, &d.in_flight, &d.derive_key), (&Forwarding::Router, &InFlight::Conflict, &None));
        let table: &[(&str, &str)] = &[
            (r#"{"scope": {"headers": ["a"]}, "forwarding": "detached"}"#, "upstream"),
            (r#"{"scope": {"headers": ["a"]}, "forwarding": "teleport"}"#, "forwarding"),
            (r#"{"scope": {"headers": ["a"]}, "upstream": {"cluster": "x"}}"#, "upstream"),
            (r#"{"scope": {"headers": ["a"]}, "forwarding": "detached", "upstream": {}}"#, "upstream.cluster"),
            (
                r#"{"scope": {"headers": ["a"]}, "forwarding": "detached", "upstream": {"cluster": "x", "retries": 3}}"#,
                "upstream.retries",
            ),
            (r#"{"scope": {"headers": ["a"]}, "wait_ms": 100}"#, "wait_ms"),
            (r#"{"scope": {"headers": ["a"]}, "in_flight": "wait", "wait_ms": 0}"#, "wait_ms"),
            (r#"{"scope": {"headers": ["a"]}, "derive_key": {"headers": []}}"#, "derive_key.headers"),
            (r#"{"scope": {"global": true}, "derive_key": {"headers": ["x-agent-task-id"]}}"#, "derive_key"),
        ];
        for (text, field) in table {
            assert_eq!(refused(text).field, *field, "{text}");
        }
        // A route inherits detached forwarding and may turn it off.
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "forwarding": "detached", "upstream": {"cluster": "api"},
                "routes": [{"prefix": "/slow"}, {"prefix": "/", "forwarding": "router"}]}"#,
        )
        .unwrap();
        assert!(matches!(c.routes[0].policy.forwarding, Forwarding::Detached { .. }));
        assert_eq!(c.routes[1].policy.forwarding, Forwarding::Router);
    }

    #[test]
    fn hold_headers_is_on_by_default_and_off_only_without_detached_forwarding() {
        assert!(parse(r#"{"scope": {"global": true}}"#).unwrap().hold_headers);
        assert!(!parse(r#"{"scope": {"global": true}, "hold_headers": false}"#).unwrap().hold_headers);
        let e = parse(r#"{"scope": {"global": true}, "hold_headers": "no"}"#).unwrap_err();
        assert_eq!(e.field, "hold_headers");
        let e = parse(
            r#"{"scope": {"global": true}, "hold_headers": false,
                "routes": [{"prefix": "/a", "forwarding": "detached", "upstream": {"cluster": "c", "timeout_ms": 1000}}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "hold_headers", "{e}");
        let e =
            parse(r#"{"scope": {"global": true}, "routes": [{"prefix": "/a", "hold_headers": false}]}"#).unwrap_err();
        assert!(e.field.contains("hold_headers"), "{e}");
    }

    #[test]
    fn mismatch_status_is_422_by_default_409_per_route_and_nothing_else() {
        let c = Config::parse(
            br#"{"scope": {"global": true}, "routes": [{"prefix": "/acp", "mismatch_status": 409}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        let statuses: Vec<u16> = c.policies().map(|p| p.mismatch_status).collect();
        assert_eq!(statuses, [409, 422]);
        for bad in ["400", "\"409\"", "409.0", "null"] {
            let e = Config::parse(format!(r#"{{"scope": {{"global": true}}, "mismatch_status": {bad}}}"#).as_bytes())
                .unwrap_err();
            assert!(e.to_string().contains("`mismatch_status`"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_detached_upstream_timeout_must_stay_below_the_lock_and_so_the_record() {
        let detached = |fields: &str| {
            format!(
                r#"{{"scope": {{"headers": ["a"]}}, "forwarding": "detached", "upstream": {{"cluster": "api"{fields}}}"#
            )
        };
        // The issue's case: the default timeout (30 s) with a 3 s record and a 2 s lock.
        let e = refused(&(detached("") + r#", "ttl_seconds": 3, "lock_ttl_seconds": 2}"#));
        assert_eq!(e.field, "upstream.timeout_ms");
        assert!(e.reason.contains("30000 ms") && e.reason.contains("lock_ttl_seconds (2 s"), "{e}");
        assert_eq!(
            refused(&(detached(r#", "timeout_ms": 5000"#) + r#", "lock_ttl_seconds": 5}"#)).field,
            "upstream.timeout_ms"
        );
        assert!(parse(&(detached(r#", "timeout_ms": 4999"#) + r#", "lock_ttl_seconds": 5}"#)).is_ok());
        assert!(parse(&(detached("") + "}")).is_ok(), "the defaults: 30 s below a 60 s lock");
        // Checked per route, on what the route inherits as well as what it sets.
        let route = r#"{"scope": {"headers": ["a"]}, "forwarding": "detached", "upstream": {"cluster": "api", "timeout_ms": 3000},
                        "routes": [{"prefix": "/fast"}, {"prefix": "/", "lock_ttl_seconds": 3}]}"#;
        assert_eq!(refused(route).field, "routes[1].upstream.timeout_ms");
        // With a store, the claim's answer (up to store.timeout_ms) comes first: both within the lock.
        let store = |ms: u64| format!(r#", "lock_ttl_seconds": 5, "store": {{"cluster": "s", "timeout_ms": {ms}}}}}"#);
        let e = refused(&(detached(r#", "timeout_ms": 4000"#) + &store(1000)));
        assert_eq!(e.field, "upstream.timeout_ms");
        assert!(e.reason.contains("4000 ms plus store.timeout_ms (1000 ms)"), "{e}");
        assert!(parse(&(detached(r#", "timeout_ms": 4000"#) + &store(999))).is_ok());
        // Router forwarding: the route's timeout is Envoy's, documented for the operator to keep below the lock.
        assert!(parse(r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 3, "lock_ttl_seconds": 2}"#).is_ok());
    }

    /// Issue 13, item 2: a record must outlive its lock by a stated margin (1 s), so that no
    /// claim's record can end the instant its lock goes stale; the error names `ttl_seconds`.
    #[test]
    fn ttl_seconds_must_exceed_lock_ttl_seconds_by_the_margin() {
        for (fields, field) in [
            (r#""ttl_seconds": 3, "lock_ttl_seconds": 3"#, "ttl_seconds"),
            (r#""ttl_seconds": 60"#, "ttl_seconds"),
            (r#""ttl_seconds": 30, "lock_ttl_seconds": 60"#, "ttl_seconds"),
            (r#""routes": [{"prefix": "/p", "lock_ttl_seconds": 86400}]"#, "routes[0].ttl_seconds"),
        ] {
            let e = refused(&format!(r#"{{"scope": {{"headers": ["a"]}}, {fields}}}"#));
            assert_eq!(e.field, field, "{fields}: {e}");
            assert!(e.reason.contains("lock_ttl_seconds") && e.reason.contains("1 s"), "{fields}: {e}");
        }
        assert!(parse(r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 4, "lock_ttl_seconds": 3}"#).is_ok());
        assert!(
            parse(r#"{"scope": {"headers": ["a"]}, "ttl_seconds": 61}"#).is_ok(),
            "61 s over the default 60 s lock"
        );
    }

    #[test]
    fn empty_configuration_is_refused_for_missing_scope_not_for_syntax() {
        assert_eq!(refused("").field, "scope.headers");
        assert_eq!(refused("  \n").field, "scope.headers");
    }

    #[test]
    fn routes_inherit_top_level_fields_and_override_nested_ones_partially() {
        let c = parse(
            r#"{"scope": {"headers": ["authorization"]}, "ttl_seconds": 600,
                "fingerprint": {"headers": ["x-tenant"]},
                "routes": [{"prefix": "/payments", "require_key": true, "fingerprint": {"json": "canonical"}},
                           {"prefix": "/", "methods": ["PUT"]}]}"#,
        )
        .unwrap();
        let pay = c.policy_for("POST", "/payments/charge?x=1").unwrap();
        assert!(pay.require_key);
        assert_eq!(pay.ttl_seconds, 600);
        assert_eq!(pay.fingerprint.headers, vec!["x-tenant"]);
        assert_eq!(pay.fingerprint.json, JsonMode::Canonical);
        assert!(c.policy_for("GET", "/payments").is_none());
        assert!(c.policy_for("POST", "/orders").is_none(), "second route only protects PUT");
        assert!(c.policy_for("PUT", "/orders").is_some());
        assert_eq!(c.policies().count(), 2);
        assert_eq!(c.policy_index_for("PUT", "/orders"), Some(1));
        assert_eq!(c.policy_at(1).map(|p| &p.methods), Some(&vec!["PUT".to_string()]));
    }

    #[test]
    fn routes_inherit_and_override_the_anonymous_scope_and_fingerprint_switches() {
        let c = parse(
            r#"{"scope": {"headers": ["authorization"], "anonymous": "shared"}, "fingerprint": {"trailers": false},
                "routes": [{"prefix": "/pay", "scope": {"anonymous": "reject"}, "fingerprint": {"operation_headers": false}},
                           {"prefix": "/"}]}"#,
        )
        .unwrap();
        let pay = &c.routes[0].policy;
        assert_eq!(pay.scope.anonymous, Anonymous::Reject);
        assert_eq!(pay.scope.headers, vec!["authorization"]);
        assert!(!pay.fingerprint.operation_headers && !pay.fingerprint.trailers);
        let rest = &c.routes[1].policy;
        assert_eq!(rest.scope.anonymous, Anonymous::Shared);
        assert!(rest.fingerprint.operation_headers && !rest.fingerprint.trailers);
        let e = refused(r#"{"scope": {"headers": ["a"], "anonymous": "pool"}}"#);
        assert!(e.to_string().contains(r#"expected one of "reject", "shared", got "pool""#), "{e}");
    }

    #[test]
    fn without_routes_every_path_is_protected_for_configured_methods() {
        let c = parse(MINIMAL).unwrap();
        assert!(c.policy_for("POST", "/anything").is_some());
        assert!(c.policy_for("PATCH", "/").is_some());
        assert!(c.policy_for("GET", "/anything").is_none());
        assert!(c.protects_method("POST") && !c.protects_method("GET"));
    }

    /// Found by the boundary oracle (issue 41): Envoy forwards an HTTP/2 `:method` of `Post` (its
    /// HTTP/1 codec refuses it), Werkzeug (Flask) and Django read it as POST and run the POST
    /// handler, and idemgate, comparing methods case-sensitively, let it through unprotected: a
    /// key sent as `Post` over HTTP/2 and as `POST` executed twice. A method is compared without
    /// regard to ASCII case (the fingerprint keeps it as sent: `Post` then `POST` is 422).
    #[test]
    fn a_method_in_another_letter_case_is_protected_as_the_method() {
        let c = parse(MINIMAL).unwrap();
        for m in ["post", "Post", "pAtCh"] {
            assert!(c.policy_for(m, "/anything").is_some(), "{m}");
            assert!(c.protects_method(m), "{m}");
        }
        assert!(c.policy_for("get", "/anything").is_none());
        let routed =
            parse(r#"{"scope": {"global": true}, "routes": [{"prefix": "/v1/payments", "methods": ["PUT"]}]}"#)
                .unwrap();
        assert!(routed.policy_for("Put", "/v1/payments").is_some());
        assert!(routed.policy_for("Post", "/v1/payments").is_none());
    }

    #[test]
    fn routes_match_on_path_without_query_first_match_wins() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/a", "namespace": "first"}, {"prefix": "/a/b", "namespace": "second"}]}"#,
        )
        .unwrap();
        assert_eq!(c.policy_for("POST", "/a/b").unwrap().namespace, "first");
        assert!(c.policy_for("POST", "/x?/a").is_none());
    }

    /// Found by an adversarial review: a route for other methods hid every later route, so a POST
    /// to /v1/orders was not protected at all (every retry with its key executed).
    #[test]
    fn a_route_for_other_methods_does_not_hide_the_routes_after_it() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/v1/orders", "methods": ["PUT"], "namespace": "orders"}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        assert_eq!(c.policy_for("PUT", "/v1/orders/7").unwrap().namespace, "orders");
        assert_eq!(c.policy_index_for("POST", "/v1/orders"), Some(1));
        assert!(c.policy_for("GET", "/v1/orders").is_none());
    }

    #[test]
    fn routes_match_every_spelling_of_a_path_by_its_normal_form() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [
                {"prefix": "/v1/payments", "case_insensitive": false, "namespace": "pay"},
                {"prefix": "/v1/Refunds", "namespace": "refund"}]}"#,
        )
        .unwrap();
        let ns = |path: &str| c.policy_for("POST", path).map(|p| p.namespace.as_str());
        for path in [
            "/v1/payments",
            "/v1//payments",
            "//v1/payments",
            "/v1/./payments",
            "/v1/%70ayments",
            "/v1/payments/../payments",
            "/v1/%2e/payments/x?y=1",
            "/v1/payments#x",
            "/x/../v1/payments",
            "/v1\\payments",
        ] {
            assert_eq!(ns(path), Some("pay"), "{path}");
        }
        // Case-sensitive on request.
        assert_eq!(ns("/V1/payments"), None);
        assert_eq!(ns("/v1/%50ayments"), None, "%50 is P");
        // Case-insensitive by default.
        for path in ["/v1/refunds", "/V1/REFUNDS/9", "//v1/%72efunds", "/v1/%52efunds"] {
            assert_eq!(ns(path), Some("refund"), "{path}");
        }
        // Decoding servers read an encoded slash as a separator; servlet containers cut `;params`.
        for path in [
            "/v1%2Fpayments",
            "/%2Fv1/payments",
            "/v1%5Cpayments",
            "/v1%252Fpayments",
            "/v1;jsessionid=1/payments",
            "/v1/x/..;/payments",
            "/v1/x/..%3B/payments",
        ] {
            assert_eq!(ns(path), Some("pay"), "{path}");
        }
        // No reading puts a slash inside `payments` apart, or reads `/v1/pay;ments` beyond `/v1/pay`.
        assert_eq!(ns("/v1/pay%2Fments"), None);
        assert_eq!(ns("/v1/pay;ments"), None);
        // A path whose normal form matches nothing is still matched as sent (query cut off): an
        // upstream that does not resolve `%2e%2e` reads it under /v1/payments.
        assert_eq!(ns("/v1/payments/%2e%2e/orders"), Some("pay"));
        assert_eq!(ns("/v1/orders"), None);
        // Readings that select two routes keeping keys apart select neither (`Selection::Ambiguous`,
        // refused by the filter): a spelling of /a/b whose normal form (`/a%2Fb`) matches only
        // the route after it belongs to no route; plain spellings of /a/b stay /a/b's.
        let two = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/a/b", "namespace": "ab"},
                {"prefix": "/", "namespace": "rest"}]}"#,
        )
        .unwrap();
        let two_ns = |path: &str| two.policy_for("POST", path).map(|p| p.namespace.as_str());
        for path in ["/a/b", "/A/b", "/a/b/c"] {
            assert_eq!(two_ns(path), Some("ab"), "{path}");
        }
        for path in ["/a%2Fb", "/x/../a/b", "/a;x/b", "/a/x/..;/b/c"] {
            assert_eq!(two_ns(path), None, "{path}");
            assert!(matches!(two.select_route("POST", path, None), Selection::Ambiguous { .. }), "{path}");
        }
        assert_eq!(two_ns("/a/c"), Some("rest"));
        // A prefix with an escape is read the way the path is: `/caf%C3%A9` is `/café` decoded.
        let escaped = parse(r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/caf%C3%A9"}]}"#).unwrap();
        assert!(escaped.policy_for("POST", "/x/..;/caf%c3%a9/1").is_some());
        assert!(escaped.policy_for("POST", "/caf\u{e9}").is_some());
        assert_eq!(ns("*"), None);
        assert_eq!(ns(""), None);
        // Without routes, every path is protected, even an odd one.
        let every = parse(MINIMAL).unwrap();
        assert!(every.policy_for("POST", "*").is_some() && every.policy_for("POST", "").is_some());
    }

    #[test]
    fn route_prefixes_must_be_in_normal_form_and_the_case_option_a_boolean() {
        for (prefix, write) in [
            ("/v1//payments", "/v1/payments"),
            ("/v1/./payments", "/v1/payments"),
            ("/v1/x/../payments", "/v1/payments"),
            ("/v1/%70ayments", "/v1/payments"),
            ("/v1/payments%2f", "/v1/payments%2F"),
            ("/v1/payments?x=1", "/v1/payments"),
            ("/v1/payments/.", "/v1/payments/"),
        ] {
            let text = format!(
                r#"{{"scope": {{"headers": ["a"]}}, "routes": [{{"prefix": "/ok"}}, {{"prefix": "{prefix}"}}]}}"#
            );
            let e = refused(&text);
            assert_eq!(e.field, "routes[1].prefix", "{prefix}: {e}");
            assert!(e.reason.contains(&format!("write \"{write}\"")), "{prefix}: {e}");
        }
        let e = refused(r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p", "case_insensitive": "yes"}]}"#);
        assert_eq!(e.field, "routes[0].case_insensitive", "{e}");
        let c = parse(r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p"}, {"prefix": "/q", "case_insensitive": false}]}"#)
            .unwrap();
        let ci = |r: &Route| matches!(r.select, RouteMatch::Prefix { case_insensitive: true, .. });
        assert!(ci(&c.routes[0]) && !ci(&c.routes[1]), "case-insensitive unless a route says false");
        // The top level has no such field: it selects nothing there.
        assert_eq!(refused(r#"{"scope": {"headers": ["a"]}, "case_insensitive": true}"#).field, "case_insensitive");
    }

    #[test]
    fn a_route_name_selects_by_the_envoy_route_that_matched_in_order_with_prefixes() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"route_name": "pay", "namespace": "by-name"},
                {"prefix": "/v1/payments", "namespace": "by-prefix"}, {"route_name": "orders", "methods": ["PUT"]}]}"#,
        )
        .unwrap();
        assert!(c.uses_route_names());
        let ns = |path: &str, name: Option<&str>| {
            c.policy_index_for_route("POST", path, name).and_then(|i| c.policy_at(i)).map(|p| p.namespace.as_str())
        };
        // Whatever the path, the Envoy route decides.
        assert_eq!(ns("/anything", Some("pay")), Some("by-name"));
        assert_eq!(ns("/v1/payments", Some("pay")), Some("by-name"), "first match wins");
        assert_eq!(ns("/v1/payments", Some("other")), Some("by-prefix"));
        assert_eq!(ns("/v1//payments", None), Some("by-prefix"));
        assert_eq!(ns("/anything", Some("Pay")), None, "exact, case included");
        assert_eq!(ns("/anything", Some("")), None);
        assert_eq!(ns("/anything", None), None);
        // The route's own methods still apply.
        assert_eq!(c.policy_index_for_route("POST", "/x", Some("orders")), None);
        assert_eq!(c.policy_index_for_route("PUT", "/x", Some("orders")), Some(2));
        // Without a route name, policy_for sees only prefixes.
        assert_eq!(c.policy_for("POST", "/anything").map(|p| p.namespace.as_str()), None);
        assert!(!parse(r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/p"}]}"#).unwrap().uses_route_names());
        assert!(!parse(MINIMAL).unwrap().uses_route_names());
    }

    #[test]
    fn a_routes_metrics_label_is_its_name_or_what_selects_it() {
        let c = parse(
            r#"{"scope": {"headers": ["a"]}, "routes": [{"prefix": "/v1/payments", "name": "pay-v1"},
                {"prefix": "/v1/re.funds/"}, {"route_name": "orders.api"}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        let names: Vec<&str> = c.routes.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["pay-v1", "v1_re_funds", "orders_api", "root"]);
        assert!(c.routes.iter().all(|r| is_route_label(&r.name)));
        let long = format!(r#"{{"scope": {{"headers": ["a"]}}, "routes": [{{"prefix": "/{}"}}]}}"#, "a".repeat(100));
        assert_eq!(parse(&long).unwrap().routes[0].name.len(), ROUTE_LABEL_MAX);
        for bad in ["", "a.b", "a b", "é", &"x".repeat(ROUTE_LABEL_MAX + 1)] {
            let text = format!(r#"{{"scope": {{"headers": ["a"]}}, "routes": [{{"prefix": "/p", "name": "{bad}"}}]}}"#);
            let e = parse(&text).unwrap_err();
            assert_eq!(e.field, "routes[0].name", "{bad:?}");
            assert!(e.reason.contains(&format!("1 to {ROUTE_LABEL_MAX} ")), "{}", e.reason);
        }
        let top = parse(r#"{"scope": {"headers": ["a"]}, "name": "x"}"#).unwrap_err();
        assert_eq!(top.field, "name");
    }

    #[test]
    fn a_route_has_a_prefix_or_a_route_name_and_errors_name_the_field() {
        let table: &[(&str, &str)] = &[
            (r#"{"prefix": "/p", "route_name": "pay"}"#, "routes[0].route_name"),
            (r#"{"route_name": ""}"#, "routes[0].route_name"),
            (r#"{"route_name": 7}"#, "routes[0].route_name"),
            (r#"{"route_name": "pay", "case_insensitive": true}"#, "routes[0].case_insensitive"),
            (r#"{"namespace": "x"}"#, "routes[0].prefix"),
        ];
        for (route, field) in table {
            let e = refused(&format!(r#"{{"scope": {{"headers": ["a"]}}, "routes": [{route}]}}"#));
            assert_eq!(e.field, *field, "{route}: {e}");
        }
        assert!(refused(r#"{"scope": {"headers": ["a"]}, "routes": [{}]}"#).reason.contains("route_name"));
        assert_eq!(refused(r#"{"scope": {"headers": ["a"]}, "route_name": "pay"}"#).field, "route_name");
        let c = parse(r#"{"scope": {"headers": ["a"]}, "routes": [{"route_name": "pay"}]}"#).unwrap();
        assert_eq!(c.routes[0].select, RouteMatch::RouteName("pay".into()));
    }

    /// A route with every nested object, for errors placed at each level.
    const NESTED: &str = r#"{"scope": {"headers": ["a"]}, "store": {"cluster": "s"}, "local": {"max_entries": 16},
        "routes": [{"prefix": "/a"}, {"prefix": "/b", "forwarding": "detached", "upstream": {"cluster": "u", "timeout_ms": 1000},
        "fingerprint": {"json": "raw"}, "derive_key": {"headers": ["x-step"]}, "protocol": "mcp", "mcp": {"tools": ["t"]}}]}"#;

    #[test]
    fn nested_config_parses_so_the_errors_below_are_each_its_own() {
        assert!(parse(NESTED).is_ok());
    }

    #[test]
    fn an_unknown_field_at_each_level_names_its_path() {
        for (after, field) in [
            (r#""scope": {"#, "scope.colour"),
            (r#""store": {"#, "store.colour"),
            (r#""local": {"#, "local.colour"),
            (r#"{"prefix": "/b", "#, "routes[1].colour"),
            (r#""upstream": {"#, "routes[1].upstream.colour"),
            (r#""fingerprint": {"#, "routes[1].fingerprint.colour"),
            (r#""derive_key": {"#, "routes[1].derive_key.colour"),
            (r#""mcp": {"#, "routes[1].mcp.colour"),
            (r#"{"scope""#, "colour"),
        ] {
            let text = NESTED.replacen(after, &after.replacen('{', r#"{"colour": 1, "#, 1), 1);
            assert!(NESTED.contains(after), "{after}");
            let e = refused(&text);
            assert_eq!(e.field, field, "{text}: {e}");
            assert!(e.reason.starts_with("unknown field `colour`, expected"), "{e}");
        }
    }

    #[test]
    fn a_wrong_type_names_its_path() {
        for (from, to, field, reason) in [
            (r#""timeout_ms": 1000"#, r#""timeout_ms": "1000""#, "routes[1].upstream.timeout_ms", "expected u64"),
            (r#""timeout_ms": 1000"#, r#""timeout_ms": -1"#, "routes[1].upstream.timeout_ms", "expected u64"),
            (
                r#""headers": ["x-step"]"#,
                r#""headers": ["x-step", 7]"#,
                "routes[1].derive_key.headers[1]",
                "expected a string",
            ),
            (r#""tools": ["t"]"#, r#""tools": "t""#, "routes[1].mcp.tools", "expected a sequence"),
            (r#""max_entries": 16"#, r#""max_entries": true"#, "local.max_entries", "expected u64"),
            (r#""store": {"cluster": "s"}"#, r#""store": ["s"]"#, "store", "expected an object"),
            (r#"{"prefix": "/a"}"#, r#"["/a"]"#, "routes[0]", "expected an object"),
            (r#""headers": ["a"]"#, r#""headers": null"#, "scope.headers", "invalid type: null"),
        ] {
            assert!(NESTED.contains(from), "{from}");
            let e = refused(&NESTED.replacen(from, to, 1));
            assert_eq!(e.field, field, "{to}: {e}");
            assert!(e.reason.contains(reason), "{to}: {e}");
        }
        let e = refused(r#"[{"scope": {"global": true}}]"#);
        assert_eq!((e.field.as_str(), e.reason.contains("expected an object")), ("", true), "{e}");
    }

    /// serde_json alone keeps the last of two equal keys silently (so did the configuration when it
    /// walked a `serde_json::Value`); a key given twice is now refused, naming it.
    #[test]
    fn a_key_given_twice_is_refused_naming_it() {
        for (text, field) in [
            (r#"{"scope": {"global": true}, "ttl_seconds": 100, "ttl_seconds": 200}"#, "ttl_seconds"),
            (r#"{"scope": {"global": true, "global": false}}"#, "scope.global"),
            (
                r#"{"scope": {"global": true}, "routes": [{"prefix": "/a"}, {"prefix": "/b", "prefix": "/c"}]}"#,
                "routes[1].prefix",
            ),
        ] {
            let e = refused(text);
            assert_eq!(e.field, field, "{text}: {e}");
            assert!(e.reason.starts_with("duplicate field"), "{e}");
        }
    }

    #[test]
    fn null_is_a_wrong_type_except_where_it_means_absent_or_removes_a_derivation() {
        assert_eq!(refused(r#"{"scope": {"global": true}, "header": null}"#).field, "header");
        assert_eq!(refused(r#"{"scope": {"global": true}, "hold_headers": null}"#).field, "hold_headers");
        let c = parse(r#"{"scope": {"global": true}, "store": null, "local": null, "routes": null}"#).unwrap();
        assert_eq!((c.store, c.routes.len()), (None, 0));
        let c = parse(r#"{"scope": {"headers": ["a"]}, "derive_key": {"headers": ["x-step"]}, "routes": [{"prefix": "/a", "derive_key": null}, {"prefix": "/b"}]}"#).unwrap();
        assert_eq!((c.routes[0].policy.derive_key.is_none(), c.routes[1].policy.derive_key.is_some()), (true, true));
        assert_eq!(
            refused(r#"{"scope": {"global": true}, "routes": [{"prefix": "/a", "store": null}]}"#).field,
            "routes[0].store"
        );
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;

        const POLICY_FIELDS: &[&str] = &[
            "header",
            "methods",
            "require_key",
            "namespace",
            "key_max_length",
            "key_syntax",
            "ttl_seconds",
            "lock_ttl_seconds",
            "unknown_outcome_seconds",
            "tombstone_seconds",
            "max_request_body_bytes",
            "max_response_body_bytes",
            "fingerprint",
            "scope",
            "release_on_status",
            "mismatch_status",
            "log_headers",
            "credential_headers",
            "replay_exclude_headers",
            "stale_lock",
            "forwarding",
            "upstream",
            "in_flight",
            "wait_ms",
            "derive_key",
            "grpc",
            "next_hop_failures",
        ];
        const TOP_ONLY_FIELDS: &[&str] = &["store", "routes", "local", "max_buffered_bytes", "hold_headers"];

        proptest! {
            #[test]
            fn parse_never_panics_on_any_bytes(raw in proptest::collection::vec(any::<u8>(), 0..200)) {
                let _ = Config::parse(&raw);
            }

            #[test]
            fn parse_never_panics_on_json_with_known_names(
                fields in proptest::collection::vec((proptest::sample::select(POLICY_FIELDS.iter().chain(TOP_ONLY_FIELDS).copied().collect::<Vec<_>>()),
                                                      prop_oneof![Just("1".to_string()), Just("\"x\"".to_string()), Just("[]".to_string()), Just("{}".to_string()), Just("null".to_string()), Just("true".to_string()), Just("[429]".to_string())]), 0..6)
            ) {
                let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\": {v}")).collect();
                let _ = Config::parse(format!("{{{}}}", body.join(",")).as_bytes());
            }
        }
    }

    #[test]
    fn a_logged_header_is_never_a_credential_a_scope_header_or_the_key() {
        // Built in: the usual credential headers, in any case.
        for h in ["authorization", "Proxy-Authorization", "cookie", "set-cookie", "x-api-key"] {
            let e =
                refused(&format!(r#"{{"scope": {{"headers": ["x-account-id"]}}, "log_headers": ["x-run", "{h}"]}}"#));
            assert_eq!(e.field, "log_headers[1]", "{h}");
            assert!(e.reason.contains("credential"), "{e}");
        }
        // The policy's scope headers, whatever they are called.
        let e = refused(r#"{"scope": {"headers": ["x-account-id", "x-tenant"]}, "log_headers": ["x-tenant"]}"#);
        assert_eq!(e.field, "log_headers[0]");
        assert!(e.reason.contains("scope header"), "{e}");
        // The key header (records hold no raw key).
        let e = refused(r#"{"scope": {"headers": ["x-account-id"]}, "log_headers": ["idempotency-key"]}"#);
        assert_eq!(e.field, "log_headers[0]");
        // A credential the operator names (credential_headers), per route too.
        let e = refused(
            r#"{"scope": {"headers": ["x-account-id"]}, "credential_headers": ["x-shop-secret"], "log_headers": ["x-shop-secret"]}"#,
        );
        assert_eq!(e.field, "log_headers[0]");
        let e = refused(
            r#"{"scope": {"headers": ["x-account-id"]}, "credential_headers": ["x-shop-secret"],
                "routes": [{"prefix": "/a"}, {"prefix": "/b", "log_headers": ["x-shop-secret"]}]}"#,
        );
        assert_eq!(e.field, "routes[1].log_headers[0]");
        // A route's own credential_headers add to the inherited ones (before: they replaced them,
        // and the top level's x-shop-secret was logged on that route).
        let e = refused(
            r#"{"scope": {"headers": ["x-account-id"]}, "credential_headers": ["x-shop-secret"],
                "routes": [{"prefix": "/b", "credential_headers": ["x-other"], "log_headers": ["x-shop-secret"]}]}"#,
        );
        assert_eq!(e.field, "routes[0].log_headers[0]");
        let e = refused(
            r#"{"scope": {"headers": ["x-account-id"]}, "credential_headers": ["x-shop-secret"],
                "routes": [{"prefix": "/b", "credential_headers": ["x-other"], "log_headers": ["x-other"]}]}"#,
        );
        assert_eq!(e.field, "routes[0].log_headers[0]");
        let e = refused(
            r#"{"scope": {"headers": ["x-account-id"]}, "routes": [{"prefix": "/b", "scope": {"headers": ["x-user"]}, "log_headers": ["x-user"]}]}"#,
        );
        assert_eq!(e.field, "routes[0].log_headers[0]");
        assert_eq!(
            refused(r#"{"scope": {"headers": ["x-a"]}, "credential_headers": ["bad header"]}"#).field,
            "credential_headers[0]"
        );
        // What names a run is still logged.
        let c = parse(
            r#"{"scope": {"headers": ["authorization"]}, "credential_headers": ["x-shop-secret"], "log_headers": ["x-agent-run-id"]}"#,
        )
        .unwrap();
        assert_eq!(c.default_policy.log_headers, vec!["x-agent-run-id"]);
        assert_eq!(c.default_policy.credential_headers, vec!["x-shop-secret"]);
    }

    /// Issue 40: `mcp.input_required` awaits by default (0.3.0; "keep" before), and takes
    /// "await", "keep" and "release"; anything else is refused, naming the field.
    #[test]
    fn mcp_input_required_awaits_by_default() {
        let route = |m: &str| {
            format!(
                r#"{{"scope": {{"headers": ["authorization"]}}, "routes": [{{"prefix": "/mcp", "protocol": "mcp", "mcp": {{"tools": ["t"]{m}}}}}]}}"#
            )
        };
        let of = |m: &str| parse(&route(m)).unwrap().routes[0].policy.mcp.as_ref().map(|p| p.input_required);
        assert_eq!(of(""), Some(InputRequired::Await));
        assert_eq!(of(r#", "input_required": "await""#), Some(InputRequired::Await));
        assert_eq!(of(r#", "input_required": "keep""#), Some(InputRequired::Keep));
        assert_eq!(of(r#", "input_required": "release""#), Some(InputRequired::Release));
        let e = refused(&route(r#", "input_required": "wait""#));
        assert!(e.field.ends_with("input_required"), "{}", e.field);
    }

    #[test]
    fn next_hop_failures_are_stored_by_default_classified_per_route_and_only_with_router_forwarding() {
        let c = parse(
            r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/hop", "next_hop_failures": "classify"}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        assert_eq!(c.routes[0].policy.next_hop_failures, NextHopFailures::Classify);
        assert_eq!(c.routes[1].policy.next_hop_failures, NextHopFailures::Store);
        assert_eq!(parse(MINIMAL).unwrap().default_policy.next_hop_failures, NextHopFailures::Store);
        let e = refused(r#"{"scope": {"headers": ["authorization"]}, "next_hop_failures": "release"}"#);
        assert_eq!(e.field, "next_hop_failures");
        let e = refused(
            r#"{"scope": {"headers": ["authorization"]}, "next_hop_failures": "classify", "forwarding": "detached", "upstream": {"cluster": "api", "timeout_ms": 1000}}"#,
        );
        assert_eq!(e.field, "next_hop_failures");
    }

    #[test]
    fn grpc_is_refused_by_default_passed_per_route_and_never_with_require_key() {
        let c = parse(
            r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/pay.Payments", "grpc": "pass"}, {"prefix": "/"}]}"#,
        )
        .unwrap();
        assert_eq!(c.routes[0].policy.grpc, GrpcMode::Pass);
        assert_eq!(c.routes[1].policy.grpc, GrpcMode::Refuse);
        assert_eq!(parse(MINIMAL).unwrap().default_policy.grpc, GrpcMode::Refuse);
        let e = refused(r#"{"scope": {"headers": ["authorization"]}, "grpc": "replay"}"#);
        assert_eq!(e.field, "grpc");
        assert!(e.reason.contains("\"refuse\", \"pass\""), "{e}");
        let e = refused(
            r#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/g", "grpc": "pass", "require_key": true}]}"#,
        );
        assert_eq!(e.field, "routes[0].grpc");
        assert!(e.reason.contains("require_key"), "{e}");
    }

    #[test]
    fn readings_that_select_routes_storing_keys_apart_are_ambiguous_and_alike_ones_are_not() {
        let apart = Config::parse(
            br#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments", "namespace": "pay"}, {"prefix": "/", "namespace": "rest"}]}"#,
        )
        .unwrap();
        for path in ["/v1/payments/../orders", "/v1/payments/..%2Forders", "/v1%2Fpayments", "/v1;x/payments"] {
            assert_eq!(apart.select_route("POST", path, None), Selection::Ambiguous { first: 0, other: 1 }, "{path}");
            assert_eq!(apart.policy_index_for("POST", path), None, "{path}");
        }
        assert_eq!(apart.select_route("POST", "/v1/payments/p1", None), Selection::Policy(0));
        assert_eq!(apart.select_route("POST", "/v1/orders", None), Selection::Policy(1));
        assert_eq!(apart.select_route("GET", "/v1/payments/../orders", None), Selection::Unprotected);
        let alike = Config::parse(br#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/v1/payments", "ttl_seconds": 3600}, {"prefix": "/"}]}"#)
            .unwrap();
        assert_eq!(alike.select_route("POST", "/v1%2Fpayments", None), Selection::Policy(0));
        assert_eq!(alike.select_route("POST", "/v1/payments/../orders", None), Selection::Policy(0));
        // Another scope, key header or key rule keeps keys apart too.
        for other in [
            r#"{"prefix": "/", "scope": {"headers": ["x-tenant"]}}"#,
            r#"{"prefix": "/", "header": "x-idempotency-key"}"#,
            r#"{"prefix": "/", "key_syntax": "any"}"#,
            // An MCP route reads its key from the body, a plain one does not (adversarial review).
            r#"{"prefix": "/", "protocol": "mcp"}"#,
            r#"{"prefix": "/", "protocol": "mcp", "mcp": {"tools": ["charge"]}}"#,
        ] {
            let c = Config::parse(format!(r#"{{"scope": {{"headers": ["authorization"]}}, "routes": [{{"prefix": "/v1/payments"}}, {other}]}}"#).as_bytes()).unwrap();
            assert!(matches!(c.select_route("POST", "/v1%2Fpayments", None), Selection::Ambiguous { .. }), "{other}");
        }
    }

    #[test]
    fn an_mcp_route_releases_the_transports_pre_dispatch_statuses_unless_told_otherwise() {
        let c = Config::parse(br#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/mcp", "protocol": "mcp"}, {"prefix": "/pay"}]}"#).unwrap();
        assert_eq!(c.policy_for("POST", "/mcp").unwrap().release_on_status, MCP_RELEASE_ON_STATUS.to_vec());
        assert_eq!(c.policy_for("POST", "/pay").unwrap().release_on_status, vec![429]);
        let c = Config::parse(br#"{"scope": {"headers": ["authorization"]}, "routes": [{"prefix": "/mcp", "protocol": "mcp", "release_on_status": [429]}]}"#).unwrap();
        assert_eq!(c.policy_for("POST", "/mcp").unwrap().release_on_status, vec![429]);
        let c = Config::parse(br#"{"scope": {"headers": ["authorization"]}, "release_on_status": [503], "routes": [{"prefix": "/mcp", "protocol": "mcp"}]}"#).unwrap();
        assert_eq!(c.policy_for("POST", "/mcp").unwrap().release_on_status, vec![503]);
    }
}
