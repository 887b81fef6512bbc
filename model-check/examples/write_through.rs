//! Checking your own connector: a deliberately simple write-through CPU connector, written
//! outside kvrelay-core against its public traits, model-checked with kvrelay's system model and
//! properties.
//!
//! The connector: every full prompt block a step computes is copied to a host slot before the
//! step ends (`wait_for_save` starts the copies and waits for them); a waiting request whose
//! next blocks are on the host loads them synchronously before its forward pass. No eviction:
//! when the slots run out, nothing more is stored. No fences are needed, because no copy
//! outlives the step that started it.
//!
//! The one subtle point is *when* a block counts as stored. [`Publish::AfterOutput`] (the
//! correct one) publishes a step's blocks when the step's output comes back
//! (`update_connector_output`), i.e. after every rank ran `wait_for_save`, which waits for the
//! copies. [`Publish::FireAndForget`] is the tempting shortcut: publish as soon as the store is
//! planned and let the copies run past the end of the step. The checker finds what goes wrong:
//! a preempted request's blocks are handed to another request and rewritten while the copy
//! still reads them (or a later load reads a slot the copy has not written yet).
//!
//! Run: `cargo run --release -p kvrelay-model-check --example write_through`.

use std::collections::{BTreeMap, VecDeque};

use kvrelay_core::{
    AggregatedOutput, BlockHash, BlockId, FinishDecision, InvariantViolation, Lookup, Meta,
    RequestId, SchedulerConfig, SchedulerConnector, SchedulerOutput, SchedulerView, SortedSet,
    Transfer, TransferCommand, TransferDirection, TransferDone, TransferResults, WorkerConnector,
};
use kvrelay_model_check::{Connectors, SystemConfig};

/// When planned stores become visible to lookups.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum Publish {
    /// When the step's output comes back: every rank has finished the copies.
    AfterOutput,
    /// As soon as the store is planned, and the copies are not waited for (wrong).
    FireAndForget,
}

/// One copy: a request's GPU blocks and the host slots, one per block.
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Copy {
    pub request: RequestId,
    pub blocks: Vec<BlockId>,
    pub slots: Vec<u64>,
}

/// The step's metadata: synchronous loads, then the step's stores.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WtMeta {
    pub loads: Vec<Copy>,
    pub stores: Vec<Copy>,
}

/// The scheduler side.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct WriteThrough {
    publish: Publish,
    capacity: u64,
    /// Published blocks: hash → slot.
    stored: BTreeMap<BlockHash, u64>,
    /// Planned, not yet published, per step in flight (oldest first).
    planned: VecDeque<Vec<(BlockHash, u64)>>,
    next_slot: u64,
    /// Local hit passed to the last lookup, per request.
    hits: BTreeMap<RequestId, u32>,
    loads: Vec<Copy>,
}

impl WriteThrough {
    fn is_known(&self, h: &BlockHash) -> bool {
        self.stored.contains_key(h) || self.planned.iter().flatten().any(|(p, _)| p == h)
    }
}

impl SchedulerConnector for WriteThrough {
    type StepMeta = WtMeta;
    type WorkerMeta = Meta;

    fn get_num_new_matched_tokens(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        num_computed_tokens: u32,
    ) -> Lookup {
        let Some(r) = view.request(request) else {
            return Lookup::MISS;
        };
        let bs = view.config().block_size;
        let prompt_blocks = r.num_prompt_tokens() / bs;
        let num_tokens = r.tokens().len() as u32;
        let mut idx = num_computed_tokens / bs;
        while idx < prompt_blocks
            && (idx + 1) * bs < num_tokens
            && r.block_hashes()
                .get(idx as usize)
                .is_some_and(|h| self.stored.contains_key(h))
        {
            idx += 1;
        }
        self.hits.insert(request, num_computed_tokens);
        Lookup::Hit {
            tokens: (idx * bs).saturating_sub(num_computed_tokens),
            load_async: false,
        }
    }

