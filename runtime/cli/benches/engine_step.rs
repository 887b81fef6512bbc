//! The engine step round trip of an empty step: schedule → every rank's hooks → each rank's
//! output → aggregate → apply, with W = 8 in-process ranks (target ≤ 30 µs) and 2 ranks as
//! worker processes over Unix sockets (target ≤ 150 µs). Nothing is scheduled, so this is the
//! fixed cost a step pays for having ranks.
//!
//! Run: `cargo bench -p kvrelay-cli --bench engine_step`.

use divan::Bencher;
use kvrelay_engine::{Engine, RunConfig, Workers};

fn main() {
    divan::main();
}

fn bench_empty_step(b: Bencher, config: RunConfig) {
    let rt = kvrelay_engine::runtime().unwrap();
    let mut engine = rt.block_on(Engine::start(&config, 1024)).unwrap();
    b.bench_local(|| {
        let o = rt.block_on(engine.step()).unwrap();
        assert!(o.idle);
    });
    rt.block_on(engine.stop());
}

#[divan::bench(sample_count = 200, sample_size = 20)]
fn in_process_w8(b: Bencher) {
    bench_empty_step(
        b,
        RunConfig {
            ranks: 8,
            ..RunConfig::default()
        },
    );
}

#[divan::bench(sample_count = 200, sample_size = 20)]
fn processes_w2(b: Bencher) {
    bench_empty_step(
        b,
        RunConfig {
            ranks: 2,
            workers: Workers::Process,
            worker_exe: Some(env!("CARGO_BIN_EXE_kvrelay").into()),
            ..RunConfig::default()
        },
    );
}
