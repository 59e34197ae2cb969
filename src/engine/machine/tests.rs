//! The machine's own inputs that the HTTP glue once decided itself (issue 26): body chunks in
//! the worker's buffer budget, an MCP POST's body, and an internal redirect's hand-over and
//! adoption, driven by a host kept in memory (its budget count, the body, the local tier) that
//! records the machine's commands.

use super::*;
use crate::config::Config;
use crate::decision::Phase as KeyPhase;
use crate::engine::request::NotProtected;
use crate::local::memory::MemoryShared;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const NOW: u64 = 1_000_000;
/// The re-created stream as the driver describes it: context 11 on connection 7, carrying the
/// mark of the request under `mark`'s storage key.
fn on(mark: StorageKey) -> crate::redirect::Stream {
    crate::redirect::Stream { mark: Some(mark), connection: Some(7), context_id: 11 }
}

/// What the machine told its driver, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Did {
    Count(Count),
    Reply(&'static str),
    McpReply {
        id: Vec<u8>,
        batch: Vec<Vec<u8>>,
    },
    HandOver {
        url: String,
        skey: StorageKey,
    },
    Publish(&'static str),
    /// A replay, with the stored body it replays.
    Replayed(Vec<u8>),
    /// The request's mark left for a redirect (`Command::Mark`).
    Mark,
    Other,
}

/// One proxy's shared data in memory; `refuse_sets` makes every write fail as a host error.
#[derive(Default)]
struct Sd {
    mem: MemoryShared,
    refuse_sets: bool,
}

impl SharedData for Sd {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), crate::local::HostError> {
        self.mem.get(key)
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), crate::local::SetError> {
        if self.refuse_sets {
            return Err(crate::local::SetError::Host);
        }
        self.mem.set(key, value, cas)
    }
}

/// A host in memory: the worker's budget, the request body, one proxy's local tier.
struct Host {
    table: Table,
    sd: Sd,
    buffered: u64,
    max: u64,
    body: Vec<u8>,
    /// Whether the host accepts the router's retries being forbidden.
    forbid_ok: bool,
    did: Vec<Did>,
    /// The claims handed over (`Command::HandOver`).
    handed: Vec<Claim>,
    /// The worker's claims waiting for a redirect's re-created stream.
    handoffs: Handoffs<Claim>,
}

impl Host {
    fn new(config: &Config) -> Host {
        let table = Table::new(&config.local);
        let mut sd = Sd::default();
        assert!(table.ensure_created(&mut sd).is_ok());
        let max = config.max_buffered_bytes;
        Host {
            table,
            sd,
            buffered: 0,
            max,
            body: vec![],
            forbid_ok: true,
            did: vec![],
            handed: vec![],
            handoffs: Handoffs::default(),
        }
    }

    fn key_phase(&mut self, skey: &StorageKey) -> Option<KeyPhase> {
        match self.table.peek(&mut self.sd, skey, NOW) {
            Ok(p) => p.map(|p| p.summary.phase),
            Err(e) => panic!("local tier: {e:?}"),
        }
    }

    fn did(&self, d: &Did) -> bool {
        self.did.contains(d)
    }
}

impl Effects for Host {
    fn now_ms(&mut self) -> u64 {
        NOW
    }

    fn local(&mut self) -> (&Table, &mut dyn SharedData) {
        (&self.table, &mut self.sd)
    }

    fn run(&mut self, c: Command<'_>) {
        let d = match c {
            Command::Count(c) => Did::Count(c),
            Command::Reply { problem, .. } => Did::Reply(problem.slug()),
            Command::McpReply { id, batch, .. } => Did::McpReply { id, batch },
            Command::HandOver { claim, url } => {
                let skey = claim.skey;
                self.handed.push(claim);
                Did::HandOver { url, skey }
            }
            Command::Publish { outcome, .. } => Did::Publish(outcome),
            Command::Mark { .. } => Did::Mark,
            Command::Replay { record, .. } => match record.state {
                crate::record::State::Completed(r) => Did::Replayed(r.body),
                _ => Did::Other,
            },
            _ => Did::Other,
        };
        self.did.push(d);
    }

    fn logs(&self, _level: Level) -> bool {
        false
    }
}

impl Io for Host {
    type Wire = u32;

    fn budget(&self) -> Budget {
        Budget { buffered: self.buffered, max: self.max }
    }

    fn set_buffered(&mut self, buffered: u64) {
        self.buffered = buffered;
    }

    fn read_body(&mut self, _req: Option<&Protected>, size: usize) -> Vec<u8> {
        assert_eq!(size, self.body.len(), "the body is read at its size");
        self.body.clone()
    }

    fn forbid_router_retries(&mut self, head: &mut RequestHead) -> bool {
        if self.forbid_ok {
            head.forbid_router_retries();
        }
        self.forbid_ok
    }

    fn next_owner(&mut self) -> OwnerToken {
        OwnerToken([7; 16])
    }

    /// As the driver takes one: this stream is context 11 on connection 7, carrying the
    /// request's mark.
    fn take_handoff(&mut self, skey: &StorageKey, policy_index: usize, original_url: &[u8]) -> Option<Handoff<Claim>> {
        self.handoffs.take(skey, policy_index, original_url, on(*skey), NOW)
    }

    fn send(&mut self, _req: &Protected, _op: StoreOp<'_, u32>) -> Result<u32, NotSent> {
        panic!("these configurations name no store")
    }
}

fn config(json: &str) -> Config {
    match Config::parse(json.as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("configuration refused: {e:?}"),
    }
}

fn head(path: &str, key: Option<&str>, extra: &[(&str, &str)]) -> RequestHead {
    let mut pairs: Vec<(String, Vec<u8>)> = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), path.as_bytes().to_vec()),
        (":authority".into(), b"idemgate.test".to_vec()),
        ("authorization".into(), b"Bearer caller-1".to_vec()),
    ];
    if let Some(k) = key {
        pairs.push(("idempotency-key".into(), k.as_bytes().to_vec()));
    }
    pairs.extend(extra.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())));
    RequestHead::from_pairs(pairs)
}

