//! `kvrelay pd`: a workload through a prefill engine and a decode engine, two processes, with
//! the P/D connector and a router between them (parsing and printing; the engines, the KV
//! path and the router are `kvrelay_engine::pd`).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::run::{EngineArgs, TierArgs};

pub(crate) const HELP: &str = "\
Each request goes to the prefill engine with do_remote_decode and one output token; when it
finishes, the prefill engine holds its blocks and returns kv_transfer_params naming them; the
router sends the request on to the decode engine with those params and its own output length,
as vLLM's disaggregation proxy does. The decode engine's ranks read the blocks from the prefill
engine's KV server (TCP on loopback, rank to rank), each read under --read-deadline-ms, and
check every loaded block byte for byte against the request's tokens when it lands. A failed or
late read is a failed load: the decode engine recomputes those tokens. Once the decode side
has read a request's KV (its first token, or its end), the router acknowledges it and the
prefill engine releases the blocks. Each engine also offloads to its CPU pool (vLLM's
MultiConnector over the P/D connector and the offloading connector); with --tier both cascade
into one shared tier behind their CPU pools, and a prefill engine prefills from what any engine
stored there (a second pair, a restart).

Both engines step in lockstep on one virtual clock, so the counts are the same on every run.
Latencies are on that clock: time to first token runs from a request's arrival to its first
token on the decode engine.

Semantics: compat holds a request's blocks until its acknowledgement comes, for ever if it
never does (vLLM #46283). --mode strict --lease-steps N releases them N steps after the
request finished whatever the decode side does (docs/COMPAT.md).

Examples:
  kvrelay pd
  kvrelay pd --trace tests/traces/mooncake/conversation_trace.jsonl.gz --requests 300
  kvrelay pd --mode strict --lease-steps 64 --json
  kvrelay pd --tier redis://127.0.0.1:7000     (a local cluster: tests/tier/cluster.sh start)

Exit status: 0 when every request finished and neither engine left anything behind (held
blocks, requests, jobs), 1 when the run stopped on an error or left something behind (the
report says what), 2 on bad flags or files.";

/// `kvrelay pd` flags: [`EngineArgs`] for both engines, and the P/D settings.
#[derive(Args, Debug, Clone)]
pub(crate) struct PdArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub tier: TierArgs,
    /// Strict mode: steps a finished request's blocks wait for the decode side's
    /// acknowledgement before they are released anyway (default: wait for ever, as vLLM).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub lease_steps: Option<u32>,
    /// How long one read of a decode rank from the prefill engine may take (connecting
    /// included) before its load fails, in ms.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub read_deadline_ms: u64,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `kvrelay pd`: see [`HELP`].
pub(crate) fn run(args: &PdArgs) -> ExitCode {
    let config = match args.engine.config().and_then(|mut c| {
        args.tier.apply(&mut c)?;
        Ok(c)
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvrelay pd: {e}");
            return ExitCode::from(2);
        }
    };
    let records = match kvrelay_engine::requests(&config) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvrelay pd: {e}");
            return ExitCode::from(2);
        }
    };
    let bar = if args.json || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(records.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} requests  [{elapsed}]")
            .expect("a valid template"),
    );
    let run = async {
        kvrelay_engine::pd::run_processes(
            &config,
            &records,
            config.worker_exe.as_deref(),
            args.lease_steps,
            args.read_deadline_ms,
            |done, _| bar.set_position(done),
        )
        .await
    };
    let report = kvrelay_engine::runtime().and_then(|rt| rt.block_on(run));
    bar.finish_and_clear();
    let report = match report {
        Ok(r) => r,
        Err(e @ kvrelay_engine::RunError::Config(_)) => {
            eprintln!("kvrelay pd: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("kvrelay pd: {e}");
            return ExitCode::from(1);
        }
    };
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("kvrelay pd: {e}");
                return ExitCode::from(1);
            }
        }
    } else {
        print!("{}", report.text());
    }
    if report.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
