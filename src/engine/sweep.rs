//! The local table's sweep on a host's timer, and the gauges it makes: one rule for both hosts
//! (the Wasm root's tick, `src/filter/mod.rs`; the native build's configuration tick,
//! `native/src/lib.rs`). Once a second at most, `PER_SECOND` buckets from where the last sweep
//! stopped are read (expired records freed, `local::Table::sweep`), and the table's gauges are
//! the sums of every bucket's figures as of its last sweep (approximate, never made on a
//! request's path): `idemgate.local_occupancy` (records), `idemgate.local_record_bytes` (bytes of
//! the body keys, the pool's included) and `idemgate.local_evicted_age_seconds` (the age, in whole
//! seconds, of the table's latest eviction; 0 before any).

use crate::local::{Gauges, LocalError, SharedData, Table};
use crate::metrics::{Counter, Gauge};

/// How often a sweep runs (ms): the host may tick more often; `Sweeper::run` sweeps once per.
pub const PERIOD_MS: u64 = 1000;
/// Buckets each sweep reads (a second's share), freeing expired records and their bytes.
pub const PER_SECOND: u32 = 512;

/// One sweeper's place in the table and what it last read.
#[derive(Clone, Debug, Default)]
pub struct Sweeper {
    /// The next bucket to read.
    at: u32,
    /// When the last sweep ran (ms since the epoch; 0: never).
    last_ms: u64,
    /// The occupancy the last sweep found (for the 80 % warning).
    last_occupancy: u64,
    /// The table's figures, bucket by bucket, as the sweep last read them.
    gauges: Gauges,
}

/// What one sweep did and found: the host counts `counters`, sets `gauges` and logs the rest.
#[derive(Debug)]
pub struct Swept {
    /// Records freed (`idemgate.local_swept`, one each).
    pub freed: u32,
    /// Every bucket was read once more since the last pass ended (`idemgate.local_sweep_passes`).
    pub pass_ended: bool,
    /// The table's gauges as of this sweep.
    pub gauges: [(Gauge, u64); 3],
    /// Occupancy rose to 80 % of capacity or more since the last sweep: the warning to log.
    pub high_water: Option<String>,
    /// The sweep failed part way (the gauges are still those of the buckets read).
    pub error: Option<LocalError>,
}

impl Swept {
    /// The counters this sweep counts, each once per entry.
    pub fn counters(&self) -> impl Iterator<Item = Counter> {
        let freed = std::iter::repeat_n(Counter::LocalSwept, usize::try_from(self.freed).unwrap_or(0));
        freed.chain(self.pass_ended.then_some(Counter::LocalSweepPasses))
    }
}

impl Sweeper {
    /// When the next sweep is due (ms since the epoch): the host's timer is armed for it.
    pub fn next_ms(&self) -> u64 {
        self.last_ms.saturating_add(PERIOD_MS)
    }

    /// Sweeps `table` if `PERIOD_MS` passed since the last sweep (`None`: not due yet).
    pub fn run(&mut self, table: &Table, sd: &mut dyn SharedData, now_ms: u64) -> Option<Swept> {
        if self.last_ms != 0 && now_ms.saturating_sub(self.last_ms) < PERIOD_MS {
            return None;
        }
        self.last_ms = now_ms.max(1);
        let buckets = table.buckets();
        let (freed, error) = match table.sweep(sd, self.at, PER_SECOND, now_ms, &mut self.gauges) {
            Ok(n) => (n, None),
            Err(e) => (0, Some(e)),
        };
        let next = (self.at + PER_SECOND) % buckets.max(1);
        // Every bucket read once more since the last pass: tests wait on this count.
        let pass_ended = PER_SECOND >= buckets || next <= self.at;
        self.at = next;
        let occupancy = self.gauges.occupancy();
        let high_water = table.crossed_high_water(self.last_occupancy, occupancy).then(|| {
            format!(
                "idemgate: local table {occupancy} of {} records (80 % or more): when full, records older than local.min_protection_seconds are evicted, then requests get 503 capacity-exhausted",
                table.capacity()
            )
        });
        self.last_occupancy = occupancy;
        Some(Swept {
            freed,
            pass_ended,
            gauges: [
                (Gauge::LocalRecordBytes, self.gauges.bytes()),
                (Gauge::LocalOccupancy, occupancy),
                (Gauge::LocalEvictedAgeSeconds, self.gauges.evicted_age_ms() / 1000),
            ],
            high_water,
            error,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LocalConfig, WhenFull};
    use crate::local::memory::MemoryShared;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NOW: u64 = 1_000_000_000;

    /// The pace both hosts share: at most one sweep per `PERIOD_MS` however often the host ticks,
    /// `PER_SECOND` buckets each, a pass counted when every bucket was read once more; the gauges
    /// of an empty table are 0, and the host's timer is armed for the next sweep.
    #[test]
    fn one_sweep_a_second_reads_its_share_and_counts_each_pass_once() {
        // 2048 buckets (one per `DENSITY` records): a pass is four sweeps.
        let t = Table::new(&LocalConfig {
            max_entries: 2048 * crate::local::DENSITY,
            max_bytes: 1 << 20,
            when_full: WhenFull::EvictOldest,
            min_protection_seconds: 0,
        });
        assert_eq!(t.buckets(), 2048);
        let mut sd = MemoryShared::default();
        t.ensure_created(&mut sd).unwrap();
        let mut s = Sweeper::default();
        let mut passes = vec![];
        for k in 0..8u64 {
            let at = NOW + k * PERIOD_MS;
            let swept = s.run(&t, &mut sd, at).expect("due");
            assert!(swept.error.is_none(), "{swept:?}");
            assert_eq!(swept.freed, 0);
            assert_eq!(
                swept.gauges,
                [(Gauge::LocalRecordBytes, 0), (Gauge::LocalOccupancy, 0), (Gauge::LocalEvictedAgeSeconds, 0)]
            );
            assert!(swept.high_water.is_none());
            passes.push(swept.pass_ended);
            assert_eq!(
                swept.counters().collect::<Vec<_>>(),
                swept.pass_ended.then_some(Counter::LocalSweepPasses).into_iter().collect::<Vec<_>>()
            );
            // A host ticking every 100 ms meanwhile sweeps nothing more.
            assert!(s.run(&t, &mut sd, at + PERIOD_MS - 1).is_none());
            assert_eq!(s.next_ms(), at + PERIOD_MS);
        }
        assert_eq!(passes, [false, false, false, true, false, false, false, true]);
    }
}
