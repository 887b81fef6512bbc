//! The executor-side fold of all ranks' connector outputs (vLLM's `KVOutputAggregator`,
//! SEMANTICS.md §4.1–§4.2, invariants I-21…I-27).
//!
//! Call [`Aggregator::aggregate`] once per executed step with every rank's output (index =
//! rank), after all ranks returned; hand the result to the scheduler's
//! `update_connector_output`. Call [`Aggregator::salvage`] with the outputs of a step in which
//! some rank failed: they are counted first at the next `aggregate`, without their KV events.
//!
//! A request id is emitted in `finished_sending` (`finished_recving`) in the call where the
//! number of reports since its last emission reaches the quorum — the "count cycle" of I-21.
//! The quorum starts at `get_finished_count() or world_size` and changes when an output carries
//! `expected_finished_count > 0`; the change affects only ids whose count has not started (I-26).
//!
//! Counting is dense: per direction an array indexed by [`RequestId::index`], so one report is
//! one array update (no hashing). Interned ids keep the arrays as small as the number of live
//! requests.

use alloc::vec::Vec;

use crate::Mode;
use crate::events::KvEvents;
use crate::ids::{BlockId, Rank, RequestId};
use crate::meta::{Meta, MetaMismatch, WorkerMeta};
use crate::output::{AggregatedOutput, SortedSet, WorkerOutput};

/// A transfer direction, as counted by the aggregator.
#[derive(
    Clone, Copy, Debug, Eq, Hash, Ord, PartialEq, PartialOrd, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// `finished_sending`: async send/save completions.
    Send,
    /// `finished_recving`: async recv/load completions.
    Recv,
}

/// Why an [`Aggregator`] call was rejected. A rejected call changes nothing.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
pub enum AggregateError {
    /// Strict mode: `rank` reported `request` in `direction` twice in one count cycle. vLLM would
    /// count both reports and emit the id before every rank finished.
    #[error("{rank} reported {request} as finished {direction:?} twice in one count cycle")]
    DuplicateReport {
        /// The reporting rank.
        rank: Rank,
        /// The request reported twice.
        request: RequestId,
        /// The direction of the report.
        direction: Direction,
    },
    /// The ranks' worker metadata cannot be folded.
    #[error(transparent)]
    MetaMismatch(#[from] MetaMismatch),
    /// `output_rank` is not an index of `outputs`.
    #[error("output rank {output_rank} is out of range for {ranks} outputs")]
    RankOutOfRange {
        /// The rank asked for.
        output_rank: Rank,
        /// The number of outputs given.
        ranks: usize,
    },
}

impl AggregateError {
    /// The snake_case error kind used by conformance cases.
    pub fn kind(&self) -> &'static str {
        match self {
            AggregateError::DuplicateReport { .. } => "duplicate_report",
            AggregateError::MetaMismatch(_) => "meta_mismatch",
            AggregateError::RankOutOfRange { .. } => "rank_out_of_range",
        }
    }
}

/// The count of one id in one direction: `target` reports are needed (the quorum when counting
/// started), `seen` arrived. `target == 0` means the id is not being counted.
#[derive(
    Clone, Copy, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize,
)]
struct Count {
    target: u32,
    seen: u32,
}

/// A set of ranks as a bitset (strict mode's per-id reporters).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct RankBits(Vec<u64>);

impl RankBits {
    fn contains(&self, r: Rank) -> bool {
        self.0
            .get(r.index() / 64)
            .is_some_and(|w| w & (1 << (r.index() % 64)) != 0)
    }
    fn insert(&mut self, r: Rank) {
        let w = r.index() / 64;
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << (r.index() % 64);
    }
    fn clear(&mut self) {
        self.0.iter_mut().for_each(|w| *w = 0);
    }
    fn len(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// The counters of one direction.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Tally {
    /// Indexed by request id.
    counts: Vec<Count>,
    /// Ids with `target > 0`.
    live: u32,
    /// Strict mode only, indexed by request id: the ranks that reported in the current cycle.
    reporters: Vec<RankBits>,
}

/// What to restore if a strict-mode call is rejected part-way.
#[derive(Debug)]
struct Undo {
    direction: Direction,
    id: RequestId,
    count: Count,
    reporters: RankBits,
}

impl Tally {
    fn ensure(&mut self, id: RequestId, strict: bool) {
        if id.index() >= self.counts.len() {
            self.counts.resize(id.index() + 1, Count::default());
        }
        if strict && id.index() >= self.reporters.len() {
            self.reporters.resize(id.index() + 1, RankBits::default());
        }
    }

