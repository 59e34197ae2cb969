//! A flood of unique keys must not grow Envoy's memory without bound: the local tier is a fixed
//! set of shared-data names with its own eviction. Measured on Envoy's resident memory (/proc)
//! and the allocator's figure from the admin `/memory` endpoint, not on a self-reported gauge.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use support::http;
use support::upstream::Upstream;
use support::{Envoy, EnvoyOptions};

fn flood(port: u16, from: u64, count: u64, threads: u64) -> u64 {
    let ok = Arc::new(AtomicU64::new(0));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let ok = ok.clone();
            std::thread::spawn(move || {
                let mut n = from + t;
                while n < from + count {
                    let key = format!("flood-{n}");
                    let h = [
                        ("authorization", "Bearer flood"),
                        ("idempotency-key", key.as_str()),
                        ("x-up-body-bytes", "4000"),
                    ];
                    if let Ok(r) = http::request(port, "POST", "/charges", &h, b"{\"amount\":1}") {
                        if r.status == 201 {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    n += threads;
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    ok.load(Ordering::Relaxed)
}

/// The allocator's `allocated` bytes from the admin `/memory` endpoint. Panics when the answer has
/// no readable figure: a growth measured from a 0 would pass without measuring anything.
fn allocated(envoy: &Envoy) -> u64 {
    let r = http::get(envoy.admin_port, "/memory").expect("admin /memory");
    let allocated = r.json()["allocated"].as_str().and_then(|s| s.parse().ok());
    allocated.unwrap_or_else(|| panic!("admin /memory has no readable \"allocated\" figure: {}", r.body_text()))
}

#[test]
fn a_flood_of_unique_keys_keeps_envoy_memory_flat_under_the_cap() {
    let up = Upstream::start();
    let cfg = r#"{"scope": {"headers": ["authorization"]},
                  "local": {"max_entries": 2000, "max_bytes": 16777216, "when_full": "evict_oldest",
                            "min_protection_seconds": 0}}"#;
    let envoy = Envoy::start(&EnvoyOptions::new(cfg, up.port));
    // Warm up: fill the table well past its capacity, so every later key evicts an old one.
    let warm = flood(envoy.port, 0, 6_000, 4);
    let (rss_1, alloc_1) = (envoy.rss_bytes(), allocated(&envoy));
    let more = flood(envoy.port, 6_000, 18_000, 4);
    let (rss_2, alloc_2) = (envoy.rss_bytes(), allocated(&envoy));
    eprintln!(
        "memory flood: after {} keys rss={} KiB allocated={} KiB; after {} more keys rss={} KiB allocated={} KiB; evictions={}",
        warm,
        rss_1 / 1024,
        alloc_1 / 1024,
        more,
        rss_2 / 1024,
        alloc_2 / 1024,
        envoy.stat("idemgate.local_evictions")
    );
    assert!(warm > 5_000 && more > 17_000, "the flood was served: {warm} + {more}");
    assert_eq!(up.executions(), warm + more, "every unique key executed exactly once");
    assert!(envoy.stat("idemgate.local_evictions") > 10_000);
    // 18,000 more records of ~4 KB would be ~70 MB if every key kept its own entry.
    let growth = rss_2.saturating_sub(rss_1);
    assert!(growth < 12 * 1024 * 1024, "resident memory grew by {} KiB", growth / 1024);
    let alloc_growth = alloc_2.saturating_sub(alloc_1);
    assert!(alloc_growth < 8 * 1024 * 1024, "allocated memory grew by {} KiB", alloc_growth / 1024);
    envoy.assert_no_wasm_panic();
}
