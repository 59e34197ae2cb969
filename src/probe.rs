//! `idemgate probe`: what an API does with an Idempotency-Key, judged per rule of a profile
//! (`draft`: the IETF draft draft-ietf-httpapi-idempotency-key-header-06 only; `stripe`: Stripe's
//! documented behaviour; `strict`: idemgate's own answers). The command line sends the requests
//! and measures executions; this module only judges what came back, so every verdict is
//! unit-tested.
//!
//! Executions are judged on evidence, not on appearances: a count or list URL read around each
//! step (`Executions::Counted` / `Executions::Changed`), or, without one, a request under a fresh
//! key (`Seen::fresh`) whose answer shows whether the API's answers tell executions apart at all.
//! Each rule ends `kept`, `violated`, `inconclusive` (nothing showed either way) or `skipped`,
//! with the request and the answer that decided it.

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

    fn marked(&self, replay_header: &str) -> bool {
        self.header(replay_header).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    fn problem(&self) -> bool {
        self.header("content-type")
            .is_some_and(|v| v.trim().to_ascii_lowercase().starts_with("application/problem+json"))
    }

    /// The draft's error answers: a body describing the problem (or linking documentation), or a
    /// `Link` header.
    fn described(&self) -> bool {
        !self.body.iter().all(u8::is_ascii_whitespace) || self.header("link").is_some()
    }

    fn links_documentation(&self) -> bool {
        self.header("link").is_some() || {
            let b = String::from_utf8_lossy(&self.body);
            b.contains("http://") || b.contains("https://")
        }
    }

    fn same_result(&self, other: &Answer) -> bool {
        self.status == other.status && self.body == other.body
    }

    /// `201, 57 bytes, content-type: application/json`.
    pub fn summary(&self) -> String {
        let ct = self.header("content-type").map_or(String::new(), |c| format!(", content-type: {c}"));
        let body = String::from_utf8_lossy(&self.body);
        let shown: String = body.chars().take(120).collect();
        let more = if body.chars().count() > 120 { "…" } else { "" };
        format!("{}{ct}, body {shown:?}{more}", self.status)
    }
}

/// What the evidence URL showed across one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executions {
    /// The count (or the list's length) grew by this much.
    Counted(u64),
    /// The list's body changed (or not); how many times is unknown.
    Changed(bool),
    /// No evidence URL.
    Unknown,
}

impl Executions {
    /// None when unknown; Some(true) when at least one execution happened.
    fn any(self) -> Option<bool> {
        match self {
            Executions::Counted(n) => Some(n > 0),
            Executions::Changed(c) => Some(c),
            Executions::Unknown => None,
        }
    }

    fn describe(self) -> String {
        match self {
            Executions::Counted(n) => format!("{n} execution(s) counted"),
            Executions::Changed(true) => "the list changed (at least one execution)".into(),
            Executions::Changed(false) => "the list did not change (no execution)".into(),
            Executions::Unknown => "executions not measured".into(),
        }
    }
}

/// One step: the requests sent (described), their answers, and the executions seen across it.
#[derive(Clone, Debug)]
pub struct Step {
    pub request: String,
    pub answers: Vec<Answer>,
    pub executions: Executions,
}

impl Step {
    pub fn one(request: impl Into<String>, answer: Answer, executions: Executions) -> Step {
        Step { request: request.into(), answers: vec![answer], executions }
    }

    fn answer(&self) -> &Answer {
        static NONE: Answer = Answer { status: 0, headers: vec![], body: vec![] };
        self.answers.first().unwrap_or(&NONE)
    }
}

/// What the probe saw (a step is absent when its rule was skipped).
#[derive(Clone, Debug)]
pub struct Seen {
    /// The first request with key A.
    pub first: Step,
    /// The same request again with key A.
    pub second: Option<Step>,
    /// The same request under a fresh key (only without an evidence URL).
    pub fresh: Option<Step>,
    /// The same request sent several times at once with a fresh key B.
    pub concurrent: Option<Step>,
    /// Key A with a changed body.
    pub mismatch: Option<Step>,
    /// A malformed key.
    pub malformed: Option<Step>,
    /// No key at all.
    pub missing: Option<Step>,
    /// Key A from the second caller (other credentials).
    pub other_caller: Option<Step>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Kept,
    Violated,
    Inconclusive,
    Skipped,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Kept => "kept",
            Verdict::Violated => "violated",
            Verdict::Inconclusive => "inconclusive",
            Verdict::Skipped => "skipped",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    Draft,
    Stripe,
    Strict,
}

