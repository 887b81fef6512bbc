//! Worker → scheduler metadata as a commutative monoid (SEMANTICS.md §4.3–§4.4, I-25, I-31).
//!
//! Each rank builds at most one metadata object per step (`build_connector_worker_meta`); the
//! aggregator folds the ranks' objects with [`WorkerMeta::merge_from`], and the scheduler-side
//! connector sees the fold. `None` is the identity, so a rank with nothing to report returns
//! `None` and costs nothing.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Debug;

use crate::ids::JobId;
use crate::sorted_set::SortedSet;

/// Two metadata values that cannot be merged: different forms, or multi tuples of different
/// lengths. Error kind `meta_mismatch`.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MetaMismatch {
    /// The two values are of different forms (e.g. `offload` and `set`).
    #[error("cannot merge worker metadata of form `{left}` with form `{right}`")]
    Forms {
        /// Form of the left operand.
        left: &'static str,
        /// Form of the right operand.
        right: &'static str,
    },
    /// Two MultiConnector tuples with different numbers of slots.
    #[error("cannot merge multi metadata with {left} slots and {right} slots")]
    MultiLength {
        /// Slots of the left operand.
        left: usize,
        /// Slots of the right operand.
        right: usize,
    },
}

/// A worker-metadata type: what an engine's connector ships from every rank to the scheduler.
///
/// Implement it for your own metadata to use it with the [`crate::Aggregator`]. The merge must be
/// a commutative monoid with `None` as identity (I-25): associative and commutative, so the
/// result does not depend on rank order or on how the fold is grouped. `kvrelay-tests` has a law
/// suite (`kvrelay_tests::laws::check_worker_meta_laws`) that checks this for any implementation.
pub trait WorkerMeta: Clone + Debug + Eq {
    /// `self ⊕ other`, in place.
    ///
    /// On error `self` must be unchanged: the aggregator relies on it to reject a step whole.
    fn merge_from(&mut self, other: &Self) -> Result<(), MetaMismatch>;
}

/// `a ⊕ b` with `None` as identity: `None ⊕ None = None`.
pub fn merge<M: WorkerMeta>(a: Option<M>, b: Option<M>) -> Result<Option<M>, MetaMismatch> {
    match (a, b) {
        (None, b) => Ok(b),
        (a, None) => Ok(a),
        (Some(mut a), Some(b)) => {
            a.merge_from(&b)?;
            Ok(Some(a))
        }
    }
}

/// The worker metadata of kvrelay's own connectors, in the three forms of SEMANTICS.md §4.3–§4.4.
///
/// It crosses process boundaries (rank → engine), so decoding validates it: an [`OffloadMeta`]
/// must be well formed, and `multi` tuples nest at most [`MAX_META_DEPTH`] deep (a decoder fed
/// a deeper value stops with an error instead of recursing without bound).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Meta {
    /// Offloading completions: per job, how many ranks completed it.
    Offload(OffloadMeta),
    /// An opaque set (an example form; merge is set union).
    Set(SortedSet<String>),
    /// MultiConnector: one slot per child connector, `None` where that child built nothing.
    Multi(Vec<Option<Meta>>),
}

/// `OffloadingWorkerMetadata`: completed transfer jobs with their counts, plus transfer stats.
///
/// A rank marks each job it finished (or acknowledged without transferring) with count 1; merge
/// adds counts per job, and adds `bytes` and `transfers`.
///
/// `failed` is kvrelay's addition for [`Mode::Strict`](crate::Mode::Strict) (vLLM asserts that
/// transfers never fail): the completed jobs whose transfer failed on some rank. A failed job is
/// still an acknowledgement (it counts towards the job's quorum); merge takes the union, so a job
/// that failed on any rank is failed. Always empty under `compat`.
///
/// Jobs and counts are kept in two parallel arrays sorted by job. Job ids are strictly
/// increasing and every rank of a step usually completes the same jobs, so the common merge is
/// one slice comparison and one vectorisable addition of counts.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "OffloadMetaWire")]
pub struct OffloadMeta {
    /// Completed jobs, ascending, distinct.
    jobs: Vec<JobId>,
    /// `counts[i]` is the count of `jobs[i]`.
    counts: Vec<u32>,
    /// Completed jobs whose transfer failed, ascending, each one of `jobs`.
    failed: Vec<JobId>,
    /// Bytes moved.
    pub bytes: u64,
    /// Transfers performed.
    pub transfers: u64,
}

