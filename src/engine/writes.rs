//! The root's store writes made after forwarding (a completion, a release, an outcome-unknown
//! mark), as a sans-IO machine: writes and the answers to their callouts come in, with the time;
//! actions come out (send this write's request, count and log this, this write is over, stop
//! now). The glue (`filter/mod.rs`) sends, answers and counts; every rule of the schedule is here.
//!
//! A write is retried after each failed attempt on `store::retry_delay_ms`'s schedule, at most
//! `MAX_WRITE_ATTEMPTS` attempts, then its fallback (for a completion: mark the outcome unknown)
//! runs the same schedule; a write never falls back to freeing its key. One write has at most
//! one request in flight: a NOSCRIPT answer, a too-large refusal or etcd's "absent" answer
//! replace its request only once the previous one is answered. All of it fits in
//! `store::write_window_ms`, which the operator CLI waits out.

use std::collections::{HashMap, VecDeque};

use crate::backend::{Backend, Unbuilt};
use crate::etcd::Fence;
use crate::scope::StorageKey;
use crate::seal::Seal;
use crate::store::{retry_delay_ms, StoreRequest, Transition, TransitionReply, MAX_WRITE_ATTEMPTS};

/// How long a stopping root (plugin reload, listener drain, shutdown) holds its VM for writes
/// still queued or in flight: the whole retry schedule of a write and of its outcome-unknown
/// fallback (2 x 6.2 s of backoff plus their timeouts).
pub const STOP_HOLD_MS: u64 = 20_000;

/// A write to the store, made by the root context.
#[derive(Clone, Debug)]
pub struct Job {
    pub what: &'static str,
    pub key_hash: String,
    pub request: StoreRequest,
    /// Sent if `request` keeps failing (for a completion: mark the outcome unknown).
    pub fallback: Option<Box<Job>>,
    /// A write carrying a record (a completion, an outcome-unknown mark): its transition, from
    /// which the machine builds, only when an answer calls for it, the where-absent second
    /// transaction (etcd, answered `TransitionReply::Absent`) or the same completion without its
    /// response body (the store refused the record as too large).
    pub source: Option<Box<Source>>,
    /// `request` is a where-absent second transaction (its answer is read by
    /// `Backend::parse_where_absent`).
    pub where_absent: bool,
    pub attempts: u8,
}

/// The transition a `Job` writes, and where.
#[derive(Clone, Debug)]
pub struct Source {
    pub transition: Transition,
    pub skey: StorageKey,
}

impl Job {
    /// The write `t` of `skey` as a job: its request (built by `backend`, which for etcd carries
    /// the lease usable at `now_ms`), and `t` itself when it carries a record.
    pub fn build(
        what: &'static str,
        skey: &StorageKey,
        t: &Transition,
        fence: Option<&Fence>,
        backend: Backend,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<Job, Unbuilt> {
        Job::build_owned(what, skey, t.clone(), fence, backend, seal, now_ms)
    }

    /// `build`, keeping `t` itself (no copy of its record) when it carries a record.
    pub fn build_owned(
        what: &'static str,
        skey: &StorageKey,
        t: Transition,
        fence: Option<&Fence>,
        backend: Backend,
        seal: &Seal,
        now_ms: u64,
    ) -> Result<Job, Unbuilt> {
        let request = backend.transition_request(&t, skey, seal, now_ms, fence)?;
        let source = t.record.is_some().then(|| Box::new(Source { transition: t, skey: *skey }));
        Ok(Job { what, key_hash: skey.hex(), request, fallback: None, source, where_absent: false, attempts: 0 })
    }
}

/// One write, from its first request to its end (landed or given up), whatever requests it sends
/// on the way (its retries, its script, its smaller form, its where-absent transaction, its
/// fallback).
pub type WriteId = u64;

/// What the machine needs to read a write's answer and, when the answer calls for one, to build
/// its next request or schedule its retry.
pub struct Builder<'a> {
    /// The store, for reading answers.
    pub store: Backend,
    pub seal: Option<&'a Seal>,
    /// The time now and the store with the lease usable then (etcd): asked only when a request is
    /// built or a retry scheduled, so an answer that lands costs no clock read.
    pub writer: &'a dyn Fn() -> (u64, Backend),
}

