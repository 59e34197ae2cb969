//! Which build this is: its version (Cargo.toml's, the one CHANGELOG.md and RELEASES name) and the
//! formats of the records it reads and writes, logged once when the plugin is configured so an
//! operator can tell from a proxy's log which release runs there and whether two builds can share
//! a store (docs/operating.md, "Upgrades and mixed fleets").
//!
//! The formats are read from the constants the encoders use, so the line cannot drift from what
//! the build writes:
//! - store values: `IGS1` (the store scripts' header) + `IGM1` (the seal) + `IGR` version 1 (the
//!   record), under `idemgate:v1:` in Redis and `idemgate/v1/` in etcd. A decoder refuses any
//!   other magic or record version (503 `record-unreadable`, never a replay or a second execution).
//! - the local tier: shared-data names of layout v4 (`idemgate.v4.local.n<max_entries>`); a v3
//!   table left by a module before layout v4 is read, never written (`local::v3`).

use crate::{etcd, local, record, seal, store};

/// This build's version (semantic versioning; a `-dev` suffix until its release is recorded).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The line logged at configuration: the version and the record formats this build reads and
/// writes.
pub fn configured_line() -> String {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    format!(
        "idemgate {VERSION}: store records written and read as {}+{}+{}{} under {} (Redis) or {} (etcd); local table layout {} (a v3 table left by a reload is read, never written)",
        text(store::VALUE_MAGIC),
        text(seal::SEALED_MAGIC),
        text(record::MAGIC),
        record::VERSION,
        store::KEY_PREFIX,
        etcd::KEY_PREFIX,
        local::LAYOUT,
    )
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    /// A failure here after a format change is the reminder: say in CHANGELOG.md whether records
    /// changed, and keep tests/it/mixed_fleet.rs (the previous release beside this one) passing.
    #[test]
    fn the_line_names_the_version_and_the_formats_the_encoders_write() {
        let line = configured_line();
        assert!(line.starts_with(&format!("idemgate {}: ", env!("CARGO_PKG_VERSION"))), "{line}");
        assert!(line.contains("as IGS1+IGM1+IGR1 under idemgate:v1: (Redis) or idemgate/v1/ (etcd)"), "{line}");
        assert!(line.contains("local table layout v4 "), "{line}");
    }
}
