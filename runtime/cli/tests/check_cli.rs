//! `kvrelay check` as a user runs it: exit codes, the diagram file, refused flags.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs `kvrelay check ARGS`, killing it (and failing) if it runs past `limit`: nothing here may
/// leave a process behind (e.g. an explorer that should have been refused).
fn kvrelay_check(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .arg("check")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvrelay runs");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvrelay check {args:?} still ran after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn temp_file(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!("kvrelay-{}-{nanos}-{name}", std::process::id()))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn a_faulty_configuration_exits_1_and_writes_its_counterexample_diagram() {
    let out_file = temp_file("double-report.mmd");
    let out = kvrelay_check(
        &[
            "--model",
            "completion",
            "--faulty-double-report",
            "--threads",
            "1",
            "--diagram",
            out_file.to_str().unwrap(),
        ],
        LIMIT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("VIOLATED"), "{stdout}");
    assert!(
        stdout.contains("    1. rank 0: recv of req#0 completes"),
        "numbered counterexample lines: {stdout}"
    );
    assert!(stderr.contains("wrote the counterexample"), "{stderr}");
    for line in [
        "kvrelay check: completion model\n",
        "  model = completion\n",
        "  faulty_double_report = true\n",
        "  faulty_bind_first = false\n",
        "  threads = 1\n",
    ] {
        assert!(stderr.contains(line), "{line:?} in {stderr}");
    }
    let diagram = std::fs::read_to_string(&out_file).expect("the diagram file was written");
    let _ = std::fs::remove_file(&out_file);
    assert!(diagram.starts_with("sequenceDiagram\n"), "{diagram}");
    assert!(diagram.contains("participant p1 as rank 0"), "{diagram}");
    assert!(
        diagram.contains("p0->>p1: recv of req#35;0 completes"),
        "{diagram}"
    );
    assert_eq!(diagram.matches("->>").count(), 8, "{diagram}");
}