/// What happened to a write, for the glue's counters and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// The store answered the write (changed, refused, or rewritten): `store_writes`.
    Landed,
    /// The store refused it: the claim is no longer this owner's (log only).
    NoLongerOurs,
    /// The store had lost the claim and wrote the record where it was: `store_claim_gone_rewritten`.
    ClaimGoneRewritten,
    /// etcd found the key absent and the write writes nothing there (log only).
    NothingWhereAbsent,
    /// Redis answered NOSCRIPT: sent again with its script (`store_script_loads`).
    ScriptLoad,
    /// The store refused the write as too large (`store_errors`).
    TooLarge,
    /// ... and it goes again without its response body (`store_writes_too_large`).
    TooLargeWithoutBody,
    /// An attempt failed and is retried after `delay_ms` (`store_errors`, `store_write_retries`).
    Retry { why: String, delay_ms: u64 },
    /// Its last attempt failed (`store_errors`, `store_write_failures`): its fallback is sent if it
    /// has one, else it is given up.
    Failed { why: String, attempts: u8, fallback: bool },
}

/// What the glue does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send the write's current request (`Writes::request`), then report `sent`/`not_sent`
    /// (the callout's token is the glue's), and later `answered`.
    Send(WriteId),
    /// Count and log `note` for write `id`, `what` of `key_hash`.
    Note { id: WriteId, what: &'static str, key_hash: String, note: Note },
    /// The write is over (landed or given up): one fewer pending.
    Ended,
    /// The root was stopping and may stop now (`pending` writes left: none, or the hold ran out).
    Stop { pending: usize },
}

/// The root's writes: the ones in flight and the ones waiting for their retry.
#[derive(Default)]
pub struct Writes {
    next_id: WriteId,
    /// Sent (or about to be): one request each.
    in_flight: HashMap<WriteId, Job>,
    /// Failed writes waiting for their retry: (due time in ms, write).
    retries: Vec<(u64, WriteId, Job)>,
    /// Set when the root was asked to stop with writes pending: when it stops anyway.
    stopping_until_ms: Option<u64>,
    out: VecDeque<Action>,
}

impl Writes {
    /// The next action, in order.
    pub fn poll(&mut self) -> Option<Action> {
        self.out.pop_front()
    }

    /// Writes not over: in flight or waiting for their retry.
    pub fn pending(&self) -> usize {
        self.in_flight.len() + self.retries.len()
    }

    /// The request write `id` is to send (`Action::Send`).
    pub fn request(&self, id: WriteId) -> Option<&StoreRequest> {
        self.in_flight.get(&id).map(|j| &j.request)
    }

    /// A new write: sent at once.
    pub fn push(&mut self, job: Job) -> WriteId {
        let id = self.new_id();
        self.send(id, job);
        id
    }

