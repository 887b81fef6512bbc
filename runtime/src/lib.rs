//! kvrelay-runtime: the shell around `kvrelay-core`.
//!
//! Today it holds the conformance runner ([`conformance`]), the case-replay benchmark
//! ([`mod@bench`]) and the model check's command line ([`check`]) behind the one `kvrelay`
//! binary (`kvrelay conformance`, `kvrelay bench`, `kvrelay check`), whose `main.rs` only parses
//! the command line and prints. The engine loop, worker ranks and transfer backends follow in
//! the runtime issue.

pub mod bench;
pub mod check;
pub mod conformance;
