//! The offloading manager's native class, `kvrelay._kvrelay._OffloadManager`: kvrelay-core's
//! [`CpuOffloadingManager`] (LRU or ARC) behind plain Python values. The Python class
//! `kvrelay.CPUOffloadingManager` (`python/kvrelay/manager.py`) wraps it and builds vLLM 0.33's
//! own result types; it also keeps each request's scope on vLLM's `ReqContext` and hands the
//! scope's id here.
//!
//! # When the wrapper calls what
//!
//! | vLLM's method | native call |
//! | --- | --- |
//! | `on_new_request` (and the first call of a context) | `open_request() -> rid` |
//! | `lookup` | `lookup_result(key, req_context)` is the wrapper's `lookup` (`lookup(key)`: 0/1/2) |
//! | `prepare_load` | `prepare_load(keys, rid, positions) -> chunk ids` (`AssertionError`: not loadable) |
//! | `touch` | `touch(keys)` |
//! | `complete_load` | `complete_load(keys)` (`AssertionError`: not pinned) |
//! | `prepare_store` | `prepare_store(keys, rid, positions) -> None \| (keys_to_store, chunk ids, evicted)` |
//! | `complete_store` | `complete_store(keys, success)` |
//! | `on_request_finished` | `request_finished(rid)` |
//! | `take_events` | `take_events() -> [(keys, removed, metadata_only)]` |
//! | `reset_cache` | `reset()` |
//! | `get_stats` | `usage()`, `take_batch_stats()` |
//! | the attributes `counts`, `stores_skipped_in_current_batch`, ... | `tracked()`, `offer_count(key)`, `batch_stats()` |
//!
//! Chunk ids come back as a `bytearray` of int32, for `numpy.frombuffer`.
//!
//! Keys are vLLM's `OffloadKey` bytes: a block hash and a 4-byte big-endian group. The hash
//! bytes are interned to the core's [`BlockHash`] (a dense id; see `hashes.rs`) and the group is
//! the key's own, so the core groups keys as vLLM does. Keys handed back are the objects that
//! came in where the group matches (new `bytes` otherwise). `positions` is the context's
//! key → end-token dict (or `None`).
//!
//! Events are drained from the core after every call that makes them, so that a failed store's
//! removal keeps vLLM's `metadata_only` flag; with events off they are dropped at once.
//!
//! Departures from vLLM (a caller following vLLM's protocol never sees the first four): a
//! refused `prepare_load`/`complete_load` changes nothing (vLLM pins or unpins the keys before
//! the bad one); a key offered twice in one `prepare_store` is stored once; a finished request's
//! context used again records no access (vLLM asserts on a key it had not seen); a key's
//! position is read when the key is accessed (vLLM reads it again when the request finishes).
//! Beyond that: a context never finished keeps its scope in the core (vLLM's state
//! dies with the context); and the core breaks LRU rank ties between different hashes (keys of
//! one request at one position, in groups with different hashes) by first sight, vLLM by the
//! bytes.

use kvrelay_core::{
    Access, ChunkId, CpuOffloadingManager, KeyLookup, ManagerConfig, ManagerError, OffloadKey,
    PolicyKind, RequestId,
};
use pyo3::exceptions::{PyAssertionError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyTuple};

use crate::hashes::{Hashes, offload_key};

pyo3::create_exception!(
    kvrelay,
    UnsupportedConfig,
    PyValueError,
    "A constructor argument of vLLM's CPUOffloadingManager that kvrelay's manager cannot honour."
);

/// Adds this file's classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OffloadManager>()?;
    m.add("UnsupportedConfig", m.py().get_type::<UnsupportedConfig>())?;
    Ok(())
}

/// The core's policy named `name` (vLLM's "lru" or "arc"); anything else is
/// [`UnsupportedConfig`], naming the argument `arg`.
pub(crate) fn policy(arg: &str, name: &str) -> PyResult<PolicyKind> {
    match name {
        "lru" => Ok(PolicyKind::Lru),
        "arc" => Ok(PolicyKind::Arc),
        other => Err(UnsupportedConfig::new_err(format!(
            "{arg} {other:?}: kvrelay has \"lru\" and \"arc\""
        ))),
    }
}

