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
//!   A key's tombstone in Redis (`tombstone_seconds`): `IGS1T` + `IGM1` + `IGT` version 1 under
//!   `idemgate:v1:t:{idemgate:v1:<hex>}` (`store::tombstone_redis_key`), the record's key's hash tag.
//! - the local tier: shared-data names of layout v4 (`idemgate.v4.local.n<max_entries>`); a v3
//!   table left by a module before layout v4 is read, never written (`local::v3`).

use crate::{etcd, local, record, seal, store};

/// This build's version (semantic versioning; a `-dev` suffix until its release is recorded).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The line logged at configuration: the version and the record formats this build reads and
/// writes.
pub fn configured_line() -> String {
    format!("idemgate {VERSION}: {}", formats())
}

/// The record formats this build reads and writes (the module's configured line and the operator
/// CLI's `--version` both say it so).
pub fn formats() -> String {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let record = format!("{}+{}{}", text(seal::SEALED_MAGIC), text(record::MAGIC), record::VERSION);
    // A key's tombstone in Redis: its header, then the seal around its body's magic and version.
    let (version, magic) = store::TOMBSTONE_BODY.split_last().unwrap_or((&0, &[]));
    let tombstone = format!("{}+{}+{}{version}", text(store::TOMBSTONE_MAGIC), text(seal::SEALED_MAGIC), text(magic));
    format!(
        "store records written and read as {}+{record} under {} (Redis; a key's tombstone {tombstone} under {}) or {}+{record} under {} (etcd; a key's tombstone {tombstone}+expiry under {}<hex>/t); local table layout {} (a v3 table left by a reload is read, never written)",
        text(store::VALUE_MAGIC),
        store::KEY_PREFIX,
        store::tombstone_redis_key_of(&format!("{}<hex>", store::KEY_PREFIX)),
        text(etcd::VALUE_MAGIC),
        etcd::KEY_PREFIX,
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
        assert!(
            line.contains(
                "as IGS1+IGM1+IGR1 under idemgate:v1: (Redis; a key's tombstone IGS1T+IGM1+IGT1 under idemgate:v1:t:{idemgate:v1:<hex>}) or IGE1+IGM1+IGR1 under idemgate/v1/ (etcd; a key's tombstone IGS1T+IGM1+IGT1+expiry under idemgate/v1/<hex>/t)"
            ),
            "{line}"
        );
        assert!(line.contains("local table layout v4 "), "{line}");
        // The tombstone key named is the one the store writes: `<hex>` read as a storage key's hex.
        let skey = crate::scope::StorageKey([0xab; 32]);
        let named = format!("{}{}", store::KEY_PREFIX, crate::hex::encode(&skey.0));
        assert_eq!(store::tombstone_redis_key(&skey), format!("idemgate:v1:t:{{{named}}}"));
        let value = store::tombstone_value(
            &skey,
            &crate::fingerprint::Fingerprint([1; 32]),
            &crate::seal::Seal::new(Some("0123456789abcdef0123456789abcdef"), None).unwrap(),
        );
        assert!(value.starts_with(b"IGS1TIGM1"), "{:?}", String::from_utf8_lossy(&value));
        assert_eq!(crate::etcd::key_tombstone_key(&skey), format!("idemgate/v1/{}/t", crate::hex::encode(&skey.0)));
    }
}
