//! Profile of idemgate's per-request work in the core, step by step (`make bench` runs it natively
//! and compiled to wasm32-wasip1 under Node.js, whose V8 is the engine Envoy runs the filter in).
//!
//! Each step is what the filter does for one protected request, on the same inputs as the Envoy
//! benchmark (70-byte JSON body, its headers, a bucket of 32 entries, a 200-byte response). Host calls
//! are not here: shared data is an in-memory map with the host's CAS rules, so the figures are
//! the Wasm-side cost only. Output: one JSON object per line, `{"step", "ns_per_op", "allocs_per_op", "iters"}`.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) every step runs a few times only, as
//! a smoke test that the profile still runs.

use idemgate::backend::Backend;
use idemgate::config::Config;
use idemgate::engine::writes::Job;
use idemgate::fingerprint::Fingerprint;
use idemgate::key::parse_key_header;
use idemgate::local::memory::MemoryShared;
use idemgate::local::{Begin, Bucket, Completed, Table};
use idemgate::owner::{OwnerSeed, OwnerToken, TokenSources};
use idemgate::record::{Creator, Lifetimes, Record, StoredResponse, UnknownReason};
use idemgate::request::RequestHead;
use idemgate::scope::{CallerScope, StorageKey};
use idemgate::seal::Seal;
use idemgate::store::{ClaimReply, Transition, TransitionReply};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Counts allocations (and reallocations), so each step also reports how many it makes: on
/// wasm32 every one is a call into the module's allocator.
struct Counting;
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The benchmark's plugin configuration: a table of 4096 entries (128 buckets of 64), evicting
/// the oldest when full, as under a flood of unique keys.
const CONFIG: &[u8] =
    br#"{"scope": {"headers": ["authorization"]}, "local": {"max_entries": 4096, "when_full": "evict_oldest"}}"#;
const BODY: &[u8] = br#"{"amount":4200,"currency":"eur","note":"benchmark body of fixed size"}"#;

/// Shared data with the host's rules (the crate's one fake, feature `testkit`).
type Map = MemoryShared;

fn head(key: &str) -> RequestHead {
    let pairs: Vec<(String, Vec<u8>)> = [
        (":method", "POST"),
        (":path", "/bench"),
        (":authority", "bench"),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("authorization", "Bearer bench"),
        ("idempotency-key", key),
        ("content-length", "70"),
        ("x-request-id", "7f3c2a9e-5b1d-4e8f-9a6c-2d4b8e1f0a3c"),
    ]
    .iter()
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .collect();
    RequestHead::from_pairs(pairs)
}

struct Bench {
    full: bool,
    lines: Vec<String>,
}

