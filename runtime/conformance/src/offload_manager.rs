//! The `offload_manager` machine: the CPU offloading manager (SEMANTICS.md §5.2–§5.4).
//!
//! Key strings and request strings are interned in the case's [`Interner`]; a key named `n`
//! becomes `OffloadKey { hash: BlockHash(id(n)), group: 0 }`, so the mapping is deterministic
//! per case and renders back to the same names.
//!
//! Run by `kvrelay conformance` for a case with `"machine": "offload_manager"`.

use std::collections::BTreeSet;

use kvrelay_core::{
    Access, BlockHash, CpuOffloadingManager, Interner, KeyLookup, ManagerConfig, OffloadEvent,
    OffloadKey, PolicyKind, RequestId,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness};
use super::json::{NoArgs, parse_call, parse_config};

/// Drives the CPU offloading manager (SEMANTICS.md §5.2–§5.4).
#[derive(Debug)]
pub struct OffloadManagerHarness {
    manager: CpuOffloadingManager,
}

/// A converted `offload_manager` call.
#[derive(Debug, Clone)]
pub enum ManagerOp {
    /// `lookup`.
    Lookup(OffloadKey),
    /// `prepare_store`.
    PrepareStore(Vec<OffloadKey>, Option<RequestId>),
    /// `complete_store`.
    CompleteStore(Vec<OffloadKey>, bool),
    /// `prepare_load`.
    PrepareLoad(Vec<OffloadKey>, Option<RequestId>),
    /// `complete_load`.
    CompleteLoad(Vec<OffloadKey>),
    /// `touch`.
    Touch(Vec<OffloadKey>, Option<RequestId>),
    /// `request_finished`.
    RequestFinished(RequestId),
    /// `take_events`.
    TakeEvents,
    /// `reset`.
    Reset,
}

/// What a call returned.
#[derive(Debug)]
pub enum ManagerOut {
    /// `"ok"`.
    Ok,
    /// A lookup result.
    Lookup(KeyLookup),
    /// `prepare_store`'s result.
    Store(Option<(Vec<OffloadKey>, Vec<OffloadKey>)>),
    /// Drained events.
    Events(Vec<OffloadEvent>),
}

pub(crate) fn key(name: &str, ids: &mut Interner) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(u64::from(ids.intern(name).0)),
        group: 0,
    }
}

pub(crate) fn keys(names: &[String], ids: &mut Interner) -> Vec<OffloadKey> {
    names.iter().map(|n| key(n, ids)).collect()
}

fn key_name(k: &OffloadKey, ids: &Interner) -> String {
    u32::try_from(k.hash.0)
        .ok()
        .and_then(|i| ids.resolve(RequestId(i)))
        .unwrap_or("?")
        .to_owned()
}

pub(crate) fn render_list(ks: &[OffloadKey], ids: &Interner) -> Value {
    json!(ks.iter().map(|k| key_name(k, ids)).collect::<Vec<_>>())
}

pub(crate) fn render_set(ks: &[OffloadKey], ids: &Interner) -> Value {
    json!(ks.iter().map(|k| key_name(k, ids)).collect::<BTreeSet<_>>())
}

pub(crate) fn norm_set(v: &Value) -> Result<Value, CaseError> {
    let names: Vec<String> =
        serde_json::from_value(v.clone()).map_err(|e| CaseError(format!("not a key set: {e}")))?;
    Ok(json!(names.into_iter().collect::<BTreeSet<_>>()))
}

/// The calls of an `offload_manager` case.
#[derive(Deserialize, Debug)]
#[serde(
    tag = "call",
    content = "with",
    rename_all = "snake_case",
    deny_unknown_fields
)]
enum ManagerCall {
    Lookup {
        key: String,
        #[serde(default)]
        request: Option<String>,
    },
    PrepareStore(RequestKeys),
    CompleteStore {
        keys: Vec<String>,
        #[serde(default = "succeeded")]
        success: bool,
    },
    PrepareLoad(RequestKeys),
    CompleteLoad {
        keys: Vec<String>,
    },
    Touch(RequestKeys),
    RequestFinished {
        request: String,
    },
    TakeEvents(NoArgs),
    Reset(NoArgs),
}

/// `prepare_store`'s expected result (a set of evicted keys, the stored ones in offer order).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ExpectedStore {
    #[serde(default)]
    keys_to_store: Vec<String>,
    #[serde(default)]
    evicted_keys: Vec<String>,
}

/// One event of `take_events`' expected result.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ExpectedEvent {
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    removed: bool,
}

/// An `offload_manager` case's config.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ManagerCaseConfig {
    capacity_chunks: u32,
    #[serde(default)]
    policy: Policy,
    #[serde(default = "one")]
    store_threshold: u32,
}

/// The eviction policy, as cases name it.
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Policy {
    #[default]
    Lru,
    Arc,
}

impl Policy {
    pub(crate) fn kind(&self) -> PolicyKind {
        match self {
            Policy::Lru => PolicyKind::Lru,
            Policy::Arc => PolicyKind::Arc,
        }
    }
}

pub(crate) fn one() -> u32 {
    1
}

/// `prepare_store`'s result: null, or the keys to store in order and the evicted ones as a set.
pub(crate) fn render_store(
    out: &Option<(Vec<OffloadKey>, Vec<OffloadKey>)>,
    ids: &Interner,
) -> Value {
    match out {
        None => Value::Null,
        Some((stored, evicted)) => json!({
            "keys_to_store": render_list(stored, ids),
            "evicted_keys": render_set(evicted, ids),
        }),
    }
}