    fn update_state_after_alloc(
        &mut self,
        view: &SchedulerView<'_>,
        request: RequestId,
        blocks: &[Vec<BlockId>],
        num_external_tokens: u32,
    ) {
        if num_external_tokens == 0 {
            return;
        }
        let (Some(r), Some(&hit)) = (view.request(request), self.hits.get(&request)) else {
            return;
        };
        let bs = view.config().block_size;
        let first = hit / bs;
        let mut copy = Copy {
            request,
            blocks: Vec::new(),
            slots: Vec::new(),
        };
        for idx in first..(hit + num_external_tokens) / bs {
            let (Some(h), Some(&b)) = (
                r.block_hashes().get(idx as usize),
                blocks[0].get(idx as usize),
            ) else {
                return;
            };
            copy.blocks.push(b);
            copy.slots.push(self.stored[h]);
        }
        self.loads.push(copy);
    }

    fn build_connector_meta(&mut self, view: &SchedulerView<'_>, out: &SchedulerOutput) -> WtMeta {
        let bs = view.config().block_size;
        let before: BTreeMap<RequestId, u32> = out
            .scheduled_requests()
            .map(|r| (r.id, r.num_computed_tokens))
            .collect();
        let mut stores = Vec::new();
        let mut planned = Vec::new();
        for &(id, n) in &out.num_scheduled_tokens {
            let Some(r) = view.request(id) else { continue };
            let end = (before.get(&id).copied().unwrap_or(0) + n).min(r.num_prompt_tokens());
            let mut copy = Copy {
                request: id,
                blocks: Vec::new(),
                slots: Vec::new(),
            };
            for idx in 0..end / bs {
                let Some(&h) = r.block_hashes().get(idx as usize) else {
                    break;
                };
                if self.is_known(&h) || planned.iter().any(|(p, _)| *p == h) {
                    continue;
                }
                if self.next_slot == self.capacity {
                    break;
                }
                copy.blocks.push(r.block_ids(0)[idx as usize]);
                copy.slots.push(self.next_slot);
                planned.push((h, self.next_slot));
                self.next_slot += 1;
            }
            if !copy.blocks.is_empty() {
                stores.push(copy);
            }
        }
        match self.publish {
            Publish::FireAndForget => self.stored.extend(planned),
            Publish::AfterOutput => self.planned.push_back(planned),
        }
        WtMeta {
            loads: std::mem::take(&mut self.loads),
            stores,
        }
    }

    fn update_connector_output(&mut self, _view: &SchedulerView<'_>, _output: &AggregatedOutput) {
        // Called once per delivered step, oldest first (every rank of the model produces an
        // output, so every step carries one).
        if let Some(done) = self.planned.pop_front() {
            self.stored.extend(done);
        }
    }

    fn request_finished(
        &mut self,
        _view: &SchedulerView<'_>,
        request: RequestId,
        _blocks: &[Vec<BlockId>],
    ) -> FinishDecision {
        self.hits.remove(&request);
        FinishDecision::default()
    }
}

/// The worker side: loads in `start_load_kv`, stores in `wait_for_save`, both waited for.
#[derive(Clone, Debug, Default, Eq, Hash, PartialEq)]
pub struct WriteThroughWorker {
    /// Whether `wait_for_save` waits for the copies it starts.
    wait_stores: bool,
    bound: Option<WtMeta>,
    next_job: u64,
    in_flight: std::collections::BTreeSet<kvrelay_core::JobId>,
}

impl WriteThroughWorker {
    fn start(
        &mut self,
        copies: &[Copy],
        direction: TransferDirection,
        wait: bool,
    ) -> Vec<TransferCommand> {
        let mut cmds = Vec::new();
        let mut jobs = Vec::new();
        for c in copies {
            let job = kvrelay_core::JobId(self.next_job);
            self.next_job += 1;
            self.in_flight.insert(job);
            jobs.push(job);
            cmds.push(TransferCommand::Start(Transfer {
                job,
                direction,
                request: c.request,
                gpu_blocks: c.blocks.clone(),
                groups: vec![0; c.blocks.len()],
                external: c.slots.clone(),
            }));
        }
        if wait && !jobs.is_empty() {
            cmds.push(TransferCommand::Wait(jobs.into_iter().collect()));
        }
        cmds
    }
}

