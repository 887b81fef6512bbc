//! Fuzz entry points: what the coverage-guided targets in `tests/fuzz/` call, and what
//! `tests/tests/fuzz_inputs.rs` calls with proptest's inputs on every CI run. Each takes
//! arbitrary bytes and must not panic: bad input is a typed error, never a crash.
//!
//! | entry | input | what it checks |
//! | --- | --- | --- |
//! | [`frame`] | a frame body from a worker or an engine | decodes to a message or a typed [`WireError`](kvrelay_engine::transport::wire::WireError); a decoded message re-encodes to bytes that decode and re-encode to the same bytes |
//! | [`case_json`] | a conformance case file | parses to a case or a typed error; a parsed case runs to a verdict |
//! | [`core_calls`] | a program of calls | the core's engine step, offloading connector and W rank drivers under any order of calls, transfer completions (failed ones included) and forged rank outputs: typed errors only, and every machine's `check_invariants()` holds after every call that succeeded |

use std::collections::VecDeque;

use kvrelay_core::testing::{SimDma, SimError};
use kvrelay_core::{
    BlockId, EngineCore, GroupKind, JobId, ManagerConfig, Meta, Mode, OffloadMeta,
    OffloadingConfig, OffloadingConnector, OffloadingConnectorMeta, OffloadingWorker,
    OffloadingWorkerConfig, PolicyKind, Rank, RankConfig, RankDriver, RequestId, RequestSpec,
    ScheduledStep, SchedulerConfig, SortedSet, StepId, WorkerOutput,
};

use kvrelay_engine::transport::wire::{Down, Up, decode_body, encode};

/// A frame body (after the length prefix): decoded both ways; what decodes must re-encode
/// stably.
pub fn frame(data: &[u8]) {
    fn stable<T: serde::Serialize + serde::de::DeserializeOwned>(data: &[u8]) {
        let Ok(v) = decode_body::<T>(data) else {
            return;
        };
        let once = encode(&v);
        let again: T = decode_body(&once[4..]).expect("a re-encoded frame decodes");
        assert_eq!(encode(&again), once, "re-encoding is stable");
    }
    stable::<Up>(data);
    stable::<Down>(data);
}

/// A conformance case file: parsed, and run when it parses (a verdict either way).
pub fn case_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(case) = kvrelay_conformance::AnyCase::parse(text, "fuzz") {
        let _ = case.run();
    }
}

/// Calls at most, per program.
const MAX_CALLS: usize = 4_000;

