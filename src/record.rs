//! The record kept for each (scope, key): its state and a versioned, compact binary encoding.
//!
//! Records hold no raw key and no credential: they are addressed by a hashed storage key (see
//! `scope`). Decoding is total: any byte string gives a record or a `DecodeError`, never a panic.
//! The layout is documented in docs/internals.md ("Record encoding").

use std::fmt;

use crate::config::Policy;
use crate::fingerprint::Fingerprint;
use crate::owner::OwnerToken;

/// The first bytes of an encoded record (`idemgate --version` names it).
pub const MAGIC: &[u8; 3] = b"IGR";
/// The current encoding version. A decoder refuses versions it does not know.
pub const VERSION: u8 = 1;
/// What a key's small tombstone holds (`Record::key_tombstone_bytes`): this, then the record's
/// fingerprint (32 bytes). Never the start of an encoded record (`MAGIC`).
pub const KEY_TOMBSTONE_BODY: &[u8; 4] = b"IGT\x01";
/// Most header lines (and most log values) a record holds: a decoder never builds more.
pub const MAX_LIST_ITEMS: usize = 1024;

/// A replay is a local reply, which carries no trailers: a response that ended with trailers is
/// stored with this header naming them (`note_dropped_trailers`), so every replay says plainly
/// which trailers it lacks. An upstream's own header of this name is never stored.
pub const TRAILERS_DROPPED_HEADER: &str = "idempotent-replayed-trailers-dropped";

/// Records in `response` that its trailers `names` cannot be replayed (lowercase, in order,
/// each once, comma-separated).
pub fn note_dropped_trailers(response: &mut StoredResponse, names: &[String]) {
    note_dropped_trailers_in(&mut response.headers, names);
}

/// `note_dropped_trailers` on a header list (a detached call's answer to its client, a local
/// reply that carries no trailers either).
pub fn note_dropped_trailers_in(headers: &mut Vec<(String, Vec<u8>)>, names: &[String]) {
    let mut seen: Vec<String> = vec![];
    for n in names {
        let n = n.to_ascii_lowercase();
        if !seen.contains(&n) {
            seen.push(n);
        }
    }
    headers.retain(|(n, _)| n != TRAILERS_DROPPED_HEADER);
    if !seen.is_empty() {
        headers.push((TRAILERS_DROPPED_HEADER.to_string(), seen.join(", ").into_bytes()));
    }
}

/// Whether an upstream's response header (name lowercase, as the host gives it) may be stored
/// and replayed: not a pseudo-header, not `NOT_REPLAYED`, and not `TRAILERS_DROPPED_HEADER`
/// (only idemgate says which trailers a replay lacks). The operator's `replay_exclude_headers`
/// come on top.
pub fn storable_header(name: &str) -> bool {
    !name.starts_with(':') && !NOT_REPLAYED.contains(&name) && name != TRAILERS_DROPPED_HEADER
}

/// Response headers never stored: hop-by-hop (RFC 9110 section 7.6.1) and those Envoy recomputes.
pub const NOT_REPLAYED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

/// Who created a record: a later 409/422 names its request id to the client; the logged values
/// are for operators only (logs, `idemgate inspect`), never echoed (`Policy::log_headers`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Creator {
    /// The `x-request-id` of the request that created the record.
    pub request_id: String,
    /// The configured `log_headers` values of that request, (name, value): never a credential,
    /// scope or key header (refused at configuration).
    pub log_values: Vec<(String, String)>,
}

/// A response as stored for replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// Kept headers, lowercase names, hop-by-hop and excluded headers already removed.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// Why a record's outcome is unknown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnknownReason {
    /// The upstream did not answer within the route's timeout.
    UpstreamTimeout,
    /// The upstream stream was reset after the request was sent.
    UpstreamReset,
    /// The client went away after the request was forwarded, before the response was stored.
    DownstreamGone,
    /// A forwarded request's lock expired without a completion.
    StaleLock,
    /// The response could not be written to the store.
    StoreWriteFailed,
    /// Any other way the request may have executed without a response.
    Other,
}

impl UnknownReason {
    fn code(self) -> u8 {
        match self {
            UnknownReason::UpstreamTimeout => 1,
            UnknownReason::UpstreamReset => 2,
            UnknownReason::DownstreamGone => 3,
            UnknownReason::StaleLock => 4,
            UnknownReason::StoreWriteFailed => 5,
            UnknownReason::Other => 6,
        }
    }

    fn from_code(c: u8) -> Option<UnknownReason> {
        Some(match c {
            1 => UnknownReason::UpstreamTimeout,
            2 => UnknownReason::UpstreamReset,
            3 => UnknownReason::DownstreamGone,
            4 => UnknownReason::StaleLock,
            5 => UnknownReason::StoreWriteFailed,
            6 => UnknownReason::Other,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            UnknownReason::UpstreamTimeout => "upstream_timeout",
            UnknownReason::UpstreamReset => "upstream_reset",
            UnknownReason::DownstreamGone => "downstream_gone",
            UnknownReason::StaleLock => "stale_lock",
            UnknownReason::StoreWriteFailed => "store_write_failed",
            UnknownReason::Other => "other",
        }
    }
}

/// Where a key stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Claimed, not yet forwarded (the request body may still be arriving, or the store is being
    /// asked). If its lock expires it provably never executed and may be taken over.
    Claimed { owner: OwnerToken, lock_expires_at_ms: u64 },
    /// Forwarded to the upstream; the response has not been stored yet.
    Forwarded { owner: OwnerToken, lock_expires_at_ms: u64 },
    /// The upstream's response, kept for replay.
    Completed(StoredResponse),
    /// The upstream answered with a body larger than `max_response_body_bytes`: only the status and
    /// `location` are kept; retries get a problem document carrying them, never an empty 2xx.
    CompletedTooLarge { status: u16, location: Option<Vec<u8>> },
    /// It may have executed, but no response was kept.
    OutcomeUnknown { reason: UnknownReason },
    /// An MCP call (2026-07-28) between two rounds: its round `round` (`mcp::Call::round`, what
    /// the client sent for it) was answered `input_required` with `response`, which a re-sent
    /// copy of that round is replayed; a round with other answers may continue the call, once
    /// (`Record::round`, `lifecycle::Event::Continue`). A completed stage in every tier
    /// (its answer is kept), never the call's final answer. Tag 6: a decoder without it (a
    /// release before 2026-12) refuses the record as unreadable, never runs nor replays it.
    /// `earlier`: the rounds of the call before it (oldest first, at most `MAX_EARLIER_ROUNDS`),
    /// each answered the current question if sent again, never run again.
    AwaitingInput(Box<Awaiting>),
}

/// What an awaiting record holds (`State::AwaitingInput`), boxed: a record is mostly another state.
/// Made only by `Awaiting::new` (or decoded as written): the question's state digest is read from
/// the question it is kept with, once, so the two never disagree. A digest that disagrees with
/// its question could run a round twice: none where the question has a state lets any round
/// not listed run (another spelling of an earlier question's answer); an earlier question's lets
/// a copy of the round that answered it run again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Awaiting {
    /// The round that asked (`mcp::Call::round`).
    round: [u8; 32],
    /// The rounds of the call before it, oldest first.
    earlier: Vec<[u8; 32]>,
    /// `state_digest` of the question's `requestState` (`None`: it gives none), as the round that
    /// answers it must echo (`Record::round`).
    asked_state: Option<[u8; 32]>,
    /// The question: the round's answer as stored.
    response: StoredResponse,
}

