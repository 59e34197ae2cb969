//! One protected request as a sans-IO machine (issue 26): the phase it is in, with the data that
//! phase needs (`Phase`), and one method per input (the request's headers admitted, a body chunk
//! or the trailers, an MCP POST's body, the store's answer to the call it is paused on, the
//! upstream's response as it flows, a stream ended for an internal redirect or re-created for
//! one, the exchange's end). Each method decides with `engine::request`'s, `engine::budget`'s and
//! `engine::settle`'s pure steps and says what to do through [`Io`]: commands out ([`Command`]:
//! reply this problem (as JSON-RPC to this MCP id), replay this record, continue, hold for a
//! wait, hand to the root, hand the claim over to a redirect's stream, push a root write, count,
//! log, publish), and what it uses synchronously: the clock (read lazily, at most what the
//! decision needs), the local tier (`Table` over `&mut dyn SharedData`, core code over a trait),
//! the worker's buffer budget count (`Io::budget`), the request body once whole, the router's
//! retries forbidden on a request's headers, a fresh owner token, and sending a store call
//! (built and dispatched by the caller, who answers with its handle `W` or why it could not be
//! sent).
//!
//! Two drivers: the HTTP context (`src/filter/http.rs`, Envoy's callbacks into inputs, commands
//! into host calls) and the in-memory world (`engine::world`, tests). Nothing here reads the
//! host.
//!
//! ```text
//! Pass ◀─(unprotected / passed)─ protect ─▶ Waiting{claim?} ─ body end ─▶ Calling ─▶ Forwarded
//!                                   │                          │            │           │
//!                                   └──────────────▶ Answered ◀┴────────────┘   end: settle
//! Held, Detached: the root answers (in_flight "wait", forwarding "detached")
//! ```

use std::sync::Arc;

use crate::config::{Forwarding, Hop, InFlight, OnUnavailable, Policy};
use crate::decision::{Outcome, HOP_PROBE_HEADER, IN_FLIGHT_RETRY_AFTER_SECONDS, UNAVAILABLE_RETRY_AFTER_SECONDS};
use crate::engine::budget::{Budget, Held};
use crate::engine::forwards::Forward;
use crate::engine::request::{
    self, Admitted, Answered, Asked, AtBodyEnd, AtMcpBody, KeyFrom, McpCall, Sent, Step, StoreAnswer, StoreMode,
};
use crate::engine::settle::{self, Claim, Count as SettleCount, Level};
use crate::engine::waiters::Waiter;
use crate::etcd::Fence;
use crate::failsafe::{self, Broken, Holding};
use crate::fingerprint::Fingerprint;
use crate::local::{Begin, Handle, LocalError, Seen, SharedData, Table};
use crate::mcp::Accepts;
use crate::owner::OwnerToken;
use crate::problem::ProblemKind;
use crate::record::{Creator, Lifetimes, Record, State, StoredResponse, NOT_REPLAYED};
use crate::redirect::{self, Handoff, Handoffs};
use crate::request::RequestHead;
use crate::scope::{CallerScope, StorageKey};
use crate::store::{StoreError, Transition, TransitionReply, ValueError};

pub use crate::engine::settle::Level as LogLevel;

/// Where a request is, with the data that phase needs (and nothing a phase cannot have).
/// One per request, held inline: boxing its large variants would cost an allocation per request.
/// `W`: the driver's handle of a store call in flight.
#[allow(clippy::large_enum_variant)]
pub enum Phase<W> {
    /// Not protected, or forwarded unprotected: every callback continues.
    Pass,
    /// A POST on an MCP route (`protocol: "mcp"`): whether it is protected is known only from
    /// its whole body, buffered in the worker's budget; nothing is held yet.
    McpBody { route: usize, policy: Arc<Policy>, head: RequestHead },
    /// Protected; waiting for the whole body, holding nothing (`seen`: the key's bucket as read
    /// at headers, for the claim at the body's end).
    Waiting { req: Protected, seen: Option<Seen> },
    /// A store call is in flight (claim-or-read, a take-over, or a read); the request is paused.
    Calling { req: Protected, call: Call<W> },
    /// Forwarded upstream under our claim(s); its response is copied while it flows.
    Forwarded { req: Protected, claim: Claimed, response: Response, redirected: bool },
    /// Sent upstream by the root context (`forwarding: "detached"`); the root answers.
    Detached { skey: StorageKey },
    /// Held until the first attempt with this key finishes (`in_flight: "wait"`); the root answers.
    Held { skey: StorageKey },
    /// We answered locally (problem or replay): never store our own reply.
    Answered,
}

/// A protected request: its route's policy and everything known once its key is.
#[derive(Clone, Debug)]
pub struct Protected {
    /// The route's index in the configuration (per-route counters, claims handed to the root).
    pub route: usize,
    pub policy: Arc<Policy>,
    pub head: RequestHead,
    pub skey: StorageKey,
    pub scope: CallerScope,
    pub creator: Creator,
    pub owner: OwnerToken,
    /// The key is derived at the end of the body (`derive_key.include_body`).
    pub derive_at_body: bool,
    /// An MCP `tools/call`: its JSON-RPC id (JSON text).
    pub mcp: Option<Vec<u8>>,
    /// An MCP `tools/call`: which round of its call it is (`mcp::Call::round`).
    pub mcp_round: Option<crate::record::RoundId>,
    /// An MCP call's next round: the awaiting record it continued, whose rounds
    /// (`Record::rounds_run`) the awaiting record it may leave lists, and which a release of
    /// the round restores.
    pub mcp_continued: Option<Box<Record>>,
    /// The request body, kept for detached forwarding.
    pub body: Vec<u8>,
}

/// The claim(s) a forwarded request holds.
#[derive(Clone, Copy, Debug)]
pub struct Claimed {
    pub handle: Option<Handle>,
    pub fp: Fingerprint,
    pub in_store: bool,
}

/// A store call in flight (`Phase::Calling`).
pub struct Call<W> {
    /// The local claim held meanwhile, if any.
    pub handle: Option<Handle>,
    pub fp: Fingerprint,
    pub asked: Asked,
    /// When it was sent (this proxy's clock).
    pub sent_at_ms: u64,
    /// `store.kind: "etcd"`: the value the claim-or-read found and its revision, which a
    /// take-over or stale-to-unknown decided on it compares.
    pub fence: Option<Fence>,
    /// The driver's handle of the call (its callout token and the request sent).
    pub wire: W,
}

/// The upstream's response as it flows (`Phase::Forwarded`).
#[derive(Default, Debug)]
pub struct Response {
    pub stored: Option<StoredResponse>,
    pub too_large: bool,
    pub complete: bool,
}

impl Protected {
    /// The request the headers protect (`request::at_headers`), `head` as it is forwarded: with
    /// a key derived now added (`Admitted::add_derived_key`) and the router's retries forbidden.
    /// Its creator is read from that head; a key derived with the body
    /// (`KeyFrom::DerivedAtBody`) waits for the body's end. No MCP call, no body kept.
    pub fn at_headers(a: Admitted, head: RequestHead, owner: OwnerToken) -> Protected {
        let derive_at_body = a.from == KeyFrom::DerivedAtBody;
        Protected { derive_at_body, ..Protected::new(a.route, a.policy, head, a.skey, a.scope, owner) }
    }

    /// A protected request of route `route` under `policy`, its creator read from `head`
    /// (`request::creator_of`): its key known now, no MCP call, no body kept.
    fn new(
        route: usize,
        policy: Arc<Policy>,
        head: RequestHead,
        skey: StorageKey,
        scope: CallerScope,
        owner: OwnerToken,
    ) -> Protected {
        let creator = request::creator_of(&policy, &head);
        Protected {
            route,
            policy,
            head,
            skey,
            scope,
            creator,
            owner,
            derive_at_body: false,
            mcp: None,
            mcp_round: None,
            mcp_continued: None,
            body: vec![],
        }
    }

    /// The storage key Envoy's filter state shows (none while the key waits for the body).
    pub fn published_key(&self) -> Option<&StorageKey> {
        (!self.derive_at_body).then_some(&self.skey)
    }

    /// The request's `accept-encoding` lines.
    pub fn accept_encoding(&self) -> Vec<Vec<u8>> {
        self.head.values("accept-encoding").into_iter().map(<[u8]>::to_vec).collect()
    }

