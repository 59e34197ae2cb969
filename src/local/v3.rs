//! The layout v3 table (`idemgate.v3.local.n<max_entries>`), read only: what a module of layout
//! v4 consults after a hot reload from a v3 module, whose claims may still be in flight and whose
//! records still hold their keys (docs/local-tier.md, "Upgrade from layout v3").
//!
//! v4 never writes here: the v3 module keeps completing, releasing and sweeping its own records
//! while it drains. v4 only reads a key's v3 bucket (and, to replay or name a creator, its slot)
//! when its own bucket does not hold the key.

use super::{HostError, Name, SharedData};
use crate::decision::{Phase, Summary};
use crate::fingerprint::Fingerprint;
use crate::owner::OwnerToken;
use crate::record::Record;
use crate::scope::StorageKey;

const MAGIC: &[u8; 4] = b"IGB\x03";
/// v3's entry, after its position and tag bytes.
const ENTRY_BYTES: usize = 32 + 1 + 32 + 16 + 8 + 8 + 8 + 2 + 4 + 8;
const WIDTH: usize = 64;

/// A v3 record as its bucket holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub position: usize,
    pub skey: StorageKey,
    pub owner: OwnerToken,
    pub summary: Summary,
    pub status: u16,
}

/// The v3 table of the same `max_entries` (v3 names and geometry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V3 {
    prefix: String,
    buckets: u32,
}

impl V3 {
    pub fn new(max_entries: u64) -> V3 {
        let buckets = max_entries.div_ceil(8).clamp(1, u64::from(u32::MAX));
        V3 { prefix: format!("idemgate.v3.local.n{max_entries}"), buckets: u32::try_from(buckets).unwrap_or(u32::MAX) }
    }

    /// Whether a v3 module created its table in this Envoy (its `ready` mark).
    pub fn present(&self, sd: &mut dyn SharedData) -> bool {
        matches!(sd.get(&Name::of(format_args!("{}.ready", self.prefix))), Ok((Some(v), _)) if v == b"1")
    }

    fn bucket_of(&self, skey: &StorageKey) -> u32 {
        let mut first = [0u8; 8];
        first.copy_from_slice(skey.0.get(24..32).unwrap_or(&[0u8; 8]));
        u32::try_from(u64::from_le_bytes(first) % u64::from(self.buckets)).unwrap_or(0)
    }

    /// The v3 record that holds `skey` at `now_ms`, if any. An unreadable bucket counts as a host
    /// error: never as absent (that could execute a v3 claim again).
    pub fn holder(&self, sd: &mut dyn SharedData, skey: &StorageKey, now_ms: u64) -> Result<Option<Entry>, HostError> {
        let i = self.bucket_of(skey);
        let (v, _) = sd.get(&Name::of(format_args!("{}.b.{i}", self.prefix)))?;
        let Some(v) = v else { return Ok(None) };
        let entries = decode(&v).ok_or(HostError)?;
        Ok(entries.into_iter().find(|e| e.skey == *skey && !e.summary.is_free(now_ms)))
    }

    /// The record in `e`'s slot, when its owner and key match.
    pub fn record(&self, sd: &mut dyn SharedData, skey: &StorageKey, e: &Entry) -> Option<Record> {
        let i = self.bucket_of(skey);
        let (v, _) = sd.get(&Name::of(format_args!("{}.s.{i}.{}", self.prefix, e.position))).ok()?;
        let v = v?;
        if v.get(..16) != Some(e.owner.0.as_slice()) || v.get(16..48) != Some(skey.0.as_slice()) {
            return None;
        }
        Record::decode(v.get(48..)?).ok()
    }
}

/// A v3 bucket's entries (`None`: not a v3 bucket).
fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    let (&used, mut r) = bytes.strip_prefix(MAGIC.as_slice())?.split_first()?;
    let mut out = Vec::with_capacity(usize::from(used));
    for _ in 0..used {
        let (&j, tail) = r.split_first()?;
        let (&tag, tail) = tail.split_first()?;
        let body = tail.get(..ENTRY_BYTES)?;
        r = tail.get(ENTRY_BYTES..)?;
        let u64_at = |at: usize| body.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        let lock_expires_at_ms = u64_at(97)?;
        let phase = match tag {
            1 => Phase::Claimed { lock_expires_at_ms },
            2 => Phase::Forwarded { lock_expires_at_ms },
            3 => Phase::Completed,
            4 => Phase::Unknown,
            _ => return None,
        };
        let fingerprint = match body.get(32)? {
            0 => None,
            1 => Some(Fingerprint(body.get(33..65)?.try_into().ok()?)),
            _ => return None,
        };
        if usize::from(j) >= WIDTH {
            return None;
        }
        out.push(Entry {
            position: usize::from(j),
            skey: StorageKey(body.get(0..32)?.try_into().ok()?),
            owner: OwnerToken(body.get(65..81)?.try_into().ok()?),
            summary: Summary { fingerprint, expires_at_ms: u64_at(89)?, phase },
            status: u16::from_le_bytes(body.get(105..107)?.try_into().ok()?),
        });
    }
    r.is_empty().then_some(out)
}

/// A v3 bucket as the v3 module wrote it (for the tests of the upgrade path).
#[cfg(test)]
pub fn encode_for_test(entries: &[(usize, u8, StorageKey, OwnerToken, u64, u64)]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.push(u8::try_from(entries.len()).unwrap_or(0));
    for (j, tag, skey, owner, expires, lock) in entries {
        out.push(u8::try_from(*j).unwrap_or(0));
        out.push(*tag);
        out.extend_from_slice(&skey.0);
        out.push(1);
        out.extend_from_slice(&[7u8; 32]);
        out.extend_from_slice(&owner.0);
        out.extend_from_slice(&0u64.to_le_bytes());
        out.extend_from_slice(&expires.to_le_bytes());
        out.extend_from_slice(&lock.to_le_bytes());
        out.extend_from_slice(&201u16.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes());
    }
    out
}
