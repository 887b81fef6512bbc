//! Runs one completion check and prints the report: `cargo run --release -p kvrelay-model-check
//! --example check -- [ci|deep] [threads]`.

use kvrelay_model_check::{CompletionConfig, check_completions};

fn main() {
    let mut args = std::env::args().skip(1);
    let config = match args.next().as_deref() {
        None | Some("ci") => CompletionConfig::ci(),
        Some("deep") => CompletionConfig::deep(),
        Some(other) => panic!("unknown preset {other}: use ci or deep"),
    };
    let mut config = config;
    for kv in std::env::var("MC_OVERRIDE").unwrap_or_default().split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').expect("k=v");
        match k {
            "ranks" => config.ranks = v.parse().unwrap(),
            "requests" => config.requests = v.parse().unwrap(),
            "failures" => config.failures = v.parse().unwrap(),
            "strict" => config.mode = if v.parse().unwrap() { kvrelay_core::Mode::Strict } else { kvrelay_core::Mode::Compat },
            "double" => config.faulty_double_report = v.parse().unwrap(),
            "bind" => config.faulty_bind_first = v.parse().unwrap(),
            _ => panic!("unknown {k}"),
        }
    }
    let threads = args.next().map_or(2, |t| t.parse().expect("threads"));
    let report = check_completions(config, threads, &mut |p| {
        eprintln!(
            "  states {} unique {} depth {} {:.1} s",
            p.states, p.unique_states, p.max_depth, p.elapsed_seconds
        );
    });
    println!(
        "{config:?}: states {} unique {} depth {} in {:.2} s, complete {}",
        report.states, report.unique_states, report.max_depth, report.seconds, report.complete
    );
    for p in &report.properties {
        println!("  {:<9} {:<5} {}", p.expectation, p.holds, p.name);
    }
}
