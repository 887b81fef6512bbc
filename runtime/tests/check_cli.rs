//! `kvrelay check` as a user runs it: exit codes, the trace file, refused flags.

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
            "--faulty-double-report",
            "--threads",
            "1",
            "--trace-out",
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
    let diagram = std::fs::read_to_string(&out_file).expect("the trace file was written");
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
fn trace_of_writes_the_example_of_a_sometimes_property() {
    let out_file = temp_file("example.mmd");
    let out = kvrelay_check(
        &[
            "--threads",
            "1",
            "--trace-of",
            "all transfers",
            "--trace-out",
            out_file.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let diagram = std::fs::read_to_string(&out_file).expect("the trace file was written");
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
            &["--symmetry"][..],
            "--symmetry does not apply to --model completion",
        ),
        (&["--threads", "0"][..], "--threads must be at least 1"),
        (
            &["--ranks", "0"][..],
            "invalid configuration of the completion model",
        ),
        (
            &["--trace-of", "no such property", "--trace-out", "x.mmd"][..],
            "matches no property",
        ),
        (
            &["--trace-of", "I-24", "--trace-out", "x.mmd"][..],
            "matches several properties",
        ),
    ] {
        let out = kvrelay_check(args, Duration::from_secs(30));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    // Contradictory flags are clap errors (also status 2).
    for args in [
        &["--bfs", "--dfs"][..],
        &["--explore", "127.0.0.1:1", "--dfs"][..],
        &["--allow-remote"][..],
        &["--trace-of", "I-21"][..],
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
