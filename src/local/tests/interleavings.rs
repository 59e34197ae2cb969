//! Several workers run the real local-tier code on threads; every shared-data call waits for the
//! scheduler, which grants one call at a time in the order a schedule dictates. Exhaustive for two
//! workers up to a schedule depth, random for three or more.

use super::*;
use crate::local::pool::Pool;
use std::sync::{Arc, Condvar, Mutex};

struct State {
    model: Model,
    /// The worker allowed to make its next call.
    turn: Option<usize>,
    /// Workers blocked at a call.
    waiting: Vec<bool>,
    done: Vec<bool>,
    /// Checked after every host call: the first violation, with the step it followed.
    invariant: Option<Invariant>,
    violation: Option<String>,
}

/// A property of shared data that must hold after every single host call.
type Invariant = Box<dyn Fn(&Model) -> Result<(), String> + Send>;

struct Sched {
    state: Mutex<State>,
    cv: Condvar,
}

struct WorkerData {
    id: usize,
    sched: Arc<Sched>,
}

impl WorkerData {
    fn call<T>(&mut self, f: impl FnOnce(&mut Model) -> T) -> T {
        let mut st = self.sched.state.lock().unwrap();
        st.waiting[self.id] = true;
        self.sched.cv.notify_all();
        while st.turn != Some(self.id) {
            st = self.sched.cv.wait(st).unwrap();
        }
        st.turn = None;
        st.waiting[self.id] = false;
        let out = f(&mut st.model);
        if st.violation.is_none() {
            if let Some(Err(e)) = st.invariant.as_ref().map(|inv| inv(&st.model)) {
                st.violation = Some(format!("after a call of worker {}: {e}", self.id));
            }
        }
        self.sched.cv.notify_all();
        out
    }
}

impl SharedData for WorkerData {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        self.call(|m| m.get(key))
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.call(|m| m.set(key, value, cas))
    }
}

type Work<T> = Box<dyn FnOnce(&mut dyn SharedData) -> T + Send>;

/// Runs `workers` from `model`; at each step the next worker is `schedule[step]` (or, past its
/// end or when that worker is done, the lowest-numbered worker still running).
fn run<T: Send + 'static>(model: Model, schedule: &[usize], workers: Vec<Work<T>>) -> (Vec<T>, Model) {
    let (results, model, _) = run_checked(model, schedule, workers, None);
    (results, model)
}

/// `run`, checking `invariant` after every host call; also returns its first violation.
fn run_checked<T: Send + 'static>(
    model: Model,
    schedule: &[usize],
    workers: Vec<Work<T>>,
    invariant: Option<Invariant>,
) -> (Vec<T>, Model, Option<String>) {
    let n = workers.len();
    let sched = Arc::new(Sched {
        state: Mutex::new(State {
            model,
            turn: None,
            waiting: vec![false; n],
            done: vec![false; n],
            invariant,
            violation: None,
        }),
        cv: Condvar::new(),
    });
    let handles: Vec<_> = workers
        .into_iter()
        .enumerate()
        .map(|(id, w)| {
            let s = sched.clone();
            std::thread::spawn(move || {
                let mut sd = WorkerData { id, sched: s.clone() };
                let out = w(&mut sd);
                let mut st = s.state.lock().unwrap();
                st.done[id] = true;
                s.cv.notify_all();
                out
            })
        })
        .collect();
    let mut step = 0;
    loop {
        let mut st = sched.state.lock().unwrap();
        // Wait until every running worker is blocked at a call, and the last grant was consumed.
        while st.turn.is_some() || (0..n).any(|i| !st.done[i] && !st.waiting[i]) {
            st = sched.cv.wait(st).unwrap();
        }
        if st.done.iter().all(|d| *d) {
            break;
        }
        let preferred = schedule.get(step).copied().unwrap_or(0) % n;
        let next = (0..n).map(|k| (preferred + k) % n).find(|i| !st.done[*i]).unwrap();
        st.turn = Some(next);
        sched.cv.notify_all();
        step += 1;
    }
    let results = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let st = Arc::try_unwrap(sched).ok().unwrap().state.into_inner().unwrap();
    (results, st.model, st.violation)
}

/// Every schedule of `depth` binary choices.
fn all_binary_schedules(depth: u32) -> impl Iterator<Item = Vec<usize>> {
    (0..(1u32 << depth)).map(move |bits| (0..depth).map(|i| ((bits >> i) & 1) as usize).collect())
}

/// A small deterministic PRNG for random schedules.
fn schedules(workers: usize, count: usize, len: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut x = seed | 1;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % workers as u64) as usize
                })
                .collect()
        })
        .collect()
}

fn claimers(t: &Table, n: usize, k: StorageKey, f: Option<Fingerprint>, now: u64) -> Vec<Work<Begin>> {
    (0..n)
        .map(|i| {
            let t = t.clone();
            Box::new(move |sd: &mut dyn SharedData| {
                t.begin(sd, k, f, now, &policy(), owner(i as u8 + 1), &creator(&format!("w{i}"))).unwrap()
            }) as Work<Begin>
        })
        .collect()
}

/// Workers that run the filter's path: a look at request headers (nothing claimed), then the
/// claim at the body's end with the fingerprint, on the bucket read at headers.
fn claimers_via_headers(t: &Table, n: usize, k: StorageKey, now: u64) -> Vec<Work<Begin>> {
    (0..n)
        .map(|i| {
            let t = t.clone();
            Box::new(move |sd: &mut dyn SharedData| {
                let (o, c) = (owner(i as u8 + 1), creator(&format!("w{i}")));
                match t.begin(sd, k, None, now, &policy(), o, &c).unwrap() {
                    Begin::NeedFingerprint { seen } => {
                        t.begin_after(sd, k, Some(fp(1)), now + 1, &policy(), o, &c, seen).unwrap()
                    }
                    answered => answered,
                }
            }) as Work<Begin>
        })
        .collect()
}

