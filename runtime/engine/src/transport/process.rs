//! Ranks as worker processes: the engine's end of the link (`spawn_worker`, `WorkerLink`)
//! and the worker's own main ([`worker_main`], `kvrelay worker`).
//!
//! The engine listens on a Unix socket of its own, starts `kvrelay worker --socket PATH
//! --rank R` (`RunConfig::worker_exe`, else `$KVRELAY_WORKER_EXE`, else the running
//! executable), and speaks [`crate::transport::wire`]
//! with it. The worker builds the same rank task an in-process rank is, from the setup it
//! receives, so the two transports differ only in how a `StepMsg` and a `RankReport`
//! travel. A worker that does not connect within [`CONNECT_TIMEOUT`], a frame that does not
//! decode, a closed connection: each stops the run with a typed error, and the worker process
//! is killed rather than left behind.
//!
//! # What is left behind: nothing
//!
//! * The socket lives in a directory of its own (`$TMPDIR/kvrelay-PID-N/rank-R.sock`, mode
//!   0700), which a guard removes as soon as the worker has connected, or when the start is
//!   abandoned (an error, a timeout, the future dropped). Once connected, nothing needs the
//!   file: even a killed engine leaves none.
//! * The worker process is held by a guard that kills and reaps it when dropped: the link's
//!   task ending on an error, aborted by [`crate::Engine::shutdown_on`] after its grace period,
//!   or dropped with its runtime. On a normal stop the engine closes the link, the worker
//!   answers with its figures and exits; the engine waits [`EXIT_TIMEOUT`] for that, then kills.
//! * The worker dies with its engine: at start it asks the kernel (Linux,
//!   `PR_SET_PDEATHSIG`) for SIGKILL when its parent dies — which the kernel takes to be the
//!   parent *thread* that started it, so start workers from a thread that lives as long as
//!   the engine (a runtime's own threads do; `spawn_blocking`'s do not). If the engine died
//!   before that, connecting fails and the worker exits. And a worker whose link closes
//!   finishes the step it is on and exits within [`WIND_DOWN`], even if its engine lives on.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::process::{Child, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, mpsc};

use crate::RunError;
use crate::rank::{RankDelta, RankReport, RankSetup, RankStats, StepMsg};
use crate::transfer::TransferEngine;
use crate::transport::wire::{Down, Up, WireError, read_frame, write_frame};
use crate::transport::{BoxFuture, RankConn, Transport};

/// Ranks as `kvrelay worker` processes, over Unix sockets.
#[derive(Debug, Default)]
pub struct Processes {
    /// The executable to start (default: `$KVRELAY_WORKER_EXE`, else this one).
    pub exe: Option<PathBuf>,
}

impl Transport for Processes {
    fn connect(
        &self,
        setup: RankSetup,
        _wake: Arc<Notify>,
        reports: mpsc::Sender<RankReport>,
    ) -> BoxFuture<'_, Result<RankConn, RunError>> {
        Box::pin(async move {
            let link = spawn_worker(&setup, self.exe.as_deref()).await?;
            let (steps, rx) = mpsc::channel::<StepMsg>(1);
            let task = tokio::spawn(link.run(rx, reports));
            Ok(RankConn { steps, task })
        })
    }
}

/// How long a started worker has to connect and say hello.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the engine waits for a worker's reason to stop once sending to it failed.
const LAST_WORD_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the engine waits for a worker to exit once it sent its figures, before it kills it.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a worker whose link closed has to finish its step and send its figures before it
/// exits without them.
pub const WIND_DOWN: Duration = Duration::from_millis(500);

/// The engine's end of one worker process.
#[derive(Debug)]
pub(crate) struct WorkerLink {
    rank: u32,
    process: WorkerProcess,
    stream: UnixStream,
}

/// A directory holding one worker's socket, removed with everything in it when dropped.
#[derive(Debug)]
struct SocketDir(PathBuf);

