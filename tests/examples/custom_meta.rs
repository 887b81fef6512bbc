//! An engine with its own worker-metadata type: implement [`WorkerMeta`], check the laws with
//! `kvrelay_tests::laws::check_worker_meta_laws` in the engine's tests, and aggregate with
//! `Aggregator<YourMeta>`.
//!
//! `cargo run -p kvrelay-tests --example custom_meta` runs the law suite and one aggregated step;
//! `cargo test -p kvrelay-tests --example custom_meta` runs the tests at the bottom.

use kvrelay_core::{
    AggregateError, AggregatedOutput, Aggregator, MetaMismatch, Mode, Rank, RequestId, WorkerMeta,
    WorkerOutput,
};
use kvrelay_tests::laws::check_worker_meta_laws;
use proptest::prelude::*;

/// The highest KV offset any rank has flushed: merge is `max` (never fails).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct MaxWatermark(pub u64);

impl WorkerMeta for MaxWatermark {
    fn merge_from(&mut self, other: &Self) -> Result<(), MetaMismatch> {
        self.0 = self.0.max(other.0);
        Ok(())
    }
}

/// The storage tier a rank moved KV to.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum Tier {
    /// Host memory.
    Cpu,
    /// Local disk.
    Disk,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Tier::Cpu => "cpu",
            Tier::Disk => "disk",
        }
    }
}

/// Bytes and transfers moved to one tier: counters add (saturating); ranks reporting different
/// tiers in one step are a mismatch, which rejects the step.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct TierBytes {
    /// The tier.
    pub tier: Tier,
    /// Bytes moved.
    pub bytes: u64,
    /// Transfers performed.
    pub transfers: u32,
}

impl WorkerMeta for TierBytes {
    fn merge_from(&mut self, other: &Self) -> Result<(), MetaMismatch> {
        // Check first, change after: a failed merge must leave `self` as it was.
        if self.tier != other.tier {
            return Err(MetaMismatch::Forms {
                left: self.tier.name(),
                right: other.tier.name(),
            });
        }
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.transfers = self.transfers.saturating_add(other.transfers);
        Ok(())
    }
}

fn watermarks() -> impl Strategy<Value = MaxWatermark> {
    prop_oneof![0u64..1_000, Just(u64::MAX)].prop_map(MaxWatermark)
}

fn tier_bytes() -> impl Strategy<Value = TierBytes> {
    (
        prop_oneof![Just(Tier::Cpu), Just(Tier::Disk)],
        prop_oneof![4 => 0u64..1_000, 1 => (u64::MAX - 1)..=u64::MAX],
        0u32..10,
    )
        .prop_map(|(tier, bytes, transfers)| TierBytes {
            tier,
            bytes,
            transfers,
        })
}

/// One rank's output: it finished sending `ids` and reports `meta`.
fn output<M>(ids: &[u32], meta: Option<M>) -> Option<WorkerOutput<M>> {
    Some(WorkerOutput {
        finished_sending: Some(ids.iter().copied().map(RequestId).collect()),
        worker_meta: meta,
        ..WorkerOutput::default()
    })
}

/// One step of a 3-rank engine: every rank finished request 7; ranks 0 and 2 report watermarks.
fn one_step() -> Result<Option<AggregatedOutput<MaxWatermark>>, AggregateError> {
    let mut aggregator: Aggregator<MaxWatermark> = Aggregator::new(3, Mode::Strict);
    aggregator.aggregate(
        &[
            output(&[7], Some(MaxWatermark(120))),
            output(&[7], None),
            output(&[7], Some(MaxWatermark(96))),
        ],
        Rank(0),
    )
}

fn main() {
    check_worker_meta_laws(watermarks());
    check_worker_meta_laws(tier_bytes());
    println!("MaxWatermark and TierBytes obey the worker-metadata laws");
    let out = one_step()
        .expect("compatible metadata")
        .expect("rank 0 produced an output");
    println!(
        "finished_sending = {:?}, worker_meta = {:?}",
        out.finished_sending, out.worker_meta
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::SortedSet;
    use kvrelay_tests::laws::config;

    #[test]
    fn max_watermark_obeys_the_laws() {
        check_worker_meta_laws(watermarks());
    }

    #[test]
    fn tier_bytes_obeys_the_laws() {
        check_worker_meta_laws(tier_bytes());
    }

    #[test]
    fn the_aggregator_folds_watermarks_to_the_max() {
        let out = one_step().unwrap().unwrap();
        assert_eq!(out.worker_meta, Some(MaxWatermark(120)));
        assert_eq!(
            out.finished_sending,
            Some(SortedSet::from_vec(vec![RequestId(7)]))
        );
    }

    proptest! {
        #![proptest_config(config())]

        /// I-25 for a custom type: the aggregated metadata is the max over the ranks that reported
        /// one, whatever the rank order.
        #[test]
        fn aggregated_watermark_is_the_max_in_any_rank_order(
            metas in proptest::collection::vec(proptest::option::of(watermarks()), 1..6)
                .prop_flat_map(|m| (Just(m.clone()), Just(m).prop_shuffle()))
        ) {
            let (metas, shuffled) = metas;
            let run = |metas: &[Option<MaxWatermark>]| {
                let outputs: Vec<_> = metas.iter().map(|m| output(&[1], *m)).collect();
                let mut a: Aggregator<MaxWatermark> = Aggregator::new(1, Mode::Compat);
                a.aggregate(&outputs, Rank(0)).unwrap().unwrap().worker_meta
            };
            let expected = metas.iter().flatten().map(|m| m.0).max().map(MaxWatermark);
            prop_assert_eq!(run(&metas), expected);
            prop_assert_eq!(run(&shuffled), expected);
        }
    }

    #[test]
    fn mismatched_tiers_reject_the_whole_step() {
        let cpu = TierBytes {
            tier: Tier::Cpu,
            bytes: 10,
            transfers: 1,
        };
        let disk = TierBytes {
            tier: Tier::Disk,
            ..cpu
        };
        let mut a: Aggregator<TierBytes> = Aggregator::new(2, Mode::Compat);
        a.aggregate(&[output(&[1], Some(cpu)), output(&[], None)], Rank(0))
            .unwrap();
        let before = a.clone();
        let err = a
            .aggregate(
                &[output(&[1], Some(cpu)), output(&[1], Some(disk))],
                Rank(0),
            )
            .unwrap_err();
        assert_eq!(
            err,
            AggregateError::MetaMismatch(MetaMismatch::Forms {
                left: "cpu",
                right: "disk"
            })
        );
        assert_eq!(a, before, "a rejected step counts no report");
        let out = a
            .aggregate(&[output(&[], Some(cpu)), output(&[1], Some(cpu))], Rank(0))
            .unwrap()
            .unwrap();
        assert_eq!(
            out.finished_sending,
            Some(SortedSet::from_vec(vec![RequestId(1)]))
        );
        assert_eq!(
            out.worker_meta,
            Some(TierBytes {
                bytes: 20,
                transfers: 2,
                ..cpu
            })
        );
    }
}
