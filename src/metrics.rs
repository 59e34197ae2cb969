//! idemgate's metrics: their names as Envoy shows them (`idemgate.<name>` in /stats, under the
//! host's custom namespace) and the rules that say which counter an engine event counts. Host
//! free: the Wasm glue (`filter::host`, which hands them to proxy-wasm) and the native build
//! (`native/src/metrics.rs`, Envoy's dynamic module stats) count the same events through these
//! rules, so the two builds show the same counters for the same requests.

use crate::engine::machine::Count;
use crate::engine::waiters::Reply as WaitReply;
use crate::engine::writes::Note;
use crate::problem::ProblemKind;

/// The counters idemgate exports, `idemgate.<name>` in Envoy's /stats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    Protected,
    Claimed,
    TakenOver,
    Replayed,
    InFlightConflict,
    Mismatch,
    MissingKey,
    InvalidKey,
    ScopeMissing,
    BodyTooLarge,
    Stored,
    StoredWithoutBody,
    Released,
    UnknownOutcome,
    LostClaim,
    LocalFull,
    LocalEvictions,
    LocalErrors,
    BufferBudgetExceeded,
    LocalSwept,
    LocalSweepPasses,
    StoreCalls,
    StoreCallsWaited,
    StoreErrors,
    StoreUnavailable,
    StorePassed,
    RecordUnreadable,
    RecordUnauthentic,
    StoreReplays,
    ReplaysDecoded,
    ReplaysEncodingNotAccepted,
    StoreWrites,
    StoreWriteRetries,
    StoreWriteFailures,
    StoreClaimGoneRewritten,
    /// A completion the store refused as too large, written again without its response body.
    StoreWritesTooLarge,
    StoreAnswersTooLate,
    StoreScriptLoads,
    StoreAuthentications,
    StoreTokenRefused,
    RootWakesMissed,
    DetachedForwards,
    Waited,
    WaitAnswered,
    DerivedKeys,
    UpstreamAttemptsRepeated,
    InternalErrors,
    GrpcRefused,
    RouteAmbiguous,
    McpRefused,
    GrpcPassed,
    RedirectsFollowed,
    RedirectsUnfollowed,
    /// A request that met its key's tombstone (`tombstone_seconds`): refused `key-expired`.
    KeyExpired,
}

impl Counter {
    pub const ALL: [Counter; 54] = [
        Counter::Protected,
        Counter::Claimed,
        Counter::TakenOver,
        Counter::Replayed,
        Counter::InFlightConflict,
        Counter::Mismatch,
        Counter::MissingKey,
        Counter::InvalidKey,
        Counter::ScopeMissing,
        Counter::BodyTooLarge,
        Counter::Stored,
        Counter::StoredWithoutBody,
        Counter::Released,
        Counter::UnknownOutcome,
        Counter::LostClaim,
        Counter::LocalFull,
        Counter::LocalEvictions,
        Counter::LocalErrors,
        Counter::BufferBudgetExceeded,
        Counter::LocalSwept,
        Counter::LocalSweepPasses,
        Counter::StoreCalls,
        Counter::StoreCallsWaited,
        Counter::StoreErrors,
        Counter::StoreUnavailable,
        Counter::StorePassed,
        Counter::RecordUnreadable,
        Counter::RecordUnauthentic,
        Counter::StoreReplays,
        Counter::ReplaysDecoded,
        Counter::ReplaysEncodingNotAccepted,
        Counter::StoreWrites,
        Counter::StoreWriteRetries,
        Counter::StoreWriteFailures,
        Counter::StoreClaimGoneRewritten,
        Counter::StoreWritesTooLarge,
        Counter::StoreAnswersTooLate,
        Counter::StoreScriptLoads,
        Counter::StoreAuthentications,
        Counter::StoreTokenRefused,
        Counter::RootWakesMissed,
        Counter::DetachedForwards,
        Counter::Waited,
        Counter::WaitAnswered,
        Counter::DerivedKeys,
        Counter::UpstreamAttemptsRepeated,
        Counter::InternalErrors,
        Counter::GrpcRefused,
        Counter::RouteAmbiguous,
        Counter::McpRefused,
        Counter::GrpcPassed,
        Counter::RedirectsFollowed,
        Counter::RedirectsUnfollowed,
        Counter::KeyExpired,
    ];