/// [`OffloadMeta`] as decoded, before its invariants are checked.
#[derive(serde::Deserialize)]
struct OffloadMetaWire {
    jobs: Vec<JobId>,
    counts: Vec<u32>,
    #[serde(default)]
    failed: Vec<JobId>,
    bytes: u64,
    transfers: u64,
}

impl TryFrom<OffloadMetaWire> for OffloadMeta {
    type Error = &'static str;

    /// Jobs strictly ascending (so distinct), one count per job: what `count`, `add` and
    /// `mark_completed` rely on.
    fn try_from(w: OffloadMetaWire) -> Result<Self, Self::Error> {
        if w.jobs.len() != w.counts.len() {
            return Err("offload metadata needs one count per job");
        }
        if w.jobs.windows(2).any(|p| p[0] >= p[1]) {
            return Err("offload metadata jobs must be strictly ascending");
        }
        if w.failed.windows(2).any(|p| p[0] >= p[1]) {
            return Err("offload metadata failed jobs must be strictly ascending");
        }
        if w.failed.iter().any(|j| w.jobs.binary_search(j).is_err()) {
            return Err("offload metadata failed jobs must be completed jobs");
        }
        Ok(Self {
            jobs: w.jobs,
            counts: w.counts,
            failed: w.failed,
            bytes: w.bytes,
            transfers: w.transfers,
        })
    }
}

/// How deep `multi` metadata may nest when it is decoded (a MultiConnector over
/// MultiConnectors is one level per composition).
pub const MAX_META_DEPTH: usize = 8;

impl<'de> serde::Deserialize<'de> for Meta {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::DeserializeSeed::deserialize(MetaSeed { depth: 0 }, d)
    }
}

/// Decodes a [`Meta`] at nesting `depth`.
struct MetaSeed {
    depth: usize,
}

/// The variant names of [`Meta`].
#[derive(serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum MetaForm {
    Offload,
    Set,
    Multi,
}

impl<'de> serde::de::DeserializeSeed<'de> for MetaSeed {
    type Value = Meta;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Meta, D::Error> {
        d.deserialize_enum("Meta", &["offload", "set", "multi"], self)
    }
}

impl<'de> serde::de::Visitor<'de> for MetaSeed {
    type Value = Meta;

    fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("worker metadata (offload, set or multi)")
    }

    fn visit_enum<A: serde::de::EnumAccess<'de>>(self, data: A) -> Result<Meta, A::Error> {
        use serde::de::{Error, VariantAccess};
        let (form, variant) = data.variant::<MetaForm>()?;
        match form {
            MetaForm::Offload => variant.newtype_variant().map(Meta::Offload),
            MetaForm::Set => variant.newtype_variant().map(Meta::Set),
            MetaForm::Multi if self.depth >= MAX_META_DEPTH => Err(A::Error::custom(
                alloc::format!("multi metadata nested deeper than {MAX_META_DEPTH}"),
            )),
            MetaForm::Multi => variant
                .newtype_variant_seed(SlotsSeed {
                    depth: self.depth + 1,
                })
                .map(Meta::Multi),
        }
    }
}

/// Decodes the slots of a `multi` value at nesting `depth`.
struct SlotsSeed {
    depth: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for SlotsSeed {
    type Value = Vec<Option<Meta>>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for SlotsSeed {
    type Value = Vec<Option<Meta>>;

    fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("a sequence of optional worker metadata")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // Bounded: a length prefix from the wire is not trusted for the capacity.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(slot) = seq.next_element_seed(SlotSeed { depth: self.depth })? {
            out.push(slot);
        }
        Ok(out)
    }
}

/// Decodes one `multi` slot (`null` or a [`Meta`]) at nesting `depth`.
struct SlotSeed {
    depth: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for SlotSeed {
    type Value = Option<Meta>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_option(self)
    }
}

impl<'de> serde::de::Visitor<'de> for SlotSeed {
    type Value = Option<Meta>;

    fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("null or worker metadata")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        serde::de::DeserializeSeed::deserialize(MetaSeed { depth: self.depth }, d).map(Some)
    }
}

