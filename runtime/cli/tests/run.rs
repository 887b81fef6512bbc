//! `kvrelay run`: the engine runtime serves a workload end to end with real bytes, and its
//! verification can fail.

use std::process::Command;

use kvrelay_engine::transport::{InProcess, Processes, Transport};
use kvrelay_engine::workload::{WorkloadConfig, read_trace, write_trace};
use kvrelay_engine::{RunConfig, RunError, requests, run, run_with};
use kvrelay_sim::faults::LoseRank;

fn small() -> RunConfig {
    RunConfig {
        workload: WorkloadConfig {
            conversations: 24,
            ..WorkloadConfig::default()
        },
        check: true,
        ..RunConfig::default()
    }
}

// Protects the main job: every request finishes, requests are preempted and offloaded blocks are
// loaded back, every load is verified, and every machine's invariants hold after every step.
#[test]
fn the_default_shape_offloads_preempts_and_verifies_everything() {
    let c = small();
    let records = requests(&c).unwrap();
    let r = run(&c, &records, &mut ()).unwrap();
    assert_eq!(r.finished, r.requests);
    assert_eq!(r.requests, records.len() as u64);
    assert!(r.preemptions > 0, "{r:#?}");
    assert!(r.blocks_offloaded > 0 && r.blocks_loaded > 0, "{r:#?}");
    assert!(
        r.cpu_loaded_tokens > 0 && r.gpu_prefix_hit_tokens > 0,
        "{r:#?}"
    );
    assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
    assert!(r.written_slots_verified > 0 && r.read_blocks_checked > 0);
    assert!(r.invariants_checked);
    assert_eq!(
        r.invariant_checks,
        3 * r.steps,
        "the engine and both ranks check every step"
    );
}

// Protects async scheduling with real bytes: every step after the first is scheduled while the
// ranks run the previous one, the ranks receive the sampled tokens before they compute them, and
// every check still holds.
#[test]
fn async_scheduling_depth_2_verifies_too() {
    let c = RunConfig {
        async_depth: 2,
        ..small()
    };
    let records = requests(&c).unwrap();
    let r = run(&c, &records, &mut ()).unwrap();
    assert_eq!(r.finished, r.requests);
    assert!(r.scheduled_ahead > r.steps / 2, "{r:#?}");
    assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
    assert_eq!(r.invariant_checks, 3 * r.steps);
    let bad = RunConfig {
        async_depth: 3,
        ..small()
    };
    assert!(matches!(
        run(&bad, &records, &mut ()),
        Err(RunError::Config(_))
    ));
}

// Protects several ranks and other shapes: 1 and 3 ranks, block-major is not needed, ARC.
#[test]
fn other_rank_counts_and_the_arc_policy_verify_too() {
    for ranks in [1, 3] {
        let c = RunConfig {
            ranks,
            policy: kvrelay_core::PolicyKind::Arc,
            ..small()
        };
        let records = requests(&c).unwrap();
        let r = run(&c, &records, &mut ()).unwrap();
        assert_eq!(r.finished, r.requests, "{ranks} ranks");
        assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
    }
}

// Protects "never hangs": a rank that stops without reporting (a crash, injected through the
// transport seam: `kvrelay_sim::faults::LoseRank`) stops the run with an error naming it, on both
// transports.
#[test]
fn a_rank_that_vanishes_stops_the_run_instead_of_hanging_it() {
    let exe = Some(std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvrelay")));
    let transports: [Box<dyn Transport>; 2] = [
        Box::new(LoseRank {
            inner: InProcess,
            rank: 0,
            after_steps: 5,
        }),
        Box::new(LoseRank {
            inner: Processes { exe },
            rank: 0,
            after_steps: 5,
        }),
    ];
    for transport in transports {
        let c = small();
        let records = requests(&c).unwrap();
        match run_with(&c, &records, &mut (), &*transport) {
            Err(RunError::RankGone { rank: 0 }) | Err(RunError::Worker { rank: 0, .. }) => {}
            other => panic!("{transport:?}: expected rank 0 gone, got {other:?}"),
        }
    }
}

// Protects bad configurations: a typed error, not a panic.
#[test]
fn bad_configurations_are_errors() {
    let c = RunConfig {
        block_bytes: Some(100),
        ..small()
    };
    let records = requests(&small()).unwrap();
    assert!(matches!(
        run(&c, &records, &mut ()),
        Err(RunError::Config(_))
    ));
    let c = RunConfig {
        ranks: 0,
        ..small()
    };
    assert!(matches!(
        run(&c, &records, &mut ()),
        Err(RunError::Config(_))
    ));
}

fn kvrelay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .output()
        .expect("run kvrelay")
}

