//! kvrelay's step-protocol guard for a worker-side connector inside vLLM,
//! `kvrelay._kvrelay._StepGuard`: kvrelay-core's [`WorkerProtocol`] (SEMANTICS.md §2.4, I-1…I-6)
//! behind two calls. `kvrelay.vllm` passes every worker-side hook of vLLM's own offloading
//! worker through it before making the call, so that a hook out of order (a `bind` before
//! `handle_preemptions`, a `clear` that is not the step's last call, a step opened before the
//! previous one cleared) stops the worker with `kvrelay.StepProtocolViolation` instead of
//! reporting completions no one can trust.
//!
//! Call `begin_step` at the step's first hook, with its shape, then `handle(name)` for every hook
//! including the first (names as [`WorkerCall::name`]). A violation sticks: every later call
//! raises it again.

use kvrelay_core::{StepShape, WorkerCall, WorkerProtocol};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    kvrelay,
    StepProtocolViolation,
    PyRuntimeError,
    "A worker-side connector hook out of vLLM's step order (kvrelay-core's WorkerProtocol)."
);

/// Adds this file's class and exception to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepGuard>()?;
    m.add(
        "StepProtocolViolation",
        m.py().get_type::<StepProtocolViolation>(),
    )
}

/// One rank's guard. See the module docs.
#[pyclass(module = "kvrelay._kvrelay", name = "_StepGuard", unsendable)]
#[derive(Debug, Default)]
pub(crate) struct StepGuard {
    protocol: WorkerProtocol,
}

#[pymethods]
impl StepGuard {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Opens the next step; its number. `sync_loads`: a load completes before the forward;
    /// `forward`: tokens are scheduled (layer hooks may run); `defer_finalize`: `wait_for_save`
    /// and `clear` come after the draft model (speculative decoding).
    fn begin_step(
        &mut self,
        sync_loads: bool,
        forward: bool,
        defer_finalize: bool,
    ) -> PyResult<u64> {
        let shape = StepShape {
            sync_loads,
            forward,
            defer_finalize,
        };
        let step = self
            .protocol
            .begin_step(shape)
            .map_err(|v| StepProtocolViolation::new_err(v.to_string()))?;
        Ok(step.0)
    }

    /// Admits the hook `call` (e.g. `"bind"`, `"start_load_kv"`) if it is the step's next legal
    /// one; an unknown name is a `ValueError`.
    fn handle(&mut self, call: &str) -> PyResult<()> {
        let c = WorkerCall::from_name(call)
            .ok_or_else(|| PyValueError::new_err(format!("no worker hook named {call:?}")))?;
        self.protocol
            .handle(c)
            .map_err(|v| StepProtocolViolation::new_err(v.to_string()))
    }

    /// Whether the step is between its first hook and its final `clear`.
    #[getter]
    fn in_step(&self) -> bool {
        !matches!(self.protocol.phase(), kvrelay_core::WorkerPhase::Idle)
    }
}