/// Reads a program's bytes (zeros once they run out).
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }

    fn below(&mut self, n: u32) -> u32 {
        u32::from(self.byte()) % n.max(1)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A program of calls into the core (see the module docs). The first bytes choose the shape:
/// ranks, GPU and CPU pool sizes, mode, async depth, policy.
pub fn core_calls(data: &[u8]) {
    let mut b = Bytes(data);
    let ranks = 1 + b.below(3);
    let mode = if b.byte() & 1 == 0 {
        Mode::Compat
    } else {
        Mode::Strict
    };
    let config = SchedulerConfig {
        block_size: 4,
        num_gpu_blocks: 8 + b.below(24),
        groups: vec![GroupKind::FullAttention],
        max_num_batched_tokens: 8 + b.below(64),
        max_num_seqs: 1 + b.below(6),
        max_model_len: 128,
        enable_prefix_caching: true,
        enable_chunked_prefill: true,
        async_depth: 1 + b.below(2),
        mode,
        ..SchedulerConfig::default()
    };
    let policy = if b.byte() & 1 == 0 {
        PolicyKind::Lru
    } else {
        PolicyKind::Arc
    };
    let off = OffloadingConfig::new(
        1,
        ranks,
        ManagerConfig {
            capacity_chunks: 2 + b.below(16),
            policy,
            store_threshold: 0,
        },
    );
    let Ok(connector) = OffloadingConnector::new(off, &config) else {
        return;
    };
    let Ok(mut engine) = EngineCore::new(config.clone(), connector, ranks) else {
        return;
    };
    let rank_config = RankConfig {
        layers: 1,
        block_size: config.block_size,
        groups: config.groups.clone(),
    };
    let mut drivers: Vec<RankDriver<OffloadingWorker>> = (0..ranks)
        .map(|_| {
            RankDriver::new(
                rank_config.clone(),
                OffloadingWorker::new(OffloadingWorkerConfig {
                    blocks_per_chunk: 1,
                    is_store_writer: true,
                    bytes_per_block: 1,
                    mode,
                }),
            )
        })
        .collect();
    // The program completes every transfer itself, in any order.
    let mut dma = vec![SimDma::manual(); ranks as usize];
    let mut steps: VecDeque<ScheduledStep<OffloadingConnectorMeta>> = VecDeque::new();
    let mut next_id = 0u32;
    for _ in 0..MAX_CALLS {
        if b.is_empty() || engine.broken().is_some() {
            return;
        }
        let ok = match b.below(9) {
            0 => {
                let len = 1 + b.below(40);
                let base = b.below(3) * 1000;
                let spec = RequestSpec {
                    id: RequestId(next_id),
                    prompt: (0..len).map(|t| base + t).collect(),
                    max_tokens: 1 + b.below(8),
                    stop_token: None,
                    kv_transfer_params: None,
                };
                next_id += 1;
                engine.add_request(spec).is_ok()
            }
            1 => engine.abort(RequestId(b.below(next_id.max(1)))).is_ok(),
            2 => match engine.schedule() {
                Ok(s) => {
                    steps.push_back(s.step);
                    true
                }
                Err(_) => false,
            },
            3 | 4 => {
                let r = b.below(ranks) as usize;
                run_rank(&mut engine, &mut drivers[r], r, &steps, &mut dma[r])
            }
            5 => {
                let r = b.below(ranks) as usize;
                let (pick, failed) = (b.byte() as usize, b.byte() & 7 == 0);
                let in_flight: Vec<JobId> = dma[r].in_flight().collect();
                match in_flight.len() {
                    0 => true,
                    n => dma[r]
                        .complete(&mut drivers[r], in_flight[pick % n], !failed)
                        .is_ok(),
                }
            }
            6 => {
                if engine.ready() {
                    let step = steps.front().map(|s| s.output.step);
                    let sampled = step.map_or_else(Vec::new, |step| {
                        engine
                            .scheduler()
                            .sampling(step)
                            .map(|(id, pos)| (id, vec![pos % 50_000]))
                            .collect()
                    });
                    let applied = engine.apply(sampled).is_ok();
                    steps.pop_front();
                    applied
                } else {
                    true
                }
            }
            7 => engine.reset_connector_cache().is_ok(),
            _ => {
                // A forged output: any step, any rank, arbitrary contents.
                let step = StepId(u64::from(b.below(8)));
                let rank = Rank(b.below(ranks + 1));
                let output = forged(&mut b);
                let _ = engine.rank_output(step, rank, Some(output));
                // Whatever it did, the engine must still be consistent (or stopped).
                true
            }
        };
        if ok && engine.broken().is_none() && engine.scheduler().broken().is_none() {
            engine.check_invariants().expect("engine invariants");
        }
        for d in &drivers {
            if d.error().is_none() {
                d.check_invariants().expect("rank driver invariants");
            }
        }
    }
}

/// Runs rank `r` from where it stands until it waits or ends its step; its output goes to the
/// engine. `false` when a call returned an error.
fn run_rank(
    engine: &mut EngineCore<OffloadingConnector>,
    driver: &mut RankDriver<OffloadingWorker>,
    r: usize,
    steps: &VecDeque<ScheduledStep<OffloadingConnectorMeta>>,
    dma: &mut SimDma,
) -> bool {
    let polled = if driver.current_step().is_some() {
        dma.resume(driver, &mut ())
    } else {
        let Some(first) = steps.front().map(|s| s.output.step.0) else {
            return true;
        };
        let Some(next) = driver
            .steps_done()
            .checked_sub(first)
            .and_then(|i| steps.get(usize::try_from(i).ok()?))
        else {
            return true;
        };
        dma.run_step(driver, next, &mut ())
    };
    match polled {
        Ok(out) => {
            let step = StepId(driver.steps_done() - 1);
            engine.rank_output(step, Rank(r as u32), Some(out)).is_ok()
        }
        Err(SimError::Waiting { .. }) => true,
        Err(_) => false,
    }
}

/// An arbitrary rank output.
fn forged(b: &mut Bytes<'_>) -> WorkerOutput {
    let ids = |b: &mut Bytes<'_>| {
        let n = b.below(3);
        SortedSet::from_vec((0..n).map(|_| RequestId(b.below(8))).collect())
    };
    let finished_recving = (b.byte() & 1 == 1).then(|| ids(b));
    let failed_recving = ids(b);
    let invalid_block_ids = SortedSet::from_vec(
        (0..b.below(3))
            .map(|_| BlockId(u64::from(b.below(40))))
            .collect(),
    );
    let worker_meta = (b.byte() & 1 == 1).then(|| {
        let mut m = OffloadMeta::from_counts(
            (0..b.below(3)).map(|_| (JobId(u64::from(b.below(16))), b.below(3))),
        );
        if b.byte() & 3 == 0 {
            let first = m.completed_jobs().next().map(|(j, _)| j);
            if let Some(j) = first {
                m.mark_failed(j);
            }
        }
        Meta::Offload(m)
    });
    WorkerOutput {
        finished_recving,
        failed_recving,
        invalid_block_ids,
        worker_meta,
        ..WorkerOutput::default()
    }
}
