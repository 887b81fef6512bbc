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
use serde_json::{Map, Value, json};

use super::case::{CaseError, Harness, err};
use super::json::{arg, only, unknown_call};

const CALLS: [&str; 9] = [
    "lookup",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "touch",
    "request_finished",
    "take_events",
    "reset",
];

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

fn key(name: &str, ids: &mut Interner) -> OffloadKey {
    OffloadKey {
        hash: BlockHash(u64::from(ids.intern(name).0)),
        group: 0,
    }
}

fn keys(names: &[String], ids: &mut Interner) -> Vec<OffloadKey> {
    names.iter().map(|n| key(n, ids)).collect()
}

fn key_name(k: &OffloadKey, ids: &Interner) -> String {
    u32::try_from(k.hash.0)
        .ok()
        .and_then(|i| ids.resolve(RequestId(i)))
        .unwrap_or("?")
        .to_owned()
}

fn render_list(ks: &[OffloadKey], ids: &Interner) -> Value {
    json!(ks.iter().map(|k| key_name(k, ids)).collect::<Vec<_>>())
}

fn render_set(ks: &[OffloadKey], ids: &Interner) -> Value {
    json!(ks.iter().map(|k| key_name(k, ids)).collect::<BTreeSet<_>>())
}

fn norm_set(v: &Value) -> Result<Value, CaseError> {
    let names: Vec<String> =
        serde_json::from_value(v.clone()).map_err(|e| CaseError(format!("not a key set: {e}")))?;
    Ok(json!(names.into_iter().collect::<BTreeSet<_>>()))
}

impl Harness for OffloadManagerHarness {
    type Op = ManagerOp;
    type Out = ManagerOut;

    fn new(config: &Map<String, Value>) -> Result<Self, CaseError> {
        only(config, &["capacity_chunks", "policy", "store_threshold"])?;
        let capacity_chunks: u32 = arg(config, "capacity_chunks", None)?;
        let policy = match arg::<String>(config, "policy", Some("lru".to_owned()))?.as_str() {
            "lru" => PolicyKind::Lru,
            "arc" => PolicyKind::Arc,
            other => return err(format!("unknown policy `{other}` (expected lru or arc)")),
        };
        let store_threshold: u32 = arg(config, "store_threshold", Some(1))?;
        let manager = CpuOffloadingManager::new(ManagerConfig {
            capacity_chunks,
            policy,
            store_threshold,
        })
        .map_err(|e| CaseError(format!("bad config: {e}")))?;
        Ok(Self { manager })
    }

    fn convert(
        call: &str,
        args: &Map<String, Value>,
        ids: &mut Interner,
    ) -> Result<Self::Op, CaseError> {
        let request = |args: &Map<String, Value>, ids: &mut Interner| {
            arg::<Option<String>>(args, "request", Some(None)).map(|r| r.map(|r| ids.intern(&r)))
        };
        let ks = |args: &Map<String, Value>, ids: &mut Interner| {
            arg::<Vec<String>>(args, "keys", None).map(|k| keys(&k, ids))
        };
        Ok(match call {
            "lookup" => {
                only(args, &["key", "request"])?;
                let name: String = arg(args, "key", None)?;
                request(args, ids)?;
                ManagerOp::Lookup(key(&name, ids))
            }
            "prepare_store" => {
                only(args, &["keys", "request"])?;
                ManagerOp::PrepareStore(ks(args, ids)?, request(args, ids)?)
            }
            "complete_store" => {
                only(args, &["keys", "success"])?;
                ManagerOp::CompleteStore(ks(args, ids)?, arg(args, "success", Some(true))?)
            }
            "prepare_load" => {
                only(args, &["keys", "request"])?;
                ManagerOp::PrepareLoad(ks(args, ids)?, request(args, ids)?)
            }
            "complete_load" => {
                only(args, &["keys"])?;
                ManagerOp::CompleteLoad(ks(args, ids)?)
            }
            "touch" => {
                only(args, &["keys", "request"])?;
                ManagerOp::Touch(ks(args, ids)?, request(args, ids)?)
            }
            "request_finished" => {
                only(args, &["request"])?;
                let r: String = arg(args, "request", None)?;
                ManagerOp::RequestFinished(ids.intern(&r))
            }
            "take_events" => {
                only(args, &[])?;
                ManagerOp::TakeEvents
            }
            "reset" => {
                only(args, &[])?;
                ManagerOp::Reset
            }
            other => return unknown_call(other, &CALLS),
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
            ManagerOut::Store(None) => Value::Null,
            ManagerOut::Store(Some((stored, evicted))) => json!({
                "keys_to_store": render_list(stored, ids),
                "evicted_keys": render_set(evicted, ids),
            }),
            ManagerOut::Events(events) => Value::Array(
                events
                    .iter()
                    .map(|e| json!({"keys": render_set(&e.keys, ids), "removed": e.removed}))
                    .collect(),
            ),
        }
    }

    fn normalize_expected(call: &str, v: &Value, _ids: &mut Interner) -> Result<Value, CaseError> {
        match (call, v) {
            ("prepare_store", Value::Object(o)) => {
                only(o, &["keys_to_store", "evicted_keys"])?;
                let stored = o.get("keys_to_store").cloned().unwrap_or(json!([]));
                let evicted = norm_set(o.get("evicted_keys").unwrap_or(&json!([])))?;
                Ok(json!({"keys_to_store": stored, "evicted_keys": evicted}))
            }
            ("take_events", Value::Array(events)) => {
                let mut out = Vec::with_capacity(events.len());
                for e in events {
                    let Value::Object(o) = e else {
                        return err("an event must be an object");
                    };
                    only(o, &["keys", "removed"])?;
                    let ks = norm_set(o.get("keys").unwrap_or(&json!([])))?;
                    let removed = o.get("removed").cloned().unwrap_or(json!(false));
                    out.push(json!({"keys": ks, "removed": removed}));
                }
                Ok(Value::Array(out))
            }
            _ => Ok(v.clone()),
        }
    }
}
