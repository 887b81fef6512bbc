//! The calls of the `engine` machine as cases write them (FORMAT.md): one enum tagged by the
//! call's name, each call's arguments a struct that denies unknown fields, parsed by serde
//! ([`super::json::parse_call`]); then [`EngineCall::into_op`] checks what serde cannot (either
//! `prompt` or `prompt_len`, …) and interns request names, in the order the arguments are
//! listed, into the [`EngineOp`] the harness runs.

use std::collections::BTreeMap;

use kvrelay_core::{
    AggregatedOutput, BlockId, Interner, JobId, Lookup, Params, RequestId, RequestSpec, StepId,
    Token,
};
use serde::Deserialize;

use super::case::{CaseError, err};
use super::json::{Flag, NoArgs, id_set, present};

/// A converted `engine` call.
#[derive(Debug, Clone)]
pub enum EngineOp {
    /// `add_request`: the spec, the scripted lookup answer (if given) and delay-free (if given).
    AddRequest {
        /// The request.
        spec: RequestSpec,
        /// `Some(answer)` when the case gave `lookup`.
        lookup: Option<Lookup>,
        /// `Some(delay)` when the case gave `delay_free`.
        delay_free: Option<bool>,
    },
    /// `set_lookup`.
    SetLookup(RequestId, Lookup),
    /// `set_delay_free`.
    SetDelayFree(RequestId, bool),
    /// `set_delay_all`.
    SetDelayAll(bool),
    /// `set_finish_params`.
    SetFinishParams(RequestId, Params),
    /// `set_pending_block_frees`.
    SetPendingBlockFrees(bool),
    /// `set_push_work`.
    SetPushWork(bool),
    /// `abort`.
    Abort(RequestId),
    /// `schedule`.
    Schedule,
    /// `apply_output`.
    ApplyOutput {
        /// The step (`None`: the oldest in flight).
        step: Option<StepId>,
        /// Per-request overrides of the fake sampler.
        sampled: Vec<(RequestId, Vec<Token>)>,
        /// The aggregated connector output (`None`: the step produced none).
        kv: Option<AggregatedOutput>,
        /// Whether the case gave any connector-output field (scripted connector only).
        kv_given: bool,
    },
    /// `execute` (offloading): every rank's worker step for a scheduled step.
    Execute(Option<StepId>),
    /// `run_step` (offloading): `schedule`, `execute`, `apply_output`.
    RunStep,
    /// `drain` (offloading): `run_step` until no request is left, at most this many steps.
    Drain(u32),
    /// `hold` (offloading).
    Hold {
        /// The rank.
        rank: u32,
        /// Held or not.
        value: bool,
    },
    /// `complete` (offloading): feed completions to one rank.
    Complete {
        /// The rank.
        rank: u32,
        /// The jobs (`None`: every transfer in flight on it).
        jobs: Option<Vec<JobId>>,
    },
    /// `lookup` (offloading): the manager's answer for the chunks of a prompt.
    Lookup {
        /// A request whose prompt to use (`Some(None)`: a name never seen, which `lookup` does
        /// not intern, as the oracle does not: interning order decides the fake sampler's
        /// tokens).
        id: Option<Option<RequestId>>,
        /// Or explicit tokens.
        prompt: Option<Vec<Token>>,
    },
    /// `offload_state` (offloading).
    OffloadState,
    /// `reset_cache`: `reset_connector_cache()`.
    ResetCache,
    /// `request`.
    Request(RequestId),
    /// `state`.
    State,
    /// `connector_calls`.
    ConnectorCalls,
}

