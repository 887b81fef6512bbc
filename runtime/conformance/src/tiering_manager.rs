//! The `tiering_manager` machine: tiered offloading (SEMANTICS.md §5.9), the core's
//! [`TieringManager`] with the store behind each secondary tier played by the case.
//!
//! The harness keeps, per tier, the keys its store holds, the probes handed out and not yet
//! answered, the jobs in flight and what was handed out since the last `tier_submitted`. It takes
//! the manager's work after every call. Keys and requests are named as in `offload_manager`.
//!
//! Run by `kvrelay conformance` for a case with `"machine": "tiering_manager"`.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::{
    Access, Interner, LookupResult, ManagerConfig, OffloadEvent, OffloadKey, RequestId, TierId,
    TierJobId, TierReport, TierWork, TieringConfig, TieringManager,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness};
use super::json::{NoArgs, parse_call, parse_config};
use super::offload_manager::{
    OffloadManagerHarness, Policy, key, keys, norm_set, one, render_events, render_list,
    render_set, render_store,
};

/// What one tier was handed since the last `tier_submitted`.
#[derive(Debug, Default)]
pub struct Submitted {
    probes: BTreeSet<OffloadKey>,
    stores: Vec<(TierJobId, Vec<OffloadKey>)>,
    loads: Vec<(TierJobId, Vec<OffloadKey>)>,
}

/// The store behind one tier, as the case plays it.
#[derive(Debug, Default)]
struct Store {
    holds: BTreeSet<OffloadKey>,
    unanswered: Vec<(OffloadKey, u64)>,
    /// Store jobs in flight and their keys (a successful one puts them in `holds`).
    storing: BTreeMap<TierJobId, Vec<OffloadKey>>,
    submitted: Submitted,
}

/// Drives the tiering manager over case-played stores.
#[derive(Debug)]
pub struct TieringHarness {
    manager: TieringManager,
    stores: Vec<Store>,
}

/// A converted `tiering_manager` call.
#[derive(Debug, Clone)]
pub enum TieringOp {
    /// `new_request`.
    NewRequest(RequestId),
    /// `lookup`.
    Lookup(OffloadKey, RequestId),
    /// `prepare_store`.
    PrepareStore(Vec<OffloadKey>, RequestId),
    /// `complete_store`.
    CompleteStore(Vec<OffloadKey>, RequestId, bool),
    /// `prepare_load`.
    PrepareLoad(Vec<OffloadKey>, RequestId),
    /// `complete_load`.
    CompleteLoad(Vec<OffloadKey>),
    /// `touch`.
    Touch(Vec<OffloadKey>, RequestId),
    /// `request_finished`.
    RequestFinished(RequestId),
    /// `schedule_end`.
    ScheduleEnd,
    /// `has_pending_work`.
    HasPendingWork,
    /// `take_events`.
    TakeEvents,
    /// `tier_put` / `tier_remove`.
    TierHolds(u8, Vec<OffloadKey>, bool),
    /// `tier_submitted`.
    TierSubmitted(u8),
    /// `tier_answer_probes`.
    TierAnswerProbes(u8),
    /// `tier_finish`.
    TierFinish(u8, u64, bool, Option<Vec<OffloadKey>>),
}

/// What a call returned.
#[derive(Debug)]
pub enum TieringOut {
    /// `"ok"`.
    Ok,
    /// `new_request`'s policy.
    ChunkLevel,
    /// A lookup result.
    Lookup(LookupResult),
    /// A boolean.
    Bool(bool),
    /// `prepare_store`'s result.
    Store(Option<(Vec<OffloadKey>, Vec<OffloadKey>)>),
    /// Drained events.
    Events(Vec<OffloadEvent>),
    /// `tier_submitted`.
    Submitted(Submitted),
}

