//! The offloading connector, scheduler side (SEMANTICS.md §1.8, §5.5, §6.4, I-38…I-45): vLLM
//! 0.33.0's `OffloadingConnectorScheduler` over the [`CpuOffloadingManager`].
//!
//! GPU blocks are offloaded in *chunks* of `blocks_per_chunk` consecutive blocks of one KV cache
//! group. A chunk is named by an [`OffloadKey`]: the block hash of the chunk's last block and the
//! group index. Every transfer is a *job* with a strictly increasing [`JobId`] (shared by loads
//! and stores); a job is complete once every one of the `num_workers` ranks has acknowledged it
//! through the worker metadata ([`crate::OffloadMeta`] inside [`crate::Meta::Offload`]).
//!
//! # When the scheduler calls what
//!
//! * `get_num_new_matched_tokens`: the longest prefix of ready chunks beyond the local hit
//!   (sliding-window groups need only their last window). [`crate::Lookup::Pending`] while the request
//!   still has jobs in flight (issue #46014), while a key it would load is write-pending, or while
//!   another request is loading one of those keys.
//! * `update_state_after_alloc`: records every allocated block (fence detection, issue #46951);
//!   with external tokens, pins the keys in the manager and creates the request's one load job.
//! * `build_connector_meta`: block tables, `jobs_to_flush` (jobs of preempted requests, jobs
//!   reading a block reallocated this step), store jobs for scheduled and finished requests
//!   (prompt only by default), then `on_request_finished` for the finished ones.
//! * `update_connector_output`: sums acknowledgements per job; at `num_workers` the manager
//!   completes the store (keys become loadable) or the load (keys unpinned).
//! * `request_finished`: never delays the free. The full-attention source blocks of the
//!   request's in-flight stores enter the fence index, so that reusing one forces a flush.
//! * `reset_cache`: every job in flight is flushed and forgotten; its late acknowledgements only
//!   drain the reset fence.
//! * `take_events` once per `update_from_output`: the manager's events as vLLM's CPU placeholder
//!   payloads, rendered as text; with structured events on (`set_cache_events`, which
//!   [`crate::Scheduler::set_cache_events`] calls), the same events as [`crate::CacheEvent`]s
//!   for `take_cache_events`, called right after (the scheduler does).
//!
//! # Errors
//!
//! Where vLLM asserts (an acknowledgement for an unknown job, a count that would drive a job
//! below zero, a manager refusing to pin a key it reported as a hit), the connector keeps a
//! description and hands it to the scheduler through [`crate::SchedulerConnector::take_error`]; the
//! scheduler then stops with the sticky [`crate::SchedulerError::ConnectorContract`].

//!
//! # Layout
//!
//! | file | what |
//! | --- | --- |
//! | `config.rs`, `meta.rs` | the configuration; the metadata shipped to the workers |
//! | `connector.rs` | the scheduler's calls ([`crate::SchedulerConnector`]) |
//! | `lookup.rs` | hits: the ready chunks beyond the local hit |
//! | `store.rs` | stores, fences, per-request bookkeeping |
//! | `invariants.rs` | `check_invariants()` |
//! | `worker.rs` | the worker side ([`OffloadingWorker`]) |
//! | `manager/` | the CPU chunk pool and its replacement policies ([`CpuOffloadingManager`]) |
//!
//! This file holds the connector's state.

use crate::scheduler::ConnectorError;
use crate::scheduler::GroupKind;
use crate::scheduler::SchedulerConfig;
use crate::scheduler::SchedulerView;
use alloc::format;
mod config;
mod connector;
mod invariants;
mod lookup;
mod manager;
mod managers;
mod meta;
mod store;
mod tiering;
mod worker;

#[cfg(test)]
mod tests;

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;

pub use config::{OffloadingConfig, OffloadingError};
pub use manager::{
    Access, ChunkId, CpuOffloadingManager, KeyLookup, ManagerConfig, ManagerError, OffloadEvent,
    OffloadKey, PolicyKind, PrepareStoreOutput,
};
pub use managers::OffloadingManager;
pub use meta::{GpuSpec, OffloadingConnectorMeta, TransferJob};
pub use tiering::{
    LookupResult, TierId, TierJobId, TierReport, TierWork, TieringConfig, TieringError,
    TieringManager, TieringStats,
};
pub use worker::{OffloadingWorker, OffloadingWorkerConfig};

use crate::ids::{BlockId, JobId, RequestId};
use crate::tokens::BlockHash;

// State.

