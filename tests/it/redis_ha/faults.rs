//! The short form of `redis_ha` (`make test`, through `make test-faults`): the Redis primary
//! SIGKILLed under load through two proxies; Sentinel promotes a replica, HAProxy routes to it,
//! webdis reconnects, nobody repoints anything. The full forms are `make test-redis-ha`.

use super::{run, Fault};

#[test]
fn redis_ha_primary_killed_under_load_comes_back_without_an_operator() {
    let m = run(Fault::Primary, 400, "short-primary");
    // The fault was met: some requests were refused while no primary answered, and the load
    // outlived the failover (requests sent after the fault executed), so what was measured is a
    // failover, not a run that ended before it.
    assert!(m.refused > 0, "no request was refused: the primary's death was never met");
    assert!(m.answers.get("201").copied().unwrap_or(0) > m.keys / 8, "{:?}", m.answers);
}
