//! kvrelay-runtime: the shell around `kvrelay-core`.
//!
//! Today it holds the conformance runner ([`conformance`]) and the case-replay benchmark
//! ([`bench`]) behind the one `kvrelay` binary (`kvrelay conformance`, `kvrelay bench`,
//! `kvrelay check`). The engine loop, worker ranks and transfer backends follow in the runtime
//! issue.

pub mod bench;
pub mod conformance;
