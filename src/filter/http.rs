//! The HTTP context: one per request. A small state machine over the core:
//!
//! ```text
//! headers ──(unprotected)──────────────────────────────────────────────▶ pass
//!    │ admit: 400 ─▶ answered
//!    │ begin(no fingerprint): claim ─▶ Holding ──body end: mark_forwarded─▶ Forwarded
//!    │                        409 ─▶ answered
//!    │                        need fingerprint ─▶ Buffering ──body end: begin(fp)─▶ Forwarded | replay | 409/422
//! Forwarded: capture the response while it flows; on_log: classify ─▶ complete | release | unknown
//! ```

use std::rc::Rc;

use log::{debug, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::host::{self, Counter, HostShared};
use super::Shared;
use crate::config::Policy;
use crate::decision::{admit, check_body_size, classify, Admission, ExchangeFacts, Outcome};
use crate::fingerprint::Fingerprint;
use crate::local::{Begin, Completed, Handle, LocalError};
use crate::owner::{OwnerToken, TokenSources};
use crate::problem::ProblemKind;
use crate::record::{Creator, Record, State, StoredResponse};
use crate::request::RequestHead;
use crate::scope::{CallerScope, StorageKey};

/// Response headers never stored: hop-by-hop (RFC 9110 section 7.6.1) and those Envoy recomputes.
const NOT_REPLAYED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
];

enum Phase {
    /// Not protected, or already answered: every callback continues.
    Pass,
    /// Protected; the decision waits for the whole body (a claim is held if `handle` is set).
    Waiting { handle: Option<Handle> },
    /// Forwarded upstream under our claim.
    Forwarded { handle: Handle, fp: Fingerprint },
    /// We answered locally (problem or replay): never store our own reply.
    Answered,
}

struct Protected {
    policy_index: usize,
    head: RequestHead,
    skey: StorageKey,
    scope: CallerScope,
    creator: Creator,
    owner: OwnerToken,
}

pub struct Http {
    shared: Rc<Shared>,
    phase: Phase,
    req: Option<Protected>,
    /// Bytes of request body this context has counted against the VM's budget.
    budgeted: u64,
    body_size: usize,
    response: Option<StoredResponse>,
    response_too_large: bool,
    response_complete: bool,
}

impl Http {
    pub fn new(shared: Rc<Shared>) -> Http {
        Http {
            shared,
            phase: Phase::Pass,
            req: None,
            budgeted: 0,
            body_size: 0,
            response: None,
            response_too_large: false,
            response_complete: false,
        }
    }

    fn policy(&self) -> Option<&Policy> {
        let i = self.req.as_ref()?.policy_index;
        self.shared.config.policies().get(i).copied()
    }

