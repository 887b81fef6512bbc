//! kvrelay-runtime: the shell around `kvrelay-core`.
//!
//! * [`run`] — the engine runtime (`kvrelay run`): an engine loop over the core's engine step,
//!   W rank tasks moving real KV bytes between a "GPU" arena and a CPU offload pool, every
//!   load and read verified.
//! * [`conformance`] — the conformance runner (`kvrelay conformance`).
//! * [`mod@bench`] — the case-replay benchmark (`kvrelay bench`).
//! * [`check`] — the model check's command line (`kvrelay check`).
//! * [`fuzz`] — the fuzz entry points (bytes in, no panic out), shared by the fuzz targets in
//!   `tests/fuzz/` and the proptest suite that runs them in CI.
//!
//! `main.rs` only parses the command line and prints.

pub mod bench;
pub mod check;
pub mod conformance;
pub mod fuzz;
pub mod run;
