//! Envoy's internal redirects (a route's `internal_redirect_policy`): the router follows a
//! 3xx itself, ends the request's stream (its filters see the end, with response code details
//! `internal_redirect`) and re-creates it for the target, which runs the filter chain again with
//! `x-envoy-original-url` set to the URL redirected from. Both streams are one request: the first
//! hands its claim over (`Handoffs::post`), the re-created one takes it (`Handoffs::take`) and
//! settles it with the final answer.
//!
//! The header alone proves nothing (a client can send it, and an internal client's reaches the
//! filter): a claim is taken only by a stream that carries the request's **mark**, of the same
//! VM, on the same downstream connection, created after the hand-over, within
//! `HANDOFF_WINDOW_MS`, under the same storage key (so the same caller scope and key), naming
//! the URL the claim's request was redirected from. The mark (`Command::Mark`) is the claim's
//! storage key, which the stream that forwards under the claim leaves in Envoy's filter state
//! with the life span `Request`: Envoy carries it into the streams it re-creates for that request
//! and into no other. Another request, even the same client's on the same connection (HTTP/1.1
//! keep-alive, another HTTP/2 stream), starts without it and cannot write it (no client writes
//! filter state). A claim nobody takes is settled outcome-unknown (its first hop executed) when
//! its window ends.

use crate::decision::Outcome;
use crate::record::UnknownReason;
use crate::scope::StorageKey;

/// The header Envoy sets on a re-created stream: `scheme://authority/path` redirected from.
pub const ORIGINAL_URL_HEADER: &str = "x-envoy-original-url";

/// Envoy's response code details of a stream ended for an internal redirect.
pub const REDIRECT_CODE_DETAILS: &str = "internal_redirect";

/// How long a handed-over claim waits for its re-created stream. Envoy re-creates it in the
/// same call as it ends the first (no wait at all), unless a filter before idemgate pauses it.
pub const HANDOFF_WINDOW_MS: u64 = 10_000;

/// At most this many claims wait at once per VM; beyond, the oldest is settled outcome-unknown.
pub const MAX_HANDOFFS: usize = 256;

/// How a re-created stream's exchange settles its claim: as any exchange, except that nothing
/// releases it (a connection failure or a `release_on_status` answer of the target says nothing
/// about the first hop, which executed): outcome-unknown instead.
pub fn after_first_hop(outcome: Outcome) -> Outcome {
    match outcome {
        Outcome::Release => Outcome::Unknown(UnknownReason::Other),
        o => o,
    }
}

/// A claim handed over by a stream Envoy ended for an internal redirect.
#[derive(Clone, Debug)]
pub struct Handoff<C> {
    pub claim: C,
    pub skey: StorageKey,
    /// The policy the claim was made under (the re-created stream's key is read with it).
    pub policy_index: usize,
    /// `authority` + `path` of the redirected request (what follows `scheme://` in Envoy's header).
    pub url: String,
    /// The downstream connection's id (`connection.id`); a hand-over without one is never taken.
    pub connection: Option<u64>,
    /// Whether the stream that handed it over left the request's mark (`Command::Mark`), or
    /// found it: a hand-over without one is never taken.
    pub marked: bool,
    /// The context that handed it over: only a later one takes it.
    pub from_context: u32,
    pub posted_ms: u64,
}

/// Whether `header` (an `x-envoy-original-url` value) names `url` (authority + path).
pub fn original_url_matches(header: &[u8], url: &str) -> bool {
    let rest = header.strip_prefix(b"http://").or_else(|| header.strip_prefix(b"https://"));
    rest.is_some_and(|r| r == url.as_bytes())
}

/// The authority of an `x-envoy-original-url` value (`http[s]://authority/path`), if it has one.
pub fn original_authority(header: &[u8]) -> Option<&str> {
    let rest = header.strip_prefix(b"http://").or_else(|| header.strip_prefix(b"https://"))?;
    let end = rest.iter().position(|b| *b == b'/').unwrap_or(rest.len());
    std::str::from_utf8(rest.get(..end)?).ok().filter(|a| !a.is_empty())
}

/// The path of an `x-envoy-original-url` value (`http[s]://authority/path`, query included), if
/// it has one.
pub fn original_path(header: &[u8]) -> Option<&str> {
    let rest = header.strip_prefix(b"http://").or_else(|| header.strip_prefix(b"https://"))?;
    let start = rest.iter().position(|b| *b == b'/')?;
    std::str::from_utf8(rest.get(start..)?).ok()
}

/// What the host tells of a stream that may continue a claim handed over.
#[derive(Clone, Copy, Debug)]
pub struct Stream {
    /// The mark found in its Request-life filter state (a storage key), if any.
    pub mark: Option<StorageKey>,
    /// Its downstream connection's id (`connection.id`).
    pub connection: Option<u64>,
    /// Its context (the native build: the count of hand-overs when it was created).
    pub context_id: u32,
}

