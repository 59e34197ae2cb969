//! The external store protocol: Redis behind webdis, reached with HTTP callouts through an Envoy
//! cluster. Requests are built and answers parsed here, without host calls, so every byte sent
//! and every answer understood is unit-tested and fuzzable.
//!
//! - **Claim-or-read in one round trip**: a Lua script reads the key and, when absent, writes a
//!   forwarded-in-progress claim whose `PX` is a forwarded claim's life (`record::Lifetimes`),
//!   with the lock expiry (Redis's clock, `TIME`) inside the value. It answers `{"1", now, owner}`
//!   (claimed, echoing the claim's owner token: a "claimed" that does not is refused) or
//!   `{"0", now, value, pttl}`, all as strings: webdis 0.1.9's raw output garbles integers inside
//!   arrays.
//! - **One clock**: every store comparison is made with Redis's clock. A value's life is its key's
//!   `PX` (durations from `record::Lifetimes`, counted by Redis) and its expiry is read back as
//!   `TIME + PTTL`; its lock expiry is written by the scripts from `TIME`. The times inside the
//!   encoded record come from the writing proxy's clock and are never compared with Redis's.
//! - **Owner-checked transitions**: one script, parameterised, does completion, release,
//!   outcome-unknown marking and stale-lock take-over: it changes the value only if it still
//!   carries the expected owner token and phase (and, for stale locks, only if the lock expired
//!   by Redis's clock). Of racing callers exactly one wins.
//!
//! A claim is written as *forwarded* because forwarding follows it at once: a proxy that dies in
//! between leaves a claim that is judged outcome-unknown after `lock_ttl_seconds`, never executed
//! again. (The never-forwarded claims of the local tier are the ones that may be taken over.)
//!
//! Values are binary-safe: arguments are percent-encoded in the webdis command path, the large
//! completed record travels as a PUT body (webdis makes it the last argument), and answers are
//! read as raw RESP (`.raw`).
//!
//! **Scripts by name**: each call runs its script by SHA-1 (`EVALSHA`, the name computed when the
//! crate is compiled: `Script::sha1_hex`). A Redis that does not hold the script (restarted,
//! failed over, `SCRIPT FLUSH`) answers NOSCRIPT, which means the script did not run: the parsers
//! answer it as its own case (`ClaimReply::NoScript`, `TransitionReply::NoScript`), never as an
//! outage, and the caller re-sends the same call once with the script in full
//! (`StoreRequest::with_script`, an `EVAL`, which also loads it for later calls).

use std::fmt;

use crate::decision::{Phase, Summary};
use crate::fingerprint::Fingerprint;
use crate::lifecycle::{self, Event, TakeOver};
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record, Stage, State};
use crate::scope::StorageKey;
use crate::seal::{Seal, Unsealed};
use crate::sha1;

/// Prefix of every Redis key idemgate writes (the namespace is inside the hashed storage key).
/// Attempts of one write made after forwarding (completion, release, outcome-unknown mark) before
/// its fallback: the first, one retry at once (a transient error), then retries after 0.2, 0.4,
/// 0.8, 1.6 and 3.2 s, so a store that is back within about 6 s still gets the write. The root
/// context runs this schedule (`engine::writes`); the operator CLI waits it out (`write_window_ms`).
pub const MAX_WRITE_ATTEMPTS: u8 = 7;

/// How long to wait before retrying a write that has failed `attempts` times (1-based).
pub fn retry_delay_ms(attempts: u8) -> u64 {
    match attempts {
        0 | 1 => 0,
        n => 200u64 << u32::from((n - 2).min(10)),
    }
}

/// Room for the root's tick (retries are dispatched on a 100 ms tick) and its queue, per write.
const WRITE_SCHEDULE_SLACK_MS: u64 = 1_000;

/// The most schedules one request's writes after forwarding can run in a row: the write (a
/// completion), its body-less rewrite when the store refuses it as too large, and its
/// outcome-unknown fallback, each of which may on etcd send its where-absent second transaction
/// with a schedule of its own (`engine::writes`: too large, absent).
const WRITE_SCHEDULES_IN_A_ROW: u64 = 6;

/// The longest a proxy may go on sending one request's writes after forwarding, each attempt
/// given the store's `timeout_ms`: `MAX_WRITE_ATTEMPTS` attempts and the backoff between them,
/// plus slack for the tick, for each of `WRITE_SCHEDULES_IN_A_ROW` schedules. A write sent within
/// this window may still land; after it, none of that request's writes can follow.
pub fn write_window_ms(store_timeout_ms: u64) -> u64 {
    let backoff: u64 = (1..MAX_WRITE_ATTEMPTS).map(retry_delay_ms).sum();
    let one = store_timeout_ms.saturating_mul(u64::from(MAX_WRITE_ATTEMPTS)).saturating_add(backoff);
    one.saturating_add(WRITE_SCHEDULE_SLACK_MS).saturating_mul(WRITE_SCHEDULES_IN_A_ROW)
}

pub const KEY_PREFIX: &str = "idemgate:v1:";
/// Marks a stored value (`idemgate --version` names it): `IGS1`, the header the store scripts write (phase, owner, lock expiry),
/// then the sealed record.
pub const VALUE_MAGIC: &[u8; 4] = b"IGS1";
/// `IGS1` + phase (1) + owner hex (32) + lock expiry in ms, 15 decimal digits.
const HEADER_LEN: usize = 4 + 1 + 32 + 15;

/// Claim-or-read. KEYS[1], KEYS[2] (the key's tombstone, `tombstone_key`); ARGV: owner hex, PX ms
/// (a forwarded claim's life), lock ms, whether the route keeps tombstones ('1'/'0'), record
/// (last). Answers `{'1', now, owner hex}` (claimed: the owner echoed, so an answer made without
/// reading the request is refused) or `{'0', now, value, pttl}` (an existing value with its
/// remaining life by Redis's clock). A release tombstone (`IGS1R<owner>`) is no record: the claim
/// of the owner it names is refused (`{"2", now}`: that owner's release has run, so this claim
/// arrived late), any other claim replaces it. Where no record is held and the route keeps
/// tombstones, the key's tombstone (`IGS1T`, written with its completion, outliving the record)
/// is answered `{'3', now, tombstone, pttl}` and nothing is claimed.
const CLAIM_SCRIPT: &str = "local t=redis.call('TIME') \
local now=tonumber(t[1])*1000+math.floor(tonumber(t[2])/1000) \
local v=redis.call('GET',KEYS[1]) \
if v and string.sub(v,1,5)=='IGS1R' then \
if string.sub(v,6,37)==ARGV[1] then return {'2',string.format('%d',now)} end \
v=false end \
if v then return {'0',string.format('%d',now),v,string.format('%d',redis.call('PTTL',KEYS[1]))} end \
if ARGV[4]=='1' then local d=redis.call('GET',KEYS[2]) \
if d then return {'3',string.format('%d',now),d,string.format('%d',redis.call('PTTL',KEYS[2]))} end end \
redis.call('SET',KEYS[1],'IGS1P'..ARGV[1]..string.format('%015d',now+tonumber(ARGV[3]))..ARGV[5],'PX',ARGV[2]) \
return {'1',string.format('%d',now),ARGV[1]}";