impl OffloadMeta {
    /// Metadata with no completed job.
    pub fn new() -> Self {
        Self::default()
    }

    /// Metadata from `(job, count)` pairs in any order; counts of a repeated job add up.
    pub fn from_counts(counts: impl IntoIterator<Item = (JobId, u32)>) -> Self {
        let mut v: Vec<(JobId, u32)> = counts.into_iter().collect();
        v.sort_unstable_by_key(|&(j, _)| j);
        v.dedup_by(|later, earlier| {
            if later.0 == earlier.0 {
                earlier.1 = earlier.1.wrapping_add(later.1);
                true
            } else {
                false
            }
        });
        let (jobs, counts) = v.into_iter().unzip();
        Self {
            jobs,
            counts,
            failed: Vec::new(),
            bytes: 0,
            transfers: 0,
        }
    }

    /// Records that this rank's transfer of `job` failed ([`Mode::Strict`](crate::Mode::Strict)
    /// only): an acknowledgement (count 1) that says so.
    pub fn mark_failed(&mut self, job: JobId) {
        self.mark_completed(job);
        if let Err(at) = self.failed.binary_search(&job) {
            self.failed.insert(at, job);
        }
    }

    /// The completed jobs whose transfer failed on some rank, ascending.
    pub fn failed_jobs(&self) -> &[JobId] {
        &self.failed
    }

    /// Whether `job` failed on some rank.
    pub fn is_failed(&self, job: JobId) -> bool {
        self.failed.binary_search(&job).is_ok()
    }

    /// Records that this rank completed `job` (count 1, as `mark_completed` does).
    pub fn mark_completed(&mut self, job: JobId) {
        match self.jobs.binary_search(&job) {
            Ok(at) => self.counts[at] = 1,
            Err(at) => {
                self.jobs.insert(at, job);
                self.counts.insert(at, 1);
            }
        }
    }

    /// The completed jobs with their counts, ascending by job.
    pub fn completed_jobs(&self) -> impl ExactSizeIterator<Item = (JobId, u32)> + '_ {
        self.jobs.iter().copied().zip(self.counts.iter().copied())
    }

    /// Number of distinct completed jobs.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether no job is recorded.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The count of `job` (0 if absent).
    pub fn count(&self, job: JobId) -> u32 {
        self.jobs
            .binary_search(&job)
            .map_or(0, |at| self.counts[at])
    }

    /// Adds `other`'s counts and stats into `self` (cannot fail).
    pub fn add(&mut self, other: &OffloadMeta) {
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.transfers = self.transfers.saturating_add(other.transfers);
        if !other.failed.is_empty() {
            let mut failed: Vec<JobId> = self.failed.iter().chain(&other.failed).copied().collect();
            failed.sort_unstable();
            failed.dedup();
            self.failed = failed;
        }
        // Fast path: the same jobs on both sides (the common case): add the counts in place.
        // Counts add modulo 2^32 (wrapping keeps the addition vectorisable and the merge a
        // commutative monoid; a count is bounded by the number of ranks, far below 2^32).
        if self.jobs == other.jobs {
            for (x, y) in self.counts.iter_mut().zip(&other.counts) {
                *x = x.wrapping_add(*y);
            }
            return;
        }
        let n = self.jobs.len() + other.jobs.len();
        let (mut jobs, mut counts) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (a, ac, b, bc) = (&self.jobs, &self.counts, &other.jobs, &other.counts);
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                core::cmp::Ordering::Less => {
                    jobs.push(a[i]);
                    counts.push(ac[i]);
                    i += 1;
                }
                core::cmp::Ordering::Greater => {
                    jobs.push(b[j]);
                    counts.push(bc[j]);
                    j += 1;
                }
                core::cmp::Ordering::Equal => {
                    jobs.push(a[i]);
                    counts.push(ac[i].wrapping_add(bc[j]));
                    i += 1;
                    j += 1;
                }
            }
        }
        jobs.extend_from_slice(&a[i..]);
        counts.extend_from_slice(&ac[i..]);
        jobs.extend_from_slice(&b[j..]);
        counts.extend_from_slice(&bc[j..]);
        self.jobs = jobs;
        self.counts = counts;
    }
}

