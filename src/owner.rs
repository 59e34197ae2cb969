//! Owner tokens: which request holds a claim.
//!
//! A completion or release is applied only if the record still carries the writer's token, so a
//! request whose claim was taken over can never overwrite its successor. Tokens must be unique
//! across worker threads and proxies with no JavaScript host: the filter feeds this module WASI
//! `random_get` bytes where the host offers them, and always mixes in the node id, the clock and a
//! per-VM counter, so two tokens differ even if one source is weak.

use crate::fingerprint::Framer;

const OWNER_TAG: &[u8] = b"idemgate-owner-v1\0";

/// A 16-byte owner token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub [u8; 16]);

/// What an owner token is derived from.
#[derive(Clone, Debug, Default)]
pub struct TokenSources<'a> {
    /// Random bytes from the host (empty when it has none).
    pub entropy: &'a [u8],
    /// The proxy's node id (Envoy `node.id`), distinct per proxy.
    pub node: &'a str,
    /// The VM's own identity: its root context id and the time it started, distinct per worker.
    pub vm: u64,
    /// Current time in nanoseconds since the epoch.
    pub now_nanos: u64,
    /// A counter, increased for each token of this VM.
    pub counter: u64,
}

impl OwnerToken {
    pub fn derive(s: &TokenSources<'_>) -> OwnerToken {
        let mut f = Framer::new(OWNER_TAG);
        f.field(s.entropy);
        f.field(s.node.as_bytes());
        f.field(&s.vm.to_le_bytes());
        f.field(&s.now_nanos.to_le_bytes());
        f.field(&s.counter.to_le_bytes());
        let digest = f.finish();
        let mut out = [0u8; 16];
        out.copy_from_slice(digest.get(..16).unwrap_or(&[0u8; 16]));
        OwnerToken(out)
    }

    pub fn hex(&self) -> String {
        crate::hex::encode(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn tokens_differ_by_counter_node_vm_time_and_entropy() {
        let base = TokenSources { entropy: b"", node: "envoy-a", vm: 1, now_nanos: 5, counter: 0 };
        let t = OwnerToken::derive(&base);
        let variants = [
            TokenSources { counter: 1, ..base.clone() },
            TokenSources { node: "envoy-b", ..base.clone() },
            TokenSources { vm: 2, ..base.clone() },
            TokenSources { now_nanos: 6, ..base.clone() },
            TokenSources { entropy: b"\x01", ..base.clone() },
        ];
        for v in &variants {
            assert_ne!(OwnerToken::derive(v), t, "{v:?}");
        }
        assert_eq!(OwnerToken::derive(&base), t, "derivation is deterministic");
    }

    #[test]
    fn a_hundred_thousand_counter_values_from_one_vm_never_collide() {
        let mut seen = std::collections::HashSet::new();
        for counter in 0..100_000 {
            let s = TokenSources { entropy: b"", node: "n", vm: 7, now_nanos: 42, counter };
            assert!(seen.insert(OwnerToken::derive(&s)));
        }
    }
}