impl WorkerConnector for WriteThroughWorker {
    type StepMeta = WtMeta;
    type WorkerMeta = Meta;

    fn bind(&mut self, meta: &WtMeta) {
        self.bound = Some(meta.clone());
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        let loads = self
            .bound
            .as_ref()
            .map(|m| m.loads.clone())
            .unwrap_or_default();
        self.start(&loads, TransferDirection::Load, true)
    }
    fn wait_for_save(&mut self) -> Vec<TransferCommand> {
        let stores = self
            .bound
            .as_ref()
            .map(|m| m.stores.clone())
            .unwrap_or_default();
        self.start(&stores, TransferDirection::Store, self.wait_stores)
    }
    fn handle_transfer_done(&mut self, done: TransferDone) {
        self.in_flight.remove(&done.job);
    }
    fn get_transfer_results(&mut self, _finished: &SortedSet<RequestId>) -> TransferResults {
        TransferResults::default()
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        SortedSet::new()
    }
    fn clear(&mut self) {
        self.bound = None;
    }
}

/// The pair the system model composes.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct WriteThroughPair {
    pub publish: Publish,
    pub capacity: u64,
}

impl Connectors for WriteThroughPair {
    type Sched = WriteThrough;
    type Worker = WriteThroughWorker;

    fn name(&self) -> String {
        format!("write-through ({:?})", self.publish)
    }
    fn scheduler_connector(
        &self,
        _c: &SchedulerConfig,
        _m: &SystemConfig,
    ) -> Result<WriteThrough, String> {
        Ok(WriteThrough {
            publish: self.publish,
            capacity: self.capacity,
            stored: BTreeMap::new(),
            planned: VecDeque::new(),
            next_slot: 0,
            hits: BTreeMap::new(),
            loads: Vec::new(),
        })
    }
    fn worker(&self, _rank: u32, _m: &SystemConfig) -> WriteThroughWorker {
        WriteThroughWorker {
            wait_stores: self.publish == Publish::AfterOutput,
            ..WriteThroughWorker::default()
        }
    }
    /// Every copy finished within its step: nothing may be in flight between steps is checked
    /// by the model's own properties; here, the slots never exceed the capacity.
    fn check_sched(&self, c: &WriteThrough) -> Result<(), InvariantViolation> {
        if c.next_slot > c.capacity {
            return Err(InvariantViolation {
                id: "example",
                detail: format!("slot {} beyond capacity {}", c.next_slot, c.capacity),
            });
        }
        Ok(())
    }
}

/// The configuration the example checks: 2 ranks, 2 requests sharing a prompt block, a tight
/// GPU pool (so blocks are evicted and reloaded), no offloading manager (its fields are unused).
pub fn config(async_depth: u32) -> SystemConfig {
    SystemConfig {
        async_depth,
        ..SystemConfig::ci()
    }
}

#[allow(dead_code)]
fn main() {
    use kvrelay_model_check::{CheckOptions, SystemModel, check};
    for (publish, depth) in [
        (Publish::AfterOutput, 1),
        (Publish::AfterOutput, 2),
        (Publish::FireAndForget, 1),
    ] {
        let model = SystemModel::new(
            WriteThroughPair {
                publish,
                capacity: 4,
            },
            config(depth),
        )
        .expect("a valid configuration");
        let report = check(model, &CheckOptions::default(), &mut |_| {});
        println!(
            "{publish:?}, async depth {depth}: {} unique states, passed: {}",
            report.unique_states,
            report.passed()
        );
        for p in report
            .properties
            .iter()
            .filter(|p| p.expectation == "always" && !p.holds)
        {
            println!("  violated: {}", p.name);
            for line in p.path.iter().flatten() {
                println!("    {line}");
            }
        }
    }
}
