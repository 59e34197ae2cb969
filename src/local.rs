//! The local tier: records shared by all worker threads of one Envoy, in proxy-wasm shared data.
//!
//! Two host facts decide the design (../shared/PROXY_WASM_NOTES.md):
//! - a CAS write to an **absent** key simply inserts it, so "insert if absent" is not atomic;
//! - a key name, once written, is never freed.
//!
//! So the table is a set of key names whose number is bounded, the buckets created once (only
//! where truly absent) when the plugin is configured, before its VM serves traffic, and every
//! state change afterwards is a compare-and-swap on a key that exists. Layout v4
//! (docs/local-tier.md has the sizing and the bound analysis):
//!
//! - **Set-associative buckets** `<prefix>.b.<i>`: `B = ceil(max_entries / 32)` buckets of
//!   `BUCKET_WIDTH` (64) positions (a table of at most 64 records is one bucket of `max_entries`
//!   positions). A key lives in bucket `skey mod B`, and nowhere else. A bucket's value holds its
//!   occupied positions **and its own accounting**: the bytes its body keys hold (against its
//!   share of `local.max_bytes`: three quarters of it over `B`) and the age of its last eviction. So a claim is
//!   one read and one CAS of one bucket, capacity and eviction are decided within the bucket, and
//!   no table-wide counter is on the request path.
//! - **Body keys** `<prefix>.r.<i>.<j>`, one per position ever used: the stored record (creator
//!   and response), prefixed with its owner's token and the storage key. The owner writes it just
//!   before the bucket CAS that completes its claim; a reader checks the token, so a body left by
//!   an earlier owner of the position (or a stale owner's late write) is never replayed for
//!   another's record. The bucket counts the bytes a body key holds until a later owner of its
//!   position replaces them. Past its record's own expiry (`tombstone_seconds`) a completed
//!   record's body key holds only its key's tombstone (`Table::shrink`, `TOMBSTONE_BODY_BYTES`).
//! - **The pool** `<prefix>.pool` (`pool`): the table-wide part of `local.max_bytes` (a quarter;
//!   the buckets' shares are the rest, so shares and pool add up to `max_bytes` exactly). Only a
//!   body that does not fit its bucket's remaining share takes bytes from it: its owner lists a
//!   reservation (bucket, position, owner, bytes, body CAS) before writing the body with a CAS,
//!   and its entry counts 0 bytes in the bucket. A reservation goes back when its completion
//!   fails, and otherwise at the sweep of its bucket once its position no longer holds its owner
//!   (`Table::sweep`, `Table::settle_stale`). Created with the buckets, or alone on a table made
//!   by a v4 module without it (the bucket encoding is unchanged: both read each other's).
//! - `<prefix>.ready`: set once every bucket exists.
//!
//! Gauges (records, bytes, last eviction age) are sums over the buckets, made off the request
//! path by the tick's sweep (`Gauges`).
//!
//! A full bucket gives a new key the place of its oldest completed or outcome-unknown record
//! older than that record's own floor (`Entry::floor_ms`, written by the configuration that wrote
//! it: every configuration of the VM with the same `max_entries` shares the table), with
//! `when_full: "evict_oldest"` (the default); never a claim in flight. With none, the answer is
//! `Begin::Full` (503 `capacity-exhausted`, or, with a store, no local copy).
//!
//! `<prefix>` is `idemgate.v4.local.n<max_entries>`: the layout version and the capacity are in
//! the names, so a module with another layout, or a changed `local.max_entries`, starts a fresh
//! table instead of misreading this one. After a hot reload from a v3 module, the v3 table's
//! records are honoured read-only (`v3`): a key v4 does not hold is looked up there before it is
//! claimed.
//!
//! Everything here is plain Rust over the `SharedData` trait, tested against a model with the
//! host's exact semantics (`memory::MemoryShared`) under many interleavings of several workers.

use crate::config::{LocalConfig, Policy, WhenFull};
use crate::decision::{decide, Decision, Lookup, Phase, Summary};
use crate::fingerprint::Fingerprint;
use crate::lifecycle::{self, Event, Facts, Refusal, TakeOver};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage, State, UnknownReason};
use crate::scope::StorageKey;

#[cfg(any(test, feature = "testkit"))]
pub mod memory;
pub mod pool;
pub mod v3;

use pool::{Pool, Reservation};

/// The table's layout, in every shared-data name it uses (`idemgate.<LAYOUT>.local.n<max_entries>`).
pub const LAYOUT: &str = "v4";

/// Positions a bucket holds at most (its value holds only the occupied ones).
pub const BUCKET_WIDTH: usize = 64;
/// Average records per bucket at `max_entries`: `buckets = ceil(max_entries / DENSITY)`, half
/// their width, so under uniform keys a first bucket overflows only past `max_entries`.
pub const DENSITY: u64 = 32;
/// How many times an operation retries after losing a CAS race before giving up.
const MAX_CAS_RETRIES: usize = 64;
const BUCKET_MAGIC: &[u8; 4] = b"IGB\x04";
/// An entry's fixed part: position, stage, key, fingerprint, owner, four times, status, body
/// bytes, floor, creator length (the creator's bytes follow, at most `MAX_CREATOR_BYTES`).
const ENTRY_BYTES: usize = 1 + 1 + 32 + 33 + 16 + 8 + 8 + 8 + 2 + 4 + 8 + 1;
/// The creator an in-flight entry keeps (to name the run holding the key in a 409).
const MAX_CREATOR_BYTES: usize = 255;
/// The bucket's header: magic, the last eviction's instant and age, the entry count.
const HEADER_BYTES: usize = 4 + 8 + 8 + 1;
/// The pool's part of `local.max_bytes` is `max_bytes / POOL_DIVISOR` (plus what the division
/// into bucket shares leaves).
const POOL_DIVISOR: u64 = 4;

/// The host's shared data, exactly as proxy-wasm exposes it.
pub trait SharedData {
    /// The value and its CAS; `(None, None)` for a key never written; `(None, Some(cas))` after
    /// a removal (an empty value).
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError>;
    /// With `cas: None` always succeeds. With `Some(c)`: fails with `CasMismatch` when the key
    /// exists with another CAS, and **inserts** when the key is absent.
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}

/// The host refused a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetError {
    CasMismatch,
    Host,
}

/// Why the local tier could not answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalError {
    /// A host call failed.
    Host,
    /// A bucket is missing: the table was not created (the plugin was not configured).
    Missing,
    /// A bucket could not be decoded.
    Corrupt,
    /// Too many lost CAS races in a row.
    Contended,
    /// The lifecycle refused a transition the decision table chose (`lifecycle::next`): a broken
    /// invariant, answered like any other local error (503), never forwarded.
    Refused(Refusal),
}

impl From<HostError> for LocalError {
    fn from(_: HostError) -> LocalError {
        LocalError::Host
    }
}

/// One occupied position of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub skey: StorageKey,
    pub fingerprint: Option<Fingerprint>,
    /// Claimed, Forwarded, Completed or Unknown (never `Absent`: that is an empty position).
    pub stage: Stage,
    pub owner: OwnerToken,
    /// When the entry entered its stage: its claim, then its completion or outcome-unknown mark
    /// (the eviction floor counts from it: only finished records are ever evicted).
    pub since_ms: u64,
    pub expires_at_ms: u64,
    /// A claim's lock. For a completed entry (no lock), when its record turns into its key's
    /// tombstone (the record's own expiry: `Record::is_tombstone`), the sweep's cue to shrink its
    /// body to the tombstone (`Table::shrink`), then `expires_at_ms` once shrunk. An entry completed
    /// by an earlier module holds its claim's lock there: earlier, so the shrink reads the record
    /// first and leaves it until it is one.
    pub lock_expires_at_ms: u64,
    /// The status of a completed record (0 otherwise).
    pub status: u16,
    /// Bytes the position's body key holds (this record's, or, before it completes, those an
    /// earlier owner of the position left), counted in the bucket's share of `max_bytes`.
    pub body_bytes: u32,
    /// The entry's own protection floor: it may be evicted only once `since_ms + floor_ms` has
    /// passed (`u64::MAX`: never, it is kept until it expires). Set by the configuration that
    /// claimed the key (`Table::entry_floor_ms`) and only ever raised by the ones that complete
    /// or mark it (another listener may mark a stale claim outcome-unknown), so the protection a
    /// record was promised holds whatever other configuration shares the table (another listener
    /// in the same VM, or a reload) and evicts.
    pub floor_ms: u64,
    /// The run that claimed it (`encode_creator`), kept until completion (the body has it then):
    /// a 409 names it without reading another key. Empty when too long to keep.
    pub creator: Vec<u8>,
}

/// The stage of a position (empty: `Absent`).
fn stage_of(p: &Option<Entry>) -> Stage {
    p.as_ref().map_or(Stage::Absent, |e| e.stage)
}

/// The one lifecycle (`lifecycle::next`) applied to a position at `now_ms`, for a caller holding
/// `h`'s claim when `h` is given.
fn step(p: &Option<Entry>, event: Event, h: Option<&Handle>, now_ms: u64) -> Result<Stage, Refusal> {
    let facts = match p {
        Some(e) => Facts::of(&e.summary(), now_ms, h.is_some_and(|h| e.owner == h.owner && e.skey == h.skey)),
        None => Facts::default(),
    };
    lifecycle::next(stage_of(p), event, facts)
}

impl Entry {
    fn summary(&self) -> Summary {
        let lock_expires_at_ms = self.lock_expires_at_ms;
        let phase = match self.stage {
            Stage::Claimed | Stage::Absent => Phase::Claimed { lock_expires_at_ms },
            Stage::Forwarded => Phase::Forwarded { lock_expires_at_ms },
            Stage::Completed => Phase::Completed,
            Stage::Unknown => Phase::Unknown,
        };
        Summary { fingerprint: self.fingerprint, expires_at_ms: self.expires_at_ms, phase }
    }

    /// The core's rule (`Summary::is_free`): past its expiry and holding no live lock.
    fn is_free(&self, now_ms: u64) -> bool {
        self.summary().is_free(now_ms)
    }

    /// Whether this entry holds `skey` at `now_ms` (a position holds a key until it is free).
    fn holds(&self, skey: &StorageKey, now_ms: u64) -> bool {
        self.skey == *skey && !self.is_free(now_ms)
    }

    /// Whether eviction may drop it (`Event::Evict`): never a live claim (that would allow a
    /// second execution of a request still running).
    fn evictable(&self, now_ms: u64) -> bool {
        lifecycle::next(self.stage, Event::Evict, Facts::of(&self.summary(), now_ms, false)).is_ok()
            && now_ms.saturating_sub(self.since_ms) >= self.floor_ms
    }