    /// The root's waiter for this request held under fingerprint `fp` (`in_flight: "wait"`) by
    /// the driver's context `context_id`, from `now_ms` for `wait_ms`.
    pub fn waiter(&self, context_id: u32, fp: Fingerprint, now_ms: u64, wait_ms: u64) -> Waiter {
        Waiter {
            context_id,
            skey: self.skey,
            fp,
            request_id: self.creator.request_id.clone(),
            deadline_ms: now_ms.saturating_add(wait_ms),
            since_ms: now_ms,
            mismatch_status: self.policy.mismatch_status,
            policy_index: self.route,
            next_store_poll_ms: now_ms,
            polling: false,
            accept_encoding: self.accept_encoding(),
            max_decoded_bytes: self.policy.max_response_body_bytes,
            tombstone_seconds: self.policy.tombstone_seconds,
        }
    }

    /// This request as the root sends it upstream (`forwarding: "detached"`) to `cluster` with
    /// `timeout_ms` through `hop`, under `claim`, whose lock may be judged stale at
    /// `lock_deadline_ms`: its header lines in order, pseudo headers included, but for the
    /// hop-by-hop and recomputed ones (`NOT_REPLAYED`), `expect` and the hop probe's mark
    /// (`HOP_PROBE_HEADER`: only the root's probe carries it); a value that is not UTF-8 is left
    /// out. Its `context_id` is the driver's to set (0 here).
    fn forward(self, cluster: String, timeout_ms: u64, hop: Hop, claim: Claim, lock_deadline_ms: u64) -> Forward {
        let headers = self
            .head
            .headers
            .iter()
            .filter(|(n, _)| !NOT_REPLAYED.contains(&n.as_str()) && n != "expect" && n != HOP_PROBE_HEADER)
            .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.clone(), v.to_string())))
            .collect();
        Forward {
            context_id: 0,
            cluster,
            timeout_ms,
            hop,
            headers,
            body: self.body,
            claim,
            request_id: self.creator.request_id,
            sent_at_ms: 0,
            lock_deadline_ms,
        }
    }

    /// The claim `held` as the settlement and the root know it.
    pub fn claim(&self, held: Claimed) -> Claim {
        Claim {
            handle: held.handle,
            fp: held.fp,
            in_store: held.in_store,
            owner: self.owner,
            skey: self.skey,
            policy_index: self.route,
            creator: self.creator.clone(),
            log: log_line(Some(self), "", "").trim_start_matches("idemgate: outcome= ").to_string(),
            mcp_id: self.mcp.clone(),
            mcp_round: self.mcp_round,
            mcp_continued: self.mcp_continued.clone(),
        }
    }
}

/// The log line of a request's outcome.
pub fn log_line(req: Option<&Protected>, outcome: &str, extra: &str) -> String {
    let Some(r) = req else { return format!("idemgate: outcome={outcome} {extra}") };
    let mut line = format!(
        "idemgate: outcome={outcome} key={} scope={} method={} path={} request_id={}",
        r.skey.hex(),
        r.scope.short(),
        r.head.method,
        r.head.path_without_query(),
        r.creator.request_id
    );
    for (n, v) in &r.creator.log_values {
        line.push_str(&format!(" {n}={v}"));
    }
    if !extra.is_empty() {
        line.push(' ');
        line.push_str(extra);
    }
    line
}

/// What a request holds when `handle` is its local claim, never forwarded (`fail_closed`).
fn holding(handle: Option<Handle>) -> Holding {
    if handle.is_some() {
        Holding::LocalClaim
    } else {
        Holding::Nothing
    }
}

/// The outcome of a protected request whose client left before it was forwarded or answered.
pub const ABANDONED: &str = "abandoned";

/// The outcome of a stream Envoy ended for an internal redirect: its claim handed over.
pub const REDIRECTED: &str = "redirected";

/// What the callback the input came from returns to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
}

/// A counter the machine counts (the glue's `Counter` of the same name; `Released` without the
/// route, the others with it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Claimed,
    TakenOver,
    LocalEvictions,
    LocalErrors,
    StoreErrors,
    StorePassed,
    StoreReplays,
    StoreAnswersTooLate,
    RecordUnauthentic,
    UnknownOutcome,
    LostClaim,
    DerivedKeys,
    /// An MCP `tools/call` found protected at its body's end (other requests are counted at
    /// their headers by the driver).
    Protected,
    /// A stream re-created for an internal redirect continues its first stream's claim.
    RedirectsFollowed,
    Released,
    Stored,
    StoredWithoutBody,
    InternalErrors,
}

/// What a count says of the request's hold on its key, which the glue measures
/// (`Histogram::KeyHeldMs`): from its claim or take-over to its claim's settlement here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHold {
    /// The request holds the key from now on.
    Starts,
    /// The claim the request held (if it held one) is settled.
    Ends,
}

impl Count {
    /// Whether this count starts or ends the request's hold on its key (both glues' one rule).
    pub fn key_hold(self) -> Option<KeyHold> {
        match self {
            Count::Claimed | Count::TakenOver => Some(KeyHold::Starts),
            Count::Stored | Count::StoredWithoutBody | Count::UnknownOutcome | Count::LostClaim | Count::Released => {
                Some(KeyHold::Ends)
            }
            Count::LocalEvictions
            | Count::LocalErrors
            | Count::StoreErrors
            | Count::StorePassed
            | Count::StoreReplays
            | Count::StoreAnswersTooLate
            | Count::RecordUnauthentic
            | Count::DerivedKeys
            | Count::Protected
            | Count::RedirectsFollowed
            | Count::InternalErrors => None,
        }
    }
}

/// What the driver does, in the order given. Handed over one at a time (`Io::run`), never
/// stored: a large variant costs no allocation.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Command<'a> {
    Count(Count),
    /// A log line (built only when its level is logged).
    Log(Level, String),
    /// Answer with this problem (never stored); `req`: the request, when protected. The driver
    /// counts it by its kind, logs it, publishes its slug and sends it.
    Reply {
        req: Option<&'a Protected>,
        problem: ProblemKind,
        creator: Option<&'a Creator>,
    },
    /// Replay this completed record to the request.
    Replay {
        req: &'a Protected,
        record: Record,
    },
    /// Push this store write of `skey` through the root (fenced with `fence` on etcd), with the
    /// fallback sent if it keeps failing.
    Write {
        what: &'static str,
        skey: StorageKey,
        transition: Box<Transition>,
        fallback: Option<Box<Transition>>,
        fence: Option<&'a Fence>,
    },
    /// The key was derived from the body: put it in the request's headers.
    KeyDerived {
        header: &'a str,
        key: &'a str,
    },
    /// Hold the request until the first attempt with its key finishes (`in_flight: "wait"`).
    Hold {
        req: &'a Protected,
        fp: Fingerprint,
        wait_ms: u64,
    },
    /// Hand the request, built for the root to send (`forwarding: "detached"`), to the root:
    /// the driver sets its `context_id`.
    Detach(Box<Forward>),
    /// Leave the outcome slug in Envoy's filter state (the first wins).
    Publish {
        key: Option<StorageKey>,
        outcome: &'static str,
    },
    /// This request (on an MCP route) is answered in JSON-RPC: to `id` (JSON text; `null`
    /// before it is read), the ids of a refused batch, as the client accepts.
    McpReply {
        id: Vec<u8>,
        batch: Vec<Vec<u8>>,
        accepts: Accepts,
    },
    /// The request goes upstream under its claim: the driver leaves the request's mark (its
    /// storage key, `crate::redirect`) in Envoy's filter state with the life span `Request`,
    /// which only the streams Envoy re-creates for this request inherit, and remembers that it
    /// did for a hand-over.
    Mark {
        skey: StorageKey,
    },
    /// The stream was ended for an internal redirect: `claim` waits for the stream Envoy
    /// re-creates for it (`crate::redirect`), which was redirected from `url` (authority and
    /// path). The driver adds what only the host knows (the connection, its context, the
    /// request's mark, the time).
    HandOver {
        claim: Claim,
        url: String,
    },
}

