//! The etcd v3 store (`store.kind: "etcd"`): the same lifecycle as the Redis store
//! (`store.rs`), kept in a linearizable, Raft-replicated key-value store reached through etcd's
//! JSON gateway (`POST /v3/kv/txn`, `/v3/kv/range`, `/v3/lease/grant`) with HTTP callouts.
//! Requests are built and answers parsed here, without host calls.
//!
//! **Keys.** A storage key `S` lives under three etcd keys: `idemgate/v1/<S hex>` holds the value,
//! `idemgate/v1/<S hex>/o` holds its *owner mark* (the phase letter and the owner token's hex, 33
//! bytes), `idemgate/v1/<S hex>/r/<owner hex>` is a release tombstone of one owner, and
//! `idemgate/v1/<S hex>/t` the key's own tombstone (`tombstone_seconds`: the record's fingerprint
//! and its expiry, `key_tombstone_value`, put with a completion and outliving its record). Every
//! write puts the value and its owner mark together, in one transaction.
//!
//! **Values.** `IGE1` followed by the seal (`seal.rs`, bound to the etcd key) of
//! `phase(1) owner(32 hex) lock-expiry-ms(15 digits) expiry-ms(15 digits) record`. Unlike the
//! Redis store, where a script writes the header from Redis's clock, every byte of an etcd value
//! is written by a proxy, so the seal covers the header too: phase, owner and times cannot be
//! changed without the secret.
//!
//! **Claim-or-read, one round trip.** One transaction: if the value was never created
//! (`create_revision == 0`) and the owner has no release tombstone, put the forwarded claim and its
//! owner mark with the current window's lease and read the owner mark back (the answer echoes the
//! owner: a "succeeded" that does not is refused); otherwise range-read the value, whose
//! `mod_revision` is the fencing token (`Fence`) of any transition a non-owner makes on it.
//!
//! **Owner-checked transitions**, built from `store::Transition` (so from `lifecycle::sources`,
//! `needs_stale_lock` and `store_writes_where_absent`, as the Redis scripts are):
//! - by the owner (complete, release, mark unknown): compare the owner mark with the one expected
//!   phase and the owner; where-absent writes (complete, mark unknown) read, on failure, whether
//!   the value exists (key only): absent, the answer is `TransitionReply::Absent` and the caller
//!   sends `where_absent_request`, a second transaction that writes only if the value is still
//!   absent (`create_revision == 0`): answer 2. The record is carried once per transaction, never
//!   twice (a nested where-absent put in the same transaction doubled its size, and etcd refuses a
//!   request over `--max-request-bytes`, 1.5 MiB by default, counted on the decoded request, not
//!   the base64 JSON: measured on etcd 3.4.23, a 1.2 MB value in 1.6 MB of JSON lands, a 1.6 MB
//!   value is answered 400 `etcdserver: request is too large`, and one over the gRPC limit
//!   (`--max-request-bytes` + 512 KiB) 429 `grpc: received message larger than max`);
//! - by another request (stale-to-unknown, take-over, claim of a free value): compare the value's
//!   `mod_revision` with the one read (nobody changed it since), after checking, here, the read
//!   owner, phase and (stale) lock by the one clock rule below;
//! - release of a lost claim: deletes the owner's claim if it landed, otherwise puts the owner's
//!   release tombstone, which the claim transaction compares: the late claim is refused.
//!
//! **The clock rule.** etcd has no clock a transaction can read. Expiry of the *keys* is etcd's:
//! every put carries a lease that outlives the record's life (`Leases`). Lock expiry and record
//! expiry are judged by the proxies' clocks: a value carries the times its writer computed on its
//! own clock, and every reader judges them with its clock taken `CLOCK_SKEW_TOLERANCE_MS` behind
//! (`judged_now`). So with proxies' clocks within that tolerance of each other no lock is judged
//! stale, and no record free, before its writer's clock says so. Beyond it, a proxy whose clock
//! runs ahead can judge a lock stale early: with `stale_lock: "reject"` (the default) that is an
//! early outcome-unknown (never a second execution); with `"takeover"` an early take-over.
//!
//! **Leases.** Never granted on the critical path: the root context grants one per window of
//! `LEASE_WINDOW_MS` ahead of need (`Leases::wants_grant`), with a TTL of the window plus the
//! longest record life plus `LEASE_MARGIN_MS`, and every put of that window uses it; a request
//! finding no usable lease is refused (503), never claims without expiry. Where a key's tombstone
//! outlives every record, tombstones get leases of their own (`tombstone_lease_ttl_seconds`), so
//! etcd drops a completed record about `ttl` after its completion, not with its tombstone.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::de::{self, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::base64::unb64;
use crate::config::Config;
use crate::fingerprint::Fingerprint;
use crate::lifecycle::{self, Event, Facts};
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record, Stage, State};
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{
    stage_letter, stage_of_letter, ClaimReply, ReadReply, StoreError, StoreRequest, StoredValue, Transition,
    TransitionReply, ValueError, WhereAbsent,
};

/// Prefix of every etcd key idemgate writes (the namespace is inside the hashed storage key).
pub const KEY_PREFIX: &str = "idemgate/v1/";
/// How far apart the proxies' clocks may be (defined with the configuration, which checks lifetimes
/// against it): every reader judges locks and expiries with its clock taken this far behind
/// (`judged_now`).
pub use crate::config::CLOCK_SKEW_TOLERANCE_MS;
/// One lease serves the puts of one window of this length.
pub const LEASE_WINDOW_MS: u64 = 60_000;
/// A lease outlives the window and the longest record life by this much more: a write built late
/// in its window and retried by the root (at most about 20 s) still lands under a live lease.
pub const LEASE_MARGIN_MS: u64 = 30_000;
/// A failed grant is tried again after this long.
const LEASE_RETRY_MS: u64 = 500;
/// A grant with no answer after this long is sent again (the host answers every callout within
/// `store.timeout_ms`, which may be longer): each answer's lease is timed from its own send.
const LEASE_GRANT_STUCK_MS: u64 = 10_000;

/// The first bytes of every value the etcd store holds (`idemgate --version` names it).
pub const VALUE_MAGIC: &[u8; 4] = b"IGE1";
/// phase (1) + owner hex (32) + lock expiry ms (15 digits) + expiry ms (15 digits).
const HEADER_LEN: usize = 1 + 32 + 15 + 15;
/// What a release tombstone holds (its key names the owner).
const TOMBSTONE: &[u8] = b"R";
/// Elements of any list in an answer: idemgate's transactions answer at most three operations and
/// one key-value. An answer claiming more is refused as it arrives, before it costs memory.
const MAX_LIST: usize = 4;

/// The path of every transaction.
const TXN_PATH: &str = "/v3/kv/txn";

/// The etcd key of a storage key's value, with room for `more` bytes after it.
fn key_with_room(skey: &StorageKey, more: usize) -> String {
    let mut key = String::with_capacity(KEY_PREFIX.len() + 64 + more);
    key.push_str(KEY_PREFIX);
    crate::hex::encode_into(&skey.0, &mut key);
    key
}

/// The etcd key of a storage key's own tombstone (`tombstone_seconds`), `idemgate/v1/<S hex>/t`:
/// the record's fingerprint and the tombstone's expiry (`key_tombstone_value`), written with a
/// completion and outliving its record. Not a release tombstone (`tombstone_key`, `/r/<owner>`).
pub fn key_tombstone_key(skey: &StorageKey) -> String {
    let mut key = key_with_room(skey, 2);
    key.push_str("/t");
    key
}

/// The value of a key's tombstone at its etcd key `key`: the Redis tombstone's layout
/// (`store::tombstone_value_at`: `IGS1T`, the fingerprint sealed for `key`) with, inside the
/// seal, its expiry by its writer's clock in 15 digits (judged by `judged_now`, as a value's):
/// 5 + 36 + 36 + 15 = 92 bytes, whatever the response was.
fn key_tombstone_value_at(key: &str, fingerprint: &Fingerprint, expires_at_ms: u64, seal: &Seal) -> Vec<u8> {
    let mut expiry = Vec::with_capacity(15);
    push_digits15(&mut expiry, expires_at_ms);
    crate::store::tombstone_value_at(key, fingerprint, &expiry, seal)
}

/// `key_tombstone_value_at` at `skey`'s tombstone key.
pub fn key_tombstone_value(skey: &StorageKey, fingerprint: &Fingerprint, expires_at_ms: u64, seal: &Seal) -> Vec<u8> {
    key_tombstone_value_at(&key_tombstone_key(skey), fingerprint, expires_at_ms, seal)
}

/// Decodes `skey`'s tombstone as the value it stands for (`StoredValue::key_tombstone`) and its
/// expiry (its writer's clock); the seal must verify for the tombstone's own key.
pub fn open_key_tombstone(v: &[u8], skey: &StorageKey, seal: &Seal) -> Result<(StoredValue, u64), ValueError> {
    let (fp, expiry) = crate::store::open_tombstone_at(v, &key_tombstone_key(skey), seal)?;
    let expires = digits15(Some(&expiry)).ok_or_else(|| ValueError::Unreadable("stored tombstone: expiry".into()))?;
    Ok((StoredValue::key_tombstone(fp), expires))
}

