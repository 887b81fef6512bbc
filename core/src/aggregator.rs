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

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::Mode;
use crate::ids::{BlockId, Rank, RequestId};
use crate::messages::AggregatedOutput;
use crate::messages::Direction;
use crate::messages::KvEvents;
use crate::messages::Meta;
use crate::messages::MetaMismatch;
use crate::messages::WorkerMeta;
use crate::messages::WorkerOutput;
use crate::sorted_set::SortedSet;

/// Why an [`Aggregator`] call was rejected. A rejected call changes nothing.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
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

/// A dense table indexed by request id whose equality and hash ignore trailing default
/// entries: how far the table has grown is capacity, not state. (Two aggregators that saw the
/// same reports are equal even if one of them was pre-sized; the model checker relies on it.)
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
struct Dense<T>(Vec<T>);

impl<T: Default + PartialEq> Dense<T> {
    fn live(&self) -> &[T] {
        let default = T::default();
        let end = self
            .0
            .iter()
            .rposition(|x| *x != default)
            .map_or(0, |i| i + 1);
        &self.0[..end]
    }
}

impl<T: Default + PartialEq> PartialEq for Dense<T> {
    fn eq(&self, other: &Self) -> bool {
        self.live() == other.live()
    }
}

impl<T: Default + Eq> Eq for Dense<T> {}

impl<T: Default + PartialEq + core::hash::Hash> core::hash::Hash for Dense<T> {
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        self.live().hash(state);
    }
}

impl<T> core::ops::Deref for Dense<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T> core::ops::DerefMut for Dense<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

/// A set of ranks as a bitset (one id's reporters, as [`Tally`] stores them apart: the low
/// word dense, the high words sparse): ranks 0..64 in `low`, higher ranks in `high` (empty
/// when there is none).
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
struct RankBits {
    low: u64,
    high: Vec<u64>,
}

impl RankBits {
    fn contains(&self, r: Rank) -> bool {
        let (w, bit) = (r.index() / 64, 1u64 << (r.index() % 64));
        if w == 0 {
            self.low & bit != 0
        } else {
            self.high.get(w - 1).is_some_and(|x| x & bit != 0)
        }
    }
    fn insert(&mut self, r: Rank) {
        let (w, bit) = (r.index() / 64, 1u64 << (r.index() % 64));
        if w == 0 {
            self.low |= bit;
        } else {
            if self.high.len() < w {
                self.high.resize(w, 0);
            }
            self.high[w - 1] |= bit;
        }
    }
    fn len(&self) -> u32 {
        self.low.count_ones() + self.high.iter().map(|w| w.count_ones()).sum::<u32>()
    }
}

/// The counters of one direction, dense by request id.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
struct Tally {
    /// Reports still needed to close the id's count cycle; 0 = no cycle open (vLLM's
    /// `_send_remaining_count` / `_recv_remaining_count`, with "absent" as 0).
    remaining: Dense<u32>,
    /// Strict mode only: the ranks below 64 that reported in the current cycle, a bit each
    /// (dense: the hot path touches one word per report).
    low: Dense<u64>,
    /// Strict mode only: the ranks from 64 up that reported in the current cycle, words per id
    /// (sparse: only ids such ranks reported; an id without any is absent).
    high: BTreeMap<usize, Vec<u64>>,
    /// Strict mode only: touched by the call in progress (all false between calls).
    touched: Dense<bool>,
    /// Strict mode only: ids with an open cycle (`remaining` ≠ 0, so with reporters). While it
    /// is 0 in both directions, a call without salvaged outputs cannot hold a duplicate report.
    open: u32,
}

/// Counts one report against an id's `remaining` reports (0 = no cycle open: one starts with
/// `quorum`); returns whether this report closed the cycle, i.e. the id is emitted now.
#[inline]
fn tick(remaining: &mut u32, quorum: u32) -> bool {
    let left = if *remaining == 0 { quorum } else { *remaining } - 1;
    *remaining = left;
    left == 0
}

/// How a call counts reports.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
enum Counting {
    Compat,
    Strict,
}

/// The state of one (direction, id) before a strict-mode call first touched it.
#[derive(Debug)]
struct Undo {
    direction: Direction,
    id: RequestId,
    remaining: u32,
    reporters: RankBits,
}

impl Tally {
    /// Makes room for ids up to `max`.
    fn ensure(&mut self, max: RequestId, strict: bool) {
        if max.index() >= self.remaining.len() {
            self.remaining.resize(max.index() + 1, 0);
        }
        if strict && max.index() >= self.low.len() {
            self.low.resize(max.index() + 1, 0);
            self.touched.resize(max.index() + 1, false);
        }
    }