    fn creator(&self) -> Option<Creator> {
        decode_creator(&self.creator)
    }
}

fn stage_tag(s: Stage) -> u8 {
    match s {
        Stage::Absent | Stage::Claimed => 1,
        Stage::Forwarded => 2,
        Stage::Completed => 3,
        Stage::Unknown => 4,
    }
}

/// A bucket: `width` positions, the bytes left in the body keys of its empty positions, and its
/// last eviction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub positions: Vec<Option<Entry>>,
    /// For an empty position: the bytes its body key still holds (a freed record's body, replaced
    /// by the position's next owner). Counted in the bucket's bytes until then.
    pub left: Vec<u32>,
    /// When the bucket last evicted a record, and that record's age (ms).
    pub evicted_at_ms: u64,
    pub evicted_age_ms: u64,
}

impl Bucket {
    pub fn empty() -> Bucket {
        Bucket::of_width(BUCKET_WIDTH)
    }

    pub fn of_width(width: usize) -> Bucket {
        Bucket { positions: vec![None; width], left: vec![0; width], evicted_at_ms: 0, evicted_age_ms: 0 }
    }

    /// Header (magic, last eviction instant and age, entry count), each entry (position, stage
    /// tag, fields, creator), then the count and list of (position, bytes) left in body keys.
    pub fn encode(&self) -> Vec<u8> {
        let used = self.positions.iter().filter(|p| p.is_some()).count();
        let mut out = Vec::with_capacity(HEADER_BYTES + 1 + used * (ENTRY_BYTES + 36));
        out.extend_from_slice(BUCKET_MAGIC);
        out.extend_from_slice(&self.evicted_at_ms.to_le_bytes());
        out.extend_from_slice(&self.evicted_age_ms.to_le_bytes());
        out.push(u8::try_from(used).unwrap_or(u8::MAX));
        for (j, p) in self.positions.iter().enumerate() {
            let Some(e) = p else { continue };
            encode_entry(&mut out, j, e);
        }
        let left: Vec<(usize, u32)> = self.left.iter().copied().enumerate().filter(|(_, b)| *b > 0).collect();
        out.push(u8::try_from(left.len()).unwrap_or(u8::MAX));
        for (j, b) in left {
            out.push(u8::try_from(j).unwrap_or(u8::MAX));
            out.extend_from_slice(&b.to_le_bytes());
        }
        out
    }

    /// Refuses an unknown magic or tag, a position out of range or not in increasing order,
    /// truncation and trailing bytes.
    pub fn decode(bytes: &[u8]) -> Option<Bucket> {
        Bucket::decode_width(bytes, BUCKET_WIDTH)
    }

    /// `decode` for a bucket of `width` positions.
    pub fn decode_width(bytes: &[u8], width: usize) -> Option<Bucket> {
        let r = bytes.strip_prefix(BUCKET_MAGIC.as_slice())?;
        let u64_of = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
        let mut b = Bucket::of_width(width);
        b.evicted_at_ms = u64_of(r.get(0..8)?)?;
        b.evicted_age_ms = u64_of(r.get(8..16)?)?;
        let (&used, mut r) = r.get(16..)?.split_first()?;
        let mut next = 0usize;
        for _ in 0..used {
            let (j, entry, rest) = decode_entry(r, width, next)?;
            next = j + 1;
            r = rest;
            *b.positions.get_mut(j)? = Some(entry);
        }
        let (&n, mut r) = r.split_first()?;
        for _ in 0..n {
            let (&j, tail) = r.split_first()?;
            let bytes = u32::from_le_bytes(tail.get(..4)?.try_into().ok()?);
            r = tail.get(4..)?;
            let j = usize::from(j);
            if b.positions.get(j)?.is_some() {
                return None;
            }
            *b.left.get_mut(j)? = bytes;
        }
        r.is_empty().then_some(b)
    }

    pub fn occupied(&self) -> u64 {
        self.positions.iter().filter(|p| p.is_some()).count() as u64
    }

    /// Bytes its body keys hold (its share of `max_bytes` bounds it).
    pub fn bytes(&self) -> u64 {
        let held: u64 = self.positions.iter().flatten().map(|e| u64::from(e.body_bytes)).sum();
        held + self.left.iter().map(|b| u64::from(*b)).sum::<u64>()
    }

    /// Empties position `j`; the bytes its body key holds stay counted (`left`).
    fn free(&mut self, j: usize) -> Option<Entry> {
        let e = self.positions.get_mut(j)?.take()?;
        if let Some(l) = self.left.get_mut(j) {
            *l = e.body_bytes;
        }
        Some(e)
    }
}

/// Appends entry `e` at position `j` as a bucket holds it: position, stage tag, fields, creator
/// (`ENTRY_BYTES` and the creator's bytes).
#[inline(always)]
fn encode_entry(out: &mut Vec<u8>, j: usize, e: &Entry) {
    out.push(u8::try_from(j).unwrap_or(u8::MAX));
    out.push(stage_tag(e.stage));
    out.extend_from_slice(&e.skey.0);
    match &e.fingerprint {
        None => out.extend_from_slice(&[0u8; 33]),
        Some(fp) => {
            out.push(1);
            out.extend_from_slice(&fp.0);
        }
    }
    out.extend_from_slice(&e.owner.0);
    out.extend_from_slice(&e.since_ms.to_le_bytes());
    out.extend_from_slice(&e.expires_at_ms.to_le_bytes());
    out.extend_from_slice(&e.lock_expires_at_ms.to_le_bytes());
    out.extend_from_slice(&e.status.to_le_bytes());
    out.extend_from_slice(&e.body_bytes.to_le_bytes());
    out.extend_from_slice(&e.floor_ms.to_le_bytes());
    let creator = e.creator.get(..MAX_CREATOR_BYTES.min(e.creator.len())).unwrap_or(&[]);
    out.push(u8::try_from(creator.len()).unwrap_or(0));
    out.extend_from_slice(creator);
}

/// Decodes the entry at the start of `r`: its position (at least `next`, under `width`), the
/// entry, and the bytes after it.
#[inline(always)]
fn decode_entry(r: &[u8], width: usize, next: usize) -> Option<(usize, Entry, &[u8])> {
    let u64_of = |b: &[u8]| b.try_into().ok().map(u64::from_le_bytes);
    let (&j, tail) = r.split_first()?;
    let j = usize::from(j);
    if j < next || j >= width {
        return None;
    }
    let (&tag, tail) = tail.split_first()?;
    let stage = match tag {
        1 => Stage::Claimed,
        2 => Stage::Forwarded,
        3 => Stage::Completed,
        4 => Stage::Unknown,
        _ => return None,
    };
    let body = tail.get(..ENTRY_BYTES - 2)?;
    let arr = |from: usize, to: usize| body.get(from..to);
    let u64_at = |at: usize| arr(at, at + 8).and_then(u64_of);
    let fingerprint = match body.get(32)? {
        0 => None,
        1 => Some(Fingerprint(arr(33, 65)?.try_into().ok()?)),
        _ => return None,
    };
    let creator_len = usize::from(*body.get(ENTRY_BYTES - 3)?);
    let creator = tail.get(ENTRY_BYTES - 2..ENTRY_BYTES - 2 + creator_len)?.to_vec();
    let rest = tail.get(ENTRY_BYTES - 2 + creator_len..)?;
    let e = Entry {
        skey: StorageKey(arr(0, 32)?.try_into().ok()?),
        fingerprint,
        stage,
        owner: OwnerToken(arr(65, 81)?.try_into().ok()?),
        since_ms: u64_at(81)?,
        expires_at_ms: u64_at(89)?,
        lock_expires_at_ms: u64_at(97)?,
        status: u16::from_le_bytes(arr(105, 107)?.try_into().ok()?),
        body_bytes: u32::from_le_bytes(arr(107, 111)?.try_into().ok()?),
        floor_ms: u64_at(111)?,
        creator,
    };
    Some((j, e, rest))
}

/// A bucket's value read without decoding its entries: where each entry lies, and the bytes the
/// bucket counts. An operation on one entry (`Table::complete`) decodes
/// only that one and writes the same value back with that entry replaced:
/// byte for byte what `Bucket::decode`, a change to that entry and `Bucket::encode` give.
struct RawBucket {
    bytes: Vec<u8>,
    /// Per occupied position, in order: (position, offset, length).
    entries: Vec<(usize, usize, usize)>,
    /// Bytes the bucket counts (`Bucket::bytes`).
    counted: u64,
}

/// Where, in an entry, its body bytes lie.
const ENTRY_BODY_BYTES_AT: usize = 2 + 107;

impl RawBucket {
    /// Indexes a bucket of `width` positions; refuses what `Bucket::decode_width` refuses in its
    /// layout (magic, positions out of range or order, lengths, trailing bytes, a `left` at an
    /// occupied position), checking the stage tag of every entry but decoding none.
    fn index(bytes: Vec<u8>, width: usize) -> Option<RawBucket> {
        let header = BUCKET_MAGIC.len() + 16;
        if bytes.get(..BUCKET_MAGIC.len())? != BUCKET_MAGIC.as_slice() {
            return None;
        }
        let used = usize::from(*bytes.get(header)?);
        let mut at = header + 1;
        let mut entries = Vec::with_capacity(used);
        let mut occupied = [false; 256];
        let mut counted = 0u64;
        let mut next = 0usize;
        for _ in 0..used {
            let j = usize::from(*bytes.get(at)?);
            if j < next || j >= width || !(1..=4).contains(bytes.get(at + 1)?) {
                return None;
            }
            next = j + 1;
            let len = ENTRY_BYTES + usize::from(*bytes.get(at + ENTRY_BYTES - 1)?);
            bytes.get(at..at + len)?;
            let b = bytes.get(at + ENTRY_BODY_BYTES_AT..at + ENTRY_BODY_BYTES_AT + 4)?;
            counted += u64::from(u32::from_le_bytes(b.try_into().ok()?));
            *occupied.get_mut(j)? = true;
            entries.push((j, at, len));
            at += len;
        }
        let n = usize::from(*bytes.get(at)?);
        at += 1;
        for _ in 0..n {
            let j = usize::from(*bytes.get(at)?);
            if j >= width || *occupied.get(j)? {
                return None;
            }
            let b = bytes.get(at + 1..at + 5)?;
            counted += u64::from(u32::from_le_bytes(b.try_into().ok()?));
            at += 5;
        }
        (at == bytes.len()).then_some(RawBucket { bytes, entries, counted })
    }

