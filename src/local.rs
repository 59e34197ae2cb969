//! The local tier: records shared by all worker threads of one Envoy, in proxy-wasm shared data.
//!
//! Two host facts decide the design (../shared/PROXY_WASM_NOTES.md):
//! - a CAS write to an **absent** key simply inserts it, so "insert if absent" is not atomic;
//! - a key name, once written, is never freed.
//!
//! So the table is a set of key names whose number is bounded, the buckets created once (only
//! where truly absent) when the plugin is configured, before its VM serves traffic, and every
//! state change afterwards is a compare-and-swap on a key that exists:
//!
//! - `B = ceil(max_entries / 8)` **buckets** `<prefix>.b.<i>`, each with up to 64 positions, of
//!   which the value holds only the occupied ones (memory follows use: about 8 entries a bucket
//!   when the table is full, so a bucket overflows only far past its average). A key lives in
//!   bucket `skey mod B`. Claims, take-overs, completions and releases are CAS writes of the whole
//!   bucket, so exactly one of two racing workers wins.
//! - `<prefix>.count`: the occupied positions of all buckets, against `local.max_entries` (CAS
//!   counter). A claim that needs a new position reserves one unit first and only then makes its
//!   single bucket CAS, so the bound holds under any interleaving; a replaced free or evicted
//!   entry hands its unit over.
//! - **record slots** `<prefix>.s.<i>.<j>`, one per position ever used: the full record (creator,
//!   and the stored response once completed). A slot is written only by the owner of its position
//!   and prefixed with that owner's token, so a reader can tell a stale slot from a current one.
//! - `<prefix>.usage`: bytes held by completed records, against `local.max_bytes` (CAS counter).
//! - `<prefix>.evicted_age`: the age (ms) of the last record evicted (the protection actually given).
//! - `<prefix>.ready`: set once every bucket exists.
//!
//! When `max_entries` is reached, a new key takes the place of the oldest completed or
//! outcome-unknown record older than its own floor (`Entry::floor_ms`: the
//! `min_protection_seconds` of the configuration that wrote it, which may not be the one evicting:
//! every configuration of the VM with the same `max_entries` shares the table), in its bucket or a
//! few next ones (`when_full: "evict_oldest"`, the default); never a claim in flight. With none, the answer is
//! `Begin::Full` (503 `capacity-exhausted`, or, with a store, no local copy).
//!
//! `<prefix>` is `idemgate.v3.local.n<max_entries>`: the layout version and the capacity are in
//! the names, so a module with another layout, or a changed `local.max_entries`, starts a fresh
//! table instead of misreading this one. Memory is bounded by `max_entries` entries (and at most
//! `64 B` slot names) plus `max_bytes` of responses, whatever the number of distinct keys.
//!
//! Everything here is plain Rust over the `SharedData` trait, tested against a model with the
//! host's exact semantics under many interleavings of several workers.

use crate::config::{LocalConfig, Policy, WhenFull};
use crate::decision::{decide, Decision, Lookup, Phase, Summary};
use crate::fingerprint::Fingerprint;
use crate::lifecycle::{self, Event, Facts, Refusal, TakeOver};
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, Stage, State, UnknownReason};
use crate::scope::StorageKey;

/// Positions a bucket may hold (its value holds only the occupied ones).
pub const BUCKET_WIDTH: usize = 64;
/// Average entries per bucket when the table is full: `buckets = ceil(max_entries / DENSITY)`.
pub const DENSITY: u64 = 8;
/// How many buckets after its own a claim looks at for a record to evict when the table is full.
const EVICT_SCAN_BUCKETS: u32 = 8;
/// How many times an operation retries after losing a CAS race before giving up.
const MAX_CAS_RETRIES: usize = 64;
const BUCKET_MAGIC: &[u8; 4] = b"IGB\x03";
const ENTRY_BYTES: usize = 1 + 32 + 1 + 32 + 16 + 8 + 8 + 8 + 2 + 4 + 8;

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
    pub phase: EntryPhase,
    pub owner: OwnerToken,
    /// When the entry entered its stage: its claim, then its completion or outcome-unknown mark
    /// (the eviction floor counts from it: only finished records are ever evicted).
    pub since_ms: u64,
    pub expires_at_ms: u64,
    pub lock_expires_at_ms: u64,
    /// The status of a completed record (0 otherwise).
    pub status: u16,
    /// Bytes of the completed record in its slot, counted in `usage`.
    pub slot_bytes: u32,
    /// The entry's own protection floor: it may be evicted only once `since_ms + floor_ms` has
    /// passed (`u64::MAX`: never, it is kept until it expires). Set by the configuration that
    /// claimed the key (`Table::entry_floor_ms`) and only ever raised by the ones that complete
    /// or mark it (another listener may mark a stale claim outcome-unknown), so the protection a
    /// record was promised holds whatever other configuration shares the table (another listener
    /// in the same VM, or a reload) and evicts.
    pub floor_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryPhase {
    Claimed,
    InProgress,
    Completed,
    Unknown,
}

impl EntryPhase {
    /// The bucket encoding of a live stage (`None` for `Absent`: an empty position).
    fn of(stage: Stage) -> Option<EntryPhase> {
        match stage {
            Stage::Absent => None,
            Stage::Claimed => Some(EntryPhase::Claimed),
            Stage::Forwarded => Some(EntryPhase::InProgress),
            Stage::Completed => Some(EntryPhase::Completed),
            Stage::Unknown => Some(EntryPhase::Unknown),
        }
    }
}