fn claimed(results: &[Begin]) -> usize {
    results.iter().filter(|b| matches!(b, Begin::Claimed { .. })).count()
}

#[test]
fn exactly_one_of_two_workers_claims_a_free_key_under_every_interleaving() {
    let t = table(64, WhenFull::Reject);
    let base = fresh(&t);
    let mut runs = 0;
    for s in all_binary_schedules(10) {
        let (results, _) = run(base.clone(), &s, claimers(&t, 2, skey(1), Some(fp(1)), NOW));
        // Through the filter's path: each looks at headers, then claims on what it read.
        let (via_headers, model) = run(base.clone(), &s, claimers_via_headers(&t, 2, skey(1), NOW));
        for r in [&results, &via_headers] {
            assert_eq!(claimed(r), 1, "schedule {s:?}: {r:?}");
            assert!(r.iter().any(|b| is_reject(b, &in_flight())), "{r:?}");
        }
        let mut m = model;
        assert_eq!(t.occupied(&mut m), 1, "schedule {s:?}: one entry of the key");
        runs += 1;
    }
    assert_eq!(runs, 1024);
}

/// The headers' look claims nothing: under every interleaving of two workers that only look,
/// the table stays empty, and each hands a bucket read to its body's end.
#[test]
fn looks_at_headers_claim_nothing_under_every_interleaving() {
    let t = table(64, WhenFull::Reject);
    let base = fresh(&t);
    for s in all_binary_schedules(6) {
        let (results, model) = run(base.clone(), &s, claimers(&t, 2, skey(1), None, NOW));
        assert!(results.iter().all(|b| matches!(b, Begin::NeedFingerprint { seen: Some(_) })), "{results:?}");
        let mut m = model;
        assert_eq!(t.occupied(&mut m), 0);
    }
}

#[test]
fn exactly_one_of_four_workers_claims_under_random_interleavings() {
    let t = table(64, WhenFull::Reject);
    let base = fresh(&t);
    for s in schedules(4, 300, 40, 0x5eed) {
        let (results, _) = run(base.clone(), &s, claimers(&t, 4, skey(2), Some(fp(1)), NOW));
        assert_eq!(claimed(&results), 1, "schedule {s:?}: {results:?}");
    }
}

#[test]
fn exactly_one_retry_takes_over_a_stale_never_forwarded_claim_under_every_interleaving() {
    let t = table(64, WhenFull::Reject);
    let mut base = fresh(&t);
    // A claim made at headers (by a module of before claims moved to the body's end) by a request
    // whose VM died before forwarding.
    claim_at_headers(&t, &mut base, skey(3), 99, NOW, &policy());
    let later = NOW + policy().lock_ttl_seconds * 1000;
    for s in all_binary_schedules(10) {
        let (results, model) = run(base.clone(), &s, claimers(&t, 2, skey(3), Some(fp(1)), later));
        assert_eq!(claimed(&results), 1, "schedule {s:?}: {results:?}");
        assert!(results.iter().any(|b| matches!(b, Begin::Claimed { took_over: true, .. })));
        // The loser sees the winner's live claim.
        assert!(results.iter().any(|b| is_reject(b, &in_flight())), "{results:?}");
        let mut m = model;
        assert_eq!(t.occupied(&mut m), 1);
    }
    for s in schedules(3, 200, 40, 7) {
        let (results, _) = run(base.clone(), &s, claimers(&t, 3, skey(3), Some(fp(1)), later));
        assert_eq!(claimed(&results), 1, "schedule {s:?}: {results:?}");
    }
}

#[test]
fn racing_retries_on_a_stale_forwarded_lock_never_execute() {
    let t = table(64, WhenFull::Reject);
    let mut base = fresh(&t);
    claim(&t, &mut base, skey(4), Some(fp(1)), 99, NOW);
    let later = NOW + policy().lock_ttl_seconds * 1000;
    for s in all_binary_schedules(10) {
        let (results, _) = run(base.clone(), &s, claimers(&t, 2, skey(4), Some(fp(1)), later));
        assert_eq!(claimed(&results), 0, "schedule {s:?}: {results:?}");
        assert!(results.iter().all(|b| is_reject(b, &ProblemKind::OutcomeUnknown)), "{results:?}");
    }
}

#[test]
fn a_completion_racing_a_takeover_never_lets_both_succeed() {
    // stale_lock "takeover": the original owner completes late while a retry takes over.
    let t = table(64, WhenFull::Reject);
    let mut p = policy();
    p.stale_lock = crate::config::StaleLock::Takeover;
    let mut base = fresh(&t);
    let a = handle(&t.begin(&mut base, skey(5), Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    let later = NOW + p.lock_ttl_seconds * 1000;
    for s in all_binary_schedules(12) {
        let (t1, t2, p1, p2) = (t.clone(), t.clone(), p.clone(), p.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                format!("{:?}", complete(&t1, sd, &a, fp(1), response("a"), false, &creator("a"), later, &p1).unwrap())
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                match t2.begin(sd, skey(5), Some(fp(1)), later, &p2, owner(2), &creator("b")).unwrap() {
                    Begin::Claimed { .. } => "Claimed".to_string(),
                    Begin::Replay(_) => "Replay".to_string(),
                    other => format!("{other:?}"),
                }
            }),
        ];
        let (r, model) = run(base.clone(), &s, work);
        let ok = matches!((r[0].as_str(), r[1].as_str()), ("Stored", "Replay") | ("LostClaim", "Claimed"));
        assert!(ok, "schedule {s:?}: {r:?}");
        // Whatever happened, the table holds exactly one record for the key, owned by the winner.
        let mut m = model;
        assert_eq!(t.occupied(&mut m), 1);
    }
}

