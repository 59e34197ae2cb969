//! `https://` for `idemgate probe`: rustls (ring provider) with the Mozilla roots from
//! webpki-roots, plus the PEM certificates of `IDEMGATE_PROBE_CA_FILE` (a private CA, e.g. a
//! staging API's). Native only, like the whole CLI: nothing of it enters dist/idemgate.wasm.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use idemgate::probe::Answer;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

fn config() -> std::io::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(file) = std::env::var_os("IDEMGATE_PROBE_CA_FILE").filter(|f| !f.is_empty()) {
        let certs = CertificateDer::pem_file_iter(&file)
            .map_err(|e| std::io::Error::other(format!("IDEMGATE_PROBE_CA_FILE {}: {e}", file.to_string_lossy())))?;
        for c in certs {
            let c = c.map_err(|e| std::io::Error::other(format!("IDEMGATE_PROBE_CA_FILE: {e}")))?;
            roots.add(c).map_err(|e| std::io::Error::other(format!("IDEMGATE_PROBE_CA_FILE: {e}")))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// One HTTP/1.1 exchange over TLS on the connection `c` to `host:port`.
#[allow(clippy::too_many_arguments)]
pub fn exchange(
    c: TcpStream,
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &[u8],
    timeout: Duration,
) -> std::io::Result<Answer> {
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    let name = ServerName::try_from(host.to_string()).map_err(|e| std::io::Error::other(format!("{host}: {e}")))?;
    let conn = rustls::ClientConnection::new(config()?, name).map_err(std::io::Error::other)?;
    let mut tls = rustls::StreamOwned::new(conn, c);
    super::exchange_on(&mut tls, host, port, method, path, headers, body)
}
