//! etcd's lease and token, kept ahead of need by the root's tick, as a sans-IO machine over the
//! root's `etcd::Leases` and `etcd::Auth`: the tick and the answers to its callouts come in with
//! the time; actions come out (send this authentication, send this lease grant, use this token,
//! count and log this). When to ask is `Leases::wants_grant`'s and `Auth::wants_authenticate`'s
//! rule; this machine adds the order between them (no grant before the first token: it would only
//! be refused; a grant at once when a token arrives) and what each answer does. The glue
//! (`filter/mod.rs`) sends, counts and logs.

use crate::etcd::{self, Auth, Leases};
use crate::store::StoreRequest;

/// What happened, for the glue's counters and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// The authentication request could not be built (a broken credential): not sent.
    AuthUnbuilt(String),
    /// etcd gave a token (`store_authentications`).
    Authenticated,
    /// etcd refused the authentication, or its answer is unreadable (`store_errors`): `said` is
    /// etcd's own text.
    AuthFailed { why: String, said: String },
    /// etcd granted a lease.
    LeaseGranted,
    /// etcd refused the grant, or its answer is unreadable (`store_errors`).
    LeaseFailed(String),
}

/// What the glue does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send this authentication, with no token; report `auth_sent` or `auth_not_sent`.
    Authenticate(StoreRequest),
    /// Send this lease grant (of this kind), with the current token; report `lease_sent` or
    /// `lease_not_sent`.
    GrantLease(StoreRequest, LeaseKind),
    /// Every store request carries this token from now on (`authorization`).
    UseToken(String),
    Note(Note),
}

/// Which of the root's leases a grant is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseKind {
    /// The records' (`etcd::lease_ttl_seconds`).
    Records,
    /// The keys' tombstones' (`etcd::tombstone_lease_ttl_seconds`), where one outlives every
    /// record.
    Tombstones,
}

/// The leases a write made at `now_ms` puts under: the records', and the keys' tombstones'
/// (`tombstone_leases`, where the configuration has leases of their own:
/// `etcd::tombstone_lease_ttl_seconds`; otherwise the records' lease covers them).
pub fn usable(leases: &Leases, tombstone_leases: Option<&Leases>, now_ms: u64) -> (Option<i64>, Option<i64>) {
    let lease = leases.usable(now_ms);
    (lease, tombstone_leases.map_or(lease, |t| t.usable(now_ms)))
}

/// Every store answer passes here: whether it refused the token in use (`etcd::token_refused`;
/// `Some`: counted as `store_token_refused`, the next tick authenticates again), and whether that
/// is news (`Some(true)`: logged once per token). Only an etcd store with a secret has a token.
pub fn token_refused(auth: &mut Auth, secret: Option<&str>, status: Option<u16>, body: &[u8]) -> Option<bool> {
    if secret.is_none() || !etcd::token_refused(status, body) {
        return None;
    }
    Some(auth.refused())
}

/// The root's etcd lease and token.
pub struct Keeper<'a> {
    pub leases: &'a mut Leases,
    /// The keys' tombstones' leases and their TTL, where a tombstone outlives every record
    /// (`etcd::tombstone_lease_ttl_seconds`); `None`: tombstones go under the records' leases.
    pub tombstone_leases: Option<(&'a mut Leases, u64)>,
    pub auth: &'a mut Auth,
    /// The `user:password` the root authenticates with (`IDEMGATE_STORE_AUTH`), if etcd has auth.
    pub secret: Option<&'a str>,
    pub lease_ttl_seconds: u64,
}

impl Keeper<'_> {
    /// The tick's authentication: asked when `Auth::wants_authenticate` says so (at start, every
    /// `refresh_ms`, at once after etcd refused the token).
    pub fn authenticate_if_due(&mut self, refresh_ms: u64, now_ms: u64) -> Option<Action> {
        let secret = self.secret?;
        if !self.auth.wants_authenticate(now_ms, refresh_ms) {
            return None;
        }
        match etcd::authenticate_request(secret) {
            Ok(req) => Some(Action::Authenticate(req)),
            Err(e) => {
                self.auth.failed(now_ms);
                Some(Action::Note(Note::AuthUnbuilt(e)))
            }
        }
    }

    pub fn auth_sent(&mut self, now_ms: u64) {
        self.auth.sent(now_ms);
    }

    /// The authentication could not be sent (`store_errors`): tried again after its backoff.
    pub fn auth_not_sent(&mut self, now_ms: u64) {
        self.auth.failed(now_ms);
    }

    /// The leases of `kind` and their TTL (`None`: no such leases).
    fn of_kind(&mut self, kind: LeaseKind) -> Option<(&mut Leases, u64)> {
        match kind {
            LeaseKind::Records => Some((&mut *self.leases, self.lease_ttl_seconds)),
            LeaseKind::Tombstones => self.tombstone_leases.as_mut().map(|(l, ttl)| (&mut **l, *ttl)),
        }
    }

    /// The tick's lease grant: asked when `Leases::wants_grant` says so (the records' first,
    /// then the tombstones'), never before the first token of an etcd with auth.
    pub fn grant_if_due(&mut self, now_ms: u64) -> Option<Action> {
        if self.secret.is_some() && self.auth.token().is_none() {
            return None;
        }
        [LeaseKind::Records, LeaseKind::Tombstones].into_iter().find_map(|kind| {
            let (leases, ttl) = self.of_kind(kind)?;
            leases.wants_grant(now_ms).then(|| Action::GrantLease(etcd::lease_grant_request(ttl), kind))
        })
    }

    pub fn lease_sent(&mut self, kind: LeaseKind, now_ms: u64) {
        if let Some((l, _)) = self.of_kind(kind) {
            l.grant_sent(now_ms);
        }
    }

    /// The grant could not be sent (`store_errors`): tried again after its backoff.
    pub fn lease_not_sent(&mut self, kind: LeaseKind, now_ms: u64) {
        if let Some((l, _)) = self.of_kind(kind) {
            l.grant_not_sent(now_ms);
        }
    }

    /// etcd's answer to the authentication: a token (used from now on; the first lease needed
    /// it, so a grant follows if due), or a failure (tried again after its backoff).
    pub fn auth_answered(&mut self, status: Option<u16>, body: &[u8], now_ms: u64) -> Vec<Action> {
        match etcd::parse_authenticate(status, body) {
            Ok(token) => {
                self.auth.obtained(token.clone(), now_ms);
                let mut out = vec![Action::UseToken(token), Action::Note(Note::Authenticated)];
                out.extend(self.grant_if_due(now_ms));
                out
            }
            Err(e) => {
                self.auth.failed(now_ms);
                vec![Action::Note(Note::AuthFailed { why: e.to_string(), said: etcd::error_text(body) })]
            }
        }
    }

    /// etcd's answer to the grant of `kind` sent at `sent_at_ms`.
    pub fn lease_answered(
        &mut self,
        kind: LeaseKind,
        sent_at_ms: u64,
        status: Option<u16>,
        body: &[u8],
        now_ms: u64,
    ) -> Note {
        let Some((leases, ttl)) = self.of_kind(kind) else {
            return Note::LeaseFailed("a lease of a kind this configuration has none of".into());
        };
        match etcd::parse_lease_grant(status, body, ttl) {
            Ok(id) => {
                leases.granted(id, sent_at_ms, now_ms);
                Note::LeaseGranted
            }
            Err(e) => {
                leases.grant_failed(sent_at_ms, now_ms);
                Note::LeaseFailed(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests;