impl Profile {
    pub fn parse(s: &str) -> Result<Profile, String> {
        match s {
            "draft" => Ok(Profile::Draft),
            "stripe" => Ok(Profile::Stripe),
            "strict" => Ok(Profile::Strict),
            _ => Err(format!("--profile {s:?}: expected draft, stripe or strict")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Draft => "draft",
            Profile::Stripe => "stripe",
            Profile::Strict => "strict",
        }
    }

    /// What the profile's rules come from.
    pub fn source(self) -> &'static str {
        match self {
            Profile::Draft => "draft-ietf-httpapi-idempotency-key-header-06",
            Profile::Stripe => "Stripe API reference, Idempotent requests (docs.stripe.com/api/idempotent_requests)",
            Profile::Strict => "idemgate's own answers (README, docs/probe.md)",
        }
    }
}

/// Every rule's name, in the order reported.
pub const RULES: [&str; 8] = [
    "replay-identical",
    "replay-marked",
    "in-flight-409",
    "mismatch-refused",
    "malformed-key-400",
    "missing-key-400",
    "other-caller-scoped",
    "expiry-published",
];

/// A rule as a profile states it: where, how strongly, in its words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clause {
    pub section: &'static str,
    pub level: &'static str,
    pub wording: &'static str,
}

/// The clause of `rule` in `profile`, None when the profile has no such rule.
pub fn clause(profile: Profile, rule: &str) -> Option<Clause> {
    let c = |section, level, wording| Some(Clause { section, level, wording });
    match (profile, rule) {
        (Profile::Draft, "replay-identical") => c(
            "§2.6 Idempotency Enforcement Scenarios",
            "SHOULD",
            "Duplicate request (idempotency key has been seen): retry if the original request was processed; the resource SHOULD respond with the result of the previously completed operation, success or an error",
        ),
        (Profile::Draft, "in-flight-409") => c(
            "§2.7 Error Scenarios",
            "SHOULD",
            "If the request is retried, while the original request is still being processed, the resource server SHOULD reply with an HTTP 409 status code with body containing problem description",
        ),
        (Profile::Draft, "mismatch-refused") => c(
            "§2.7 Error Scenarios",
            "SHOULD",
            "If there is an attempt to reuse an idempotency key with a different request payload, the resource server SHOULD reply with a HTTP 422 status code with body containing a link pointing to relevant documentation (or the HTTP header Link)",
        ),
        (Profile::Draft, "missing-key-400") => c(
            "§2.7 Error Scenarios",
            "SHOULD",
            "If the Idempotency-Key request header is missing for a documented idempotent operation requiring this header, the resource server SHOULD reply with an HTTP 400 status code with body containing a link pointing to relevant documentation (or the HTTP header Link)",
        ),
        (Profile::Stripe, "replay-identical") => c(
            "Idempotent requests",
            "documented",
            "Subsequent requests with the same key return the same result (status code and body of the first request), including 500 errors",
        ),
        (Profile::Stripe, "replay-marked") => c(
            "Idempotent requests",
            "documented",
            "A replayed response carries the header Idempotent-Replayed: true",
        ),
        (Profile::Stripe, "in-flight-409") => c(
            "Errors (409 Conflict)",
            "documented",
            "The request conflicts with another request (perhaps due to using the same idempotent key): 409",
        ),
        (Profile::Stripe, "mismatch-refused") => c(
            "Idempotent requests",
            "documented",
            "The idempotency layer compares incoming parameters to those of the original request and errors if they're not the same (an idempotency_error, a 4xx)",
        ),
        (Profile::Stripe, "other-caller-scoped") => c(
            "Idempotent requests",
            "documented",
            "Keys belong to the account that sent them: another account's request with the same key is its own request",
        ),
        (Profile::Strict, "replay-identical") => {
            c("idemgate", "required", "A retry is answered with the stored status and body; the operation runs once")
        }
        (Profile::Strict, "replay-marked") => {
            c("idemgate", "required", "A replayed answer carries the replay header (Idempotent-Replayed: true)")
        }
        (Profile::Strict, "in-flight-409") => c(
            "idemgate",
            "required",
            "A duplicate while the first is executing is answered 409 application/problem+json; the operation runs once",
        ),
        (Profile::Strict, "mismatch-refused") => c(
            "idemgate",
            "required",
            "The same key with another body is answered 422 application/problem+json and never executed",
        ),
        (Profile::Strict, "malformed-key-400") => {
            c("idemgate", "required", "A malformed key is answered 400 application/problem+json and never executed")
        }
        (Profile::Strict, "missing-key-400") => {
            c("idemgate", "required", "A request without a key where one is required is answered 400 application/problem+json")
        }
        (Profile::Strict, "other-caller-scoped") => c(
            "idemgate",
            "required",
            "Keys are scoped to the caller: another caller's request with the same key never gets the first caller's answer",
        ),
        (Profile::Strict, "expiry-published") => c(
            "idemgate",
            "required",
            "Answers publish the key's lifetime in a header (idempotency-key-expires-in or similar)",
        ),
        _ => None,
    }
}