/// The stage of a position (empty: `Absent`).
fn stage_of(p: &Option<Entry>) -> Stage {
    p.as_ref().map_or(Stage::Absent, |e| e.summary().stage())
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
        let phase = match self.phase {
            EntryPhase::Claimed => Phase::Claimed { lock_expires_at_ms },
            EntryPhase::InProgress => Phase::InProgress { lock_expires_at_ms },
            EntryPhase::Completed => Phase::Completed,
            EntryPhase::Unknown => Phase::Unknown,
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
        lifecycle::next(self.summary().stage(), Event::Evict, Facts::of(&self.summary(), now_ms, false)).is_ok()
            && now_ms.saturating_sub(self.since_ms) >= self.floor_ms
    }
}

/// A bucket: `BUCKET_WIDTH` positions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bucket {
    pub positions: Vec<Option<Entry>>,
}

impl Bucket {
    pub fn empty() -> Bucket {
        Bucket { positions: vec![None; BUCKET_WIDTH] }
    }

    /// Magic, the number of occupied positions, then each: its index, its phase tag, the entry.
    pub fn encode(&self) -> Vec<u8> {
        let used = self.positions.iter().filter(|p| p.is_some()).count();
        let mut out = Vec::with_capacity(5 + used * (1 + ENTRY_BYTES));
        out.extend_from_slice(BUCKET_MAGIC);
        out.push(u8::try_from(used).unwrap_or(u8::MAX));
        for (j, p) in self.positions.iter().enumerate() {
            let Some(e) = p else { continue };
            out.push(u8::try_from(j).unwrap_or(u8::MAX));
            out.push(match e.phase {
                EntryPhase::Claimed => 1,
                EntryPhase::InProgress => 2,
                EntryPhase::Completed => 3,
                EntryPhase::Unknown => 4,
            });
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
            out.extend_from_slice(&e.slot_bytes.to_le_bytes());
            out.extend_from_slice(&e.floor_ms.to_le_bytes());
        }
        out
    }

    /// Refuses an unknown magic or tag, a position out of range or not in increasing order,
    /// truncation and trailing bytes.
    pub fn decode(bytes: &[u8]) -> Option<Bucket> {
        let (&used, mut r) = bytes.strip_prefix(BUCKET_MAGIC.as_slice())?.split_first()?;
        let mut b = Bucket::empty();
        let mut next = 0usize;
        for _ in 0..used {
            let (&j, tail) = r.split_first()?;
            let j = usize::from(j);
            if j < next || j >= BUCKET_WIDTH {
                return None;
            }
            next = j + 1;
            let (&tag, tail) = tail.split_first()?;
            let phase = match tag {
                1 => EntryPhase::Claimed,
                2 => EntryPhase::InProgress,
                3 => EntryPhase::Completed,
                4 => EntryPhase::Unknown,
                _ => return None,
            };
            let body = tail.get(..ENTRY_BYTES - 1)?;
            r = tail.get(ENTRY_BYTES - 1..)?;
            let arr = |from: usize, to: usize| body.get(from..to);
            let u64_at = |at: usize| arr(at, at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
            let skey: [u8; 32] = arr(0, 32)?.try_into().ok()?;
            let fingerprint = match body.get(32)? {
                0 => None,
                1 => Some(Fingerprint(arr(33, 65)?.try_into().ok()?)),
                _ => return None,
            };
            let owner: [u8; 16] = arr(65, 81)?.try_into().ok()?;
            *b.positions.get_mut(j)? = Some(Entry {
                skey: StorageKey(skey),
                fingerprint,
                phase,
                owner: OwnerToken(owner),
                since_ms: u64_at(81)?,
                expires_at_ms: u64_at(89)?,
                lock_expires_at_ms: u64_at(97)?,
                status: u16::from_le_bytes(arr(105, 107)?.try_into().ok()?),
                slot_bytes: u32::from_le_bytes(arr(107, 111)?.try_into().ok()?),
                floor_ms: u64_at(111)?,
            });
        }
        r.is_empty().then_some(b)
    }

    fn occupied(&self) -> u64 {
        self.positions.iter().filter(|p| p.is_some()).count() as u64
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
    /// This request now holds the key: forward it (after `mark_forwarded` when the claim was made
    /// before the fingerprint was known).
    Claimed { handle: Handle, took_over: bool, evicted: bool },
    /// Completed before: replay this record.
    Replay(Record),
    /// Answer with this problem; `creator` names the run that made the record, when known.
    Reject { problem: ProblemKind, creator: Option<Creator>, marked_unknown: bool },
    /// The decision needs the fingerprint: buffer the body, then call `begin` again with it.
    NeedFingerprint,
    /// The key's bucket holds only unexpired records that may not be evicted.
    Full,
}

/// A live record read without claiming anything (`Table::peek`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peeked {
    pub summary: Summary,
    /// The record, when it is completed and its slot could be read.
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
    max_entries: u64,
    max_bytes: u64,
    when_full: WhenFull,
    /// The protection floor this configuration gives the records it writes (each entry keeps
    /// its own: `Entry::floor_ms`).
    floor_ms: u64,
}

impl Table {
    pub fn new(cfg: &LocalConfig) -> Table {
        let buckets = cfg.max_entries.div_ceil(DENSITY).clamp(1, u64::from(u32::MAX));
        Table {
            prefix: format!("idemgate.v3.local.n{}", cfg.max_entries),
            buckets: u32::try_from(buckets).unwrap_or(u32::MAX),
            max_entries: cfg.max_entries,
            max_bytes: cfg.max_bytes,
            when_full: cfg.when_full,
            floor_ms: cfg.min_protection_seconds.saturating_mul(1000),
        }
    }