    /// The ranks that reported id `i` in its current cycle.
    fn reporters(&self, i: usize) -> RankBits {
        RankBits {
            low: self.low.get(i).copied().unwrap_or(0),
            high: self.high.get(&i).cloned().unwrap_or_default(),
        }
    }

    /// Sets the ranks that reported id `i` (a room for `i` was ensured).
    fn set_reporters(&mut self, i: usize, r: RankBits) {
        self.low[i] = r.low;
        if r.high.is_empty() {
            self.high.remove(&i);
        } else {
            self.high.insert(i, r.high);
        }
    }

    fn has_reporter(&self, i: usize, rank: Rank) -> bool {
        if rank.index() < 64 {
            self.low[i] & (1u64 << rank.index()) != 0
        } else {
            self.reporters(i).contains(rank)
        }
    }

    fn add_reporter(&mut self, i: usize, rank: Rank) {
        if rank.index() < 64 {
            self.low[i] |= 1u64 << rank.index();
        } else {
            let mut r = self.reporters(i);
            r.insert(rank);
            self.set_reporters(i, r);
        }
    }

    fn clear_reporters(&mut self, i: usize) {
        self.low[i] = 0;
        if !self.high.is_empty() {
            self.high.remove(&i);
        }
    }

    /// Counts `rank`'s reports of `ids` (sorted), pushing the ids whose cycle completes to
    /// `emitted`: compat mode; strict mode with `undo` (a duplicate is possible and rolls the
    /// call back), or strict mode on a call that cannot hold a duplicate (`Unlogged`).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn count(
        &mut self,
        how: Counting,
        direction: Direction,
        rank: Rank,
        ids: &[RequestId],
        quorum: u32,
        emitted: &mut Vec<RequestId>,
        undo: Option<&mut Vec<Undo>>,
    ) -> Result<(), AggregateError> {
        match (how, undo) {
            (Counting::Compat, _) => {
                self.count_compat(ids, quorum, emitted);
                Ok(())
            }
            (Counting::Strict, Some(undo)) => {
                self.count_strict(direction, rank, ids, quorum, emitted, undo)
            }
            (Counting::Strict, None) => {
                self.count_strict_unlogged(rank, ids, quorum, emitted);
                Ok(())
            }
        }
    }

    /// Strict-mode counting of a call that holds no duplicate (checked before: see
    /// [`Aggregator::fold`]): the reporters are kept, nothing is logged for a rollback, and
    /// `open` is left to [`Tally::settle_open`] at the end of the call.
    #[inline]
    fn count_strict_unlogged(
        &mut self,
        rank: Rank,
        ids: &[RequestId],
        quorum: u32,
        emitted: &mut Vec<RequestId>,
    ) {
        let Some(&max) = ids.last() else { return };
        self.ensure(max, true);
        // `open` is settled once for the whole call (`settle_open`): counted here it would see
        // cycles an earlier rank of the same call opened without counting them, and underflow.
        if rank.index() < 64 && self.high.is_empty() {
            // The common case: one word per report, in two dense arrays.
            let bit = 1u64 << rank.index();
            let (remaining, low) = (&mut self.remaining[..], &mut self.low[..]);
            for &id in ids {
                let i = id.index();
                if tick(&mut remaining[i], quorum) {
                    low[i] = 0;
                    emitted.push(id);
                } else {
                    low[i] |= bit;
                }
            }
        } else {
            for &id in ids {
                let i = id.index();
                if tick(&mut self.remaining[i], quorum) {
                    self.clear_reporters(i);
                    emitted.push(id);
                } else {
                    self.add_reporter(i, rank);
                }
            }
        }
    }

    /// Counts compat-mode reports of `ids` (sorted); pushes the ids whose cycle completes to
    /// `emitted`. This is the hot path: one array update per report.
    #[inline]
    fn count_compat(&mut self, ids: &[RequestId], quorum: u32, emitted: &mut Vec<RequestId>) {
        let Some(&max) = ids.last() else { return };
        self.ensure(max, false);
        let remaining = &mut self.remaining[..];
        for &id in ids {
            if tick(&mut remaining[id.index()], quorum) {
                emitted.push(id);
            }
        }
    }

    /// Counts strict-mode reports of `ids` by `rank`. The first touch of each id in this call is
    /// logged to `undo` (`touched` marks it), so a rejected call can be rolled back exactly;
    /// [`Tally::untouch`] resets the marks when the call ends either way.
    fn count_strict(
        &mut self,
        direction: Direction,
        rank: Rank,
        ids: &[RequestId],
        quorum: u32,
        emitted: &mut Vec<RequestId>,
        undo: &mut Vec<Undo>,
    ) -> Result<(), AggregateError> {
        let Some(&max) = ids.last() else {
            return Ok(());
        };
        self.ensure(max, true);
        for &id in ids {
            let i = id.index();
            if self.has_reporter(i, rank) {
                return Err(AggregateError::DuplicateReport {
                    rank,
                    request: id,
                    direction,
                });
            }
            if !self.touched[i] {
                self.touched[i] = true;
                undo.push(Undo {
                    direction,
                    id,
                    remaining: self.remaining[i],
                    reporters: self.reporters(i),
                });
            }
            let was_open = self.remaining[i] != 0;
            if tick(&mut self.remaining[i], quorum) {
                self.clear_reporters(i);
                self.open -= u32::from(was_open);
                emitted.push(id);
            } else {
                self.add_reporter(i, rank);
                self.open += u32::from(!was_open);
            }
        }
        Ok(())
    }

    /// Sets `open` after a call counted without a log (no cycle was open before it): `reports`
    /// reports were counted and `emitted` ids emitted, under one `quorum` for the whole call
    /// if `steady`. Each emission closed a cycle of exactly `quorum` of the reports, so when
    /// they account for every report no cycle is left open — the steady state, settled in
    /// O(1); otherwise the open cycles are counted.
    fn settle_open(&mut self, reports: usize, emitted: usize, quorum: u32, steady: bool) {
        self.open = if steady && reports == emitted * quorum as usize {
            0
        } else {
            self.remaining.iter().filter(|&&r| r != 0).count() as u32
        };
    }

    fn restore(&mut self, u: Undo) {
        let (was, restored) = (self.remaining[u.id.index()] != 0, u.remaining != 0);
        self.open = self.open + u32::from(restored) - u32::from(was);
        self.remaining[u.id.index()] = u.remaining;
        self.set_reporters(u.id.index(), u.reporters);
    }

    fn untouch(&mut self, id: RequestId) {
        self.touched[id.index()] = false;
    }

    fn remaining(&self, id: RequestId) -> Option<u32> {
        self.remaining.get(id.index()).copied().filter(|&r| r != 0)
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
    /// The largest quorum ever in force: no open cycle needs more reports (I-26).
    quorum_high: u32,
    send: Tally,
    recv: Tally,
    /// Indexed by request id: reported in some `failed_recving`, not yet emitted.
    failed_pending: Dense<bool>,
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
            quorum_high: quorum,
            send: Tally::default(),
            recv: Tally::default(),
            failed_pending: Dense::default(),
            failed_pending_len: 0,
            salvaged: Vec::new(),
        }
    }

    /// vLLM's `init_kv_output_aggregator(connector)`, called once when the executor starts: the
    /// quorum is the scheduler connector's `get_finished_count()` answer or, when that is `None`
    /// or 0 (Python's `or`), the world size.
    ///
    /// # Panics
    /// If the resulting quorum is 0 (`world_size` 0 with no override), as [`Aggregator::new`].
    pub fn for_connector<C>(connector: &C, world_size: u32, mode: Mode) -> Self
    where
        C: crate::SchedulerConnector<WorkerMeta = M> + ?Sized,
    {
        let quorum = match connector.get_finished_count() {
            Some(n) if n > 0 => n,
            _ => world_size,
        };
        Self::new(quorum, mode)
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

    /// The reports `id` still needs to close its current count cycle, if one is open.
    pub fn remaining(&self, direction: Direction, id: RequestId) -> Option<u32> {
        match direction {
            Direction::Send => self.send.remaining(id),
            Direction::Recv => self.recv.remaining(id),
        }
    }

    /// Whether the aggregator holds no state for `id`: no open count, no pending failure. Only
    /// then may the id be released for reuse.
    pub fn is_idle(&self, id: RequestId) -> bool {
        self.send.remaining(id).is_none()
            && self.recv.remaining(id).is_none()
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
        self.salvage_unchecked(outputs);
        crate::debug_assert_invariants!(self);
    }

    fn salvage_unchecked(&mut self, outputs: Vec<Option<WorkerOutput<M>>>) {
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
        let out = self.aggregate_unchecked(outputs, output_rank);
        crate::debug_assert_invariants!(self);
        out
    }

    fn aggregate_unchecked(
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
        // Typically every rank reports the same ids: size the emissions by the largest set.
        let largest = |f: fn(&WorkerOutput<M>) -> &Option<SortedSet<RequestId>>| {
            sources()
                .filter_map(|(_, o)| f(o).as_ref().map(SortedSet::len))
                .max()
                .unwrap_or(0)
        };
        let mut sent = Vec::with_capacity(largest(|o| &o.finished_sending));
        let mut recvd = Vec::with_capacity(largest(|o| &o.finished_recving));
        let mut invalid: Vec<BlockId> = Vec::new();
        let mut kv_events: Option<KvEvents> = None;
        // Strict mode logs what each call first touches, so a duplicate can be rolled back —
        // unless the call cannot hold one: no salvaged output (so every rank reports each id
        // at most once in the call) and no cycle open before it (so no rank is already among
        // any id's reporters). Then counting needs no log: the steady state of ranks that
        // report together, where strict costs little more than compat.
        let how = match self.mode {
            Mode::Compat => Counting::Compat,
            Mode::Strict => Counting::Strict,
        };
        let clean = salvaged.is_empty() && self.send.open == 0 && self.recv.open == 0;
        let mut undo = (how == Counting::Strict && !clean).then(Vec::new);
        let mut counted = || -> Result<(), AggregateError> {
            for (rank, o) in sources() {
                if o.expected_finished_count > 0 {
                    quorum = o.expected_finished_count;
                }
                if let Some(ids) = &o.finished_sending {
                    let (d, t) = (Direction::Send, &mut self.send);
                    t.count(
                        how,
                        d,
                        rank,
                        ids.as_slice(),
                        quorum,
                        &mut sent,
                        undo.as_mut(),
                    )?;
                }
                if let Some(ids) = &o.finished_recving {
                    let (d, t) = (Direction::Recv, &mut self.recv);
                    t.count(
                        how,
                        d,
                        rank,
                        ids.as_slice(),
                        quorum,
                        &mut recvd,
                        undo.as_mut(),
                    )?;
                }
            }
            Ok(())
        };
        let quorum_before = self.quorum;
        let result = counted();
        if result.is_ok() && how == Counting::Strict && undo.is_none() {
            // Unlogged strict counting leaves `open` to be settled here.
            let steady = sources().all(|(_, o)| {
                o.expected_finished_count == 0 || o.expected_finished_count == quorum_before
            });
            let reports = |f: fn(&WorkerOutput<M>) -> &Option<SortedSet<RequestId>>| {
                sources()
                    .filter_map(|(_, o)| f(o).as_ref().map(SortedSet::len))
                    .sum::<usize>()
            };
            let (rs, rr) = (
                reports(|o| &o.finished_sending),
                reports(|o| &o.finished_recving),
            );
            self.send.settle_open(rs, sent.len(), quorum_before, steady);
            self.recv
                .settle_open(rr, recvd.len(), quorum_before, steady);
        }
        for u in undo.into_iter().flatten() {
            let tally = match u.direction {
                Direction::Send => &mut self.send,
                Direction::Recv => &mut self.recv,
            };
            tally.untouch(u.id);
            if result.is_err() {
                tally.restore(u);
            }
        }
        result?;

        // Nothing below can fail: commit.
        self.quorum = quorum;
        let call_high = sources()
            .map(|(_, o)| o.expected_finished_count)
            .max()
            .unwrap_or(0);
        self.quorum_high = self.quorum_high.max(call_high);
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

    /// Checks I-21 (an open cycle still needs between 1 and quorum−1 reports — emission is due
    /// at 0; in strict mode its reports came from distinct ranks), I-26 (the quorum is positive,
    /// and no cycle needs more reports than any quorum ever in force) and the salvage rule of
    /// §2.6 (salvaged outputs carry no KV events).
    pub fn check_invariants(&self) -> Result<(), crate::InvariantViolation> {
        use crate::ensure_invariant;
        ensure_invariant!(self.quorum >= 1, "I-26", "quorum is {}", self.quorum);
        ensure_invariant!(
            self.quorum_high >= self.quorum,
            "I-26",
            "quorum {} above the recorded high {}",
            self.quorum,
            self.quorum_high
        );
        for (direction, tally) in [(Direction::Send, &self.send), (Direction::Recv, &self.recv)] {
            let open = tally.remaining.iter().filter(|&&r| r != 0).count();
            let counted = if self.mode == Mode::Strict {
                tally.open as usize
            } else {
                0
            };
            ensure_invariant!(
                open == counted || self.mode == Mode::Compat,
                "I-21",
                "strict {direction:?}: {open} open cycles, {counted} counted"
            );
            for (i, &r) in tally.remaining.iter().enumerate() {
                ensure_invariant!(
                    r < self.quorum_high,
                    "I-21",
                    "{direction:?} id {i}: needs {r} more reports, above any quorum ({})",
                    self.quorum_high
                );
                if self.mode == Mode::Strict {
                    let reporters = tally.reporters(i).len();
                    ensure_invariant!(
                        (r == 0) == (reporters == 0),
                        "I-21",
                        "strict {direction:?} id {i}: {reporters} reporters with {r} reports to go"
                    );
                }
            }
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

#[cfg(test)]
mod tests {
    use alloc::vec;
    use alloc::vec::Vec;

    use super::*;

    fn ids(xs: &[u32]) -> SortedSet<RequestId> {
        xs.iter().copied().map(RequestId).collect()
    }

    fn sending(xs: &[u32]) -> Option<WorkerOutput> {
        Some(WorkerOutput {
            finished_sending: Some(ids(xs)),
            ..WorkerOutput::default()
        })
    }

    #[test]
    fn strict_duplicate_rolls_back_every_counter_and_keeps_the_salvage() {
        let mut a: Aggregator = Aggregator::new(3, Mode::Strict);
        a.aggregate(&[sending(&[1, 2]), sending(&[2]), None], Rank(0))
            .unwrap();
        a.salvage(vec![None, None, sending(&[1])]);
        let before = a.clone();
        // Rank 2's salvaged report of 1 plus ranks 0 and 1 would close 1's cycle; rank 0 then
        // repeats 2 in the same cycle.
        let err = a
            .aggregate(
                &[sending(&[2, 3]), sending(&[1, 3]), sending(&[3])],
                Rank(0),
            )
            .unwrap_err();
        assert_eq!(
            err,
            AggregateError::DuplicateReport {
                rank: Rank(0),
                request: RequestId(2),
                direction: Direction::Send
            }
        );
        assert_eq!(a, before, "a rejected call changes nothing");
        a.check_invariants().unwrap();
        let out = a.aggregate(&[sending(&[3]), sending(&[1, 3]), sending(&[3])], Rank(0));
        let out = out.unwrap().unwrap();
        assert_eq!(out.finished_sending, Some(ids(&[1, 3])));
        assert_eq!(a.salvaged_len(), 0);
        a.check_invariants().unwrap();
    }

    #[test]
    fn strict_mode_tracks_ranks_beyond_64() {
        let mut a: Aggregator = Aggregator::new(2, Mode::Strict);
        let mut outputs: Vec<Option<WorkerOutput>> = vec![Some(WorkerOutput::default()); 71];
        outputs[70] = sending(&[5]);
        a.aggregate(&outputs, Rank(0)).unwrap();
        assert_eq!(a.remaining(Direction::Send, RequestId(5)), Some(1));
        let err = a.aggregate(&outputs, Rank(0)).unwrap_err();
        assert_eq!(err.kind(), "duplicate_report");
        outputs[70] = None;
        outputs[64] = sending(&[5]);
        let out = a.aggregate(&outputs, Rank(0)).unwrap().unwrap();
        assert_eq!(out.finished_sending, Some(ids(&[5])));
        assert!(a.is_idle(RequestId(5)));
        a.check_invariants().unwrap();
    }

    #[test]
    fn quorum_changes_within_one_call_keep_the_invariants() {
        let mut a: Aggregator = Aggregator::new(2, Mode::Compat);
        let raise = Some(WorkerOutput {
            expected_finished_count: 5,
            finished_recving: Some(ids(&[7])),
            ..WorkerOutput::default()
        });
        let lower = Some(WorkerOutput {
            expected_finished_count: 3,
            ..WorkerOutput::default()
        });
        let out = a.aggregate(&[raise, lower], Rank(0)).unwrap().unwrap();
        assert_eq!(out.expected_finished_count, 3);
        // 7 started counting under quorum 5 and keeps needing 4 more reports (I-26).
        assert_eq!(a.remaining(Direction::Recv, RequestId(7)), Some(4));
        a.check_invariants().unwrap();
    }

    #[test]
    fn an_absent_output_rank_consumes_nothing_and_a_bad_one_is_an_error() {
        let mut a: Aggregator = Aggregator::new(1, Mode::Compat);
        a.salvage(vec![sending(&[1])]);
        assert_eq!(a.aggregate(&[None, sending(&[2])], Rank(0)), Ok(None));
        assert_eq!(a.salvaged_len(), 1);
        assert!(a.is_idle(RequestId(2)));
        let err = a.aggregate(&[sending(&[2])], Rank(1)).unwrap_err();
        assert_eq!(
            err,
            AggregateError::RankOutOfRange {
                output_rank: Rank(1),
                ranks: 1
            }
        );
        assert_eq!(a.salvaged_len(), 1);
    }

    #[test]
    fn connector_finished_count_overrides_the_world_size() {
        // `get_finished_count() or world_size`: None and 0 both fall back (Python's `or`).
        let quorum = |n, w| {
            let mut connector = crate::ScriptedConnector::quiet();
            connector.set_finished_count(n);
            Aggregator::for_connector(&connector, w, Mode::Compat).quorum()
        };
        assert_eq!(quorum(None, 4), 4);
        assert_eq!(quorum(Some(0), 4), 4);
        assert_eq!(quorum(Some(2), 4), 2);
        assert_eq!(quorum(Some(8), 4), 8);
    }

    #[test]
    fn equality_sees_counts_but_not_capacity() {
        // The model checker and the "a rejected call changes nothing" checks compare
        // aggregators: a pending count must make them differ, a pre-sized table must not.
        let fresh: Aggregator = Aggregator::new(2, Mode::Compat);
        assert_eq!(fresh, Aggregator::with_capacity(2, Mode::Compat, 16));
        let mut counting = fresh.clone();
        counting.aggregate(&[sending(&[3]), None], Rank(0)).unwrap();
        assert_eq!(counting.remaining(Direction::Send, RequestId(3)), Some(1));
        assert_ne!(counting, fresh);
        let mut other = fresh.clone();
        other.aggregate(&[sending(&[2]), None], Rank(0)).unwrap();
        assert_ne!(counting, other);
    }

    #[test]
    fn strict_counts_reporters_beyond_64_ranks() {
        // Protects I-22 beyond 64 ranks: ranks 64 and up live in `Tally::high`, and the
        // invariant check counts reporters across both words.
        let mut a: Aggregator = Aggregator::new(66, Mode::Strict);
        let mut outputs = vec![None; 66];
        outputs[0] = sending(&[5]);
        outputs[64] = sending(&[5]);
        let out = a.aggregate(&outputs, Rank(0)).unwrap().unwrap();
        assert_eq!(out.finished_sending, None, "2 of 66 reports close nothing");
        assert_eq!(a.remaining(Direction::Send, RequestId(5)), Some(64));
        a.check_invariants().unwrap();
        // Rank 64 reporting again within the cycle is a duplicate, like any other rank.
        let mut again = vec![None; 66];
        again[0] = Some(WorkerOutput::default());
        again[64] = sending(&[5]);
        assert_eq!(
            a.aggregate(&again, Rank(0)).unwrap_err(),
            AggregateError::DuplicateReport {
                rank: Rank(64),
                request: RequestId(5),
                direction: Direction::Send
            }
        );
    }

    #[test]
    fn check_invariants_rejects_a_corrupt_aggregator() {
        // Protects I-21…I-27 as the model checker sees them (it calls check_invariants after
        // every action): each kind of corruption is reported.
        let mut healthy: Aggregator = Aggregator::new(2, Mode::Strict);
        healthy.aggregate(&[sending(&[1]), None], Rank(0)).unwrap();
        healthy.check_invariants().unwrap();
        let id_of = |a: Aggregator, f: fn(&mut Aggregator)| {
            let mut a = a;
            f(&mut a);
            a.check_invariants().unwrap_err().id
        };
        // More reports to go than any quorum.
        assert_eq!(id_of(healthy.clone(), |a| a.send.remaining[1] = 2), "I-21");
        // Strict: reports to go but nobody reported in the cycle.
        assert_eq!(
            id_of(healthy.clone(), |a| a.send.clear_reporters(1)),
            "I-21"
        );
        // A pending failure not counted.
        assert_eq!(
            id_of(healthy.clone(), |a| a.failed_pending.push(true)),
            "I-24"
        );
        // A quorum above its recorded high.
        assert_eq!(id_of(healthy, |a| a.quorum = 3), "I-26");
    }
}