/// How the rules are judged.
#[derive(Clone, Debug)]
pub struct Options {
    pub profile: Profile,
    /// Lowercase name of the replay header (default `idempotent-replayed`).
    pub replay_header: String,
    /// Rules asked to be skipped.
    pub skip: Vec<String>,
}

/// One rule's verdict and what decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub name: &'static str,
    pub clause: Option<Clause>,
    pub verdict: Verdict,
    pub detail: String,
    /// The request that decided it and its answer(s).
    pub request: String,
    pub answers: Vec<String>,
    pub executions: String,
}

/// The rules the probe will judge, and so the steps it must send (a skipped rule sends nothing).
pub fn wanted(o: &Options, rule: &str) -> bool {
    clause(o.profile, rule).is_some() && !o.skip.iter().any(|s| s == rule)
}

/// Judges every rule of the profile. `first` must already be the expected success (the command
/// line stops with exit 2 otherwise).
pub fn judge(s: &Seen, o: &Options) -> Vec<Rule> {
    RULES
        .iter()
        .filter(|name| clause(o.profile, name).is_some())
        .map(|&name| {
            let cl = clause(o.profile, name);
            let step = step_for(s, name);
            let skipped = |why: &str| Rule {
                name,
                clause: cl,
                verdict: Verdict::Skipped,
                detail: why.into(),
                request: String::new(),
                answers: vec![],
                executions: String::new(),
            };
            if o.skip.iter().any(|k| k == name) {
                return skipped("skipped (--skip)");
            }
            let Some(step) = step else {
                return skipped(match name {
                    "missing-key-400" => "not checked (pass --check-missing-key when the operation requires a key)",
                    "other-caller-scoped" => {
                        "not checked (pass --second-caller-header with another caller's credentials)"
                    }
                    _ => "not checked",
                });
            };
            let (verdict, detail) = match name {
                "replay-identical" => replay(s, step, o),
                "replay-marked" => marked(step, o),
                "in-flight-409" => in_flight(s, step, o),
                "mismatch-refused" => mismatch(s, step, o),
                "malformed-key-400" => refused_400(step, "a malformed key", o),
                "missing-key-400" => refused_400(step, "a request without a key", o),
                "other-caller-scoped" => scoped(s, step),
                _ => expiry(s),
            };
            Rule {
                name,
                clause: cl,
                verdict,
                detail,
                request: step.request.clone(),
                answers: step.answers.iter().map(Answer::summary).collect(),
                executions: step.executions.describe(),
            }
        })
        .collect()
}

fn step_for<'a>(s: &'a Seen, rule: &str) -> Option<&'a Step> {
    match rule {
        "replay-identical" | "replay-marked" => s.second.as_ref(),
        "in-flight-409" => s.concurrent.as_ref(),
        "mismatch-refused" => s.mismatch.as_ref(),
        "malformed-key-400" => s.malformed.as_ref(),
        "missing-key-400" => s.missing.as_ref(),
        "other-caller-scoped" => s.other_caller.as_ref(),
        _ => Some(&s.first),
    }
}

/// Whether the API's answers tell executions apart: None without the fresh-key request.
fn answers_tell_executions_apart(s: &Seen) -> Option<bool> {
    s.fresh.as_ref().map(|f| !f.answer().same_result(s.first.answer()))
}

fn replay(s: &Seen, step: &Step, o: &Options) -> (Verdict, String) {
    let (first, second) = (s.first.answer(), step.answer());
    let executed = step.executions.any();
    let same_body = first.body == second.body;
    let what = match (first.status == second.status, same_body) {
        (true, true) => format!("the retry answered {} with the same body", second.status),
        (true, false) => format!("the retry answered {} with a different body", second.status),
        (false, true) => {
            format!("the retry answered {} (the first {}) with the same body", second.status, first.status)
        }
        (false, false) => {
            format!("the retry answered {} (the first {}) with a different body", second.status, first.status)
        }
    };
    if executed == Some(true) {
        return (Verdict::Violated, format!("{what}; the retry executed again ({})", step.executions.describe()));
    }
    let identical = first.same_result(second);
    if executed == Some(false) {
        return if identical {
            (Verdict::Kept, format!("{what}; no new execution"))
        } else if o.profile == Profile::Draft && second.status == 409 && same_body {
            (
                Verdict::Violated,
                format!("{what}; no new execution, but the draft asks for the previous result, not a 409"),
            )
        } else {
            (Verdict::Violated, format!("{what}; no new execution, but not the first answer"))
        };
    }
    // No evidence URL: the fresh key's answer shows whether answers tell executions apart.
    match (identical, answers_tell_executions_apart(s)) {
        (false, _) => (Verdict::Violated, format!("{what}: not the first answer (executions not measured)")),
        // The answer was replayed, but an answer says nothing of the execution behind it: a
        // server can run the operation again and then answer with the stored result.
        (true, Some(true)) => (
            Verdict::Inconclusive,
            format!(
                "{what}, while a fresh key got a different answer: the answer was replayed, but whether the retry executed again was not measured (pass --count-url or --list-url)"
            ),
        ),
        (true, Some(false)) => (
            Verdict::Inconclusive,
            format!(
                "{what}, but a fresh key got the same answer too: the answers cannot tell a replay from a new execution (pass --count-url or --list-url)"
            ),
        ),
        (true, None) => (Verdict::Inconclusive, format!("{what}; executions not measured")),
    }
}