impl Awaiting {
    /// The awaiting record of the round `round` (after the rounds `earlier`) whose answer
    /// `response` asks for input: the question's `requestState` digest is read from `response`
    /// here, when the record is written, and stored with it (no lookup parses the question).
    pub fn new(round: [u8; 32], earlier: Vec<[u8; 32]>, response: StoredResponse) -> Awaiting {
        let asked_state = asked_state(&response.body);
        Awaiting { round, earlier, asked_state, response }
    }

    /// The round that asked.
    pub fn round(&self) -> [u8; 32] {
        self.round
    }

    /// The rounds of the call before the one that asked, oldest first.
    pub fn earlier(&self) -> &[[u8; 32]] {
        &self.earlier
    }

    /// The stored digest of the question's `requestState`.
    pub fn asked_state(&self) -> Option<[u8; 32]> {
        self.asked_state
    }

    /// The question, as stored.
    pub fn response(&self) -> &StoredResponse {
        &self.response
    }
}

/// Most earlier rounds an awaiting record lists: a call asking more often than this is kept as
/// its answer (`"keep"`), loud and never run twice.
pub const MAX_EARLIER_ROUNDS: usize = 64;

/// Which round of an MCP call a request is (`mcp::Call::round`): the digest of what the client
/// sends for a round (`params.inputResponses` and `params.requestState`, in their semantic form,
/// an empty `inputResponses` as none), and of the `requestState` it echoes, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundId {
    pub digest: [u8; 32],
    /// `state_digest` of the round's `params.requestState`.
    pub state: Option<[u8; 32]>,
}

const STATE_TAG: &[u8] = b"idemgate-mcp-request-state-v1\0";

/// The digest of a `requestState` (a string in the schema; another value as serde reads it):
/// what a round echoes and what its question gave, compared (`Record::round`).
pub fn state_digest(v: &serde_json::Value) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(STATE_TAG);
    match v {
        serde_json::Value::String(s) => {
            h.update(b"s");
            h.update(s.as_bytes());
        }
        other => {
            h.update(b"v");
            h.update(serde_json::to_vec(other).unwrap_or_default());
        }
    }
    h.finalize().into()
}

/// The `requestState` a question (an awaiting record's final JSON-RPC response, as
/// `mcp::final_response` keeps it) gives the client to echo, as `state_digest`; `None` when it gives
/// none (or cannot be read: then any new round is its answer, as before the state was checked).
/// Read once, by `Awaiting::new`.
fn asked_state(message: &[u8]) -> Option<[u8; 32]> {
    let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<serde_json::Value>(message) else { return None };
    m.get("result").and_then(|r| r.get("requestState")).filter(|v| !v.is_null()).map(state_digest)
}

/// What a round of an MCP call meets in the key's record (`Record::round`): the one rule every
/// tier applies to an awaiting record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// Not an awaiting record: replayed, refused, ... as any record.
    NotAwaiting,
    /// The round that asked, or an earlier round of the call, sent again: replayed the call's
    /// current question, never run again.
    Asked,
    /// Another round of the same call that answers the current question (it echoes the
    /// question's `requestState`; a question without one: any round not run before): it may
    /// take the key (awaiting -> forwarded, atomically in its tier) and run; once.
    Next,
}

impl State {
    /// A completed state without its body: the status and `location` only.
    pub fn without_body(self) -> State {
        match self {
            // An awaiting round's question too large to keep: kept as the call's answer (its
            // status only), so the call ends loudly and nothing runs again.
            State::AwaitingInput(a) => State::Completed(a.response).without_body(),
            State::Completed(r) => State::CompletedTooLarge {
                status: r.status,
                location: r.headers.into_iter().find(|(n, _)| n == "location").map(|(_, v)| v),
            },
            other => other,
        }
    }

    fn tag(&self) -> u8 {
        match self {
            State::Claimed { .. } => 1,
            State::Forwarded { .. } => 2,
            State::Completed(_) => 3,
            State::CompletedTooLarge { .. } => 4,
            State::OutcomeUnknown { .. } => 5,
            State::AwaitingInput(_) => 6,
        }
    }

    /// The owner of a live claim, if any.
    pub fn owner(&self) -> Option<OwnerToken> {
        match self {
            State::Claimed { owner, .. } | State::Forwarded { owner, .. } => Some(*owner),
            _ => None,
        }
    }
}

/// One record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: Fingerprint,
    pub created_at_ms: u64,
    /// After this instant the record counts as absent (checked on read, whatever the store's TTL).
    pub expires_at_ms: u64,
    pub creator: Creator,
    pub state: State,
}

/// The stages of the one lifecycle (`lifecycle::next` is its transition table); each transition
/// that enters a live stage gives the record a new expiry. Every tier (the local
/// tier's bucket entries and slots, the store's `PX`) takes it from `Lifetimes::life_ms`, so the
/// tiers cannot disagree on how long a state lasts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// No record holds the key (never claimed, released, expired or evicted): it lives nowhere.
    Absent,
    /// Claimed at request headers, not forwarded yet (the body may still be arriving).
    Claimed,
    /// Forwarded (or about to be): in flight while its lock lives, outcome-unknown afterwards.
    Forwarded,
    /// Completed: the response (or its status and `location`) is kept.
    Completed,
    /// Marked outcome-unknown: it may have executed, no response is kept.
    Unknown,
}

/// How long each stage of a record lasts, from the transition that enters it: one table for
/// every tier. Durations only: each tier adds them to its own clock (a proxy's for the local
/// tier; Redis's for the store, where they are the key's `PX`), so no time written by one clock
/// is ever compared with another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    pub ttl_ms: u64,
    pub lock_ms: u64,
    pub unknown_ms: u64,
    /// How long a completed record is kept past `ttl_ms` as its key's tombstone
    /// (`tombstone_seconds`; 0: not at all).
    pub tombstone_ms: u64,
}

impl Lifetimes {
    /// The lifetimes a route's policy sets.
    pub fn of(policy: &Policy) -> Lifetimes {
        Lifetimes {
            ttl_ms: policy.ttl_seconds.saturating_mul(1000),
            lock_ms: policy.lock_ttl_seconds.saturating_mul(1000),
            unknown_ms: policy.unknown_outcome_seconds.saturating_mul(1000),
            tombstone_ms: policy.tombstone_seconds.saturating_mul(1000),
        }
    }

