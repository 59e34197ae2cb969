//! Store processes for tests, all on 127.0.0.1 with ports chosen at run time, SIGKILLed when
//! dropped (also when a test panics half-way through starting them):
//!
//! - `Redis`: redis-server 7.0 loading `envoy/redis.conf` (AOF on) with its own data folder; the
//!   command line sets the port, the folder and `--daemonize no`.
//! - `Webdis`: the HTTP-to-Redis gateway idemgate's store calls go through, with its own JSON
//!   configuration (optionally HTTP basic auth).
//! - `RedisCluster`: three Redis Cluster masters, an Envoy running `envoy/redis-cluster-proxy.yaml`
//!   (redis_proxy) in front of them, and webdis in front of that Envoy.
//! - `resp`: a tiny binary-safe RESP client, so tests can read exactly the bytes Redis holds.
//! - `base64`, `basic_auth`, `pct`: encoders for webdis requests.

use super::{envoy_bin, free_port, http, listener_is_owned_by, repo_root, Scratch};
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// How long a process may take to become ready before the test fails with its log.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a helper command (redis-cli) may run.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The ACL users of `envoy/redis.conf` (its demo passwords): idemgate's (`default`, the user
/// webdis 0.1.9 authenticates as with `redis_auth`) and the operators' (`admin`), which the
/// tests use to look at what Redis holds.
pub const REDIS_IDEMGATE_PASSWORD: &str = "idemgate-demo-redis-password";
pub const REDIS_ADMIN: (&str, &str) = ("admin", "idemgate-demo-admin-password");

/// The Redis configuration shipped to users, loaded by every test Redis.
pub fn redis_conf() -> PathBuf {
    repo_root().join("envoy/redis.conf")
}

/// The Envoy redis_proxy example shipped to users, with `${...}` placeholders.
pub fn cluster_proxy_template() -> PathBuf {
    repo_root().join("envoy/redis-cluster-proxy.yaml")
}

/// `envoy/redis-cluster-proxy.yaml` with its placeholders replaced.
pub fn render_cluster_proxy_config(listen_port: u16, admin_port: u16, seed_port: u16) -> String {
    let template = std::fs::read_to_string(cluster_proxy_template()).expect("read envoy/redis-cluster-proxy.yaml");
    let rendered = template
        .replace("${LISTEN_PORT}", &listen_port.to_string())
        .replace("${ADMIN_PORT}", &admin_port.to_string())
        .replace("${SEED_PORT}", &seed_port.to_string());
    // Only comments may still mention a placeholder.
    for line in rendered.lines().filter(|l| !l.trim_start().starts_with('#')) {
        assert!(!line.contains("${"), "unreplaced placeholder in redis-cluster-proxy.yaml: {line}");
    }
    rendered
}

/// `n` distinct ports that were free a moment ago on 127.0.0.1 (held together while chosen, so
/// they differ from each other).
pub fn free_ports(n: usize) -> Vec<u16> {
    // `free_port` never hands a port out twice, so the ports differ.
    (0..n).map(|_| free_port()).collect()
}

/// Standard base64 (with padding) of `bytes`.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The `authorization` header value for HTTP basic auth with `user_password` ("user:password").
pub fn basic_auth(user_password: &str) -> String {
    format!("Basic {}", base64(user_password.as_bytes()))
}

