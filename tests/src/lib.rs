//! Test helpers shared by kvrelay's own tests and by engines that build on `kvrelay-core`.
//!
//! * [`laws`]: the worker-metadata law suite ([`laws::check_worker_meta_laws`]) and proptest
//!   strategies for kvrelay's types (metadata, request sets, KV events, worker outputs).
//! * [`build`]: builders of the values tests hand to the core (request ids and sets, request
//!   specs, lookup answers, parameters, aggregated outputs, rank and manager configurations).
//! * [`drive`]: step drivers (a scheduler's schedule / fake sampling / apply, a rank's step
//!   polled to its end), checking invariants as they go.
//! * [`fuzz`]: the fuzz entry points (bytes in, no panic out) of the coverage-guided targets in
//!   `tests/fuzz/`, which `tests/fuzz_inputs.rs` runs with proptest's inputs on every CI run.
//! * [`runner`]: proptest runner loops for tests that cannot use `proptest!` (state machines
//!   against a reference model, coverage counters so that they cannot pass vacuously).
//!
//! The property tests of this crate live in `tests/tests/`; the conformance cases in
//! `tests/conformance/`.

pub mod build;
pub mod drive;
pub mod fuzz;
pub mod laws;
pub mod runner;
