//! vLLM's request-id strings ↔ the core's dense [`RequestId`]s, keeping each string's Python
//! object so that what goes back to Python is the very object that came in.
//!
//! Call [`Ids::intern`] for every id a call brings in and [`Ids::name`] for every id it hands
//! back. Ids the core no longer holds anything for are released in sweeps
//! ([`Ids::sweep_if_large`], with the core's `is_idle`), so that the core's dense tables stay
//! about as small as the live requests while an id that comes back step after step keeps its
//! entry.
//!
//! The table is keyed by Python's own string hash (computed once per string object and cached
//! in it), so a lookup hashes nothing; equal hashes are told apart by the text.

use hashbrown::HashTable;
use kvrelay_core::RequestId;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// Idle entries tolerated before a sweep, beyond twice the entries in use.
const SWEEP_SLACK: usize = 4096;

/// One interned id: Python's hash of its name, the name's text, the id.
#[derive(Debug)]
struct Entry {
    hash: u64,
    text: Box<str>,
    id: RequestId,
}

/// The interned ids and their names.
#[derive(Debug, Default)]
pub(crate) struct Ids {
    table: HashTable<Entry>,
    /// Indexed by id: the name's Python object, while the id is interned.
    by_id: Vec<Option<Py<PyString>>>,
    free: Vec<RequestId>,
    /// Entries the last sweep kept.
    kept: usize,
}

impl Ids {
    /// The id of `name` (a `str`; anything else is a `TypeError`), allocated on first sight.
    pub(crate) fn intern(&mut self, name: &Bound<'_, PyAny>) -> PyResult<RequestId> {
        let s = name.downcast::<PyString>()?;
        let hash = s.hash()? as u64;
        let text = s.to_str()?;
        if let Some(e) = self.table.find(hash, |e| *e.text == *text) {
            return Ok(e.id);
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let next = u32::try_from(self.by_id.len()).map_err(|_| {
                    pyo3::exceptions::PyOverflowError::new_err("more than 2^32 live request ids")
                })?;
                self.by_id.push(None);
                RequestId(next)
            }
        };
        self.by_id[id.index()] = Some(s.clone().unbind());
        let entry = Entry {
            hash,
            text: text.into(),
            id,
        };
        self.table.insert_unique(hash, entry, |e| e.hash);
        Ok(id)
    }

    /// The Python string of an interned id. The core only hands back ids it was given, and they
    /// are released only when it holds nothing for them: a miss is kvrelay's bug, said so.
    pub(crate) fn name<'py>(
        &self,
        py: Python<'py>,
        id: RequestId,
    ) -> PyResult<Bound<'py, PyString>> {
        match self.by_id.get(id.index()).and_then(Option::as_ref) {
            Some(n) => Ok(n.bind(py).clone()),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "kvrelay bug: request id {} handed back after it was released",
                id.0
            ))),
        }
    }

    /// Releases every id for which `idle` holds, once the table has grown by more than
    /// [`SWEEP_SLACK`] entries beyond twice what the last sweep kept: amortized O(1) per intern.
    pub(crate) fn sweep_if_large(&mut self, idle: impl Fn(RequestId) -> bool) {
        if self.table.len() <= 2 * self.kept + SWEEP_SLACK {
            return;
        }
        let free = &mut self.free;
        let by_id = &mut self.by_id;
        self.table.retain(|e| {
            let keep = !idle(e.id);
            if !keep {
                by_id[e.id.index()] = None;
                free.push(e.id);
            }
            keep
        });
        self.kept = self.table.len();
    }

    /// The interned ids, in table order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.table.iter().map(|e| e.id)
    }

    /// Number of interned ids (idle ones not yet swept included).
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }
}