    /// Counts compat-mode reports of `ids`; pushes the ids whose cycle completes to `emitted`.
    #[inline]
    fn count_compat(&mut self, ids: &[RequestId], quorum: u32, emitted: &mut Vec<RequestId>) {
        for &id in ids {
            if id.index() >= self.counts.len() {
                self.ensure(id, false);
            }
            let c = &mut self.counts[id.index()];
            if c.target == 0 {
                c.target = quorum;
                self.live += 1;
            }
            c.seen += 1;
            if c.seen == c.target {
                *c = Count::default();
                self.live -= 1;
                emitted.push(id);
            }
        }
    }

    /// Counts strict-mode reports of `ids` by `rank`, logging the prior state of every touched
    /// id to `undo`. A rank already among an id's reporters is a duplicate.
    fn count_strict(
        &mut self,
        direction: Direction,
        rank: Rank,
        ids: &[RequestId],
        quorum: u32,
        emitted: &mut Vec<RequestId>,
        undo: &mut Vec<Undo>,
    ) -> Result<(), AggregateError> {
        for &id in ids {
            self.ensure(id, true);
            let i = id.index();
            if self.reporters[i].contains(rank) {
                return Err(AggregateError::DuplicateReport {
                    rank,
                    request: id,
                    direction,
                });
            }
            undo.push(Undo {
                direction,
                id,
                count: self.counts[i],
                reporters: self.reporters[i].clone(),
            });
            let c = &mut self.counts[i];
            if c.target == 0 {
                c.target = quorum;
                self.live += 1;
            }
            c.seen += 1;
            if c.seen == c.target {
                *c = Count::default();
                self.live -= 1;
                self.reporters[i].clear();
                emitted.push(id);
            } else {
                self.reporters[i].insert(rank);
            }
        }
        Ok(())
    }

    fn restore(&mut self, u: Undo) {
        let i = u.id.index();
        let was_live = self.counts[i].target != 0;
        let will_be_live = u.count.target != 0;
        match (was_live, will_be_live) {
            (true, false) => self.live -= 1,
            (false, true) => self.live += 1,
            _ => {}
        }
        self.counts[i] = u.count;
        self.reporters[i] = u.reporters;
    }

    fn pending(&self, id: RequestId) -> Option<(u32, u32)> {
        self.counts
            .get(id.index())
            .filter(|c| c.target != 0)
            .map(|c| (c.seen, c.target))
    }
}

/// The executor-side aggregator of all ranks' connector outputs (one per engine).
///
/// Generic over the worker-metadata type `M` ([`Meta`] by default), so an engine with its own
/// metadata aggregates it the same way.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(bound(
    serialize = "M: serde::Serialize",
    deserialize = "M: serde::Deserialize<'de>"
))]
pub struct Aggregator<M = Meta> {
    mode: Mode,
    quorum: u32,
    send: Tally,
    recv: Tally,
    /// Indexed by request id: reported in some `failed_recving`, not yet emitted.
    failed_pending: Vec<bool>,
    failed_pending_len: u32,
    /// Outputs of failed steps, with the rank that produced them, counted first next time.
    salvaged: Vec<(Rank, WorkerOutput<M>)>,
}

impl<M: WorkerMeta> Aggregator<M> {
    /// An aggregator needing `quorum` reports per id (`get_finished_count() or world_size`).
    ///
    /// # Panics
    /// If `quorum` is 0: a quorum of zero reports is meaningless and would emit nothing ever.
    pub fn new(quorum: u32, mode: Mode) -> Self {
        assert!(quorum >= 1, "aggregator quorum must be at least 1");
        Self {
            mode,
            quorum,
            send: Tally::default(),
            recv: Tally::default(),
            failed_pending: Vec::new(),
            failed_pending_len: 0,
            salvaged: Vec::new(),
        }
    }

    /// Like [`Aggregator::new`], with the dense tables pre-sized for ids `0..requests`.
    pub fn with_capacity(quorum: u32, mode: Mode, requests: usize) -> Self {
        let mut a = Self::new(quorum, mode);
        if let Some(last) = requests.checked_sub(1) {
            let id = RequestId(u32::try_from(last).unwrap_or(u32::MAX));
            let strict = mode == Mode::Strict;
            a.send.ensure(id, strict);
            a.recv.ensure(id, strict);
            a.failed_pending.resize(requests, false);
        }
        a
    }