/// What the connector keeps of a finished request (the scheduler may free it at once).
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
struct Finished {
    aborted: bool,
    num_tokens: u32,
    num_prompt_tokens: u32,
    num_computed_tokens: u32,
}

/// `RequestOffloadState`.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct ReqState {
    /// The hash of each complete chunk's last block (a key is this hash and a group).
    chunk_hashes: Vec<BlockHash>,
    /// Per group, the request's block table as the connector knows it (stale sliding-window
    /// entries zeroed).
    block_ids: Vec<Vec<BlockId>>,
    /// Per group, the next chunk to offer for storing.
    next_stored_chunk: Vec<u32>,
    /// Jobs in flight: one load, or stores (plus at most a sync load).
    jobs: BTreeSet<JobId>,
    finished_signaled: bool,
    num_locally_computed_tokens: u32,
    max_load_tokens: Option<u32>,
    max_offload_tokens: Option<u32>,
    finished: Option<Finished>,
}

impl ReqState {
    fn new(ngroups: usize, max_load_tokens: Option<u32>, max_offload_tokens: Option<u32>) -> Self {
        Self {
            chunk_hashes: Vec::new(),
            block_ids: alloc::vec![Vec::new(); ngroups],
            next_stored_chunk: alloc::vec![0; ngroups],
            jobs: BTreeSet::new(),
            finished_signaled: false,
            num_locally_computed_tokens: 0,
            max_load_tokens,
            max_offload_tokens,
            finished: None,
        }
    }

    /// `update_offload_keys`: a key per complete chunk of `block_hashes`.
    fn update_keys(&mut self, block_hashes: &[BlockHash], bpc: usize) {
        while (self.chunk_hashes.len() + 1) * bpc <= block_hashes.len() {
            let last = (self.chunk_hashes.len() + 1) * bpc - 1;
            self.chunk_hashes.push(block_hashes[last]);
        }
    }

    fn key(&self, chunk: usize, group: usize) -> OffloadKey {
        OffloadKey {
            hash: self.chunk_hashes[chunk],
            group: group as u32,
        }
    }
}

/// `TransferJobStatus`.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
struct JobStatus {
    request: RequestId,
    /// Acknowledgements still due.
    pending: u32,
    keys: Vec<OffloadKey>,
    is_store: bool,
    is_sync_load: bool,
    /// Sliding-window sources, fenced from creation.
    fenced: Vec<BlockId>,
    /// Full-attention sources, fenced once the request finished.
    deferred_fence: Vec<BlockId>,
    /// Some rank acknowledged the job as failed (`strict` workers only): a store then completes
    /// with `success = false` and its chunks are freed.
    failed: bool,
}

impl Batch {
    fn seal_allocated(&mut self) {
        if !self.allocated_sealed {
            self.allocated.sort_unstable();
            self.allocated.dedup();
            self.allocated_sealed = true;
        }
    }
}

/// Per-step scratch, emptied at the end of `build_connector_meta`.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
struct Batch {
    load_jobs: BTreeMap<JobId, TransferJob>,
    sync_loads: BTreeSet<RequestId>,
    sync_load_tokens: u32,
    jobs_to_flush: BTreeSet<JobId>,
    /// Blocks allocated this step, unsorted with repeats until [`Batch::seal_allocated`].
    allocated: Vec<BlockId>,
    allocated_sealed: bool,
}

/// The scheduler side of the offloading connector. See the module docs.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct OffloadingConnector {
    config: OffloadingConfig,
    block_size: u32,
    /// The KV cache groups (this and the two orders below are fixed at construction and shared
    /// by every clone: the model checker clones the connector with every state).
    groups: Arc<[GroupKind]>,
    /// Full-attention groups, then sliding-window groups by decreasing window (lookup order).
    lookup_groups: Arc<[usize]>,
    swa_groups: Arc<[usize]>,
    manager: OffloadingManager,
    requests: BTreeMap<RequestId, ReqState>,
    /// Tracked requests that finished and were not yet handed over in a step's
    /// `finished_req_ids`, in the order they finished. vLLM iterates `finished_req_ids`, a Python
    /// set, when it builds their last stores and signals `on_request_finished` (so in hash-seed
    /// order); kvrelay takes them in finish order (`docs/COMPAT.md`, *Finish order*).
    finish_order: Vec<RequestId>,
    jobs: BTreeMap<JobId, JobStatus>,
    job_counter: u64,
    stale_job_threshold: u64,
    reset_fence: BTreeMap<JobId, u32>,
    /// The fence index: GPU block → in-flight stores reading it.
    block_to_jobs: BTreeMap<BlockId, BTreeSet<JobId>>,
    batch: Batch,
    /// `Some` when GPU prefix caching is on: keys of in-flight async loads.
    chunks_being_loaded: Option<BTreeSet<OffloadKey>>,
    /// Stores the manager could not allocate (`prepare_store` → `None`).
    allocation_failures: u64,
    /// `on_reset_flushed` notifications (the manager has no such hook; counted here).
    resets_flushed: u64,
    /// With structured events on ([`crate::SchedulerConnector::set_cache_events`]): the events
    /// of the last `take_events`, until `take_cache_events` drains them. `None` while off.
    cache_events: Option<Vec<crate::messages::CacheEvent>>,
    error: Option<ConnectorError>,
}

