//! The shared tier with an in-process store, driven step by step, where the tests can reach
//! between a probe and the load it leads to: engines of one process share what they stored,
//! values evicted or corrupted under a running engine are recomputed, never served. Every run
//! checks every load and read (`check`), so wrong KV reaching a GPU block would stop it.

#[path = "support/tier_drive.rs"]
mod tier_drive;

use kvrelay_engine::tier::{Store, TierConfig};
use kvrelay_engine::{Engine, RunConfig};

use self::tier_drive::drive;

fn config() -> RunConfig {
    RunConfig {
        check: true,
        // A CPU pool of 16 chunks: the workload below does not fit, so an engine misses
        // chunks it stored and evicted, and asks the tier.
        cpu_blocks: Some(16),
        gpu_blocks: Some(64),
        tier: Some(TierConfig::parse("memory").unwrap()),
        ..RunConfig::default()
    }
}

fn memory(store: &Store) -> kvrelay_engine::tier::MemoryStore {
    match store {
        Store::Memory(m) => m.clone(),
        _ => panic!("an in-process store"),
    }
}

/// Runs a first engine to fill a store, and returns the store.
async fn filled() -> Store {
    let first = Engine::start(&config(), 128).await.unwrap();
    let store = first.tier_store().unwrap().clone();
    let f = drive(first, |_| {}).await;
    let t = f.tier.expect("a tier");
    assert!(t.blocks_stored > 0 && t.store_failures == 0);
    assert!(!memory(&store).is_empty());
    store
}

// Protects sharing (issue 36 item 3): a second engine promotes what the first stored, and
// computes fewer tokens than the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_loads_what_the_first_stored() {
    let first = Engine::start(&config(), 128).await.unwrap();
    let store = first.tier_store().unwrap().clone();
    let a = drive(first, |_| {}).await;
    let mut second = Engine::start(&config(), 128).await.unwrap();
    assert!(second.share_tier_store(store));
    let b = drive(second, |_| {}).await;
    let t = b.tier.expect("a tier");
    assert!(t.probes_found > 0 && t.blocks_loaded > 0, "{t:?}");
    assert_eq!(t.load_failures, 0);
    assert!(
        b.tokens_computed < a.tokens_computed,
        "{} vs {}",
        b.tokens_computed,
        a.tokens_computed
    );
}

// Protects "evicted between lookup and load": values removed after the probes found them fail
// the promotion (a failed load, marked missing), the requests recompute and finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_evicted_between_probe_and_load_are_recomputed() {
    let store = filled().await;
    let mut second = Engine::start(&config(), 128).await.unwrap();
    second.share_tier_store(store.clone());
    let m = memory(&store);
    let b = drive(second, |e| {
        if e.tier_figures().is_some_and(|t| t.probes_found > 0) {
            for k in m.keys() {
                m.set_raw(&k, None);
            }
        }
    })
    .await;
    let t = b.tier.expect("a tier");
    assert!(t.values_missing > 0, "{t:?}");
    assert!(t.load_failures > 0);
}

// Protects the header check: a value with one flipped payload byte, or truncated, is refused,
// and nothing reaches a CPU pool from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_values_are_refused() {
    let store = filled().await;
    let m = memory(&store);
    // Whole chunks: every rank's shard of a chunk flipped, or every one truncated (a chunk with
    // one bad shard is refused whatever the others are).
    let keys = m.keys();
    let chunk = |k: &str| k.rsplit_once(":r").map(|(c, _)| c.to_string()).unwrap();
    let mut chunks: Vec<String> = keys.iter().map(|k| chunk(k)).collect();
    chunks.dedup();
    for k in keys {
        let mut v = m.get_raw(&k).unwrap();
        let i = chunks.binary_search(&chunk(&k)).unwrap();
        if i % 2 == 0 {
            *v.last_mut().unwrap() ^= 0x40;
        } else {
            v.truncate(v.len() / 2);
        }
        m.set_raw(&k, Some(v));
    }
    let mut second = Engine::start(&config(), 128).await.unwrap();
    second.share_tier_store(store);
    let b = drive(second, |_| {}).await;
    let t = b.tier.expect("a tier");
    assert!(t.values_refused > 0, "{t:?}");
    assert_eq!(t.blocks_loaded, 0, "nothing refused is loaded");
}
