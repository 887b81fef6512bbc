//! The offloading connector's scheduler side as a native class,
//! `kvrelay._kvrelay._OffloadScheduler`: kvrelay-core's [`OffloadingConnector`] (and the CPU
//! manager inside it) run beside vLLM 0.33's own `Scheduler` through a [`ShadowState`]. The
//! Python class `kvrelay.vllm.KvrelayOffloadingConnector` (`python/kvrelay/vllm.py`) wraps it:
//! it hands over the `Request` objects vLLM's scheduler passes, and turns the core's jobs into
//! vLLM's own `TransferJob`s for vLLM's worker.
//!
//! # When the wrapper calls what
//!
//! | vLLM's connector method | native call |
//! | --- | --- |
//! | `on_new_request` | `on_new_request(request)` |
//! | `get_num_new_matched_tokens` | `lookup(request, num_computed_tokens) -> (int \| None, bool)` |
//! | `update_state_after_alloc` | `after_alloc(request, block_ids, num_external_tokens)` |
//! | `build_connector_meta` | `build_meta(scheduler_output, requests) -> (loads, stores, flush)` |
//! | `update_connector_output` | `update_output(completed_jobs)` |
//! | `request_finished` | `request_finished(request, block_ids) -> bool` |
//! | `take_events` | `take_events() -> [(keys, removed)]` |
//! | `reset_cache`, `has_pending_push_work` | the same names |
//!
//! Every call that gets a `Request` first mirrors it into the shadow (status, token and hash
//! counts, computed tokens, preemptions, `kv_transfer_params`); tokens and hashes are mirrored
//! from where the shadow's copy ends, so a call costs the new tokens, not the request.
//! `build_meta` mirrors every scheduled and finished request it is given.
//!
//! vLLM's block hashes (`bytes`) are interned to the core's [`BlockHash`] (dense ids, freed in
//! sweeps once neither the shadow nor the connector names them); keys handed back are vLLM's
//! `OffloadKey` bytes (hash + 4-byte big-endian group). Where vLLM's connector asserts (an
//! acknowledgement for an unknown job, a count below zero), the core's contract error raises
//! `AssertionError` with the core's description; the connector keeps it (sticky).

use kvrelay_core::{
    AggregatedOutput, BlockHash, BlockId, CachedRequestData, GroupKind, JobId, Lookup,
    ManagerConfig, Meta, NewRequestData, OffloadMeta, OffloadingConfig, OffloadingConnector,
    OffloadingConnectorMeta, Params, RequestId, RequestMirror, RequestStatus, SchedulerConfig,
    SchedulerConnector, SchedulerOutput, ShadowState, SortedSet, StepId, TransferJob,
};
use pyo3::exceptions::{PyAssertionError, PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyTuple};

use crate::hashes::{Hashes, offload_key};
use crate::ids::Ids;
use crate::manager::{self, UnsupportedConfig};

/// Adds this file's class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OffloadScheduler>()
}

/// vLLM's block hash of a request (`bytes`), interned.
fn intern(hashes: &mut Hashes, hash: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    let b = hash.downcast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err("a request's block hashes are bytes (vLLM's BlockHash)")
    })?;
    Ok(hashes.intern(b.as_bytes(), b))
}

/// The core's status of vLLM's `RequestStatus` (an `IntEnum`, by its value in vLLM 0.33).
fn status(value: u32) -> PyResult<RequestStatus> {
    Ok(match value {
        1 | 2 | 4 => RequestStatus::Waiting, // WAITING, …_GRAMMAR, …_STREAMING_REQ
        3 => RequestStatus::WaitingForRemoteKvs,
        5 => RequestStatus::Running,
        6 => RequestStatus::Preempted,
        7 | 10 | 12 => RequestStatus::FinishedStopped, // STOPPED, IGNORED, REPETITION
        8 => RequestStatus::FinishedLengthCapped,
        9 => RequestStatus::FinishedAborted,
        11 => RequestStatus::FinishedError,
        v => {
            return Err(PyTypeError::new_err(format!(
                "unknown vLLM RequestStatus value {v}"
            )));
        }
    })
}

/// Block ids of one table per group (`tuple[list[int], ...]` or a list of lists).
fn tables(block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<BlockId>>> {
    block_ids
        .try_iter()?
        .map(|g| {
            g?.try_iter()?
                .map(|b| Ok(BlockId(b?.extract::<u64>()?)))
                .collect::<PyResult<Vec<BlockId>>>()
        })
        .collect()
}

/// A transfer job as the wrapper builds vLLM's from it: `(job id, request id, per-group GPU
/// block ids, per-group first table index, int32 chunk ids (group-major), sync)`.
fn job_tuple<'py>(
    py: Python<'py>,
    ids: &Ids,
    id: JobId,
    job: &TransferJob,
) -> PyResult<Bound<'py, PyTuple>> {
    let blocks: Vec<Vec<u64>> = job
        .gpu
        .block_ids
        .iter()
        .map(|g| g.iter().map(|b| b.0).collect())
        .collect();
    let chunks: Vec<u8> = job
        .chunks
        .iter()
        .flatten()
        .flat_map(|c| (c.0 as i32).to_ne_bytes())
        .collect();
    (
        id.0,
        ids.name(py, job.request)?,
        blocks,
        job.gpu.block_indices.clone(),
        PyByteArray::new(py, &chunks),
        job.sync,
    )
        .into_pyobject(py)
}

