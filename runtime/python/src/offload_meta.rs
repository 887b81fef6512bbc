//! vLLM's `OffloadingWorkerMetadata.aggregate` chain, computed in one pass.
//!
//! vLLM's aggregator folds the ranks' worker metadata pairwise with the objects' own
//! `aggregate()`. For vLLM's offloading connector each call copies the accumulated
//! `completed_jobs` dict, adds the other's counts into the copy and builds new `TransferStats`:
//! at W ranks, W - 1 dict copies. [`fold`] builds the chain's result at once — the counts summed
//! per job id in vLLM's order (first-seen keys first), byte counts and times summed left to right,
//! the sizes concatenated — which is what the last of vLLM's calls returns; the intermediate
//! objects no one else sees are not built.
//!
//! It does so only where the result is known to be the same: every object exactly vLLM's class
//! (no subclass), the three classes' `aggregate` as vLLM defines them (not replaced since this
//! module first looked), plain `int` job ids, counts and byte counts within 64 bits, `float` times,
//! `list` sizes. Otherwise it answers `None` and the caller calls the objects' own `aggregate()`,
//! as vLLM does.

use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyFloat, PyInt, PyList, PyType};
use rustc_hash::FxHashMap;

/// Where vLLM 0.33 defines the classes.
const MODULE: &str = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common";

/// vLLM's three classes and their `aggregate` functions as first seen (`None`: not importable,
/// so no object can be of them).
static CLASSES: GILOnceCell<Option<Classes>> = GILOnceCell::new();

#[derive(Debug)]
struct Classes {
    /// `OffloadingWorkerMetadata`, `TransferStats`, `DirectionalTransferStats`.
    meta: Py<PyType>,
    stats: Py<PyType>,
    directional: Py<PyType>,
    /// Their `aggregate`, in that order.
    aggregate: [Py<PyAny>; 3],
}

impl Classes {
    fn load(py: Python<'_>) -> PyResult<Self> {
        let m = py.import(MODULE)?;
        let class = |name: &str| -> PyResult<Py<PyType>> {
            Ok(m.getattr(name)?.downcast_into::<PyType>()?.unbind())
        };
        let (meta, stats, directional) = (
            class("OffloadingWorkerMetadata")?,
            class("TransferStats")?,
            class("DirectionalTransferStats")?,
        );
        let aggregate = [&meta, &stats, &directional].map(|c| {
            c.bind(py)
                .getattr(pyo3::intern!(py, "aggregate"))
                .map(Bound::unbind)
        });
        let [a, b, c] = aggregate;
        Ok(Self {
            meta,
            stats,
            directional,
            aggregate: [a?, b?, c?],
        })
    }

    /// Whether no class's `aggregate` was replaced since [`Classes::load`].
    fn unpatched(&self, py: Python<'_>) -> bool {
        [&self.meta, &self.stats, &self.directional]
            .iter()
            .zip(&self.aggregate)
            .all(|(c, f)| {
                c.bind(py)
                    .getattr(pyo3::intern!(py, "aggregate"))
                    .is_ok_and(|g| g.is(f))
            })
    }
}

/// Whether `x` is exactly an instance of `class`.
fn exactly(x: &Bound<'_, PyAny>, class: &Py<PyType>) -> bool {
    x.get_type().is(class)
}

/// Whether some object in `metas` is not `None` and every such object is exactly vLLM's
/// `OffloadingWorkerMetadata`, its classes unpatched: then [`fold`] may be tried on the chain.
pub(crate) fn eligible(py: Python<'_>, metas: &[Bound<'_, PyAny>]) -> bool {
    if metas.iter().all(|m| m.is_none()) {
        return false;
    }
    let Some(classes) = CLASSES.get_or_init(py, || Classes::load(py).ok()) else {
        return false;
    };
    metas
        .iter()
        .all(|m| m.is_none() || exactly(m, &classes.meta))
        && classes.unpatched(py)
}

/// The result of vLLM's `chain[0].aggregate(chain[1]).aggregate(chain[2])...` (at least two
/// objects), or `None` where a value is not one [`fold`] handles (see the module docs).
pub(crate) fn fold<'py>(chain: &[Bound<'py, PyAny>]) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(first) = chain.first() else {
        return Ok(None);
    };
    let py = first.py();
    let Some(Some(classes)) = CLASSES.get(py) else {
        return Ok(None);
    };
    let mut jobs = Jobs::default();
    let mut load = Directional::default();
    let mut store = Directional::default();
    for (i, meta) in chain.iter().enumerate() {
        let Some(parts) = Parts::of(classes, meta) else {
            return Ok(None);
        };
        let added = jobs.add(&parts.jobs)
            && load.add(&parts.load, i == 0)
            && store.add(&parts.store, i == 0);
        if !added {
            return Ok(None);
        }
    }
    let kw = PyDict::new(py);
    kw.set_item("load", load.build(py, classes)?)?;
    kw.set_item("store", store.build(py, classes)?)?;
    let stats = classes.stats.bind(py).call((), Some(&kw))?;
    let kw = PyDict::new(py);
    kw.set_item("completed_jobs", jobs.build(py)?)?;
    kw.set_item("transfer_stats", stats)?;
    Ok(Some(classes.meta.bind(py).call((), Some(&kw))?))
}