/// The etcd key of a storage key's value.
pub fn etcd_key(skey: &StorageKey) -> String {
    key_with_room(skey, 0)
}

/// The etcd key of a storage key's owner mark.
pub fn owner_key(skey: &StorageKey) -> String {
    let mut key = key_with_room(skey, 2);
    key.push_str("/o");
    key
}

/// The etcd key of `owner`'s release tombstone for a storage key.
pub fn tombstone_key(skey: &StorageKey, owner: &OwnerToken) -> String {
    let mut key = key_with_room(skey, 3 + 32);
    key.push_str("/r/");
    crate::hex::encode_into(&owner.0, &mut key);
    key
}

/// A reader's clock for judging locks and expiries written by any proxy (the clock rule above).
pub fn judged_now(local_now_ms: u64) -> u64 {
    local_now_ms.saturating_sub(CLOCK_SKEW_TOLERANCE_MS)
}

/// The owner mark: the phase letter and the owner token's hex.
pub fn owner_mark(phase: Stage, owner: &OwnerToken) -> [u8; 33] {
    let mut m = [stage_letter(phase); 33];
    for (slot, digit) in m.iter_mut().skip(1).zip(crate::hex::digits(&owner.0)) {
        *slot = digit;
    }
    m
}

/// `n` (at most 15 digits' worth) in 15 decimal digits.
fn push_digits15(out: &mut Vec<u8>, n: u64) {
    let mut digits = [b'0'; 15];
    let mut n = n.min(999_999_999_999_999);
    for slot in digits.iter_mut().rev() {
        *slot = b'0' + (n % 10) as u8;
        n /= 10;
    }
    out.extend_from_slice(&digits);
}

/// Encodes a value as a proxy writes it at `skey`: `expires_at_ms` and the lock expiry are times
/// of the writer's clock.
pub fn encode_value(v: &StoredValue, expires_at_ms: u64, skey: &StorageKey, seal: &Seal) -> Vec<u8> {
    seal_value(v.phase, &v.owner, v.lock_expires_at_ms, &v.record, expires_at_ms, &etcd_key(skey), seal)
}

/// `encode_value` of its parts, at the etcd key `key`.
fn seal_value(
    phase: Stage,
    owner: &OwnerToken,
    lock_expires_at_ms: u64,
    record: &Record,
    expires_at_ms: u64,
    key: &str,
    seal: &Seal,
) -> Vec<u8> {
    let record = record.encode();
    let mut body = Vec::with_capacity(HEADER_LEN + record.len());
    // The phase and the owner's hex: the owner mark's 33 bytes.
    body.extend_from_slice(&owner_mark(phase, owner));
    push_digits15(&mut body, lock_expires_at_ms);
    push_digits15(&mut body, expires_at_ms);
    body.extend_from_slice(&record);
    let sealed = seal.seal(key, &body);
    let mut out = Vec::with_capacity(VALUE_MAGIC.len() + sealed.len());
    out.extend_from_slice(VALUE_MAGIC);
    out.extend_from_slice(&sealed);
    out
}