/// A pool's `(num_chunks, free, evictable, write_pending)` chunks, as vLLM's usage gauges read
/// them (the Python side's `_set_usage`).
pub(crate) fn pool_usage(m: &CpuOffloadingManager) -> (u32, u32, u32, u32) {
    (
        m.config().capacity_chunks,
        m.num_free_chunks(),
        m.num_evictable(),
        m.num_write_pending(),
    )
}

/// vLLM's key bytes ↔ the core's [`OffloadKey`]: each distinct hash (the key minus its 4-byte
/// group) gets a dense id ([`Hashes`], with the first key object seen) while the core may name a
/// key with that hash; the group is the key's own.
#[derive(Debug, Default)]
struct KeyTable {
    hashes: Hashes,
}

/// A key's hash bytes and group, checked: `bytes` (`TypeError`) of at least 4 (`ValueError`).
fn split_key<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<(&'a [u8], u32)> {
    let bytes = key.downcast::<PyBytes>().map_err(|_| {
        PyTypeError::new_err(format!(
            "an offload key is bytes (block hash + 4-byte group), got {}",
            key.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    let b = bytes.as_bytes();
    let Some(cut) = b.len().checked_sub(4) else {
        return Err(PyValueError::new_err(format!(
            "an offload key ends with a 4-byte group: {} bytes is too short",
            b.len()
        )));
    };
    let group = u32::from_be_bytes(b[cut..].try_into().expect("4 bytes"));
    Ok((&b[..cut], group))
}

impl KeyTable {
    /// The core key of a known hash (`None`: this hash was never offered).
    fn find(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<OffloadKey>> {
        let (hash, group) = split_key(key)?;
        Ok(self
            .hashes
            .find(hash)
            .map(|hash| OffloadKey { hash, group }))
    }

    /// The core key, interning its hash on first sight.
    fn intern(&mut self, key: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
        let (hash, group) = split_key(key)?;
        let hash = self.hashes.intern(hash, key.downcast::<PyBytes>()?);
        Ok(OffloadKey { hash, group })
    }

    /// The bytes of a core key: the object first seen with its hash where the group matches,
    /// else new bytes.
    fn object<'py>(&self, py: Python<'py>, k: OffloadKey) -> PyResult<Bound<'py, PyBytes>> {
        let first = self.hashes.object(py, k.hash)?;
        let b = first.as_bytes();
        let cut = b.len() - 4;
        if b[cut..] == k.group.to_be_bytes() {
            return Ok(first.clone());
        }
        Ok(offload_key(py, &b[..cut], k.group))
    }

    /// A list of the bytes of core keys.
    fn list<'py>(&self, py: Python<'py>, keys: &[OffloadKey]) -> PyResult<Bound<'py, PyList>> {
        let objects = keys
            .iter()
            .map(|&k| self.object(py, k))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, objects)
    }
}

