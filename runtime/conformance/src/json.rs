//! The JSON of conformance cases: decoding a call's arguments and the core values they carry,
//! and encoding results into the canonical JSON that expectations are compared with.
//!
//! Every harness imports what it needs from here: [`parse_call`] (a call into the machine's
//! call enum, by serde) and the argument shapes several machines share ([`NoArgs`], [`Flag`],
//! [`present`]), the JSON shapes of values several machines share (metadata, worker
//! outputs, events, request ids, scheduler outputs) and the normalisers that sort a set-valued
//! field of an expected result. A value only one machine knows is decoded and rendered in that
//! machine's file. This file imports no harness.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_core::{
    AggregatedOutput, BlockId, Interner, JobId, KvEvent, KvEvents, Meta, OffloadMeta, Params,
    RequestId, SchedulerOutput, SortedSet, StepResult, WorkerOutput,
};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};

use super::case::CaseError;

// ---------------------------------------------------------------------------------------------
// Arguments

/// Parses one call into `T`, a machine's call enum tagged by the call's name with its
/// arguments as content (`#[serde(tag = "call", content = "with")]`, each variant's arguments a
/// struct that denies unknown fields): an unknown call, an unknown or missing argument and a
/// wrongly typed value are errors that name them.
pub(super) fn parse_call<T: DeserializeOwned>(
    call: &str,
    args: &Map<String, Value>,
) -> Result<T, CaseError> {
    // The call's name first (`call` sorts before `with` in a JSON map), so that serde reads the
    // arguments straight into the variant's struct: the error then has their path.
    let value = json!({ "call": call, "with": args });
    serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        CaseError(match path.strip_prefix("with.") {
            // An argument of the call itself: serde's field is the case's argument.
            Some(arg) if !arg.contains(['.', '[']) && inner.starts_with("unknown field") => inner
                .replacen("unknown field", "unknown argument", 1)
                .replace(", there are no fields", " (this call takes none)"),
            Some(arg) => format!("argument `{arg}`: {inner}"),
            None if path == "call" => inner.replacen("unknown variant", "unknown call", 1),
            None => inner.replacen("missing field", "missing argument", 1),
        })
    })
}

/// A machine's `config`, parsed into `T` (a struct that denies unknown fields).
pub(super) fn parse_config<T: DeserializeOwned>(
    config: &Map<String, Value>,
) -> Result<T, CaseError> {
    serde_json::from_value(Value::Object(config.clone()))
        .map_err(|e| CaseError(format!("config: {e}")))
}

/// The arguments of a call that takes none (and the config of a machine that takes none).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct NoArgs {}

/// `{"value": bool}`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Flag {
    pub(super) value: bool,
}

/// For an argument whose absence and whose `null` mean different things: `#[serde(default,
/// deserialize_with = "present")]` on an `Option<T>` field gives `None` when absent and
/// `Some(v)` when given (`T` may itself be an `Option`, `null` then `Some(None)`).
pub(super) fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

// ---------------------------------------------------------------------------------------------
// Meta, worker outputs, events and request ids

/// Meta, as written in cases.
#[derive(Deserialize, Clone, Debug)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub(super) enum JMeta {
    Offload(JOffload),
    Set(Vec<String>),
    Multi(Vec<Option<JMeta>>),
}

/// The offloading connector's worker metadata, as written in cases.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct JOffload {
    #[serde(default)]
    completed_jobs: BTreeMap<u64, u32>,
    #[serde(default)]
    bytes: u64,
    #[serde(default)]
    transfers: u64,
}

impl JMeta {
    pub(super) fn into_core(self) -> Meta {
        match self {
            JMeta::Offload(o) => {
                let mut m = OffloadMeta::from_counts(
                    o.completed_jobs.into_iter().map(|(j, n)| (JobId(j), n)),
                );
                m.bytes = o.bytes;
                m.transfers = o.transfers;
                Meta::Offload(m)
            }
            JMeta::Set(items) => Meta::Set(SortedSet::from_vec(items)),
            JMeta::Multi(slots) => {
                Meta::Multi(slots.into_iter().map(|s| s.map(JMeta::into_core)).collect())
            }
        }
    }
}

/// The canonical JSON of worker metadata (`{"offload": …}`, `{"set": […]}`, `{"multi": […]}`).
pub(super) fn render_meta(m: &Meta) -> Value {
    match m {
        Meta::Offload(o) => {
            let jobs: Map<String, Value> = o
                .completed_jobs()
                .map(|(j, n)| (j.0.to_string(), json!(n)))
                .collect();
            json!({ "offload": { "completed_jobs": jobs, "bytes": o.bytes, "transfers": o.transfers } })
        }
        Meta::Set(s) => json!({ "set": s.as_slice() }),
        Meta::Multi(slots) => {
            json!({ "multi": slots.iter().map(|s| s.as_ref().map_or(Value::Null, render_meta)).collect::<Vec<_>>() })
        }
    }
}

