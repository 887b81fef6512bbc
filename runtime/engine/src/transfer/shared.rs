//! A rank's CPU pool in memory its worker process shares with the engine: an anonymous memory
//! file (`memfd`) the engine creates and the worker maps by its `/proc/PID/fd/N` name. The
//! engine's shared tier then reads the chunks it cascades and writes the chunks it promotes in
//! pools that live in other processes, as vLLM's scheduler reads and writes its primary tier
//! in a region the workers share (`SharedOffloadRegion`).
//!
//! # Safety of the sharing
//!
//! The mapping is plain bytes (no pointers, no invariants); the only hazard is two processes
//! touching the same chunk at once, and the core rules that out: a chunk being cascaded is
//! pinned (no transfer writes it) and a chunk being promoted is reserved (no transfer reads or
//! writes it) until the tier reports (I-50). A rank's copy thread and the engine's tier take the
//! pool's lock in their own process only; the core's pins are what order them across
//! processes, and every loaded block is still checked byte for byte at landing.
//!
//! The memory file lives as long as a mapping or the engine's descriptor does: nothing is left
//! on any file system when the processes end, however they end.
#![allow(unsafe_code)]

use std::fs::File;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

/// Shared bytes of a fixed length.
#[derive(Debug)]
pub struct SharedBytes {
    map: MmapMut,
    /// Where another process of this user opens it (`/proc/PID/fd/N`).
    path: PathBuf,
    /// Keeps the memory file (and so `path`) open in the creating process.
    _file: File,
}

impl SharedBytes {
    /// A zeroed memory file of `len` bytes, mapped here (Linux only).
    #[cfg(target_os = "linux")]
    pub fn create(len: usize) -> std::io::Result<Self> {
        let fd = nix::sys::memfd::memfd_create(
            c"kvrelay-cpu-pool",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?;
        let file = File::from(fd);
        file.set_len(len as u64)?;
        let path = PathBuf::from(format!(
            "/proc/{}/fd/{}",
            std::process::id(),
            std::os::fd::AsRawFd::as_raw_fd(&file)
        ));
        Self::map(file, path)
    }

    /// Memory files are Linux's (`memfd_create`).
    #[cfg(not(target_os = "linux"))]
    pub fn create(_len: usize) -> std::io::Result<Self> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    /// Maps the memory file another process created, at `path`; an error unless it holds
    /// exactly `len` bytes.
    pub fn open(path: &Path, len: usize) -> std::io::Result<Self> {
        let file = File::options().read(true).write(true).open(path)?;
        let found = file.metadata()?.len();
        if found != len as u64 {
            return Err(std::io::Error::other(format!(
                "{}: {found} bytes, the pool has {len}",
                path.display()
            )));
        }
        Self::map(file, path.to_owned())
    }

    fn map(file: File, path: PathBuf) -> std::io::Result<Self> {
        // SAFETY: the file is a memory file of this engine's, never truncated while mapped (its
        // length is fixed at creation, and checked on open); concurrent writers in the other
        // process touch other chunks only (see the module docs).
        let map = unsafe { MmapMut::map_mut(&file)? };
        Ok(Self {
            map,
            path,
            _file: file,
        })
    }

    /// Where another process opens it ([`SharedBytes::open`]).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Deref for SharedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

impl DerefMut for SharedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Protects the sharing itself: what one mapping writes, another mapping of the same memory
    // file (as a worker process opens it, by its /proc name) reads; a length that differs from
    // the pool's is refused.
    #[test]
    fn two_mappings_of_one_memory_file_see_each_others_bytes() {
        let mut a = SharedBytes::create(4096).unwrap();
        let mut b = SharedBytes::open(a.path(), 4096).unwrap();
        a[100] = 7;
        b[4000] = 9;
        assert_eq!((b[100], a[4000]), (7, 9));
        assert!(SharedBytes::open(a.path(), 8192).is_err());
        assert!(SharedBytes::open(Path::new("/proc/self/fd/999999"), 4096).is_err());
    }
}
