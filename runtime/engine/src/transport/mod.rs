//! How the engine reaches its ranks, and the clock it waits on: the two seams (besides the
//! transfer engine, [`crate::transfer`]) that a simulation replaces.
//!
//! * [`Transport`] starts one rank and hands back the sender of its steps and the task that
//!   serves it; the rank reports on the channel it was given. [`InProcess`] (`in_process.rs`)
//!   runs the rank task in this process; [`Processes`] ([`process`]) starts a `kvrelay worker`
//!   and speaks [`wire`] with it. The engine does not know which — a transport that delays,
//!   reorders, duplicates or drops messages is the simulation's (`kvrelay-sim`).
//! * [`Clock`] is every wait of the engine (the idle wait, the check for a vanished rank) and
//!   every time it measures. [`TokioClock`] is tokio's clock, which is virtual under a paused
//!   runtime (`tokio::time::pause`). Timeline timestamps (`--timeline`) stay wall time.
//!
//! Call [`crate::Engine::start`] for the transport its configuration names ([`for_config`]) and
//! tokio's clock; `Engine::start_with` takes both explicitly, `crate::run_with` the transport.

mod frame;
mod in_process;
pub mod process;
pub mod wire;

pub use self::in_process::InProcess;
pub use self::process::Processes;

use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;

use crate::RunError;
use crate::rank::{RankReport, RankSetup, RankStats, StepMsg};

/// A boxed future of this module's traits (they are used as trait objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One rank, connected.
#[derive(Debug)]
pub struct RankConn {
    /// Where the engine sends the rank its steps; dropping it asks the rank to stop.
    pub steps: mpsc::Sender<StepMsg>,
    /// The task serving the rank; it ends with the rank's figures.
    pub task: JoinHandle<RankStats>,
}

/// How the engine reaches a rank.
pub trait Transport: Send + Sync + Debug {
    /// Starts rank `setup.rank`, reporting on `reports`; `wake` is notified when one of its
    /// transfers completes (so that an idle engine steps again).
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>>;
}

/// The transport `c.workers` names: [`InProcess`], or [`Processes`] starting `c.worker_exe`.
pub fn for_config(c: &crate::RunConfig) -> Box<dyn Transport> {
    match c.workers {
        crate::Workers::InProcess => Box::new(InProcess),
        crate::Workers::Process => Box::new(Processes {
            exe: c.worker_exe.clone(),
        }),
    }
}

/// The time the engine waits on and measures with.
pub trait Clock: Send + Sync + Debug {
    /// Time since this clock's origin.
    fn now(&self) -> Duration;
    /// Completes once `d` has passed on this clock.
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()>;
}

/// tokio's clock: real time, or virtual time under a paused runtime.
#[derive(Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        Self {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(d))
    }
}