impl SocketDir {
    /// A fresh directory `$TMPDIR/kvrelay-PID-N`, readable by this user only.
    fn create() -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        // One directory per worker started: two engines of one process (tests running side by
        // side, an embedder with two) must not take each other's socket.
        static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvrelay-{}-{n}", std::process::id()));
        let mut builder = std::fs::DirBuilder::new();
        builder.mode(0o700);
        if let Err(e) = builder.create(&path) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(e);
            }
            // Left by an engine of this pid that was killed while a worker connected.
            std::fs::remove_dir_all(&path)?;
            builder.create(&path)?;
        }
        Ok(Self(path))
    }

    fn socket(&self, rank: u32) -> PathBuf {
        self.0.join(format!("rank-{rank}.sock"))
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A worker process, killed and reaped when dropped unless it exited.
#[derive(Debug)]
struct WorkerProcess(Child);

impl WorkerProcess {
    /// Waits up to `timeout` for the process to exit by itself (polling: a blocking wait
    /// could not be cancelled, nor bounded); the drop kills it if it did not.
    async fn exit_within(mut self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while matches!(self.0.try_wait(), Ok(None)) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // After `try_wait` saw it exit, both are no-ops (std keeps its status): no other
        // process can be hit through a reused pid.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn worker_exe(configured: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = configured {
        return Ok(p.to_path_buf());
    }
    match std::env::var_os("KVRELAY_WORKER_EXE") {
        Some(p) => Ok(PathBuf::from(p)),
        None => std::env::current_exe().map_err(|e| e.to_string()),
    }
}

/// Starts the worker process of `setup.rank` and hands it its setup. Cancel-safe: dropped
/// midway, it kills the process and removes the socket.
pub(crate) async fn spawn_worker(
    setup: &RankSetup,
    exe: Option<&Path>,
) -> Result<WorkerLink, RunError> {
    let rank = setup.rank;
    let fail = |why: String| RunError::Worker { rank, why };
    let dir = SocketDir::create().map_err(|e| fail(format!("socket directory: {e}")))?;
    let path = dir.socket(rank);
    let listener =
        UnixListener::bind(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let exe = worker_exe(exe).map_err(fail)?;
    let child = std::process::Command::new(&exe)
        .arg("worker")
        .arg("--socket")
        .arg(&path)
        .arg("--rank")
        .arg(rank.to_string())
        .stdin(Stdio::null())
        // A process group of its own: a terminal's Ctrl-C reaches the engine alone, which
        // then stops its workers in order (they would otherwise die mid-step, and the run
        // stop on a lost rank instead of on the interrupt).
        .process_group(0)
        .spawn()
        .map_err(|e| fail(format!("cannot start {}: {e}", exe.display())))?;
    let process = WorkerProcess(child);
    let mut stream = match tokio::time::timeout(CONNECT_TIMEOUT, handshake(&listener)).await {
        Ok(Ok((stream, Up::Hello { rank: r }))) if r == rank => stream,
        Ok(Ok((_, hello))) => {
            return Err(fail(format!(
                "expected hello from rank {rank}, got {hello:?}"
            )));
        }
        Ok(Err(e)) => return Err(fail(format!("handshake: {e}"))),
        Err(_) => return Err(fail(format!("did not connect within {CONNECT_TIMEOUT:?}"))),
    };
    // Connected: the socket file has served its purpose.
    drop(listener);
    drop(dir);
    write_frame(&mut stream, &Down::Setup(setup.clone())).await?;
    Ok(WorkerLink {
        rank,
        process,
        stream,
    })
}

/// Accepts the worker's connection and reads its hello.
async fn handshake(listener: &UnixListener) -> Result<(UnixStream, Up), WireError> {
    let (mut stream, _) = listener.accept().await.map_err(WireError::Io)?;
    let hello: Up = read_frame(&mut stream).await?;
    Ok((stream, hello))
}

/// Reads frames into a channel (reading is not cancel-safe, so it has a task of its own).
fn reader<T: serde::de::DeserializeOwned + Send + 'static>(
    mut rd: OwnedReadHalf,
) -> mpsc::Receiver<Result<T, WireError>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let f = read_frame::<_, T>(&mut rd).await;
            let last = f.is_err();
            if tx.send(f).await.is_err() || last {
                return;
            }
        }
    });
    rx
}