/// Owner-checked transition. KEYS[1], KEYS[2] (the key's tombstone); ARGV: expected owner hex,
/// expected phases, require stale lock ('1'/'0'), new phase ('X' deletes), new owner hex, ttl ms,
/// lock ms ('-': none), where absent ('0', '1', 'K'), the key's tombstone ('-': none) and its
/// PX ms, record ('-': keep the stored one) last. Answers `{1, new owner hex}`
/// when it changed the value, `{0, new owner hex}` otherwise: the echo of `ARGV[5]` lets a reader
/// refuse an answer that is not its own request's (webdis 0.1.9 can hand a new client the late
/// answer of a command whose client went away: `parse_transition_reply`).
/// New phase 'R' is a release of a claim whose answer was lost: as 'X', but when the key is
/// absent it writes a tombstone naming the owner for ttl ms, so the claim landing late is refused.
/// Where absent '1' or 'K' (a completion, an outcome-unknown mark): when the key is absent or holds
/// a release tombstone, the new value is written with the record and the answer is `{2, ...}` (the owner's
/// claim was lost by the store); 'K' keeps the stored record where the owner's claim is found.
/// Whenever a completed value ('D') is written with a tombstone, the tombstone is written at
/// KEYS[2] in the same script (so no reader finds the record gone before its tombstone is there);
/// a deletion ('X') with the tombstone argument 'F' (an operator's `forget`) deletes it too.
const TRANSITION_SCRIPT: &str = "local v=redis.call('GET',KEYS[1]) \
if v and ARGV[8]~='0' and string.sub(v,1,5)=='IGS1R' then v=false end \
if not v and ARGV[4]=='R' then redis.call('SET',KEYS[1],'IGS1R'..ARGV[1],'PX',ARGV[6]) return {1,ARGV[5]} end \
local t=redis.call('TIME') \
local now=tonumber(t[1])*1000+math.floor(tonumber(t[2])/1000) \
local lock=0 \
if ARGV[7]~='-' then lock=now+tonumber(ARGV[7]) end \
local function tomb() if ARGV[4]=='D' and ARGV[9]~='-' then redis.call('SET',KEYS[2],ARGV[9],'PX',ARGV[10]) end end \
if not v and ARGV[8]~='0' and ARGV[11]~='-' and ARGV[4]~='X' then \
redis.call('SET',KEYS[1],'IGS1'..ARGV[4]..ARGV[5]..string.format('%015d',lock)..ARGV[11],'PX',ARGV[6]) tomb() return {2,ARGV[5]} end \
if not v or string.sub(v,1,4)~='IGS1' or string.sub(v,6,37)~=ARGV[1] then return {0,ARGV[5]} end \
if not string.find(ARGV[2],string.sub(v,5,5),1,true) then return {0,ARGV[5]} end \
if ARGV[3]=='1' and tonumber(string.sub(v,38,52))>now then return {0,ARGV[5]} end \
if ARGV[4]=='X' or ARGV[4]=='R' then redis.call('DEL',KEYS[1]) \
if ARGV[4]=='X' and ARGV[9]=='F' then redis.call('DEL',KEYS[2]) end return {1,ARGV[5]} end \
local rec=ARGV[11] \
if rec=='-' or ARGV[8]=='K' then rec=string.sub(v,53) end \
redis.call('SET',KEYS[1],'IGS1'..ARGV[4]..ARGV[5]..string.format('%015d',lock)..rec,'PX',ARGV[6]) \
tomb() \
return {1,ARGV[5]}";

/// Redis's names for the scripts (lowercase hex SHA-1 of their text), computed at compile time.
const CLAIM_SHA1: [u8; 40] = sha1::hex(&sha1::digest(CLAIM_SCRIPT.as_bytes()));
const TRANSITION_SHA1: [u8; 40] = sha1::hex(&sha1::digest(TRANSITION_SCRIPT.as_bytes()));

/// A Lua script idemgate runs in Redis: sent by its SHA-1 (`EVALSHA`), and in full (`EVAL`, which
/// also loads it) only after Redis answered NOSCRIPT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Script {
    /// Claim-or-read (`claim_request`).
    Claim,
    /// The owner-checked transition (`Transition::request`).
    Transition,
}

impl Script {
    /// The script's text.
    pub fn text(self) -> &'static str {
        match self {
            Script::Claim => CLAIM_SCRIPT,
            Script::Transition => TRANSITION_SCRIPT,
        }
    }

    /// Redis's name for the script: the lowercase hex SHA-1 of its text.
    pub fn sha1_hex(self) -> &'static [u8; 40] {
        match self {
            Script::Claim => &CLAIM_SHA1,
            Script::Transition => &TRANSITION_SHA1,
        }
    }

    /// The webdis command that runs the script by name on `key` (and its tombstone's key,
    /// `tombstone_redis_key`: both in one Redis Cluster slot) with `args`, appended to `out`:
    /// `EVALSHA/<sha1>/2/key/tombstone key/args...` (every argument percent-encoded straight into `out`).
    fn command_into(self, key: &str, args: &[&[u8]], out: &mut String) {
        out.push_str("EVALSHA/");
        encode_arg_into(self.sha1_hex(), out);
        out.push_str("/2/");
        encode_arg_into(key.as_bytes(), out);
        out.push('/');
        encode_arg_into(tombstone_redis_key_of(key).as_bytes(), out);
        for a in args {
            out.push('/');
            encode_arg_into(a, out);
        }
    }

    /// The start of the command up to the key count: `EVALSHA/<sha1>/` or `EVAL/<script>/`.
    fn head(self, in_full: bool) -> String {
        if in_full {
            format!("EVAL/{}/", encode_arg(self.text().as_bytes()))
        } else {
            format!("EVALSHA/{}/", encode_arg(self.sha1_hex()))
        }
    }
}

/// The store's encoding of a stage (`record::Stage`): the letter a value's header, a transition's
/// arguments and etcd's owner mark carry. The store holds three stages: `Forwarded` (`P`), `Completed`
/// (`D`), `Unknown` (`U`). It holds no never-forwarded claim (its claim script enters `Forwarded` at
/// once), so a `Claimed` stage is written as the claim it is, `P`; `Absent` is `X`, the letter a
/// transition that deletes the key carries and which no reader accepts as a value's.
pub fn stage_letter(stage: Stage) -> u8 {
    match stage {
        Stage::Claimed | Stage::Forwarded => b'P',
        Stage::Completed => b'D',
        Stage::Unknown => b'U',
        Stage::Absent => b'X',
    }
}

/// The stage a value's letter encodes (`stage_letter`'s inverse over the stages the store holds).
pub fn stage_of_letter(letter: u8) -> Option<Stage> {
    match letter {
        b'P' => Some(Stage::Forwarded),
        b'D' => Some(Stage::Completed),
        b'U' => Some(Stage::Unknown),
        _ => None,
    }
}

/// A value read from the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredValue {
    /// `Forwarded`, `Completed` or `Unknown`: the stages the store holds (`stage_of_letter`).
    pub phase: Stage,
    pub owner: OwnerToken,
    /// By Redis's clock.
    pub lock_expires_at_ms: u64,
    pub record: Record,
}

impl StoredValue {
    /// A key's tombstone read from a store (no record held: `Record::key_tombstone`), as the
    /// value the decision table judges: completed, owned by nobody, holding no lock.
    pub fn key_tombstone(fp: Fingerprint) -> StoredValue {
        StoredValue {
            phase: Stage::Completed,
            owner: OwnerToken([0; 16]),
            lock_expires_at_ms: 0,
            record: Record::key_tombstone(fp),
        }
    }