    /// The entry at position `j` (`None`: empty), decoded.
    fn entry(&self, j: usize) -> Option<Entry> {
        let &(_, at, len) = self.entries.iter().find(|(p, _, _)| *p == j)?;
        decode_entry(self.bytes.get(at..at + len)?, BUCKET_WIDTH.max(j + 1), 0).map(|(_, e, _)| e)
    }

    /// The value with the (occupied) entry at position `j` replaced by `e`; `None` when `j` is
    /// empty.
    fn with_entry(&self, j: usize, e: &Entry) -> Option<Vec<u8>> {
        let &(_, at, len) = self.entries.iter().find(|(p, _, _)| *p == j)?;
        let mut out = Vec::with_capacity(self.bytes.len() + MAX_CREATOR_BYTES);
        out.extend_from_slice(self.bytes.get(..at)?);
        encode_entry(&mut out, j, e);
        out.extend_from_slice(self.bytes.get(at + len..)?);
        Some(out)
    }
}

/// A claim held by this request: where it lives and who holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    pub bucket: u32,
    pub position: usize,
    pub owner: OwnerToken,
    pub skey: StorageKey,
}

/// The result of `Table::begin`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Begin {
    /// This request now holds the key, forwarded (made only with the fingerprint): forward it.
    Claimed { handle: Handle, took_over: bool, evicted: bool },
    /// Completed before: replay this record.
    Replay(Record),
    /// Answer with this problem; `creator` names the run that made the record, when known.
    Reject { problem: ProblemKind, creator: Option<Creator>, marked_unknown: bool },
    /// The decision needs the fingerprint: buffer the body, then call `begin_after` with it and
    /// `seen` (the bucket as read now, when the key was free to claim).
    NeedFingerprint { seen: Option<Seen> },
    /// The key's bucket holds only unexpired records that may not be evicted.
    Full,
}

/// A key's bucket as `begin` read it at request headers, with its CAS (`Begin::NeedFingerprint`):
/// the claim at the body's end makes its first CAS on it (`Table::begin_after`). Kept encoded
/// (the value as shared data holds it: a few bytes per record the bucket holds).
///
/// Only a read at most `SEEN_MAX_AGE_MS` old is used: Envoy's CAS is one process-wide 32-bit
/// counter, so a bucket's CAS can come round to the value read after 2^32 writes in the process,
/// which a read kept for a whole slow upload could otherwise span (the CAS would then pass on a
/// bucket that changed). 2^32 writes within that bound would take over 400 million writes a
/// second, far beyond one mutex-guarded map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    bucket: u32,
    value: Vec<u8>,
    cas: u32,
    read_at_ms: u64,
}

/// How long a bucket read kept from request headers (`Seen`) may be used for the claim's CAS;
/// an older one (or one from a clock that went back) is read again.
pub const SEEN_MAX_AGE_MS: u64 = 10_000;

impl Seen {
    /// The bytes it keeps (the filter counts them in the worker's buffer budget).
    pub fn bytes(&self) -> u64 {
        self.value.len() as u64
    }
}

/// A live record read without claiming anything (`Table::peek`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peeked {
    pub summary: Summary,
    /// The record, when it is completed and its body could be read.
    pub record: Option<Record>,
    /// The response status the index keeps (0 before completion).
    pub status: u16,
}

/// What a completion did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completed {
    /// The record was stored with its response.
    Stored,
    /// Stored without its body (over `max_response_body_bytes` or `local.max_bytes`).
    StoredWithoutBody,
    /// The claim was no longer ours (taken over): nothing written.
    LostClaim,
}

/// The local table's geometry and names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    prefix: String,
    buckets: u32,
    /// Positions per bucket.
    width: usize,
    max_entries: u64,
    max_bytes: u64,
    when_full: WhenFull,
    /// The protection floor this configuration gives the records it writes (each entry keeps
    /// its own: `Entry::floor_ms`).
    floor_ms: u64,
    /// The v3 table of a module this one replaced by a hot reload, consulted read-only.
    v3: Option<v3::V3>,
}

impl Table {
    pub fn new(cfg: &LocalConfig) -> Table {
        let small = cfg.max_entries <= BUCKET_WIDTH as u64;
        let buckets = if small { 1 } else { cfg.max_entries.div_ceil(DENSITY).clamp(1, u64::from(u32::MAX)) };
        let width = if small { usize::try_from(cfg.max_entries.max(1)).unwrap_or(BUCKET_WIDTH) } else { BUCKET_WIDTH };
        Table {
            prefix: format!("idemgate.{LAYOUT}.local.n{}", cfg.max_entries),
            buckets: u32::try_from(buckets).unwrap_or(u32::MAX),
            width,
            max_entries: cfg.max_entries,
            max_bytes: cfg.max_bytes,
            when_full: cfg.when_full,
            floor_ms: cfg.min_protection_seconds.saturating_mul(1000),
            v3: None,
        }
    }

    /// With an external store the local tier is a cache: the store keeps every record, so a full
    /// bucket evicts the oldest finished record whatever its age (a claim in flight still never).
    /// Only records this configuration writes get no floor: a record another configuration wrote
    /// (another listener of the VM without a store, or this one before a reload added the store)
    /// keeps its own.
    pub fn as_cache(mut self) -> Table {
        self.when_full = WhenFull::EvictOldest;
        self.floor_ms = 0;
        self
    }

    /// Honours the records of a v3 table of the same `max_entries` when a v3 module created one
    /// in this Envoy (a hot reload from it): a key this table does not hold is looked up there
    /// before it is claimed. Returns whether it found one.
    pub fn consult_v3_if_present(&mut self, sd: &mut dyn SharedData) -> bool {
        let old = v3::V3::new(self.max_entries);
        self.v3 = old.present(sd).then_some(old);
        self.v3.is_some()
    }

    /// The floor of an entry this configuration writes: its `min_protection_seconds` when it
    /// evicts (`evict_oldest`), none as a cache, and never evicted under `when_full: "reject"`
    /// (that configuration promised to keep every record until it expires).
    fn entry_floor_ms(&self) -> u64 {
        match self.when_full {
            WhenFull::EvictOldest => self.floor_ms,
            _ => u64::MAX,
        }
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    /// Positions per bucket.
    pub fn width(&self) -> usize {
        self.width
    }

    /// `local.max_entries`: the records the table is sized for (a bucket overflows first, under
    /// uniform keys, only past it: docs/local-tier.md).
    pub fn capacity(&self) -> u64 {
        self.max_entries
    }

    /// The most records it can ever hold: every position of every bucket.
    pub fn positions(&self) -> u64 {
        u64::from(self.buckets) * self.width as u64
    }

    /// A bucket's share of `local.max_bytes`: the bytes its body keys may hold (counted in the
    /// bucket). The buckets share `max_bytes` less a quarter, the pool's part (`pool_bytes`).
    pub fn bucket_bytes(&self) -> u64 {
        (self.max_bytes - self.max_bytes / POOL_DIVISOR) / u64::from(self.buckets.max(1))
    }

    /// The table-wide pool's part of `local.max_bytes`: what the bucket shares leave of it, so
    /// `buckets x bucket_bytes + pool_bytes = max_bytes`. Only a body that does not fit its
    /// bucket's remaining share takes bytes from it.
    pub fn pool_bytes(&self) -> u64 {
        self.max_bytes - self.bucket_bytes() * u64::from(self.buckets.max(1))
    }

    /// Bytes of the bucket index with every position held (an empty table holds only the bucket
    /// names and their headers).
    pub fn max_index_bytes(&self) -> u64 {
        u64::from(self.buckets) * (HEADER_BYTES + 1) as u64 + self.positions() * (ENTRY_BYTES + 5) as u64
    }

    /// What the table holds and supports, for the configure-time log line: a record lives
    /// `ttl_seconds`, so `capacity / ttl_seconds` protected requests a second fit without
    /// evicting. "Reserved" is the most it may take: the index with every position held plus
    /// `max_bytes` of responses (memory follows use up to that).
    pub fn describe(&self, ttl_seconds: u64) -> String {
        let mib = (self.max_index_bytes() + self.max_bytes) as f64 / (1024.0 * 1024.0);
        let rate = self.max_entries as f64 / ttl_seconds.max(1) as f64;
        format!(
            "idemgate: local table: capacity {} records ({} buckets of {}), {mib:.0} MiB reserved, supports {rate:.1} protected requests/s sustained at ttl_seconds {ttl_seconds}",
            self.max_entries, self.buckets, self.width
        )
    }

    /// Whether occupancy went from under 80 % of capacity to at least that (a warning is due).
    pub fn crossed_high_water(&self, before: u64, now: u64) -> bool {
        let mark = self.max_entries.saturating_mul(8).div_ceil(10);
        before < mark && now >= mark
    }

    pub fn bucket_name(&self, i: u32) -> Name {
        Name::of(format_args!("{}.b.{i}", self.prefix))
    }

    /// The body key of position `j` of bucket `i`.
    pub fn body_name(&self, i: u32, j: usize) -> Name {
        Name::of(format_args!("{}.r.{i}.{j}", self.prefix))
    }

    /// The table-wide pool of bytes for bodies too large for their bucket (`pool`).
    pub fn pool_name(&self) -> Name {
        Name::of(format_args!("{}.pool", self.prefix))
    }

    fn ready_name(&self) -> Name {
        Name::of(format_args!("{}.ready", self.prefix))
    }

    pub fn bucket_of(&self, skey: &StorageKey) -> u32 {
        let mut first = [0u8; 8];
        first.copy_from_slice(skey.0.get(24..32).unwrap_or(&[0u8; 8]));
        u32::try_from(u64::from_le_bytes(first) % u64::from(self.buckets)).unwrap_or(0)
    }

    /// Creates the buckets where they are truly absent; never touches one that exists (a worker
    /// starting or a configuration reload keeps live records). Returns how many keys it created.
    /// Call it when the plugin is configured, before traffic: Envoy configures the main-thread VM
    /// before any worker serves a request.
    pub fn ensure_created(&self, sd: &mut dyn SharedData) -> Result<u32, LocalError> {
        // The pool is created on its own: a table made by the first v4 module (82b9130) has its
        // buckets and `ready` but no pool. Only where truly absent, as the buckets.
        let mut created = 0;
        if let (None, None) = sd.get(&self.pool_name())? {
            sd.set(&self.pool_name(), &Pool::default().encode(), None).map_err(|_| LocalError::Host)?;
            created += 1;
        }
        if let (Some(v), _) = sd.get(&self.ready_name())? {
            if v == b"1" {
                return Ok(created);
            }
        }
        let empty = Bucket::of_width(self.width).encode();
        for i in 0..self.buckets {
            let name = self.bucket_name(i);
            if let (None, None) = sd.get(&name)? {
                sd.set(&name, &empty, None).map_err(|_| LocalError::Host)?;
                created += 1;
            }
        }
        sd.set(&self.ready_name(), b"1", None).map_err(|_| LocalError::Host)?;
        Ok(created)
    }

    pub fn read_bucket(&self, sd: &mut dyn SharedData, i: u32) -> Result<(Bucket, u32), LocalError> {
        self.read_bucket_value(sd, i).map(|(b, cas, _)| (b, cas))
    }

    /// `read_bucket`, with the value as read.
    fn read_bucket_value(&self, sd: &mut dyn SharedData, i: u32) -> Result<(Bucket, u32, Vec<u8>), LocalError> {
        match sd.get(&self.bucket_name(i))? {
            (Some(v), Some(cas)) => match Bucket::decode_width(&v, self.width) {
                Some(b) => Ok((b, cas, v)),
                None => Err(LocalError::Corrupt),
            },
            // Never created, or emptied by something else: creating it here would not be atomic.
            _ => Err(LocalError::Missing),
        }
    }

    /// A bucket's value, indexed but not decoded (`RawBucket`), and its CAS.
    fn read_raw(&self, sd: &mut dyn SharedData, i: u32) -> Result<(RawBucket, u32), LocalError> {
        match sd.get(&self.bucket_name(i))? {
            (Some(v), Some(cas)) => RawBucket::index(v, self.width).map(|b| (b, cas)).ok_or(LocalError::Corrupt),
            _ => Err(LocalError::Missing),
        }
    }

    /// Writes a bucket with CAS; `Ok(false)` when another worker changed it first.
    fn write_bucket(&self, sd: &mut dyn SharedData, i: u32, b: &Bucket, cas: u32) -> Result<bool, LocalError> {
        self.write_value(sd, i, &b.encode(), cas)
    }

    /// Writes a bucket's encoded value with CAS; `Ok(false)` when another worker changed it first.
    fn write_value(&self, sd: &mut dyn SharedData, i: u32, value: &[u8], cas: u32) -> Result<bool, LocalError> {
        match sd.set(&self.bucket_name(i), value, Some(cas)) {
            Ok(()) => Ok(true),
            Err(SetError::CasMismatch) => Ok(false),
            Err(SetError::Host) => Err(LocalError::Host),
        }
    }

    /// Reads a body key if it belongs to `owner` and `skey`.
    fn read_body(&self, sd: &mut dyn SharedData, h: &Handle) -> Result<Option<Record>, LocalError> {
        let (v, _) = sd.get(&self.body_name(h.bucket, h.position))?;
        Ok(v.and_then(|v| decode_body(&v, h)))
    }

    /// Looks the key up and, when it is free (or a stale claim that never forwarded), claims it
    /// atomically: one read and one CAS of the key's bucket, the claim forwarded at once (it
    /// carries its fingerprint). The claim keeps `creator` in its entry (a 409 names it).
    ///
    /// `fp` is `None` at request headers: then nothing is claimed or taken over. What the key
    /// holds is answered at once (a live claim: 409; a full bucket: 503), and otherwise
    /// `NeedFingerprint` waits for the body; when the key was free to claim (or take over) it
    /// carries the bucket as read with its CAS (`Seen`), which the claim at the body's end
    /// (`begin_after`) makes its first CAS on: a first request reads its bucket once. A request
    /// whose body is still uploading holds nothing, so a client that gives up mid-upload leaves
    /// no claim behind.
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        &self,
        sd: &mut dyn SharedData,
        skey: StorageKey,
        fp: Option<Fingerprint>,
        now_ms: u64,
        policy: &Policy,
        owner: OwnerToken,
        creator: &Creator,
    ) -> Result<Begin, LocalError> {
        self.begin_after(sd, skey, fp, now_ms, policy, owner, creator, None)
    }