    /// Whether the counter also exists per route: what a request of the route met (its
    /// outcome, its refusals); what the root counts outside a request (store writes and calls,
    /// sweeps, wakes) and the local release (`release_local` counts it with no route) are counted in
    /// total only.
    pub fn per_route(self) -> bool {
        !matches!(
            self,
            Counter::Released
                | Counter::LocalEvictions
                | Counter::LocalErrors
                | Counter::LocalSwept
                | Counter::LocalSweepPasses
                | Counter::StoreCalls
                | Counter::StoreCallsWaited
                | Counter::StoreErrors
                | Counter::StoreReplays
                | Counter::StoreWrites
                | Counter::StoreWriteRetries
                | Counter::StoreWriteFailures
                | Counter::StoreClaimGoneRewritten
                | Counter::StoreWritesTooLarge
                | Counter::StoreAnswersTooLate
                | Counter::StoreScriptLoads
                | Counter::StoreAuthentications
                | Counter::StoreTokenRefused
                | Counter::RootWakesMissed
                | Counter::DetachedForwards
                | Counter::InternalErrors
                | Counter::RouteAmbiguous
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Counter::Protected => "idemgate.protected",
            Counter::Claimed => "idemgate.claimed",
            Counter::TakenOver => "idemgate.taken_over",
            Counter::Replayed => "idemgate.replayed",
            Counter::InFlightConflict => "idemgate.in_flight_conflict",
            Counter::Mismatch => "idemgate.mismatch",
            Counter::MissingKey => "idemgate.missing_key",
            Counter::InvalidKey => "idemgate.invalid_key",
            Counter::ScopeMissing => "idemgate.scope_missing",
            Counter::BodyTooLarge => "idemgate.body_too_large",
            Counter::Stored => "idemgate.stored",
            Counter::StoredWithoutBody => "idemgate.stored_without_body",
            Counter::Released => "idemgate.released",
            Counter::UnknownOutcome => "idemgate.unknown_outcome",
            Counter::LostClaim => "idemgate.lost_claim",
            Counter::LocalFull => "idemgate.local_full",
            Counter::LocalEvictions => "idemgate.local_evictions",
            Counter::LocalErrors => "idemgate.local_errors",
            Counter::BufferBudgetExceeded => "idemgate.buffer_budget_exceeded",
            Counter::LocalSwept => "idemgate.local_swept",
            Counter::LocalSweepPasses => "idemgate.local_sweep_passes",
            Counter::StoreCalls => "idemgate.store_calls",
            Counter::StoreCallsWaited => "idemgate.store_calls_waited",
            Counter::StoreErrors => "idemgate.store_errors",
            Counter::StoreUnavailable => "idemgate.store_unavailable",
            Counter::StorePassed => "idemgate.store_passed_unprotected",
            Counter::RecordUnreadable => "idemgate.record_unreadable",
            Counter::RecordUnauthentic => "idemgate.record_unauthentic",
            Counter::StoreReplays => "idemgate.store_replays",
            Counter::ReplaysDecoded => "idemgate.replays_decoded",
            Counter::ReplaysEncodingNotAccepted => "idemgate.replays_encoding_not_accepted",
            Counter::StoreWrites => "idemgate.store_writes",
            Counter::StoreWriteRetries => "idemgate.store_write_retries",
            Counter::StoreWriteFailures => "idemgate.store_write_failures",
            Counter::StoreClaimGoneRewritten => "idemgate.store_claim_gone_rewritten",
            Counter::StoreWritesTooLarge => "idemgate.store_writes_too_large",
            Counter::StoreAnswersTooLate => "idemgate.store_answers_too_late",
            Counter::StoreScriptLoads => "idemgate.store_script_loads",
            Counter::StoreAuthentications => "idemgate.store_authentications",
            Counter::StoreTokenRefused => "idemgate.store_token_refused",
            Counter::RootWakesMissed => "idemgate.root_wakes_missed",
            Counter::DetachedForwards => "idemgate.detached_forwards",
            Counter::Waited => "idemgate.waited",
            Counter::WaitAnswered => "idemgate.wait_answered",
            Counter::DerivedKeys => "idemgate.derived_keys",
            Counter::UpstreamAttemptsRepeated => "idemgate.upstream_attempts_repeated",
            Counter::InternalErrors => "idemgate.internal_errors",
            Counter::GrpcRefused => "idemgate.grpc_refused",
            Counter::RouteAmbiguous => "idemgate.route_ambiguous",
            Counter::KeyExpired => "idemgate.key_expired",
            Counter::McpRefused => "idemgate.mcp_refused",
            Counter::GrpcPassed => "idemgate.grpc_passed_unprotected",
            Counter::RedirectsFollowed => "idemgate.internal_redirects_followed",
            Counter::RedirectsUnfollowed => "idemgate.internal_redirects_unfollowed",
        }
    }
}

