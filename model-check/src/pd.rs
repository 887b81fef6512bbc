//! A P/D (disaggregated prefill) connector pair for the system model: the decode side loads each
//! request's prompt KV from a remote prefill instance asynchronously, the way vLLM's NIXL
//! connector does, and the prefill side holds a finished request's blocks until its KV was sent
//! (delayed frees). Transfers can fail; a failed load is reported as the spec asks (invalid
//! blocks for one KV-cache group, request-level `failed_recving` for several) and the scheduler
//! recomputes.
//!
//! It exists so the model checker covers the scheduler paths no offloading connector reaches:
//! `WAITING_FOR_REMOTE_KVS`, aborts while loading (PR #32255, I-17), load-failure recovery
//! (I-33…I-37), held blocks freed on the aggregated `finished_sending` (I-15), and, as a
//! [`crate::MultiPair`] child, MultiConnector composition (PR #18246, issue #46951). It is a
//! deliberately small, correct connector outside the core: what is under check is the core's
//! scheduler, aggregator, worker protocol and MultiConnector around it.
//!
//! The remote prefill instance holds every prompt block of every request at
//! [`remote_slot`]`(request, index)` (an address the system model defines); the system model
//! seeds those slots with the blocks' contents when a request arrives
//! ([`Connectors::remote_prefill`]).

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::{
    BlockId, FinishDecision, JobId, Lookup, Meta, RequestId, RequestStatus, SchedulerConnector,
    SchedulerOutput, SchedulerView, SortedSet, Transfer, TransferCommand, TransferDirection,
    TransferDone, TransferResults, WorkerConnector,
};

use crate::system::{Connectors, SystemConfig, is_remote_slot, property_names, remote_slot};

/// The external location a finished request's block `index` is sent to (the decode instance).
fn send_slot(request: RequestId, index: u32) -> u64 {
    (1 << 61) | (u64::from(request.0) << 32) | u64::from(index)
}

/// One transfer's worth of blocks: a request's GPU blocks and their external slots.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PdCopy {
    /// The request.
    pub request: RequestId,
    /// GPU blocks (every group's, non-null), in order.
    pub blocks: Vec<BlockId>,
    /// External slots, one per block.
    pub slots: Vec<u64>,
}

/// The P/D connector's per-step metadata.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PdMeta {
    /// Async loads admitted since the previous step.
    pub loads: Vec<PdCopy>,
    /// Sends of requests that finished since the previous step (their frees are delayed).
    pub sends: Vec<PdCopy>,
}

/// What the P/D connector does.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PdRole {
    /// Decode side: every request's prompt is loaded from the remote prefill instance (once:
    /// the request's transfer parameters are consumed at its first allocation, as NIXL's are).
    pub load: bool,
    /// Prefill side: a request that finished by length holds its blocks until every rank sent
    /// them (`request_finished` answers `delay_free`).
    pub send: bool,
    /// Load failures are reported as invalid block ids (`true`; one KV-cache group only) or as
    /// request-level `failed_recving` (`false`).
    pub failures_as_blocks: bool,
}

/// The scheduler side.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdConnector {
    role: PdRole,
    /// Requests whose remote-prefill parameters were consumed.
    consumed: BTreeSet<RequestId>,
    /// The block-aligned local hit passed to the last lookup of each request.
    hits: BTreeMap<RequestId, u32>,
    loads: Vec<PdCopy>,
    sends: Vec<PdCopy>,
}

impl PdConnector {
    /// A connector in `role`.
    pub fn new(role: PdRole) -> Self {
        Self {
            role,
            consumed: BTreeSet::new(),
            hits: BTreeMap::new(),
            loads: Vec::new(),
            sends: Vec::new(),
        }
    }
}

/// Every non-null block of `blocks[g][first..last]`, every group, with `slot(index)`.
fn copy_of(
    request: RequestId,
    blocks: &[Vec<BlockId>],
    first: u32,
    last: u32,
    slot: fn(RequestId, u32) -> u64,
) -> PdCopy {
    let mut c = PdCopy {
        request,
        blocks: Vec::new(),
        slots: Vec::new(),
    };
    for group in blocks {
        for idx in first..last.min(group.len() as u32) {
            let b = group[idx as usize];
            if b.0 != 0 {
                c.blocks.push(b);
                c.slots.push(slot(request, idx));
            }
        }
    }
    c
}

