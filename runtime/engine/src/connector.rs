//! The engine's connector: kvrelay's CPU offloading connector (`kvrelay run`), or the P/D
//! connector of a prefill or a decode engine (`kvrelay pd`, [`crate::pd`]) — chosen once, when
//! the engine is built ([`crate::RunConfig::pd`]), as one type for the engine step, the ranks
//! and the wire between them ([`kvrelay_core::Either`]).

use kvrelay_core::{
    Either, EitherWorker, OffloadingConnector, OffloadingConnectorMeta, OffloadingWorker,
    PdConnector, PdMeta, PdWorker,
};

/// The scheduler side: the offloading connector (left) or the P/D connector (right).
pub type EngineConnector = Either<Box<OffloadingConnector>, PdConnector>;

/// A step's connector metadata, as the ranks receive it.
pub type EngineMeta = Either<OffloadingConnectorMeta, PdMeta>;

/// A rank's worker connector.
pub type EngineWorker = EitherWorker<OffloadingWorker, PdWorker>;