    /// What the decision table needs, with the value's expiry by Redis's clock (`expires_at_ms`,
    /// from `ClaimReply::Exists`: Redis's `TIME` plus the key's `PTTL`). The record's own
    /// `expires_at_ms` was computed by the clock of whichever proxy wrote it: never used here.
    pub fn summary(&self, expires_at_ms: u64) -> Summary {
        let phase = match self.phase {
            // As it reads back: the store holds a claim as forwarded (`stage_letter`).
            Stage::Claimed | Stage::Forwarded => Phase::Forwarded { lock_expires_at_ms: self.lock_expires_at_ms },
            Stage::Completed => Phase::Completed,
            Stage::Unknown => Phase::Unknown,
            // No value read is absent (`stage_of_letter`); were one built so, it is judged as
            // outcome-unknown: never executed again, never replayed.
            Stage::Absent => Phase::Unknown,
        };
        Summary { fingerprint: Some(self.record.fingerprint), expires_at_ms, phase }
    }

    /// The stored record, its expiry moved onto another clock: `local_now_ms` plus what is left of
    /// its life by Redis's clock (`expires_at_ms - store_now_ms`). A proxy keeps its copy of a
    /// completed record with this expiry, so the copy ends with the store's key, judged by the
    /// proxy's own clock, whatever the skew between the clocks.
    pub fn record_on_clock(&self, store_now_ms: u64, expires_at_ms: u64, local_now_ms: u64) -> Record {
        let mut r = self.record.clone();
        let tier_end = match expires_at_ms {
            // A key without expiry never ends, on any clock.
            u64::MAX => u64::MAX,
            at => local_now_ms.saturating_add(at.saturating_sub(store_now_ms)),
        };
        // A completed record's own expiry (its writer's clock) ends it as a record before the
        // store drops its key: what is left is its tombstone (`Record::is_tombstone`).
        r.expires_at_ms = match r.state {
            State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_) => {
                tier_end.min(self.record.expires_at_ms)
            }
            _ => tier_end,
        };
        r
    }

    /// Encodes a value as the scripts write it at `skey`, its record sealed with `seal` (used by
    /// tests and by nothing on the wire).
    pub fn encode(&self, skey: &StorageKey, seal: &Seal) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + 64);
        out.extend_from_slice(VALUE_MAGIC);
        out.push(stage_letter(self.phase));
        out.extend_from_slice(self.owner.hex().as_bytes());
        out.extend_from_slice(format!("{:015}", self.lock_expires_at_ms % 1_000_000_000_000_000).as_bytes());
        out.extend_from_slice(&seal.seal(&redis_key(skey), &self.record.encode()));
        out
    }

    /// Decodes the value read at `skey`. Its record must verify under `seal` for this very key
    /// (`ValueError::Unauthentic` otherwise: never replayed, never forwarded on), and a completed
    /// phase must carry a completed record.
    pub fn open(v: &[u8], skey: &StorageKey, seal: &Seal) -> Result<StoredValue, ValueError> {
        let bad = |why: &str| ValueError::Unreadable(format!("stored value: {why}"));
        if v.len() < HEADER_LEN || !v.starts_with(VALUE_MAGIC) {
            return Err(bad("no idemgate header"));
        }
        let Some(phase) = v.get(4).and_then(|l| stage_of_letter(*l)) else {
            return Err(bad("unknown phase"));
        };
        let owner = crate::hex::decode::<16>(v.get(5..37).unwrap_or_default()).ok_or_else(|| bad("owner"))?;
        let lock = std::str::from_utf8(v.get(37..52).unwrap_or_default())
            .ok()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| bad("lock expiry"))?;
        let (record, _) =
            seal.open(&redis_key(skey), v.get(HEADER_LEN..).unwrap_or_default()).map_err(ValueError::Unauthentic)?;
        let record = Record::decode(record).map_err(|e| bad(&e.to_string()))?;
        let completed =
            matches!(record.state, State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_));
        if phase == Stage::Completed && !completed {
            return Err(bad("completed phase without a completed record"));
        }
        Ok(StoredValue { phase, owner: OwnerToken(owner), lock_expires_at_ms: lock, record })
    }
}

/// Why a stored value was not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ValueError {
    /// Damaged, or written by a later release (another value format or record version).
    Unreadable(String),
    /// Its record's seal does not verify for its key: moved from another key or namespace,
    /// forged, truncated, or written with a secret this proxy does not hold (`seal`).
    Unauthentic(Unsealed),
}

impl ValueError {
    pub fn is_unauthentic(&self) -> bool {
        matches!(self, ValueError::Unauthentic(_))
    }
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueError::Unreadable(why) => write!(f, "{why}"),
            ValueError::Unauthentic(why) => write!(f, "stored value: unauthentic: {why}"),
        }
    }
}

/// Why the store could not answer. Any of these is "store unavailable" to the decision table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// No answer: reset, refused, or `store.timeout_ms` elapsed.
    NoAnswer,
    /// webdis answered with an HTTP error (503 when Redis is down, 403 when not allowed).
    Http(u16),
    /// Redis answered an error (`-ERR ...`).
    Redis(String),
    /// An answer that is not what the script returns.
    Garbled(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::NoAnswer => write!(f, "no answer from the store"),
            StoreError::Http(s) => write!(f, "store answered HTTP {s}"),
            StoreError::Redis(e) => write!(f, "redis error: {e}"),
            StoreError::Garbled(e) => write!(f, "unexpected store answer: {e}"),
        }
    }
}

/// An HTTP request to webdis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRequest {
    pub method: &'static str,
    pub path: String,
    pub body: Vec<u8>,
    /// The script this request runs by its SHA-1 (`EVALSHA`), if it does: see `with_script`.
    pub by_sha1: Option<Script>,
}

impl StoreRequest {
    /// A webdis command sent as the body of `POST /` (e.g. `GET/<key>.raw`), running no script
    /// by name.
    pub fn command(command: &str) -> StoreRequest {
        StoreRequest { method: "POST", path: "/".into(), body: command.as_bytes().to_vec(), by_sha1: None }
    }

    /// The same call with its script in full (`EVAL`, which also loads it), to send once after
    /// Redis answered this request NOSCRIPT: the script did not run, so sending the call again
    /// cannot run it twice. Every argument is kept byte for byte; only `EVALSHA/<sha1>` becomes
    /// `EVAL/<script>`. `None` for a request that runs no script by name (an `EVAL` already, a
    /// `GET`): a store answering NOSCRIPT to those is not believed, and nothing is sent again.
    pub fn with_script(&self) -> Option<StoreRequest> {
        let script = self.by_sha1?;
        let (by_name, in_full) = (script.head(false), script.head(true));
        let mut again = StoreRequest { by_sha1: None, ..self.clone() };
        if let Some(rest) = self.body.strip_prefix(by_name.as_bytes()) {
            again.body = [in_full.as_bytes(), rest].concat();
        } else if let Some(rest) = self.path.strip_prefix('/').and_then(|p| p.strip_prefix(by_name.as_str())) {
            again.path = format!("/{in_full}{rest}");
        } else {
            return None;
        }
        Some(again)
    }
}

/// Percent-encodes every byte but RFC 3986 unreserved characters other than `.` (webdis reads
/// a dot in the last argument as the output format).
pub fn encode_arg(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    encode_arg_into(bytes, &mut out);
    out
}

/// `encode_arg(bytes)` appended to `out`: a request's arguments are encoded into its one string.
pub fn encode_arg_into(bytes: &[u8], out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    // Room for the worst case (every byte escaped) at once, not grown byte by byte.
    out.reserve(bytes.len().saturating_mul(3));
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'~' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
}

/// A short argument (an owner's hex, phase letters, a decimal) kept on the stack: a request's
/// arguments need no allocation each.
#[derive(Clone, Copy)]
struct Arg {
    buf: [u8; 32],
    len: usize,
}

impl Arg {
    fn bytes(b: &[u8]) -> Arg {
        let mut a = Arg { buf: [0; 32], len: b.len().min(32) };
        a.buf.iter_mut().zip(b).for_each(|(d, s)| *d = *s);
        a
    }

