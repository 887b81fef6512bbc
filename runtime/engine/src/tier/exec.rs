//! Carrying out one step's tier work against the store and the ranks' CPU pools: existence
//! probes, cascades (CPU pool → store) and promotions (store → CPU pool), one store command per
//! chunk, all of a batch concurrently, each within the deadline. Whatever goes wrong — the store
//! unreachable, a command timing out, a value missing or refused by its header — becomes a
//! report the core understands (a probe that found nothing, a failed job); nothing panics and
//! nothing unchecked reaches a pool.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use kvrelay_core::{ChunkId, KvLayout, OffloadKey, RequestId, TierReport, TierWork};

use super::TierFigures;
use super::store::Store;
use super::value::{decode, encode_parts, shard_key};
use crate::transfer::host::HostPool;

/// The ranks' CPU pools as the tier sees them.
#[derive(Clone, Debug)]
pub struct Pools {
    /// Per rank.
    pub pools: Vec<HostPool>,
    /// Their layout (every rank's is the same).
    pub host: KvLayout,
    pub blocks_per_chunk: u32,
}

impl Pools {
    /// The value of `chunk` in `rank`'s pool under `key`: its bytes layer by layer, framed.
    fn encode(&self, rank: usize, chunk: ChunkId, key: &str) -> Vec<u8> {
        let pool = self.pools[rank].read();
        let parts: Vec<&[u8]> = self
            .spans(chunk)
            .map(|(at, len)| &pool[at..at + len])
            .collect();
        encode_parts(key, &parts)
    }

    /// Writes `payload` (layer by layer, as [`Pools::encode`] frames it) into `chunk` of
    /// `rank`'s pool.
    fn write(&self, rank: usize, chunk: ChunkId, payload: &[u8]) {
        let mut pool = self.pools[rank].write();
        let mut from = 0;
        for (at, len) in self.spans(chunk) {
            pool[at..at + len].copy_from_slice(&payload[from..from + len]);
            from += len;
        }
    }

    /// Per layer, the byte span of the chunk's blocks (consecutive in a layer-major pool).
    fn spans(&self, chunk: ChunkId) -> impl Iterator<Item = (usize, usize)> + '_ {
        let first = u64::from(chunk.0) * u64::from(self.blocks_per_chunk);
        let len = (self.host.block_bytes() * u64::from(self.blocks_per_chunk)) as usize;
        (0..self.host.layers()).map(move |l| {
            let at = self.host.offset(l, first).expect("a chunk of the pool");
            (at as usize, len)
        })
    }

    /// One rank's shard of a chunk, in bytes.
    pub fn chunk_bytes(&self) -> u64 {
        self.host.block_bytes() * u64::from(self.blocks_per_chunk) * u64::from(self.host.layers())
    }
}

/// A promoted chunk the ranks must learn the content of (it was written behind their backs).
#[derive(Clone, Copy, Debug, Eq, PartialEq)]
pub struct Promoted {
    pub chunk: ChunkId,
    pub key: OffloadKey,
    /// The request whose lookup promoted it: its tokens give the chunk's content.
    pub request: RequestId,
}

/// What a batch of work came to.
#[derive(Debug, Default)]
pub struct Done {
    /// In the order of the work (probes, then each job), for the core.
    pub reports: Vec<TierReport>,
    pub promoted: Vec<Promoted>,
    pub figures: TierFigures,
}

/// A chunk of a work item: the item's index, the chunk's index in it, its key and CPU chunk.
type Slot = (usize, usize, OffloadKey, ChunkId);

/// The outcome of one chunk's command.
#[derive(Clone, Copy)]
enum ChunkResult {
    Probe(bool),
    Stored,
    Loaded,
    Failed(Failure),
}

#[derive(Clone, Copy)]
enum Failure {
    Io,
    Timeout,
    Missing,
    Refused,
}

