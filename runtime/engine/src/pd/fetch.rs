//! [`RemoteEngine`]: a decode rank's transfer engine. Its loads read held blocks from the
//! prefill engine's KV server ([`super::KvServer`]) and write them into the rank's arena.
//!
//! One task per rank runs the loads in the order started, over one connection (opened on
//! first use, reopened after a failure). Every read, connecting included, has a deadline
//! ([`super::Source::deadline_ms`]): a load whose read fails, passes its deadline, is answered
//! `Gone` or `Refused`, or brings back fewer bytes than its blocks need completes as failed
//! (`CopyDone::failed`), and its blocks are not written. After a deadline the connection is
//! dropped, so that a late answer is never taken for the next read's.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvrelay_core::pd::remote_slot_parts;
use kvrelay_core::{CopyRun, KvLayout, PlanError, RequestId, Transfer, TransferDirection};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};

use super::{KvRead, KvReply, READ_BLOCKS, Source};
use crate::transfer::host::HostArena;
use crate::transfer::{
    COPY_QUEUE_BOUND, CopyDone, CopyJob, RemoteRead, TransferEngine, TransferError,
};
use crate::transport::wire::{read_frame, write_frame};

/// See the module docs.
#[derive(Debug)]
pub struct RemoteEngine {
    jobs: mpsc::Sender<CopyJob>,
}

/// Why a read failed (logged; the load fails either way).
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("{0}")]
    Io(String),
    #[error("deadline of {0:?} passed")]
    Deadline(Duration),
    #[error("the prefill engine no longer holds {0:?}")]
    Gone(kvrelay_core::RequestId),
    #[error("refused: {0}")]
    Refused(String),
    #[error("{got} bytes for {want}")]
    Short { got: usize, want: usize },
    #[error("a copy to bytes {0:?} of an arena of {1}")]
    OutOfArena(core::ops::Range<usize>, usize),
    #[error("a store job: a decode rank only loads")]
    NotALoad,
}

impl RemoteEngine {
    /// The engine of rank `rank`, writing into `arena`; completions go to `done`, and `wake` is
    /// notified after each.
    pub fn spawn(
        rank: u32,
        arena: &HostArena,
        source: Source,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
    ) -> Self {
        let (jobs, rx) = mpsc::channel(COPY_QUEUE_BOUND);
        let reader = Reader {
            rank,
            source,
            arena: arena.shared(),
            conn: None,
        };
        tokio::spawn(reader.run(rx, done, wake));
        Self { jobs }
    }
}

impl TransferEngine for RemoteEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => TransferError::QueueFull,
            mpsc::error::TrySendError::Closed(_) => TransferError::Stopped,
        })
    }
}

/// The task behind a [`RemoteEngine`].
struct Reader {
    rank: u32,
    source: Source,
    arena: Arc<RwLock<Vec<u8>>>,
    conn: Option<TcpStream>,
}

impl Reader {
    async fn run(
        mut self,
        mut jobs: mpsc::Receiver<CopyJob>,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
    ) {
        while let Some(job) = jobs.recv().await {
            let t = Instant::now();
            let result = self.load(&job).await;
            if let Err(e) = &result {
                tracing::debug!(rank = self.rank, job = job.job.0, error = %e, "P/D load failed");
            }
            let d = CopyDone {
                job: job.job,
                direction: job.direction,
                bytes: result.as_ref().map_or(0, |b| *b),
                copies: job.runs.len() as u64,
                elapsed: t.elapsed(),
                result: Ok(()),
                failed: result.is_err(),
            };
            if done.send(d).await.is_err() {
                return;
            }
            wake.notify_one();
        }
    }

    /// Reads the job's blocks and writes them into the arena; the bytes moved.
    async fn load(&mut self, job: &CopyJob) -> Result<u64, ReadError> {
        let read = match (&job.remote, job.direction) {
            (Some(r), TransferDirection::Load) => r,
            _ => return Err(ReadError::NotALoad),
        };
        let deadline = Duration::from_millis(self.source.deadline_ms);
        let bytes = match tokio::time::timeout(deadline, self.read_all(read)).await {
            Ok(r) => r,
            Err(_) => Err(ReadError::Deadline(deadline)),
        };
        let bytes = bytes.inspect_err(|_| self.conn = None)?;
        write_runs(&self.arena, &job.runs, &bytes)?;
        Ok(bytes.len() as u64)
    }

    /// Every block of `read`, in pieces of at most [`READ_BLOCKS`].
    async fn read_all(&mut self, read: &RemoteRead) -> Result<Vec<u8>, ReadError> {
        let io = |e: crate::transport::wire::WireError| ReadError::Io(e.to_string());
        if self.conn.is_none() {
            let c = TcpStream::connect(&self.source.addr)
                .await
                .map_err(|e| ReadError::Io(format!("connect {}: {e}", self.source.addr)))?;
            let _ = c.set_nodelay(true);
            self.conn = Some(c);
        }
        let conn = self.conn.as_mut().expect("just connected");
        let mut out = Vec::new();
        for piece in read.blocks.chunks(READ_BLOCKS) {
            let ask = KvRead {
                rank: self.rank,
                request: read.request,
                blocks: piece.to_vec(),
            };
            write_frame(conn, &ask).await.map_err(io)?;
            match read_frame::<_, KvReply>(conn).await.map_err(io)? {
                KvReply::Blocks(b) => out.extend_from_slice(&b),
                KvReply::Gone(r) => return Err(ReadError::Gone(r)),
                KvReply::Refused(why) => return Err(ReadError::Refused(why)),
            }
        }
        Ok(out)
    }
}