fn digits15(b: Option<&[u8]>) -> Option<u64> {
    let b = b?;
    if b.len() != 15 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Decodes the value read at `skey` and its expiry (the writer's clock). The seal must verify
/// for this very key (`ValueError::Unauthentic` otherwise), and a completed phase must carry a
/// completed record.
pub fn open_value(v: &[u8], skey: &StorageKey, seal: &Seal) -> Result<(StoredValue, u64), ValueError> {
    let bad = |why: &str| ValueError::Unreadable(format!("stored value: {why}"));
    let sealed = v.strip_prefix(VALUE_MAGIC).ok_or_else(|| bad("no idemgate etcd header"))?;
    let (body, _) = seal.open(&etcd_key(skey), sealed).map_err(ValueError::Unauthentic)?;
    if body.len() < HEADER_LEN {
        return Err(bad("short header"));
    }
    let phase = body.first().copied().and_then(stage_of_letter).ok_or_else(|| bad("unknown phase"))?;
    let owner = body.get(1..33).and_then(crate::hex::decode::<16>).ok_or_else(|| bad("owner"))?;
    let lock = digits15(body.get(33..48)).ok_or_else(|| bad("lock expiry"))?;
    let expires = digits15(body.get(48..63)).ok_or_else(|| bad("expiry"))?;
    let record = Record::decode(body.get(HEADER_LEN..).unwrap_or_default()).map_err(|e| bad(&e.to_string()))?;
    let completed =
        matches!(record.state, State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_));
    if phase == Stage::Completed && !completed {
        return Err(bad("completed phase without a completed record"));
    }
    Ok((StoredValue { phase, owner: OwnerToken(owner), lock_expires_at_ms: lock, record }, expires))
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Requests.

/// A JSON body, written directly into one buffer sized before it is written: the requests here
/// are fixed shapes of objects, lists and short strings (base64, decimals, names). A
/// `serde_json::Value` tree of the same cost about ten times the allocations, and a tree of
/// small strings joined level by level (each field, object and list its own `String`) about 80 a
/// transaction; written this way a claim costs a handful (counted, `tests/it/bench_builds.rs`).
struct Body(String);

impl Body {
    fn with_capacity(n: usize) -> Body {
        Body(String::with_capacity(n))
    }

    fn raw(&mut self, text: &str) -> &mut Body {
        self.0.push_str(text);
        self
    }

    /// A JSON string: quotes, backslashes and control characters escaped.
    fn str(&mut self, text: &str) -> &mut Body {
        self.0.push('"');
        for c in text.chars() {
            match c {
                '"' => self.0.push_str("\\\""),
                '\\' => self.0.push_str("\\\\"),
                c if u32::from(c) < 0x20 => {
                    let _ = write!(self.0, "\\u{:04x}", u32::from(c));
                }
                c => self.0.push(c),
            }
        }
        self.0.push('"');
        self
    }

    /// A JSON string of `bytes` in base64 (whose alphabet needs no escape).
    fn b64(&mut self, bytes: &[u8]) -> &mut Body {
        self.0.push('"');
        crate::base64::b64_into(bytes, &mut self.0);
        self.0.push('"');
        self
    }

    /// A 64-bit integer as proto3 JSON writes it: a decimal string.
    fn int(&mut self, n: i64) -> &mut Body {
        let _ = write!(self.0, "\"{n}\"");
        self
    }

    fn post(self, path: &'static str) -> StoreRequest {
        StoreRequest { method: "POST", path: path.to_string(), body: self.0.into_bytes(), by_sha1: None }
    }
}

/// The length of `n` bytes in base64, quoted.
fn b64_len(n: usize) -> usize {
    n.div_ceil(3) * 4 + 2
}

/// Room for a decimal 64-bit integer, quoted.
const INT_LEN: usize = 22;

/// One comparison of a transaction (every one `EQUAL`).
enum Compare<'a> {
    /// `key` was never created (or is absent since): its `create_revision` is 0.
    NeverCreated(&'a [u8]),
    /// `key`'s `mod_revision` is the one read (the fencing token of a non-owner's transition).
    ModRevision(&'a [u8], i64),
    /// `key` holds exactly `value`.
    Value(&'a [u8], &'a [u8]),
}

impl Compare<'_> {
    /// At most the length `write` writes.
    fn len(&self) -> usize {
        let fixed = r#"{"key":,"target":"CREATE","result":"EQUAL","create_revision":}"#.len();
        match self {
            Compare::NeverCreated(k) => fixed + b64_len(k.len()) + 3,
            Compare::ModRevision(k, _) => fixed + b64_len(k.len()) + INT_LEN,
            Compare::Value(k, v) => fixed + b64_len(k.len()) + b64_len(v.len()),
        }
    }

    fn write(&self, out: &mut Body) {
        let (key, target) = match self {
            Compare::NeverCreated(k) => (k, "CREATE"),
            Compare::ModRevision(k, _) => (k, "MOD"),
            Compare::Value(k, _) => (k, "VALUE"),
        };
        out.raw(r#"{"key":"#).b64(key).raw(r#","target":""#).raw(target).raw(r#"","result":"EQUAL","#);
        match self {
            Compare::NeverCreated(_) => out.raw(r#""create_revision":"0""#),
            Compare::ModRevision(_, rev) => out.raw(r#""mod_revision":"#).int(*rev),
            Compare::Value(_, v) => out.raw(r#""value":"#).b64(v),
        };
        out.raw("}");
    }
}

/// One operation of a transaction.
enum Op<'a> {
    /// Puts `value` at `key` with `lease`.
    Put(&'a [u8], &'a [u8], i64),
    /// Reads `key` (its value and revisions).
    Range(&'a [u8]),
    /// Reads whether `key` exists: its name only, never its value.
    Exists(&'a [u8]),
    Delete(&'a [u8]),
}

impl Op<'_> {
    /// At most the length `write` writes.
    fn len(&self) -> usize {
        let fixed = r#"{"request_delete_range":{"key":,"keys_only":true}}"#.len();
        match self {
            Op::Put(k, v, _) => fixed + b64_len(k.len()) + b64_len(v.len()) + r#","value":,"lease":"#.len() + INT_LEN,
            Op::Range(k) | Op::Exists(k) | Op::Delete(k) => fixed + b64_len(k.len()),
        }
    }

    fn write(&self, out: &mut Body) {
        match self {
            Op::Put(k, v, lease) => {
                out.raw(r#"{"request_put":{"key":"#).b64(k).raw(r#","value":"#).b64(v).raw(r#","lease":"#).int(*lease)
            }
            Op::Range(k) => out.raw(r#"{"request_range":{"key":"#).b64(k),
            Op::Exists(k) => out.raw(r#"{"request_range":{"key":"#).b64(k).raw(r#","keys_only":true"#),
            Op::Delete(k) => out.raw(r#"{"request_delete_range":{"key":"#).b64(k),
        };
        out.raw("}}");
    }
}

/// A transaction at `TXN_PATH`: if every comparison holds, the `success` operations, otherwise
/// the `failure` ones; written into one buffer of the length all of them need.
fn txn(compare: &[Compare], success: &[Op], failure: &[Op]) -> StoreRequest {
    let len = r#"{"compare":[],"success":[],"failure":[]}"#.len()
        + compare.iter().map(|c| c.len() + 1).sum::<usize>()
        + success.iter().chain(failure).map(|o| o.len() + 1).sum::<usize>();
    let mut out = Body::with_capacity(len);
    out.raw(r#"{"compare":["#);
    for (i, c) in compare.iter().enumerate() {
        if i > 0 {
            out.raw(",");
        }
        c.write(&mut out);
    }
    for (name, ops) in [(r#"],"success":["#, success), (r#"],"failure":["#, failure)] {
        out.raw(name);
        for (i, o) in ops.iter().enumerate() {
            if i > 0 {
                out.raw(",");
            }
            o.write(&mut out);
        }
    }
    out.raw("]}");
    out.post(TXN_PATH)
}

/// The etcd keys of one storage key (`etcd_key`, `owner_key`), each made once per request.
struct Keys {
    value: String,
    owner: String,
    /// The key's own tombstone (`key_tombstone_key`).
    tomb: String,
}

impl Keys {
    fn of(skey: &StorageKey) -> Keys {
        Keys { value: etcd_key(skey), owner: owner_key(skey), tomb: key_tombstone_key(skey) }
    }
}

/// What a write does to the key's own tombstone besides the value and its owner mark.
#[derive(Clone, Copy)]
enum TombWrite<'a> {
    /// Nothing.
    Keep,
    /// A completion on a route with tombstones (`Transition::key_tombstone_of`): puts the
    /// tombstone of this fingerprint, expiring then (the writer's clock), with the lease given.
    Put(&'a Fingerprint, u64, i64),
    /// A claim of a key whose value was absent and whose tombstone was past its expiry (the
    /// fence compared its revision): the old tombstone goes.
    Delete,
}

/// A value a transaction writes (`encode_value` of its parts), its record borrowed.
struct NewValue<'a> {
    phase: Stage,
    owner: OwnerToken,
    lock_expires_at_ms: u64,
    record: &'a Record,
    expires_at_ms: u64,
}

/// The puts that write `value` and its owner mark, then the read of the mark back (the answer
/// echoes who now holds the key), then what `tomb` does to the key's tombstone (in the same
/// transaction: no reader finds the record gone before its tombstone is there), handed to `then`
/// (which writes the transaction carrying them).
fn with_write_ops<R>(
    keys: &Keys,
    seal: &Seal,
    value: &NewValue,
    lease: i64,
    tomb: TombWrite,
    then: impl FnOnce(&[Op]) -> R,
) -> R {
    let v = value;
    let sealed = seal_value(v.phase, &v.owner, v.lock_expires_at_ms, v.record, v.expires_at_ms, &keys.value, seal);
    let mark = owner_mark(v.phase, &v.owner);
    let tomb_value = match tomb {
        TombWrite::Put(fp, expires_at_ms, _) => key_tombstone_value_at(&keys.tomb, fp, expires_at_ms, seal),
        _ => vec![],
    };
    let mut ops = Vec::with_capacity(4);
    ops.push(Op::Put(keys.value.as_bytes(), &sealed, lease));
    ops.push(Op::Put(keys.owner.as_bytes(), &mark, lease));
    ops.push(Op::Range(keys.owner.as_bytes()));
    match tomb {
        TombWrite::Keep => {}
        TombWrite::Put(_, _, tomb_lease) => ops.push(Op::Put(keys.tomb.as_bytes(), &tomb_value, tomb_lease)),
        TombWrite::Delete => ops.push(Op::Delete(keys.tomb.as_bytes())),
    }
    then(&ops)
}

/// Claim-or-read in one transaction: the forwarded claim (`record`, owned by `owner`, its lock
/// and expiry those of a forwarded claim from `now_ms` on this proxy's clock) is put with `lease`
/// if the value was never created and `owner` left no release tombstone (and, on a route that
/// keeps tombstones, the key has no tombstone of its own); otherwise the value is read (and on
/// such a route the key's tombstone with it, in the same transaction).
pub fn claim_request(
    skey: &StorageKey,
    owner: &OwnerToken,
    record: &Record,
    lifetimes: &Lifetimes,
    seal: &Seal,
    lease: i64,
    now_ms: u64,
) -> StoreRequest {
    let value = NewValue {
        phase: Stage::Forwarded,
        owner: *owner,
        lock_expires_at_ms: lifetimes.lock_expires_at(now_ms),
        record,
        expires_at_ms: lifetimes.expires_at(Stage::Forwarded, now_ms),
    };
    let keys = Keys::of(skey);
    let tombstone = tombstone_key(skey, owner);
    // The key's own tombstone counts only on a route that keeps tombstones (as Redis's claim
    // script's flag): elsewhere a key outliving its record is claimed as before.
    let tombs = lifetimes.tombstone_ms > 0;
    let compare = [
        Compare::NeverCreated(keys.value.as_bytes()),
        Compare::NeverCreated(tombstone.as_bytes()),
        Compare::NeverCreated(keys.tomb.as_bytes()),
    ];
    let reads = [Op::Range(keys.value.as_bytes()), Op::Range(keys.tomb.as_bytes())];
    let n = 1 + usize::from(tombs);
    with_write_ops(&keys, seal, &value, lease, TombWrite::Keep, |writes| {
        txn(compare.get(..1 + n).unwrap_or_default(), writes, reads.get(..n).unwrap_or_default())
    })
}

/// A read (no claim): the value of `skey`.
pub fn read_request(skey: &StorageKey) -> StoreRequest {
    let key = etcd_key(skey);
    let mut out = Body::with_capacity(b64_len(key.len()) + 16);
    out.raw(r#"{"key":"#).b64(key.as_bytes()).raw("}");
    out.post("/v3/kv/range")
}

/// What a non-owner's transition was decided on: the value it read and that value's
/// `mod_revision`, the fencing token its transaction compares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    pub mod_revision: i64,
    pub value: StoredValue,
    /// The value's expiry (its writer's clock).
    pub expires_at_ms: u64,
    /// `true`: no value was held, and `value` is the key's own tombstone (`open_key_tombstone`)
    /// found past its expiry, `mod_revision` the tombstone's; a claim decided on it compares that
    /// the value is still absent and the tombstone unchanged, and deletes the tombstone.
    pub tombstone: bool,
}

/// `t` as one etcd transaction at `skey`, writing with `lease` and times from `now_ms` (this
/// proxy's clock). A transition that needs a stale lock (stale-to-unknown, take-over, claim of a
/// free value) needs the `fence` it was decided on, and is refused here (an error: never sent)
/// unless the fenced value carries the expected owner and phase and its lock is stale by
/// `judged_now`. An error is a broken invariant of the caller: it sends nothing and fails closed.
pub fn transition_request(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    lease: i64,
    now_ms: u64,
    fence: Option<&Fence>,
) -> Result<StoreRequest, String> {
    transition_body(t, skey, seal, Leased::one(lease), now_ms, fence, false)
}

/// The leases a write puts under: the record's, and the key's tombstone's (a lease outliving
/// `ttl + tombstone`: `tombstone_lease_ttl_seconds`; the record's where that one covers it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leased {
    pub record: i64,
    pub tombstone: i64,
}

impl Leased {
    /// One lease for both.
    pub fn one(lease: i64) -> Leased {
        Leased { record: lease, tombstone: lease }
    }
}

/// `transition_request` with the key's tombstone under a lease of its own (`leased.tombstone`).
pub fn transition_request_leased(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    leased: Leased,
    now_ms: u64,
    fence: Option<&Fence>,
) -> Result<StoreRequest, String> {
    transition_body(t, skey, seal, leased, now_ms, fence, false)
}

/// An operator's transition (`idemgate resolve`/`forget`, planned by `admin::plan` from the
/// value read with `parse_fenced_read`): `t` as one etcd transaction that lands only if the value
/// is still the one read, whatever the event (the value's `mod_revision` compared, never the
/// owner mark alone), so a record that changed between the operator's read and write (its
/// request, a proxy or another operator acted) is refused. Refused here, never sent, unless the
/// fenced value carries the expected owner and phase and, for a transition needing a stale lock,
/// its lock is stale by `judged_now(now_ms)`. Its puts (a completion) use `lease`, which the
/// operator grants for `operator_lease_ttl_seconds(t.ttl_ms)`; a key found absent is left absent.
pub fn operator_transition_request(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    lease: i64,
    now_ms: u64,
    fence: &Fence,
) -> Result<StoreRequest, String> {
    if t.tombstone || t.where_absent != WhereAbsent::Refuse {
        return Err("an operator's transition never writes where the key is absent".into());
    }
    if t.new_phase.is_some() && lease <= 0 {
        return Err("an operator's write without a lease".into());
    }
    transition_body(t, skey, seal, Leased::one(lease), now_ms, Some(fence), true)
}

/// The TTL of the lease an operator's write carries: the record's life (`ttl_ms`, from the write)
/// plus `LEASE_MARGIN_MS`, which covers the time between the grant and the put and the readers'
/// `CLOCK_SKEW_TOLERANCE_MS`.
pub fn operator_lease_ttl_seconds(ttl_ms: u64) -> u64 {
    ttl_ms.saturating_add(LEASE_MARGIN_MS).div_ceil(1000)
}

fn transition_body(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    leased: Leased,
    now_ms: u64,
    fence: Option<&Fence>,
    always_fenced: bool,
) -> Result<StoreRequest, String> {
    let lease = leased.record;
    let keys = Keys::of(skey);
    let expected_mark;
    let compare = if t.require_stale || always_fenced {
        let Some(f) = fence else {
            return Err("a transition on a stale lock without the value it was decided on".into());
        };
        if f.value.owner != t.expected_owner {
            return Err("the fenced value is not the expected owner's".into());
        }
        let summary = f.value.summary(f.expires_at_ms);
        // An operator's request is judged as an operator's (`operator_transition_request`): its
        // event is `Event::Operator`, whose facts hold no owner.
        let operator = always_fenced || matches!(t.event, Some(Event::Operator(_)));
        match t.event.filter(|e| !always_fenced || matches!(e, Event::Operator(_))) {
            // The decision taken on the fenced value, judged by the one transition table at
            // `judged_now` (as Redis's script and the local tier's CAS judge theirs).
            Some(event) => {
                let facts = Facts::of(&summary, judged_now(now_ms), !operator);
                lifecycle::next(f.value.phase, event, facts)
                    .map_err(|r| format!("the fenced value refuses {event:?}: {r:?}"))?;
            }
            // A transition that names no event (none the filter or the CLI builds): the phase
            // read, and its lock stale when it was a claim.
            None => {
                if !t.expected_phases.as_bytes().contains(&stage_letter(f.value.phase)) {
                    return Err("the fenced value is not in an expected phase".into());
                }
                if t.require_stale && summary.lock_is_live(judged_now(now_ms)) {
                    return Err("the fenced value's lock is live".into());
                }
            }
        }
        match f.tombstone {
            // The key held only its tombstone (past its expiry): the value still absent, the
            // tombstone still the one read.
            true => Compare::ModRevision(keys.tomb.as_bytes(), f.mod_revision),
            false => Compare::ModRevision(keys.value.as_bytes(), f.mod_revision),
        }
    } else {
        // An owner's own transition: the owner mark must be exactly the expected phase and owner.
        let [phase] = t.expected_phases.as_bytes() else {
            return Err(format!("an owner's transition expects one phase, not {:?}", t.expected_phases));
        };
        let phase = stage_of_letter(*phase).ok_or("an unknown expected phase")?;
        expected_mark = owner_mark(phase, &t.expected_owner);
        Compare::Value(keys.owner.as_bytes(), &expected_mark)
    };
    // A new owner's claim (a take-over): refused if that owner already released it, its answer
    // lost (`Transition::release_lost` leaves the tombstone), as a claim transaction is.
    let taker = (t.new_phase.is_some() && t.new_owner != t.expected_owner).then(|| tombstone_key(skey, &t.new_owner));
    let over_tombstone = fence.is_some_and(|f| f.tombstone);
    let mut compares = Vec::with_capacity(3);
    compares.push(compare);
    if over_tombstone {
        compares.push(Compare::NeverCreated(keys.value.as_bytes()));
    }
    if let Some(k) = &taker {
        compares.push(Compare::NeverCreated(k.as_bytes()));
    }
    let new_value = match t.new_phase {
        None => None,
        Some(phase) => {
            let record = match (&t.record, fence) {
                (Some(r), _) => r,
                // Keep the stored record (stale-to-unknown): the fenced value's.
                (None, Some(f)) => &f.value.record,
                (None, None) => return Err("a transition keeping a stored record it never read".into()),
            };
            let lock = t.lock_ms.map_or(0, |l| now_ms.saturating_add(l));
            let expires_at_ms = now_ms.saturating_add(t.record_ttl_ms());
            Some(NewValue { phase, owner: t.new_owner, lock_expires_at_ms: lock, record, expires_at_ms })
        }
    };
    let tomb = match (t.key_tombstone_of(), over_tombstone) {
        (Some(fp), _) => TombWrite::Put(fp, now_ms.saturating_add(t.ttl_ms), leased.tombstone),
        (None, true) => TombWrite::Delete,
        (None, false) => TombWrite::Keep,
    };
    // A release whose claim may land later: leave the owner's tombstone, which the claim
    // transaction compares.
    let own_tombstone = (new_value.is_none() && t.tombstone).then(|| tombstone_key(skey, &t.expected_owner));
    let failure = match (&new_value, &own_tombstone) {
        (None, Some(k)) => Some(Op::Put(k.as_bytes(), TOMBSTONE, lease)),
        // Whether the value exists: absent, the write follows in `where_absent_request` (the
        // record once per transaction).
        (Some(_), _) if writes_where_absent(t) => Some(Op::Exists(keys.value.as_bytes())),
        _ => None,
    };
    let failure = failure.as_slice();
    Ok(match &new_value {
        // An operator's `forget` deletes the key's tombstone with the record; a proxy's own
        // release keeps it (it is the memory of an execution).
        None if t.forget_tombstone && !t.tombstone => txn(
            &compares,
            &[Op::Delete(keys.value.as_bytes()), Op::Delete(keys.owner.as_bytes()), Op::Delete(keys.tomb.as_bytes())],
            failure,
        ),
        None => txn(&compares, &[Op::Delete(keys.value.as_bytes()), Op::Delete(keys.owner.as_bytes())], failure),
        Some(value) => with_write_ops(&keys, seal, value, lease, tomb, |writes| txn(&compares, writes, failure)),
    })
}

/// Whether `t` writes its record where the key is absent (a completion, an outcome-unknown mark).
pub fn writes_where_absent(t: &Transition) -> bool {
    t.new_phase.is_some()
        && t.record.is_some()
        && matches!(t.where_absent, WhereAbsent::Write | WhereAbsent::WriteKeepingStored)
}

/// The second transaction of a where-absent write whose owner-checked transaction was answered
/// `TransitionReply::Absent`: `t`'s new value (and owner mark), put only if the value is still
/// absent (`create_revision == 0`); answered by `parse_where_absent_reply`. An error (never sent)
/// for a transition that does not write where absent.
pub fn where_absent_request(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    lease: i64,
    now_ms: u64,
) -> Result<StoreRequest, String> {
    where_absent_request_leased(t, skey, seal, Leased::one(lease), now_ms)
}

/// `where_absent_request` with the key's tombstone under a lease of its own.
pub fn where_absent_request_leased(
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    leased: Leased,
    now_ms: u64,
) -> Result<StoreRequest, String> {
    let lease = leased.record;
    let (Some(phase), Some(record), true) = (t.new_phase, t.record.as_ref(), writes_where_absent(t)) else {
        return Err("a where-absent write for a transition that never writes where absent".into());
    };
    let lock_expires_at_ms = t.lock_ms.map_or(0, |l| now_ms.saturating_add(l));
    let expires_at_ms = now_ms.saturating_add(t.record_ttl_ms());
    let value = NewValue { phase, owner: t.new_owner, lock_expires_at_ms, record, expires_at_ms };
    let keys = Keys::of(skey);
    // A completion written where its claim was lost writes its key's tombstone too, as Redis's
    // script does.
    let tomb = t
        .key_tombstone_of()
        .map_or(TombWrite::Keep, |fp| TombWrite::Put(fp, now_ms.saturating_add(t.ttl_ms), leased.tombstone));
    Ok(with_write_ops(&keys, seal, &value, lease, tomb, |writes| {
        txn(&[Compare::NeverCreated(keys.value.as_bytes())], writes, &[])
    }))
}

/// The answer to `where_absent_request`: written (`ClaimGoneRewritten`: the store had lost the
/// owner's claim) or refused (the key exists again: another request holds it).
pub fn parse_where_absent_reply(status: Option<u16>, body: &[u8]) -> Result<TransitionReply, StoreError> {
    let a: TxnAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    match (a.succeeded, shape_of(&a.responses)?.as_slice()) {
        (true, _) => writes_echo(&a.responses, &StorageKey([0; 32]), None).map(|_| TransitionReply::ClaimGoneRewritten),
        (false, b"") => Ok(TransitionReply::Refused),
        _ => Err(garbled("etcd where-absent answer shape")),
    }
}

/// Whether etcd refused a request for its size: over `--max-request-bytes` (400, "request is too
/// large") or over its gRPC receive limit (429, "received message larger than max"). Nothing of it
/// was applied.
pub fn refused_as_too_large(status: Option<u16>, body: &[u8]) -> bool {
    let text = error_text(body);
    match status {
        Some(400) => text.contains("request is too large"),
        Some(429) => text.contains("larger than max"),
        Some(413) => true,
        _ => false,
    }
}

/// The lease grant request: `ttl_seconds` (`lease_ttl_seconds`), its id chosen by etcd.
pub fn lease_grant_request(ttl_seconds: u64) -> StoreRequest {
    let mut out = Body::with_capacity(48);
    out.raw(r#"{"TTL":"#).int(i64::try_from(ttl_seconds).unwrap_or(i64::MAX)).raw(r#","ID":"0"}"#);
    out.post("/v3/lease/grant")
}

/// The longest life any record of `config` is given (`Lifetimes::life_ms` of a forwarded claim,
/// a completion and an outcome-unknown mark, over every policy). A completion's record lives
/// `ttl` (`Transition::record_ttl_ms`): its key's tombstone, which outlives it, is a key of its
/// own under a lease of its own (`longest_tombstone_life_ms`).
pub fn longest_life_ms(config: &Config) -> u64 {
    config
        .policies()
        .map(|p| {
            let l = Lifetimes { tombstone_ms: 0, ..Lifetimes::of(p) };
            [Stage::Forwarded, Stage::Completed, Stage::Unknown].iter().map(|s| l.life_ms(*s)).max().unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

/// The longest life of a key's tombstone in `config` (`ttl + tombstone` from its completion,
/// over the policies that keep tombstones; 0: none does).
pub fn longest_tombstone_life_ms(config: &Config) -> u64 {
    config
        .policies()
        .map(Lifetimes::of)
        .filter(|l| l.tombstone_ms > 0)
        .map(|l| l.life_ms(Stage::Completed))
        .max()
        .unwrap_or(0)
}

/// The TTL of each window's lease: the window, the longest record life, and the margin. A put made
/// while its lease is usable (`Leases::usable`) outlives its record's life by etcd's clock.
pub fn lease_ttl_seconds(config: &Config) -> u64 {
    lease_ttl_for(longest_life_ms(config))
}

/// The TTL of each window's lease for keys' tombstones, where one outlives every record (`None`:
/// none does, and tombstones go under the records' lease, `lease_ttl_seconds`): the window, the
/// longest tombstone life, and the margin. So the record of a completed key is dropped by etcd
/// about `ttl` after its completion (not `ttl + tombstone`), and only its small tombstone stays.
pub fn tombstone_lease_ttl_seconds(config: &Config) -> Option<u64> {
    let tombs = longest_tombstone_life_ms(config);
    (tombs > longest_life_ms(config)).then(|| lease_ttl_for(tombs))
}

fn lease_ttl_for(life_ms: u64) -> u64 {
    LEASE_WINDOW_MS.saturating_add(life_ms).saturating_add(LEASE_MARGIN_MS).div_ceil(1000)
}

/// A VM's leases: at most two granted (the current window's and the next), and at most one grant
/// in flight. Times are this proxy's clock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leases {
    granted: Vec<(i64, u64)>,
    grant_sent_at_ms: Option<u64>,
    retry_at_ms: u64,
}

impl Leases {
    /// The lease a put made now uses: granted by a request sent less than a window ago, so it
    /// outlives the longest record life from now (its TTL started when etcd granted it, after the
    /// request was sent). `None`: no usable lease, refuse (never put without one).
    pub fn usable(&self, now_ms: u64) -> Option<i64> {
        self.granted.iter().filter(|(_, until)| now_ms < *until).max_by_key(|(_, until)| *until).map(|(id, _)| *id)
    }

    /// Whether the root should grant a lease now: no grant in flight, and no usable lease with
    /// more than half a window of use left.
    pub fn wants_grant(&self, now_ms: u64) -> bool {
        if let Some(sent) = self.grant_sent_at_ms {
            if now_ms.saturating_sub(sent) < LEASE_GRANT_STUCK_MS {
                return false;
            }
        }
        if now_ms < self.retry_at_ms {
            return false;
        }
        let newest = self.granted.iter().map(|(_, until)| *until).max().unwrap_or(0);
        newest.saturating_sub(now_ms) <= LEASE_WINDOW_MS / 2
    }

    pub fn grant_sent(&mut self, now_ms: u64) {
        self.grant_sent_at_ms = Some(now_ms);
    }

    /// The grant sent at `sent_at_ms` answered lease `id` (now): usable a window from that send,
    /// whichever grant's answer this is. A grant sent again after `LEASE_GRANT_STUCK_MS` can be
    /// answered after a later one: timed from the later send, or from its arrival, its lease would
    /// be used longer than its TTL covers (etcd started it when it granted it, after the send).
    pub fn granted(&mut self, id: i64, sent_at_ms: u64, now_ms: u64) {
        self.answered(sent_at_ms);
        self.granted.retain(|(_, until)| now_ms < *until);
        self.granted.push((id, sent_at_ms.saturating_add(LEASE_WINDOW_MS)));
        if self.granted.len() > 2 {
            // The one usable for the shortest time goes.
            let shortest = self.granted.iter().enumerate().min_by_key(|(_, (_, until))| *until).map(|(i, _)| i);
            if let Some(i) = shortest {
                self.granted.remove(i);
            }
        }
    }

    /// The grant sent at `sent_at_ms` failed (now): tried again after `LEASE_RETRY_MS`, unless a
    /// newer grant is in flight.
    pub fn grant_failed(&mut self, sent_at_ms: u64, now_ms: u64) {
        if self.answered(sent_at_ms) {
            self.retry_at_ms = now_ms.saturating_add(LEASE_RETRY_MS);
        }
    }

    /// A grant could not be sent (now): tried again after `LEASE_RETRY_MS`.
    pub fn grant_not_sent(&mut self, now_ms: u64) {
        self.grant_sent_at_ms = None;
        self.retry_at_ms = now_ms.saturating_add(LEASE_RETRY_MS);
    }

    /// Forgets the grant in flight if it is the one sent at `sent_at_ms`; true if it was.
    fn answered(&mut self, sent_at_ms: u64) -> bool {
        let latest = self.grant_sent_at_ms == Some(sent_at_ms);
        if latest {
            self.grant_sent_at_ms = None;
        }
        latest
    }
}

// ---------------------------------------------------------------------------------------------
// Authentication. With etcd's auth enabled, every request carries a token (`authorization:
// <token>`) that `/v3/auth/authenticate` hands out for a user and password. The credential comes
// from the VM's environment (`IDEMGATE_STORE_AUTH`, `user:password`), never the plugin
// configuration. The root context authenticates ahead of need, as it grants leases: at start,
// every `store.token_refresh_seconds` after (below etcd's token TTL, so a token in use never
// expires), and at once when etcd refuses the token (401: a member restarted, a password changed).
// A request is never sent without the token once one is needed: until the first one arrives no
// lease is granted either, so requests are refused (503), never forwarded unprotected.

/// The path of the authentication request.
pub const AUTH_PATH: &str = "/v3/auth/authenticate";
/// `store.token_refresh_seconds` by default (defined with the configuration).
pub use crate::config::DEFAULT_TOKEN_REFRESH_SECONDS;
/// The longest token accepted (etcd's simple tokens are about 20 bytes, its JWTs a few hundred).
const MAX_TOKEN_LEN: usize = 4096;
/// A failed authentication is tried again after this long, doubled at each failure up to
/// `AUTH_RETRY_MAX_MS` (a wrong password costs etcd a bcrypt check each time).
const AUTH_RETRY_MS: u64 = 500;
const AUTH_RETRY_MAX_MS: u64 = 10_000;
/// An authentication with no answer after this long is forgotten and sent again.
const AUTH_STUCK_MS: u64 = 10_000;

/// The authentication request for `user_password` (`user:password`, split at the first colon;
/// the password may contain colons). Refused: no colon, or an empty user.
pub fn authenticate_request(user_password: &str) -> Result<StoreRequest, String> {
    let Some((user, password)) = user_password.split_once(':') else {
        return Err("IDEMGATE_STORE_AUTH must be user:password".into());
    };
    if user.is_empty() {
        return Err("IDEMGATE_STORE_AUTH has an empty user name".into());
    }
    let mut out = Body::with_capacity(user.len() + password.len() + 32);
    out.raw(r#"{"name":"#).str(user).raw(r#","password":"#).str(password).raw("}");
    Ok(out.post(AUTH_PATH))
}

#[derive(Deserialize)]
struct AuthAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    token: Option<String>,
}

/// Parses the answer to `authenticate_request`: the token, which must fit in a header value
/// (visible ASCII only, at most `MAX_TOKEN_LEN` bytes).
pub fn parse_authenticate(status: Option<u16>, body: &[u8]) -> Result<String, StoreError> {
    let a: AuthAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    let token = a.token.unwrap_or_default();
    if token.is_empty() || token.len() > MAX_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(garbled("etcd auth token"));
    }
    Ok(token)
}

/// What etcd said in an error answer (`{"error": "etcdserver: ..."}`), or the start of any other
/// body (a proxy's or a TLS server's own text), without control characters and cut to 200
/// characters, for a log line.
pub fn error_text(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct ErrorAnswer {
        error: Option<String>,
    }
    let text = match serde_json::from_slice::<ErrorAnswer>(body).ok().and_then(|a| a.error) {
        Some(e) => e,
        None => String::from_utf8_lossy(body.get(..800).unwrap_or(body)).into_owned(),
    };
    text.chars().filter(|c| !c.is_control()).take(200).collect()
}

/// What etcd answers (400, gRPC InvalidArgument) to a token taken before its auth store last
/// changed (a user, role or permission added or edited anywhere in etcd): a JWT carries the
/// revision it was issued at, so every later request is refused until a new token is taken.
pub const AUTH_OLD_REVISION: &str = "etcdserver: revision of auth store is old";

/// Whether etcd refused a request's token: 401 (expired, unknown to the member, its user's
/// password changed) or a 400 saying the token is older than the auth store
/// (`AUTH_OLD_REVISION`). The root authenticates again at once. etcd refuses such a request
/// without applying it (the filter still treats it as any failed answer).
pub fn token_refused(status: Option<u16>, body: &[u8]) -> bool {
    match status {
        Some(401) => true,
        Some(400) => error_text(body) == AUTH_OLD_REVISION,
        _ => false,
    }
}

/// A VM's etcd token: the one in use, and when to ask for the next. Times are this proxy's clock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Auth {
    token: Option<String>,
    obtained_at_ms: u64,
    sent_at_ms: Option<u64>,
    retry_at_ms: u64,
    failures: u32,
    refused: bool,
}

impl Auth {
    /// The token to send, if one was obtained (kept while its successor is asked for: etcd may
    /// still accept it).
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether the root should authenticate now: none in flight, past any retry delay, and no
    /// token yet, a refused one, or one obtained `refresh_ms` ago or more.
    pub fn wants_authenticate(&self, now_ms: u64, refresh_ms: u64) -> bool {
        if let Some(sent) = self.sent_at_ms {
            if now_ms.saturating_sub(sent) < AUTH_STUCK_MS {
                return false;
            }
        }
        if now_ms < self.retry_at_ms {
            return false;
        }
        self.token.is_none() || self.refused || now_ms.saturating_sub(self.obtained_at_ms) >= refresh_ms
    }

    pub fn sent(&mut self, now_ms: u64) {
        self.sent_at_ms = Some(now_ms);
    }

    pub fn obtained(&mut self, token: String, now_ms: u64) {
        self.token = Some(token);
        self.obtained_at_ms = now_ms;
        self.sent_at_ms = None;
        self.failures = 0;
        self.refused = false;
    }

    pub fn failed(&mut self, now_ms: u64) {
        self.sent_at_ms = None;
        let delay = AUTH_RETRY_MS.saturating_mul(1 << self.failures.min(5)).min(AUTH_RETRY_MAX_MS);
        self.failures = self.failures.saturating_add(1);
        self.retry_at_ms = now_ms.saturating_add(delay);
    }

    /// etcd refused the token in use (`token_refused`): authenticate again as soon as allowed.
    /// Returns whether this is news (the first refusal of this token).
    pub fn refused(&mut self) -> bool {
        let news = self.token.is_some() && !self.refused;
        self.refused = true;
        news
    }
}

// ---------------------------------------------------------------------------------------------
// Answers. Parsed into typed shapes (unknown fields ignored without being kept), every list
// bounded as it arrives (`MAX_LIST`), every 64-bit integer a decimal string.

fn few<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    few_n::<D, T, MAX_LIST>(d)
}

/// A list of at most `N` elements, refused as the `N + 1`th arrives.
fn few_n<'de, D: Deserializer<'de>, T: Deserialize<'de>, const N: usize>(d: D) -> Result<Vec<T>, D::Error> {
    struct Few<T, const N: usize>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for Few<T, N> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a list of at most {N} elements")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            // Room for an idemgate answer's lists (`MAX_LIST`) at once, grown beyond as elements
            // arrive (a list page), never sized from the answer.
            let mut out = Vec::with_capacity(N.min(MAX_LIST));
            while let Some(item) = seq.next_element()? {
                if out.len() == N {
                    return Err(de::Error::custom("a list longer than any idemgate answer"));
                }
                out.push(item);
            }
            Ok(out)
        }
    }
    d.deserialize_seq(Few::<T, N>(std::marker::PhantomData))
}

// Strings of an answer are borrowed from it where they hold no escape (etcd writes base64 and
// decimals, which never do); a string with one is unescaped into its own copy, read the same.

#[derive(Deserialize)]
struct Header<'a> {
    #[serde(borrow)]
    revision: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct TxnAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    #[serde(default)]
    succeeded: bool,
    #[serde(borrow, default, deserialize_with = "few")]
    responses: Vec<OpAnswer<'a>>,
}

#[derive(Deserialize)]
struct OpAnswer<'a> {
    #[serde(borrow)]
    response_range: Option<RangeAnswer<'a>>,
    response_put: Option<IgnoredAny>,
    response_delete_range: Option<IgnoredAny>,
    #[serde(borrow)]
    response_txn: Option<Box<TxnAnswer<'a>>>,
}

#[derive(Deserialize)]
struct RangeAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    #[serde(borrow, default, deserialize_with = "few")]
    kvs: Vec<Kv<'a>>,
}

#[derive(Deserialize)]
struct Kv<'a> {
    #[serde(borrow)]
    key: Option<Cow<'a, str>>,
    #[serde(borrow)]
    value: Option<Cow<'a, str>>,
    #[serde(borrow)]
    mod_revision: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct LeaseAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    #[serde(rename = "ID")]
    id: Option<String>,
    #[serde(rename = "TTL")]
    ttl: Option<String>,
    error: Option<String>,
}

fn garbled(why: &str) -> StoreError {
    StoreError::Garbled(why.to_string())
}

fn check_http(status: Option<u16>) -> Result<(), StoreError> {
    match status {
        Some(200) => Ok(()),
        Some(s) => Err(StoreError::Http(s)),
        None => Err(StoreError::NoAnswer),
    }
}

fn json_answer<'a, T: Deserialize<'a>>(status: Option<u16>, body: &'a [u8]) -> Result<T, StoreError> {
    check_http(status)?;
    serde_json::from_slice(body).map_err(|e| StoreError::Garbled(format!("etcd answer: {e}")))
}

fn decimal(s: Option<&str>) -> Option<i64> {
    let s = s?;
    if s.is_empty() || s.len() > 19 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn has_revision(h: &Option<Header<'_>>) -> bool {
    h.as_ref().and_then(|h| decimal(h.revision.as_deref())).is_some()
}

impl OpAnswer<'_> {
    fn kind(&self) -> Option<u8> {
        match (&self.response_range, &self.response_put, &self.response_delete_range, &self.response_txn) {
            (Some(_), None, None, None) => Some(b'r'),
            (None, Some(_), None, None) => Some(b'p'),
            (None, None, Some(_), None) => Some(b'd'),
            (None, None, None, Some(_)) => Some(b't'),
            _ => None,
        }
    }
}

fn shape(ops: &[OpAnswer]) -> Option<Vec<u8>> {
    ops.iter().map(OpAnswer::kind).collect()
}

/// The one key-value a range read of `key` found (`None`: the key is absent).
fn single_kv(r: &RangeAnswer<'_>, key: &str) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
    match r.kvs.as_slice() {
        [] => Ok(None),
        [kv] => {
            let k = kv.key.as_deref().and_then(unb64).ok_or_else(|| garbled("etcd key"))?;
            if k != key.as_bytes() {
                return Err(garbled("etcd answered another key"));
            }
            let v = kv.value.as_deref().map_or(Some(vec![]), unb64).ok_or_else(|| garbled("etcd value"))?;
            let rev = decimal(kv.mod_revision.as_deref()).ok_or_else(|| garbled("etcd mod_revision"))?;
            Ok(Some((v, rev)))
        }
        _ => Err(garbled("etcd answered several values for one key")),
    }
}

/// Whether `ops` are the writes of `write_ops` whose owner mark reads back `echo` (when given).
fn writes_echo(ops: &[OpAnswer], skey: &StorageKey, echo: Option<&[u8]>) -> Result<(), StoreError> {
    // The value, its owner mark, the mark read back, and what the write did to the key's
    // tombstone (`TombWrite`), if anything.
    if !matches!(shape(ops).as_deref(), Some(b"ppr" | b"pprp" | b"pprd")) {
        return Err(garbled("etcd write answer shape"));
    }
    let Some(expected) = echo else { return Ok(()) };
    let mark = ops.get(2).and_then(|o| o.response_range.as_ref()).ok_or_else(|| garbled("etcd write answer"))?;
    match single_kv(mark, &owner_key(skey))? {
        Some((v, _)) if v == expected => Ok(()),
        _ => Err(garbled("etcd answer does not echo the claim's owner")),
    }
}

/// A value or a key's tombstone as opened (`open_value`, `open_key_tombstone`) with its expiry.
type Opened = Result<(StoredValue, u64), ValueError>;

/// Parses etcd's answer to `claim_request(skey, owner, ...)` (`status`: the HTTP status, `None`
/// if no answer), read at `local_now_ms` on this proxy's clock. A claim must echo `owner`'s mark.
/// An existing value comes with its `Fence` (for a take-over or stale-to-unknown), and is judged
/// by `judged_now` (its `now_ms`) against the times its writer wrote.
pub fn parse_claim_reply(
    status: Option<u16>,
    body: &[u8],
    owner: &OwnerToken,
    skey: &StorageKey,
    seal: &Seal,
    local_now_ms: u64,
) -> Result<(ClaimReply, Option<Fence>), StoreError> {
    let a: TxnAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    let now_ms = judged_now(local_now_ms);
    if a.succeeded {
        writes_echo(&a.responses, skey, Some(&owner_mark(Stage::Forwarded, owner)))?;
        return Ok((ClaimReply::Claimed { now_ms }, None));
    }
    // The value's read, and on a route that keeps tombstones the key's tombstone's.
    let reads = a
        .responses
        .iter()
        .map(|op| op.response_range.as_ref().filter(|_| op.kind() == Some(b'r')))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| garbled("etcd claim answer shape"))?;
    let (value, tomb) = match reads.as_slice() {
        [v] => (single_kv(v, &etcd_key(skey))?, None),
        [v, t] => (single_kv(v, &etcd_key(skey))?, single_kv(t, &key_tombstone_key(skey))?),
        _ => return Err(garbled("etcd claim answer shape")),
    };
    let tomb = tomb.map(|(v, rev)| (open_key_tombstone(&v, skey, seal), rev));
    // The key's tombstone answers where no record holds the key (none, or one free by
    // `judged_now`), as Redis's claim script answers it where Redis dropped the record.
    let tomb_answer = |tomb: Option<(Opened, i64)>| match tomb {
        None => None,
        Some((Ok((value, expires_at_ms)), mod_revision)) => {
            // Past its expiry it holds nothing: a claim decided on it compares it unchanged.
            let fence = value.summary(expires_at_ms).is_free(now_ms).then(|| Fence {
                mod_revision,
                value: value.clone(),
                expires_at_ms,
                tombstone: true,
            });
            Some((ClaimReply::Exists { now_ms, expires_at_ms, value }, fence))
        }
        Some((Err(why), _)) => Some((ClaimReply::Unreadable { now_ms, why }, None)),
    };
    match value {
        // Not created because this owner's release tombstone is there: this claim arrived after
        // its own release (it was given up): nothing was claimed.
        None => tomb_answer(tomb).ok_or_else(|| garbled("claim refused by its owner's release tombstone")),
        Some((v, mod_revision)) => Ok(match open_value(&v, skey, seal) {
            Ok((value, expires_at_ms)) => {
                let live_tomb = tomb_answer(tomb).filter(|(reply, _)| match reply {
                    ClaimReply::Exists { expires_at_ms, value, .. } => !value.summary(*expires_at_ms).is_free(now_ms),
                    _ => true,
                });
                match live_tomb {
                    Some(answer) if value.summary(expires_at_ms).is_free(now_ms) => answer,
                    _ => {
                        let fence = Fence { mod_revision, value: value.clone(), expires_at_ms, tombstone: false };
                        (ClaimReply::Exists { now_ms, expires_at_ms, value }, Some(fence))
                    }
                }
            }
            Err(why) => (ClaimReply::Unreadable { now_ms, why }, None),
        }),
    }
}

/// Parses the answer to a `transition_request`. With `echo` (a take-over: the new phase and
/// owner), a change must read back that owner mark.
pub fn parse_transition_reply(
    status: Option<u16>,
    body: &[u8],
    echo: Option<(&StorageKey, Stage, &OwnerToken)>,
) -> Result<TransitionReply, StoreError> {
    let a: TxnAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    let skey = echo.map_or(StorageKey([0; 32]), |(s, _, _)| *s);
    let skey = &skey;
    let echo = echo.map(|(_, p, o)| owner_mark(p, o));
    let shape = shape(&a.responses).ok_or_else(|| garbled("etcd transition answer shape"))?;
    match (a.succeeded, shape.as_slice()) {
        // A release.
        (true, b"dd" | b"ddd") if echo.is_none() => Ok(TransitionReply::Changed),
        (true, _) => {
            writes_echo(&a.responses, skey, echo.as_ref().map(|m| m.as_slice())).map(|_| TransitionReply::Changed)
        }
        (false, b"") => Ok(TransitionReply::Refused),
        // A lost claim's release left its tombstone.
        (false, b"p") if echo.is_none() => Ok(TransitionReply::Changed),
        // A where-absent write's existence check: absent, `where_absent_request` follows.
        (false, b"r") if echo.is_none() => {
            let range = a.responses.first().and_then(|o| o.response_range.as_ref());
            match range.map(|r| r.kvs.is_empty()) {
                Some(true) => Ok(TransitionReply::Absent),
                Some(false) => Ok(TransitionReply::Refused),
                None => Err(garbled("etcd existence answer")),
            }
        }
        _ => Err(garbled("etcd transition answer shape")),
    }
}

fn shape_of(ops: &[OpAnswer]) -> Result<Vec<u8>, StoreError> {
    shape(ops).ok_or_else(|| garbled("etcd answer shape"))
}

/// Parses the answer to `read_request(skey)` read at `local_now_ms`: a value past its expiry by
/// `judged_now` (its lease not yet over) is absent, as Redis would have dropped it.
pub fn parse_read_reply(
    status: Option<u16>,
    body: &[u8],
    skey: &StorageKey,
    seal: &Seal,
    local_now_ms: u64,
) -> Result<ReadReply, StoreError> {
    parse_fenced_read(status, body, skey, seal, local_now_ms).map(|(r, _)| r)
}

/// `parse_read_reply`, and with a value found its `Fence` (the value, its expiry and its
/// `mod_revision`): what an operator's transition is decided on and compares
/// (`operator_transition_request`).
pub fn parse_fenced_read(
    status: Option<u16>,
    body: &[u8],
    skey: &StorageKey,
    seal: &Seal,
    local_now_ms: u64,
) -> Result<(ReadReply, Option<Fence>), StoreError> {
    let a: RangeAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    Ok(judged_read(single_kv(&a, &etcd_key(skey))?, skey, seal, local_now_ms))
}

/// A value read at `skey` (`None`: absent) as `parse_fenced_read` reads it at `local_now_ms`.
fn judged_read(
    found: Option<(Vec<u8>, i64)>,
    skey: &StorageKey,
    seal: &Seal,
    local_now_ms: u64,
) -> (ReadReply, Option<Fence>) {
    match found {
        None => (ReadReply::Absent, None),
        Some((v, mod_revision)) => match open_value(&v, skey, seal) {
            Ok((value, expires)) if value.summary(expires).is_free(judged_now(local_now_ms)) => {
                (ReadReply::Absent, None)
            }
            Ok((value, expires_at_ms)) => {
                let fence = Fence { mod_revision, value: value.clone(), expires_at_ms, tombstone: false };
                (ReadReply::Found(value), Some(fence))
            }
            Err(e) => (ReadReply::Unreadable(e), None),
        },
    }
}

/// Most values one `read_many_request` reads: below etcd's `--max-txn-ops` (128 by default), and
/// an answer holds at most this many values (each at most etcd's `--max-request-bytes`).
pub const READ_MANY_MAX: usize = 64;

/// The reads of the values of `skeys` (the first `READ_MANY_MAX`) in one transaction: what the
/// operator's listing reads of a page of key names (`list_page_request`), one request for many
/// keys instead of one each, `serializable` as the page was (no round to the leader: a read-only
/// transaction of serializable ranges is answered by the member itself).
pub fn read_many_request(skeys: &[StorageKey]) -> StoreRequest {
    // Written here rather than as `Op`s of `txn`: the filter never sends it, so its module
    // carries none of it.
    let keys: Vec<String> = skeys.iter().take(READ_MANY_MAX).map(etcd_key).collect();
    let each = r#"{"request_range":{"key":,"serializable":true}},"#.len();
    let mut out = Body::with_capacity(32 + keys.iter().map(|k| each + b64_len(k.len())).sum::<usize>());
    out.raw(r#"{"success":["#);
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            out.raw(",");
        }
        out.raw(r#"{"request_range":{"key":"#).b64(k.as_bytes()).raw(r#","serializable":true}}"#);
    }
    out.raw("]}");
    out.post(TXN_PATH)
}

#[derive(Deserialize)]
struct ManyAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    #[serde(default)]
    succeeded: bool,
    #[serde(borrow, default, deserialize_with = "few_n::<_, _, READ_MANY_MAX>")]
    responses: Vec<OpAnswer<'a>>,
}

/// Parses the answer to `read_many_request(skeys)`: each key's value read as `parse_fenced_read`
/// reads one at `local_now_ms`, in the order of `skeys` (the first `READ_MANY_MAX`). Every read
/// must be there, of its own key.
pub fn parse_read_many(
    status: Option<u16>,
    body: &[u8],
    skeys: &[StorageKey],
    seal: &Seal,
    local_now_ms: u64,
) -> Result<Vec<ReadReply>, StoreError> {
    let a: ManyAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) || !a.succeeded {
        return Err(garbled("etcd answer without a revision, or not a read's"));
    }
    let skeys = skeys.get(..skeys.len().min(READ_MANY_MAX)).unwrap_or_default();
    if a.responses.len() != skeys.len() {
        return Err(garbled("etcd answered another number of reads than asked"));
    }
    let mut out = Vec::with_capacity(skeys.len());
    for (op, skey) in a.responses.iter().zip(skeys) {
        let range = op
            .response_range
            .as_ref()
            .filter(|_| op.kind() == Some(b'r'))
            .ok_or_else(|| garbled("etcd read answer shape"))?;
        out.push(judged_read(single_kv(range, &etcd_key(skey))?, skey, seal, local_now_ms).0);
    }
    Ok(out)
}

/// A read of `skey`'s owner mark (the phase letter and owner hex, in plain text beside the sealed
/// value): what an operator sees of the phase of a value this build cannot open.
pub fn owner_mark_request(skey: &StorageKey) -> StoreRequest {
    let key = owner_key(skey);
    let mut out = Body::with_capacity(b64_len(key.len()) + 16);
    out.raw(r#"{"key":"#).b64(key.as_bytes()).raw("}");
    out.post("/v3/kv/range")
}

/// Parses a range answer for the single etcd key `key` as stored, opened or not: `None` when
/// absent, else its bytes and `mod_revision` (what `forget_raw_request` compares). Answers
/// `read_request` (`key`: `etcd_key`) and `owner_mark_request` (`owner_key`).
pub fn parse_raw_read(status: Option<u16>, body: &[u8], key: &str) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
    let a: RangeAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    single_kv(&a, key)
}

/// The deletion of `skey`'s value and owner mark if the value is still the one read at
/// `mod_revision` (an operator's `forget` of a value this build cannot open: no owner or phase
/// is compared, only that nothing wrote the key since it was read). Its answer is read by
/// `parse_transition_reply` (no echo): changed, or refused when the value changed.
pub fn forget_raw_request(skey: &StorageKey, mod_revision: i64) -> StoreRequest {
    let keys = Keys::of(skey);
    txn(
        &[Compare::ModRevision(keys.value.as_bytes(), mod_revision)],
        &[Op::Delete(keys.value.as_bytes()), Op::Delete(keys.owner.as_bytes())],
        &[],
    )
}

/// Most keys one page of `list_page_request` asks for (and `parse_list_page` accepts).
pub const LIST_PAGE_MAX: usize = 256;

/// One page of the operator's listing (read `serializable`: the answering member's own view): the
/// etcd keys (names only, never values) from `start`
/// (`None`: the first of `KEY_PREFIX`) to the end of `KEY_PREFIX`, in key order, at most `page`
/// of them (1 to `LIST_PAGE_MAX`). Owner marks and tombstones come too (they share the prefix):
/// `parse_list_page` skips them.
pub fn list_page_request(start: Option<&[u8]>, page: usize) -> StoreRequest {
    let mut end = KEY_PREFIX.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        // `/` + 1: the first key after every key under the prefix.
        *last = last.saturating_add(1);
    }
    let start = start.unwrap_or(KEY_PREFIX.as_bytes());
    let limit = page.clamp(1, LIST_PAGE_MAX);
    let mut out = Body::with_capacity(b64_len(start.len()) + b64_len(end.len()) + 96);
    out.raw(r#"{"key":"#).b64(start).raw(r#","range_end":"#).b64(&end);
    out.raw(r#","limit":"#).int(i64::try_from(limit).unwrap_or(1)).raw(r#","keys_only":true,"serializable":true}"#);
    out.post("/v3/kv/range")
}

/// A page of storage keys (`parse_list_page`) and where the next page starts (`None`: the last).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListPage {
    /// The storage keys whose value keys the page holds, in key order.
    pub keys: Vec<StorageKey>,
    /// The start of the next page: just after the page's last key.
    pub next: Option<Vec<u8>>,
}

#[derive(Deserialize)]
struct ListAnswer<'a> {
    #[serde(borrow)]
    header: Option<Header<'a>>,
    #[serde(default, deserialize_with = "few_n::<_, _, LIST_PAGE_MAX>")]
    kvs: Vec<KeyOnly<'a>>,
    #[serde(default)]
    more: bool,
}

