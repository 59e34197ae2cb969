//! The one store interface: which protocol the configured store speaks (`store.kind`), Redis
//! through webdis (`crate::store`) or etcd v3 (`crate::etcd`), and for each of claim, read and
//! transition the request it builds and how its answer is read; and the operator's side (the
//! clock an operator's judgement uses, a fenced read, the store's own view of a key, listing,
//! the lease and the transition of `admin::plan`'s release, complete and forget). The filter's
//! glue and the operator CLI call these without asking which store it is; the requests and the
//! parsing are those of `store`, `etcd` and `admin::command`, unchanged.

use serde_json::Value;

use crate::admin::{self, Header};
use crate::config::StoreKind;
use crate::etcd::{self, Fence};
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record, Stage};
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{self, ClaimReply, ReadReply, Resp, StoreError, StoreRequest, Transition, TransitionReply};

/// The configured store, with what its writes need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Redis through webdis: its scripts judge by Redis's clock; no request carries a time.
    Redis,
    /// etcd v3: every put carries `lease` (`None`: no usable lease, nothing can be written), a
    /// key's tombstone `tombstone_lease` (`etcd::tombstone_lease_ttl_seconds`), and every request
    /// is judged by the proxy's clock (`etcd::judged_now`).
    Etcd { lease: Option<i64>, tombstone_lease: Option<i64> },
}

/// The store's credential, as its requests carry it (`Backend::credential`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credential {
    /// No credential.
    None,
    /// The `authorization` header every request carries (webdis's basic auth).
    Header(String),
    /// `user:password`, traded for a token that requests carry (etcd's `Authenticate`).
    Token(String),
}

/// Why a request could not be built.
#[derive(Debug, PartialEq, Eq)]
pub enum Unbuilt {
    /// etcd without a usable lease (none granted yet, or etcd has not answered a grant for a
    /// window): the store counts as unavailable; nothing is ever put without a lease.
    NoLease,
    /// A broken invariant of the caller (`etcd::transition_request`'s refusals): fail closed.
    Broken(String),
}

impl std::fmt::Display for Unbuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unbuilt::NoLease => write!(f, "no usable etcd lease (granted ahead by the root context)"),
            Unbuilt::Broken(why) => write!(f, "{why}"),
        }
    }
}

impl Backend {
    /// The store of `kind`; `lease` is used by etcd only.
    pub fn of(kind: StoreKind, lease: Option<i64>) -> Backend {
        match kind {
            StoreKind::Redis => Backend::Redis,
            StoreKind::Etcd => Backend::Etcd { lease, tombstone_lease: lease },
        }
    }

    /// What the store's credential (`user:password` from the VM's environment, never from the
    /// plugin configuration) becomes: webdis takes it as the `authorization` header of every
    /// request (`Credential::Header`); etcd trades it for a token (`Credential::Token`, checked
    /// here so a malformed one refuses the configuration).
    pub fn credential(&self, user_password: Option<String>) -> Result<Credential, String> {
        match (self, user_password) {
            (_, None) => Ok(Credential::None),
            (Backend::Redis, Some(v)) => Ok(Credential::Header(store::basic_auth(&v))),
            (Backend::Etcd { .. }, Some(v)) => {
                etcd::authenticate_request(&v)?;
                Ok(Credential::Token(v))
            }
        }
    }

    /// The store of `kind` whose writes use the leases `leases` gives (asked only for etcd): the
    /// records' and the keys' tombstones'.
    pub fn writing(kind: StoreKind, leases: impl FnOnce() -> (Option<i64>, Option<i64>)) -> Backend {
        match kind {
            StoreKind::Redis => Backend::Redis,
            StoreKind::Etcd => {
                let (lease, tombstone_lease) = leases();
                Backend::Etcd { lease, tombstone_lease }
            }
        }
    }

    /// The leases `t` puts under: the record's, and its key's tombstone's where it writes one
    /// (none usable: nothing is written, as for a record).
    fn leased(t: &Transition, lease: Option<i64>, tombstone_lease: Option<i64>) -> Result<etcd::Leased, Unbuilt> {
        let record = Self::lease(lease)?;
        let tombstone = match t.key_tombstone_of() {
            Some(_) => Self::lease(tombstone_lease)?,
            None => record,
        };
        Ok(etcd::Leased { record, tombstone })
    }

    /// Whether its requests and answers are judged by the proxy's clock (etcd), so the caller
    /// must read it; Redis judges by its own.
    pub fn uses_proxy_clock(&self) -> bool {
        matches!(self, Backend::Etcd { .. })
    }