/// A protected request's headers, admitted and given to a fresh machine (as `http.rs` does).
fn protect(config: &Config, host: &mut Host, key: &str) -> (Machine<u32>, StorageKey) {
    let h = head("/charges", Some(key), &[]);
    let a = match request::at_headers(config, &h, None, false) {
        Ok(a) => a,
        Err(not) => panic!("not protected: {not:?}"),
    };
    let skey = a.skey;
    let req = Protected::at_headers(a, h, OwnerToken([1; 16]));
    let mut m = Machine::new(None, true);
    assert_eq!(m.protect(host, req, false), Flow::Pause);
    assert!(matches!(m.phase(), Phase::Waiting { .. }));
    (m, skey)
}

const BUDGET: &str =
    r#"{"scope": {"headers": ["authorization"]}, "max_buffered_bytes": 4096, "max_request_body_bytes": 3000}"#;

#[test]
fn a_body_over_the_workers_budget_is_refused_and_gives_back_all_its_request_counted() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    // Other requests of the worker hold 2,000 bytes.
    host.buffered = 2_000;
    let (mut m, skey) = protect(&c, &mut host, "k-over");
    let seen = host.buffered - 2_000;
    assert!(seen > 0, "the bucket read at headers is kept within the budget");
    assert_eq!(m.body_chunk(&mut host, 1_000, false), Flow::Pause);
    assert!(host.buffered >= 3_000);
    // 2,500 bytes do not fit beside the others' 2,000 even without the bucket read: 503.
    assert_eq!(m.body_chunk(&mut host, 2_500, false), Flow::Pause);
    assert!(host.did(&Did::Reply("buffer-budget-exceeded")), "{:?}", host.did);
    assert!(matches!(m.phase(), Phase::Answered));
    assert_eq!(host.buffered, 2_000, "the refused request gives back its body and its read");
    assert_eq!(host.key_phase(&skey), None, "nothing claimed");
    // Over the route's own limit: 413.
    let mut host = Host::new(&c);
    let (mut m, _) = protect(&c, &mut host, "k-large");
    m.body_chunk(&mut host, 3_001, false);
    assert!(host.did(&Did::Reply("body-too-large")), "{:?}", host.did);
    assert_eq!(host.buffered, 0);
}

/// The read kept at headers yields to its own body: a body that fits the budget alone is
/// claimed and forwarded, and its bytes are given back once it is whole.
#[test]
fn a_body_that_fits_the_budget_alone_is_claimed_and_its_bytes_given_back_once_whole() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut m, skey) = protect(&c, &mut host, "k-whole");
    assert!(host.buffered > 0);
    host.max = 1_024;
    host.body = vec![b'x'; 1_024];
    assert_eq!(m.body_chunk(&mut host, 1_024, true), Flow::Continue);
    assert!(matches!(m.phase(), Phase::Forwarded { .. }), "{:?}", host.did);
    assert!(host.did(&Did::Count(Count::Claimed)));
    assert_eq!(host.buffered, 0);
    assert!(matches!(host.key_phase(&skey), Some(KeyPhase::Forwarded { .. })));
    // Its end gives back nothing more: the budget is the other requests'.
    host.buffered = 500;
    m.release_budget(&mut host);
    assert_eq!(host.buffered, 500);
}

#[test]
fn trailers_end_the_body_and_join_its_head() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut m, _) = protect(&c, &mut host, "k-trailers");
    host.body = b"0123456789".to_vec();
    assert_eq!(m.body_chunk(&mut host, 10, false), Flow::Pause);
    assert!(host.buffered >= 10);
    assert!(m.wants_trailers());
    let t = vec![("x-checksum".to_string(), b"abc".to_vec())];
    assert_eq!(m.trailers(&mut host, Some(t.clone())), Flow::Continue);
    let Some((req, _)) = m.forwarded() else { panic!("forwarded: {:?}", host.did) };
    assert_eq!(req.head.trailers, t);
    assert_eq!(host.buffered, 0);
    assert!(!m.wants_trailers());
    // Forwarded: further chunks and trailers continue, counting nothing.
    assert_eq!(m.body_chunk(&mut host, 20, false), Flow::Continue);
    assert_eq!(host.buffered, 0);
}

const MCP: &str = r#"{"scope": {"headers": ["authorization"]}, "max_buffered_bytes": 4096,
    "routes": [{"prefix": "/mcp", "protocol": "mcp",
                "mcp": {"tools": ["charge"], "key_arguments": ["idempotency_key"]}}]}"#;

fn call(id: u32, tool: &str, args: &str) -> Vec<u8> {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{args}}}}}"#)
        .into_bytes()
}

/// An MCP POST given to a fresh machine (`hold_headers` as given).
fn mcp_post(c: &Config, host: &mut Host, hold_headers: bool) -> (Machine<u32>, Flow) {
    let h = head("/mcp", None, &[("accept", "application/json")]);
    let Err(NotProtected::McpBody { route, policy }) = request::at_headers(c, &h, None, false) else {
        panic!("an MCP POST waits for its body")
    };
    let mut m = Machine::new(None, hold_headers);
    let flow = m.await_mcp_body(host, route, policy, h);
    (m, flow)
}

#[test]
fn an_mcp_post_is_buffered_whole_then_protected_as_a_call_or_passed() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let (mut m, flow) = mcp_post(&c, &mut host, true);
    assert_eq!(flow, Flow::Pause);
    host.body = call(8, "charge", r#"{"idempotency_key":"k-mcp"}"#);
    let half = host.body.len() / 2;
    assert_eq!(m.body_chunk(&mut host, half, false), Flow::Pause);
    assert_eq!(host.buffered, half as u64);
    let n = host.body.len();
    assert_eq!(m.body_chunk(&mut host, n, true), Flow::Continue);
    assert!(host.did(&Did::McpReply { id: b"8".to_vec(), batch: vec![] }), "{:?}", host.did);
    assert!(host.did(&Did::Count(Count::Protected)));
    assert!(host.did(&Did::Count(Count::Claimed)));
    let Some((req, _)) = m.forwarded() else { panic!("forwarded: {:?}", host.did) };
    assert_eq!(req.mcp.as_deref(), Some(&b"8"[..]));
    assert_eq!(req.owner, OwnerToken([7; 16]));
    assert_eq!(host.buffered, 0);
    // Not a protected call: passed untouched, nothing replied.
    let mut host = Host::new(&c);
    let (mut m, _) = mcp_post(&c, &mut host, true);
    host.body = br#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#.to_vec();
    let n = host.body.len();
    assert_eq!(m.body_chunk(&mut host, n, true), Flow::Continue);
    assert!(matches!(m.phase(), Phase::Pass));
    assert!(host.did.is_empty(), "{:?}", host.did);
    assert_eq!(host.buffered, 0);
}