#[derive(Deserialize)]
struct KeyOnly<'a> {
    #[serde(borrow)]
    key: Option<Cow<'a, str>>,
}

/// Parses the answer to `list_page_request(start, page)`: every key must be under `KEY_PREFIX`,
/// from `start` on, in increasing order, at most `page` of them; value keys (`KEY_PREFIX` and 64
/// lowercase hex digits) become storage keys, owner marks (`/o`) and release tombstones
/// (`/r/<owner>`) are skipped, any other key under the prefix too. A page that says more follows
/// must hold a key (the next page starts after it), so a listing always moves on.
pub fn parse_list_page(
    status: Option<u16>,
    body: &[u8],
    start: Option<&[u8]>,
    page: usize,
) -> Result<ListPage, StoreError> {
    let a: ListAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    if a.kvs.len() > page.clamp(1, LIST_PAGE_MAX) {
        return Err(garbled("etcd answered more keys than asked"));
    }
    let mut keys = vec![];
    let mut last: Vec<u8> = start.unwrap_or(KEY_PREFIX.as_bytes()).to_vec();
    let mut first = true;
    for kv in &a.kvs {
        let k = kv.key.as_deref().and_then(unb64).ok_or_else(|| garbled("etcd key"))?;
        let Some(rest) = k.strip_prefix(KEY_PREFIX.as_bytes()) else {
            return Err(garbled("etcd answered a key outside idemgate's prefix"));
        };
        // The first key may be `start` itself; every key after it must be greater.
        if k < last || (!first && k == last) {
            return Err(garbled("etcd answered keys out of order"));
        }
        first = false;
        if rest.len() == 64 {
            if let Some(skey) = storage_key_of_hex(rest) {
                keys.push(skey);
            }
        }
        last = k;
    }
    let next = match (a.more, a.kvs.is_empty()) {
        (false, _) => None,
        (true, true) => return Err(garbled("etcd said more keys follow an empty page")),
        (true, false) => {
            last.push(0);
            Some(last)
        }
    };
    Ok(ListPage { keys, next })
}