/// A store call the machine asks the driver to send for the request.
#[derive(Debug)]
pub enum StoreOp<'a, W> {
    /// Claim-or-read: `record` written with `lifetimes` where the key is free.
    Claim { record: Record, lifetimes: Lifetimes },
    /// Replace the record the store holds (owner-checked; fenced with `fence` on etcd).
    TakeOver { transition: Transition, fence: Option<&'a Fence> },
    /// Read the key (a local outcome-unknown the store may have settled).
    Read,
    /// The call `W` again, with its script in full (Redis answered NOSCRIPT): the driver counts
    /// the script load and logs it (`store_script_missing`).
    Again(&'a W),
}

/// Why a store call was not sent.
#[derive(Debug)]
pub enum NotSent {
    /// Nothing was sent (no lease, dispatch refused): a store failure.
    Failed(StoreError),
    /// A resend impossible (the call carried its script): as a lost answer.
    Lost(StoreError),
    /// A broken invariant (no seal, a request that cannot be built): fail closed.
    Broken { broken: Broken, branch: &'static str },
}

/// What a settlement needs of its driver (`settle_claim`): the clock, the local tier, and
/// commands carried out. The root's settlements (detached answers, redirects never followed)
/// use it alone.
pub trait Effects {
    /// The time now (this proxy's clock), read at most once per callback.
    fn now_ms(&mut self) -> u64;
    /// The local tier and the shared data it runs on.
    fn local(&mut self) -> (&Table, &mut dyn SharedData);
    fn run(&mut self, c: Command<'_>);
    /// Whether a line of `level` is logged (the line is built only then).
    fn logs(&self, level: Level) -> bool;
}

/// The request's driver: `Effects`, the host's request (its body, its headers' router retries,
/// the worker's buffer budget and owner tokens), and sending store calls.
pub trait Io: Effects {
    /// The driver's handle of a store call in flight.
    type Wire;
    /// The worker's buffer budget now (its count is the driver's: every request of the worker
    /// counts in it, `engine::budget`).
    fn budget(&self) -> Budget;
    /// The worker's buffer budget count is now `buffered`.
    fn set_buffered(&mut self, buffered: u64);
    /// The request body as buffered (`size` bytes), read once it is whole; `req`: the request
    /// when protected.
    fn read_body(&mut self, req: Option<&Protected>, size: usize) -> Vec<u8>;
    /// Tells the router never to re-send the request (`RequestHead::forbid_router_retries`, on
    /// `head` and the host's header map): `false` if the host refused a change (the request must
    /// then not be forwarded).
    fn forbid_router_retries(&mut self, head: &mut RequestHead) -> bool;
    /// A fresh owner token for a request found protected now (an MCP `tools/call`).
    fn next_owner(&mut self) -> OwnerToken;
    /// The claim handed over under `skey` and policy `policy_index` by a stream redirected from
    /// `original_url` (`crate::redirect`: on this request's connection, by an earlier context,
    /// within the window), taken: for a stream re-created for an internal redirect whose key
    /// only its body names (an MCP `tools/call`). `None`: none fits.
    fn take_handoff(&mut self, skey: &StorageKey, policy_index: usize, original_url: &[u8]) -> Option<Handoff<Claim>>;
    /// Sends a store call for `req`.
    fn send(&mut self, req: &Protected, op: StoreOp<'_, Self::Wire>) -> Result<Self::Wire, NotSent>;
}

/// What a protected request's exchange came to, as its driver saw it end.
pub struct Ended {
    pub outcome: Outcome,
    /// The log line's facts.
    pub detail: String,
}

fn log<I: Effects + ?Sized>(io: &mut I, level: Level, line: impl FnOnce() -> String) {
    if io.logs(level) {
        io.run(Command::Log(level, line()));
    }
}

/// One request's machine.
pub struct Machine<W> {
    phase: Phase<W>,
    /// The store the request runs with (`None`: the local tier only).
    store: StoreMode,
    /// `hold_headers`: the request headers wait with the body.
    hold_headers: bool,
    /// What the request counts in the worker's buffer budget.
    held: Held,
    /// The request body's size so far (its last chunk's `body_size`).
    body_size: usize,
}

impl<W> Machine<W> {
    pub fn new(store: StoreMode, hold_headers: bool) -> Machine<W> {
        Machine { phase: Phase::Pass, store, hold_headers, held: Held::default(), body_size: 0 }
    }

    pub fn phase(&self) -> &Phase<W> {
        &self.phase
    }

    /// The protected request, in a phase that holds it.
    pub fn protected(&self) -> Option<&Protected> {
        match &self.phase {
            Phase::Waiting { req, .. } | Phase::Calling { req, .. } | Phase::Forwarded { req, .. } => Some(req),
            _ => None,
        }
    }

    /// A POST on an MCP route (`request::at_headers`'s `NotProtected::McpBody`): whether it is
    /// protected is known from its whole body. Without `hold_headers` its headers go upstream
    /// now, before the body says, so the router is told now not to re-send it, as for any
    /// protected request (the one change an unprotected MCP POST then sees).
    pub fn await_mcp_body<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        route: usize,
        policy: Arc<Policy>,
        mut head: RequestHead,
    ) -> Flow {
        if !self.hold_headers && !io.forbid_router_retries(&mut head) {
            return self.fail_closed(io, None, Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
        }
        self.phase = Phase::McpBody { route, policy, head };
        if self.hold_headers {
            Flow::Pause
        } else {
            Flow::Continue
        }
    }

    /// A stream Envoy re-created for an internal redirect continues the claim its first stream
    /// handed over (`h`, taken with `take_handoff`; `policy` and `scope` as it read them): counted,
    /// the router told never to re-send it, forwarded under the claim, settled at this stream's
    /// end (where nothing releases it: its first hop executed). If the host refuses to forbid
    /// the router's retries it fails closed, the claim kept (judged outcome-unknown once its lock
    /// expires): never re-sent.
    pub fn adopt<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        h: Handoff<Claim>,
        policy: Arc<Policy>,
        mut head: RequestHead,
        scope: CallerScope,
    ) -> Flow {
        io.run(Command::Count(Count::RedirectsFollowed));
        let retries_forbidden = io.forbid_router_retries(&mut head);
        self.continue_claim(io, h, policy, head, scope, retries_forbidden)
    }

    /// `adopt` once the router's retries are forbidden (`retries_forbidden`: the host accepted).
    fn continue_claim<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        h: Handoff<Claim>,
        policy: Arc<Policy>,
        head: RequestHead,
        scope: CallerScope,
        retries_forbidden: bool,
    ) -> Flow {
        let c = h.claim;
        let req = Protected {
            route: c.policy_index,
            policy,
            head,
            skey: c.skey,
            scope,
            creator: c.creator,
            owner: c.owner,
            derive_at_body: false,
            mcp: c.mcp_id,
            mcp_round: c.mcp_round,
            mcp_continued: c.mcp_continued,
            body: vec![],
        };
        if !retries_forbidden {
            return self.broken(io, Some(req), Broken::HostCallFailed, "redirect_retry_guard", Holding::Forwarded);
        }
        log(io, Level::Debug, || log_line(Some(&req), "redirect_followed", &format!("from={}", h.url)));
        let claim = Claimed { handle: c.handle, fp: c.fp, in_store: c.in_store };
        self.phase = Phase::Forwarded { req, claim, response: Response::default(), redirected: true };
        Flow::Continue
    }

    /// Forwarded, and no response reached the filter: whether Envoy ended the stream for an
    /// internal redirect is read from its response code details (`redirected_away`), read
    /// only then.
    pub fn wants_code_details(&self) -> bool {
        matches!(&self.phase, Phase::Forwarded { response, .. } if response.stored.is_none())
    }

    /// The forwarded exchange's stream ended with Envoy's response code details
    /// `code_details`: ended for an internal redirect (the router took the upstream's 3xx, so no
    /// response reached this filter), its claim is handed over to the stream Envoy re-creates
    /// (`Command::HandOver`), which settles it, and `true`; otherwise nothing is done (settle it).
    pub fn redirected_away<I: Io<Wire = W>>(&mut self, io: &mut I, code_details: &str) -> bool {
        let Phase::Forwarded { req, claim, response, .. } = &self.phase else { return false };
        if response.stored.is_some() || code_details != redirect::REDIRECT_CODE_DETAILS {
            return false;
        }
        let claim = req.claim(*claim);
        let url = format!("{}{}", req.head.authority, req.head.path);
        let key = req.published_key().copied();
        self.phase = Phase::Pass;
        io.run(Command::HandOver { claim, url });
        io.run(Command::Publish { key, outcome: REDIRECTED });
        true
    }

    /// The request is over for the machine (its claim handed over to a re-created stream, or
    /// its exchange logged): every callback continues.
    pub fn end(&mut self) {
        self.phase = Phase::Pass;
    }

    /// Takes the phase out, leaving `Pass`: each input starts so and leaves the next phase.
    fn take(&mut self) -> Phase<W> {
        std::mem::replace(&mut self.phase, Phase::Pass)
    }

    fn on_unavailable(&self) -> OnUnavailable {
        self.store.unwrap_or(OnUnavailable::Reject)
    }

    /// A protected request's headers, admitted: look at headers (nothing is claimed before the
    /// body is whole: a key held by a live claim gets its 409 without buffering the body), or
    /// wait for the body when the key depends on it; with `end_of_stream` the fingerprint is
    /// known now.
    pub fn protect<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, end_of_stream: bool) -> Flow {
        if req.derive_at_body {
            // The key depends on the body: decide once it is here.
            return self.wait_for_body(io, req, None);
        }
        if end_of_stream {
            let fp = request::fingerprint_without_body(&req.policy, &req.head);
            return self.begin(io, req, Some(fp), None);
        }
        self.begin(io, req, None, None)
    }

    /// A protected request (an MCP call) whose fingerprint is known now.
    pub fn protect_with<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, fp: Fingerprint) -> Flow {
        self.begin(io, req, Some(fp), None)
    }

    /// A broken invariant met where the driver stands (fault tests: a policy lost): refused by
    /// the one rule, never forwarded; `req` for a request not yet given to the machine.
    /// `held`: what a request given here holds (`Holding::Forwarded` for a redirect adopted).
    pub fn broken<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Option<Protected>,
        broken: Broken,
        branch: &'static str,
        held: Holding,
    ) -> Flow {
        match (req, self.take()) {
            (Some(req), _) => self.fail_closed(io, Some(&req), broken, branch, None, held),
            (None, Phase::Waiting { req, .. }) => {
                self.fail_closed(io, Some(&req), broken, branch, None, Holding::Nothing)
            }
            (None, _) => self.fail_closed(io, None, broken, branch, None, Holding::Nothing),
        }
    }

    /// The request is refused with `problem` (its body too large or over the VM's budget, or
    /// refused at its headers); it holds nothing yet.
    pub fn refuse<I: Io<Wire = W>>(&mut self, io: &mut I, problem: ProblemKind) -> Flow {
        match self.take() {
            Phase::Waiting { req, .. } => self.answer(io, Some(&req), problem, None),
            _ => self.answer(io, None, problem, None),
        }
    }

    /// The body goes first in the buffer budget: the bucket read at headers is dropped (the
    /// claim at the body's end reads it again).
    fn drop_seen(&mut self) {
        if let Phase::Waiting { seen, .. } = &mut self.phase {
            *seen = None;
        }
    }

    /// Gives back what the request counts in the worker's buffer budget (its body once whole or
    /// refused, and at its end).
    pub fn release_budget<I: Io<Wire = W>>(&mut self, io: &mut I) {
        if self.held != Held::default() {
            let after = self.held.release(io.budget().buffered);
            io.set_buffered(after);
        }
    }

    /// A chunk of the request body (`body_size` bytes so far; `end`: the last): buffered in
    /// the worker's budget while the request waits for its body (a protected request's, or an
    /// MCP POST's), refused over the route's limit (413) or the budget (503), and decided once
    /// whole. A request paused on a store call keeps buffering; any other continues.
    pub fn body_chunk<I: Io<Wire = W>>(&mut self, io: &mut I, body_size: usize, end: bool) -> Flow {
        self.body_size = body_size;
        let budget = io.budget();
        let (counted, mcp) = match &self.phase {
            Phase::Waiting { req, .. } => (self.held.chunk(body_size as u64, budget, &req.policy), false),
            Phase::McpBody { policy, .. } => (self.held.chunk(body_size as u64, budget, policy), true),
            Phase::Calling { .. } => return Flow::Pause,
            _ => return Flow::Continue,
        };
        io.set_buffered(counted.buffered);
        if counted.seen_dropped {
            self.drop_seen();
        }
        if let Some(problem) = counted.refused {
            if mcp {
                // An MCP POST is refused as a JSON-RPC error with id null (the id is not read).
                if let Phase::McpBody { head, .. } = self.take() {
                    io.run(Command::McpReply { id: b"null".to_vec(), batch: vec![], accepts: accepts(&head) });
                }
            }
            return self.refuse(io, problem);
        }
        if !end {
            return Flow::Pause;
        }
        if mcp {
            self.mcp_body_complete(io)
        } else {
            self.body_complete(io, None)
        }
    }

    /// Whether the request trailers are wanted: a protected request waiting for its body (they
    /// reach the upstream with it, so they are part of its fingerprint).
    pub fn wants_trailers(&self) -> bool {
        matches!(self.phase, Phase::Waiting { .. })
    }

    /// The request trailers (`Some` when wanted): they end the body.
    pub fn trailers<I: Io<Wire = W>>(&mut self, io: &mut I, trailers: Option<Vec<(String, Vec<u8>)>>) -> Flow {
        match &self.phase {
            Phase::Waiting { .. } => self.body_complete(io, trailers),
            Phase::McpBody { .. } => self.mcp_body_complete(io),
            Phase::Calling { .. } => Flow::Pause,
            _ => Flow::Continue,
        }
    }

    /// The whole body of a protected request is here (with the trailers, if they ended it):
    /// read, given back to the budget, fingerprinted.
    fn body_complete<I: Io<Wire = W>>(&mut self, io: &mut I, trailers: Option<Vec<(String, Vec<u8>)>>) -> Flow {
        let body = io.read_body(self.protected(), self.body_size);
        self.release_budget(io);
        self.body_end(io, body, trailers)
    }

    /// The whole body of an MCP POST: passed untouched unless it is a protected `tools/call`,
    /// which is then protected as an HTTP request with a key is, its fingerprint the tool name
    /// and canonical arguments (`crate::mcp`); refusals are JSON-RPC errors to its id.
    fn mcp_body_complete<I: Io<Wire = W>>(&mut self, io: &mut I) -> Flow {
        let Phase::McpBody { route, policy, mut head } = self.take() else { return Flow::Continue };
        let body = io.read_body(None, self.body_size);
        self.release_budget(io);
        let call = match request::at_mcp_body(&policy, &head, &body) {
            AtMcpBody::Pass => return Flow::Continue,
            AtMcpBody::PolicyMissing => {
                return self.fail_closed(io, None, Broken::PolicyMissing, "mcp_body_complete", None, Holding::Nothing)
            }
            AtMcpBody::Refuse { id, batch, problem } => {
                io.run(Command::McpReply { id, batch, accepts: accepts(&head) });
                return self.answer(io, None, problem, None);
            }
            AtMcpBody::Protect(call) => *call,
        };
        io.run(Command::McpReply { id: call.id.clone(), batch: vec![], accepts: accepts(&head) });
        // A stream Envoy re-created for an internal redirect (a 307: the body re-sent) names the
        // key in its body only: the claim its first stream handed over is taken now, as an HTTP
        // request's target takes it at its headers (`take_handoff`), under the same rules, in
        // the scope of the URL it was redirected from (`request::first_hop_scope`), under the key
        // its first stream read (a derived one derived again at that URL:
        // `request::mcp_first_hop_skey`).
        let original_url = head.values(redirect::ORIGINAL_URL_HEADER).first().map(|u| u.to_vec());
        let handoff = original_url.and_then(|u| {
            let first = request::first_hop_scope(&policy, &head, &u);
            let first_skey = request::mcp_first_hop_skey(&policy, &head, &u, &call)?;
            io.take_handoff(&first_skey, route, &u).map(|h| (h, first))
        });
        let McpCall { id, tool, scope, skey, derived, digest, round, .. } = call;
        if let Some((h, scope)) = handoff {
            io.run(Command::Count(Count::RedirectsFollowed));
            // Without `hold_headers` they were forbidden at the headers (`await_mcp_body`).
            let forbidden = !self.hold_headers || io.forbid_router_retries(&mut head);
            return self.continue_claim(io, h, policy, head, scope, forbidden);
        }
        if derived {
            io.run(Command::Count(Count::DerivedKeys));
        }
        io.run(Command::Count(Count::Protected));
        if self.hold_headers && !io.forbid_router_retries(&mut head) {
            return self.fail_closed(io, None, Broken::HostCallFailed, "mcp_retry_guard", None, Holding::Nothing);
        }
        let owner = io.next_owner();
        let fp = request::mcp_fingerprint(&policy, &head, digest);
        let detached = matches!(policy.forwarding, Forwarding::Detached { .. });
        let req = Protected {
            mcp: Some(id),
            mcp_round: Some(round),
            body: if detached { body } else { vec![] },
            ..Protected::new(route, policy, head, skey, scope, owner)
        };
        log(io, Level::Debug, || log_line(Some(&req), "mcp_tools_call", &format!("tool={tool}")));
        self.protect_with(io, req, fp)
    }

    /// The whole body (and trailers, in the head) is here: fingerprint it and go on.
    pub fn body_end<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        body: Vec<u8>,
        trailers: Option<Vec<(String, Vec<u8>)>>,
    ) -> Flow {
        let Phase::Waiting { mut req, seen } = self.take() else {
            return self.fail_closed(io, None, Broken::ImpossibleDecision, "body_end", None, Holding::Nothing);
        };
        if let Some(t) = trailers {
            // Trailers reach the upstream with the request: part of its fingerprint.
            req.head.trailers = t;
        }
        let (fp, derived, keep_body) =
            match request::at_body_end(&req.policy, &mut req.head, &req.scope, req.derive_at_body, &body) {
                AtBodyEnd::Fingerprinted { fp, derived, keep_body } => (fp, derived, keep_body),
                // No key can be derived: the request is not protected.
                AtBodyEnd::Pass => return Flow::Continue,
                // Nothing was claimed yet (the key is derived only now): refused as sent.
                AtBodyEnd::Refuse(problem) => return self.answer(io, Some(&req), problem, None),
            };
        if let Some(derived) = derived {
            // `derive_key.include_body`: the key (and so the storage key) is known only now.
            req.skey = derived.skey;
            req.derive_at_body = false;
            io.run(Command::KeyDerived { header: &req.policy.header, key: derived.key.as_str() });
            io.run(Command::Count(Count::DerivedKeys));
            log(io, Level::Debug, || log_line(Some(&req), "derived_key", "key_source=derived"));
        }
        if keep_body {
            req.body = body;
        }
        self.begin(io, req, Some(fp), seen)
    }

    /// The local tier's `begin` for `req` (`fp` once the body is complete; `seen`: the bucket as
    /// read at headers), acted on.
    fn begin<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        fp: Option<Fingerprint>,
        seen: Option<Seen>,
    ) -> Flow {
        let now = io.now_ms();
        let (table, sd) = io.local();
        let begun = table.begin_after(sd, req.skey, fp, now, &req.policy, req.owner, &req.creator, seen);
        if let Ok(Begin::Claimed { took_over, evicted, .. }) = &begun {
            io.run(Command::Count(if *took_over { Count::TakenOver } else { Count::Claimed }));
            if *evicted {
                io.run(Command::Count(Count::LocalEvictions));
            }
        }
        let step = request::after_local(begun, fp, self.store, now);
        self.run(io, req, step, None)
    }

    /// The answer to the store call the request is paused on, parsed by the driver (`fence`:
    /// the etcd value a claim-or-read found). `None` when not calling.
    pub fn calling(&self) -> Option<(&Protected, &Call<W>)> {
        match &self.phase {
            Phase::Calling { req, call } => Some((req, call)),
            _ => None,
        }
    }

    /// The store answered the call the request is paused on.
    pub fn store_answer<I: Io<Wire = W>>(&mut self, io: &mut I, answer: StoreAnswer, fence: Option<Fence>) -> Flow {
        let Phase::Calling { req, call } = self.take() else { return Flow::Continue };
        if let StoreAnswer::TakeOver(Ok(TransitionReply::Changed | TransitionReply::ClaimGoneRewritten)) = &answer {
            io.run(Command::Count(Count::TakenOver));
        }
        let sent = Sent { handle: call.handle, fp: call.fp, sent_at_ms: call.sent_at_ms, round: req.mcp_round };
        let now = io.now_ms();
        let answered = request::after_store_answer(answer, &sent, &req.policy, self.on_unavailable(), now);
        if call.asked == Asked::Claim && matches!(answered, Answered::Next(Step::Replay { .. })) {
            io.run(Command::Count(Count::StoreReplays));
        }
        match answered {
            Answered::Next(step) => self.run(io, req, step, fence.or(call.fence)),
            Answered::Resend => self.send_with_script(io, req, call),
            Answered::Lost { error } => self.store_answer_lost(io, req, call.handle, call.fence.as_ref(), &error),
            // The store claimed the key for us, so late that the claim's lock may already be
            // judged stale: another request may then have marked it outcome-unknown or taken it
            // over and forwarded. Handled as a lost answer: released owner-checked (a no-op if
            // the key changed hands), never forwarded.
            Answered::TooLate { waited_ms, lock_ms, run_ms } => {
                io.run(Command::Count(Count::StoreAnswersTooLate));
                let why = format!(
                    "the store's claim answer came {waited_ms} ms after the claim was sent, too late for its lock ({lock_ms} ms; the upstream may run {run_ms} ms more)"
                );
                // The store answered: this is no outage, so never forwarded unprotected either,
                // even with on_unavailable "pass" (another request may hold the key by now).
                self.release_lost_claim(io, &req, call.fence.as_ref());
                self.store_failed_as(io, req, call.handle, &StoreError::Garbled(why), OnUnavailable::Reject)
            }
        }
    }

    /// The store's answer to the call the request is paused on could not be read as one
    /// (`e`, before parsing: no seal): a store failure.
    pub fn store_unreadable<I: Io<Wire = W>>(&mut self, io: &mut I, e: &StoreError) -> Flow {
        let Phase::Calling { req, call } = self.take() else { return Flow::Continue };
        self.store_failed(io, req, call.handle, e)
    }

    /// Redis answered our claim-or-read (or take-over) NOSCRIPT: it does not hold the script, so
    /// the script did not run and nothing was claimed. The same call goes once more with the
    /// script in full (`EVAL`, which also loads it). A NOSCRIPT to a call that carried its script
    /// is no answer Redis gives: taken as a lost answer (503, the claim released owner-checked).
    fn send_with_script<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, call: Call<W>) -> Flow {
        let now = io.now_ms();
        let again = io.send(&req, StoreOp::Again(&call.wire));
        match again {
            Ok(wire) => {
                self.phase = Phase::Calling { req, call: Call { wire, sent_at_ms: now, ..call } };
                Flow::Pause
            }
            Err(NotSent::Lost(e)) => self.store_answer_lost(io, req, call.handle, call.fence.as_ref(), &e),
            Err(not) => self.not_sent(io, req, call.handle, not),
        }
    }

    fn not_sent<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, handle: Option<Handle>, not: NotSent) -> Flow {
        match not {
            NotSent::Failed(e) | NotSent::Lost(e) => self.store_failed(io, req, handle, &e),
            NotSent::Broken { broken, branch } => {
                self.fail_closed(io, Some(&req), broken, branch, handle, holding(handle))
            }
        }
    }

    /// Sends `op` for `req` and pauses on it (`Phase::Calling`).
    #[allow(clippy::too_many_arguments)]
    fn call<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        op: StoreOp<'_, W>,
        handle: Option<Handle>,
        fp: Fingerprint,
        asked: Asked,
        fence: Option<Fence>,
    ) -> Flow {
        let now = io.now_ms();
        match io.send(&req, op) {
            Ok(wire) => {
                let call = Call { handle, fp, asked, sent_at_ms: now, fence, wire };
                self.phase = Phase::Calling { req, call };
                Flow::Pause
            }
            Err(not) => self.not_sent(io, req, handle, not),
        }
    }

    /// The claim (or take-over) was sent but its answer is lost or garbled: it may have landed
    /// (a store that timed out can still run it). Release it, owner-checked, through the root,
    /// which retries with backoff: otherwise a claim nothing executed under would answer retries
    /// with in-flight, then outcome-unknown. Then answer as for any store failure.
    fn store_answer_lost<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        handle: Option<Handle>,
        fence: Option<&Fence>,
        e: &StoreError,
    ) -> Flow {
        self.release_lost_claim(io, &req, fence);
        self.store_failed(io, req, handle, e)
    }

    /// The store could not answer: 503 (reject) or forward unprotected (pass).
    fn store_failed<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        handle: Option<Handle>,
        e: &StoreError,
    ) -> Flow {
        let Some(on_unavailable) = self.store else {
            self.release_local(io, handle);
            return self.fail_closed(io, Some(&req), Broken::StoreMissing, "store_failed", None, Holding::Nothing);
        };
        self.store_failed_as(io, req, handle, e, on_unavailable)
    }

    /// `store_failed`, with `on_unavailable` given.
    fn store_failed_as<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        handle: Option<Handle>,
        e: &StoreError,
        on_unavailable: OnUnavailable,
    ) -> Flow {
        io.run(Command::Count(Count::StoreErrors));
        self.release_local(io, handle);
        let step = request::after_store_failure(&req.policy, on_unavailable);
        match &step {
            Step::PassUnprotected => {
                io.run(Command::Count(Count::StorePassed));
                log(io, Level::Warn, || log_line(Some(&req), "store_unavailable_passed", &format!("error={e}")));
            }
            Step::Reply { .. } => {
                log(io, Level::Warn, || log_line(Some(&req), "store_unavailable", &format!("error={e}")))
            }
            _ => {}
        }
        self.run(io, req, step, None)
    }

    /// Executes the request's next step (`crate::engine::request`). `fence`: the store value a
    /// store answer decided on, which a take-over or stale-to-unknown compares.
    fn run<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, step: Step, fence: Option<Fence>) -> Flow {
        match step {
            Step::WaitForBody { seen } => self.wait_for_body(io, req, seen),
            Step::PauseForBody => {
                self.phase = Phase::Waiting { req, seen: None };
                Flow::Pause
            }
            Step::ClaimInStore { handle, fp } => {
                let lifetimes = Lifetimes::of(&req.policy);
                let record = Record::in_progress(fp, req.creator.clone(), req.owner, io.now_ms(), &lifetimes);
                self.call(io, req, StoreOp::Claim { record, lifetimes }, handle, fp, Asked::Claim, None)
            }
            // This proxy holds the key as outcome-unknown: read (never claim) what the store
            // holds, in case an operator settled it there.
            Step::ReadSettled { fp } => self.call(io, req, StoreOp::Read, None, fp, Asked::Settled, None),
            Step::Forward { handle, fp, in_store, lock_from_ms } => {
                self.forward(io, req, Claimed { handle, fp, in_store }, lock_from_ms)
            }
            Step::Replay { record, cache } => {
                let now = io.now_ms();
                // The key's tombstone (`Record::is_tombstone`): never replayed, never cached.
                if record.is_tombstone_for(req.policy.tombstone_seconds, now) {
                    self.release_local(io, cache);
                    return self.replay(io, &req, record);
                }
                // The next round of a call awaiting input, met in the local tier (a store's
                // awaiting value is continued in the store: `request::after_claim`).
                if record.round(req.mcp_round.as_ref()) == crate::record::Round::Next {
                    self.release_local(io, cache);
                    return self.continue_local(io, req, record);
                }
                if let Some(h) = cache {
                    let (table, sd) = io.local();
                    let _ = table.complete(sd, &h, record.clone(), now);
                }
                // An awaiting record met by the round that asked: its question.
                self.replay(io, &req, record.as_replayed())
            }
            Step::InFlight { creator, release, fp } => {
                self.release_local(io, release);
                self.in_flight_or_wait(io, req, fp, creator.as_ref())
            }
            Step::Reply { problem, creator, release } => {
                self.release_local(io, release);
                self.answer(io, Some(&req), problem, creator.as_ref())
            }
            Step::MarkUnknown { old_owner, creator, release } => {
                self.release_local(io, release);
                let unknown = Transition::stale_to_unknown(old_owner, &Lifetimes::of(&req.policy));
                self.enqueue(io, &req, fence.as_ref(), "stale_to_unknown", unknown);
                self.answer(io, Some(&req), ProblemKind::OutcomeUnknown, Some(&creator))
            }
            Step::TakeOver { handle, fp, old, free } => {
                let lifetimes = Lifetimes::of(&req.policy);
                let record = Record::in_progress(fp, req.creator.clone(), req.owner, io.now_ms(), &lifetimes);
                let transition = Transition::take_over(old.owner, req.owner, record, free, &lifetimes);
                self.take_over(io, req, handle, fp, transition, fence)
            }
            Step::Continue { handle, fp, old } => {
                let mut req = req;
                req.mcp_continued = Some(Box::new(old.record.clone()));
                let lifetimes = Lifetimes::of(&req.policy);
                let record = Record::in_progress(fp, req.creator.clone(), req.owner, io.now_ms(), &lifetimes);
                let transition = Transition::continue_round(old.owner, req.owner, record, &lifetimes);
                self.take_over(io, req, handle, fp, transition, fence)
            }
            Step::Unreadable { why, problem, release } => {
                self.release_local(io, release);
                self.count_unreadable(io, &req, &why);
                log(io, Level::Warn, || log_line(Some(&req), "record_unreadable", &format!("error={why}")));
                self.answer(io, Some(&req), problem, None)
            }
            Step::UnknownStands { unreadable } => {
                if let Some(why) = unreadable {
                    self.count_unreadable(io, &req, &why);
                }
                io.run(Command::Count(Count::UnknownOutcome));
                self.answer(io, Some(&req), ProblemKind::OutcomeUnknown, None)
            }
            Step::LocalFailed(e) => self.local_error(io, &req, e),
            Step::PassUnprotected => {
                io.run(Command::Publish { key: req.published_key().copied(), outcome: "passed-unprotected" });
                self.phase = Phase::Pass;
                Flow::Continue
            }
            Step::FailClosed { broken, branch, handle } => {
                self.fail_closed(io, Some(&req), broken, branch, handle, holding(handle))
            }
        }
    }

    /// The next round of an MCP call whose awaiting record (`record`) the local tier holds:
    /// continued there in one CAS (`local::Table::continue_round`), then claimed in the store
    /// if there is one (where the awaiting value is continued owner-checked), else forwarded.
    /// Another round that got there first holds the key: in flight.
    fn continue_local<I: Io<Wire = W>>(&mut self, io: &mut I, mut req: Protected, record: Record) -> Flow {
        let now = io.now_ms();
        req.mcp_continued = Some(Box::new(record.clone()));
        let fp = record.fingerprint;
        let Some(round) = req.mcp_round else {
            return self.fail_closed(
                io,
                Some(&req),
                Broken::ImpossibleDecision,
                "continue_round",
                None,
                Holding::Nothing,
            );
        };
        let (table, sd) = io.local();
        match table.continue_round(sd, req.skey, fp, &round, now, &req.policy, req.owner, &req.creator) {
            Ok(Some(handle)) => {
                io.run(Command::Count(Count::Claimed));
                let step = request::after_fingerprint(Some(handle), fp, self.store, now);
                self.run(io, req, step, None)
            }
            Ok(None) => {
                let problem = ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS };
                self.answer(io, Some(&req), problem, Some(&record.creator))
            }
            Err(e) => self.local_error(io, &req, e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn take_over<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        handle: Option<Handle>,
        fp: Fingerprint,
        transition: Transition,
        fence: Option<Fence>,
    ) -> Flow {
        let now = io.now_ms();
        let sent = io.send(&req, StoreOp::TakeOver { transition, fence: fence.as_ref() });
        match sent {
            Ok(wire) => {
                let call = Call { handle, fp, asked: Asked::TakeOver, sent_at_ms: now, fence, wire };
                self.phase = Phase::Calling { req, call };
                Flow::Pause
            }
            Err(not) => self.not_sent(io, req, handle, not),
        }
    }

    /// At the request headers, a protected request whose decision needs its body. With
    /// `hold_headers` (the default; Envoy's `allow_on_headers_stop_iteration`) the headers wait
    /// too. Without it the headers go on to the router, which starts the upstream request, while
    /// the body callbacks return `Pause` (Envoy buffers the body): the upstream never receives the
    /// request's end before the claim, and a request refused then is answered locally, which
    /// resets its upstream stream (a request never complete, never executed).
    fn wait_for_body<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, seen: Option<Seen>) -> Flow {
        // The bucket read at headers is kept for the claim only within the worker's buffer budget
        // (counted with the bodies being buffered): beyond it, the claim reads the bucket again.
        let seen = seen.filter(|s| match self.held.keep_seen(s.bytes(), io.budget()) {
            Some(after) => {
                io.set_buffered(after);
                true
            }
            None => false,
        });
        self.phase = Phase::Waiting { req, seen };
        if self.hold_headers {
            Flow::Pause
        } else {
            Flow::Continue
        }
    }

    /// A request meeting its key in flight: 409 now, or (wait mode) held until the first attempt
    /// finishes. The fingerprint is needed to tell a replay from a 422, so a wait starts once the
    /// body is complete.
    fn in_flight_or_wait<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Protected,
        fp: Option<Fingerprint>,
        creator: Option<&Creator>,
    ) -> Flow {
        match (req.policy.in_flight, fp) {
            (InFlight::Wait { .. }, None) => self.wait_for_body(io, req, None),
            (InFlight::Wait { wait_ms }, Some(fp)) => {
                io.run(Command::Hold { req: &req, fp, wait_ms });
                self.phase = Phase::Held { skey: req.skey };
                Flow::Pause
            }
            _ => self.answer(
                io,
                Some(&req),
                ProblemKind::InFlight { retry_after_seconds: IN_FLIGHT_RETRY_AFTER_SECONDS },
                creator,
            ),
        }
    }

    /// Forwards under our claim(s), whose lock runs from `lock_from_ms` (the store claim's send,
    /// or now for the local tier's).
    fn forward<I: Io<Wire = W>>(&mut self, io: &mut I, req: Protected, held: Claimed, lock_from_ms: u64) -> Flow {
        let Forwarding::Detached { cluster, timeout_ms, hop } = &req.policy.forwarding else {
            log(io, Level::Debug, || log_line(Some(&req), "forwarded", ""));
            io.run(Command::Mark { skey: req.skey });
            self.phase = Phase::Forwarded { req, claim: held, response: Response::default(), redirected: false };
            return Flow::Continue;
        };
        let (cluster, timeout_ms, hop) = (cluster.clone(), *timeout_ms, *hop);
        log(io, Level::Debug, || log_line(Some(&req), "forwarded", &format!("detached=true cluster={cluster}")));
        let lock_deadline_ms = Lifetimes::of(&req.policy).lock_expires_at(lock_from_ms);
        let claim = req.claim(held);
        let skey = req.skey;
        // The root sends it: its callout outlives this request if the client leaves. Built here,
        // where the route is known to detach: no driver can be handed a detach it cannot send.
        io.run(Command::Detach(Box::new(req.forward(cluster, timeout_ms, hop, claim, lock_deadline_ms))));
        self.phase = Phase::Detached { skey };
        Flow::Pause
    }

    fn replay<I: Io<Wire = W>>(&mut self, io: &mut I, req: &Protected, record: Record) -> Flow {
        // Whichever tier it came from: a completed record past its own expiry is its key's
        // tombstone, answered `key-expired` (the fingerprint already matched: another request
        // under the key was answered `key-reused` before this).
        if record.is_tombstone_for(req.policy.tombstone_seconds, io.now_ms()) {
            let creator = record.creator.clone();
            return self.answer(io, Some(req), ProblemKind::KeyExpired, Some(&creator));
        }
        if let State::Completed(_) = &record.state {
            self.phase = Phase::Answered;
            io.run(Command::Replay { req, record });
            return Flow::Pause;
        }
        let creator = record.creator.clone();
        match record.state {
            State::CompletedTooLarge { status, location } => {
                let location = location.map(|l| String::from_utf8_lossy(&l).into_owned());
                self.answer(io, Some(req), ProblemKind::ResponseNotStored { status, location }, Some(&creator))
            }
            // Only completed records are replayed.
            _ => self.answer(io, Some(req), ProblemKind::OutcomeUnknown, Some(&creator)),
        }
    }

    /// Sends a problem (and never stores it).
    fn answer<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Option<&Protected>,
        problem: ProblemKind,
        creator: Option<&Creator>,
    ) -> Flow {
        self.phase = Phase::Answered;
        io.run(Command::Reply { req, problem, creator });
        Flow::Pause
    }

    /// A "cannot happen" branch: refuse by the one rule (`failsafe::refuse`), never forward.
    /// `branch` names the branch in the log line; `handle` is the local claim held, if any.
    fn fail_closed<I: Io<Wire = W>>(
        &mut self,
        io: &mut I,
        req: Option<&Protected>,
        broken: Broken,
        branch: &str,
        handle: Option<Handle>,
        holding: Holding,
    ) -> Flow {
        let refusal = failsafe::refuse(broken, holding);
        if refusal.release_local {
            self.release_local(io, handle);
        }
        if refusal.release_store {
            if let Some(r) = req {
                self.release_lost_claim(io, r, None);
            }
        }
        log(io, Level::Error, || {
            log_line(req, "internal_state", &format!("branch={branch} broken={}", broken.as_str()))
        });
        self.answer(io, req, refusal.problem, None)
    }

    fn local_error<I: Io<Wire = W>>(&mut self, io: &mut I, req: &Protected, e: LocalError) -> Flow {
        io.run(Command::Count(Count::LocalErrors));
        log(io, Level::Warn, || log_line(Some(req), "local_error", &format!("error={e:?}")));
        let p = ProblemKind::StoreUnavailable { retry_after_seconds: UNAVAILABLE_RETRY_AFTER_SECONDS };
        self.answer(io, Some(req), p, None)
    }

    /// A stored value that could not be read or verified: a seal that does not verify is counted
    /// on its own (`record_unauthentic`: tampering, a transplanted value, or a proxy without the
    /// secret the record was written with) and logged with the key's hash.
    fn count_unreadable<I: Io<Wire = W>>(&self, io: &mut I, req: &Protected, why: &ValueError) {
        if why.is_unauthentic() {
            io.run(Command::Count(Count::RecordUnauthentic));
            log(io, Level::Warn, || log_line(Some(req), "record_unauthentic", &format!("error={why}")));
        }
    }

    /// Pushes a write to the root, which outlives this request (none without a store).
    fn enqueue<I: Io<Wire = W>>(
        &self,
        io: &mut I,
        req: &Protected,
        fence: Option<&Fence>,
        what: &'static str,
        t: Transition,
    ) {
        if self.store.is_none() {
            return;
        }
        io.run(Command::Write { what, skey: req.skey, transition: Box::new(t), fallback: None, fence });
    }

    /// A claim-or-read or take-over was sent and its answer is lost (or the client left while it
    /// ran): it may land in the store later, even after this release. The release is
    /// owner-checked and leaves a tombstone if the claim has not landed yet, which the claim
    /// script honours.
    fn release_lost_claim<I: Io<Wire = W>>(&self, io: &mut I, req: &Protected, fence: Option<&Fence>) {
        let t = Transition::release_lost(req.owner, &Lifetimes::of(&req.policy));
        self.enqueue(io, req, fence, "release", t);
    }

    /// Releases a local claim (owner-checked), counting it.
    fn release_local<I: Io<Wire = W>>(&self, io: &mut I, handle: Option<Handle>) {
        if let Some(h) = handle {
            let now = io.now_ms();
            let (table, sd) = io.local();
            if let Ok(true) = table.release(sd, &h, now) {
                io.run(Command::Count(Count::Released));
            }
        }
    }

    /// The request, forwarded: its policy (the response's limits and exclusions).
    pub fn forwarded(&self) -> Option<(&Protected, &Response)> {
        match &self.phase {
            Phase::Forwarded { req, response, .. } => Some((req, response)),
            _ => None,
        }
    }

    /// The upstream's response headers (`status`, every line), when forwarded: the storable
    /// ones are kept; `Some(ttl_seconds)` when the client that created the record is told its
    /// expiry policy (a status that does not release the key).
    pub fn response_headers(&mut self, headers: Vec<(String, Vec<u8>)>, end_of_stream: bool) -> Option<u64> {
        let Phase::Forwarded { req, response, .. } = &mut self.phase else { return None };
        let policy = &req.policy;
        let exclude = &policy.replay_exclude_headers;
        let mut status = 0;
        let mut kept = vec![];
        for (n, v) in headers {
            if n == ":status" {
                status = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).unwrap_or(0);
            } else if crate::record::storable_header(&n) && (!exclude.contains(&n) || answer_header(req, &n)) {
                kept.push((n, v));
            }
        }
        response.stored = Some(StoredResponse { status, headers: kept, body: vec![] });
        response.complete = end_of_stream;
        (!policy.release_on_status.contains(&status)).then_some(policy.ttl_seconds)
    }

    /// Whether the response body's next chunk is wanted (forwarded, not yet over its limit).
    pub fn wants_response_body(&self) -> bool {
        matches!(&self.phase, Phase::Forwarded { response, .. } if !response.too_large)
    }

    /// A chunk of the upstream's response body (`chunk`: empty when not wanted).
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) {
        let Phase::Forwarded { req, response, .. } = &mut self.phase else { return };
        let limit = req.policy.max_response_body_bytes as usize;
        if !response.too_large {
            if let Some(r) = response.stored.as_mut() {
                if r.body.len() + chunk.len() > limit {
                    response.too_large = true;
                    r.body = vec![];
                } else {
                    r.body.extend_from_slice(chunk);
                }
            }
        }
        if end_of_stream {
            response.complete = true;
        }
    }

    /// The upstream's response trailers, by name: a replay cannot carry them, it says which it
    /// lacks.
    pub fn response_trailers(&mut self, names: &[String]) {
        if let Phase::Forwarded { response, .. } = &mut self.phase {
            response.complete = true;
            if let Some(r) = response.stored.as_mut() {
                crate::record::note_dropped_trailers(r, names);
            }
        }
    }

    /// The forwarded exchange is over (its outcome classified by the driver): the claim settled
    /// (`engine::settle`), the local tier now, the store through the root. Returns the outcome
    /// slug (also published).
    pub fn settle<I: Io<Wire = W>>(&mut self, io: &mut I, mut ended: Ended) -> &'static str {
        let Phase::Forwarded { req, claim, response, redirected } = self.take() else { return settle::INTERNAL_STATE };
        if redirected {
            // A redirect's target never releases the claim: its first hop executed.
            ended.outcome = redirect::after_first_hop(ended.outcome);
        }
        let claim = req.claim(claim);
        let slug = settle_claim(io, &claim, Some(&req.policy), self.store.is_some(), redirected, ended, response);
        io.run(Command::Publish { key: req.published_key().copied(), outcome: slug });
        slug
    }

    /// The client left (or the stream was reset) before the request was forwarded: what it held
    /// is freed. `true` if the request was one the machine held.
    pub fn abandon<I: Io<Wire = W>>(&mut self, io: &mut I) -> bool {
        match self.take() {
            Phase::Waiting { req, .. } => {
                // The client left (or the stream was reset) before the body was complete: it
                // held nothing (the claim is made at the body's end).
                io.run(Command::Publish { key: req.published_key().copied(), outcome: ABANDONED });
                true
            }
            Phase::Calling { req, call } => {
                // The client left while the store answered: our claim may have landed. Free it,
                // owner-checked, through the root (this context's callout dies with it).
                self.release_local(io, call.handle);
                self.release_lost_claim(io, &req, call.fence.as_ref());
                io.run(Command::Publish { key: req.published_key().copied(), outcome: ABANDONED });
                true
            }
            other => {
                self.phase = other;
                false
            }
        }
    }
}

