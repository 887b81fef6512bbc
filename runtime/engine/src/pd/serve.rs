//! [`KvServer`]: a prefill engine's KV server. One task per connection answers each
//! [`KvRead`] from the arena of the rank it names, for blocks of a request the engine's P/D
//! connector still holds ([`HeldTable`]); anything else is a typed answer, never a read.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use kvrelay_core::{BlockId, KvLayout, RequestId};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::{KvRead, KvReply, READ_BLOCKS, held_block};
use crate::RunError;
use crate::transfer::host::HostArena;
use crate::transport::wire::{WireError, read_frame, write_frame};

/// The requests a prefill engine holds for decode engines, with their blocks (one list per
/// KV-cache group): written by the engine after every schedule and apply, read by the server.
pub type HeldTable = Arc<RwLock<HashMap<RequestId, Vec<Vec<BlockId>>>>>;

/// What the server answered.
#[derive(Debug, Default)]
pub struct ServeCounts {
    pub reads: AtomicU64,
    pub blocks: AtomicU64,
    pub bytes: AtomicU64,
    /// Reads of a request not held (released, or past its lease).
    pub gone: AtomicU64,
    pub refused: AtomicU64,
}

/// What the server reads: the ranks' arenas and their layout, and the held requests.
#[derive(Debug)]
struct Shared {
    arenas: Vec<HostArena>,
    gpu: KvLayout,
    held: HeldTable,
    counts: ServeCounts,
}

/// A running KV server; stops when dropped.
#[derive(Debug)]
pub struct KvServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Drop for KvServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl KvServer {
    /// Listens on `listen` (`HOST:PORT`, port 0 picks one) and serves `arenas` (one per rank,
    /// of layout `gpu`) for the requests in `held`.
    pub async fn start(
        listen: &str,
        arenas: Vec<HostArena>,
        gpu: KvLayout,
        held: HeldTable,
    ) -> Result<Self, RunError> {
        let bad = |e: std::io::Error| RunError::Config(format!("P/D KV server on {listen}: {e}"));
        let listener = TcpListener::bind(listen).await.map_err(bad)?;
        let addr = listener.local_addr().map_err(bad)?;
        let shared = Arc::new(Shared {
            arenas,
            gpu,
            held,
            counts: ServeCounts::default(),
        });
        let s = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, s.clone()));
            }
        });
        Ok(Self { addr, shared, task })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What it answered so far.
    pub fn counts(&self) -> &ServeCounts {
        &self.shared.counts
    }
}