/// Calls `f` on each item of a key collection (a list or tuple directly, else by iteration).
fn each_key(
    keys: &Bound<'_, PyAny>,
    mut f: impl FnMut(&Bound<'_, PyAny>) -> PyResult<()>,
) -> PyResult<()> {
    if let Ok(list) = keys.downcast::<PyList>() {
        for k in list.iter() {
            f(&k)?;
        }
    } else if let Ok(tuple) = keys.downcast::<PyTuple>() {
        for k in tuple.iter() {
            f(&k)?;
        }
    } else {
        for k in keys.try_iter()? {
            f(&k?)?;
        }
    }
    Ok(())
}

/// Each key's position from the context's dict, parallel to `keys` ([`Access::NO_POSITION`]
/// where the dict has none); `false` if no key has one.
fn positions_of(
    keys: &Bound<'_, PyAny>,
    dict: Option<&Bound<'_, PyDict>>,
    out: &mut Vec<u32>,
) -> PyResult<bool> {
    out.clear();
    let Some(dict) = dict.filter(|d| !d.is_empty()) else {
        return Ok(false);
    };
    let mut any = false;
    each_key(keys, |k| {
        let p = match dict.get_item(k)? {
            Some(p) => {
                any = true;
                p.extract::<u32>()
                    .ok()
                    .filter(|&p| p != Access::NO_POSITION)
                    .ok_or_else(|| {
                        PyOverflowError::new_err("a key position is an int in 0..2^32-1")
                    })?
            }
            None => Access::NO_POSITION,
        };
        out.push(p);
        Ok(())
    })?;
    Ok(any)
}

/// Chunk ids as a `bytearray` of native-endian int32 (vLLM's `CPULoadStoreSpec` dtype), for
/// `numpy.frombuffer`.
fn chunk_array<'py>(py: Python<'py>, chunks: &[ChunkId]) -> Bound<'py, PyByteArray> {
    let mut raw = Vec::with_capacity(chunks.len() * 4);
    for c in chunks {
        // Chunk ids are below the pool size, itself at most what vLLM's int32 array holds.
        raw.extend_from_slice(&(c.0 as i32).to_ne_bytes());
    }
    PyByteArray::new(py, &raw)
}

/// How [`OffloadManager::collect`] treats a key whose hash was never offered.
#[derive(Clone, Copy, Debug)]
enum Keys {
    /// Interns it (a store offer).
    Intern,
    /// Leaves it out (it is absent from the core: a call that ignores absent keys).
    Known,
    /// Refuses the call (`AssertionError`, as vLLM's assertion).
    Require,
}

/// The native manager: the core, the key table, the events drained so far, the batch stats.
#[pyclass(module = "kvrelay._kvrelay", name = "_OffloadManager")]
#[derive(Debug)]
pub(crate) struct OffloadManager {
    core: CpuOffloadingManager,
    keys: KeyTable,
    enable_events: bool,
    /// Drained core events: keys, removed, metadata-only (a failed store's removal).
    events: Vec<(Vec<OffloadKey>, bool, bool)>,
    next_request: u32,
    free_requests: Vec<u32>,
    /// `prepare_store`s' allocation sizes and skipped stores since `take_batch_stats`.
    allocation_sizes: Vec<u32>,
    stores_skipped: u64,
    /// What `lookup_result` returns: vLLM's `LookupResult` members.
    lookup_results: Option<[Py<PyAny>; 3]>,
    /// Reused per call: the call's keys and positions.
    buf: Vec<OffloadKey>,
    pos: Vec<u32>,
}

impl OffloadManager {
    /// The call's keys: interned, or found (an unknown key is left out, or refused as vLLM's
    /// assertion that the chunk is in the cache).
    fn collect(&mut self, keys: &Bound<'_, PyAny>, how: Keys) -> PyResult<Vec<OffloadKey>> {
        let mut buf = core::mem::take(&mut self.buf);
        buf.clear();
        let table = &mut self.keys;
        let r = each_key(keys, |k| {
            match how {
                Keys::Intern => buf.push(table.intern(k)?),
                Keys::Known => buf.extend(table.find(k)?),
                Keys::Require => match table.find(k)? {
                    Some(x) => buf.push(x),
                    None => {
                        return Err(PyAssertionError::new_err(format!(
                            "Chunk {} not found in cache",
                            k.repr()?
                        )));
                    }
                },
            }
            Ok(())
        });
        match r {
            Ok(()) => Ok(buf),
            Err(e) => {
                self.buf = buf;
                Err(e)
            }
        }
    }

