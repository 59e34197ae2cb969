//! The etcd fault cases: the leader SIGKILLed with duplicates in flight, a member hung by SIGSTOP,
//! quorum lost. `make test-faults` runs them (every module named `faults`), `make test-native`
//! skips them.

use super::*;

#[test]
fn etcd_fault_leader_sigkill_with_duplicates_in_flight_executes_nothing_twice_and_loses_no_acknowledged_key() {
    let mut etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    // Acknowledged before the kill: 20 keys executed and their completions landed in etcd.
    let done: Vec<String> = (0..20).map(|i| format!("k-acked-{i}")).collect();
    for k in &done {
        assert_eq!(post(&p.a, k, r#"{"amount":9}"#, &[]).status, 201);
    }
    wait_writes(&p.a, 20);
    // In flight at the kill: 10 keys running on a, each with a duplicate on b.
    let flying: Vec<String> = (0..10).map(|i| format!("k-flying-{i}")).collect();
    let mut threads = vec![];
    for k in &flying {
        threads.push(in_flight(&p.a, k.clone()));
    }
    std::thread::sleep(Duration::from_millis(300));
    for k in &flying {
        threads.push(in_flight(&p.b, k.clone()));
    }
    let leader = etcd.leader().expect("a leader");
    let killed_at = Instant::now();
    etcd.kill(leader);
    let first: Vec<u16> = threads.into_iter().map(|t| t.join().expect("thread")).collect();
    etcd.wait_leader();
    // Retries of every key on b (which never served the acknowledged ones: they come from etcd).
    let (mut replayed, mut refused) = (0, 0);
    let mut served_again_after = None;
    for k in &done {
        let (r, n) = post_until_answered(&p.b, k, r#"{"amount":9}"#);
        served_again_after.get_or_insert_with(|| killed_at.elapsed());
        refused += n;
        assert_eq!((r.status, r.header("idempotent-replayed")), (201, Some("true")), "{k}: {}", r.body_text());
        replayed += 1;
    }
    let mut retried = vec![];
    for round in 0..2 {
        for k in &flying {
            let e = if round == 0 { &p.b } else { &p.a };
            let (r, n) = post_until_answered(e, k, r#"{"amount":9}"#);
            refused += n;
            retried.push(r.status);
        }
    }
    let by_key = p.up.executions_by_key();
    let twice: Vec<_> = by_key.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!(
        "leader kill: executions {} (acknowledged 20 + in flight {}), second executions {}, acknowledged replayed {replayed}/20, first answers {first:?}, retries {retried:?} (after {refused} store-unavailable answers; the first retry served {:?} after the kill)",
        p.up.executions(),
        flying.iter().filter(|k| by_key.get(*k).copied().unwrap_or(0) > 0).count(),
        twice.len(),
        served_again_after.unwrap_or_default()
    );
    support::fault_report(
        "table.md",
        &[
            "etcd leader SIGKILL with 10 keys in flight (duplicates on the other proxy)",
            &p.up.executions().to_string(),
            &format!("second executions {}; 20/20 acknowledged keys replayed", twice.len()),
        ],
    );
    assert!(twice.is_empty(), "executed twice: {twice:?}");
    assert_eq!(replayed, 20);
}

#[test]
fn etcd_fault_a_member_hung_by_sigstop_under_traffic_executes_nothing_twice() {
    let mut etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let leader = etcd.leader().expect("leader");
    let mut statuses = vec![];
    for i in 0..30 {
        if i == 10 {
            etcd.stop(leader);
        }
        let k = format!("k-stop-{i}");
        statuses.push(post(if i % 2 == 0 { &p.a } else { &p.b }, &k, r#"{"amount":1}"#, &[]).status);
        statuses.push(post(if i % 2 == 0 { &p.b } else { &p.a }, &k, r#"{"amount":1}"#, &[]).status);
    }
    etcd.resume(leader);
    etcd.wait_leader();
    // Every key again on both proxies, once the hung member is back.
    for i in 0..30 {
        let k = format!("k-stop-{i}");
        statuses.push(post(&p.a, &k, r#"{"amount":1}"#, &[]).status);
        statuses.push(post(&p.b, &k, r#"{"amount":1}"#, &[]).status);
    }
    let by_key = p.up.executions_by_key();
    let twice: Vec<_> = by_key.iter().filter(|(_, n)| **n > 1).collect();
    let unavailable = statuses.iter().filter(|s| **s == 503).count();
    support::fault_report(
        "table.md",
        &[
            "etcd leader SIGSTOP (hung) under traffic, 30 keys x 4 requests",
            &p.up.executions().to_string(),
            &format!("second executions {}; 503 answers {unavailable}", twice.len()),
        ],
    );
    assert!(twice.is_empty(), "executed twice: {twice:?}; statuses {statuses:?}");
    // After the member is back, a new key is protected as before.
    assert_eq!(post(&p.a, "k-stop-after", "{}", &[]).status, 201);
    // a's store writes already count this test's earlier writes: the completion is awaited on b.
    let replay = replayed_on(&p.b, "k-stop-after", "{}");
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")), "{}", replay.body_text());
    assert_eq!(p.up.executions_with_key("k-stop-after"), 1);
}

#[test]
fn etcd_fault_quorum_lost_answers_503_forwards_nothing_and_protection_resumes() {
    let mut etcd = EtcdCluster::start();
    let p = Pair::new(&etcd);
    let leader = etcd.leader().expect("leader");
    let other = (leader + 1) % 3;
    etcd.kill(leader);
    etcd.kill(other);
    let started = Instant::now();
    for i in 0..6 {
        let r = post(if i % 2 == 0 { &p.a } else { &p.b }, &format!("k-noquorum-{i}"), "{}", &[]);
        assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{}", r.body_text());
    }
    assert_eq!(p.up.executions(), 0, "nothing forwarded without quorum");
    eprintln!("quorum lost: 6 requests answered 503 in {:?}", started.elapsed());
    etcd.restart(leader);
    etcd.restart(other);
    etcd.wait_leader();
    // Protection resumes: a new key executes once and replays on the other proxy. (The first
    // attempts may have landed late, once quorum returned: never forwarded, so their keys may read
    // in flight or outcome-unknown, never execute twice.)
    let mut status = 0;
    for _ in 0..40 {
        status = post(&p.a, "k-quorum-back", r#"{"amount":1}"#, &[]).status;
        if status != 503 {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(status, 201);
    // a's store writes already count the releases of the claims refused while quorum was lost
    // (they land once it returns): the completion is awaited on b itself.
    let replay = replayed_on(&p.b, "k-quorum-back", r#"{"amount":1}"#);
    assert_eq!((replay.status, replay.header("idempotent-replayed")), (201, Some("true")), "{}", replay.body_text());
    assert_eq!(p.up.executions_with_key("k-quorum-back"), 1);
    for i in 0..6 {
        let _ = post(&p.a, &format!("k-noquorum-{i}"), "{}", &[]);
    }
    let by_key = p.up.executions_by_key();
    assert!(by_key.values().all(|n| *n <= 1), "{by_key:?}");
    support::fault_report(
        "table.md",
        &[
            "etcd quorum lost (2 of 3 SIGKILLed), then back",
            &p.up.executions().to_string(),
            "503 while lost; protected after",
        ],
    );
}
