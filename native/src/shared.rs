//! The local tier's shared data in process memory: what Envoy's Wasm shared data is to the Wasm
//! build (one map per Envoy process, seen by every worker, each write taking the next value of one
//! process-wide CAS counter), here a map in 64 shards, each behind its own mutex, so workers
//! touching different keys never wait on each other. A get or a set holds one shard's lock for
//! the call only: the local tier's compare-and-set (`local::Table`) is what makes a claim atomic,
//! exactly as over Envoy's shared data, and `set` with a CAS checks and writes under one lock.

use idemgate::local::{HostError, SetError, SharedData};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

const SHARDS: usize = 64;

/// One shard: each key's value and the CAS of its last write.
type Shard = HashMap<String, (Vec<u8>, u32), BuildHasherDefault<KeyHasher>>;

/// The shards' hash, in place of the standard library's SipHash: the key taken eight bytes at a
/// time (FxHash's step, as rustc's own maps), then splitmix64's finaliser so that every bit of the
/// result depends on every byte. SipHash guards a map against keys chosen to collide; these keys
/// are the local table's own names (`idemgate.<layout>.local.n<entries>.b.<bucket>` and the
/// like), the bucket picked by the storage key's keyed hash (`scope::StorageKey`), never text a
/// client chose. The map lookup was about a twelfth of this module's share of a first request,
/// mostly cache misses on the keys compared rather than the hash (profiled 2026-12-07,
/// docs/native.md).
#[derive(Default)]
struct KeyHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl KeyHasher {
    fn step(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.step(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            if let Some(head) = w.get_mut(..rest.len()) {
                head.copy_from_slice(rest);
            }
            // The length in the top byte: "ab" and "ab\0" differ.
            self.step(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.step(u64::from(i));
    }

    /// The state through splitmix64's finaliser: the map takes the low bits and the top seven,
    /// the shard (`shard_of`) bits 32 to 37.
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

struct Data {
    shards: Vec<Mutex<Shard>>,
    cas: AtomicU32,
}

static DATA: OnceLock<Data> = OnceLock::new();

fn data() -> &'static Data {
    DATA.get_or_init(|| Data {
        shards: (0..SHARDS).map(|_| Mutex::new(HashMap::default())).collect(),
        cas: AtomicU32::new(0),
    })
}

/// Which shard holds a key: bits the shard's own map does not index by (`KeyHasher::finish`).
fn shard_of(key: &str) -> usize {
    let mut h = KeyHasher::default();
    h.write(key.as_bytes());
    ((h.finish() >> 32) % SHARDS as u64) as usize
}

fn lock(key: &str) -> Option<MutexGuard<'static, Shard>> {
    // A poisoned shard cannot happen (the module aborts on panic); its data is still whole.
    data().shards.get(shard_of(key)).map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The next CAS value: never 0 (0 means "no CAS" to the table, as to Envoy).
fn next_cas() -> u32 {
    let prev = data().cas.fetch_add(1, Ordering::Relaxed);
    prev.wrapping_add(1).max(1)
}

/// The process's shared data (a handle: the map is the process's).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessShared;

impl SharedData for ProcessShared {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        let map = lock(key).ok_or(HostError)?;
        Ok(match map.get(key) {
            None => (None, None),
            Some((v, cas)) if v.is_empty() => (None, Some(*cas)),
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
        })
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        let mut map = lock(key).ok_or(SetError::Host)?;
        // One lookup; a key already there is rewritten in place (its name not copied again), as a
        // bucket and a record position are at every write. The value gets an allocation of its own
        // length: the old one reused would keep the largest value a record position ever held, a
        // memory `local.max_bytes` (which counts values' lengths) would not bound.
        match map.get_mut(key) {
            Some((have_value, have_cas)) => {
                if cas.is_some_and(|want| want != 0 && want != *have_cas) {
                    return Err(SetError::CasMismatch);
                }
                *have_value = value.to_vec();
                *have_cas = next_cas();
            }
            None => {
                map.insert(key.to_string(), (value.to_vec(), next_cas()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_semantics_are_envoys() {
        let mut sd = ProcessShared;
        let k = "idemgate-native-test.cas";
        assert_eq!(sd.get(k).unwrap(), (None, None));
        // A CAS write to an absent key inserts it.
        sd.set(k, b"a", Some(7)).unwrap();
        let (v, cas) = sd.get(k).unwrap();
        assert_eq!(v.as_deref(), Some(&b"a"[..]));
        let cas = cas.unwrap();
        // A stale CAS is refused and changes nothing.
        assert_eq!(sd.set(k, b"b", Some(cas.wrapping_add(1).max(1))), Err(SetError::CasMismatch));
        assert_eq!(sd.get(k).unwrap().0.as_deref(), Some(&b"a"[..]));
        sd.set(k, b"b", Some(cas)).unwrap();
        // A removal keeps the key with a CAS.
        sd.set(k, b"", None).unwrap();
        let (v, cas2) = sd.get(k).unwrap();
        assert!(v.is_none() && cas2.is_some());
    }

    #[test]
    fn a_key_rewritten_in_place_reads_its_last_value_whole() {
        // `set` rewrites a present key in place: a shorter value after a longer one must not keep
        // the longer one's tail (nor its allocation), and every write takes a new CAS.
        let mut sd = ProcessShared;
        let k = "idemgate-native-test.rewrite";
        sd.set(k, b"a longer first value", None).unwrap();
        let (_, first) = sd.get(k).unwrap();
        sd.set(k, b"short", first).unwrap();
        let (v, second) = sd.get(k).unwrap();
        assert_eq!(v.as_deref(), Some(&b"short"[..]));
        assert_ne!(first, second);
        assert_eq!(sd.set(k, b"stale", first), Err(SetError::CasMismatch));
        sd.set(k, b"longer again than the first value", second).unwrap();
        assert_eq!(sd.get(k).unwrap().0.as_deref(), Some(&b"longer again than the first value"[..]));
    }

    #[test]
    fn keys_spread_over_the_shards() {
        // The local table's names (buckets and record positions) land in every shard, none
        // holding more than four times its share.
        let mut per = [0usize; SHARDS];
        let names = (0..25_000).map(|i| format!("idemgate.v4.local.n200000.b.{i}"));
        for name in names.chain((0..25_000).map(|i| format!("idemgate.v4.local.n200000.r.{i}.3"))) {
            per[shard_of(&name)] += 1;
        }
        let share = 50_000 / SHARDS;
        assert!(per.iter().all(|n| *n > 0 && *n < 4 * share), "{per:?}");
    }

    #[test]
    fn one_cas_write_wins_among_threads() {
        // Eight threads read the same CAS, then all write with it: exactly one write lands.
        let k = "idemgate-native-test.race";
        let mut sd = ProcessShared;
        sd.set(k, b"bucket", None).unwrap();
        let (_, cas) = sd.get(k).unwrap();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
        let wins: usize = (0..8u8)
            .map(|i| {
                let b = std::sync::Arc::clone(&barrier);
                std::thread::spawn(move || {
                    b.wait();
                    usize::from(ProcessShared.set(k, &[i], cas).is_ok())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(wins, 1);
    }
}
