//! Which protocol the configured store speaks (`store.kind`): Redis through webdis
//! (`crate::store`) or etcd v3 (`crate::etcd`). The few places the glue builds a store request or
//! reads a store answer ask here; every rule stays in the core.

use super::Shared;
use crate::config::StoreKind;
use crate::etcd::{self, Fence};
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record};
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{self, ClaimReply, ReadReply, StoreError, StorePhase, StoreRequest, Transition, TransitionReply};

/// Why an etcd request could not be built.
#[derive(Debug)]
pub enum Unbuilt {
    /// No usable lease (none granted yet, or etcd has not answered a grant for a window): the
    /// store counts as unavailable; nothing is ever put without a lease.
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

pub fn is_etcd(shared: &Shared) -> bool {
    shared.config.store.as_ref().is_some_and(|s| s.kind == StoreKind::Etcd)
}

/// Every etcd answer passes here: a refused token (`etcd::token_refused`) has the root
/// authenticate again at its next tick.
pub fn note_answer(shared: &Shared, status: Option<u16>, body: &[u8]) {
    if shared.etcd_secret.is_none() || !etcd::token_refused(status, body) {
        return;
    }
    shared.metrics.inc(super::host::Counter::StoreTokenRefused);
    if shared.etcd_auth.borrow_mut().refused() {
        log::warn!("idemgate: etcd refused the token (expired, its member forgot it, or etcd's auth changed since): authenticating again");
    }
}

fn lease(shared: &Shared, now_ms: u64) -> Result<i64, Unbuilt> {
    shared.leases.borrow().usable(now_ms).ok_or(Unbuilt::NoLease)
}

/// The claim-or-read request.
pub fn claim_request(
    shared: &Shared,
    skey: &StorageKey,
    owner: &OwnerToken,
    record: &Record,
    lifetimes: &Lifetimes,
    seal: &Seal,
    now_ms: u64,
) -> Result<StoreRequest, Unbuilt> {
    if !is_etcd(shared) {
        return Ok(store::claim_request(skey, owner, record, lifetimes, seal));
    }
    Ok(etcd::claim_request(skey, owner, record, lifetimes, seal, lease(shared, now_ms)?, now_ms))
}

/// The answer to a claim-or-read, with etcd's fence of an existing value.
pub fn parse_claim(
    shared: &Shared,
    status: Option<u16>,
    body: &[u8],
    owner: &OwnerToken,
    skey: &StorageKey,
    seal: &Seal,
    now_ms: u64,
) -> Result<(ClaimReply, Option<Fence>), StoreError> {
    note_answer(shared, status, body);
    if !is_etcd(shared) {
        return store::parse_claim_reply(status, body, owner, skey, seal).map(|r| (r, None));
    }
    etcd::parse_claim_reply(status, body, owner, skey, seal, now_ms)
}

/// A transition's request (`fence`: the value a non-owner decided on; etcd needs it).
pub fn transition_request(
    shared: &Shared,
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    now_ms: u64,
    fence: Option<&Fence>,
) -> Result<StoreRequest, Unbuilt> {
    if !is_etcd(shared) {
        return Ok(t.request(skey, seal));
    }
    etcd::transition_request(t, skey, seal, lease(shared, now_ms)?, now_ms, fence).map_err(Unbuilt::Broken)
}

/// etcd: the second transaction of `t` when it writes where the key is absent (sent only if the
/// owner-checked one is answered `TransitionReply::Absent`); `None` for Redis (its script writes
/// where absent in the same call) and for a transition that never writes where absent.
pub fn where_absent_request(
    shared: &Shared,
    t: &Transition,
    skey: &StorageKey,
    seal: &Seal,
    now_ms: u64,
) -> Result<Option<StoreRequest>, Unbuilt> {
    if !is_etcd(shared) || !etcd::writes_where_absent(t) {
        return Ok(None);
    }
    etcd::where_absent_request(t, skey, seal, lease(shared, now_ms)?, now_ms).map(Some).map_err(Unbuilt::Broken)
}

/// The answer to `where_absent_request`'s request.
pub fn parse_where_absent(shared: &Shared, status: Option<u16>, body: &[u8]) -> Result<TransitionReply, StoreError> {
    note_answer(shared, status, body);
    etcd::parse_where_absent_reply(status, body)
}

/// Whether the store refused a request for its size (nothing of it applied): etcd over
/// `--max-request-bytes` or its gRPC limit, webdis over `http_max_request_size` (413).
pub fn refused_as_too_large(shared: &Shared, status: Option<u16>, body: &[u8]) -> bool {
    if is_etcd(shared) {
        etcd::refused_as_too_large(status, body)
    } else {
        store::refused_as_too_large(status)
    }
}

/// The answer to a write made by the root context.
pub fn parse_write(shared: &Shared, status: Option<u16>, body: &[u8]) -> Result<TransitionReply, StoreError> {
    note_answer(shared, status, body);
    if !is_etcd(shared) {
        return store::parse_transition_reply(status, body);
    }
    etcd::parse_transition_reply(status, body, None)
}

/// The answer to a take-over: with etcd, a change must echo the new owner's claim.
pub fn parse_take_over(
    shared: &Shared,
    status: Option<u16>,
    body: &[u8],
    skey: &StorageKey,
    owner: &OwnerToken,
) -> Result<TransitionReply, StoreError> {
    note_answer(shared, status, body);
    if !is_etcd(shared) {
        return store::parse_transition_reply(status, body);
    }
    etcd::parse_transition_reply(status, body, Some((skey, StorePhase::InProgress, owner)))
}

pub fn read_request(shared: &Shared, skey: &StorageKey) -> StoreRequest {
    if !is_etcd(shared) {
        return store::read_request(skey);
    }
    etcd::read_request(skey)
}

pub fn parse_read(
    shared: &Shared,
    status: Option<u16>,
    body: &[u8],
    skey: &StorageKey,
    seal: &Seal,
    now_ms: u64,
) -> Result<ReadReply, StoreError> {
    note_answer(shared, status, body);
    if !is_etcd(shared) {
        return store::parse_read_reply(status, body, skey, seal);
    }
    etcd::parse_read_reply(status, body, skey, seal, now_ms)
}