/// Carries out `work` (one step's) and returns what happened, in the order of `work`.
pub(super) async fn run(
    work: Vec<TierWork>,
    store: Store,
    namespace: Arc<str>,
    pools: Pools,
    timeout: Duration,
) -> Done {
    // tokio's clock: virtual under the simulation's paused runtime.
    let started = tokio::time::Instant::now();
    // One pipeline per hash-slot bucket and kind of command: every chunk of a bucket shares
    // the bucket's slot, so its commands go in one round trip.
    let mut batches: BTreeMap<(u8, u8), Vec<Slot>> = BTreeMap::new();
    let mut slots: Vec<Vec<Option<ChunkResult>>> = Vec::with_capacity(work.len());
    for (w, item) in work.iter().enumerate() {
        let chunks = chunks_of(item);
        let kind = Kind::of(item) as u8;
        for (i, (key, chunk)) in chunks.iter().enumerate() {
            batches
                .entry((bucket(*key), kind))
                .or_default()
                .push((w, i, *key, *chunk));
        }
        slots.push((0..chunks.len()).map(|_| None).collect());
    }
    let ctx = (store, namespace, pools);
    let mut done = Done::default();
    // Every pipeline is a future of this task, polled here: none runs on after the batch is
    // reported (dropped at the deadline, a pipeline's connection goes with it).
    let mut pipelines: FuturesUnordered<_> = batches
        .into_iter()
        .map(|((_, kind), batch)| {
            let ctx = &ctx;
            async move {
                let mut first_error = None;
                let results = pipeline(ctx, Kind::from(kind), &batch, &mut first_error).await;
                (batch, results, first_error)
            }
        })
        .collect();
    join_within(
        &mut pipelines,
        timeout,
        &mut slots,
        &mut done.figures.first_error,
    )
    .await;
    drop(pipelines);
    for r in slots.iter_mut().flatten().filter(|r| r.is_none()) {
        *r = Some(ChunkResult::Failed(Failure::Timeout));
    }
    for (item, results) in work.into_iter().zip(slots) {
        settle(item, results, &ctx.2, &mut done);
    }
    done.figures.batches += 1;
    done.figures
        .batch_us
        .push(started.elapsed().as_secs_f64() * 1e6);
    done
}

/// A pipeline's chunks, what each came to, and the first store error it met.
type Joined = (Vec<Slot>, Vec<ChunkResult>, Option<String>);

/// Takes each pipeline's results into `slots` as it ends, until all have or `timeout` passed:
/// one deadline for the whole batch (every command was sent at its start), one timer, not one
/// per pipeline, each of which would wake the runtime's driver to register. The chunks of the
/// pipelines still waiting then stay `None`. An answer ready when the deadline is counts (the
/// pipelines are polled first, as `tokio::time::timeout` polls its future first): under the
/// simulation's paused clock the two often fall on one instant, and an unbiased `select!`
/// would pick between them at random, so a seed would not replay.
async fn join_within(
    pipelines: &mut FuturesUnordered<impl Future<Output = Joined>>,
    timeout: Duration,
    slots: &mut [Vec<Option<ChunkResult>>],
    first_error: &mut Option<String>,
) {
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    loop {
        let joined = tokio::select! {
            biased;
            joined = pipelines.next() => joined,
            () = &mut deadline => return,
        };
        let Some((batch, results, error)) = joined else {
            return;
        };
        for ((w, i, _, _), r) in batch.into_iter().zip(results) {
            slots[w][i] = Some(r);
        }
        if first_error.is_none() {
            *first_error = error;
        }
    }
}

/// The hash-slot bucket of a chunk (the tag of its keys: see `value.rs`).
fn bucket(key: OffloadKey) -> u8 {
    (key.hash.0 & 0xff) as u8
}

#[derive(Clone, Copy)]
enum Kind {
    Probe,
    Store,
    Load,
}

impl Kind {
    fn of(w: &TierWork) -> Self {
        match w {
            TierWork::Probe { .. } => Self::Probe,
            TierWork::Store { .. } => Self::Store,
            TierWork::Load { .. } => Self::Load,
        }
    }

    fn from(k: u8) -> Self {
        match k {
            0 => Self::Probe,
            1 => Self::Store,
            _ => Self::Load,
        }
    }
}

/// The (key, chunk) pairs of a work item (a probe has no chunk).
fn chunks_of(w: &TierWork) -> Vec<(OffloadKey, ChunkId)> {
    match w {
        TierWork::Probe { keys, .. } => keys.iter().map(|(k, _)| (*k, ChunkId(0))).collect(),
        TierWork::Store { keys, chunks, .. } | TierWork::Load { keys, chunks, .. } => {
            keys.iter().copied().zip(chunks.iter().copied()).collect()
        }
    }
}