    /// Whether it needs leases and tokens granted ahead by the root's tick (etcd).
    pub fn needs_tick(&self) -> bool {
        matches!(self, Backend::Etcd { .. })
    }

    fn lease(lease: Option<i64>) -> Result<i64, Unbuilt> {
        lease.ok_or(Unbuilt::NoLease)
    }

    /// The claim-or-read request: `record` (forwarded, owned by `owner`) put if the key is free.
    pub fn claim_request(
        &self,
        skey: &StorageKey,
        owner: &OwnerToken,
        record: &Record,
        lifetimes: &Lifetimes,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<StoreRequest, Unbuilt> {
        match *self {
            Backend::Redis => Ok(store::claim_request(skey, owner, record, lifetimes, seal)),
            Backend::Etcd { lease, .. } => {
                Ok(etcd::claim_request(skey, owner, record, lifetimes, seal, Self::lease(lease)?, now_ms))
            }
        }
    }

    /// The answer to a claim-or-read, with etcd's fence of an existing value.
    pub fn parse_claim(
        &self,
        status: Option<u16>,
        body: &[u8],
        owner: &OwnerToken,
        skey: &StorageKey,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<(ClaimReply, Option<Fence>), StoreError> {
        match self {
            Backend::Redis => store::parse_claim_reply(status, body, owner, skey, seal).map(|r| (r, None)),
            Backend::Etcd { .. } => etcd::parse_claim_reply(status, body, owner, skey, seal, now_ms),
        }
    }

    /// A transition's request (`fence`: the value a non-owner decided on; etcd needs it).
    pub fn transition_request(
        &self,
        t: &Transition,
        skey: &StorageKey,
        seal: &Seal,
        now_ms: u64,
        fence: Option<&Fence>,
    ) -> Result<StoreRequest, Unbuilt> {
        match *self {
            Backend::Redis => Ok(t.request(skey, seal)),
            Backend::Etcd { lease, tombstone_lease } => {
                let leased = Self::leased(t, lease, tombstone_lease)?;
                etcd::transition_request_leased(t, skey, seal, leased, now_ms, fence).map_err(Unbuilt::Broken)
            }
        }
    }

    /// The second request of `t` when it writes where the key is absent, sent only if the first
    /// is answered `TransitionReply::Absent` (etcd); `None` where there is none (Redis's script
    /// writes where absent in the same call; a transition that never writes where absent).
    pub fn where_absent_request(
        &self,
        t: &Transition,
        skey: &StorageKey,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<Option<StoreRequest>, Unbuilt> {
        match *self {
            Backend::Etcd { lease, tombstone_lease } if etcd::writes_where_absent(t) => {
                let leased = Self::leased(t, lease, tombstone_lease)?;
                etcd::where_absent_request_leased(t, skey, seal, leased, now_ms).map(Some).map_err(Unbuilt::Broken)
            }
            _ => Ok(None),
        }
    }

    /// The answer to `where_absent_request`'s request (only etcd sends one).
    pub fn parse_where_absent(&self, status: Option<u16>, body: &[u8]) -> Result<TransitionReply, StoreError> {
        etcd::parse_where_absent_reply(status, body)
    }

    /// Whether the store refused a request for its size (nothing of it applied): etcd over
    /// `--max-request-bytes` or its gRPC limit, webdis over `http_max_request_size` (413).
    pub fn refused_as_too_large(&self, status: Option<u16>, body: &[u8]) -> bool {
        match self {
            Backend::Redis => store::refused_as_too_large(status),
            Backend::Etcd { .. } => etcd::refused_as_too_large(status, body),
        }
    }

    /// The answer to an owner's write or a stale-to-unknown (no echo checked).
    pub fn parse_write(&self, status: Option<u16>, body: &[u8]) -> Result<TransitionReply, StoreError> {
        match self {
            Backend::Redis => store::parse_transition_reply(status, body, None),
            Backend::Etcd { .. } => etcd::parse_transition_reply(status, body, None),
        }
    }

    /// The answer to a take-over by `owner`: a change forwards the request, so the answer must be
    /// this request's: it must echo `owner` (Redis: the transition script's echo; etcd: the new
    /// owner's claim).
    pub fn parse_take_over(
        &self,
        status: Option<u16>,
        body: &[u8],
        skey: &StorageKey,
        owner: &OwnerToken,
    ) -> Result<TransitionReply, StoreError> {
        match self {
            Backend::Redis => store::parse_transition_reply(status, body, Some(owner)),
            Backend::Etcd { .. } => etcd::parse_transition_reply(status, body, Some((skey, Stage::Forwarded, owner))),
        }
    }

    /// A read (no claim) of `skey`'s value.
    pub fn read_request(&self, skey: &StorageKey) -> StoreRequest {
        match self {
            Backend::Redis => store::read_request(skey),
            Backend::Etcd { .. } => etcd::read_request(skey),
        }
    }

    /// The answer to `read_request`, read at `now_ms` on this proxy's clock (etcd: a value past
    /// its expiry by `etcd::judged_now` is absent, as Redis would have dropped it).
    pub fn parse_read(
        &self,
        status: Option<u16>,
        body: &[u8],
        skey: &StorageKey,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<ReadReply, StoreError> {
        match self {
            Backend::Redis => store::parse_read_reply(status, body, skey, seal),
            Backend::Etcd { .. } => etcd::parse_read_reply(status, body, skey, seal, now_ms),
        }
    }
}

/// One page of a listing of the store's keys (`Backend::list_request`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listing {
    pub found: Vec<Listed>,
    /// Where the next page starts; `None`: the listing is over.
    pub next: Option<Vec<u8>>,
}

/// A key a listing found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listed {
    /// A key and its value's header, read together (Redis: `GETRANGE` in the scan): judged
    /// without reading the record. `hex`: the key as stored, without its prefix.
    Header { hex: String, header: Header },
    /// A key alone (etcd: a page of key names, never of values): its value is read to judge it.
    Key(StorageKey),
}

/// A value as stored (`Backend::parse_raw_read`), whatever it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawValue {
    pub bytes: Vec<u8>,
    /// etcd's `mod_revision` of the value (what its deletion compares); Redis: `None`.
    pub revision: Option<i64>,
}

/// How many keys one step of a Redis scan asks for.
const SCAN_COUNT: u32 = 200;

/// The operator's side of the interface: what `idemgate inspect`, `list`, `resolve` and `forget`
/// send and how they read the answers.
impl Backend {
    /// The request that reads the clock an operator's judgement uses, when it is the store's:
    /// Redis's `TIME` (every lock is judged by it, as the filter's scripts do), answered with
    /// `nonce`. `None` where the operator's own clock is used (etcd: `judged_now`, as the filter
    /// does).
    pub fn clock_request(&self, nonce: &str) -> Option<StoreRequest> {
        match self {
            Backend::Redis => Some(StoreRequest::command(&admin::command::time(nonce))),
            Backend::Etcd { .. } => None,
        }
    }