impl WorkerLink {
    /// Forwards steps to the worker and its outputs to the engine until the engine hangs up;
    /// returns the worker's figures. Dropped (the task aborted), it kills the worker.
    pub(crate) async fn run(
        self,
        mut steps: mpsc::Receiver<StepMsg>,
        reports: mpsc::Sender<RankReport>,
    ) -> RankStats {
        let WorkerLink {
            rank,
            process,
            stream,
        } = self;
        let (rd, mut wr): (OwnedReadHalf, OwnedWriteHalf) = stream.into_split();
        let mut frames = reader::<Up>(rd);
        let mut current = None;
        let stats = loop {
            tokio::select! {
                m = steps.recv() => match m {
                    Some(m) => {
                        current = Some(m.step.output.step);
                        if let Err(report) = send_step(rank, &m, &mut wr, &mut frames).await {
                            let _ = reports.send(report).await;
                            break None;
                        }
                    }
                    None => {
                        // The engine is done: close our side, the worker answers with its
                        // figures.
                        drop(wr);
                        break drain_stats(&mut frames).await;
                    }
                },
                f = frames.recv() => {
                    let report = report_of(rank, current, f);
                    if report.output.is_ok() {
                        current = None;
                    }
                    let stop = report.output.is_err();
                    if reports.send(report).await.is_err() || stop {
                        break None;
                    }
                }
            }
        };
        match stats {
            Some(s) => {
                process.exit_within(EXIT_TIMEOUT).await;
                s
            }
            // Dropping the process kills it.
            None => RankStats::default(),
        }
    }
}

/// Sends one step to the worker; on failure, the report to make: the worker's own reason to
/// stop if it sent one before it closed the connection, else the broken pipe.
async fn send_step(
    rank: u32,
    m: &StepMsg,
    wr: &mut OwnedWriteHalf,
    frames: &mut mpsc::Receiver<Result<Up, WireError>>,
) -> Result<(), RankReport> {
    let frame = Down::Step {
        step: (*m.step).clone(),
        tokens: (*m.tokens).clone(),
        forget: (*m.forget).clone(),
        promoted: (*m.promoted).clone(),
    };
    let Err(e) = write_frame(wr, &frame).await else {
        return Ok(());
    };
    let step = m.step.output.step;
    Err(match last_word(frames).await {
        Some((step, message)) => RankReport {
            rank,
            step,
            output: Err(RunError::Remote { rank, message }),
            delta: RankDelta::default(),
        },
        None => failed(
            rank,
            Some(step),
            RunError::Worker {
                rank,
                why: format!("sending a step: {e}"),
            },
        ),
    })
}

/// The report a frame from the worker (or the end of its frames) makes.
fn report_of(
    rank: u32,
    current: Option<kvrelay_core::StepId>,
    f: Option<Result<Up, WireError>>,
) -> RankReport {
    match f {
        Some(Ok(Up::Output {
            step,
            output,
            delta,
        })) => RankReport {
            rank,
            step,
            output: Ok(output),
            delta: *delta,
        },
        Some(Ok(Up::Failed { step, message })) => RankReport {
            rank,
            step,
            output: Err(RunError::Remote { rank, message }),
            delta: RankDelta::default(),
        },
        Some(Ok(other)) => failed(
            rank,
            current,
            RunError::Worker {
                rank,
                why: format!("unexpected frame {other:?}"),
            },
        ),
        Some(Err(e)) => failed(
            rank,
            current,
            RunError::Worker {
                rank,
                why: format!("connection: {e}"),
            },
        ),
        None => failed(rank, current, RunError::RankGone { rank }),
    }
}

