//! `kvrelay route`: a workload through N engines behind kvrelay's KV-aware router, against
//! round robin, side by side (parsing and printing; the router is `kvrelay-router`).

use std::process::ExitCode;

use clap::Args;
use kvrelay_router::{Policy, RouteReport};

use crate::run::EngineArgs;

pub(crate) const HELP: &str = "\
Each engine publishes its KV events (vLLM's wire format) on loopback ZMQ; the router follows
every stream (replaying what it missed) and, with kv-aware, sends each request to the engine
holding its longest cached prefix (GPU or CPU; vLLM's block hashes of the prompt), fewer live
requests breaking ties. Requests arrive on the workload's virtual clock, and each routing
decision sees every event of every step before it, so a run routes the same way anywhere.

Examples:
  kvrelay route --trace tests/traces/mooncake/conversation_trace.jsonl.gz --requests 2000
  kvrelay route --policy kv-aware --engines 4 --json

Exit status: 0 when every policy's run finished, 1 when one stopped on an error, 2 on bad
flags or files.";

/// `kvrelay route` flags: the fleet, the policies, and [`EngineArgs`] for each engine.
#[derive(Args, Debug, Clone)]
pub(crate) struct RouteArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Engines behind the router.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub engines: u32,
    /// The routing policy, or both side by side.
    #[arg(long, default_value = "both", value_parser = ["kv-aware", "round-robin", "both"])]
    pub policy: String,
    /// Print the reports as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `kvrelay route`: see [`HELP`].
pub(crate) fn run(args: &RouteArgs) -> ExitCode {
    let config = match args.engine.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvrelay route: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(s) = config.trace_split {
        eprintln!("kvrelay route: trace_split {s}: the router deals the requests out itself");
        return ExitCode::from(2);
    }
    let records = match kvrelay_engine::requests(&config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvrelay route: {e}");
            return ExitCode::from(2);
        }
    };
    let policies = match args.policy.as_str() {
        "kv-aware" => vec![Policy::KvAware],
        "round-robin" => vec![Policy::RoundRobin],
        _ => vec![Policy::KvAware, Policy::RoundRobin],
    };
    let mut reports = Vec::new();
    for p in policies {
        eprintln!(
            "kvrelay route: {} requests through {} engines, {}",
            records.len(),
            args.engines,
            name(p)
        );
        match kvrelay_router::route(&config, &records, args.engines as usize, p) {
            Ok(r) => reports.push(r),
            Err(e) => {
                eprintln!("kvrelay route: {}: {e}", name(p));
                return ExitCode::from(1);
            }
        }
    }
    if args.json {
        match serde_json::to_string_pretty(&reports) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("kvrelay route: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        print!("{}", table(&reports));
    }
    ExitCode::SUCCESS
}

fn name(p: Policy) -> &'static str {
    match p {
        Policy::KvAware => "kv-aware",
        Policy::RoundRobin => "round-robin",
    }
}

/// One column per policy: the totals, then each engine's share.
fn table(reports: &[RouteReport]) -> String {
    let mut rows: Vec<(String, Vec<String>)> = vec![
        (
            "prompt tokens".into(),
            col(reports, |r| r.prompt_tokens.to_string()),
        ),
        (
            "reused tokens".into(),
            col(reports, |r| r.reused_tokens.to_string()),
        ),
        (
            "prefix reuse".into(),
            col(reports, |r| format!("{:.1} %", r.reuse_pct)),
        ),
        (
            "tokens computed".into(),
            col(reports, |r| r.tokens_computed.to_string()),
        ),
        (
            "wall".into(),
            col(reports, |r| format!("{:.1} s", r.wall_s)),
        ),
    ];
    let n = reports.first().map_or(0, |r| r.engines.len());
    for k in 0..n {
        rows.push((
            format!("engine {k}"),
            col(reports, |r| {
                let s = &r.engines[k];
                format!(
                    "{} req ({} by prefix), {} reused, {} computed",
                    s.requests, s.by_prefix, s.report.reused_tokens, s.report.tokens_computed
                )
            }),
        ));
    }
    let mut out = format!("{:<16}", "");
    for r in reports {
        out += &format!("  {:<52}", name(r.policy));
    }
    out = out.trim_end().to_string() + "\n";
    for (label, cells) in rows {
        out += &format!("{label:<16}");
        for c in cells {
            out += &format!("  {c:<52}");
        }
        out = out.trim_end().to_string() + "\n";
    }
    out
}

fn col(reports: &[RouteReport], f: impl Fn(&RouteReport) -> String) -> Vec<String> {
    reports.iter().map(f).collect()
}
