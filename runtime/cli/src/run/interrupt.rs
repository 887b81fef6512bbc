//! SIGINT and SIGTERM during `kvrelay run`: the first asks the run to stop (it stops stepping,
//! gives its ranks [`kvrelay_engine::stop::STOP_GRACE`] to exit, kills what is left); the
//! second asks it to kill them at once; a third, or a run still not ended [`FORCE_EXIT_AFTER`]
//! after the second, exits the process there and then (its worker processes die with it: their
//! parent-death signal).
//!
//! # When to call what
//!
//! [`listen`] before the run starts: from then on the two signals no longer kill the process
//! outright. Hand [`Interrupts::signal`] to `kvrelay_engine::run_until`; after a run that
//! returned `RunError::Interrupted`, [`Interrupts::first`] names the signal, whose
//! [`Signal::exit_code`] is the exit status.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvrelay_engine::{StopRequest, StopSignal, Stopper, stop_channel};
use tokio::signal::unix::{SignalKind, signal};

/// How long a run has to end after the second signal before the process exits regardless.
pub(crate) const FORCE_EXIT_AFTER: Duration = Duration::from_secs(3);

/// A signal that interrupts a run.
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub(crate) enum Signal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

impl Signal {
    /// Its name, as `kill -l` spells it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Interrupt => "SIGINT",
            Self::Terminate => "SIGTERM",
        }
    }

    /// The exit status of a run it interrupted: 128 + its number, as a shell reports a process
    /// the signal killed.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Self::Interrupt => 130,
            Self::Terminate => 143,
        }
    }
}

/// The listening started by [`listen`].
#[derive(Debug)]
pub(crate) struct Interrupts {
    signal: StopSignal,
    first: Arc<OnceLock<Signal>>,
}

impl Interrupts {
    /// The run's end of the stop channel the signals drive.
    pub(crate) fn signal(&self) -> StopSignal {
        self.signal.clone()
    }

    /// The first signal received, if any.
    pub(crate) fn first(&self) -> Option<Signal> {
        self.first.get().copied()
    }
}

/// Takes SIGINT and SIGTERM over, on a thread of their own (so that they are heard even while
/// the engine's thread is busy).
pub(crate) fn listen() -> std::io::Result<Interrupts> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered here, before the run starts, not when the thread first polls them.
    let (int, term) = {
        let _entered = rt.enter();
        (
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        )
    };
    let (stopper, stop) = stop_channel();
    let first = Arc::new(OnceLock::new());
    let heard = first.clone();
    std::thread::Builder::new()
        .name("kvrelay-signals".into())
        .spawn(move || rt.block_on(forward(int, term, stopper, heard)))?;
    Ok(Interrupts {
        signal: stop,
        first,
    })
}

/// Escalates the stop on each signal; after the second, exits the process once a third
/// comes or [`FORCE_EXIT_AFTER`] has passed (the run normally ends, and the process with it,
/// well before).
async fn forward(
    mut int: tokio::signal::unix::Signal,
    mut term: tokio::signal::unix::Signal,
    stopper: Stopper,
    first: Arc<OnceLock<Signal>>,
) {
    loop {
        let s = tokio::select! {
            Some(()) = int.recv() => Signal::Interrupt,
            Some(()) = term.recv() => Signal::Terminate,
            else => return,
        };
        let _ = first.set(s);
        if stopper.escalate() == StopRequest::Immediate {
            break;
        }
    }
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        () = tokio::time::sleep(FORCE_EXIT_AFTER) => {}
    }
    let s = first.get().copied().unwrap_or(Signal::Interrupt);
    eprintln!(
        "kvrelay run: interrupted by {} and not stopped in time: exiting now",
        s.name()
    );
    std::process::exit(i32::from(s.exit_code()));
}
