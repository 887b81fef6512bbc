//! MultiConnector: K child connectors composed in order, as vLLM 0.33.0's `MultiConnector`
//! (SEMANTICS.md §1.7, §4.3, I-28…I-32, S13).
//!
//! Use it when one engine needs several connectors at once, e.g. a P/D sender that also
//! offloads to CPU: every child sees every request, every child may save it, and at most one
//! child loads it.
//!
//! * [`MultiConnector`] is the scheduler side. Loads come from the lowest child with a positive
//!   match (remembered per request until `request_finished`); every child saves. When `n > 1`
//!   children delay a request's free, the `n − 1` extra saves are counted in
//!   `extra_async_saves` and shipped to the workers in the next [`MultiMeta`].
//! * [`MultiWorker`] is the worker side of one rank. It merges the shipped counts into its own
//!   map and suppresses a child's `finished_sending` report for a request while an extra save
//!   of it is pending, so the request is reported exactly once, after its last saving child
//!   (I-28).
//!
//! Children are any [`SchedulerConnector`] / [`WorkerConnector`] whose worker metadata is
//! [`Meta`]; a homogeneous `Vec<C>` is the simple case, and `Box<dyn SchedulerConnector<..>>`
//! (the traits are object safe, and boxes implement them) composes children of different types
//! that share a metadata type.
//!
//! # Errors
//!
//! Where vLLM raises, this module returns a [`ConnectorError`]: two children setting the same
//! `kv_transfer_params` key (I-32), children disagreeing on the finished count, a worker
//! metadata that is not one slot per child. The trait methods have no error channel of their
//! own, so [`MultiConnector`] keeps the error and hands it to the scheduler through
//! [`SchedulerConnector::take_error`]; the scheduler then stops with the sticky
//! [`crate::SchedulerError::ConnectorContract`], as vLLM's engine stops on the exception.
//! Callers that drive a [`MultiConnector`] directly use the `try_*` methods.

use alloc::collections::BTreeMap;
use alloc::format;
use alloc::string::ToString;
use alloc::vec::Vec;

use crate::ids::RequestId;
use crate::messages::Meta;
use crate::scheduler::ConnectorError;

mod connector;
mod worker;

#[cfg(test)]
mod tests;

pub use connector::MultiConnector;
pub use worker::MultiWorker;

/// `extra_async_saves`: per request, the number of async saves beyond the first still to be
/// reported (always ≥ 1 while present).
pub type ExtraAsyncSaves = BTreeMap<RequestId, u32>;

/// The MultiConnector's per-step metadata (vLLM's `MultiKVConnectorMetadata`), delivered
/// unchanged to every rank's [`MultiWorker`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MultiMeta<M> {
    /// Child `i`'s metadata of this step, in child order.
    pub metadata: Vec<M>,
    /// Extra async saves recorded since the previous step (`None` when there were none). The
    /// worker merges them before any child can report the request (I-28).
    pub extra_async_saves: Option<ExtraAsyncSaves>,
}

/// vLLM's `get_finished_count` over the children's answers: `None` if any child answers
/// `None`, else their common value; two different values are
/// [`ConnectorError::FinishedCountConflict`].
pub fn combine_finished_counts(
    counts: impl IntoIterator<Item = Option<u32>>,
) -> Result<Option<u32>, ConnectorError> {
    let mut distinct: Vec<u32> = Vec::new();
    for c in counts {
        let Some(c) = c else { return Ok(None) };
        if !distinct.contains(&c) {
            distinct.push(c);
        }
    }
    if distinct.len() > 1 {
        distinct.sort_unstable();
        return Err(ConnectorError::FinishedCountConflict { counts: distinct });
    }
    Ok(distinct.first().copied())
}

/// Splits an aggregated worker metadata into what each of `children` children observes in
/// `update_connector_output`: `None` gives every child `None`; a `multi` tuple gives child `i`
/// slot `i` (slots beyond the children are ignored, as in vLLM); anything else, or a tuple
/// with fewer slots than children, is [`ConnectorError::WorkerMetaShape`].
pub fn route_worker_meta(
    meta: Option<Meta>,
    children: usize,
) -> Result<Vec<Option<Meta>>, ConnectorError> {
    match meta {
        None => Ok(alloc::vec![None; children]),
        Some(Meta::Multi(mut slots)) if slots.len() >= children => {
            slots.truncate(children);
            Ok(slots)
        }
        Some(Meta::Multi(slots)) => Err(ConnectorError::WorkerMetaShape {
            found: format!("multi with {} slots", slots.len()),
            expected: format!("multi with {children} slots"),
        }),
        Some(other) => Err(ConnectorError::WorkerMetaShape {
            found: other.form().to_string(),
            expected: format!("multi with {children} slots"),
        }),
    }
}