/// Whether `name` is a response header an MCP call's answer is read by (`mcp::answer_of`: its
/// content type and coding): kept whatever `replay_exclude_headers` says, since without them an
/// answer carrying the call's response could be read as none and a released status release it.
fn answer_header(req: &Protected, name: &str) -> bool {
    req.mcp.is_some() && (name == "content-type" || name == "content-encoding")
}

/// The MCP reply's `accepts`, from the request's `accept` lines.
fn accepts(head: &RequestHead) -> Accepts {
    Accepts::of(&head.values("accept"))
}

/// The claim a stream Envoy re-created for an internal redirect continues, taken out of
/// `handoffs`: under each policy a hand-over that fits the stream names (`policies`, from
/// `Handoffs::policies_for`; `policy` gives each), the stream's storage key is read from its
/// headers (`request::redirected_claim`), and a claim handed over under that policy and key,
/// redirected from `original_url`, that fits the stream `on` (its request's mark, its
/// connection, a later context), within the window, is taken. `None`: an ordinary request (a
/// client can send the header).
pub fn take_handoff(
    handoffs: &mut Handoffs<Claim>,
    policies: &[usize],
    policy: impl Fn(usize) -> Option<Arc<Policy>>,
    head: &RequestHead,
    original_url: &[u8],
    on: redirect::Stream,
    now_ms: u64,
) -> Option<(Handoff<Claim>, Arc<Policy>, CallerScope)> {
    for &i in policies {
        let Some(p) = policy(i) else { continue };
        let Some((scope, skey)) = request::redirected_claim(&p, head, original_url) else { continue };
        if let Some(h) = handoffs.take(&skey, i, original_url, on, now_ms) {
            return Some((h, p, scope));
        }
    }
    None
}