/// 64 lowercase hex digits (as `etcd_key` writes them) as a storage key.
fn storage_key_of_hex(hex: &[u8]) -> Option<StorageKey> {
    if hex.iter().any(u8::is_ascii_uppercase) {
        return None;
    }
    crate::hex::decode::<32>(hex).map(StorageKey)
}

/// Parses the answer to `lease_grant_request(ttl_seconds)`: the lease id, if etcd granted at
/// least the TTL asked for.
pub fn parse_lease_grant(status: Option<u16>, body: &[u8], ttl_seconds: u64) -> Result<i64, StoreError> {
    let a: LeaseAnswer = json_answer(status, body)?;
    if !has_revision(&a.header) {
        return Err(garbled("etcd answer without a revision"));
    }
    if let Some(e) = a.error.filter(|e| !e.is_empty()) {
        return Err(StoreError::Garbled(format!("etcd lease grant: {e}")));
    }
    let id = decimal(a.id.as_deref()).filter(|id| *id > 0).ok_or_else(|| garbled("etcd lease id"))?;
    let ttl = decimal(a.ttl.as_deref()).ok_or_else(|| garbled("etcd lease ttl"))?;
    if u64::try_from(ttl).unwrap_or(0) < ttl_seconds {
        return Err(garbled("etcd granted a shorter lease than asked"));
    }
    Ok(id)
}

#[cfg(test)]
mod tests;