#[test]
fn an_mcp_post_is_refused_in_json_rpc_to_its_id_or_null() {
    let c = config(MCP);
    // Over the budget before its id is read: to id null.
    let mut host = Host::new(&c);
    host.buffered = 4_000;
    let (mut m, _) = mcp_post(&c, &mut host, true);
    assert_eq!(m.body_chunk(&mut host, 200, false), Flow::Pause);
    assert_eq!(
        host.did,
        vec![Did::McpReply { id: b"null".to_vec(), batch: vec![] }, Did::Reply("buffer-budget-exceeded")]
    );
    assert_eq!(host.buffered, 4_000);
    // A batch holding a protected call: to its ids. Ended by the trailers.
    let mut host = Host::new(&c);
    let (mut m, _) = mcp_post(&c, &mut host, true);
    let mut batch = b"[".to_vec();
    batch.extend(call(1, "charge", r#"{"idempotency_key":"k"}"#));
    batch.extend(br#",{"jsonrpc":"2.0","id":2,"method":"tools/list"}]"#);
    host.body = batch;
    let n = host.body.len();
    assert_eq!(m.body_chunk(&mut host, n, false), Flow::Pause);
    assert!(!m.wants_trailers());
    assert_eq!(m.trailers(&mut host, None), Flow::Pause);
    let ids = vec![b"1".to_vec(), b"2".to_vec()];
    assert_eq!(host.did, vec![Did::McpReply { id: b"null".to_vec(), batch: ids }, Did::Reply("mcp-batch-refused")]);
    assert_eq!(host.buffered, 0);
    // Without `hold_headers` the router is told at once never to re-send it; a host refusing
    // that fails closed, before anything is forwarded.
    let mut host = Host::new(&c);
    host.forbid_ok = false;
    let (m, flow) = mcp_post(&c, &mut host, false);
    assert_eq!(flow, Flow::Pause);
    assert!(matches!(m.phase(), Phase::Answered));
    assert!(host.did(&Did::Reply("internal-state")), "{:?}", host.did);
}

/// A request forwarded under its local claim (`k-redirect`), as a stream that then ends.
fn forwarded(c: &Config, host: &mut Host) -> (Machine<u32>, StorageKey) {
    let (mut m, skey) = protect(c, host, "k-redirect");
    assert_eq!(m.body_chunk(host, 0, true), Flow::Continue);
    assert!(m.forwarded().is_some());
    // Forwarded under its claim, the request is marked once (its redirect's stream inherits it).
    assert_eq!(host.did.iter().filter(|d| **d == Did::Mark).count(), 1, "{:?}", host.did);
    (m, skey)
}

#[test]
fn a_stream_ended_for_an_internal_redirect_hands_its_claim_over() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut m, skey) = forwarded(&c, &mut host);
    assert!(m.wants_code_details());
    // Ended otherwise (a reset): settled by the driver, not handed over.
    assert!(!m.redirected_away(&mut host, "upstream_reset_before_response_started"));
    assert!(m.forwarded().is_some());
    assert!(m.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    assert!(host.did(&Did::HandOver { url: "idemgate.test/charges".into(), skey }), "{:?}", host.did);
    assert!(host.did(&Did::Publish(REDIRECTED)));
    assert!(matches!(m.phase(), Phase::Pass));
    // The claim stays held for the stream Envoy re-creates.
    assert!(matches!(host.key_phase(&skey), Some(KeyPhase::Forwarded { .. })));
    // A response reached the filter: no redirect, whatever the details say.
    let mut host = Host::new(&c);
    let (mut m, _) = forwarded(&c, &mut host);
    let _ = m.response_headers(vec![(":status".into(), b"302".to_vec())], true);
    assert!(!m.wants_code_details());
    assert!(!m.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    assert!(m.forwarded().is_some());
}

/// The claim `host` was handed, as the driver posts it (connection 7, context 10).
fn handed(host: &mut Host) -> Handoffs<Claim> {
    let Some(claim) = host.handed.pop() else { panic!("no claim handed over: {:?}", host.did) };
    let mut handoffs = Handoffs::default();
    let h = Handoff {
        skey: claim.skey,
        policy_index: claim.policy_index,
        url: "idemgate.test/charges".into(),
        connection: Some(7),
        marked: true,
        from_context: 10,
        posted_ms: NOW,
        claim,
    };
    assert!(handoffs.post(h).is_empty());
    handoffs
}

const URL: &[u8] = b"http://idemgate.test/charges";

#[test]
fn the_recreated_stream_continues_the_claim_and_its_target_never_releases_it() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut first, skey) = forwarded(&c, &mut host);
    assert!(first.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    let mut handoffs = handed(&mut host);
    let policy = |i: usize| c.shared_policy(i);
    // Another key (or caller) takes nothing.
    let other = head("/target", Some("k-other"), &[]);
    assert!(take_handoff(&mut handoffs, &[0], policy, &other, URL, on(skey), NOW).is_none());
    let target = head("/target", Some("k-redirect"), &[]);
    // The same request forged on the same connection, without the request's mark (filter state
    // only Envoy's re-created stream inherits), or with another request's: nothing.
    let unmarked = crate::redirect::Stream { mark: None, ..on(skey) };
    assert!(take_handoff(&mut handoffs, &[0], policy, &target, URL, unmarked, NOW).is_none());
    let other_mark = on(crate::scope::StorageKey([9; 32]));
    assert!(take_handoff(&mut handoffs, &[0], policy, &target, URL, other_mark, NOW).is_none());
    let taken = take_handoff(&mut handoffs, &[0], policy, &target, URL, on(skey), NOW);
    let Some((h, p, scope)) = taken else { panic!("the re-created stream takes its claim") };
    assert!(handoffs.is_empty());
    let mut m = Machine::new(None, true);
    assert_eq!(m.adopt(&mut host, h, p, target, scope), Flow::Continue);
    assert!(host.did(&Did::Count(Count::RedirectsFollowed)));
    let Some((req, _)) = m.forwarded() else { panic!("forwarded under the claim") };
    assert_eq!((req.skey, req.owner), (skey, OwnerToken([1; 16])));
    // The target never connects (a release for any other request): its first hop executed, so
    // the key is outcome-unknown, never released.
    let slug = m.settle(&mut host, Ended { outcome: Outcome::Release, detail: String::new() });
    assert_eq!(host.key_phase(&skey), Some(KeyPhase::Unknown), "settled {slug}");
}

/// Issue 40: a redirect to another host re-creates the stream under another `:authority`, part
/// of the caller's scope: the stream reads its key in the scope of the URL it came from, so it
/// takes its claim; a URL that names another authority than the claim's takes nothing.
#[test]
fn a_stream_recreated_for_another_host_continues_the_claim_in_the_first_hops_scope() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut first, skey) = forwarded(&c, &mut host);
    assert!(first.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    let mut handoffs = handed(&mut host);
    let policy = |i: usize| c.shared_policy(i);
    let mut target = head("/target", Some("k-redirect"), &[]);
    target.authority = "pay.example.test".into();
    let elsewhere = b"http://other.example.test/charges";
    assert!(take_handoff(&mut handoffs, &[0], policy, &target, elsewhere, on(skey), NOW).is_none());
    let taken = take_handoff(&mut handoffs, &[0], policy, &target, URL, on(skey), NOW);
    let Some((h, p, scope)) = taken else { panic!("the re-created stream takes its claim") };
    assert_eq!(h.skey, skey);
    assert_eq!(scope, CallerScope::of(&head("/charges", Some("k-redirect"), &[]), &p.scope), "the first hop's scope");
    assert_ne!(scope, CallerScope::of(&target, &p.scope));
}

#[test]
fn a_recreated_stream_whose_retries_cannot_be_forbidden_fails_closed_keeping_the_claim() {
    let c = config(BUDGET);
    let mut host = Host::new(&c);
    let (mut first, skey) = forwarded(&c, &mut host);
    assert!(first.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    let mut handoffs = handed(&mut host);
    let target = head("/target", Some("k-redirect"), &[]);
    let taken = take_handoff(&mut handoffs, &[0], |i| c.shared_policy(i), &target, URL, on(skey), NOW);
    let Some((h, p, scope)) = taken else { panic!("the re-created stream takes its claim") };
    host.forbid_ok = false;
    let mut m = Machine::new(None, true);
    assert_eq!(m.adopt(&mut host, h, p, target, scope), Flow::Pause);
    assert!(host.did(&Did::Reply("internal-state")), "{:?}", host.did);
    assert!(matches!(m.phase(), Phase::Answered));
    // Never re-sent, never released: the claim stands until its lock expires.
    assert!(matches!(host.key_phase(&skey), Some(KeyPhase::Forwarded { .. })));
}

/// The driver's end of a request (`Http::log_exchange`): what it counted given back, then a
/// request still waiting for its body abandoned. The worker's count is then the other
/// requests' again (`base`): nothing leaked, nothing given back twice.
fn ends(host: &mut Host, m: &mut Machine<u32>, base: u64, what: &str) {
    m.release_budget(host);
    let _ = m.abandon(host);
    m.end();
    assert_eq!(host.buffered, base, "{what}: the worker's count after the request ended ({:?})", host.did);
    // A second end (or a release after the end) gives back nothing more.
    m.release_budget(host);
    assert_eq!(host.buffered, base, "{what}: released twice");
}

/// The review of this move: however a request ends (refused, reset mid-upload, whole and
/// forwarded, its bucket read dropped for its body, an MCP POST passed, refused or protected,
/// a stream ended for an internal redirect, its re-created target), the worker's buffer count
/// returns to what the other requests count: never leaked, never given back twice.
#[test]
fn every_kind_of_end_gives_back_exactly_what_its_request_counted() {
    const BASE: u64 = 1_500;
    let c = config(BUDGET);
    // Refused over the route's limit (413), mid-upload.
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = protect(&c, &mut host, "k-413");
    assert!(host.buffered > BASE, "the bucket read is kept");
    m.body_chunk(&mut host, 1_000, false);
    m.body_chunk(&mut host, 3_001, false);
    assert!(host.did(&Did::Reply("body-too-large")));
    ends(&mut host, &mut m, BASE, "413");
    // Refused over the worker's budget (503).
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = protect(&c, &mut host, "k-503");
    m.body_chunk(&mut host, 1_000, false);
    host.buffered += 1_000; // another request meanwhile
    m.body_chunk(&mut host, 2_000, false);
    assert!(host.did(&Did::Reply("buffer-budget-exceeded")), "{:?}", host.did);
    ends(&mut host, &mut m, BASE + 1_000, "503");
    // Reset mid-upload, with its bucket read kept.
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = protect(&c, &mut host, "k-reset");
    assert_eq!(m.body_chunk(&mut host, 700, false), Flow::Pause);
    ends(&mut host, &mut m, BASE, "reset mid-upload");
    assert!(host.did(&Did::Publish(ABANDONED)));
    // Its bucket read dropped for its own body, then reset.
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = protect(&c, &mut host, "k-yield");
    let seen = host.buffered - BASE;
    assert!(seen > 0);
    // Fits beside the others alone, not with the read too.
    let chunk = (host.max - BASE - seen + 1) as usize;
    assert_eq!(m.body_chunk(&mut host, chunk, false), Flow::Pause);
    assert_eq!(host.buffered, BASE + chunk as u64, "the read yielded its bytes");
    ends(&mut host, &mut m, BASE, "read dropped, then reset");
    // Its bucket read dropped, then the body whole: claimed and forwarded, then settled.
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, skey) = protect(&c, &mut host, "k-yield-whole");
    let seen = host.buffered - BASE;
    let n = (host.max - BASE - seen + 1) as usize;
    host.body = vec![b'x'; n];
    assert_eq!(m.body_chunk(&mut host, n - 10, false), Flow::Pause);
    assert_eq!(m.body_chunk(&mut host, n, true), Flow::Continue);
    assert!(m.forwarded().is_some(), "{:?}", host.did);
    assert_eq!(host.buffered, BASE, "given back once whole");
    let _ = m.settle(&mut host, Ended { outcome: Outcome::Release, detail: String::new() });
    ends(&mut host, &mut m, BASE, "whole and forwarded");
    assert_eq!(host.key_phase(&skey), None, "released");
    // Internal redirect: the first stream hands its claim over; its target settles it.
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut first, skey) = protect(&c, &mut host, "k-redirect");
    host.body = vec![b'y'; 100];
    assert_eq!(first.body_chunk(&mut host, 100, true), Flow::Continue);
    first.release_budget(&mut host);
    assert!(first.redirected_away(&mut host, redirect::REDIRECT_CODE_DETAILS));
    assert_eq!(host.buffered, BASE, "redirected");
    let mut handoffs = handed(&mut host);
    let target = head("/target", Some("k-redirect"), &[]);
    let taken = take_handoff(&mut handoffs, &[0], |i| c.shared_policy(i), &target, URL, on(skey), NOW);
    let Some((h, p, scope)) = taken else { panic!("the re-created stream takes its claim") };
    let mut m = Machine::new(None, true);
    assert_eq!(m.adopt(&mut host, h, p, target, scope), Flow::Continue);
    // Envoy gives the target the buffered body: it passes, counting nothing.
    assert_eq!(m.body_chunk(&mut host, 100, true), Flow::Continue);
    let _ = m.settle(&mut host, Ended { outcome: Outcome::Release, detail: String::new() });
    ends(&mut host, &mut m, BASE, "redirect's target");
    assert_eq!(host.key_phase(&skey), Some(KeyPhase::Unknown));
    // MCP POSTs: passed, refused at its body, reset mid-upload, over the budget, protected.
    let c = config(MCP);
    let list = br#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#.to_vec();
    let bad = call(3, "charge", r#"{"idempotency_key":7}"#);
    let good = call(4, "charge", r#"{"idempotency_key":"k-mcp-end"}"#);
    for (what, body, trailers) in [("passed", &list, false), ("refused", &bad, true), ("protected", &good, false)] {
        let mut host = Host::new(&c);
        host.buffered = BASE;
        let (mut m, _) = mcp_post(&c, &mut host, true);
        host.body = body.clone();
        let n = body.len();
        assert_eq!(m.body_chunk(&mut host, n - 5, false), Flow::Pause);
        assert_eq!(host.buffered, BASE + n as u64 - 5);
        if trailers {
            m.body_chunk(&mut host, n, false);
            m.trailers(&mut host, None);
        } else {
            m.body_chunk(&mut host, n, true);
        }
        match what {
            "passed" => assert!(matches!(m.phase(), Phase::Pass), "{:?}", host.did),
            "refused" => assert!(matches!(m.phase(), Phase::Answered), "{:?}", host.did),
            _ => assert!(m.forwarded().is_some(), "{:?}", host.did),
        }
        ends(&mut host, &mut m, BASE, what);
    }
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = mcp_post(&c, &mut host, true);
    assert_eq!(m.body_chunk(&mut host, 1_000, false), Flow::Pause);
    ends(&mut host, &mut m, BASE, "MCP reset mid-upload");
    let mut host = Host::new(&c);
    host.buffered = BASE;
    let (mut m, _) = mcp_post(&c, &mut host, true);
    m.body_chunk(&mut host, 1_000, false);
    host.buffered += 1_700; // others meanwhile
    m.body_chunk(&mut host, 1_900, false);
    assert!(host.did(&Did::McpReply { id: b"null".to_vec(), batch: vec![] }), "{:?}", host.did);
    ends(&mut host, &mut m, BASE + 1_700, "MCP over the budget");
}

/// An MCP `tools/call` whose key is in its body (`key_arguments`), forwarded under its claim.
fn mcp_forwarded(c: &Config, host: &mut Host) -> (Machine<u32>, StorageKey) {
    let (mut m, _) = mcp_post(c, host, true);
    host.body = call(5, "charge", r#"{"idempotency_key":"k-mcp-redirect"}"#);
    let n = host.body.len();
    assert_eq!(m.body_chunk(host, n, true), Flow::Continue);
    let Some((req, _)) = m.forwarded() else { panic!("forwarded: {:?}", host.did) };
    let skey = req.skey;
    (m, skey)
}

/// An MCP call forwarded, then ended for an internal redirect: its claim handed over (posted as
/// the driver posts it: connection 7, context 10), and the re-created stream's head (a 307 to
/// /mcp/target: a POST, its body re-sent; its headers name no key, so nothing is taken at them).
fn mcp_redirected(c: &Config, host: &mut Host) -> (StorageKey, RequestHead) {
    let (mut first, skey) = mcp_forwarded(c, host);
    assert!(first.redirected_away(host, redirect::REDIRECT_CODE_DETAILS));
    let Some(claim) = host.handed.pop() else { panic!("handed over: {:?}", host.did) };
    host.handoffs.post(Handoff {
        skey: claim.skey,
        policy_index: claim.policy_index,
        url: "idemgate.test/mcp".into(),
        connection: Some(7),
        marked: true,
        from_context: 10,
        posted_ms: NOW,
        claim,
    });
    let target = head(
        "/mcp/target",
        None,
        &[("accept", "application/json"), ("x-envoy-original-url", "http://idemgate.test/mcp")],
    );
    (skey, target)
}

/// Found by the review of 86a57ed (present before it too): a stream re-created for an internal
/// redirect (a 307, the body re-sent) of an MCP `tools/call` whose key is in its body was never
/// matched to the claim its first stream handed over: the key is read from the re-created
/// stream's headers (`request::redirected_claim`), and there is none there. The target then ran as
/// a new call under a key its own first hop still held: a JSON-RPC error (`key-reused`, its path
/// being another; `request-in-flight` on the same path) for a call whose first hop executed, the
/// target never run, and the claim expired outcome-unknown. It continues the claim once its body
/// names the key, as an HTTP request's target does at its headers.
#[test]
fn an_mcp_call_redirected_with_its_key_in_its_body_continues_its_claim() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let (skey, target) = mcp_redirected(&c, &mut host);
    host.did.clear();
    let mut handoffs = std::mem::take(&mut host.handoffs);
    let at_headers =
        take_handoff(&mut handoffs, &[0], |i| c.shared_policy(i), &target, b"http://idemgate.test/mcp", on(skey), NOW);
    assert!(at_headers.is_none(), "no key in its headers");
    host.handoffs = handoffs;
    let Err(NotProtected::McpBody { route, policy }) = request::at_headers(&c, &target, None, false) else {
        panic!("an MCP POST waits for its body")
    };
    let mut m = Machine::new(None, true);
    assert_eq!(m.await_mcp_body(&mut host, route, policy, target), Flow::Pause);
    let n = host.body.len();
    assert_eq!(m.body_chunk(&mut host, n, true), Flow::Continue, "{:?}", host.did);
    assert!(host.did(&Did::McpReply { id: b"5".to_vec(), batch: vec![] }), "its refusals answer its id");
    assert!(host.did(&Did::Count(Count::RedirectsFollowed)), "{:?}", host.did);
    assert!(host.handoffs.is_empty(), "the claim is taken");
    let Some((req, _)) = m.forwarded() else { panic!("forwarded under the claim: {:?}", host.did) };
    assert_eq!((req.skey, req.owner), (skey, OwnerToken([7; 16])));
    // Its target's answer never releases the key: the first hop executed.
    let _ = m.settle(&mut host, Ended { outcome: Outcome::Release, detail: String::new() });
    assert_eq!(host.key_phase(&skey), Some(KeyPhase::Unknown));
}

/// Issue 39, item 8: a route timeout's outcome-unknown mark that the local tier fails to write
/// (a host error on every write) is not reported as marked: it is counted as a local error and
/// published `local-error`, and the claim stays as it was (in flight, never released), so a
/// retry is answered 409 until the lock expires and outcome-unknown after, never executed.
#[test]
fn a_failed_outcome_unknown_mark_is_a_local_error_and_keeps_the_claim() {
    let c = config(r#"{"scope": {"headers": ["authorization"]}}"#);
    let mut host = Host::new(&c);
    let (mut m, skey) = forwarded(&c, &mut host);
    host.sd.refuse_sets = true;
    let ended =
        Ended { outcome: Outcome::Unknown(crate::record::UnknownReason::UpstreamTimeout), detail: String::new() };
    let slug = m.settle(&mut host, ended);
    assert_eq!(slug, "local-error", "{:?}", host.did);
    assert!(host.did(&Did::Count(Count::LocalErrors)), "{:?}", host.did);
    assert!(host.did(&Did::Count(Count::UnknownOutcome)), "{:?}", host.did);
    assert!(!host.did(&Did::Count(Count::Released)), "{:?}", host.did);
    host.sd.refuse_sets = false;
    assert!(matches!(host.key_phase(&skey), Some(KeyPhase::Forwarded { .. })), "the claim is kept, never released");
    // The same mark on a working local tier: marked.
    let mut host = Host::new(&c);
    let (mut m, skey) = forwarded(&c, &mut host);
    let ended =
        Ended { outcome: Outcome::Unknown(crate::record::UnknownReason::UpstreamTimeout), detail: String::new() };
    assert_eq!(m.settle(&mut host, ended), "marked-unknown");
    assert!(!host.did(&Did::Count(Count::LocalErrors)), "{:?}", host.did);
    assert_eq!(host.key_phase(&skey), Some(KeyPhase::Unknown));
}

/// The review of this session's MCP change: an MCP call's answer is read by its content type and
/// coding (`mcp::answer_of`), so they are kept with the response even where the route's
/// `replay_exclude_headers` names them (without them a gzipped 400 carrying the call's response
/// read as no response, and the released status released the key); a plain route's exclusion
/// stands.
#[test]
fn an_mcp_answer_keeps_the_headers_it_is_read_by_whatever_the_replay_exclusions() {
    let c = config(&MCP.replace(
        r#""protocol": "mcp","#,
        r#""protocol": "mcp", "replay_exclude_headers": ["content-type", "content-encoding", "x-trace"],"#,
    ));
    let mut host = Host::new(&c);
    let (mut m, _) = mcp_forwarded(&c, &mut host);
    let headers =
        [(":status", "400"), ("content-type", "application/json"), ("content-encoding", "gzip"), ("x-trace", "t")];
    m.response_headers(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(), false);
    let Some((_, response)) = m.forwarded() else { panic!("forwarded") };
    let names: Vec<&str> = response.stored.iter().flat_map(|r| r.headers.iter().map(|(n, _)| n.as_str())).collect();
    assert_eq!(names, vec!["content-type", "content-encoding"]);
}

/// The review of d9644e2 with 9ff0837: "a redirect's target never releases the claim: its first
/// hop executed" (`redirect::after_first_hop`) was applied before the MCP settlement, which
/// turned an `input_required` answer into a release: an MCP `tools/call` whose first hop answered
/// 307 and whose target asked for input released the continued claim, so a retry under the key
/// ran it again. Even on a route that releases such rounds, a redirect's target keeps the answer.
#[test]
fn a_redirect_target_asking_for_input_never_releases_the_continued_claim() {
    let c = config(&MCP.replace(
        r#""key_arguments": ["idempotency_key"]"#,
        r#""key_arguments": ["idempotency_key"], "input_required": "release""#,
    ));
    let mut host = Host::new(&c);
    let (skey, target) = mcp_redirected(&c, &mut host);
    let Err(NotProtected::McpBody { route, policy }) = request::at_headers(&c, &target, None, false) else {
        panic!("an MCP POST waits for its body")
    };
    let mut m = Machine::new(None, true);
    assert_eq!(m.await_mcp_body(&mut host, route, policy, target), Flow::Pause);
    let n = host.body.len();
    assert_eq!(m.body_chunk(&mut host, n, true), Flow::Continue, "{:?}", host.did);
    assert!(host.did(&Did::Count(Count::RedirectsFollowed)), "{:?}", host.did);
    let asks: &[u8] = &question_asking("s1");
    let headers = [(":status", "200"), ("content-type", "application/json")];
    m.response_headers(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(), false);
    m.response_body(asks, true);
    let slug = m.settle(&mut host, Ended { outcome: Outcome::Store, detail: String::new() });
    assert_eq!(slug, "stored");
    assert_eq!(
        host.key_phase(&skey),
        Some(KeyPhase::Completed),
        "settled {slug}: a redirect's target released its claim"
    );
}

/// A server's question for round answers (id 5): an `input_required` result with `state` as its
/// `requestState`.
fn question_asking(state: &str) -> Vec<u8> {
    format!(
        r#"{{"jsonrpc":"2.0","id":5,"result":{{"resultType":"input_required","inputRequests":{{"q":{{"method":"elicitation/create","params":{{}}}}}},"requestState":"{state}"}}}}"#
    )
    .into_bytes()
}

/// Round `round` of an MCP call of `charge` under key `key`: `extra` holds its round's members
/// (`"inputResponses":...,"requestState":...`), empty for a first round.
fn round_call(id: u32, key: &str, amount: u32, extra: &str) -> Vec<u8> {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"charge","arguments":{{"idempotency_key":"{key}","amount":{amount}}}{sep}{extra}}}}}"#
    )
    .into_bytes()
}

