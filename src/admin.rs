//! What an operator does to a key, as plain rules (the `idemgate` command line is the driver):
//! compute a request's storage key, read a stored value as a report, read the short header of a
//! value while listing, and settle a key (release, complete, forget) as an owner- and
//! phase-checked `store::Transition` planned from the value just read.
//!
//! Settling follows the filter's own lifecycle, so it never makes a key execute twice by itself:
//! - **release** (the next retry executes) only from outcome-unknown (the operator checked
//!   upstream that it did not run) or from a claim whose lock has expired;
//! - **complete** (retries replay what the operator found upstream) from the same states;
//! - **forget** (delete) from anything but a claim whose lock is live.
//!
//! A claim whose lock is live belongs to a request that may still be running: every action on
//! it is refused with the reason. The transition names the owner and phase read, and the store's
//! script re-checks both (and, for a claim, that its lock expired by Redis's clock), so a value
//! that changed between the read and the write is left alone.

use std::fmt;

use serde_json::{json, Map, Value};

use crate::config::{Anonymous, ScopeConfig};
use crate::key::parse_key;
use crate::lifecycle::{self, Event, Facts, Refusal as LifecycleRefusal, Settlement};
use crate::problem::ProblemKind;
use crate::record::{Lifetimes, Record, Stage, State, StoredResponse, NOT_REPLAYED};
use crate::request::RequestHead;
use crate::scope::{CallerScope, StorageKey};
use crate::store::{
    encode_arg, phase_letters, stage_letter, stage_of_letter, StoredValue, Transition, WhereAbsent, KEY_PREFIX,
};

/// Whether the store, not a proxy's local tier, settles a key the local tier refuses with
/// `problem`: an outcome-unknown key is settled by an operator in the store (`resolve`), so
/// with a store the filter asks the store again instead of answering from its local copy.
pub fn store_settles(problem: &ProblemKind) -> bool {
    matches!(problem, ProblemKind::OutcomeUnknown)
}

/// Length of a stored value's header (`IGS1`, phase, owner hex, lock expiry): what `list` reads.
pub const VALUE_HEADER_LEN: usize = 52;

/// Reads a storage key as an operator has it: 64 hex digits (any case), or the Redis key
/// (`idemgate:v1:<hex>`) as `list` prints it or a log line shows it.
pub fn parse_storage_key(text: &str) -> Result<StorageKey, String> {
    let t = text.trim();
    let hex = t.strip_prefix(KEY_PREFIX).unwrap_or(t);
    let Some(bytes) = crate::hex::decode::<32>(hex.as_bytes()) else {
        return Err(format!(
            "{t:?} is not a storage key: expected 64 hex digits (the full key a log line or `idemgate key` prints)"
        ));
    };
    Ok(StorageKey(bytes))
}

/// What a request carried that decides its storage key.
#[derive(Clone, Debug, Default)]
pub struct KeyRequest {
    pub namespace: String,
    /// The configured scope headers, in configured order (lowercase).
    pub scope_names: Vec<String>,
    /// Header lines the request carried, `(name, value)`, in order (several lines of one name
    /// are several values, as the filter reads them).
    pub lines: Vec<(String, String)>,
    /// The request's `:authority`; `None` when the policy has `include_authority: false`.
    pub authority: Option<String>,
    /// The request's `:scheme` (`http` or `https`; empty when unknown). The scope no longer reads
    /// it (`scope::normal_authority` drops ports 80 and 443 whatever the scheme).
    pub scheme: String,
    /// `scope.global`: every caller shares one scope.
    pub global: bool,
    /// `scope.anonymous: "shared"`.
    pub anonymous_shared: bool,
    /// The key header's value as sent (bare or quoted).
    pub key: String,
    pub key_max_length: usize,
    /// The policy's `key_syntax`.
    pub key_syntax: crate::key::KeySyntax,
}

/// A computed storage key and whether the filter would accept the request's caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputedKey {
    pub storage_key: StorageKey,
    pub scope: CallerScope,
    /// `None` when the caller may use a key; otherwise why the filter refuses it (no record).
    pub refused: Option<String>,
}