fn marked(step: &Step, o: &Options) -> (Verdict, String) {
    let second = step.answer();
    match second.header(&o.replay_header) {
        Some(v) if v.trim().eq_ignore_ascii_case("true") => {
            (Verdict::Kept, format!("the retry carried {}: true", o.replay_header))
        }
        Some(v) => (Verdict::Violated, format!("the retry carried {}: {v} (not true)", o.replay_header)),
        None => {
            let other: Vec<&str> = second
                .headers
                .iter()
                .filter(|(n, _)| n.contains("replay") && *n != o.replay_header)
                .map(|(n, _)| n.as_str())
                .collect();
            let hint = if other.is_empty() {
                String::new()
            } else {
                format!(" (it carried {}: see --replay-header)", other.join(", "))
            };
            (Verdict::Violated, format!("the retry carried no {}{hint}", o.replay_header))
        }
    }
}

fn in_flight(s: &Seen, step: &Step, o: &Options) -> (Verdict, String) {
    let n = step.answers.len();
    let conflicts: Vec<&Answer> = step.answers.iter().filter(|a| a.status == 409).collect();
    let others: Vec<&Answer> = step.answers.iter().filter(|a| a.status != 409).collect();
    let marked = others.iter().filter(|a| a.marked(&o.replay_header)).count();
    let distinct = others.first().map_or(0, |one| others.iter().filter(|a| !a.same_result(one)).count());
    let observed = format!(
        "{n} concurrent requests with one key: {} answered 409, {} answered otherwise ({} marked as replays, {} unlike the first of them)",
        conflicts.len(),
        others.len(),
        marked,
        distinct
    );
    let ran = match step.executions {
        Executions::Counted(k) => Some(k),
        Executions::Changed(false) => Some(0),
        _ => None,
    };
    if let Some(k) = ran.filter(|k| *k > 1) {
        return (Verdict::Violated, format!("{observed}; {k} executions counted: it ran more than once"));
    }
    if ran.is_none() && distinct > 0 && answers_tell_executions_apart(s) != Some(false) {
        return (Verdict::Violated, format!("{observed}: different results to one key"));
    }
    if ran.is_none() && others.len() > 1 && marked + 1 < others.len() {
        // Without evidence, several unmarked successes to one key: ran more than once unless
        // the answers cannot tell (then inconclusive below).
        if answers_tell_executions_apart(s) == Some(true) {
            return (Verdict::Violated, format!("{observed}: more than one unmarked answer"));
        }
    }
    let conflict_ok = |a: &&Answer| match o.profile {
        Profile::Strict => a.problem(),
        Profile::Draft => a.described(),
        Profile::Stripe => true,
    };
    if !conflicts.is_empty() {
        if let Some(bad) = conflicts.iter().find(|a| !conflict_ok(a)) {
            let want = if o.profile == Profile::Strict {
                "an application/problem+json document"
            } else {
                "a problem description"
            };
            return (Verdict::Violated, format!("{observed}; a 409 without {want}: {}", bad.summary()));
        }
        let evidence = ran.map_or(String::new(), |k| format!("; {k} execution(s) counted"));
        let kind = if conflicts.iter().all(|a| a.problem()) { " (problem+json)" } else { " (plain bodies)" };
        if ran.is_none() && answers_tell_executions_apart(s) == Some(false) && others.len() > 1 {
            return (Verdict::Inconclusive, format!("{observed}{kind}: the answers cannot tell executions apart"));
        }
        return (Verdict::Kept, format!("{observed}{kind}{evidence}"));
    }
    // No 409: the duplicates were held and answered later (or ran).
    if ran.is_none() && answers_tell_executions_apart(s) == Some(false) {
        return (
            Verdict::Inconclusive,
            format!("{observed}, no 409: the answers cannot tell executions apart (a fresh key got the same answer; pass --count-url or --list-url)"),
        );
    }
    let evidence = ran.map_or(" (executions not measured)".to_string(), |k| format!("; {k} execution(s) counted"));
    (
        Verdict::Inconclusive,
        format!(
            "{observed}, no 409{evidence}: every duplicate got the first one's result, so the draft's 409 for a request still in progress was not observed (the server held them, or they arrived after it finished)"
        ),
    )
}