/// What one request of a multi-round call met: forwarded (its machine, to settle), replayed
/// (the body), or refused (the problem's slug).
enum Met {
    Forwarded(Box<Machine<u32>>),
    Replayed(Vec<u8>),
    Refused(&'static str),
}

fn send_round(c: &Config, host: &mut Host, body: Vec<u8>) -> Met {
    host.did.clear();
    let (mut m, _) = mcp_post(c, host, true);
    host.body = body;
    let n = host.body.len();
    let flow = m.body_chunk(host, n, true);
    if flow == Flow::Continue && m.forwarded().is_some() {
        return Met::Forwarded(Box::new(m));
    }
    for d in &host.did {
        match d {
            Did::Replayed(b) => return Met::Replayed(b.clone()),
            Did::Reply(slug) => return Met::Refused(slug),
            _ => {}
        }
    }
    panic!("neither forwarded, replayed nor refused: {:?}", host.did)
}

fn answer_round(host: &mut Host, m: &mut Machine<u32>, answer: &[u8]) -> &'static str {
    let headers = [(":status", "200"), ("content-type", "application/json")];
    m.response_headers(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(), false);
    m.response_body(answer, true);
    m.settle(host, Ended { outcome: Outcome::Store, detail: String::new() })
}

/// Issue 40: a multi-round MCP call (2026-07-28) is one call under its key. By default
/// (`mcp.input_required` absent: "await") a round answered `input_required` leaves an awaiting
/// record: a re-sent round is replayed its question (never run again, even after the next round
/// started), the next round (other answers) runs once, a copy of it sent while it runs is in
/// flight, another call under the key is refused, and once the call ends every round is
/// replayed its final result. Before the awaiting record the default kept the question as the
/// call's answer: the second round was replayed the question and never ran.
#[test]
fn a_multi_round_call_awaits_input_and_runs_each_round_once() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let asks: &[u8] = &question_asking("s1");
    let done = br#"{"jsonrpc":"2.0","id":5,"result":{"content":[{"type":"text","text":"charged"}]}}"#;
    let round2 = r#""inputResponses":{"q":{"action":"accept","content":{"ok":true}}},"requestState":"s1""#;
    let mut runs = 0;
    // Round 1 runs and asks.
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-rounds", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    runs += 1;
    assert_eq!(answer_round(&mut host, &mut r1, asks), "stored");
    // Round 1 sent again: its question, not a run.
    match send_round(&c, &mut host, round_call(5, "k-rounds", 10, "")) {
        Met::Replayed(b) => assert!(String::from_utf8_lossy(&b).contains("input_required"), "{b:?}"),
        Met::Forwarded(_) => panic!("a re-sent round 1 ran the tool again"),
        Met::Refused(s) => panic!("a re-sent round 1 refused {s}"),
    }
    // Another call under the key while the call awaits: refused.
    match send_round(&c, &mut host, round_call(6, "k-rounds", 99, "")) {
        Met::Refused(s) => assert_eq!(s, "key-reused"),
        Met::Forwarded(_) => panic!("another call under an awaiting key ran"),
        Met::Replayed(b) => panic!("another call under the key got the question: {b:?}"),
    }
    // Round 2 runs once.
    let mut r2 = match send_round(&c, &mut host, round_call(5, "k-rounds", 10, round2)) {
        Met::Forwarded(m) => m,
        Met::Replayed(b) => panic!("round 2 was replayed round 1's question: {}", String::from_utf8_lossy(&b)),
        Met::Refused(s) => panic!("round 2 refused {s}"),
    };
    runs += 1;
    // While round 2 runs: a copy of it is in flight, and so is a re-sent round 1.
    for body in [round_call(5, "k-rounds", 10, round2), round_call(5, "k-rounds", 10, "")] {
        match send_round(&c, &mut host, body) {
            Met::Refused(s) => assert_eq!(s, "request-in-flight"),
            Met::Forwarded(_) => panic!("a round ran beside the running round 2"),
            Met::Replayed(b) => panic!("replayed while round 2 runs: {b:?}"),
        }
    }
    assert_eq!(answer_round(&mut host, &mut r2, done), "stored");
    // The call ended: every round, the first included, is replayed its final result.
    for body in [round_call(5, "k-rounds", 10, round2), round_call(5, "k-rounds", 10, "")] {
        match send_round(&c, &mut host, body) {
            Met::Replayed(b) => assert!(String::from_utf8_lossy(&b).contains("charged"), "{b:?}"),
            Met::Forwarded(_) => panic!("a round ran after the call ended"),
            Met::Refused(s) => panic!("refused {s} after the call ended"),
        }
    }
    assert_eq!(runs, 2, "one run per round");
}

