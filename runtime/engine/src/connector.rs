//! The engine's connector, chosen once when the engine is built ([`crate::RunConfig::pd`]) as
//! one type for the engine step, the ranks and the wire between them
//! ([`kvrelay_core::Either`]):
//!
//! * `kvrelay run`: kvrelay's CPU offloading connector (left);
//! * `kvrelay pd` ([`crate::pd`]): vLLM's MultiConnector over the P/D connector and the
//!   offloading connector (right), as vLLM deployments pair NIXL with CPU offloading — the P/D
//!   connector first, so that a remote prefill's hit is the one loaded.
//!
//! [`offloading`] and [`pd`] find each connector wherever it is.

use kvrelay_core::{
    ConnectorError, Either, EitherWorker, MultiConnector, MultiMeta, MultiWorker,
    OffloadingConnector, OffloadingConnectorMeta, OffloadingWorker, PdConnector, PdMeta, PdWorker,
};

/// A child of a P/D engine's MultiConnector.
pub type Child = Either<Box<OffloadingConnector>, PdConnector>;

/// The scheduler side.
pub type EngineConnector = Either<Box<OffloadingConnector>, MultiConnector<Child>>;

/// A step's connector metadata, as the ranks receive it.
pub type EngineMeta =
    Either<OffloadingConnectorMeta, MultiMeta<Either<OffloadingConnectorMeta, PdMeta>>>;

/// A rank's worker connector.
pub type EngineWorker =
    EitherWorker<OffloadingWorker, MultiWorker<EitherWorker<OffloadingWorker, PdWorker>>>;

/// A P/D engine's connector: the MultiConnector over `pd` and `offloading`.
pub fn pd_engine(
    pd: PdConnector,
    offloading: OffloadingConnector,
) -> Result<EngineConnector, ConnectorError> {
    let children = vec![Either::Right(pd), Either::Left(Box::new(offloading))];
    Ok(Either::Right(MultiConnector::new(children)?))
}

/// A rank's worker: the offloading worker alone, or (P/D) the MultiConnector's workers in the
/// scheduler side's order.
pub fn worker(offloading: OffloadingWorker, pd: Option<PdWorker>) -> EngineWorker {
    EitherWorker::new(match pd {
        None => Either::Left(offloading),
        Some(pd) => Either::Right(MultiWorker::new(vec![
            EitherWorker::new(Either::Right(pd)),
            EitherWorker::new(Either::Left(offloading)),
        ])),
    })
}

/// The offloading connector, alone or a child.
pub fn offloading(c: &EngineConnector) -> Option<&OffloadingConnector> {
    match c {
        Either::Left(o) => Some(o),
        Either::Right(m) => m.children().iter().find_map(Either::left).map(|o| &**o),
    }
}

/// The offloading connector, mutably.
pub fn offloading_mut(c: &mut EngineConnector) -> Option<&mut OffloadingConnector> {
    match c {
        Either::Left(o) => Some(o),
        Either::Right(m) => {
            let i = m.children().iter().position(|c| c.left().is_some())?;
            m.child_mut(i)?.left_mut().map(|o| &mut **o)
        }
    }
}

/// The P/D connector (`None`: not a P/D engine).
pub fn pd(c: &EngineConnector) -> Option<&PdConnector> {
    c.right()?.children().iter().find_map(Either::right)
}

/// The P/D connector, mutably.
pub fn pd_mut(c: &mut EngineConnector) -> Option<&mut PdConnector> {
    let m = c.right_mut()?;
    let i = m.children().iter().position(|c| c.right().is_some())?;
    m.child_mut(i)?.right_mut()
}
