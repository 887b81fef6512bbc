//! [`MultiWorker`]: the worker side of one rank.

use super::ExtraAsyncSaves;
use super::MultiMeta;
use crate::InvariantViolation;
use crate::ensure_invariant;
use crate::ids::BlockId;
use crate::ids::JobId;
use crate::ids::RequestId;
use crate::messages::Meta;
use crate::messages::build_multi;
use crate::sorted_set::SortedSet;
use crate::worker::TransferCommand;
use crate::worker::TransferDone;
use crate::worker::TransferResults;
use crate::worker::WorkerConnector;
use crate::worker::WorkerError;
use alloc::collections::BTreeMap;
use alloc::vec::Vec;
/// The worker side of vLLM's MultiConnector for one rank (see the module docs).
///
/// Children's transfer jobs are renumbered so that jobs of different children never share an
/// id: the runtime sees only this worker's job ids, and [`WorkerConnector::handle_transfer_done`]
/// routes each completion back to the child that started the job.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiWorker<W> {
    pub(super) children: Vec<W>,
    /// `_extra_async_saves`, merged from every bound metadata.
    pub(super) extra_async_saves: ExtraAsyncSaves,
    /// Live jobs: outer id → (child, the child's id), and back.
    pub(super) jobs: BTreeMap<JobId, (usize, JobId)>,
    pub(super) outer: BTreeMap<(usize, JobId), JobId>,
    pub(super) next_job: u64,
}

impl<W: WorkerConnector<WorkerMeta = Meta>> MultiWorker<W> {
    /// Composes `children` (one per child of the scheduler-side [`crate::MultiConnector`], same order).
    pub fn new(children: Vec<W>) -> Self {
        Self {
            children,
            extra_async_saves: BTreeMap::new(),
            jobs: BTreeMap::new(),
            outer: BTreeMap::new(),
            next_job: 0,
        }
    }

    /// The children, in order.
    pub fn children(&self) -> &[W] {
        &self.children
    }

    /// Child `i`, mutably (to configure it between calls; `None` if out of range).
    pub fn child_mut(&mut self, i: usize) -> Option<&mut W> {
        self.children.get_mut(i)
    }

    /// Extra async saves still pending on this rank.
    pub fn extra_async_saves(&self) -> &ExtraAsyncSaves {
        &self.extra_async_saves
    }

    /// The bind half that concerns this worker: merges `extra` into the pending map (a request
    /// named again takes the new count, as `dict.update` does).
    pub fn merge_extra_async_saves(&mut self, extra: Option<&ExtraAsyncSaves>) {
        self.merge_extra_async_saves_unchecked(extra);
        crate::debug_assert_invariants!(self);
    }

    fn merge_extra_async_saves_unchecked(&mut self, extra: Option<&ExtraAsyncSaves>) {
        for (&r, &n) in extra.into_iter().flatten() {
            if n == 0 {
                // Never produced by MultiConnector (it records n − 1 only for n > 1); a 0
                // would make the next report of r vanish, so it is not recorded.
                self.extra_async_saves.remove(&r);
            } else {
                self.extra_async_saves.insert(r, n);
            }
        }
    }

    /// Folds one child's `finished_sending` report into `out`: an id with a pending extra save
    /// consumes one unit (the entry goes at 0) and is not forwarded; any other id is (I-28).
    pub fn consume_finished_sending<'a>(
        &mut self,
        reported: impl IntoIterator<Item = &'a RequestId>,
        out: &mut SortedSet<RequestId>,
    ) {
        self.consume_finished_sending_unchecked(reported, out);
        crate::debug_assert_invariants!(self);
    }

    fn consume_finished_sending_unchecked<'a>(
        &mut self,
        reported: impl IntoIterator<Item = &'a RequestId>,
        out: &mut SortedSet<RequestId>,
    ) {
        for &r in reported {
            match self.extra_async_saves.get_mut(&r) {
                None => {
                    out.insert(r);
                }
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    self.extra_async_saves.remove(&r);
                }
            }
        }
    }

    /// Renumbers child `i`'s commands into this worker's job ids. A wait for a job no longer
    /// live (its completion was fed back already) is dropped: there is nothing to wait for.
    fn lift(&mut self, i: usize, cmds: Vec<TransferCommand>) -> Vec<TransferCommand> {
        cmds.into_iter()
            .filter_map(|cmd| match cmd {
                TransferCommand::Start(mut t) => {
                    let outer = JobId(self.next_job);
                    self.next_job += 1;
                    self.jobs.insert(outer, (i, t.job));
                    self.outer.insert((i, t.job), outer);
                    t.job = outer;
                    Some(TransferCommand::Start(t))
                }
                TransferCommand::Wait(jobs) => {
                    let lifted: SortedSet<JobId> = jobs
                        .iter()
                        .filter_map(|&j| self.outer.get(&(i, j)).copied())
                        .collect();
                    (!lifted.is_empty()).then_some(TransferCommand::Wait(lifted))
                }
            })
            .collect()
    }

    /// Runs `hook` on every child in order and concatenates their (renumbered) commands.
    fn each(
        &mut self,
        mut hook: impl FnMut(&mut W) -> Vec<TransferCommand>,
    ) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        for i in 0..self.children.len() {
            let cmds = hook(&mut self.children[i]);
            out.extend(self.lift(i, cmds));
        }
        out
    }

    /// The invariants of one rank: pending extra saves are at least 1 (I-28), and the job
    /// renumbering is a bijection onto live child jobs (`multi-jobs`: not a spec invariant, the
    /// renumbering is kvrelay's own).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        for (r, &n) in &self.extra_async_saves {
            ensure_invariant!(n >= 1, "I-28", "worker extra_async_saves[{r:?}] is 0");
        }
        ensure_invariant!(
            self.jobs.len() == self.outer.len(),
            "multi-jobs",
            "job renumbering has {} outer and {} inner entries",
            self.jobs.len(),
            self.outer.len()
        );
        for (&o, &(i, j)) in &self.jobs {
            ensure_invariant!(
                i < self.children.len() && self.outer.get(&(i, j)) == Some(&o),
                "multi-jobs",
                "job {o:?} maps to child {i} job {j:?}, which does not map back"
            );
        }
        for c in &self.children {
            WorkerConnector::check_invariants(c)?;
        }
        Ok(())
    }
}