/// Issue 13, item 1: a release frees the position with a CAS of the bucket, then clears the
/// record slot. A worker that claims the freed position in between (and completes) must keep its
/// record: the clearing checks the slot's owner.
#[test]
fn a_release_never_clears_the_slot_of_a_worker_that_claimed_the_position_meanwhile() {
    let t = table(8, WhenFull::Reject); // one bucket: both keys share it
    let mut base = fresh(&t);
    let a = handle(&claim(&t, &mut base, skey(20), Some(fp(1)), 1, NOW));
    for s in all_binary_schedules(12) {
        let (t1, t2) = (t.clone(), t.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| format!("{:?}", t1.release(sd, &a, NOW).unwrap())),
            Box::new(move |sd: &mut dyn SharedData| {
                let b = handle(&t2.begin(sd, skey(21), Some(fp(2)), NOW, &policy(), owner(2), &creator("b")).unwrap());
                let done = complete(&t2, sd, &b, fp(2), response("b"), false, &creator("b"), NOW, &policy()).unwrap();
                format!("{done:?}")
            }),
        ];
        let (r, model) = run(base.clone(), &s, work);
        assert_eq!(r, ["true", "Stored"], "schedule {s:?}");
        let mut m = model;
        match claim(&t, &mut m, skey(21), Some(fp(2)), 3, NOW + 1) {
            Begin::Replay(rec) => {
                assert_eq!(rec.state, crate::record::State::Completed(response("b")), "schedule {s:?}")
            }
            other => panic!("schedule {s:?}: the completed record was lost: {other:?}"),
        }
    }
}

/// Issue 13, item 1, the sweep: it frees an expired position with a CAS of the bucket, then clears
/// the slot; a worker that claimed that position in between keeps its completed record.
#[test]
fn a_sweep_never_clears_the_slot_of_a_worker_that_claimed_the_position_meanwhile() {
    let t = table(8, WhenFull::Reject);
    let mut base = fresh(&t);
    let a = handle(&claim(&t, &mut base, skey(22), Some(fp(1)), 1, NOW));
    complete(&t, &mut base, &a, fp(1), response("a"), false, &creator("a"), NOW, &policy()).unwrap();
    let later = NOW + policy().ttl_seconds * 1000;
    for s in all_binary_schedules(12) {
        let (t1, t2) = (t.clone(), t.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                format!("{:?}", t1.sweep(sd, 0, 1, later, &mut Gauges::default()).unwrap())
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                let b =
                    handle(&t2.begin(sd, skey(23), Some(fp(2)), later, &policy(), owner(2), &creator("b")).unwrap());
                let done = complete(&t2, sd, &b, fp(2), response("b"), false, &creator("b"), later, &policy()).unwrap();
                format!("{done:?}")
            }),
        ];
        let (r, model) = run(base.clone(), &s, work);
        assert_eq!(r[1], "Stored", "schedule {s:?}: {r:?}");
        let mut m = model;
        match claim(&t, &mut m, skey(23), Some(fp(2)), 3, later + 1) {
            Begin::Replay(rec) => {
                assert_eq!(rec.state, crate::record::State::Completed(response("b")), "schedule {s:?}")
            }
            other => panic!("schedule {s:?}: the completed record was lost: {other:?}"),
        }
    }
}

/// Issue 14: the capacity bound is a count reserved before the claim's single bucket CAS. Two
/// workers claiming different keys (in different buckets) for the last free unit: exactly one
/// claims, under every interleaving, and the count always equals the entries held.
#[test]
fn two_claims_for_the_last_free_record_never_exceed_max_entries_under_every_interleaving() {
    let t = floor_table(16, WhenFull::EvictOldest, 0);
    let mut base = fresh(&t);
    for n in 0..15u64 {
        claim(&t, &mut base, skey(n), Some(fp(1)), 1, NOW); // in flight: never evicted
    }
    // A table of 16 is one bucket of 16 positions (layout v4): one position left for two keys.
    let (a, b) = (skey(100), skey(101));
    for s in all_binary_schedules(12) {
        let (t1, t2) = (t.clone(), t.clone());
        let work: Vec<Work<Begin>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                t1.begin(sd, a, Some(fp(2)), NOW, &policy(), owner(2), &creator("a")).unwrap()
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                t2.begin(sd, b, Some(fp(3)), NOW, &policy(), owner(3), &creator("b")).unwrap()
            }),
        ];
        let (r, mut m) = run(base.clone(), &s, work);
        assert_eq!(claimed(&r), 1, "schedule {s:?}: {r:?}");
        assert!(r.contains(&Begin::Full), "schedule {s:?}: {r:?}");
        assert_eq!((t.count(&mut m), t.occupied(&mut m)), (16, 16), "schedule {s:?}");
    }
}