    fn hex(owner: &OwnerToken) -> Arg {
        let mut a = Arg { buf: [0; 32], len: 32 };
        a.buf.iter_mut().zip(crate::hex::digits(&owner.0)).for_each(|(d, s)| *d = s);
        a
    }

    /// `n` in decimal, as `n.to_string()` writes it.
    fn decimal(mut n: u64) -> Arg {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        loop {
            at -= 1;
            if let Some(d) = digits.get_mut(at) {
                *d = b'0' + (n % 10) as u8;
            }
            n /= 10;
            if n == 0 || at == 0 {
                break;
            }
        }
        Arg::bytes(digits.get(at..).unwrap_or_default())
    }

    fn as_slice(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or_default()
    }
}

/// The `authorization` header value for webdis HTTP basic auth from `user:password` (taken from
/// the VM's environment, never from the plugin configuration).
pub fn basic_auth(user_password: &str) -> String {
    format!("Basic {}", crate::base64::b64(user_password.as_bytes()))
}

/// The Redis key of a storage key.
pub fn redis_key(skey: &StorageKey) -> String {
    let mut key = String::with_capacity(KEY_PREFIX.len() + 64);
    key.push_str(KEY_PREFIX);
    crate::hex::encode_into(&skey.0, &mut key);
    key
}

/// The Redis key of a storage key's tombstone, `idemgate:v1:t:{idemgate:v1:<hex>}`: under
/// idemgate's prefix (the store's ACL, docs/stores.md); never a storage key's name
/// (`admin::parse_storage_key` refuses it), so a build that does not know tombstones never reads
/// it as a record; and its hash tag is the record's whole key, so Redis Cluster keeps both in one
/// slot and runs the scripts that name both (a script's keys in two slots are refused,
/// `CROSSSLOT`).
pub fn tombstone_redis_key(skey: &StorageKey) -> String {
    tombstone_redis_key_of(&redis_key(skey))
}

/// `tombstone_redis_key` of a record's Redis key `key` (also how `release::formats` names it).
pub fn tombstone_redis_key_of(key: &str) -> String {
    format!("{KEY_PREFIX}t:{{{key}}}")
}

/// Marks a key's tombstone in Redis: `IGS1T`, then `TOMBSTONE_BODY` and the fingerprint, sealed
/// for the tombstone's own Redis key (`seal`): 5 + 36 + 36 = 77 bytes, whatever the response was.
pub const TOMBSTONE_MAGIC: &[u8; 5] = b"IGS1T";
/// What a tombstone holds inside its seal: this, then the record's fingerprint (32 bytes)
/// (`Record::key_tombstone_bytes`, which the local tier keeps unsealed).
pub const TOMBSTONE_BODY: &[u8; 4] = crate::record::KEY_TOMBSTONE_BODY;

/// The value of `skey`'s tombstone: its record's fingerprint only (no response, no header, no
/// creator), sealed for the tombstone's key.
pub fn tombstone_value(skey: &StorageKey, fingerprint: &Fingerprint, seal: &Seal) -> Vec<u8> {
    tombstone_value_at(&tombstone_redis_key(skey), fingerprint, &[], seal)
}

/// A key's tombstone as any store writes it at its own key `key`: `IGS1T`, then sealed for `key`
/// the key tombstone's bytes (`Record::key_tombstone_bytes`: `TOMBSTONE_BODY` and the
/// fingerprint) and `trailer` (Redis: none, its `PX` times it; etcd: the expiry its writer's clock
/// gave it, `etcd::key_tombstone_value`).
pub fn tombstone_value_at(key: &str, fingerprint: &Fingerprint, trailer: &[u8], seal: &Seal) -> Vec<u8> {
    let body = [Record::key_tombstone_bytes(fingerprint).as_slice(), trailer].concat();
    [&TOMBSTONE_MAGIC[..], &seal.seal(key, &body)].concat()
}

/// The fingerprint `skey`'s tombstone holds, if `v` is one this proxy's seal verifies for its key.
pub fn open_tombstone(v: &[u8], skey: &StorageKey, seal: &Seal) -> Result<Fingerprint, ValueError> {
    match open_tombstone_at(v, &tombstone_redis_key(skey), seal)? {
        (fp, trailer) if trailer.is_empty() => Ok(fp),
        _ => Err(ValueError::Unreadable("stored tombstone: layout".into())),
    }
}

/// The fingerprint and trailer of a tombstone written by `tombstone_value_at` at `key`, if this
/// proxy's seal verifies it for that key.
pub fn open_tombstone_at(v: &[u8], key: &str, seal: &Seal) -> Result<(Fingerprint, Vec<u8>), ValueError> {
    let bad = |why: &str| ValueError::Unreadable(format!("stored tombstone: {why}"));
    let sealed = v.strip_prefix(&TOMBSTONE_MAGIC[..]).ok_or_else(|| bad("no idemgate header"))?;
    let (body, _) = seal.open(key, sealed).map_err(ValueError::Unauthentic)?;
    let head = body.get(..TOMBSTONE_BODY.len() + 32).ok_or_else(|| bad("layout"))?;
    let fp = Record::open_key_tombstone(head).map(|r| r.fingerprint).ok_or_else(|| bad("layout"))?;
    Ok((fp, body.get(head.len()..).unwrap_or_default().to_vec()))
}

/// Room for `Script::command_into`'s command on `key` with `args`, every byte escaped, and
/// `/`...`.raw` around it: the string is never grown while it is built.
fn command_capacity(key: &str, args: &[&[u8]]) -> usize {
    let escaped: usize = args.iter().map(|a| a.len() + 1).sum::<usize>() + 2 * key.len() + 4;
    16 + 40 + escaped.saturating_mul(3)
}

/// A webdis command (`EVALSHA/...` of `script` on `key` with `args`, raw output) as the body of
/// `POST /`, built in one string.
fn script_post(script: Script, key: &str, args: &[&[u8]]) -> StoreRequest {
    let mut body = String::with_capacity(command_capacity(key, args));
    script.command_into(key, args, &mut body);
    body.push_str(".raw");
    StoreRequest { method: "POST", path: "/".into(), body: body.into_bytes(), by_sha1: Some(script) }
}

/// The claim script's ARGV: the claim enters `Forwarded` (the lifecycle's `Claim` from `Absent`,
/// with the fingerprint), living as a forwarded claim; whether the route keeps tombstones (a key
/// with none held answers its tombstone instead of being claimed).
/// The record, sealed for `key`, is the last.
fn claim_args(owner: &OwnerToken, lifetimes: &Lifetimes) -> [Arg; 4] {
    [
        Arg::hex(owner),
        Arg::decimal(lifetimes.life_ms(Stage::Forwarded)),
        Arg::decimal(lifetimes.lock_ms),
        Arg::bytes(if lifetimes.tombstone_ms > 0 { b"1" } else { b"0" }),
    ]
}

/// Claim-or-read: one POST whose body is the webdis command path (`EVALSHA` of the claim script).
pub fn claim_request(
    skey: &StorageKey,
    owner: &OwnerToken,
    record: &Record,
    lifetimes: &Lifetimes,
    seal: &Seal,
) -> StoreRequest {
    let key = redis_key(skey);
    let sealed = seal.seal(&key, &record.encode());
    let [a, b, c, d] = claim_args(owner, lifetimes);
    script_post(Script::Claim, &key, &[a.as_slice(), b.as_slice(), c.as_slice(), d.as_slice(), &sealed])
}

