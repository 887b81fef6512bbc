//! The manager's working buffers: per-call lists (scope indices, candidates, the sorted
//! offer, eviction victims) reused from call to call, and the storage of finished requests'
//! scopes, so that a call allocates only what it returns.
//!
//! They hold nothing between calls — every call clears what it uses before filling it — so
//! they are not part of the manager's state: a clone starts with empty buffers, and equality
//! and hashing ignore them (two managers that differ only in their buffers' leftovers are the
//! same state to the model checker).
//!
//! The manager keeps them boxed ([`ScratchBox`]): a call that needs them beside `&mut self`
//! takes them out and puts them back by moving one pointer.

use alloc::boxed::Box;
use alloc::vec::Vec;

use super::scope::RequestAccess;
use super::types::OffloadKey;

/// How many finished requests' scopes are kept for reuse.
pub(super) const SPARE_SCOPES: usize = 16;

/// Reused per-call buffers. See the module docs.
#[derive(Default)]
pub(super) struct Scratch {
    /// Each key's index in the request's scope (`RequestAccess::admit`).
    pub(super) at: Vec<u32>,
    /// Store candidates: indices into the call's keys, with the keys' `arena::mix`
    /// (`prepare_store`).
    pub(super) candidates: Vec<(usize, u64)>,
    /// Arena slots of the offered keys that are stored, flagged `offered` for the call
    /// (`prepare_store`: eviction protection).
    pub(super) offered: Vec<u32>,
    /// Arena slots of the ghosts that react to a store miss (`prepare_store`).
    pub(super) ghosts: Vec<u32>,
    /// Arena slots chosen for eviction (the policies' `evict`), or whose pins a call took.
    pub(super) slots: Vec<u32>,
    /// Keys with their positions for the LRU's provisional ranks (`record_load`, `prepare_store`).
    pub(super) ranked: Vec<(OffloadKey, u32)>,
    /// A finished request's scope entries in commit order (`on_request_finished`).
    pub(super) order: Vec<u32>,
    /// Cleared scopes of finished requests (at most [`SPARE_SCOPES`]), given to new requests
    /// so that a request's scope does not allocate anew.
    pub(super) spare_scopes: Vec<RequestAccess>,
}

/// The manager's [`Scratch`], boxed; `None` until a call first needs it (and in a clone).
#[derive(Default)]
pub(super) struct ScratchBox(Option<Box<Scratch>>);

impl ScratchBox {
    /// Takes the buffers out for a call (see [`Self::put`]).
    #[inline]
    pub(super) fn take(&mut self) -> Box<Scratch> {
        self.0.take().unwrap_or_default()
    }

    /// Puts back what [`Self::take`] took.
    #[inline]
    pub(super) fn put(&mut self, scratch: Box<Scratch>) {
        self.0 = Some(scratch);
    }

    /// The buffers, in place.
    #[inline]
    pub(super) fn get(&mut self) -> &mut Scratch {
        self.0.get_or_insert_default()
    }
}

impl Clone for ScratchBox {
    /// Empty buffers: they carry nothing between calls.
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl core::fmt::Debug for ScratchBox {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Scratch")
    }
}

impl PartialEq for ScratchBox {
    /// Always equal: buffers are not state.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ScratchBox {}

impl core::hash::Hash for ScratchBox {
    /// Nothing: buffers are not state.
    fn hash<H: core::hash::Hasher>(&self, _: &mut H) {}
}
