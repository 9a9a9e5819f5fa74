//! Device memory. The host backend is always available; a CUDA backend is
//! loaded dynamically where a driver exists.
pub mod host;
pub mod shared;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crate::status::Result;

/// Per-device allocation statistics reported by `PJRT_Device_MemoryStats`.
#[derive(Default, Debug)]
pub struct MemoryCounters {
    bytes_in_use: AtomicI64,
    peak_bytes_in_use: AtomicI64,
    num_allocs: AtomicI64,
    largest_alloc: AtomicI64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: i64,
    pub num_allocs: i64,
    pub largest_alloc_size: i64,
}

impl MemoryCounters {
    pub fn allocated(&self, bytes: usize) {
        let bytes = bytes as i64;
        let now = self.bytes_in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes_in_use.fetch_max(now, Ordering::Relaxed);
        self.num_allocs.fetch_add(1, Ordering::Relaxed);
        self.largest_alloc.fetch_max(bytes, Ordering::Relaxed);
    }

    pub fn freed(&self, bytes: usize) {
        self.bytes_in_use.fetch_sub(bytes as i64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MemoryStats {
        MemoryStats {
            bytes_in_use: self.bytes_in_use.load(Ordering::Relaxed),
            peak_bytes_in_use: self.peak_bytes_in_use.load(Ordering::Relaxed),
            num_allocs: self.num_allocs.load(Ordering::Relaxed),
            largest_alloc_size: self.largest_alloc.load(Ordering::Relaxed),
        }
    }
}

/// One device allocation. Reads and writes are bounds-checked; the owner
/// (a buffer) orders them through its definition event.
pub trait DeviceMemory: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` into the allocation starting at `offset`.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Lends the whole contents as a host slice for the duration of `f`:
    /// host memory lends itself without a copy, device memory stages.
    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let mut staging = vec![0u8; self.len()];
        self.read(0, &mut staging)?;
        f(&staging)
    }
    /// The address a framework may read directly (host memory) or the device
    /// address (GPU memory); stable for the allocation's lifetime.
    fn address(&self) -> usize;
    /// True when `address()` is host-addressable memory.
    fn is_host_memory(&self) -> bool;
    /// Shared-memory name under which another process on this host can map
    /// the allocation, if it is backed by shared memory.
    fn shared_name(&self) -> Option<String> {
        None
    }
}

pub type Allocation = Arc<dyn DeviceMemory>;
