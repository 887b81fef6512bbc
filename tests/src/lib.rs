//! Test helpers shared by kvrelay's own tests and by engines that build on `kvrelay-core`.
//!
//! * [`laws`]: the worker-metadata law suite ([`laws::check_worker_meta_laws`]) and proptest
//!   strategies for kvrelay's types (metadata, request sets, KV events, worker outputs).
//!
//! The property tests of this crate live in `tests/tests/`; the conformance cases in
//! `tests/conformance/`.

pub mod laws;
