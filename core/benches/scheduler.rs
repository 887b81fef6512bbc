//! Scheduler step cost: one `schedule()` + `update_from_output()` for 256 running (decoding)
//! requests, block size 16, two KV cache groups (full attention + a 128-token sliding window),
//! with a connector that does nothing ([`NoopConnector`]). The target: ≤ 50 µs per step.
//!
//! The scheduler is warmed up first (every request past its prefill, in steady decode); then each
//! iteration is exactly one engine step on it: schedule, fake-sample (one token per request),
//! apply the output. The pool is large enough that no request is ever preempted or finished
//! during the run, so every iteration does the same kind of work (a block boundary every 16
//! steps per request, as in a real decode).
//!
//! Run: `cargo bench -p kvrelay-core --bench scheduler`.

use divan::{Bencher, black_box};
use kvrelay_core::{
    GroupKind, ModelOutput, NoopConnector, RequestId, RequestSpec, Scheduler, SchedulerConfig,
};

fn main() {
    divan::main();
}

const REQUESTS: u32 = 256;

fn warmed(groups: Vec<GroupKind>, async_depth: u32) -> Scheduler<NoopConnector> {
    let config = SchedulerConfig {
        block_size: 16,
        num_gpu_blocks: 120_000,
        groups,
        max_num_batched_tokens: 16_384,
        max_num_seqs: REQUESTS,
        max_model_len: 4096,
        async_depth,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(config, NoopConnector).unwrap();
    for i in 0..REQUESTS {
        s.add_request(RequestSpec {
            id: RequestId(i),
            prompt: (0..200).map(|t| i * 1000 + t + 1).collect(),
            max_tokens: 4000,
            stop_token: None,
            kv_transfer_params: None,
        })
        .unwrap();
    }
    // Prefill everything, then a few decode steps so the running loop is in steady state.
    for _ in 0..8 {
        one_step(&mut s);
    }
    assert_eq!(s.view().running().len(), REQUESTS as usize);
    s
}

fn one_step(s: &mut Scheduler<NoopConnector>) -> u32 {
    let step = s.schedule().unwrap();
    let sampled = s.fake_sample(step.output.step);
    s.update_from_output(
        step.output.step,
        ModelOutput {
            sampled,
            kv_connector_output: None,
        },
    )
    .unwrap();
    step.output.total_num_scheduled_tokens
}

// One scheduler per benchmark, stepped for every iteration: 100 samples × 20 steps = 2000 steps,
// each adding one token to each of 256 requests, which the pool and max_model_len leave room for.
#[divan::bench(sample_count = 100, sample_size = 20)]
fn step_256_full_and_swa(bencher: Bencher<'_, '_>) {
    let mut s = warmed(
        vec![
            GroupKind::FullAttention,
            GroupKind::SlidingWindow { window: 128 },
        ],
        1,
    );
    bencher.bench_local(|| black_box(one_step(&mut s)));
}

#[divan::bench(sample_count = 100, sample_size = 20)]
fn step_256_full_only(bencher: Bencher<'_, '_>) {
    let mut s = warmed(vec![GroupKind::FullAttention], 1);
    bencher.bench_local(|| black_box(one_step(&mut s)));
}