/// Gauges of the local tier's shared data, set by the root context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gauge {
    /// Bytes of completed records held (what `local.max_bytes` bounds).
    LocalRecordBytes,
    /// Bytes of the bucket index with `local.max_entries` records (its bound).
    LocalIndexBytes,
    /// Store writes queued or in flight in root contexts (every worker's, summed: each adds and
    /// subtracts its own).
    StoreWritesPending,
    /// Records the local table holds now.
    LocalOccupancy,
    /// Records it may hold (`local.max_entries`).
    LocalCapacity,
    /// Age in seconds of the last record evicted to make room: the protection actually given.
    LocalEvictedAgeSeconds,
}

impl Gauge {
    pub const ALL: [Gauge; 6] = [
        Gauge::LocalRecordBytes,
        Gauge::LocalIndexBytes,
        Gauge::StoreWritesPending,
        Gauge::LocalOccupancy,
        Gauge::LocalCapacity,
        Gauge::LocalEvictedAgeSeconds,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Gauge::LocalRecordBytes => "idemgate.local_record_bytes",
            Gauge::LocalIndexBytes => "idemgate.local_index_bytes",
            Gauge::StoreWritesPending => "idemgate.store_writes_pending",
            Gauge::LocalOccupancy => "idemgate.local_occupancy",
            Gauge::LocalCapacity => "idemgate.local_capacity",
            Gauge::LocalEvictedAgeSeconds => "idemgate.local_evicted_age_seconds",
        }
    }
}

/// The name of counter `c` for the route labelled `route` (`config::Route::name`):
/// `idemgate.route.<route>.<name>`. The shipped Envoy configurations' `stats_config.stats_tags`
/// (docs/operating.md, "Metrics") take `<route>` out as the label `route`: `idemgate_route_<name>{route="..."}`
/// in Prometheus.
pub fn route_counter_name(route: &str, c: Counter) -> String {
    format!("idemgate.route.{route}.{}", c.name().trim_start_matches("idemgate."))
}

/// The build-info gauge, always 1: `idemgate.build_info.<version>`, the version taken out as the
/// label `version` by the shipped configurations' `stats_tags` (`idemgate_build_info{version=
/// "0.9.0"} 1`).
pub const BUILD_INFO: &str = concat!("idemgate.build_info.", env!("CARGO_PKG_VERSION"));

/// Histograms (Envoy's default buckets: 0.5, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, ...,
/// 3600000), each value handed to the host by the next flush (`Metrics::record`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Histogram {
    /// Milliseconds from sending a store call a request waits for (claim, take-over, read) to
    /// its answer.
    StoreRoundTripMs,
    /// Milliseconds a request held its key: from its claim to its settlement (stored, released,
    /// marked outcome-unknown).
    KeyHeldMs,
    /// Milliseconds a request held by `in_flight: "wait"` waited until it was answered.
    WaitMs,
    /// Bytes of the stored response body a replay was made from.
    ReplayBytes,
}

impl Histogram {
    pub const ALL: [Histogram; 4] =
        [Histogram::StoreRoundTripMs, Histogram::KeyHeldMs, Histogram::WaitMs, Histogram::ReplayBytes];