/// vLLM 0.33's offloading connector, scheduler side, on kvrelay-core. See the module docs.
#[pyclass(module = "kvrelay._kvrelay", name = "_OffloadScheduler", unsendable)]
#[derive(Debug)]
pub(crate) struct OffloadScheduler {
    conn: OffloadingConnector,
    shadow: ShadowState,
    ids: Ids,
    hashes: Hashes,
    step: u64,
    /// The first contract error, raised again by every later call (sticky).
    error: Option<String>,
}

impl OffloadScheduler {
    /// Mirrors vLLM's `request` into the shadow; its id.
    fn mirror(&mut self, request: &Bound<'_, PyAny>) -> PyResult<RequestId> {
        let id = self.ids.intern(&request.getattr("request_id")?)?;
        let (have_tokens, have_hashes) = self.shadow.lengths(id).unwrap_or((0, 0));
        let all = request.getattr("all_token_ids")?;
        let hashes = request.getattr("block_hashes")?;
        let (nt, nh) = (all.len()?, hashes.len()?);
        let (from_t, from_h) = (have_tokens.min(nt), have_hashes.min(nh));
        let tokens = (from_t..nt)
            .map(|i| all.get_item(i)?.extract::<u32>())
            .collect::<PyResult<Vec<u32>>>()?;
        let new_hashes = (from_h..nh)
            .map(|i| intern(&mut self.hashes, &hashes.get_item(i)?))
            .collect::<PyResult<Vec<BlockHash>>>()?;
        let params = params(&request.getattr("kv_transfer_params")?)?;
        let m = RequestMirror {
            status: status(request.getattr("status")?.extract()?)?,
            tokens: &tokens,
            num_prompt_tokens: request.getattr("num_prompt_tokens")?.extract()?,
            block_hashes: &new_hashes,
            num_computed_tokens: request.getattr("num_computed_tokens")?.extract()?,
            num_preemptions: request.getattr("num_preemptions")?.extract()?,
            kv_transfer_params: params.as_ref(),
            blocks: &[],
        };
        self.shadow
            .mirror_from(id, from_t, from_h, m)
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(id)
    }

    /// Raises the connector's contract error: the one the last call made, or an earlier one
    /// (vLLM asserts there; kvrelay's connector then refuses every later call).
    fn check(&mut self) -> PyResult<()> {
        if self.error.is_none() {
            self.error = self.conn.take_error().map(|e| format!("{e:?}"));
        }
        match &self.error {
            None => Ok(()),
            Some(e) => Err(PyAssertionError::new_err(format!("kvrelay connector: {e}"))),
        }
    }

    /// vLLM's `SchedulerOutput` as the core's.
    fn output(&mut self, so: &Bound<'_, PyAny>) -> PyResult<SchedulerOutput> {
        let mut out = SchedulerOutput {
            step: StepId(self.step),
            ..SchedulerOutput::default()
        };
        self.step += 1;
        for n in so.getattr("scheduled_new_reqs")?.try_iter()? {
            let n = n?;
            out.scheduled_new_reqs.push(NewRequestData {
                id: self.ids.intern(&n.getattr("req_id")?)?,
                block_ids: tables(&n.getattr("block_ids")?)?,
                num_computed_tokens: n.getattr("num_computed_tokens")?.extract()?,
            });
        }
        let c = so.getattr("scheduled_cached_reqs")?;
        let resumed = c.getattr("resumed_req_ids")?;
        let (new_blocks, computed) = (
            c.getattr("new_block_ids")?,
            c.getattr("num_computed_tokens")?,
        );
        for (i, r) in c.getattr("req_ids")?.try_iter()?.enumerate() {
            let r = r?;
            let nb = new_blocks.get_item(i)?;
            out.scheduled_cached_reqs.push(CachedRequestData {
                id: self.ids.intern(&r)?,
                resumed: resumed.contains(&r)?,
                new_block_ids: if nb.is_none() {
                    Vec::new()
                } else {
                    tables(&nb)?
                },
                num_computed_tokens: computed.get_item(i)?.extract()?,
            });
        }
        let scheduled = so.getattr("num_scheduled_tokens")?;
        for item in scheduled.downcast::<PyDict>()?.iter() {
            let n: u32 = item.1.extract()?;
            out.num_scheduled_tokens
                .push((self.ids.intern(&item.0)?, n));
        }
        out.total_num_scheduled_tokens = so.getattr("total_num_scheduled_tokens")?.extract()?;
        out.finished_req_ids = self.id_set(&so.getattr("finished_req_ids")?)?;
        out.preempted_req_ids = self.id_set(&so.getattr("preempted_req_ids")?)?;
        Ok(out)
    }