/// The Redis command `claim_request` makes webdis run, with the script in full (as its
/// `with_script` form does): `EVAL script 2 key tombstone-key ARGV...`, for tests that run the
/// script on Redis directly.
pub fn claim_command(
    skey: &StorageKey,
    owner: &OwnerToken,
    record: &Record,
    lifetimes: &Lifetimes,
    seal: &Seal,
) -> Vec<Vec<u8>> {
    let key = redis_key(skey);
    let sealed = seal.seal(&key, &record.encode());
    let tomb = tombstone_redis_key_of(&key);
    let mut cmd = vec![b"EVAL".to_vec(), CLAIM_SCRIPT.as_bytes().to_vec(), b"2".to_vec(), key.into_bytes()];
    cmd.push(tomb.into_bytes());
    cmd.extend(claim_args(owner, lifetimes).iter().map(|a| a.as_slice().to_vec()));
    cmd.push(sealed);
    cmd
}

/// A read (no claim): used by requests waiting for another attempt's result. `GET key`.
pub fn read_request(skey: &StorageKey) -> StoreRequest {
    StoreRequest::command(&format!("GET/{}.raw", encode_arg(redis_key(skey).as_bytes())))
}

/// The answer to `read_request`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadReply {
    Absent,
    Found(StoredValue),
    /// The key holds a value this build cannot decode or verify (see `ClaimReply::Unreadable`).
    Unreadable(ValueError),
}

/// Parses the answer to `read_request(skey)`.
pub fn parse_read_reply(
    status: Option<u16>,
    body: &[u8],
    skey: &StorageKey,
    seal: &Seal,
) -> Result<ReadReply, StoreError> {
    match parse_reply(status, body)? {
        Resp::Bulk(None) => Ok(ReadReply::Absent),
        // A release tombstone holds no record: the key is free.
        Resp::Bulk(Some(v)) if v.starts_with(b"IGS1R") => Ok(ReadReply::Absent),
        Resp::Bulk(Some(v)) => Ok(match StoredValue::open(&v, skey, seal) {
            Ok(value) => ReadReply::Found(value),
            Err(e) => ReadReply::Unreadable(e),
        }),
        _ => Err(garbled("read reply")),
    }
}

/// The phase letters the transition script must find for `event`: the stages the lifecycle lets
/// it leave (`lifecycle::sources`), in the store's encoding.
fn expected_phases(event: Event) -> &'static str {
    phase_letters(|stage| lifecycle::sources(event).contains(&stage))
}

/// The phase letters (`"PU"`, ...) a transition script accepts: those of the stages the store
/// holds that `accepted` takes, in the store's encoding (`stage_letter`), in the order P, D, U.
pub fn phase_letters(accepted: impl Fn(Stage) -> bool) -> &'static str {
    match (accepted(Stage::Forwarded), accepted(Stage::Completed), accepted(Stage::Unknown)) {
        (true, true, true) => "PDU",
        (true, true, false) => "PD",
        (true, false, true) => "PU",
        (false, true, true) => "DU",
        (true, false, false) => "P",
        (false, true, false) => "D",
        (false, false, true) => "U",
        // No stored value can make this transition: the script then changes nothing.
        (false, false, false) => "",
    }
}

/// An owner-checked change of a stored value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub expected_owner: OwnerToken,
    /// Phase letters accepted, e.g. "P" or "PU".
    pub expected_phases: &'static str,
    /// Only if the stored lock has expired by Redis's clock.
    pub require_stale: bool,
    /// `None` deletes the key.
    /// `Forwarded`, `Completed` or `Unknown` (`stage_letter`).
    pub new_phase: Option<Stage>,
    /// The lifecycle event this transition makes (`lifecycle::next`'s row), which a store that
    /// checks a decision before sending it (etcd's fenced transitions) judges by; `None`: an
    /// operator's settlement (`admin::plan`), which the table does not hold and which is checked
    /// by its expected phases and stale lock only.
    pub event: Option<Event>,
    pub new_owner: OwnerToken,
    pub ttl_ms: u64,
    /// A new lock of this many ms from Redis's now, or none.
    pub lock_ms: Option<u64>,
    /// A new record, or keep the stored one.
    pub record: Option<Record>,
    /// With `new_phase: None`: when the key is absent, leave a release tombstone for `ttl_ms`.
    pub tombstone: bool,
    /// What to do when the key is absent (or holds a release tombstone).
    pub where_absent: WhereAbsent,
    /// A completion's key tombstone: the last `key_tombstone_ms` of `ttl_ms` (`Lifetimes::tombstone_ms`;
    /// 0: none). The store keeps the record for the rest (`record_ttl_ms`) and writes the
    /// tombstone (the record's fingerprint only: `tombstone_value` in Redis,
    /// `etcd::key_tombstone_value` in etcd) for the whole of `ttl_ms`, in the same script or
    /// transaction (`key_tombstone_of`).
    pub key_tombstone_ms: u64,
    /// An operator's `forget` (a deletion, new phase `X`): the key's tombstone is deleted with the
    /// record, in the same script, so the next retry executes as `forget` promises
    /// (`admin::FORGOTTEN`). A proxy's own release keeps it: it is the memory of an execution.
    pub forget_tombstone: bool,
}

/// What an owner-checked transition does where it finds no value (the key absent, or a release
/// tombstone): `lifecycle::store_writes_where_absent` says which events write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WhereAbsent {
    /// Change nothing (answer 0).
    Refuse,
    /// Write the new value with the transition's record (answer 2).
    Write,
    /// Write the new value with the transition's record (answer 2); where the owner's claim is
    /// found, keep its stored record (an outcome-unknown mark).
    WriteKeepingStored,
}

impl WhereAbsent {
    fn letter(self) -> u8 {
        match self {
            WhereAbsent::Refuse => b'0',
            WhereAbsent::Write => b'1',
            WhereAbsent::WriteKeepingStored => b'K',
        }
    }

    /// `how` if the store writes `event` where its key is absent, else `Refuse`.
    fn for_event(event: Event, how: WhereAbsent) -> WhereAbsent {
        if lifecycle::store_writes_where_absent(event) {
            how
        } else {
            WhereAbsent::Refuse
        }
    }
}

impl Transition {
    /// Completion by the owner: store the completed record (sent as the PUT body). Where the store
    /// lost the owner's claim, the record is written all the same (answer 2).
    /// The same transition with its record's response body left out (`State::without_body`: the
    /// status and `location` only), for a completion whose whole record the store refused as too
    /// large; `None` for a transition carrying no response.
    pub fn without_body(&self) -> Option<Transition> {
        let record = self.record.as_ref().filter(|r| matches!(r.state, State::Completed(_)))?;
        let record = Record { state: record.state.clone().without_body(), ..record.clone() };
        Some(Transition { record: Some(record), ..self.clone() })
    }

    pub fn complete(owner: OwnerToken, record: Record, lifetimes: &Lifetimes) -> Transition {
        Transition {
            expected_owner: owner,
            expected_phases: expected_phases(Event::Complete),
            require_stale: lifecycle::needs_stale_lock(Event::Complete),
            new_phase: Some(Stage::Completed),
            event: Some(Event::Complete),
            new_owner: owner,
            ttl_ms: lifetimes.life_ms(Stage::Completed),
            lock_ms: None,
            record: Some(record),
            tombstone: false,
            where_absent: WhereAbsent::for_event(Event::Complete, WhereAbsent::Write),
            key_tombstone_ms: lifetimes.tombstone_ms,
            forget_tombstone: false,
        }
    }

