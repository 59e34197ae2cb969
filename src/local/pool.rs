//! The table-wide byte pool of layout v4 (`<prefix>.pool`): the part of `local.max_bytes` that
//! only bodies too large for their bucket's remaining share pay for (docs/local-tier.md, "Large
//! bodies").
//!
//! Its value lists every reservation: (bucket, position, owner token, bytes, the body key's CAS
//! before the owner's write). The bytes the pool counts are the sum of the list, so there is no
//! separate counter to drift. A body is written only after its reservation is in the list (a CAS
//! of the pool), and a reservation leaves the list only once its body key no longer holds that
//! owner's body, or can no longer be written by it (`Table::complete`, `Table::sweep`): the list
//! always covers every pooled byte a body key holds.

use crate::owner::OwnerToken;

const MAGIC: &[u8; 4] = b"IGP\x01";
/// Bucket, position, owner, bytes, body CAS.
const RESERVATION_BYTES: usize = 4 + 1 + 16 + 4 + 4;
/// Reservations the pool holds at most (its value stays under 30 KB): past it a large body is
/// kept without its body, as when the pool has no bytes left.
pub const MAX_RESERVATIONS: usize = 1024;

/// One pooled body: position `position` of bucket `bucket`, written by `owner`, `bytes` long;
/// `body_cas` is the CAS its body key had just before the owner's (conditional) write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub bucket: u32,
    pub position: usize,
    pub owner: OwnerToken,
    pub bytes: u32,
    pub body_cas: u32,
}

impl Reservation {
    /// Whether `other` is the same reservation: the same owner's body at the same position, on
    /// the same CAS of its body key (an owner that lost a race to the sweep reserves again with
    /// the new CAS, and the sweep's giving back of the old one must not take the new one).
    pub fn same(&self, other: &Reservation) -> bool {
        self.bucket == other.bucket
            && self.position == other.position
            && self.owner == other.owner
            && self.body_cas == other.body_cas
    }
}

/// The pool's value: its reservations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pool {
    pub reservations: Vec<Reservation>,
}

impl Pool {
    /// Bytes reserved.
    pub fn used(&self) -> u64 {
        self.reservations.iter().map(|r| u64::from(r.bytes)).sum()
    }

    /// Magic, count (u16), then each reservation.
    pub fn encode(&self) -> Vec<u8> {
        let n = self.reservations.len().min(MAX_RESERVATIONS);
        let mut out = Vec::with_capacity(MAGIC.len() + 2 + n * RESERVATION_BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&u16::try_from(n).unwrap_or(u16::MAX).to_le_bytes());
        for r in self.reservations.iter().take(n) {
            out.extend_from_slice(&r.bucket.to_le_bytes());
            out.push(u8::try_from(r.position).unwrap_or(u8::MAX));
            out.extend_from_slice(&r.owner.0);
            out.extend_from_slice(&r.bytes.to_le_bytes());
            out.extend_from_slice(&r.body_cas.to_le_bytes());
        }
        out
    }

    /// Refuses an unknown magic, more than `MAX_RESERVATIONS`, truncation and trailing bytes.
    pub fn decode(bytes: &[u8]) -> Option<Pool> {
        let r = bytes.strip_prefix(MAGIC.as_slice())?;
        let n = usize::from(u16::from_le_bytes(r.get(..2)?.try_into().ok()?));
        let r = r.get(2..)?;
        if n > MAX_RESERVATIONS || r.len() != n * RESERVATION_BYTES {
            return None;
        }
        let u32_at = |c: &[u8], at: usize| c.get(at..at + 4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes);
        let reservations = r
            .chunks_exact(RESERVATION_BYTES)
            .map(|c| {
                Some(Reservation {
                    bucket: u32_at(c, 0)?,
                    position: usize::from(*c.get(4)?),
                    owner: OwnerToken(c.get(5..21)?.try_into().ok()?),
                    bytes: u32_at(c, 21)?,
                    body_cas: u32_at(c, 25)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Pool { reservations })
    }
}