    fn id_set(&mut self, ids: &Bound<'_, PyAny>) -> PyResult<SortedSet<RequestId>> {
        if ids.is_none() {
            return Ok(SortedSet::new());
        }
        let v = ids
            .try_iter()?
            .map(|r| self.ids.intern(&r?))
            .collect::<PyResult<Vec<RequestId>>>()?;
        Ok(SortedSet::from_vec(v))
    }

    /// Sweeps the id and hash tables (amortized): an id is kept while the shadow or the
    /// connector holds its request, a hash while either may name it.
    fn sweep(&mut self) {
        if self.hashes.wants_sweep() {
            let (conn, view, ids) = (&self.conn, self.shadow.view(), &self.ids);
            let mirrored = ids
                .ids()
                .filter_map(|id| view.request(id))
                .flat_map(|r| r.block_hashes().iter().copied());
            self.hashes.sweep(conn.referenced_hashes().chain(mirrored));
        }
        let (conn, shadow) = (&self.conn, &self.shadow);
        self.ids
            .sweep_if_large(|id| !conn.tracks(id) && !shadow.contains(id));
    }

    fn meta<'py>(
        &self,
        py: Python<'py>,
        m: &OffloadingConnectorMeta,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let jobs = |jobs: &std::collections::BTreeMap<JobId, TransferJob>| {
            jobs.iter()
                .map(|(&id, j)| job_tuple(py, &self.ids, id, j))
                .collect::<PyResult<Vec<_>>>()
        };
        let flush: Vec<u64> = m.jobs_to_flush.iter().map(|j| j.0).collect();
        (jobs(&m.load_jobs)?, jobs(&m.store_jobs)?, flush).into_pyobject(py)
    }
}

/// `kv_transfer_params` as the core's params (keys and values by `str()`).
fn params(p: &Bound<'_, PyAny>) -> PyResult<Option<Params>> {
    if p.is_none() {
        return Ok(None);
    }
    let d = p.downcast::<PyDict>()?;
    let mut out = Params::new();
    for (k, v) in d.iter() {
        out.insert(k.str()?.to_string(), v.str()?.to_string());
    }
    Ok(Some(out))
}