fn failed(rank: u32, step: Option<kvrelay_core::StepId>, e: RunError) -> RankReport {
    RankReport {
        rank,
        step: step.unwrap_or(kvrelay_core::StepId(u64::MAX)),
        output: Err(e),
        delta: RankDelta::default(),
    }
}

/// The reason a worker sent for stopping (`Up::Failed`), if one comes before its connection
/// ends; waits at most [`LAST_WORD_TIMEOUT`] (a worker whose socket broke is gone or going).
async fn last_word(
    frames: &mut mpsc::Receiver<Result<Up, WireError>>,
) -> Option<(kvrelay_core::StepId, String)> {
    tokio::time::timeout(LAST_WORD_TIMEOUT, async {
        while let Some(Ok(f)) = frames.recv().await {
            if let Up::Failed { step, message } = f {
                return Some((step, message));
            }
        }
        None
    })
    .await
    .ok()
    .flatten()
}

async fn drain_stats(frames: &mut mpsc::Receiver<Result<Up, WireError>>) -> Option<RankStats> {
    while let Some(f) = frames.recv().await {
        if let Ok(Up::Stats(s)) = f {
            return Some(s);
        }
        if f.is_err() {
            return None;
        }
    }
    None
}

/// `kvrelay worker --socket PATH --rank R`: one rank as a process of its own, started by
/// `kvrelay run --workers process`. Exits 0 when the engine closed the connection after the
/// last step, 1 on any error (printed on stderr); dies with its engine (see the module docs).
pub fn worker_main(socket: &Path, rank: u32) -> ExitCode {
    worker_main_with(socket, rank, std::convert::identity)
}

/// [`worker_main`] with the backend's transfer engine passed through `wrap` (the transfer-engine
/// seam, as [`RankSetup::build_with`]): a worker binary of a test or a simulation.
pub fn worker_main_with(socket: &Path, rank: u32, wrap: EngineWrap) -> ExitCode {
    if let Err(e) = die_with_parent() {
        eprintln!("kvrelay worker {rank}: parent-death signal: {e}");
        return ExitCode::from(1);
    }
    // One thread for the link, the frame reader and the rank task: a step's frames then hop
    // between tasks, not threads (copies run on the rank's copy thread).
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvrelay worker {rank}: tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(worker(socket, rank, wrap)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvrelay worker {rank}: {e}");
            ExitCode::from(1)
        }
    }
}

/// Asks the kernel to SIGKILL this process when the thread that started it ends (Linux).
/// Called before connecting: an engine that died before this call is not there to connect to.
#[cfg(target_os = "linux")]
pub(crate) fn die_with_parent() -> Result<(), String> {
    nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(|e| e.to_string())
}

/// Elsewhere a worker notices its engine's death through its link alone.
#[cfg(not(target_os = "linux"))]
pub(crate) fn die_with_parent() -> Result<(), String> {
    Ok(())
}

/// What a worker does to its backend's transfer engine before its rank uses it.
pub type EngineWrap = fn(Box<dyn TransferEngine>) -> Box<dyn TransferEngine>;

async fn worker(socket: &Path, rank: u32, wrap: EngineWrap) -> Result<(), RunError> {
    let Linked {
        mut wr,
        mut frames,
        setup,
    } = connect(socket, rank).await?;
    let task = match setup.build_with(Arc::new(Notify::new()), wrap) {
        Ok(task) => task,
        Err(e) => {
            let step = kvrelay_core::StepId(u64::MAX);
            let message = e.to_string();
            write_frame(&mut wr, &Up::Failed { step, message }).await?;
            return Err(e);
        }
    };
    let (step_tx, step_rx) = mpsc::channel(1);
    let (rep_tx, rep_rx) = mpsc::channel::<RankReport>(1);
    let handle = tokio::spawn(task.run(step_rx, rep_tx));
    let error = match serve(rank, &mut wr, &mut frames, step_tx, rep_rx).await {
        Served::Done(error) => error,
        Served::Abandoned(e) => {
            handle.abort();
            return Err(e);
        }
    };
    let stats = handle.await.unwrap_or_default();
    write_frame(&mut wr, &Up::Stats(stats)).await?;
    error.map_or(Ok(()), Err)
}

