//! What a seed decides: [`SimRng`], the seeded generator of every choice of a run, and
//! [`FaultMix`], the faults of the run drawn from it.

use kvrelay_engine::content::mix;
use serde::Serialize;

/// The seeded generator of every choice of a run.
#[derive(Clone, Debug)]
pub(crate) struct SimRng(u64);

impl SimRng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(mix(seed ^ 0x6a09_e667_f3bc_c908))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// `true` with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// An independent generator for a part of the run (a rank's transfers, a relay).
    pub(crate) fn fork(&mut self, salt: u64) -> Self {
        Self(mix(self.next_u64() ^ salt))
    }
}

/// A fault's rate: off, `low` or `high`, drawn from `r`.
fn rate(r: &mut SimRng, low: f64, high: f64) -> f64 {
    match r.range(0, 2) {
        0 => 0.0,
        1 => low,
        _ => high,
    }
}

/// One seed in this many runs with a shared tier (seed 1 too).
pub const TIER_SHARE: u64 = 4;

/// The faults of one run: each a probability per opportunity (a transfer, a frame, a step, a
/// store command).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FaultMix {
    /// A transfer fails part-way.
    pub transfer_fail: f64,
    /// A transfer is slow (5–40 ms instead of tens of µs).
    pub transfer_slow: f64,
    /// A rank's report is delayed (0.1–20 ms): a slow rank, reports reordered across ranks.
    pub report_delay: f64,
    /// A report is sent twice (the copy at once or later: a duplicate or a stale frame).
    pub report_duplicate: f64,
    /// A step frame reaches a rank late (0.1–10 ms).
    pub step_delay: f64,
    /// Per engine step: a live request is aborted.
    pub abort: f64,
    /// Per engine step: the connector's cache is reset (jobs may be in flight).
    pub reset: f64,
    /// One rank stops answering after a drawn step.
    pub rank_lost: bool,
    /// The run has a shared tier (the simulated store, `tier.rs`); the `tier_*` faults are
    /// its, per store command (one slot's pipeline).
    pub tier: bool,
    /// A key vanishes: any key of the store, and a key the command reads (evicted between
    /// probe and load).
    pub tier_evict: f64,
    /// A write lands partly: one value of the command truncated or torn under its key.
    pub tier_torn: f64,
    /// The command's node goes away for one to three deadlines: commands to it time out.
    pub tier_away: f64,
    /// A slow answer, within the deadline.
    pub tier_slow: f64,
}

impl FaultMix {
    /// No fault.
    pub fn none() -> Self {
        Self::default()
    }

    /// Every fault kind, at rates that still let most requests finish.
    pub fn every() -> Self {
        Self {
            transfer_fail: 0.05,
            transfer_slow: 0.05,
            report_delay: 0.2,
            report_duplicate: 0.1,
            step_delay: 0.2,
            abort: 0.03,
            reset: 0.01,
            rank_lost: true,
            tier: true,
            tier_evict: 0.05,
            tier_torn: 0.05,
            tier_away: 0.01,
            tier_slow: 0.05,
        }
    }

    /// Seed 0: none; seed 1: every kind; others: each kind off, low or high, drawn from the
    /// seed (a rank is lost in about one seed in eight; one in [`TIER_SHARE`] has a shared
    /// tier, its faults drawn likewise).
    pub fn for_seed(seed: u64) -> Self {
        match seed {
            0 => return Self::none(),
            1 => return Self::every(),
            _ => {}
        }
        let r = &mut SimRng::new(seed ^ 0xfa17);
        let mut mix = Self {
            transfer_fail: rate(r, 0.01, 0.1),
            transfer_slow: rate(r, 0.02, 0.2),
            report_delay: rate(r, 0.05, 0.5),
            report_duplicate: rate(r, 0.02, 0.2),
            step_delay: rate(r, 0.05, 0.5),
            abort: rate(r, 0.01, 0.05),
            reset: rate(r, 0.003, 0.02),
            rank_lost: r.range(0, 7) == 0,
            ..Self::none()
        };
        // Drawn after the others: the seeds' other faults are those they had before the tier.
        if r.range(0, TIER_SHARE - 1) == 0 {
            mix.tier = true;
            mix.tier_evict = rate(r, 0.01, 0.1);
            mix.tier_torn = rate(r, 0.01, 0.1);
            mix.tier_away = rate(r, 0.003, 0.02);
            mix.tier_slow = rate(r, 0.02, 0.2);
        }
        mix
    }

    /// The kinds this mix injects, by name.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (on, name) in [
            (self.transfer_fail > 0.0, "transfer_fail"),
            (self.transfer_slow > 0.0, "transfer_slow"),
            (self.report_delay > 0.0, "report_delay"),
            (self.report_duplicate > 0.0, "report_duplicate"),
            (self.step_delay > 0.0, "step_delay"),
            (self.abort > 0.0, "abort"),
            (self.reset > 0.0, "reset"),
            (self.rank_lost, "rank_lost"),
            (self.tier_evict > 0.0, "tier_evict"),
            (self.tier_torn > 0.0, "tier_torn"),
            (self.tier_away > 0.0, "tier_away"),
            (self.tier_slow > 0.0, "tier_slow"),
        ] {
            if on {
                v.push(name);
            }
        }
        v
    }
}
