//! Local replies: problem documents and replays. Usable from an HTTP context, or from the root
//! context after `set_effective_context` to a live HTTP context (detached forwarding, waiters).

use proxy_wasm::hostcalls;

use crate::problem::ProblemKind;
use crate::record::{Creator, Record, State};

/// Sends a problem document.
pub fn problem(kind: &ProblemKind, request_id: &str, creator: Option<&Creator>) {
    let p = kind.to_problem(request_id, creator);
    let headers: Vec<(&str, &str)> = p.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    let _ = hostcalls::send_http_response(u32::from(p.status), headers, Some(&p.body));
}

/// The header advertising how long the key's record lasts (the IETF draft asks resources to
/// publish their expiry policy): seconds from now.
pub const EXPIRES_HEADER: &str = "idempotency-key-expires-in";

/// Seconds until `expires_at_ms`, rounded up.
pub fn expires_in(expires_at_ms: u64, now_ms: u64) -> String {
    expires_at_ms.saturating_sub(now_ms).div_ceil(1000).to_string()
}

/// Sends a response as the upstream gave it. `replayed` adds `idempotent-replayed: true`;
/// `expires_in` the expiry header. Header values that are not valid UTF-8 are left out (the host
/// call takes text).
pub fn response(status: u16, headers: &[(String, Vec<u8>)], body: &[u8], replayed: bool, expires_in: Option<&str>) {
    let mut h: Vec<(&str, &str)> =
        headers.iter().filter_map(|(n, v)| std::str::from_utf8(v).ok().map(|v| (n.as_str(), v))).collect();
    if replayed {
        h.push(("idempotent-replayed", "true"));
    }
    if let Some(e) = expires_in {
        h.push((EXPIRES_HEADER, e));
    }
    let _ = hostcalls::send_http_response(u32::from(status), h, Some(body));
}

/// Replays a completed record; returns the problem sent instead when there is no body to replay.
pub fn replay(record: &Record, request_id: &str, now_ms: u64) -> Option<ProblemKind> {
    match &record.state {
        State::Completed(r) => {
            response(r.status, &r.headers, &r.body, true, Some(&expires_in(record.expires_at_ms, now_ms)));
            None
        }
        State::CompletedTooLarge { status, location } => {
            let location = location.as_ref().map(|l| String::from_utf8_lossy(l).into_owned());
            let kind = ProblemKind::ResponseNotStored { status: *status, location };
            problem(&kind, request_id, Some(&record.creator));
            Some(kind)
        }
        _ => {
            problem(&ProblemKind::OutcomeUnknown, request_id, Some(&record.creator));
            Some(ProblemKind::OutcomeUnknown)
        }
    }
}