    /// Release by the owner: the request never executed.
    pub fn release(owner: OwnerToken) -> Transition {
        Transition {
            expected_owner: owner,
            expected_phases: expected_phases(Event::Release),
            require_stale: lifecycle::needs_stale_lock(Event::Release),
            new_phase: None,
            event: Some(Event::Release),
            new_owner: owner,
            ttl_ms: 1,
            lock_ms: None,
            record: None,
            tombstone: false,
            where_absent: WhereAbsent::Refuse,
            key_tombstone_ms: 0,
            forget_tombstone: false,
        }
    }

    /// Release by the owner of a claim (or take-over) whose answer was lost: it may land later
    /// (a slow link or store). Deletes the claim if it landed; if the key is absent, leaves a
    /// tombstone naming the owner for as long as the claim itself would live, which the claim
    /// script honours: the late claim is refused, any other claim replaces it.
    pub fn release_lost(owner: OwnerToken, lifetimes: &Lifetimes) -> Transition {
        Transition { tombstone: true, ttl_ms: lifetimes.life_ms(Stage::Forwarded), ..Transition::release(owner) }
    }

    /// The owner's request may have executed without a response: outcome-unknown for
    /// `unknown_outcome_seconds` from now (Redis's now: the `PX`). The claim's stored record is
    /// kept; where the store lost the claim, `where_absent` (the owner's record of the request,
    /// `Record::unknown`) is written instead (answer 2), so the key never reads as free.
    pub fn unknown(owner: OwnerToken, where_absent: Record, lifetimes: &Lifetimes) -> Transition {
        Transition {
            record: Some(where_absent),
            where_absent: WhereAbsent::for_event(Event::MarkUnknown, WhereAbsent::WriteKeepingStored),
            ..Transition::to_unknown(owner, Event::MarkUnknown, lifetimes)
        }
    }

    /// Another request's forwarded lock expired (by Redis's clock) without a completion.
    pub fn stale_to_unknown(stale_owner: OwnerToken, lifetimes: &Lifetimes) -> Transition {
        Transition::to_unknown(stale_owner, Event::StaleToUnknown, lifetimes)
    }

    /// `event` to outcome-unknown, keeping the stored record and refusing where absent.
    fn to_unknown(owner: OwnerToken, event: Event, lifetimes: &Lifetimes) -> Transition {
        Transition {
            expected_owner: owner,
            expected_phases: expected_phases(event),
            require_stale: lifecycle::needs_stale_lock(event),
            new_phase: Some(Stage::Unknown),
            event: Some(event),
            new_owner: owner,
            ttl_ms: lifetimes.life_ms(Stage::Unknown),
            lock_ms: None,
            record: None,
            tombstone: false,
            where_absent: WhereAbsent::Refuse,
            key_tombstone_ms: 0,
            forget_tombstone: false,
        }
    }

    /// Replaces another request's value with a claim of our own: a forwarded claim whose lock
    /// expired (`stale_lock: "takeover"`), or, when `free`, any value the decision table judged
    /// free (past its record's expiry; `Summary::is_free`). Either way the script changes the
    /// value only if its lock is not live by Redis's clock (a completed or unknown value holds
    /// none): a claim whose lock is live is never replaced, whatever its record's expiry. The
    /// new value lives as a forwarded claim (`Stage::Forwarded`).
    pub fn take_over(
        stale_owner: OwnerToken,
        owner: OwnerToken,
        record: Record,
        free: bool,
        lifetimes: &Lifetimes,
    ) -> Transition {
        // A free value is claimed anew; a stale forwarded claim is taken over (`stale_lock:
        // "takeover"`). The store holds no never-forwarded claims.
        let event = match free {
            true => Event::Claim { forwarding: true },
            false => Event::TakeOver { how: TakeOver::StaleForwarded, forwarding: true },
        };
        Transition {
            expected_owner: stale_owner,
            expected_phases: expected_phases(event),
            require_stale: lifecycle::needs_stale_lock(event),
            new_phase: Some(Stage::Forwarded),
            event: Some(event),
            new_owner: owner,
            ttl_ms: lifetimes.life_ms(Stage::Forwarded),
            lock_ms: Some(lifetimes.lock_ms),
            record: Some(record),
            tombstone: false,
            where_absent: WhereAbsent::Refuse,
            key_tombstone_ms: 0,
            forget_tombstone: false,
        }
    }

    /// The next round of an MCP call awaiting input (`record::Round::Next`): replaces the
    /// awaiting record `awaiting_owner` completed with a forwarded claim of our own, as a
    /// take-over does (owner- and phase-checked in Redis's script; fenced by the value's
    /// revision in etcd), so of two rounds that met the same awaiting record one continues and
    /// the other finds a claim in flight.
    pub fn continue_round(
        awaiting_owner: OwnerToken,
        owner: OwnerToken,
        record: Record,
        lifetimes: &Lifetimes,
    ) -> Transition {
        Transition {
            event: Some(Event::Continue),
            expected_phases: expected_phases(Event::Continue),
            require_stale: lifecycle::needs_stale_lock(Event::Continue),
            ..Transition::take_over(awaiting_owner, owner, record, true, lifetimes)
        }
    }

    /// The script's ARGV before the record (the record, or `-`, is the last argument).
    fn args(&self) -> [Arg; 8] {
        let phase = self.new_phase.map_or(if self.tombstone { b'R' } else { b'X' }, stage_letter);
        [
            Arg::hex(&self.expected_owner),
            Arg::bytes(self.expected_phases.as_bytes()),
            Arg::bytes(if self.require_stale { b"1" } else { b"0" }),
            Arg::bytes(&[phase]),
            Arg::hex(&self.new_owner),
            Arg::decimal(self.record_ttl_ms()),
            self.lock_ms.map_or(Arg::bytes(b"-"), Arg::decimal),
            Arg::bytes(&[self.where_absent.letter()]),
        ]
    }

    /// How long the store keeps the value itself: `ttl_ms` less the key's tombstone.
    pub fn record_ttl_ms(&self) -> u64 {
        self.ttl_ms.saturating_sub(self.key_tombstone_ms).max(1)
    }

    /// The key's tombstone this transition writes and its `PX` (`ttl_ms`): a completion carrying
    /// a record on a route that keeps tombstones; `F` for an operator's `forget`, which deletes
    /// it; `("-", "0")` otherwise.
    fn tombstone_args(&self, skey: &StorageKey, seal: &Seal) -> (Vec<u8>, Arg) {
        if self.forget_tombstone && self.new_phase.is_none() && !self.tombstone {
            return (b"F".to_vec(), Arg::bytes(b"0"));
        }
        match self.key_tombstone_of() {
            Some(fp) => (tombstone_value(skey, fp, seal), Arg::decimal(self.ttl_ms.max(1))),
            None => (b"-".to_vec(), Arg::bytes(b"0")),
        }
    }

    /// The fingerprint of the key's tombstone this transition writes with its record, for the
    /// whole of `ttl_ms` (the record itself for `record_ttl_ms`): a completion carrying a record
    /// on a route that keeps tombstones. One rule for both stores (Redis's script, etcd's
    /// transaction).
    pub fn key_tombstone_of(&self) -> Option<&Fingerprint> {
        match (&self.record, self.new_phase) {
            (Some(r), Some(Stage::Completed)) if self.key_tombstone_ms > 0 => Some(&r.fingerprint),
            _ => None,
        }
    }

