//! The CUDA backend: a rank's KV arena in device memory and its CPU offload pool in pinned host
//! memory, through the CUDA driver API ([cudarc], loaded with `dlopen` at run time, so the crate
//! builds and runs where there is no CUDA at all: [`probe`] says why not, and `--backend cuda`
//! stops with that reason).
//!
//! # Streams and ordering
//!
//! ```text
//! compute stream   forward writes (staged htod) ── record forward_done ── … checks (dtoh, synced)
//! transfer stream        wait(forward_done) ── store dtoh / load htod runs ── record end
//! completer thread                                     synchronize(end) ── CopyDone, in order
//! ```
//!
//! * The forward pass has no model: its writes are the content words of `content`,
//!   staged in a pinned buffer and copied to the arena on the **compute stream**, after which
//!   the shared `forward_done` event is recorded.
//! * Every transfer runs on the rank's one **transfer stream** after a `wait` on
//!   `forward_done`: a (deferred) store reads blocks the forward wrote, and a load may write a
//!   block whose earlier content is still being written by a forward that freed it. One stream
//!   per rank makes the rank's transfers complete in the order they were started.
//! * The issuing thread never blocks on the GPU: a second thread waits for each transfer's end
//!   event in order and reports `CopyDone`. The forward reads a loaded block only after the
//!   rank driver heard of its completion (host-side ordering), and no block is rewritten while
//!   a store reads it (the core's fences, I-4).
//!
//! Every device and host range is checked against its allocation before a copy is issued: a bad
//! plan is a [`TransferError`], never an out-of-bounds DMA.
//!
//! Copies go as batched driver calls (`cuMemcpyBatchAsync`, CUDA 12.8 and later; one call a
//! copy before that): scattered 8 KiB blocks move 5 times faster than one call each. The
//! forward's slot writes and the checks' reads are not copies: two device kernels
//! (`kernels.rs`) write and check a round of slots in place, halving a Mooncake slice's time.
//!
//! Not run in this repository's CI (no GPU there): the code is compiled and type-checked on
//! every build, and `probe` runs (and says there is no driver). Run on an H200 on 2026-11-27: `tests/cuda.rs` of the CLI and `benches/cuda.rs` here; figures in docs/FIGURES.md.

#![allow(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError, PinnedHostSlice, result,
    sys,
};
use kvrelay_core::{CopyRun, TransferDirection};
use tokio::sync::{Notify, mpsc};

use crate::content::{fill, holds};
use crate::transfer::kernels::SlotKernels;
use crate::transfer::{
    COPY_QUEUE_BOUND, CopyDone, CopyJob, KvArena, Slot, TransferEngine, TransferError,
};

/// Bytes of the pinned staging buffer through which the forward writes and the checks read.
const STAGING_BYTES: usize = 8 << 20;

fn cuda(e: DriverError) -> TransferError {
    TransferError::Cuda(e.to_string())
}

/// The name of CUDA device 0, or why CUDA cannot be used (no driver library, no device, an
/// error of the driver). Never panics: the driver library is probed before any call into it.
pub fn probe() -> Result<String, String> {
    // SAFETY: `is_culib_present` only tries to `dlopen` the driver library and drops it.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so not found)".into());
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return Err("no CUDA device".into()),
        Err(e) => return Err(format!("no usable CUDA device ({e})")),
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("CUDA device 0: {e}"))?;
    ctx.name().map_err(|e| format!("CUDA device 0: {e}"))
}

/// A rank's device arena and the streams that touch it; shared by the arena (compute side) and
/// the transfer engine's issuing thread.
#[derive(Debug)]
pub(crate) struct Device {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    /// Owns the allocation; `base` points into it.
    _arena: CudaSlice<u8>,
    base: sys::CUdeviceptr,
    len: usize,
    /// Recorded on the compute stream after every forward write; transfers wait for it.
    forward_done: CudaEvent,
    /// Copies go as `cuMemcpyBatchAsync` calls: the driver has it (CUDA 12.8 and later) and
    /// it has not failed (then it is switched off, with a line on stderr).
    batch: AtomicBool,
}

