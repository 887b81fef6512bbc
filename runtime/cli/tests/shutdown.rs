//! Clean shutdown (issue 34, item 4): SIGINT and SIGTERM end a `kvrelay run --workers process`
//! with the documented status, no worker process and no socket file left; a worker whose
//! engine is killed outright exits too. Each test runs the real binary with `TMPDIR` set to a
//! fresh directory, where the engine puts its sockets, and finds the workers through /proc
//! (Linux only).
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A process, told apart from a later one with the same pid by its start time.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
struct Proc {
    pid: u32,
    started: u64,
}

/// `(state, ppid, start time)` of `pid`, from /proc/PID/stat.
fn stat(pid: u32) -> Option<(String, u32, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // pid (comm) state ppid …: the fields after the last ')'; the start time is the 20th.
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    Some((
        f.first()?.to_string(),
        f.get(1)?.parse().ok()?,
        f.get(19)?.parse().ok()?,
    ))
}

/// The live (not zombie) children of `parent` whose first argument is `arg1`, if given.
fn children(parent: u32, arg1: Option<&str>) -> Vec<Proc> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Some((state, ppid, started)) = stat(pid) else {
            continue;
        };
        if ppid != parent || state == "Z" {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let first = cmd.split(|&b| b == 0).nth(1).map(String::from_utf8_lossy);
        if arg1.is_none_or(|a| first.as_deref() == Some(a)) {
            out.push(Proc { pid, started });
        }
    }
    out
}

/// Whether `p` still runs (a zombie waiting for a reaper does not).
fn alive(p: Proc) -> bool {
    stat(p.pid).is_some_and(|(state, _, started)| started == p.started && state != "Z")
}