impl Bench {
    /// Runs `f` repeatedly for about 300 ms (`IDEMGATE_HOT_PATH_MS`) (a few times when not benchmarking) and records the
    /// mean time per call.
    fn step(&mut self, name: &str, mut f: impl FnMut(u64)) {
        // IDEMGATE_HOT_PATH_MS: time per step (300 ms unless set; `BENCH_QUICK=1 make bench` sets 30).
        let ms = std::env::var("IDEMGATE_HOT_PATH_MS").ok().and_then(|v| v.parse::<u128>().ok()).unwrap_or(300);
        let (budget_ns, mut batch) = if self.full { (ms * 1_000_000, 64u64) } else { (0, 2) };
        let mut iters = 0u64;
        let allocs0 = ALLOCATIONS.load(Ordering::Relaxed);
        let start = Instant::now();
        loop {
            for i in 0..batch {
                f(iters + i);
            }
            iters += batch;
            if start.elapsed().as_nanos() >= budget_ns {
                break;
            }
            batch = batch.saturating_mul(2).min(1 << 16);
        }
        let ns = start.elapsed().as_nanos() as f64 / iters as f64;
        let allocs = (ALLOCATIONS.load(Ordering::Relaxed) - allocs0) as f64 / iters as f64;
        let line = format!(
            "{{\"step\": \"{name}\", \"ns_per_op\": {ns:.1}, \"allocs_per_op\": {allocs:.1}, \"iters\": {iters}}}"
        );
        println!("{line}");
        self.lines.push(line);
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let mut b = Bench { full, lines: Vec::new() };
    let Ok(cfg) = Config::parse(CONFIG) else {
        eprintln!("hot_path: the benchmark configuration was refused");
        std::process::exit(2);
    };
    let canonical_cfg =
        Config::parse(br#"{"scope": {"headers": ["authorization"]}, "fingerprint": {"json": "canonical"}}"#);
    let Some(policy) = cfg.policy_at(0) else { std::process::exit(2) };
    let fixed = head("replay-key");
    let pairs = fixed.headers.clone();

    // Steps at request headers.
    b.step("request_head_from_headers", |_| {
        black_box(RequestHead::from_pairs(black_box(pairs.clone())));
    });
    b.step("parse_key", |_| {
        black_box(parse_key_header(&fixed.values("idempotency-key"), 255, idemgate::key::KeySyntax::Strict).ok());
    });
    let scope = CallerScope::of(&fixed, &policy.scope);
    b.step("caller_scope_sha256", |_| {
        black_box(CallerScope::of(black_box(&fixed), &policy.scope));
    });
    let Ok(Some(key)) = parse_key_header(&fixed.values("idempotency-key"), 255, idemgate::key::KeySyntax::Strict)
    else {
        std::process::exit(2)
    };
    b.step("storage_key_sha256", |_| {
        black_box(StorageKey::derive(&policy.namespace, &scope, black_box(&key)));
    });
    let seed = OwnerSeed::derive(&TokenSources { entropy: &[7u8; 16], node: "bench", vm: 1, now_nanos: 1 });
    b.step("owner_token_sha256", |i| {
        black_box(OwnerToken::next(&seed, i));
    });
    // At end of body.
    b.step("fingerprint_raw_body", |_| {
        black_box(Fingerprint::compute(black_box(&fixed), BODY, &policy.fingerprint));
    });
    if let Some(p) = canonical_cfg.as_ref().ok().and_then(|c| c.policy_at(0)) {
        b.step("fingerprint_canonical_json", |_| {
            black_box(Fingerprint::compute(black_box(&fixed), BODY, &p.fingerprint));
        });
    }
    // Local tier encodings.
    let table = Table::new(&cfg.local);
    let mut sd = Map::default();
    if table.ensure_created(&mut sd).is_err() {
        std::process::exit(2);
    }
    let creator = Creator { request_id: "7f3c2a9e-5b1d-4e8f-9a6c-2d4b8e1f0a3c".into(), log_values: vec![] };
    let (fp, _) = Fingerprint::compute(&fixed, BODY, &policy.fingerprint);
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("location".into(), b"/charges/ch_1".to_vec()),
        ],
        body: br#"{"id":"ch_1","amount":4200,"currency":"eur","status":"succeeded","note":"benchmark body of fixed size","created":1700000000}"#.to_vec(),
    };
    let record = Record::completed(fp, response.clone(), false, creator.clone(), 1_000, 86_400);
    let encoded = record.encode();
    b.step("record_encode_200b_response", |_| {
        black_box(black_box(&record).encode());
    });
    b.step("record_decode_200b_response", |_| {
        black_box(Record::decode(black_box(&encoded)).ok());
    });
    // A table at `max_entries`: 32 claims a bucket with distinct keys landing anywhere, then the
    // bucket bytes of the fullest one.
    for n in 0..(32 * table.buckets() as u64) {
        let sk = StorageKey::derive(&policy.namespace, &scope, &numbered_key("fill", n));
        let _ = table.begin(&mut sd, sk, Some(fp), 1_000, policy, OwnerToken([1; 16]), &creator);
    }
    let bucket_bytes = sd
        .entries()
        .filter(|(k, _)| k.contains(".b."))
        .map(|(_, v)| v.clone())
        .max_by_key(|v| v.len())
        .unwrap_or_default();
    b.step("bucket_decode", |_| {
        black_box(Bucket::decode(black_box(&bucket_bytes)));
    });
    if let Some(bucket) = Bucket::decode(&bucket_bytes) {
        b.step("bucket_encode", |_| {
            black_box(black_box(&bucket).encode());
        });
    }
    // Whole local-tier operations (shared-data copies in the map included).
    let skey = StorageKey::derive(&policy.namespace, &scope, &key);
    let mut sd = Map::default();
    let _ = table.ensure_created(&mut sd);
    if let Ok(Begin::Claimed { handle, .. }) =
        table.begin(&mut sd, skey, Some(fp), 1_000, policy, OwnerToken([2; 16]), &creator)
    {
        let _ = table.complete(&mut sd, &handle, record.clone(), 1_000);
    }
    // The step below must measure a replay, not a refusal.
    if !matches!(
        table.begin(&mut sd, skey, Some(fp), 2_000, policy, OwnerToken([3; 16]), &creator),
        Ok(Begin::Replay(_))
    ) {
        eprintln!("hot_path: the stored record is not replayed");
        std::process::exit(2);
    }
    b.step("local_begin_replay_hit", |_| {
        black_box(table.begin(&mut sd, skey, Some(fp), 2_000, policy, OwnerToken([3; 16]), &creator).ok());
    });
    let mut sd2 = Map::default();
    let _ = table.ensure_created(&mut sd2);
    let mut claimed = 0u64;
    b.step("local_claim_forward_complete", |i| {
        let sk = StorageKey::derive(&policy.namespace, &scope, &numbered_key("k", i));
        // The filter's path: a look at headers, the claim at the body's end on that read.
        let seen = match table.begin(&mut sd2, sk, None, 1_000 + i, policy, OwnerToken([4; 16]), &creator) {
            Ok(Begin::NeedFingerprint { seen }) => seen,
            _ => None,
        };
        if let Ok(Begin::Claimed { handle, .. }) =
            table.begin_after(&mut sd2, sk, Some(fp), 1_000 + i, policy, OwnerToken([4; 16]), &creator, seen)
        {
            let r = Record::completed(fp, response.clone(), false, creator.clone(), 1_000 + i, 86_400);
            if matches!(table.complete(&mut sd2, &handle, r, 1_000 + i), Ok(Completed::Stored)) {
                claimed += 1;
            }
        }
    });
    if claimed == 0 {
        eprintln!("hot_path: no claim was completed");
        std::process::exit(2);
    }
    // A first request (looked at, claimed, completed) into a bucket at realistic occupancy: 32
    // records (a bucket's average at `max_entries`) and 64 (a full bucket). A table of at most 64
    // records is one bucket of that width: filled with completed records, each new key takes the
    // place of the oldest (`evict_oldest`, no floor), so the occupancy stays put.
    for width in [32u64, 64] {
        let Ok(c) = Config::parse(
            format!(
                r#"{{"scope": {{"headers": ["authorization"]}}, "local": {{"max_entries": {width}, "when_full": "evict_oldest", "min_protection_seconds": 0}}}}"#
            )
            .as_bytes(),
        ) else {
            std::process::exit(2)
        };
        let t = Table::new(&c.local);
        let mut sd = Map::default();
        let _ = t.ensure_created(&mut sd);
        let first_request = |sd: &mut Map, i: u64| {
            let sk = StorageKey::derive(&policy.namespace, &scope, &numbered_key("o", i));
            let now = 1_000 + i;
            let seen = match t.begin(sd, sk, None, now, policy, OwnerToken([5; 16]), &creator) {
                Ok(Begin::NeedFingerprint { seen }) => seen,
                _ => None,
            };
            match t.begin_after(sd, sk, Some(fp), now, policy, OwnerToken([5; 16]), &creator, seen) {
                Ok(Begin::Claimed { handle, .. }) => {
                    let r = Record::completed(fp, response.clone(), false, creator.clone(), now, 86_400);
                    matches!(t.complete(sd, &handle, r, now), Ok(Completed::Stored))
                }
                _ => false,
            }
        };
        for i in 0..width {
            first_request(&mut sd, i);
        }
        if t.count(&mut sd) != width {
            eprintln!("hot_path: the bucket of {width} is not full");
            std::process::exit(2);
        }
        let mut stored = 0u64;
        b.step(&format!("local_first_request_bucket_of_{width}"), |i| {
            stored += u64::from(first_request(&mut sd, width + i));
        });
        if stored == 0 || t.count(&mut sd) != width {
            eprintln!("hot_path: the bucket of {width} did not stay full");
            std::process::exit(2);
        }
    }
    store_steps(&mut b, &StoreInputs { skey, fp, creator: &creator, response: &response, policy });
    if !full {
        // Smoke run: every step ran and printed a figure.
        assert_eq!(b.lines.len(), 20, "{:?}", b.lines);
    }
}