    /// The Redis command `request` makes webdis run, with the script in full (as its
    /// `with_script` form does): `EVAL script 2 key tombstone-key ARGV...`, for tests that run the
    /// script on Redis directly.
    pub fn eval_command(&self, skey: &StorageKey, seal: &Seal) -> Vec<Vec<u8>> {
        let mut cmd = vec![b"EVAL".to_vec(), TRANSITION_SCRIPT.as_bytes().to_vec(), b"2".to_vec()];
        let key = redis_key(skey);
        cmd.push(key.clone().into_bytes());
        cmd.push(tombstone_redis_key(skey).into_bytes());
        cmd.extend(self.args().iter().map(|a| a.as_slice().to_vec()));
        let (tomb, tomb_px) = self.tombstone_args(skey, seal);
        cmd.push(tomb);
        cmd.push(tomb_px.as_slice().to_vec());
        cmd.push(self.record.as_ref().map_or(b"-".to_vec(), |r| seal.seal(&key, &r.encode())));
        cmd
    }

    /// The webdis request: a POST of the command, or a PUT with the record as body when there is
    /// a record (it can be large and binary).
    pub fn request(&self, skey: &StorageKey, seal: &Seal) -> StoreRequest {
        let owned = self.args();
        let (tomb, tomb_px) = self.tombstone_args(skey, seal);
        let [a0, a1, a2, a3, a4, a5, a6, a7] = &owned;
        let [a0, a1, a2, a3, a4, a5, a6, a7] = [a0, a1, a2, a3, a4, a5, a6, a7].map(Arg::as_slice);
        let args = [a0, a1, a2, a3, a4, a5, a6, a7, &tomb, tomb_px.as_slice()];
        let key = redis_key(skey);
        let script = Script::Transition;
        match &self.record {
            // webdis takes a PUT body as the last argument: binary-safe and not inflated.
            Some(r) => {
                let mut path = String::with_capacity(command_capacity(&key, &args));
                path.push('/');
                script.command_into(&key, &args, &mut path);
                path.push_str(".raw");
                StoreRequest { method: "PUT", path, body: seal.seal(&key, &r.encode()), by_sha1: Some(script) }
            }
            None => script_post(script, &key, &[a0, a1, a2, a3, a4, a5, a6, a7, &tomb, tomb_px.as_slice(), b"-"]),
        }
    }
}

/// A RESP value (RESP2, as webdis's `.raw` output gives).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Resp>>),
}

const MAX_RESP_DEPTH: usize = 8;
/// Elements of every array in one answer, all levels together: idemgate's scripts answer at most
/// three. An answer claiming more is garbage, refused before it costs memory.
const MAX_RESP_ELEMENTS: usize = 16;

/// Parses exactly one RESP value; anything else (trailing bytes, truncation, bad lengths) is an
/// error, never a panic. No allocation is sized from a count read in the answer: arrays grow as
/// their elements arrive, and at most `MAX_RESP_ELEMENTS` arrive, so memory stays within a few
/// bytes per answer byte whatever the answer claims.
pub fn parse_resp(bytes: &[u8]) -> Result<Resp, StoreError> {
    parse_resp_within(bytes, MAX_RESP_ELEMENTS)
}

/// The fewest bytes a RESP element takes (`:0\r\n`, `*0\r\n`, `$-1\r\n` and longer).
const MIN_RESP_ELEMENT_BYTES: usize = 4;

/// Parses exactly one RESP value with arrays as long as the answer's bytes can hold: for the
/// operator's listing, whose `SCAN` page holds as many keys as Redis returns (its `COUNT` is a
/// hint). No answer that parses is refused for its length, and memory still stays within a few
/// bytes per answer byte (each element takes at least `MIN_RESP_ELEMENT_BYTES` of it). The
/// filter never reads such an answer: its replies keep `parse_resp`'s bound.
pub fn parse_resp_any_length(bytes: &[u8]) -> Result<Resp, StoreError> {
    parse_resp_within(bytes, bytes.len() / MIN_RESP_ELEMENT_BYTES)
}

/// `parse_resp` with `budget` array elements at most, all levels together.
fn parse_resp_within(bytes: &[u8], mut budget: usize) -> Result<Resp, StoreError> {
    let (v, rest) = parse_one(bytes, 0, &mut budget)?;
    if !rest.is_empty() {
        return Err(StoreError::Garbled("trailing bytes after the RESP value".into()));
    }
    Ok(v)
}

fn garbled(why: &str) -> StoreError {
    StoreError::Garbled(why.to_string())
}

fn line(b: &[u8]) -> Result<(&[u8], &[u8]), StoreError> {
    let end = b.windows(2).position(|w| w == b"\r\n").ok_or_else(|| garbled("RESP line without CRLF"))?;
    Ok((b.get(..end).unwrap_or_default(), b.get(end + 2..).unwrap_or_default()))
}

fn number(b: &[u8]) -> Result<i64, StoreError> {
    std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).ok_or_else(|| garbled("RESP number"))
}

fn parse_one<'a>(b: &'a [u8], depth: usize, budget: &mut usize) -> Result<(Resp, &'a [u8]), StoreError> {
    if depth > MAX_RESP_DEPTH {
        return Err(garbled("RESP nesting too deep"));
    }
    let (&kind, rest) = b.split_first().ok_or_else(|| garbled("empty RESP"))?;
    let (head, rest) = line(rest)?;
    match kind {
        b'+' => Ok((Resp::Simple(String::from_utf8_lossy(head).into_owned()), rest)),
        b'-' => Ok((Resp::Error(String::from_utf8_lossy(head).into_owned()), rest)),
        b':' => Ok((Resp::Integer(number(head)?), rest)),
        b'$' => {
            let n = number(head)?;
            if n < 0 {
                return Ok((Resp::Bulk(None), rest));
            }
            let n = usize::try_from(n).map_err(|_| garbled("RESP length"))?;
            let data = rest.get(..n).ok_or_else(|| garbled("RESP bulk truncated"))?;
            let after = rest.get(n..).ok_or_else(|| garbled("RESP bulk truncated"))?;
            let after = after.strip_prefix(b"\r\n").ok_or_else(|| garbled("RESP bulk without CRLF"))?;
            // The bytes are there: copying them costs one byte per answer byte.
            Ok((Resp::Bulk(Some(data.to_vec())), after))
        }
        b'*' => {
            let n = number(head)?;
            if n < 0 {
                return Ok((Resp::Array(None), rest));
            }
            let n = usize::try_from(n).map_err(|_| garbled("RESP length"))?;
            if n > *budget {
                return Err(garbled("RESP arrays longer than any idemgate answer"));
            }
            *budget -= n;
            // Grown as elements arrive, never sized from the count.
            let mut items = Vec::new();
            let mut rest = rest;
            for _ in 0..n {
                let (v, r) = parse_one(rest, depth + 1, budget)?;
                items.push(v);
                rest = r;
            }
            Ok((Resp::Array(Some(items)), rest))
        }
        _ => Err(garbled("unknown RESP type")),
    }
}