/// Settles `claim` (`engine::settle`), the local tier's commands carried out through `io` and
/// the rest (writes, counts, logs) given to it. Returns the outcome slug.
pub fn settle_claim(
    io: &mut dyn Effects,
    claim: &Claim,
    policy: Option<&Policy>,
    has_store: bool,
    redirected: bool,
    ended: Ended,
    response: Response,
) -> &'static str {
    let now = io.now_ms();
    let (machine, cmds) = settle::start(
        claim,
        policy,
        has_store,
        redirected,
        ended.outcome,
        response.stored,
        response.too_large,
        &ended.detail,
        now,
    );
    let mut answer = settle::LocalAnswer::None;
    for c in cmds {
        if let Some(a) = settle_command(io, claim, policy, c, now) {
            answer = a;
        }
    }
    let (cmds, slug) = machine.finish(answer);
    for c in cmds {
        settle_command(io, claim, policy, c, now);
    }
    slug
}

/// Settles `claim` away from its request, as its whole exchange ended as `s` says: the Wasm
/// root's and the native main thread's settlements (a detached forward answered or never sent, a
/// redirect never followed). Returns the outcome slug.
pub fn settle_away(
    io: &mut dyn Effects,
    claim: &Claim,
    policy: Option<&Policy>,
    has_store: bool,
    s: crate::engine::forwards::Settle,
) -> &'static str {
    let ended = Ended { outcome: s.outcome, detail: s.detail };
    let response = Response { stored: s.response, too_large: s.too_large, complete: true };
    settle_claim(io, claim, policy, has_store, false, ended, response)
}