/// One `engine` call as a case writes it (both connectors; a call for the other connector is a typed error when it
/// runs, not a parse error).
#[derive(Deserialize, Debug)]
#[serde(tag = "call", content = "with", rename_all = "snake_case")]
pub(super) enum EngineCall {
    AddRequest(AddRequest),
    SetLookup(SetLookup),
    SetDelayFree(SetDelayFree),
    SetDelayAll(Flag),
    SetFinishParams(SetFinishParams),
    SetPendingBlockFrees(Flag),
    SetPushWork(Flag),
    Abort(Id),
    Schedule(NoArgs),
    ApplyOutput(ApplyOutput),
    Execute(Step),
    RunStep(NoArgs),
    Drain(Drain),
    Hold(Hold),
    Complete(Complete),
    Lookup(LookupArgs),
    OffloadState(NoArgs),
    ResetCache(NoArgs),
    Request(Id),
    State(NoArgs),
    ConnectorCalls(NoArgs),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct AddRequest {
    id: String,
    prompt_len: Option<u32>,
    prompt: Option<Vec<Token>>,
    max_tokens: u32,
    #[serde(default)]
    stop_token: Option<Token>,
    /// Absent: the script is left as it is; `null`: pending.
    #[serde(default, deserialize_with = "present")]
    lookup: Option<Option<Hit>>,
    #[serde(default)]
    delay_free: Option<bool>,
}

/// A scripted lookup answer: `null` is pending, else `{"tokens": n, "async": bool}`.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Hit {
    tokens: u32,
    #[serde(default, rename = "async")]
    load_async: bool,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct SetLookup {
    id: String,
    /// Required; `null` is pending.
    #[serde(deserialize_with = "present")]
    lookup: Option<Option<Hit>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct SetDelayFree {
    id: String,
    delay: bool,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct SetFinishParams {
    id: String,
    params: Params,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Id {
    id: String,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct ApplyOutput {
    step: Option<u64>,
    #[serde(default)]
    sampled: BTreeMap<String, Vec<Token>>,
    /// The four connector-output fields: `Some` when given (`null` included).
    #[serde(default, deserialize_with = "present")]
    finished_sending: Option<Option<Vec<String>>>,
    #[serde(default, deserialize_with = "present")]
    finished_recving: Option<Option<Vec<String>>>,
    #[serde(default, deserialize_with = "present")]
    failed_recving: Option<Vec<String>>,
    #[serde(default, deserialize_with = "present")]
    invalid_block_ids: Option<Vec<u64>>,
    #[serde(default)]
    no_kv_output: bool,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Step {
    step: Option<u64>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Drain {
    #[serde(default = "default_max_steps")]
    max_steps: u32,
}

fn default_max_steps() -> u32 {
    100
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Hold {
    rank: u32,
    #[serde(default = "held")]
    value: bool,
}

fn held() -> bool {
    true
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct Complete {
    rank: u32,
    jobs: Option<Vec<u64>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub(super) struct LookupArgs {
    id: Option<String>,
    prompt: Option<Vec<Token>>,
}

impl EngineCall {
    /// The operation the harness runs; request names are interned in `ids` here.
    pub(super) fn into_op(self, ids: &mut Interner) -> Result<EngineOp, CaseError> {
        Ok(match self {
            Self::AddRequest(a) => a.into_op(ids)?,
            Self::SetLookup(a) => {
                let lookup = a.lookup.expect("required by serde");
                EngineOp::SetLookup(ids.intern(&a.id), scripted(lookup))
            }
            Self::SetDelayFree(a) => EngineOp::SetDelayFree(ids.intern(&a.id), a.delay),
            Self::SetDelayAll(f) => EngineOp::SetDelayAll(f.value),
            Self::SetFinishParams(a) => EngineOp::SetFinishParams(ids.intern(&a.id), a.params),
            Self::SetPendingBlockFrees(f) => EngineOp::SetPendingBlockFrees(f.value),
            Self::SetPushWork(f) => EngineOp::SetPushWork(f.value),
            Self::Abort(a) => EngineOp::Abort(ids.intern(&a.id)),
            Self::Schedule(NoArgs {}) => EngineOp::Schedule,
            Self::ApplyOutput(a) => a.into_op(ids)?,
            Self::Execute(a) => EngineOp::Execute(a.step.map(StepId)),
            Self::RunStep(NoArgs {}) => EngineOp::RunStep,
            Self::Drain(a) => EngineOp::Drain(a.max_steps),
            Self::Hold(a) => EngineOp::Hold {
                rank: a.rank,
                value: a.value,
            },
            Self::Complete(a) => EngineOp::Complete {
                rank: a.rank,
                jobs: a.jobs.map(|v| v.into_iter().map(JobId).collect()),
            },
            Self::Lookup(a) => a.into_op(ids)?,
            Self::OffloadState(NoArgs {}) => EngineOp::OffloadState,
            Self::ResetCache(NoArgs {}) => EngineOp::ResetCache,
            Self::Request(a) => EngineOp::Request(ids.intern(&a.id)),
            Self::State(NoArgs {}) => EngineOp::State,
            Self::ConnectorCalls(NoArgs {}) => EngineOp::ConnectorCalls,
        })
    }
}

/// The scheduler's answer for a scripted lookup (`None`: pending).
fn scripted(hit: Option<Hit>) -> Lookup {
    match hit {
        None => Lookup::Pending,
        Some(h) => Lookup::Hit {
            tokens: h.tokens,
            load_async: h.load_async,
        },
    }
}

impl AddRequest {
    fn into_op(self, ids: &mut Interner) -> Result<EngineOp, CaseError> {
        let id = ids.intern(&self.id);
        let prompt = match (self.prompt, self.prompt_len) {
            (Some(_), Some(_)) => return err("give either `prompt` or `prompt_len`, not both"),
            (Some(p), None) => p,
            (None, Some(n)) => generated_prompt(&self.id, n),
            (None, None) => return err("missing argument `prompt_len` (or `prompt`)"),
        };
        Ok(EngineOp::AddRequest {
            spec: RequestSpec {
                id,
                prompt,
                max_tokens: self.max_tokens,
                stop_token: self.stop_token,
                kv_transfer_params: None,
            },
            lookup: self.lookup.map(scripted),
            delay_free: self.delay_free,
        })
    }
}

impl ApplyOutput {
    /// The step's tokens and connector output; names interned as listed: `sampled` (by name),
    /// `finished_sending`, `finished_recving`, `failed_recving`.
    fn into_op(self, ids: &mut Interner) -> Result<EngineOp, CaseError> {
        let sampled: Vec<(RequestId, Vec<Token>)> = self
            .sampled
            .into_iter()
            .map(|(n, t)| (ids.intern(&n), t))
            .collect();
        let given = [
            ("finished_sending", self.finished_sending.is_some()),
            ("finished_recving", self.finished_recving.is_some()),
            ("failed_recving", self.failed_recving.is_some()),
            ("invalid_block_ids", self.invalid_block_ids.is_some()),
        ];
        if self.no_kv_output
            && let Some((k, _)) = given.iter().find(|(_, g)| *g)
        {
            return err(format!("`{k}` given together with `no_kv_output: true`"));
        }
        let kv_given = self.no_kv_output || given.iter().any(|(_, g)| *g);
        let names = |s: Option<Option<Vec<String>>>, ids: &mut Interner| {
            s.flatten().map(|s| id_set(s, ids))
        };
        let kv = (!self.no_kv_output).then(|| {
            let finished_sending = names(self.finished_sending, ids);
            let finished_recving = names(self.finished_recving, ids);
            AggregatedOutput {
                finished_sending,
                finished_recving,
                invalid_block_ids: self
                    .invalid_block_ids
                    .unwrap_or_default()
                    .into_iter()
                    .map(BlockId)
                    .collect(),
                failed_recving: id_set(self.failed_recving.unwrap_or_default(), ids),
                worker_meta: None,
                kv_events: None,
                expected_finished_count: 1,
            }
        });
        Ok(EngineOp::ApplyOutput {
            step: self.step.map(StepId),
            sampled,
            kv,
            kv_given,
        })
    }
}

impl LookupArgs {
    /// A named request's prompt (a name never seen is not interned: the oracle does not, and
    /// interning order decides the fake sampler's tokens), or explicit tokens.
    fn into_op(self, ids: &mut Interner) -> Result<EngineOp, CaseError> {
        match (self.id, self.prompt) {
            (Some(_), Some(_)) => err("give either `id` or `prompt`, not both"),
            (None, None) => err("missing argument `id` (or `prompt`)"),
            (Some(name), None) => Ok(EngineOp::Lookup {
                id: Some(ids.get(&name)),
                prompt: None,
            }),
            (None, Some(prompt)) => Ok(EngineOp::Lookup {
                id: None,
                prompt: Some(prompt),
            }),
        }
    }
}

/// FNV-1a (32 bit) of a request name: the seed of its generated prompt.
fn name_seed(name: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// The prompt `prompt_len` generates for request `name`: token `i` is
/// `1 + (fnv1a32(name) + i) mod 1_000_000`.
pub fn generated_prompt(name: &str, len: u32) -> Vec<Token> {
    let seed = name_seed(name);
    (0..len)
        .map(|i| 1 + seed.wrapping_add(i) % 1_000_000)
        .collect()
}