/// Polls `done` every 20 ms until it holds or `within` passed; whether it held.
fn eventually(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A test's directories: `tmp`, the engine's `TMPDIR` (empty at the start), and `out`, for
/// the engine's stderr and a fake worker (a file, not a pipe: a process left behind would
/// hold a pipe open). Both are removed when dropped.
#[derive(Debug)]
struct Scratch {
    tmp: PathBuf,
    out: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = |kind: &str| {
            let d = std::env::temp_dir().join(format!(
                "kvrelay-shutdown-{}-{name}-{kind}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        Self {
            tmp: dir("tmp"),
            out: dir("out"),
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.out.join("stderr")).unwrap_or_default()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.tmp);
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// Everything under `dir`, recursively.
fn left_in(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(left_in(&p));
        }
        out.push(p);
    }
    out
}

/// `kvrelay run --workers process` on a workload that runs for many seconds, its sockets in
/// `s.tmp`, its stderr in `s.out`.
fn start_run(s: &Scratch, worker_exe: Option<&Path>) -> Child {
    let stderr = std::fs::File::create(s.out.join("stderr")).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvrelay"));
    cmd.args(["run", "--workers", "process", "--conversations", "2000"])
        .env("TMPDIR", &s.tmp)
        .env_remove("KVRELAY_WORKER_EXE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    if let Some(exe) = worker_exe {
        cmd.env("KVRELAY_WORKER_EXE", exe);
    }
    cmd.spawn().expect("kvrelay starts")
}

/// The engine's two worker processes, once both run (and the engine is still running).
fn both_workers(engine: &mut Child) -> Vec<Proc> {
    let mut found = Vec::new();
    let up = eventually(Duration::from_secs(30), || {
        found = children(engine.id(), Some("worker"));
        found.len() == 2
    });
    assert!(up, "two worker processes within 30 s: {found:?}");
    // Serving for a while: steps in flight, transfers running.
    std::thread::sleep(Duration::from_millis(500));
    assert!(engine.try_wait().unwrap().is_none(), "the run is still on");
    found
}

fn send(signal: &str, pid: u32) {
    let sent = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -s {signal} {pid}");
}

/// Waits up to `within` for `child` to exit; its status.
fn exit_within(child: &mut Child, within: Duration) -> ExitStatus {
    let mut status = None;
    eventually(within, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("kvrelay run did not exit within {within:?}");
    };
    status
}

/// Asserts that none of `procs` runs `within` (killing those that do, so that a failing test
/// leaves nothing behind either).
fn all_gone(procs: &[Proc], within: Duration) {
    let gone = eventually(within, || !procs.iter().any(|p| alive(*p)));
    let running: Vec<&Proc> = procs.iter().filter(|p| alive(**p)).collect();
    for p in &running {
        let _ = Command::new("kill")
            .args(["-9", &p.pid.to_string()])
            .status();
    }
    assert!(
        gone,
        "processes still running after {within:?}: {running:?}"
    );
}

/// Asserts that none of `procs` runs within 3 s, and that `tmp` holds nothing.
fn nothing_left(procs: &[Proc], tmp: &Path) {
    all_gone(procs, Duration::from_secs(3));
    assert_eq!(left_in(tmp), Vec::<PathBuf>::new(), "files left in TMPDIR");
}

/// Interrupts a serving run with `signal`: it must exit with `status` within 5 s (the 2 s
/// grace included) saying so, and leave no worker and no socket behind.
fn interrupt(signal: &str, status: i32) {
    let s = Scratch::new(signal);
    let mut engine = start_run(&s, None);
    let workers = both_workers(&mut engine);
    send(signal, engine.id());
    let exit = exit_within(&mut engine, Duration::from_secs(5));
    let stderr = s.stderr();
    assert_eq!(exit.code(), Some(status), "{exit:?}; stderr: {stderr}");
    let line = format!("kvrelay run: SIG{signal}: interrupted after");
    assert!(stderr.contains(&line), "stderr: {stderr}");
    // The workers exited by themselves once their links closed, none was killed.
    assert!(stderr.contains("(0 killed after"), "stderr: {stderr}");
    nothing_left(&workers, &s.tmp);
}

// Protects the SIGTERM contract: exit status 143, no worker and no socket file left.
#[test]
fn sigterm_stops_the_run_and_leaves_no_worker_and_no_socket() {
    interrupt("TERM", 143);
}

// Protects the SIGINT (Ctrl-C) contract: exit status 130, no worker and no socket file left.
#[test]
fn sigint_stops_the_run_and_leaves_no_worker_and_no_socket() {
    interrupt("INT", 130);
}

// Protects the start-up path: a signal while a worker has yet to connect (its socket file
// exists then) kills it and removes the file. The worker here never connects.
#[test]
fn sigterm_while_a_worker_connects_kills_it_and_removes_its_socket() {
    let s = Scratch::new("connecting");
    let exe = s.out.join("never-connects");
    std::fs::write(&exe, "#!/bin/sh\nexec sleep 60\n").unwrap();
    let mut perm = std::fs::metadata(&exe).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&exe, perm).unwrap();
    let mut engine = start_run(&s, Some(&exe));
    let mut workers = Vec::new();
    let sockets = || {
        let all = left_in(&s.tmp);
        all.into_iter()
            .filter(|p| p.extension() == Some("sock".as_ref()))
            .count()
    };
    let waiting = eventually(Duration::from_secs(10), || {
        workers = children(engine.id(), None);
        sockets() == 1 && workers.len() == 1
    });
    assert!(waiting, "a socket and a worker: {}, {workers:?}", sockets());
    send("TERM", engine.id());
    let exit = exit_within(&mut engine, Duration::from_secs(5));
    assert_eq!(exit.code(), Some(143), "{exit:?}; stderr: {}", s.stderr());
    nothing_left(&workers, &s.tmp);
}

// Protects the parent-death contract: an engine killed outright (no chance to clean up)
// leaves no worker running, nor a socket file (removed once its worker connected).
#[test]
fn workers_exit_when_their_engine_is_killed() {
    let s = Scratch::new("KILL");
    let mut engine = start_run(&s, None);
    let workers = both_workers(&mut engine);
    send("KILL", engine.id());
    let _ = engine.wait();
    all_gone(&workers, Duration::from_millis(1500));
    nothing_left(&workers, &s.tmp);
}
