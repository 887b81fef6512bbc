//! A P/D engine as a process of its own: the router's end ([`EngineProcess`], a [`PdLink`])
//! and the engine's ([`engine_main`], `kvrelay pd-engine`).
//!
//! The router starts `kvrelay pd-engine` (`$KVRELAY_WORKER_EXE`, else the running executable)
//! and speaks length-delimited postcard frames ([`crate::transport::wire`]) over its stdin
//! and stdout: the engine's configuration first, then one tick at a time. Every answer has a
//! deadline ([`ANSWER_TIMEOUT`]); a frame that does not decode, a closed pipe, an answer out of
//! turn or late: each is a typed error ([`RunError::EngineProcess`]), and the process is
//! killed when its link is dropped. The engine process dies with the router (Linux,
//! `PR_SET_PDEATHSIG`) and ends when its stdin closes.

use std::path::Path;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::route::{EngineSummary, PdLink, Tick, Ticked};
use crate::transport::wire::{WireError, read_frame, write_frame};
use crate::{Engine, RunConfig, RunError};

/// How long the router waits for an engine process's answer: its start, one tick (one engine
/// step, a 128 k-token prefill chunk included), or its summary.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// Router → engine process.
#[derive(Debug, Serialize, Deserialize)]
enum Down {
    /// The engine's configuration (JSON: [`RunConfig`] as a config file has it) and the
    /// longest request it must admit.
    Start {
        config: String,
        max_model_len: u32,
    },
    Tick(Tick),
    Finish,
}

/// Engine process → router.
#[derive(Debug, Serialize, Deserialize)]
enum Up {
    /// Started; a prefill engine's KV server address.
    Ready {
        kv_addr: Option<String>,
    },
    Ticked(Ticked),
    Summary(Box<EngineSummary>),
    /// The engine stopped with this error.
    Failed(String),
}

/// A running engine process (see the module docs).
#[derive(Debug)]
pub struct EngineProcess {
    name: String,
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl EngineProcess {
    /// Starts `exe pd-engine` (`None`: `$KVRELAY_WORKER_EXE`, else this executable) as the
    /// engine `name` of `config`; returns it with its KV server's address (a prefill engine's).
    pub async fn spawn(
        name: &str,
        exe: Option<&Path>,
        config: &RunConfig,
        max_model_len: u32,
    ) -> Result<(Self, Option<String>), RunError> {
        let fail = |why: String| RunError::EngineProcess {
            engine: name.to_owned(),
            why,
        };
        let exe = crate::transport::process::worker_exe(exe).map_err(fail)?;
        let mut child = Command::new(&exe)
            .arg("pd-engine")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("cannot start {}: {e}", exe.display())))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(fail("no pipes".into()));
        };
        let mut p = Self {
            name: name.to_owned(),
            child,
            stdin,
            stdout,
        };
        let config = serde_json::to_string(config).map_err(|e| fail(e.to_string()))?;
        match p
            .ask(&Down::Start {
                config,
                max_model_len,
            })
            .await?
        {
            Up::Ready { kv_addr } => Ok((p, kv_addr)),
            other => Err(p.unexpected(&other)),
        }
    }

    /// Kills the process now (a test's fault: the engine dies mid-run).
    pub fn kill(&mut self) {
        let _ = self.child.start_kill();
    }

    /// Sends `msg` and waits for the answer, within [`ANSWER_TIMEOUT`].
    async fn ask(&mut self, msg: &Down) -> Result<Up, RunError> {
        let fail = |why: String| RunError::EngineProcess {
            engine: self.name.clone(),
            why,
        };
        write_frame(&mut self.stdin, msg)
            .await
            .map_err(|e| fail(format!("send: {e}")))?;
        match tokio::time::timeout(ANSWER_TIMEOUT, read_frame(&mut self.stdout)).await {
            Ok(Ok(Up::Failed(why))) => Err(fail(why)),
            Ok(Ok(up)) => Ok(up),
            Ok(Err(e)) => Err(fail(format!("answer: {e}"))),
            Err(_) => Err(fail(format!("no answer within {ANSWER_TIMEOUT:?}"))),
        }
    }

    fn unexpected(&self, up: &Up) -> RunError {
        RunError::EngineProcess {
            engine: self.name.clone(),
            why: format!("answer out of turn: {up:?}"),
        }
    }
}

impl PdLink for EngineProcess {
    async fn tick(&mut self, tick: Tick) -> Result<Ticked, RunError> {
        match self.ask(&Down::Tick(tick)).await? {
            Up::Ticked(t) => Ok(t),
            other => Err(self.unexpected(&other)),
        }
    }

    async fn finish(mut self) -> Result<EngineSummary, RunError> {
        let summary = match self.ask(&Down::Finish).await? {
            Up::Summary(s) => *s,
            other => return Err(self.unexpected(&other)),
        };
        drop(self.stdin);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        Ok(summary)
    }
}

/// `kvrelay pd-engine`: an engine driven over stdin and stdout (see the module docs).
pub fn engine_main() -> ExitCode {
    if let Err(e) = crate::transport::process::die_with_parent() {
        eprintln!("kvrelay pd-engine: parent-death signal: {e}");
        return ExitCode::from(1);
    }
    let rt = match crate::run::runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvrelay pd-engine: {e}");
            return ExitCode::from(1);
        }
    };
    let (mut input, mut output) = (tokio::io::stdin(), tokio::io::stdout());
    match rt.block_on(serve(&mut input, &mut output)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvrelay pd-engine: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs the engine the first frame configures, one tick per frame, until `Finish` (or the
/// router hangs up); an engine error is answered `Failed` before it ends the process.
async fn serve<R, W>(input: &mut R, output: &mut W) -> Result<(), WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Down::Start {
        config,
        max_model_len,
    } = read_frame(input).await?
    else {
        return write_frame(
            output,
            &Up::Failed("expected the configuration first".into()),
        )
        .await;
    };
    let mut engine = match start(&config, max_model_len).await {
        Ok(e) => e,
        Err(e) => return write_frame(output, &Up::Failed(e.to_string())).await,
    };
    let kv_addr = engine.kv_server().map(|s| s.addr().to_string());
    write_frame(output, &Up::Ready { kv_addr }).await?;
    loop {
        let down = match read_frame(input).await {
            Err(WireError::Closed) => return Ok(()),
            other => other?,
        };
        let up = match down {
            Down::Tick(t) => match engine.tick(t).await {
                Ok(t) => Up::Ticked(t),
                Err(e) => return write_frame(output, &Up::Failed(e.to_string())).await,
            },
            Down::Finish => {
                let up = match engine.finish().await {
                    Ok(s) => Up::Summary(Box::new(s)),
                    Err(e) => Up::Failed(e.to_string()),
                };
                return write_frame(output, &up).await;
            }
            Down::Start { .. } => Up::Failed("started twice".into()),
        };
        write_frame(output, &up).await?;
    }
}

async fn start(config: &str, max_model_len: u32) -> Result<Engine, RunError> {
    let c: RunConfig =
        serde_json::from_str(config).map_err(|e| RunError::Config(format!("{e}")))?;
    Engine::start(&c, max_model_len).await
}