fn cdiv(a: u32, b: u32) -> u32 {
    a.div_ceil(b)
}

/// A `kv_transfer_params` entry that is a non-negative integer (`max_load_tokens`, …).
fn param_u32(view: &SchedulerView<'_>, id: RequestId, key: &str) -> Option<u32> {
    view.request(id)?
        .kv_transfer_params()?
        .get(key)?
        .trim()
        .parse()
        .ok()
}

impl OffloadingConnector {
    /// A connector for an engine with `scheduler`'s block size and KV cache groups (every group
    /// is offloaded).
    pub fn new(
        config: OffloadingConfig,
        scheduler: &SchedulerConfig,
    ) -> Result<Self, OffloadingError> {
        let bad = |s: &str| Err(OffloadingError::InvalidConfig(String::from(s)));
        if config.blocks_per_chunk == 0 {
            return bad("blocks_per_chunk must be at least 1");
        }
        if config.num_workers == 0 {
            return bad("num_workers must be at least 1");
        }
        if scheduler.block_size == 0 || scheduler.groups.is_empty() || scheduler.groups.len() > 8 {
            return bad("the scheduler needs a block size and 1 to 8 groups");
        }
        if scheduler
            .groups
            .iter()
            .any(|g| matches!(g, GroupKind::SlidingWindow { window: 0 }))
        {
            return bad("a sliding window must be at least 1 token");
        }
        if scheduler
            .block_size
            .checked_mul(config.blocks_per_chunk)
            .is_none()
        {
            return bad("tokens per chunk overflow");
        }
        let bad_manager = |e| OffloadingError::InvalidConfig(format!("manager: {e:?}"));
        let manager = match config.tiering {
            None => OffloadingManager::Cpu(
                CpuOffloadingManager::new(config.manager).map_err(bad_manager)?,
            ),
            Some(t) => OffloadingManager::Tiering(
                TieringManager::new(config.manager, t)
                    .map_err(|e| OffloadingError::InvalidConfig(format!("tiering: {e}")))?,
            ),
        };
        let groups = scheduler.groups.clone();
        let mut swa: Vec<usize> = (0..groups.len())
            .filter(|&g| matches!(groups[g], GroupKind::SlidingWindow { .. }))
            .collect();
        let tpc = scheduler.block_size * config.blocks_per_chunk;
        let window_chunks = |g: usize| match groups[g] {
            GroupKind::SlidingWindow { window } => cdiv(window, tpc),
            GroupKind::FullAttention => 0,
        };
        swa.sort_by_key(|&g| core::cmp::Reverse(window_chunks(g)));
        let mut lookup_groups: Vec<usize> = (0..groups.len())
            .filter(|&g| groups[g] == GroupKind::FullAttention)
            .collect();
        lookup_groups.extend_from_slice(&swa);
        Ok(Self {
            block_size: scheduler.block_size,
            groups: groups.into(),
            lookup_groups: lookup_groups.into(),
            swa_groups: swa.into(),
            manager,
            requests: BTreeMap::new(),
            finish_order: Vec::new(),
            jobs: BTreeMap::new(),
            job_counter: 0,
            stale_job_threshold: 0,
            reset_fence: BTreeMap::new(),
            block_to_jobs: BTreeMap::new(),
            batch: Batch::default(),
            chunks_being_loaded: scheduler.enable_prefix_caching.then(BTreeSet::new),
            allocation_failures: 0,
            resets_flushed: 0,
            cache_events: None,
            error: None,
            config,
        })
    }

