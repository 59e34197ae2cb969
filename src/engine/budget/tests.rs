//! The buffer budget's arithmetic: what a request counts, what it yields and gives back.

use super::*;
use crate::config::Config;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn policy(max_body: u64) -> std::sync::Arc<Policy> {
    let json = format!(r#"{{"scope": {{"headers": ["authorization"]}}, "max_request_body_bytes": {max_body}}}"#);
    match Config::parse(json.as_bytes()) {
        Ok(c) => c.shared_policy(0).unwrap_or_default(),
        Err(e) => panic!("configuration refused: {e:?}"),
    }
}

const fn budget(buffered: u64, max: u64) -> Budget {
    Budget { buffered, max }
}

#[test]
fn chunks_count_only_their_new_bytes_and_a_release_gives_all_back() {
    let p = policy(10_000);
    let mut h = Held::default();
    // Another request counts 100 bytes; this body grows to 600, then 1,000 bytes.
    let c = h.chunk(600, budget(100, 4_096), &p);
    assert_eq!(c, Counted { buffered: 700, seen_dropped: false, refused: None });
    let c = h.chunk(1_000, budget(c.buffered, 4_096), &p);
    assert_eq!(c.buffered, 1_100);
    assert_eq!(h.bytes(), 1_000);
    // Its end gives back its own bytes, never another request's.
    assert_eq!(h.release(1_100), 100);
    assert_eq!(h, Held::default());
    assert_eq!(h.release(100), 100);
}

#[test]
fn the_bucket_read_is_kept_only_within_the_budget() {
    let mut h = Held::default();
    assert_eq!(h.keep_seen(500, budget(3_700, 4_096)), None);
    assert_eq!(h.bytes(), 0);
    assert_eq!(h.keep_seen(396, budget(3_700, 4_096)), Some(4_096));
    assert_eq!(h.bytes(), 396);
}

/// The read kept at headers yields its bytes to its own request's body: a body that fits the
/// budget alone is never refused for it (the review's finding, `faults::a_body_that_fits_...`).
#[test]
fn the_bucket_read_yields_to_its_own_body_before_the_body_is_refused() {
    let p = policy(1_024);
    let mut h = Held::default();
    assert_eq!(h.keep_seen(300, budget(0, 1_024)), Some(300));
    // 800 bytes fit beside the read: it stays.
    let c = h.chunk(700, budget(300, 1_024), &p);
    assert_eq!(c, Counted { buffered: 1_000, seen_dropped: false, refused: None });
    // The whole body (1,024) does not: the read is dropped, the body counted alone.
    let c = h.chunk(1_024, budget(1_000, 1_024), &p);
    assert_eq!(c, Counted { buffered: 1_024, seen_dropped: true, refused: None });
    assert_eq!(h.bytes(), 1_024);
}

#[test]
fn a_refused_body_gives_back_everything_its_request_counted() {
    let p = policy(10_000);
    let mut h = Held::default();
    assert_eq!(h.keep_seen(200, budget(0, 4_096)), Some(200));
    assert_eq!(h.chunk(1_000, budget(200, 4_096), &p).buffered, 1_200);
    // Another request took 3,000 bytes meanwhile: 2,000 more does not fit even without the read.
    let c = h.chunk(3_000, budget(4_200, 4_096), &p);
    assert!(matches!(c.refused, Some(ProblemKind::BufferBudgetExceeded { .. })), "{c:?}");
    assert!(c.seen_dropped);
    assert_eq!(c.buffered, 3_000);
    assert_eq!(h, Held::default());
    // Over the route's own limit: 413, whatever the budget.
    let small = policy(1_000);
    let mut h = Held::default();
    let c = h.chunk(1_001, budget(0, 1 << 30), &small);
    assert_eq!(c.refused, Some(ProblemKind::BodyTooLarge { limit: 1_000 }));
    assert_eq!(c.buffered, 0);
}