impl Device {
    /// A zeroed arena of `len` bytes on device 0.
    pub(crate) fn open(len: usize) -> Result<Arc<Self>, TransferError> {
        probe().map_err(TransferError::Cuda)?;
        let ctx = CudaContext::new(0).map_err(cuda)?;
        // SAFETY: this backend orders its streams itself with events (module docs), so
        // cudarc's per-allocation tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let compute = ctx.new_stream().map_err(cuda)?;
        let arena = compute.alloc_zeros::<u8>(len.max(1)).map_err(cuda)?;
        let (base, sync) = arena.device_ptr(&compute);
        drop(sync);
        let forward_done = ctx.new_event(None).map_err(cuda)?;
        forward_done.record(&compute).map_err(cuda)?;
        compute.synchronize().map_err(cuda)?;
        Ok(Arc::new(Self {
            ctx,
            compute,
            _arena: arena,
            base,
            len,
            forward_done,
            batch: AtomicBool::new(has_batch_copies()),
        }))
    }

    fn check(&self, at: usize, len: usize) -> Result<sys::CUdeviceptr, TransferError> {
        match at.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.base + at as u64),
            _ => Err(TransferError::Cuda(format!(
                "device range {at}+{len} outside the {}-byte arena",
                self.len
            ))),
        }
    }
}

/// Whether the driver library exports `cuMemcpyBatchAsync` (asked before the first call: cudarc
/// panics on a missing symbol).
fn has_batch_copies() -> bool {
    // SAFETY: `culib` is the driver library `probe` found; looking a symbol up calls nothing.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync")
            .is_ok()
    }
}

/// Copies per batched driver call, at most.
const BATCH: usize = 1 << 14;

/// Issues one copy per `(dst, src, bytes)` on `stream` — device or pinned host addresses
/// (unified addressing gives the direction) — as batched calls while `batch` holds, else one
/// `cuMemcpyAsync` each. A small scattered copy costs about 2 µs of driver time on its own
/// (`benches/cuda.rs`), so batching is what keeps decode steps and churned blocks cheap. A
/// batched call that fails switches batching off (said on stderr) and its copies are issued one
/// by one: a copy is idempotent, since no source changes before the stream passes it.
///
/// # Safety
/// Every range lies in its allocation, and neither side is touched by the host, nor the
/// destination by another stream, until the stream passes this point.
unsafe fn copy_runs(
    batch: &AtomicBool,
    runs: &[(u64, u64, usize)],
    stream: &CudaStream,
) -> Result<(), TransferError> {
    for chunk in runs.chunks(BATCH) {
        if chunk.len() > 1 && batch.load(Ordering::Relaxed) {
            // SAFETY: the caller's contract.
            match unsafe { copy_batch(chunk, stream) } {
                Ok(()) => continue,
                Err(e) => {
                    batch.store(false, Ordering::Relaxed);
                    eprintln!("kvrelay: cuMemcpyBatchAsync failed ({e}); copying run by run");
                }
            }
        }
        for &(dst, src, len) in chunk {
            // SAFETY: the caller's contract.
            unsafe { sys::cuMemcpyAsync(dst, src, len, stream.cu_stream()) }
                .result()
                .map_err(cuda)?;
        }
    }
    Ok(())
}

/// One `cuMemcpyBatchAsync` of `chunk`, ordered on `stream`.
///
/// # Safety
/// As [`copy_runs`].
unsafe fn copy_batch(chunk: &[(u64, u64, usize)], stream: &CudaStream) -> Result<(), DriverError> {
    let device = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: 0,
    };
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        // Hints matter for managed memory only (ours is not).
        srcLocHint: device,
        dstLocHint: device,
        flags: 0,
    };
    let mut dsts: Vec<u64> = chunk.iter().map(|r| r.0).collect();
    let mut srcs: Vec<u64> = chunk.iter().map(|r| r.1).collect();
    let mut sizes: Vec<usize> = chunk.iter().map(|r| r.2).collect();
    let (mut first, mut fail) = (0usize, usize::MAX);
    // SAFETY: the caller's contract; the arrays hold `chunk.len()` entries and one attribute
    // that applies from copy 0 on.
    unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            chunk.len(),
            &mut attrs,
            &mut first,
            1,
            &mut fail,
            stream.cu_stream(),
        )
    }
    .result()
}