    /// The answer to `clock_request(nonce)`, in ms: one that does not echo `nonce` is not this
    /// request's (garbled).
    pub fn parse_clock(&self, status: Option<u16>, body: &[u8], nonce: &str) -> Result<u64, StoreError> {
        match command_answer(status, body)? {
            Resp::Array(Some(items)) => {
                let parts: Vec<Vec<u8>> = items
                    .iter()
                    .filter_map(|i| if let Resp::Bulk(Some(b)) = i { Some(b.clone()) } else { None })
                    .collect();
                match parts.as_slice() {
                    [.., echo] if parts.len() == 3 && echo.as_slice() == nonce.as_bytes() => admin::time_ms(&parts)
                        .ok_or_else(|| StoreError::Garbled(format!("unexpected TIME answer: {items:?}"))),
                    _ => Err(StoreError::Garbled(format!("unexpected TIME answer (not this request's): {items:?}"))),
                }
            }
            other => Err(StoreError::Garbled(format!("unexpected TIME answer: {other:?}"))),
        }
    }

    /// The time an operator's judgement uses when the operator's clock reads `local_now_ms` and
    /// `clock_request` is `None` (etcd: `judged_now`, the clock taken the skew tolerance behind).
    pub fn judged_now(&self, local_now_ms: u64) -> u64 {
        match self {
            Backend::Redis => local_now_ms,
            Backend::Etcd { .. } => etcd::judged_now(local_now_ms),
        }
    }

    /// The answer to `read_request` as an operator reads it, at `local_now_ms` on the operator's
    /// clock: the value and, with etcd, the `Fence` an operator's transition is decided on.
    pub fn parse_fenced_read(
        &self,
        status: Option<u16>,
        body: &[u8],
        skey: &StorageKey,
        seal: &Seal,
        local_now_ms: u64,
    ) -> Result<(ReadReply, Option<Fence>), StoreError> {
        match self {
            Backend::Redis => store::parse_read_reply(status, body, skey, seal).map(|r| (r, None)),
            Backend::Etcd { .. } => etcd::parse_fenced_read(status, body, skey, seal, local_now_ms),
        }
    }