    /// With an external store the local tier is a cache: the store keeps every record, so a full
    /// table evicts the oldest finished record whatever its age (a claim in flight still never).
    /// Only records this configuration writes get no floor: a record another configuration wrote
    /// (another listener of the VM without a store, or this one before a reload added the store)
    /// keeps its own.
    pub fn as_cache(mut self) -> Table {
        self.when_full = WhenFull::EvictOldest;
        self.floor_ms = 0;
        self
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

    /// Records the table holds at most (`local.max_entries`).
    pub fn capacity(&self) -> u64 {
        self.max_entries
    }

    /// Bytes of the bucket index with every record held: bounded by `max_entries` (an empty
    /// table holds only the bucket names and their 4-byte headers).
    pub fn max_index_bytes(&self) -> u64 {
        u64::from(self.buckets) * (BUCKET_MAGIC.len() + 1) as u64 + self.max_entries * (1 + ENTRY_BYTES) as u64
    }

    /// What the table holds and supports, for the configure-time log line: a record lives
    /// `ttl_seconds`, so `capacity / ttl_seconds` protected requests a second fit without
    /// evicting. "Reserved" is the most it may take: the index at capacity plus `max_bytes` of
    /// responses (memory follows use up to that).
    pub fn describe(&self, ttl_seconds: u64) -> String {
        let mib = (self.max_index_bytes() + self.max_bytes) as f64 / (1024.0 * 1024.0);
        let rate = self.max_entries as f64 / ttl_seconds.max(1) as f64;
        format!(
            "idemgate: local table: capacity {} records, {mib:.0} MiB reserved, supports {rate:.1} protected requests/s sustained at ttl_seconds {ttl_seconds}",
            self.max_entries
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

    pub fn slot_name(&self, i: u32, j: usize) -> Name {
        Name::of(format_args!("{}.s.{i}.{j}", self.prefix))
    }

    fn usage_name(&self) -> Name {
        Name::of(format_args!("{}.usage", self.prefix))
    }

    fn count_name(&self) -> Name {
        Name::of(format_args!("{}.count", self.prefix))
    }

    fn evicted_age_name(&self) -> Name {
        Name::of(format_args!("{}.evicted_age", self.prefix))
    }

    fn ready_name(&self) -> Name {
        Name::of(format_args!("{}.ready", self.prefix))
    }

    pub fn bucket_of(&self, skey: &StorageKey) -> u32 {
        let mut first = [0u8; 8];
        first.copy_from_slice(skey.0.get(24..32).unwrap_or(&[0u8; 8]));
        u32::try_from(u64::from_le_bytes(first) % u64::from(self.buckets)).unwrap_or(0)
    }

    /// Creates the buckets and the counters where they are truly absent; never touches one that
    /// exists (a worker starting or a configuration reload keeps live records). Returns how many
    /// keys it created. Call it when the plugin is configured, before traffic: Envoy configures
    /// the main-thread VM before any worker serves a request.
    pub fn ensure_created(&self, sd: &mut dyn SharedData) -> Result<u32, LocalError> {
        if let (Some(v), _) = sd.get(&self.ready_name())? {
            if v == b"1" {
                return Ok(0);
            }
        }
        let mut created = 0;
        let empty = Bucket::empty().encode();
        for i in 0..self.buckets {
            let name = self.bucket_name(i);
            if let (None, None) = sd.get(&name)? {
                sd.set(&name, &empty, None).map_err(|_| LocalError::Host)?;
                created += 1;
            }
        }
        for name in [self.usage_name(), self.count_name()] {
            if let (None, None) = sd.get(&name)? {
                sd.set(&name, &0u64.to_le_bytes(), None).map_err(|_| LocalError::Host)?;
                created += 1;
            }
        }
        sd.set(&self.ready_name(), b"1", None).map_err(|_| LocalError::Host)?;
        Ok(created)
    }

    fn read_bucket(&self, sd: &mut dyn SharedData, i: u32) -> Result<(Bucket, u32), LocalError> {
        match sd.get(&self.bucket_name(i))? {
            (Some(v), Some(cas)) => Bucket::decode(&v).map(|b| (b, cas)).ok_or(LocalError::Corrupt),
            // Never created, or emptied by something else: creating it here would not be atomic.
            _ => Err(LocalError::Missing),
        }
    }

    /// Writes a bucket with CAS; `Ok(false)` when another worker changed it first.
    fn write_bucket(&self, sd: &mut dyn SharedData, i: u32, b: &Bucket, cas: u32) -> Result<bool, LocalError> {
        match sd.set(&self.bucket_name(i), &b.encode(), Some(cas)) {
            Ok(()) => Ok(true),
            Err(SetError::CasMismatch) => Ok(false),
            Err(SetError::Host) => Err(LocalError::Host),
        }
    }

    /// Reads a record slot if it belongs to `owner` and `skey`.
    fn read_slot(&self, sd: &mut dyn SharedData, h: &Handle) -> Result<Option<(Record, u32)>, LocalError> {
        let (v, cas) = sd.get(&self.slot_name(h.bucket, h.position))?;
        let (Some(v), Some(cas)) = (v, cas) else { return Ok(None) };
        Ok(decode_slot(&v, h).map(|r| (r, cas)))
    }

    /// Looks the key up and, when it is free (or a stale claim that never forwarded), claims it
    /// atomically. `fp` is `None` at request headers. On a claim, `creator` and the owner are
    /// written to the record slot.
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
        let mut unit = Unit::None;
        let out = self.begin_holding(sd, skey, fp, now_ms, policy, owner, creator, &mut unit);
        if unit != Unit::None {
            // A unit of the count this call reserved (or took from an evicted record) but did
            // not use: the position it stands for is free.
            self.add_to(sd, &self.count_name(), -1);
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn begin_holding(
        &self,
        sd: &mut dyn SharedData,
        skey: StorageKey,
        fp: Option<Fingerprint>,
        now_ms: u64,
        policy: &Policy,
        owner: OwnerToken,
        creator: &Creator,
        unit: &mut Unit,
    ) -> Result<Begin, LocalError> {
        let i = self.bucket_of(&skey);
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas) = self.read_bucket(sd, i)?;
            let live = bucket.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.holds(&skey, now_ms)));
            let lookup = match live.and_then(|j| bucket.positions.get(j)).and_then(|p| p.as_ref()) {
                Some(e) => Lookup::Found(e.summary()),
                None => Lookup::Absent,
            };
            let decision = decide(lookup, fp.as_ref(), now_ms, policy, crate::config::OnUnavailable::Reject);
            let lifetimes = Lifetimes::of(policy);
            let forwarding = fp.is_some();
            let target = match (&decision, live) {
                (Decision::Claim, _) => match self.place(sd, i, &bucket, now_ms, unit)? {
                    Some(place) => Some((place, false)),
                    None => return Ok(Begin::Full),
                },
                (Decision::TakeOver, Some(j)) => Some((Place { position: j, evicted_age_ms: None, new: false }, true)),
                _ => None,
            };
            // The one lifecycle says what the claim becomes: a new claim of an empty, free or
            // evicted position, or a take-over of a stale claim; anything else is refused.
            let stage = match target {
                None => Stage::Absent,
                Some((place, took_over)) => {
                    let p = bucket.positions.get(place.position).cloned().flatten();
                    let event = match (took_over, p.as_ref().map(|e| e.phase)) {
                        (true, Some(EntryPhase::InProgress)) => {
                            Event::TakeOver { how: TakeOver::StaleForwarded, forwarding }
                        }
                        (true, _) => Event::TakeOver { how: TakeOver::NeverForwarded, forwarding },
                        (false, _) => Event::Claim { forwarding },
                    };
                    let from = match place.evicted_age_ms {
                        Some(_) => step(&p, Event::Evict, None, now_ms).map(|_| None).map_err(LocalError::Refused)?,
                        None => p,
                    };
                    step(&from, event, None, now_ms).map_err(LocalError::Refused)?
                }
            };
            let new_entry = Entry {
                skey,
                fingerprint: fp,
                phase: EntryPhase::of(stage).unwrap_or(EntryPhase::Claimed),
                owner,
                since_ms: now_ms,
                expires_at_ms: lifetimes.expires_at(stage, now_ms),
                lock_expires_at_ms: lifetimes.lock_expires_at(now_ms),
                status: 0,
                slot_bytes: 0,
                floor_ms: self.entry_floor_ms(),
            };
            if let Some((place, took_over)) = target {
                // Claim the position (new, free, expired, evicted, or a stale claim taken over)
                // with one CAS of the whole bucket; a lost race starts over with a fresh read.
                let j = place.position;
                let freed = bucket.positions.get(j).and_then(|p| p.as_ref()).map_or(0, |e| e.slot_bytes);
                if let Some(p) = bucket.positions.get_mut(j) {
                    *p = Some(new_entry);
                }
                if !self.write_bucket(sd, i, &bucket, cas)? {
                    continue;
                }
                let evicted = place.evicted_age_ms.is_some() || (place.new && *unit == Unit::Evicted);
                if place.new {
                    *unit = Unit::None; // the new position holds it now
                }
                if let Some(age) = place.evicted_age_ms {
                    self.note_eviction(sd, age);
                }
                self.add_usage(sd, -i64::from(freed));
                let handle = Handle { bucket: i, position: j, owner, skey };
                self.write_claim_slot(sd, &handle, &bucket, creator);
                return Ok(Begin::Claimed { handle, took_over, evicted });
            }
            match (decision, live) {
                (Decision::MarkUnknown, Some(j)) => {
                    let Some(p) = bucket.positions.get_mut(j) else { return Err(LocalError::Corrupt) };
                    let to = step(p, Event::StaleToUnknown, None, now_ms).map_err(LocalError::Refused)?;
                    let (Some(e), Some(phase)) = (p.as_mut(), EntryPhase::of(to)) else {
                        return Err(LocalError::Corrupt);
                    };
                    e.phase = phase;
                    e.since_ms = now_ms;
                    e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
                    e.expires_at_ms = lifetimes.expires_at(Stage::Unknown, now_ms);
                    let e = e.clone();
                    if !self.write_bucket(sd, i, &bucket, cas)? {
                        continue;
                    }
                    let creator = self.creator_of(sd, i, j, &e);
                    return Ok(Begin::Reject { problem: ProblemKind::OutcomeUnknown, creator, marked_unknown: true });
                }
                (Decision::Replay, Some(j)) => {
                    let Some(Some(e)) = bucket.positions.get(j) else { return Err(LocalError::Corrupt) };
                    let h = Handle { bucket: i, position: j, owner: e.owner, skey };
                    return Ok(match self.read_slot(sd, &h)? {
                        Some((r, _)) if matches!(r.state, State::Completed(_) | State::CompletedTooLarge { .. }) => {
                            Begin::Replay(r)
                        }
                        // The slot no longer matches (should not happen): never execute again;
                        // answer with what the index knows.
                        _ => Begin::Reject {
                            problem: ProblemKind::ResponseNotStored { status: e.status, location: None },
                            creator: None,
                            marked_unknown: false,
                        },
                    });
                }
                (Decision::Reject(problem), j) => {
                    let creator = j.and_then(|j| {
                        let e = bucket.positions.get(j)?.as_ref()?.clone();
                        self.creator_of(sd, i, j, &e)
                    });
                    return Ok(Begin::Reject { problem, creator, marked_unknown: false });
                }
                (Decision::NeedFingerprint, _) => return Ok(Begin::NeedFingerprint),
                // Claim and TakeOver were handled above; PassUnprotected cannot come from the
                // local tier; MarkUnknown and Replay always have a live position.
                _ => return Err(LocalError::Corrupt),
            }
        }
        Err(LocalError::Contended)
    }

