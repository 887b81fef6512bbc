//! The embedding API: an [`EngineHandle`] an inference server calls from its own tasks —
//! [`EngineHandle::submit`] a request and read its tokens as they are sampled,
//! [`EngineHandle::abort`], [`EngineHandle::reset_cache`], [`EngineHandle::reset_prefix_cache`] — while one task steps the
//! [`Engine`].
//!
//! # When to call what
//!
//! [`EngineHandle::spawn`] inside a tokio runtime starts the engine task; every call then goes
//! through one bounded command queue ([`SUBMIT_QUEUE_BOUND`]: a full queue makes callers wait,
//! which is the engine's backpressure). The engine task applies the commands that arrived
//! between two steps, steps while it has work, and sleeps on the queue when it has none. A
//! request's stream yields [`RequestEvent::Tokens`] per step that accepted tokens and ends
//! with one [`RequestEvent::Finished`] — or, if the engine stops on an error first, one
//! [`RequestEvent::Failed`] naming it; dropping the stream aborts the request.
//! [`EngineHandle::shutdown`] stops the ranks and returns the error that stopped the engine,
//! if one did.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use kvrelay_core::{FinishReason, MAX_REQUEST_ID, RequestId, Token};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::metrics::{Metrics, Server};
use crate::{Engine, RunConfig, RunError, report, run};

/// Commands waiting for the engine task, at most.
pub const SUBMIT_QUEUE_BOUND: usize = 256;

/// What a request's stream yields.
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum RequestEvent {
    /// Tokens accepted by one step.
    Tokens(Vec<Token>),
    /// The request finished; nothing follows.
    Finished(FinishReason),
    /// The engine stopped on an error before the request finished (a rank lost, a byte
    /// mismatch…): the error's message, which names the rank where there is one. Nothing
    /// follows.
    Failed(String),
}

/// A request's event stream. Bounded by construction: it holds at most one event per output
/// token plus the finish.
pub type RequestStream = mpsc::Receiver<RequestEvent>;

enum Command {
    Submit {
        prompt: Vec<Token>,
        max_tokens: u32,
        reply: oneshot::Sender<Result<(RequestId, RequestStream), RunError>>,
    },
    Abort {
        id: RequestId,
        reply: oneshot::Sender<Result<bool, RunError>>,
    },
    Reset {
        reply: oneshot::Sender<Result<Option<bool>, RunError>>,
    },
    ResetPrefix {
        reply: oneshot::Sender<Result<bool, RunError>>,
    },
}

/// A running engine, callable from any task. See the module docs.
#[derive(Debug)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    task: JoinHandle<Result<(), RunError>>,
    /// The metrics endpoint ([`RunConfig::metrics`]): served until [`EngineHandle::shutdown`].
    server: Option<Server>,
}

fn stopped() -> RunError {
    RunError::EngineStopped
}

impl EngineHandle {
    /// Starts an engine for requests of at most `max_model_len` tokens, with its ranks.
    pub async fn spawn(config: RunConfig, max_model_len: u32) -> Result<Self, RunError> {
        let served = run::serve_metrics(&config)?;
        let mut engine = Engine::start(&config, max_model_len).await?;
        let metrics = served.as_ref().map(|(m, _)| m.clone());
        if let Some(m) = &metrics {
            engine.set_metrics(m.clone());
        }
        let (commands, rx) = mpsc::channel(SUBMIT_QUEUE_BOUND);
        let task = tokio::spawn(serve(engine, rx, metrics));
        Ok(Self {
            commands,
            task,
            server: served.map(|(_, s)| s),
        })
    }

    /// Where the metrics are served (the port chosen, for port 0), if they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(Server::addr)
    }

    /// Submits a request; returns its id and its event stream.
    pub async fn submit(
        &self,
        prompt: Vec<Token>,
        max_tokens: u32,
    ) -> Result<(RequestId, RequestStream), RunError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::Submit {
                prompt,
                max_tokens,
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Aborts a request; `false` if it was not live.
    pub async fn abort(&self, id: RequestId) -> Result<bool, RunError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::Abort { id, reply })
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Resets the connector's cache.
    pub async fn reset_cache(&self) -> Result<Option<bool>, RunError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::Reset { reply })
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Resets the GPU prefix cache and the connector's (vLLM's `reset_prefix_cache(
    /// reset_connector=True)`): `false`, and the GPU cache kept, while a request holds blocks.
    /// With KV events on, the next step publishes `AllBlocksCleared`.
    pub async fn reset_prefix_cache(&self) -> Result<bool, RunError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::ResetPrefix { reply })
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Stops the engine once it has no work left; returns the error that stopped it, if any.
    /// The metrics, if served, get the ranks' figures and stop being served.
    pub async fn shutdown(self) -> Result<(), RunError> {
        drop(self.commands);
        let outcome = self.task.await.map_err(|_| stopped())?;
        drop(self.server);
        outcome
    }
}