    pub fn name(self) -> &'static str {
        match self {
            Histogram::StoreRoundTripMs => "idemgate.store_round_trip_ms",
            Histogram::KeyHeldMs => "idemgate.key_held_ms",
            Histogram::WaitMs => "idemgate.wait_ms",
            Histogram::ReplayBytes => "idemgate.replay_bytes",
        }
    }
}

/// The counter that says how many requests' counters are in Envoy's /stats: every request's
/// `on_log` is counted, and handed to the host after every other counter of the same flush.
pub const SETTLED_COUNTER: &str = "idemgate.requests_settled";

/// The counter a problem reply counts.
pub fn problem_counter(problem: &ProblemKind) -> Counter {
    match problem {
        ProblemKind::KeyMissing { .. } => Counter::MissingKey,
        // A key that cannot be derived from a JSON body naming a member twice, as one that cannot
        // be derived from a header sent twice (`key-repeated`).
        ProblemKind::KeyInvalid { .. } | ProblemKind::BodyAmbiguous => Counter::InvalidKey,
        ProblemKind::ScopeMissing { .. } => Counter::ScopeMissing,
        ProblemKind::BodyTooLarge { .. } => Counter::BodyTooLarge,
        ProblemKind::InFlight { .. } => Counter::InFlightConflict,
        ProblemKind::OutcomeUnknown => Counter::UnknownOutcome,
        ProblemKind::KeyExpired => Counter::KeyExpired,
        ProblemKind::KeyReused { .. } => Counter::Mismatch,
        ProblemKind::CapacityExhausted { .. } => Counter::LocalFull,
        ProblemKind::BufferBudgetExceeded { .. } => Counter::BufferBudgetExceeded,
        ProblemKind::StoreUnavailable { .. } => Counter::StoreUnavailable,
        ProblemKind::RecordUnreadable { .. } => Counter::RecordUnreadable,
        ProblemKind::ResponseNotStored { .. } => Counter::Replayed,
        ProblemKind::UpstreamNoAnswer => Counter::UnknownOutcome,
        ProblemKind::EncodingNotAccepted { .. } => Counter::ReplaysEncodingNotAccepted,
        ProblemKind::InternalState { .. } => Counter::InternalErrors,
        ProblemKind::GrpcUnsupported { .. } => Counter::GrpcRefused,
        ProblemKind::RouteAmbiguous => Counter::RouteAmbiguous,
        ProblemKind::McpBatchRefused | ProblemKind::McpBodyAmbiguous | ProblemKind::McpHeaderMismatch { .. } => {
            Counter::McpRefused
        }
    }
}

/// The counters a request held by `in_flight: "wait"` counts when it is answered (its route's
/// too), in both builds: the counter the same answer counts for a retry that meets the key
/// directly (a replay `replayed`, a problem `problem_counter`'s, so `response-not-stored` is a
/// replay whether the record came with its status only or as completed too large), and
/// `wait_answered` for an answer given before the wait ended (a 409 `request-in-flight` is none).
pub fn wait_counters(reply: &WaitReply) -> [Option<Counter>; 2] {
    match reply {
        WaitReply::InFlight { retry_after_seconds } => {
            [Some(problem_counter(&ProblemKind::InFlight { retry_after_seconds: *retry_after_seconds })), None]
        }
        WaitReply::Replay(_) => [Some(Counter::WaitAnswered), Some(Counter::Replayed)],
        WaitReply::Problem(kind) => [Some(Counter::WaitAnswered), Some(problem_counter(kind))],
    }
}

