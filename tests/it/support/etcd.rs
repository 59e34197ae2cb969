//! A three-member etcd cluster on 127.0.0.1 (Debian `etcd-server` 3.4, installed by
//! `scripts/install-deps.sh etcd`), ports picked at run time, data in a scratch folder, every
//! member killed when dropped. Members can be killed (SIGKILL), hung (SIGSTOP), resumed (SIGCONT)
//! and started again on their data; the leader is found through `/v3/maintenance/status`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use super::http;
use super::{free_port, Scratch};

pub struct Member {
    pub name: String,
    pub client_port: u16,
    /// With `start_tls`: the member's HTTPS client port (client certificates required); the
    /// plain `client_port` stays for the tests' own administration on loopback.
    pub tls_port: u16,
    pub peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
    stopped: bool,
}

pub struct EtcdCluster {
    pub members: Vec<Member>,
    initial_cluster: String,
    /// Flags every member starts with (`start_with`), e.g. `--auth-token-ttl`.
    extra_args: Vec<String>,
    /// `start_tls`: the folder of `tls.crt`, `tls.key` and `ca.crt`.
    tls_dir: Option<PathBuf>,
    /// With auth enabled (`enable_auth`): root's token, renewed when etcd refuses it.
    root_token: std::cell::RefCell<Option<String>>,
    auth_enabled: bool,
    _scratch: Scratch,
}

/// root's password once `enable_auth` ran (the tests' own admin; never given to a proxy).
pub const ROOT_PASSWORD: &str = "root-pw-3c9d";

fn b64(bytes: &[u8]) -> String {
    idemgate::base64::b64(bytes)
}

impl EtcdCluster {
    /// Starts three members and waits (bounded) until they agree on a leader.
    pub fn start() -> EtcdCluster {
        EtcdCluster::start_with(&[])
    }

    /// `start`, every member also given `extra_args`.
    pub fn start_with(extra_args: &[&str]) -> EtcdCluster {
        EtcdCluster::start_inner(extra_args, None)
    }

    /// `start`, every member also serving HTTPS on its `tls_port` with `tls_dir`'s `tls.crt` and
    /// `tls.key`, accepting only clients whose certificate `ca.crt` signed.
    pub fn start_tls(tls_dir: &std::path::Path) -> EtcdCluster {
        EtcdCluster::start_inner(&[], Some(tls_dir.to_path_buf()))
    }

    fn start_inner(extra_args: &[&str], tls_dir: Option<PathBuf>) -> EtcdCluster {
        let scratch = Scratch::new("etcd");
        let members: Vec<Member> = (0..3)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                tls_port: free_port(),
                peer_port: free_port(),
                dir: scratch.0.join(format!("m{i}")),
                child: None,
                stopped: false,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut c = EtcdCluster {
            members,
            initial_cluster,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            tls_dir,
            root_token: std::cell::RefCell::new(None),
            auth_enabled: false,
            _scratch: scratch,
        };
        for i in 0..3 {
            c.launch(i, "new");
        }
        c.wait_leader();
        c
    }

    fn launch(&mut self, i: usize, state: &str) {
        let initial_cluster = self.initial_cluster.clone();
        let mut extra_args = self.extra_args.clone();
        if let Some(d) = &self.tls_dir {
            let f = |n: &str| d.join(n).display().to_string();
            extra_args.extend([
                "--cert-file".to_string(),
                f("tls.crt"),
                "--key-file".to_string(),
                f("tls.key"),
                "--client-cert-auth".to_string(),
                "--trusted-ca-file".to_string(),
                f("ca.crt"),
            ]);
        }
        let tls = self.tls_dir.is_some();
        let m = &mut self.members[i];
        std::fs::create_dir_all(&m.dir).expect("etcd dir");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(m.dir.with_extension("log")).expect("log");
        let mut client = format!("http://127.0.0.1:{}", m.client_port);
        if tls {
            client.push_str(&format!(",https://127.0.0.1:{}", m.tls_port));
        }
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new("etcd")
            .args(["--name", &m.name, "--data-dir"])
            .arg(m.dir.join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial_cluster, "--initial-cluster-state", state])
            .args(["--initial-cluster-token", "idemgate-tests"])
            .args(&extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start etcd (installed by scripts/install-deps.sh etcd)");
        m.child = Some(child);
        m.stopped = false;
    }