/// A worker's end of its link, set up.
#[derive(Debug)]
struct Linked {
    wr: OwnedWriteHalf,
    frames: mpsc::Receiver<Result<Down, WireError>>,
    setup: RankSetup,
}

/// Connects to the engine, says hello and reads the setup of `rank`.
async fn connect(socket: &Path, rank: u32) -> Result<Linked, RunError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| RunError::Worker {
            rank,
            why: format!("{}: {e}", socket.display()),
        })?;
    let (rd, mut wr) = stream.into_split();
    write_frame(&mut wr, &Up::Hello { rank }).await?;
    let mut frames = reader::<Down>(rd);
    match frames.recv().await {
        Some(Ok(Down::Setup(setup))) if setup.rank == rank => Ok(Linked { wr, frames, setup }),
        Some(Ok(other)) => Err(RunError::Worker {
            rank,
            why: format!("expected the setup of rank {rank}, got {other:?}"),
        }),
        Some(Err(e)) => Err(e.into()),
        None => Err(RunError::RankGone { rank }),
    }
}

/// How [`serve`] ended.
#[derive(Debug)]
enum Served {
    /// The rank task ended (after the link closed, or on its own error); the link's error, if
    /// one closed it.
    Done(Option<RunError>),
    /// The rank task is left running: a report could not be sent, or the link closed and it
    /// was still busy [`WIND_DOWN`] later.
    Abandoned(RunError),
}

/// Feeds the engine's steps to the rank task and its reports back until the rank task ends:
/// when the link closes, the rank finishes the step it is on, within [`WIND_DOWN`].
async fn serve(
    rank: u32,
    wr: &mut OwnedWriteHalf,
    frames: &mut mpsc::Receiver<Result<Down, WireError>>,
    step_tx: mpsc::Sender<StepMsg>,
    mut rep_rx: mpsc::Receiver<RankReport>,
) -> Served {
    let mut step_tx = Some(step_tx);
    let mut error = None;
    // Armed when the link closes (or fails).
    let mut wind_down = pin!(tokio::time::sleep(Duration::MAX));
    loop {
        tokio::select! {
            f = frames.recv(), if step_tx.is_some() => {
                match f {
                    Some(Ok(Down::Step { step, tokens, forget, promoted })) => {
                        let m = StepMsg {
                            step: Arc::new(step),
                            tokens: Arc::new(tokens),
                            forget: Arc::new(forget),
                            promoted: Arc::new(promoted),
                        };
                        if let Some(tx) = &step_tx && tx.send(m).await.is_err() {
                            step_tx = None;
                        }
                    }
                    Some(Ok(Down::Setup(_))) => {
                        error = Some(RunError::Worker { rank, why: "a second setup".into() });
                        step_tx = None;
                    }
                    Some(Err(WireError::Closed)) | None => step_tx = None,
                    Some(Err(e)) => {
                        error = Some(e.into());
                        step_tx = None;
                    }
                }
                if step_tx.is_none() {
                    wind_down.as_mut().reset(tokio::time::Instant::now() + WIND_DOWN);
                }
            },
            r = rep_rx.recv() => match r {
                Some(rep) => {
                    let frame = match rep.output {
                        Ok(output) => Up::Output { step: rep.step, output, delta: Box::new(rep.delta) },
                        Err(e) => Up::Failed { step: rep.step, message: e.to_string() },
                    };
                    if let Err(e) = write_frame(wr, &frame).await {
                        return Served::Abandoned(e.into());
                    }
                }
                None => return Served::Done(error),
            },
            () = &mut wind_down => return Served::Abandoned(RunError::Worker {
                rank,
                why: format!("the rank was still busy {WIND_DOWN:?} after its link closed"),
            }),
        }
    }
}