fn settle_command(
    io: &mut dyn Effects,
    claim: &Claim,
    policy: Option<&Policy>,
    c: settle::Command<'_>,
    now: u64,
) -> Option<settle::LocalAnswer> {
    use settle::{Local, LocalAnswer};
    match c {
        settle::Command::Write { what, transition, fallback } => {
            io.run(Command::Write { what, skey: claim.skey, transition, fallback, fence: None })
        }
        settle::Command::Local(Local::Complete(h, record)) => {
            let (table, sd) = io.local();
            // Where this tier is the record's authority (no store claim), its entry is kept
            // through the key's tombstone too (`Lifetimes::life_ms`); a claim in the store leaves
            // the tombstone to the store, the local copy ending with the record.
            let tombstone_ms = match policy {
                Some(p) if !claim.in_store => Lifetimes::of(p).tombstone_ms,
                _ => 0,
            };
            let until = record.expires_at_ms.saturating_add(tombstone_ms);
            let done = table.complete_until(sd, &h, *record, now, until).map_err(|e| format!("{e:?}"));
            return Some(LocalAnswer::Completed(done));
        }
        settle::Command::Local(Local::Release(h)) => {
            let (table, sd) = io.local();
            return Some(LocalAnswer::Released(matches!(table.release(sd, &h, now), Ok(true))));
        }
        settle::Command::Local(Local::MarkUnknown(h, reason)) => {
            let marked = match policy {
                Some(policy) => {
                    let (table, sd) = io.local();
                    table.mark_unknown(sd, &h, reason, now, policy).map_err(|e| format!("{e:?}"))
                }
                // Cannot happen (`start` asks for no local command without the policy).
                None => Err("no policy".to_string()),
            };
            return Some(LocalAnswer::Marked(marked));
        }
        settle::Command::Count(c) => io.run(Command::Count(match c {
            SettleCount::InternalErrors => Count::InternalErrors,
            SettleCount::Stored => Count::Stored,
            SettleCount::StoredWithoutBody => Count::StoredWithoutBody,
            SettleCount::LostClaim => Count::LostClaim,
            SettleCount::LocalErrors => Count::LocalErrors,
            SettleCount::UnknownOutcome => Count::UnknownOutcome,
            SettleCount::Released => Count::Released,
        })),
        settle::Command::Log(level, line) => log(io, level, || line.to_string()),
    }
    None
}

#[cfg(test)]
mod tests;
