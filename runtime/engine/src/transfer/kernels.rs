//! The CUDA arena's slot writes and checks as two device kernels (hand-written PTX, loaded with
//! the driver API: no compiler at build or run time).
//!
//! A token slot is a few bytes (8 with `--trace`'s default 128-byte blocks), and a step writes
//! and checks thousands of them, scattered over the arena. As copies, every run of adjacent
//! slots was a copy entry of its own, and the run's time grew with the number of entries, not
//! with the bytes (docs/FIGURES.md, the H200 rows). Here a round of slots costs one upload of
//! its `(offset, word)` entries and one launch: `kvr_fill` writes each slot's word into every
//! 8-byte word of the slot; `kvr_check` compares them and leaves the smallest index of a slot
//! that differs (`atom.min`) in a result word, read back once.
//!
//! Call [`SlotKernels::load`] once per arena (an error means: keep the copy path), then
//! [`SlotKernels::fill`] / [`SlotKernels::check`] per round, on the compute stream. Offsets are
//! checked against the arena by the caller before a launch.

#![allow(unsafe_code)]

use std::ffi::{CString, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice, result, sys};

use crate::transfer::TransferError;

/// Threads per block of both kernels.
const THREADS: u32 = 256;

/// `kvr_fill(base, entries, total, words_per_slot)` and
/// `kvr_check(base, entries, total, words_per_slot, result)`: thread `t < total` handles word
/// `t % words_per_slot` of entry `t / words_per_slot`; an entry is two u64s, the slot's byte
/// offset in the arena and its word. Both share [`SLOT_WORD`], which leaves the word's address
/// in `%rd16` and the entry's word in `%rd13` (and the entry's index in `%rd8`).
fn ptx() -> String {
    let entry = |name: &str, result_param: &str, tail: &str| {
        let body = SLOT_WORD.replace("DONE", &format!("{name}_done"));
        format!(
            ".visible .entry {name}(\n    .param .u64 p_base,\n    .param .u64 p_entries,\n    \
             .param .u64 p_total,\n    .param .u32 p_wps{result_param}\n)\n{{\n{body}{tail}\
             {name}_done:\n    ret;\n}}\n"
        )
    };
    let fill = entry("kvr_fill", "", "    st.global.u64 [%rd16], %rd13;\n");
    let check = entry("kvr_check", ",\n    .param .u64 p_result", CHECK_TAIL);
    format!(".version 7.0\n.target sm_70\n.address_size 64\n\n{fill}\n{check}")
}

/// The kernels' common body: the thread's slot word (see [`ptx`]).
const SLOT_WORD: &str = "    .reg .pred %p<3>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<20>;
    ld.param.u64 %rd1, [p_base];
    ld.param.u64 %rd2, [p_entries];
    ld.param.u64 %rd3, [p_total];
    ld.param.u32 %r1, [p_wps];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mul.wide.u32 %rd4, %r2, %r3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd6, %rd4, %rd5;
    setp.ge.u64 %p1, %rd6, %rd3;
    @%p1 bra DONE;
    cvt.u64.u32 %rd7, %r1;
    div.u64 %rd8, %rd6, %rd7;
    rem.u64 %rd9, %rd6, %rd7;
    shl.b64 %rd10, %rd8, 4;
    add.u64 %rd11, %rd2, %rd10;
    ld.global.u64 %rd12, [%rd11];
    ld.global.u64 %rd13, [%rd11+8];
    shl.b64 %rd14, %rd9, 3;
    add.u64 %rd15, %rd1, %rd12;
    add.u64 %rd16, %rd15, %rd14;
";

/// `kvr_check`'s end: a slot word that differs lowers the result to its entry's index.
const CHECK_TAIL: &str = "    ld.param.u64 %rd18, [p_result];
    ld.global.u64 %rd17, [%rd16];
    setp.ne.u64 %p2, %rd17, %rd13;
    cvt.u32.u64 %r5, %rd8;
    @%p2 atom.global.min.u32 %r6, [%rd18], %r5;
";

fn cuda(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Cuda(format!("{what}: {e}"))
}

