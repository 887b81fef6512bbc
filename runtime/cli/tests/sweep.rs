//! `kvrelay sweep`: a grid of configurations run in parallel on a trace, reported as JSON, as a
//! table and as a plot. Every sweep here runs a tiny trace the test writes (24 requests, a few
//! milliseconds per configuration).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn kvrelay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .output()
        .expect("the kvrelay binary runs")
}

/// A fresh folder of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvrelay-sweep-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    dir
}

/// A chat trace in the Mooncake format, 64-token hash blocks: 8 conversations of 3 turns over 2
/// system prompts, each turn re-sending the conversation so far (two blocks more each turn),
/// 100 ms apart. A GPU pool of 40 blocks of 16 tokens holds little of it, so what a later turn
/// reuses of an earlier one comes mostly from the CPU pool.
fn tiny_trace(dir: &Path) -> PathBuf {
    let mut text = String::new();
    let mut history: Vec<Vec<u64>> = (0..8u64).map(|c| vec![c % 2 * 2, c % 2 * 2 + 1]).collect();
    let (mut next_id, mut timestamp) = (100u64, 0u64);
    for _turn in 0..3 {
        for h in &mut history {
            h.extend([next_id, next_id + 1]);
            next_id += 2;
            let ids: Vec<String> = h.iter().map(u64::to_string).collect();
            text.push_str(&format!(
                "{{\"timestamp\": {timestamp}, \"input_length\": {}, \"output_length\": 8, \
                 \"hash_ids\": [{}]}}\n",
                h.len() * 64,
                ids.join(", ")
            ));
            timestamp += 100;
        }
    }
    let path = dir.join("tiny.jsonl");
    std::fs::write(&path, text).expect("the trace is written");
    path
}

/// `kvrelay sweep` on the first 20 requests of the tiny trace, a 2×2 grid, and `extra`.
fn sweep(trace: &Path, extra: &[&str]) -> Output {
    let trace = trace.to_str().expect("a UTF-8 path");
    let mut args = vec![
        "sweep",
        "--trace",
        trace,
        "--hash-block-tokens",
        "64",
        "--requests",
        "20",
        "--gpu-blocks",
        "40",
        "--cpu-blocks",
        "256,16",
        "--policy",
        "lru,arc",
    ];
    args.extend_from_slice(extra);
    kvrelay(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The rows of `--json`, each without its wall-clock time.
fn rows(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "{}", stderr(o));
    let json: Value = serde_json::from_slice(&o.stdout).expect("--json prints JSON");
    let mut rows = json["rows"].as_array().expect("rows").clone();
    for r in &mut rows {
        r.as_object_mut()
            .expect("a row is an object")
            .remove("wall_s");
    }
    rows
}

fn row<'a>(rows: &'a [Value], policy: &str, cpu_blocks: u64) -> &'a Value {
    let found: Vec<&Value> = rows
        .iter()
        .filter(|r| r["policy"] == policy && r["cpu_blocks"] == cpu_blocks)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one row for {policy}, {cpu_blocks}: {rows:#?}"
    );
    found[0]
}

