//! `kvrelay bench`: a conformance case as a benchmark workload.
//!
//! The case is parsed and its arguments converted to core values once. Then it is timed two
//! ways, each over `repeat` replays on fresh machines (building a machine is not timed):
//!
//! * **whole replay** — every call of the case in one timed region: what the machine costs,
//!   with no timer inside (a 30 ns call timed on its own is mostly `Instant::now`). Quote this
//!   one when comparing with another implementation's time for the same calls.
//! * **per call kind** — each call timed on its own, the median per kind: where the time goes.
//!
//! Parsing, conversion and result rendering are outside both. Before timing, the case is run once
//! with its expectations checked, so a benchmark of a wrong implementation fails instead of
//! reporting a number.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use crate::{AnyCase, Harness, PreparedCase};

/// Timing of one call kind.
#[derive(Debug, Clone, PartialEq)]
pub struct KindStats {
    /// The call's name.
    pub call: String,
    /// Timed calls (calls of this kind per replay × replays).
    pub samples: usize,
    /// Median, 10th and 90th percentile, in nanoseconds.
    pub median_ns: f64,
    /// 10th percentile, ns.
    pub p10_ns: f64,
    /// 90th percentile, ns.
    pub p90_ns: f64,
}

/// What [`bench_case`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// Replays timed, each way.
    pub replays: usize,
    /// Calls per replay.
    pub calls: usize,
    /// A whole replay (every call in one timed region): median, 10th and 90th percentile, ns.
    pub replay_median_ns: f64,
    /// 10th percentile of a whole replay, ns.
    pub replay_p10_ns: f64,
    /// 90th percentile of a whole replay, ns.
    pub replay_p90_ns: f64,
    /// Per call kind, each call timed on its own (sorted by call name).
    pub kinds: Vec<KindStats>,
}

impl BenchReport {
    /// The sum over call kinds of median × calls per replay: the per-call estimate of a
    /// replay, timer cost included.
    pub fn sum_of_kind_medians_ns(&self) -> f64 {
        let per_replay = |k: &KindStats| k.samples as f64 / self.replays as f64;
        self.kinds.iter().map(|k| k.median_ns * per_replay(k)).sum()
    }
}

/// Replays `case` `repeat` times each way (see the module docs) and returns the timings.
pub fn bench_case(case: &AnyCase, repeat: usize) -> Result<BenchReport, String> {
    match case {
        AnyCase::Aggregator(c) => bench_prepared(c, repeat),
        AnyCase::WorkerMeta(c) => bench_prepared(c, repeat),
        AnyCase::EventAccumulator(c) => bench_prepared(c, repeat),
        AnyCase::WorkerProtocol(c) => bench_prepared(c, repeat),
        AnyCase::Engine(c) => bench_prepared(c, repeat),
        AnyCase::OffloadManager(c) => bench_prepared(c, repeat),
        AnyCase::TieringManager(c) => bench_prepared(c, repeat),
        AnyCase::Multi(c) => bench_prepared(c, repeat),
    }
}

fn bench_prepared<H: Harness>(
    case: &PreparedCase<H>,
    repeat: usize,
) -> Result<BenchReport, String> {
    case.run()
        .map_err(|e| format!("the case does not pass, so it is not benchmarked: {e}"))?;
    let mut replays = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        let mut machine = H::new(&case.config).map_err(|e| e.to_string())?;
        let t = Instant::now();
        for c in &case.calls {
            drop(black_box(machine.apply(black_box(&c.op))));
        }
        replays.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        drop(black_box(machine));
    }
    replays.sort_unstable();
    // Each call's kind as an index, found once: no string lookup between timed calls.
    let names: BTreeMap<&str, usize> = case
        .calls
        .iter()
        .map(|c| c.call.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .enumerate()
        .map(|(i, n)| (n, i))
        .collect();
    let kind_of: Vec<usize> = case.calls.iter().map(|c| names[c.call.as_str()]).collect();
    let mut samples: Vec<Vec<u64>> = vec![Vec::new(); names.len()];
    for _ in 0..repeat {
        let mut machine = H::new(&case.config).map_err(|e| e.to_string())?;
        for (c, &kind) in case.calls.iter().zip(&kind_of) {
            let op = black_box(&c.op);
            let t = Instant::now();
            let out = machine.apply(op);
            let ns = t.elapsed().as_nanos();
            drop(black_box(out));
            samples[kind].push(u64::try_from(ns).unwrap_or(u64::MAX));
        }
    }
    let kinds = names
        .into_iter()
        .map(|(call, i)| (call, std::mem::take(&mut samples[i])))
        .map(|(call, mut v)| {
            v.sort_unstable();
            KindStats {
                call: call.to_string(),
                samples: v.len(),
                median_ns: percentile(&v, 0.5),
                p10_ns: percentile(&v, 0.1),
                p90_ns: percentile(&v, 0.9),
            }
        })
        .collect();
    Ok(BenchReport {
        replays: repeat,
        calls: case.calls.len(),
        replay_median_ns: percentile(&replays, 0.5),
        replay_p10_ns: percentile(&replays, 0.1),
        replay_p90_ns: percentile(&replays, 0.9),
        kinds,
    })
}

/// The `q`-quantile of sorted `v` (nearest rank; the mean of the two middle values for the
/// median of an even count).
fn percentile(v: &[u64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    if q == 0.5 && v.len().is_multiple_of(2) {
        let m = v.len() / 2;
        return (v[m - 1] as f64 + v[m] as f64) / 2.0;
    }
    let idx = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[idx.min(v.len() - 1)] as f64
}

/// A duration in ns, human-readable.
pub fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.3} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn median_of_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(percentile(&[1, 2, 3, 10], 0.5), 2.5);
        assert_eq!(percentile(&[1, 2, 3], 0.5), 2.0);
        assert_eq!(percentile(&[5], 0.9), 5.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
