//! `idemgate probe`: what an API's answers say about its idempotency, judged per rule of the
//! IETF draft (draft-ietf-httpapi-idempotency-key-header). The command line sends the requests;
//! this module only judges what came back, so every verdict is unit-tested.
//!
//! The probe sees answers, not executions: a rule is "violated" only on evidence (two different
//! answers to one key, a 2xx where the draft asks a refusal), "kept" when the answers show it, and
//! "not-observed" when nothing showed either way (e.g. the concurrent requests never overlapped).

use serde_json::{json, Value};

/// One answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    /// Lowercase names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    fn problem(&self) -> bool {
        self.header("content-type")
            .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("application/problem+json"))
    }

    fn same_result(&self, other: &Answer) -> bool {
        self.status == other.status && self.body == other.body
    }
}

/// What the probe saw.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// The first request with key A.
    pub first: Answer,
    /// The same request again with key A.
    pub second: Answer,
    /// The same request sent several times at once with a fresh key B.
    pub concurrent: Vec<Answer>,
    /// Key A with a changed body.
    pub mismatch: Answer,
    /// A malformed key.
    pub malformed: Answer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Kept,
    Violated,
    NotObserved,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Kept => "kept",
            Verdict::Violated => "violated",
            Verdict::NotObserved => "not-observed",
        }
    }
}

/// One rule's verdict and what showed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
}

fn rule(name: &'static str, verdict: Verdict, detail: String) -> Rule {
    Rule { name, verdict, detail }
}

/// Judges every rule.
pub fn judge(s: &Seen) -> Vec<Rule> {
    let (first, second) = (&s.first, &s.second);
    let identical = if second.same_result(first) {
        rule(
            "replay-identical",
            Verdict::Kept,
            format!("the second call answered {} with the same body", second.status),
        )
    } else {
        rule(
            "replay-identical",
            Verdict::Violated,
            format!(
                "first answered {}, the second {} with another body: the call ran twice or was not replayed",
                first.status, second.status
            ),
        )
    };
    let marked = if second.replayed() {
        rule("replay-marked", Verdict::Kept, "the second call carried idempotent-replayed: true".into())
    } else {
        rule("replay-marked", Verdict::Violated, "the second call carried no idempotent-replayed: true".into())
    };
    rules_rest(s, vec![identical, marked])
}

fn rules_rest(s: &Seen, mut out: Vec<Rule>) -> Vec<Rule> {
    let answered: Vec<&Answer> = s.concurrent.iter().filter(|a| a.status != 409).collect();
    let conflicts = s.concurrent.len() - answered.len();
    let distinct = answered.first().map_or(0, |one| answered.iter().filter(|a| !a.same_result(one)).count());
    let originals = answered.iter().filter(|a| !a.replayed()).count();
    out.push(if distinct > 0 || originals > 1 {
        rule(
            "in-flight-409",
            Verdict::Violated,
            format!(
                "{} concurrent calls with one key: {} answered without a 409 ({} not marked as replays, {} with another result)",
                s.concurrent.len(),
                answered.len(),
                originals,
                distinct
            ),
        )
    } else if conflicts > 0 && s.concurrent.iter().filter(|a| a.status == 409).all(Answer::problem) {
        rule("in-flight-409", Verdict::Kept, format!("{conflicts} of {} concurrent calls answered 409 (problem+json)", s.concurrent.len()))
    } else if conflicts > 0 {
        rule("in-flight-409", Verdict::Violated, "a 409 that is not an application/problem+json document".into())
    } else {
        rule("in-flight-409", Verdict::NotObserved, "the concurrent calls never overlapped (all replays)".into())
    });
    out.push(match (s.mismatch.status, s.mismatch.problem()) {
        (422, true) => {
            rule("mismatch-422", Verdict::Kept, "a changed body with the same key answered 422 (problem+json)".into())
        }
        (st, p) => rule(
            "mismatch-422",
            Verdict::Violated,
            format!(
                "a changed body with the same key answered {st}{}",
                if p { "" } else { " without a problem document" }
            ),
        ),
    });
    out.push(match (s.malformed.status, s.malformed.problem()) {
        (400, true) => rule("malformed-key-400", Verdict::Kept, "a malformed key answered 400 (problem+json)".into()),
        (st, p) => rule(
            "malformed-key-400",
            Verdict::Violated,
            format!("a malformed key answered {st}{}", if p { "" } else { " without a problem document" }),
        ),
    });
    let published = [&s.first, &s.second]
        .iter()
        .find_map(|a| a.headers.iter().find(|(n, _)| n.contains("idempotency") && n.contains("expire")).cloned());
    out.push(match published {
        Some((n, v)) => rule("expiry-published", Verdict::Kept, format!("{n}: {v}")),
        None => rule("expiry-published", Verdict::Violated, "no idempotency-key-expires-in (or similar) header".into()),
    });
    out
}