    /// The quorum in force.
    pub fn quorum(&self) -> u32 {
        self.quorum
    }

    /// The mode this aggregator runs in.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// `(reports seen, reports needed)` of `id`'s current count cycle, if one is open.
    pub fn pending(&self, direction: Direction, id: RequestId) -> Option<(u32, u32)> {
        match direction {
            Direction::Send => self.send.pending(id),
            Direction::Recv => self.recv.pending(id),
        }
    }

    /// Whether the aggregator holds no state for `id`: no open count, no pending failure. Only
    /// then may the id be released for reuse.
    pub fn is_idle(&self, id: RequestId) -> bool {
        self.send.pending(id).is_none()
            && self.recv.pending(id).is_none()
            && !self
                .failed_pending
                .get(id.index())
                .copied()
                .unwrap_or(false)
    }

    /// Number of salvaged outputs waiting for the next [`Aggregator::aggregate`].
    pub fn salvaged_len(&self) -> usize {
        self.salvaged.len()
    }

    /// Stashes the outputs (index = rank) of a step in which some rank failed; they are counted
    /// first at the next `aggregate`. Their KV events are dropped (replaying them could break the
    /// live ranks' event quorum). `None` entries are skipped.
    pub fn salvage(&mut self, outputs: Vec<Option<WorkerOutput<M>>>) {
        for (rank, output) in outputs.into_iter().enumerate() {
            if let Some(mut output) = output {
                output.kv_events = None;
                self.salvaged.push((rank_of(rank), output));
            }
        }
    }

    /// Folds one step's outputs (index = rank; `None` = that rank produced no connector output).
    ///
    /// Returns `Ok(None)` without consuming anything when `outputs[output_rank]` is `None` (the
    /// `execute_model` phase of async scheduling, I-27). On error nothing changes.
    pub fn aggregate(
        &mut self,
        outputs: &[Option<WorkerOutput<M>>],
        output_rank: Rank,
    ) -> Result<Option<AggregatedOutput<M>>, AggregateError> {
        match outputs.get(output_rank.index()) {
            None => {
                return Err(AggregateError::RankOutOfRange {
                    output_rank,
                    ranks: outputs.len(),
                });
            }
            Some(None) => return Ok(None),
            Some(Some(_)) => {}
        }
        let salvaged = core::mem::take(&mut self.salvaged);
        let result = self.fold(&salvaged, outputs);
        if result.is_err() {
            self.salvaged = salvaged;
        }
        result.map(Some)
    }