/// At capacity, two claims evict at once (within their bucket, layout v4): both claim, each in
/// place of one finished record, and the table stays at capacity.
#[test]
fn racing_evictions_keep_the_table_at_capacity_under_random_interleavings() {
    let t = floor_table(16, WhenFull::EvictOldest, 0);
    let mut base = fresh(&t);
    // All 16 positions of the one bucket hold finished records.
    for (n, k) in keys_in_bucket(&t, 0, 16).into_iter().enumerate() {
        let h = handle(&claim(&t, &mut base, k, Some(fp(1)), 1, NOW + n as u64));
        complete(&t, &mut base, &h, fp(1), response("r"), false, &creator("c"), NOW, &policy()).unwrap();
    }
    let (a, b) = (keys_in_bucket(&t, 0, 20)[19], keys_in_bucket(&t, 0, 20)[18]);
    for s in schedules(2, 400, 40, 14).into_iter().chain(all_binary_schedules(10)) {
        let (t1, t2) = (t.clone(), t.clone());
        let later = NOW + 1_000;
        let work: Vec<Work<Begin>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                t1.begin(sd, a, Some(fp(2)), later, &policy(), owner(2), &creator("a")).unwrap()
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                t2.begin(sd, b, Some(fp(3)), later, &policy(), owner(3), &creator("b")).unwrap()
            }),
        ];
        let (r, mut m) = run(base.clone(), &s, work);
        assert_eq!(claimed(&r), 2, "schedule {s:?}: {r:?}");
        assert_eq!((t.count(&mut m), t.occupied(&mut m)), (16, 16), "schedule {s:?}");
    }
}

/// The model is faithful enough to catch the classic mistake: a claim made by writing a per-key
/// name "if absent" (CAS on an absent key inserts) lets two workers win.
#[test]
fn the_model_catches_a_naive_insert_if_absent_claim() {
    let naive = |id: u8| -> Work<bool> {
        Box::new(move |sd: &mut dyn SharedData| {
            let (v, cas) = sd.get("naive.key").unwrap();
            if v.is_some() {
                return false;
            }
            // The CAS read from an absent key is none: the write cannot be conditional.
            sd.set("naive.key", &[id], cas).is_ok()
        })
    };
    let mut double_wins = 0;
    for s in all_binary_schedules(4) {
        let (r, _) = run(Model::default(), &s, vec![naive(1), naive(2)]);
        if r.iter().all(|w| *w) {
            double_wins += 1;
        }
    }
    assert!(double_wins > 0, "the naive claim must fail under some interleaving");
}

/// Layout v4's body keys: a stale owner's completion reads the bucket, then writes its body key
/// before its CAS. Meanwhile its record is marked outcome-unknown, evicted, and its position
/// reused by another key whose owner completes. Under every interleaving the new key replays its
/// own response or, when the late write replaced its body, answers with its status, never the
/// stale owner's response; and the evicted key is never answered with the new key's.
#[test]
fn a_late_body_of_an_evicted_record_is_never_replayed_for_the_next_owner_of_its_position() {
    let t = table(1, WhenFull::EvictOldest); // one position: every claim reuses it
    let p = policy();
    let mut base = fresh(&t);
    let a = handle(&t.begin(&mut base, skey(30), Some(fp(1)), NOW, &p, owner(1), &creator("a")).unwrap());
    let later = NOW + p.lock_ttl_seconds * 1000 + 1;
    for s in all_binary_schedules(12) {
        let (t1, t2, p1, p2) = (t.clone(), t.clone(), p.clone(), p.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                format!("{:?}", complete(&t1, sd, &a, fp(1), response("a"), false, &creator("a"), later, &p1).unwrap())
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                // A retry of the first key finds its lock stale (outcome-unknown), then a new key
                // takes the only position and completes.
                let first = t2.begin(sd, skey(30), Some(fp(1)), later, &p2, owner(2), &creator("r")).unwrap();
                let b = match t2.begin(sd, skey(31), Some(fp(2)), later, &p2, owner(3), &creator("b")).unwrap() {
                    Begin::Claimed { handle, .. } => handle,
                    other => return format!("{first:?} / {other:?}"),
                };
                let done = complete(&t2, sd, &b, fp(2), response("b"), false, &creator("b"), later, &p2).unwrap();
                // Its retry, while the stale owner's completion may still be under way.
                let retry = t2.begin(sd, skey(31), Some(fp(2)), later + 1, &p2, owner(4), &creator("c")).unwrap();
                format!("{done:?} / {}", replayed(retry))
            }),
        ];
        let (r, model) = run(base.clone(), &s, work);
        let mut m = model;
        let last = t.begin(&mut m, skey(31), Some(fp(2)), later + 1, &p, owner(5), &creator("d")).unwrap();
        for answer in [r[1].rsplit(" / ").next().unwrap_or("").to_string(), replayed(last)] {
            let ok = matches!(answer.as_str(), "b" | "not-stored-201")
                // The stale owner completed before the retry saw its lock: the position is its key's.
                || (r[0] == "Stored" && answer.starts_with("Full"))
                || (r[0] == "Stored" && r[1].contains("Full"));
            assert!(ok, "schedule {s:?}: {r:?}: {answer}");
        }
        if let Ok(Some(peeked)) = t.peek(&mut m, &skey(30), later + 1) {
            if let Some(rec) = peeked.record {
                assert_eq!(rec.state, crate::record::State::Completed(response("a")), "schedule {s:?}: {r:?}");
            }
        }
    }
}

/// What a retry of a completed key was answered: the replayed body, `not-stored-<status>`, or the
/// answer itself.
fn replayed(b: Begin) -> String {
    match b {
        Begin::Replay(rec) => match rec.state {
            crate::record::State::Completed(r) => String::from_utf8_lossy(&r.body).into_owned(),
            other => format!("{other:?}"),
        },
        Begin::Reject { problem: ProblemKind::ResponseNotStored { status, .. }, .. } => format!("not-stored-{status}"),
        other => format!("{other:?}"),
    }
}

/// A table that evicts with no floor, `max_entries` records and `max_bytes` for bodies.
fn bytes_table(max_entries: u64, max_bytes: u64) -> Table {
    Table::new(&LocalConfig { max_entries, max_bytes, when_full: WhenFull::EvictOldest, min_protection_seconds: 0 })
}

