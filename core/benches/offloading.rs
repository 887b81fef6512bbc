//! Offloading connector cost: one `build_connector_meta` for 256 running requests whose prompts
//! are 16 chunks each (block size 16, 4 blocks per chunk, 1024-token prompts). The issue's
//! target: ≤ 50 µs.
//!
//! * `decode_step_256x16`: the steady state. Every prompt was offloaded, every request decodes
//!   one token; the connector refreshes keys and block tables and finds nothing new to store.
//! * `store_step_256x16`: the step that completes all 256 prefills at once: 256 store jobs of
//!   16 chunks each (4096 keys offered to the manager, 16384 GPU blocks).
//!
//! Each iteration runs on a fresh clone of the connector (cloning is not timed), against the
//! scheduler view and output of a real step.
//!
//! Run: `cargo bench -p kvrelay-core --bench offloading`.

use divan::{Bencher, black_box};
use kvrelay_core::{
    AggregatedOutput, ManagerConfig, Meta, ModelOutput, OffloadMeta, OffloadingConfig,
    OffloadingConnector, PolicyKind, RequestId, RequestSpec, Scheduler, SchedulerConfig,
    SchedulerConnector, SchedulerOutput, SortedSet,
};

fn main() {
    divan::main();
}

const REQUESTS: u32 = 256;
const CHUNKS: u32 = 16;
const BLOCK: u32 = 16;
const BPC: u32 = 4;
const PROMPT: u32 = CHUNKS * BPC * BLOCK;

fn scheduler() -> Scheduler<OffloadingConnector> {
    let config = SchedulerConfig {
        block_size: BLOCK,
        num_gpu_blocks: REQUESTS * (PROMPT / BLOCK + 8) + 16,
        max_num_batched_tokens: REQUESTS * PROMPT,
        max_num_seqs: REQUESTS,
        max_model_len: PROMPT + 256,
        enable_prefix_caching: false,
        ..SchedulerConfig::default()
    };
    let off = OffloadingConfig::new(
        BPC,
        1,
        ManagerConfig {
            capacity_chunks: REQUESTS * CHUNKS * 2,
            policy: PolicyKind::Lru,
            store_threshold: 0,
        },
    );
    let conn = OffloadingConnector::new(off, &config).unwrap();
    let mut s = Scheduler::new(config, conn).unwrap();
    for i in 0..REQUESTS {
        s.add_request(RequestSpec {
            id: RequestId(i),
            prompt: (0..PROMPT).map(|t| i * 100_000 + t + 1).collect(),
            max_tokens: 200,
            stop_token: None,
            kv_transfer_params: None,
        })
        .unwrap();
    }
    s
}

/// One step; every job in flight is acknowledged in its output (a single rank).
fn step(s: &mut Scheduler<OffloadingConnector>) -> SchedulerOutput {
    let st = s.schedule().unwrap();
    let jobs: Vec<_> = s.connector().jobs_in_flight().map(|j| (j, 1)).collect();
    let sampled = s.fake_sample(st.output.step);
    let kv = AggregatedOutput {
        finished_sending: None,
        finished_recving: None,
        invalid_block_ids: SortedSet::new(),
        failed_recving: SortedSet::new(),
        worker_meta: Some(Meta::Offload(OffloadMeta::from_counts(jobs))),
        kv_events: None,
        expected_finished_count: 1,
    };
    s.update_from_output(
        st.output.step,
        ModelOutput {
            sampled,
            kv_connector_output: Some(kv),
        },
    )
    .unwrap();
    st.output
}

#[divan::bench(sample_count = 200, sample_size = 1)]
fn decode_step_256x16(bencher: Bencher<'_, '_>) {
    let mut s = scheduler();
    for _ in 0..4 {
        step(&mut s);
    }
    // The next decode step's output, and the connector as it was before that step's build.
    let before = s.connector().clone();
    let output = step(&mut s);
    assert_eq!(output.num_scheduled_tokens.len(), REQUESTS as usize);
    let view = s.view();
    bencher
        .with_inputs(|| before.clone())
        .bench_local_values(|mut c| {
            let meta = c.build_connector_meta(&view, &output);
            black_box(meta);
            c
        });
}

#[divan::bench(sample_count = 50, sample_size = 1)]
fn store_step_256x16(bencher: Bencher<'_, '_>) {
    let mut s = scheduler();
    let before = s.connector().clone();
    let output = step(&mut s);
    assert_eq!(output.scheduled_new_reqs.len(), REQUESTS as usize);
    let view = s.view();
    bencher
        .with_inputs(|| before.clone())
        .bench_local_values(|mut c| {
            let meta = c.build_connector_meta(&view, &output);
            assert_eq!(meta.store_jobs.len(), REQUESTS as usize);
            black_box(meta);
            c
        });
}
