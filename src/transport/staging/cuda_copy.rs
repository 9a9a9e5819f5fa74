//! `CudaCopy`: the staging pipeline's `DeviceCopy` for a CUDA buffer. A
//! chunk's copy is `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` between the
//! buffer and a ring slot (pinned memory, `SlotMemory::Pinned`) on the
//! device's stream, and its completion a host function queued after it
//! (`backend/cuda/async_copy.rs`): the call returns before the bytes move,
//! so the pipeline puts the previous chunk on the wire meanwhile, and a
//! receive reports its bytes landed only once the last copy's completion
//! fired. The completion keeps the buffer alive until the copy is done.
use std::time::Instant;

use super::copy::{check_range, CopyCompletion, DeviceCopy, Pending};
use super::ring::Slot;
use crate::backend::cuda::{expect_cuda, CopyDone};
use crate::backend::Allocation;
use crate::status::Result;

/// A CUDA buffer as the staging pipeline reaches it.
pub struct CudaCopy {
    memory: Allocation,
}

impl CudaCopy {
    /// `memory` must be CUDA memory (`INVALID_ARGUMENT` otherwise).
    pub fn new(memory: Allocation) -> Result<CudaCopy> {
        expect_cuda(&memory, "a staged CUDA copy")?;
        Ok(CudaCopy { memory })
    }
}

struct CudaCompletion(CopyDone);

impl CopyCompletion for CudaCompletion {
    fn is_done(&mut self) -> Result<bool> {
        Ok(self.0.is_done())
    }

    fn wait_until(&mut self, until: Instant) -> Result<bool> {
        Ok(self.0.wait_until(until))
    }
}

impl DeviceCopy for CudaCopy {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn to_device(&self, slot: &Slot, offset: usize, len: usize) -> Result<Pending> {
        check_range(self.memory.len(), slot, offset, len)?;
        let cuda = expect_cuda(&self.memory, "a staged CUDA copy")?;
        // SAFETY: `len` bytes of the slot are readable (checked); the
        // pipeline neither writes nor hands out the slot before this copy's
        // completion says it is done (a stopped pipeline parks it).
        let copy = unsafe { cuda.copy_from_host_async(&self.memory, offset, slot.as_ptr(), len) }?;
        Ok(Pending::Running(Box::new(CudaCompletion(copy))))
    }

    fn to_host(&self, offset: usize, slot: &Slot, len: usize) -> Result<Pending> {
        check_range(self.memory.len(), slot, offset, len)?;
        let cuda = expect_cuda(&self.memory, "a staged CUDA copy")?;
        // SAFETY: as in `to_device`: the slot is the pipeline's alone until
        // the completion says the copy wrote it.
        let copy = unsafe { cuda.copy_to_host_async(&self.memory, offset, slot.as_ptr(), len) }?;
        Ok(Pending::Running(Box::new(CudaCompletion(copy))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;
    use crate::backend::{Backend, MemoryCounters};
    use crate::status::Code;

    #[test]
    fn only_cuda_memory_is_taken() {
        let host = HostBackend::new(1)
            .allocate(0, 64, std::sync::Arc::new(MemoryCounters::default()))
            .unwrap();
        let refused = CudaCopy::new(host).err().unwrap();
        assert_eq!(refused.code, Code::InvalidArgument);
    }
}
