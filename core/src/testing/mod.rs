//! Test doubles: a connector answering from a script, its worker twin, and the fake sampler.
//!
//! Behind the `testing` feature (and `cfg(test)`): production builds of the core do not carry
//! them. The model checker, the conformance runner and the test suites enable it.

mod sampler;
mod scripted;
mod scripted_worker;

pub use sampler::fake_token;
pub use scripted::{ConnectorCall, ScriptedConnector, ScriptedLoad, ScriptedMeta};
pub use scripted_worker::ScriptedWorker;