/// The storage key of a request, computed exactly as the filter does (`CallerScope::of`,
/// `StorageKey::derive`, the key parsed as the header is).
pub fn storage_key_for(req: &KeyRequest) -> Result<ComputedKey, String> {
    let key = parse_key(req.key.as_bytes(), req.key_max_length, req.key_syntax).map_err(|e| format!("key: {e}"))?;
    let mut pairs: Vec<(String, Vec<u8>)> = vec![];
    if let Some(a) = &req.authority {
        pairs.push((":authority".into(), a.as_bytes().to_vec()));
        pairs.push((":scheme".into(), req.scheme.as_bytes().to_vec()));
    }
    for (n, v) in &req.lines {
        pairs.push((n.trim().to_ascii_lowercase(), v.trim_matches([' ', '\t']).as_bytes().to_vec()));
    }
    let cfg = ScopeConfig {
        headers: req.scope_names.iter().map(|n| n.to_ascii_lowercase()).collect(),
        global: req.global,
        include_authority: req.authority.is_some(),
        anonymous: if req.anonymous_shared { Anonymous::Shared } else { Anonymous::Reject },
    };
    let scope = CallerScope::of(&RequestHead::from_pairs(pairs), &cfg);
    let refused = scope.admits(&cfg).err().map(|p| match p {
        ProblemKind::ScopeMissing { headers } => {
            format!("the filter refuses this caller (scope-missing: none of {headers:?} carried a value)")
        }
        other => format!("the filter refuses this caller ({})", other.slug()),
    });
    Ok(ComputedKey { storage_key: StorageKey::derive(&req.namespace, &scope, &key), scope, refused })
}

/// A key's stage as operators name it (`inspect`'s `state`, `list --state`): in-flight (a
/// claim, forwarded or not), completed, outcome-unknown, absent.
pub fn state_name(stage: Stage) -> &'static str {
    match stage {
        Stage::Claimed | Stage::Forwarded => "in-flight",
        Stage::Completed => "completed",
        Stage::Unknown => "outcome-unknown",
        Stage::Absent => "absent",
    }
}

/// The stage `list --state` names: the store holds a claim as `Forwarded` only.
pub fn parse_state(s: &str) -> Result<Stage, String> {
    match s {
        "in-flight" => Ok(Stage::Forwarded),
        "completed" => Ok(Stage::Completed),
        "outcome-unknown" => Ok(Stage::Unknown),
        _ => Err(format!("{s:?}: expected in-flight, completed or outcome-unknown")),
    }
}

/// The header of a stored value, read without its record (`GETRANGE key 0 51`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Header {
    Value {
        /// `Forwarded`, `Completed` or `Unknown`: the stages the store holds.
        state: Stage,
        owner: String,
        lock_expires_at_ms: u64,
    },
    /// A release tombstone (the key is free), or a key's tombstone (`store::TOMBSTONE_MAGIC`,
    /// under its own Redis key: no record).
    Tombstone,
    /// Not a header this build knows.
    Unreadable,
}

/// Parses the first `VALUE_HEADER_LEN` bytes of a stored value.
pub fn parse_header(bytes: &[u8]) -> Header {
    if bytes.starts_with(b"IGS1R") || bytes.starts_with(crate::store::TOMBSTONE_MAGIC) {
        return Header::Tombstone;
    }
    if bytes.len() < VALUE_HEADER_LEN || !bytes.starts_with(b"IGS1") {
        return Header::Unreadable;
    }
    let Some(state) = bytes.get(4).and_then(|l| stage_of_letter(*l)) else {
        return Header::Unreadable;
    };
    let owner = String::from_utf8_lossy(bytes.get(5..37).unwrap_or_default()).into_owned();
    let lock = std::str::from_utf8(bytes.get(37..52).unwrap_or_default()).ok().and_then(|s| s.parse::<u64>().ok());
    match lock {
        Some(lock_expires_at_ms) => Header::Value { state, owner, lock_expires_at_ms },
        None => Header::Unreadable,
    }
}

/// webdis command bodies (`POST /`) the operator tool sends besides the filter's own.
pub mod command {
    use super::*;

    /// `TIME`: Redis's clock, which every lock is judged by (in a script: the shipped webdis ACL
    /// lets only EVAL, GET and PING through), answered with `nonce` after it (`{seconds,
    /// microseconds, nonce}`): webdis 0.1.9 can hand a new connection the late answer of another
    /// client's command (docs/stores.md), so the CLI takes only an answer echoing its own nonce.
    pub fn time(nonce: &str) -> String {
        format!(
            "EVAL/{}/0/{}.raw",
            encode_arg(b"local t=redis.call('TIME') return {t[1],t[2],ARGV[1]}"),
            encode_arg(nonce.as_bytes())
        )
    }

