//! The worker's buffer budget (`max_buffered_bytes`) as one request counts in it, sans-IO.
//! A protected request's body, and an MCP POST's, is buffered until whole; the key's bucket read
//! at headers is kept for the claim at the body's end only while it fits. The worker's count is
//! the driver's (one per worker, shared by its requests: `engine::machine::Io::budget`); what one
//! request counts in it is its [`Held`], given back when its body is whole, when it is refused,
//! and at its end.
//!
//! The bucket read is only a saving: over the budget it yields its bytes to its own request's
//! body (the claim then reads the bucket again) before the body is refused.

use crate::config::Policy;
use crate::engine::request;
use crate::problem::ProblemKind;

/// The worker's budget now: the bytes its requests count, and its cap (`max_buffered_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    pub buffered: u64,
    pub max: u64,
}

/// What one request counts in its worker's budget: its body so far, and the bucket read at
/// headers it keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    body: u64,
    seen: u64,
}

/// A body chunk, counted (`Held::chunk`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counted {
    /// The worker's count after it.
    pub buffered: u64,
    /// The chunk did not fit beside the bucket read kept at headers: the read is dropped (its
    /// bytes given back; the claim reads the bucket again).
    pub seen_dropped: bool,
    /// The body is refused (over the route's limit, or over the budget even without the bucket
    /// read): everything this request counted is given back.
    pub refused: Option<ProblemKind>,
}

impl Held {
    /// The bytes this request counts (its body, the bucket read it keeps).
    pub fn bytes(&self) -> u64 {
        self.body.saturating_add(self.seen)
    }

    /// Keeps the bucket read at headers (`bytes`) if it fits `budget`: the worker's count after,
    /// `None` when it does not fit (the claim then reads the bucket again).
    pub fn keep_seen(&mut self, bytes: u64, budget: Budget) -> Option<u64> {
        let after = budget.buffered.saturating_add(bytes);
        if after > budget.max {
            return None;
        }
        self.seen = bytes;
        Some(after)
    }

    /// A chunk of the body, `body_size` bytes so far, under `policy`'s limit and `budget`.
    pub fn chunk(&mut self, body_size: u64, budget: Budget, policy: &Policy) -> Counted {
        let mut buffered = budget.buffered;
        let seen_dropped = buffered.saturating_add(body_size.saturating_sub(self.body)) > budget.max;
        if seen_dropped {
            buffered = buffered.saturating_sub(self.seen);
            self.seen = 0;
        }
        match request::body_chunk(body_size, self.body, buffered, budget.max, policy) {
            Ok(delta) => {
                self.body = body_size;
                Counted { buffered: buffered.saturating_add(delta), seen_dropped, refused: None }
            }
            Err(p) => Counted { buffered: self.release(buffered), seen_dropped, refused: Some(p) },
        }
    }

    /// Gives back everything this request counted: the worker's count (`buffered`) after.
    pub fn release(&mut self, buffered: u64) -> u64 {
        let after = buffered.saturating_sub(self.body).saturating_sub(self.seen);
        *self = Held::default();
        after
    }
}

#[cfg(test)]
mod tests;
