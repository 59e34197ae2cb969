//! The operator CLI (`idemgate`) run against one store, the same calls for Redis (`--webdis`) and
//! etcd (`--etcd`): the tests of each store differ in their stack, not in how they ask the CLI.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// `idemgate` with a store's flag and credential; the record key every test VM has.
pub struct OperatorCli {
    /// `--webdis URL` or `--etcd URL[,URL...]`.
    store: [String; 2],
    /// `IDEMGATE_STORE_AUTH`, unset if `None`.
    auth: Option<String>,
}

impl OperatorCli {
    pub fn webdis(url: &str, auth: Option<&str>) -> OperatorCli {
        OperatorCli { store: ["--webdis".into(), url.into()], auth: auth.map(str::to_string) }
    }

    /// `urls`: every member, comma-separated.
    pub fn etcd(urls: &str, auth: Option<&str>) -> OperatorCli {
        OperatorCli { store: ["--etcd".into(), urls.into()], auth: auth.map(str::to_string) }
    }

    /// `idemgate <store flag> ARGS`, the other store's variable removed from its environment.
    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run idemgate")
    }

    /// `run`, started and left running (its output piped).
    pub fn spawn(&self, args: &[&str]) -> Child {
        let mut c = self.command(args);
        c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start idemgate")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_idemgate"));
        c.args(&self.store).args(args).env("IDEMGATE_RECORD_KEY", super::RECORD_KEY);
        c.env_remove("IDEMGATE_WEBDIS").env_remove("IDEMGATE_ETCD");
        match &self.auth {
            Some(a) => c.env("IDEMGATE_STORE_AUTH", a),
            None => c.env_remove("IDEMGATE_STORE_AUTH"),
        };
        c
    }

    /// The storage key of `key` for a caller whose scope is its `authorization` header, by
    /// `idemgate key` (authority `idemgate.test`, as the tests' requests send).
    pub fn storage_key(&self, authorization: &str, key: &str) -> String {
        let auth = format!("authorization: {authorization}");
        let out = self.run(&["key", "--scope-header", &auth, "--authority", "idemgate.test", key]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).trim().to_string()
    }

    /// The storage keys `idemgate list --state STATE` prints.
    pub fn listed(&self, state: &str) -> Vec<String> {
        self.list_keys(&["list", "--state", state])
    }

    /// The storage keys `idemgate list --state STATE --limit LIMIT` prints.
    pub fn listed_at_most(&self, state: &str, limit: usize) -> Vec<String> {
        self.list_keys(&["list", "--state", state, "--limit", &limit.to_string()])
    }

    fn list_keys(&self, args: &[&str]) -> Vec<String> {
        let out = self.run(args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stdout).lines().filter_map(|l| l.split('\t').next()).map(str::to_string).collect()
    }

    /// Polls `list` (at most 200 looks, 100 ms apart) until `skey` is in `state`: the filter's root
    /// context writes outcomes after the answer, retrying with backoff if the store refuses.
    /// `why` says more when it never is (the proxies' counters, say).
    ///
    /// A look whose `list` fails is one more look, not a failure (a store that does not answer
    /// now). While a test held the proxies' store link, `list` failed now and then with
    /// "unexpected SCAN answer": webdis 0.1.9 wrote a proxy's late answer (its client gone) to
    /// the CLI's new connection (docs/stores.md); the CLI now asks again when an answer does not
    /// echo its nonce.
    pub fn wait_listed(&self, state: &str, skey: &str, why: impl Fn() -> String) {
        let mut last_error = String::new();
        for _ in 0..200 {
            let out = self.run(&["list", "--state", state]);
            if !out.status.success() {
                last_error = text(&out.stderr);
            } else if text(&out.stdout).lines().any(|l| l.split('\t').next() == Some(skey)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let inspect = text(&self.run(&["inspect", skey]).stdout);
        panic!("{skey} never listed as {state}; {}; last list error: {last_error:?}; inspect: {inspect}", why());
    }

    /// `idemgate inspect SKEY`, parsed.
    pub fn inspect(&self, skey: &str) -> serde_json::Value {
        let out = self.run(&["inspect", skey]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
    }
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A value another fleet wrote for storage key `skey` (hex): an outcome-unknown record or a
/// forwarded claim (`phase`) whose lock expires at `lock`, created at `now` for an hour, owner
/// `[5; 16]`, sealed with another record key, so this build cannot read it. With its storage key.
pub fn foreign_value(
    skey: &str,
    phase: idemgate::record::Stage,
    lock: u64,
    now: u64,
) -> (idemgate::scope::StorageKey, idemgate::store::StoredValue, idemgate::seal::Seal) {
    use idemgate::record::{Creator, Record, Stage, State, UnknownReason};
    let owner = idemgate::owner::OwnerToken([5; 16]);
    let state = match phase {
        Stage::Unknown => State::OutcomeUnknown { reason: UnknownReason::UpstreamReset },
        _ => State::Forwarded { owner, lock_expires_at_ms: lock },
    };
    let record = Record {
        fingerprint: idemgate::fingerprint::Fingerprint([7; 32]),
        created_at_ms: now,
        expires_at_ms: now + 3_600_000,
        creator: Creator { request_id: "r-foreign".into(), log_values: vec![] },
        state,
    };
    let other = idemgate::seal::Seal::new(Some("another-fleets-record-key-0123456789abcdef"), None).expect("seal");
    let sk = idemgate::scope::StorageKey(idemgate::hex::decode::<32>(skey.as_bytes()).expect("hex storage key"));
    (sk, idemgate::store::StoredValue { phase, owner, lock_expires_at_ms: lock, record }, other)
}
