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
//!   (sliding-window groups need only their last window). [`Lookup::Pending`] while the request
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
//!
//! # Errors
//!
//! Where vLLM asserts (an acknowledgement for an unknown job, a count that would drive a job
//! below zero, a manager refusing to pin a key it reported as a hit), the connector keeps a
//! description and hands it to the scheduler through [`SchedulerConnector::take_error`]; the
//! scheduler then stops with the sticky [`crate::SchedulerError::ConnectorContract`].

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::block_pool::{BlockHash, NULL_BLOCK};
use crate::connector::{FinishDecision, Lookup, SchedulerConnector};
use crate::events::KvEvent;
use crate::ids::{BlockId, JobId, RequestId};
use crate::meta::Meta;
use crate::offload_manager::{
    Access, ChunkId, CpuOffloadingManager, KeyLookup, ManagerConfig, OffloadKey,
};
use crate::output::{AggregatedOutput, SortedSet};
use crate::scheduler::{GroupKind, RequestStatus, SchedulerConfig, SchedulerOutput, SchedulerView};
use crate::{InvariantViolation, ensure_invariant};

// ---------------------------------------------------------------------------------------------
// Configuration.

/// Configuration of the scheduler-side offloading connector.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadingConfig {
    /// GPU blocks per offloaded chunk (≥ 1).
    pub blocks_per_chunk: u32,
    /// Acknowledgements a job needs: the parallel world size (≥ 1).
    pub num_workers: u32,
    /// Store only prompt tokens (vLLM's default `offload_prompt_only = true`).
    pub offload_prompt_only: bool,
    /// Tokens that may be loaded synchronously per step (vLLM's `sync_load_budget_bytes`
    /// divided by the KV bytes per token); `0` disables synchronous loads.
    pub sync_load_budget_tokens: u32,
    /// The CPU manager's configuration.
    pub manager: ManagerConfig,
}

impl OffloadingConfig {
    /// A configuration with vLLM's defaults (prompt-only stores, no synchronous loads).
    pub fn new(blocks_per_chunk: u32, num_workers: u32, manager: ManagerConfig) -> Self {
        Self {
            blocks_per_chunk,
            num_workers,
            offload_prompt_only: true,
            sync_load_budget_tokens: 0,
            manager,
        }
    }
}

/// Errors of the offloading connector's construction.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
pub enum OffloadingError {
    /// A configuration value out of range.
    #[error("invalid offloading configuration: {0}")]
    InvalidConfig(String),
}

// ---------------------------------------------------------------------------------------------
// Metadata.

/// The GPU side of a transfer (vLLM's `GPULoadStoreSpec`): per KV cache group, the blocks read or
/// written, and the index in the request's block table of each group's first block.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuSpec {
    /// Per group, the non-null GPU blocks, in table order.
    pub block_ids: Vec<Vec<BlockId>>,
    /// Per group, the table index of `block_ids[g][0]` (0 when the group has no block). Its
    /// remainder modulo `blocks_per_chunk` is the offset of the first block inside the first
    /// host chunk.
    pub block_indices: Vec<u32>,
}

/// One transfer job as the workers receive it (vLLM's `TransferJob`).
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TransferJob {
    /// The request it serves.
    pub request: RequestId,
    /// GPU blocks: the source of a store, the destination of a load.
    pub gpu: GpuSpec,
    /// Per group, the host chunks: the destination of a store, the source of a load.
    pub chunks: Vec<Vec<ChunkId>>,
    /// Loads only: completed before this step's forward (`sync`).
    pub sync: bool,
}

impl TransferJob {
    /// Number of GPU blocks moved.
    pub fn num_blocks(&self) -> usize {
        self.gpu.block_ids.iter().map(Vec::len).sum()
    }
}

/// `OffloadingConnectorMetadata`: the step's new jobs and the jobs the workers must complete
/// before any KV write of the step.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OffloadingConnectorMeta {
    /// Loads created this step.
    pub load_jobs: BTreeMap<JobId, TransferJob>,
    /// Stores created this step.
    pub store_jobs: BTreeMap<JobId, TransferJob>,
    /// Jobs to finish in `handle_preemptions` (I-41, I-42).
    pub jobs_to_flush: SortedSet<JobId>,
}