/// The claims handed over and not yet taken, oldest first.
#[derive(Debug)]
pub struct Handoffs<C> {
    items: Vec<Handoff<C>>,
}

impl<C> Default for Handoffs<C> {
    fn default() -> Self {
        Handoffs { items: vec![] }
    }
}

impl<C> Handoffs<C> {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Hands a claim over; returns those pushed out (beyond `MAX_HANDOFFS`), to settle.
    pub fn post(&mut self, h: Handoff<C>) -> Vec<Handoff<C>> {
        self.items.push(h);
        let over = self.items.len().saturating_sub(MAX_HANDOFFS);
        self.items.drain(..over).collect()
    }

    fn fits(h: &Handoff<C>, original_url: &[u8], on: Stream, now_ms: u64) -> bool {
        h.marked
            && on.mark == Some(h.skey)
            && h.connection.is_some()
            && h.connection == on.connection
            && on.context_id > h.from_context
            && now_ms.saturating_sub(h.posted_ms) <= HANDOFF_WINDOW_MS
            && original_url_matches(original_url, &h.url)
    }

    /// The policies of the claims a stream (`on`, carrying `original_url`) could take, each
    /// once: its storage key is read under each.
    pub fn policies_for(&self, original_url: &[u8], on: Stream, now_ms: u64) -> Vec<usize> {
        let mut out: Vec<usize> = vec![];
        for h in &self.items {
            if Self::fits(h, original_url, on, now_ms) && !out.contains(&h.policy_index) {
                out.push(h.policy_index);
            }
        }
        out
    }

    /// Takes the claim a re-created stream continues, if one fits it exactly (see the module).
    /// Of two that fit (one key's requests on one connection: the mark is the storage key), the
    /// newest: Envoy re-creates a stream in the call that ends the one it continues, so nothing
    /// of the same key is handed over between; an older one is another request's, left to expire
    /// outcome-unknown.
    pub fn take(
        &mut self,
        skey: &StorageKey,
        policy_index: usize,
        original_url: &[u8],
        on: Stream,
        now_ms: u64,
    ) -> Option<Handoff<C>> {
        let pos = self.items.iter().rposition(|h| {
            h.skey == *skey && h.policy_index == policy_index && Self::fits(h, original_url, on, now_ms)
        })?;
        Some(self.items.remove(pos))
    }

