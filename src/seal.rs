//! Authenticated store records: every record idemgate writes to the external store carries an
//! HMAC-SHA-256 over the Redis key it is written under and the record's bytes, keyed with a
//! secret from the VM's environment (`IDEMGATE_RECORD_KEY`). A value that fails verification
//! (transplanted from another key or namespace, forged, truncated, written with a key this proxy
//! does not hold) is never replayed and never lets a request through: it reads as unreadable.
//!
//! Rotation: a proxy writes with its current key and also accepts the previous one
//! (`IDEMGATE_RECORD_KEY_PREVIOUS`), so proxies can be rolled one by one: first give every proxy
//! the new key as previous, then make it current everywhere, then drop the old one.
//!
//! What the tag covers: the record (its fingerprint, state, response, expiry on the writer's
//! clock) and the key. Not the small header the store scripts write around it (phase letter,
//! owner token, lock expiry by Redis's clock): those are written by Redis itself from Redis's
//! `TIME`, so no proxy can sign them. Whoever can write the store can change them, or delete the
//! key, which no signature prevents (the store's ACL does); what a changed header can do is
//! stated in docs/THREAT_MODEL.md: it can make a key look in flight or outcome-unknown, never
//! make a response replay under another key. A completed phase must carry a completed record
//! (`store::StoredValue::open`), so a header change cannot turn a claim into a replay.
//!
//! The local tier needs none of this: shared data is the Envoy process's own memory, which only
//! the Wasm modules loaded in it can read or write.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Marks a sealed record: `IGM1` + 32 bytes of tag + the record.
pub const SEALED_MAGIC: &[u8; 4] = b"IGM1";
const TAG_LEN: usize = 32;
/// The least secret accepted, in bytes (`openssl rand -hex 32` gives 64).
pub const MIN_KEY_BYTES: usize = 32;
/// Domain separation: these tags authenticate idemgate store records, nothing else.
const CONTEXT: &[u8] = b"idemgate store record v1\0";

/// The environment variable holding the secret records are written with.
pub const RECORD_KEY_ENV: &str = "IDEMGATE_RECORD_KEY";
/// The environment variable holding a previous secret, still accepted on reading.
pub const PREVIOUS_RECORD_KEY_ENV: &str = "IDEMGATE_RECORD_KEY_PREVIOUS";

/// Why a stored record was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsealed {
    /// No seal at all (written by a build before records were sealed, or by someone else).
    NotSealed,
    /// A seal that no key this proxy holds verifies: forged, moved from another key or
    /// namespace, truncated, or sealed with a key this proxy was not given.
    BadTag,
}

impl fmt::Display for Unsealed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unsealed::NotSealed => write!(f, "record is not sealed"),
            Unsealed::BadTag => write!(f, "record seal does not verify for this key"),
        }
    }
}

/// Which key verified a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verified {
    Current,
    Previous,
}

/// The keys a proxy (or the operator CLI) seals and opens store records with.
#[derive(Clone)]
pub struct Seal {
    current: Hmac<Sha256>,
    previous: Option<Hmac<Sha256>>,
}

impl fmt::Debug for Seal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Seal {{ previous: {} }}", self.previous.is_some())
    }
}

fn mac_for(secret: &[u8], name: &str) -> Result<Hmac<Sha256>, String> {
    if secret.len() < MIN_KEY_BYTES {
        return Err(format!("{name} must hold at least {MIN_KEY_BYTES} bytes (for example `openssl rand -hex 32`)"));
    }
    Hmac::<Sha256>::new_from_slice(secret).map_err(|e| format!("{name}: {e}"))
}

impl Seal {
    /// From the secrets' values (`current` from `IDEMGATE_RECORD_KEY`, `previous` from
    /// `IDEMGATE_RECORD_KEY_PREVIOUS`). A missing or short current secret is an error: a proxy
    /// that shares a store never writes unauthenticated records. An empty previous is none.
    pub fn new(current: Option<&str>, previous: Option<&str>) -> Result<Seal, String> {
        let current = match current {
            Some(c) if !c.is_empty() => mac_for(c.as_bytes(), RECORD_KEY_ENV)?,
            _ => {
                return Err(format!(
                    "{RECORD_KEY_ENV} is not set in the VM's environment: a store needs a secret of at least \
                     {MIN_KEY_BYTES} bytes, the same on every proxy (vm_config.environment_variables)"
                ))
            }
        };
        let previous = match previous {
            Some(p) if !p.is_empty() => Some(mac_for(p.as_bytes(), PREVIOUS_RECORD_KEY_ENV)?),
            _ => None,
        };
        Ok(Seal { current, previous })
    }