// ---------------------------------------------------------------------------------------------
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
    groups: Vec<GroupKind>,
    /// Full-attention groups, then sliding-window groups by decreasing window (lookup order).
    lookup_groups: Vec<usize>,
    swa_groups: Vec<usize>,
    manager: CpuOffloadingManager,
    requests: BTreeMap<RequestId, ReqState>,
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
    error: Option<String>,
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
        let manager = CpuOffloadingManager::new(config.manager)
            .map_err(|e| OffloadingError::InvalidConfig(format!("manager: {e:?}")))?;
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
            groups,
            lookup_groups,
            swa_groups: swa,
            manager,
            requests: BTreeMap::new(),
            jobs: BTreeMap::new(),
            job_counter: 0,
            stale_job_threshold: 0,
            reset_fence: BTreeMap::new(),
            block_to_jobs: BTreeMap::new(),
            batch: Batch::default(),
            chunks_being_loaded: scheduler.enable_prefix_caching.then(BTreeSet::new),
            allocation_failures: 0,
            resets_flushed: 0,
            error: None,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &OffloadingConfig {
        &self.config
    }

    /// The CPU manager (read-only).
    pub fn manager(&self) -> &CpuOffloadingManager {
        &self.manager
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

    fn fail(&mut self, why: String) {
        if self.error.is_none() {
            self.error = Some(why);
        }
    }

    fn new_job_id(&mut self) -> JobId {
        let id = JobId(self.job_counter);
        self.job_counter += 1;
        id
    }

    /// Chunks a sliding-window group must have ready at the end of a hit of `num_tokens`
    /// (`load_window_size_in_chunks`); `None` for full attention.
    fn load_window(&self, g: usize, num_tokens: u32) -> Option<u32> {
        let GroupKind::SlidingWindow { window } = self.groups[g] else {
            return None;
        };
        let tpc = self.tpc();
        let right_padding = (tpc - num_tokens % tpc) % tpc;
        Some(cdiv(window, tpc).max(cdiv(window - 1 + right_padding, tpc)))
    }

    fn window_chunks(&self, g: usize) -> Option<u32> {
        match self.groups[g] {
            GroupKind::SlidingWindow { window } => Some(cdiv(window, self.tpc())),
            GroupKind::FullAttention => None,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Lookup.

    /// `_maximal_prefix_lookup`: consecutive ready-or-pending chunks from `from`; `None` when a
    /// counted one is write-pending.
    fn prefix_lookup(&self, st: &ReqState, g: usize, from: usize, to: usize) -> Option<u32> {
        let mut hits = 0;
        let mut pending = false;
        for c in from..to {
            match self.manager.lookup(st.key(c, g)) {
                KeyLookup::Hit => hits += 1,
                KeyLookup::HitPending => {
                    hits += 1;
                    pending = true;
                }
                KeyLookup::Miss => break,
            }
        }
        (!pending).then_some(hits)
    }

    /// `_sliding_window_lookup`: the end (relative to `from`) of the last run of `window`
    /// consecutive hits, scanning from the end; the first (rightmost) run may need `initial`.
    fn window_lookup(
        &self,
        st: &ReqState,
        g: usize,
        from: usize,
        to: usize,
        window: u32,
        initial: u32,
    ) -> Option<u32> {
        let mut pending = false;
        let mut run = 0;
        let mut required = if initial == 0 { window } else { initial };
        for idx in (0..to - from).rev() {
            match self.manager.lookup(st.key(from + idx, g)) {
                KeyLookup::Hit => run += 1,
                KeyLookup::HitPending => {
                    pending = true;
                    run += 1;
                }
                KeyLookup::Miss => {
                    run = 0;
                    pending = false;
                    required = window;
                }
            }
            if run == required {
                return (!pending).then_some(idx as u32 + required);
            }
        }
        (!pending).then_some(run)
    }

    /// `_lookup_complete_chunks`: tokens loadable beyond the local hit, `None` = ask again.
    fn lookup_chunks(&self, st: &ReqState, num_tokens: u32) -> Option<u32> {
        let tpc = i64::from(self.tpc());
        let computed = i64::from(st.num_locally_computed_tokens);
        let mut max_hit = i64::from(num_tokens);
        if let Some(m) = st.max_load_tokens {
            max_hit = max_hit.min(computed + i64::from(m));
        }
        if !self.swa_groups.is_empty() {
            // The last prompt token is recomputed for its logprobs under sliding windows.
            max_hit -= 1;
        }
        let nkeys = st.chunk_hashes.len() as i64;
        let mut num_hit: i64 = 0;
        let mut defer = false;
        let mut groups: &[usize] = &self.lookup_groups;
        while !groups.is_empty() {
            let mut looked_up_swa = false;
            let current = groups;
            groups = &[];
            for &g in current {
                max_hit = max_hit.min(nkeys * tpc);
                if st.max_load_tokens.is_some() {
                    max_hit = max_hit.div_euclid(tpc) * tpc;
                }
                if max_hit - computed < tpc {
                    return Some(0);
                }
                let num_chunks = ((max_hit + tpc - 1) / tpc).min(nkeys) as usize;
                let start = (computed / tpc) as usize;
                let hits = match self.window_chunks(g) {
                    None => self.prefix_lookup(st, g, start, num_chunks),
                    Some(window) => {
                        let candidate_end = max_hit.min(num_chunks as i64 * tpc);
                        let initial = self
                            .load_window(g, candidate_end as u32)
                            .expect("a sliding-window group");
                        self.window_lookup(st, g, start, num_chunks, window, initial)
                    }
                };
                match hits {
                    Some(0) => return Some(0),
                    None => defer = true,
                    Some(n) => max_hit = max_hit.min(tpc * (start as i64 + i64::from(n))),
                }
                let new_hit = max_hit - computed;
                if new_hit < tpc {
                    return Some(0);
                }
                if new_hit < num_hit {
                    if defer {
                        defer = false;
                        groups = &self.lookup_groups;
                    } else if looked_up_swa && groups.is_empty() {
                        groups = &self.swa_groups;
                    }
                }
                looked_up_swa |= self.window_chunks(g).is_some();
                num_hit = new_hit;
            }
        }
        if defer {
            return None;
        }
        let num_hit = num_hit as u32;
        if let Some(loading) = &self.chunks_being_loaded
            && !loading.is_empty()
        {
            let end = st.num_locally_computed_tokens + num_hit;
            let start = (st.num_locally_computed_tokens / self.tpc()) as usize;
            let num_chunks = (cdiv(end, self.tpc()) as usize).min(st.chunk_hashes.len());
            for g in 0..self.groups.len() {
                let mut from = start.min(num_chunks);
                if let Some(w) = self.load_window(g, end) {
                    from = from.max(num_chunks.saturating_sub(w as usize));
                }
                if (from..num_chunks).any(|c| loading.contains(&st.key(c, g))) {
                    return None;
                }
            }
        }
        Some(num_hit)
    }

    // -----------------------------------------------------------------------------------------
    // Store jobs.

    /// Whether block `i` (absolute table index) of a sliding-window group can serve a hit at a
    /// chunk boundary (`reachable_block_mask` with chunk alignment); `None` = every block.
    fn swa_reachable(&self, g: usize) -> Option<u32> {
        let GroupKind::SlidingWindow { window } = self.groups[g] else {
            return None;
        };
        let need = cdiv(window - 1, self.block_size);
        (need < self.config.blocks_per_chunk).then_some(need)
    }

    /// `_build_store_jobs` for one request.
    fn build_store_job(
        &mut self,
        view: &SchedulerView<'_>,
        id: RequestId,
        scheduled: u32,
        store_jobs: &mut BTreeMap<JobId, TransferJob>,
    ) {
        let Some(st) = self.requests.get(&id) else {
            return;
        };
        let (num_tokens, num_prompt, after_batch, finished) = match (st.finished, view.request(id))
        {
            (Some(f), _) => {
                let n = if f.aborted {
                    f.num_computed_tokens
                } else {
                    f.num_prompt_tokens.max(f.num_tokens.saturating_sub(1))
                };
                (f.num_tokens, f.num_prompt_tokens, n, true)
            }
            (None, Some(r)) => (
                r.tokens().len() as u32,
                r.num_prompt_tokens(),
                r.num_computed_tokens() + scheduled,
                false,
            ),
            (None, None) => return,
        };
        let offloadable = {
            let mut n = after_batch.min(num_tokens);
            if let Some(m) = st.max_offload_tokens {
                n = n.min(m);
            }
            if self.config.offload_prompt_only {
                n = n.min(num_prompt);
            }
            n
        };
        let bpc = self.bpc();
        let tpc = self.tpc();
        let ngroups = self.groups.len();
        let storable = |st: &ReqState, g: usize| -> usize {
            ((offloadable / tpc) as usize)
                .min(st.block_ids[g].len() / bpc)
                .min(st.chunk_hashes.len())
        };
        let mut keys: Vec<OffloadKey> = Vec::new();
        let mut positions: Vec<u32> = Vec::new();
        let mut ranges: [(usize, usize); 8] = [(0, 0); 8];
        for (g, range) in ranges.iter_mut().enumerate().take(ngroups) {
            let num_chunks = storable(st, g);
            let start = st.next_stored_chunk[g] as usize;
            *range = (start, num_chunks);
            let need = self.swa_reachable(g);
            let table = &st.block_ids[g];
            for c in start..num_chunks {
                let blocks = &table[c * bpc..(c + 1) * bpc];
                if blocks[bpc - 1] == NULL_BLOCK {
                    continue;
                }
                // Blocks that can serve a hit: all, or the last `need` of the chunk.
                let first_reachable = match need {
                    None => 0,
                    Some(need) => bpc - need as usize,
                };
                if first_reachable >= bpc {
                    continue;
                }
                if blocks[first_reachable..].contains(&NULL_BLOCK) {
                    continue;
                }
                keys.push(st.key(c, g));
                positions.push((c as u32 + 1) * tpc);
            }
        }
        let advance = |st: &mut ReqState| {
            for g in 0..ngroups {
                let n = storable(st, g) as u32;
                st.next_stored_chunk[g] = st.next_stored_chunk[g].max(n);
            }
        };
        if keys.is_empty() {
            let st = self.requests.get_mut(&id).expect("looked up above");
            advance(st);
            return;
        }
        let out = self.manager.prepare_store(
            &keys,
            Access {
                request: Some(id),
                positions: Some(&positions),
            },
        );
        let Some(out) = out else {
            self.allocation_failures += 1;
            return;
        };
        let st = self.requests.get_mut(&id).expect("looked up above");
        if out.keys_to_store.is_empty() {
            advance(st);
            return;
        }
        let chunk_of: BTreeMap<OffloadKey, ChunkId> = out
            .keys_to_store
            .iter()
            .copied()
            .zip(out.chunks.iter().copied())
            .collect();
        let mut gpu = GpuSpec {
            block_ids: alloc::vec![Vec::new(); ngroups],
            block_indices: alloc::vec![0; ngroups],
        };
        let mut chunks: Vec<Vec<ChunkId>> = alloc::vec![Vec::new(); ngroups];
        let mut fenced = Vec::new();
        let mut deferred = Vec::new();
        for (g, &(start, num_chunks)) in ranges.iter().enumerate().take(ngroups) {
            let swa = matches!(self.groups[g], GroupKind::SlidingWindow { .. });
            let mut first: Option<u32> = None;
            for c in start..num_chunks {
                let Some(&chunk) = chunk_of.get(&st.key(c, g)) else {
                    continue;
                };
                chunks[g].push(chunk);
                for i in 0..bpc {
                    let b = st.block_ids[g][c * bpc + i];
                    if b == NULL_BLOCK {
                        continue;
                    }
                    first.get_or_insert((c * bpc + i) as u32);
                    gpu.block_ids[g].push(b);
                    if swa {
                        fenced.push(b);
                    } else {
                        deferred.push(b);
                    }
                }
            }
            gpu.block_indices[g] = first.unwrap_or(0);
            st.next_stored_chunk[g] = st.next_stored_chunk[g].max(num_chunks as u32);
        }
        let job = JobId(self.job_counter);
        self.job_counter += 1;
        // A store may join stores or a sync load, never an async load (I-39).
        if let Some(other) = st.jobs.iter().next()
            && let Some(o) = self.jobs.get(other)
            && !(o.is_store || o.is_sync_load)
        {
            let why = format!("store job {job:?} for {id:?} next to async load {other:?}");
            self.fail(why);
        }
        let st = self.requests.get_mut(&id).expect("looked up above");
        st.jobs.insert(job);
        for &b in &fenced {
            self.block_to_jobs.entry(b).or_default().insert(job);
        }
        if finished {
            for &b in &deferred {
                self.block_to_jobs.entry(b).or_default().insert(job);
                if self.batch.allocated.binary_search(&b).is_ok() {
                    self.batch.jobs_to_flush.insert(job);
                }
            }
        }
        self.jobs.insert(
            job,
            JobStatus {
                request: id,
                pending: self.config.num_workers,
                keys: out.keys_to_store,
                is_store: true,
                is_sync_load: false,
                fenced,
                deferred_fence: deferred,
            },
        );
        store_jobs.insert(
            job,
            TransferJob {
                request: id,
                gpu,
                chunks,
                sync: false,
            },
        );
    }

    /// `_update_req_states`.
    fn update_request_states(&mut self, view: &SchedulerView<'_>, out: &SchedulerOutput) {
        let bpc = self.bpc();
        let mut ends: BTreeMap<RequestId, Vec<usize>> = BTreeMap::new();
        for req in out.scheduled_requests() {
            let (id, blocks, full) = (req.id, req.block_ids, req.full_table);
            let Some(st) = self.requests.get_mut(&id) else {
                continue;
            };
            if let Some(r) = view.request(id) {
                st.update_keys(r.block_hashes(), bpc);
            }
            if full {
                st.block_ids.iter_mut().for_each(Vec::clear);
            }
            if blocks.is_empty() {
                continue;
            }
            if !self.swa_groups.is_empty() {
                ends.insert(
                    id,
                    self.swa_groups
                        .iter()
                        .map(|&g| st.block_ids[g].len())
                        .collect(),
                );
            }
            for (g, table) in st.block_ids.iter_mut().enumerate() {
                let Some(new_blocks) = blocks.get(g) else {
                    continue;
                };
                table.extend_from_slice(new_blocks);
                self.batch
                    .allocated
                    .extend(new_blocks.iter().copied().filter(|&b| b != NULL_BLOCK));
            }
        }
        // The allocated set is needed (sorted, for lookups) only with sliding-window groups, a
        // non-empty fence index, or finished requests whose stores get fenced at creation.
        if !self.swa_groups.is_empty()
            || !self.block_to_jobs.is_empty()
            || !out.finished_req_ids.is_empty()
        {
            self.batch.seal_allocated();
        }
        // Stale sliding-window entries (freed below the window, then reallocated) are zeroed.
        if !self.swa_groups.is_empty() && !self.batch.allocated.is_empty() {
            for (id, st) in self.requests.iter_mut() {
                let ends = ends.get(id);
                for (i, &g) in self.swa_groups.iter().enumerate() {
                    let start = st.next_stored_chunk[g] as usize * bpc;
                    let end = ends.map_or(st.block_ids[g].len(), |e| e[i]);
                    for j in start..end.min(st.block_ids[g].len()) {
                        if self
                            .batch
                            .allocated
                            .binary_search(&st.block_ids[g][j])
                            .is_ok()
                        {
                            st.block_ids[g][j] = NULL_BLOCK;
                        }
                    }
                }
            }
        }
    }

    fn remove_from_fence(&mut self, job: JobId, blocks: &[BlockId]) {
        for b in blocks {
            if let Some(set) = self.block_to_jobs.get_mut(b) {
                set.remove(&job);
                if set.is_empty() {
                    self.block_to_jobs.remove(b);
                }
            }
        }
    }

    /// Checks I-38…I-46 (connector side) and the manager's own invariants (I-40).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.manager.check_invariants()?;
        for (&id, j) in &self.jobs {
            ensure_invariant!(
                id.0 >= self.stale_job_threshold && id.0 < self.job_counter,
                "I-38",
                "job {id:?} outside [{}, {})",
                self.stale_job_threshold,
                self.job_counter
            );
            ensure_invariant!(
                j.pending >= 1 && j.pending <= self.config.num_workers,
                "I-38",
                "job {id:?} has pending count {}",
                j.pending
            );
            ensure_invariant!(
                self.requests
                    .get(&j.request)
                    .is_some_and(|r| r.jobs.contains(&id)),
                "I-39",
                "job {id:?} not listed by its request {:?}",
                j.request
            );
        }
        for &id in self.reset_fence.keys() {
            ensure_invariant!(
                id.0 < self.stale_job_threshold,
                "I-45",
                "reset-fenced job {id:?} is not stale"
            );
        }
        let mut listed = 0;
        for (&rid, r) in &self.requests {
            listed += r.jobs.len();
            let mut async_loads = 0;
            for id in &r.jobs {
                let Some(j) = self.jobs.get(id) else {
                    return Err(InvariantViolation::new(
                        "I-39",
                        format!("{rid:?} lists unknown job {id:?}"),
                    ));
                };
                ensure_invariant!(
                    j.request == rid,
                    "I-39",
                    "{rid:?} lists job {id:?} of {:?}",
                    j.request
                );
                async_loads += usize::from(!j.is_store && !j.is_sync_load);
            }
            ensure_invariant!(
                async_loads == 0 || r.jobs.len() == 1,
                "I-39",
                "{rid:?} has an async load next to other jobs"
            );
            let loads = r.jobs.iter().filter(|id| !self.jobs[id].is_store).count();
            ensure_invariant!(loads <= 1, "I-39", "{rid:?} has {loads} load jobs");
            ensure_invariant!(
                !r.finished_signaled || !r.jobs.is_empty(),
                "I-48",
                "{rid:?} finished and idle but still tracked"
            );
        }
        // I-44: `on_request_finished` comes after the request's last `prepare_store` and is
        // the last call about it: no scope stays open for a request already signalled finished,
        // or for one the connector no longer tracks (it would never be closed).
        for rid in self.manager.scoped_requests() {
            let open = self
                .requests
                .get(&rid)
                .is_some_and(|r| !r.finished_signaled);
            ensure_invariant!(
                open,
                "I-44",
                "the manager keeps an access scope for {rid:?}, already finished or untracked"
            );
        }
        ensure_invariant!(
            listed == self.jobs.len(),
            "I-39",
            "requests list {listed} jobs, {} in flight",
            self.jobs.len()
        );
        for (b, set) in &self.block_to_jobs {
            ensure_invariant!(!set.is_empty(), "I-41", "block {} has an empty fence", b.0);
            for id in set {
                let Some(j) = self.jobs.get(id) else {
                    return Err(InvariantViolation::new(
                        "I-41",
                        format!("block {} fenced by finished job {id:?}", b.0),
                    ));
                };
                let finished = self.requests[&j.request].finished.is_some();
                ensure_invariant!(
                    j.fenced.contains(b) || (finished && j.deferred_fence.contains(b)),
                    "I-41",
                    "block {} fenced by job {id:?} that does not read it",
                    b.0
                );
            }
        }
        for (id, j) in &self.jobs {
            let finished = self.requests[&j.request].finished.is_some();
            let watched = j
                .fenced
                .iter()
                .chain(j.deferred_fence.iter().filter(|_| finished));
            for b in watched {
                ensure_invariant!(
                    self.block_to_jobs.get(b).is_some_and(|s| s.contains(id)),
                    "I-41",
                    "job {id:?} reads block {} that is not fenced",
                    b.0
                );
            }
        }
        if let Some(loading) = &self.chunks_being_loaded {
            for k in loading {
                ensure_invariant!(
                    self.jobs
                        .values()
                        .any(|j| !j.is_store && !j.is_sync_load && j.keys.contains(k)),
                    "I-43",
                    "key {k:?} marked as being loaded without an async load"
                );
            }
        }
        Ok(())
    }
}

impl SchedulerConnector for OffloadingConnector {
    type Meta = OffloadingConnectorMeta;
    type WorkerMeta = Meta;

    fn on_new_request(&mut self, view: &SchedulerView<'_>, request: RequestId) {
        let st = ReqState::new(
            self.groups.len(),
            param_u32(view, request, "max_load_tokens"),
            param_u32(view, request, "max_offload_tokens"),
        );
        self.requests.insert(request, st);
    }

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let bpc = self.bpc();
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        let Some(st) = self.requests.get_mut(&request) else {
            return Lookup::MISS;
        };
        for g in 0..st.block_ids.len() {
            st.block_ids[g].clear();
            st.next_stored_chunk[g] = 0;
        }
        if !st.jobs.is_empty() {
            // Still in flight (e.g. preempted with unflushed stores): ask again (issue #46014).
            return Lookup::Pending;
        }
        st.update_keys(r.block_hashes(), bpc);
        st.num_locally_computed_tokens = num_computed_tokens;
        let num_tokens = r.tokens().len() as u32;
        let st = &self.requests[&request];
        let Some(hit) = self.lookup_chunks(st, num_tokens) else {
            return Lookup::Pending;
        };
        // `_reserve_sync_load`.
        self.batch.sync_loads.remove(&request);
        let budget = self.config.sync_load_budget_tokens;
        let sync = budget > 0
            && hit > 0
            && num_computed_tokens + hit < num_tokens
            && self.batch.sync_load_tokens + hit <= budget;
        if sync {
            self.batch.sync_load_tokens += hit;
            self.batch.sync_loads.insert(request);
        }
        Lookup::Hit {
            tokens: hit,
            load_async: hit > 0 && !sync,
        }
    }

    fn update_state_after_alloc(
        &mut self,
        _view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        for group in blocks {
            self.batch
                .allocated
                .extend(group.iter().copied().filter(|&b| b != NULL_BLOCK));
        }
        if num_external_tokens == 0 {
            return;
        }
        let bs = self.block_size;
        let bpc = self.bpc();
        let tpc = self.tpc();
        let sync = self.batch.sync_loads.contains(&request);
        let Some(st) = self.requests.get_mut(&request) else {
            self.fail(format!("load for untracked request {request:?}"));
            return;
        };
        let local = st.num_locally_computed_tokens;
        let cached = local + num_external_tokens;
        let ngroups = st.block_ids.len();
        let mut keys = Vec::new();
        let mut key_chunks = Vec::new();
        let mut per_group_keys = alloc::vec![0usize; ngroups];
        let mut gpu = GpuSpec {
            block_ids: alloc::vec![Vec::new(); ngroups],
            block_indices: alloc::vec![0; ngroups],
        };
        let num_chunks = cdiv(cached, tpc) as usize;
        for (g, group_keys) in per_group_keys.iter_mut().enumerate() {
            let table = blocks.get(g).map_or(&[][..], Vec::as_slice);
            let num_gpu_blocks = (cdiv(cached, bs) as usize).min(table.len());
            let first_fresh = cdiv(local, bs) as usize;
            // Fresh (unhashed) blocks start at the local hit; nulls lie below a window.
            let start = (first_fresh..num_gpu_blocks)
                .find(|&i| table[i] != NULL_BLOCK)
                .unwrap_or(num_gpu_blocks);
            if start < num_gpu_blocks {
                let first_chunk = start / bpc;
                for c in first_chunk..num_chunks.min(st.chunk_hashes.len()) {
                    keys.push(st.key(c, g));
                    key_chunks.push(c);
                    *group_keys += 1;
                }
            }
            gpu.block_ids[g] = table[start..num_gpu_blocks].to_vec();
            gpu.block_indices[g] = start as u32;
            // CHUNK_LEVEL: chunks hit (locally or loaded) are not offered for storing.
            st.next_stored_chunk[g] = num_chunks as u32;
        }
        let positions: Vec<u32> = key_chunks.iter().map(|&c| (c as u32 + 1) * tpc).collect();
        let host = match self.manager.prepare_load(
            &keys,
            Access {
                request: Some(request),
                positions: Some(&positions),
            },
        ) {
            Ok(h) => h,
            Err(e) => {
                self.fail(format!("prepare_load for {request:?} failed: {e:?}"));
                return;
            }
        };
        let mut chunks = Vec::with_capacity(ngroups);
        let mut it = host.into_iter();
        for n in per_group_keys {
            chunks.push(it.by_ref().take(n).collect::<Vec<ChunkId>>());
        }
        let job = self.new_job_id();
        if !self.requests[&request].jobs.is_empty() {
            // A load is created only for a request without jobs (I-39; vLLM asserts).
            self.fail(format!(
                "load job {job:?} for {request:?} with jobs in flight"
            ));
        }
        let st = self.requests.get_mut(&request).expect("looked up above");
        st.jobs.insert(job);
        if !sync && let Some(loading) = &mut self.chunks_being_loaded {
            loading.extend(keys.iter().copied());
        }
        self.jobs.insert(
            job,
            JobStatus {
                request,
                pending: self.config.num_workers,
                keys,
                is_store: false,
                is_sync_load: sync,
                fenced: Vec::new(),
                deferred_fence: Vec::new(),
            },
        );
        self.batch.load_jobs.insert(
            job,
            TransferJob {
                request,
                gpu,
                chunks,
                sync,
            },
        );
    }

    fn build_connector_meta(
        &mut self,
        view: &SchedulerView<'_>,
        output: &SchedulerOutput,
    ) -> OffloadingConnectorMeta {
        self.update_request_states(view, output);
        // Jobs of preempted requests, except loads created in this very batch.
        for id in output.preempted_req_ids.iter() {
            let Some(st) = self.requests.get(id) else {
                continue;
            };
            for j in &st.jobs {
                if !self.batch.load_jobs.contains_key(j) {
                    self.batch.jobs_to_flush.insert(*j);
                }
            }
        }
        // Jobs reading a block reallocated in this step.
        if !self.block_to_jobs.is_empty() {
            for b in &self.batch.allocated {
                if let Some(set) = self.block_to_jobs.get(b) {
                    self.batch.jobs_to_flush.extend(set.iter().copied());
                }
            }
        }
        let mut store_jobs = BTreeMap::new();
        for &(id, n) in &output.num_scheduled_tokens {
            self.build_store_job(view, id, n, &mut store_jobs);
        }
        for &id in output.finished_req_ids.iter() {
            self.build_store_job(view, id, 0, &mut store_jobs);
        }
        let batch = core::mem::take(&mut self.batch);
        let meta = OffloadingConnectorMeta {
            load_jobs: batch.load_jobs,
            store_jobs,
            jobs_to_flush: SortedSet::from_vec(batch.jobs_to_flush.into_iter().collect()),
        };
        for &id in output.finished_req_ids.iter() {
            let Some(st) = self.requests.get_mut(&id) else {
                continue;
            };
            st.finished_signaled = true;
            let idle = st.jobs.is_empty();
            self.manager.on_request_finished(id);
            if idle {
                self.requests.remove(&id);
            }
        }
        meta
    }

    fn update_connector_output(
        &mut self,
        _view: &SchedulerView<'_>,
        output: &AggregatedOutput<Meta>,
    ) {
        let meta = match &output.worker_meta {
            None => return,
            Some(Meta::Offload(m)) => m,
            Some(other) => {
                let why = format!("worker metadata of form `{}`", other.form());
                self.fail(why);
                return;
            }
        };
        for (job, count) in meta.completed_jobs() {
            if count == 0 {
                self.fail(format!("job {job:?} acknowledged with count 0"));
                continue;
            }
            if job.0 < self.stale_job_threshold {
                if let Some(left) = self.reset_fence.get_mut(&job) {
                    *left = left.saturating_sub(count);
                    if *left == 0 {
                        self.reset_fence.remove(&job);
                        if self.reset_fence.is_empty() {
                            self.resets_flushed += 1;
                        }
                    }
                }
                continue;
            }
            let Some(j) = self.jobs.get_mut(&job) else {
                self.fail(format!("acknowledgement for unknown job {job:?}"));
                continue;
            };
            if count > j.pending {
                let why = format!("job {job:?} acknowledged {count} times, {} due", j.pending);
                self.fail(why);
                continue;
            }
            j.pending -= count;
            if j.pending > 0 {
                continue;
            }
            let j = self.jobs.remove(&job).expect("present above");
            if j.is_store {
                self.manager.complete_store(&j.keys, true);
            } else {
                if let Err(e) = self.manager.complete_load(&j.keys) {
                    self.fail(format!("complete_load of job {job:?} failed: {e:?}"));
                }
                if let Some(loading) = &mut self.chunks_being_loaded {
                    for k in &j.keys {
                        loading.remove(k);
                    }
                }
            }
            let finished = self
                .requests
                .get(&j.request)
                .is_some_and(|r| r.finished.is_some());
            if !self.block_to_jobs.is_empty() {
                self.remove_from_fence(job, &j.fenced);
                if finished {
                    self.remove_from_fence(job, &j.deferred_fence);
                }
            }
            if let Some(st) = self.requests.get_mut(&j.request) {
                st.jobs.remove(&job);
                if st.finished_signaled && st.jobs.is_empty() {
                    self.requests.remove(&j.request);
                }
            }
        }
    }

    fn request_finished(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        _blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        let bpc = self.bpc();
        let Some(st) = self.requests.get_mut(&request) else {
            // Untracked: nothing in flight, nothing deferred; finalize at once.
            self.manager.on_request_finished(request);
            return FinishDecision::default();
        };
        if let Some(r) = view.request(request) {
            st.update_keys(r.block_hashes(), bpc);
            st.finished = Some(Finished {
                aborted: r.status() == RequestStatus::FinishedAborted,
                num_tokens: r.tokens().len() as u32,
                num_prompt_tokens: r.num_prompt_tokens(),
                num_computed_tokens: r.num_computed_tokens(),
            });
        }
        for job in &st.jobs {
            if let Some(j) = self.jobs.get(job) {
                for &b in &j.deferred_fence {
                    self.block_to_jobs.entry(b).or_default().insert(*job);
                }
            }
        }
        FinishDecision::default()
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        for e in self.manager.take_events() {
            if e.removed {
                // One removal per group (the placeholder payload of vLLM's events tracker).
                let mut by_group: BTreeMap<u32, Vec<BlockHash>> = BTreeMap::new();
                for k in &e.keys {
                    by_group.entry(k.group).or_default().push(k.hash);
                }
                for (g, hashes) in by_group {
                    out.push(KvEvent(format!(
                        "BlockRemoved(medium=CPU, group={g}, hashes={:?})",
                        hashes.iter().map(|h| h.0).collect::<Vec<u64>>()
                    )));
                }
            } else {
                for k in &e.keys {
                    out.push(KvEvent(format!(
                        "BlockStored(medium=CPU, group={}, hashes=[{}], block_size=0)",
                        k.group, k.hash.0
                    )));
                }
            }
        }
        out
    }

    fn take_error(&mut self) -> Option<String> {
        self.error.take()
    }

    fn has_pending_push_work(&self) -> bool {
        !self.jobs.is_empty() || !self.reset_fence.is_empty() || self.manager.has_pending_work()
    }

    fn meta_is_empty(&self, meta: &OffloadingConnectorMeta) -> bool {
        meta.load_jobs.is_empty() && meta.store_jobs.is_empty() && meta.jobs_to_flush.is_empty()
    }

    fn tracks_request(&self, request: RequestId) -> bool {
        self.tracks(request)
    }

    /// `reset_cache`. vLLM asserts that no step is half-built; the one case reachable between
    /// steps — a second reset before the first one's flush was delivered — answers `Some(false)`
    /// here and changes nothing.
    fn reset_cache(&mut self) -> Option<bool> {
        if !self.batch.load_jobs.is_empty()
            || !self.batch.sync_loads.is_empty()
            || !self.batch.jobs_to_flush.is_empty()
            || !self.batch.allocated.is_empty()
        {
            return Some(false);
        }
        self.batch.jobs_to_flush.extend(self.jobs.keys().copied());
        let finished: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.finished.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in finished {
            let st = self.requests.remove(&id).expect("listed above");
            if !st.finished_signaled {
                self.manager.on_request_finished(id);
            }
        }
        self.manager.reset();
        for st in self.requests.values_mut() {
            st.next_stored_chunk.iter_mut().for_each(|n| *n = 0);
            st.jobs.clear();
        }
        self.stale_job_threshold = self.job_counter;
        if !self.jobs.is_empty() {
            for (&id, j) in &self.jobs {
                self.reset_fence.insert(id, j.pending);
            }
        } else if self.reset_fence.is_empty() {
            self.resets_flushed += 1;
        }
        self.jobs.clear();
        self.block_to_jobs.clear();
        if let Some(loading) = &mut self.chunks_being_loaded {
            loading.clear();
        }
        Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::offload_manager::PolicyKind;

    fn connector() -> OffloadingConnector {
        let manager = ManagerConfig {
            capacity_chunks: 8,
            policy: PolicyKind::Lru,
            store_threshold: 0,
        };
        OffloadingConnector::new(
            OffloadingConfig::new(2, 1, manager),
            &SchedulerConfig::default(),
        )
        .unwrap()
    }

    /// A job of `kind`: `'s'` store, `'l'` async load, `'y'` sync load.
    fn job(request: RequestId, kind: char) -> JobStatus {
        JobStatus {
            request,
            pending: 1,
            keys: Vec::new(),
            is_store: kind == 's',
            is_sync_load: kind == 'y',
            fenced: Vec::new(),
            deferred_fence: Vec::new(),
        }
    }

    /// A connector with jobs 0.. (one per kind, all of request 1, listed by it).
    fn with_jobs(kinds: &str) -> OffloadingConnector {
        let mut conn = connector();
        let r = RequestId(1);
        let mut st = ReqState::new(1, None, None);
        for (i, kind) in kinds.chars().enumerate() {
            let id = conn.new_job_id();
            assert_eq!(id, JobId(i as u64));
            conn.jobs.insert(id, job(r, kind));
            st.jobs.insert(id);
        }
        conn.requests.insert(r, st);
        conn
    }

    /// A connector with `groups` (block size 4, 3 blocks per chunk: 12-token chunks) and a
    /// request whose chunk keys in group `g` are as `patterns[g]` says, chunk by chunk: `h`
    /// stored, `p` being stored (write-pending), `.` missing.
    fn lookup_fixture(groups: &[GroupKind], patterns: &[&str]) -> (OffloadingConnector, ReqState) {
        let sched = SchedulerConfig {
            block_size: 4,
            groups: groups.to_vec(),
            ..SchedulerConfig::default()
        };
        let manager = ManagerConfig {
            capacity_chunks: 64,
            policy: PolicyKind::Lru,
            store_threshold: 0,
        };
        let mut conn = OffloadingConnector::new(OffloadingConfig::new(3, 1, manager), &sched)
            .expect("a valid configuration");
        let mut st = ReqState::new(groups.len(), None, None);
        st.chunk_hashes = (0..patterns[0].len() as u64)
            .map(|c| BlockHash(1000 + c))
            .collect();
        for (g, pattern) in patterns.iter().enumerate() {
            for (c, kind) in pattern.chars().enumerate() {
                if kind == '.' {
                    continue;
                }
                let key = [st.key(c, g)];
                let access = Access {
                    request: None,
                    positions: None,
                };
                let out = conn.manager.prepare_store(&key, access).expect("room");
                assert_eq!(out.keys_to_store, key);
                if kind == 'h' {
                    conn.manager.complete_store(&key, true);
                }
            }
        }
        (conn, st)
    }

    /// `lookup_chunks` for a fresh request of `num_tokens` tokens: `(locally computed tokens,
    /// max_load_tokens)`.
    fn hit(
        groups: &[GroupKind],
        patterns: &[&str],
        num_tokens: u32,
        bounds: (u32, Option<u32>),
    ) -> Option<u32> {
        let (conn, mut st) = lookup_fixture(groups, patterns);
        st.num_locally_computed_tokens = bounds.0;
        st.max_load_tokens = bounds.1;
        conn.lookup_chunks(&st, num_tokens)
    }

    #[test]
    fn the_sliding_window_lookup_on_holes_and_write_pending_keys() {
        // `_sliding_window_lookup` scans from the end for a window's worth of consecutive
        // chunks (16 tokens: 2 chunks); a run reaching chunk 0 is a hit however short; a
        // write-pending key inside the chosen run means "ask again" (`None`), one outside it
        // does not matter. 49 tokens: at most 48 hit (the last token is recomputed).
        let swa = [GroupKind::SlidingWindow { window: 16 }];
        for (pattern, want) in [
            ("hhhh", Some(48)),
            (".hhh", Some(48)),
            ("..hh", Some(48)),
            ("h.hh", Some(48)),
            ("p.hh", Some(48)),
            ("hhh.", Some(36)),
            ("hh.h", Some(24)), // the last chunk alone is no window
            ("h...", Some(12)), // a run at the start needs no whole window
            (".h.h", Some(0)),
            ("...h", Some(0)),
            ("hhhp", None),
            ("h.hp", None),
            ("hp.h", None),
            ("ph.h", None),
        ] {
            assert_eq!(hit(&swa, &[pattern], 49, (0, None)), want, "{pattern}");
        }
        // A chunk-aligned prompt hits one token short of its end.
        assert_eq!(hit(&swa, &["h.hh"], 48, (0, None)), Some(47));
        // After a local hit of one chunk the scan starts at chunk 1.
        assert_eq!(hit(&swa, &[".h.h"], 49, (12, None)), Some(12));
    }

    #[test]
    fn the_prefix_lookup_stops_at_the_first_miss() {
        // `_maximal_prefix_lookup`: consecutive keys from the first uncomputed chunk; a
        // write-pending key before the first miss means "ask again".
        let full = [GroupKind::FullAttention];
        for (pattern, want) in [
            ("hhhh", Some(48)),
            ("hh.h", Some(24)),
            ("hh.p", Some(24)),
            (".hhh", Some(0)),
            ("hhp.", None),
            ("p...", None),
        ] {
            assert_eq!(hit(&full, &[pattern], 49, (0, None)), want, "{pattern}");
        }
        assert_eq!(hit(&full, &[".hhh"], 49, (12, None)), Some(36));
    }

    #[test]
    fn max_load_tokens_bounds_the_hit_to_whole_chunks_past_the_local_hit() {
        let full = [GroupKind::FullAttention];
        for (bounds, want) in [
            ((0, Some(30)), Some(24)),
            ((12, Some(30)), Some(24)),
            ((12, Some(36)), Some(36)),
            ((0, Some(11)), Some(0)),
            ((0, Some(100)), Some(48)),
            ((24, Some(12)), Some(12)),
        ] {
            assert_eq!(hit(&full, &["hhhh"], 49, bounds), want, "{bounds:?}");
        }
    }

    #[test]
    fn the_hybrid_lookup_converges_on_a_hit_every_group_can_serve() {
        // `_lookup_complete_chunks`: full attention first, then sliding windows by decreasing
        // window; a group that shrinks the hit sends the lookup round again.
        let fa_swa = [
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 16 },
        ];
        assert_eq!(hit(&fa_swa, &["hhh.", "hhhh"], 49, (0, None)), Some(36));
        assert_eq!(hit(&fa_swa, &["hhhh", "hh.h"], 49, (0, None)), Some(24));
        // Full attention's write-pending chunk 3 defers, but the window group's hit ends at
        // chunk 1, so a second round looks again below chunk 3 and hits.
        assert_eq!(hit(&fa_swa, &["hhhp", "hh.h"], 49, (0, None)), Some(24));
        assert_eq!(hit(&fa_swa, &["hhhp", "hhhh"], 49, (0, None)), None);
        // Two windows, 40 tokens (4 chunks) then 16 (2): the 16-token group cuts the hit to
        // 48, where the 40-token group's window (tokens 8..48) reaches the missing chunk 1, so
        // the hit falls to the run at the start, 12 tokens.
        let two = [
            GroupKind::SlidingWindow { window: 16 },
            GroupKind::SlidingWindow { window: 40 },
        ];
        assert_eq!(hit(&two, &["hhhh.h", "h.hhhh"], 73, (0, None)), Some(12));
        assert_eq!(hit(&two, &["hhhh.h", "hhhhhh"], 73, (0, None)), Some(48));
    }

    #[test]
    fn sealing_sorts_and_dedups_the_allocated_blocks() {
        // The fence and stale-entry checks binary-search this list: allocation order is the
        // free queue's (not sorted), and a block may be reported twice in a step.
        let mut batch = Batch {
            allocated: [9, 3, 7, 3].map(BlockId).to_vec(),
            ..Batch::default()
        };
        batch.seal_allocated();
        assert_eq!(batch.allocated, [3, 7, 9].map(BlockId));
        assert!(batch.allocated_sealed);
    }

    #[test]
    fn check_invariants_rejects_corrupt_job_tables() {
        // cargo-mutants survivors: the public calls never build these states, so only a
        // corrupted connector shows that each check looks at all.
        // Stores plus a sync load are fine.
        assert_eq!(with_jobs("ssy").check_invariants(), Ok(()));
        let mut unlisted = with_jobs("s");
        unlisted
            .requests
            .get_mut(&RequestId(1))
            .unwrap()
            .jobs
            .clear();
        let e = unlisted.check_invariants().unwrap_err();
        assert!(format!("{e:?}").contains("not listed"), "{e:?}");
        // An async load only ever runs alone.
        let e = with_jobs("ls").check_invariants().unwrap_err();
        assert!(format!("{e:?}").contains("async load next to"), "{e:?}");
    }
}