/// Copies `bytes` into the arena along `runs` (`host`: the offset in `bytes`), after checking
/// that every run lies within both.
fn write_runs(arena: &RwLock<Vec<u8>>, runs: &[CopyRun], bytes: &[u8]) -> Result<(), ReadError> {
    let want = runs
        .iter()
        .map(|r| (r.host + r.len) as usize)
        .max()
        .unwrap_or(0);
    if bytes.len() != want {
        return Err(ReadError::Short {
            got: bytes.len(),
            want,
        });
    }
    let mut a = arena.write().unwrap_or_else(|p| p.into_inner());
    for r in runs {
        let (g, h, n) = (r.gpu as usize, r.host as usize, r.len as usize);
        let len = a.len();
        let Some(dst) = a.get_mut(g..g + n) else {
            return Err(ReadError::OutOfArena(g..g + n, len));
        };
        dst.copy_from_slice(&bytes[h..h + n]);
    }
    Ok(())
}

/// A P/D load's copies: every block's layers, in the order the prefill engine's KV server
/// sends them (per block, its group's layers in order), into the rank's arena; and what to
/// read (each block's index from its [`remote_slot`](kvrelay_core::pd::remote_slot), and its
/// group).
pub(crate) fn plan(t: &Transfer, gpu: &KvLayout) -> Result<(Vec<CopyRun>, RemoteRead), PlanError> {
    let job = t.job.0;
    let n = t.gpu_blocks.len();
    if t.groups.len() != n || t.external.len() != n {
        return Err(PlanError::Shape {
            job,
            blocks: n,
            groups: t.groups.len(),
            external: t.external.len(),
        });
    }
    let len = gpu.block_bytes();
    let (mut runs, mut blocks, mut at) = (Vec::new(), Vec::with_capacity(n), 0u64);
    let request = t
        .external
        .first()
        .and_then(|&s| remote_slot_parts(s))
        .map(|p| p.0);
    for ((&block, &slot), &group) in t.gpu_blocks.iter().zip(&t.external).zip(&t.groups) {
        let out_of_range = PlanError::OutOfRange { job, block, slot };
        let Some((_, index)) = remote_slot_parts(slot).filter(|p| Some(p.0) == request) else {
            return Err(out_of_range);
        };
        if gpu.layers_of(group).next().is_none() {
            return Err(PlanError::UnknownGroup { job, group });
        }
        for layer in gpu.layers_of(group) {
            let g = gpu.offset(layer, block.0).ok_or(out_of_range.clone())?;
            runs.push(CopyRun {
                gpu: g,
                host: at,
                len,
            });
            at += len;
        }
        blocks.push((index, group));
    }
    let read = RemoteRead {
        request: request.unwrap_or(RequestId(0)),
        blocks,
    };
    Ok((runs, read))
}

#[cfg(test)]
mod tests {
    use kvrelay_core::pd::remote_slot;
    use kvrelay_core::{BlockId, JobId, LayoutOrder};

    use super::*;

    fn transfer(slots: Vec<u64>) -> Transfer {
        Transfer {
            job: JobId(1),
            direction: TransferDirection::Load,
            request: RequestId(9),
            gpu_blocks: vec![BlockId(3), BlockId(1)],
            groups: vec![0, 0],
            external: slots,
        }
    }

    // Protects the decode side's plan: one held request's blocks, read in the server's order
    // (per block, its layers), each landing on its own GPU block; a host slot, or blocks of two
    // requests in one load, are plan errors; an answer of the wrong length writes nothing.
    #[test]
    fn a_load_reads_one_held_request_in_the_servers_order() {
        let gpu = KvLayout::new(vec![0, 0], 4, 8, LayoutOrder::LayerMajor).unwrap();
        let t = transfer(vec![
            remote_slot(RequestId(5), 0),
            remote_slot(RequestId(5), 4),
        ]);
        let (runs, read) = plan(&t, &gpu).unwrap();
        assert_eq!(read.request, RequestId(5));
        assert_eq!(read.blocks, vec![(0, 0), (4, 0)]);
        let at = |layer, block| gpu.offset(layer, block).unwrap();
        let want = [(at(0, 3), 0), (at(1, 3), 8), (at(0, 1), 16), (at(1, 1), 24)];
        let got: Vec<(u64, u64)> = runs.iter().map(|r| (r.gpu, r.host)).collect();
        assert_eq!(got, want);
        assert!(plan(&transfer(vec![remote_slot(RequestId(5), 0), 2]), &gpu).is_err());
        let two = vec![remote_slot(RequestId(5), 0), remote_slot(RequestId(6), 1)];
        assert!(plan(&transfer(two), &gpu).is_err());
        let arena = RwLock::new(vec![0u8; gpu.total_bytes() as usize]);
        assert!(write_runs(&arena, &runs, &[1u8; 31]).is_err());
        assert!(arena.read().unwrap().iter().all(|&b| b == 0));
        write_runs(&arena, &runs, &[1u8; 32]).unwrap();
        assert_eq!(
            arena.read().unwrap().iter().filter(|&&b| b == 1).count(),
            32
        );
    }
}