/// The bodies (over `min_len` bytes) of `owners` a body key holds: (bucket, position, owner, bytes).
fn large_bodies(m: &Model, owners: &[u8], min_len: usize) -> Vec<(u32, usize, OwnerToken, usize)> {
    let mut out = vec![];
    for (k, (v, _)) in &m.map {
        let Some((rest, j)) = k.rsplit_once('.') else { continue };
        let Some((head, i)) = rest.rsplit_once('.') else { continue };
        if !head.ends_with(".r") || v.len() <= min_len {
            continue;
        }
        let Some(o) = owners.iter().map(|n| owner(*n)).find(|o| v.get(..16) == Some(o.0.as_slice())) else { continue };
        out.push((i.parse().unwrap(), j.parse().unwrap(), o, v.len()));
    }
    out
}

fn pool_of(t: &Table, m: &Model) -> Pool {
    Pool::decode(&m.map.get(&*t.pool_name()).expect("the pool exists").0).expect("the pool decodes")
}

/// After every host call: each body over `min_len` bytes of `owners` (bodies no bucket share can
/// hold) is listed in the pool, the pool stays within its part, and the body keys hold at most
/// `local.max_bytes`.
fn pooled_bodies_are_listed(t: &Table, owners: Vec<u8>, min_len: usize) -> Invariant {
    let t = t.clone();
    Box::new(move |m: &Model| {
        let pool = pool_of(&t, m);
        if pool.used() > t.pool_bytes() {
            return Err(format!("the pool counts {} bytes, over its {}", pool.used(), t.pool_bytes()));
        }
        for (i, j, o, len) in large_bodies(m, &owners, min_len) {
            let listed = pool.reservations.iter().any(|r| r.bucket == i && r.position == j && r.owner == o);
            if !listed {
                return Err(format!("body key {i}.{j} holds {len} bytes of owner {} the pool does not list", o.0[0]));
            }
        }
        let held: usize = m.map.iter().filter(|(k, _)| k.contains(".r.")).map(|(_, (v, _))| v.len()).sum();
        if held as u64 > t.max_bytes {
            return Err(format!("body keys hold {held} bytes, over max_bytes {}", t.max_bytes));
        }
        Ok(())
    })
}

/// Every reservation the pool still lists belongs to the record at its position.
fn no_stale_reservation(t: &Table, m: &mut Model) -> Result<(), String> {
    for r in pool_of(t, m).reservations {
        let (b, _) = t.read_bucket(m, r.bucket).unwrap();
        if !b.positions[r.position].as_ref().is_some_and(|e| e.owner == r.owner) {
            return Err(format!("a reservation of owner {} outlived its record: {r:?}", r.owner.0[0]));
        }
    }
    Ok(())
}

/// Two workers complete a body too large for their bucket's share at once, and the pool has room
/// for one: exactly one keeps its body (on the pool), the other its status; no body is ever held
/// without the pool listing it; each key replays only its own response.
#[test]
fn two_large_bodies_completing_at_once_when_the_pool_has_room_for_one() {
    // 4 buckets of 64: each bucket's share is 3,000 bytes and the pool 4,000, so a body of about
    // 3,400 bytes fits only the pool, and only one at a time.
    let t = bytes_table(128, 16_000);
    assert_eq!((t.buckets(), t.bucket_bytes(), t.pool_bytes()), (4, 3_000, 4_000));
    let mut base = fresh(&t);
    let keys = keys_in_bucket(&t, 0, 2);
    let ha = handle(&claim(&t, &mut base, keys[0], Some(fp(1)), 1, NOW));
    let hb = handle(&claim(&t, &mut base, keys[1], Some(fp(2)), 2, NOW));
    let (ba, bb) = ("a".repeat(3_300), "b".repeat(3_300));
    let mut runs = 0;
    for s in all_binary_schedules(12).chain(schedules(2, 300, 40, 27)) {
        let (t1, t2, ba1, bb1) = (t.clone(), t.clone(), ba.clone(), bb.clone());
        let work: Vec<Work<Completed>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                complete(&t1, sd, &ha, fp(1), response(&ba1), false, &creator("a"), NOW, &policy()).unwrap()
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                complete(&t2, sd, &hb, fp(2), response(&bb1), false, &creator("b"), NOW, &policy()).unwrap()
            }),
        ];
        let inv = pooled_bodies_are_listed(&t, vec![1, 2], 3_000);
        let (r, mut m, violation) = run_checked(base.clone(), &s, work, Some(inv));
        assert_eq!(violation, None, "schedule {s:?}: {r:?}");
        let stored: Vec<bool> = r.iter().map(|c| *c == Completed::Stored).collect();
        assert_eq!(stored.iter().filter(|s| **s).count(), 1, "schedule {s:?}: {r:?}");
        assert!(r.iter().all(|c| matches!(c, Completed::Stored | Completed::StoredWithoutBody)), "{r:?}");
        for (n, (k, body)) in [(keys[0], &ba), (keys[1], &bb)].into_iter().enumerate() {
            let answer = replayed(claim(&t, &mut m, k, Some(fp(n as u8 + 1)), 9, NOW + 1));
            if stored[n] {
                assert_eq!(&answer, body, "schedule {s:?}: {r:?}");
            } else {
                assert!(answer.starts_with("CompletedTooLarge { status: 201"), "schedule {s:?}: {r:?}: {answer}");
            }
        }
        let full = large_bodies(&m, &[1, 2], 3_000);
        assert_eq!(full.len(), 1, "schedule {s:?}");
        assert_eq!(t.pool_usage(&mut m), full[0].3 as u64, "the pool counts exactly the body it holds");
        let mut g = Gauges::default();
        t.sweep(&mut m, 0, t.buckets(), NOW + 1, &mut g).unwrap();
        assert_eq!(t.pool_usage(&mut m), full[0].3 as u64, "a live record keeps its reservation");
        runs += 1;
    }
    assert_eq!(runs, 4096 + 300);
}

