//! Runs every conformance case of `tests/conformance/cases/` through the same runner as
//! `kvrelay conformance`: the public cases of `shared/conformance/cases/` (copied into
//! `public/`) and kvrelay's own (`kvrelay/`).

use std::path::{Path, PathBuf};

use kvrelay_conformance::{MACHINES, collect_files, run_file};

fn cases_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("conformance/cases")
}

/// Machines that follow in a later issue (`false` in [`MACHINES`]): their cases must fail, and
/// say why.
fn not_yet(machine: &str) -> bool {
    MACHINES.iter().any(|&(m, built)| m == machine && !built)
}

fn machine_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).expect("case file readable");
    let v: serde_json::Value = serde_json::from_str(&text).expect("case file is JSON");
    v["machine"]
        .as_str()
        .expect("case names a machine")
        .to_string()
}

#[test]
fn every_case_of_an_implemented_machine_passes() {
    let files = collect_files(&[cases_dir()]).expect("cases folder readable");
    assert!(
        files.len() >= 6,
        "expected the public cases at least, found {}",
        files.len()
    );
    let mut failures = Vec::new();
    let mut ran = 0;
    for f in &files {
        if not_yet(&machine_of(f)) {
            continue;
        }
        ran += 1;
        let outcome = run_file(f);
        if outcome.result.is_err() {
            failures.push(format!("{} ({})", outcome, f.display()));
        }
    }
    assert!(ran >= 4, "ran only {ran} cases");
    assert!(
        failures.is_empty(),
        "failing cases:\n{}",
        failures.join("\n")
    );
}

#[test]
fn cases_of_machines_not_built_yet_fail_with_a_clear_message() {
    let files = collect_files(&[cases_dir()]).expect("cases folder readable");
    let mut seen = 0;
    for f in files.iter().filter(|f| not_yet(&machine_of(f))) {
        seen += 1;
        let outcome = run_file(f);
        let msg = outcome
            .result
            .expect_err("an unimplemented machine cannot pass");
        assert!(
            msg.contains("not implemented yet"),
            "unclear message: {msg}"
        );
    }
    let missing = MACHINES.iter().filter(|(_, built)| !built).count();
    assert!(
        seen >= missing,
        "a public case of every machine not built yet is expected here"
    );
}