    /// One step of a scan: `SCAN cursor MATCH idemgate:v1:* COUNT count` (never blocks Redis),
    /// then `GETRANGE key 0 51` of each key found (a value's header, never its possibly large
    /// record), in one script whose answer is flat (`{nonce, cursor, key, header, key, header,
    /// ...}`): webdis 0.1.9's raw output garbles nested arrays. `nonce` as in `time`.
    pub fn scan(cursor: &str, count: u32, nonce: &str) -> String {
        const SCRIPT: &str = "local r=redis.call('SCAN',ARGV[1],'MATCH',ARGV[2],'COUNT',ARGV[3]) \
local out={ARGV[4],r[1]} \
for _,k in ipairs(r[2]) do out[#out+1]=k out[#out+1]=redis.call('GETRANGE',k,0,51) end \
return out";
        format!(
            "EVAL/{}/0/{}/{}/{count}/{}.raw",
            encode_arg(SCRIPT.as_bytes()),
            encode_arg(cursor.as_bytes()),
            encode_arg(format!("{KEY_PREFIX}*").as_bytes()),
            encode_arg(nonce.as_bytes())
        )
    }

    /// The deletion of a value this build cannot read (`forget` of an unreadable record): `DEL key`
    /// only if the value's SHA-1 is still `sha1_hex`, the value the operator read (anything written
    /// since is left alone), answered `{"1"|"0", nonce}` (deleted or not; `nonce` as in `time`).
    pub fn forget_raw(redis_key: &str, sha1_hex: &str, nonce: &str) -> String {
        const SCRIPT: &str = "local v=redis.call('GET',KEYS[1]) \
if v and redis.sha1hex(v)==ARGV[1] then redis.call('DEL',KEYS[1]) return {'1',ARGV[2]} end \
return {'0',ARGV[2]}";
        format!(
            "EVAL/{}/1/{}/{}/{}.raw",
            encode_arg(SCRIPT.as_bytes()),
            encode_arg(redis_key.as_bytes()),
            encode_arg(sha1_hex.as_bytes()),
            encode_arg(nonce.as_bytes())
        )
    }

    /// `PTTL key` (in a script, as `time`).
    pub fn pttl(redis_key: &str) -> String {
        format!("EVAL/{}/1/{}.raw", encode_arg(b"return redis.call('PTTL',KEYS[1])"), encode_arg(redis_key.as_bytes()))
    }
}

/// Redis's `TIME` answer (`[seconds, microseconds]`) in ms.
pub fn time_ms(items: &[Vec<u8>]) -> Option<u64> {
    let n = |i: usize| items.get(i).and_then(|b| std::str::from_utf8(b).ok()).and_then(|s| s.parse::<u64>().ok());
    Some(n(0)?.saturating_mul(1000).saturating_add(n(1)? / 1000))
}

/// Header values as text (bytes that are not UTF-8 are replaced).
fn text(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

/// The report `inspect` prints: every field an operator needs to act, nothing secret (a record
/// holds no raw key and no credential).
pub fn report(skey: &StorageKey, value: &StoredValue, now_ms: u64) -> Value {
    let r = &value.record;
    let state = value.phase;
    let mut m = Map::new();
    m.insert("storage_key".into(), json!(skey.hex()));
    m.insert("state".into(), json!(state_name(state)));
    m.insert("now_ms".into(), json!(now_ms));
    m.insert("created_at_ms".into(), json!(r.created_at_ms));
    m.insert("expires_at_ms".into(), json!(r.expires_at_ms));
    m.insert("owner".into(), json!(value.owner.hex()));
    m.insert("fingerprint".into(), json!(crate::hex::encode(&r.fingerprint.0)));
    let mut creator = Map::new();
    creator.insert("request_id".into(), json!(r.creator.request_id));
    let logged: Map<String, Value> = r.creator.log_values.iter().map(|(n, v)| (n.clone(), json!(v))).collect();
    creator.insert("logged_headers".into(), Value::Object(logged));
    m.insert("creator".into(), Value::Object(creator));
    if state == Stage::Completed {
        // Past its own expiry the store still holds it as its key's tombstone (`tombstone_seconds`):
        // never replayed, answered `key-expired`.
        m.insert("tombstone".into(), json!(r.is_tombstone(now_ms)));
    }
    if state == Stage::Forwarded {
        let live = value.lock_expires_at_ms > now_ms;
        m.insert("lock_expires_at_ms".into(), json!(value.lock_expires_at_ms));
        m.insert("lock".into(), json!(if live { "live" } else { "expired" }));
    }
    match &r.state {
        State::Completed(resp) => {
            m.insert("status".into(), json!(resp.status));
            let h: Vec<Value> = resp.headers.iter().map(|(n, v)| json!([n, text(v)])).collect();
            m.insert("response_headers".into(), Value::Array(h));
            m.insert("body_bytes".into(), json!(resp.body.len()));
        }
        State::CompletedTooLarge { status, location } => {
            m.insert("status".into(), json!(status));
            m.insert("body_kept".into(), json!(false));
            if let Some(l) = location {
                m.insert("location".into(), json!(text(l)));
            }
        }
        State::OutcomeUnknown { reason } => {
            m.insert("reason".into(), json!(reason.as_str()));
        }
        State::AwaitingInput(a) => {
            let response = a.response();
            m.insert("awaiting_input".into(), json!(true));
            m.insert("status".into(), json!(response.status));
            m.insert("body_bytes".into(), json!(response.body.len()));
        }
        State::Claimed { .. } | State::Forwarded { .. } => {}
    }
    Value::Object(m)
}

/// What an operator asks of a key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Free the key: the next retry executes.
    Release,
    /// Store this response: retries replay it. Kept `ttl_ms` from now.
    Complete { response: StoredResponse, ttl_ms: u64 },
    /// Delete the record.
    Forget,
}