    /// The claims whose window is over, to settle outcome-unknown.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Handoff<C>> {
        let (old, keep): (Vec<_>, Vec<_>) =
            self.items.drain(..).partition(|h| now_ms.saturating_sub(h.posted_ms) > HANDOFF_WINDOW_MS);
        self.items = keep;
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn h(skey: u8, conn: Option<u64>, ctx: u32, at: u64) -> Handoff<&'static str> {
        Handoff {
            claim: "c",
            skey: StorageKey([skey; 32]),
            policy_index: 0,
            url: "api.test/charges?x=1".into(),
            connection: conn,
            marked: true,
            from_context: ctx,
            posted_ms: at,
        }
    }

    const URL: &[u8] = b"http://api.test/charges?x=1";

    /// A stream carrying the mark of the request under storage key 1, on `conn`, of context `ctx`.
    fn on(conn: Option<u64>, ctx: u32) -> Stream {
        Stream { mark: Some(StorageKey([1; 32])), connection: conn, context_id: ctx }
    }

    #[test]
    fn the_authority_of_an_original_url() {
        assert_eq!(original_authority(b"http://pay.example.test/confirm/1"), Some("pay.example.test"));
        assert_eq!(original_authority(b"https://api.example.test:8443/x?y=/z"), Some("api.example.test:8443"));
        assert_eq!(original_authority(b"http://bare.example.test"), Some("bare.example.test"));
        assert_eq!(original_path(b"http://pay.example.test/confirm/1"), Some("/confirm/1"));
        assert_eq!(original_path(b"https://api.example.test:8443/x?y=/z"), Some("/x?y=/z"));
        assert_eq!(original_path(b"http://bare.example.test"), None);
        assert_eq!(original_path(b"/relative"), None);
        for none in [&b"ftp://a/b"[..], b"http:///path", b"/path", b""] {
            assert_eq!(original_authority(none), None, "{}", String::from_utf8_lossy(none));
        }
    }

    #[test]
    fn the_recreated_stream_takes_its_claim_once() {
        let mut t = Handoffs::default();
        assert!(t.post(h(1, Some(7), 10, 100)).is_empty());
        assert_eq!(t.policies_for(URL, on(Some(7), 11), 100), vec![0]);
        assert!(t.take(&StorageKey([1; 32]), 0, URL, on(Some(7), 11), 100).is_some());
        assert!(t.take(&StorageKey([1; 32]), 0, URL, on(Some(7), 12), 100).is_none());
        assert!(t.is_empty());
    }

    #[test]
    fn anything_else_takes_nothing() {
        let mut t = Handoffs::default();
        t.post(h(1, Some(7), 10, 100));
        let k = StorageKey([1; 32]);
        // another caller or key, another connection, an earlier context, too late, another URL
        assert!(t.take(&StorageKey([2; 32]), 0, URL, on(Some(7), 11), 100).is_none());
        assert!(t.take(&k, 1, URL, on(Some(7), 11), 100).is_none());
        assert!(t.take(&k, 0, URL, on(Some(8), 11), 100).is_none());
        assert!(t.take(&k, 0, URL, on(None, 11), 100).is_none());
        assert!(t.take(&k, 0, URL, on(Some(7), 10), 100).is_none());
        assert!(t.take(&k, 0, URL, on(Some(7), 11), 100 + HANDOFF_WINDOW_MS + 1).is_none());
        assert!(t.take(&k, 0, b"http://api.test/charges", on(Some(7), 11), 100).is_none());
        assert!(t.take(&k, 0, b"api.test/charges?x=1", on(Some(7), 11), 100).is_none());
        assert_eq!(t.len(), 1);
        // the same stream without the request's mark, or with another request's: never (a
        // request an internal client forges on the same connection starts without one)
        let unmarked = Stream { mark: None, ..on(Some(7), 11) };
        let other = Stream { mark: Some(StorageKey([2; 32])), ..on(Some(7), 11) };
        assert!(t.policies_for(URL, unmarked, 100).is_empty());
        assert!(t.take(&k, 0, URL, unmarked, 100).is_none());
        assert!(t.take(&k, 0, URL, other, 100).is_none());
        assert_eq!(t.len(), 1);
        // a hand-over without a mark is never taken, even by a stream without one
        let mut m = Handoffs::default();
        m.post(Handoff { marked: false, ..h(1, Some(7), 10, 100) });
        assert!(m.take(&k, 0, URL, unmarked, 100).is_none());
        assert!(m.take(&k, 0, URL, on(Some(7), 11), 100).is_none());
        // a hand-over without a connection id is never taken
        let mut u = Handoffs::default();
        u.post(h(1, None, 10, 100));
        assert!(u.take(&k, 0, URL, on(None, 11), 100).is_none());
    }

    #[test]
    fn of_two_hand_overs_of_one_key_the_stream_takes_the_newest() {
        // Review (h-review4): the mark is the storage key, so two requests of one key on one
        // connection both fit it. `stale_lock: "takeover"`, `lock_ttl_seconds` under the window:
        // R1's claim handed over (its target runs without idemgate) and gone stale, R2 takes it
        // over, is redirected, and hands its own claim over; Envoy re-creates R2's stream in the
        // same call, so its hand-over is the newest. Before, the stream took the oldest, R1's,
        // and R2's own expired outcome-unknown after R2's answer.
        let mut t = Handoffs::default();
        t.post(Handoff { claim: "r1", ..h(1, Some(7), 10, 100) });
        t.post(Handoff { claim: "r2", ..h(1, Some(7), 20, 5_000) });
        let taken = t.take(&StorageKey([1; 32]), 0, URL, on(Some(7), 21), 5_000).map(|h| h.claim);
        assert_eq!(taken, Some("r2"));
        // R1's, never taken by R2's stream, is settled outcome-unknown when its window ends.
        assert_eq!(t.expire(100 + HANDOFF_WINDOW_MS + 1).first().map(|h| h.claim), Some("r1"));
    }

    #[test]
    fn a_target_never_releases_the_claim() {
        assert!(matches!(after_first_hop(Outcome::Release), Outcome::Unknown(UnknownReason::Other)));
        assert!(matches!(after_first_hop(Outcome::Store), Outcome::Store));
        let timeout = Outcome::Unknown(UnknownReason::UpstreamTimeout);
        assert!(matches!(after_first_hop(timeout), Outcome::Unknown(UnknownReason::UpstreamTimeout)));
    }

    #[test]
    fn https_and_http_name_the_same_url() {
        assert!(original_url_matches(b"https://api.test/charges?x=1", "api.test/charges?x=1"));
        assert!(!original_url_matches(b"ftp://api.test/charges?x=1", "api.test/charges?x=1"));
    }

    #[test]
    fn unclaimed_handoffs_expire_and_overflow_pushes_the_oldest_out() {
        let mut t = Handoffs::default();
        t.post(h(1, Some(1), 1, 0));
        t.post(h(2, Some(1), 2, 5_000));
        let old = t.expire(HANDOFF_WINDOW_MS + 1);
        assert_eq!(old.len(), 1);
        assert_eq!(old[0].skey, StorageKey([1; 32]));
        assert_eq!(t.len(), 1);
        let mut pushed = 0;
        for i in 0..MAX_HANDOFFS {
            pushed += t.post(h(3, Some(1), i as u32, 6_000)).len();
        }
        assert_eq!(pushed, 1);
        assert_eq!(t.len(), MAX_HANDOFFS);
    }
}