    fn log_line(&self, outcome: &str, extra: &str) -> String {
        let Some(r) = self.req.as_ref() else { return format!("idemgate: outcome={outcome} {extra}") };
        let mut line = format!(
            "idemgate: outcome={outcome} key={} scope={} method={} path={} request_id={}",
            r.skey.short(),
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

    /// Sends a problem (and never stores it).
    fn answer(&mut self, problem: ProblemKind, creator: Option<&Creator>) -> Action {
        let counter = match &problem {
            ProblemKind::KeyMissing { .. } => Some(Counter::MissingKey),
            ProblemKind::KeyInvalid { .. } => Some(Counter::InvalidKey),
            ProblemKind::BodyTooLarge { .. } => Some(Counter::BodyTooLarge),
            ProblemKind::InFlight { .. } => Some(Counter::InFlightConflict),
            ProblemKind::OutcomeUnknown => Some(Counter::UnknownOutcome),
            ProblemKind::KeyReused => Some(Counter::Mismatch),
            ProblemKind::CapacityExhausted { .. } => Some(Counter::LocalFull),
            ProblemKind::BufferBudgetExceeded { .. } => Some(Counter::BufferBudgetExceeded),
            ProblemKind::StoreUnavailable { .. } => Some(Counter::LocalErrors),
            ProblemKind::ResponseNotStored { .. } => Some(Counter::Replayed),
        };
        if let Some(c) = counter {
            self.shared.metrics.inc(c);
        }
        let by = creator.map_or(String::new(), |c| {
            let mut s = format!("created_by_request_id={}", c.request_id);
            for (n, v) in &c.log_values {
                s.push_str(&format!(" created_by_{n}={v}"));
            }
            s
        });
        info!("{}", self.log_line(problem.slug(), &by));
        let request_id = self.req.as_ref().map_or_else(
            || host::header(MapType::HttpRequestHeaders, "x-request-id").unwrap_or_default(),
            |r| r.creator.request_id.clone(),
        );
        let p = problem.to_problem(&request_id, creator);
        let headers: Vec<(&str, &str)> = p.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        self.phase = Phase::Answered;
        let _ = hostcalls::send_http_response(u32::from(p.status), headers, Some(&p.body));
        Action::Pause
    }

    fn replay(&mut self, record: Record) -> Action {
        let creator = record.creator.clone();
        match record.state {
            State::Completed(r) => {
                self.shared.metrics.inc(Counter::Replayed);
                debug!(
                    "{}",
                    self.log_line(
                        "replayed",
                        &format!("status={} created_by_request_id={}", r.status, creator.request_id)
                    )
                );
                let mut headers: Vec<(&str, &str)> = r
                    .headers
                    .iter()
                    .filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v)))
                    .collect();
                headers.push(("idempotent-replayed", "true"));
                self.phase = Phase::Answered;
                let _ = hostcalls::send_http_response(u32::from(r.status), headers, Some(&r.body));
                Action::Pause
            }
            State::CompletedTooLarge { status, location } => {
                let location = location.map(|l| String::from_utf8_lossy(&l).into_owned());
                self.answer(ProblemKind::ResponseNotStored { status, location }, Some(&creator))
            }
            // begin() only returns completed records for replay.
            _ => self.answer(ProblemKind::OutcomeUnknown, Some(&creator)),
        }
    }

    fn local_error(&mut self, e: LocalError) -> Action {
        warn!("{}", self.log_line("local_error", &format!("error={e:?}")));
        self.answer(
            ProblemKind::StoreUnavailable { retry_after_seconds: crate::decision::UNAVAILABLE_RETRY_AFTER_SECONDS },
            None,
        )
    }

    /// Acts on the local tier's answer. `fp` is set once the body is complete.
    fn act(&mut self, begun: Result<Begin, LocalError>, fp: Option<Fingerprint>) -> Action {
        match begun {
            Ok(Begin::Claimed { handle, took_over, evicted }) => {
                self.shared.metrics.inc(if took_over { Counter::TakenOver } else { Counter::Claimed });
                if evicted {
                    self.shared.metrics.inc(Counter::LocalEvictions);
                }
                match fp {
                    Some(fp) => self.forward(handle, fp),
                    None => {
                        debug!("{}", self.log_line("claimed", "waiting_for_body=true"));
                        self.phase = Phase::Waiting { handle: Some(handle) };
                        Action::Pause
                    }
                }
            }
            Ok(Begin::Replay(r)) => self.replay(r),
            Ok(Begin::Reject { problem, creator, .. }) => self.answer(problem, creator.as_ref()),
            Ok(Begin::NeedFingerprint) => {
                self.phase = Phase::Waiting { handle: None };
                Action::Pause
            }
            Ok(Begin::Full) => self.answer(
                ProblemKind::CapacityExhausted {
                    retry_after_seconds: crate::decision::UNAVAILABLE_RETRY_AFTER_SECONDS,
                },
                None,
            ),
            Err(e) => {
                self.shared.metrics.inc(Counter::LocalErrors);
                self.local_error(e)
            }
        }
    }

    fn forward(&mut self, handle: Handle, fp: Fingerprint) -> Action {
        debug!("{}", self.log_line("forwarded", ""));
        self.phase = Phase::Forwarded { handle, fp };
        Action::Continue
    }

    fn begin(&self, fp: Option<Fingerprint>) -> Result<Begin, LocalError> {
        let (Some(r), Some(policy)) = (self.req.as_ref(), self.policy()) else { return Err(LocalError::Corrupt) };
        self.shared.table.begin(&mut HostShared, r.skey, fp, host::now_ms(), policy, r.owner, &r.creator)
    }

    /// The whole body is here: fingerprint it and go on.
    fn body_complete(&mut self) -> Action {
        let body = host::buffer(BufferType::HttpRequestBody, self.body_size);
        self.release_budget();
        let (Some(r), Some(policy)) = (self.req.as_ref(), self.policy()) else { return Action::Continue };
        let (fp, _) = Fingerprint::compute(&r.head, &body, &policy.fingerprint);
        let policy = policy.clone();
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Waiting { handle: Some(handle) } => {
                match self.shared.table.mark_forwarded(&mut HostShared, &handle, fp, host::now_ms(), &policy) {
                    Ok(true) => self.forward(handle, fp),
                    Ok(false) => {
                        self.shared.metrics.inc(Counter::LostClaim);
                        self.answer(
                            ProblemKind::InFlight {
                                retry_after_seconds: crate::decision::IN_FLIGHT_RETRY_AFTER_SECONDS,
                            },
                            None,
                        )
                    }
                    Err(e) => self.local_error(e),
                }
            }
            Phase::Waiting { handle: None } => {
                let begun = self.begin(Some(fp));
                self.act(begun, Some(fp))
            }
            other => {
                self.phase = other;
                Action::Continue
            }
        }
    }

    fn release_budget(&mut self) {
        if self.budgeted > 0 {
            let b = &self.shared.buffered;
            b.set(b.get().saturating_sub(self.budgeted));
            self.budgeted = 0;
        }
    }

    /// Frees a claim that was never forwarded (the request was refused or abandoned).
    fn release_unforwarded(&mut self) {
        if let Phase::Waiting { handle: Some(h) } = &self.phase {
            let h = *h;
            if let Ok(true) = self.shared.table.release(&mut HostShared, &h) {
                self.shared.metrics.inc(Counter::Released);
                debug!("{}", self.log_line("released", "reason=never_forwarded"));
            }
            self.phase = Phase::Waiting { handle: None };
        }
    }

    fn finish(&mut self, handle: Handle, fp: Fingerprint) {
        let Some(policy) = self.policy().cloned() else { return };
        let flags = host::property(&["response", "flags"])
            .and_then(|b| b.get(..8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes))
            .unwrap_or(0);
        let code_details = host::property(&["response", "code_details"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let status = self.response.as_ref().map(|r| r.status).or_else(|| {
            host::property(&["response", "code"])
                .and_then(|b| b.get(..8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes))
                .and_then(|c| u16::try_from(c).ok())
                .filter(|c| *c > 0)
        });
        let facts = ExchangeFacts {
            forwarded: true,
            status,
            code_details: code_details.clone(),
            flags,
            response_complete: self.response_complete,
        };
        let outcome = classify(&facts, &policy);
        let now = host::now_ms();
        let t = &self.shared.table;
        let creator = self.req.as_ref().map(|r| r.creator.clone()).unwrap_or_default();
        let detail = format!("status={} code_details={code_details} flags={flags}", status.unwrap_or(0));
        match outcome {
            Outcome::Store => {
                let response = self.response.take().unwrap_or(StoredResponse {
                    status: status.unwrap_or(0),
                    headers: vec![],
                    body: vec![],
                });
                match t.complete(
                    &mut HostShared,
                    &handle,
                    fp,
                    response,
                    self.response_too_large,
                    &creator,
                    now,
                    &policy,
                ) {
                    Ok(Completed::Stored) => {
                        self.shared.metrics.inc(Counter::Stored);
                        debug!("{}", self.log_line("stored", &detail));
                    }
                    Ok(Completed::StoredWithoutBody) => {
                        self.shared.metrics.inc(Counter::StoredWithoutBody);
                        info!("{}", self.log_line("stored_without_body", &detail));
                    }
                    Ok(Completed::LostClaim) => {
                        self.shared.metrics.inc(Counter::LostClaim);
                        info!("{}", self.log_line("lost_claim", &detail));
                    }
                    Err(e) => {
                        self.shared.metrics.inc(Counter::LocalErrors);
                        warn!("{}", self.log_line("store_failed", &format!("{detail} error={e:?}")));
                    }
                }
            }
            Outcome::Release => {
                if let Ok(true) = t.release(&mut HostShared, &handle) {
                    self.shared.metrics.inc(Counter::Released);
                }
                info!("{}", self.log_line("released", &detail));
            }
            Outcome::Unknown(reason) => {
                let _ = t.mark_unknown(&mut HostShared, &handle, reason, now, &policy);
                self.shared.metrics.inc(Counter::UnknownOutcome);
                info!("{}", self.log_line("unknown_outcome", &format!("{detail} reason={}", reason.as_str())));
            }
        }
    }
}

impl Context for Http {}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        // Cheap path first: two single-header reads decide whether the request is protected.
        let method = host::header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
        let path = host::header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        let policies = self.shared.config.policies();
        let Some(policy) = self.shared.config.policy_for(&method, &path) else { return Action::Continue };
        let policy_index = policies.iter().position(|p| std::ptr::eq(*p, policy)).unwrap_or(0);
        // The whole header map: a repeated key header must be seen, not just its first line.
        let head = RequestHead::from_pairs(host::all_headers(MapType::HttpRequestHeaders));
        let key = match admit(Some(policy), &head.values(&policy.header)) {
            Admission::Pass => return Action::Continue,
            Admission::Reject(p) => {
                self.req = None;
                return self.answer(p, None);
            }
            Admission::Protect(k) => k,
        };
        self.shared.metrics.inc(Counter::Protected);
        let scope = CallerScope::of(&head, &policy.scope);
        let skey = StorageKey::derive(&policy.namespace, &scope, &key);
        let request_id =
            head.values("x-request-id").first().map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
        let log_values = policy
            .log_headers
            .iter()
            .filter_map(|h| head.values(h).first().map(|v| (h.clone(), String::from_utf8_lossy(v).into_owned())))
            .collect();
        let counter = self.shared.next_token();
        let owner = OwnerToken::derive(&TokenSources {
            entropy: &host::entropy(),
            node: &self.shared.node,
            vm: self.shared.vm,
            now_nanos: host::now_nanos(),
            counter,
        });
        self.req =
            Some(Protected { policy_index, head, skey, scope, creator: Creator { request_id, log_values }, owner });
        if end_of_stream {
            // No body: the fingerprint is known now.
            let fp = {
                let (Some(r), Some(p)) = (self.req.as_ref(), self.policy()) else { return Action::Continue };
                Fingerprint::compute(&r.head, b"", &p.fingerprint).0
            };
            let begun = self.begin(Some(fp));
            return self.act(begun, Some(fp));
        }
        // Claim at headers: concurrent duplicates get a 409 without buffering their bodies.
        let begun = self.begin(None);
        self.act(begun, None)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::Waiting { .. }) {
            return Action::Continue;
        }
        self.body_size = body_size;
        let Some(policy) = self.policy() else { return Action::Continue };
        if let Err(p) = check_body_size(body_size as u64, policy) {
            self.release_budget();
            self.release_unforwarded();
            return self.answer(p, None);
        }
        // Per-VM budget of buffered bytes: many concurrent large bodies get a 503, not an OOM.
        let total = body_size as u64;
        let delta = total.saturating_sub(self.budgeted);
        let b = &self.shared.buffered;
        if b.get().saturating_add(delta) > self.shared.config.max_buffered_bytes {
            self.release_budget();
            self.release_unforwarded();
            return self.answer(
                ProblemKind::BufferBudgetExceeded {
                    retry_after_seconds: crate::decision::UNAVAILABLE_RETRY_AFTER_SECONDS,
                },
                None,
            );
        }
        b.set(b.get() + delta);
        self.budgeted = total;
        if end_of_stream {
            self.body_complete()
        } else {
            Action::Pause
        }
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> Action {
        if matches!(self.phase, Phase::Waiting { .. }) {
            return self.body_complete();
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::Forwarded { .. }) {
            return Action::Continue;
        }
        let Some(policy) = self.policy() else { return Action::Continue };
        let exclude = &policy.replay_exclude_headers;
        let mut status = 0;
        let mut headers = vec![];
        for (n, v) in host::all_headers(MapType::HttpResponseHeaders) {
            if n == ":status" {
                status = std::str::from_utf8(&v).ok().and_then(|s| s.parse().ok()).unwrap_or(0);
            } else if !n.starts_with(':') && !NOT_REPLAYED.contains(&n.as_str()) && !exclude.contains(&n) {
                headers.push((n, v));
            }
        }
        self.response = Some(StoredResponse { status, headers, body: vec![] });
        self.response_complete = end_of_stream;
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::Forwarded { .. }) {
            return Action::Continue;
        }
        let limit = self.policy().map_or(0, |p| p.max_response_body_bytes) as usize;
        if !self.response_too_large {
            let chunk = host::buffer(BufferType::HttpResponseBody, body_size);
            if let Some(r) = self.response.as_mut() {
                if r.body.len() + chunk.len() > limit {
                    self.response_too_large = true;
                    r.body = vec![];
                } else {
                    r.body.extend_from_slice(&chunk);
                }
            }
        }
        if end_of_stream {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _n: usize) -> Action {
        if matches!(self.phase, Phase::Forwarded { .. }) {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release_budget();
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Forwarded { handle, fp } => self.finish(handle, fp),
            p @ Phase::Waiting { handle: Some(_) } => {
                // The client left (or the stream was reset) before the body was complete: the
                // request was never forwarded, so a retry may execute it.
                self.phase = p;
                self.release_unforwarded();
            }
            _ => {}
        }
    }
}