/// The calls of a `tiering_manager` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum Call {
    NewRequest { request: String },
    Lookup { key: String, request: String },
    PrepareStore(RequestKeys),
    CompleteStore(StoreEnd),
    PrepareLoad(RequestKeys),
    CompleteLoad(RequestKeys),
    Touch(RequestKeys),
    RequestFinished { request: String },
    ScheduleEnd(NoArgs),
    HasPendingWork(NoArgs),
    TakeEvents(NoArgs),
    TierPut(TierKeys),
    TierRemove(TierKeys),
    TierSubmitted(TierOnly),
    TierAnswerProbes(TierOnly),
    TierFinish(TierFinish),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct RequestKeys {
    keys: Vec<String>,
    request: String,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct StoreEnd {
    keys: Vec<String>,
    request: String,
    #[serde(default = "yes")]
    success: bool,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TierKeys {
    #[serde(default)]
    tier: u8,
    keys: Vec<String>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TierOnly {
    #[serde(default)]
    tier: u8,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TierFinish {
    #[serde(default)]
    tier: u8,
    job: u64,
    #[serde(default = "yes")]
    success: bool,
    #[serde(default)]
    successful_keys: Option<Vec<String>>,
}

/// A `tiering_manager` case's config.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Config {
    capacity_chunks: u32,
    #[serde(default)]
    policy: Policy,
    #[serde(default = "one")]
    store_threshold: u32,
    #[serde(default = "one_u8")]
    tiers: u8,
    #[serde(default)]
    mode: Mode,
    #[serde(default)]
    deadline_steps: Option<u32>,
}

#[derive(Deserialize, Debug, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    #[default]
    Compat,
    Strict,
}

/// `tier_submitted`'s expected result.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ExpectedSubmitted {
    probes: Vec<String>,
    stores: Vec<ExpectedJob>,
    loads: Vec<ExpectedJob>,
}

#[derive(Deserialize, Debug, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct ExpectedJob {
    job: u64,
    keys: Vec<String>,
}

fn one_u8() -> u8 {
    1
}

fn yes() -> bool {
    true
}

/// The default strict deadline of the format (steps).
const DEFAULT_DEADLINE_STEPS: u32 = 8;

impl TieringHarness {
    /// Files the manager's new work under each tier's store.
    fn collect_work(&mut self) {
        for w in self.manager.take_tier_work() {
            match w {
                TierWork::Probe { tier, keys } => {
                    let s = &mut self.stores[tier.0 as usize];
                    s.submitted.probes.extend(keys.iter().map(|k| k.0));
                    s.unanswered.extend(keys);
                }
                TierWork::Store {
                    tier, job, keys, ..
                } => {
                    let s = &mut self.stores[tier.0 as usize];
                    s.storing.insert(job, keys.clone());
                    s.submitted.stores.push((job, keys));
                }
                TierWork::Load {
                    tier, job, keys, ..
                } => {
                    self.stores[tier.0 as usize]
                        .submitted
                        .loads
                        .push((job, keys));
                }
            }
        }
    }

