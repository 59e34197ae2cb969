//! The etcd keeper driven in memory: a clock the test moves, the root's 100 ms tick, and its
//! authentications and grants answered, refused, lost (no status) or left unanswered.

use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const TTL: u64 = 600;
const REFRESH_MS: u64 = 60_000;
const TICK_MS: u64 = 100;
const TOKEN: &[u8] = br#"{"header":{"revision":"1"},"token":"aCYxrMFTHEFthxCm.12"}"#;
const LEASE: &[u8] = br#"{"header":{"revision":"1"},"ID":"41","TTL":"600"}"#;

/// The root as the tests see it: the state, what is in flight, and what was done.
struct Sim {
    leases: Leases,
    auth: Auth,
    secret: Option<&'static str>,
    now: u64,
    token: Option<String>,
    /// Authentications in flight (a stuck one is sent again after `AUTH_STUCK_MS`).
    auth_in_flight: usize,
    /// Grants in flight: when each was sent.
    grants: Vec<u64>,
    /// When each grant was sent, and whether a token was held then.
    grants_sent: Vec<(u64, bool)>,
    auths_sent: usize,
    notes: Vec<Note>,
    refuse_next_send: bool,
}

impl Sim {
    fn new(secret: Option<&'static str>) -> Sim {
        Sim {
            leases: Leases::default(),
            auth: Auth::default(),
            secret,
            now: 1_000_000,
            token: None,
            auth_in_flight: 0,
            grants: vec![],
            grants_sent: vec![],
            auths_sent: 0,
            notes: vec![],
            refuse_next_send: false,
        }
    }

    fn keeper(&mut self) -> Keeper<'_> {
        Keeper {
            leases: &mut self.leases,
            tombstone_leases: None,
            auth: &mut self.auth,
            secret: self.secret,
            lease_ttl_seconds: TTL,
        }
    }

    fn run(&mut self, a: Action) {
        let now = self.now;
        match a {
            Action::Authenticate(_) => {
                self.auths_sent += 1;
                if std::mem::take(&mut self.refuse_next_send) {
                    self.keeper().auth_not_sent(now);
                } else {
                    self.auth_in_flight += 1;
                    self.keeper().auth_sent(now);
                }
            }
            Action::GrantLease(_, kind) => {
                assert_eq!(kind, LeaseKind::Records, "no tombstone leases configured");
                self.grants_sent.push((now, self.token.is_some()));
                if std::mem::take(&mut self.refuse_next_send) {
                    self.keeper().lease_not_sent(kind, now);
                } else {
                    self.grants.push(now);
                    self.keeper().lease_sent(kind, now);
                }
            }
            Action::UseToken(t) => self.token = Some(t),
            Action::Note(n) => self.notes.push(n),
        }
    }

    /// The root's tick: authentication first, then the lease.
    fn tick(&mut self) {
        let now = self.now;
        if let Some(a) = self.keeper().authenticate_if_due(REFRESH_MS, now) {
            self.run(a);
        }
        if let Some(a) = self.keeper().grant_if_due(now) {
            self.run(a);
        }
    }

    fn advance(&mut self, ms: u64) {
        let until = self.now + ms;
        while self.now < until {
            self.now = (self.now + TICK_MS).min(until);
            self.tick();
        }
    }

    fn auth_answer(&mut self, status: Option<u16>, body: &[u8]) {
        assert!(self.auth_in_flight > 0, "answered an authentication never sent");
        self.auth_in_flight -= 1;
        let now = self.now;
        for a in self.keeper().auth_answered(status, body, now) {
            self.run(a);
        }
    }

    fn lease_answer(&mut self, i: usize, status: Option<u16>, body: &[u8]) {
        let sent = self.grants.remove(i);
        let now = self.now;
        let n = self.keeper().lease_answered(LeaseKind::Records, sent, status, body, now);
        self.notes.push(n);
    }
}

#[test]
fn without_auth_a_lease_is_granted_at_the_first_tick_and_usable_once_answered() {
    let mut sim = Sim::new(None);
    sim.tick();
    assert_eq!(sim.grants.len(), 1);
    assert_eq!(sim.auths_sent, 0, "no credential, no authentication");
    assert_eq!(sim.leases.usable(sim.now), None);
    sim.lease_answer(0, Some(200), LEASE);
    assert_eq!(sim.leases.usable(sim.now), Some(41));
    assert_eq!(sim.notes, vec![Note::LeaseGranted]);
}

