//! Host-backend device memory that lives in POSIX shared memory, so that a
//! sender in another process on this host can write a receive destination
//! directly (no staging copy on either side).
use std::sync::Arc;

use super::{DeviceMemory, MemoryCounters};
use crate::status::Result;
use crate::transport::shm::SharedRegion;

pub struct SharedHostMemory {
    region: Arc<SharedRegion>,
    counters: Arc<MemoryCounters>,
}

impl SharedHostMemory {
    pub fn allocate(len: usize, counters: Arc<MemoryCounters>) -> Result<SharedHostMemory> {
        let region = Arc::new(SharedRegion::create(len)?);
        counters.allocated(len);
        Ok(SharedHostMemory { region, counters })
    }

    /// The region, for transports that write into it.
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }
}

impl DeviceMemory for SharedHostMemory {
    fn len(&self) -> usize {
        self.region.len()
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.region.read_at(offset, dst)
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.region.write_at(offset, src)
    }

    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let len = self.region.len();
        if len == 0 {
            return f(&[]);
        }
        // SAFETY: the mapping holds `len` bytes for the region's life (we hold
        // an Arc); readers run after the definition event, when no transport
        // writes any more.
        f(unsafe { std::slice::from_raw_parts(self.region.as_ptr(), len) })
    }

    fn address(&self) -> usize {
        self.region.as_ptr() as usize
    }

    fn is_host_memory(&self) -> bool {
        true
    }

    fn shared_name(&self) -> Option<String> {
        Some(self.region.name().to_string())
    }
}

impl Drop for SharedHostMemory {
    fn drop(&mut self) {
        self.counters.freed(self.region.len());
    }
}