/// One metadata object's fields, checked to be vLLM's plain types.
struct Parts<'py> {
    jobs: Bound<'py, PyDict>,
    load: Bound<'py, PyAny>,
    store: Bound<'py, PyAny>,
}

impl<'py> Parts<'py> {
    fn of(classes: &Classes, meta: &Bound<'py, PyAny>) -> Option<Self> {
        let py = meta.py();
        if !exactly(meta, &classes.meta) {
            return None;
        }
        let jobs = meta.getattr(pyo3::intern!(py, "completed_jobs")).ok()?;
        let jobs = jobs.downcast_exact::<PyDict>().ok()?.clone();
        let stats = meta.getattr(pyo3::intern!(py, "transfer_stats")).ok()?;
        if !exactly(&stats, &classes.stats) {
            return None;
        }
        let load = stats.getattr(pyo3::intern!(py, "load")).ok()?;
        let store = stats.getattr(pyo3::intern!(py, "store")).ok()?;
        (exactly(&load, &classes.directional) && exactly(&store, &classes.directional))
            .then_some(Self { jobs, load, store })
    }
}

/// An exact `int` within 64 bits.
fn int(x: &Bound<'_, PyAny>) -> Option<i64> {
    x.downcast_exact::<PyInt>().ok()?.extract().ok()
}

/// The merged `completed_jobs`: each job id's first key object, in first-seen order, and its
/// summed count.
#[derive(Default)]
struct Jobs<'py> {
    index: FxHashMap<i64, usize>,
    /// Per job: its id, the key object, the count.
    entries: Vec<(i64, Bound<'py, PyAny>, i64)>,
}

impl<'py> Jobs<'py> {
    /// vLLM's `merged[job_id] = merged.get(job_id, 0) + v` for every item; false where a key or
    /// count is not a 64-bit `int` or a sum overflows. Ranks usually name the same jobs in the
    /// same order, so the entry at the item's position is tried before the index.
    fn add(&mut self, jobs: &Bound<'py, PyDict>) -> bool {
        if self.entries.is_empty() {
            self.index.reserve(jobs.len());
        }
        // vLLM's workers count each job once: CPython's one `1` object, known without asking.
        let one = 1i64.into_pyobject(jobs.py()).map(Bound::into_any);
        for (position, (key, count)) in jobs.iter().enumerate() {
            let count = match &one {
                Ok(one) if count.is(one) => Some(1),
                _ => int(&count),
            };
            let (Some(id), Some(count)) = (int(&key), count) else {
                return false;
            };
            let at = match self.entries.get(position) {
                Some(e) if e.0 == id => Some(position),
                _ => self.index.get(&id).copied(),
            };
            match at {
                Some(at) => match self.entries[at].2.checked_add(count) {
                    Some(sum) => self.entries[at].2 = sum,
                    None => return false,
                },
                None => {
                    self.index.insert(id, self.entries.len());
                    self.entries.push((id, key, count));
                }
            }
        }
        true
    }

    fn build(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (_, key, count) in &self.entries {
            d.set_item(key, count)?;
        }
        Ok(d)
    }
}

/// A `DirectionalTransferStats` being summed: bytes, time, the sizes' objects.
#[derive(Default)]
struct Directional<'py> {
    bytes: i64,
    time: f64,
    sizes: Vec<Bound<'py, PyAny>>,
}

impl<'py> Directional<'py> {
    /// vLLM's `bytes=self.bytes + other.bytes, time=self.time + other.time,
    /// sizes=[*self.sizes, *other.sizes]` (`first`: the accumulator's own values); false where a
    /// value is not a plain `int`, `float` or `list`, or the bytes overflow.
    fn add(&mut self, stats: &Bound<'py, PyAny>, first: bool) -> bool {
        let py = stats.py();
        let field = |name: &Bound<'py, pyo3::types::PyString>| stats.getattr(name).ok();
        let (Some(bytes), Some(time), Some(sizes)) = (
            field(pyo3::intern!(py, "bytes")),
            field(pyo3::intern!(py, "time")),
            field(pyo3::intern!(py, "sizes")),
        ) else {
            return false;
        };
        let (Some(bytes), Ok(time), Ok(sizes)) = (
            int(&bytes),
            time.downcast_exact::<PyFloat>(),
            sizes.downcast_exact::<PyList>(),
        ) else {
            return false;
        };
        let time = time.value();
        if first {
            (self.bytes, self.time) = (bytes, time);
        } else {
            let Some(b) = self.bytes.checked_add(bytes) else {
                return false;
            };
            (self.bytes, self.time) = (b, self.time + time);
        }
        self.sizes.extend(sizes.iter());
        true
    }

    fn build(&self, py: Python<'py>, classes: &Classes) -> PyResult<Bound<'py, PyAny>> {
        let kw = PyDict::new(py);
        kw.set_item("bytes", self.bytes)?;
        kw.set_item("time", self.time)?;
        kw.set_item("sizes", PyList::new(py, &self.sizes)?)?;
        classes.directional.bind(py).call((), Some(&kw))
    }
}