    /// From the process environment (the Wasm VM's, or the operator CLI's).
    pub fn from_env() -> Result<Seal, String> {
        let current = std::env::var(RECORD_KEY_ENV).ok();
        let previous = std::env::var(PREVIOUS_RECORD_KEY_ENV).ok();
        Seal::new(current.as_deref(), previous.as_deref())
    }

    fn tag(mac: &Hmac<Sha256>, redis_key: &str, record: &[u8]) -> Hmac<Sha256> {
        let mut m = mac.clone();
        m.update(CONTEXT);
        m.update(&(redis_key.len() as u64).to_be_bytes());
        m.update(redis_key.as_bytes());
        m.update(record);
        m
    }

    /// `record` sealed for `redis_key`: the bytes to store.
    pub fn seal(&self, redis_key: &str, record: &[u8]) -> Vec<u8> {
        let tag = Seal::tag(&self.current, redis_key, record).finalize().into_bytes();
        let mut out = Vec::with_capacity(SEALED_MAGIC.len() + TAG_LEN + record.len());
        out.extend_from_slice(SEALED_MAGIC);
        out.extend_from_slice(&tag);
        out.extend_from_slice(record);
        out
    }

    /// The record inside `sealed`, if a key this proxy holds verifies it for `redis_key`.
    /// Verification is constant-time (`Mac::verify_slice`).
    pub fn open<'a>(&self, redis_key: &str, sealed: &'a [u8]) -> Result<(&'a [u8], Verified), Unsealed> {
        let (Some(magic), Some(tag), Some(record)) =
            (sealed.get(..4), sealed.get(4..4 + TAG_LEN), sealed.get(4 + TAG_LEN..))
        else {
            return Err(Unsealed::NotSealed);
        };
        if magic != SEALED_MAGIC {
            return Err(Unsealed::NotSealed);
        }
        if Seal::tag(&self.current, redis_key, record).verify_slice(tag).is_ok() {
            return Ok((record, Verified::Current));
        }
        match &self.previous {
            Some(p) if Seal::tag(p, redis_key, record).verify_slice(tag).is_ok() => Ok((record, Verified::Previous)),
            _ => Err(Unsealed::BadTag),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const K1: &str = "0123456789abcdef0123456789abcdef-one";
    const K2: &str = "0123456789abcdef0123456789abcdef-two";

    #[test]
    fn a_sealed_record_opens_under_its_key_only() {
        let s = Seal::new(Some(K1), None).unwrap();
        let sealed = s.seal("idemgate:v1:aa", b"record");
        assert_eq!(s.open("idemgate:v1:aa", &sealed), Ok((&b"record"[..], Verified::Current)));
        assert_eq!(s.open("idemgate:v1:ab", &sealed), Err(Unsealed::BadTag), "moved to another key");
    }

    #[test]
    fn forged_truncated_and_unsealed_values_are_refused() {
        let s = Seal::new(Some(K1), None).unwrap();
        let mut sealed = s.seal("k", b"record bytes");
        assert_eq!(s.open("k", &sealed[..sealed.len() - 1]), Err(Unsealed::BadTag), "truncated");
        assert_eq!(s.open("k", &sealed[..10]), Err(Unsealed::NotSealed), "cut inside the tag");
        assert_eq!(s.open("k", b"record bytes"), Err(Unsealed::NotSealed));
        let last = sealed.len() - 1;
        sealed[last] ^= 1;
        assert_eq!(s.open("k", &sealed), Err(Unsealed::BadTag), "one bit changed");
        let other = Seal::new(Some(K2), None).unwrap();
        assert_eq!(other.open("k", &s.seal("k", b"r")), Err(Unsealed::BadTag), "another secret");
    }

    #[test]
    fn rotation_accepts_the_previous_key_and_writes_with_the_new_one() {
        let old = Seal::new(Some(K1), None).unwrap();
        let rotated = Seal::new(Some(K2), Some(K1)).unwrap();
        let by_old = old.seal("k", b"r");
        assert_eq!(rotated.open("k", &by_old), Ok((&b"r"[..], Verified::Previous)));
        let by_new = rotated.seal("k", b"r");
        assert_eq!(rotated.open("k", &by_new), Ok((&b"r"[..], Verified::Current)));
        assert_eq!(old.open("k", &by_new), Err(Unsealed::BadTag), "a proxy not yet given the new key");
    }

    #[test]
    fn a_missing_or_short_secret_is_refused() {
        assert!(Seal::new(None, None).unwrap_err().contains(RECORD_KEY_ENV));
        assert!(Seal::new(Some(""), None).is_err());
        assert!(Seal::new(Some("short"), None).unwrap_err().contains("at least 32 bytes"));
        assert!(Seal::new(Some(K1), Some("short")).unwrap_err().contains(PREVIOUS_RECORD_KEY_ENV));
        assert!(Seal::new(Some(K1), Some("")).is_ok(), "an empty previous key is none");
    }
}