fn mismatch(s: &Seen, step: &Step, o: &Options) -> (Verdict, String) {
    let a = step.answer();
    let first = s.first.answer();
    let body_word = if a.body == first.body { "the first answer's body" } else { "a different body" };
    let observed = format!("key A with a changed body answered {} with {body_word}", a.status);
    if step.executions.any() == Some(true) {
        return (Verdict::Violated, format!("{observed}; the changed body executed ({})", step.executions.describe()));
    }
    let (ok, want) = match o.profile {
        Profile::Draft => (a.status == 422 && a.described(), "422 with a body or a Link header"),
        Profile::Strict => (a.status == 422 && a.problem(), "422 application/problem+json"),
        Profile::Stripe => ((400..500).contains(&a.status) && a.status != 409, "a 4xx idempotency error"),
    };
    if ok {
        let link = if o.profile == Profile::Draft && !a.links_documentation() {
            " (no link to documentation in the body or a Link header)"
        } else {
            ""
        };
        (Verdict::Kept, format!("{observed}{link}"))
    } else if a.same_result(first) && answers_tell_executions_apart(s) == Some(false) {
        (
            Verdict::Violated,
            format!("{observed}: the same answer as the first request (and as a fresh key), not refused ({want})"),
        )
    } else if a.same_result(first) {
        (
            Verdict::Violated,
            format!("{observed}: it was answered as a replay of the first request, not refused ({want})"),
        )
    } else if (200..300).contains(&a.status) && step.executions.any().is_none() {
        (Verdict::Violated, format!("{observed}: accepted, not refused ({want}); executions not measured"))
    } else {
        (Verdict::Violated, format!("{observed}, not {want}"))
    }
}

fn refused_400(step: &Step, what: &str, o: &Options) -> (Verdict, String) {
    let a = step.answer();
    let observed = format!("{what} answered {}", a.summary());
    if step.executions.any() == Some(true) {
        return (Verdict::Violated, format!("{observed}; it executed ({})", step.executions.describe()));
    }
    let ok = a.status == 400
        && match o.profile {
            Profile::Strict => a.problem(),
            _ => a.described(),
        };
    if ok {
        (Verdict::Kept, observed)
    } else {
        let want = if o.profile == Profile::Strict {
            "400 application/problem+json"
        } else {
            "400 with a body or a Link header"
        };
        (Verdict::Violated, format!("{observed}, not {want}"))
    }
}

fn scoped(s: &Seen, step: &Step) -> (Verdict, String) {
    let (a, first) = (step.answer(), s.first.answer());
    let observed = format!("the second caller's request with key A answered {}", a.status);
    if a.body == first.body && !a.body.is_empty() {
        if step.executions.any() == Some(true) {
            // It ran as its own request: the same bytes are the operation's, not a replay.
            return (
                Verdict::Kept,
                format!(
                    "{observed} with the first caller's body, but it executed as its own request ({})",
                    step.executions.describe()
                ),
            );
        }
        if answers_tell_executions_apart(s) == Some(false) {
            return (
                Verdict::Inconclusive,
                format!("{observed} with the first caller's body, but every execution answers that body"),
            );
        }
        return (
            Verdict::Violated,
            format!("{observed} with the first caller's body: the key is not scoped to the caller"),
        );
    }
    (Verdict::Kept, format!("{observed} with its own answer ({})", step.executions.describe()))
}

fn expiry(s: &Seen) -> (Verdict, String) {
    let published = s
        .first
        .answers
        .iter()
        .chain(s.second.iter().flat_map(|st| st.answers.iter()))
        .find_map(|a| a.headers.iter().find(|(n, _)| n.contains("idempotency") && n.contains("expire")).cloned());
    match published {
        Some((n, v)) => (Verdict::Kept, format!("{n}: {v}")),
        None => (
            Verdict::Violated,
            "no idempotency-key-expires-in (or similar) header on the first answer or the retry".into(),
        ),
    }
}

/// The process's exit status for these verdicts: 1 on a violation, 3 on an inconclusive rule
/// when `fail_inconclusive`, else 0.
pub fn exit_code(rules: &[Rule], fail_inconclusive: bool) -> u8 {
    if rules.iter().any(|r| r.verdict == Verdict::Violated) {
        1
    } else if fail_inconclusive && rules.iter().any(|r| r.verdict == Verdict::Inconclusive) {
        3
    } else {
        0
    }
}

fn count(rules: &[Rule], v: Verdict) -> usize {
    rules.iter().filter(|r| r.verdict == v).count()
}

