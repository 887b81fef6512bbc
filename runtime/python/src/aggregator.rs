//! `kvrelay.KVOutputAggregator`: vLLM 0.33's `KVOutputAggregator` (its executor calls
//! `aggregate(outputs, output_rank)` once per step with every rank's `ModelRunnerOutput`, and
//! `ft_defer_kv_connector_outputs` with the outputs of a step in which a rank failed).
//!
//! The counting — which request ids every rank has finished, the quorum and its changes, failed
//! loads, salvaged outputs — is kvrelay-core's [`Aggregator`], in vLLM's mode (`compat`) unless
//! `strict=True`. What vLLM leaves to the objects themselves stays theirs: worker metadata and
//! connector stats are folded with their own `.aggregate()`, KV events with `add_events` and
//! `increment_workers`, in vLLM's order (salvaged outputs first, then rank by rank). The one
//! exception is vLLM's own `OffloadingWorkerMetadata`, whose fold is computed in one pass with
//! the same result (`offload_meta.rs` says when).
//!
//! Departures from vLLM, each where vLLM would fail later or in a worse way: a quorum below 1 is
//! a `ValueError` (vLLM would never emit an id); request ids must be `str` (`TypeError`); a call
//! that raises leaves the counts as they were (vLLM may have counted part of it).

use kvrelay_core::{Aggregator, Direction, Mode, Rank, RequestId, SortedSet, WorkerOutput};
use pyo3::exceptions::{PyAssertionError, PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyList, PySet, PyType};

use crate::ids::Ids;
use crate::offload_meta;

/// vLLM's `KVOutputAggregator`, counting in kvrelay-core.
#[pyclass(module = "kvrelay", name = "KVOutputAggregator")]
#[derive(Debug)]
pub(crate) struct KvOutputAggregator {
    core: Aggregator,
    ids: Ids,
    /// The salvaged `KVConnectorOutput` objects (their events dropped): their metadata and stats
    /// fold first at the next `aggregate`, as their counts do in the core.
    salvaged: Vec<Py<PyAny>>,
}

/// vLLM's `KVConnectorOutput` class, imported once.
static KV_CONNECTOR_OUTPUT: GILOnceCell<Py<PyType>> = GILOnceCell::new();