/// [`render_meta`], `null` for no metadata.
pub(super) fn render_opt_meta(m: Option<&Meta>) -> Value {
    m.map_or(Value::Null, render_meta)
}

/// Metadata (or `null`) as written in a case, converted to the core's.
pub(super) fn parse_meta(v: &Value) -> Result<Option<Meta>, CaseError> {
    serde_json::from_value::<Option<JMeta>>(v.clone())
        .map(|m| m.map(JMeta::into_core))
        .map_err(|e| CaseError(format!("not a Meta: {e}")))
}

/// WorkerOutput, as written in cases (every field optional).
#[derive(Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct JWorkerOutput {
    #[serde(default)]
    finished_sending: Option<Vec<String>>,
    #[serde(default)]
    finished_recving: Option<Vec<String>>,
    #[serde(default)]
    invalid_block_ids: Vec<u64>,
    #[serde(default)]
    failed_recving: Vec<String>,
    #[serde(default)]
    expected_finished_count: u32,
    #[serde(default)]
    worker_meta: Option<JMeta>,
    #[serde(default)]
    kv_events: Option<Vec<String>>,
}

/// Request names as a set of ids, interned in `ids`.
pub(super) fn id_set(names: Vec<String>, ids: &mut Interner) -> SortedSet<RequestId> {
    names.iter().map(|n| ids.intern(n)).collect()
}

impl JWorkerOutput {
    pub(super) fn into_core(self, ids: &mut Interner) -> WorkerOutput {
        WorkerOutput {
            finished_sending: self.finished_sending.map(|s| id_set(s, ids)),
            finished_recving: self.finished_recving.map(|s| id_set(s, ids)),
            invalid_block_ids: self.invalid_block_ids.into_iter().map(BlockId).collect(),
            failed_recving: id_set(self.failed_recving, ids),
            expected_finished_count: self.expected_finished_count,
            worker_meta: self.worker_meta.map(JMeta::into_core),
            kv_events: self
                .kv_events
                .map(|e| KvEvents::from_worker(e.into_iter().map(KvEvent).collect())),
        }
    }
}

/// `{"events": [...], "workers": n}`.
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct JEvents {
    events: Vec<String>,
    workers: std::num::NonZeroU32,
}

impl JEvents {
    pub(super) fn into_core(self) -> KvEvents {
        KvEvents {
            events: self.events.into_iter().map(KvEvent).collect(),
            workers: self.workers,
        }
    }
}

/// KV events as `{"events": [sorted], "workers": n}`, `null` for none.
pub(super) fn render_events(e: Option<&KvEvents>) -> Value {
    match e {
        None => Value::Null,
        Some(e) => {
            let mut evs: Vec<&str> = e.events.iter().map(|x| x.0.as_str()).collect();
            evs.sort_unstable();
            json!({ "events": evs, "workers": e.workers.get() })
        }
    }
}

/// A set of request ids as a JSON array sorted by the ids' names (byte order).
pub(super) fn render_ids(s: &SortedSet<RequestId>, ids: &Interner) -> Value {
    let names: BTreeSet<&str> = s.iter().map(|&id| ids.resolve(id).unwrap_or("?")).collect();
    json!(names)
}

/// [`render_ids`], `null` for no set.
pub(super) fn render_opt_ids(s: Option<&SortedSet<RequestId>>, ids: &Interner) -> Value {
    s.map_or(Value::Null, |s| render_ids(s, ids))
}

/// The canonical JSON of an aggregated connector output (every field present).
pub(super) fn render_aggregated(a: &AggregatedOutput, ids: &Interner) -> Value {
    json!({
        "finished_sending": render_opt_ids(a.finished_sending.as_ref(), ids),
        "finished_recving": render_opt_ids(a.finished_recving.as_ref(), ids),
        "invalid_block_ids": a.invalid_block_ids.iter().map(|b| b.0).collect::<Vec<_>>(),
        "failed_recving": render_ids(&a.failed_recving, ids),
        "worker_meta": render_opt_meta(a.worker_meta.as_ref()),
        "kv_events": render_events(a.kv_events.as_ref()),
        "expected_finished_count": a.expected_finished_count,
    })
}

// ---------------------------------------------------------------------------------------------
// Scheduler values