impl<W: WorkerConnector<WorkerMeta = Meta>> WorkerConnector for MultiWorker<W> {
    type StepMeta = MultiMeta<W::StepMeta>;
    type WorkerMeta = Meta;

    /// Child `i` handles `meta.metadata[i]` (children beyond the metadata are skipped, as
    /// Python's `zip` does).
    fn handle_preemptions(&mut self, meta: &Self::StepMeta) -> Vec<TransferCommand> {
        let mut out = Vec::new();
        for (i, m) in meta.metadata.iter().enumerate().take(self.children.len()) {
            let cmds = self.children[i].handle_preemptions(m);
            out.extend(self.lift(i, cmds));
        }
        out
    }

    /// Merges `extra_async_saves` first, then binds child `i` to `meta.metadata[i]`.
    fn bind(&mut self, meta: &Self::StepMeta) {
        self.merge_extra_async_saves(meta.extra_async_saves.as_ref());
        for (c, m) in self.children.iter_mut().zip(&meta.metadata) {
            c.bind(m);
        }
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        self.each(W::start_load_kv)
    }

    fn wait_for_layer_load(&mut self, layer: u32) -> Vec<TransferCommand> {
        self.each(|c| c.wait_for_layer_load(layer))
    }

    fn save_kv_layer(&mut self, layer: u32) -> Vec<TransferCommand> {
        self.each(|c| c.save_kv_layer(layer))
    }

    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        self.each(W::wait_for_save)
    }

    /// Routed to the child that started the job; a job this worker never started is ignored.
    fn handle_transfer_done(&mut self, done: TransferDone) {
        if let Some((i, inner)) = self.jobs.remove(&done.job) {
            self.outer.remove(&(i, inner));
            self.children[i].handle_transfer_done(TransferDone {
                job: inner,
                ok: done.ok,
            });
        }
    }

    /// Unions `finished_recving` and `failed_recving` over the children; `finished_sending`
    /// goes through [`MultiWorker::consume_finished_sending`], child by child in order. Empty
    /// sets are `None`, as vLLM's `get_finished` gives them.
    fn get_transfer_results(&mut self, finished_req_ids: &SortedSet<RequestId>) -> TransferResults {
        let mut sending = SortedSet::new();
        let mut recving = SortedSet::new();
        let mut failed = SortedSet::new();
        for i in 0..self.children.len() {
            let r = self.children[i].get_transfer_results(finished_req_ids);
            if let Some(s) = &r.finished_recving {
                recving.union_with(s);
            }
            failed.union_with(&r.failed_recving);
            self.consume_finished_sending(r.finished_sending.iter().flatten(), &mut sending);
        }
        TransferResults {
            finished_sending: (!sending.is_empty()).then_some(sending),
            finished_recving: (!recving.is_empty()).then_some(recving),
            failed_recving: failed,
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        let mut out = SortedSet::new();
        for c in &mut self.children {
            out.union_with(&c.get_block_ids_with_load_errors());
        }
        out
    }

    /// `None` if every child built `None`, else one slot per child (I-31).
    fn build_connector_worker_meta(&mut self) -> Option<Meta> {
        build_multi(
            self.children
                .iter_mut()
                .map(W::build_connector_worker_meta)
                .collect(),
        )
    }

    fn clear(&mut self) {
        for c in &mut self.children {
            c.clear();
        }
    }

    /// The first child's error, in child order (vLLM: the first assertion ends the worker);
    /// a job id in it is the child's own numbering.
    fn error(&self) -> Option<WorkerError> {
        self.children.iter().find_map(W::error)
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Self::check_invariants(self)
    }
}