#[pymethods]
impl KvOutputAggregator {
    /// `KVOutputAggregator(expected_finished_count, *, strict=False)`.
    #[new]
    #[pyo3(signature = (expected_finished_count, *, strict = false))]
    fn new(expected_finished_count: i64, strict: bool) -> PyResult<Self> {
        let quorum = u32::try_from(expected_finished_count)
            .ok()
            .filter(|&q| q >= 1)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "expected_finished_count must be between 1 and 2^32-1, got {expected_finished_count}"
                ))
            })?;
        let mode = if strict { Mode::Strict } else { Mode::Compat };
        Ok(Self {
            core: Aggregator::new(quorum, mode),
            ids: Ids::default(),
            salvaged: Vec::new(),
        })
    }

    /// vLLM's `from_connector`: the quorum is `connector.get_finished_count() or world_size`.
    #[classmethod]
    #[pyo3(signature = (connector, world_size, *, strict = false))]
    fn from_connector(
        cls: &Bound<'_, PyType>,
        connector: &Bound<'_, PyAny>,
        world_size: i64,
        strict: bool,
    ) -> PyResult<Py<PyAny>> {
        let count = connector.call_method0("get_finished_count")?;
        let quorum = if count.is_truthy()? {
            count
        } else {
            world_size.into_pyobject(cls.py())?.into_any()
        };
        let kwargs = PyDict::new(cls.py());
        kwargs.set_item("strict", strict)?;
        Ok(cls.call((quorum,), Some(&kwargs))?.unbind())
    }

    /// The quorum in force (vLLM's `_expected_finished_count`).
    #[getter]
    fn expected_finished_count(&self) -> u32 {
        self.core.quorum()
    }

    /// The same, under vLLM's attribute name (read by vLLM's own tests).
    #[getter]
    fn _expected_finished_count(&self) -> u32 {
        self.core.quorum()
    }

    /// `{request id: reports still needed}` of the open send counts (vLLM's private dict, as a
    /// snapshot of the core's counts: for inspection and vLLM's own tests, not for the hot path).
    #[getter]
    fn _send_remaining_count<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.remaining(py, Direction::Send)
    }

    /// The same for the open receive counts.
    #[getter]
    fn _recv_remaining_count<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.remaining(py, Direction::Recv)
    }

    /// The salvaged `KVConnectorOutput` objects the next `aggregate` counts first (vLLM's
    /// private list, as a snapshot: for inspection and vLLM's own tests).
    #[getter]
    fn _salvaged_outputs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.salvaged.iter().map(|s| s.bind(py)))
    }

    /// Request ids the aggregator holds state for (open counts, pending failures).
    #[getter]
    fn live_request_ids(&self) -> usize {
        self.ids.len()
    }

    /// Folds one step's outputs; returns `outputs[output_rank]` with its `kv_connector_output`
    /// replaced by the fold, or `None` when that output is falsy (async scheduling's
    /// `execute_model` phase).
    #[pyo3(signature = (outputs, output_rank = 0))]
    fn aggregate<'py>(
        &mut self,
        outputs: &Bound<'py, PyAny>,
        output_rank: isize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = outputs.py();
        let n = outputs.len()?;
        let index = if output_rank < 0 {
            output_rank + n as isize
        } else {
            output_rank
        };
        if index < 0 || index as usize >= n {
            return Err(PyIndexError::new_err("list index out of range"));
        }
        let chosen = outputs.get_item(index as usize)?;
        if !chosen.is_truthy()? {
            return Ok(None);
        }
        let mut kv = Vec::with_capacity(n);
        for o in outputs.try_iter()? {
            let o = o?;
            if o.is_none() {
                return Err(PyAssertionError::new_err(
                    "a rank's ModelRunnerOutput is None",
                ));
            }
            kv.push(o.getattr(pyo3::intern!(py, "kv_connector_output"))?);
        }
        let mut seen = Seen::default();
        let converted = kv
            .iter()
            .map(|k| self.convert(k, &mut seen))
            .collect::<PyResult<Vec<_>>>()?;
        let folded = Folded::of(
            py,
            self.salvaged.iter().map(|s| s.bind(py)).chain(kv.iter()),
        )?;
        let out = self
            .core
            .aggregate(&converted, Rank(index as u32))
            .map_err(|e| PyValueError::new_err(e.to_string()))?
            .ok_or_else(|| {
                PyRuntimeError::new_err("kvrelay bug: the chosen rank's output vanished")
            })?;
        self.salvaged.clear();
        let kv_out = self.build_output(py, &out, folded)?;
        chosen.setattr(pyo3::intern!(py, "kv_connector_output"), kv_out)?;
        self.release_idle();
        Ok(Some(chosen))
    }

    /// vLLM's `ft_defer_kv_connector_outputs`: stashes a failed step's connector outputs (their
    /// KV events dropped) to be counted first at the next `aggregate`.
    fn ft_defer_kv_connector_outputs(
        &mut self,
        kv_connector_outputs: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = kv_connector_outputs.py();
        let mut stashed = Vec::new();
        for o in kv_connector_outputs.try_iter()? {
            let o = o?;
            if o.is_none() {
                continue;
            }
            o.setattr(pyo3::intern!(py, "kv_cache_events"), py.None())?;
            if !o.is_truthy()? {
                continue;
            }
            stashed.push(Some(
                self.convert(&o, &mut Seen::default())?.unwrap_or_default(),
            ));
            self.salvaged.push(o.unbind());
        }
        self.core.salvage(stashed);
        Ok(())
    }
}

