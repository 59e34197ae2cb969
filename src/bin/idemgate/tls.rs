//! `https://` for `idemgate probe`: rustls (ring provider) with the Mozilla roots from
//! webpki-roots, plus the PEM certificates of `IDEMGATE_PROBE_CA_FILE` (a private CA, e.g. a
//! staging API's). Native only, like the whole CLI: nothing of it enters dist/idemgate.wasm.

use std::net::TcpStream;
use std::sync::Arc;

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

/// The connection `c` to `host` inside a TLS client session (certificates checked against the
/// roots of `config`); its timeouts are the caller's.
pub fn wrap(c: TcpStream, host: &str) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    let name = ServerName::try_from(host.to_string()).map_err(|e| std::io::Error::other(format!("{host}: {e}")))?;
    let conn = rustls::ClientConnection::new(config()?, name).map_err(std::io::Error::other)?;
    Ok(rustls::StreamOwned::new(conn, c))
}