/// Percent-encodes one webdis argument: everything but ASCII letters, digits, `-`, `_` and `~`,
/// so `/` (argument separator) and `.` (format suffix) inside it reach Redis as themselves.
pub fn pct(arg: impl AsRef<[u8]>) -> String {
    let mut out = String::new();
    for &b in arg.as_ref() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'~' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A child process killed (SIGKILL) and reaped when dropped.
struct Proc(Option<Child>);

impl Proc {
    fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The exit status, if the process has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    fn pid(&self) -> Option<u32> {
        self.0.as_ref().map(Child::id)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A log file opened for appending (kept across restarts), for a child's stdout and stderr.
fn log_stdio(path: &Path) -> (Stdio, Stdio) {
    let f = OpenOptions::new().create(true).append(true).open(path).expect("open log file");
    let g = f.try_clone().expect("clone log file");
    (Stdio::from(f), Stdio::from(g))
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).map(|s| s.replace('\0', "")).unwrap_or_default()
}

/// Runs a command with a deadline; panics if it cannot start or runs too long.
fn run_bounded(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (installed by scripts/install-deps.sh store)"));
    let mut out = child.stdout.take().expect("stdout pipe");
    let mut err = child.stderr.take().expect("stderr pipe");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for command") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} ran longer than {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: out_reader.join().unwrap_or_default(), stderr: err_reader.join().unwrap_or_default() }
}

/// A minimal, binary-safe RESP2 client: one command per connection.
pub mod resp {
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    #[derive(Clone, Debug, PartialEq, Eq)]
    pub enum Value {
        /// `+OK`
        Status(String),
        /// `-ERR ...`
        Error(String),
        /// `:1`
        Int(i64),
        /// `$n` bytes, or `$-1` (None).
        Bulk(Option<Vec<u8>>),
        /// `*n` values, or `*-1` (None).
        Array(Option<Vec<Value>>),
    }

    impl Value {
        /// The elements of an array reply (empty for a nil array); panics on anything else.
        pub fn into_array(self) -> Vec<Value> {
            match self {
                Value::Array(a) => a.unwrap_or_default(),
                other => panic!("expected a RESP array, got {other:?}"),
            }
        }

        /// The bytes of a bulk reply (None for nil); panics on anything else.
        pub fn into_bulk(self) -> Option<Vec<u8>> {
            match self {
                Value::Bulk(b) => b,
                other => panic!("expected a RESP bulk string, got {other:?}"),
            }
        }
    }

    /// The request bytes for a command: an array of bulk strings.
    pub fn encode(args: &[&[u8]]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    fn bad(msg: String) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
    }

    fn line(r: &mut impl BufRead) -> std::io::Result<String> {
        let mut buf = Vec::new();
        r.read_until(b'\n', &mut buf)?;
        if !buf.ends_with(b"\r\n") {
            return Err(bad(format!("truncated RESP line {:?}", String::from_utf8_lossy(&buf))));
        }
        buf.truncate(buf.len() - 2);
        String::from_utf8(buf).map_err(|e| bad(format!("non-UTF-8 RESP line: {e}")))
    }

    fn len(s: &str) -> std::io::Result<i64> {
        s.parse().map_err(|_| bad(format!("bad RESP length {s:?}")))
    }

    /// Reads one reply.
    pub fn read(r: &mut impl BufRead) -> std::io::Result<Value> {
        let l = line(r)?;
        let rest = l.get(1..).unwrap_or("");
        match l.as_bytes().first() {
            Some(b'+') => Ok(Value::Status(rest.to_string())),
            Some(b'-') => Ok(Value::Error(rest.to_string())),
            Some(b':') => Ok(Value::Int(len(rest)?)),
            Some(b'$') => {
                let n = len(rest)?;
                if n < 0 {
                    return Ok(Value::Bulk(None));
                }
                let mut data = vec![0; n as usize + 2];
                r.read_exact(&mut data)?;
                if !data.ends_with(b"\r\n") {
                    return Err(bad("bulk string not followed by CRLF".to_string()));
                }
                data.truncate(n as usize);
                Ok(Value::Bulk(Some(data)))
            }
            Some(b'*') => {
                let n = len(rest)?;
                if n < 0 {
                    return Ok(Value::Array(None));
                }
                (0..n).map(|_| read(r)).collect::<std::io::Result<Vec<_>>>().map(|v| Value::Array(Some(v)))
            }
            _ => Err(bad(format!("unknown RESP reply {l:?}"))),
        }
    }

    /// Parses one complete reply (for example the body of a webdis `.raw` response).
    pub fn parse(mut bytes: &[u8]) -> std::io::Result<Value> {
        let v = read(&mut bytes)?;
        if !bytes.is_empty() {
            return Err(bad(format!("{} bytes after the RESP reply", bytes.len())));
        }
        Ok(v)
    }

    /// Sends one command to 127.0.0.1:`port` over a new connection, as the operators' ACL user
    /// of `envoy/redis.conf` (`super::REDIS_ADMIN`; a Redis without that user answers the AUTH
    /// with an error, which is ignored), and reads its reply.
    pub fn command(port: u16, args: &[&[u8]]) -> std::io::Result<Value> {
        let (user, password) = super::REDIS_ADMIN;
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.set_write_timeout(Some(Duration::from_secs(10)))?;
        let mut bytes = encode(&[b"AUTH", user.as_bytes(), password.as_bytes()]);
        bytes.extend_from_slice(&encode(args));
        (&s).write_all(&bytes)?;
        let mut r = BufReader::new(&s);
        let _auth = read(&mut r)?;
        read(&mut r)
    }

    /// One command from a client that never authenticated.
    pub fn command_anonymous(port: u16, args: &[&[u8]]) -> std::io::Result<Value> {
        let s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        (&s).write_all(&encode(args))?;
        read(&mut BufReader::new(&s))
    }
}

use resp::Value;

/// Runs `args` on 127.0.0.1:`port`; panics on a connection error (not on a Redis error reply).
fn must(port: u16, args: &[&[u8]]) -> Value {
    resp::command(port, args).unwrap_or_else(|e| {
        panic!("redis on port {port}: {:?}: {e}", args.iter().map(|a| String::from_utf8_lossy(a)).collect::<Vec<_>>())
    })
}

fn keys_raw(port: u16, pattern: &str) -> Vec<Vec<u8>> {
    let mut keys: Vec<Vec<u8>> =
        must(port, &[b"KEYS", pattern.as_bytes()]).into_array().into_iter().filter_map(Value::into_bulk).collect();
    keys.sort();
    keys
}

fn get_raw_at(port: u16, key: &[u8]) -> Option<Vec<u8>> {
    match must(port, &[b"GET", key]) {
        Value::Bulk(v) => v,
        other => panic!("GET {} on port {port}: {other:?}", String::from_utf8_lossy(key)),
    }
}

/// Every byte a key holds: a string's value; the elements of a hash (field, value, ...), list,
/// set or sorted set (member, score, ...) joined by `\n`; `DUMP` for other types. None when the
/// key no longer exists.
fn value_bytes(port: u16, key: &[u8]) -> Option<Vec<u8>> {
    let kind = match must(port, &[b"TYPE", key]) {
        Value::Status(s) => s,
        other => panic!("TYPE on port {port}: {other:?}"),
    };
    let elements = |args: &[&[u8]]| -> Option<Vec<u8>> {
        let parts: Vec<Vec<u8>> = must(port, args).into_array().into_iter().filter_map(Value::into_bulk).collect();
        Some(parts.join(&b'\n'))
    };
    match kind.as_str() {
        "none" => None,
        "string" => get_raw_at(port, key),
        "hash" => elements(&[b"HGETALL", key]),
        "list" => elements(&[b"LRANGE", key, b"0", b"-1"]),
        "set" => elements(&[b"SMEMBERS", key]),
        "zset" => elements(&[b"ZRANGE", key, b"0", b"-1", b"WITHSCORES"]),
        _ => must(port, &[b"DUMP", key]).into_bulk(),
    }
}

fn dump_all_at(port: u16) -> Vec<(String, Vec<u8>)> {
    keys_raw(port, "*")
        .into_iter()
        .filter_map(|k| value_bytes(port, &k).map(|v| (String::from_utf8_lossy(&k).into_owned(), v)))
        .collect()
}

/// A running redis-server (standalone or cluster node), SIGKILLed when dropped.
pub struct Redis {
    pub port: u16,
    dir: PathBuf,
    /// Extra command-line options (cluster mode).
    extra_args: Vec<String>,
    /// The default user opened to every command and key after each start (`start_open`).
    open: bool,
    proc: Proc,
    _scratch: Option<Scratch>,
}

impl Redis {
    /// A fresh Redis with AOF on (envoy/redis.conf) in a new scratch folder.
    pub fn start() -> Redis {
        let scratch = Scratch::new("redis");
        Redis::launch_new(scratch.0.clone(), free_port(), Vec::new(), Some(scratch))
    }

    /// Like `start`, but with Redis's default user open to every command and key (set after
    /// each start with `ACL SETUSER`): for tests of the test support itself, which write keys
    /// outside idemgate's prefix through webdis.
    pub fn start_open() -> Redis {
        let scratch = Scratch::new("redis");
        let mut r = Redis {
            port: free_port(),
            dir: scratch.0.clone(),
            extra_args: Vec::new(),
            open: true,
            proc: Proc(None),
            _scratch: Some(scratch),
        };
        r.launch();
        r
    }

    /// A fresh Redis like `start`, with more command-line options (e.g. `--appendfsync always`).
    pub fn start_with_args(args: &[&str]) -> Redis {
        let scratch = Scratch::new("redis");
        let args = args.iter().map(|a| a.to_string()).collect();
        Redis::launch_new(scratch.0.clone(), free_port(), args, Some(scratch))
    }

    /// A Redis using `dir` (created if missing, kept when dropped) and `port`: start it again
    /// on the same folder to test what survives in the AOF.
    pub fn start_in(dir: &Path, port: u16) -> Redis {
        std::fs::create_dir_all(dir).expect("create redis dir");
        Redis::launch_new(dir.to_path_buf(), port, Vec::new(), None)
    }

    /// A Redis Cluster master (not yet part of a cluster) in `dir`.
    fn start_cluster_node(dir: &Path, port: u16, bus_port: u16) -> Redis {
        std::fs::create_dir_all(dir).expect("create redis dir");
        let args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            .into_iter()
            .map(String::from)
            .chain(["--cluster-port".to_string(), bus_port.to_string()])
            .chain(["--cluster-node-timeout", "5000"].map(String::from))
            .collect();
        // Envoy's redis_proxy in front of the cluster connects without credentials: the cluster
        // example opens Redis's default user (not hardened; see docs/stores.md).
        let mut r =
            Redis { port, dir: dir.to_path_buf(), extra_args: args, open: true, proc: Proc(None), _scratch: None };
        r.launch();
        r
    }

    fn launch_new(dir: PathBuf, port: u16, extra_args: Vec<String>, scratch: Option<Scratch>) -> Redis {
        let mut r = Redis { port, dir, extra_args, open: false, proc: Proc(None), _scratch: scratch };
        r.launch();
        r.load_idemgate_scripts();
        r
    }

    /// Loads idemgate's two store scripts (`SCRIPT LOAD`, as the operators' user), so a new test
    /// Redis is one that has served idemgate before: the first claim and completion are one
    /// `EVALSHA` each, as later ones are. A restart (`restart`) empties the script cache, as it
    /// does in production; `tests/it/store_scripts.rs` starts from an empty cache (`SCRIPT FLUSH`).
    /// Redis's names for the scripts must be the ones idemgate computed at compile time.
    pub fn load_idemgate_scripts(&self) {
        use idemgate::store::Script;
        for script in [Script::Claim, Script::Transition] {
            let name = must(self.port, &[b"SCRIPT", b"LOAD", script.text().as_bytes()]).into_bulk();
            assert_eq!(name.as_deref(), Some(&script.sha1_hex()[..]), "Redis's name for the {script:?} script");
        }
    }

    fn launch(&mut self) {
        let (out, err) = log_stdio(&self.log_path());
        let child = Command::new("redis-server")
            .arg(redis_conf())
            .args(["--port", &self.port.to_string(), "--daemonize", "no", "--dir"])
            .arg(&self.dir)
            .args(&self.extra_args)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start redis-server (installed by scripts/install-deps.sh store)");
        self.proc = Proc(Some(child));
        self.wait_ready();
        if self.open {
            let open: [&[u8]; 8] = [b"ACL", b"SETUSER", b"default", b"on", b"nopass", b"~*", b"&*", b"+@all"];
            assert_eq!(must(self.port, &open), Value::Status("OK".into()), "open the default user");
        }
    }

    /// Waits until this process (not another one on the same port) answers PING; AOF loading
    /// answers -LOADING until done.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        let pid = self.proc.pid().expect("redis started");
        loop {
            if let Some(status) = self.proc.exited() {
                self.proc.0 = None;
                panic!("redis-server on port {} exited ({status}); log:\n{}", self.port, self.log());
            }
            if resp::command(self.port, &[b"PING"]).ok() == Some(Value::Status("PONG".into())) {
                let info = resp::command(self.port, &[b"INFO", b"server"]).ok().and_then(Value::into_bulk);
                let info = String::from_utf8_lossy(&info.unwrap_or_default()).into_owned();
                if !info.contains(&format!("process_id:{pid}\r\n")) {
                    self.proc.kill9();
                    panic!("another process answers on redis port {}:\n{info}\nlog:\n{}", self.port, self.log());
                }
                return;
            }
            if Instant::now() >= deadline {
                panic!("redis-server on port {} not ready in {READY_TIMEOUT:?}; log:\n{}", self.port, self.log());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGKILL (no shutdown save, no final fsync), then reap the process.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    /// Starts again with the same folder, port and options (after a kill9 if still running) and
    /// waits until the AOF is loaded.
    pub fn restart(&mut self) {
        self.proc.kill9();
        self.launch();
    }

    /// The data folder (AOF in `appendonlydir/`, log in `redis.log`).
    pub fn dir(&self) -> PathBuf {
        self.dir.clone()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("redis.log")
    }

    /// Everything this folder's Redis processes logged (kept across restarts).
    pub fn log(&self) -> String {
        read_log(&self.log_path())
    }

    /// One command over RESP; panics on a connection error, returns Redis errors as `Value::Error`.
    pub fn command(&self, args: &[&[u8]]) -> Value {
        must(self.port, args)
    }

    /// `redis-cli -p PORT args...`, returning its stdout (text; use `get_raw` for exact bytes).
    pub fn cli(&self, args: &[&str]) -> String {
        let (user, password) = REDIS_ADMIN;
        let out = run_bounded(
            Command::new("redis-cli")
                .args(["-p", &self.port.to_string(), "--user", user, "--pass", password, "--no-auth-warning"])
                .args(args),
            COMMAND_TIMEOUT,
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `KEYS pattern`, sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        keys_raw(self.port, pattern).into_iter().map(|k| String::from_utf8_lossy(&k).into_owned()).collect()
    }

    /// The exact bytes of a string key, None when absent.
    pub fn get_raw(&self, key: impl AsRef<[u8]>) -> Option<Vec<u8>> {
        get_raw_at(self.port, key.as_ref())
    }

    /// Every key with every byte it holds (see `value_bytes`), sorted by key.
    pub fn dump_all_values(&self) -> Vec<(String, Vec<u8>)> {
        dump_all_at(self.port)
    }
}

/// A running webdis, SIGKILLed when dropped.
pub struct Webdis {
    pub port: u16,
    /// The Redis (or RESP proxy) it forwards to.
    pub redis_port: u16,
    /// "user:password" when started with basic auth.
    pub auth: Option<String>,
    proc: Proc,
    config_path: PathBuf,
    log_path: PathBuf,
    out_path: PathBuf,
    scratch: Scratch,
}

impl Webdis {
    /// webdis's process id (its open descriptors are in `/proc/PID/fd`).
    pub fn pid(&self) -> u32 {
        self.proc.0.as_ref().map_or(0, |c| c.id())
    }

    /// webdis in front of 127.0.0.1:`redis_port`, every command allowed except DEBUG.
    pub fn start(redis_port: u16) -> Webdis {
        Webdis::start_inner(redis_port, None, Some(REDIS_IDEMGATE_PASSWORD))
    }

    /// `start` on a port of the caller's (the support's own tests: a port another webdis holds).
    pub fn start_on_port(redis_port: u16, port: u16) -> Webdis {
        let config = Webdis::default_config(redis_port, None, Some(REDIS_IDEMGATE_PASSWORD));
        Webdis::launch_new(redis_port, None, Some(port), config)
    }

    /// webdis with a shipped configuration (`envoy/docker-compose/webdis.json`): its ACL and its
    /// Redis credential, in front of 127.0.0.1:`redis_port`; requests carry the ACL's basic-auth
    /// credential, if it has one.
    pub fn start_shipped(redis_port: u16, shipped: &serde_json::Value) -> Webdis {
        let auth = shipped["acl"]
            .as_array()
            .and_then(|acl| acl.iter().find_map(|a| a["http_basic_auth"].as_str().map(str::to_string)));
        let mut config = shipped.clone();
        Webdis::launch_new(redis_port, auth, None, |port, log_path| {
            config["redis_host"] = "127.0.0.1".into();
            config["redis_port"] = redis_port.into();
            config["http_host"] = "127.0.0.1".into();
            config["http_port"] = port.into();
            config["daemonize"] = false.into();
            config["logfile"] = serde_json::json!(log_path);
            config
        })
    }

    /// Like `start`, but only clients sending HTTP basic auth `user_password` ("user:password")
    /// may run commands (all but DEBUG); everyone else gets 403.
    pub fn start_with_auth(redis_port: u16, user_password: &str) -> Webdis {
        Webdis::start_inner(redis_port, Some(user_password.to_string()), Some(REDIS_IDEMGATE_PASSWORD))
    }

    /// `redis_auth`: the password webdis sends Redis (`AUTH`), None for a Redis without one.
    fn start_inner(redis_port: u16, auth: Option<String>, redis_auth: Option<&str>) -> Webdis {
        let config = Webdis::default_config(redis_port, auth.clone(), redis_auth);
        Webdis::launch_new(redis_port, auth, None, config)
    }

    /// The configuration `start_inner` writes, given its port and log path.
    fn default_config(
        redis_port: u16,
        auth: Option<String>,
        redis_auth: Option<&str>,
    ) -> impl FnOnce(u16, &Path) -> serde_json::Value + '_ {
        // ACLs apply in order, later matches overriding earlier ones; "*" matches every command.
        let acl = match &auth {
            None => serde_json::json!([{"disabled": ["DEBUG"]}]),
            Some(user_password) => serde_json::json!([
                {"disabled": ["*"]},
                {"http_basic_auth": user_password, "enabled": ["*"], "disabled": ["DEBUG"]},
            ]),
        };
        move |port, log_path| {
            serde_json::json!({
                "redis_host": "127.0.0.1",
                "redis_port": redis_port,
                "redis_auth": redis_auth,
                "http_host": "127.0.0.1",
                "http_port": port,
                "threads": 2,
                "pool_size": 8,
                "daemonize": false,
                "database": 0,
                "verbosity": 3,
                "logfile": log_path,
                "http_max_request_size": 134_217_728,
                "acl": acl,
            })
        }
    }

    /// Writes the configuration `config(port, log path)` and starts webdis with it.
    fn launch_new(
        redis_port: u16,
        auth: Option<String>,
        port: Option<u16>,
        config: impl FnOnce(u16, &Path) -> serde_json::Value,
    ) -> Webdis {
        let scratch = Scratch::new("webdis");
        let port = port.unwrap_or_else(free_port);
        let log_path = scratch.0.join("webdis.log");
        let config = config(port, &log_path);
        let config_path = scratch.0.join("webdis.json");
        std::fs::write(&config_path, serde_json::to_string_pretty(&config).expect("json")).expect("write webdis.json");
        let out_path = scratch.0.join("webdis.out");
        let mut w = Webdis { port, redis_port, auth, proc: Proc(None), config_path, log_path, out_path, scratch };
        w.launch();
        w
    }

    fn launch(&mut self) {
        let (out, err) = log_stdio(&self.out_path);
        let child = Command::new("webdis")
            .arg(&self.config_path)
            .current_dir(&self.scratch.0)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("start webdis (installed by scripts/install-deps.sh store)");
        self.proc = Proc(Some(child));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.proc.exited() {
                self.proc.0 = None;
                panic!("webdis on port {} exited ({status}); log:\n{}", self.port, self.log());
            }
            let last = match self.request("GET", "/PING", b"") {
                // Only our own webdis: one that cannot bind its port exits with status 0 after
                // logging "Address already in use", and until then another webdis on that port
                // answers PING for it (the tests' store would silently be another test's).
                Ok(r) if r.status == 200 && listener_is_owned_by(self.pid(), self.port) => return,
                Ok(r) if r.status == 200 => {
                    if let Some(status) = self.proc.exited() {
                        self.proc.0 = None;
                        panic!(
                            "webdis on port {} exited ({status}) while another process answers on its port; log:\n{}",
                            self.port,
                            self.log()
                        );
                    }
                    format!("200 from a listener not (yet) ours on port {}", self.port)
                }
                Ok(r) => format!("{} {}", r.status, r.body_text()),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                panic!(
                    "webdis on port {} (redis port {}) did not answer GET /PING with 200 in {READY_TIMEOUT:?} \
                     (last: {last}); log:\n{}",
                    self.port,
                    self.redis_port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGKILL, then reap the process.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    /// Starts again on the same port and configuration (after a kill9 if still running); waits
    /// until GET /PING answers 200, so its Redis must be up.
    pub fn restart(&mut self) {
        self.proc.kill9();
        self.launch();
    }

    /// Points this webdis at another Redis on 127.0.0.1 (a promoted replica), as an operator
    /// would after a failover: rewrites `redis_port` in its configuration and starts it again on
    /// the same HTTP port (SIGKILL first); waits until GET /PING answers 200 through the new Redis.
    pub fn repoint(&mut self, redis_port: u16) {
        self.proc.kill9();
        let text = std::fs::read(&self.config_path).expect("read webdis.json");
        let mut config: serde_json::Value = serde_json::from_slice(&text).expect("webdis.json is JSON");
        config["redis_port"] = redis_port.into();
        std::fs::write(&self.config_path, serde_json::to_string_pretty(&config).expect("json"))
            .expect("write webdis.json");
        self.redis_port = redis_port;
        self.launch();
    }

    /// webdis's log file and anything it printed.
    pub fn log(&self) -> String {
        format!("{}{}", read_log(&self.log_path), read_log(&self.out_path))
    }

    /// A request to webdis, with the basic-auth header when it was started with auth.
    pub fn request(&self, method: &str, path: &str, body: &[u8]) -> std::io::Result<http::Response> {
        let auth = self.auth.as_deref().map(basic_auth);
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
        http::request(self.port, method, path, &headers, body)
    }

    /// `POST /` with a command such as `SET/k/v` (or `GET/k.raw`) as the body.
    pub fn post(&self, command: &str) -> http::Response {
        self.request("POST", "/", command.as_bytes()).expect("POST to webdis")
    }
}

/// Three Redis Cluster masters behind Envoy's redis_proxy behind webdis; everything killed when
/// dropped.
pub struct RedisCluster {
    /// webdis in front of the Envoy listener, as idemgate would call it.
    pub webdis: Webdis,
    /// Envoy's redis_proxy, the listener webdis calls (it speaks RESP, like a single Redis).
    envoy: Proc,
    envoy_config_path: PathBuf,
    envoy_log_path: PathBuf,
    /// The three masters (slots 0-5460, 5461-10922, 10923-16383 in this order).
    pub nodes: Vec<Redis>,
    _scratch: Scratch,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let scratch = Scratch::new("redis-cluster");
        let ports = free_ports(8);
        let nodes: Vec<Redis> = (0..3)
            .map(|i| Redis::start_cluster_node(&scratch.0.join(format!("node-{i}")), ports[i], ports[3 + i]))
            .collect();
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let out = run_bounded(
            Command::new("redis-cli").args(["--cluster", "create"]).args(&addrs).args([
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ]),
            COMMAND_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        for n in &nodes {
            loop {
                let info = n.command(&[b"CLUSTER", b"INFO"]).into_bulk().unwrap_or_default();
                if String::from_utf8_lossy(&info).contains("cluster_state:ok") {
                    break;
                }
                if Instant::now() >= deadline {
                    panic!(
                        "redis cluster node {} not in cluster_state:ok:\n{}\nlog:\n{}",
                        n.port,
                        String::from_utf8_lossy(&info),
                        n.log()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        let (envoy_port, envoy_admin_port) = (ports[6], ports[7]);
        let envoy_config_path = scratch.0.join("redis-cluster-proxy.yaml");
        std::fs::write(&envoy_config_path, render_cluster_proxy_config(envoy_port, envoy_admin_port, nodes[0].port))
            .expect("write envoy config");
        let envoy_log_path = scratch.0.join("envoy.log");
        let log_file = File::create(&envoy_log_path).expect("create envoy log");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&envoy_config_path)
            .args(["--concurrency", "1", "--disable-hot-restart", "--log-level", "info"])
            .current_dir(&scratch.0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .spawn()
            .expect("start envoy (installed by scripts/install-deps.sh envoy)");
        let mut envoy = Proc(Some(child));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = envoy.exited() {
                envoy.0 = None;
                panic!("envoy (redis_proxy) exited ({status}); log:\n{}", read_log(&envoy_log_path));
            }
            if http::get(envoy_admin_port, "/ready").map(|r| r.status == 200).unwrap_or(false) {
                break;
            }
            if Instant::now() >= deadline {
                panic!("envoy (redis_proxy) not ready in {READY_TIMEOUT:?}; log:\n{}", read_log(&envoy_log_path));
            }
            std::thread::sleep(Duration::from_millis(50));
        }

        let webdis = Webdis::start_inner(envoy_port, None, None);
        let cluster = RedisCluster { webdis, envoy, envoy_config_path, envoy_log_path, nodes, _scratch: scratch };
        // PING is answered by Envoy itself; a keyed read proves routing to the owning node works.
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let r = cluster.webdis.request("POST", "/", b"GET/idemgate-ready-probe");
            if matches!(&r, Ok(r) if r.status == 200 && r.json() == serde_json::json!({"GET": null})) {
                break;
            }
            if Instant::now() >= deadline {
                panic!(
                    "GET through webdis -> envoy -> cluster failed: {:?}\nenvoy log:\n{}\nwebdis log:\n{}",
                    r.map(|r| (r.status, r.body_text())),
                    cluster.envoy_log(),
                    cluster.webdis.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    pub fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The rendered Envoy configuration.
    pub fn envoy_config_path(&self) -> &Path {
        &self.envoy_config_path
    }

    pub fn envoy_log(&self) -> String {
        read_log(&self.envoy_log_path)
    }

    /// The port of the master owning `key`'s hash slot (asked with CLUSTER KEYSLOT and SLOTS).
    pub fn node_of(&self, key: impl AsRef<[u8]>) -> u16 {
        let port = self.nodes[0].port;
        let slot = match must(port, &[b"CLUSTER", b"KEYSLOT", key.as_ref()]) {
            Value::Int(s) => s,
            other => panic!("CLUSTER KEYSLOT: {other:?}"),
        };
        for range in must(port, &[b"CLUSTER", b"SLOTS"]).into_array() {
            // [start, end, [ip, port, id, ...], replicas...]
            let range = range.into_array();
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(master)) =
                (range.first(), range.get(1), range.get(2))
            else {
                panic!("unexpected CLUSTER SLOTS entry {range:?}");
            };
            if (*start..=*end).contains(&slot) {
                if let Value::Array(Some(m)) = master {
                    if let Some(Value::Int(p)) = m.get(1) {
                        return *p as u16;
                    }
                }
                panic!("unexpected CLUSTER SLOTS master {master:?}");
            }
        }
        panic!("no node owns slot {slot}");
    }

    fn node(&self, port: u16) -> &Redis {
        self.nodes.iter().find(|n| n.port == port).unwrap_or_else(|| panic!("no cluster node on port {port}"))
    }

    /// The exact bytes of a string key, read from the node owning it.
    pub fn get_raw(&self, key: impl AsRef<[u8]>) -> Option<Vec<u8>> {
        let key = key.as_ref();
        self.node(self.node_of(key)).get_raw(key)
    }

    /// `KEYS pattern` on every node, merged and sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut all: Vec<String> = self.nodes.iter().flat_map(|n| n.keys(pattern)).collect();
        all.sort();
        all
    }

    /// Every key on every node with every byte it holds, sorted by key.
    pub fn dump_all_values(&self) -> Vec<(String, Vec<u8>)> {
        let mut all: Vec<(String, Vec<u8>)> = self.nodes.iter().flat_map(Redis::dump_all_values).collect();
        all.sort();
        all
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Front to back: webdis, Envoy, then the nodes (fields dropped after this).
        self.webdis.kill9();
        self.envoy.kill9();
    }
}

/// A fake store on 127.0.0.1 that answers every HTTP request (any method, path and body) with
/// the same 200 and the same body, as webdis's `.raw` output would carry it: a hostile or broken
/// store for tests of what idemgate refuses to believe. Counts the requests it answered.
pub struct FakeStore {
    pub port: u16,
    requests: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FakeStore {
    pub fn start(answer: Vec<u8>) -> FakeStore {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake store");
        let port = listener.local_addr().expect("addr").port();
        let requests = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let answer = Arc::new(answer);
        let (n, sp) = (requests.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if sp.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(conn) = conn {
                    let (n, answer) = (n.clone(), answer.clone());
                    std::thread::spawn(move || fake_store_serve(conn, &answer, &n));
                }
            }
        });
        FakeStore { port, requests, stop }
    }

    /// How many requests it answered.
    pub fn requests(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FakeStore {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// Reads requests on one keep-alive connection (head, then `content-length` bytes) and answers
/// each with `answer`.
fn fake_store_serve(conn: std::net::TcpStream, answer: &[u8], n: &std::sync::atomic::AtomicU64) {
    use std::io::{BufRead, BufReader, Write};
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut writer) = conn.try_clone() else { return };
    let mut reader = BufReader::new(conn);
    loop {
        let mut length = 0usize;
        let mut first = true;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() && !first {
                break;
            }
            first = false;
            if let Some((name, value)) = line.split_once(':') {
                if name.trim().eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let head = format!("HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n", answer.len());
        if writer.write_all(head.as_bytes()).and_then(|_| writer.write_all(answer)).is_err() {
            return;
        }
    }
}