    /// How long a record lives from entering `stage`:
    ///
    /// | stage | life |
    /// |---|---|
    /// | absent | 0 (nothing is kept) |
    /// | claimed | `ttl`, never less than its lock |
    /// | forwarded | its lock, then `unknown_outcome` (a forwarded claim whose lock expired without a completion *is* outcome-unknown, from that moment) |
    /// | completed | `ttl`, from the completion, then `tombstone` (the record's own `expires_at_ms`, the completion plus `ttl`, says when it stops being replayed: `Record::is_tombstone`) |
    /// | unknown | `unknown_outcome`, from the moment it became unknown |
    pub fn life_ms(&self, stage: Stage) -> u64 {
        match stage {
            Stage::Absent => 0,
            Stage::Claimed => self.ttl_ms.max(self.lock_ms),
            Stage::Forwarded => self.lock_ms.saturating_add(self.unknown_ms),
            Stage::Completed => self.ttl_ms.saturating_add(self.tombstone_ms),
            Stage::Unknown => self.unknown_ms,
        }
    }

    /// The expiry of a record entering `stage` at `now_ms` (by the clock `now_ms` was read from).
    pub fn expires_at(&self, stage: Stage, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.life_ms(stage))
    }

    /// The expiry of a lock taken at `now_ms`.
    pub fn lock_expires_at(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add(self.lock_ms)
    }

    /// Whether the store's answer to a claim (or take-over) sent at `sent_at_ms` still lets its
    /// request be forwarded when it arrives at `now_ms` (both read from this proxy's clock), the
    /// request then running for up to `run_ms` (the upstream timeout where idemgate knows it:
    /// detached forwarding; 0 otherwise): only if nobody can judge the claim's lock stale before
    /// that. The lock was taken no earlier than the send, for `lock_ms` (Redis: from when the
    /// script ran, by Redis's clock; etcd: from the send, by this clock, which readers judge taken
    /// the skew tolerance behind; the local tier: from the local claim, made before the send), so
    /// until `lock_ms` after the send no reader finds it stale. An answer later than that may come
    /// after another request marked the claim outcome-unknown (or, with `stale_lock: "takeover"`,
    /// took it over and forwarded): it is not used.
    pub fn answer_in_time(&self, sent_at_ms: u64, now_ms: u64, run_ms: u64) -> bool {
        now_ms.saturating_sub(sent_at_ms).saturating_add(run_ms) < self.lock_ms
    }
}

/// The timeout of a detached upstream call sent at `now_ms` under a lock that may be judged stale
/// from `lock_deadline_ms` (both this proxy's clock): the upstream's `timeout_ms`, cut so that the
/// call ends by then (a call still running past the lock would let a retry execute beside it);
/// 0 when the lock is already spent: the call must not be sent.
pub fn callout_timeout_within_lock(timeout_ms: u64, lock_deadline_ms: u64, now_ms: u64) -> u64 {
    timeout_ms.min(lock_deadline_ms.saturating_sub(now_ms))
}

impl Record {
    /// The completed record of an upstream response: kept whole, or (`too_large`: over
    /// `max_response_body_bytes`) with only its status and `location`.
    pub fn completed(
        fingerprint: Fingerprint,
        response: StoredResponse,
        too_large: bool,
        creator: Creator,
        now_ms: u64,
        ttl_seconds: u64,
    ) -> Record {
        let state = State::Completed(response);
        Record {
            fingerprint,
            created_at_ms: now_ms,
            expires_at_ms: now_ms.saturating_add(ttl_seconds.saturating_mul(1000)), // Stage::Completed
            creator,
            state: if too_large { state.without_body() } else { state },
        }
    }

    /// The record of a claim made just before forwarding: in progress, owned by `owner`, its lock
    /// and its expiry those of a forwarded claim (`Lifetimes`), by the clock `now_ms` was read
    /// from. (In the store these times are informational: Redis's clock and `PX` decide.)
    pub fn in_progress(
        fingerprint: Fingerprint,
        creator: Creator,
        owner: OwnerToken,
        now_ms: u64,
        lifetimes: &Lifetimes,
    ) -> Record {
        Record {
            fingerprint,
            created_at_ms: now_ms,
            expires_at_ms: lifetimes.expires_at(Stage::Forwarded, now_ms),
            creator,
            state: State::Forwarded { owner, lock_expires_at_ms: lifetimes.lock_expires_at(now_ms) },
        }
    }

    /// The record of a request that may have executed without a response (`reason`), living as
    /// an outcome-unknown record (`Lifetimes`) from `now_ms`. The store writes it only where the
    /// owner's claim is gone (`store::WhereAbsent`); otherwise the claim's own record is kept.
    pub fn unknown(
        fingerprint: Fingerprint,
        creator: Creator,
        reason: UnknownReason,
        now_ms: u64,
        lifetimes: &Lifetimes,
    ) -> Record {
        Record {
            fingerprint,
            created_at_ms: now_ms,
            expires_at_ms: lifetimes.expires_at(Stage::Unknown, now_ms),
            creator,
            state: State::OutcomeUnknown { reason },
        }
    }

