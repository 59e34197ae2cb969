//! The configured store (`crate::backend::Backend`) as the glue sees it: the store of
//! `store.kind` with the lease the root holds, and every etcd answer shown to its token keeper.
//! The few places the glue builds a store request or reads a store answer ask here; every rule,
//! and which protocol each request speaks, stays in the core.

use super::Shared;
use crate::config::StoreKind;
use crate::engine::keeper;
use crate::etcd::Fence;
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record};
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{ClaimReply, ReadReply, StoreError, StoreRequest, Transition, TransitionReply};

pub use crate::backend::{Backend, Unbuilt};

fn kind(shared: &Shared) -> StoreKind {
    shared.config.store.as_ref().map_or(StoreKind::Redis, |s| s.kind)
}

/// The configured store (Redis if none is: no request is then ever built), for reads and
/// answers (no lease).
pub fn backend(shared: &Shared) -> Backend {
    Backend::of(kind(shared), None)
}

/// The configured store with the lease usable at `now_ms` (etcd), for writes.
pub fn writer(shared: &Shared, now_ms: u64) -> Backend {
    Backend::writing(kind(shared), || {
        let (leases, tombstones) = (shared.leases.borrow(), shared.tombstone_leases.borrow());
        keeper::usable(&leases, shared.tombstone_lease_ttl_seconds.map(|_| &*tombstones), now_ms)
    })
}

/// Every answer passes here: a refused etcd token (`etcd::token_refused`) has the root
/// authenticate again at its next tick (only an etcd store with a secret has a token).
pub fn note_answer(shared: &Shared, status: Option<u16>, body: &[u8]) {
    let refused =
        keeper::token_refused(&mut shared.etcd_auth.borrow_mut(), shared.etcd_secret.as_deref(), status, body);
    let Some(news) = refused else { return };
    shared.metrics.inc(super::host::Counter::StoreTokenRefused);
    if news {
        log::warn!("idemgate: etcd refused the token (expired, its member forgot it, or etcd's auth changed since): authenticating again");
    }
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
    writer(shared, now_ms).claim_request(skey, owner, record, lifetimes, seal, now_ms)
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
    backend(shared).parse_claim(status, body, owner, skey, seal, now_ms)
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
    writer(shared, now_ms).transition_request(t, skey, seal, now_ms, fence)
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
    backend(shared).parse_take_over(status, body, skey, owner)
}

pub fn read_request(shared: &Shared, skey: &StorageKey) -> StoreRequest {
    backend(shared).read_request(skey)
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
    backend(shared).parse_read(status, body, skey, seal, now_ms)
}