    /// `begin` with the bucket read at headers (`seen`, from `Begin::NeedFingerprint`). Its CAS
    /// proves it current: a claim, take-over or outcome-unknown mark decided on it is written with
    /// that CAS, and a bucket changed since fails it and is read again. A decision that writes
    /// nothing (replay, refusal, full) is never made on it: the bucket is read again first. A
    /// `seen` of another bucket (a key derived from the body), or older than `SEEN_MAX_AGE_MS` (the
    /// CAS counter could have come round), is ignored.
    #[allow(clippy::too_many_arguments)]
    pub fn begin_after(
        &self,
        sd: &mut dyn SharedData,
        skey: StorageKey,
        fp: Option<Fingerprint>,
        now_ms: u64,
        policy: &Policy,
        owner: OwnerToken,
        creator: &Creator,
        seen: Option<Seen>,
    ) -> Result<Begin, LocalError> {
        let i = self.bucket_of(&skey);
        let mut v3_checked = false;
        let mut seen = seen.filter(|s| s.bucket == i && now_ms.abs_diff(s.read_at_ms) <= SEEN_MAX_AGE_MS);
        for _ in 0..MAX_CAS_RETRIES + usize::from(seen.is_some()) {
            let headers_read = seen.take().and_then(|s| Some((Bucket::decode_width(&s.value, self.width)?, s.cas)));
            let (mut bucket, cas, value, from_headers) = match headers_read {
                Some((b, cas)) => (b, cas, None, true),
                None => {
                    let (b, cas, v) = self.read_bucket_value(sd, i)?;
                    (b, cas, Some(v), false)
                }
            };
            let live = bucket.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.holds(&skey, now_ms)));
            let lookup = match live.and_then(|j| bucket.positions.get(j)).and_then(|p| p.as_ref()) {
                Some(e) => Lookup::Found(e.summary()),
                None => Lookup::Absent,
            };
            let decision = decide(lookup, fp.as_ref(), now_ms, policy, crate::config::OnUnavailable::Reject);
            if !v3_checked && (live.is_none() || decision == Decision::TakeOver) {
                // A key this table does not hold, or holds only by a stale claim that never
                // forwarded (one made at headers by a module of before claims moved to the body's
                // end), may still be held by the v3 module this one
                // replaced: its record answers, and nothing is claimed or taken over while it
                // holds the key.
                if let Some(answer) = self.answer_from_v3(sd, &skey, fp.as_ref(), now_ms, policy)? {
                    return Ok(answer);
                }
                v3_checked = true;
            }
            let lifetimes = Lifetimes::of(policy);
            let writes = matches!(decision, Decision::MarkUnknown)
                || (fp.is_some() && matches!(decision, Decision::Claim | Decision::TakeOver));
            if from_headers && !writes {
                // Only a CAS proves the headers' read current: decide again on a fresh one.
                continue;
            }
            let target = match (&decision, live) {
                (Decision::Claim, _) => match self.place(sd, i, &bucket, now_ms) {
                    Some(place) => Some((place, false)),
                    None if from_headers => continue,
                    None => return Ok(Begin::Full),
                },
                (Decision::TakeOver, Some(j)) => Some((Place { position: j, evicted_age_ms: None }, true)),
                _ => None,
            };
            if fp.is_none() && target.is_some() {
                // Request headers: claim nothing until the body is whole (the bucket goes to the
                // claim at its end).
                let seen = value.map(|value| Seen { bucket: i, value, cas, read_at_ms: now_ms });
                return Ok(Begin::NeedFingerprint { seen });
            }
            if let Some((place, took_over)) = target {
                // The one lifecycle says what the claim becomes: a new claim of an empty, free or
                // evicted position, or a take-over of a stale claim; anything else is refused.
                // Claims carry their fingerprint (made at the body's end): forwarded at once.
                let j = place.position;
                let p = bucket.positions.get(j).cloned().flatten();
                let event = match (took_over, p.as_ref().map(|e| e.stage)) {
                    (true, Some(Stage::Forwarded)) => {
                        Event::TakeOver { how: TakeOver::StaleForwarded, forwarding: true }
                    }
                    (true, _) => Event::TakeOver { how: TakeOver::NeverForwarded, forwarding: true },
                    (false, _) => Event::Claim { forwarding: true },
                };
                let from = match place.evicted_age_ms {
                    Some(_) => step(&p, Event::Evict, None, now_ms).map(|_| None).map_err(LocalError::Refused)?,
                    None => p.clone(),
                };
                let stage = step(&from, event, None, now_ms).map_err(LocalError::Refused)?;
                // The position's body key keeps what it holds until this claim completes: its
                // bytes stay counted, now on the new entry.
                let body_bytes = match &p {
                    Some(e) => e.body_bytes,
                    None => bucket.left.get(j).copied().unwrap_or(0),
                };
                if let Some(l) = bucket.left.get_mut(j) {
                    *l = 0;
                }
                let new_entry = Entry {
                    skey,
                    fingerprint: fp,
                    stage,
                    owner,
                    since_ms: now_ms,
                    expires_at_ms: lifetimes.expires_at(stage, now_ms),
                    lock_expires_at_ms: lifetimes.lock_expires_at(now_ms),
                    status: 0,
                    body_bytes,
                    floor_ms: self.entry_floor_ms(),
                    creator: encode_creator(creator),
                };
                if let Some(age) = place.evicted_age_ms {
                    bucket.evicted_at_ms = now_ms;
                    bucket.evicted_age_ms = age;
                }
                let Some(slot) = bucket.positions.get_mut(j) else { return Err(LocalError::Corrupt) };
                *slot = Some(new_entry);
                // One CAS of the whole bucket; a lost race starts over with a fresh read.
                if !self.write_bucket(sd, i, &bucket, cas)? {
                    continue;
                }
                let handle = Handle { bucket: i, position: j, owner, skey };
                return Ok(Begin::Claimed { handle, took_over, evicted: place.evicted_age_ms.is_some() });
            }
            match (decision, live) {
                (Decision::MarkUnknown, Some(j)) => {
                    let Some(p) = bucket.positions.get_mut(j) else { return Err(LocalError::Corrupt) };
                    let to = step(p, Event::StaleToUnknown, None, now_ms).map_err(LocalError::Refused)?;
                    let Some(e) = p.as_mut() else { return Err(LocalError::Corrupt) };
                    e.stage = to;
                    e.since_ms = now_ms;
                    e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
                    e.expires_at_ms = lifetimes.expires_at(Stage::Unknown, now_ms);
                    let creator = e.creator();
                    if !self.write_bucket(sd, i, &bucket, cas)? {
                        continue;
                    }
                    return Ok(Begin::Reject { problem: ProblemKind::OutcomeUnknown, creator, marked_unknown: true });
                }
                (Decision::Replay, Some(j)) => {
                    let Some(Some(e)) = bucket.positions.get(j) else { return Err(LocalError::Corrupt) };
                    let h = Handle { bucket: i, position: j, owner: e.owner, skey };
                    return Ok(match self.read_body(sd, &h)? {
                        // An awaiting record too (`State::AwaitingInput`): the engine replays its
                        // question to the round that asked, or continues the call
                        // (`continue_round`) for the next.
                        Some(r)
                            if matches!(
                                r.state,
                                State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_)
                            ) =>
                        {
                            // Past its own expiry: its key's tombstone (answered `key-expired`,
                            // on every route, as a store's), whether shrunk yet or not; the body
                            // keeps only that from now on.
                            if r.is_tombstone(now_ms) && !r.is_key_tombstone() {
                                let e = e.clone();
                                let _ = self.shrink(sd, i, j, &e, now_ms);
                                Begin::Replay(Record::key_tombstone(r.fingerprint))
                            } else {
                                Begin::Replay(r)
                            }
                        }
                        // No body of this record (the bucket had no room even for its status, or
                        // a stale owner's late write replaced it): never execute again; answer
                        // with what the index knows.
                        _ => Begin::Reject {
                            problem: ProblemKind::ResponseNotStored { status: e.status, location: None },
                            creator: None,
                            marked_unknown: false,
                        },
                    });
                }
                (Decision::Reject(problem), j) => {
                    let creator = j.and_then(|j| self.creator_of(sd, i, j, bucket.positions.get(j)?.as_ref()?));
                    return Ok(Begin::Reject { problem, creator, marked_unknown: false });
                }
                (Decision::NeedFingerprint, _) => return Ok(Begin::NeedFingerprint { seen: None }),
                // Claim and TakeOver were handled above; PassUnprotected cannot come from the
                // local tier; MarkUnknown and Replay always have a live position.
                _ => return Err(LocalError::Corrupt),
            }
        }
        Err(LocalError::Contended)
    }

    /// The next round (`round`) of an MCP call whose awaiting record `skey` holds
    /// (`record::Round::Next`, the fingerprint `fp` matched) continues the call: the record's
    /// entry becomes a forwarded claim of `owner` (`Event::Continue`), in one CAS of its bucket
    /// made on the read that found the awaiting record, so of two rounds that found it one
    /// continues and the other finds the claim (`None`: the key holds no awaiting record of this
    /// call any more, or not for another round; the caller answers in flight, never forwards).
    #[allow(clippy::too_many_arguments)]
    pub fn continue_round(
        &self,
        sd: &mut dyn SharedData,
        skey: StorageKey,
        fp: Fingerprint,
        round: &crate::record::RoundId,
        now_ms: u64,
        policy: &Policy,
        owner: OwnerToken,
        creator: &Creator,
    ) -> Result<Option<Handle>, LocalError> {
        let i = self.bucket_of(&skey);
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas, _) = self.read_bucket_value(sd, i)?;
            let live = bucket.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.holds(&skey, now_ms)));
            let Some(j) = live else { return Ok(None) };
            let Some(Some(e)) = bucket.positions.get(j) else { return Err(LocalError::Corrupt) };
            if e.stage != Stage::Completed || e.fingerprint != Some(fp) {
                return Ok(None);
            }
            let held = Handle { bucket: i, position: j, owner: e.owner, skey };
            match self.read_body(sd, &held)? {
                Some(r) if r.fingerprint == fp && r.round(Some(round)) == crate::record::Round::Next => {}
                _ => return Ok(None),
            }
            let stage = step(&Some(e.clone()), Event::Continue, None, now_ms).map_err(LocalError::Refused)?;
            let lifetimes = Lifetimes::of(policy);
            let new_entry = Entry {
                skey,
                fingerprint: Some(fp),
                stage,
                owner,
                since_ms: now_ms,
                expires_at_ms: lifetimes.expires_at(stage, now_ms),
                lock_expires_at_ms: lifetimes.lock_expires_at(now_ms),
                status: 0,
                // The position's body key keeps the awaiting record until this round completes:
                // its bytes stay counted, now on the new entry.
                body_bytes: e.body_bytes,
                floor_ms: self.entry_floor_ms(),
                creator: encode_creator(creator),
            };
            let Some(slot) = bucket.positions.get_mut(j) else { return Err(LocalError::Corrupt) };
            *slot = Some(new_entry);
            if !self.write_bucket(sd, i, &bucket, cas)? {
                continue;
            }
            return Ok(Some(Handle { bucket: i, position: j, owner, skey }));
        }
        Err(LocalError::Contended)
    }

    /// What a v3 record of `skey` answers, when the v3 table of a replaced module holds it: a
    /// replay of its response, or a refusal; never a claim (v4 does not write there, and v3 does
    /// not look here). A stale v3 claim is answered as in flight and a stale forwarded one as
    /// outcome-unknown: its owner may still be running it.
    fn answer_from_v3(
        &self,
        sd: &mut dyn SharedData,
        skey: &StorageKey,
        fp: Option<&Fingerprint>,
        now_ms: u64,
        policy: &Policy,
    ) -> Result<Option<Begin>, LocalError> {
        let Some(old) = &self.v3 else { return Ok(None) };
        let Some(e) = old.holder(sd, skey, now_ms)? else { return Ok(None) };
        let creator = |sd: &mut dyn SharedData| old.record(sd, skey, &e).map(|r| r.creator);
        let answer = match decide(Lookup::Found(e.summary), fp, now_ms, policy, crate::config::OnUnavailable::Reject) {
            Decision::Replay => match old.record(sd, skey, &e) {
                Some(r) if matches!(r.state, State::Completed(_) | State::CompletedTooLarge { .. }) => Begin::Replay(r),
                _ => Begin::Reject {
                    problem: ProblemKind::ResponseNotStored { status: e.status, location: None },
                    creator: None,
                    marked_unknown: false,
                },
            },
            Decision::NeedFingerprint => Begin::NeedFingerprint { seen: None },
            Decision::Reject(problem) => Begin::Reject { problem, creator: creator(sd), marked_unknown: false },
            Decision::MarkUnknown => {
                Begin::Reject { problem: ProblemKind::OutcomeUnknown, creator: creator(sd), marked_unknown: false }
            }
            _ => Begin::Reject {
                problem: ProblemKind::InFlight { retry_after_seconds: 1 },
                creator: creator(sd),
                marked_unknown: false,
            },
        };
        Ok(Some(answer))
    }

    /// Reads the live record of `skey` without claiming anything: its summary and, when it is
    /// completed, the record itself (for requests waiting on another attempt).
    pub fn peek(&self, sd: &mut dyn SharedData, skey: &StorageKey, now_ms: u64) -> Result<Option<Peeked>, LocalError> {
        let i = self.bucket_of(skey);
        let (bucket, _) = self.read_bucket(sd, i)?;
        let found = bucket
            .positions
            .iter()
            .enumerate()
            .find_map(|(j, p)| p.as_ref().filter(|e| e.holds(skey, now_ms)).map(|e| (j, e)));
        let Some((j, e)) = found else {
            let Some(old) = &self.v3 else { return Ok(None) };
            let Some(e) = old.holder(sd, skey, now_ms)? else { return Ok(None) };
            let record = match e.summary.phase {
                Phase::Completed => old.record(sd, skey, &e),
                _ => None,
            };
            return Ok(Some(Peeked { summary: e.summary, record, status: e.status }));
        };
        let record = match e.stage {
            Stage::Completed => self.read_body(sd, &Handle { bucket: i, position: j, owner: e.owner, skey: *skey })?,
            _ => None,
        };
        Ok(Some(Peeked { summary: e.summary(), record, status: e.status }))
    }

    /// A position for a new key in its bucket `i`, in this order: a free one (expired, no live
    /// lock); an empty one (first one whose body key holds bytes: the claim takes them over); the
    /// oldest tombstone (`tombstone_position`); or, with `evict_oldest`, the oldest finished record
    /// past its floor. `None`: full.
    fn place(&self, sd: &mut dyn SharedData, i: u32, b: &Bucket, now_ms: u64) -> Option<Place> {
        if let Some(j) = b.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.is_free(now_ms))) {
            return Some(Place { position: j, evicted_age_ms: None });
        }
        let empty =
            |with_bytes: bool| b.positions.iter().zip(&b.left).position(|(p, l)| p.is_none() && (*l > 0) == with_bytes);
        if let Some(j) = empty(true).or_else(|| empty(false)) {
            return Some(Place { position: j, evicted_age_ms: None });
        }
        if let Some((j, age)) = self.tombstone_position(sd, i, b, now_ms) {
            return Some(Place { position: j, evicted_age_ms: Some(age) });
        }
        self.eviction_candidate(b, now_ms).map(|(j, age)| Place { position: j, evicted_age_ms: Some(age) })
    }

    /// The oldest completed record of bucket `i` past its own expiry, kept as its key's tombstone
    /// (`Record::is_tombstone`, read from its body), and its age. A full bucket takes it before any
    /// live record is evicted, whatever `when_full` says and whatever its floor (the floor protects
    /// a live record; a tombstone has outlived its record and only warns): without it, tombstones
    /// would cost a live record (an outcome-unknown mark, a completion of a longer `ttl_seconds`)
    /// its place, and that key a second execution, where without tombstones their positions
    /// would have been free. Read only when the bucket has neither a free nor an empty position.
    fn tombstone_position(&self, sd: &mut dyn SharedData, i: u32, b: &Bucket, now_ms: u64) -> Option<(usize, u64)> {
        let mut oldest: Option<(usize, u64)> = None;
        for (j, p) in b.positions.iter().enumerate() {
            let Some(e) = p.as_ref().filter(|e| e.stage == Stage::Completed) else { continue };
            if lifecycle::next(e.stage, Event::Evict, Facts::of(&e.summary(), now_ms, false)).is_err() {
                continue;
            }
            let h = Handle { bucket: i, position: j, owner: e.owner, skey: e.skey };
            let tombstone = self.read_body(sd, &h).ok().flatten().is_some_and(|r| r.is_tombstone(now_ms));
            let age = now_ms.saturating_sub(e.since_ms);
            if tombstone && oldest.is_none_or(|(_, a)| age > a) {
                oldest = Some((j, age));
            }
        }
        oldest
    }

    /// The oldest completed or outcome-unknown record of `b` past its own floor (`Entry::floor_ms`,
    /// set by the configuration that wrote it, not this one), and its age, when this
    /// configuration evicts at all. Never a claim in flight.
    fn eviction_candidate(&self, b: &Bucket, now_ms: u64) -> Option<(usize, u64)> {
        if self.when_full != WhenFull::EvictOldest {
            return None;
        }
        b.positions
            .iter()
            .enumerate()
            .filter_map(|(j, p)| {
                p.as_ref().filter(|e| e.evictable(now_ms)).map(|e| (j, now_ms.saturating_sub(e.since_ms)))
            })
            .max_by_key(|(_, age)| *age)
    }

    /// The run that made entry `e` at position `j` of bucket `i`: kept in the entry until
    /// completion, in its body after.
    fn creator_of(&self, sd: &mut dyn SharedData, i: u32, j: usize, e: &Entry) -> Option<Creator> {
        if let Some(c) = e.creator() {
            return Some(c);
        }
        let h = Handle { bucket: i, position: j, owner: e.owner, skey: e.skey };
        // A key's tombstone names no run (as a store's).
        self.read_body(sd, &h).ok().flatten().filter(|r| !r.is_key_tombstone()).map(|r| r.creator)
    }

    /// Applies `event` to our entry (`h`'s claim) with CAS, retrying lost races: the lifecycle
    /// (`lifecycle::next`) gives the entry's next stage, and `f` fills in the rest of it. The
    /// refusal when the table refuses (the position is no longer ours, or not in a stage the event
    /// can leave): nothing is written.
    fn transition(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        event: Event,
        now_ms: u64,
        mut f: impl FnMut(&mut Bucket, Stage),
    ) -> Result<Result<Stage, Refusal>, LocalError> {
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas) = self.read_bucket(sd, h.bucket)?;
            let Some(slot) = bucket.positions.get(h.position) else { return Err(LocalError::Corrupt) };
            let to = match step(slot, event, Some(h), now_ms) {
                Ok(to) => to,
                Err(refused) => return Ok(Err(refused)),
            };
            f(&mut bucket, to);
            if self.write_bucket(sd, h.bucket, &bucket, cas)? {
                return Ok(Ok(to));
            }
        }
        Err(LocalError::Contended)
    }

    /// Stores a completed record (see `Record::completed`): the body key first, then the bucket
    /// CAS that marks the entry completed (a reader that sees it completed finds its body). A body
    /// that does not fit the bucket's remaining share of `local.max_bytes` takes its bytes from
    /// the table-wide pool instead (`store_pooled`: a few more calls, on that path only). With no
    /// room there either, only the status and `location` are kept (and with no room even for
    /// those, the status in the index): retries then get a problem carrying them, never a second
    /// execution.
    pub fn complete(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        record: Record,
        now_ms: u64,
    ) -> Result<Completed, LocalError> {
        let until = record.expires_at_ms;
        self.complete_until(sd, h, record, now_ms, until)
    }

    /// `complete`, the entry kept until `expires_at_ms` (the record's own expiry plus its
    /// tombstone time, `Lifetimes::life_ms`, where this tier is the record's authority): past the
    /// record's own expiry it is its key's tombstone (`Record::is_tombstone`).
    pub fn complete_until(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        record: Record,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> Result<Completed, LocalError> {
        let fp = record.fingerprint;
        let tombstone_from_ms = record.expires_at_ms;
        let status = match &record.state {
            State::Completed(r) => r.status,
            State::AwaitingInput(a) => a.response().status,
            State::CompletedTooLarge { status, .. } => *status,
            _ => 0,
        };
        let full = encode_body(h, &record);
        let has_body = matches!(record.state, State::Completed(_) | State::AwaitingInput(_));
        // The status-only record, made only when the full one does not fit.
        let mut lean: Option<Vec<u8>> = None;
        let name = self.body_name(h.bucket, h.position);
        // What the body key holds from us now: (bytes written, with the body).
        let mut written: Option<(u32, bool)> = None;
        // Our reservation in the pool, once the body key holds the full body on it.
        let mut pooled: Option<Reservation> = None;
        // Pool attempts left (a body write that lost a race to the sweep tries again).
        let mut pool_tries = 3;
        for _ in 0..MAX_CAS_RETRIES {
            // Only our entry is decoded (`RawBucket`).
            let (raw, cas) = self.read_raw(sd, h.bucket)?;
            if h.position >= self.width {
                return Err(LocalError::Corrupt);
            }
            let slot = raw.entry(h.position);
            let position = &slot;
            if step(position, Event::Complete, Some(h), now_ms).is_err() {
                if written.is_some() {
                    self.withdraw(sd, h, pooled);
                }
                return Ok(Completed::LostClaim);
            }
            let ours = position.as_ref().map_or(0, |e| u64::from(e.body_bytes));
            let others = raw.counted.saturating_sub(ours);
            let fits = |b: &[u8]| others.saturating_add(b.len() as u64) <= self.bucket_bytes();
            while has_body && pooled.is_none() && !fits(&full) && pool_tries > 0 {
                pool_tries -= 1;
                match self.store_pooled(sd, h, &full)? {
                    Pooled::Stored(r) => {
                        pooled = Some(r);
                        written = Some((u32::try_from(full.len()).unwrap_or(u32::MAX), true));
                    }
                    Pooled::NoRoom => pool_tries = 0,
                    Pooled::Raced => {}
                }
            }
            if has_body && pooled.is_none() && !fits(&full) && lean.is_none() {
                let mut r = record.clone();
                r.state = r.state.without_body();
                lean = Some(encode_body(h, &r));
            }
            let body_bytes = if pooled.is_some() {
                // The pool counts the body; the bytes the key held before are gone from it.
                0
            } else {
                let choice: Option<(&[u8], bool)> = if fits(&full) {
                    Some((&full, has_body))
                } else {
                    lean.as_deref().filter(|l| fits(l)).map(|l| (l, false))
                };
                let want = choice.map(|(b, body)| (u32::try_from(b.len()).unwrap_or(u32::MAX), body));
                if want != written {
                    match choice {
                        Some((bytes, _)) => sd.set(&name, bytes, None).map_err(|_| LocalError::Host)?,
                        None if written.is_some() => sd.set(&name, b"", None).map_err(|_| LocalError::Host)?,
                        None => {}
                    }
                    written = want;
                }
                match written {
                    Some((n, _)) => n,
                    // Nothing written: an earlier body the key may hold stays counted.
                    None => u32::try_from(ours).unwrap_or(u32::MAX),
                }
            };
            let Some(mut e) = slot else { return Err(LocalError::Corrupt) };
            e.stage = Stage::Completed;
            e.since_ms = now_ms;
            e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
            e.fingerprint = Some(fp);
            e.expires_at_ms = expires_at_ms;
            // No lock past completion: when the record turns into its key's tombstone instead.
            e.lock_expires_at_ms = tombstone_from_ms;
            e.status = status;
            e.body_bytes = body_bytes;
            e.creator = vec![];
            let Some(value) = raw.with_entry(h.position, &e) else { return Err(LocalError::Corrupt) };
            if self.write_value(sd, h.bucket, &value, cas)? {
                return Ok(if matches!(written, Some((_, true))) {
                    Completed::Stored
                } else {
                    Completed::StoredWithoutBody
                });
            }
        }
        if written.is_some() {
            self.withdraw(sd, h, pooled);
        }
        Err(LocalError::Contended)
    }

    /// Writes `body` on a reservation in the pool, when the pool has room: the body key's CAS
    /// first (written once, empty, if the key was never written), then the reservation (CAS of
    /// the pool), then the body with the CAS read first. So the body is never written unless the
    /// pool counts it, and a reservation the sweep dropped meanwhile (it changes the key's CAS
    /// before dropping one whose write may still come) makes the write fail. `None`: no room, or
    /// a lost race (the caller keeps the status only).
    fn store_pooled(&self, sd: &mut dyn SharedData, h: &Handle, body: &[u8]) -> Result<Pooled, LocalError> {
        let Ok(bytes) = u32::try_from(body.len()) else { return Ok(Pooled::NoRoom) };
        if u64::from(bytes) > self.pool_bytes() {
            return Ok(Pooled::NoRoom);
        }
        let name = self.body_name(h.bucket, h.position);
        let body_cas = match sd.get(&name)? {
            (_, Some(c)) => c,
            (_, None) => {
                sd.set(&name, b"", None).map_err(|_| LocalError::Host)?;
                match sd.get(&name)? {
                    (_, Some(c)) => c,
                    (_, None) => return Ok(Pooled::NoRoom),
                }
            }
        };
        let r = Reservation { bucket: h.bucket, position: h.position, owner: h.owner, bytes, body_cas };
        if !self.reserve(sd, r)? {
            return Ok(Pooled::NoRoom);
        }
        match sd.set(&name, body, Some(body_cas)) {
            Ok(()) => Ok(Pooled::Stored(r)),
            Err(e) => {
                // Nothing of ours was written: the reservation goes back.
                let _ = self.unreserve(sd, &[r]);
                match e {
                    SetError::CasMismatch => Ok(Pooled::Raced),
                    SetError::Host => Err(LocalError::Host),
                }
            }
        }
    }

    /// The pool and its CAS; `None` when it is missing or unreadable (then it has no room).
    fn read_pool(&self, sd: &mut dyn SharedData) -> Result<Option<(Pool, u32)>, LocalError> {
        Ok(match sd.get(&self.pool_name())? {
            (Some(v), Some(cas)) => Pool::decode(&v).map(|p| (p, cas)),
            _ => None,
        })
    }

    /// Adds `r` to the pool if its bytes fit in `pool_bytes` and the list has room. Whether it did.
    fn reserve(&self, sd: &mut dyn SharedData, r: Reservation) -> Result<bool, LocalError> {
        for _ in 0..MAX_CAS_RETRIES {
            let Some((mut pool, cas)) = self.read_pool(sd)? else { return Ok(false) };
            if pool.reservations.len() >= pool::MAX_RESERVATIONS
                || pool.used().saturating_add(u64::from(r.bytes)) > self.pool_bytes()
            {
                return Ok(false);
            }
            pool.reservations.push(r);
            match sd.set(&self.pool_name(), &pool.encode(), Some(cas)) {
                Ok(()) => return Ok(true),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Host) => return Err(LocalError::Host),
            }
        }
        Ok(false)
    }

    /// Gives back the reservations `rs` (those still listed). Whether the pool no longer lists
    /// them (`false`: a host error or lost races; the sweep tries again).
    fn unreserve(&self, sd: &mut dyn SharedData, rs: &[Reservation]) -> bool {
        for _ in 0..MAX_CAS_RETRIES {
            let Ok(Some((mut pool, cas))) = self.read_pool(sd) else { return false };
            let before = pool.reservations.len();
            pool.reservations.retain(|x| !rs.iter().any(|r| r.same(x)));
            if pool.reservations.len() == before {
                return true;
            }
            match sd.set(&self.pool_name(), &pool.encode(), Some(cas)) {
                Ok(()) => return true,
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Host) => return false,
            }
        }
        false
    }

    /// Takes back what a completion that did not land wrote: empties the body key if it still
    /// holds our body (owner-checked), and gives back our reservation once the key no longer
    /// holds it (else the sweep reclaims it).
    fn withdraw(&self, sd: &mut dyn SharedData, h: &Handle, pooled: Option<Reservation>) {
        let gone = self.withdraw_body(sd, h) || !self.body_holds(sd, h);
        if let Some(r) = pooled.filter(|_| gone) {
            let _ = self.unreserve(sd, &[r]);
        }
    }

    /// Whether `h`'s body key holds `h`'s owner's body (`true` when it cannot tell).
    fn body_holds(&self, sd: &mut dyn SharedData, h: &Handle) -> bool {
        match sd.get(&self.body_name(h.bucket, h.position)) {
            Ok((v, _)) => v.is_some_and(|v| body_belongs_to(&v, h)),
            Err(_) => true,
        }
    }

    /// Empties a body key `h`'s owner wrote (a claim it then lost: a stale owner's late write,
    /// which the position's current owner never counted; or a record the sweep freed), if it
    /// still holds that body (CAS).
    /// Whether it emptied it.
    fn withdraw_body(&self, sd: &mut dyn SharedData, h: &Handle) -> bool {
        let name = self.body_name(h.bucket, h.position);
        match sd.get(&name) {
            Ok((Some(v), Some(cas))) if body_belongs_to(&v, h) => sd.set(&name, b"", Some(cas)).is_ok(),
            _ => false,
        }
    }

    /// Frees our claim: the request never executed, a retry may. `Ok(false)` if it was not ours
    /// (or no longer a claim, or already free at `now_ms`: `lifecycle::next` refuses).
    pub fn release(&self, sd: &mut dyn SharedData, h: &Handle, now_ms: u64) -> Result<bool, LocalError> {
        let freed = self.transition(sd, h, Event::Release, now_ms, |bucket, _| {
            bucket.free(h.position);
        })?;
        Ok(freed.is_ok())
    }

    /// The request may have executed without a response: keep an outcome-unknown record for
    /// `unknown_outcome_seconds`.
    pub fn mark_unknown(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        reason: UnknownReason,
        now_ms: u64,
        policy: &Policy,
    ) -> Result<bool, LocalError> {
        let _ = reason; // kept in logs and counters by the caller
        let done = self.transition(sd, h, Event::MarkUnknown, now_ms, |bucket, to| {
            if let Some(Some(e)) = bucket.positions.get_mut(h.position) {
                e.stage = to;
                e.since_ms = now_ms;
                e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
                e.expires_at_ms = Lifetimes::of(policy).expires_at(to, now_ms);
            }
        })?;
        Ok(done.is_ok())
    }

    /// Frees expired entries of `count` buckets from `start` (wrapping), so their positions are
    /// free even if their keys never come back, and notes each bucket's figures in `gauges`.
    /// Returns how many entries it freed. Off the request path (the root's tick).
    pub fn sweep(
        &self,
        sd: &mut dyn SharedData,
        start: u32,
        count: u32,
        now_ms: u64,
        gauges: &mut Gauges,
    ) -> Result<u32, LocalError> {
        gauges.fit(self.buckets);
        let count = count.min(self.buckets);
        let n = u64::from(self.buckets);
        let in_range = |i: u32| i < self.buckets && (u64::from(i) + n - u64::from(start) % n) % n < u64::from(count);
        // The pool's reservations in these buckets, checked against each bucket as swept.
        let mut listed: Vec<Reservation> = match self.read_pool(sd)? {
            Some((p, _)) => p.reservations.into_iter().filter(|r| in_range(r.bucket)).collect(),
            None => vec![],
        };
        listed.sort_by_key(|r| r.bucket);
        let mut stale: Vec<Reservation> = vec![];
        let mut freed_total = 0;
        for k in 0..count {
            let i = (start.wrapping_add(k)) % self.buckets;
            for _ in 0..MAX_CAS_RETRIES {
                let (mut bucket, cas) = self.read_bucket(sd, i)?;
                let expired: Vec<usize> = (0..bucket.positions.len())
                    .filter(|j| bucket.positions.get(*j).is_some_and(|p| step(p, Event::Expire, None, now_ms).is_ok()))
                    .collect();
                let freed: Vec<(usize, Entry)> =
                    expired.iter().filter_map(|j| bucket.free(*j).map(|e| (*j, e))).collect();
                if freed.is_empty() {
                    let bucket = self.shrink_all(sd, i, bucket, now_ms);
                    gauges.note(i, &bucket);
                    note_stale(&listed, i, &bucket, &mut stale);
                    break;
                }
                if self.write_bucket(sd, i, &bucket, cas)? {
                    freed_total += freed.len() as u32;
                    let bucket = self.drop_bodies(sd, i, &freed).unwrap_or(bucket);
                    let bucket = self.shrink_all(sd, i, bucket, now_ms);
                    gauges.note(i, &bucket);
                    note_stale(&listed, i, &bucket, &mut stale);
                    break;
                }
            }
        }
        let reclaimed: Vec<Reservation> = stale.into_iter().filter(|r| self.settle_stale(sd, r)).collect();
        if !reclaimed.is_empty() {
            let _ = self.unreserve(sd, &reclaimed);
        }
        if let Ok(Some((p, _))) = self.read_pool(sd) {
            gauges.pool_bytes = p.used();
        }
        Ok(freed_total)
    }

    /// Shrinks every completed record of bucket `i` (as read: `b`) that its entry says is past its
    /// own expiry and not shrunk yet (`Entry::lock_expires_at_ms`) to its key's tombstone
    /// (`shrink`). Returns the bucket to note: `b`, or read again when one was shrunk.
    fn shrink_all(&self, sd: &mut dyn SharedData, i: u32, b: Bucket, now_ms: u64) -> Bucket {
        let due: Vec<(usize, Entry)> = b
            .positions
            .iter()
            .enumerate()
            .filter_map(|(j, p)| p.as_ref().map(|e| (j, e)))
            .filter(|(_, e)| e.stage == Stage::Completed && e.lock_expires_at_ms <= now_ms && !e.is_free(now_ms))
            .map(|(j, e)| (j, e.clone()))
            .collect();
        let mut shrunk = false;
        for (j, e) in &due {
            shrunk |= matches!(self.shrink(sd, i, *j, e, now_ms), Ok(true));
        }
        match shrunk {
            true => self.read_bucket(sd, i).map(|(b, _)| b).unwrap_or(b),
            false => b,
        }
    }

    /// Makes the completed record `e` at position `j` of bucket `i`, past its own expiry (read
    /// from its body: `Record::is_tombstone`), its key's tombstone: its body key then holds only
    /// the fingerprint (`encode_tombstone_body`, written with the CAS of the read that found the
    /// record, so a later owner's body is never overwritten), and its bucket counts those bytes
    /// (and gives back a pooled body's reservation) while the position still holds `e`'s owner.
    /// The entry itself is unchanged but for its bytes and its cue (`Entry::lock_expires_at_ms`):
    /// the key stays held, completed, until its own expiry. Whether the bucket now says so.
    fn shrink(&self, sd: &mut dyn SharedData, i: u32, j: usize, e: &Entry, now_ms: u64) -> Result<bool, LocalError> {
        let Some(fp) = e.fingerprint else { return Ok(false) };
        let h = Handle { bucket: i, position: j, owner: e.owner, skey: e.skey };
        let name = self.body_name(i, j);
        let tomb = encode_tombstone_body(&h, &fp);
        let (value, cas) = sd.get(&name)?;
        let body = value.as_deref().and_then(|v| decode_body(v, &h));
        match &body {
            Some(r) if r.is_key_tombstone() => {}
            Some(r) if r.fingerprint == fp && r.is_tombstone(now_ms) => match sd.set(&name, &tomb, cas) {
                Ok(()) => {}
                Err(SetError::CasMismatch) => return Ok(false),
                Err(SetError::Host) => return Err(LocalError::Host),
            },
            // Not its key's tombstone yet (an entry completed by an earlier module: its cue is
            // its lock), or no body of this record: nothing to shrink.
            Some(_) => return Ok(false),
            None => {}
        }
        let shrunk = body.is_some();
        let held = |b: &Bucket| match b.positions.get(j) {
            Some(Some(x)) => x.owner == e.owner && x.skey == e.skey && x.stage == Stage::Completed,
            _ => false,
        };
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, bcas) = self.read_bucket(sd, i)?;
            if !held(&bucket) {
                // A later owner holds the position: its entry keeps counting what it counts
                // (at least what the key holds now) until its completion replaces it.
                return Ok(false);
            }
            let others = bucket.bytes();
            let Some(Some(x)) = bucket.positions.get_mut(j) else { return Ok(false) };
            let others = others.saturating_sub(u64::from(x.body_bytes));
            let pooled = shrunk && x.body_bytes == 0;
            // A pooled body's tombstone moves to the bucket when its share has room (else the
            // reservation keeps counting more than the key holds until the record is freed).
            let counted = !pooled || others + TOMBSTONE_BODY_BYTES as u64 <= self.bucket_bytes();
            if shrunk && counted {
                x.body_bytes = TOMBSTONE_BODY_BYTES as u32;
            }
            x.lock_expires_at_ms = x.expires_at_ms;
            if self.write_bucket(sd, i, &bucket, bcas)? {
                if pooled && counted {
                    self.unreserve_position(sd, i, j, e.owner);
                }
                return Ok(true);
            }
        }
        Err(LocalError::Contended)
    }

    /// Gives back the pool's reservations of `owner`'s body at position `j` of bucket `i`.
    fn unreserve_position(&self, sd: &mut dyn SharedData, i: u32, j: usize, owner: OwnerToken) {
        let Ok(Some((pool, _))) = self.read_pool(sd) else { return };
        let mine: Vec<Reservation> =
            pool.reservations.into_iter().filter(|r| r.bucket == i && r.position == j && r.owner == owner).collect();
        if !mine.is_empty() {
            let _ = self.unreserve(sd, &mine);
        }
    }

    /// Makes sure a reservation whose record no longer holds its position (evicted, expired and
    /// freed, replaced, or a claim lost before its body landed) covers no byte any more: empties
    /// the body key if it holds the owner's body (CAS); if it holds something else with the CAS
    /// the owner read before its write, that write may still come, so the sweep rewrites the
    /// value as it is (a CAS) to make it fail. Whether the reservation may go.
    fn settle_stale(&self, sd: &mut dyn SharedData, r: &Reservation) -> bool {
        let name = self.body_name(r.bucket, r.position);
        match sd.get(&name) {
            Ok((v, Some(cas))) => {
                let v = v.unwrap_or_default();
                if v.get(..16) == Some(r.owner.0.as_slice()) {
                    sd.set(&name, b"", Some(cas)).is_ok()
                } else if cas == r.body_cas {
                    sd.set(&name, &v, Some(cas)).is_ok()
                } else {
                    true
                }
            }
            // Never written: the owner wrote it (empty) before reserving, so this cannot be.
            Ok((_, None)) => true,
            Err(_) => false,
        }
    }

    /// Empties the body keys of the records a sweep just freed, each only if it still holds that
    /// record's body (owner-checked CAS: a later owner of the position keeps its own), then stops
    /// counting them where their position is still empty. Returns the bucket as written.
    fn drop_bodies(&self, sd: &mut dyn SharedData, i: u32, freed: &[(usize, Entry)]) -> Option<Bucket> {
        let mut dropped = vec![];
        for (j, e) in freed.iter().filter(|(_, e)| e.body_bytes > 0) {
            let h = Handle { bucket: i, position: *j, owner: e.owner, skey: e.skey };
            if self.withdraw_body(sd, &h) {
                dropped.push(*j);
            }
        }
        if dropped.is_empty() {
            return None;
        }
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas) = self.read_bucket(sd, i).ok()?;
            for j in &dropped {
                if bucket.positions.get(*j).is_some_and(Option::is_none) {
                    if let Some(l) = bucket.left.get_mut(*j) {
                        *l = 0;
                    }
                }
            }
            if self.write_bucket(sd, i, &bucket, cas).ok()? {
                return Some(bucket);
            }
        }
        None
    }

    /// Records held now (reads every bucket: for tests and diagnostics; the gauges come from the
    /// sweep).
    pub fn count(&self, sd: &mut dyn SharedData) -> u64 {
        (0..self.buckets).filter_map(|i| self.read_bucket(sd, i).ok()).map(|(b, _)| b.occupied()).sum()
    }

    /// Bytes the body keys hold now, as the buckets and the pool count them (reads every bucket
    /// and the pool, as `count`).
    pub fn usage(&self, sd: &mut dyn SharedData) -> u64 {
        let buckets: u64 = (0..self.buckets).filter_map(|i| self.read_bucket(sd, i).ok()).map(|(b, _)| b.bytes()).sum();
        buckets + self.pool_usage(sd)
    }

    /// Bytes the pool's reservations count.
    pub fn pool_usage(&self, sd: &mut dyn SharedData) -> u64 {
        self.read_pool(sd).ok().flatten().map_or(0, |(p, _)| p.used())
    }

    /// The age in ms of the last record evicted to make room (0 before any eviction; reads every
    /// bucket, as `count`).
    pub fn last_evicted_age_ms(&self, sd: &mut dyn SharedData) -> u64 {
        let mut g = Gauges::default();
        for i in 0..self.buckets {
            if let Ok((b, _)) = self.read_bucket(sd, i) {
                g.fit(self.buckets);
                g.note(i, &b);
            }
        }
        g.evicted_age_ms()
    }

    /// Number of occupied positions (`count`).
    pub fn occupied(&self, sd: &mut dyn SharedData) -> u64 {
        self.count(sd)
    }
}

