//! [`Samples`]: a series of measurements (per-step times) kept in bounded memory.

use serde::{Deserialize, Serialize};

use crate::content::mix;

/// Samples kept at most per series: medians and p99s of a run of any length come from this
/// many values.
pub const SAMPLES_KEPT: usize = 1 << 12;

/// The first [`SAMPLES_KEPT`] values of a series, then a uniform sample of all of them
/// (Algorithm R, with a deterministic generator): the n-th value replaces a kept one with
/// probability `SAMPLES_KEPT / n`. Quantiles of the kept values estimate the whole series'
/// (exactly, for series no longer than the bound), and a long run's memory stays flat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Samples<T> {
    kept: Vec<T>,
    seen: u64,
}

impl<T: Copy> Samples<T> {
    /// Records one value.
    pub fn push(&mut self, v: T) {
        self.seen += 1;
        if self.kept.len() < SAMPLES_KEPT {
            self.kept.push(v);
            return;
        }
        let i = mix(self.seen) % self.seen;
        if let Some(slot) = self.kept.get_mut(i as usize) {
            *slot = v;
        }
    }

    /// Adds another series' kept values (the ranks' series, for the report).
    pub fn absorb(&mut self, other: &Samples<T>) {
        for &v in &other.kept {
            self.push(v);
        }
    }

    /// The kept values.
    pub fn values(&self) -> &[T] {
        &self.kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the bound (a soak's memory stays flat) and the sample's honesty (a series with a
    // known median keeps it).
    #[test]
    fn samples_stay_bounded_and_representative() {
        let mut s = Samples::default();
        for i in 0..(SAMPLES_KEPT as u64 * 8) {
            s.push(i % 1000);
        }
        assert_eq!(s.values().len(), SAMPLES_KEPT);
        let mut v = s.values().to_vec();
        v.sort_unstable();
        let median = v[v.len() / 2];
        assert!((450..=550).contains(&median), "{median}");
    }
}