/// `take_events`' result: the events in order, each one's keys as a set.
pub(crate) fn render_events(events: &[OffloadEvent], ids: &Interner) -> Value {
    Value::Array(
        events
            .iter()
            .map(|e| json!({"keys": render_set(&e.keys, ids), "removed": e.removed}))
            .collect(),
    )
}

/// `keys` in the context of an optional `request`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct RequestKeys {
    keys: Vec<String>,
    #[serde(default)]
    request: Option<String>,
}

fn succeeded() -> bool {
    true
}

impl Harness for OffloadManagerHarness {
    type Op = ManagerOp;
    type Out = ManagerOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        let c: ManagerCaseConfig = parse_config(config)?;
        let manager = CpuOffloadingManager::new(ManagerConfig {
            capacity_chunks: c.capacity_chunks,
            policy: c.policy.kind(),
            store_threshold: c.store_threshold,
        })
        .map_err(|e| CaseError(format!("bad config: {e}")))?;
        Ok(Self { manager })
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        // Names are interned in the order the arguments are listed below (keys, then request).
        let request = |r: Option<String>, ids: &mut Interner| r.map(|r| ids.intern(&r));
        Ok(match parse_call::<ManagerCall>(call, args)? {
            ManagerCall::Lookup {
                key: name,
                request: r,
            } => {
                request(r, ids);
                ManagerOp::Lookup(key(&name, ids))
            }
            ManagerCall::PrepareStore(k) => {
                ManagerOp::PrepareStore(keys(&k.keys, ids), request(k.request, ids))
            }
            ManagerCall::CompleteStore { keys: k, success } => {
                ManagerOp::CompleteStore(keys(&k, ids), success)
            }
            ManagerCall::PrepareLoad(k) => {
                ManagerOp::PrepareLoad(keys(&k.keys, ids), request(k.request, ids))
            }
            ManagerCall::CompleteLoad { keys: k } => ManagerOp::CompleteLoad(keys(&k, ids)),
            ManagerCall::Touch(k) => ManagerOp::Touch(keys(&k.keys, ids), request(k.request, ids)),
            ManagerCall::RequestFinished { request: r } => {
                ManagerOp::RequestFinished(ids.intern(&r))
            }
            ManagerCall::TakeEvents(NoArgs {}) => ManagerOp::TakeEvents,
            ManagerCall::Reset(NoArgs {}) => ManagerOp::Reset,
        })
    }

    fn apply(&mut self, op: &Self::Op) -> Result<Self::Out, &'static str> {
        let access = |request: &Option<RequestId>| Access {
            request: *request,
            positions: None,
        };
        let m = &mut self.manager;
        Ok(match op {
            ManagerOp::Lookup(k) => ManagerOut::Lookup(m.lookup(*k)),
            ManagerOp::PrepareStore(ks, r) => ManagerOut::Store(
                m.prepare_store(ks, access(r))
                    .map(|o| (o.keys_to_store, o.evicted)),
            ),
            ManagerOp::CompleteStore(ks, success) => {
                m.complete_store(ks, *success);
                ManagerOut::Ok
            }
            ManagerOp::PrepareLoad(ks, r) => {
                m.prepare_load(ks, access(r)).map_err(|e| e.kind())?;
                ManagerOut::Ok
            }
            ManagerOp::CompleteLoad(ks) => {
                m.complete_load(ks).map_err(|e| e.kind())?;
                ManagerOut::Ok
            }
            ManagerOp::Touch(ks, r) => {
                m.touch(ks, access(r));
                ManagerOut::Ok
            }
            ManagerOp::RequestFinished(r) => {
                m.on_request_finished(*r);
                ManagerOut::Ok
            }
            ManagerOp::TakeEvents => ManagerOut::Events(m.take_events()),
            ManagerOp::Reset => {
                m.reset();
                ManagerOut::Ok
            }
        })
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.manager.check_invariants().map_err(|e| e.to_string())
    }

    fn render(out: &Self::Out, ids: &Interner) -> Value {
        match out {
            ManagerOut::Ok => json!("ok"),
            ManagerOut::Lookup(KeyLookup::Miss) => json!("miss"),
            ManagerOut::Lookup(KeyLookup::Hit) => json!("hit"),
            ManagerOut::Lookup(KeyLookup::HitPending) => json!("hit_pending"),
            ManagerOut::Store(out) => render_store(out, ids),
            ManagerOut::Events(events) => render_events(events, ids),
        }
    }

    fn normalize_expected(call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        let shape = |e: serde_json::Error| CaseError(format!("expected `{call}` result: {e}"));
        match (call, v) {
            ("prepare_store", Value::Object(_)) => {
                let e: ExpectedStore = serde_json::from_value(v.clone()).map_err(shape)?;
                let evicted = norm_set(&json!(e.evicted_keys))?;
                Ok(json!({"keys_to_store": e.keys_to_store, "evicted_keys": evicted}))
            }
            ("take_events", Value::Array(_)) => {
                let events: Vec<ExpectedEvent> =
                    serde_json::from_value(v.clone()).map_err(shape)?;
                let mut out = Vec::with_capacity(events.len());
                for e in events {
                    let ks = norm_set(&json!(e.keys))?;
                    out.push(json!({"keys": ks, "removed": e.removed}));
                }
                Ok(Value::Array(out))
            }
            _ => Ok(v.clone()),
        }
    }
}