    pub fn is_expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_at_ms
    }

    /// The one tombstone rule, for every tier: a completed record that a tier still holds (its
    /// tier keeps it `tombstone_seconds` past `ttl_seconds`, `Lifetimes::life_ms`) but that is
    /// past its own expiry (its completion plus `ttl_seconds`, `Record::completed`) is its key's
    /// tombstone: never replayed, never executed again (`key-expired`; another request under the
    /// key is `key-reused`, as before). `expires_at_ms` may have been written by another proxy's
    /// clock: a skew moves only the moment a replay turns into `key-expired`; the key is freed
    /// only by the tier's own expiry, judged by the tier's clock.
    pub fn is_tombstone(&self, now_ms: u64) -> bool {
        matches!(self.state, State::Completed(_) | State::CompletedTooLarge { .. } | State::AwaitingInput(_))
            && self.is_expired(now_ms)
    }

    /// The one rule for a round of an MCP call (`round`: `mcp::Call::round`; `None`: not an MCP
    /// call) meeting this record, whose fingerprint already matched.
    pub fn round(&self, round: Option<&RoundId>) -> Round {
        match (&self.state, round) {
            (State::AwaitingInput(a), Some(r)) if a.round == r.digest || a.earlier.contains(&r.digest) => Round::Asked,
            // A round that does not echo the current question's `requestState` answers another
            // question (an earlier one, answered again or spelled another way) or none: the
            // current question, never a run (the round that answers an earlier question ran
            // already, as the round the record lists or one spelled as it).
            // The digest stored with the question when it was written (`Awaiting::new`).
            (State::AwaitingInput(a), Some(r)) => match a.asked_state {
                Some(asked) if r.state != Some(asked) => Round::Asked,
                _ => Round::Next,
            },
            // An awaiting record met by a request that is not an MCP round (another route's
            // request with the same fingerprint cannot be: MCP fingerprints are tagged): its
            // question, never a run.
            (State::AwaitingInput(_), None) => Round::Asked,
            _ => Round::NotAwaiting,
        }
    }

    /// The rounds an awaiting record's call has run (its earlier rounds, then the one that
    /// asked): what the next round's awaiting record lists as earlier. Empty for other records.
    pub fn rounds_run(&self) -> Vec<[u8; 32]> {
        match &self.state {
            State::AwaitingInput(a) => a.earlier.iter().chain([&a.round]).copied().collect(),
            _ => vec![],
        }
    }

    /// The record as replayed to a re-sent round: an awaiting record's question as a
    /// completed response; any other record as it is.
    pub fn as_replayed(self) -> Record {
        match self.state {
            State::AwaitingInput(a) => Record { state: State::Completed(a.response), ..self },
            _ => self,
        }
    }

    /// `is_tombstone` as a route applies it: a route with `tombstone_seconds: 0` has none, and
    /// replays a completed record for as long as its tier holds it, as before tombstones (a
    /// store's copy judged a little past its own expiry by a reader whose clock runs ahead, etcd's
    /// skew tolerance; or a record a route with tombstones wrote). A key's small tombstone read
    /// from a store (`key_tombstone`) is one on every route: it holds nothing to replay.
    pub fn is_tombstone_for(&self, tombstone_seconds: u64, now_ms: u64) -> bool {
        (tombstone_seconds > 0 || self.is_key_tombstone()) && self.is_tombstone(now_ms)
    }

    /// What a store's small tombstone of a key (its record's fingerprint only: Redis's
    /// `store::tombstone_value`) reads as: a completed record past its own expiry, holding no
    /// response, no creator, no times. It is made only from a tombstone read, never encoded
    /// (status 0 is no status: `Record::decode` refuses it), so no decoded record is one.
    pub fn key_tombstone(fingerprint: Fingerprint) -> Record {
        Record {
            fingerprint,
            created_at_ms: 0,
            expires_at_ms: 0,
            creator: Creator::default(),
            state: State::CompletedTooLarge { status: 0, location: None },
        }
    }

    /// A key's small tombstone (`key_tombstone`) as bytes: `KEY_TOMBSTONE_BODY`, then the
    /// fingerprint (36 bytes). Redis seals it for the tombstone's key (`store::tombstone_value`);
    /// the local tier keeps it in the record's body key (`local::Table::sweep`).
    pub fn key_tombstone_bytes(fingerprint: &Fingerprint) -> Vec<u8> {
        [KEY_TOMBSTONE_BODY.as_slice(), fingerprint.0.as_slice()].concat()
    }

    /// The key tombstone `b` holds (`key_tombstone_bytes`), if it is one.
    pub fn open_key_tombstone(b: &[u8]) -> Option<Record> {
        let fp: [u8; 32] = b.strip_prefix(KEY_TOMBSTONE_BODY.as_slice())?.try_into().ok()?;
        Some(Record::key_tombstone(Fingerprint(fp)))
    }

    /// Whether this is a store's small tombstone (`key_tombstone`).
    pub fn is_key_tombstone(&self) -> bool {
        self.expires_at_ms == 0 && matches!(self.state, State::CompletedTooLarge { status: 0, location: None })
    }

    /// Encodes the record (see docs/internals.md for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.body_len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(self.state.tag());
        out.extend_from_slice(&self.fingerprint.0);
        put_varint(&mut out, self.created_at_ms);
        put_varint(&mut out, self.expires_at_ms);
        put_bytes(&mut out, self.creator.request_id.as_bytes());
        put_varint(&mut out, self.creator.log_values.len() as u64);
        for (n, v) in &self.creator.log_values {
            put_bytes(&mut out, n.as_bytes());
            put_bytes(&mut out, v.as_bytes());
        }
        match &self.state {
            State::Claimed { owner, lock_expires_at_ms } | State::Forwarded { owner, lock_expires_at_ms } => {
                out.extend_from_slice(&owner.0);
                put_varint(&mut out, *lock_expires_at_ms);
            }
            State::Completed(r) => {
                put_varint(&mut out, u64::from(r.status));
                put_varint(&mut out, r.headers.len() as u64);
                for (n, v) in &r.headers {
                    put_bytes(&mut out, n.as_bytes());
                    put_bytes(&mut out, v);
                }
                put_bytes(&mut out, &r.body);
            }
            State::CompletedTooLarge { status, location } => {
                put_varint(&mut out, u64::from(*status));
                match location {
                    None => out.push(0),
                    Some(l) => {
                        out.push(1);
                        put_bytes(&mut out, l);
                    }
                }
            }
            State::OutcomeUnknown { reason } => out.push(reason.code()),
            State::AwaitingInput(a) => {
                let r = &a.response;
                out.extend_from_slice(&a.round);
                put_varint(&mut out, a.earlier.len() as u64);
                for e in &a.earlier {
                    out.extend_from_slice(e);
                }
                match &a.asked_state {
                    None => out.push(0),
                    Some(d) => {
                        out.push(1);
                        out.extend_from_slice(d);
                    }
                }
                put_varint(&mut out, u64::from(r.status));
                put_varint(&mut out, r.headers.len() as u64);
                for (n, v) in &r.headers {
                    put_bytes(&mut out, n.as_bytes());
                    put_bytes(&mut out, v);
                }
                put_bytes(&mut out, &r.body);
            }
        }
        out
    }

    fn body_len(&self) -> usize {
        let response = match &self.state {
            State::Completed(r) => Some(r),
            State::AwaitingInput(a) => Some(&a.response),
            _ => None,
        };
        match response {
            Some(r) => r.body.len() + r.headers.iter().map(|(n, v)| n.len() + v.len() + 4).sum::<usize>(),
            _ => 0,
        }
    }

    /// Decodes a record; any malformed input is an error.
    pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
        let mut r = Reader { buf: bytes, pos: 0 };
        if r.take(3)? != MAGIC {
            return Err(DecodeError::BadMagic);
        }
        let version = r.byte()?;
        if version != VERSION {
            return Err(DecodeError::UnsupportedVersion(version));
        }
        let tag = r.byte()?;
        let mut fp = [0u8; 32];
        fp.copy_from_slice(r.take(32)?);
        let created_at_ms = r.varint()?;
        let expires_at_ms = r.varint()?;
        let request_id = r.string()?;
        let n = r.items()?;
        // Grown as items arrive: a count read from the input never sizes an allocation.
        let mut log_values = Vec::new();
        for _ in 0..n {
            log_values.push((r.string()?, r.string()?));
        }
        let state = match tag {
            1 | 2 => {
                let mut owner = [0u8; 16];
                owner.copy_from_slice(r.take(16)?);
                let owner = OwnerToken(owner);
                let lock_expires_at_ms = r.varint()?;
                if tag == 1 {
                    State::Claimed { owner, lock_expires_at_ms }
                } else {
                    State::Forwarded { owner, lock_expires_at_ms }
                }
            }
            3 => {
                let status = r.status()?;
                let n = r.items()?;
                let mut headers = Vec::new();
                for _ in 0..n {
                    headers.push((r.string()?, r.bytes()?.to_vec()));
                }
                let body = r.bytes()?.to_vec();
                State::Completed(StoredResponse { status, headers, body })
            }
            6 => {
                let mut round = [0u8; 32];
                round.copy_from_slice(r.take(32)?);
                let n = r.items()?;
                if n > MAX_EARLIER_ROUNDS {
                    return Err(DecodeError::TooManyItems);
                }
                let mut earlier = Vec::new();
                for _ in 0..n {
                    let mut e = [0u8; 32];
                    e.copy_from_slice(r.take(32)?);
                    earlier.push(e);
                }
                // The question's state digest as written with it (never derived again here).
                let asked_state = match r.byte()? {
                    0 => None,
                    1 => {
                        let mut d = [0u8; 32];
                        d.copy_from_slice(r.take(32)?);
                        Some(d)
                    }
                    other => return Err(DecodeError::BadValue(other)),
                };
                State::AwaitingInput(Box::new(Awaiting { round, earlier, asked_state, response: r.response()? }))
            }
            4 => {
                let status = r.status()?;
                let location = match r.byte()? {
                    0 => None,
                    1 => Some(r.bytes()?.to_vec()),
                    other => return Err(DecodeError::BadValue(other)),
                };
                State::CompletedTooLarge { status, location }
            }
            5 => {
                let code = r.byte()?;
                State::OutcomeUnknown { reason: UnknownReason::from_code(code).ok_or(DecodeError::BadValue(code))? }
            }
            other => return Err(DecodeError::BadTag(other)),
        };
        if r.pos != bytes.len() {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(Record {
            fingerprint: Fingerprint(fp),
            created_at_ms,
            expires_at_ms,
            creator: Creator { request_id, log_values },
            state,
        })
    }
}