/// The table's gauges, made by the sweep from the buckets it reads (each bucket's figures as of
/// its last sweep: approximate, never on the request path).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Per bucket: records, bytes, last eviction instant and age.
    buckets: Vec<(u8, u64, u64, u64)>,
    /// Bytes the pool's reservations count, as of the last sweep.
    pool_bytes: u64,
}

impl Gauges {
    fn fit(&mut self, buckets: u32) {
        let n = usize::try_from(buckets).unwrap_or(0);
        if self.buckets.len() != n {
            self.buckets = vec![(0, 0, 0, 0); n];
        }
    }

    fn note(&mut self, i: u32, b: &Bucket) {
        if let Some(g) = usize::try_from(i).ok().and_then(|i| self.buckets.get_mut(i)) {
            *g = (u8::try_from(b.occupied()).unwrap_or(u8::MAX), b.bytes(), b.evicted_at_ms, b.evicted_age_ms);
        }
    }

    /// Records held (as of each bucket's last sweep).
    pub fn occupancy(&self) -> u64 {
        self.buckets.iter().map(|g| u64::from(g.0)).sum()
    }

    /// Bytes the body keys hold (the buckets' and the pool's).
    pub fn bytes(&self) -> u64 {
        self.buckets.iter().map(|g| g.1).sum::<u64>() + self.pool_bytes
    }

