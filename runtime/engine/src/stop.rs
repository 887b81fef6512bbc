//! Stopping a run before its end: an embedder's [`Stopper`] asks, the run's [`StopSignal`]
//! hears. The engine knows no signals and no terminal; whoever embeds it decides what asks
//! (`kvrelay run` wires SIGINT and SIGTERM to [`Stopper::escalate`]).
//!
//! # When to call what
//!
//! * [`stop_channel`] before the run: keep the [`Stopper`], hand the [`StopSignal`] to
//!   [`crate::run_until`] (or, driving an [`crate::Engine`] yourself, to
//!   [`crate::Engine::shutdown_on`]).
//! * [`Stopper::escalate`] once ([`StopRequest::Graceful`]): the run stops stepping, closes its
//!   ranks' links (a worker process then finishes the step it is on, sends its figures and
//!   exits), waits up to [`STOP_GRACE`] for them, kills what is left and returns
//!   [`crate::RunError::Interrupted`].
//! * [`Stopper::escalate`] again ([`StopRequest::Immediate`]): the grace is cut short, what is
//!   left is killed now.
//!
//! A request never goes back: the value only moves down [`StopRequest`]. A dropped
//! [`Stopper`] asks nothing more; [`StopSignal::never`] is a signal nobody can raise.

use std::time::Duration;

use tokio::sync::watch;

use crate::transport::Clock;

/// How long a run asked to stop gives its ranks to exit before it kills them.
pub const STOP_GRACE: Duration = Duration::from_secs(2);

/// What a run has been asked, in escalating order.
#[derive(Clone, Copy, Debug, Eq, Ord, PartialEq, PartialOrd)]
pub enum StopRequest {
    /// Nothing: run to the end.
    None,
    /// Stop stepping; give the ranks [`STOP_GRACE`] to exit, then kill what is left.
    Graceful,
    /// Stop now: kill the ranks without waiting.
    Immediate,
}

/// The asking end: see the module docs.
#[derive(Debug)]
pub struct Stopper {
    tx: watch::Sender<StopRequest>,
}

/// The hearing end, one per run: see the module docs.
#[derive(Clone, Debug)]
pub struct StopSignal {
    /// `None`: nobody can ask.
    rx: Option<watch::Receiver<StopRequest>>,
}

/// A new pair: nothing asked yet.
pub fn stop_channel() -> (Stopper, StopSignal) {
    let (tx, rx) = watch::channel(StopRequest::None);
    (Stopper { tx }, StopSignal { rx: Some(rx) })
}

impl Stopper {
    /// Asks one step more than before (none → graceful → immediate); returns what is asked
    /// now. Callable from any thread, inside or outside a tokio runtime.
    pub fn escalate(&self) -> StopRequest {
        self.tx.send_modify(|r| {
            *r = match *r {
                StopRequest::None => StopRequest::Graceful,
                StopRequest::Graceful | StopRequest::Immediate => StopRequest::Immediate,
            }
        });
        *self.tx.borrow()
    }
}

impl StopSignal {
    /// A signal nobody can raise (a run to its end, as [`crate::run()`]).
    pub fn never() -> Self {
        Self { rx: None }
    }

    /// What has been asked so far.
    pub fn request(&self) -> StopRequest {
        self.rx
            .as_ref()
            .map_or(StopRequest::None, |rx| *rx.borrow())
    }

    /// Completes once at least `level` has been asked; never, if it cannot be any more (the
    /// [`Stopper`] is gone). Cancel-safe.
    pub async fn at_least(&mut self, level: StopRequest) {
        if let Some(rx) = &mut self.rx
            && rx.wait_for(|r| *r >= level).await.is_ok()
        {
            return;
        }
        std::future::pending().await
    }

    /// Completes when what is left of a run must be killed: `grace` after a graceful stop was
    /// asked (timed on `clock`, the engine's), or as soon as an immediate one is.
    pub async fn deadline(&mut self, clock: &dyn Clock, grace: Duration) {
        self.at_least(StopRequest::Graceful).await;
        tokio::select! {
            () = clock.sleep(grace) => {}
            () = self.at_least(StopRequest::Immediate) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the escalation order the CLI's second signal relies on.
    #[test]
    fn a_request_only_escalates() {
        let (stopper, signal) = stop_channel();
        assert_eq!(signal.request(), StopRequest::None);
        assert_eq!(stopper.escalate(), StopRequest::Graceful);
        assert_eq!(signal.request(), StopRequest::Graceful);
        assert_eq!(stopper.escalate(), StopRequest::Immediate);
        assert_eq!(stopper.escalate(), StopRequest::Immediate);
        assert_eq!(StopSignal::never().request(), StopRequest::None);
    }
}
