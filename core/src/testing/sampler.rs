//! The fake sampler of tests and simulations.

use alloc::vec::Vec;

use crate::engine::{Applied, EngineCore, EngineError};
use crate::ids::{RequestId, StepId};
use crate::scheduler::{Scheduler, SchedulerConnector};
use crate::tokens::{Token, hash_block};

/// The deterministic "sampler" of tests and simulations: the token a request samples at
/// `position` (the index the new token will have). Reproducible on every platform.
pub fn fake_token(id: RequestId, position: u32) -> Token {
    let h = hash_block(None, &[id.0, position, 0x5eed]);
    (h.0 % 50_000) as Token + 1
}

impl<C: SchedulerConnector> Scheduler<C> {
    /// The fake sampler's tokens for a step in flight: one [`fake_token`] per request in
    /// [`Scheduler::sampling`]. Use it to build a [`crate::ModelOutput`] in tests and
    /// simulations.
    pub fn fake_sample(&self, step: StepId) -> Vec<(RequestId, Vec<Token>)> {
        self.sampling(step)
            .map(|(id, position)| (id, alloc::vec![fake_token(id, position)]))
            .collect()
    }
}

impl<C: SchedulerConnector> EngineCore<C> {
    /// [`EngineCore::apply`] with the fake sampler's tokens for the oldest step in flight.
    pub fn apply_fake(&mut self) -> Result<Applied<C::WorkerMeta>, EngineError> {
        let sampled = match self.scheduler().steps_in_flight().next() {
            Some(step) => self.scheduler().fake_sample(step),
            None => Vec::new(),
        };
        self.apply(sampled)
    }
}