    /// Reads the live record of `skey` without claiming anything: its summary and, when it is
    /// completed, the record itself (for requests waiting on another attempt).
    pub fn peek(&self, sd: &mut dyn SharedData, skey: &StorageKey, now_ms: u64) -> Result<Option<Peeked>, LocalError> {
        let i = self.bucket_of(skey);
        let (bucket, _) = self.read_bucket(sd, i)?;
        let Some((j, e)) = bucket
            .positions
            .iter()
            .enumerate()
            .find_map(|(j, p)| p.as_ref().filter(|e| e.holds(skey, now_ms)).map(|e| (j, e)))
        else {
            return Ok(None);
        };
        let record = match e.phase {
            EntryPhase::Completed => {
                let h = Handle { bucket: i, position: j, owner: e.owner, skey: *skey };
                self.read_slot(sd, &h)?.map(|(r, _)| r)
            }
            _ => None,
        };
        Ok(Some(Peeked { summary: e.summary(), record, status: e.status }))
    }

    /// A position for a new key, in this order: a free one (expired, no live lock: it hands its
    /// unit of the count over); an empty one, with a unit of the count (reserved now, or taken
    /// from a free or evicted record of one of the next buckets when the table is full); or, at
    /// capacity with `evict_oldest`, the oldest finished record of this bucket older than the
    /// floor. `None`: full.
    fn place(
        &self,
        sd: &mut dyn SharedData,
        i: u32,
        b: &Bucket,
        now_ms: u64,
        unit: &mut Unit,
    ) -> Result<Option<Place>, LocalError> {
        if let Some(j) = b.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.is_free(now_ms))) {
            return Ok(Some(Place { position: j, evicted_age_ms: None, new: false }));
        }
        let empty = b.positions.iter().position(Option::is_none);
        if let Some(j) = empty {
            if *unit == Unit::None && self.reserve_on(sd, &self.count_name(), 1, self.max_entries)? {
                *unit = Unit::Reserved;
            }
            if *unit != Unit::None {
                return Ok(Some(Place { position: j, evicted_age_ms: None, new: true }));
            }
        }
        if let Some((j, age)) = self.eviction_candidate(b, now_ms) {
            return Ok(Some(Place { position: j, evicted_age_ms: Some(age), new: false }));
        }
        if let Some(j) = empty {
            if let Some(evicted) = self.take_from_next_buckets(sd, i, now_ms)? {
                *unit = if evicted { Unit::Evicted } else { Unit::Reserved };
                return Ok(Some(Place { position: j, evicted_age_ms: None, new: true }));
            }
        }
        Ok(None)
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