/// The device address of `at` in pinned host memory (unified addressing).
fn host_addr(slice: &[u8], at: usize) -> u64 {
    slice.as_ptr() as u64 + at as u64
}

/// The compute side of a rank on CUDA: the forward's writes and the checks' reads, by the slot
/// kernels (`kernels.rs`) where they load, else by copies through the staging buffer.
#[derive(Debug)]
pub(crate) struct CudaArena {
    dev: Arc<Device>,
    slot_bytes: usize,
    staging: PinnedHostSlice<u8>,
    kernels: Option<SlotKernels>,
}

impl CudaArena {
    pub(crate) fn new(dev: Arc<Device>, slot_bytes: usize) -> Result<Self, TransferError> {
        let bytes = STAGING_BYTES.max(slot_bytes);
        // SAFETY: the buffer is written before it is read (`fill` stages, `first_mismatch`
        // copies into it and synchronizes first).
        let staging = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(cuda)?;
        let kernels = match SlotKernels::load(&dev.ctx, &dev.compute, bytes / 16) {
            Ok(k) if slot_bytes.is_multiple_of(8) && slot_bytes > 0 => Some(k),
            Ok(_) => None,
            Err(e) => {
                eprintln!("kvrelay: {e}; writing and checking slots by copies");
                None
            }
        };
        Ok(Self {
            dev,
            slot_bytes,
            staging,
            kernels,
        })
    }

    /// Slots per round through the staging buffer (copy path).
    fn per_round(&self) -> usize {
        (self.staging.len() / self.slot_bytes).max(1)
    }

    /// Maximal runs of slots adjacent in the arena: `(arena offset, staging offset, bytes)`.
    fn runs(&self, slots: &[Slot]) -> Vec<(usize, usize, usize)> {
        let sb = self.slot_bytes;
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        for (i, s) in slots.iter().enumerate() {
            match runs.last_mut() {
                Some(r) if r.0 + r.2 == s.at => r.2 += sb,
                _ => runs.push((s.at, i * sb, sb)),
            }
        }
        runs
    }

    /// Stages `round`'s `(offset, word)` entries for the kernels, every slot checked against
    /// the arena; the staged bytes.
    fn stage_entries(&mut self, round: &[Slot]) -> Result<usize, TransferError> {
        for s in round {
            self.dev.check(s.at, self.slot_bytes)?;
        }
        let staging = self.staging.as_mut_slice().map_err(cuda)?;
        for (e, s) in staging.chunks_exact_mut(16).zip(round) {
            e[..8].copy_from_slice(&(s.at as u64).to_le_bytes());
            e[8..].copy_from_slice(&s.word.to_le_bytes());
        }
        Ok(round.len() * 16)
    }

    fn fill_by_copies(&mut self, slots: &[Slot]) -> Result<(), TransferError> {
        let (sb, stream) = (self.slot_bytes, self.dev.compute.clone());
        for round in slots.chunks(self.per_round()) {
            let runs = self.runs(round);
            // The previous round's copies read the staging buffer: let them finish.
            stream.synchronize().map_err(cuda)?;
            let staging = self.staging.as_mut_slice().map_err(cuda)?;
            for (i, s) in round.iter().enumerate() {
                fill(&mut staging[i * sb..(i + 1) * sb], s.word);
            }
            let mut copies = Vec::with_capacity(runs.len());
            for &(at, from, len) in &runs {
                copies.push((self.dev.check(at, len)?, host_addr(staging, from), len));
            }
            // SAFETY: every destination lies in the arena (checked); the sources lie in the
            // pinned staging buffer this struct owns and does not touch until the stream is
            // synchronized.
            unsafe { copy_runs(&self.dev.batch, &copies, &stream) }?;
        }
        Ok(())
    }