    fn new_id(&mut self) -> WriteId {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    fn send(&mut self, id: WriteId, job: Job) {
        self.in_flight.insert(id, job);
        self.out.push_back(Action::Send(id));
    }

    /// The host refused to send write `id`'s request: a failed attempt.
    pub fn not_sent(&mut self, id: WriteId, why: &str, now_ms: &dyn Fn() -> u64) {
        if let Some(job) = self.in_flight.remove(&id) {
            self.failed(id, job, why, now_ms);
        }
    }

    /// Write `id` cannot be sent at all (no store configured: cannot happen): over, uncounted.
    pub fn abandon(&mut self, id: WriteId) {
        if self.in_flight.remove(&id).is_some() {
            self.ended();
        }
    }

    /// The callout of write `id` was answered: `status` `None` when it got no answer (a timeout,
    /// a reset: the host's "lost"), with `body`.
    pub fn answered(&mut self, id: WriteId, status: Option<u16>, body: &[u8], b: &Builder) {
        let Some(job) = self.in_flight.remove(&id) else { return };
        if b.store.refused_as_too_large(status, body) {
            return self.too_large(id, job, b);
        }
        let parsed = match job.where_absent {
            true => b.store.parse_where_absent(status, body),
            false => b.store.parse_write(status, body),
        };
        let now_ms = || (b.writer)().0;
        match parsed {
            // Redis lost the script (restart, failover, SCRIPT FLUSH): nothing ran.
            Ok(TransitionReply::NoScript) => self.with_script(id, job, &now_ms),
            Ok(TransitionReply::Changed) => self.landed(id, job, None),
            // etcd: the claim is gone and the key absent; a write that writes where absent sends
            // its second transaction (as the same write: its retries, its fallback).
            Ok(TransitionReply::Absent) => self.where_absent(id, job, b),
            Ok(TransitionReply::Refused) => self.landed(id, job, Some(Note::NoLongerOurs)),
            // The store lost the claim (FLUSHALL, an eviction, a failover) while the request
            // ran: the record was written where it was gone.
            Ok(TransitionReply::ClaimGoneRewritten) => self.landed(id, job, Some(Note::ClaimGoneRewritten)),
            Err(e) => self.failed(id, job, &e.to_string(), &now_ms),
        }
    }

    /// When the next retry is due, if one is waiting (the root's tick sends it then).
    pub fn next_retry_ms(&self) -> Option<u64> {
        self.retries.iter().map(|(at, _, _)| *at).min()
    }

    /// The root's tick: sends the retries whose time has come.
    pub fn tick(&mut self, now_ms: u64) {
        if self.retries.is_empty() {
            return;
        }
        let (due, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.retries).into_iter().partition(|(at, _, _)| *at <= now_ms);
        self.retries = later;
        for (_, id, job) in due {
            self.send(id, job);
        }
    }

    /// The host asks the root to stop, with `queued` writes handed over but not yet pushed:
    /// true if it may stop now; otherwise it is held until its writes are over or
    /// `STOP_HOLD_MS` has passed (`Action::Stop`, from `stop_if_drained`).
    pub fn stop(&mut self, queued: usize, now_ms: u64) -> bool {
        if self.pending() + queued == 0 {
            return true;
        }
        self.stopping_until_ms = Some(now_ms.saturating_add(STOP_HOLD_MS));
        false
    }

    /// A stopping root stops once its writes are over (`queued` ones handed over count) or its
    /// hold has passed: `Action::Stop`, once.
    pub fn stop_if_drained(&mut self, queued: usize, now_ms: u64) {
        let Some(until) = self.stopping_until_ms else { return };
        let pending = self.pending() + queued;
        if pending == 0 || now_ms >= until {
            self.stopping_until_ms = None;
            self.out.push_back(Action::Stop { pending });
        }
    }

    /// Whether the root is holding its VM for pending writes.
    pub fn stopping(&self) -> bool {
        self.stopping_until_ms.is_some()
    }

    /// Every write not over, for another machine to carry on (a host whose root cannot be held
    /// past its end, as the native build's configuration: `adopt`), each with when it is due: a
    /// write waiting for its retry keeps its time and attempts; one in flight is due at `now_ms`,
    /// sent again (a write may land twice: each is a transition checked by owner, so the second
    /// changes nothing). The machine is left with none.
    pub fn hand_over(&mut self, now_ms: u64) -> Vec<(u64, Job)> {
        let mut jobs: Vec<(WriteId, u64, Job)> = self.in_flight.drain().map(|(id, job)| (id, now_ms, job)).collect();
        jobs.extend(self.retries.drain(..).map(|(at, id, job)| (id, at, job)));
        // In the order they were made.
        jobs.sort_by_key(|(id, _, _)| *id);
        self.stopping_until_ms = None;
        jobs.into_iter().map(|(_, at, job)| (at, job)).collect()
    }

    /// A write handed over by another machine (`hand_over`), sent when `due_ms` comes (at the
    /// next `tick`), with the attempts it has made.
    pub fn adopt(&mut self, due_ms: u64, job: Job) -> WriteId {
        let id = self.new_id();
        self.retries.push((due_ms, id, job));
        id
    }

    fn note(&mut self, id: WriteId, job: &Job, note: Note) {
        self.out.push_back(Action::Note { id, what: job.what, key_hash: job.key_hash.clone(), note });
    }

    fn ended(&mut self) {
        self.out.push_back(Action::Ended);
    }

    /// The store answered the write (changed, refused, or written where its claim was gone).
    fn landed(&mut self, id: WriteId, job: Job, first: Option<Note>) {
        if let Some(n) = first {
            self.note(id, &job, n);
        }
        self.out.push_back(Action::Note { id, what: job.what, key_hash: job.key_hash, note: Note::Landed });
        self.ended();
    }

    /// Redis answered NOSCRIPT: the same write goes again at once with the script in full (`EVAL`,
    /// which also loads it), as the same attempt. A write that carried its script cannot be
    /// answered NOSCRIPT: that is a failed attempt.
    fn with_script(&mut self, id: WriteId, mut job: Job, now_ms: &dyn Fn() -> u64) {
        match job.request.with_script() {
            Some(again) => {
                self.note(id, &job, Note::ScriptLoad);
                job.request = again;
                self.send(id, job);
            }
            None => self.failed(id, job, "NOSCRIPT answered to a write carrying its script", now_ms),
        }
    }

    /// The store refused the write as too large (nothing of it applied): retrying cannot help. A
    /// completion goes again without its response body, so the key ends as "executed, response
    /// not stored" on every proxy, never outcome-unknown; any other write goes to its fallback at
    /// once.
    fn too_large(&mut self, id: WriteId, mut job: Job, b: &Builder) {
        self.note(id, &job, Note::TooLarge);
        let (now_ms, writer) = (b.writer)();
        let smaller = job.source.as_ref().and_then(|src| {
            let small = src.transition.without_body()?;
            Some(Job::build("complete_without_body", &src.skey, &small, None, writer, b.seal?, now_ms))
        });
        match smaller {
            Some(Ok(mut small)) => {
                self.note(id, &job, Note::TooLargeWithoutBody);
                small.fallback = job.fallback.take();
                self.send(id, small);
            }
            other => {
                let why = match other {
                    Some(Err(e)) => format!("refused by the store as too large; without its body: {e}"),
                    _ => "refused by the store as too large".to_string(),
                };
                job.attempts = MAX_WRITE_ATTEMPTS.saturating_sub(1);
                self.failed(id, job, &why, &|| now_ms);
            }
        }
    }

    /// etcd answered that the key is absent: a write that writes where absent sends its second
    /// transaction, as the same write (its retries, its fallback); any other write is done.
    fn where_absent(&mut self, id: WriteId, mut job: Job, b: &Builder) {
        let (now_ms, writer) = (b.writer)();
        let built = match (job.source.as_ref(), b.seal) {
            (Some(src), Some(seal)) => writer.where_absent_request(&src.transition, &src.skey, seal, now_ms),
            _ => Ok(None),
        };
        match built {
            Ok(Some(request)) => {
                job.request = request;
                job.where_absent = true;
                job.attempts = 0;
                self.send(id, job);
            }
            Ok(None) => self.landed(id, job, Some(Note::NothingWhereAbsent)),
            // No lease now: as a failed attempt (retried; the retry asks again).
            Err(e) => self.failed(id, job, &e.to_string(), &|| now_ms),
        }
    }

    /// A failed attempt: retried (with backoff), then its fallback, then given up.
    fn failed(&mut self, id: WriteId, mut job: Job, why: &str, now_ms: &dyn Fn() -> u64) {
        job.attempts = job.attempts.saturating_add(1);
        if job.attempts < MAX_WRITE_ATTEMPTS {
            let delay_ms = retry_delay_ms(job.attempts);
            self.note(id, &job, Note::Retry { why: why.to_string(), delay_ms });
            if delay_ms == 0 {
                self.send(id, job);
            } else {
                // Later, not now: a store that is restarting refuses an immediate retry just the same.
                self.retries.push((now_ms().saturating_add(delay_ms), id, job));
            }
            return;
        }
        let fallback = job.fallback.take();
        self.note(
            id,
            &job,
            Note::Failed { why: why.to_string(), attempts: job.attempts, fallback: fallback.is_some() },
        );
        match fallback {
            Some(f) => self.send(id, *f),
            None => self.ended(),
        }
    }
}

#[cfg(test)]
mod tests;