    /// At capacity, with no room in the key's own bucket: frees one position in one of the next
    /// `EVICT_SCAN_BUCKETS` buckets (a free record, else an evictable one) with a CAS of that
    /// bucket, and keeps its unit of the count for the caller's claim (so no other claim can take
    /// it in between). `Some(true)` when it evicted a live record.
    fn take_from_next_buckets(&self, sd: &mut dyn SharedData, i: u32, now_ms: u64) -> Result<Option<bool>, LocalError> {
        for k in 1..=EVICT_SCAN_BUCKETS.min(self.buckets.saturating_sub(1)) {
            let n = i.wrapping_add(k) % self.buckets;
            for _ in 0..MAX_CAS_RETRIES {
                let (mut bucket, cas) = self.read_bucket(sd, n)?;
                let free = bucket.positions.iter().position(|p| p.as_ref().is_some_and(|e| e.is_free(now_ms)));
                let (j, age) = match free {
                    Some(j) => (j, None),
                    None => match self.eviction_candidate(&bucket, now_ms) {
                        Some((j, age)) => (j, Some(age)),
                        None => break,
                    },
                };
                let Some(p) = bucket.positions.get_mut(j) else { break };
                let event = if age.is_some() { Event::Evict } else { Event::Expire };
                step(p, event, None, now_ms).map_err(LocalError::Refused)?;
                let Some(e) = p.take() else { break };
                if !self.write_bucket(sd, n, &bucket, cas)? {
                    continue;
                }
                self.add_usage(sd, -i64::from(e.slot_bytes));
                self.clear_slot(sd, &Handle { bucket: n, position: j, owner: e.owner, skey: e.skey });
                if let Some(age) = age {
                    self.note_eviction(sd, age);
                }
                return Ok(Some(age.is_some()));
            }
        }
        Ok(None)
    }

