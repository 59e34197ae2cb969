//! The short forms of `redis_ha` (`make test`, through `make test-faults`): each fault under load
//! through two proxies, executions counted per key, recovery with nobody repointing anything. The
//! full forms are `make test-redis-ha`.

use super::{primary_back_alone, run, Fault};

#[test]
fn redis_ha_primary_killed_under_load_comes_back_without_an_operator() {
    let m = run(Fault::Primary, 400, "short-primary");
    // The fault was met: some requests were refused while no primary answered (a run whose load
    // ended before the kill measures nothing), and the keys executed before it were answered 201.
    // `run` asserts the rest: served again with nobody repointing anything (bounded attempts),
    // every retry answered as documented, and no key executed twice unless the new primary
    // lacked its claim.
    assert!(m.refused > 0, "no request was refused: the primary's death was never met");
    assert!(m.answers.get("201").copied().unwrap_or(0) >= m.keys / 8, "{:?}", m.answers);
}

/// A former primary that comes back alone after the whole store went down must not acknowledge a
/// claim no replica has: the shipped `min-replicas-to-write 1` makes it refuse (503, nothing
/// forwarded) until a replica synced from it. Without it (the configuration before), the 20 keys
/// sent while it ran alone executed, it died again, the promoted replica lacked their claims and
/// all 20 executed a second time.
#[test]
fn redis_ha_former_primary_back_alone_acknowledges_no_claim_a_promotion_can_lose() {
    let m = primary_back_alone(20, "short-alone");
    assert!(m.twice.is_empty(), "executed twice: {:?} (answers while alone: {:?})", m.twice, m.alone);
    assert_eq!(m.alone.get("201"), None, "claims acknowledged with no replica: {:?}", m.alone);
}