/// The loaded kernels and their device buffers (see the module docs).
#[derive(Debug)]
pub(crate) struct SlotKernels {
    fill: sys::CUfunction,
    check: sys::CUfunction,
    /// Entries of one round, on the device (owned here; used through `entries_ptr`).
    _entries: CudaSlice<u8>,
    entries_ptr: sys::CUdeviceptr,
    /// The check's result word, on the device (owned here; used through `result_ptr`) and read
    /// back into `result_host`.
    _result: CudaSlice<u32>,
    result_ptr: sys::CUdeviceptr,
    result_host: PinnedHostSlice<u32>,
    /// Entries a round holds at most.
    capacity: usize,
}

// SAFETY: the function handles belong to the context's module, which lives as long as the
// context (never unloaded); they are used only from the thread that owns the arena.
unsafe impl Send for SlotKernels {}

impl SlotKernels {
    /// Loads the kernels into `ctx` and allocates room for `capacity` entries a round.
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        capacity: usize,
    ) -> Result<Self, TransferError> {
        ctx.bind_to_thread().map_err(|e| cuda("bind", e))?;
        let image = CString::new(ptx()).map_err(|e| cuda("ptx", e))?;
        let mut module = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX text that outlives the call.
        unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) }
            .result()
            .map_err(|e| cuda("loading the slot kernels", e))?;
        let function = |name: &str| {
            let name = CString::new(name).map_err(|e| cuda("kernel name", e))?;
            let mut f = std::ptr::null_mut();
            // SAFETY: `module` was loaded above; `name` is NUL-terminated.
            unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) }
                .result()
                .map_err(|e| cuda("finding a slot kernel", e))?;
            Ok::<_, TransferError>(f)
        };
        let (fill, check) = (function("kvr_fill")?, function("kvr_check")?);
        let entries = stream
            .alloc_zeros::<u8>(capacity.max(1) * 16)
            .map_err(|e| cuda("entries buffer", e))?;
        let result = stream
            .alloc_zeros::<u32>(1)
            .map_err(|e| cuda("result word", e))?;
        let (entries_ptr, s1) = entries.device_ptr(stream);
        drop(s1);
        let (result_ptr, s2) = result.device_ptr(stream);
        drop(s2);
        // SAFETY: written by a device copy before it is read (after a synchronize).
        let result_host =
            unsafe { ctx.alloc_pinned_with_flags::<u32>(1, 0) }.map_err(|e| cuda("pinned", e))?;
        Ok(Self {
            fill,
            check,
            _entries: entries,
            entries_ptr,
            _result: result,
            result_ptr,
            result_host,
            capacity,
        })
    }

    /// Entries a round may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Writes `staged` (16-byte entries, at most [`Self::capacity`], in pinned memory) into the
    /// entries buffer and fills their slots of `words_per_slot` words at `base`, on `stream`.
    ///
    /// # Safety
    /// `staged` stays untouched until the stream passes this point; every entry's slot lies in
    /// the arena at `base`.
    pub(crate) unsafe fn fill(
        &self,
        stream: &CudaStream,
        base: sys::CUdeviceptr,
        staged: &[u8],
        words_per_slot: u32,
    ) -> Result<(), TransferError> {
        // SAFETY: the caller's contract.
        unsafe { self.upload(stream, staged) }?;
        let total = (staged.len() / 16) as u64 * u64::from(words_per_slot);
        let (mut b, mut e, mut t, mut w) = (base, self.entries_ptr, total, words_per_slot);
        let mut params: [*mut c_void; 4] = [
            (&raw mut b).cast(),
            (&raw mut e).cast(),
            (&raw mut t).cast(),
            (&raw mut w).cast(),
        ];
        // SAFETY: the parameters match kvr_fill's; the caller's contract covers the memory.
        unsafe { launch(self.fill, total, &mut params, stream) }
    }

    /// Like [`Self::fill`], but checks the slots: the index of the first entry whose slot does
    /// not hold its word, after waiting for the stream.
    ///
    /// # Safety
    /// As [`Self::fill`].
    pub(crate) unsafe fn check(
        &mut self,
        stream: &CudaStream,
        base: sys::CUdeviceptr,
        staged: &[u8],
        words_per_slot: u32,
    ) -> Result<Option<usize>, TransferError> {
        let cu = stream.cu_stream();
        // SAFETY: the result word is this struct's device allocation.
        unsafe { sys::cuMemsetD32Async(self.result_ptr, u32::MAX, 1, cu) }
            .result()
            .map_err(|e| cuda("clearing the result", e))?;
        // SAFETY: the caller's contract.
        unsafe { self.upload(stream, staged) }?;
        let total = (staged.len() / 16) as u64 * u64::from(words_per_slot);
        let (mut b, mut e, mut t, mut w, mut r) = (
            base,
            self.entries_ptr,
            total,
            words_per_slot,
            self.result_ptr,
        );
        let mut params: [*mut c_void; 5] = [
            (&raw mut b).cast(),
            (&raw mut e).cast(),
            (&raw mut t).cast(),
            (&raw mut w).cast(),
            (&raw mut r).cast(),
        ];
        // SAFETY: the parameters match kvr_check's; the caller's contract covers the memory.
        unsafe { launch(self.check, total, &mut params, stream) }?;
        let host = self
            .result_host
            .as_mut_slice()
            .map_err(|e| cuda("pinned", e))?;
        // SAFETY: both sides are this struct's own one-word allocations; read after the sync.
        unsafe { result::memcpy_dtoh_async(host, self.result_ptr, cu) }
            .map_err(|e| cuda("reading the result", e))?;
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        let first = self.result_host.as_slice().map_err(|e| cuda("pinned", e))?[0];
        Ok((first != u32::MAX).then_some(first as usize))
    }

    /// Copies `staged` to the entries buffer, on `stream`.
    ///
    /// # Safety
    /// As [`Self::fill`].
    unsafe fn upload(&self, stream: &CudaStream, staged: &[u8]) -> Result<(), TransferError> {
        if staged.len() > self.capacity * 16 || !staged.len().is_multiple_of(16) {
            return Err(TransferError::Cuda(format!(
                "{} bytes of slot entries for a buffer of {} entries",
                staged.len(),
                self.capacity
            )));
        }
        // SAFETY: the destination is this struct's buffer, large enough (checked above); the
        // caller keeps `staged` until the stream passes.
        unsafe { result::memcpy_htod_async(self.entries_ptr, staged, stream.cu_stream()) }
            .map_err(|e| cuda("uploading slot entries", e))
    }
}

