//! The P/D pair for the system model: kvrelay-core's P/D connector ([`PdConnector`] +
//! [`PdWorker`], the code engines run) in the roles and with the remote side a configuration
//! asks for. The decode side loads each request's prompt KV from a remote prefill instance
//! asynchronously, the way vLLM's NIXL connector does; the prefill side holds a finished
//! request's blocks until the decode side acknowledges them (delayed frees), or, in strict
//! mode, until its lease runs out. Transfers can fail; a failed load is reported as the spec
//! asks (invalid blocks for one KV-cache group, request-level `failed_recving` for several)
//! and the scheduler recomputes.
//!
//! It covers the scheduler paths no offloading connector reaches: `WAITING_FOR_REMOTE_KVS`,
//! aborts while loading (PR #32255, I-17), load-failure recovery (I-33…I-37), held blocks freed
//! on the aggregated `finished_sending` (I-15), a decode side that never answers (issue #46283,
//! I-54), and, as a [`crate::MultiPair`] child, MultiConnector composition (PR #18246, issue
//! #46951).
//!
//! Every request carries the params a router would give it: `do_remote_decode`, and
//! `do_remote_prefill` naming itself on the remote prefill instance, which holds every prompt
//! block at [`remote_slot`]`(request, index)`; the system model seeds those slots with the
//! blocks' contents when a request arrives ([`Connectors::remote_prefill`]). The decode side's
//! acknowledgement is an action of the environment ([`Connectors::acknowledge`]), which a
//! configuration may never take ([`PdPair::remote_answers`]).
//!
//! [`remote_slot`]: kvrelay_core::pd::remote_slot

use kvrelay_core::pd::{PdConfig, PdMeta, PdParams, RemotePrefill, is_remote_slot};
use kvrelay_core::{
    BlockId, InvariantViolation, Meta, Mode, Params, PdConnector, PdWorker, RequestId, SortedSet,
    Transfer, TransferCommand, TransferDone, TransferResults, WorkerConnector,
};

use crate::system::{Connectors, SystemConfig, property_names};

/// What the P/D connector does.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub struct PdRole {
    /// Decode side: every request's prompt is loaded from the remote prefill instance (once:
    /// the request's transfer parameters are consumed at its first allocation, as NIXL's are).
    pub load: bool,
    /// Prefill side: a request that finished by length holds its blocks until the decode side
    /// acknowledges them (`request_finished` answers `delay_free`).
    pub send: bool,
    /// Load failures are reported as invalid block ids (`true`; one KV-cache group only) or as
    /// request-level `failed_recving` (`false`).
    pub failures_as_blocks: bool,
}

impl PdRole {
    /// The core connector's configuration for this role (`lease_steps` in strict mode).
    ///
    /// `kv_delivery` (PR #50297) is off. With it, async depth 2 has an unbounded path: while
    /// another request's load stays in flight (the environment need never complete it), a
    /// request preempted in its final step drops its output, recomputes and is preempted there
    /// again, its preemption count growing each time — so the exhaustive search does not end
    /// (the path ends as soon as the load completes: not a livelock under fair transfers).
    /// Bounding that count in the model is open work.
    pub fn config(self, lease_steps: Option<u32>) -> PdConfig {
        PdConfig {
            engine: 0,
            load: self.load,
            send: self.send,
            failures_as_blocks: self.failures_as_blocks,
            lease_steps,
            kv_delivery: false,
        }
    }
}

/// The params a router gives request `id` in `role`: hold it for a decode side (prefill), load
/// its whole prompt from the remote prefill instance (decode).
pub fn request_params(role: PdRole, id: RequestId, prompt_tokens: u32) -> Option<Params> {
    let mut p = Params::new();
    if role.send {
        p.extend(PdParams::for_prefill());
    }
    if role.load {
        p.extend(PdParams::for_decode(RemotePrefill {
            engine: 0,
            request: id.0,
            num_tokens: prompt_tokens,
        }));
    }
    (!p.is_empty()).then_some(p)
}

/// Faults of the P/D pair, each reproducing a historical bug class.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq)]
pub enum PdFault {
    /// The worker reports a failed load as a success (the bug class of Mooncake PR #50984 and
    /// of connectors that "swallow" transfer errors): the scheduler then computes on top of
    /// blocks the load left half-written.
    SwallowLoadFailures,
}

/// The core's [`PdWorker`], with a fault the model may inject between it and its transfers.
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdModelWorker {
    inner: PdWorker,
    fault: Option<PdFault>,
}

impl WorkerConnector for PdModelWorker {
    type StepMeta = PdMeta;
    type WorkerMeta = Meta;