/// The table of `a_completion_racing_the_eviction_of_its_own_position...`: one bucket of two
/// positions whose share is mostly held, so a body of about 3,400 bytes goes to the pool. Returns
/// the table, the state, the stale owner's handle and the instant its lock is stale.
fn eviction_race_setup() -> (Table, Model, Handle, u64) {
    // One bucket of 2 positions: share 12,000 bytes, pool 4,000.
    let t = bytes_table(2, 16_000);
    assert_eq!((t.buckets(), t.width(), t.bucket_bytes(), t.pool_bytes()), (1, 2, 12_000, 4_000));
    let p = policy();
    let mut base = fresh(&t);
    // Y's 10,000-byte body fills most of the share; X's claim evicts Y and keeps its bytes
    // counted (X is in flight at `later`, never evicted); A holds the other position.
    let y = handle(&claim(&t, &mut base, skey(40), Some(fp(1)), 40, NOW));
    complete(&t, &mut base, &y, fp(1), response(&"y".repeat(10_000)), false, &creator("y"), NOW, &p).unwrap();
    let a = handle(&claim(&t, &mut base, skey(41), Some(fp(1)), 1, NOW + 1));
    assert!(matches!(claim(&t, &mut base, skey(42), Some(fp(1)), 42, NOW + 5), Begin::Claimed { evicted: true, .. }));
    assert!(t.bucket_bytes() - t.read_bucket(&mut base, 0).unwrap().0.bytes() < 3_000);
    (t, base, a, NOW + 1 + p.lock_ttl_seconds * 1000)
}

/// The work racing the stale owner: a retry of its key marks it outcome-unknown, a new key takes
/// its position (eviction) and completes a large body, the sweep passes (before that completion
/// when `sweep_first`), and the new key's retry (`d-body` when it replays its own body).
fn evict_complete_sweep(t: &Table, later: u64, sweep_first: bool) -> Work<String> {
    let t = t.clone();
    Box::new(move |sd: &mut dyn SharedData| {
        let p = policy();
        let first = t.begin(sd, skey(41), Some(fp(1)), later, &p, owner(2), &creator("r")).unwrap();
        let d = match t.begin(sd, skey(43), Some(fp(2)), later, &p, owner(3), &creator("d")).unwrap() {
            Begin::Claimed { handle, .. } => handle,
            other => return format!("{first:?} / {other:?}"),
        };
        let big = "d".repeat(3_300);
        if sweep_first {
            t.sweep(sd, 0, 1, later, &mut Gauges::default()).unwrap();
        }
        let done = complete(&t, sd, &d, fp(2), response(&big), false, &creator("d"), later, &p).unwrap();
        if !sweep_first {
            t.sweep(sd, 0, 1, later, &mut Gauges::default()).unwrap();
        }
        let retry = t.begin(sd, skey(43), Some(fp(2)), later + 1, &p, owner(4), &creator("e")).unwrap();
        let answer = replayed(retry);
        format!("{done:?} / {}", if answer == big { "d-body" } else { answer.as_str() })
    })
}

/// A late completion of a large body races the eviction of its own position (its lock went
/// stale: a retry marked it outcome-unknown, a new key took the position) and the sweep: the pool
/// lists every pooled body at every step, the new key replays only its own response, and after
/// the next sweep no reservation outlives its record.
/// What every schedule of a large completion racing the eviction of its own position must end
/// in: a new key answered with its own body, or status-only, or `not-stored-201` (the stale
/// owner's late write replaced the new key's body: the one interleaving that loses a body, never
/// mixes one: docs/local-tier.md), or a full bucket; then no stale reservation after a sweep, and
/// once everything expired an empty pool and no large body left.
fn eviction_race_settles(t: &Table, m: &mut Model, r: &[String], s: &[usize], later: u64) {
    let answer = r[1].rsplit(" / ").next().unwrap_or("");
    let ok = answer == "d-body"
        || answer.starts_with("CompletedTooLarge { status: 201")
        || answer == "not-stored-201"
        || (r[0].contains("Stored") && r[1].contains("Full"));
    assert!(ok, "schedule {s:?}: {r:?}");
    t.sweep(m, 0, 1, later + 2, &mut Gauges::default()).unwrap();
    assert_eq!(no_stale_reservation(t, m), Ok(()), "schedule {s:?}: {r:?}");
    let far = later + 10 * policy().ttl_seconds * 1000;
    t.sweep(m, 0, 1, far, &mut Gauges::default()).unwrap();
    t.sweep(m, 0, 1, far, &mut Gauges::default()).unwrap();
    assert_eq!(t.pool_usage(m), 0, "schedule {s:?}: {r:?}");
    assert_eq!(large_bodies(m, &[1, 3], 3_000), vec![], "schedule {s:?}: {r:?}");
}

#[test]
fn a_completion_racing_the_eviction_of_its_own_position_never_leaks_the_pool() {
    let (t, base, a, later) = eviction_race_setup();
    for s in all_binary_schedules(12).chain(schedules(2, 300, 60, 41)) {
        let t1 = t.clone();
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                let big = "a".repeat(3_300);
                format!("{:?}", complete(&t1, sd, &a, fp(1), response(&big), false, &creator("a"), later, &policy()))
            }),
            evict_complete_sweep(&t, later, false),
        ];
        let inv = pooled_bodies_are_listed(&t, vec![1, 3], 3_000);
        let (r, mut m, violation) = run_checked(base.clone(), &s, work, Some(inv));
        assert_eq!(violation, None, "schedule {s:?}: {r:?}");
        eviction_race_settles(&t, &mut m, &r, &s, later);
    }
}