/// A request id as its name in the case.
pub(super) fn render_id(id: RequestId, ids: &Interner) -> Value {
    json!(ids.resolve(id).unwrap_or("?"))
}

/// Request ids as their names, in order.
pub(super) fn render_id_list(list: &[RequestId], ids: &Interner) -> Value {
    Value::Array(list.iter().map(|&id| render_id(id, ids)).collect())
}

/// Block tables (one list of block ids per KV-cache group).
pub(super) fn render_tables(t: &[Vec<BlockId>]) -> Value {
    json!(
        t.iter()
            .map(|g| g.iter().map(|b| b.0).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    )
}

/// A request's `kv_transfer_params`, `null` for none.
pub(super) fn render_params(p: Option<&Params>) -> Value {
    p.map_or(Value::Null, |p| json!(p))
}

/// The fields of a Scheduled result other than `meta`.
pub(super) fn scheduled_fields(
    o: &SchedulerOutput,
    groups: usize,
    ids: &Interner,
) -> Map<String, Value> {
    let name = |id: RequestId| ids.resolve(id).unwrap_or("?").to_string();
    let mut block_ids = Map::new();
    let mut new_block_ids = Map::new();
    for n in &o.scheduled_new_reqs {
        block_ids.insert(name(n.id), render_tables(&n.block_ids));
    }
    let mut resumed = Vec::new();
    for c in &o.scheduled_cached_reqs {
        if c.resumed {
            resumed.push(render_id(c.id, ids));
            block_ids.insert(name(c.id), render_tables(&c.new_block_ids));
        } else if c.new_block_ids.is_empty() {
            // No block in any group (vLLM's `None`): rendered as one empty list per group.
            new_block_ids.insert(name(c.id), json!(vec![Vec::<u32>::new(); groups]));
        } else {
            new_block_ids.insert(name(c.id), render_tables(&c.new_block_ids));
        }
    }
    let v = json!({
        "step": o.step.0,
        "scheduled": o.num_scheduled_tokens.iter().map(|(id, n)| json!([render_id(*id, ids), n])).collect::<Vec<_>>(),
        "total": o.total_num_scheduled_tokens,
        "new": o.scheduled_new_reqs.iter().map(|n| render_id(n.id, ids)).collect::<Vec<_>>(),
        "resumed": resumed,
        "block_ids": block_ids,
        "new_block_ids": new_block_ids,
        "finished_req_ids": render_ids(&o.finished_req_ids, ids),
        "preempted_req_ids": render_ids(&o.preempted_req_ids, ids),
        "has_sync_kv_loads": o.has_sync_kv_loads,
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

/// An applied step: its request outputs, and its KV events sorted.
pub(super) fn render_step_result(r: &StepResult, ids: &Interner) -> Value {
    let outputs: Vec<Value> = r
        .outputs
        .iter()
        .map(|o| {
            json!({
                "id": render_id(o.id, ids),
                "new_tokens": o.new_tokens,
                "finish": o.finish.map_or(Value::Null, |f| serde_json::to_value(f).unwrap_or(Value::Null)),
                "kv_transfer_params": render_params(o.kv_transfer_params.as_ref()),
            })
        })
        .collect();
    let mut events: Vec<&str> = r.events.iter().map(|e| e.0.as_str()).collect();
    events.sort_unstable();
    json!({ "outputs": outputs, "events": events })
}

// ---------------------------------------------------------------------------------------------
// Set-valued fields of expected results

/// Sorts and deduplicates the string array at `key` of object `v` (a set-valued field).
pub(super) fn normalize_set_field(v: &mut Value, key: &str) -> Result<(), CaseError> {
    let Some(slot) = v.get_mut(key) else {
        return Ok(());
    };
    if slot.is_null() {
        return Ok(());
    }
    let mut names: Vec<String> = serde_json::from_value(slot.clone())
        .map_err(|e| CaseError(format!("`{key}` must be an array of request ids: {e}")))?;
    names.sort_unstable();
    names.dedup();
    *slot = json!(names);
    Ok(())
}

/// Sorts and deduplicates the integer array at `key` of object `v` (a set-valued field).
pub(super) fn normalize_int_set_field(v: &mut Value, key: &str) -> Result<(), CaseError> {
    let Some(slot) = v.get_mut(key) else {
        return Ok(());
    };
    if slot.is_null() {
        return Ok(());
    }
    let mut xs: Vec<u64> = serde_json::from_value(slot.clone())
        .map_err(|e| CaseError(format!("`{key}` must be an array of integers: {e}")))?;
    xs.sort_unstable();
    xs.dedup();
    *slot = json!(xs);
    Ok(())
}
