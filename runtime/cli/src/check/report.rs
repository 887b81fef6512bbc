//! What a finished check prints: the run's summary, one row per property, the counterexamples
//! (stdout), and the Mermaid diagram `--diagram` asks for.

use std::process::ExitCode;

use kvrelay_model_check::{CheckReport, Stop};

/// Writes the diagram `--diagram` asks for; a missing discovery is reported, not an error.
pub(super) fn write_diagram(
    report: &CheckReport,
    path: &std::path::Path,
    diagram_of: Option<&'static str>,
) -> Result<(), String> {
    let chosen = match diagram_of {
        Some(name) => report.property(name),
        None => report
            .properties
            .iter()
            .find(|p| !p.holds && p.expectation != "sometimes" && p.diagram.is_some()),
    };
    let Some(p) = chosen.filter(|p| p.diagram.is_some()) else {
        let why = match diagram_of {
            None => "no property was violated".to_owned(),
            Some(name) => {
                let stopped = if report.stop == Stop::FirstViolation {
                    " before the run stopped at the first violation (try --keep-going)"
                } else {
                    ""
                };
                match report.property(name).map(|p| p.expectation) {
                    Some("sometimes") => format!("no example of {name:?} was found{stopped}"),
                    _ => format!("no counterexample to {name:?} was found{stopped}"),
                }
            }
        };
        eprintln!("kvrelay check: {why}; {} not written", path.display());
        return Ok(());
    };
    let diagram = report.mermaid(p.name).unwrap_or_default();
    std::fs::write(path, diagram)
        .map_err(|e| format!("cannot write --diagram {}: {e}", path.display()))?;
    eprintln!(
        "kvrelay check: wrote the {} of {:?} ({} actions) to {} as a Mermaid sequence diagram",
        if p.expectation == "sometimes" {
            "example"
        } else {
            "counterexample"
        },
        p.name,
        p.diagram.as_ref().map_or(0, Vec::len),
        path.display()
    );
    Ok(())
}

pub(super) fn print_report(r: &CheckReport) -> ExitCode {
    let rate = if r.seconds > 0.0 {
        r.states as f64 / r.seconds
    } else {
        0.0
    };
    println!(
        "{} — {} states, {} unique, max depth {}, {:.2} s, {:.0} states/s ({}{}, {} thread{})",
        r.stop,
        r.states,
        r.unique_states,
        r.max_depth,
        r.seconds,
        rate,
        r.strategy,
        if r.symmetry { ", symmetry" } else { "" },
        r.threads,
        if r.threads == 1 { "" } else { "s" }
    );
    println!();
    println!("{:<10} {:<10} property", "result", "kind");
    for p in &r.properties {
        let verdict = match (p.expectation, p.holds) {
            ("sometimes", true) => "example",
            ("sometimes", false) => "NO EXAMPLE",
            (_, true) => "holds",
            (_, false) => "VIOLATED",
        };
        println!("{verdict:<10} {:<10} {}", p.expectation, p.name);
    }
    for p in &r.properties {
        if let (false, Some(path)) = (p.holds, &p.path) {
            println!();
            println!(
                "counterexample for \"{}\" ({} action{}):",
                p.name,
                path.len(),
                if path.len() == 1 { "" } else { "s" }
            );
            for (i, line) in path.iter().enumerate() {
                println!("  {:>3}. {line}", i + 1);
            }
            if let Some(encoded) = &p.encoded_path {
                println!("  (in the explorer, --explore ADDR: #/steps/{encoded})");
            }
        }
    }
    if r.passed_within_bound() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
