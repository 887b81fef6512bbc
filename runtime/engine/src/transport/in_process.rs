//! [`InProcess`]: ranks as tasks of this process, over channels (`kvrelay run`'s default).

use std::sync::Arc;

use tokio::sync::{Notify, mpsc};

use super::{BoxFuture, RankConn, Transport};
use crate::RunError;
use crate::rank::{RankReport, RankSetup, StepMsg};

/// Ranks as tasks of this process, over channels.
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
            let task = setup.build(wake)?;
            let (steps, rx) = mpsc::channel::<StepMsg>(1);
            let task = tokio::spawn(task.run(rx, reports));
            Ok(RankConn { steps, task })
        })
    }
}