impl SchedulerConnector for PdConnector {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        if !self.role.load || self.consumed.contains(&request) {
            return Lookup::MISS;
        }
        // NIXL: the remote holds the whole prompt; the scheduler recomputes the last token.
        let tokens = r.num_prompt_tokens().saturating_sub(num_computed_tokens);
        self.hits.insert(request, num_computed_tokens);
        Lookup::Hit {
            tokens,
            load_async: tokens > 0,
        }
    }

    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        let Some(hit) = self.hits.remove(&request) else {
            return;
        };
        self.consumed.insert(request);
        if num_external_tokens == 0 {
            return;
        }
        let bs = view.config().block_size;
        let copy = copy_of(
            request,
            blocks,
            hit / bs,
            (hit + num_external_tokens) / bs,
            remote_slot,
        );
        if !copy.blocks.is_empty() {
            self.loads.push(copy);
        }
    }

    fn build_connector_meta(
        &mut self,
        _view: &SchedulerView<'_>,
        _out: &SchedulerOutput,
    ) -> PdMeta {
        PdMeta {
            loads: std::mem::take(&mut self.loads),
            sends: std::mem::take(&mut self.sends),
        }
    }

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.hits.remove(&request);
        let length_capped = view
            .request(request)
            .is_some_and(|r| r.status() == RequestStatus::FinishedLengthCapped);
        if !self.role.send || !length_capped {
            return FinishDecision::default();
        }
        let n = blocks.iter().map(Vec::len).max().unwrap_or(0) as u32;
        let copy = copy_of(request, blocks, 0, n, send_slot);
        if copy.blocks.is_empty() {
            return FinishDecision::default();
        }
        self.sends.push(copy);
        FinishDecision {
            delay_free: true,
            kv_transfer_params: None,
        }
    }
}

/// A transfer the worker started and that has not completed.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct Job {
    request: RequestId,
    direction: TransferDirection,
    blocks: Vec<BlockId>,
}

/// The worker side of one rank: loads and sends are started in `start_load_kv` (after the
/// step's forward launch, as async transfers are) and reported when they complete.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdWorker {
    failures_as_blocks: bool,
    /// [`PdFault::SwallowLoadFailures`].
    swallow_failures: bool,
    bound: Option<PdMeta>,
    next_job: u64,
    jobs: BTreeMap<JobId, Job>,
    /// Requests with a failed load job whose other jobs are still in flight.
    failing: BTreeSet<RequestId>,
    finished_sending: SortedSet<RequestId>,
    finished_recving: SortedSet<RequestId>,
    failed_recving: SortedSet<RequestId>,
    invalid_blocks: SortedSet<BlockId>,
}

impl PdWorker {
    /// A worker reporting failed loads as invalid blocks (`true`) or request-level failures.
    pub fn new(failures_as_blocks: bool) -> Self {
        Self {
            failures_as_blocks,
            swallow_failures: false,
            bound: None,
            next_job: 0,
            jobs: BTreeMap::new(),
            failing: BTreeSet::new(),
            finished_sending: SortedSet::new(),
            finished_recving: SortedSet::new(),
            failed_recving: SortedSet::new(),
            invalid_blocks: SortedSet::new(),
        }
    }

    fn start(&mut self, copies: &[PdCopy], direction: TransferDirection) -> Vec<TransferCommand> {
        let mut cmds = Vec::with_capacity(copies.len());
        for c in copies {
            let job = JobId(self.next_job);
            self.next_job += 1;
            self.jobs.insert(
                job,
                Job {
                    request: c.request,
                    direction,
                    blocks: c.blocks.clone(),
                },
            );
            cmds.push(TransferCommand::Start(Transfer {
                job,
                direction,
                request: c.request,
                gpu_blocks: c.blocks.clone(),
                // One KV cache group.
                groups: vec![0; c.blocks.len()],
                external: c.slots.clone(),
            }));
        }
        cmds
    }
}