    fn store(&mut self, tier: u8) -> Result<&mut Store, &'static str> {
        self.stores.get_mut(tier as usize).ok_or("unknown_tier")
    }

    fn answer_probes(&mut self, tier: u8) -> Result<(), &'static str> {
        let s = self.store(tier)?;
        let answers: Vec<_> = s
            .unanswered
            .drain(..)
            .map(|(k, g)| (k, g, s.holds.contains(&k)))
            .collect();
        for (key, generation, found) in answers {
            let report = TierReport::Probed {
                tier: TierId(tier),
                key,
                generation,
                found,
            };
            self.manager.report(report).map_err(|e| e.kind())?;
        }
        Ok(())
    }

    fn finish(
        &mut self,
        tier: u8,
        job: u64,
        success: bool,
        ok: &Option<Vec<OffloadKey>>,
    ) -> Result<(), &'static str> {
        self.store(tier)?;
        let report = TierReport::Finished {
            tier: TierId(tier),
            job: TierJobId(job),
            success,
            successful_keys: ok.clone(),
        };
        self.manager.report(report).map_err(|e| e.kind())?;
        let s = self.store(tier)?;
        if let Some(stored) = s.storing.remove(&TierJobId(job))
            && success
        {
            s.holds.extend(stored);
        }
        Ok(())
    }

    /// The calls that drive the manager (the `tier_*` calls play the stores).
    fn apply_manager(&mut self, op: &TieringOp) -> Result<TieringOut, &'static str> {
        let access = |r: &RequestId| Access {
            request: Some(*r),
            positions: None,
        };
        let m = &mut self.manager;
        let known = |m: &TieringManager, r: &RequestId| {
            if m.knows(*r) {
                Ok(())
            } else {
                Err("unknown_request")
            }
        };
        Ok(match op {
            TieringOp::NewRequest(r) => {
                m.on_new_request(*r);
                TieringOut::ChunkLevel
            }
            TieringOp::Lookup(k, r) => {
                known(m, r)?;
                TieringOut::Lookup(m.lookup(*k, *r, Access::NO_POSITION))
            }
            TieringOp::PrepareStore(ks, r) => TieringOut::Store(
                m.prepare_store(ks, access(r))
                    .map_err(|e| e.kind())?
                    .map(|o| (o.keys_to_store, o.evicted)),
            ),
            TieringOp::CompleteStore(ks, r, success) => {
                m.complete_store(ks, *r, *success).map_err(|e| e.kind())?;
                TieringOut::Ok
            }
            TieringOp::PrepareLoad(ks, r) => {
                known(m, r)?;
                m.prepare_load(ks, access(r)).map_err(|e| e.kind())?;
                TieringOut::Ok
            }
            TieringOp::CompleteLoad(ks) => {
                m.complete_load(ks).map_err(|e| e.kind())?;
                TieringOut::Ok
            }
            TieringOp::Touch(ks, r) => {
                known(m, r)?;
                m.touch(ks, access(r));
                TieringOut::Ok
            }
            TieringOp::RequestFinished(r) => {
                m.on_request_finished(*r).map_err(|e| e.kind())?;
                TieringOut::Ok
            }
            TieringOp::ScheduleEnd => {
                m.on_schedule_end();
                TieringOut::Ok
            }
            TieringOp::HasPendingWork => TieringOut::Bool(m.has_pending_work()),
            TieringOp::TakeEvents => TieringOut::Events(m.take_events()),
            // The `tier_*` calls play the stores: `apply` runs them.
            _ => return Err("not_a_manager_call"),
        })
    }
}

fn convert_call(call: Call, ids: &mut Interner) -> TieringOp {
    let req = |r: &str, ids: &mut Interner| ids.intern(r);
    match call {
        Call::NewRequest { request } => TieringOp::NewRequest(req(&request, ids)),
        Call::Lookup { key: k, request } => {
            let k = key(&k, ids);
            TieringOp::Lookup(k, req(&request, ids))
        }
        Call::PrepareStore(a) => TieringOp::PrepareStore(keys(&a.keys, ids), req(&a.request, ids)),
        Call::CompleteStore(a) => {
            TieringOp::CompleteStore(keys(&a.keys, ids), req(&a.request, ids), a.success)
        }
        Call::PrepareLoad(a) => TieringOp::PrepareLoad(keys(&a.keys, ids), req(&a.request, ids)),
        Call::CompleteLoad(a) => {
            req(&a.request, ids);
            TieringOp::CompleteLoad(keys(&a.keys, ids))
        }
        Call::Touch(a) => TieringOp::Touch(keys(&a.keys, ids), req(&a.request, ids)),
        Call::RequestFinished { request } => TieringOp::RequestFinished(req(&request, ids)),
        Call::ScheduleEnd(NoArgs {}) => TieringOp::ScheduleEnd,
        Call::HasPendingWork(NoArgs {}) => TieringOp::HasPendingWork,
        Call::TakeEvents(NoArgs {}) => TieringOp::TakeEvents,
        Call::TierPut(a) => TieringOp::TierHolds(a.tier, keys(&a.keys, ids), true),
        Call::TierRemove(a) => TieringOp::TierHolds(a.tier, keys(&a.keys, ids), false),
        Call::TierSubmitted(a) => TieringOp::TierSubmitted(a.tier),
        Call::TierAnswerProbes(a) => TieringOp::TierAnswerProbes(a.tier),
        Call::TierFinish(a) => TieringOp::TierFinish(
            a.tier,
            a.job,
            a.success,
            a.successful_keys.map(|k| keys(&k, ids)),
        ),
    }
}

