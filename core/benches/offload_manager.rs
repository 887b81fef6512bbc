//! CPU offloading manager throughput: lookup + prepare_store + complete_store per key, on a
//! full pool of 16 384 chunks with a stream of fresh keys, so every store evicts (the target:
//! ≥ 5 M key operations/s). One iteration handles a batch of 64 keys; divan reports time per
//! iteration and items (keys) per second.
//!
//! Run: `cargo bench -p kvrelay-core --bench offload_manager`.

use divan::{Bencher, black_box, counter::ItemsCount};
use kvrelay_core::{
    Access, BlockHash, CpuOffloadingManager, KeyLookup, ManagerConfig, OffloadKey, PolicyKind,
};

fn main() {
    divan::main();
}

const CAPACITY: u32 = 16_384;
const BATCH: u64 = 64;

fn key(n: u64) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(n),
        group: 0,
    }
}

#[divan::bench(args = [PolicyKind::Lru, PolicyKind::Arc])]
fn lookup_store_complete(bencher: Bencher, policy: PolicyKind) {
    let mut m = CpuOffloadingManager::new(ManagerConfig {
        capacity_chunks: CAPACITY,
        policy,
        store_threshold: 1,
    })
    .expect("a valid config");
    let mut next = 0u64;
    let mut batch = |m: &mut CpuOffloadingManager| {
        let keys: Vec<OffloadKey> = (next..next + BATCH).map(key).collect();
        next += BATCH;
        for k in &keys {
            black_box(m.lookup(*k) == KeyLookup::Miss);
        }
        let out = m
            .prepare_store(&keys, Access::default())
            .expect("idle chunks are evictable");
        m.complete_store(&out.keys_to_store, true);
    };
    for _ in 0..u64::from(CAPACITY) / BATCH {
        batch(&mut m);
    }
    bencher
        .counter(ItemsCount::new(BATCH))
        .bench_local(|| batch(&mut m));
}