    fn mismatch_by_copies(&mut self, slots: &[Slot]) -> Result<Option<usize>, TransferError> {
        let (sb, stream) = (self.slot_bytes, self.dev.compute.clone());
        for (n, round) in slots.chunks(self.per_round()).enumerate() {
            let runs = self.runs(round);
            stream.synchronize().map_err(cuda)?;
            let staging = self.staging.as_mut_slice().map_err(cuda)?;
            let mut copies = Vec::with_capacity(runs.len());
            for &(at, into, len) in &runs {
                copies.push((host_addr(staging, into), self.dev.check(at, len)?, len));
            }
            // SAFETY: every source lies in the arena (checked); the destinations lie in this
            // struct's pinned buffer, read only after the synchronize below.
            unsafe { copy_runs(&self.dev.batch, &copies, &stream) }?;
            stream.synchronize().map_err(cuda)?;
            if let Some(i) = round
                .iter()
                .enumerate()
                .position(|(i, s)| !holds(&staging[i * sb..(i + 1) * sb], s.word))
            {
                return Ok(Some(n * self.per_round() + i));
            }
        }
        Ok(None)
    }
}

impl KvArena for CudaArena {
    fn fill(&mut self, slots: &[Slot]) -> Result<(), TransferError> {
        let Some(per_round) = self.kernels.as_ref().map(SlotKernels::capacity) else {
            self.fill_by_copies(slots)?;
            return self
                .dev
                .forward_done
                .record(&self.dev.compute)
                .map_err(cuda);
        };
        let (stream, wps) = (self.dev.compute.clone(), (self.slot_bytes / 8) as u32);
        for round in slots.chunks(per_round) {
            // The previous round's upload reads the staging buffer: let it finish.
            stream.synchronize().map_err(cuda)?;
            let n = self.stage_entries(round)?;
            let (k, staging) = (
                self.kernels.as_ref().expect("checked"),
                self.staging.as_slice(),
            );
            let staged = &staging.map_err(cuda)?[..n];
            // SAFETY: every slot lies in the arena (checked when staged); the staging buffer is
            // not touched again before the next round's synchronize.
            unsafe { k.fill(&stream, self.dev.base, staged, wps) }?;
        }
        self.dev.forward_done.record(&stream).map_err(cuda)
    }

    fn first_mismatch(&mut self, slots: &[Slot]) -> Result<Option<usize>, TransferError> {
        let Some(per_round) = self.kernels.as_ref().map(SlotKernels::capacity) else {
            return self.mismatch_by_copies(slots);
        };
        let (stream, wps) = (self.dev.compute.clone(), (self.slot_bytes / 8) as u32);
        for (r, round) in slots.chunks(per_round).enumerate() {
            stream.synchronize().map_err(cuda)?;
            let n = self.stage_entries(round)?;
            let staging = self.staging.as_slice().map_err(cuda)?;
            let k = self.kernels.as_mut().expect("checked");
            // SAFETY: as in `fill`; `check` synchronizes before it returns.
            if let Some(i) = unsafe { k.check(&stream, self.dev.base, &staging[..n], wps) }? {
                return Ok(Some(r * per_round + i));
            }
        }
        Ok(None)
    }
}

/// A transfer issued on the transfer stream, waiting for its end event.
struct Issued {
    job: CopyJob,
    bytes: u64,
    start: Option<CudaEvent>,
    end: Option<CudaEvent>,
    result: Result<(), TransferError>,
}

/// The transfer engine of a rank on CUDA: an issuing thread and a completing thread.
#[derive(Debug)]
pub(crate) struct CudaEngine {
    tx: Option<SyncSender<CopyJob>>,
    threads: Vec<JoinHandle<()>>,
}