    /// Keeps the age of the record just evicted, for the gauge (the protection actually given).
    fn note_eviction(&self, sd: &mut dyn SharedData, age_ms: u64) {
        let _ = sd.set(&self.evicted_age_name(), &age_ms.to_le_bytes(), None);
    }

    fn write_claim_slot(&self, sd: &mut dyn SharedData, h: &Handle, b: &Bucket, creator: &Creator) {
        let Some(Some(e)) = b.positions.get(h.position) else { return };
        let state = match e.phase {
            EntryPhase::Claimed => State::Claimed { owner: h.owner, lock_expires_at_ms: e.lock_expires_at_ms },
            _ => State::InProgress { owner: h.owner, lock_expires_at_ms: e.lock_expires_at_ms },
        };
        let record = Record {
            fingerprint: e.fingerprint.unwrap_or(Fingerprint([0; 32])),
            created_at_ms: e.since_ms,
            expires_at_ms: e.expires_at_ms,
            creator: creator.clone(),
            state,
        };
        // Best effort: the slot only serves to name the creator until completion.
        let _ = sd.set(&self.slot_name(h.bucket, h.position), &encode_slot(h, &record), None);
    }

    fn creator_of(&self, sd: &mut dyn SharedData, i: u32, j: usize, e: &Entry) -> Option<Creator> {
        let h = Handle { bucket: i, position: j, owner: e.owner, skey: e.skey };
        self.read_slot(sd, &h).ok().flatten().map(|(r, _)| r.creator)
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
        f: impl FnMut(&mut Option<Entry>, Stage),
    ) -> Result<Result<Stage, Refusal>, LocalError> {
        self.transition_from(sd, h, None, event, now_ms, f)
    }