/// An integer, whether Redis sent it as an integer or webdis re-encoded it as a bulk string.
fn as_int(v: &Resp) -> Option<i64> {
    match v {
        Resp::Integer(i) => Some(*i),
        Resp::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

fn check_http(status: Option<u16>) -> Result<(), StoreError> {
    match status {
        Some(200) => Ok(()),
        Some(s) => Err(StoreError::Http(s)),
        None => Err(StoreError::NoAnswer),
    }
}

/// The answer to a command that runs no script by name (a `GET`): any Redis error, NOSCRIPT
/// included, is `StoreError::Redis`.
fn parse_reply(status: Option<u16>, body: &[u8]) -> Result<Resp, StoreError> {
    check_http(status)?;
    match parse_resp(body)? {
        Resp::Error(e) => Err(StoreError::Redis(e)),
        v => Ok(v),
    }
}

/// The error Redis answers to an `EVALSHA` of a script it does not hold: "NOSCRIPT No matching
/// script. Please use EVAL." (Redis 7.0; webdis passes it with HTTP 200).
const NOSCRIPT: &str = "NOSCRIPT";

/// What Redis did with a script call.
enum Ran {
    Answered(Resp),
    /// NOSCRIPT: Redis does not hold the script, so it did not run.
    NoScript,
}

/// The answer to a script call: HTTP 200 with one RESP value. Redis's NOSCRIPT error (its error
/// code, the first word of the error line, exactly `NOSCRIPT`) is its own case; any other error
/// is `StoreError::Redis`. No answer, an HTTP error or bytes that do not parse are never NOSCRIPT.
fn parse_script_reply(status: Option<u16>, body: &[u8]) -> Result<Ran, StoreError> {
    check_http(status)?;
    match parse_resp(body)? {
        Resp::Error(e) if e.split(' ').next() == Some(NOSCRIPT) => Ok(Ran::NoScript),
        Resp::Error(e) => Err(StoreError::Redis(e)),
        v => Ok(Ran::Answered(v)),
    }
}

/// The answer to a claim-or-read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimReply {
    /// This request now holds the key (forwarded-in-progress).
    Claimed { now_ms: u64 },
    /// The key exists: decide on it with Redis's clock. `expires_at_ms` is when Redis drops it
    /// (`now_ms` + its `PTTL`; `u64::MAX` for a key without one).
    Exists { now_ms: u64, expires_at_ms: u64, value: StoredValue },
    /// The key exists (so nothing was claimed) but its value cannot be decoded: damaged, or
    /// written by a later release (another value format or record version) during a rolling
    /// upgrade, or its seal does not verify. The store answered; it is not "unavailable"
    /// (`decision::Lookup::Unreadable`).
    Unreadable { now_ms: u64, why: ValueError },
    /// Redis does not hold the claim script (restarted, failed over, `SCRIPT FLUSH`): nothing ran
    /// and nothing was claimed. Send the request's `with_script` form, once.
    NoScript,
}

/// Parses webdis's answer to `claim_request` made with `owner` (`status` is the HTTP status,
/// `None` if no answer). A "claimed" answer must echo `owner`: one that does not (a store, proxy
/// or mock answering without reading the request) is garbled, so nothing is forwarded on it.
pub fn parse_claim_reply(
    status: Option<u16>,
    body: &[u8],
    owner: &OwnerToken,
    skey: &StorageKey,
    seal: &Seal,
) -> Result<ClaimReply, StoreError> {
    let answer = match parse_script_reply(status, body)? {
        Ran::NoScript => return Ok(ClaimReply::NoScript),
        Ran::Answered(v) => v,
    };
    let Resp::Array(Some(items)) = answer else {
        return Err(garbled("claim reply is not an array"));
    };
    let now_ms =
        items.get(1).and_then(as_int).and_then(|n| u64::try_from(n).ok()).ok_or_else(|| garbled("claim reply time"))?;
    match (items.first().and_then(as_int), items.get(2), items.len()) {
        (Some(1), Some(Resp::Bulk(Some(echo))), 3) if echo.as_slice() == owner.hex().as_bytes() => {
            Ok(ClaimReply::Claimed { now_ms })
        }
        (Some(1), _, _) => Err(garbled("claim reply does not echo the claim's owner")),
        (Some(0), Some(Resp::Bulk(Some(v))), 4) => {
            // PTTL: the remaining ms, or -1 for a key without expiry (never written so: it
            // never expires, which holds the key rather than freeing it). Nothing else is valid.
            let expires_at_ms = match items.get(3).and_then(as_int) {
                Some(-1) => u64::MAX,
                Some(left) => now_ms.saturating_add(u64::try_from(left).map_err(|_| garbled("claim reply pttl"))?),
                None => return Err(garbled("claim reply pttl")),
            };
            Ok(match StoredValue::open(v, skey, seal) {
                Ok(value) => ClaimReply::Exists { now_ms, expires_at_ms, value },
                Err(why) => ClaimReply::Unreadable { now_ms, why },
            })
        }
        // The key's tombstone (no record held): nothing was claimed. Its fingerprint is all it
        // holds; it is judged as a completed record past its own expiry (`Record::key_tombstone`):
        // `key-expired` for the same request, `key-reused` for another.
        (Some(3), Some(Resp::Bulk(Some(v))), 4) => {
            let expires_at_ms = match items.get(3).and_then(as_int) {
                Some(left) if left >= 0 => now_ms.saturating_add(u64::try_from(left).unwrap_or(u64::MAX)),
                // Never written without a PX; one without reads as held, never free.
                Some(-1) => u64::MAX,
                _ => return Err(garbled("claim reply pttl")),
            };
            Ok(match open_tombstone(v, skey, seal) {
                Ok(fp) => ClaimReply::Exists { now_ms, expires_at_ms, value: StoredValue::key_tombstone(fp) },
                Err(why) => ClaimReply::Unreadable { now_ms, why },
            })
        }
        _ => Err(garbled("claim reply shape")),
    }
}

/// The answer to an owner-checked transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransitionReply {
    /// The value was changed (1).
    Changed,
    /// Nothing changed (0): the value is not the expected owner's, or not in an expected phase, or
    /// its lock is live.
    Refused,
    /// The key was absent (or a release tombstone) and the new value was written there (2): the
    /// store had lost the owner's claim (`WhereAbsent`).
    ClaimGoneRewritten,
    /// Redis does not hold the transition script (restarted, failed over, `SCRIPT FLUSH`): nothing
    /// ran and nothing changed. Send the request's `with_script` form, once.
    NoScript,
    /// etcd only: the owner's claim is not there and the key is absent; nothing was written yet.
    /// A write that writes where absent sends its second transaction
    /// (`etcd::where_absent_request`), which writes only if the key is still absent.
    Absent,
}

impl TransitionReply {
    /// The store holds the transition's new value.
    pub fn written(self) -> bool {
        matches!(self, TransitionReply::Changed | TransitionReply::ClaimGoneRewritten)
    }
}

/// Whether webdis refused a request for its size (over its `http_max_request_size`, 413 Request
/// Entity Too Large): nothing reached Redis.
pub fn refused_as_too_large(status: Option<u16>) -> bool {
    status == Some(413)
}

/// Parses the answer to a transition: `{n, new owner hex}` (`TRANSITION_SCRIPT`). `echo`: the new
/// owner the request named, when the caller acts on a change (a take-over forwards on it): an
/// answer echoing another owner is garbled. Whatever `echo`, an answer without one (a bare
/// integer) is garbled: webdis 0.1.9 writes a command's late answer to the connection that reuses
/// the file descriptor of a client that went away, so a request can read another request's answer
/// (docs/stores.md).
pub fn parse_transition_reply(
    status: Option<u16>,
    body: &[u8],
    echo: Option<&OwnerToken>,
) -> Result<TransitionReply, StoreError> {
    let answer = match parse_script_reply(status, body)? {
        Ran::NoScript => return Ok(TransitionReply::NoScript),
        Ran::Answered(v) => v,
    };
    let Resp::Array(Some(items)) = answer else { return Err(garbled("transition reply is not its own")) };
    let (Some(code), Some(Resp::Bulk(Some(echoed))), 2) = (items.first().and_then(as_int), items.get(1), items.len())
    else {
        return Err(garbled("transition reply shape"));
    };
    if echo.is_some_and(|owner| echoed.as_slice() != owner.hex().as_bytes()) {
        return Err(garbled("transition reply does not echo the request's new owner"));
    }
    match code {
        1 => Ok(TransitionReply::Changed),
        0 => Ok(TransitionReply::Refused),
        2 => Ok(TransitionReply::ClaimGoneRewritten),
        _ => Err(garbled("transition reply")),
    }
}

#[cfg(test)]
mod tests;
