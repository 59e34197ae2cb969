//! TLS on the store link, as shipped in `envoy/store-tls/`: certificates made with the `openssl`
//! command at run time, the TLS terminator in front of webdis (`webdis-tls.yaml`, a real Envoy on
//! 127.0.0.1 with ports chosen at run time) and idemgate's `idemgate_store` cluster over TLS
//! (`idemgate-store-cluster.yaml`), both rendered from the shipped files.

use super::{envoy_bin, free_port, http, repo_root, Scratch};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The store's name in the shipped files (SNI, the certificate's subject alternative name).
pub const STORE_NAME: &str = "webdis.idemgate.internal";
/// Where the shipped files read their certificates and keys.
const SHIPPED_TLS_DIR: &str = "/etc/idemgate/store-tls/";

/// `openssl ARGS` in `dir`, which must succeed.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("run openssl (installed by scripts/install-deps.sh store)");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA and, signed by it, the store's server certificate (`tls.crt`, `tls.key`, naming
/// `STORE_NAME`) and a proxy's client certificate (`proxy.crt`, `proxy.key`), in a folder laid
/// out as the shipped files expect `/etc/idemgate/store-tls/`.
pub struct Pki {
    pub dir: PathBuf,
    _scratch: Scratch,
}

impl Pki {
    pub fn generate(name: &str) -> Pki {
        Pki::generate_with(name, STORE_NAME, "/CN=idemgate-proxy")
    }

    /// For etcd: a server certificate naming `server_name` and 127.0.0.1, good for both ends of
    /// a TLS connection (etcd's JSON gateway dials its own gRPC server with it), and a proxy
    /// certificate with no Common Name (its name in a subject alternative name): with auth on,
    /// etcd's JSON gateway refuses a client certificate carrying one (400 "CommonName of client
    /// sending a request against gateway will be ignored and not used as expected").
    pub fn generate_for(name: &str, server_name: &str) -> Pki {
        Pki::generate_with(name, server_name, "/O=idemgate-proxy")
    }

    fn generate_with(name: &str, server_name: &str, proxy_subject: &str) -> Pki {
        let scratch = Scratch::new(&format!("pki-{name}"));
        let dir = scratch.0.clone();
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
        let ca_subject = format!("/CN=idemgate test CA {name}");
        let mut ca = vec!["req", "-x509", "-days", "2", "-keyout", "ca.key", "-out", "ca.crt", "-subj"];
        ca.push(&ca_subject);
        ca.extend(["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]);
        ca.extend(ec);
        openssl(&dir, &ca);
        for (stem, subject, ext) in [
            (
                "tls",
                server_name,
                format!("subjectAltName=DNS:{server_name},IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"),
            ),
            ("proxy", proxy_subject, "subjectAltName=DNS:idemgate-proxy\nextendedKeyUsage=clientAuth\n".to_string()),
        ] {
            std::fs::write(dir.join(format!("{stem}.ext")), ext).expect("write extensions");
            let (key, csr, crt, extfile) =
                (format!("{stem}.key"), format!("{stem}.csr"), format!("{stem}.crt"), format!("{stem}.ext"));
            let subject = if subject.starts_with('/') { subject.to_string() } else { format!("/CN={subject}") };
            let mut req = vec!["req", "-new", "-keyout", &key, "-out", &csr, "-subj", &subject];
            req.extend(ec);
            openssl(&dir, &req);
            openssl(
                &dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.crt",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &crt,
                    "-extfile",
                    &extfile,
                ],
            );
        }
        Pki { dir, _scratch: scratch }
    }

    /// `text` with the shipped certificate folder replaced by this one.
    pub fn place(&self, text: &str) -> String {
        text.replace(SHIPPED_TLS_DIR, &format!("{}/", self.dir.display()))
    }
}

/// Replaces `${NAME}` placeholders and checks none is left outside comments.
pub fn render(template: &str, values: &[(&str, String)], what: &str) -> String {
    let mut text = template.to_string();
    for (name, value) in values {
        text = text.replace(&format!("${{{name}}}"), value);
    }
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        assert!(!line.contains("${"), "unreplaced placeholder in {what}: {line}");
    }
    text
}

pub fn shipped(rel: &str) -> String {
    std::fs::read_to_string(repo_root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// `envoy/store-tls/idemgate-store-cluster.yaml` rendered for a terminator on 127.0.0.1:`port`,
/// with `pki`'s files: a cluster for `EnvoyOptions::extra_clusters`.
pub fn store_cluster(port: u16, pki: &Pki) -> String {
    let text = shipped("envoy/store-tls/idemgate-store-cluster.yaml");
    let values = [("STORE_ADDRESS", "127.0.0.1".to_string()), ("STORE_PORT", port.to_string())];
    pki.place(&render(&text, &values, "idemgate-store-cluster.yaml"))
}

/// The TLS terminator of `envoy/store-tls/webdis-tls.yaml` in front of webdis on
/// 127.0.0.1:`webdis_port`; killed when dropped.
pub struct StoreTls {
    pub port: u16,
    pub admin_port: u16,
    pub config_path: PathBuf,
    child: Option<Child>,
    log_path: PathBuf,
    _scratch: Scratch,
}

impl StoreTls {
    pub fn start(webdis_port: u16, pki: &Pki) -> StoreTls {
        let scratch = Scratch::new("store-tls");
        let (port, admin_port) = (free_port(), free_port());
        let values = [
            ("LISTEN_ADDRESS", "127.0.0.1".to_string()),
            ("LISTEN_PORT", port.to_string()),
            ("ADMIN_PORT", admin_port.to_string()),
            ("WEBDIS_PORT", webdis_port.to_string()),
        ];
        let config = pki.place(&render(&shipped("envoy/store-tls/webdis-tls.yaml"), &values, "webdis-tls.yaml"));
        let config_path = scratch.0.join("webdis-tls.yaml");
        std::fs::write(&config_path, config).expect("write webdis-tls.yaml");
        let log_path = scratch.0.join("envoy.log");
        let log = std::fs::File::create(&log_path).expect("create log");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", "1", "--disable-hot-restart", "--log-level", "info"])
            .current_dir(&scratch.0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start envoy (installed by scripts/install-deps.sh envoy)");
        let mut t = StoreTls { port, admin_port, config_path, child: Some(child), log_path, _scratch: scratch };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(Ok(Some(status))) = t.child.as_mut().map(Child::try_wait) {
                t.child = None;
                panic!("the TLS terminator exited ({status}); log:\n{}", t.log());
            }
            if http::get(admin_port, "/ready").is_ok_and(|r| r.status == 200) {
                return t;
            }
            assert!(Instant::now() < deadline, "the TLS terminator was not ready in 60 s; log:\n{}", t.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// A counter from the admin `/stats` endpoint whose name ends with `suffix` (0 when absent).
    pub fn stat(&self, suffix: &str) -> u64 {
        let r = http::get(self.admin_port, "/stats").expect("admin stats");
        String::from_utf8_lossy(&r.body)
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter(|(n, _)| n.ends_with(suffix))
            .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
            .sum()
    }
}

impl Drop for StoreTls {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