impl CudaEngine {
    /// Starts the engine of a rank whose arena is `dev` and whose pinned host pool has
    /// `host_bytes` bytes (allocated here, once). Completions go to `done`; `wake` is notified
    /// after each.
    pub(crate) fn spawn(
        rank: u32,
        dev: Arc<Device>,
        host_bytes: usize,
        done: mpsc::Sender<CopyDone>,
        wake: Arc<Notify>,
    ) -> Result<Self, TransferError> {
        let stream = dev.ctx.new_stream().map_err(cuda)?;
        // SAFETY: zeroed right below, before any copy reads it.
        let mut pool =
            unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(host_bytes.max(1), 0) }.map_err(cuda)?;
        pool.as_mut_slice().map_err(cuda)?.fill(0);
        let (tx, rx) = sync_channel::<CopyJob>(COPY_QUEUE_BOUND);
        let (issued_tx, issued_rx) = sync_channel::<Issued>(COPY_QUEUE_BOUND);
        let thread = |name: String| std::thread::Builder::new().name(name);
        let ctx = dev.ctx.clone();
        let issuer = thread(format!("kvrelay-cuda-issue-{rank}"))
            .spawn(move || issue_loop(&rx, &dev, &stream, pool, &issued_tx))
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        let completer = thread(format!("kvrelay-cuda-done-{rank}"))
            .spawn(move || complete_loop(&ctx, &issued_rx, &done, &wake))
            .map_err(|e| TransferError::Thread(e.to_string()))?;
        Ok(Self {
            tx: Some(tx),
            threads: vec![issuer, completer],
        })
    }
}

impl TransferEngine for CudaEngine {
    fn start(&mut self, job: CopyJob) -> Result<(), TransferError> {
        let tx = self.tx.as_ref().ok_or(TransferError::Stopped)?;
        tx.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => TransferError::QueueFull,
            TrySendError::Disconnected(_) => TransferError::Stopped,
        })
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn issue_loop(
    rx: &Receiver<CopyJob>,
    dev: &Device,
    stream: &Arc<CudaStream>,
    mut pool: PinnedHostSlice<u8>,
    issued: &SyncSender<Issued>,
) {
    if dev.ctx.bind_to_thread().is_err() {
        return;
    }
    while let Ok(job) = rx.recv() {
        let mut out = Issued {
            bytes: job.runs.iter().map(|r| r.len).sum(),
            start: None,
            end: None,
            result: Ok(()),
            job,
        };
        out.result = issue(&mut out, dev, stream, &mut pool);
        if issued.send(out).is_err() {
            break;
        }
    }
    // The pool is freed when this returns: no copy may still use it.
    let _ = stream.synchronize();
}

fn issue(
    out: &mut Issued,
    dev: &Device,
    stream: &CudaStream,
    pool: &mut PinnedHostSlice<u8>,
) -> Result<(), TransferError> {
    let pool_len = pool.len();
    let host_range = |r: &CopyRun| -> Result<std::ops::Range<usize>, TransferError> {
        let (at, len) = (r.host as usize, r.len as usize);
        match at.checked_add(len) {
            Some(end) if end <= pool_len => Ok(at..end),
            _ => Err(TransferError::Cuda(format!(
                "host range {at}+{len} outside the {pool_len}-byte pool"
            ))),
        }
    };
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = dev.ctx.new_event(timing).map_err(cuda)?;
    let end = dev.ctx.new_event(timing).map_err(cuda)?;
    stream.wait(&dev.forward_done).map_err(cuda)?;
    start.record(stream).map_err(cuda)?;
    let host = pool.as_mut_slice().map_err(cuda)?;
    let mut copies = Vec::with_capacity(out.job.runs.len());
    for r in &out.job.runs {
        let h = host_addr(host, host_range(r)?.start);
        let g = dev.check(r.gpu as usize, r.len as usize)?;
        copies.push(match out.job.direction {
            TransferDirection::Store => (h, g, r.len as usize),
            TransferDirection::Load => (g, h, r.len as usize),
        });
    }
    // SAFETY: both ranges of every copy lie in their allocations (checked above); the pool is
    // pinned and owned by this thread, which keeps it until the stream is synchronized; the
    // device range is not written by the compute stream while the transfer runs (the core's
    // fences).
    unsafe { copy_runs(&dev.batch, &copies, stream) }?;
    end.record(stream).map_err(cuda)?;
    out.start = Some(start);
    out.end = Some(end);
    Ok(())
}