impl Meta {
    /// The form's name, as in conformance JSON.
    pub fn form(&self) -> &'static str {
        match self {
            Meta::Offload(_) => "offload",
            Meta::Set(_) => "set",
            Meta::Multi(_) => "multi",
        }
    }

    /// Whether `self ⊕ other` is defined, checked before anything is changed.
    fn check_mergeable(&self, other: &Meta) -> Result<(), MetaMismatch> {
        match (self, other) {
            (Meta::Offload(_), Meta::Offload(_)) | (Meta::Set(_), Meta::Set(_)) => Ok(()),
            (Meta::Multi(a), Meta::Multi(b)) => {
                if a.len() != b.len() {
                    return Err(MetaMismatch::MultiLength {
                        left: a.len(),
                        right: b.len(),
                    });
                }
                for (x, y) in a.iter().zip(b) {
                    if let (Some(x), Some(y)) = (x, y) {
                        x.check_mergeable(y)?;
                    }
                }
                Ok(())
            }
            _ => Err(MetaMismatch::Forms {
                left: self.form(),
                right: other.form(),
            }),
        }
    }

    /// `self ⊕ other` once [`Meta::check_mergeable`] passed.
    fn merge_checked(&mut self, other: &Meta) {
        match (self, other) {
            (Meta::Offload(a), Meta::Offload(b)) => a.add(b),
            (Meta::Set(a), Meta::Set(b)) => a.union_with(b),
            (Meta::Multi(a), Meta::Multi(b)) => {
                for (x, y) in a.iter_mut().zip(b) {
                    match (x.as_mut(), y) {
                        (_, None) => {}
                        (None, Some(y)) => *x = Some(y.clone()),
                        (Some(x), Some(y)) => x.merge_checked(y),
                    }
                }
            }
            // check_mergeable ran first and rejects every other pair of forms.
            _ => unreachable!("merge_checked called on unmergeable forms"),
        }
    }
}

impl WorkerMeta for Meta {
    fn merge_from(&mut self, other: &Self) -> Result<(), MetaMismatch> {
        self.check_mergeable(other)?;
        self.merge_checked(other);
        Ok(())
    }
}

/// The MultiConnector's `build_connector_worker_meta`: `None` if every child built `None`, else
/// a tuple with one slot per child (I-31: slot i holds only child i's object).
pub fn build_multi(children: Vec<Option<Meta>>) -> Option<Meta> {
    if children.iter().all(Option::is_none) {
        None
    } else {
        Some(Meta::Multi(children))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_meta_counts_distinct_jobs() {
        // Protects I-25's counting: an offload meta holds one entry per distinct job.
        let m = OffloadMeta::from_counts([(JobId(2), 1), (JobId(1), 1), (JobId(2), 1)]);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m.completed_jobs().collect::<Vec<_>>(),
            [(JobId(1), 1), (JobId(2), 2)]
        );
        assert_eq!(OffloadMeta::new().len(), 0);
    }

    #[test]
    fn offload_meta_count_reads_recorded_counts() {
        // Protects I-25: counts read back what was recorded (the merge law
        // `count(a + b) = count(a) + count(b)` alone also holds for a constant 0).
        let m = OffloadMeta::from_counts([(JobId(3), 1), (JobId(1), 2), (JobId(3), 1)]);
        assert_eq!(m.count(JobId(1)), 2);
        assert_eq!(m.count(JobId(3)), 2);
        assert_eq!(m.count(JobId(2)), 0, "an absent job counts 0");
        for (job, count) in m.completed_jobs() {
            assert_eq!(m.count(job), count);
        }
    }

    #[test]
    fn mismatched_forms_are_named_in_the_error() {
        // Protects the typed meta_mismatch error: it names both forms.
        let offload = Meta::Offload(OffloadMeta::new());
        let set = Meta::Set(SortedSet::default());
        let multi = Meta::Multi(alloc::vec![None]);
        assert_eq!(
            merge(Some(offload.clone()), Some(set.clone())),
            Err(MetaMismatch::Forms {
                left: "offload",
                right: "set"
            })
        );
        assert_eq!(
            merge(Some(multi), Some(offload)),
            Err(MetaMismatch::Forms {
                left: "multi",
                right: "offload"
            })
        );
    }
}