/// `handle_preemptions` keeps its default, nothing to fence: loads write only the loading
/// request's own blocks, and sends read blocks the scheduler holds until they are reported.
impl WorkerConnector for PdWorker {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn bind(&mut self, meta: &PdMeta) {
        self.bound = Some(meta.clone());
    }

    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        let Some(meta) = self.bound.clone() else {
            return Vec::new();
        };
        let mut cmds = self.start(&meta.loads, TransferDirection::Load);
        cmds.extend(self.start(&meta.sends, TransferDirection::Store));
        cmds
    }

    fn handle_transfer_done(&mut self, done: TransferDone) {
        let Some(job) = self.jobs.remove(&done.job) else {
            return;
        };
        let r = job.request;
        let more = self
            .jobs
            .values()
            .any(|j| j.request == r && j.direction == job.direction);
        match job.direction {
            TransferDirection::Load => {
                if !done.ok && !self.swallow_failures {
                    self.failing.insert(r);
                    if self.failures_as_blocks {
                        self.invalid_blocks
                            .union_with(&job.blocks.iter().copied().collect());
                    }
                }
                if !more {
                    self.finished_recving.insert(r);
                    if self.failing.remove(&r) && !self.failures_as_blocks {
                        self.failed_recving.insert(r);
                    }
                }
            }
            // A failed send is the decode side's problem; the blocks may be freed either way.
            TransferDirection::Store => {
                if !more {
                    self.finished_sending.insert(r);
                }
            }
        }
    }

    fn get_transfer_results(&mut self, _finished: &SortedSet<RequestId>) -> TransferResults {
        let take = |s: &mut SortedSet<RequestId>| {
            let s = std::mem::take(s);
            (!s.is_empty()).then_some(s)
        };
        TransferResults {
            finished_sending: take(&mut self.finished_sending),
            finished_recving: take(&mut self.finished_recving),
            failed_recving: std::mem::take(&mut self.failed_recving),
        }
    }

    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        std::mem::take(&mut self.invalid_blocks)
    }

    fn clear(&mut self) {
        self.bound = None;
    }
}

/// Faults of the P/D pair, each reproducing a historical bug class.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum PdFault {
    /// The worker reports a failed load as a success (the bug class of Mooncake PR #50984 and
    /// of connectors that "swallow" transfer errors): the scheduler then computes on top of
    /// blocks the load left half-written.
    SwallowLoadFailures,
}

/// The P/D pair for [`crate::SystemModel`].
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdPair {
    /// What the connector does.
    pub role: PdRole,
    /// An injected fault (none: the connector as written).
    pub fault: Option<PdFault>,
}

impl Default for PdPair {
    /// Decode and prefill side at once (vLLM's `kv_both`), failures as invalid blocks.
    fn default() -> Self {
        Self {
            role: PdRole {
                load: true,
                send: true,
                failures_as_blocks: true,
            },
            fault: None,
        }
    }
}

impl Connectors for PdPair {
    type Sched = PdConnector;
    type Worker = PdWorker;

    fn name(&self) -> String {
        match self.fault {
            None => "p/d".to_owned(),
            Some(f) => format!("p/d with fault {f:?}"),
        }
    }

    fn scheduler_connector(
        &self,
        _config: &kvrelay_core::SchedulerConfig,
        model: &SystemConfig,
    ) -> Result<PdConnector, String> {
        if self.role.failures_as_blocks && model.sliding_window.is_some() {
            return Err(
                "a P/D connector with several KV-cache groups must report load failures \
                        per request (failures_as_blocks = false): vLLM rejects invalid block ids \
                        there (I-36)"
                    .to_owned(),
            );
        }
        Ok(PdConnector::new(self.role))
    }

    fn worker(&self, _rank: u32, _model: &SystemConfig) -> PdWorker {
        let mut w = PdWorker::new(self.role.failures_as_blocks);
        w.swallow_failures = self.fault == Some(PdFault::SwallowLoadFailures);
        w
    }

    fn remote_prefill(&self) -> bool {
        self.role.load
    }

    fn load_may_fail(&self, load: &Transfer) -> bool {
        load.external.iter().copied().all(is_remote_slot)
    }

    fn describe_meta(&self, meta: &PdMeta) -> String {
        let list = |v: &[PdCopy]| {
            v.iter()
                .map(|c| {
                    let b: Vec<u64> = c.blocks.iter().map(|b| b.0).collect();
                    format!("req {} blocks {b:?}", c.request.0)
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !meta.loads.is_empty() {
            parts.push(format!("loads [{}]", list(&meta.loads)));
        }
        if !meta.sends.is_empty() {
            parts.push(format!("sends [{}]", list(&meta.sends)));
        }
        parts.join("; ")
    }

    /// Preemption, a clean end, a send holding a finished request's blocks (when sending), a
    /// failed load recomputed (when the configuration allows failures).
    fn expected_examples(&self, config: &SystemConfig) -> Vec<&'static str> {
        use property_names as n;
        let mut v = vec![n::PREEMPTED, n::ALL_DONE];
        if self.role.send {
            v.push(n::DELAYED_FREE);
        }
        if self.role.load && config.load_failures > 0 {
            v.push(n::LOAD_FAILED_RECOMPUTED);
        }
        v
    }
}