fn complete_loop(
    ctx: &CudaContext,
    issued: &Receiver<Issued>,
    done: &mpsc::Sender<CopyDone>,
    wake: &Notify,
) {
    if ctx.bind_to_thread().is_err() {
        return;
    }
    while let Ok(i) = issued.recv() {
        let mut elapsed = Duration::ZERO;
        let mut result = i.result;
        if let (Ok(()), Some(start), Some(end)) = (&result, &i.start, &i.end) {
            result = end
                .synchronize()
                .and_then(|()| start.elapsed_ms(end))
                .map(|ms| elapsed = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
                .map_err(cuda);
        }
        let out = CopyDone {
            job: i.job.job,
            direction: i.job.direction,
            bytes: i.bytes,
            copies: i.job.runs.len() as u64,
            elapsed,
            result,
            failed: false,
        };
        if done.blocking_send(out).is_err() {
            return;
        }
        wake.notify_one();
    }
}

/// One rank's CUDA copy path alone — a device arena, a pinned pool and the transfer engine
/// between them — for benchmarks (`benches/cuda.rs`): [`CudaCopier::copy`] runs one job through
/// the same issue and completion threads a rank uses and waits for it; [`CudaCopier::one_copy`]
/// is the practical limit it is compared to, one `cuMemcpy` of the same bytes.
#[derive(Debug)]
pub struct CudaCopier {
    dev: Arc<Device>,
    engine: CudaEngine,
    done: mpsc::Receiver<CopyDone>,
    /// The baseline's pinned buffer (the engine owns its own pool).
    pinned: PinnedHostSlice<u8>,
}

impl CudaCopier {
    /// An arena of `arena_bytes` on device 0 and a pinned pool of `host_bytes`; fails with the
    /// probe's reason where there is no CUDA.
    pub fn open(arena_bytes: usize, host_bytes: usize) -> Result<Self, TransferError> {
        let dev = Device::open(arena_bytes)?;
        let (tx, done) = mpsc::channel(COPY_QUEUE_BOUND);
        let engine = CudaEngine::spawn(0, dev.clone(), host_bytes, tx, Arc::new(Notify::new()))?;
        // SAFETY: only ever a copy's destination or source; its content is never read here.
        let pinned =
            unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(host_bytes.max(1), 0) }.map_err(cuda)?;
        Ok(Self {
            dev,
            engine,
            done,
            pinned,
        })
    }

    /// Batched copies on (where the driver has them, the default) or off: the benchmark
    /// compares the two in one run.
    pub fn set_batched(&mut self, on: bool) {
        self.dev
            .batch
            .store(on && has_batch_copies(), Ordering::Relaxed);
    }

    /// Runs `job` and waits for its completion (its result, or the engine's error).
    pub fn copy(&mut self, job: CopyJob) -> Result<CopyDone, TransferError> {
        self.engine.start(job)?;
        let done = self.done.blocking_recv().ok_or(TransferError::Stopped)?;
        done.result.clone().map(|()| done)
    }

    /// One copy of the first `bytes` of the arena to (store) or from (load) a pinned buffer, on
    /// the compute stream, waited for.
    pub fn one_copy(
        &mut self,
        direction: TransferDirection,
        bytes: usize,
    ) -> Result<(), TransferError> {
        let g = self.dev.check(0, bytes)?;
        let stream = self.dev.compute.clone();
        let host = self.pinned.as_mut_slice().map_err(cuda)?;
        let Some(host) = host.get_mut(..bytes) else {
            return Err(TransferError::Cuda(format!(
                "{bytes} bytes outside the pinned buffer"
            )));
        };
        // SAFETY: both ranges lie in their allocations (checked above); the stream is
        // synchronized before the pinned buffer is touched again.
        match direction {
            TransferDirection::Store => unsafe {
                result::memcpy_dtoh_async(host, g, stream.cu_stream())
            },
            TransferDirection::Load => unsafe {
                result::memcpy_htod_async(g, host, stream.cu_stream())
            },
        }
        .map_err(cuda)?;
        stream.synchronize().map_err(cuda)
    }
}