/// Why bytes are not a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    Truncated,
    BadMagic,
    UnsupportedVersion(u8),
    BadTag(u8),
    BadValue(u8),
    VarintOverflow,
    BadStatus,
    BadUtf8,
    TrailingBytes,
    /// More header lines or log values than `MAX_LIST_ITEMS`.
    TooManyItems,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not an idemgate record: {self:?}")
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, DecodeError> {
        self.take(1)?.first().copied().ok_or(DecodeError::Truncated)
    }

    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            // One encoding per value: a trailing zero byte would be a second spelling of it.
            if b == 0 && shift > 0 {
                return Err(DecodeError::VarintOverflow);
            }
            let part = u64::from(b & 0x7f);
            if shift == 63 && part > 1 {
                return Err(DecodeError::VarintOverflow);
            }
            v |= part << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError::VarintOverflow)
    }

    /// A count of items (header lines, log values) that follow, at most `MAX_LIST_ITEMS`: each
    /// item is a few bytes in the input but about 50 in memory, so a record of millions of empty
    /// items would amplify memory; none idemgate writes has that many (Envoy allows 100 headers
    /// by default).
    fn items(&mut self) -> Result<usize, DecodeError> {
        let n = self.count()?;
        if n > MAX_LIST_ITEMS {
            return Err(DecodeError::TooManyItems);
        }
        Ok(n)
    }

    /// A count of bytes or items that follow: each takes at least one byte, so a count larger
    /// than what remains is garbage (and must not drive a huge allocation).
    fn count(&mut self) -> Result<usize, DecodeError> {
        let n = self.varint()?;
        let remaining = (self.buf.len() - self.pos.min(self.buf.len())) as u64;
        if n > remaining {
            return Err(DecodeError::Truncated);
        }
        usize::try_from(n).map_err(|_| DecodeError::Truncated)
    }

    fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.count()?;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        std::str::from_utf8(self.bytes()?).map(str::to_owned).map_err(|_| DecodeError::BadUtf8)
    }

    /// A stored response as tag 3 lays it out (status, headers, body), for tag 6.
    fn response(&mut self) -> Result<StoredResponse, DecodeError> {
        let status = self.status()?;
        let n = self.items()?;
        let mut headers = Vec::new();
        for _ in 0..n {
            headers.push((self.string()?, self.bytes()?.to_vec()));
        }
        let body = self.bytes()?.to_vec();
        Ok(StoredResponse { status, headers, body })
    }

    fn status(&mut self) -> Result<u16, DecodeError> {
        match self.varint()? {
            s @ 100..=999 => u16::try_from(s).map_err(|_| DecodeError::BadStatus),
            _ => Err(DecodeError::BadStatus),
        }
    }
}