    fn bind(&mut self, meta: &PdMeta) {
        self.inner.bind(meta);
    }
    fn start_load_kv(&mut self) -> Vec<TransferCommand> {
        self.inner.start_load_kv()
    }
    fn handle_transfer_done(&mut self, mut done: TransferDone) {
        if self.fault == Some(PdFault::SwallowLoadFailures) {
            done.ok = true;
        }
        self.inner.handle_transfer_done(done);
    }
    fn get_transfer_results(&mut self, finished: &SortedSet<RequestId>) -> TransferResults {
        self.inner.get_transfer_results(finished)
    }
    fn get_block_ids_with_load_errors(&mut self) -> SortedSet<BlockId> {
        self.inner.get_block_ids_with_load_errors()
    }
    fn clear(&mut self) {
        self.inner.clear();
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner.check_invariants()
    }
}

/// The P/D pair for [`crate::SystemModel`].
#[derive(Clone, Debug, Eq, Hash, PartialEq)]
pub struct PdPair {
    /// What the connector does.
    pub role: PdRole,
    /// An injected fault (none: the connector as written).
    pub fault: Option<PdFault>,
    /// Whether the decode side may acknowledge a held request (`false`: it never answers, the
    /// remote of vLLM issue #46283).
    pub remote_answers: bool,
    /// Strict mode's lease on a held request, in steps (compat holds for ever, as vLLM).
    pub lease_steps: u32,
}

impl Default for PdPair {
    /// Decode and prefill side at once (vLLM's `kv_both`), failures as invalid blocks, a decode
    /// side that may answer, a lease of 2 steps in strict mode.
    fn default() -> Self {
        Self {
            role: PdRole {
                load: true,
                send: true,
                failures_as_blocks: true,
            },
            fault: None,
            remote_answers: true,
            lease_steps: 2,
        }
    }
}

impl PdPair {
    /// The pair with a decode side that never answers.
    pub fn silent_remote() -> Self {
        Self {
            remote_answers: false,
            ..Self::default()
        }
    }
}

impl Connectors for PdPair {
    type Sched = PdConnector;
    type Worker = PdModelWorker;

    fn name(&self) -> String {
        let mut name = "p/d".to_owned();
        if !self.remote_answers {
            name.push_str(" with a silent decode side");
        }
        if let Some(f) = self.fault {
            name.push_str(&format!(" with fault {f:?}"));
        }
        name
    }

    fn scheduler_connector(
        &self,
        _config: &kvrelay_core::SchedulerConfig,
        model: &SystemConfig,
    ) -> Result<PdConnector, String> {
        if self.role.failures_as_blocks && model.sliding_window.is_some() {
            return Err(
                "a P/D connector with several KV-cache groups must report load failures \
                        per request (failures_as_blocks = false): vLLM rejects invalid block ids \
                        there (I-36)"
                    .to_owned(),
            );
        }
        if self.lease_steps == 0 {
            return Err("a lease lasts at least 1 step".to_owned());
        }
        let lease = (model.mode == Mode::Strict).then_some(self.lease_steps);
        Ok(PdConnector::new(self.role.config(lease)))
    }

    fn worker(&self, _rank: u32, _model: &SystemConfig) -> PdModelWorker {
        PdModelWorker {
            inner: PdWorker::new(self.role.failures_as_blocks),
            fault: self.fault,
        }
    }

    fn request_params(&self, id: RequestId, model: &SystemConfig) -> Option<Params> {
        request_params(self.role, id, model.prompt_tokens)
    }

    fn remote_prefill(&self) -> bool {
        self.role.load
    }

    fn load_may_fail(&self, load: &Transfer) -> bool {
        load.external.iter().copied().all(is_remote_slot)
    }

    fn awaiting_ack(&self, connector: &PdConnector) -> Vec<RequestId> {
        if self.remote_answers {
            connector.awaiting_ack().collect()
        } else {
            Vec::new()
        }
    }

    fn acknowledge(&self, connector: &mut PdConnector, request: RequestId) {
        connector.acknowledge(request);
    }

    fn describe_meta(&self, meta: &PdMeta) -> String {
        let loads: Vec<String> = meta
            .loads
            .iter()
            .map(|c| {
                let b: Vec<u64> = c.blocks.iter().map(|b| b.0).collect();
                format!("req {} blocks {b:?}", c.request.0)
            })
            .collect();
        let mut parts = Vec::new();
        if !loads.is_empty() {
            parts.push(format!("loads [{}]", loads.join(", ")));
        }
        if !meta.releases.is_empty() {
            let r: Vec<u32> = meta.releases.iter().map(|r| r.0).collect();
            parts.push(format!("releases {r:?}"));
        }
        parts.join("; ")
    }

    /// Preemption, a clean end and a held request released (when sending; unless a silent
    /// decode side holds it for ever: compat), a failed load recomputed (when the configuration
    /// allows failures).
    fn expected_examples(&self, config: &SystemConfig) -> Vec<&'static str> {
        use property_names as n;
        let mut v = vec![n::PREEMPTED];
        let released = self.remote_answers || config.mode == Mode::Strict;
        if released || !self.role.send {
            v.push(n::ALL_DONE);
        }
        if self.role.send && released {
            v.push(n::DELAYED_FREE);
        }
        if self.role.load && config.load_failures > 0 {
            v.push(n::LOAD_FAILED_RECOMPUTED);
        }
        v
    }
}
