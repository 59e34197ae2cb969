//! The one store interface: which protocol the configured store speaks (`store.kind`), Redis
//! through webdis (`crate::store`) or etcd v3 (`crate::etcd`), and for each of claim, read and
//! transition the request it builds and how its answer is read. The filter's glue and the
//! operator CLI call these without asking which store it is; the requests and the parsing are
//! those of `store` and `etcd`, unchanged.

use crate::config::StoreKind;
use crate::etcd::{self, Fence};
use crate::owner::OwnerToken;
use crate::record::{Lifetimes, Record};
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{self, ClaimReply, ReadReply, StoreError, StorePhase, StoreRequest, Transition, TransitionReply};

/// The configured store, with what its writes need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Redis through webdis: its scripts judge by Redis's clock; no request carries a time.
    Redis,
    /// etcd v3: every put carries `lease` (`None`: no usable lease, nothing can be written) and
    /// every request is judged by the proxy's clock (`etcd::judged_now`).
    Etcd { lease: Option<i64> },
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
            StoreKind::Etcd => Backend::Etcd { lease },
        }
    }

    /// The store of `kind` whose writes use the lease `lease` gives (asked only for etcd).
    pub fn writing(kind: StoreKind, lease: impl FnOnce() -> Option<i64>) -> Backend {
        match kind {
            StoreKind::Redis => Backend::Redis,
            StoreKind::Etcd => Backend::Etcd { lease: lease() },
        }
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
            Backend::Etcd { lease } => {
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
            Backend::Etcd { lease } => {
                etcd::transition_request(t, skey, seal, Self::lease(lease)?, now_ms, fence).map_err(Unbuilt::Broken)
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
            Backend::Etcd { lease } if etcd::writes_where_absent(t) => {
                etcd::where_absent_request(t, skey, seal, Self::lease(lease)?, now_ms)
                    .map(Some)
                    .map_err(Unbuilt::Broken)
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
            Backend::Redis => store::parse_transition_reply(status, body),
            Backend::Etcd { .. } => etcd::parse_transition_reply(status, body, None),
        }
    }

    /// The answer to a take-over by `owner`: with etcd, a change must echo the new owner's claim.
    pub fn parse_take_over(
        &self,
        status: Option<u16>,
        body: &[u8],
        skey: &StorageKey,
        owner: &OwnerToken,
    ) -> Result<TransitionReply, StoreError> {
        match self {
            Backend::Redis => store::parse_transition_reply(status, body),
            Backend::Etcd { .. } => {
                etcd::parse_transition_reply(status, body, Some((skey, StorePhase::InProgress, owner)))
            }
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