/// For tests: a question as a server asks it (an `input_required` result carrying `state` as its
/// `requestState`), answered 200.
#[cfg(test)]
pub(crate) fn question_for_tests(state: &str) -> StoredResponse {
    let body =
        format!(r#"{{"jsonrpc":"2.0","id":1,"result":{{"resultType":"input_required","requestState":"{state}"}}}}"#);
    StoredResponse { status: 200, headers: vec![], body: body.into_bytes() }
}

#[cfg(test)]
mod tests {
    #[test]
    fn dropped_trailers_are_named_once_each_and_replace_an_earlier_note() {
        let mut r = StoredResponse { status: 200, headers: vec![("a".into(), b"1".to_vec())], body: vec![] };
        note_dropped_trailers(&mut r, &["X-Checksum".into(), "server-timing".into(), "x-checksum".into()]);
        note_dropped_trailers(&mut r, &["X-Checksum".into(), "server-timing".into()]);
        assert_eq!(
            r.headers,
            vec![("a".into(), b"1".to_vec()), (TRAILERS_DROPPED_HEADER.into(), b"x-checksum, server-timing".to_vec())]
        );
        note_dropped_trailers(&mut r, &[]);
        assert_eq!(r.headers, vec![("a".into(), b"1".to_vec())]);
    }

    #[test]
    fn an_upstreams_own_trailers_dropped_header_and_hop_headers_are_never_stored() {
        assert!(storable_header("content-type"));
        assert!(storable_header("x-checksum"));
        for n in [":status", "content-length", "transfer-encoding", "trailer", TRAILERS_DROPPED_HEADER] {
            assert!(!storable_header(n), "{n}");
        }
    }

    use super::*;

    /// Issue 40: an MCP call's awaiting record (tag 6) keeps its round and its question through
    /// the encoding; the one round rule answers the round that asked with its question and any
    /// other round of the call as its next; other records are no rounds' business.
    #[test]
    fn an_awaiting_record_round_trips_and_tells_the_asking_round_from_the_next() {
        let response = StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: br#"{"result":{"resultType":"input_required"}}"#.to_vec(),
        };
        let r = Record {
            fingerprint: Fingerprint([3; 32]),
            created_at_ms: 5,
            expires_at_ms: 9,
            creator: Creator { request_id: "r1".into(), log_values: vec![] },
            state: State::AwaitingInput(Box::new(Awaiting::new([1; 32], vec![[5; 32]], response.clone()))),
        };
        let bytes = r.encode();
        assert_eq!(bytes.get(4), Some(&6), "tag 6");
        assert_eq!(Record::decode(&bytes), Ok(r.clone()));
        for cut in 0..bytes.len() {
            assert!(Record::decode(bytes.get(..cut).unwrap_or_default()).is_err(), "{cut}");
        }
        let id = |d: u8| RoundId { digest: [d; 32], state: None };
        assert_eq!(r.round(Some(&id(1))), Round::Asked);
        assert_eq!(r.round(Some(&id(2))), Round::Next, "a question without requestState: any new round");
        assert_eq!(r.round(Some(&id(5))), Round::Asked, "an earlier round is answered the current question");
        assert_eq!(r.rounds_run(), vec![[5; 32], [1; 32]]);
        assert_eq!(r.round(None), Round::Asked);
        let replayed = r.clone().as_replayed();
        assert_eq!(replayed.state, State::Completed(response.clone()));
        let done = Record { state: State::Completed(response), ..r.clone() };
        assert_eq!(done.round(Some(&id(2))), Round::NotAwaiting);
        assert!(matches!(r.state.clone().without_body(), State::CompletedTooLarge { status: 200, .. }));
        assert!(r.is_tombstone(9) && !r.is_tombstone(8), "an awaiting record past its expiry is its key's tombstone");
    }

    /// Review (h-review2): a question with a `requestState` is answered only by a round that
    /// echoes it; a round echoing another state (an earlier question's, answered again) or none
    /// is answered the question, never run.
    #[test]
    fn only_a_round_echoing_the_questions_state_is_the_next() {
        let asked = |state: &str| Record {
            fingerprint: Fingerprint([3; 32]),
            created_at_ms: 5,
            expires_at_ms: 9,
            creator: Creator { request_id: "r1".into(), log_values: vec![] },
            state: State::AwaitingInput(Box::new(Awaiting::new([1; 32], vec![], question(state)))),
        };
        let s2 = state_digest(&serde_json::Value::String("s2".into()));
        let s1 = state_digest(&serde_json::Value::String("s1".into()));
        let r = asked("s2");
        assert_eq!(r.round(Some(&RoundId { digest: [2; 32], state: Some(s2) })), Round::Next);
        assert_eq!(r.round(Some(&RoundId { digest: [2; 32], state: Some(s1) })), Round::Asked);
        assert_eq!(r.round(Some(&RoundId { digest: [2; 32], state: None })), Round::Asked);
        let escaped = asked("s\\u0032");
        assert_eq!(
            escaped.round(Some(&RoundId { digest: [2; 32], state: Some(s2) })),
            Round::Next,
            "the state as the parsers read it"
        );
    }

    /// A question asking for input with `requestState` `state`.
    fn question(state: &str) -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: format!(
                r#"{{"jsonrpc":"2.0","id":1,"result":{{"resultType":"input_required","requestState":"{state}"}}}}"#
            )
            .into_bytes(),
        }
    }

    /// Where an awaiting record's encoding holds its digest's flag: before the digest (if any)
    /// and the question, which end the encoding.
    fn flag_at(r: &Record) -> usize {
        let State::AwaitingInput(a) = &r.state else { panic!("{r:?}") };
        let mut question = vec![];
        put_varint(&mut question, u64::from(a.response.status));
        put_varint(&mut question, a.response.headers.len() as u64);
        for (n, v) in &a.response.headers {
            put_bytes(&mut question, n.as_bytes());
            put_bytes(&mut question, v);
        }
        put_bytes(&mut question, &a.response.body);
        r.encode().len() - question.len() - if a.asked_state.is_some() { 33 } else { 1 }
    }

    fn awaiting_record(a: Awaiting) -> Record {
        Record {
            fingerprint: Fingerprint([3; 32]),
            created_at_ms: 5,
            expires_at_ms: 9,
            creator: Creator { request_id: "r1".into(), log_values: vec![] },
            state: State::AwaitingInput(Box::new(a)),
        }
    }

    /// Tag 6 stores the question's `requestState` digest, written once with the question
    /// (`Awaiting::new`): decoding yields the digest encoded (after the earlier rounds: `1` and the
    /// digest, `0` for a question without state), and the round rule judges a decoded record by
    /// it: the round echoing the question's `requestState` is the next, one echoing another
    /// (an earlier question's) or none is not.
    #[test]
    fn a_decoded_awaiting_record_yields_the_digest_encoded_and_judges_rounds_by_it() {
        let s1 = state_digest(&serde_json::Value::String("s1".into()));
        let s2 = state_digest(&serde_json::Value::String("s2".into()));
        let r = awaiting_record(Awaiting::new([1; 32], vec![[5; 32]], question("s2")));
        let bytes = r.encode();
        let at = flag_at(&r);
        assert_eq!(bytes.get(at), Some(&1), "a digest follows");
        assert_eq!(bytes.get(at + 1..at + 33), Some(&s2[..]), "the digest as encoded");
        let decoded = Record::decode(&bytes).expect("decodes");
        assert_eq!(decoded, r);
        let State::AwaitingInput(a) = &decoded.state else { panic!("{decoded:?}") };
        assert_eq!(a.asked_state(), Some(s2), "the digest that was encoded");
        let round = |state| Some(RoundId { digest: [2; 32], state });
        assert_eq!(decoded.round(round(Some(s2)).as_ref()), Round::Next, "echoes the question's requestState");
        assert_eq!(decoded.round(round(Some(s1)).as_ref()), Round::Asked, "echoes an earlier question's");
        assert_eq!(decoded.round(round(None).as_ref()), Round::Asked, "echoes none");
        // A question without a state (or one that is no JSON): `0`, no digest, any new round.
        for body in [br#"{"result":{"resultType":"input_required"}}"#.to_vec(), b"not json".to_vec()] {
            let q = StoredResponse { status: 200, headers: vec![], body };
            let r = awaiting_record(Awaiting::new([1; 32], vec![], q));
            let bytes = r.encode();
            let at = flag_at(&r);
            assert_eq!(bytes.get(at), Some(&0));
            let decoded = Record::decode(&bytes).expect("decodes");
            let State::AwaitingInput(a) = &decoded.state else { panic!("{decoded:?}") };
            assert_eq!(a.asked_state(), None);
            assert_eq!(decoded.round(round(Some(s1)).as_ref()), Round::Next);
        }
        // A flag other than 0 or 1 is no encoding of this record: refused (one encoding only).
        let mut bad = bytes.clone();
        let at = flag_at(&r);
        bad[at] = 2;
        assert_eq!(Record::decode(&bad), Err(DecodeError::BadValue(2)));
    }

    /// Adversarial check of the stored digest: it is read from the stored question only once, and
    /// a lookup never parses the question again (the stored digest decides, as this shows with a
    /// digest made to disagree). A disagreement could run a round twice: round 2 (echoing s1) ran
    /// and asked again (s2); were the stored digest s1's (carried over from the question before)
    /// or none, round 2 sent again in another spelling (another round digest, echoing s1) would be
    /// the next round and run round 2's step a second time. So the record is made only by
    /// `Awaiting::new` from the question it keeps, whatever the call asked before; the machine
    /// test `a_round_answering_an_earlier_question_is_never_run` drives the same through the
    /// local tier, and the request test for a sealed store value through the store's.
    #[test]
    fn the_stored_digest_is_the_kept_questions_never_an_earlier_ones() {
        let s1 = state_digest(&serde_json::Value::String("s1".into()));
        let s2 = state_digest(&serde_json::Value::String("s2".into()));
        let first = awaiting_record(Awaiting::new([1; 32], vec![], question("s1")));
        // Round 2 (digest [2; 32], echoing s1) is the next, runs and asks again: the new awaiting
        // record, as `engine::settle` writes it (the earlier rounds from the one it continued).
        assert_eq!(first.round(Some(&RoundId { digest: [2; 32], state: Some(s1) })), Round::Next);
        let second = awaiting_record(Awaiting::new([2; 32], first.rounds_run(), question("s2")));
        let second = Record::decode(&second.encode()).expect("decodes");
        let State::AwaitingInput(a) = &second.state else { panic!("{second:?}") };
        assert_eq!(a.asked_state(), Some(s2), "the question kept, not the one before");
        let respelled = RoundId { digest: [7; 32], state: Some(s1) };
        assert_eq!(second.round(Some(&respelled)), Round::Asked, "round 2 respelled never runs again");
        assert_eq!(second.round(Some(&RoundId { digest: [2; 32], state: Some(s1) })), Round::Asked);
        assert_eq!(second.round(Some(&RoundId { digest: [3; 32], state: Some(s2) })), Round::Next);
        // What a disagreeing digest would do (only a writer other than `Awaiting::new` could
        // store one): the lookup reads the stored digest, not the question.
        for stale in [Some(s1), None] {
            let mut wrong = a.as_ref().clone();
            wrong.asked_state = stale;
            let wrong = Record::decode(&awaiting_record(wrong).encode()).expect("decodes as written");
            assert_eq!(wrong.round(Some(&respelled)), Round::Next, "{stale:?}: the stored digest decides");
        }
    }

    /// A tag-6 record laid out as before the digest (the question straight after the earlier
    /// rounds, as 0.3.0-dev builds before this one wrote it) is refused, never read with a
    /// digest taken from the question's bytes; and a decoder of that layout reads this one's
    /// flag (`0` or `1`) as the question's status, which is no status: refused too.
    #[test]
    fn an_awaiting_record_of_the_layout_without_the_digest_is_refused() {
        let r = awaiting_record(Awaiting::new([1; 32], vec![[5; 32]], question("s2")));
        let bytes = r.encode();
        let at = flag_at(&r);
        let mut old = bytes[..at].to_vec();
        old.extend_from_slice(&bytes[at + 33..]);
        assert_eq!(Record::decode(&old), Err(DecodeError::BadValue(200)), "status 200's first byte is no flag");
        assert!(matches!(bytes.get(at), Some(0 | 1)), "read as a status by the old layout: below 100");
    }
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn record(state: State) -> Record {
        Record {
            fingerprint: Fingerprint([7; 32]),
            created_at_ms: 1_764_000_000_000,
            expires_at_ms: 1_764_086_400_000,
            creator: Creator {
                request_id: "req-1".into(),
                log_values: vec![("x-agent-run-id".into(), "run-9".into())],
            },
            state,
        }
    }

    fn all_states() -> Vec<State> {
        let owner = OwnerToken([3; 16]);
        vec![
            State::Claimed { owner, lock_expires_at_ms: 60_000 },
            State::Forwarded { owner, lock_expires_at_ms: u64::MAX },
            State::Completed(StoredResponse {
                status: 201,
                headers: vec![("location".into(), b"/charges/1".to_vec()), ("x-bin".into(), vec![0, 255, 10])],
                body: b"{\"id\":1}\x00\xff".to_vec(),
            }),
            State::Completed(StoredResponse { status: 500, headers: vec![], body: vec![] }),
            State::CompletedTooLarge { status: 200, location: Some(b"/x".to_vec()) },
            State::CompletedTooLarge { status: 204, location: None },
            State::OutcomeUnknown { reason: UnknownReason::UpstreamTimeout },
            State::OutcomeUnknown { reason: UnknownReason::DownstreamGone },
            State::AwaitingInput(Box::new(Awaiting::new([1; 32], vec![[2; 32], [3; 32]], question("s1")))),
            State::AwaitingInput(Box::new(Awaiting::new(
                [1; 32],
                vec![],
                StoredResponse { status: 200, headers: vec![("a".into(), b"b".to_vec())], body: b"{}".to_vec() },
            ))),
        ]
    }

    /// Issue 40, item 6: a completed record lives `ttl` then its tombstone in every tier, and is
    /// its key's tombstone from its own expiry (the completion plus `ttl`) on; no other stage is.
    #[test]
    fn a_completed_record_outlives_its_ttl_as_the_keys_tombstone_and_no_other_stage_does() {
        let l = Lifetimes { ttl_ms: 10_000, lock_ms: 1_000, unknown_ms: 5_000, tombstone_ms: 7_000 };
        assert_eq!(l.life_ms(Stage::Completed), 17_000);
        assert_eq!(l.life_ms(Stage::Unknown), 5_000);
        assert_eq!(l.life_ms(Stage::Forwarded), 6_000);
        assert_eq!(Lifetimes { tombstone_ms: 0, ..l }.life_ms(Stage::Completed), 10_000);
        let resp = StoredResponse { status: 201, headers: vec![], body: b"x".to_vec() };
        let done = Record::completed(Fingerprint([1; 32]), resp, false, Creator::default(), 50_000, 10);
        assert_eq!(done.expires_at_ms, 60_000);
        assert!(!done.is_tombstone(59_999));
        assert!(done.is_tombstone(60_000));
        let lean = Record { state: done.state.clone().without_body(), ..done.clone() };
        assert!(lean.is_tombstone(60_000), "a completion kept without its body too");
        for state in [
            State::OutcomeUnknown { reason: UnknownReason::Other },
            State::Forwarded { owner: OwnerToken([1; 16]), lock_expires_at_ms: 0 },
        ] {
            assert!(!Record { state, ..done.clone() }.is_tombstone(60_000));
        }
        // A route without tombstones has none.
        assert!(done.is_tombstone_for(1, 60_000));
        assert!(!done.is_tombstone_for(0, 60_000));
        // A store's small tombstone is one on every route, and no encoding decodes as one.
        let key = Record::key_tombstone(done.fingerprint);
        assert!(key.is_key_tombstone() && key.is_tombstone_for(0, 1) && !done.is_key_tombstone());
        assert_eq!(Record::decode(&key.encode()), Err(DecodeError::BadStatus));
    }

    #[test]
    fn a_claim_answer_is_used_only_while_the_claims_lock_cannot_be_stale() {
        let l = Lifetimes { ttl_ms: 10_000, lock_ms: 1_000, unknown_ms: 5_000, tombstone_ms: 0 };
        let sent = 1_764_000_000_000;
        assert!(l.answer_in_time(sent, sent, 0));
        assert!(l.answer_in_time(sent, sent + 999, 0));
        // From the lock's length after the send, a reader may have judged it stale.
        assert!(!l.answer_in_time(sent, sent + 1_000, 0));
        assert!(!l.answer_in_time(sent, sent + 60_000, 0));
        // A clock that stepped back since the send: no time has passed.
        assert!(l.answer_in_time(sent, sent - 5_000, 0));
        // A request that may then run 600 ms (a detached upstream timeout) must end within it.
        assert!(l.answer_in_time(sent, sent + 399, 600));
        assert!(!l.answer_in_time(sent, sent + 400, 600));
        // A detached call sent late in its lock ends with it; none is sent once it is spent.
        assert_eq!(callout_timeout_within_lock(600, sent + 1_000, sent + 100), 600);
        assert_eq!(callout_timeout_within_lock(600, sent + 1_000, sent + 700), 300);
        assert_eq!(callout_timeout_within_lock(600, sent + 1_000, sent + 1_000), 0);
        assert_eq!(callout_timeout_within_lock(600, sent + 1_000, sent + 5_000), 0);
    }

    #[test]
    fn every_state_round_trips_through_the_encoding() {
        for s in all_states() {
            let r = record(s);
            assert_eq!(Record::decode(&r.encode()), Ok(r.clone()));
        }
    }

    #[test]
    fn encoding_is_versioned_and_tagged() {
        let bytes = record(State::OutcomeUnknown { reason: UnknownReason::Other }).encode();
        assert_eq!(&bytes[..5], b"IGR\x01\x05");
    }

    #[test]
    fn unknown_version_tag_and_values_are_errors() {
        let mut bytes = record(State::OutcomeUnknown { reason: UnknownReason::Other }).encode();
        bytes[3] = 2;
        assert_eq!(Record::decode(&bytes), Err(DecodeError::UnsupportedVersion(2)));
        bytes[3] = 1;
        bytes[4] = 9;
        assert_eq!(Record::decode(&bytes), Err(DecodeError::BadTag(9)));
        bytes[4] = 5;
        *bytes.last_mut().unwrap() = 77;
        assert_eq!(Record::decode(&bytes), Err(DecodeError::BadValue(77)));
        assert_eq!(Record::decode(b"XYZ\x01"), Err(DecodeError::BadMagic));
        assert_eq!(Record::decode(b""), Err(DecodeError::Truncated));
    }

    #[test]
    fn every_truncation_and_any_trailing_byte_is_an_error() {
        for s in all_states() {
            let bytes = record(s).encode();
            for cut in 0..bytes.len() {
                assert!(Record::decode(&bytes[..cut]).is_err(), "prefix of {cut} bytes decoded");
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(Record::decode(&longer), Err(DecodeError::TrailingBytes));
        }
    }

    #[test]
    fn a_record_has_one_encoding_only() {
        let bytes = record(State::OutcomeUnknown { reason: UnknownReason::Other }).encode();
        // created_at_ms spelled with a redundant continuation byte.
        let mut padded = bytes[..37].to_vec();
        let rest = &bytes[37..];
        let mut i = 0;
        while rest[i] & 0x80 != 0 {
            i += 1;
        }
        padded.extend_from_slice(&rest[..i]);
        padded.push(rest[i] | 0x80);
        padded.push(0);
        padded.extend_from_slice(&rest[i + 1..]);
        assert!(Record::decode(&padded).is_err());
    }

    #[test]
    fn huge_declared_length_is_refused_without_allocating_it() {
        let mut bytes = b"IGR\x01\x03".to_vec();
        bytes.extend_from_slice(&[0; 32]);
        bytes.extend_from_slice(&[0, 0]); // times
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]); // request id length
        assert_eq!(Record::decode(&bytes), Err(DecodeError::Truncated));
    }

    /// A header list of empty names and values costs two bytes each in the input and about 50
    /// in memory: more than `MAX_LIST_ITEMS` are refused, so a hostile store's record cannot
    /// amplify memory; up to it they decode.
    #[test]
    fn more_header_lines_than_any_record_holds_are_refused() {
        let mut r = record(State::Completed(StoredResponse { status: 200, headers: vec![], body: vec![] }));
        r.creator.log_values.clear();
        for n in [MAX_LIST_ITEMS, MAX_LIST_ITEMS + 1] {
            let State::Completed(ref mut resp) = r.state else { unreachable!() };
            resp.headers = vec![(String::new(), vec![]); n];
            let decoded = Record::decode(&r.encode());
            if n > MAX_LIST_ITEMS {
                assert_eq!(decoded, Err(DecodeError::TooManyItems));
            } else {
                assert_eq!(decoded, Ok(r.clone()));
            }
        }
    }

    #[test]
    fn encoded_record_holds_no_raw_key_or_credential() {
        // The record never receives the key or the scope's header values: only hashes.
        let bytes = record(all_states().remove(2)).encode();
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains("Bearer"));
        assert!(!text.contains("idempotency"));
    }

    #[test]
    fn expiry_is_checked_against_the_given_clock() {
        let r = record(State::OutcomeUnknown { reason: UnknownReason::Other });
        assert!(!r.is_expired(r.expires_at_ms - 1));
        assert!(r.is_expired(r.expires_at_ms));
    }

    #[cfg(not(target_arch = "wasm32"))]
    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn arb_state() -> impl Strategy<Value = State> {
            let owner = any::<[u8; 16]>().prop_map(OwnerToken);
            prop_oneof![
                (owner.clone(), any::<u64>()).prop_map(|(owner, l)| State::Claimed { owner, lock_expires_at_ms: l }),
                (owner, any::<u64>()).prop_map(|(owner, l)| State::Forwarded { owner, lock_expires_at_ms: l }),
                (
                    100u16..1000,
                    proptest::collection::vec(("[a-z-]{1,20}", proptest::collection::vec(any::<u8>(), 0..40)), 0..5),
                    proptest::collection::vec(any::<u8>(), 0..300)
                )
                    .prop_map(|(status, headers, body)| State::Completed(StoredResponse {
                        status,
                        headers,
                        body
                    })),
                (100u16..1000, proptest::option::of(proptest::collection::vec(any::<u8>(), 0..40)))
                    .prop_map(|(status, location)| State::CompletedTooLarge { status, location }),
                (1u8..7).prop_map(|c| State::OutcomeUnknown { reason: UnknownReason::from_code(c).unwrap() }),
                (
                    any::<[u8; 32]>(),
                    proptest::collection::vec(any::<[u8; 32]>(), 0..4),
                    proptest::option::of(any::<[u8; 32]>()),
                    100u16..1000,
                    proptest::collection::vec(any::<u8>(), 0..100)
                )
                    .prop_map(|(round, earlier, asked_state, status, body)| State::AwaitingInput(
                        Box::new(Awaiting {
                            round,
                            earlier,
                            asked_state,
                            response: StoredResponse { status, headers: vec![], body }
                        })
                    )),
            ]
        }

        proptest! {
            #[test]
            fn any_record_round_trips(state in arb_state(), fp in any::<[u8; 32]>(), c in any::<u64>(), e in any::<u64>(),
                                      rid in ".{0,30}", logs in proptest::collection::vec((".{0,10}", ".{0,10}"), 0..4)) {
                let r = Record { fingerprint: Fingerprint(fp), created_at_ms: c, expires_at_ms: e,
                                 creator: Creator { request_id: rid, log_values: logs }, state };
                prop_assert_eq!(Record::decode(&r.encode()), Ok(r));
            }

            #[test]
            fn decoding_arbitrary_bytes_never_panics_and_round_trips_when_it_succeeds(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
                if let Ok(r) = Record::decode(&bytes) {
                    prop_assert_eq!(r.encode(), bytes);
                }
            }

            #[test]
            fn decoding_mutated_records_never_panics(state in arb_state(), pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
                let r = Record { fingerprint: Fingerprint([1; 32]), created_at_ms: 1, expires_at_ms: 2, creator: Creator::default(), state };
                let mut bytes = r.encode();
                let i = pos.index(bytes.len());
                bytes[i] = byte;
                let _ = Record::decode(&bytes);
            }
        }
    }
}
