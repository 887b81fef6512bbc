//! The model checks' one test binary: every file of this folder is a module of it, so that the
//! checkers, which every file instantiates over the same models, are compiled and linked once
//! instead of once a file (`autotests = false` in `Cargo.toml`; kvrelay-tests' `tests/main.rs`
//! checks that every file of this folder is a module here). A test is named after its file:
//! `cargo test --release -p kvrelay-model-check --test model_check -- system_por::` runs the
//! tests of `system_por.rs` (the `::` keeps `system::` from matching `system_por::`).

mod completion;
mod diagram;
mod historical_bugs;
mod pd;
mod system;
mod system_liveness;
mod system_por;
mod system_symmetry;
mod tier;
// Holds the example as its own `write_through` module (`#[path]`, examples/write_through.rs).
#[allow(clippy::module_inception)]
mod write_through;