/// Shared data that refuses every call after `left` of them: a worker whose VM died between two
/// writes.
struct Dying<'a> {
    sd: &'a mut dyn SharedData,
    left: usize,
}

impl SharedData for Dying<'_> {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        if self.left == 0 {
            return Err(HostError);
        }
        self.left -= 1;
        self.sd.get(key)
    }
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        if self.left == 0 {
            return Err(SetError::Host);
        }
        self.left -= 1;
        self.sd.set(key, value, cas)
    }
}

/// A stale owner's late write of a large body, and an owner that dies between its writes: the
/// sweep reclaims the reservation of a record that is gone, and never lets a write it could not
/// see land unlisted (it changes the body key's CAS before dropping a reservation whose write may
/// still come).
#[test]
fn a_stale_or_dying_owner_of_a_pooled_body_never_leaves_bytes_the_pool_does_not_count() {
    let (t, base, a, later) = eviction_race_setup();
    let mut died = 0;
    for (n, s) in schedules(2, 1_600, 60, 53).into_iter().enumerate() {
        // The stale owner dies after 1 to 7 calls, or never.
        let calls = if n / 2 % 8 == 7 { usize::MAX } else { n / 2 % 8 + 1 };
        let t1 = t.clone();
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                let big = "a".repeat(3_300);
                let mut dying = Dying { sd, left: calls };
                let r = complete(&t1, &mut dying, &a, fp(1), response(&big), false, &creator("a"), later, &policy());
                format!("{r:?}")
            }),
            evict_complete_sweep(&t, later, n % 2 == 0),
        ];
        let inv = pooled_bodies_are_listed(&t, vec![1, 3], 3_000);
        let (r, mut m, violation) = run_checked(base.clone(), &s, work, Some(inv));
        assert_eq!(violation, None, "schedule {s:?}, dies after {calls}: {r:?}");
        died += usize::from(r[0].contains("Host"));
        t.sweep(&mut m, 0, 1, later + 2, &mut Gauges::default()).unwrap();
        assert_eq!(no_stale_reservation(&t, &mut m), Ok(()), "schedule {s:?}, dies after {calls}: {r:?}");
        assert!(
            pool_of(&t, &m).reservations.iter().all(|r| r.owner != owner(1)),
            "the stale owner's reservation is reclaimed: schedule {s:?}, dies after {calls}: {r:?}"
        );
    }
    assert!(died > 100, "{died} runs where the owner died mid-way");
}

#[test]
fn scratch_review_two_sweeps_and_a_stale_pooled_owner() {
    let (t, base, a, later) = eviction_race_setup();
    for (n, s) in schedules(3, 1_500, 90, 77).into_iter().enumerate() {
        let (t1, t3) = (t.clone(), t.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                let big = "a".repeat(3_300);
                format!("{:?}", complete(&t1, sd, &a, fp(1), response(&big), false, &creator("a"), later, &policy()))
            }),
            evict_complete_sweep(&t, later, n % 2 == 0),
            Box::new(move |sd: &mut dyn SharedData| {
                for _ in 0..3 {
                    t3.sweep(sd, 0, 1, later, &mut Gauges::default()).unwrap();
                }
                String::new()
            }),
        ];
        let inv = pooled_bodies_are_listed(&t, vec![1, 3], 3_000);
        let (r, mut m, violation) = run_checked(base.clone(), &s, work, Some(inv));
        assert_eq!(violation, None, "schedule {s:?}: {r:?}");
        eviction_race_settles(&t, &mut m, &r, &s, later);
    }
}

#[test]
fn scratch_review_expired_pooled_record_freed_while_its_position_is_reclaimed() {
    let t = bytes_table(128, 16_000);
    assert_eq!((t.buckets(), t.bucket_bytes(), t.pool_bytes()), (4, 3_000, 4_000));
    let mut base = fresh(&t);
    let keys = keys_in_bucket(&t, 0, 2);
    let a = handle(&claim(&t, &mut base, keys[0], Some(fp(1)), 1, NOW));
    let big = "a".repeat(3_300);
    let c = complete(&t, &mut base, &a, fp(1), response(&big), false, &creator("a"), NOW, &policy()).unwrap();
    assert_eq!(c, Completed::Stored);
    assert!(t.pool_usage(&mut base) > 3_300);
    let far = NOW + 10 * policy().ttl_seconds * 1000;
    let dkey = keys[1];
    for (n, s) in schedules(3, 1_500, 90, 91).into_iter().enumerate() {
        let (t1, t2, t3) = (t.clone(), t.clone(), t.clone());
        let work: Vec<Work<String>> = vec![
            Box::new(move |sd: &mut dyn SharedData| {
                t1.sweep(sd, 0, 4, far, &mut Gauges::default()).unwrap();
                String::new()
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                let p = policy();
                let d = match t2.begin(sd, dkey, Some(fp(2)), far, &p, owner(3), &creator("d")).unwrap() {
                    Begin::Claimed { handle, .. } => handle,
                    other => return format!("{other:?}"),
                };
                let big = "d".repeat(3_300 + n % 3);
                let done = complete(&t2, sd, &d, fp(2), response(&big), false, &creator("d"), far, &p).unwrap();
                let retry = t2.begin(sd, dkey, Some(fp(2)), far + 1, &p, owner(4), &creator("e")).unwrap();
                let answer = replayed(retry);
                format!("{done:?} / {}", if answer == big { "d-body" } else { answer.as_str() })
            }),
            Box::new(move |sd: &mut dyn SharedData| {
                for _ in 0..2 {
                    t3.sweep(sd, 0, 1, far, &mut Gauges::default()).unwrap();
                }
                String::new()
            }),
        ];
        let inv = pooled_bodies_are_listed(&t, vec![1, 3], 3_000);
        let (r, mut m, violation) = run_checked(base.clone(), &s, work, Some(inv));
        assert_eq!(violation, None, "schedule {s:?}: {r:?}");
        let ok = r[1] == "Stored / d-body" || r[1].starts_with("StoredWithoutBody / CompletedTooLarge { status: 201");
        assert!(ok, "schedule {s:?}: {r:?}");
        t.sweep(&mut m, 0, 4, far + 2, &mut Gauges::default()).unwrap();
        assert_eq!(no_stale_reservation(&t, &mut m), Ok(()), "schedule {s:?}: {r:?}");
        assert!(pool_of(&t, &m).reservations.iter().all(|r| r.owner != owner(1)), "schedule {s:?}: {r:?}");
    }
}