/// One bucket's commands of one kind, as one pipeline; a result per chunk, in order, and in
/// `first_error` the first store error met.
async fn pipeline(
    ctx: &(Store, Arc<str>, Pools),
    kind: Kind,
    batch: &[Slot],
    first_error: &mut Option<String>,
) -> Vec<ChunkResult> {
    let (store, ns, pools) = ctx;
    let ranks = pools.pools.len() as u32;
    let groups: Vec<Vec<String>> = batch
        .iter()
        .map(|&(_, _, key, _)| (0..ranks).map(|r| shard_key(ns, key, r)).collect())
        .collect();
    let mut io_failed = |e: &super::StoreError| {
        tracing::debug!(error = %e, "tier command failed");
        first_error.get_or_insert_with(|| e.to_string());
        ChunkResult::Failed(Failure::Io)
    };
    // A call that failed whole: every chunk of the batch with its result.
    let every = |r: ChunkResult| batch.iter().map(|_| r).collect();
    match kind {
        Kind::Probe => match store.exists_many(&groups).await {
            Ok(found) => found
                .into_iter()
                .map(|f| f.map_or_else(|e| io_failed(&e), ChunkResult::Probe))
                .collect(),
            Err(e) => every(io_failed(&e)),
        },
        Kind::Store => {
            let pairs: Vec<Vec<(String, Vec<u8>)>> = groups
                .into_iter()
                .zip(batch)
                .map(|(keys, &(_, _, _, chunk))| {
                    keys.into_iter()
                        .enumerate()
                        .map(|(r, k)| {
                            let v = pools.encode(r, chunk, &k);
                            (k, v)
                        })
                        .collect()
                })
                .collect();
            match store.put_many(pairs).await {
                Ok(out) => out
                    .into_iter()
                    .map(|r| r.map_or_else(|e| io_failed(&e), |()| ChunkResult::Stored))
                    .collect(),
                Err(e) => every(io_failed(&e)),
            }
        }
        Kind::Load => match store.get_many(&groups).await {
            Ok(out) => out
                .into_iter()
                .zip(groups.iter().zip(batch))
                .map(|(r, (keys, &(_, _, _, chunk)))| match r {
                    Ok(values) => promote(pools, keys, &values, chunk),
                    Err(e) => io_failed(&e),
                })
                .collect(),
            Err(e) => every(io_failed(&e)),
        },
    }
}

/// Checks every rank's shard of a chunk, then writes them into the pools: a chunk is promoted
/// whole or not at all.
fn promote(
    pools: &Pools,
    keys: &[String],
    values: &[Option<bytes::Bytes>],
    chunk: ChunkId,
) -> ChunkResult {
    let want = pools.chunk_bytes();
    let mut payloads = Vec::with_capacity(keys.len());
    for (k, v) in keys.iter().zip(values) {
        let Some(v) = v else {
            return ChunkResult::Failed(Failure::Missing);
        };
        match decode(k, v, want) {
            Ok(p) => payloads.push(p),
            Err(_) => return ChunkResult::Failed(Failure::Refused),
        }
    }
    if payloads.len() != keys.len() {
        return ChunkResult::Failed(Failure::Missing);
    }
    for (r, p) in payloads.into_iter().enumerate() {
        pools.write(r, chunk, p);
    }
    ChunkResult::Loaded
}