    /// The age of the table's latest eviction (0 before any).
    pub fn evicted_age_ms(&self) -> u64 {
        self.buckets.iter().max_by_key(|g| g.2).filter(|g| g.2 > 0).map_or(0, |g| g.3)
    }
}

/// Adds to `stale` the reservations of `listed` in bucket `i` whose position no longer holds
/// their owner's entry (as the sweep left bucket `b`).
fn note_stale(listed: &[Reservation], i: u32, b: &Bucket, stale: &mut Vec<Reservation>) {
    let from = listed.partition_point(|r| r.bucket < i);
    for r in listed.iter().skip(from).take_while(|r| r.bucket == i) {
        let held = b.positions.get(r.position).is_some_and(|p| p.as_ref().is_some_and(|e| e.owner == r.owner));
        if !held {
            stale.push(*r);
        }
    }
}

/// A shared-data key name, written on the stack: a request names a bucket and a body key
/// a few times, and none of those names needs an allocation (the longest, a body key's, is under
/// 80 bytes; a longer one, which no table makes, goes to the heap).
pub enum Name {
    Stack([u8; 96], usize),
    Heap(String),
}

impl Name {
    fn of(parts: std::fmt::Arguments<'_>) -> Name {
        use std::fmt::Write;
        let mut n = Name::Stack([0; 96], 0);
        if n.write_fmt(parts).is_err() {
            n = Name::Heap(std::fmt::format(parts));
        }
        n
    }
}

