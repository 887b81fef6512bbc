//! Test doubles: a connector answering from a script, its worker twin, the fake sampler, and the
//! simulated DMA that runs a rank's step ([`SimDma`]).
//!
//! Behind the `testing` feature (and `cfg(test)`): production builds of the core do not carry
//! them. The model checker, the conformance runner and the test suites enable it.

mod sampler;
mod scripted;
mod scripted_worker;
mod sim_dma;

pub use sampler::fake_token;
pub use scripted::{ConnectorCall, ScriptedConnector, ScriptedLoad, ScriptedMeta};
pub use scripted_worker::ScriptedWorker;
pub use sim_dma::{DmaQueue, OnWait, SimDma, SimError, StepObserver};