    /// The same connector with a store-threshold tracker of `n` keys in its manager
    /// ([`CpuOffloadingManager::with_max_tracker_size`]). Call right after [`Self::new`].
    pub fn with_max_tracker_size(mut self, n: usize) -> Self {
        self.manager = match self.manager {
            OffloadingManager::Cpu(m) => OffloadingManager::Cpu(m.with_max_tracker_size(n)),
            OffloadingManager::Tiering(t) => OffloadingManager::Tiering(t.with_max_tracker_size(n)),
        };
        self
    }

    /// The configuration.
    pub fn config(&self) -> &OffloadingConfig {
        &self.config
    }

    /// The CPU manager (read-only; the primary tier when tiered).
    pub fn manager(&self) -> &CpuOffloadingManager {
        self.manager.primary()
    }

    /// The tiering manager (read-only), when tiered.
    pub fn tiering(&self) -> Option<&TieringManager> {
        self.manager.tiering()
    }

    /// The secondary tiers' work since the last call, for the runtime to carry out (none
    /// without tiers): see [`TieringManager::take_tier_work`]. Call after every step.
    pub fn take_tier_work(&mut self) -> Vec<TierWork> {
        self.manager.take_tier_work()
    }

    /// What the runtime did with the tiers' work: see [`TieringManager::report`]. A refused
    /// report changes nothing.
    pub fn report_tier(&mut self, report: TierReport) -> Result<(), TieringError> {
        self.manager.report(report)
    }

    /// Jobs in flight (created, not yet acknowledged by every rank), ascending.
    pub fn jobs_in_flight(&self) -> impl Iterator<Item = JobId> + '_ {
        self.jobs.keys().copied()
    }

    /// Acknowledgements job `job` still needs (`None`: not in flight).
    pub fn pending_count(&self, job: JobId) -> Option<u32> {
        self.jobs.get(&job).map(|j| j.pending)
    }

    /// Jobs in flight of `request`, ascending.
    pub fn request_jobs(&self, request: RequestId) -> Vec<JobId> {
        self.requests
            .get(&request)
            .map(|r| r.jobs.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Whether the connector still tracks `request`.
    pub fn tracks(&self, request: RequestId) -> bool {
        self.requests.contains_key(&request)
    }

    /// Blocks in the fence index (read by an in-flight store and fenced), ascending.
    pub fn fenced_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.block_to_jobs.keys().copied()
    }

    /// Jobs flushed by a cache reset whose acknowledgements are still due.
    pub fn reset_fence_len(&self) -> usize {
        self.reset_fence.len()
    }

    /// Times the reset fence drained (vLLM's `on_reset_flushed`).
    pub fn resets_flushed(&self) -> u64 {
        self.resets_flushed
    }

    /// Store allocation failures so far (`prepare_store` returned `None`).
    pub fn allocation_failures(&self) -> u64 {
        self.allocation_failures
    }

    /// The manager's events since the last call, typed (draining). The trait's `take_events`
    /// drains the same events as text (and, with structured events on, keeps them for
    /// `take_cache_events`): an embedder calls one or the other.
    pub fn take_offload_events(&mut self) -> Vec<OffloadEvent> {
        self.manager.take_events()
    }

    /// Every block hash the connector may still name: its requests' chunk keys, its jobs' keys,
    /// the keys being loaded and [`CpuOffloadingManager::referenced_keys`]; a hash may come more
    /// than once. For an embedder that maps its own hashes to [`BlockHash`]es: a mapping whose
    /// hash is not among these (nor in a request it still mirrors) can be freed.
    pub fn referenced_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        let requests = self
            .requests
            .values()
            .flat_map(|r| r.chunk_hashes.iter().copied());
        let jobs = self
            .jobs
            .values()
            .flat_map(|j| j.keys.iter().map(|k| k.hash));
        let loading = self.chunks_being_loaded.iter().flatten().map(|k| k.hash);
        let manager = self.manager.primary().referenced_keys().map(|k| k.hash);
        requests.chain(jobs).chain(loading).chain(manager)
    }

    /// The next job id.
    pub fn next_job_id(&self) -> JobId {
        JobId(self.job_counter)
    }

    fn tpc(&self) -> u32 {
        self.block_size * self.config.blocks_per_chunk
    }

    fn bpc(&self) -> usize {
        self.config.blocks_per_chunk as usize
    }

    fn fail(&mut self, why: ConnectorError) {
        if self.error.is_none() {
            self.error = Some(why);
        }
    }

    fn new_job_id(&mut self) -> JobId {
        let id = JobId(self.job_counter);
        self.job_counter += 1;
        id
    }
}
