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
//! Not run in this repository's CI (no GPU there): the code is compiled and type-checked on
//! every build, and `probe` runs (and says there is no driver).

#![allow(unsafe_code)]

use std::sync::Arc;
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

/// The compute side of a rank on CUDA: the forward's writes and the checks' reads.
#[derive(Debug)]
pub(crate) struct CudaArena {
    dev: Arc<Device>,
    slot_bytes: usize,
    staging: PinnedHostSlice<u8>,
}

impl CudaArena {
    pub(crate) fn new(dev: Arc<Device>, slot_bytes: usize) -> Result<Self, TransferError> {
        let bytes = STAGING_BYTES.max(slot_bytes);
        // SAFETY: the buffer is written before it is read (`fill` stages, `first_mismatch`
        // copies into it and synchronizes first).
        let staging = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(cuda)?;
        Ok(Self {
            dev,
            slot_bytes,
            staging,
        })
    }

    /// Slots per round through the staging buffer.
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
}

impl KvArena for CudaArena {
    fn fill(&mut self, slots: &[Slot]) -> Result<(), TransferError> {
        let (sb, stream) = (self.slot_bytes, self.dev.compute.clone());
        for round in slots.chunks(self.per_round()) {
            let runs = self.runs(round);
            // The previous round's copies read the staging buffer: let them finish.
            stream.synchronize().map_err(cuda)?;
            let staging = self.staging.as_mut_slice().map_err(cuda)?;
            for (i, s) in round.iter().enumerate() {
                fill(&mut staging[i * sb..(i + 1) * sb], s.word);
            }
            for &(at, from, len) in &runs {
                let dst = self.dev.check(at, len)?;
                // SAFETY: `dst..dst+len` lies in the arena (checked); the source is pinned
                // memory this struct owns and does not touch until the stream is synchronized.
                unsafe {
                    result::memcpy_htod_async(dst, &staging[from..from + len], stream.cu_stream())
                }
                .map_err(cuda)?;
            }
        }
        self.dev.forward_done.record(&stream).map_err(cuda)
    }

    fn first_mismatch(&mut self, slots: &[Slot]) -> Result<Option<usize>, TransferError> {
        let (sb, stream) = (self.slot_bytes, self.dev.compute.clone());
        for (n, round) in slots.chunks(self.per_round()).enumerate() {
            let runs = self.runs(round);
            stream.synchronize().map_err(cuda)?;
            let staging = self.staging.as_mut_slice().map_err(cuda)?;
            for &(at, into, len) in &runs {
                let src = self.dev.check(at, len)?;
                // SAFETY: the source lies in the arena (checked); the destination is this
                // struct's pinned buffer, read only after the synchronize below.
                unsafe {
                    result::memcpy_dtoh_async(
                        &mut staging[into..into + len],
                        src,
                        stream.cu_stream(),
                    )
                }
                .map_err(cuda)?;
            }
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
    for r in &out.job.runs {
        let h = host_range(r)?;
        let g = dev.check(r.gpu as usize, r.len as usize)?;
        // SAFETY: both ranges lie in their allocations (checked above); the pool is pinned and
        // owned by this thread, which keeps it until the stream is synchronized; the device
        // range is not written by the compute stream while the transfer runs (the core's fences).
        match out.job.direction {
            TransferDirection::Store => unsafe {
                result::memcpy_dtoh_async(&mut host[h], g, stream.cu_stream())
            },
            TransferDirection::Load => unsafe {
                result::memcpy_htod_async(g, &host[h], stream.cu_stream())
            },
        }
        .map_err(cuda)?;
    }
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