    /// Runs `f` with the call's keys (`how`) and its access: the scope `rid` and the keys'
    /// positions from the context's dict. The reused buffers are put back afterwards.
    fn accessing<R>(
        &mut self,
        keys: &Bound<'_, PyAny>,
        how: Keys,
        rid: Option<u32>,
        positions: Option<&Bound<'_, PyDict>>,
        f: impl FnOnce(&mut Self, &[OffloadKey], Access<'_>) -> R,
    ) -> PyResult<R> {
        let buf = self.collect(keys, how)?;
        let mut pos = core::mem::take(&mut self.pos);
        let r = positions_of(keys, positions, &mut pos).map(|has| {
            let access = Access {
                request: rid.map(RequestId),
                positions: has.then_some(&pos[..]),
            };
            f(self, &buf, access)
        });
        self.pos = pos;
        self.buf = buf;
        r
    }

    /// Moves the core's new events here (`metadata_only`: a failed store's removal).
    fn drain_events(&mut self, metadata_only: bool) {
        for e in self.core.take_events() {
            if self.enable_events {
                self.events
                    .push((e.keys, e.removed, e.removed && metadata_only));
            }
        }
    }

    /// The core's refusal as vLLM's assertion, naming the key as vLLM does.
    fn refused(&self, py: Python<'_>, e: ManagerError) -> PyErr {
        let name = |k: OffloadKey| {
            self.keys
                .object(py, k)
                .and_then(|o| o.repr())
                .map_or_else(|_| format!("{k:?}"), |r| r.to_string())
        };
        PyAssertionError::new_err(match e {
            ManagerError::NotLoadable(k) if self.core.lookup(k) == KeyLookup::HitPending => {
                format!("Chunk {} is not ready for reading", name(k))
            }
            ManagerError::NotLoadable(k) => format!("Chunk {} not found in cache", name(k)),
            ManagerError::NotPinned(k) => format!("Chunk {} ref_cnt is already 0", name(k)),
            other => other.to_string(),
        })
    }

    /// Offered keys (`buf`, each copy) that are not stored after the call and were offered
    /// at least `min_offers` times.
    fn count_absent(&self, buf: &[OffloadKey], min_offers: u32) -> u32 {
        buf.iter()
            .filter(|&&k| {
                self.core.lookup(k) == KeyLookup::Miss
                    && (min_offers == 0 || self.core.offer_count(k) >= min_offers)
            })
            .count() as u32
    }
}

#[pymethods]
impl OffloadManager {
    /// `_OffloadManager(num_chunks, cache_policy, store_threshold, enable_events,
    /// max_tracker_size)`; a pool of no chunks or an unknown policy is [`UnsupportedConfig`].
    #[new]
    #[pyo3(signature = (
        num_chunks, cache_policy = "lru", store_threshold = 1, enable_events = false,
        max_tracker_size = 64_000
    ))]
    fn new(
        num_chunks: i64,
        cache_policy: &str,
        store_threshold: i64,
        enable_events: bool,
        max_tracker_size: i64,
    ) -> PyResult<Self> {
        let policy = policy("cache_policy", cache_policy)?;
        let capacity_chunks = u32::try_from(num_chunks).map_err(|_| {
            UnsupportedConfig::new_err(format!(
                "num_chunks must be between 0 and 2^32-1, got {num_chunks}"
            ))
        })?;
        // vLLM tracks offers only from a threshold of 2; below that every key is stored.
        let store_threshold = u32::try_from(store_threshold.max(0)).map_err(|_| {
            UnsupportedConfig::new_err(format!("store_threshold {store_threshold} is too large"))
        })?;
        let config = ManagerConfig {
            capacity_chunks,
            policy,
            store_threshold,
        };
        let max_tracker_size = usize::try_from(max_tracker_size).map_err(|_| {
            PyValueError::new_err(format!(
                "max_tracker_size must be at least 0, got {max_tracker_size}"
            ))
        })?;
        let core = CpuOffloadingManager::new(config)
            .map_err(|e| UnsupportedConfig::new_err(e.to_string()))?
            .with_max_tracker_size(max_tracker_size);
        Ok(Self {
            core,
            keys: KeyTable::default(),
            enable_events,
            events: Vec::new(),
            next_request: 0,
            free_requests: Vec::new(),
            allocation_sizes: Vec::new(),
            stores_skipped: 0,
            lookup_results: None,
            buf: Vec::new(),
            pos: Vec::new(),
        })
    }

    /// A fresh request scope id (the core opens the scope at its first access).
    fn open_request(&mut self) -> PyResult<u32> {
        if let Some(r) = self.free_requests.pop() {
            return Ok(r);
        }
        let r = self.next_request;
        self.next_request = r
            .checked_add(1)
            .ok_or_else(|| PyOverflowError::new_err("more than 2^32 open request scopes"))?;
        Ok(r)
    }

    /// Commits the scope's accesses to the policy and frees its id.
    fn request_finished(&mut self, rid: u32) {
        self.core.on_request_finished(RequestId(rid));
        self.free_requests.push(rid);
    }

    /// vLLM's `lookup(key, req_context)`: the `LookupResult` member bound by
    /// `bind_lookup_results` (the wrapper makes this its `lookup`). Never interns.
    #[pyo3(signature = (key, req_context = None))]
    fn lookup_result(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = req_context;
        let Some(members) = &self.lookup_results else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "bind_lookup_results was not called",
            ));
        };
        Ok(members[usize::from(self.lookup(key)?)].clone_ref(py))
    }

    /// Binds the values `lookup_result` returns: (miss, hit, hit pending).
    fn bind_lookup_results(&mut self, members: [Py<PyAny>; 3]) {
        self.lookup_results = Some(members);
    }

    /// 0 miss, 1 hit, 2 hit pending. Never interns.
    fn lookup(&self, key: &Bound<'_, PyAny>) -> PyResult<u8> {
        Ok(match self.keys.find(key)? {
            None => 0,
            Some(k) => match self.core.lookup(k) {
                KeyLookup::Miss => 0,
                KeyLookup::Hit => 1,
                KeyLookup::HitPending => 2,
            },
        })
    }

    /// Pins the keys for a load and returns their chunk ids; `AssertionError` (nothing pinned)
    /// if a key is not stored and ready.
    #[pyo3(signature = (keys, rid = None, positions = None))]
    fn prepare_load<'py>(
        &mut self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        rid: Option<u32>,
        positions: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let chunks = self.accessing(keys, Keys::Require, rid, positions, |m, buf, access| {
            m.core
                .prepare_load(buf, access)
                .map_err(|e| m.refused(py, e))
        })??;
        Ok(chunk_array(py, &chunks))
    }

    /// Marks the keys recently used (unknown keys are absent: nothing to do for them).
    fn touch(&mut self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = self.collect(keys, Keys::Known)?;
        self.core.touch(&buf, Access::default());
        self.buf = buf;
        Ok(())
    }

    /// Unpins loaded keys; `AssertionError` (nothing unpinned) if a key is not pinned.
    fn complete_load(&mut self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let buf = self.collect(keys, Keys::Require)?;
        let r = self
            .core
            .complete_load(&buf)
            .map_err(|e| self.refused(py, e));
        self.buf = buf;
        r
    }

    /// Reserves chunks for the offered keys that need storing: `None` if it cannot (nothing
    /// changed but the offer's accesses), else `(keys_to_store, chunk ids, evicted keys)`.
    #[pyo3(signature = (keys, rid = None, positions = None))]
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        rid: Option<u32>,
        positions: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if self.keys.hashes.wants_sweep() {
            let pending = self.events.iter().flat_map(|e| e.0.iter().copied());
            let referenced = self.core.referenced_keys().chain(pending);
            self.keys.hashes.sweep(referenced.map(|k| k.hash));
        }
        let out = self.accessing(keys, Keys::Intern, rid, positions, |m, buf, access| {
            let out = m.core.prepare_store(buf, access);
            m.note_store(buf, out.as_ref().map(|o| o.keys_to_store.len()));
            out
        })?;
        self.drain_events(false);
        let Some(out) = out else {
            return Ok(None);
        };
        let stored = self.keys.list(py, &out.keys_to_store)?;
        let chunks = chunk_array(py, &out.chunks);
        let evicted = self.keys.list(py, &out.evicted)?;
        Ok(Some(PyTuple::new(
            py,
            [stored.into_any(), chunks.into_any(), evicted.into_any()],
        )?))
    }

    /// Ends stores: success makes the write-pending keys loadable, failure removes them.
    fn complete_store(&mut self, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<()> {
        let buf = self.collect(keys, Keys::Known)?;
        self.core.complete_store(&buf, success);
        self.buf = buf;
        self.drain_events(!success);
        Ok(())
    }

    /// The events since the last call, in order, as `(keys, removed, metadata_only)`; a failed
    /// store's removal keeps only the keys that are still absent (none: dropped), as vLLM.
    fn take_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (mut keys, removed, metadata_only) in std::mem::take(&mut self.events) {
            if metadata_only {
                keys.retain(|&k| self.core.lookup(k) == KeyLookup::Miss);
                if keys.is_empty() {
                    continue;
                }
            }
            let keys = self.keys.list(py, &keys)?;
            out.append((keys, removed, metadata_only))?;
        }
        Ok(out)
    }

    /// Forgets every chunk and scope (pending events are kept, as in vLLM).
    fn reset(&mut self) {
        self.core.reset();
        self.next_request = 0;
        self.free_requests.clear();
    }

    /// `(num_chunks, free, evictable, write_pending)`.
    fn usage(&self) -> (u32, u32, u32, u32) {
        pool_usage(&self.core)
    }

    /// Hashes the key table holds (bounded: see `KeyTable`).
    #[getter]
    fn interned_hashes(&self) -> usize {
        self.keys.hashes.len()
    }

    /// Test seam: sweep the key table once `slack` hashes beyond twice the last sweep's are
    /// interned (default 65,536), so that tests exercise the sweeps.
    fn _set_key_sweep_slack(&mut self, slack: usize) {
        self.keys.hashes.slack = slack;
    }

    /// The store-threshold tracker: `[(key, offers)]`, least recently offered first.
    fn tracked<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let offers = self
            .core
            .tracked_offers()
            .map(|(k, n)| Ok((self.keys.object(py, k)?, n)))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, offers)
    }

    /// How many offers of `key` the tracker counts (0: not tracked).
    fn offer_count(&self, key: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.keys.find(key)?.map_or(0, |k| self.core.offer_count(k)))
    }

    /// `(allocation sizes, stores skipped)` so far, without taking them.
    fn batch_stats(&self) -> (Vec<u32>, u64) {
        (self.allocation_sizes.clone(), self.stores_skipped)
    }

    /// `(allocation sizes, stores skipped)` since the last call.
    fn take_batch_stats(&mut self) -> (Vec<u32>, u64) {
        (
            std::mem::take(&mut self.allocation_sizes),
            std::mem::take(&mut self.stores_skipped),
        )
    }
}

impl OffloadManager {
    /// Records a `prepare_store`'s batch stats as vLLM does: the allocation size (the stored
    /// keys; after a refusal, the offered keys still absent that passed the threshold) and,
    /// with a threshold, the absent offered keys it did not admit.
    fn note_store(&mut self, buf: &[OffloadKey], stored: Option<usize>) {
        let threshold = self.core.config().store_threshold;
        let tracking = threshold >= 2;
        match stored {
            Some(n) => {
                if n > 0 {
                    self.allocation_sizes.push(n as u32);
                }
                if tracking {
                    self.stores_skipped += u64::from(self.count_absent(buf, 0));
                }
            }
            None => {
                let absent = self.count_absent(buf, 0);
                let admitted = if tracking {
                    self.count_absent(buf, threshold)
                } else {
                    absent
                };
                self.allocation_sizes.push(admitted);
                self.stores_skipped += u64::from(absent - admitted);
            }
        }
    }
}
