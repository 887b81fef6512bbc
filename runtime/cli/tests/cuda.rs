//! The CUDA backend. With a CUDA driver and a device: a run on device memory verifies every
//! load and every read, in-process and with worker processes, and a corrupted pinned host slot
//! is caught. Without one (CI here): `--backend cuda` refuses with the reason and exits 1, and
//! `--backend auto` falls back to host memory, saying so — the GPU tests print that they skip.

use std::process::Command;

use kvrelay_engine::transfer::cuda;
use kvrelay_engine::workload::WorkloadConfig;
use kvrelay_engine::{Backend, RunConfig, RunError, Workers, requests, run, run_with};

/// The name of CUDA device 0, or `None` after printing why the test skips.
fn gpu_or_skip() -> Option<String> {
    match cuda::probe() {
        Ok(name) => Some(name),
        Err(why) => {
            println!("skipped: {why}");
            None
        }
    }
}

fn small(backend: Backend) -> RunConfig {
    RunConfig {
        backend,
        workload: WorkloadConfig {
            conversations: 24,
            ..WorkloadConfig::default()
        },
        check: true,
        ..RunConfig::default()
    }
}

fn kvrelay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .output()
        .expect("kvrelay runs")
}

// Protects run-time detection: a run never silently moves its bytes somewhere other than asked.
#[test]
fn without_a_gpu_cuda_is_refused_and_auto_falls_back_to_host() {
    if let Ok(name) = cuda::probe() {
        println!("skipped: a CUDA device is present ({name})");
        return;
    }
    let out = kvrelay(&["run", "--backend", "cuda", "--conversations", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("backend cuda: no "), "{err}");

    let out = kvrelay(&["run", "--backend", "auto", "--conversations", "2", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("backend auto: using host memory"), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["backend"], "host");
}

// Protects the CUDA data path: device arena, pinned pool, transfer stream after the compute
// stream; every load and every read checked byte for byte.
#[test]
fn on_a_gpu_every_load_and_read_is_verified() {
    let Some(name) = gpu_or_skip() else { return };
    println!("CUDA device 0: {name}");
    for workers in [Workers::InProcess, Workers::Process] {
        let c = RunConfig {
            workers,
            worker_exe: Some(env!("CARGO_BIN_EXE_kvrelay").into()),
            ..small(Backend::Cuda)
        };
        let records = requests(&c).unwrap();
        let r = run(&c, &records, &mut ()).unwrap();
        assert_eq!(r.backend, Backend::Cuda);
        assert_eq!(r.finished, r.requests);
        assert!(r.blocks_loaded > 0 && r.preemptions > 0, "{r:#?}");
        assert_eq!(r.loaded_blocks_verified, r.blocks_loaded);
        assert!(r.written_slots_verified > 0 && r.read_blocks_checked > 0);
    }
}

// Protects the verification on the GPU: it can fail there too (a load whose copies read each
// other's pinned host slots, through the transfer-engine seam: `kvrelay_sim::faults`).
#[test]
fn on_a_gpu_a_corrupted_pinned_slot_is_caught() {
    if gpu_or_skip().is_none() {
        return;
    }
    let c = small(Backend::Cuda);
    let records = requests(&c).unwrap();
    match run_with(
        &c,
        &records,
        &mut (),
        &kvrelay_sim::faults::CorruptingInProcess,
    ) {
        Err(RunError::Corrupt { what, .. }) => assert_eq!(what, "loaded"),
        other => panic!("expected a corruption error, got {other:?}"),
    }
}
