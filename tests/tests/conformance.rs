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

/// Issue 37: the core's P/D connector in the scripted connector's place passes every scripted
/// `engine` case it can express (`kvrelay_conformance::substitute_pd`); those it cannot are
/// listed with their reasons.
#[test]
fn the_pd_connector_passes_the_scripted_engine_cases() {
    use kvrelay_conformance::{AnyCase, Substituted, substitute_pd};
    let files = collect_files(&[cases_dir()]).expect("cases folder readable");
    let (mut passed, mut failed, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
    for f in files {
        let text = std::fs::read_to_string(&f).expect("readable");
        let Ok(AnyCase::Engine(case)) = AnyCase::parse(&text, &f.display().to_string()) else {
            continue;
        };
        match substitute_pd(&case) {
            Substituted::Passed => passed.push(case.name.clone()),
            Substituted::Failed(e) => failed.push(format!("{}: {e}", case.name)),
            Substituted::NotExpressible(why) => skipped.push(format!("{}: {why}", case.name)),
            Substituted::NotScripted => {}
        }
    }
    eprintln!("passed {}:\n  {}", passed.len(), passed.join("\n  "));
    eprintln!(
        "not expressible {}:\n  {}",
        skipped.len(),
        skipped.join("\n  ")
    );
    assert!(
        failed.is_empty(),
        "failing with the P/D connector:\n{}",
        failed.join("\n")
    );
    assert!(passed.len() >= 10, "only {} cases passed", passed.len());
}