/// Launches `f` over `total` threads on `stream`.
///
/// # Safety
/// `params` match the kernel's parameters, and the memory they name is valid for it.
unsafe fn launch(
    f: sys::CUfunction,
    total: u64,
    params: &mut [*mut c_void],
    stream: &CudaStream,
) -> Result<(), TransferError> {
    if total == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(total.div_ceil(u64::from(THREADS)))
        .ok()
        .filter(|&b| b <= i32::MAX as u32) // the grid's x limit
        .ok_or_else(|| TransferError::Cuda(format!("{total} slot words in one launch")))?;
    // SAFETY: the caller's contract.
    unsafe {
        sys::cuLaunchKernel(
            f,
            blocks,
            1,
            1,
            THREADS,
            1,
            1,
            0,
            stream.cu_stream(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| cuda("launching a slot kernel", e))
}

#[cfg(test)]
mod tests {
    /// Protects the PTX text the driver loads (no GPU here: its shape is what can be checked):
    /// both entries, each with its parameters and its own exit label, the check's atomic.
    #[test]
    fn the_ptx_has_both_kernels_whole() {
        let p = super::ptx();
        assert!(p.starts_with(".version 7.0\n.target sm_70\n.address_size 64\n"));
        for (name, params) in [("kvr_fill", 4), ("kvr_check", 5)] {
            let at = p.find(&format!(".visible .entry {name}(")).expect(name);
            let body = &p[at..];
            let end = body.find("\n}\n").expect("closed");
            let body = &body[..end];
            assert_eq!(body.matches(".param ").count(), params, "{name}");
            assert_eq!(body.matches(&format!("{name}_done")).count(), 2, "{name}");
        }
        assert_eq!(p.matches("st.global.u64 [%rd16], %rd13;").count(), 1);
        assert_eq!(p.matches("atom.global.min.u32").count(), 1);
    }
}