/// Issue 40, found writing the event sequences down: a call that asks twice (round 2 answered
/// `input_required` again) awaits round 3; a copy of round 1 sent then (a duplicate client) is no
/// next round: it is answered the call's current question, never run again (a tool that acts
/// before it asks would act twice). Round 3 then finishes the call once.
#[test]
fn an_earlier_round_sent_after_a_later_one_asked_is_never_run_again() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let done = br#"{"jsonrpc":"2.0","id":5,"result":{"content":[{"type":"text","text":"charged"}]}}"#;
    let round = |state: &str, ok: bool| {
        format!(r#""inputResponses":{{"q":{{"action":"accept","content":{{"ok":{ok}}}}}}},"requestState":"{state}""#)
    };
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-thrice", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r1, &question_asking("s1")), "stored");
    let Met::Forwarded(mut r2) = send_round(&c, &mut host, round_call(5, "k-thrice", 10, &round("s1", false))) else {
        panic!("round 2 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r2, &question_asking("s2")), "stored");
    for (what, extra) in [("round 1", String::new()), ("round 2", round("s1", false))] {
        match send_round(&c, &mut host, round_call(5, "k-thrice", 10, &extra)) {
            Met::Replayed(b) => assert!(String::from_utf8_lossy(&b).contains("\"s2\""), "{what}: {b:?}"),
            Met::Forwarded(_) => panic!("{what} sent again after round 2 asked ran again"),
            Met::Refused(s) => panic!("{what} refused {s}"),
        }
    }
    let Met::Forwarded(mut r3) = send_round(&c, &mut host, round_call(5, "k-thrice", 10, &round("s2", true))) else {
        panic!("round 3 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r3, done), "stored");
    match send_round(&c, &mut host, round_call(5, "k-thrice", 10, "")) {
        Met::Replayed(b) => assert!(String::from_utf8_lossy(&b).contains("charged"), "{b:?}"),
        _ => panic!("round 1 after the call ended is replayed its final result"),
    }
}

/// Issue 40: a next round whose exchange is released (the upstream refused it before running
/// anything: a status the route releases, no JSON-RPC answer) leaves the call awaiting as it
/// was, never a free key: a re-sent round 1 is still answered the question, never run again, and
/// the next round sent again runs.
#[test]
fn a_released_next_round_leaves_the_call_awaiting() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let asks: &[u8] = &question_asking("s1");
    let round2 = r#""inputResponses":{"q":{"action":"accept","content":{"ok":true}}},"requestState":"s1""#;
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-released", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r1, asks), "stored");
    let Met::Forwarded(mut r2) = send_round(&c, &mut host, round_call(5, "k-released", 10, round2)) else {
        panic!("round 2 is forwarded")
    };
    let headers = [(":status", "503"), ("content-type", "text/plain")];
    r2.response_headers(headers.iter().map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())).collect(), false);
    r2.response_body(b"busy", true);
    r2.settle(&mut host, Ended { outcome: Outcome::Release, detail: String::new() });
    match send_round(&c, &mut host, round_call(5, "k-released", 10, "")) {
        Met::Replayed(b) => assert!(String::from_utf8_lossy(&b).contains("input_required"), "{b:?}"),
        Met::Forwarded(_) => panic!("round 1 ran again after round 2 was released"),
        Met::Refused(s) => panic!("round 1 refused {s}"),
    }
    assert!(matches!(send_round(&c, &mut host, round_call(5, "k-released", 10, round2)), Met::Forwarded(_)));
}

/// Issue 40: a next round whose outcome is unknown (forwarded, then its client went away before
/// any answer) may have run: the key is outcome-unknown for every round, the first included, as
/// for a one-round call; nothing runs again.
#[test]
fn a_next_round_whose_outcome_is_unknown_runs_nothing_again() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let asks: &[u8] = &question_asking("s1");
    let round2 = r#""inputResponses":{"q":{"action":"accept","content":{"ok":true}}},"requestState":"s1""#;
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-unknown", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r1, asks), "stored");
    let Met::Forwarded(mut r2) = send_round(&c, &mut host, round_call(5, "k-unknown", 10, round2)) else {
        panic!("round 2 is forwarded")
    };
    let gone = Outcome::Unknown(crate::record::UnknownReason::DownstreamGone);
    assert_eq!(r2.settle(&mut host, Ended { outcome: gone, detail: String::new() }), "marked-unknown");
    for body in [round_call(5, "k-unknown", 10, ""), round_call(5, "k-unknown", 10, round2)] {
        match send_round(&c, &mut host, body) {
            Met::Refused(s) => assert_eq!(s, "outcome-unknown"),
            Met::Forwarded(_) => panic!("a round ran again after round 2's outcome was lost"),
            Met::Replayed(b) => panic!("replayed {b:?} after round 2's outcome was lost"),
        }
    }
}

