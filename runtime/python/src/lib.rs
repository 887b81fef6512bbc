//! The native half of the Python package `kvrelay` (`kvrelay._kvrelay`): kvrelay-core's
//! aggregator and CPU offloading manager behind classes that take and return vLLM 0.33's own
//! Python objects. The Python half (`python/kvrelay/`) re-exports them under vLLM's class names
//! and holds what must be Python (the vLLM connector class).
//!
//! | file | what |
//! | --- | --- |
//! | `ids.rs` | request-id strings ↔ the core's dense ids, keeping the Python string objects |
//! | `hashes.rs` | vLLM's hash bytes ↔ the core's dense block hashes, keeping the bytes objects |
//! | `aggregator.rs` | `KVOutputAggregator`: vLLM's outputs in, the core's counts, vLLM's output out |
//! | `offload_meta.rs` | vLLM's `OffloadingWorkerMetadata.aggregate` chain in one pass (for the aggregator) |
//! | `manager.rs` | the offloading manager's native class (the Python wrapper converts its results) |
//! | `guard.rs` | kvrelay's step-protocol guard in front of vLLM's own offloading worker |
//! | `connector.rs` | the offloading connector's scheduler side beside vLLM's scheduler (`kvrelay.vllm` wraps it) |
//!
//! The counting and chunk logic is the core's, never repeated here; this crate only converts,
//! and calls the Python methods vLLM calls (worker metadata's and KV events' own folding).

use pyo3::prelude::*;

mod aggregator;
mod connector;
mod guard;
mod hashes;
mod ids;
mod manager;
mod offload_meta;

/// The module `kvrelay._kvrelay`.
#[pymodule]
fn _kvrelay(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<aggregator::KvOutputAggregator>()?;
    manager::register(m)?;
    connector::register(m)?;
    guard::register(m)?;
    Ok(())
}
