//! The short form of `redis_ha` (`make test`, through `make test-faults`): the Redis primary
//! SIGKILLed under load through two proxies; Sentinel promotes a replica, HAProxy routes to it,
//! webdis reconnects, nobody repoints anything. The full forms are `make test-redis-ha`.

use super::{run, Fault};

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