    /// `transition`, starting from a bucket the caller has just read (and its CAS) instead of
    /// reading it again: if it changed since, the CAS fails and the next round reads it afresh.
    fn transition_from(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        mut read: Option<(Bucket, u32)>,
        event: Event,
        now_ms: u64,
        mut f: impl FnMut(&mut Option<Entry>, Stage),
    ) -> Result<Result<Stage, Refusal>, LocalError> {
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas) = match read.take() {
                Some(b) => b,
                None => self.read_bucket(sd, h.bucket)?,
            };
            let Some(slot) = bucket.positions.get_mut(h.position) else { return Err(LocalError::Corrupt) };
            let to = match step(slot, event, Some(h), now_ms) {
                Ok(to) => to,
                Err(refused) => return Ok(Err(refused)),
            };
            f(slot, to);
            if self.write_bucket(sd, h.bucket, &bucket, cas)? {
                return Ok(Ok(to));
            }
        }
        Err(LocalError::Contended)
    }

    /// A claim made at headers becomes in progress with its fingerprint, just before forwarding.
    /// Forwarding requires a claim that is still the key's only live claim: the position is still
    /// ours, and no other position holds the key (a retry may have claimed it elsewhere while our
    /// claim, made before a slow upload, had expired). Both are checked in the same CAS of the
    /// bucket that marks us forwarded. The lock restarts now and the expiry becomes a forwarded claim's (`Stage::Forwarded`: the lock, then `unknown_outcome_seconds`).
    /// `Ok(false)`: do not forward.
    pub fn mark_forwarded(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        fp: Fingerprint,
        now_ms: u64,
        policy: &Policy,
    ) -> Result<bool, LocalError> {
        let lifetimes = Lifetimes::of(policy);
        for _ in 0..MAX_CAS_RETRIES {
            let (mut bucket, cas) = self.read_bucket(sd, h.bucket)?;
            let superseded = bucket
                .positions
                .iter()
                .enumerate()
                .any(|(j, p)| j != h.position && p.as_ref().is_some_and(|e| e.holds(&h.skey, now_ms)));
            let Some(slot) = bucket.positions.get_mut(h.position) else { return Err(LocalError::Corrupt) };
            let Ok(phase) = step(slot, Event::Forward, Some(h), now_ms).map(EntryPhase::of) else { return Ok(false) };
            let (Some(e), Some(phase)) = (slot.as_mut(), phase) else { return Ok(false) };
            if superseded {
                return Ok(false);
            }
            e.phase = phase;
            e.fingerprint = Some(fp);
            e.lock_expires_at_ms = lifetimes.lock_expires_at(now_ms);
            e.expires_at_ms = lifetimes.expires_at(Stage::Forwarded, now_ms);
            if self.write_bucket(sd, h.bucket, &bucket, cas)? {
                return Ok(true);
            }
        }
        Err(LocalError::Contended)
    }

    /// Stores a completed record (see `Record::completed`). When `local.max_bytes` has no room
    /// for it, only the status and `location` are kept: retries then get a problem carrying them,
    /// never a second execution.
    pub fn complete(
        &self,
        sd: &mut dyn SharedData,
        h: &Handle,
        mut record: Record,
        now_ms: u64,
    ) -> Result<Completed, LocalError> {
        let fp = record.fingerprint;
        let expires_at_ms = record.expires_at_ms;
        let mut bytes = encode_slot(h, &record);
        let mut without_body = !matches!(record.state, State::Completed(_));
        if !without_body && !self.reserve(sd, bytes.len() as u64)? {
            without_body = true;
            record.state = record.state.without_body();
            bytes = encode_slot(h, &record);
        }
        let status = match &record.state {
            State::Completed(r) => r.status,
            State::CompletedTooLarge { status, .. } => *status,
            _ => 0,
        };
        let counted = if without_body { 0 } else { u32::try_from(bytes.len()).unwrap_or(u32::MAX) };
        // Only a claim the lifecycle lets its owner complete is written (checked again in the
        // bucket CAS below): a refused completion never overwrites the slot.
        let (bucket, cas) = self.read_bucket(sd, h.bucket)?;
        let Some(position) = bucket.positions.get(h.position) else { return Err(LocalError::Corrupt) };
        if step(position, Event::Complete, Some(h), now_ms).is_err() {
            self.add_usage(sd, -i64::from(counted));
            return Ok(Completed::LostClaim);
        }
        // The slot first (owner-checked with CAS), then the index: a reader that sees the entry
        // completed always finds its record.
        let wrote = match self.read_slot(sd, h)? {
            Some((_, cas)) => matches!(sd.set(&self.slot_name(h.bucket, h.position), &bytes, Some(cas)), Ok(())),
            None => false,
        };
        if !wrote {
            self.add_usage(sd, -i64::from(counted));
            return Ok(Completed::LostClaim);
        }
        // The bucket read above is the first round's: unchanged since, its CAS holds.
        let updated = self.transition_from(sd, h, Some((bucket, cas)), Event::Complete, now_ms, |slot, to| {
            if let (Some(e), Some(phase)) = (slot, EntryPhase::of(to)) {
                e.phase = phase;
                e.since_ms = now_ms;
                e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
                e.fingerprint = Some(fp);
                e.expires_at_ms = expires_at_ms;
                e.status = status;
                e.slot_bytes = counted;
            }
        })?;
        if updated.is_err() {
            self.add_usage(sd, -i64::from(counted));
            return Ok(Completed::LostClaim);
        }
        Ok(if without_body { Completed::StoredWithoutBody } else { Completed::Stored })
    }

    /// Frees our claim: the request never executed, a retry may. `Ok(false)` if it was not ours
    /// (or no longer a claim, or already free at `now_ms`: `lifecycle::next` refuses).
    pub fn release(&self, sd: &mut dyn SharedData, h: &Handle, now_ms: u64) -> Result<bool, LocalError> {
        let mut bytes = 0;
        let freed = self.transition(sd, h, Event::Release, now_ms, |slot, _| {
            bytes = slot.as_ref().map_or(0, |e| e.slot_bytes);
            *slot = None;
        })?;
        match freed {
            Ok(_) => {
                self.add_usage(sd, -i64::from(bytes));
                self.add_to(sd, &self.count_name(), -1);
                self.clear_slot(sd, h);
                Ok(true)
            }
            Err(_) => Ok(false),
        }
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
        let done = self.transition(sd, h, Event::MarkUnknown, now_ms, |slot, to| {
            if let (Some(e), Some(phase)) = (slot, EntryPhase::of(to)) {
                e.phase = phase;
                e.since_ms = now_ms;
                e.floor_ms = e.floor_ms.max(self.entry_floor_ms());
                e.expires_at_ms = Lifetimes::of(policy).expires_at(to, now_ms);
            }
        })?;
        Ok(done.is_ok())
    }

    /// Frees expired entries of `count` buckets from `start` (wrapping), so their response bytes
    /// are released even if their keys never come back. Returns how many entries it freed.
    pub fn sweep(&self, sd: &mut dyn SharedData, start: u32, count: u32, now_ms: u64) -> Result<u32, LocalError> {
        let mut freed_total = 0;
        for k in 0..count.min(self.buckets) {
            let i = (start.wrapping_add(k)) % self.buckets;
            for _ in 0..MAX_CAS_RETRIES {
                let (mut bucket, cas) = self.read_bucket(sd, i)?;
                let mut freed = vec![];
                for (j, p) in bucket.positions.iter_mut().enumerate() {
                    if step(p, Event::Expire, None, now_ms).is_err() {
                        continue;
                    }
                    if let Some(e) = p.take() {
                        freed.push((Handle { bucket: i, position: j, owner: e.owner, skey: e.skey }, e.slot_bytes));
                    }
                }
                if freed.is_empty() {
                    break;
                }
                if self.write_bucket(sd, i, &bucket, cas)? {
                    self.add_to(sd, &self.count_name(), -(freed.len() as i64));
                    for (h, bytes) in &freed {
                        self.add_usage(sd, -i64::from(*bytes));
                        self.clear_slot(sd, h);
                    }
                    freed_total += freed.len() as u32;
                    break;
                }
            }
        }
        Ok(freed_total)
    }

    /// Empties the record slot of a position just freed, only if it still holds `h`'s record
    /// (CAS on the slot): a worker that claimed the position after the bucket was written may
    /// already have written its own record there, and keeps it. A slot left behind by a lost race
    /// is ignored by readers (its owner differs from the position's) and overwritten by the next
    /// owner of the position.
    fn clear_slot(&self, sd: &mut dyn SharedData, h: &Handle) {
        let name = self.slot_name(h.bucket, h.position);
        if let Ok((Some(v), Some(cas))) = sd.get(&name) {
            if slot_belongs_to(&v, h) {
                let _ = sd.set(&name, b"", Some(cas));
            }
        }
    }

    /// Bytes of completed records held now.
    pub fn usage(&self, sd: &mut dyn SharedData) -> u64 {
        self.read_u64(sd, &self.usage_name())
    }

    /// Records held now (the count every claim, release, eviction and sweep keeps).
    pub fn count(&self, sd: &mut dyn SharedData) -> u64 {
        self.read_u64(sd, &self.count_name())
    }

    /// The age in ms of the last record evicted to make room (0 before any eviction).
    pub fn last_evicted_age_ms(&self, sd: &mut dyn SharedData) -> u64 {
        self.read_u64(sd, &self.evicted_age_name())
    }

    fn read_u64(&self, sd: &mut dyn SharedData, name: &str) -> u64 {
        match sd.get(name) {
            Ok((Some(v), _)) => v.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0),
            _ => 0,
        }
    }

    /// Number of occupied positions (scans every bucket: for tests and diagnostics).
    pub fn occupied(&self, sd: &mut dyn SharedData) -> u64 {
        (0..self.buckets).filter_map(|i| self.read_bucket(sd, i).ok()).map(|(b, _)| b.occupied()).sum()
    }

    /// Adds `bytes` to usage if it stays within `max_bytes`.
    fn reserve(&self, sd: &mut dyn SharedData, bytes: u64) -> Result<bool, LocalError> {
        self.reserve_on(sd, &self.usage_name(), bytes, self.max_bytes)
    }

    /// Adds `amount` to the counter `name` (CAS) if it stays within `limit`.
    fn reserve_on(&self, sd: &mut dyn SharedData, name: &str, amount: u64, limit: u64) -> Result<bool, LocalError> {
        for _ in 0..MAX_CAS_RETRIES {
            let (v, cas) = sd.get(name)?;
            let (Some(v), Some(cas)) = (v, cas) else { return Err(LocalError::Missing) };
            let used = v.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0);
            if used.saturating_add(amount) > limit {
                return Ok(false);
            }
            match sd.set(name, &(used + amount).to_le_bytes(), Some(cas)) {
                Ok(()) => return Ok(true),
                Err(SetError::CasMismatch) => continue,
                Err(SetError::Host) => return Err(LocalError::Host),
            }
        }
        Err(LocalError::Contended)
    }

    fn add_usage(&self, sd: &mut dyn SharedData, delta: i64) {
        self.add_to(sd, &self.usage_name(), delta);
    }

    fn add_to(&self, sd: &mut dyn SharedData, name: &str, delta: i64) {
        if delta == 0 {
            return;
        }
        for _ in 0..MAX_CAS_RETRIES {
            let Ok((Some(v), Some(cas))) = sd.get(name) else { return };
            let used = v.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0);
            let next = used.saturating_add_signed(delta);
            if sd.set(name, &next.to_le_bytes(), Some(cas)) != Err(SetError::CasMismatch) {
                return;
            }
        }
    }
}