/// One line: what the verdicts add up to.
pub fn summary(url: &str, o: &Options, rules: &[Rule]) -> String {
    format!(
        "{url}: profile {} ({}): {} kept, {} violated, {} inconclusive, {} skipped",
        o.profile.as_str(),
        o.profile.source(),
        count(rules, Verdict::Kept),
        count(rules, Verdict::Violated),
        count(rules, Verdict::Inconclusive),
        count(rules, Verdict::Skipped)
    )
}

/// The JSON report (`--json`).
pub fn report(url: &str, o: &Options, rules: &[Rule], requests_sent: usize) -> Value {
    let rs: Vec<Value> = rules
        .iter()
        .map(|r| {
            json!({
                "rule": r.name,
                "verdict": r.verdict.as_str(),
                "detail": r.detail,
                "section": r.clause.map(|c| c.section),
                "level": r.clause.map(|c| c.level),
                "wording": r.clause.map(|c| c.wording),
                "request": r.request,
                "answers": r.answers,
                "executions": r.executions,
            })
        })
        .collect();
    json!({
        "url": url,
        "profile": o.profile.as_str(),
        "source": o.profile.source(),
        "requests_sent": requests_sent,
        "rules": rs,
        "passed": !rules.iter().any(|r| r.verdict == Verdict::Violated),
    })
}

fn xml(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control() || *c == '\n' || *c == '\t')
        .map(|c| match c {
            '&' => "&amp;".to_string(),
            '<' => "&lt;".to_string(),
            '>' => "&gt;".to_string(),
            '"' => "&quot;".to_string(),
            '\'' => "&apos;".to_string(),
            c => c.to_string(),
        })
        .collect()
}

/// JUnit XML (`--junit FILE`): one test case per rule; violated is a failure, skipped skipped,
/// inconclusive a failure only when `fail_inconclusive` (else skipped with its reason).
pub fn junit(url: &str, o: &Options, rules: &[Rule], fail_inconclusive: bool) -> String {
    let fails = |r: &Rule| r.verdict == Verdict::Violated || (fail_inconclusive && r.verdict == Verdict::Inconclusive);
    let failures = rules.iter().filter(|r| fails(r)).count();
    let skipped = rules.iter().filter(|r| !fails(r) && r.verdict != Verdict::Kept).count();
    let mut out = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites>\n<testsuite name=\"idemgate probe {} {}\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\">\n",
        xml(o.profile.as_str()),
        xml(url),
        rules.len()
    );
    for r in rules {
        let text = format!(
            "{}\n{}\nrequest: {}\nanswers: {}\n{}",
            r.detail,
            r.clause.map_or(String::new(), |c| format!("{} {}: {}", c.section, c.level, c.wording)),
            r.request,
            r.answers.join(" | "),
            r.executions
        );
        out.push_str(&format!("<testcase classname=\"idemgate.probe.{}\" name=\"{}\">", o.profile.as_str(), r.name));
        if fails(r) {
            out.push_str(&format!("<failure message=\"{}\">{}</failure>", xml(r.verdict.as_str()), xml(&text)));
        } else if r.verdict != Verdict::Kept {
            out.push_str(&format!("<skipped message=\"{}: {}\"/>", r.verdict.as_str(), xml(&r.detail)));
        } else {
            out.push_str(&format!("<system-out>{}</system-out>", xml(&text)));
        }
        out.push_str("</testcase>\n");
    }
    out.push_str("</testsuite>\n</testsuites>\n");
    out
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

/// What an evidence URL's answer counts: a JSON number, an object with a `count`/`total` number
/// (or a single numeric member), or the length of a JSON array (alone or the only array member
/// of an object). None when it holds no count (then only a change of its body is evidence).
pub fn evidence_count(body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    match &v {
        Value::Number(n) => n.as_u64(),
        Value::Array(items) => Some(items.len() as u64),
        Value::Object(m) => {
            for k in ["count", "total", "total_count", "executions"] {
                if let Some(n) = m.get(k).and_then(Value::as_u64) {
                    return Some(n);
                }
            }
            let arrays: Vec<&Vec<Value>> = m.values().filter_map(Value::as_array).collect();
            if let [one] = arrays.as_slice() {
                return Some(one.len() as u64);
            }
            let numbers: Vec<u64> = m.values().filter_map(Value::as_u64).collect();
            if let [one] = numbers.as_slice() {
                return Some(*one);
            }
            None
        }
        _ => std::str::from_utf8(body).ok()?.trim().parse().ok(),
    }
}