// Protects the command line: the report as JSON, a written trace replayed, exit status 2 on
// bad files.
#[test]
fn the_command_line_reports_json_and_replays_its_own_trace() {
    let dir = std::env::temp_dir().join(format!("kvrelay-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("w.jsonl");
    let t = trace.to_str().unwrap();
    let out = kvrelay(&["run", "--conversations", "8", "--json", "--write-trace", t]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["finished"], v["requests"]);
    let written = read_trace(&trace, 64).unwrap();
    assert_eq!(v["requests"], written.len() as u64);

    // With --trace, hash blocks are 512 tokens (Mooncake's) unless given: a trace written with
    // 64 is refused, naming the flag, rather than replayed as other requests.
    let out = kvrelay(&["run", "--trace", t]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--hash-block-tokens"));

    let perfetto = dir.join("timeline.json");
    let out = kvrelay(&[
        "run",
        "--trace",
        t,
        "--hash-block-tokens",
        "64",
        // A trace gets production defaults; the generated workload's shape, given, makes
        // the replay the same run.
        "--gpu-blocks",
        "320",
        "--cpu-blocks",
        "4096",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "1024",
        "--block-bytes",
        "2048",
        "--json",
        "--timeline",
        perfetto.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_same_run(&w, &v);
    let events: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&perfetto).unwrap()).unwrap();
    let spans = events["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count() as u64;
    // The engine's steps and each of the 2 ranks' steps, plus transfers.
    assert!(spans >= 3 * w["steps"].as_u64().unwrap(), "{spans} spans");

    std::fs::write(&trace, "not json\n").unwrap();
    let out = kvrelay(&["run", "--trace", t]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(":1:"));

    let cfg = dir.join("c.toml");
    std::fs::write(&cfg, "ranks = 1\n[workload]\nconversations = 4\n").unwrap();
    let out = kvrelay(&["run", "--config", cfg.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ranks"], 1);
    std::fs::write(&cfg, "rank = 1\n").unwrap();
    let out = kvrelay(&["run", "--config", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "an unknown key is refused");

    write_trace(&trace, &written[..1]).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

// Protects the process transport: 2 worker processes over Unix sockets serve the workload
// with every check, and a worker that cannot start is a typed error, not a hang (a corruption
// inside a worker: `runtime/sim/tests/faults.rs`).
#[test]
fn worker_processes_serve_verify_and_fail_cleanly() {
    let c = RunConfig {
        workers: kvrelay_engine::Workers::Process,
        worker_exe: Some(env!("CARGO_BIN_EXE_kvrelay").into()),
        ..small()
    };
    let records = requests(&c).unwrap();
    let r = run(&c, &records, &mut ()).unwrap();
    assert_eq!(r.finished, r.requests);
    assert!(r.blocks_loaded > 0);
    assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
    assert_eq!(
        r.invariant_checks,
        3 * r.steps,
        "the engine and both ranks check every step"
    );

    let missing = RunConfig {
        worker_exe: Some("/nonexistent/kvrelay".into()),
        ..c.clone()
    };
    match run(&missing, &records, &mut ()) {
        Err(RunError::Worker { rank: 0, why }) => assert!(why.contains("cannot start"), "{why}"),
        other => panic!("expected a worker start error, got {other:?}"),
    }
}

// Protects admission as vLLM does it: a GPU pool that cannot hold one request of max_model_len
// is refused at start with the numbers (exit 2), and prompts of max_model_len or more are
// refused at submit, counted, while the rest of the run goes on.
#[test]
fn admission_refuses_what_cannot_fit_and_counts_it() {
    let out = kvrelay(&["run", "--conversations", "8", "--gpu-blocks", "50"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot hold one request of max_model_len"),
        "{err}"
    );
    assert!(err.contains("--gpu-blocks"), "{err}");

    let out = kvrelay(&[
        "run",
        "--conversations",
        "8",
        "--max-model-len",
        "700",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (refused, finished) = (
        v["refused"].as_u64().unwrap(),
        v["finished"].as_u64().unwrap(),
    );
    assert!(
        refused > 0 && finished > 0,
        "{refused} refused, {finished} finished"
    );
    assert_eq!(refused + finished, v["requests"].as_u64().unwrap());
    assert_eq!(v["max_model_len"], 700);
}

/// The same requests, and (a run's steps do not depend on the machine's speed) the same run,
/// count for count.
fn assert_same_run(w: &serde_json::Value, v: &serde_json::Value) {
    for k in [
        "requests",
        "prompt_tokens",
        "generated_tokens",
        "tokens_computed",
        "reused_tokens",
        "cpu_loaded_tokens",
        "steps",
        "preemptions",
        "blocks_offloaded",
        "blocks_loaded",
        "written_slots_verified",
        "read_blocks_checked",
    ] {
        assert_eq!(w[k], v[k], "{k}");
    }
}

// Protects `--trace-split K/N` (issue 36): the N shares are the whole workload's requests,
// prompt for prompt, each run on an engine built for the whole (its max_model_len); a bad
// split, on the command line or in TOML, is refused at start with exit status 2.
#[test]
fn trace_split_shares_are_the_whole_workload() {
    let json = |args: &[&str]| -> serde_json::Value {
        let out = kvrelay(&[&["run", "--conversations", "24", "--json"], args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let whole = json(&["--requests", "30"]);
    let shares = [
        json(&["--requests", "30", "--trace-split", "0/2"]),
        json(&["--requests", "30", "--trace-split", "1/2"]),
    ];
    for k in ["requests", "finished", "prompt_tokens"] {
        assert_eq!(
            n(&whole, k),
            shares.iter().map(|s| n(s, k)).sum::<u64>(),
            "{k}"
        );
    }
    assert_eq!(n(&shares[0], "requests"), 15);
    for s in &shares {
        assert_eq!(s["max_model_len"], whole["max_model_len"]);
        assert_eq!(s["gpu_blocks"], whole["gpu_blocks"]);
    }
    for bad in ["2/2", "1", "0/0"] {
        let out = kvrelay(&["run", "--trace-split", bad]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--trace-split") && err.contains("K"), "{err}");
    }
    let dir = std::env::temp_dir().join(format!("kvrelay-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("split.toml");
    std::fs::write(&toml, "trace_split = \"3/2\"\n").unwrap();
    let out = kvrelay(&["run", "--config", toml.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("engine K of N"));
    std::fs::write(&toml, "trace_split = \"1/2\"\nrequests = 10\n").unwrap();
    let v = json(&["--config", toml.to_str().unwrap()]);
    assert_eq!(n(&v, "requests"), 5);
    std::fs::remove_dir_all(&dir).unwrap();
}
