//! vLLM's request-id strings ↔ the core's dense [`RequestId`]s, keeping each string's Python
//! object so that what goes back to Python is the very object that came in.
//!
//! Call [`Ids::intern`] for every id a call brings in, [`Ids::name`] for every id it hands back,
//! and [`Ids::release`] once the core holds nothing for an id (the aggregator's `is_idle`), so
//! that the core's dense tables stay as small as the live requests.

use kvrelay_core::RequestId;
use pyo3::prelude::*;
use pyo3::types::PyString;
use rustc_hash::FxHashMap;

/// The live ids and their names.
#[derive(Debug, Default)]
pub(crate) struct Ids {
    by_name: FxHashMap<Box<str>, RequestId>,
    names: Vec<Option<Py<PyString>>>,
    free: Vec<RequestId>,
}

impl Ids {
    /// The id of `name` (a `str`; anything else is a `TypeError`), allocated on first sight.
    pub(crate) fn intern(&mut self, name: &Bound<'_, PyAny>) -> PyResult<RequestId> {
        let s = name.downcast::<PyString>()?;
        let text = s.to_str()?;
        if let Some(&id) = self.by_name.get(text) {
            return Ok(id);
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let next = u32::try_from(self.names.len()).map_err(|_| {
                    pyo3::exceptions::PyOverflowError::new_err("more than 2^32 live request ids")
                })?;
                self.names.push(None);
                RequestId(next)
            }
        };
        self.names[id.index()] = Some(s.clone().unbind());
        self.by_name.insert(text.into(), id);
        Ok(id)
    }

    /// The Python string of a live id. The core only hands back ids it was given, and they
    /// are released only when it holds nothing for them: a miss is kvrelay's bug, said so.
    pub(crate) fn name<'py>(
        &self,
        py: Python<'py>,
        id: RequestId,
    ) -> PyResult<Bound<'py, PyString>> {
        match self.names.get(id.index()).and_then(Option::as_ref) {
            Some(n) => Ok(n.bind(py).clone()),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
                "kvrelay bug: request id {} handed back after it was released",
                id.0
            ))),
        }
    }

    /// Forgets `id`; it may be handed out again.
    pub(crate) fn release(&mut self, py: Python<'_>, id: RequestId) {
        if let Some(name) = self.names.get_mut(id.index()).and_then(Option::take) {
            if let Ok(text) = name.bind(py).to_str() {
                self.by_name.remove(text);
            }
            self.free.push(id);
        }
    }

    /// Number of live ids.
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }
}