impl KvOutputAggregator {
    /// One rank's `KVConnectorOutput` as the core's worker output (`None` or a falsy one: an
    /// empty output, which counts nothing — vLLM skips it); the ids it names are interned.
    /// `seen` holds the sets converted for earlier ranks of the same call: a set equal to the
    /// last one of its field (Python's equality, which vLLM's counting dicts use) reuses its
    /// conversion, as ranks mostly finish the same requests in the same step.
    fn convert<'py>(
        &mut self,
        kv: &Bound<'py, PyAny>,
        seen: &mut Seen<'py>,
    ) -> PyResult<Option<WorkerOutput>> {
        if kv.is_none() || !kv.is_truthy()? {
            return Ok(Some(WorkerOutput::default()));
        }
        let py = kv.py();
        let mut ids = |field: usize, name: &str| -> PyResult<Option<SortedSet<RequestId>>> {
            let set = kv.getattr(name)?;
            if set.is_none() {
                return Ok(None);
            }
            let exact = set.downcast_exact::<PySet>().is_ok();
            if let Some((last, ids)) = &seen[field]
                && exact
                && set.eq(last)?
            {
                return Ok(Some(ids.clone()));
            }
            let mut v = Vec::with_capacity(set.len().unwrap_or(0));
            for s in set.try_iter()? {
                let id = self.ids.intern(&s?)?;
                v.push(id);
            }
            let ids = SortedSet::from_vec(v);
            if exact {
                seen[field] = Some((set, ids.clone()));
            }
            Ok(Some(ids))
        };
        let finished_sending = ids(0, "finished_sending")?;
        let finished_recving = ids(1, "finished_recving")?;
        let failed_recving = ids(2, "failed_recving")?.unwrap_or_default();
        let mut blocks = Vec::new();
        for b in kv
            .getattr(pyo3::intern!(py, "invalid_block_ids"))?
            .try_iter()?
        {
            blocks.push(kvrelay_core::BlockId(b?.extract()?));
        }
        let expected: i64 = kv
            .getattr(pyo3::intern!(py, "expected_finished_count"))?
            .extract()?;
        Ok(Some(WorkerOutput {
            finished_sending,
            finished_recving,
            invalid_block_ids: SortedSet::from_vec(blocks),
            failed_recving,
            expected_finished_count: u32::try_from(expected.max(0)).unwrap_or(u32::MAX),
            worker_meta: None,
            kv_events: None,
        }))
    }

    /// vLLM's `KVConnectorOutput(...)` of the fold.
    fn build_output<'py>(
        &self,
        py: Python<'py>,
        out: &kvrelay_core::AggregatedOutput,
        folded: Folded<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let names = |set: &Option<SortedSet<RequestId>>| {
            set.as_ref()
                .map(|s| self.to_set(py, s.iter().copied()))
                .transpose()
        };
        let failed = self.to_set(py, out.failed_recving.iter().copied())?;
        let invalid = PySet::new(py, out.invalid_block_ids.iter().map(|b| b.0))?;
        let class = KV_CONNECTOR_OUTPUT.import(py, "vllm.v1.outputs", "KVConnectorOutput")?;
        let kw = PyDict::new(py);
        kw.set_item("finished_sending", names(&out.finished_sending)?)?;
        kw.set_item("finished_recving", names(&out.finished_recving)?)?;
        kw.set_item("kv_connector_stats", or_none(folded.stats)?)?;
        kw.set_item("kv_cache_events", or_none(folded.events)?)?;
        kw.set_item("kv_connector_worker_meta", or_none(folded.meta)?)?;
        kw.set_item("invalid_block_ids", invalid)?;
        kw.set_item("failed_recving", failed)?;
        kw.set_item("expected_finished_count", out.expected_finished_count)?;
        class.call((), Some(&kw))
    }

    fn to_set<'py>(
        &self,
        py: Python<'py>,
        ids: impl Iterator<Item = RequestId>,
    ) -> PyResult<Bound<'py, PySet>> {
        let v = ids
            .map(|id| self.ids.name(py, id))
            .collect::<PyResult<Vec<_>>>()?;
        PySet::new(py, v)
    }

    fn remaining<'py>(
        &self,
        py: Python<'py>,
        direction: Direction,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for id in self.ids.ids() {
            if let Some(n) = self.core.remaining(direction, id) {
                d.set_item(self.ids.name(py, id)?, n)?;
            }
        }
        Ok(d)
    }

    /// Releases, now and then, the ids the core no longer holds anything for.
    fn release_idle(&mut self) {
        let core = &self.core;
        self.ids.sweep_if_large(|id| core.is_idle(id));
    }
}

/// Per id-set field of `KVConnectorOutput` (sending, receiving, failed), the last exact `set`
/// converted in this call and its ids.
type Seen<'py> = [Option<(Bound<'py, PyAny>, SortedSet<RequestId>)>; 3];

/// `x or None`, Python's truthiness.
fn or_none(x: Option<Bound<'_, PyAny>>) -> PyResult<Option<Bound<'_, PyAny>>> {
    match x {
        Some(x) if x.is_truthy()? => Ok(Some(x)),
        _ => Ok(None),
    }
}

/// What vLLM folds with the objects' own methods: connector stats, worker metadata, KV events.
struct Folded<'py> {
    stats: Option<Bound<'py, PyAny>>,
    meta: Option<Bound<'py, PyAny>>,
    events: Option<Bound<'py, PyAny>>,
}

