//! `kvrelay worker` whose rank 0 corrupts its first load ([`kvrelay_sim::faults`], as
//! `CorruptingInProcess`; the other ranks are plain workers): a worker process for tests that must
//! see a worker's corruption error reach the engine. Give it as `RunConfig::worker_exe` with
//! `Workers::Process`; it takes the command line the engine starts a worker with,
//! `worker --socket PATH --rank R`.

use std::path::PathBuf;
use std::process::ExitCode;

use kvrelay_engine::transport::process::{worker_main, worker_main_with};
use kvrelay_sim::faults::CorruptFirstLoad;

fn main() -> ExitCode {
    match parse(std::env::args().skip(1)) {
        Ok((socket, 0)) => worker_main_with(&socket, 0, CorruptFirstLoad::wrap),
        Ok((socket, rank)) => worker_main(&socket, rank),
        Err(why) => {
            eprintln!(
                "kvrelay-corrupting-worker: {why}\nusage: kvrelay-corrupting-worker worker --socket PATH --rank R"
            );
            ExitCode::from(2)
        }
    }
}

/// `worker --socket PATH --rank R`, flags in any order.
fn parse(mut args: impl Iterator<Item = String>) -> Result<(PathBuf, u32), String> {
    if args.next().as_deref() != Some("worker") {
        return Err("expected the subcommand `worker`".into());
    }
    let (mut socket, mut rank) = (None, None);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--socket" => socket = Some(PathBuf::from(value)),
            "--rank" => rank = Some(value.parse().map_err(|e| format!("--rank {value}: {e}"))?),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok((
        socket.ok_or("--socket is required")?,
        rank.ok_or("--rank is required")?,
    ))
}
