//! `kvrelay run --kv-events`: what a user gets wrong gets a clear error before the run starts
//! (nothing half-published), and a run without the flag publishes nothing and reports no
//! events. The wire format itself is judged by vLLM's own code in `tests/kv_events`.

use std::net::TcpListener;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .arg("run")
        .args(["--requests", "10", "--json"])
        .args(args)
        .output()
        .expect("kvrelay runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Protects: an endpoint that cannot be bound is a configuration error naming it, exit 2.
#[test]
fn an_unbindable_endpoint_is_refused_by_name() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = format!("tcp://*:{port}");
    let o = run(&["--kv-events", &e]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("cannot bind {e}")),
        "{}",
        stderr(&o)
    );
}

/// Protects the deadline on the one remote wait: a `connect` endpoint where nothing listens
/// fails within the connect deadline (5 s), saying so, instead of publishing into nothing.
#[test]
fn a_connect_endpoint_nobody_serves_fails_within_its_deadline() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = Instant::now();
    let o = run(&["--kv-events", &format!("tcp://127.0.0.1:{port}")]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("kv-events"), "{}", stderr(&o));
    assert!(t.elapsed() < Duration::from_secs(30));
}

/// Protects: the other `--kv-events-*` flags without `--kv-events` are refused, not ignored.
#[test]
fn event_options_without_an_endpoint_are_refused() {
    let o = run(&["--kv-events-replay", "tcp://*:0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--kv-events"), "{}", stderr(&o));
}

/// Protects: without `--kv-events` the report has no `kv_events` entry; with it (port 0), the
/// run prints where it publishes and reports what it published.
#[test]
fn the_report_says_what_was_published() {
    let o = run(&[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(r.get("kv_events").is_none());

    let o = run(&["--kv-events", "tcp://*:0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("kvrelay run: KV events on tcp://"),
        "{}",
        stderr(&o)
    );
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let k = &r["kv_events"];
    assert!(k["batches"].as_u64().unwrap() > 0, "{r}");
    assert!(k["events"].as_u64().unwrap() >= k["batches"].as_u64().unwrap());
}