    pub fn client_ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client_port).collect()
    }

    pub fn tls_ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.tls_port).collect()
    }

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.members[i].dir.with_extension("log")).unwrap_or_default()
    }

    /// `POST path` with a JSON body to member `i` (2 s timeout), as root once auth is enabled
    /// (root's token renewed once if etcd refuses it).
    pub fn call(&self, i: usize, path: &str, body: &Value) -> Option<Value> {
        for _ in 0..2 {
            let token = self.root_token.borrow().clone();
            let headers: Vec<(&str, &str)> = token.iter().map(|t| ("authorization", t.as_str())).collect();
            let r = http::request_timeout(
                self.members[i].client_port,
                "POST",
                path,
                &headers,
                body.to_string().as_bytes(),
                Duration::from_secs(2),
            )
            .ok()?;
            if self.auth_enabled && idemgate::etcd::token_refused(Some(r.status), &r.body) {
                *self.root_token.borrow_mut() = self.authenticate(i, "root", ROOT_PASSWORD);
                continue;
            }
            return (r.status == 200).then(|| r.json());
        }
        None
    }

    /// A token for `user` from member `i`, if etcd grants one.
    pub fn authenticate(&self, i: usize, user: &str, password: &str) -> Option<String> {
        let body = json!({"name": user, "password": password}).to_string();
        let r = http::request_timeout(
            self.members[i].client_port,
            "POST",
            "/v3/auth/authenticate",
            &[],
            body.as_bytes(),
            Duration::from_secs(2),
        )
        .ok()?;
        (r.status == 200).then(|| r.json()["token"].as_str().map(str::to_string)).flatten()
    }

    /// Turns etcd's authentication on: user `user` (password `password`) may read and write
    /// idemgate's keys (`idemgate::etcd::KEY_PREFIX` and below) and nothing else; root (password
    /// `ROOT_PASSWORD`) administers. From then on `call` acts as root.
    pub fn enable_auth(&mut self, user: &str, password: &str) {
        let prefix = idemgate::etcd::KEY_PREFIX.as_bytes();
        let mut end = prefix.to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let steps = [
            ("/v3/auth/user/add", json!({"name": "root", "password": ROOT_PASSWORD})),
            ("/v3/auth/user/grant", json!({"user": "root", "role": "root"})),
            ("/v3/auth/role/add", json!({"name": "idemgate-rw"})),
            (
                "/v3/auth/role/grant",
                json!({"name": "idemgate-rw", "perm": {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(&end)}}),
            ),
            ("/v3/auth/user/add", json!({"name": user, "password": password})),
            ("/v3/auth/user/grant", json!({"user": user, "role": "idemgate-rw"})),
            ("/v3/auth/enable", json!({})),
        ];
        let l = self.wait_leader();
        for (path, body) in steps {
            assert!(self.call(l, path, &body).is_some(), "etcd refused {path} {body}");
        }
        self.auth_enabled = true;
        *self.root_token.borrow_mut() = self.authenticate(l, "root", ROOT_PASSWORD);
        assert!(self.root_token.borrow().is_some(), "root could not authenticate");
    }

    /// Sets `user`'s password (as root): etcd invalidates every token it handed `user`.
    pub fn change_password(&self, user: &str, password: &str) {
        let l = self.wait_leader();
        let body = json!({"name": user, "password": password});
        assert!(self.call(l, "/v3/auth/user/changepw", &body).is_some(), "etcd refused changepw");
    }

    /// Adds a role (as root): etcd's auth store moves to a new revision, so every token issued
    /// before is older than it.
    pub fn add_role(&self, name: &str) {
        let l = self.wait_leader();
        assert!(self.call(l, "/v3/auth/role/add", &json!({"name": name})).is_some(), "etcd refused role/add");
    }

    fn alive(&self, i: usize) -> bool {
        self.members[i].child.is_some() && !self.members[i].stopped
    }

    /// The index of the member the live members name as leader, if they agree on one.
    pub fn leader(&self) -> Option<usize> {
        let mut ids = vec![];
        let mut leader = None;
        for i in (0..3).filter(|i| self.alive(*i)) {
            let s = self.call(i, "/v3/maintenance/status", &json!({}))?;
            let l = s["leader"].as_str()?.to_string();
            if l == "0" || leader.as_ref().is_some_and(|x: &String| *x != l) {
                return None;
            }
            leader = Some(l);
            ids.push((i, s["header"]["member_id"].as_str()?.to_string()));
        }
        let leader = leader?;
        ids.into_iter().find(|(_, id)| *id == leader).map(|(i, _)| i)
    }

    /// Waits (at most 300 looks, 100 ms apart) for a leader among the live members.
    pub fn wait_leader(&self) -> usize {
        for _ in 0..300 {
            if let Some(l) = self.leader() {
                return l;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("etcd elected no leader; logs:\n{}\n{}\n{}", self.log(0), self.log(1), self.log(2));
    }

    /// SIGKILL member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal(&self, i: usize, sig: &str) {
        if let Some(c) = self.members[i].child.as_ref() {
            let _ = Command::new("kill").args([sig, &c.id().to_string()]).status();
        }
    }

    /// SIGSTOP member `i`: it hangs, its connections stay open.
    pub fn stop(&mut self, i: usize) {
        self.signal(i, "-STOP");
        self.members[i].stopped = true;
    }

    /// SIGCONT member `i`.
    pub fn resume(&mut self, i: usize) {
        self.signal(i, "-CONT");
        self.members[i].stopped = false;
    }

    /// Starts a killed member again on its data.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.launch(i, "existing");
    }

    /// Every key and value in the cluster (a linearizable range of the whole keyspace, asked of
    /// the live members in turn).
    pub fn all(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        let q = json!({"key": b64(&[0]), "range_end": b64(&[0])});
        for i in (0..3).filter(|i| self.alive(*i)) {
            if let Some(r) = self.call(i, "/v3/kv/range", &q) {
                let kvs = r["kvs"].as_array().cloned().unwrap_or_default();
                return kvs
                    .iter()
                    .map(|kv| {
                        let d = |f: &str| idemgate::base64::unb64(kv[f].as_str().unwrap_or("")).expect("base64");
                        (d("key"), d("value"))
                    })
                    .collect();
            }
        }
        panic!("no etcd member answered a range");
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.resume(i);
            self.kill(i);
        }
    }
}

