//! The shared tier over worker processes: each worker's CPU pool is a memory file it shares with
//! the engine, whose tier writes the chunks it promotes there (`transfer/shared.rs`). A second
//! engine, its ranks `kvrelay worker` processes, loads what a first engine stored, every loaded
//! block checked byte for byte in the worker that reads it (`check`): a promotion that did not
//! reach the worker's pool would stop the run with wrong KV.

#[path = "../../engine/tests/support/tier_drive.rs"]
mod tier_drive;

use std::path::PathBuf;

use kvrelay_engine::config::Workers;
use kvrelay_engine::tier::TierConfig;
use kvrelay_engine::{Engine, RunConfig};

use self::tier_drive::drive;

fn config(workers: Workers) -> RunConfig {
    RunConfig {
        check: true,
        ranks: 2,
        workers,
        worker_exe: Some(PathBuf::from(env!("CARGO_BIN_EXE_kvrelay"))),
        // A CPU pool of 16 chunks: the workload does not fit, so the second engine asks the tier.
        cpu_blocks: Some(16),
        gpu_blocks: Some(64),
        tier: Some(TierConfig::parse("memory").unwrap()),
        ..RunConfig::default()
    }
}

// Protects `--tier --workers process` (issue 36): promotions land in the pools of ranks that
// live in other processes, and every block loaded from them holds the KV its tokens call for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_processes_load_what_the_tier_promoted_into_their_pools() {
    let first = Engine::start(&config(Workers::InProcess), 128)
        .await
        .unwrap();
    let store = first.tier_store().unwrap().clone();
    let a = drive(first, |_| {}).await;
    let mut second = Engine::start(&config(Workers::Process), 128).await.unwrap();
    assert!(second.share_tier_store(store));
    let b = drive(second, |_| {}).await;
    let t = b.tier.expect("a tier");
    assert!(t.blocks_loaded > 0, "promotions: {t:?}");
    assert_eq!(t.load_failures, 0);
    assert!(b.tokens_computed < a.tokens_computed);
}