// Protects the grid: one row per configuration (policy × CPU pool), each with every figure the
// sweep promises, each run to its end; and the pool really varies between rows: under LRU, the
// pool that holds the trace's conversations reuses more than a 16-block one, and loads more from
// it. The SVG plot is written.
#[test]
fn a_2x2_grid_gives_one_row_per_configuration_and_the_cpu_pool_varies() {
    let dir = scratch("grid");
    let trace = tiny_trace(&dir);
    let svg = dir.join("sweep.svg");
    let out = sweep(&trace, &["--json", "--plot", svg.to_str().unwrap()]);
    let rows = rows(&out);
    assert_eq!(rows.len(), 4, "{rows:#?}");
    for policy in ["lru", "arc"] {
        for cpu in [16, 256] {
            let r = row(&rows, policy, cpu);
            assert_eq!(r["gpu_blocks"], 40);
            assert_eq!(r["requests"], 20);
            assert_eq!(r["finished"], 20, "{r:#}");
            for figure in [
                "reuse_pct",
                "gpu_prefix_hit_tokens",
                "cpu_loaded_tokens",
                "tokens_computed",
                "bytes_stored",
                "bytes_loaded",
                "preemptions",
                "ttft_ms_median",
                "ttft_ms_p99",
                "tpot_ms_median",
            ] {
                assert!(r[figure].is_number(), "{figure} in {r:#}");
            }
            assert!(r["ttft_ms_median"].as_f64().unwrap() > 0.0, "{r:#}");
        }
    }
    let (small, large) = (row(&rows, "lru", 16), row(&rows, "lru", 256));
    let reuse = |r: &Value| r["reuse_pct"].as_f64().unwrap();
    let loaded = |r: &Value| r["cpu_loaded_tokens"].as_u64().unwrap();
    assert!(reuse(large) >= reuse(small), "{small:#}\n{large:#}");
    assert!(loaded(large) > loaded(small), "{small:#}\n{large:#}");
    assert!(
        large["tokens_computed"].as_u64() < small["tokens_computed"].as_u64(),
        "{small:#}\n{large:#}"
    );
    let text = std::fs::read_to_string(&svg).expect("the plot is written");
    assert!(
        text.starts_with("<svg") || text.starts_with("<?xml"),
        "{}",
        &text[..text.len().min(200)]
    );
    assert!(text.trim_end().ends_with("</svg>"));
    let progress = stderr(&out);
    assert_eq!(
        progress.matches("kvrelay sweep: [").count(),
        4,
        "{progress}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// Protects the parallel runs: configurations run on threads beside each other give the rows
// they give one at a time (each run has its own engine, ranks and runtime, and runs are
// deterministic).
#[test]
fn rows_are_the_same_one_at_a_time_and_in_parallel() {
    let dir = scratch("jobs");
    let trace = tiny_trace(&dir);
    let one = rows(&sweep(&trace, &["--json", "--jobs", "1"]));
    let four = rows(&sweep(&trace, &["--json", "--jobs", "4"]));
    assert_eq!(one, four);
    let _ = std::fs::remove_dir_all(&dir);
}

// Protects the table and the PNG: a header and a row per configuration for people, and a file
// that is a PNG.
#[test]
fn the_table_has_a_row_per_configuration_and_the_png_plot_is_a_png() {
    let dir = scratch("png");
    let trace = tiny_trace(&dir);
    let png = dir.join("sweep.png");
    let out = sweep(&trace, &["--plot", png.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("policy") && lines[0].contains("TTFT p50"),
        "{table}"
    );
    for (i, (policy, cpu)) in [("lru", "16"), ("lru", "256"), ("arc", "16"), ("arc", "256")]
        .iter()
        .enumerate()
    {
        let cells: Vec<&str> = lines[i + 1].split_whitespace().collect();
        assert_eq!(
            (cells[0], cells[1], cells[2]),
            (*policy, "40", *cpu),
            "{table}"
        );
    }
    let bytes = std::fs::read(&png).expect("the plot is written");
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{:?}",
        &bytes[..bytes.len().min(8)]
    );
    assert!(bytes.len() > 10_000, "a chart, not an empty image");
    let _ = std::fs::remove_dir_all(&dir);
}

// Protects the errors a person meets first: an empty grid, a pool of 0 blocks, an unknown
// policy, a plot in another format exit with status 2 and say what is wrong, before anything
// runs.
#[test]
fn bad_grids_and_plots_exit_2_with_the_reason() {
    let dir = scratch("bad");
    let trace = tiny_trace(&dir);
    let trace = trace.to_str().unwrap();
    let gif = dir.join("sweep.gif");
    let cases: [(&[&str], &str); 5] = [
        (&["--cpu-blocks="], "an empty value"),
        (&["--cpu-blocks", "16,,256"], "an empty value"),
        (&["--cpu-blocks", "0,4096"], "0 CPU blocks"),
        (&["--cpu-blocks", "16", "--policy", "lru,mru"], "mru"),
        (
            &["--cpu-blocks", "16", "--plot", gif.to_str().unwrap()],
            ".svg or .png",
        ),
    ];
    for (flags, says) in cases {
        let mut args = vec!["sweep", "--trace", trace];
        args.extend_from_slice(flags);
        let out = kvrelay(&args);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{flags:?}: {}", stderr(&out));
        assert!(out.stdout.is_empty(), "{flags:?} ran");
    }
    assert!(!gif.exists());
    let out = kvrelay(&["sweep"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--cpu-blocks"), "{}", stderr(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

// Protects the help: it says what a sweep is for and when to use it.
#[test]
fn help_says_what_a_sweep_is_for() {
    let out = kvrelay(&["sweep", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for says in [
        "What-if sweeps",
        "Use it to size the CPU offload pool",
        "Exit status",
    ] {
        assert!(help.contains(says), "{says}: {help}");
    }
}