/// A shared-data key name, written on the stack: a request names a bucket, a slot and a counter
/// a dozen times, and none of those names needs an allocation (the longest, a slot's, is under
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

/// A unit of the record count a claim holds for a new position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unit {
    None,
    /// Reserved under `max_entries`, or taken from a free record of another bucket.
    Reserved,
    /// Taken from a record evicted from another bucket.
    Evicted,
}

/// Where a claim goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Place {
    position: usize,
    /// The age of the record this claim replaces by eviction.
    evicted_age_ms: Option<u64>,
    /// An empty position: the claim uses the unit of the count it holds.
    new: bool,
}

/// A slot: the owner's token and the storage key, then the encoded record.
fn encode_slot(h: &Handle, r: &Record) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    out.extend_from_slice(&h.owner.0);
    out.extend_from_slice(&h.skey.0);
    out.extend_from_slice(&r.encode());
    out
}

/// Whether a slot's value was written by `h`'s owner for `h`'s key.
fn slot_belongs_to(v: &[u8], h: &Handle) -> bool {
    v.get(..16) == Some(h.owner.0.as_slice()) && v.get(16..48) == Some(h.skey.0.as_slice())
}

fn decode_slot(v: &[u8], h: &Handle) -> Option<Record> {
    if !slot_belongs_to(v, h) {
        return None;
    }
    Record::decode(v.get(48..)?).ok()
}

#[cfg(test)]
mod tests;