/// What one first request brings to the Redis store path.
struct StoreInputs<'a> {
    skey: StorageKey,
    fp: Fingerprint,
    creator: &'a Creator,
    response: &'a StoredResponse,
    policy: &'a idemgate::config::Policy,
}

/// The Redis store path of one first request, as the filter runs it (host calls excluded): the
/// claim-or-read request with its sealed in-progress record (`engine::machine`'s `ClaimInStore`,
/// then `Backend::claim_request` in the glue's `send`), the claim's answer read
/// (`Backend::parse_claim`), the completion write and its outcome-unknown fallback built
/// (`engine::settle`'s `Store` outcome, then the root's `Job::build` of each), the completion's
/// answer read (`Backend::parse_write`); then all four in a row.
fn store_steps(b: &mut Bench, i: &StoreInputs) {
    let Ok(seal) = Seal::new(Some("4f1c7a0e9b2d3c5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6"), None) else {
        std::process::exit(2)
    };
    let store = Backend::Redis;
    let lifetimes = Lifetimes::of(i.policy);
    let seed = OwnerSeed::derive(&TokenSources { entropy: &[9u8; 16], node: "bench", vm: 1, now_nanos: 1 });
    let owner = OwnerToken::next(&seed, 1);
    let now = 1_700_000_000_123u64;
    let claim = |now: u64| {
        let record = Record::in_progress(i.fp, i.creator.clone(), owner, now, &lifetimes);
        store.claim_request(&i.skey, &owner, &record, &lifetimes, &seal, now)
    };
    // Redis's answers: the claim script's `{'1', now, owner}`, the transition script's `{1, owner}`.
    let claimed = format!("*3\r\n$1\r\n1\r\n$13\r\n{now}\r\n$32\r\n{}\r\n", owner.hex()).into_bytes();
    let changed = format!("*2\r\n:1\r\n$32\r\n{}\r\n", owner.hex()).into_bytes();
    let parse_claim = || store.parse_claim(Some(200), &claimed, &owner, &i.skey, &seal, now);
    let complete = |now: u64| {
        let record = Record::completed(i.fp, i.response.clone(), false, i.creator.clone(), now, i.policy.ttl_seconds);
        let gone = Record::unknown(i.fp, i.creator.clone(), UnknownReason::StoreWriteFailed, now, &lifetimes);
        let unknown = Transition::unknown(owner, gone, &lifetimes);
        let done = Transition::complete(owner, record.clone(), &lifetimes);
        let job = Job::build_owned("complete", &i.skey, done, None, store, &seal, now);
        let fallback = Job::build_owned("unknown_fallback", &i.skey, unknown, None, store, &seal, now);
        // The record also completes the local tier's copy.
        (job.ok().zip(fallback.ok()), record)
    };
    let parse_write = || store.parse_write(Some(200), &changed);
    if !matches!(parse_claim(), Ok((ClaimReply::Claimed { .. }, None)))
        || parse_write() != Ok(TransitionReply::Changed)
        || claim(now).is_err()
        || complete(now).0.is_none()
    {
        eprintln!("hot_path: the store path's requests or answers are not those of a first request");
        std::process::exit(2);
    }
    b.step("store_claim_request", |n| {
        black_box(claim(now + n).ok());
    });
    b.step("store_parse_claim_reply", |_| {
        black_box(parse_claim().ok());
    });
    b.step("store_completion_jobs", |n| {
        black_box(complete(now + n));
    });
    b.step("store_parse_completion_reply", |_| {
        black_box(parse_write().ok());
    });
    b.step("store_first_request", |n| {
        black_box(claim(now + n).ok());
        black_box(parse_claim().ok());
        black_box(complete(now + n));
        black_box(parse_write().ok());
    });
}

/// A distinct valid key for each `i`.
fn numbered_key(prefix: &str, i: u64) -> idemgate::key::IdempotencyKey {
    let text = format!("{prefix}-{i}");
    match parse_key_header(&[text.as_bytes()], 255, idemgate::key::KeySyntax::Strict) {
        Ok(Some(k)) => k,
        _ => std::process::exit(2),
    }
}
