//! A rank that dies (issue 22): a worker process killed while the engine serves requests. The
//! engine must report an error naming the rank, end every live request with it, and shut down
//! without hanging or leaving a process behind. Linux only (it reads /proc to find the worker).
#![cfg(target_os = "linux")]

use std::path::PathBuf;
use std::time::Duration;

use kvrelay_engine::api::{EngineHandle, RequestEvent};
use kvrelay_engine::{RunConfig, Workers};

/// This test process's `kvrelay worker` children: (pid, rank), zombies excluded.
fn workers() -> Vec<(u32, u32)> {
    let me = std::process::id();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid …: the fields after the last ')'.
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        let mut f = after.split_whitespace();
        let (state, ppid) = (f.next(), f.next().and_then(|p| p.parse::<u32>().ok()));
        if ppid != Some(me) || state == Some("Z") {
            continue;
        }
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.get(1).map(String::as_str) != Some("worker") {
            continue;
        }
        let rank = args
            .iter()
            .position(|a| a == "--rank")
            .and_then(|i| args.get(i + 1))
            .and_then(|r| r.parse().ok());
        if let Some(rank) = rank {
            out.push((pid, rank));
        }
    }
    out
}

// Protects the killed-rank contract: a clear error naming the rank, every live request ended
// with it, a shutdown that ends, no worker process left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_process_stops_the_engine_cleanly() {
    let config = RunConfig {
        ranks: 2,
        workers: Workers::Process,
        worker_exe: Some(PathBuf::from(env!("CARGO_BIN_EXE_kvrelay"))),
        // A small GPU pool: requests are preempted and offloaded, so transfers are in flight.
        gpu_blocks: Some(48),
        check: true,
        ..RunConfig::default()
    };
    // 600 tokens fit the 47 usable blocks of 16 (the engine refuses a pool that cannot hold one).
    let h = EngineHandle::spawn(config, 600).await.unwrap();
    let mut streams = Vec::new();
    for i in 0..8u32 {
        let prompt: Vec<u32> = (0..200).map(|t| t + 1000 * i).collect();
        let (_, s) = h.submit(prompt, 4_000).await.unwrap();
        streams.push(s);
    }
    // Wait until the engine is serving (tokens streamed), then kill rank 1's process.
    let first = tokio::time::timeout(Duration::from_secs(30), streams[0].recv())
        .await
        .expect("tokens within 30 s");
    assert!(matches!(first, Some(RequestEvent::Tokens(_))), "{first:?}");
    let running = workers();
    assert_eq!(running.len(), 2, "two worker processes: {running:?}");
    let (pid, _) = *running.iter().find(|(_, r)| *r == 1).expect("rank 1");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // Every live request ends with the error, which names rank 1.
    for mut s in streams {
        let last = tokio::time::timeout(Duration::from_secs(30), async move {
            let mut last = None;
            while let Some(e) = s.recv().await {
                last = Some(e);
            }
            last
        })
        .await
        .expect("every stream ends within 30 s");
        match last {
            Some(RequestEvent::Failed(why)) => assert!(why.contains("rank 1"), "{why}"),
            other => panic!("expected the engine's error, got {other:?}"),
        }
    }
    let stopped = tokio::time::timeout(Duration::from_secs(30), h.shutdown())
        .await
        .expect("shutdown within 30 s");
    let e = stopped.expect_err("the engine stopped on the lost rank");
    assert!(e.to_string().contains("rank 1"), "{e}");
    // No worker process is left behind (the surviving rank exits when the engine hangs up).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !workers().is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(workers(), vec![], "worker processes left behind");
}
