//! Step drivers: one engine step of a [`Scheduler`] (schedule, fake sampling, apply), and one
//! rank's step through a [`RankDriver`], each checking the machine's invariants as it goes.
//!
//! Use [`schedule`] and [`apply`] where a test keeps steps in flight (async scheduling) or
//! applies outputs out of the usual rhythm, [`step`] for a whole step at once; they panic on any
//! error, so a test that expects an error calls the scheduler itself. [`run_rank_step`] polls a
//! rank whose step has begun to its end, for workers that never make a rank wait (the scripted
//! ones); a test that completes transfers itself drives the rank by hand, or with a
//! [`SimDma`]. [`computed`] reads back how far a request got.

use kvrelay_core::testing::SimDma;
use kvrelay_core::{
    AggregatedOutput, ModelOutput, RankAction, RankDriver, Scheduler, SchedulerConnector,
    SchedulerOutput, StepId, StepResult, WorkerConnector, WorkerOutput,
};

use crate::build::rid;

/// `check_invariants()` of `s`, panicking on a violation.
pub fn check<C: SchedulerConnector>(s: &Scheduler<C>) {
    s.check_invariants().unwrap();
}

/// Schedules a step and checks the invariants; returns the step's output.
pub fn schedule<C: SchedulerConnector>(s: &mut Scheduler<C>) -> SchedulerOutput {
    let out = s.schedule().unwrap().output;
    check(s);
    out
}

/// Applies `step`'s output: the fake sampler's tokens ([`Scheduler::fake_sample`]) and the
/// aggregated connector output `kv`; checks the invariants and returns the step's result.
pub fn apply<C: SchedulerConnector>(
    s: &mut Scheduler<C>,
    step: StepId,
    kv: Option<AggregatedOutput<C::WorkerMeta>>,
) -> StepResult {
    let sampled = s.fake_sample(step);
    let r = s
        .update_from_output(
            step,
            ModelOutput {
                sampled,
                kv_connector_output: kv,
            },
        )
        .unwrap();
    check(s);
    r
}

/// One whole step: [`schedule`], then [`apply`] its output with `kv`.
pub fn step<C: SchedulerConnector>(
    s: &mut Scheduler<C>,
    kv: Option<AggregatedOutput<C::WorkerMeta>>,
) -> (SchedulerOutput, StepResult) {
    let out = schedule(s);
    let res = apply(s, out.step, kv);
    (out, res)
}

/// The computed tokens of request `id`.
///
/// # Panics
/// If `s` does not hold the request.
pub fn computed<C: SchedulerConnector>(s: &Scheduler<C>, id: u32) -> u32 {
    s.view().request(rid(id)).unwrap().num_computed_tokens()
}

/// Polls `driver`, whose step has begun, to the end of the step under a DMA that completes
/// nothing (the transfers started stay in flight on the driver): returns every action before
/// `Done`, and the rank's output. `check_invariants()` of the driver runs after every action.
///
/// # Panics
/// If the rank has to wait for a transfer, or is idle (no step was begun).
pub fn run_rank_step<W>(
    driver: &mut RankDriver<W>,
) -> (Vec<RankAction<W::WorkerMeta>>, WorkerOutput<W::WorkerMeta>)
where
    W: WorkerConnector,
    W::StepMeta: Clone,
{
    let mut seen = Vec::new();
    let out = SimDma::manual()
        .resume(driver, &mut |a: &RankAction<W::WorkerMeta>| {
            seen.push(a.clone())
        })
        .unwrap_or_else(|e| panic!("the rank's step did not end: {e}"));
    (seen, out)
}