    /// The request for what the store itself says of a key beside its value, when a read does
    /// not say it (Redis: the key's `PTTL`).
    pub fn inspect_request(&self, skey: &StorageKey) -> Option<StoreRequest> {
        match self {
            Backend::Redis => Some(StoreRequest::command(&admin::command::pttl(&store::redis_key(skey)))),
            Backend::Etcd { .. } => None,
        }
    }

    /// The fields `inspect` adds to `admin::report`: the store's own lifetime of the key (Redis:
    /// `store_ttl_ms` from `inspect_request`'s `answer`; etcd: the value's expiry by its writer's
    /// clock and its `mod_revision`, from the read's `fence`).
    pub fn store_fields(
        &self,
        fence: Option<&Fence>,
        answer: Option<(Option<u16>, &[u8])>,
    ) -> Result<Vec<(&'static str, Value)>, StoreError> {
        match self {
            Backend::Redis => match answer {
                Some((status, body)) => match command_answer(status, body)? {
                    Resp::Integer(ms) => Ok(vec![("store_ttl_ms", ms.into())]),
                    _ => Ok(vec![]),
                },
                None => Ok(vec![]),
            },
            Backend::Etcd { .. } => Ok(fence
                .map(|f| {
                    vec![("store_expires_at_ms", f.expires_at_ms.into()), ("store_mod_revision", f.mod_revision.into())]
                })
                .unwrap_or_default()),
        }
    }

    /// One page of the store's idemgate keys, from `cursor` (`None`: the first page): never a
    /// command that blocks the store, never an unbounded range. Redis: a `SCAN` step with each
    /// value's header (`admin::command::scan`); etcd: a page of at most `etcd::LIST_PAGE_MAX`
    /// key names. `nonce`: what a Redis answer echoes (`admin::command::scan`).
    pub fn list_request(&self, cursor: Option<&[u8]>, nonce: &str) -> StoreRequest {
        match self {
            Backend::Redis => {
                let cursor = cursor.map_or_else(|| "0".to_string(), |c| String::from_utf8_lossy(c).into_owned());
                StoreRequest::command(&admin::command::scan(&cursor, SCAN_COUNT, nonce))
            }
            Backend::Etcd { .. } => etcd::list_page_request(cursor, etcd::LIST_PAGE_MAX),
        }
    }

    /// The answer to `list_request(cursor, nonce)`: a Redis answer that does not echo `nonce` is
    /// not this request's (garbled).
    pub fn parse_list(
        &self,
        status: Option<u16>,
        body: &[u8],
        cursor: Option<&[u8]>,
        nonce: &str,
    ) -> Result<Listing, StoreError> {
        match self {
            Backend::Redis => {
                // A page holds as many keys as Redis returns: parsed without the filter's bound.
                let answer = command_answer_parsed(status, body, store::parse_resp_any_length)?;
                let garbled = || {
                    // A Redis error carries no nonce: this request refused (a user without `SCAN`
                    // or `GETRANGE`, say) or another client's late error; asked again either way.
                    if let Resp::Error(e) = &answer {
                        return StoreError::Garbled(format!(
                            "Redis refused the SCAN script (or answered another client's command): {e} \
                             (the CLI's user needs +scan +getrange: docs/operating.md)"
                        ));
                    }
                    // The answer's first elements only: it may be another client's large record.
                    let shown: String = match &answer {
                        Resp::Array(Some(items)) => format!("{:?}", items.iter().take(3).collect::<Vec<_>>()),
                        other => format!("{other:?}"),
                    }
                    .chars()
                    .take(200)
                    .collect();
                    StoreError::Garbled(format!("unexpected SCAN answer (not this request's): {shown}"))
                };
                let Resp::Array(Some(items)) = &answer else { return Err(garbled()) };
                let Some((Resp::Bulk(Some(echo)), items)) = items.split_first() else { return Err(garbled()) };
                if echo.as_slice() != nonce.as_bytes() {
                    return Err(garbled());
                }
                let Some((Resp::Bulk(Some(next)), found)) = items.split_first() else { return Err(garbled()) };
                let mut out = vec![];
                for pair in found.chunks(2) {
                    let [Resp::Bulk(Some(k)), Resp::Bulk(Some(head))] = pair else { continue };
                    let k = String::from_utf8_lossy(k).into_owned();
                    let hex = k.strip_prefix(store::KEY_PREFIX).unwrap_or(&k).to_string();
                    out.push(Listed::Header { hex, header: admin::parse_header(head) });
                }
                let next = Some(next.clone()).filter(|n| n.as_slice() != b"0");
                Ok(Listing { found: out, next })
            }
            Backend::Etcd { .. } => {
                let page = etcd::parse_list_page(status, body, cursor, etcd::LIST_PAGE_MAX)?;
                Ok(Listing { found: page.keys.into_iter().map(Listed::Key).collect(), next: page.next })
            }
        }
    }