/// The engine task.
async fn serve(
    mut engine: Engine,
    mut commands: mpsc::Receiver<Command>,
    metrics: Option<Arc<Metrics>>,
) -> Result<(), RunError> {
    let mut streams: HashMap<RequestId, mpsc::Sender<RequestEvent>> = HashMap::new();
    let mut free: Vec<RequestId> = Vec::new();
    let mut next_id: u32 = 0;
    let mut open = true;
    let outcome = 'serve: loop {
        if open && !engine.has_work() {
            match commands.recv().await {
                Some(c) => apply(&mut engine, c, &mut streams, &mut free, &mut next_id),
                None => open = false,
            }
        }
        while open {
            match commands.try_recv() {
                Ok(c) => apply(&mut engine, c, &mut streams, &mut free, &mut next_id),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        // A stream dropped by its reader aborts its request.
        let gone: Vec<RequestId> = streams
            .iter()
            .filter(|(_, s)| s.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            streams.remove(&id);
            if let Err(e) = engine.abort(id) {
                break 'serve Err(e);
            }
        }
        if !engine.has_work() {
            if open {
                continue;
            }
            break Ok(());
        }
        let step = match engine.step().await {
            Ok(s) => s,
            Err(e) => break Err(e),
        };
        for o in &step.outputs {
            let Some(s) = streams.get(&o.id) else {
                continue;
            };
            if !o.new_tokens.is_empty() {
                let _ = s.try_send(RequestEvent::Tokens(o.new_tokens.clone()));
            }
            if let Some(reason) = o.finish {
                let _ = s.try_send(RequestEvent::Finished(reason));
                streams.remove(&o.id);
            }
        }
        free.extend(step.released.iter().copied());
        if step.idle {
            engine.wait_idle().await;
        }
    };
    if let Err(e) = &outcome {
        // Every live request ends with the error that stopped the engine (its stream has room:
        // it holds at most its tokens and one final event).
        let why = e.to_string();
        for (_, s) in streams.drain() {
            let _ = s.try_send(RequestEvent::Failed(why.clone()));
        }
    }
    let (_, ranks) = engine.shutdown().await;
    if let Some(m) = &metrics {
        report::publish_ranks(m, &ranks);
    }
    outcome
}

fn apply(
    engine: &mut Engine,
    c: Command,
    streams: &mut HashMap<RequestId, mpsc::Sender<RequestEvent>>,
    free: &mut Vec<RequestId>,
    next_id: &mut u32,
) {
    match c {
        Command::Submit {
            prompt,
            max_tokens,
            reply,
        } => {
            let id = match free.pop() {
                Some(id) => id,
                None if *next_id < MAX_REQUEST_ID => {
                    *next_id += 1;
                    RequestId(*next_id - 1)
                }
                None => {
                    let _ = reply.send(Err(RunError::Config(format!(
                        "{MAX_REQUEST_ID} requests live: no request id free"
                    ))));
                    return;
                }
            };
            let (tx, rx) = mpsc::channel(max_tokens as usize + 1);
            match engine.add(id, prompt, max_tokens) {
                Ok(()) => {
                    streams.insert(id, tx);
                    let _ = reply.send(Ok((id, rx)));
                }
                Err(e) => {
                    free.push(id);
                    let _ = reply.send(Err(e));
                }
            }
        }
        Command::Abort { id, reply } => {
            let r = engine.abort(id);
            if let (Ok(true), Some(s)) = (&r, streams.remove(&id)) {
                let _ = s.try_send(RequestEvent::Finished(FinishReason::Aborted));
            }
            let _ = reply.send(r);
        }
        Command::Reset { reply } => {
            let _ = reply.send(engine.reset_cache());
        }
        Command::ResetPrefix { reply } => {
            let _ = reply.send(engine.reset_prefix_cache());
        }
    }
}