/// What `forget` reports once the store's record is deleted: what it reached and what it did not
/// (a proxy's local tier keeps its copy, which no operator's call reaches; docs/operating.md,
/// "What `forget` does not reach").
pub const FORGOTTEN: &str = "forgotten in the store: a proxy that holds no copy of the key executes its next retry. \
A proxy whose local tier keeps a copy still answers from it: a completed copy is replayed until it expires \
(ttl_seconds), is evicted or that Envoy restarts; an outcome-unknown copy answers 409 until \
unknown_outcome_seconds. Only restarting an Envoy empties its local tier";

/// Why an action is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A claim whose lock is live: its request may still be running.
    InFlight { lock_expires_in_ms: u64 },
    /// A claim whose lock expired less than the proxies' write window ago: the proxy that
    /// forwarded it may still be retrying its completion (a store link down, say), which would
    /// land after the operator's action and leave two answers for one key.
    WritesMayLand { lock_expired_ms_ago: u64, wait_ms: u64 },
    /// Release or complete asked of a completed record.
    Completed,
    /// `forget` of a value this build cannot read whose phase or lock cannot be read either
    /// (`Unsealed`): it may be another build's live claim. `--force` takes the operator's word.
    Unjudged { what: &'static str },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::InFlight { lock_expires_in_ms } => write!(
                f,
                "refused: the key is in flight and its lock is live for {lock_expires_in_ms} ms more: its request may \
                 still be running. Wait for it to finish (or for its lock to expire, which makes it outcome-unknown), \
                 then inspect it again"
            ),
            Refusal::WritesMayLand { lock_expired_ms_ago, wait_ms } => write!(
                f,
                "refused: the key's lock expired only {lock_expired_ms_ago} ms ago, and the proxy that forwarded it may \
                 still be retrying its completion for {wait_ms} ms more (every write is retried, then its \
                 outcome-unknown fallback, each attempt up to store.timeout_ms: see --store-timeout-ms). Settling it \
                 now could leave one answer on that proxy and another everywhere else; inspect it again then"
            ),
            Refusal::Completed => write!(
                f,
                "refused: the key is completed and retries already replay its response; `idemgate forget` deletes it \
                 from the store if it must go (its next retry then executes again on a proxy that holds no copy \
                 of it; a proxy's local copy keeps replaying until it expires)"
            ),
            Refusal::Unjudged { what } => write!(
                f,
                "refused: the key holds a value this build cannot read, and {what}: it may be the live claim of \
                 a proxy of another build (or sealed with another record key), whose request may still be \
                 running, and deleting it would let a retry execute meanwhile. Check that no request with this \
                 key is running, then run forget again with --force"
            ),
        }
    }
}