    /// The answer to `read_request(skey)` as stored, whatever it holds: `None` when absent, else
    /// the value's bytes and (etcd) its `mod_revision`. What `inspect` shows and `forget` deletes
    /// of a value this build cannot read.
    pub fn parse_raw_read(
        &self,
        status: Option<u16>,
        body: &[u8],
        skey: &StorageKey,
    ) -> Result<Option<RawValue>, StoreError> {
        match self {
            Backend::Redis => match command_answer(status, body)? {
                Resp::Bulk(None) => Ok(None),
                Resp::Bulk(Some(bytes)) => Ok(Some(RawValue { bytes, revision: None })),
                other => Err(StoreError::Garbled(format!("unexpected GET answer: {other:?}"))),
            },
            Backend::Etcd { .. } => Ok(etcd::parse_raw_read(status, body, &etcd::etcd_key(skey))?
                .map(|(bytes, rev)| RawValue { bytes, revision: Some(rev) })),
        }
    }

    /// The request for the plain-text phase of a value, where it is not in the value itself
    /// (etcd: the owner mark; Redis's value header carries it).
    pub fn raw_phase_request(&self, skey: &StorageKey) -> Option<StoreRequest> {
        match self {
            Backend::Redis => None,
            Backend::Etcd { .. } => Some(etcd::owner_mark_request(skey)),
        }
    }

    /// What can be read of `raw`, a value this build cannot open, with the answer to
    /// `raw_phase_request` (`mark`) where there is one.
    pub fn unsealed(
        &self,
        raw: &RawValue,
        skey: &StorageKey,
        mark: Option<(Option<u16>, &[u8])>,
    ) -> Result<admin::Unsealed, StoreError> {
        match self {
            Backend::Redis => Ok(admin::Unsealed::of_redis_value(&raw.bytes)),
            Backend::Etcd { .. } => match mark {
                Some((status, body)) => Ok(etcd::parse_raw_read(status, body, &etcd::owner_key(skey))?
                    .map(|(m, _)| admin::Unsealed::of_etcd_mark(&m))
                    .unwrap_or_default()),
                None => Ok(admin::Unsealed::default()),
            },
        }
    }

    /// The deletion of `raw` (a value this build cannot open) at `skey`, only if the store still
    /// holds exactly it: Redis compares its SHA-1 in a script answered with `nonce`, etcd its
    /// `mod_revision` (deleting the owner mark with it).
    pub fn forget_raw_request(&self, skey: &StorageKey, raw: &RawValue, nonce: &str) -> StoreRequest {
        match (self, raw.revision) {
            (Backend::Etcd { .. }, Some(rev)) => etcd::forget_raw_request(skey, rev),
            _ => {
                let sha1 = crate::sha1::hex(&crate::sha1::digest(&raw.bytes));
                let sha1 = String::from_utf8_lossy(&sha1).into_owned();
                StoreRequest::command(&admin::command::forget_raw(&store::redis_key(skey), &sha1, nonce))
            }
        }
    }

    /// The answer to `forget_raw_request(.., nonce)`: `Changed` (deleted) or `Refused` (the value
    /// changed since it was read, or is gone).
    pub fn parse_forget_raw(
        &self,
        status: Option<u16>,
        body: &[u8],
        nonce: &str,
    ) -> Result<TransitionReply, StoreError> {
        match self {
            Backend::Redis => match command_answer(status, body)? {
                Resp::Array(Some(items)) => match items.as_slice() {
                    [Resp::Bulk(Some(done)), Resp::Bulk(Some(echo))] if echo.as_slice() == nonce.as_bytes() => {
                        Ok(if done.as_slice() == b"1" { TransitionReply::Changed } else { TransitionReply::Refused })
                    }
                    _ => Err(StoreError::Garbled(format!("unexpected forget answer (not this request's): {items:?}"))),
                },
                other => Err(StoreError::Garbled(format!("unexpected forget answer: {other:?}"))),
            },
            Backend::Etcd { .. } => etcd::parse_transition_reply(status, body, None),
        }
    }

