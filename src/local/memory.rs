//! Shared data in memory with Envoy's exact semantics: the one fake the local tier's tests, the
//! integration tests (`tests/it/lifecycle_tiers.rs`) and the benchmark profile (`benches/hot_path.rs`)
//! run the table over. Compiled for tests and behind the cargo feature `testkit` (never in the
//! shipped module: the wasm build leaves the feature off).

use super::{HostError, SetError, SharedData};
use std::collections::HashMap;

/// Envoy's shared data: a CAS write to an absent key inserts it; a removal (an empty value) keeps
/// the key with a CAS; every write takes the next value of one process-wide CAS counter.
#[derive(Default, Clone, Debug)]
pub struct MemoryShared {
    pub(crate) map: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
    /// Host calls made so far (`get` and `set`), for the tests that count them.
    pub calls: u64,
}

impl MemoryShared {
    /// Key names written so far (a name is never freed).
    pub fn names(&self) -> usize {
        self.map.len()
    }

    /// Bytes of names and values held.
    pub fn bytes(&self) -> usize {
        self.map.iter().map(|(k, (v, _))| k.len() + v.len()).sum()
    }

    /// Every key and its value.
    pub fn entries(&self) -> impl Iterator<Item = (&String, &Vec<u8>)> {
        self.map.iter().map(|(k, (v, _))| (k, v))
    }

    /// Sets the process-wide CAS counter to `last` (the next write takes `last + 1`): a test's
    /// stand-in for the 2^32 writes after which Envoy's counter comes round.
    pub fn set_last_cas(&mut self, last: u32) {
        self.next_cas = last;
    }

    /// Key names that start with `prefix`.
    pub fn names_with(&self, prefix: &str) -> Vec<String> {
        self.map.keys().filter(|k| k.starts_with(prefix)).cloned().collect()
    }
}

impl SharedData for MemoryShared {
    fn get(&mut self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), HostError> {
        self.calls += 1;
        Ok(match self.map.get(key) {
            None => (None, None),
            Some((v, cas)) if v.is_empty() => (None, Some(*cas)),
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
        })
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        self.calls += 1;
        if let (Some(want), Some((_, have))) = (cas.filter(|c| *c != 0), self.map.get(key)) {
            if want != *have {
                return Err(SetError::CasMismatch);
            }
        }
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        self.map.insert(key.to_string(), (value.to_vec(), self.next_cas));
        Ok(())
    }
}