impl<'py> Folded<'py> {
    /// vLLM's loop over `chain(salvaged, kv_outputs)`, skipping falsy outputs. Worker metadata
    /// that is all vLLM's `OffloadingWorkerMetadata` is folded in one pass (`offload_meta.rs`:
    /// the same result, its `aggregate()` pure); any other is folded with its own `aggregate()`
    /// in vLLM's order.
    fn of<'a>(
        py: Python<'py>,
        outputs: impl Iterator<Item = &'a Bound<'py, PyAny>>,
    ) -> PyResult<Self>
    where
        'py: 'a,
    {
        let mut live = Vec::new();
        for kv in outputs {
            if !kv.is_none() && kv.is_truthy()? {
                live.push(kv);
            }
        }
        let metas = live
            .iter()
            .map(|kv| kv.getattr(pyo3::intern!(py, "kv_connector_worker_meta")))
            .collect::<PyResult<Vec<_>>>()?;
        let native = offload_meta::eligible(py, &metas);
        let mut f = Folded {
            stats: None,
            meta: None,
            events: None,
        };
        for (kv, meta) in live.into_iter().zip(&metas) {
            f.fold_stats(kv.getattr(pyo3::intern!(py, "kv_connector_stats"))?)?;
            if !native {
                f.fold_meta(meta.clone())?;
            }
            f.fold_events(kv.getattr(pyo3::intern!(py, "kv_cache_events"))?)?;
        }
        if native {
            f.fold_offload_meta(&metas)?;
        }
        Ok(f)
    }

    /// vLLM's metadata fold when every object is its `OffloadingWorkerMetadata`: the chain is the
    /// first non-`None` object, then every later truthy one; two or more are folded in one pass,
    /// or step by step as [`Folded::fold_meta`] folds them where `offload_meta::fold` declines.
    fn fold_offload_meta(&mut self, metas: &[Bound<'py, PyAny>]) -> PyResult<()> {
        let mut chain = Vec::with_capacity(metas.len());
        for m in metas {
            if chain.is_empty() && !m.is_none() || m.is_truthy()? {
                chain.push(m.clone());
            }
        }
        if chain.len() >= 2
            && let Some(folded) = offload_meta::fold(&chain)?
        {
            self.meta = Some(folded);
            return Ok(());
        }
        chain.into_iter().try_for_each(|m| self.fold_meta(m))
    }

    /// vLLM's step for `kv_connector_stats`: the first is the accumulator, each later truthy
    /// one is folded with `aggregate()`.
    fn fold_stats(&mut self, stats: Bound<'py, PyAny>) -> PyResult<()> {
        self.stats = Some(match self.stats.take().filter(|a| !a.is_none()) {
            None => stats,
            Some(acc) if stats.is_truthy()? => {
                same_type(&acc, &stats)?;
                acc.call_method1(pyo3::intern!(stats.py(), "aggregate"), (stats,))?
            }
            Some(acc) => acc,
        });
        Ok(())
    }

    /// The same for `kv_connector_worker_meta` (no type assertion in vLLM).
    fn fold_meta(&mut self, meta: Bound<'py, PyAny>) -> PyResult<()> {
        self.meta = Some(match self.meta.take().filter(|a| !a.is_none()) {
            None => meta,
            Some(acc) if meta.is_truthy()? => {
                acc.call_method1(pyo3::intern!(meta.py(), "aggregate"), (meta,))?
            }
            Some(acc) => acc,
        });
        Ok(())
    }

    /// vLLM's step for `kv_cache_events`: later truthy events are added to the first's.
    fn fold_events(&mut self, events: Bound<'py, PyAny>) -> PyResult<()> {
        let py = events.py();
        self.events = Some(match self.events.take().filter(|a| !a.is_none()) {
            None => events,
            Some(acc) if events.is_truthy()? => {
                same_type(&acc, &events)?;
                let all = events.call_method0(pyo3::intern!(py, "get_all_events"))?;
                acc.call_method1(pyo3::intern!(py, "add_events"), (all,))?;
                acc.call_method1(pyo3::intern!(py, "increment_workers"), (1,))?;
                acc
            }
            Some(acc) => acc,
        });
        Ok(())
    }
}

/// vLLM's `assert isinstance(acc, type(x))`.
fn same_type(acc: &Bound<'_, PyAny>, x: &Bound<'_, PyAny>) -> PyResult<()> {
    if acc.is_instance(&x.get_type())? {
        Ok(())
    } else {
        Err(PyAssertionError::new_err(format!(
            "cannot fold a {} into a {}",
            x.get_type().name()?,
            acc.get_type().name()?
        )))
    }
}