/// Plans an operator's action on the value just read (`now_ms` by the store's clock) as one
/// owner- and phase-checked transition, or refuses it. `write_window_ms` is how long after a
/// claim's lock expired its proxy may still land a write (`store::write_window_ms` of the
/// proxies' `store.timeout_ms`): a claim is settled only once that has passed too, so no
/// completion still being retried can land after the operator's action.
pub fn plan(action: &Settle, value: &StoredValue, now_ms: u64, write_window_ms: u64) -> Result<Transition, Refusal> {
    let owner = value.owner;
    let settlement = match action {
        Settle::Release => Settlement::Release,
        Settle::Complete { .. } => Settlement::Complete,
        Settle::Forget => Settlement::Forget,
    };
    let event = Event::Operator(settlement);
    judge(value.phase, value.lock_expires_at_ms, settlement, now_ms, write_window_ms)?;
    let claim = matches!(value.phase, Stage::Claimed | Stage::Forwarded);
    // The letter the value was read with.
    let phases = phase_letters(|p| stage_letter(p) == stage_letter(value.phase));
    // The script re-checks a claim's lock by Redis's clock, so one that was renewed meanwhile stays.
    // A key that vanished since it was read is refused, never written anew.
    let checked = |t: Transition| Transition {
        expected_phases: phases,
        require_stale: claim,
        event: Some(event),
        where_absent: WhereAbsent::Refuse,
        ..t
    };
    match action {
        Settle::Release => Ok(checked(Transition::release(owner))),
        // The key's tombstone goes with its record (Redis; etcd's is the record itself).
        Settle::Forget => Ok(checked(Transition { forget_tombstone: true, ..Transition::release(owner) })),
        Settle::Complete { response, ttl_ms } => {
            let record = Record {
                fingerprint: value.record.fingerprint,
                created_at_ms: value.record.created_at_ms,
                expires_at_ms: now_ms.saturating_add(*ttl_ms),
                creator: value.record.creator.clone(),
                state: State::Completed(response.clone()),
            };
            // A completion lives `ttl_ms` from now (by Redis's clock: the `PX`).
            let lives = Lifetimes { ttl_ms: *ttl_ms, lock_ms: 0, unknown_ms: 0, tombstone_ms: 0 };
            Ok(checked(Transition::complete(owner, record, &lives)))
        }
    }
}

/// Whether an operator may `settlement` a value in `phase` whose lock expires at
/// `lock_expires_at_ms`, judged at `now_ms` (the store's clock) with the proxies' write window
/// (`plan`'s rule, and `plan_raw_forget`'s for a value read only in part).
fn judge(
    phase: Stage,
    lock_expires_at_ms: u64,
    settlement: Settlement,
    now_ms: u64,
    write_window_ms: u64,
) -> Result<(), Refusal> {
    // The one transition table judges the value as read (the operator never holds the claim);
    // the stores judge it again atomically when they write (Redis's script by its clock, etcd on
    // the fenced value).
    let facts = Facts { owner: false, lock_live: lock_expires_at_ms > now_ms, free: false };
    match lifecycle::next(phase, Event::Operator(settlement), facts) {
        Ok(_) => {}
        Err(LifecycleRefusal::LockLive) => {
            return Err(Refusal::InFlight { lock_expires_in_ms: lock_expires_at_ms.saturating_sub(now_ms) });
        }
        Err(_) if phase == Stage::Completed => return Err(Refusal::Completed),
        // A value read is never absent (`store::stage_of_letter`); were one built so, its
        // transition expects no phase and the store changes nothing.
        Err(_) => {}
    }
    // Beyond the table: the proxy that forwarded a claim may still be retrying its completion
    // for a write window after its lock expired.
    let claim = matches!(phase, Stage::Claimed | Stage::Forwarded);
    if claim && lock_expires_at_ms.saturating_add(write_window_ms) > now_ms {
        let lock_expired_ms_ago = now_ms.saturating_sub(lock_expires_at_ms);
        return Err(Refusal::WritesMayLand { lock_expired_ms_ago, wait_ms: write_window_ms - lock_expired_ms_ago });
    }
    Ok(())
}

/// What can be read of a value this build cannot open (sealed with another record key, by
/// another build, damaged): the plain-text parts beside its sealed record. Redis: the value's
/// header (phase, owner, lock expiry: `parse_header`); etcd: the owner mark (phase and owner; the
/// lock is inside the seal).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unsealed {
    pub phase: Option<Stage>,
    pub owner: Option<String>,
    pub lock_expires_at_ms: Option<u64>,
}

impl Unsealed {
    /// A Redis value's header, if it has one this build knows.
    pub fn of_redis_value(bytes: &[u8]) -> Unsealed {
        match parse_header(bytes) {
            Header::Value { state, owner, lock_expires_at_ms } => {
                Unsealed { phase: Some(state), owner: Some(owner), lock_expires_at_ms: Some(lock_expires_at_ms) }
            }
            Header::Tombstone | Header::Unreadable => Unsealed::default(),
        }
    }