impl std::fmt::Write for Name {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let Name::Stack(buf, len) = self else { return Err(std::fmt::Error) };
        let end = *len + s.len();
        buf.get_mut(*len..end).ok_or(std::fmt::Error)?.copy_from_slice(s.as_bytes());
        *len = end;
        Ok(())
    }
}

impl std::ops::Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        match self {
            // Only whole `&str`s are ever written in: always UTF-8.
            Name::Stack(buf, len) => buf.get(..*len).and_then(|b| std::str::from_utf8(b).ok()).unwrap_or(""),
            Name::Heap(s) => s,
        }
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self)
    }
}

/// What `Table::store_pooled` did.
enum Pooled {
    /// The body key holds the body, on this reservation.
    Stored(Reservation),
    /// The pool has no room (or is missing): keep the status only.
    NoRoom,
    /// The body key changed between its read and the write: nothing written, nothing reserved.
    Raced,
}

/// Where a claim goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    position: usize,
    /// The age of the record this claim replaces by eviction.
    evicted_age_ms: Option<u64>,
}

/// The creator as an entry keeps it: the request id, then each log value (name, value), each a
/// length byte and its bytes; empty when it does not fit in `MAX_CREATOR_BYTES`.
fn encode_creator(c: &Creator) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + c.request_id.len());
    let put = |s: &str, out: &mut Vec<u8>| match u8::try_from(s.len()) {
        Ok(n) => {
            out.push(n);
            out.extend_from_slice(s.as_bytes());
            true
        }
        Err(_) => false,
    };
    let mut ok = put(&c.request_id, &mut out);
    for (n, v) in &c.log_values {
        ok = ok && put(n, &mut out) && put(v, &mut out);
    }
    if !ok || out.len() > MAX_CREATOR_BYTES {
        return vec![];
    }
    out
}

