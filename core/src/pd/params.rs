//! The `kv_transfer_params` a P/D pair exchanges, typed and validated.
//!
//! A router asks a prefill engine to hold a request's KV for a decode engine with
//! `do_remote_decode`; the prefill engine's final output answers with the params that let the
//! decode engine find that KV (`do_remote_prefill`, the producing engine, its request, how many
//! tokens' KV it holds), and the router forwards them with the request to the decode engine, as
//! vLLM's disaggregation proxy does with NIXL's params. Values are strings ([`Params`]):
//! booleans `true` / `false` (or Python's `True` / `False`), numbers decimal. Decode params at
//! the process boundary ([`PdParams::parse`]): the connector treats params it cannot read as
//! absent.

use alloc::string::{String, ToString};

use crate::scheduler::Params;

/// The prefill engine holds this request's KV for a decode engine (`"true"`).
pub const DO_REMOTE_DECODE: &str = "do_remote_decode";
/// The request's prompt KV waits on a prefill engine (`"true"`); the keys below say where.
pub const DO_REMOTE_PREFILL: &str = "do_remote_prefill";
/// The prefill engine's id.
pub const REMOTE_ENGINE_ID: &str = "remote_engine_id";
/// The request's id on the prefill engine.
pub const REMOTE_REQUEST_ID: &str = "remote_request_id";
/// Leading prompt tokens whose KV the prefill engine holds.
pub const REMOTE_NUM_TOKENS: &str = "remote_num_tokens";

/// Where a request's prompt KV waits: the prefill engine, its request, the tokens it covers.
#[derive(Clone, Copy, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RemotePrefill {
    /// The prefill engine.
    pub engine: u32,
    /// The request's id there.
    pub request: u32,
    /// Leading prompt tokens whose KV it holds.
    pub num_tokens: u32,
}

/// The P/D entries of a request's `kv_transfer_params`.
#[derive(Clone, Copy, Debug, Default, Eq, Hash, PartialEq)]
pub struct PdParams {
    /// `do_remote_decode`: hold the KV for a decode engine when the request finishes.
    pub remote_decode: bool,
    /// `do_remote_prefill` and where: load the prompt KV from a prefill engine.
    pub remote_prefill: Option<RemotePrefill>,
}

/// Why a request's P/D params cannot be read.
#[derive(Clone, Debug, Eq, Hash, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PdParamsError {
    /// A flag that is neither `true` nor `false`.
    #[error("kv_transfer_params[{key:?}] = {value:?} is not true or false")]
    NotABool {
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
    },
    /// A number that is not a decimal `u32`.
    #[error("kv_transfer_params[{key:?}] = {value:?} is not a number from 0 to 4294967295")]
    NotANumber {
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
    },
    /// `do_remote_prefill` without one of the keys that say where.
    #[error("kv_transfer_params has do_remote_prefill but no {key:?}")]
    Missing {
        /// The missing key.
        key: &'static str,
    },
}

impl PdParams {
    /// Reads the P/D entries of `params` (other keys are left alone).
    pub fn parse(params: &Params) -> Result<Self, PdParamsError> {
        let flag = |key: &'static str| match params.get(key).map(String::as_str) {
            // `True` / `False`: Python's `str()` of a bool, as the Python package passes them.
            None | Some("false" | "False") => Ok(false),
            Some("true" | "True") => Ok(true),
            Some(v) => Err(PdParamsError::NotABool {
                key,
                value: v.to_string(),
            }),
        };
        let number = |key: &'static str| {
            let v = params.get(key).ok_or(PdParamsError::Missing { key })?;
            v.parse().map_err(|_| PdParamsError::NotANumber {
                key,
                value: v.clone(),
            })
        };
        let remote_decode = flag(DO_REMOTE_DECODE)?;
        let remote_prefill = if flag(DO_REMOTE_PREFILL)? {
            Some(RemotePrefill {
                engine: number(REMOTE_ENGINE_ID)?,
                request: number(REMOTE_REQUEST_ID)?,
                num_tokens: number(REMOTE_NUM_TOKENS)?,
            })
        } else {
            None
        };
        Ok(Self {
            remote_decode,
            remote_prefill,
        })
    }

    /// The params a router forwards to a decode engine (what a prefill engine's final output
    /// carries).
    pub fn for_decode(at: RemotePrefill) -> Params {
        let mut p = Params::new();
        p.insert(DO_REMOTE_PREFILL.to_string(), "true".to_string());
        p.insert(REMOTE_ENGINE_ID.to_string(), at.engine.to_string());
        p.insert(REMOTE_REQUEST_ID.to_string(), at.request.to_string());
        p.insert(REMOTE_NUM_TOKENS.to_string(), at.num_tokens.to_string());
        p
    }

    /// The params a router sends with a request to a prefill engine.
    pub fn for_prefill() -> Params {
        let mut p = Params::new();
        p.insert(DO_REMOTE_DECODE.to_string(), "true".to_string());
        p
    }
}
