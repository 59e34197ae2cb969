//! Owner tokens: which request holds a claim.
//!
//! A completion or release is applied only if the record still carries the writer's token, so a
//! request whose claim was taken over can never overwrite its successor, and a store's "claimed"
//! answer must echo the claim's token. Two requests holding the same token on the same key would
//! break that, so tokens must never repeat, across worker threads, proxies and restarts, and must
//! not be guessable from one another.
//!
//! Each VM derives one **seed** when its root context is configured (`OwnerSeed::derive`): SHA-256
//! over 16 bytes of WASI `random_get` (where the host offers it), the proxy's node id, the VM's
//! root context id and its start time in nanoseconds. Each request's token is then
//! `SHA-256("idemgate-owner-v2", seed, counter)` cut to 128 bits, the counter counting this VM's
//! tokens from 1 (`OwnerToken::next`): no host call and no randomness per request. What that
//! guarantees:
//!
//! - one VM never repeats a token: its counter never repeats (a `u64` counting up by one), and two
//!   counters give the same token only through a collision of 128-bit truncated SHA-256;
//! - two VMs (workers, proxies, a VM restarted after a crash or a reload) have different seeds
//!   unless their 16 random bytes are equal (2^-128 for a pair) and, on a host without
//!   `random_get`, unless they share node id, root context id and start nanosecond;
//! - any two tokens ever made are equal only by a collision of 128-bit outputs: with 2^40 tokens in
//!   all, a probability below 2^-49;
//! - the seed never leaves the VM (never stored, sent or logged), so a token seen in the store
//!   or on the store link tells nothing of any other token.

use crate::fingerprint::Framer;

const SEED_TAG: &[u8] = b"idemgate-owner-seed-v1\0";
const OWNER_TAG: &[u8] = b"idemgate-owner-v2\0";

/// A 16-byte owner token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OwnerToken(pub [u8; 16]);

/// What a VM's seed is derived from.
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
}

/// One VM's secret seed for its owner tokens (see the module's guarantees).
#[derive(Clone)]
pub struct OwnerSeed([u8; 32]);

impl std::fmt::Debug for OwnerSeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The seed is secret: tokens are unguessable only while it is.
        f.write_str("OwnerSeed(..)")
    }
}

impl OwnerSeed {
    pub fn derive(s: &TokenSources<'_>) -> OwnerSeed {
        let mut f = Framer::new(SEED_TAG);
        f.field(s.entropy);
        f.field(s.node.as_bytes());
        f.field(&s.vm.to_le_bytes());
        f.field(&s.now_nanos.to_le_bytes());
        OwnerSeed(f.finish())
    }
}

impl OwnerToken {
    /// The VM's token number `counter` (count from 1, never reuse a number with one seed).
    pub fn next(seed: &OwnerSeed, counter: u64) -> OwnerToken {
        let mut f = Framer::new(OWNER_TAG);
        f.field(&seed.0);
        f.field(&counter.to_le_bytes());
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

    fn seed(entropy: &[u8], node: &str, vm: u64, now_nanos: u64) -> OwnerSeed {
        OwnerSeed::derive(&TokenSources { entropy, node, vm, now_nanos })
    }

    #[test]
    fn seeds_differ_by_entropy_node_vm_and_start_time() {
        let base = seed(b"", "envoy-a", 1, 5);
        let t = OwnerToken::next(&base, 1);
        for other in [
            seed(b"\x01", "envoy-a", 1, 5),
            seed(b"", "envoy-b", 1, 5),
            seed(b"", "envoy-a", 2, 5),
            seed(b"", "envoy-a", 1, 6),
        ] {
            assert_ne!(OwnerToken::next(&other, 1), t);
        }
        assert_eq!(OwnerToken::next(&seed(b"", "envoy-a", 1, 5), 1), t, "derivation is deterministic");
    }

    #[test]
    fn a_hundred_thousand_tokens_of_one_vm_never_collide() {
        let s = seed(b"0123456789abcdef", "n", 7, 42);
        let mut seen = std::collections::HashSet::new();
        for counter in 1..=100_000 {
            assert!(seen.insert(OwnerToken::next(&s, counter)));
        }
    }

    #[test]
    fn vms_seeded_alike_but_for_their_random_bytes_never_share_tokens() {
        // Two workers of one proxy started in the same nanosecond with the same root id: only
        // the host's random bytes tell them apart, and they do for every counter value.
        let a = seed(b"random bytes one", "n", 1, 42);
        let b = seed(b"random bytes two", "n", 1, 42);
        let mut seen = std::collections::HashSet::new();
        for counter in 1..=10_000 {
            assert!(seen.insert(OwnerToken::next(&a, counter)));
            assert!(seen.insert(OwnerToken::next(&b, counter)));
        }
    }

    #[test]
    fn the_seed_is_never_printed() {
        assert_eq!(format!("{:?}", seed(b"x", "n", 1, 1)), "OwnerSeed(..)");
    }

    #[test]
    fn owner_token_layout_is_pinned() {
        // printf 'idemgate-owner-v2\0' ; printf '32:' ; <32 zero bytes> ; printf ',8:' ;
        // <1 as 8 little-endian bytes> ; printf ',' | sha256sum, first 16 bytes.
        let t = OwnerToken::next(&OwnerSeed([0; 32]), 1);
        assert_eq!(t.hex(), PINNED_TOKEN);
    }

    const PINNED_TOKEN: &str = "48da7d888f5b9fda6fe294d84980064a";
}