#[test]
fn diagram_of_writes_the_example_of_a_sometimes_property() {
    let out_file = temp_file("example.mmd");
    let out = kvrelay_check(
        &[
            "--model",
            "completion",
            "--threads",
            "1",
            "--diagram-of",
            "all transfers",
            "--diagram",
            out_file.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let diagram = std::fs::read_to_string(&out_file).expect("the diagram file was written");
    let _ = std::fs::remove_file(&out_file);
    assert!(
        diagram.contains("example of sometimes \"all transfers emitted\""),
        "{diagram}"
    );
}

#[test]
fn a_non_loopback_explorer_address_is_refused() {
    let out = kvrelay_check(&["--explore", "0.0.0.0:1"], Duration::from_secs(30));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not a loopback address"), "{stderr}");
    assert!(stderr.contains("--allow-remote"), "{stderr}");
}

#[test]
fn flags_that_cannot_apply_are_refused_before_checking() {
    for (args, expected) in [
        (
            &["--model", "completion", "--symmetry"][..],
            "--symmetry does not apply to --model completion",
        ),
        (&["--threads", "0"][..], "--threads must be at least 1"),
        (
            &["--model", "completion", "--ranks", "0"][..],
            "invalid configuration of the completion model",
        ),
        (
            &["--ranks", "0"][..],
            "invalid configuration of the system model",
        ),
        (
            &["--prompt-tokens", "3", "--block-size", "2"][..],
            "invalid configuration of the system model",
        ),
        (
            &[
                "--fault",
                "drop-zero-external-alloc",
                "--fault",
                "lookup-ignores-jobs",
            ][..],
            "at most one scheduler-side --fault can be injected, not both \
             drop-zero-external-alloc and lookup-ignores-jobs",
        ),
        (
            &["--diagram-of", "no such property", "--diagram", "x.mmd"][..],
            "matches no property",
        ),
        (
            &[
                "--model",
                "completion",
                "--diagram-of",
                "I-24",
                "--diagram",
                "x.mmd",
            ][..],
            "matches several properties",
        ),
        // Flags of one model are refused for the other.
        (
            &["--model", "completion", "--gpu-blocks", "3"][..],
            "--gpu-blocks does not apply to --model completion (only to --model system)",
        ),
        (
            &["--model", "completion", "--fault", "bind-first"][..],
            "--fault does not apply to --model completion (only to --model system)",
        ),
        (
            &["--model", "completion", "--unordered-completions"][..],
            "--unordered-completions does not apply to --model completion",
        ),
        (
            &["--model", "completion", "--policy", "arc"][..],
            "--policy does not apply to --model completion",
        ),
        (
            &["--model", "completion", "--partial-order", "true"][..],
            "--partial-order does not apply to --model completion (only to --model system)",
        ),
        (
            &["--failures", "true"][..],
            "--failures does not apply to --model system (only to --model completion)",
        ),
        (
            &["--faulty-bind-first"][..],
            "--faulty-bind-first does not apply to --model system",
        ),
        (
            &["--faulty-double-report"][..],
            "--faulty-double-report does not apply to --model system",
        ),
    ] {
        let out = kvrelay_check(args, Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    // Contradictory or unknown flags are clap errors (also status 2); breadth-first is the
    // default, and has no flag.
    for args in [
        &["--explore", "127.0.0.1:1", "--dfs"][..],
        &["--allow-remote"][..],
        &["--bfs"][..],
        &["--diagram-of", "I-21"][..],
        &["--fault", "no-such-fault"][..],
        &["--policy", "fifo"][..],
        &["--model", "no-such-model"][..],
    ] {
        let out = kvrelay_check(args, Duration::from_secs(30));
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// The default `kvrelay check` is the system model's `ci` preset, explored exhaustively, with
/// every property listed as holding or with an example.
#[test]
fn the_default_check_is_the_system_model_ci_and_every_property_passes() {
    use kvrelay_model_check::system_properties as n;
    let out = kvrelay_check(&[], LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("system model of the offloading connector"),
        "{stderr}"
    );
    assert!(stdout.starts_with("explored exhaustively"), "{stdout}");
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("result"))
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect();
    for always in [
        n::PROTOCOL,
        n::NO_WRITE_UNDER_STORE,
        n::DATA,
        n::OWNED_WRITES,
        n::FINISHED_ONCE,
        n::QUORUM,
        n::CORE,
        n::QUIESCENT,
    ] {
        let row = format!("{:<10} {:<10} {always}", "holds", "always");
        assert!(rows.contains(&row.as_str()), "{row:?} in {stdout}");
    }
    for sometimes in [
        n::FLUSHED,
        n::PREEMPTED,
        n::RESUMED_FROM_OFFLOAD,
        n::ALL_DONE,
    ] {
        let row = format!("{:<10} {:<10} {sometimes}", "example", "sometimes");
        assert!(rows.contains(&row.as_str()), "{row:?} in {stdout}");
    }
    assert_eq!(rows.len(), 12, "{stdout}");
    assert!(
        !stdout.contains("VIOLATED") && !stdout.contains("NO EXAMPLE"),
        "{stdout}"
    );
}

#[test]
fn a_system_fault_exits_1_and_writes_its_counterexample_diagram() {
    use kvrelay_model_check::system_properties as n;
    let out_file = temp_file("swallow-load-failures.mmd");
    let out = kvrelay_check(
        &[
            "--connector",
            "pd",
            "--fault",
            "swallow-load-failures",
            "--threads",
            "1",
            "--diagram",
            out_file.to_str().unwrap(),
        ],
        LIMIT,
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("{:<10} {:<10} {}", "VIOLATED", "always", n::DATA)),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("counterexample for \"{}\"", n::DATA)),
        "{stdout}"
    );
    assert!(stdout.contains("    1. request 0 arrives"), "{stdout}");
    assert!(stderr.contains("wrote the counterexample"), "{stderr}");
    let diagram = std::fs::read_to_string(&out_file).expect("the diagram file was written");
    let _ = std::fs::remove_file(&out_file);
    assert!(diagram.starts_with("sequenceDiagram\n"), "{diagram}");
    for participant in ["env", "scheduler", "rank 0", "rank 1", "aggregator"] {
        assert!(
            diagram.contains(&format!(" as {participant}\n")),
            "{participant}: {diagram}"
        );
    }
    assert!(diagram.contains("->>"), "{diagram}");
    assert!(
        diagram.contains(&format!("counterexample to always \"{}\"", n::DATA)),
        "{diagram}"
    );
}

/// The system model's override flags reach its configuration, echoed on stderr before the run as
/// `key = value` lines named after the flags.
#[test]
fn system_flags_override_the_preset() {
    let out = kvrelay_check(
        &[
            "--config",
            "deep",
            "--ranks",
            "1",
            "--requests",
            "1",
            "--mode",
            "strict",
            "--gpu-blocks",
            "9",
            "--block-size",
            "1",
            "--no-prefix-caching",
            "--cpu-chunks",
            "2",
            "--blocks-per-chunk",
            "2",
            "--prompt-tokens",
            "4",
            "--shared-tokens",
            "2",
            "--max-tokens",
            "1",
            "--max-batched-tokens",
            "4",
            "--async-depth",
            "1",
            "--aborts",
            "0",
            "--resets",
            "0",
            "--idle-steps",
            "1",
            "--policy",
            "arc",
            "--sliding-window",
            "2",
            "--unordered-completions",
            "--fault",
            "lookup-ignores-jobs",
            "--max-depth",
            "4",
            "--threads",
            "1",
        ],
        LIMIT,
    );
    let stderr = text(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{stderr}");
    for line in [
        "kvrelay check: system model of the offloading connector\n",
        "  model = system\n",
        "  config = deep\n",
        "  ranks = 1\n",
        "  requests = 1\n",
        "  mode = strict\n",
        "  connector = offloading\n",
        "  gpu_blocks = 9\n",
        "  block_size = 1\n",
        "  no_prefix_caching = true\n",
        "  cpu_chunks = 2\n",
        "  blocks_per_chunk = 2\n",
        "  prompt_tokens = 4\n",
        "  shared_tokens = 2\n",
        "  max_tokens = 1\n",
        "  max_batched_tokens = 4\n",
        "  async_depth = 1\n",
        "  aborts = 0\n",
        "  resets = 0\n",
        "  load_failures = 0\n",
        "  idle_steps = 1\n",
        "  policy = arc\n",
        "  sliding_window = 2\n",
        "  unordered_completions = true\n",
        "  faults = lookup-ignores-jobs\n",
        "  threads = 1\n",
        "  dfs = false\n",
        "  symmetry = false\n",
        "  max_depth = 4\n",
        "  keep_going = false\n",
    ] {
        assert!(stderr.contains(line), "{line:?} in {stderr}");
    }
    assert!(!stderr.contains("pd_role"), "{stderr}");
}

#[test]
fn connectors_run_and_their_faults_are_found_or_refused() {
    // The P/D connector's ci configuration holds (exit 0) ...
    let out = kvrelay_check(&["--connector", "pd"], LIMIT);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(text(&out.stdout).contains("a load fails and the request recomputes"));
    assert!(
        stderr.contains("  connector = pd\n  pd_role = both\n"),
        "{stderr}"
    );
    assert!(stderr.contains("  load_failures = 1\n"), "{stderr}");
    // ... two senders without their extra saves are caught (exit 1) ...
    let out = kvrelay_check(
        &[
            "--connector",
            "multi-senders",
            "--fault",
            "strip-extra-saves",
            "--threads",
            "1",
        ],
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("decode side acknowledges"));
    // ... a decode side that never answers is stuck in compat (exit 1) and released by the
    // lease in strict (exit 0, issue 37) ...
    let silent = ["--connector", "pd", "--pd-silent-remote", "--threads", "1"];
    let out = kvrelay_check(&silent, LIMIT);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("no stuck state"));
    let out = kvrelay_check(&[&silent[..], &["--mode", "strict"]].concat(), LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    // ... and faults or roles that do not fit the connector are typed errors (exit 2).
    for (args, why) in [
        (
            &["--fault", "swallow-load-failures"][..],
            "applies to --connector pd",
        ),
        (
            &["--connector", "pd", "--fault", "strip-extra-saves"][..],
            "multi-senders",
        ),
        (&["--pd-role", "decode"][..], "apply to --connector pd"),
        (
            &["--connector", "pd", "--pd-lease", "0"][..],
            "at least 1 step",
        ),
        (
            &["--model", "completion", "--connector", "pd"][..],
            "--connector does not apply",
        ),
    ] {
        let out = kvrelay_check(args, LIMIT);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains(why),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// A fault re-introduced inside kvrelay-core (the scheduler's, and the runner's and executor's,
/// whose step runs in the core) needs a build with the `scheduler-faults` feature: without it, a
/// clear error, never a silently fault-free run.
#[cfg(not(feature = "scheduler-faults"))]
#[test]
fn a_core_fault_without_the_feature_is_refused() {
    for args in [
        &["--connector", "pd", "--fault", "free-aborted-while-loading"][..],
        &["--fault", "bind-first"][..],
        &["--fault", "skip-handle-preemptions"][..],
        &["--fault", "one-rank-output"][..],
    ] {
        let out = kvrelay_check(args, LIMIT);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains("--features scheduler-faults"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// vLLM issue #46014 from the command line: the faulty lookup with the GPU prefix cache off
/// re-admits a request whose flushed store is unacknowledged, and its load job is refused (I-39).
#[test]
fn the_readmission_fault_is_found_with_the_prefix_cache_off() {
    let args = [
        "--fault",
        "lookup-ignores-jobs",
        "--no-prefix-caching",
        "--ranks",
        "1",
        "--requests",
        "3",
        "--max-tokens",
        "3",
        "--gpu-blocks",
        "5",
        "--async-depth",
        "2",
        "--aborts",
        "0",
        "--threads",
        "1",
    ];
    let out = kvrelay_check(&args, LIMIT);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(stdout.contains("for RequestId(1) next to job"), "{stdout}");
    // The prefix-cache flag belongs to the system model.
    let out = kvrelay_check(&["--model", "completion", "--no-prefix-caching"], LIMIT);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--no-prefix-caching"),
        "{}",
        text(&out.stderr)
    );
}

/// `--partial-order` (issue 23): off by default with the `ci` preset (its counts are pinned),
/// on with `deep`, either way on request; echoed as `partial_order = …`; the reduced `ci`
/// check holds like the full one, on fewer states.
#[test]
fn partial_order_defaults_by_preset_and_keeps_the_verdicts() {
    let unique = |stdout: &str| -> u64 {
        let (_, after) = stdout.split_once(" states, ").expect("a summary line");
        after
            .split_once(" unique")
            .expect("unique states")
            .0
            .replace(',', "")
            .parse()
            .expect("a number")
    };
    let full = kvrelay_check(&[], LIMIT);
    let stderr = text(&full.stderr);
    assert_eq!(full.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("  partial_order = false\n"), "{stderr}");
    let reduced = kvrelay_check(&["--partial-order", "true"], LIMIT);
    let stderr = text(&reduced.stderr);
    assert_eq!(reduced.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("  partial_order = true\n"), "{stderr}");
    let (f, r) = (unique(&text(&full.stdout)), unique(&text(&reduced.stdout)));
    assert!(r < f, "the reduction must reduce: {r} vs {f}");
    let deep = kvrelay_check(&["--config", "deep", "--max-depth", "3"], LIMIT);
    let stderr = text(&deep.stderr);
    assert!(stderr.contains("  partial_order = true\n"), "{stderr}");
}