fn decode_creator(b: &[u8]) -> Option<Creator> {
    fn take(r: &mut &[u8]) -> Option<String> {
        let (&n, tail) = r.split_first()?;
        let s = std::str::from_utf8(tail.get(..usize::from(n))?).ok()?.to_string();
        *r = tail.get(usize::from(n)..)?;
        Some(s)
    }
    let mut r = b;
    let request_id = take(&mut r)?;
    let mut log_values = vec![];
    while !r.is_empty() {
        log_values.push((take(&mut r)?, take(&mut r)?));
    }
    Some(Creator { request_id, log_values })
}

/// A body: the owner's token and the storage key (`body_belongs_to`), then `payload`.
fn body_of(h: &Handle, payload: &[u8]) -> Vec<u8> {
    [h.owner.0.as_slice(), h.skey.0.as_slice(), payload].concat()
}

/// A record's body: `body_of` its encoding.
fn encode_body(h: &Handle, r: &Record) -> Vec<u8> {
    body_of(h, &r.encode())
}

/// Whether a body was written by `h`'s owner for `h`'s key.
fn body_belongs_to(v: &[u8], h: &Handle) -> bool {
    v.get(..16) == Some(h.owner.0.as_slice()) && v.get(16..48) == Some(h.skey.0.as_slice())
}

/// The record a body holds: a completed record, or (shrunk past its own expiry, `Table::shrink`)
/// its key's tombstone (`Record::key_tombstone`).
fn decode_body(v: &[u8], h: &Handle) -> Option<Record> {
    if !body_belongs_to(v, h) {
        return None;
    }
    let r = v.get(48..)?;
    Record::open_key_tombstone(r).or_else(|| Record::decode(r).ok())
}

/// The body of a key's tombstone: the owner's token and the storage key (as every body), then
/// the key's small tombstone (`Record::key_tombstone_bytes`, what Redis seals): `TOMBSTONE_BODY_BYTES`.
fn encode_tombstone_body(h: &Handle, fp: &Fingerprint) -> Vec<u8> {
    body_of(h, &Record::key_tombstone_bytes(fp))
}

/// Bytes of a key's tombstone in the local tier (`encode_tombstone_body`): owner 16, key 32,
/// `IGT\x01` and the fingerprint 36, whatever the response was.
pub const TOMBSTONE_BODY_BYTES: usize = 16 + 32 + crate::record::KEY_TOMBSTONE_BODY.len() + 32;

#[cfg(test)]
mod tests;
