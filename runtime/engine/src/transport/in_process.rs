//! [`InProcess`]: ranks as threads of this process, over channels (`kvrelay run`'s default).
//!
//! Each rank runs on a thread of its own (tokio's blocking pool, a current-thread runtime per
//! rank), so ranks do their step's work in parallel while the engine waits; the channels carry
//! the same messages as between tasks. What a rank does in a step does not depend on when it
//! runs (transfers complete at fixed steps: `crate::rank::Completions`), so threads change the
//! run's speed, not its counts.

use std::sync::Arc;

use tokio::sync::{Notify, mpsc};

use super::{BoxFuture, RankConn, Transport};
use crate::RunError;
use crate::rank::{RankReport, RankSetup, StepMsg};

/// Ranks as threads of this process, over channels.
#[derive(Debug, Default)]
pub struct InProcess;

impl Transport for InProcess {
    fn connect(
        &self,
        setup: RankSetup,
        wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let rank = setup.rank;
            let task = setup.build(wake)?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| RunError::Worker {
                    rank,
                    why: format!("a runtime for the rank's thread: {e}"),
                })?;
            let (steps, rx) = mpsc::channel::<StepMsg>(1);
            let task = tokio::task::spawn_blocking(move || rt.block_on(task.run(rx, reports)));
            Ok(RankConn { steps, task })
        })
    }
}