/// True when no rule is violated.
pub fn passes(rules: &[Rule]) -> bool {
    rules.iter().all(|r| r.verdict != Verdict::Violated)
}

/// The JSON report (`--json`).
pub fn report(url: &str, rules: &[Rule]) -> Value {
    let rules: Vec<Value> =
        rules.iter().map(|r| json!({"rule": r.name, "verdict": r.verdict.as_str(), "detail": r.detail})).collect();
    json!({"url": url, "rules": rules, "passed": rules.iter().all(|r| r["verdict"] != "violated")})
}

/// The body of the mismatch request: a JSON object gains a member, anything else a suffix, so
/// the body differs whatever JSON canonicalisation the API applies.
pub fn changed_body(body: &[u8]) -> Vec<u8> {
    if let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(body) {
        m.insert("idemgate_probe_changed".into(), json!(true));
        if let Ok(v) = serde_json::to_vec(&Value::Object(m)) {
            return v;
        }
    }
    let mut b = body.to_vec();
    b.extend_from_slice(b"-idemgate-probe-changed");
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn a(status: u16, body: &str, headers: &[(&str, &str)]) -> Answer {
        Answer {
            status,
            headers: headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    const PROBLEM: (&str, &str) = ("content-type", "application/problem+json");

    fn good() -> Seen {
        let exp = ("idempotency-key-expires-in", "86400");
        Seen {
            first: a(201, "{\"id\":1}", &[exp]),
            second: a(201, "{\"id\":1}", &[("idempotent-replayed", "true"), exp]),
            concurrent: vec![a(201, "{\"id\":2}", &[]), a(409, "{}", &[PROBLEM]), a(409, "{}", &[PROBLEM])],
            mismatch: a(422, "{}", &[PROBLEM]),
            malformed: a(400, "{}", &[PROBLEM]),
        }
    }

    fn verdicts(s: &Seen) -> Vec<(&'static str, Verdict)> {
        judge(s).into_iter().map(|r| (r.name, r.verdict)).collect()
    }

    #[test]
    fn an_api_that_keeps_every_rule_passes() {
        let rules = judge(&good());
        assert!(passes(&rules), "{rules:?}");
        assert_eq!(rules.len(), 6);
    }

    #[test]
    fn an_api_without_idempotency_violates_every_rule() {
        let plain = Seen {
            first: a(201, "{\"id\":1}", &[]),
            second: a(201, "{\"id\":2}", &[]),
            concurrent: vec![a(201, "{\"id\":3}", &[]), a(201, "{\"id\":4}", &[])],
            mismatch: a(201, "{\"id\":5}", &[]),
            malformed: a(201, "{\"id\":6}", &[]),
        };
        assert!(verdicts(&plain).iter().all(|(_, v)| *v == Verdict::Violated), "{:?}", verdicts(&plain));
    }

    #[test]
    fn concurrent_calls_that_never_overlapped_prove_nothing() {
        let mut s = good();
        let replay = a(201, "{\"id\":2}", &[("idempotent-replayed", "true")]);
        s.concurrent = vec![a(201, "{\"id\":2}", &[]), replay.clone(), replay];
        assert!(verdicts(&s).contains(&("in-flight-409", Verdict::NotObserved)));
        assert!(passes(&judge(&s)));
        s.concurrent.push(a(201, "{\"id\":2}", &[]));
        assert!(verdicts(&s).contains(&("in-flight-409", Verdict::Violated)), "two originals: it ran twice");
    }

    #[test]
    fn a_mismatch_or_malformed_key_must_be_refused_with_a_problem() {
        let mut s = good();
        s.mismatch = a(422, "{}", &[]);
        s.malformed = a(409, "{}", &[PROBLEM]);
        let v = verdicts(&s);
        assert!(
            v.contains(&("mismatch-422", Verdict::Violated)) && v.contains(&("malformed-key-400", Verdict::Violated))
        );
    }

    #[test]
    fn a_changed_body_differs_even_after_canonicalisation() {
        assert_eq!(changed_body(b"{\"a\":1}"), b"{\"a\":1,\"idemgate_probe_changed\":true}".to_vec());
        assert_eq!(changed_body(b"x"), b"x-idemgate-probe-changed".to_vec());
    }
}
