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

use std::path::{Path, PathBuf};
use std::process::{Child, ExitCode, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, mpsc};

use crate::RunError;
use crate::rank::{RankReport, RankSetup, RankStats, StepMsg};
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

/// The engine's end of one worker process.
#[derive(Debug)]
pub(crate) struct WorkerLink {
    rank: u32,
    child: Child,
    stream: UnixStream,
    _socket: SocketFile,
}

/// Removes the socket file when the link is gone.
#[derive(Debug)]
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn worker_exe(configured: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = configured {
        return Ok(p.to_path_buf());
    }
    match std::env::var_os("KVRELAY_WORKER_EXE") {
        Some(p) => Ok(PathBuf::from(p)),
        None => std::env::current_exe().map_err(|e| e.to_string()),
    }
}

/// Starts the worker process of `setup.rank` and hands it its setup.
pub(crate) async fn spawn_worker(
    setup: &RankSetup,
    exe: Option<&Path>,
) -> Result<WorkerLink, RunError> {
    let rank = setup.rank;
    let fail = |why: String| RunError::Worker { rank, why };
    // One socket per worker started: two engines of one process (tests running side by side,
    // an embedder with two) must not take each other's socket.
    static STARTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("kvrelay-{}-{n}-{rank}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener =
        UnixListener::bind(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    let socket = SocketFile(path.clone());
    let exe = worker_exe(exe).map_err(fail)?;
    let mut child = std::process::Command::new(&exe)
        .arg("worker")
        .arg("--socket")
        .arg(&path)
        .arg("--rank")
        .arg(rank.to_string())
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("cannot start {}: {e}", exe.display())))?;
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
        let (mut stream, _) = listener.accept().await.map_err(WireError::Io)?;
        let hello: Up = read_frame(&mut stream).await?;
        Ok::<_, WireError>((stream, hello))
    })
    .await;
    let (mut stream, hello) = match connected {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            let _ = child.kill();
            return Err(fail(format!("handshake: {e}")));
        }
        Err(_) => {
            let _ = child.kill();
            return Err(fail(format!("did not connect within {CONNECT_TIMEOUT:?}")));
        }
    };
    if hello != (Up::Hello { rank }) {
        let _ = child.kill();
        return Err(fail(format!(
            "expected hello from rank {rank}, got {hello:?}"
        )));
    }
    write_frame(&mut stream, &Down::Setup(setup.clone())).await?;
    Ok(WorkerLink {
        rank,
        child,
        stream,
        _socket: socket,
    })
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
    /// returns the worker's figures.
    pub(crate) async fn run(
        self,
        mut steps: mpsc::Receiver<StepMsg>,
        reports: mpsc::Sender<RankReport>,
    ) -> RankStats {
        let WorkerLink {
            rank,
            mut child,
            stream,
            _socket,
        } = self;
        let (rd, mut wr): (OwnedReadHalf, OwnedWriteHalf) = stream.into_split();
        let mut frames = reader::<Up>(rd);
        let mut current = None;
        let stats = loop {
            tokio::select! {
                m = steps.recv() => match m {
                    Some(m) => {
                        current = Some(m.step.output.step);
                        let frame = Down::Step {
                            step: (*m.step).clone(),
                            tokens: (*m.tokens).clone(),
                            forget: (*m.forget).clone(),
                        };
                        if let Err(e) = write_frame(&mut wr, &frame).await {
                            // A worker that stopped on an error sent its reason before it closed
                            // the connection: report that, not the broken pipe it left behind.
                            let report = match last_word(&mut frames).await {
                                Some((step, message)) => RankReport {
                                    rank,
                                    step,
                                    output: Err(RunError::Remote { rank, message }),
                                },
                                None => failed(rank, current, RunError::Worker {
                                    rank,
                                    why: format!("sending a step: {e}"),
                                }),
                            };
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
                    let report = match f {
                        Some(Ok(Up::Output { step, output })) => {
                            current = None;
                            RankReport { rank, step, output: Ok(output) }
                        }
                        Some(Ok(Up::Failed { step, message })) => RankReport {
                            rank,
                            step,
                            output: Err(RunError::Remote { rank, message }),
                        },
                        Some(Ok(other)) => failed(rank, current, RunError::Worker {
                            rank,
                            why: format!("unexpected frame {other:?}"),
                        }),
                        Some(Err(e)) => failed(rank, current, RunError::Worker {
                            rank,
                            why: format!("connection: {e}"),
                        }),
                        None => failed(rank, current, RunError::RankGone { rank }),
                    };
                    let stop = report.output.is_err();
                    if reports.send(report).await.is_err() || stop {
                        break None;
                    }
                }
            }
        };
        match stats {
            Some(s) => {
                let _ = tokio::task::spawn_blocking(move || child.wait()).await;
                s
            }
            None => {
                let _ = child.kill();
                let _ = child.wait();
                RankStats::default()
            }
        }
    }
}

fn failed(rank: u32, step: Option<kvrelay_core::StepId>, e: RunError) -> RankReport {
    RankReport {
        rank,
        step: step.unwrap_or(kvrelay_core::StepId(u64::MAX)),
        output: Err(e),
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
/// last step, 1 on any error (printed on stderr).
pub fn worker_main(socket: &Path, rank: u32) -> ExitCode {
    worker_main_with(socket, rank, std::convert::identity)
}

/// [`worker_main`] with the backend's transfer engine passed through `wrap` (the transfer-engine
/// seam, as [`RankSetup::build_with`]): a worker binary of a test or a simulation.
pub fn worker_main_with(socket: &Path, rank: u32, wrap: EngineWrap) -> ExitCode {
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

/// What a worker does to its backend's transfer engine before its rank uses it.
pub type EngineWrap = fn(Box<dyn TransferEngine>) -> Box<dyn TransferEngine>;

async fn worker(socket: &Path, rank: u32, wrap: EngineWrap) -> Result<(), RunError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|e| RunError::Worker {
            rank,
            why: format!("{}: {e}", socket.display()),
        })?;
    let (rd, mut wr) = stream.into_split();
    write_frame(&mut wr, &Up::Hello { rank }).await?;
    let mut frames = reader::<Down>(rd);
    let setup = match frames.recv().await {
        Some(Ok(Down::Setup(s))) if s.rank == rank => s,
        Some(Ok(other)) => {
            return Err(RunError::Worker {
                rank,
                why: format!("expected the setup of rank {rank}, got {other:?}"),
            });
        }
        Some(Err(e)) => return Err(e.into()),
        None => return Err(RunError::RankGone { rank }),
    };
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
    let (rep_tx, mut rep_rx) = mpsc::channel::<RankReport>(1);
    let handle = tokio::spawn(task.run(step_rx, rep_tx));
    let mut step_tx = Some(step_tx);
    let mut error = None;
    loop {
        tokio::select! {
            f = frames.recv(), if step_tx.is_some() => match f {
                Some(Ok(Down::Step { step, tokens, forget })) => {
                    let m = StepMsg {
                        step: Arc::new(step),
                        tokens: Arc::new(tokens),
                        forget: Arc::new(forget),
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
            },
            r = rep_rx.recv() => match r {
                Some(rep) => {
                    let frame = match rep.output {
                        Ok(output) => Up::Output { step: rep.step, output },
                        Err(e) => Up::Failed { step: rep.step, message: e.to_string() },
                    };
                    write_frame(&mut wr, &frame).await?;
                }
                None => break,
            },
        }
    }
    let stats = handle.await.unwrap_or_default();
    write_frame(&mut wr, &Up::Stats(stats)).await?;
    match error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