#[test]
fn with_auth_no_lease_is_asked_before_the_first_token_and_one_is_asked_as_it_arrives() {
    let mut sim = Sim::new(Some("root:pw"));
    sim.tick();
    assert_eq!((sim.auths_sent, sim.grants.len()), (1, 0));
    sim.advance(1_000);
    assert_eq!((sim.auths_sent, sim.grants.len()), (1, 0), "waiting for the token");
    sim.auth_answer(Some(200), TOKEN);
    assert_eq!(sim.token.as_deref(), Some("aCYxrMFTHEFthxCm.12"));
    assert_eq!(sim.grants.len(), 1, "the grant goes with the token, not a tick later");
    assert_eq!(sim.notes, vec![Note::Authenticated]);
}

#[test]
fn a_refused_authentication_is_noted_and_asked_again_after_its_backoff() {
    let mut sim = Sim::new(Some("root:bad"));
    sim.tick();
    sim.auth_answer(Some(400), br#"{"error":"etcdserver: authentication failed","code":3}"#);
    assert!(matches!(&sim.notes[0], Note::AuthFailed { said, .. } if said.contains("authentication failed")));
    assert!(sim.token.is_none());
    sim.tick();
    assert_eq!(sim.auths_sent, 1, "not at once");
    sim.advance(10_000);
    assert_eq!(sim.auths_sent, 2);
}

#[test]
fn a_token_is_refreshed_every_refresh_period() {
    let mut sim = Sim::new(Some("root:pw"));
    sim.tick();
    sim.auth_answer(Some(200), TOKEN);
    sim.advance(REFRESH_MS - TICK_MS);
    assert_eq!(sim.auths_sent, 1);
    sim.advance(TICK_MS);
    assert_eq!(sim.auths_sent, 2);
}

// Property tests: native only (proptest is not built for wasm32).
#[cfg(not(target_arch = "wasm32"))]
mod props {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Step {
        /// The in-flight authentication is answered (0 token, 1 refused, 2 lost).
        Auth(u8),
        /// The `pick`-th grant in flight is answered (0 granted, 1 refused, 2 lost).
        Lease {
            pick: usize,
            what: u8,
        },
        RefuseNextSend,
        Advance(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => (0u8..3).prop_map(Step::Auth),
            3 => (any::<usize>(), 0u8..3).prop_map(|(pick, what)| Step::Lease { pick, what }),
            1 => Just(Step::RefuseNextSend),
            4 => (0u64..3_000).prop_map(Step::Advance),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Over random schedules of answers, losses, refusals and clock moves: with a credential, no
        /// grant is ever sent before a token is held; whatever happened before, the keeper keeps
        /// asking, so a lease is usable within a bounded number of ticks of etcd answering well again.
        #[test]
        fn random_schedules_keep_the_keeper_rules(with_auth in any::<bool>(), steps in proptest::collection::vec(step(), 1..80)) {
            let mut sim = Sim::new(if with_auth { Some("root:pw") } else { None });
            sim.tick();
            for s in steps {
                match s {
                    Step::Auth(what) => {
                        if sim.auth_in_flight == 0 { continue; }
                        match what {
                            0 => sim.auth_answer(Some(200), TOKEN),
                            1 => sim.auth_answer(Some(400), b"{}"),
                            _ => sim.auth_answer(None, b""),
                        }
                    }
                    Step::Lease { pick, what } => {
                        if sim.grants.is_empty() { continue; }
                        let i = pick % sim.grants.len();
                        match what {
                            0 => sim.lease_answer(i, Some(200), LEASE),
                            1 => sim.lease_answer(i, Some(503), b""),
                            _ => sim.lease_answer(i, None, b""),
                        }
                    }
                    Step::RefuseNextSend => sim.refuse_next_send = true,
                    Step::Advance(ms) => sim.advance(ms),
                }
            }
            if with_auth {
                prop_assert!(sim.grants_sent.iter().all(|(_, token)| *token), "a grant before the first token: {:?}", sim.grants_sent);
            }
            // etcd answers well from now on: within a bounded number of ticks, a usable lease.
            sim.refuse_next_send = false;
            for _ in 0..400 {
                if sim.leases.usable(sim.now).is_some() { break; }
                while sim.auth_in_flight > 0 { sim.auth_answer(Some(200), TOKEN); }
                while !sim.grants.is_empty() { sim.lease_answer(0, Some(200), LEASE); }
                sim.advance(TICK_MS);
            }
            prop_assert!(sim.leases.usable(sim.now).is_some(), "no lease once etcd answers again");
        }
    }
}

/// Issue 40, item 6 on etcd: where a key's tombstone outlives every record, the root keeps a
/// second set of leases for tombstones, of their own TTL, granted and answered apart from the
/// records' (so a record is dropped by etcd about `ttl` after its completion, its tombstone later).
#[test]
fn tombstones_get_leases_of_their_own_ttl_granted_and_answered_apart() {
    let (mut records, mut tombs, mut auth) = (Leases::default(), Leases::default(), Auth::default());
    let mut k = Keeper {
        leases: &mut records,
        tombstone_leases: Some((&mut tombs, 900)),
        auth: &mut auth,
        secret: None,
        lease_ttl_seconds: TTL,
    };
    let grant = |a: Option<Action>| match a {
        Some(Action::GrantLease(req, kind)) => (serde_json::from_slice::<serde_json::Value>(&req.body).unwrap(), kind),
        other => panic!("{other:?}"),
    };
    let (req, kind) = grant(k.grant_if_due(0));
    assert_eq!((req["TTL"].as_str(), kind), (Some(TTL.to_string().as_str()), LeaseKind::Records));
    k.lease_sent(kind, 0);
    let (req, kind) = grant(k.grant_if_due(0));
    assert_eq!((req["TTL"].as_str(), kind), (Some("900"), LeaseKind::Tombstones));
    k.lease_sent(kind, 0);
    assert!(k.grant_if_due(1).is_none(), "one grant of each kind in flight");
    let answer = |id: u64, ttl: u64| format!(r#"{{"header":{{"revision":"1"}},"ID":"{id}","TTL":"{ttl}"}}"#);
    // A tombstones' grant answered with the records' shorter TTL is refused.
    assert!(matches!(
        k.lease_answered(LeaseKind::Tombstones, 0, Some(200), answer(5, TTL).as_bytes(), 2),
        Note::LeaseFailed(_)
    ));
    assert_eq!(k.lease_answered(LeaseKind::Records, 0, Some(200), answer(4, TTL).as_bytes(), 2), Note::LeaseGranted);
    assert_eq!(records.usable(2), Some(4));
    assert_eq!(
        tombs.usable(2),
        None,
        "no tombstone lease yet: a completion writing one is refused, never under a shorter lease"
    );
}

#[test]
fn usable_puts_tombstones_under_their_own_leases_only_where_the_configuration_has_them() {
    let (mut records, mut tombstones) = (Leases::default(), Leases::default());
    assert_eq!(usable(&records, None, 1_000), (None, None));
    records.granted(41, 1_000, 1_010);
    // No leases of their own: the records' lease covers the tombstones.
    assert_eq!(usable(&records, None, 1_020), (Some(41), Some(41)));
    // Leases of their own, none granted yet: nothing can put a tombstone.
    assert_eq!(usable(&records, Some(&tombstones), 1_020), (Some(41), None));
    tombstones.granted(42, 1_000, 1_010);
    assert_eq!(usable(&records, Some(&tombstones), 1_020), (Some(41), Some(42)));
}

#[test]
fn a_refused_token_is_news_once_and_only_with_a_secret() {
    let refusal: &[u8] = br#"{"error":"etcdserver: invalid auth token","code":16}"#;
    let mut auth = Auth::default();
    // No secret, no token: a 401 is not about a token of ours.
    assert_eq!(token_refused(&mut auth, None, Some(401), refusal), None);
    auth.obtained("t".into(), 0);
    assert_eq!(token_refused(&mut auth, Some("u:p"), Some(200), b"{}"), None);
    assert_eq!(token_refused(&mut auth, Some("u:p"), Some(401), refusal), Some(true));
    assert_eq!(token_refused(&mut auth, Some("u:p"), Some(401), refusal), Some(false));
    assert!(auth.wants_authenticate(1, REFRESH_MS));
}
