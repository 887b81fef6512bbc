//! A rank's counters since its previous report ([`RankDelta`]): sent with every step's output
//! (as vLLM's workers send their per-step `transfer_stats`), so that the engine publishes the
//! rank-side figures while the run goes on (see [`crate::metrics`]).

use std::time::Duration;

use super::RankStats;

/// What a rank's report carries: its counters since its previous report, in a [`RankStats`]
/// whose other figures (loaded tokens, hook samples, timeline) stay empty. Any values decode (a
/// worker's frame is not trusted): adding them saturates, never panics.
pub type RankDelta = RankStats;

impl RankStats {
    /// The counters `self` (the figures now) added to `before` (the counters at the previous
    /// report).
    pub fn since(&self, before: &Self) -> RankDelta {
        let mut d = RankDelta::default();
        d.add(self);
        d.each(before, u64::saturating_sub, Duration::saturating_sub);
        d
    }

    /// Adds `d`'s counters (a report's delta) to these.
    pub fn add(&mut self, d: &Self) {
        self.each(d, u64::saturating_add, Duration::saturating_add);
    }

    fn each(
        &mut self,
        o: &Self,
        n: impl Fn(u64, u64) -> u64,
        t: impl Fn(Duration, Duration) -> Duration,
    ) {
        for (a, b) in [
            (&mut self.blocks_stored, o.blocks_stored),
            (&mut self.blocks_loaded, o.blocks_loaded),
            (&mut self.bytes_stored, o.bytes_stored),
            (&mut self.bytes_loaded, o.bytes_loaded),
            (&mut self.copies, o.copies),
            (&mut self.loaded_blocks_verified, o.loaded_blocks_verified),
            (&mut self.written_slots_verified, o.written_slots_verified),
            (&mut self.read_blocks_checked, o.read_blocks_checked),
            (&mut self.flushed_stores, o.flushed_stores),
            (&mut self.failed_transfers, o.failed_transfers),
            (&mut self.remote_blocks_loaded, o.remote_blocks_loaded),
            (&mut self.remote_bytes_loaded, o.remote_bytes_loaded),
            (&mut self.invariant_checks, o.invariant_checks),
        ] {
            *a = n(*a, b);
        }
        self.store_time = t(self.store_time, o.store_time);
        self.load_time = t(self.load_time, o.load_time);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the live rank figures: deltas taken report by report add up to the totals, and
    // hostile values saturate instead of panicking.
    #[test]
    fn deltas_add_up_and_saturate() {
        let a = RankDelta {
            copies: 3,
            store_time: Duration::from_millis(5),
            ..RankDelta::default()
        };
        let b = RankDelta {
            copies: 7,
            invariant_checks: 2,
            store_time: Duration::from_millis(9),
            ..RankDelta::default()
        };
        let mut sum = RankDelta::default();
        sum.add(&a.since(&RankDelta::default()));
        sum.add(&b.since(&a));
        assert_eq!(sum, b);
        let huge = RankDelta {
            copies: u64::MAX,
            load_time: Duration::MAX,
            ..RankDelta::default()
        };
        sum.add(&huge);
        sum.add(&huge);
        assert_eq!((sum.copies, sum.load_time), (u64::MAX, Duration::MAX));
    }
}