    /// The reads of many keys' values in one request, where a listing's pages hold names only
    /// (etcd: `etcd::read_many_request`, at most `etcd::READ_MANY_MAX` keys); `None` for Redis,
    /// whose pages carry each value's header.
    pub fn read_many_request(&self, skeys: &[StorageKey]) -> Option<StoreRequest> {
        match self {
            Backend::Redis => None,
            Backend::Etcd { .. } => Some(etcd::read_many_request(skeys)),
        }
    }

    /// The answer to `read_many_request(skeys)`: one read per key, in order, as `parse_fenced_read`
    /// judges one at `local_now_ms`.
    pub fn parse_read_many(
        &self,
        status: Option<u16>,
        body: &[u8],
        skeys: &[StorageKey],
        seal: &Seal,
        local_now_ms: u64,
    ) -> Result<Vec<ReadReply>, StoreError> {
        match self {
            Backend::Redis => Err(StoreError::Garbled("Redis reads no values while listing".into())),
            Backend::Etcd { .. } => etcd::parse_read_many(status, body, skeys, seal, local_now_ms),
        }
    }

    /// The lease an operator's transition `t` writes with, to be granted before it is built:
    /// `(request, ttl_seconds)` for etcd when `t` writes a value; `None` when none is needed.
    pub fn operator_lease_request(&self, t: &Transition) -> Option<(StoreRequest, u64)> {
        match self {
            Backend::Etcd { .. } if t.new_phase.is_some() => {
                let ttl = etcd::operator_lease_ttl_seconds(t.ttl_ms);
                Some((etcd::lease_grant_request(ttl), ttl))
            }
            _ => None,
        }
    }

    /// The lease granted by the answer to `operator_lease_request`'s request of `ttl_seconds`.
    pub fn parse_lease(&self, status: Option<u16>, body: &[u8], ttl_seconds: u64) -> Result<i64, StoreError> {
        etcd::parse_lease_grant(status, body, ttl_seconds)
    }

    /// This store writing with `lease` (etcd; Redis needs none).
    pub fn with_lease(self, lease: i64) -> Backend {
        match self {
            Backend::Redis => Backend::Redis,
            Backend::Etcd { .. } => Backend::Etcd { lease: Some(lease), tombstone_lease: Some(lease) },
        }
    }

    /// An operator's transition (`admin::plan`'s) as one request, checked against the value it
    /// was decided on: Redis's script re-checks owner, phase and lock; etcd's transaction compares
    /// the `fence` read (its `mod_revision`), with times from `local_now_ms`.
    pub fn operator_transition_request(
        &self,
        t: &Transition,
        skey: &StorageKey,
        seal: &Seal,
        local_now_ms: u64,
        fence: Option<&Fence>,
    ) -> Result<StoreRequest, Unbuilt> {
        match *self {
            Backend::Redis => Ok(t.request(skey, seal)),
            Backend::Etcd { lease, .. } => {
                let Some(fence) = fence else {
                    return Err(Unbuilt::Broken("store: a value read without its revision".into()));
                };
                let lease = match (t.new_phase, lease) {
                    (Some(_), None) => return Err(Unbuilt::NoLease),
                    (_, lease) => lease.unwrap_or(0),
                };
                etcd::operator_transition_request(t, skey, seal, lease, local_now_ms, fence).map_err(Unbuilt::Broken)
            }
        }
    }

    /// `request` once more when its answer says nothing ran because the store lost its script
    /// (Redis's `NOSCRIPT` after a restart, a failover, `SCRIPT FLUSH`): with the script in full,
    /// which also loads it. `None` otherwise.
    pub fn resend(&self, request: &StoreRequest, status: Option<u16>, body: &[u8]) -> Option<StoreRequest> {
        match self {
            Backend::Redis if store::parse_transition_reply(status, body, None) == Ok(TransitionReply::NoScript) => {
                request.with_script()
            }
            _ => None,
        }
    }

