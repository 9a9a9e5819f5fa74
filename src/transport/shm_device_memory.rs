//! Host-backend device memory that lives in POSIX shared memory, so that a
//! sender in another process on this host can write a receive destination
//! directly (no staging copy on either side). The memory is a lease from the
//! receiver's pool of pre-faulted segments (or a dedicated region).
use std::sync::Arc;

use super::destination::WritableDestination;
use super::shm_pool::ShmLease;
use crate::backend::{DeviceMemory, MemoryCounters};
use crate::status::Result;

pub struct SharedHostMemory {
    lease: Arc<ShmLease>,
    counters: Arc<MemoryCounters>,
    /// Released with the memory (a receive's share of its client's bound).
    _held: Option<Box<dyn Send + Sync>>,
}

impl SharedHostMemory {
    pub fn new(lease: ShmLease, counters: Arc<MemoryCounters>) -> SharedHostMemory {
        counters.allocated(lease.len());
        SharedHostMemory {
            lease: Arc::new(lease),
            counters,
            _held: None,
        }
    }

    /// The same memory, keeping `held` alive (and dropping it) with it.
    pub fn holding(mut self, held: Box<dyn Send + Sync>) -> SharedHostMemory {
        self._held = Some(held);
        self
    }

    /// The lease, for transports that write into it.
    pub fn lease(&self) -> &Arc<ShmLease> {
        &self.lease
    }
}

impl DeviceMemory for SharedHostMemory {
    fn len(&self) -> usize {
        self.lease.len()
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.lease.read_at(offset, dst)
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.lease.write_at(offset, src)
    }

    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let len = self.lease.len();
        if len == 0 {
            return f(&[]);
        }
        // SAFETY: the lease's `len` bytes stay mapped while we hold its Arc;
        // readers run after the definition event, when no transport writes.
        f(unsafe { std::slice::from_raw_parts(self.lease.as_mut_ptr(), len) })
    }

    fn address(&self) -> usize {
        self.lease.as_mut_ptr() as usize
    }

    fn is_host_memory(&self) -> bool {
        true
    }

    fn shared_name(&self) -> Option<String> {
        Some(self.lease.segment_name().to_string())
    }
}

impl Drop for SharedHostMemory {
    fn drop(&mut self) {
        self.counters.freed(self.lease.len());
    }
}
