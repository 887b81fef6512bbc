//! `kvrelay run --metrics`: the exposition is served while the run lasts, with vLLM's names,
//! help texts and labels; the ranks' figures grow during the run, and its totals equal the
//! run's report.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every wait of these tests ends by then.
const DEADLINE: Duration = Duration::from_secs(120);

fn kvrelay(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .arg("run")
        .args(["--requests", "40", "--check", "--json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvrelay starts")
}

/// The address the run prints on stderr; the whole of stderr comes back from the thread that
/// reads it.
fn metrics_addr(child: &mut Child) -> (String, std::thread::JoinHandle<Vec<String>>) {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    let lines = std::thread::spawn(move || {
        let mut all = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvrelay run: metrics on http://") {
                let _ = tx.send(rest.trim_end_matches("/metrics").to_owned());
            }
            all.push(line);
        }
        all
    });
    let addr = rx
        .recv_timeout(DEADLINE)
        .expect("the metrics address on stderr");
    (addr, lines)
}

/// `GET /metrics`; the body.
fn scrape(addr: &str, accept: &str) -> String {
    try_scrape(addr, accept).expect("connects")
}

/// `GET /metrics`; the body, or `None` once nothing serves on `addr` (the connection refused,
/// or reset by a server that stopped while it answered: the run ended).
fn try_scrape(addr: &str, accept: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    match s.read_to_string(&mut out) {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
        r => r.unwrap(),
    };
    let (head, body) = out.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    Some(body.to_owned())
}

/// `name{labels}` → value, from text format 0.0.4.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').expect("name and value");
            (k.to_owned(), v.parse().expect("a number"))
        })
        .collect()
}

fn engine(name: &str) -> String {
    format!("{name}{{model_name=\"kvrelay\",engine=\"0\"}}")
}

/// Scrapes `addr` until the linger ends: the last text scrape (the run's end) and an
/// OpenMetrics one of the linger. One scrape while requests were running must show the ranks'
/// figures.
fn scrape_to_the_end(addr: &str, workers: &str) -> (BTreeMap<String, f64>, String) {
    // Scraped until the linger ends; the last scrape is the run's end.
    let started = Instant::now();
    let (mut live, mut last, mut om) = (None, None, None);
    while let Some(text) = try_scrape(addr, "text/plain") {
        let s = samples(&text);
        let rank_side = [
            "vllm:kv_offload_store_bytes_total",
            "kvrelay:loaded_blocks_verified_total",
            "kvrelay:written_slots_verified_total",
        ];
        if finished(&s) < 40.0 && rank_side.iter().all(|m| s.get(&engine(m)) > Some(&0.0)) {
            live.get_or_insert_with(|| text.clone());
        }
        if finished(&s) == 40.0 && om.is_none() {
            om = try_scrape(addr, "application/openmetrics-text; version=1.0.0");
        }
        last = Some(s);
        assert!(started.elapsed() < DEADLINE, "the run never ended:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        live.is_some(),
        "no scrape during the run showed the ranks' figures ({workers})"
    );
    let last = last.expect("a scrape");
    (last, om.expect("an OpenMetrics scrape during the linger"))
}

/// Requests finished, over every reason.
fn finished(s: &BTreeMap<String, f64>) -> f64 {
    s.iter()
        .filter(|(k, _)| k.starts_with("vllm:request_success_total{"))
        .map(|(_, v)| v)
        .sum()
}

// Protects issue 38's metrics with ranks in the engine's process.
#[test]
fn the_metrics_are_vllms_and_equal_the_report() {
    metrics_of_a_run("in-process");
}

// Protects the rank figures' trip over the worker wire (each output carries its delta).
#[test]
fn worker_processes_send_their_figures_live() {
    metrics_of_a_run("process");
}

// vLLM's HELP and TYPE lines, served during the run and its linger; the ranks' figures growing
// while requests are still running (each rank report carries its delta); every counter equal to
// the run's report once the run ended, with nothing left for the end to add.
fn metrics_of_a_run(workers: &str) {
    let mut child = kvrelay(&[
        "--metrics",
        "127.0.0.1:0",
        "--metrics-linger",
        "3",
        "--workers",
        workers,
    ]);
    let (addr, stderr) = metrics_addr(&mut child);
    let first = scrape(&addr, "text/plain");
    for line in [
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        "# TYPE vllm:num_requests_running gauge",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:iteration_tokens_total histogram",
        "# TYPE vllm:kv_offload_store_bytes_total counter",
        "# TYPE kvrelay:engine_step_seconds histogram",
    ] {
        assert!(first.lines().any(|l| l == line), "{line} in\n{first}");
    }
    let (last, om) = scrape_to_the_end(&addr, workers);
    assert!(om.ends_with("# EOF\n"), "{om}");
    let out = child.wait_with_output().expect("kvrelay exits");
    assert!(out.status.success(), "{out:?}");
    let stderr = stderr.join().expect("stderr read");
    // Every rank figure reached the metrics with a step's report: the end added nothing.
    assert!(
        !stderr
            .iter()
            .any(|l| l.contains("no step's report carried")),
        "{stderr:#?}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("--json report");
    let r = |k: &str| {
        report[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} in the report"))
    };
    for (metric, field) in [
        ("vllm:prompt_tokens_total", "prompt_tokens"),
        ("vllm:generation_tokens_total", "generated_tokens"),
        ("vllm:num_preemptions_total", "preemptions"),
        ("vllm:prompt_tokens_cached_total", "reused_tokens"),
        ("vllm:kv_offload_store_bytes_total", "bytes_stored"),
        ("vllm:kv_offload_load_bytes_total", "bytes_loaded"),
        ("vllm:iteration_tokens_total_sum", "tokens_computed"),
        ("kvrelay:engine_steps_total", "steps"),
        ("kvrelay:engine_step_seconds_count", "steps"),
        ("kvrelay:tokens_computed_total", "tokens_computed"),
        ("kvrelay:blocks_stored_total", "blocks_offloaded"),
        ("kvrelay:blocks_loaded_total", "blocks_loaded"),
        ("kvrelay:copies_total", "copies"),
        ("kvrelay:flushed_stores_total", "flushed_stores"),
        (
            "kvrelay:loaded_blocks_verified_total",
            "loaded_blocks_verified",
        ),
        (
            "kvrelay:written_slots_verified_total",
            "written_slots_verified",
        ),
        ("kvrelay:read_blocks_checked_total", "read_blocks_checked"),
    ] {
        assert_eq!(
            last.get(&engine(metric)),
            Some(&r(field)),
            "{metric} = {field}"
        );
    }
    let sum = |family: &str| -> f64 {
        let prefix = format!("{family}{{");
        last.iter()
            .filter(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v)
            .sum()
    };
    assert_eq!(finished(&last), r("finished"));
    assert_eq!(sum("kvrelay:invariant_checks_total"), r("invariant_checks"));
    assert!(r("loaded_blocks_verified") > 0.0 && r("preemptions") > 0.0);
}

// Protects the configuration error: a port that cannot be bound refuses the run (exit 2).
#[test]
fn an_address_in_use_is_a_configuration_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = kvrelay(&["--metrics", &addr])
        .wait_with_output()
        .expect("kvrelay exits");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("metrics: cannot serve on"), "{err}");
}