    /// The answer to an operator's transition `t` of `skey`: it must be this request's (Redis: the
    /// script's echo of `t`'s new owner; etcd: a write must echo what it wrote).
    pub fn parse_operator_transition(
        &self,
        status: Option<u16>,
        body: &[u8],
        t: &Transition,
        skey: &StorageKey,
    ) -> Result<TransitionReply, StoreError> {
        match self {
            Backend::Redis => store::parse_transition_reply(status, body, Some(&t.new_owner)),
            Backend::Etcd { .. } => {
                etcd::parse_transition_reply(status, body, t.new_phase.map(|p| (skey, p, &t.new_owner)))
            }
        }
    }
}

/// webdis's answer to a command (`StoreRequest::command`) as a RESP value.
fn command_answer(status: Option<u16>, body: &[u8]) -> Result<Resp, StoreError> {
    command_answer_parsed(status, body, store::parse_resp)
}

/// `command_answer` with the RESP parser `parse` (the listing's reads pages of any length).
fn command_answer_parsed(
    status: Option<u16>,
    body: &[u8],
    parse: fn(&[u8]) -> Result<Resp, StoreError>,
) -> Result<Resp, StoreError> {
    match status {
        Some(200) => parse(body),
        Some(s) => Err(StoreError::Http(s)),
        None => Err(StoreError::NoAnswer),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn etcd_without_a_lease_builds_no_write_and_redis_needs_none() {
        let skey = StorageKey([1; 32]);
        let seal = Seal::new(Some("a-test-secret-of-at-least-32-bytes!!"), None).unwrap();
        let t = Transition::release(OwnerToken([2; 16]));
        let no_lease = Backend::of(StoreKind::Etcd, None);
        assert_eq!(no_lease.transition_request(&t, &skey, &seal, 1, None), Err(Unbuilt::NoLease));
        assert!(Backend::of(StoreKind::Redis, None).transition_request(&t, &skey, &seal, 1, None).is_ok());
        assert_eq!(Backend::of(StoreKind::Etcd, Some(5)).read_request(&skey), etcd::read_request(&skey));
        assert_eq!(Backend::Redis.read_request(&skey), store::read_request(&skey));
    }

    fn bulk(b: &[u8]) -> Vec<u8> {
        let mut out = format!("${}\r\n", b.len()).into_bytes();
        out.extend_from_slice(b);
        out.extend_from_slice(b"\r\n");
        out
    }

    #[test]
    fn a_redis_scan_step_lists_each_key_with_its_header_and_ends_at_cursor_zero() {
        let hex = "ab".repeat(32);
        let head = format!("IGS1P{}{:015}", "cd".repeat(16), 42);
        let answer_with = |nonce: &[u8], cursor: &[u8]| {
            let mut a = b"*6\r\n".to_vec();
            for part in
                [nonce, cursor, format!("idemgate:v1:{hex}").as_bytes(), head.as_bytes(), b"idemgate:v1:x", b"IGS1R"]
            {
                a.extend(bulk(part));
            }
            a
        };
        let answer = |cursor: &[u8]| answer_with(b"n1", cursor);
        let page = Backend::Redis.parse_list(Some(200), &answer(b"17"), None, "n1").unwrap();
        let value = Header::Value { state: Stage::Forwarded, owner: "cd".repeat(16), lock_expires_at_ms: 42 };
        assert_eq!(page.found[0], Listed::Header { hex: hex.clone(), header: value });
        assert_eq!(page.found[1], Listed::Header { hex: "x".into(), header: Header::Tombstone });
        assert_eq!(page.next.as_deref(), Some(&b"17"[..]));
        assert_eq!(Backend::Redis.parse_list(Some(200), &answer(b"0"), Some(b"17"), "n1").unwrap().next, None);
        assert_eq!(
            Backend::Redis.list_request(Some(b"17"), "n1"),
            StoreRequest::command(&admin::command::scan("17", 200, "n1"))
        );
        assert!(Backend::Redis.parse_list(Some(403), &answer(b"0"), None, "n1").is_err());
        assert!(Backend::Redis.parse_list(Some(200), b":1\r\n", None, "n1").is_err());
        // Another request's page (another nonce), or a page without one, is not this request's.
        assert!(matches!(
            Backend::Redis.parse_list(Some(200), &answer_with(b"n2", b"0"), None, "n1"),
            Err(StoreError::Garbled(_))
        ));
        let unechoed = [b"*1\r\n".to_vec(), bulk(b"0")].concat();
        assert!(matches!(Backend::Redis.parse_list(Some(200), &unechoed, None, "n1"), Err(StoreError::Garbled(_))));
    }

    #[test]
    fn the_operators_clock_is_redis_time_or_the_judged_local_clock() {
        let answer = |nonce: &[u8]| [b"*3\r\n".to_vec(), bulk(b"1700000000"), bulk(b"250000"), bulk(nonce)].concat();
        assert_eq!(Backend::Redis.parse_clock(Some(200), &answer(b"n1"), "n1"), Ok(1_700_000_000_250));
        assert!(matches!(Backend::Redis.parse_clock(Some(200), b":5\r\n", "n1"), Err(StoreError::Garbled(_))));
        assert_eq!(Backend::Redis.parse_clock(Some(503), &answer(b"n1"), "n1"), Err(StoreError::Http(503)));
        // Another request's clock (another nonce, or Redis's bare TIME answer) is not this one's.
        assert!(matches!(Backend::Redis.parse_clock(Some(200), &answer(b"n2"), "n1"), Err(StoreError::Garbled(_))));
        let bare = [b"*2\r\n".to_vec(), bulk(b"1700000000"), bulk(b"250000")].concat();
        assert!(matches!(Backend::Redis.parse_clock(Some(200), &bare, "n1"), Err(StoreError::Garbled(_))));
        let e = Backend::of(StoreKind::Etcd, None);
        assert_eq!(e.clock_request("n1"), None);
        assert_eq!(e.judged_now(1_000_000), etcd::judged_now(1_000_000));
        assert!(Backend::Redis.clock_request("n1").is_some());
    }

    /// A take-over forwards on "changed" and an operator reports it: with Redis as with etcd,
    /// only an answer echoing the request's new owner counts (webdis 0.1.9 can deliver another
    /// request's late answer to a new connection: docs/stores.md).
    #[test]
    fn a_redis_take_over_or_operator_write_reads_only_its_own_answer() {
        let skey = StorageKey([1; 32]);
        let (ours, theirs) = (OwnerToken([3; 16]), OwnerToken([4; 16]));
        let answer = |o: &OwnerToken| format!("*2\r\n:1\r\n$32\r\n{}\r\n", o.hex()).into_bytes();
        let r = Backend::Redis;
        assert_eq!(r.parse_take_over(Some(200), &answer(&ours), &skey, &ours), Ok(TransitionReply::Changed));
        assert!(matches!(r.parse_take_over(Some(200), &answer(&theirs), &skey, &ours), Err(StoreError::Garbled(_))));
        assert!(matches!(r.parse_take_over(Some(200), b":1\r\n", &skey, &ours), Err(StoreError::Garbled(_))));
        let forget = Transition::release(ours);
        assert_eq!(
            r.parse_operator_transition(Some(200), &answer(&ours), &forget, &skey),
            Ok(TransitionReply::Changed)
        );
        assert!(r.parse_operator_transition(Some(200), &answer(&theirs), &forget, &skey).is_err());
        // An owner's own write checks the shape (its transition is the same whatever answer it reads).
        assert_eq!(r.parse_write(Some(200), &answer(&theirs)), Ok(TransitionReply::Changed));
        assert!(r.parse_write(Some(200), b":1\r\n").is_err());
    }

    #[test]
    fn webdis_carries_the_credential_in_every_request_and_etcd_trades_a_well_formed_one_for_a_token() {
        let e = Backend::of(StoreKind::Etcd, None);
        assert_eq!(Backend::Redis.credential(None), Ok(Credential::None));
        assert_eq!(e.credential(None), Ok(Credential::None));
        assert_eq!(
            Backend::Redis.credential(Some("u:p".into())),
            Ok(Credential::Header(format!("Basic {}", crate::base64::b64(b"u:p"))))
        );
        assert_eq!(e.credential(Some("u:p".into())), Ok(Credential::Token("u:p".into())));
        assert!(e.credential(Some("no-colon".into())).is_err());
        assert!(e.credential(Some(":p".into())).is_err());
    }

    #[test]
    fn an_etcd_operator_write_needs_its_fence_and_a_lease_and_redis_needs_neither() {
        let skey = StorageKey([1; 32]);
        let seal = Seal::new(Some("a-test-secret-of-at-least-32-bytes!!"), None).unwrap();
        let forget = Transition {
            event: None,
            where_absent: store::WhereAbsent::Refuse,
            ..Transition::release(OwnerToken([2; 16]))
        };
        let e = Backend::of(StoreKind::Etcd, None);
        assert!(matches!(e.operator_transition_request(&forget, &skey, &seal, 1, None), Err(Unbuilt::Broken(_))));
        assert_eq!(e.operator_lease_request(&forget), None, "a delete needs no lease");
        assert!(Backend::Redis.operator_transition_request(&forget, &skey, &seal, 1, None).is_ok());
        assert_eq!(Backend::Redis.operator_lease_request(&forget), None);
        assert_eq!(e.with_lease(9), Backend::Etcd { lease: Some(9), tombstone_lease: Some(9) });
        assert_eq!(Backend::Redis.with_lease(9), Backend::Redis);
    }
}