fn render_jobs(jobs: &[(TierJobId, Vec<OffloadKey>)], ids: &Interner) -> Value {
    Value::Array(
        jobs.iter()
            .map(|(j, ks)| json!({"job": j.0, "keys": render_list(ks, ids)}))
            .collect(),
    )
}

impl Harness for TieringHarness {
    type Op = TieringOp;
    type Out = TieringOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: Config = parse_config(config)?;
        let primary = ManagerConfig {
            capacity_chunks: c.capacity_chunks,
            policy: c.policy.kind(),
            store_threshold: c.store_threshold,
        };
        let deadline_steps = match c.mode {
            Mode::Compat if c.deadline_steps.is_some() => {
                return Err(CaseError("deadline_steps needs mode \"strict\"".into()));
            }
            Mode::Compat => None,
            Mode::Strict => Some(c.deadline_steps.unwrap_or(DEFAULT_DEADLINE_STEPS)),
        };
        let config = TieringConfig {
            tiers: c.tiers,
            deadline_steps,
            promoted_most_recent: c.mode == Mode::Strict,
            hold_promoted: c.mode == Mode::Strict,
        };
        let manager = TieringManager::new(primary, config)
            .map_err(|e| CaseError(format!("bad config: {e}")))?;
        let stores = (0..c.tiers).map(|_| Store::default()).collect();
        Ok(Self { manager, stores })
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        Ok(convert_call(parse_call::<Call>(call, args)?, ids))
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        let out = match op {
            TieringOp::TierHolds(t, ks, put) => {
                let s = self.store(*t)?;
                for k in ks {
                    if *put {
                        s.holds.insert(*k);
                    } else {
                        s.holds.remove(k);
                    }
                }
                TieringOut::Ok
            }
            TieringOp::TierSubmitted(t) => {
                TieringOut::Submitted(core::mem::take(&mut self.store(*t)?.submitted))
            }
            TieringOp::TierAnswerProbes(t) => {
                self.answer_probes(*t)?;
                TieringOut::Ok
            }
            TieringOp::TierFinish(t, job, success, ok) => {
                self.finish(*t, *job, *success, ok)?;
                TieringOut::Ok
            }
            op => self.apply_manager(op)?,
        };
        self.collect_work();
        Ok(out)
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.manager.check_invariants().map_err(|e| e.to_string())
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        match out {
            TieringOut::Ok => json!("ok"),
            TieringOut::ChunkLevel => json!("chunk_level"),
            TieringOut::Lookup(r) => json!(match r {
                LookupResult::Miss => "miss",
                LookupResult::Hit => "hit",
                LookupResult::HitPending => "hit_pending",
                LookupResult::Retry => "retry",
            }),
            TieringOut::Bool(b) => json!(b),
            TieringOut::Store(out) => render_store(out, ids),
            TieringOut::Events(events) => render_events(events, ids),
            TieringOut::Submitted(s) => json!({
                "probes": render_set(&s.probes.iter().copied().collect::<Vec<_>>(), ids),
                "stores": render_jobs(&s.stores, ids),
                "loads": render_jobs(&s.loads, ids),
            }),
        }
    }

    fn normalize_expected(call: &str, v: &Value, ids: &mut Interner) -> Result<Value, CaseError> {
        if call != "tier_submitted" {
            return OffloadManagerHarness::normalize_expected(call, v, ids);
        }
        let e: ExpectedSubmitted = serde_json::from_value(v.clone())
            .map_err(|e| CaseError(format!("expected `tier_submitted` result: {e}")))?;
        Ok(json!({
            "probes": norm_set(&json!(e.probes))?,
            "stores": e.stores,
            "loads": e.loads,
        }))
    }
}
