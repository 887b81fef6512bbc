//! Runs one preset exhaustively and prints the report:
//! `cargo run --release -p kvrelay-model-check --example check -- [ci|deep] [threads]`.
//! (`kvrelay check` is the full command line.)

use kvrelay_model_check::{CompletionConfig, check_completions};

fn main() {
    let mut args = std::env::args().skip(1);
    let config = match args.next().as_deref() {
        None | Some("ci") => CompletionConfig::ci(),
        Some("deep") => CompletionConfig::deep(),
        Some(other) => panic!("unknown preset {other}: use ci or deep"),
    };
    let threads = args
        .next()
        .map_or(2, |t| t.parse().expect("threads: a number"));
    let report = check_completions(config, threads, &mut |p| {
        eprintln!(
            "  states {} unique {} depth {} {:.1} s",
            p.states, p.unique_states, p.max_depth, p.elapsed_seconds
        );
    });
    println!(
        "{config:?}: {} states, {} unique, depth {}, {:.2} s, complete {}",
        report.states, report.unique_states, report.max_depth, report.seconds, report.complete
    );
    for p in &report.properties {
        println!("  {:<9} {:<5} {}", p.expectation, p.holds, p.name);
    }
    std::process::exit(if report.passed() { 0 } else { 1 });
}