/// Answers one connection's reads until it closes or sends a frame that does not decode.
async fn serve(mut stream: TcpStream, shared: Arc<Shared>) {
    loop {
        let read: KvRead = match read_frame(&mut stream).await {
            Ok(r) => r,
            Err(WireError::Closed) => return,
            Err(e) => {
                tracing::warn!(error = %e, "P/D KV server: bad read, connection closed");
                return;
            }
        };
        let reply = answer(&shared, &read);
        let c = &shared.counts;
        c.reads.fetch_add(1, Ordering::Relaxed);
        match &reply {
            KvReply::Blocks(b) => {
                c.blocks
                    .fetch_add(read.blocks.len() as u64, Ordering::Relaxed);
                c.bytes.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
            KvReply::Gone(_) => {
                c.gone.fetch_add(1, Ordering::Relaxed);
            }
            KvReply::Refused(_) => {
                c.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        if write_frame(&mut stream, &reply).await.is_err() {
            return;
        }
    }
}

/// The reply to `read`. The held table stays read-locked while the arena is read, so the
/// engine cannot drop the request (and the scheduler then free its blocks) half-way.
fn answer(shared: &Shared, read: &KvRead) -> KvReply {
    let Some(arena) = shared.arenas.get(read.rank as usize) else {
        return KvReply::Refused(format!("no rank {}", read.rank));
    };
    if read.blocks.len() > READ_BLOCKS {
        return KvReply::Refused(format!(
            "{} blocks in one read (at most {READ_BLOCKS})",
            read.blocks.len()
        ));
    }
    let held = shared.held.read().unwrap_or_else(|p| p.into_inner());
    let Some(blocks) = held.get(&read.request) else {
        return KvReply::Gone(read.request);
    };
    let gpu = &shared.gpu;
    let len = gpu.block_bytes() as usize;
    let bytes = arena.shared();
    let bytes = bytes.read().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::new();
    for &(index, group) in &read.blocks {
        let Some(b) = held_block(blocks, index, group) else {
            return KvReply::Refused(format!(
                "{:?} holds no block {index} in group {group}",
                read.request
            ));
        };
        for layer in gpu.layers_of(group) {
            let Some(at) = gpu.offset(layer, b.0) else {
                return KvReply::Refused(format!("block {b:?} outside the arena"));
            };
            let Some(block) = bytes.get(at as usize..at as usize + len) else {
                return KvReply::Refused(format!("block {b:?} outside the arena"));
            };
            out.extend_from_slice(block);
        }
    }
    KvReply::Blocks(out)
}

/// P/D prefill: the KV server's table follows the connector's held requests. Called after
/// every schedule (which builds releases) and apply (which holds finished requests), so a
/// released request leaves the table before the scheduler can free its blocks.
pub(crate) fn sync_held(
    server: Option<&KvServer>,
    held: &HeldTable,
    s: &kvrelay_core::Scheduler<crate::connector::EngineConnector>,
) {
    let (Some(_), Some(pd)) = (server, crate::connector::pd(s.connector())) else {
        return;
    };
    let mut t = held.write().unwrap_or_else(|p| p.into_inner());
    t.retain(|r, _| pd.held_blocks(*r).is_some());
    for (r, blocks) in pd.held() {
        t.entry(r).or_insert_with(|| blocks.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_core::LayoutOrder;

    use super::*;

    /// Two ranks of a 2-layer arena of 4 blocks of 8 bytes, rank r's bytes all `r + 1`, and
    /// request 7 held with blocks [2, 3] (one group).
    fn shared() -> Shared {
        let gpu = KvLayout::new(vec![0, 0], 4, 8, LayoutOrder::LayerMajor).unwrap();
        let arenas: Vec<HostArena> = (0..2u8)
            .map(|r| {
                let a = HostArena::new(gpu.total_bytes() as usize, 4);
                a.shared().write().unwrap().fill(r + 1);
                a
            })
            .collect();
        let held = HeldTable::default();
        held.write()
            .unwrap()
            .insert(RequestId(7), vec![vec![BlockId(2), BlockId(3)]]);
        Shared {
            arenas,
            gpu,
            held,
            counts: ServeCounts::default(),
        }
    }

    fn read(rank: u32, request: u32, blocks: Vec<(u32, u32)>) -> KvRead {
        KvRead {
            rank,
            request: RequestId(request),
            blocks,
        }
    }

    // Protects the server's boundary: a read of a held request gets its rank's bytes (every
    // layer of each block); anything else — a request not held, a rank, group or block it does
    // not have, too many blocks — is a typed answer, never a read and never a panic.
    #[test]
    fn reads_outside_what_is_held_are_typed_answers_never_reads() {
        let s = shared();
        assert_eq!(
            answer(&s, &read(1, 7, vec![(1, 0), (0, 0)])),
            KvReply::Blocks(vec![2; 2 * 2 * 8])
        );
        assert_eq!(
            answer(&s, &read(0, 8, vec![(0, 0)])),
            KvReply::Gone(RequestId(8))
        );
        for bad in [
            read(2, 7, vec![(0, 0)]),
            read(0, 7, vec![(2, 0)]),
            read(0, 7, vec![(0, 1)]),
            read(0, 7, vec![(u32::MAX, u32::MAX)]),
            read(0, 7, vec![(0, 0); READ_BLOCKS + 1]),
        ] {
            assert!(matches!(answer(&s, &bad), KvReply::Refused(_)), "{bad:?}");
        }
        s.held.write().unwrap().clear();
        assert_eq!(
            answer(&s, &read(0, 7, vec![(0, 0)])),
            KvReply::Gone(RequestId(7))
        );
    }
}
