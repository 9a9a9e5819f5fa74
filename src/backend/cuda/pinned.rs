//! Pinned host memory (`cuMemHostAlloc`): the buffers a staging ring lends
//! to asynchronous device copies (`transport/staging/`). The driver can
//! copy between a device and pinned memory without a bounce of its own,
//! and only pinned memory lets `cuMemcpy*Async` return before the copy is
//! done.
//!
//! Pinned memory is locked in RAM, so the process bounds it: every buffer
//! counts against one process-wide total, and an allocation that would pass
//! the bound its caller gives (the client's `max_pinned_bytes`) is refused
//! with `RESOURCE_EXHAUSTED`, naming the option, before the driver is asked.
//! A buffer is freed (`cuMemFreeHost`) when dropped; a staging ring keeps
//! its buffers for reuse and drops them with its client.
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::status::{self, Result};

use super::*;

/// Pinned bytes this process holds now, every client's rings together.
static PINNED_HELD: AtomicUsize = AtomicUsize::new(0);

/// Pinned host bytes the process holds now (all clients).
pub fn pinned_bytes_held() -> usize {
    PINNED_HELD.load(Ordering::Relaxed)
}

/// One `cuMemHostAlloc` buffer, page-aligned, portable to every context of
/// the process, freed when dropped.
pub struct PinnedBuffer {
    pointer: *mut u8,
    len: usize,
}

// SAFETY: the buffer exclusively owns its pinned allocation; the driver
// lets any thread use or free it.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access hands out only the raw pointer.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` (> 0) bytes of pinned memory, unless the process would then
    /// hold more than `bound` pinned bytes (`RESOURCE_EXHAUSTED` naming
    /// `max_pinned_bytes`) or there is no CUDA (`UNAVAILABLE`).
    pub fn allocate(len: usize, bound: usize) -> Result<PinnedBuffer> {
        if len == 0 {
            return Err(status::invalid_argument(
                "a pinned buffer of 0 bytes was asked for",
            ));
        }
        // Reserve first, so that two clients racing cannot both pass.
        let before = PINNED_HELD.fetch_add(len, Ordering::AcqRel);
        if before.saturating_add(len) > bound {
            PINNED_HELD.fetch_sub(len, Ordering::AcqRel);
            return Err(status::resource_exhausted(format!(
                "pinning {len} more bytes of host memory would make this process hold {} (bound: \
                 max_pinned_bytes={bound})",
                before.saturating_add(len)
            )));
        }
        let allocated = CudaBackend::get().and_then(|backend| {
            // The memory is portable: any device's copies may use it; the
            // driver wants some context current to allocate it.
            backend.device(0)?.activate()?;
            // SAFETY: a plain allocation; the pointer is owned by the
            // returned buffer and freed once, in its drop.
            unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(|e| driver_error(&format!("cuMemHostAlloc of {len} bytes"), e))
        });
        match allocated {
            Ok(pointer) => Ok(PinnedBuffer {
                pointer: pointer.cast(),
                len,
            }),
            Err(e) => {
                PINNED_HELD.fetch_sub(len, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the buffer (page-aligned, valid for `len()` bytes while the
    /// buffer lives).
    pub fn as_ptr(&self) -> *mut u8 {
        self.pointer
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: `pointer` came from cuMemHostAlloc and is freed only here;
        // its owner (a staging ring) drops it only once no copy can reach it.
        if let Err(e) = unsafe { result::free_host(self.pointer.cast()) } {
            log::error!(
                "freeing {} pinned bytes: {}",
                self.len,
                driver_error("cuMemFreeHost", e)
            );
        }
        PINNED_HELD.fetch_sub(self.len, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn the_bound_is_checked_before_the_driver_is_asked() {
        // With no room at all, no driver call is made: the same answer
        // with or without a GPU.
        let refused = PinnedBuffer::allocate(4096, 0).err().unwrap();
        assert_eq!(refused.code, Code::ResourceExhausted);
        assert!(refused.message.contains("max_pinned_bytes"), "{refused}");
        assert_eq!(
            PinnedBuffer::allocate(0, 1 << 20).err().unwrap().code,
            Code::InvalidArgument
        );
        match PinnedBuffer::allocate(4096, usize::MAX) {
            Ok(buffer) => {
                assert_eq!(buffer.as_ptr() as usize % 4096, 0);
                assert!(pinned_bytes_held() >= 4096);
            }
            Err(e) => assert_eq!(e.code, Code::Unavailable, "{e}"),
        }
    }
}