/// Review (h-review2): a round that answers an earlier question (it echoes that question's
/// `requestState`) is no next round of the call. Round 2 (state s1, `ok: false`) ran and asked
/// again (state s2); a copy of round 2 whose answers differ only in spelling (`1` / `1.0`, kept
/// as written by the canonical form), or another answer to question 1, is then taken as the
/// answer to question 2 and runs: round 2's step runs twice.
#[test]
fn a_round_answering_an_earlier_question_is_never_run() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let round = |state: &str, n: &str| {
        format!(r#""inputResponses":{{"q":{{"action":"accept","content":{{"n":{n}}}}}}},"requestState":"{state}""#)
    };
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-earlier-q", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r1, &question_asking("s1")), "stored");
    let Met::Forwarded(mut r2) = send_round(&c, &mut host, round_call(5, "k-earlier-q", 10, &round("s1", "1"))) else {
        panic!("round 2 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r2, &question_asking("s2")), "stored");
    for (what, extra) in
        [("round 2 spelled 1.0", round("s1", "1.0")), ("another answer to question 1", round("s1", "2"))]
    {
        match send_round(&c, &mut host, round_call(5, "k-earlier-q", 10, &extra)) {
            Met::Forwarded(_) => panic!("{what}, sent after round 2 asked again, ran (round 2's step twice)"),
            Met::Replayed(_) | Met::Refused(_) => {}
        }
    }
}

/// Review (h-review2): a first round sent again with an empty `inputResponses` (`{}`, as a
/// client may serialise "no answers yet") after the call asked is a round of its own digest
/// (`{}` is not "absent"): Round::Next, and round 1 runs again.
#[test]
fn a_first_round_with_empty_input_responses_is_not_a_next_round() {
    let c = config(MCP);
    let mut host = Host::new(&c);
    let asks: &[u8] = &question_asking("s1");
    let Met::Forwarded(mut r1) = send_round(&c, &mut host, round_call(5, "k-empty-in", 10, "")) else {
        panic!("round 1 is forwarded")
    };
    assert_eq!(answer_round(&mut host, &mut r1, asks), "stored");
    if let Met::Forwarded(_) = send_round(&c, &mut host, round_call(5, "k-empty-in", 10, r#""inputResponses":{}"#)) {
        panic!("round 1 sent again with \"inputResponses\":{{}} ran again");
    }
}