/// Issue 40, item 6: the sweep shrinking a key's tombstone (`Table::shrink`) races a lookup of
/// that key by another worker, a second sweep, and a new key that takes the oldest tombstone's
/// position in the full bucket and completes there. Under every schedule of two of them: the
/// lookup is answered the key's tombstone (never a response, never a claim), the new key's
/// response is replayed whole (a shrink never overwrites a later owner's body), the key is held
/// until its ttl + tombstone, and the table never counts fewer bytes than its body keys hold.
#[test]
fn a_tombstone_shrinking_races_lookups_sweeps_and_a_reclaim_of_its_position() {
    let t = table(2, WhenFull::Reject);
    let p = tombstone_policy();
    let keys = keys_in_bucket(&t, 0, 3);
    let mut base = fresh(&t);
    for (n, k) in keys[..2].iter().enumerate() {
        let o = 1 + n as u8;
        let h = handle(&t.begin(&mut base, *k, Some(fp(o)), NOW + n as u64, &p, owner(o), &creator("c")).unwrap());
        complete_kept(&t, &mut base, &h, fp(o), 1024, NOW + n as u64);
    }
    let at = NOW + 10_000 + 1;
    let sweep = |t: Table| -> Work<String> {
        Box::new(move |sd: &mut dyn SharedData| format!("swept {:?}", t.sweep(sd, 0, 1, at, &mut Gauges::default())))
    };
    let lookup = |t: Table, k: StorageKey| -> Work<String> {
        Box::new(move |sd: &mut dyn SharedData| {
            match t.begin(sd, k, Some(fp(2)), at, &tombstone_policy(), owner(8), &creator("l")).unwrap() {
                Begin::Replay(r) if r.is_tombstone_for(0, at) && r.is_tombstone(at) => "tombstone".into(),
                other => format!("{other:?}"),
            }
        })
    };
    let reclaim = |t: Table, k: StorageKey| -> Work<String> {
        Box::new(move |sd: &mut dyn SharedData| {
            let p = tombstone_policy();
            let b = t.begin(sd, k, Some(fp(9)), at, &p, owner(9), &creator("n")).unwrap();
            let h = handle(&b);
            let r = Record::completed(fp(9), response("new"), false, creator("n"), at, p.ttl_seconds);
            format!("{:?}", t.complete(sd, &h, r, at).unwrap())
        })
    };
    for (name, a, b) in
        [("sweep/lookup", 0, 1), ("sweep/sweep", 0, 0), ("sweep/reclaim", 0, 2), ("lookup/reclaim", 1, 2)]
    {
        for s in all_binary_schedules(10) {
            let make = |w: usize| match w {
                0 => sweep(t.clone()),
                1 => lookup(t.clone(), keys[1]),
                _ => reclaim(t.clone(), keys[2]),
            };
            let (r, mut m) = run(base.clone(), &s, vec![make(a), make(b)]);
            for (w, out) in [(a, &r[0]), (b, &r[1])] {
                match w {
                    0 => assert_eq!(out, "swept Ok(0)", "{name} {s:?}"),
                    1 => assert_eq!(out, "tombstone", "{name} {s:?}: the lookup"),
                    _ => assert_eq!(out, "Stored", "{name} {s:?}: the new key"),
                }
            }
            // The second key (the newer tombstone) is held: never claimed again before its end.
            let again = t.begin(&mut m, keys[1], Some(fp(2)), at + 1, &p, owner(7), &creator("r")).unwrap();
            assert!(matches!(&again, Begin::Replay(r) if r.is_tombstone(at + 1)), "{name} {s:?}: {again:?}");
            if a == 2 || b == 2 {
                match t.begin(&mut m, keys[2], Some(fp(9)), at + 1, &p, owner(7), &creator("r")).unwrap() {
                    Begin::Replay(rec) => {
                        assert_eq!(rec.state, crate::record::State::Completed(response("new")), "{name} {s:?}")
                    }
                    other => panic!("{name} {s:?}: the new key's record was lost: {other:?}"),
                }
            }
            let held: u64 = m.map.iter().filter(|(k, _)| k.contains(".r.")).map(|(_, (v, _))| v.len() as u64).sum();
            assert!(t.usage(&mut m) >= held, "{name} {s:?}: counts {} of {held}", t.usage(&mut m));
            // A sweep afterwards leaves every remaining tombstone small, counted exactly.
            t.sweep(&mut m, 0, 1, at + 2, &mut Gauges::default()).unwrap();
            let tombs = m.map.iter().filter(|(k, (v, _))| k.contains(".r.") && v.len() == TOMBSTONE_BODY_BYTES).count();
            assert!(tombs >= 1, "{name} {s:?}");
            // Past ttl + tombstone the second key is free.
            let end = NOW + 1 + 110_000;
            assert!(matches!(
                t.begin(&mut m, keys[1], Some(fp(2)), end, &p, owner(6), &creator("f")).unwrap(),
                Begin::Claimed { .. }
            ));
        }
    }
}