/// The counter of the machine's `Count` of the same name. `Count::Released` is counted in total
/// only (`Counter::per_route`), the others for the request's route too.
pub fn counter(c: Count) -> Counter {
    match c {
        Count::Claimed => Counter::Claimed,
        Count::TakenOver => Counter::TakenOver,
        Count::LocalEvictions => Counter::LocalEvictions,
        Count::LocalErrors => Counter::LocalErrors,
        Count::StoreErrors => Counter::StoreErrors,
        Count::StorePassed => Counter::StorePassed,
        Count::StoreReplays => Counter::StoreReplays,
        Count::StoreAnswersTooLate => Counter::StoreAnswersTooLate,
        Count::RecordUnauthentic => Counter::RecordUnauthentic,
        Count::UnknownOutcome => Counter::UnknownOutcome,
        Count::LostClaim => Counter::LostClaim,
        Count::DerivedKeys => Counter::DerivedKeys,
        Count::Protected => Counter::Protected,
        Count::RedirectsFollowed => Counter::RedirectsFollowed,
        Count::Released => Counter::Released,
        Count::Stored => Counter::Stored,
        Count::StoredWithoutBody => Counter::StoredWithoutBody,
        Count::InternalErrors => Counter::InternalErrors,
    }
}

/// What a replay counts beyond `Counter::Replayed` (counted for every replay): a body decoded
/// from a content coding the retry does not accept, or the coding refused.
pub fn replay_counter(decoded: bool, problem: Option<&ProblemKind>) -> Option<Counter> {
    match problem {
        Some(ProblemKind::EncodingNotAccepted { .. }) => Some(Counter::ReplaysEncodingNotAccepted),
        Some(_) => None,
        None => decoded.then_some(Counter::ReplaysDecoded),
    }
}

/// The counters a store write's note counts (in total; none for the notes only logged).
pub fn note_counters(note: &Note) -> &'static [Counter] {
    match note {
        Note::Landed => &[Counter::StoreWrites],
        Note::ClaimGoneRewritten => &[Counter::StoreClaimGoneRewritten],
        Note::ScriptLoad => &[Counter::StoreScriptLoads],
        Note::TooLarge => &[Counter::StoreErrors],
        Note::TooLargeWithoutBody => &[Counter::StoreWritesTooLarge],
        Note::Retry { .. } => &[Counter::StoreErrors, Counter::StoreWriteRetries],
        Note::Failed { .. } => &[Counter::StoreErrors, Counter::StoreWriteFailures],
        Note::NoLongerOurs | Note::NothingWhereAbsent => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn a_waiters_answer_counts_what_a_direct_answer_counts_and_wait_answered() {
        let not_stored = WaitReply::Problem(ProblemKind::ResponseNotStored { status: 201, location: None });
        assert_eq!(wait_counters(&not_stored), [Some(Counter::WaitAnswered), Some(Counter::Replayed)]);
        let reused = WaitReply::Problem(ProblemKind::KeyReused { status: 422 });
        assert_eq!(wait_counters(&reused), [Some(Counter::WaitAnswered), Some(Counter::Mismatch)]);
        let over = WaitReply::InFlight { retry_after_seconds: 1 };
        assert_eq!(wait_counters(&over), [Some(Counter::InFlightConflict), None]);
    }

    #[test]
    fn a_write_note_counts_what_its_documentation_names() {
        let retry = Note::Retry { why: "503".into(), delay_ms: 100 };
        assert_eq!(note_counters(&retry), &[Counter::StoreErrors, Counter::StoreWriteRetries]);
        let failed = Note::Failed { why: "503".into(), attempts: 3, fallback: true };
        assert_eq!(note_counters(&failed), &[Counter::StoreErrors, Counter::StoreWriteFailures]);
        assert_eq!(note_counters(&Note::Landed), &[Counter::StoreWrites]);
        assert!(note_counters(&Note::NoLongerOurs).is_empty());
        assert!(note_counters(&Note::NothingWhereAbsent).is_empty());
    }

    #[test]
    fn a_replay_counts_a_decoding_or_a_refused_coding_beyond_the_replay_itself() {
        assert_eq!(replay_counter(false, None), None);
        assert_eq!(replay_counter(true, None), Some(Counter::ReplaysDecoded));
        let refused = ProblemKind::EncodingNotAccepted { coding: "br".into() };
        assert_eq!(replay_counter(false, Some(&refused)), Some(Counter::ReplaysEncodingNotAccepted));
        // A replay without a body is counted as the replay it is, nothing more.
        let not_stored = ProblemKind::ResponseNotStored { status: 200, location: None };
        assert_eq!(replay_counter(false, Some(&not_stored)), None);
    }
}
