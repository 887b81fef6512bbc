//! The cross-crate tests' one test binary: every file of this folder is a module of it, so that
//! the law suites, reference models and proptest strategies they share are compiled and linked
//! once instead of once a file (`autotests = false` in `Cargo.toml`; the test at the bottom
//! checks that every file of this folder, and of `model-check/tests/`, is a module of its
//! `main.rs`). A test is named after its file: `cargo test -p kvrelay-tests --test kvrelay_tests
//! -- conformance::` runs the tests of `conformance.rs` (the `::` keeps `offload_manager::` from
//! matching `offload_manager_model::`).

mod aggregator_i22;
mod aggregator_model;
mod aggregator_strict;
mod cache_events;
mod conformance;
mod conformance_runner;
mod decode;
mod docs;
mod engine;
mod events;
mod fuzz_inputs;
mod layout;
mod meta_laws;
mod multi;
mod offload_manager;
mod offload_manager_model;
mod offloading;
mod pd;
mod protocol;
mod scheduler;
mod scheduler_model;
mod shadow;

/// Every `.rs` file of this folder and of `model-check/tests/` is a module of its `main.rs`: with
/// `autotests = false`, a file left out would be neither compiled nor run.
#[test]
fn every_test_file_is_a_module_of_its_crates_test_binary() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut missing = Vec::new();
    for folder in ["tests/tests", "model-check/tests"] {
        let dir = root.join(folder);
        let main = std::fs::read_to_string(dir.join("main.rs")).expect("main.rs");
        for entry in std::fs::read_dir(&dir).expect("the tests folder") {
            let path = entry.expect("a directory entry").path();
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            let is_rs = path.extension().is_some_and(|e| e == "rs");
            if is_rs && stem != "main" && !main.lines().any(|l| l == format!("mod {stem};")) {
                missing.push(format!("{folder}/{stem}.rs"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not modules of their folder's main.rs: {missing:?}"
    );
}
