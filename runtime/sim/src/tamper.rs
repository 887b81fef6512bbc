//! Step messages tampered as a buggy scheduler would write them — the block-reuse bugs the
//! rank's checks exist for, entered through the engine's transport seam: [`TamperSteps`] relays
//! every step to its rank through a [`StepFault`] that rewrites it once.
//!
//! * [`StepFault::LoadIntoReadBlock`] — the first load whose step also runs a request that has
//!   read its first block gets that block as its destination: a transfer writing into a block a
//!   forward reads (a block freed while still in a table, or reused while a load fills it).
//! * [`StepFault::HandOutReadBlock`] — the first request given a new block gets, instead, a block
//!   another running request has read: one block in two tables.
//!
//! The rank must stop with `RunError::Hazard` (or `RunError::Corrupt` for a read of the wrong
//! content), never run on. Each rank's relay sees the same steps and rewrites them the same way.
//!
//! [`DropLoadCompletions`] loses the ranks' load completions on the way back: the run must stop
//! as stalled, naming the requests, within about a second.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvrelay_core::{BlockId, RequestId, ScheduledStep, tables_reset};
use kvrelay_engine::RunError;
use kvrelay_engine::connector::EngineMeta;
use kvrelay_engine::rank::{RankReport, RankSetup, StepMsg};
use kvrelay_engine::transport::{BoxFuture, RankConn, Transport};
use tokio::sync::{Notify, mpsc};

/// Which rewrite (see the module docs).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub enum StepFault {
    /// A load's first destination block is a block a running request has read.
    LoadIntoReadBlock,
    /// A request's first new block is a block another running request has read.
    HandOutReadBlock,
}

/// A transport whose steps pass through `fault` (see the module docs).
#[derive(Debug)]
pub struct TamperSteps<T> {
    /// The transport that reaches the ranks.
    pub inner: T,
    /// The rewrite.
    pub fault: StepFault,
}

impl<T: Transport> Transport for TamperSteps<T> {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let conn = self.inner.connect(setup, wake, reports).await?;
            let (steps, from_engine) = mpsc::channel(1);
            tokio::spawn(relay(from_engine, conn.steps, Tamper::new(self.fault)));
            Ok(RankConn {
                steps,
                task: conn.task,
            })
        })
    }
}

async fn relay(mut from: mpsc::Receiver<StepMsg>, to: mpsc::Sender<StepMsg>, mut t: Tamper) {
    while let Some(mut m) = from.recv().await {
        if let Some(step) = t.rewrite(&m.step) {
            m.step = Arc::new(step);
        }
        if to.send(m).await.is_err() {
            return;
        }
    }
}

/// The tables as the ranks will have them, and the rewrite, once.
struct Tamper {
    fault: StepFault,
    done: bool,
    /// Group 0's table of every live request.
    tables: BTreeMap<RequestId, Vec<BlockId>>,
    /// Steps each live request was scheduled in.
    scheduled: BTreeMap<RequestId, u32>,
}

type Step = ScheduledStep<EngineMeta>;

impl Tamper {
    fn new(fault: StepFault) -> Self {
        Self {
            fault,
            done: false,
            tables: BTreeMap::new(),
            scheduled: BTreeMap::new(),
        }
    }

    /// The step rewritten, if this is the step to rewrite; the tables follow either way.
    fn rewrite(&mut self, step: &Step) -> Option<Step> {
        let out = &step.output;
        for id in tables_reset(out) {
            self.tables.remove(&id);
            self.scheduled.remove(&id);
        }
        let mut changed = None;
        if !self.done
            && let Some((reader, block)) = self.read_block(step)
        {
            changed = self.apply(step, reader, block);
            self.done = changed.is_some();
        }
        self.follow(changed.as_ref().unwrap_or(step));
        changed
    }

    /// A request running again this step that read its first block in an earlier step and is
    /// not storing it any more (scheduled three steps before: a store completes a step after it
    /// starts).
    fn read_block(&self, step: &Step) -> Option<(RequestId, BlockId)> {
        step.output
            .scheduled_cached_reqs
            .iter()
            .filter(|c| !c.resumed && self.scheduled.get(&c.id).is_some_and(|&n| n >= 3))
            .find_map(|c| Some((c.id, *self.tables.get(&c.id)?.first()?)))
    }

    fn apply(&self, step: &Step, reader: RequestId, block: BlockId) -> Option<Step> {
        let mut s = step.clone();
        let target = match self.fault {
            StepFault::LoadIntoReadBlock => s
                .meta
                .left_mut()?
                .load_jobs
                .values_mut()
                .find(|j| j.request != reader)
                .and_then(|j| j.gpu.block_ids.first_mut())
                .and_then(|g| g.first_mut()),
            StepFault::HandOutReadBlock => s
                .output
                .scheduled_cached_reqs
                .iter_mut()
                .filter(|c| c.id != reader && !c.resumed)
                .find_map(|c| c.new_block_ids.first_mut().and_then(|g| g.first_mut())),
        }?;
        *target = block;
        Some(s)
    }

    fn follow(&mut self, step: &Step) {
        for r in step.output.scheduled_requests() {
            let new = r.block_ids.first().cloned().unwrap_or_default();
            if r.full_table {
                self.tables.insert(r.id, new);
            } else {
                self.tables.entry(r.id).or_default().extend(new);
            }
            *self.scheduled.entry(r.id).or_default() += 1;
        }
    }
}

/// A transport whose ranks' reports lose every load completion (`finished_recving`): a request
/// whose load never reports waits forever, and the run must say so (`RunError::Stalled`,
/// naming it) rather than hang.
#[derive(Debug)]
pub struct DropLoadCompletions<T> {
    /// The transport that reaches the ranks.
    pub inner: T,
}

impl<T: Transport> Transport for DropLoadCompletions<T> {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let (rank_reports, mut from_rank) = mpsc::channel::<RankReport>(1);
            let conn = self.inner.connect(setup, wake, rank_reports).await?;
            tokio::spawn(async move {
                while let Some(mut rep) = from_rank.recv().await {
                    if let Ok(out) = &mut rep.output {
                        out.finished_recving = None;
                    }
                    if reports.send(rep).await.is_err() {
                        return;
                    }
                }
            });
            Ok(conn)
        })
    }
}
