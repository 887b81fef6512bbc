//! `kvrelay run --metrics`: the exposition is served while the run lasts, with vLLM's names,
//! help texts and labels, and its totals equal the run's report.

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

/// The address the run prints on stderr; the rest of stderr goes to the returned channel's
/// reader thread.
fn metrics_addr(child: &mut Child) -> String {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("kvrelay run: metrics on http://") {
                let _ = tx.send(rest.trim_end_matches("/metrics").to_owned());
            }
        }
    });
    rx.recv_timeout(DEADLINE)
        .expect("the metrics address on stderr")
}

/// `GET /metrics`; the body.
fn scrape(addr: &str, accept: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("a head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
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

// Protects issue 38's metrics: vLLM's HELP and TYPE lines, served during the run and its
// linger, and every counter equal to the run's report once the run ended.
#[test]
fn the_metrics_are_vllms_and_equal_the_report() {
    let mut child = kvrelay(&["--metrics", "127.0.0.1:0", "--metrics-linger", "3"]);
    let addr = metrics_addr(&mut child);
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
    // The run ended once the ranks' figures are published (its linger keeps serving them).
    let started = Instant::now();
    let last = loop {
        let text = scrape(&addr, "text/plain");
        let s = samples(&text);
        if s.get(&engine("kvrelay:written_slots_verified_total")) > Some(&0.0) {
            break s;
        }
        assert!(started.elapsed() < DEADLINE, "the run never ended:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let om = scrape(&addr, "application/openmetrics-text; version=1.0.0");
    assert!(om.ends_with("# EOF\n"), "{om}");
    let out = child.wait_with_output().expect("kvrelay exits");
    assert!(out.status.success(), "{out:?}");
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
    assert_eq!(sum("vllm:request_success_total"), r("finished"));
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