#[pymethods]
impl OffloadScheduler {
    /// `groups`: per KV cache group, `None` (full attention) or its sliding window in tokens.
    #[new]
    #[pyo3(signature = (*, block_size, groups, blocks_per_chunk, num_workers, num_chunks, policy,
        store_threshold, max_tracker_size, offload_prompt_only, sync_load_budget_tokens,
        enable_prefix_caching, num_gpu_blocks, max_model_len))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: u32,
        groups: Vec<Option<u32>>,
        blocks_per_chunk: u32,
        num_workers: u32,
        num_chunks: u32,
        policy: &str,
        store_threshold: u32,
        max_tracker_size: usize,
        offload_prompt_only: bool,
        sync_load_budget_tokens: u32,
        enable_prefix_caching: bool,
        num_gpu_blocks: u32,
        max_model_len: u32,
    ) -> PyResult<Self> {
        let policy = manager::policy("eviction policy", policy)?;
        let scheduler = SchedulerConfig {
            block_size,
            num_gpu_blocks: num_gpu_blocks.max(2),
            groups: groups
                .iter()
                .map(|g| {
                    g.map_or(GroupKind::FullAttention, |window| {
                        GroupKind::SlidingWindow { window }
                    })
                })
                .collect(),
            max_model_len: max_model_len.max(1),
            enable_prefix_caching,
            ..SchedulerConfig::default()
        };
        let manager = ManagerConfig {
            capacity_chunks: num_chunks,
            policy,
            store_threshold,
        };
        let config = OffloadingConfig {
            offload_prompt_only,
            sync_load_budget_tokens,
            ..OffloadingConfig::new(blocks_per_chunk, num_workers, manager)
        };
        let bad = |e: String| UnsupportedConfig::new_err(e);
        let conn = OffloadingConnector::new(config, &scheduler)
            .map_err(|e| bad(e.to_string()))?
            .with_max_tracker_size(max_tracker_size);
        let shadow = ShadowState::new(scheduler).map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            conn,
            shadow,
            ids: Ids::default(),
            hashes: Hashes::default(),
            step: 0,
            error: None,
        })
    }

    fn on_new_request(&mut self, request: &Bound<'_, PyAny>) -> PyResult<()> {
        self.check()?;
        let id = self.mirror(request)?;
        self.conn.on_new_request(&self.shadow.view(), id);
        self.check()
    }

    /// `(None, False)` while pending, else `(tokens, load_async)`.
    fn lookup(
        &mut self,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: u32,
    ) -> PyResult<(Option<u32>, bool)> {
        self.check()?;
        let id = self.mirror(request)?;
        let l = self
            .conn
            .get_num_new_matched_tokens(&self.shadow.view(), id, num_computed_tokens);
        self.check()?;
        Ok(match l {
            Lookup::Pending => (None, false),
            Lookup::Hit { tokens, load_async } => (Some(tokens), load_async),
        })
    }

    fn after_alloc(
        &mut self,
        request: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        num_external_tokens: u32,
    ) -> PyResult<()> {
        self.check()?;
        let id = self.mirror(request)?;
        let blocks = tables(block_ids)?;
        self.conn
            .update_state_after_alloc(&self.shadow.view(), id, &blocks, num_external_tokens);
        self.check()
    }

    /// `requests`: every `Request` the step's output names (scheduled or finished) that vLLM
    /// still holds. Returns `(load jobs, store jobs, jobs to flush)`.
    fn build_meta<'py>(
        &mut self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
        requests: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        self.check()?;
        for r in requests.try_iter()? {
            self.mirror(&r?)?;
        }
        let out = self.output(scheduler_output)?;
        let meta = self.conn.build_connector_meta(&self.shadow.view(), &out);
        self.check()?;
        self.meta(py, &meta)
    }

    /// The aggregated `completed_jobs` of the step's worker metadata (`{job id: count}`).
    fn update_output(&mut self, completed_jobs: &Bound<'_, PyDict>) -> PyResult<()> {
        self.check()?;
        let counts = completed_jobs
            .iter()
            .map(|(k, v)| Ok((JobId(k.extract()?), v.extract::<u32>()?)))
            .collect::<PyResult<Vec<(JobId, u32)>>>()?;
        let output = AggregatedOutput {
            finished_sending: None,
            finished_recving: None,
            invalid_block_ids: SortedSet::new(),
            failed_recving: SortedSet::new(),
            worker_meta: Some(Meta::Offload(OffloadMeta::from_counts(counts))),
            kv_events: None,
            expected_finished_count: self.conn.config().num_workers,
        };
        self.conn
            .update_connector_output(&self.shadow.view(), &output);
        self.check()
    }

    /// Never delays the free (`False`). The request is forgotten by the shadow.
    fn request_finished(
        &mut self,
        request: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.check()?;
        let id = self.mirror(request)?;
        let blocks = tables(block_ids)?;
        let d = self.conn.request_finished(&self.shadow.view(), id, &blocks);
        self.check()?;
        self.shadow.remove(id);
        self.sweep();
        Ok(d.delay_free)
    }

    /// The manager's events since the last call: `(OffloadKey bytes list, removed)` each.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.conn.take_offload_events();
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            let keys = e
                .keys
                .iter()
                .map(|k| {
                    Ok(offload_key(
                        py,
                        self.hashes.object(py, k.hash)?.as_bytes(),
                        k.group,
                    ))
                })
                .collect::<PyResult<Vec<_>>>()?;
            out.push((keys, e.removed));
        }
        PyList::new(py, out)
    }

    fn reset_cache(&mut self) -> PyResult<bool> {
        self.check()?;
        let ok = self.conn.reset_cache();
        self.check()?;
        Ok(ok.unwrap_or(false))
    }

    fn has_pending_push_work(&self) -> bool {
        self.conn.has_pending_push_work()
    }

    /// Hashes the hash table holds (bounded: see `hashes.rs`).
    #[getter]
    fn interned_hashes(&self) -> usize {
        self.hashes.len()
    }

    /// Test seam: sweep the hash table after `slack` new hashes instead of 65,536.
    fn _set_hash_sweep_slack(&mut self, slack: usize) {
        self.hashes.slack = slack;
    }

    /// Jobs in flight, ascending.
    fn jobs_in_flight(&self) -> Vec<u64> {
        self.conn.jobs_in_flight().map(|j| j.0).collect()
    }

    /// Store allocation failures so far.
    fn allocation_failures(&self) -> u64 {
        self.conn.allocation_failures()
    }

    /// `(capacity, free, evictable, write-pending)` chunks of the CPU pool.
    fn usage(&self) -> (u32, u32, u32, u32) {
        manager::pool_usage(self.conn.manager())
    }

    /// The core's invariants (`I-38`…`I-45`); `AssertionError` naming the one broken.
    fn check_invariants(&self) -> PyResult<()> {
        SchedulerConnector::check_invariants(&self.conn)
            .map_err(|e| PyAssertionError::new_err(format!("{e:?}")))
    }
}
