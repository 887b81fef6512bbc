//! [`Intent`]: a change to scheduler-owned state that a connector asks for.

use alloc::vec::Vec;

use crate::ids::BlockId;

/// A change to scheduler-owned state that a connector asks for (SEMANTICS.md §7.3). Drained with
/// [`crate::SchedulerConnector::take_intents`] after every mutable call and applied by the scheduler;
/// an intent the scheduler cannot apply is the sticky error
/// [`crate::SchedulerError::IntentRejected`].
#[derive(Clone, Debug, Eq, Hash, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Intent {
    /// Take a reference on these GPU blocks so they are neither reused nor evicted while a
    /// transfer reads them (what `bind_gpu_block_pool` users do by touching ref counts). Each
    /// block must be in use or prefix-cached.
    Pin(Vec<BlockId>),
    /// Drop a reference taken by [`Intent::Pin`].
    Unpin(Vec<BlockId>),
}