/// Envoy's log of the store cluster's health-check events, in its folder (`Envoy::file`).
pub const STORE_HEALTH_EVENTS: &str = "store-health-events.log";

/// The `idemgate_store` cluster of the shipped `envoy/etcd/envoy.yaml` (HTTP/1.1, round robin, an
/// active health check on etcd's `/health`), from column 0, its members replaced by these client
/// ports on 127.0.0.1 and its health events logged to `STORE_HEALTH_EVENTS`: the tests run the
/// settings users copy.
pub fn envoy_cluster(ports: &[u16]) -> String {
    let text =
        std::fs::read_to_string(super::repo_root().join("envoy/etcd/envoy.yaml")).expect("envoy/etcd/envoy.yaml");
    let depth = |l: &str| l.len() - l.trim_start().len();
    let mut out = String::new();
    let (mut endpoints, mut checks) = (0, 0);
    for line in super::yaml_block(&text, "- name: idemgate_store") {
        let line = line.as_str();
        if line.trim_start().starts_with("- endpoint:") {
            let pad = &line[..depth(line)];
            if let Some(p) = ports.get(endpoints) {
                out += &format!(
                    "{pad}- endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {p}}}}}}}\n"
                );
            }
            endpoints += 1;
            continue;
        }
        out += line;
        out += "\n";
        if line.trim_start().starts_with("http_health_check:") {
            let pad = &line[..depth(line)];
            checks += 1;
            out += &format!(
                "{pad}event_logger:\n{pad}- name: envoy.health_check.event_sink.file\n{pad}  typed_config:\n\
                 {pad}    \"@type\": type.googleapis.com/envoy.extensions.health_check.event_sinks.file.v3.HealthCheckEventFileSink\n\
                 {pad}    event_log_path: {STORE_HEALTH_EVENTS}\n{pad}always_log_health_check_failures: true\n"
            );
        }
    }
    assert_eq!((endpoints, checks), (ports.len(), 1), "the shipped cluster's members and health check:\n{out}");
    out
}

/// Waits (at most 600 looks, 50 ms apart: room for a loaded machine, where one Envoy start was
/// seen to take 8 s to reach its Wasm VM) until every worker's root context holds a lease: until
/// then a request is refused (503), never claimed without expiry.
pub fn wait_leases(e: &super::Envoy, workers: u32) {
    // A Wasm VM per worker grants its own lease; the native build one per configuration.
    let want = match e.options.build {
        super::Build::Wasm => workers as usize,
        super::Build::Native => 1,
    };
    for _ in 0..600 {
        if e.log().matches("etcd lease granted").count() >= want {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no etcd lease granted; log:\n{}", e.log());
}