/// The executions between two readings of the evidence URL.
pub fn executions_between(before: &[u8], after: &[u8]) -> Executions {
    match (evidence_count(before), evidence_count(after)) {
        (Some(b), Some(a)) => Executions::Counted(a.saturating_sub(b)),
        _ => Executions::Changed(before != after),
    }
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

    fn st(answers: Vec<Answer>, e: Executions) -> Option<Step> {
        Some(Step { request: "POST /x".into(), answers, executions: e })
    }

    const PROBLEM: (&str, &str) = ("content-type", "application/problem+json");
    const REPLAYED: (&str, &str) = ("idempotent-replayed", "true");

    fn opts(p: Profile) -> Options {
        Options { profile: p, replay_header: "idempotent-replayed".into(), skip: vec![] }
    }

    fn good(e: bool) -> Seen {
        let exp = ("idempotency-key-expires-in", "86400");
        let ex = |n| if e { Executions::Counted(n) } else { Executions::Unknown };
        Seen {
            first: Step::one("POST /x", a(201, "{\"id\":1}", &[exp]), ex(1)),
            second: st(vec![a(201, "{\"id\":1}", &[REPLAYED, exp])], ex(0)),
            fresh: if e { None } else { st(vec![a(201, "{\"id\":9}", &[])], ex(1)) },
            concurrent: st(vec![a(201, "{\"id\":2}", &[]), a(409, "{}", &[PROBLEM]), a(409, "{}", &[PROBLEM])], ex(1)),
            mismatch: st(vec![a(422, "{\"type\":\"https://x/doc\"}", &[PROBLEM])], ex(0)),
            malformed: st(vec![a(400, "{}", &[PROBLEM])], ex(0)),
            missing: None,
            other_caller: None,
        }
    }

    fn verdict(s: &Seen, p: Profile, rule: &str) -> Verdict {
        judge(s, &opts(p)).into_iter().find(|r| r.name == rule).map(|r| r.verdict).unwrap_or(Verdict::Skipped)
    }

    #[test]
    fn an_api_that_keeps_every_rule_passes_every_profile() {
        for e in [true, false] {
            for p in [Profile::Draft, Profile::Stripe, Profile::Strict] {
                let rules = judge(&good(e), &opts(p));
                // Without evidence a replayed answer proves no more than the answer.
                let open = |r: &&Rule| !e && r.name == "replay-identical" && r.verdict == Verdict::Inconclusive;
                let bad: Vec<_> = rules
                    .iter()
                    .filter(|r| !matches!(r.verdict, Verdict::Kept | Verdict::Skipped) && !open(r))
                    .collect();
                assert!(bad.is_empty(), "{p:?} evidence {e}: {bad:?}");
                assert_eq!(exit_code(&rules, e), 0);
            }
        }
    }

    /// A server that executes every request and then answers a seen key with its stored answer
    /// looks exactly like a replay: without evidence never kept, with it violated.
    #[test]
    fn a_replayed_answer_without_evidence_is_not_kept() {
        let mut s = good(false);
        assert_eq!(verdict(&s, Profile::Draft, "replay-identical"), Verdict::Inconclusive);
        s.fresh = None;
        s.second = st(vec![s.first.answer().clone()], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Draft, "replay-identical"), Verdict::Violated);
    }

    #[test]
    fn the_draft_profile_has_only_the_drafts_rules() {
        let names: Vec<_> = judge(&good(true), &opts(Profile::Draft)).into_iter().map(|r| r.name).collect();
        assert_eq!(names, ["replay-identical", "in-flight-409", "mismatch-refused", "missing-key-400"]);
    }

    #[test]
    fn a_constant_answer_is_inconclusive_without_evidence_and_violated_with_it() {
        let mut s = good(false);
        let c = a(200, "{\"status\":\"accepted\"}", &[]);
        s.first = Step::one("POST /x", c.clone(), Executions::Unknown);
        s.second = st(vec![c.clone()], Executions::Unknown);
        s.fresh = st(vec![c.clone()], Executions::Unknown);
        assert_eq!(verdict(&s, Profile::Draft, "replay-identical"), Verdict::Inconclusive);
        assert_eq!(exit_code(&judge(&s, &opts(Profile::Draft)), true), 3);
        s.fresh = None;
        s.second = st(vec![c], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Draft, "replay-identical"), Verdict::Violated);
    }

    #[test]
    fn held_duplicates_are_inconclusive_and_said_so() {
        let mut s = good(true);
        let r = a(201, "{\"id\":2}", &[REPLAYED]);
        s.concurrent = st(vec![a(201, "{\"id\":2}", &[]), r.clone(), r], Executions::Counted(1));
        let rules = judge(&s, &opts(Profile::Draft));
        let rule = rules.iter().find(|r| r.name == "in-flight-409").unwrap();
        assert_eq!(rule.verdict, Verdict::Inconclusive);
        assert!(rule.detail.contains("2 marked as replays") && rule.detail.contains("no 409"), "{}", rule.detail);
        s.concurrent = st(vec![a(201, "{\"id\":2}", &[]), a(201, "{\"id\":3}", &[])], Executions::Counted(2));
        assert_eq!(verdict(&s, Profile::Draft, "in-flight-409"), Verdict::Violated);
    }

    #[test]
    fn a_plain_json_409_keeps_the_draft_but_not_strict() {
        let mut s = good(true);
        let c = a(409, "{\"detail\":\"pending\"}", &[("content-type", "application/json")]);
        s.concurrent = st(vec![a(201, "{\"id\":2}", &[]), c.clone(), c], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Draft, "in-flight-409"), Verdict::Kept);
        assert_eq!(verdict(&s, Profile::Strict, "in-flight-409"), Verdict::Violated);
    }

    #[test]
    fn a_mismatch_replayed_or_executed_is_violated_and_a_link_header_is_enough_for_the_draft() {
        let mut s = good(true);
        s.mismatch = st(vec![a(422, "", &[("link", "<https://d>; rel=\"describedby\"")])], Executions::Counted(0));
        assert_eq!(verdict(&s, Profile::Draft, "mismatch-refused"), Verdict::Kept);
        assert_eq!(verdict(&s, Profile::Strict, "mismatch-refused"), Verdict::Violated);
        s.mismatch = st(vec![s.first.answer().clone()], Executions::Counted(0));
        let r = judge(&s, &opts(Profile::Draft)).into_iter().find(|r| r.name == "mismatch-refused").unwrap();
        assert_eq!(r.verdict, Verdict::Violated);
        assert!(r.detail.contains("the first answer's body") && r.detail.contains("replay"), "{}", r.detail);
        s.mismatch = st(vec![a(201, "{\"id\":5}", &[])], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Stripe, "mismatch-refused"), Verdict::Violated);
    }

    #[test]
    fn a_409_replay_with_the_same_body_is_described_as_such() {
        let mut s = good(true);
        s.second = st(vec![a(409, "{\"id\":1}", &[])], Executions::Counted(0));
        let r = judge(&s, &opts(Profile::Draft)).into_iter().find(|r| r.name == "replay-identical").unwrap();
        assert_eq!(r.verdict, Verdict::Violated);
        assert!(r.detail.contains("with the same body") && !r.detail.contains("different body"), "{}", r.detail);
    }

    #[test]
    fn skipped_rules_and_the_replay_header_name() {
        let mut o = opts(Profile::Stripe);
        o.skip = vec!["replay-marked".into()];
        let mut s = good(true);
        s.second = st(vec![a(201, "{\"id\":1}", &[("idempotency-replayed", "true")])], Executions::Counted(0));
        let v = |o: &Options| judge(&s, o).into_iter().find(|r| r.name == "replay-marked").unwrap();
        assert_eq!(v(&o).verdict, Verdict::Skipped);
        o.skip.clear();
        assert!(v(&o).detail.contains("idempotency-replayed"), "{}", v(&o).detail);
        o.replay_header = "idempotency-replayed".into();
        assert_eq!(v(&o).verdict, Verdict::Kept);
    }

    #[test]
    fn another_callers_request_must_not_get_the_first_answer() {
        let mut s = good(true);
        s.other_caller = st(vec![s.first.answer().clone()], Executions::Counted(0));
        assert_eq!(verdict(&s, Profile::Strict, "other-caller-scoped"), Verdict::Violated);
        s.other_caller = st(vec![a(201, "{\"id\":7}", &[])], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Strict, "other-caller-scoped"), Verdict::Kept);
        // A constant answer that executed is the second caller's own, not the first's.
        s.other_caller = st(vec![s.first.answer().clone()], Executions::Counted(1));
        assert_eq!(verdict(&s, Profile::Strict, "other-caller-scoped"), Verdict::Kept);
    }

    #[test]
    fn evidence_counts() {
        assert_eq!(evidence_count(b"{\"count\": 3}"), Some(3));
        assert_eq!(evidence_count(b"[1,2]"), Some(2));
        assert_eq!(evidence_count(b"{\"data\": [1,2,3], \"more\": false}"), Some(3));
        assert_eq!(evidence_count(b" 7\n"), Some(7));
        assert_eq!(executions_between(b"<a>", b"<b>"), Executions::Changed(true));
    }

    #[test]
    fn junit_escapes_and_counts() {
        let mut s = good(true);
        s.malformed = st(vec![a(201, "<&>", &[])], Executions::Counted(1));
        let x = junit("http://h/<x>", &opts(Profile::Strict), &judge(&s, &opts(Profile::Strict)), false);
        assert!(x.contains("failures=\"1\"") && x.contains("&lt;&amp;&gt;") && !x.contains("<x>"), "{x}");
    }

    #[test]
    fn a_changed_body_differs_even_after_canonicalisation() {
        assert_eq!(changed_body(b"{\"a\":1}"), b"{\"a\":1,\"idemgate_probe_changed\":true}".to_vec());
        assert_eq!(changed_body(b"x"), b"x-idemgate-probe-changed".to_vec());
    }
}