    /// An etcd owner mark (`etcd::owner_mark`: the phase letter and 32 hex digits), if well formed.
    pub fn of_etcd_mark(mark: &[u8]) -> Unsealed {
        let phase = mark.first().and_then(|l| stage_of_letter(*l));
        let owner = mark.get(1..).filter(|o| o.len() == 32 && o.iter().all(u8::is_ascii_hexdigit));
        match (phase, owner) {
            (Some(p), Some(o)) => Unsealed { phase: Some(p), owner: Some(text(o)), lock_expires_at_ms: None },
            _ => Unsealed::default(),
        }
    }
}

/// Whether `forget` may delete a value this build cannot read, of which `seen` could be read,
/// judged at `now_ms` as `plan` judges a readable one: a claim whose lock is live (or whose
/// proxy may still land a write) is refused; a value whose phase, or a claim whose lock, cannot
/// be read is refused unless `force` (the operator checked that no request with the key runs).
pub fn plan_raw_forget(seen: &Unsealed, now_ms: u64, write_window_ms: u64, force: bool) -> Result<(), Refusal> {
    match (seen.phase, seen.lock_expires_at_ms) {
        (Some(phase), Some(lock)) => judge(phase, lock, Settlement::Forget, now_ms, write_window_ms),
        (Some(Stage::Claimed | Stage::Forwarded), None) if !force => {
            Err(Refusal::Unjudged { what: "it is a claim whose lock is sealed with it" })
        }
        (None, _) if !force => Err(Refusal::Unjudged { what: "neither its phase nor its lock can be read" }),
        _ => Ok(()),
    }
}

/// The report `inspect` prints of a value this build cannot read: what it is not (`why`), its
/// size and SHA-1 as stored, and what `seen` could be read of it.
pub fn raw_report(skey: &StorageKey, why: &str, bytes: &[u8], seen: &Unsealed, now_ms: u64) -> Value {
    let mut m = Map::new();
    m.insert("storage_key".into(), json!(skey.hex()));
    m.insert("state".into(), json!("unreadable"));
    m.insert("unreadable".into(), json!(why));
    m.insert("now_ms".into(), json!(now_ms));
    m.insert("raw_bytes".into(), json!(bytes.len()));
    m.insert("raw_sha1".into(), json!(text(&crate::sha1::hex(&crate::sha1::digest(bytes)))));
    let shown: Vec<u8> = bytes.iter().take(16).copied().collect();
    m.insert(
        "raw_prefix".into(),
        json!(shown.iter().map(|b| if b.is_ascii_graphic() { *b as char } else { '.' }).collect::<String>()),
    );
    if let Some(p) = seen.phase {
        m.insert("phase".into(), json!(state_name(p)));
    }
    if let Some(o) = &seen.owner {
        m.insert("owner".into(), json!(o));
    }
    if let Some(lock) =
        seen.lock_expires_at_ms.filter(|_| matches!(seen.phase, Some(Stage::Claimed | Stage::Forwarded)))
    {
        m.insert("lock_expires_at_ms".into(), json!(lock));
        m.insert("lock".into(), json!(if lock > now_ms { "live" } else { "expired" }));
    }
    Value::Object(m)
}

/// A response an operator found upstream, from `--status`, `--header 'name: value'` lines and a
/// body. Header names are lowercased; hop-by-hop headers and `content-length` (which the filter
/// never stores) are refused.
pub fn operator_response(status: u16, header_lines: &[String], body: Vec<u8>) -> Result<StoredResponse, String> {
    if !(200..=599).contains(&status) {
        return Err(format!("status {status}: expected 200 to 599"));
    }
    let mut headers = vec![];
    for line in header_lines {
        let Some((n, v)) = line.split_once(':') else {
            return Err(format!("header {line:?}: expected 'name: value'"));
        };
        let name = n.trim().to_ascii_lowercase();
        if name.is_empty() || !name.bytes().all(crate::key::is_tchar) {
            return Err(format!("header {line:?}: the name is not a token"));
        }
        if NOT_REPLAYED.contains(&name.as_str()) {
            return Err(format!("header {name}: never stored (hop-by-hop or recomputed)"));
        }
        headers.push((name, v.trim().as_bytes().to_vec()));
    }
    Ok(StoredResponse { status, headers, body })
}

#[cfg(test)]
mod tests;
