//! vLLM's hash bytes ↔ the core's [`BlockHash`]: a dense id per distinct hash, with a `bytes`
//! object to hand back. Used by the manager's key table (keys are a hash plus a group) and by
//! the connector (requests' block hashes).
//!
//! Call [`Hashes::intern`] for every hash a call brings in, [`Hashes::object`] for every id
//! handed back, and [`Hashes::sweep`] when [`Hashes::wants_sweep`] says so, with every id the
//! core may still name: ids are freed only in sweeps, so the table stays about as large as what
//! the core holds (amortized O(1) a hash), not as the hashes ever seen.

use kvrelay_core::BlockHash;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rustc_hash::FxHashMap;

/// vLLM's `OffloadKey` bytes of a block hash and a group: the hash, then the group as 4
/// big-endian bytes (`make_offload_key`).
pub(crate) fn offload_key<'py>(py: Python<'py>, hash: &[u8], group: u32) -> Bound<'py, PyBytes> {
    let mut v = Vec::with_capacity(hash.len() + 4);
    v.extend_from_slice(hash);
    v.extend_from_slice(&group.to_be_bytes());
    PyBytes::new(py, &v)
}

/// Interned hashes beyond twice what the last sweep kept before the next sweep.
const SWEEP_SLACK: usize = 1 << 16;

/// The interned hashes. See the module docs.
#[derive(Debug)]
pub(crate) struct Hashes {
    ids: FxHashMap<Box<[u8]>, u64>,
    /// Per id, the object first seen with that hash (`None`: freed, in `free`).
    objects: Vec<Option<Py<PyBytes>>>,
    free: Vec<u64>,
    /// Entries the last sweep kept.
    kept: usize,
    /// [`SWEEP_SLACK`], or less where a test wants sweeps often.
    pub(crate) slack: usize,
}

impl Default for Hashes {
    fn default() -> Self {
        Self {
            ids: FxHashMap::default(),
            objects: Vec::new(),
            free: Vec::new(),
            kept: 0,
            slack: SWEEP_SLACK,
        }
    }
}

impl Hashes {
    /// The id of `hash`, if interned.
    pub(crate) fn find(&self, hash: &[u8]) -> Option<BlockHash> {
        self.ids.get(hash).map(|&id| BlockHash(id))
    }

    /// The id of `hash`, interned on first sight with `object` (whose bytes start with it).
    pub(crate) fn intern(&mut self, hash: &[u8], object: &Bound<'_, PyBytes>) -> BlockHash {
        if let Some(h) = self.find(hash) {
            return h;
        }
        let object = Some(object.clone().unbind());
        let id = match self.free.pop() {
            Some(id) => {
                self.objects[id as usize] = object;
                id
            }
            None => {
                self.objects.push(object);
                self.objects.len() as u64 - 1
            }
        };
        self.ids.insert(hash.into(), id);
        BlockHash(id)
    }

    /// The object interned with `h`. The core hands back only ids it was given, and an id is
    /// freed only when nothing names it: a miss is kvrelay's bug, said so.
    pub(crate) fn object<'py>(
        &self,
        py: Python<'py>,
        h: BlockHash,
    ) -> PyResult<&Bound<'py, PyBytes>> {
        match self.objects.get(h.0 as usize) {
            Some(Some(o)) => Ok(o.bind(py)),
            _ => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "kvrelay bug: hash id {} handed back after it was freed",
                h.0
            ))),
        }
    }

    /// Number of interned hashes.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether enough was interned since the last sweep to sweep again.
    pub(crate) fn wants_sweep(&self) -> bool {
        self.ids.len() > 2 * self.kept + self.slack
    }

    /// Frees every id not in `referenced`.
    pub(crate) fn sweep(&mut self, referenced: impl Iterator<Item = BlockHash>) {
        let mut used = vec![false; self.objects.len()];
        for h in referenced {
            if let Some(u) = used.get_mut(h.0 as usize) {
                *u = true;
            }
        }
        let (objects, free) = (&mut self.objects, &mut self.free);
        self.ids.retain(|_, &mut id| {
            let keep = used[id as usize];
            if !keep {
                objects[id as usize] = None;
                free.push(id);
            }
            keep
        });
        self.kept = self.ids.len();
    }
}
