//! The local tier's shared data in process memory: what Envoy's Wasm shared data is to the Wasm
//! build (one map per Envoy process, seen by every worker, each write taking the next value of one
//! process-wide CAS counter), here a map in 64 shards, each behind its own mutex, so workers
//! touching different keys never wait on each other. A get or a set holds one shard's lock for
//! the call only: the local tier's compare-and-set (`local::Table`) is what makes a claim atomic,
//! exactly as over Envoy's shared data, and `set` with a CAS checks and writes under one lock.

use idemgate::local::{HostError, SetError, SharedData};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

const SHARDS: usize = 64;

/// One shard: each key's value and the CAS of its last write.
type Shard = HashMap<String, (Vec<u8>, u32)>;

struct Data {
    shards: Vec<Mutex<Shard>>,
    cas: AtomicU32,
}

static DATA: OnceLock<Data> = OnceLock::new();

fn data() -> &'static Data {
    DATA.get_or_init(|| Data {
        shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        cas: AtomicU32::new(0),
    })
}

/// FNV-1a over the key: which shard holds it.
fn shard_of(key: &str) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % SHARDS as u64) as usize
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
        if let (Some(want), Some((_, have))) = (cas.filter(|c| *c != 0), map.get(key)) {
            if want != *have {
                return Err(SetError::CasMismatch);
            }
        }
        map.insert(key.to_string(), (value.to_vec(), next_cas()));
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