    fn fold(
        &mut self,
        salvaged: &[(Rank, WorkerOutput<M>)],
        outputs: &[Option<WorkerOutput<M>>],
    ) -> Result<AggregatedOutput<M>, AggregateError> {
        let sources = || {
            salvaged.iter().map(|(r, o)| (*r, o)).chain(
                outputs
                    .iter()
                    .enumerate()
                    .filter_map(|(r, o)| o.as_ref().map(|o| (rank_of(r), o))),
            )
        };

        // Worker metadata first: it is pure, so a mismatch rejects the call before any counter
        // moves.
        let mut worker_meta: Option<M> = None;
        for (_, o) in sources() {
            if let Some(m) = &o.worker_meta {
                match &mut worker_meta {
                    None => worker_meta = Some(m.clone()),
                    Some(acc) => acc.merge_from(m)?,
                }
            }
        }

        let mut quorum = self.quorum;
        let mut sent = Vec::new();
        let mut recvd = Vec::new();
        let mut invalid: Vec<BlockId> = Vec::new();
        let mut kv_events: Option<KvEvents> = None;
        match self.mode {
            Mode::Compat => {
                for (_, o) in sources() {
                    if o.expected_finished_count > 0 {
                        quorum = o.expected_finished_count;
                    }
                    if let Some(ids) = &o.finished_sending {
                        self.send.count_compat(ids.as_slice(), quorum, &mut sent);
                    }
                    if let Some(ids) = &o.finished_recving {
                        self.recv.count_compat(ids.as_slice(), quorum, &mut recvd);
                    }
                }
            }
            Mode::Strict => {
                let mut undo = Vec::new();
                let mut counted = || -> Result<(), AggregateError> {
                    for (rank, o) in sources() {
                        if o.expected_finished_count > 0 {
                            quorum = o.expected_finished_count;
                        }
                        if let Some(ids) = &o.finished_sending {
                            self.send.count_strict(
                                Direction::Send,
                                rank,
                                ids.as_slice(),
                                quorum,
                                &mut sent,
                                &mut undo,
                            )?;
                        }
                        if let Some(ids) = &o.finished_recving {
                            self.recv.count_strict(
                                Direction::Recv,
                                rank,
                                ids.as_slice(),
                                quorum,
                                &mut recvd,
                                &mut undo,
                            )?;
                        }
                    }
                    Ok(())
                };
                if let Err(e) = counted() {
                    while let Some(u) = undo.pop() {
                        match u.direction {
                            Direction::Send => self.send.restore(u),
                            Direction::Recv => self.recv.restore(u),
                        }
                    }
                    return Err(e);
                }
            }
        }

        // Nothing below can fail: commit.
        self.quorum = quorum;
        for (_, o) in sources() {
            if let Some(ev) = &o.kv_events {
                match &mut kv_events {
                    None => kv_events = Some(ev.clone()),
                    Some(acc) => {
                        acc.events.extend(ev.events.iter().cloned());
                        acc.workers = acc.workers.saturating_add(1);
                    }
                }
            }
            invalid.extend_from_slice(o.invalid_block_ids.as_slice());
            for &id in &o.failed_recving {
                if id.index() >= self.failed_pending.len() {
                    self.failed_pending.resize(id.index() + 1, false);
                }
                if !self.failed_pending[id.index()] {
                    self.failed_pending[id.index()] = true;
                    self.failed_pending_len += 1;
                }
            }
        }
        let mut failed = Vec::new();
        for &id in &recvd {
            if let Some(p) = self.failed_pending.get_mut(id.index())
                && *p
            {
                *p = false;
                self.failed_pending_len -= 1;
                failed.push(id);
            }
        }

        let as_set = |v: Vec<RequestId>| (!v.is_empty()).then(|| SortedSet::from_vec(v));
        Ok(AggregatedOutput {
            finished_sending: as_set(sent),
            finished_recving: as_set(recvd),
            invalid_block_ids: SortedSet::from_vec(invalid),
            failed_recving: SortedSet::from_vec(failed),
            worker_meta,
            kv_events,
            expected_finished_count: quorum,
        })
    }

    /// Checks I-21 (every open count is strictly between 0 and its target; in strict mode its
    /// reports come from distinct ranks), I-26 (the quorum is positive) and the salvage rule of
    /// §2.6 (salvaged outputs carry no KV events).
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        ensure_invariant!(self.quorum >= 1, "I-26", "quorum is {}", self.quorum);
        for (direction, tally) in [(Direction::Send, &self.send), (Direction::Recv, &self.recv)] {
            let mut live = 0;
            for (i, c) in tally.counts.iter().enumerate() {
                if c.target == 0 {
                    ensure_invariant!(
                        c.seen == 0,
                        "I-21",
                        "{direction:?} id {i}: {} reports counted without an open cycle",
                        c.seen
                    );
                } else {
                    live += 1;
                    ensure_invariant!(
                        c.seen >= 1 && c.seen < c.target,
                        "I-21",
                        "{direction:?} id {i}: open cycle at {}/{} (emission is due at the target)",
                        c.seen,
                        c.target
                    );
                }
                if self.mode == Mode::Strict {
                    let reporters = tally.reporters.get(i).map_or(0, RankBits::len);
                    ensure_invariant!(
                        reporters == c.seen,
                        "I-21",
                        "strict {direction:?} id {i}: {} reports from {reporters} distinct ranks",
                        c.seen
                    );
                }
            }
            ensure_invariant!(
                live == tally.live,
                "I-21",
                "{direction:?}: {live} open cycles, {} recorded",
                tally.live
            );
        }
        let failed = self.failed_pending.iter().filter(|&&p| p).count();
        ensure_invariant!(
            failed == self.failed_pending_len as usize,
            "I-24",
            "{failed} pending failures, {} recorded",
            self.failed_pending_len
        );
        ensure_invariant!(
            self.salvaged.iter().all(|(_, o)| o.kv_events.is_none()),
            "I-23",
            "a salvaged output still carries KV events"
        );
        Ok(())
    }
}

fn rank_of(index: usize) -> Rank {
    // Ranks index a slice of outputs, so they fit u32 on every supported world size.
    Rank(u32::try_from(index).expect("more than u32::MAX ranks"))
}