/// Turns one work item's chunk results into its reports and figures.
fn settle(item: TierWork, results: Vec<Option<ChunkResult>>, pools: &Pools, done: &mut Done) {
    // Per chunk: whether it succeeded (failures counted by kind on the way).
    let mut ok = Vec::with_capacity(results.len());
    let mut found = Vec::with_capacity(results.len());
    for r in results {
        let f = &mut done.figures;
        match r {
            Some(ChunkResult::Probe(x)) => {
                ok.push(true);
                found.push(x);
            }
            Some(ChunkResult::Stored | ChunkResult::Loaded) => ok.push(true),
            Some(ChunkResult::Failed(why)) => {
                match why {
                    Failure::Io => f.io_errors += 1,
                    Failure::Timeout => f.timeouts += 1,
                    Failure::Missing => f.values_missing += 1,
                    Failure::Refused => f.values_refused += 1,
                }
                ok.push(false);
                found.push(false);
            }
            None => {
                ok.push(false);
                found.push(false);
            }
        }
    }
    let n = ok.iter().filter(|&&o| o).count() as u64;
    let (shard, ranks) = (pools.chunk_bytes(), pools.pools.len() as u64);
    let blocks = u64::from(pools.blocks_per_chunk) * ranks;
    let f = &mut done.figures;
    match item {
        TierWork::Probe { tier, keys } => {
            for ((key, generation), found) in keys.into_iter().zip(found) {
                f.probes += 1;
                f.probes_found += u64::from(found);
                done.reports.push(TierReport::Probed {
                    tier,
                    key,
                    generation,
                    found,
                });
            }
        }
        TierWork::Store {
            tier, job, keys, ..
        } => {
            f.store_jobs += 1;
            f.blocks_stored += n * blocks;
            f.bytes_stored += n * shard * ranks;
            f.store_failures += keys.len() as u64 - n;
            done.reports.push(TierReport::Finished {
                tier,
                job,
                success: n == keys.len() as u64,
                successful_keys: None,
            });
        }
        TierWork::Load {
            tier,
            request,
            job,
            keys,
            chunks,
        } => {
            f.load_jobs += 1;
            f.blocks_loaded += n * blocks;
            f.bytes_loaded += n * shard * ranks;
            f.load_failures += keys.len() as u64 - n;
            let mut loaded = Vec::with_capacity(keys.len());
            for ((&key, &chunk), _) in keys.iter().zip(&chunks).zip(&ok).filter(|p| *p.1) {
                loaded.push(key);
                done.promoted.push(Promoted {
                    chunk,
                    key,
                    request,
                });
            }
            let success = loaded.len() == keys.len();
            done.reports.push(TierReport::Finished {
                tier,
                job,
                success,
                successful_keys: (!success && !loaded.is_empty()).then_some(loaded),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::store::{Answers, MemoryStore, StoreBackend, StoreFuture};
    use kvrelay_core::{BlockHash, KvLayout, LayoutOrder, TierId, TierJobId};

    /// A store that never answers a command for a chunk of an odd bucket (a node gone quiet)
    /// and keeps the others.
    #[derive(Debug, Default)]
    struct HalfDeaf(MemoryStore);

    fn deaf(first_key: &str) -> bool {
        // The bucket is the two hex digits before the tag's `}` (`value::shard_key`).
        let at = first_key.find('}').expect("a tagged key");
        u8::from_str_radix(&first_key[at - 2..at], 16).expect("hex") % 2 == 1
    }

    impl StoreBackend for HalfDeaf {
        fn exists_many<'a>(&'a self, _: &'a [Vec<String>]) -> StoreFuture<'a, Answers<bool>> {
            Box::pin(std::future::pending())
        }

        fn put_many<'a>(
            &'a self,
            groups: &'a [Vec<(String, Vec<u8>)>],
        ) -> StoreFuture<'a, Answers<()>> {
            Box::pin(async move {
                if deaf(&groups[0][0].0) {
                    std::future::pending::<()>().await;
                }
                for (k, v) in groups.iter().flatten() {
                    self.0.set_raw(k, Some(v.clone()));
                }
                Ok(groups.iter().map(|_| Ok(())).collect())
            })
        }

        fn get_many<'a>(
            &'a self,
            _: &'a [Vec<String>],
        ) -> StoreFuture<'a, Answers<Vec<Option<Vec<u8>>>>> {
            Box::pin(std::future::pending())
        }
    }

    // Protects the batch's one deadline: a node that never answers fails its chunks as timed
    // out when the deadline passes, the others' results are kept, and the batch ends (it never
    // waits for the silent node).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_node_times_out_its_chunks_and_keeps_the_others() {
        let host = KvLayout::new(vec![0; 2], 8, 64, LayoutOrder::LayerMajor).unwrap();
        let pools = Pools {
            pools: vec![HostPool::new(host.total_bytes() as usize)],
            host,
            blocks_per_chunk: 1,
        };
        let keys: Vec<OffloadKey> = (0..8u64)
            .map(|i| OffloadKey {
                hash: BlockHash(0x100 + i),
                group: 0,
            })
            .collect();
        let work = vec![TierWork::Store {
            tier: TierId(0),
            job: TierJobId(1),
            keys,
            chunks: (0..8).map(ChunkId).collect(),
        }];
        let backend = Arc::new(HalfDeaf::default());
        let store = Store::Custom(backend.clone());
        let batch = run(work, store, "t".into(), pools, Duration::from_millis(100));
        let done = tokio::time::timeout(Duration::from_secs(5), batch)
            .await
            .expect("the batch ends at its deadline, not with the silent node");
        let f = &done.figures;
        assert_eq!((f.timeouts, f.store_failures), (4, 4), "{f:?}");
        assert_eq!(backend.0.len(), 4, "the answering node's chunks are stored");
        assert!(matches!(
            done.reports[..],
            [TierReport::Finished { success: false, .. }]
        ));
    }
}
