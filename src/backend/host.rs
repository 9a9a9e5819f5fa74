//! Host backend: device memory is host memory.
use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use super::{Allocation, Backend, DeviceMemory, MemoryCounters};
use crate::pjrt::named_values::NamedValue;
use crate::status::{invalid_argument, out_of_range, resource_exhausted, Result};

/// The device kind of host-backend devices.
pub const HOST_DEVICE_KIND: &str = "crosshost-host";

/// Host memory pretending to be `num_devices` devices.
#[derive(Debug)]
pub struct HostBackend {
    num_devices: usize,
}

impl HostBackend {
    pub fn new(num_devices: usize) -> HostBackend {
        HostBackend { num_devices }
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn is_host(&self) -> bool {
        true
    }

    fn device_count(&self) -> usize {
        self.num_devices
    }

    fn device_kind(&self, _index: usize) -> String {
        HOST_DEVICE_KIND.to_string()
    }

    fn device_attributes(&self, _index: usize) -> Vec<(String, NamedValue)> {
        Vec::new()
    }

    fn allocate(
        &self,
        index: usize,
        bytes: usize,
        counters: Arc<MemoryCounters>,
    ) -> Result<Allocation> {
        if index >= self.num_devices {
            return Err(invalid_argument(format!(
                "host backend has {} devices, no device {index}",
                self.num_devices
            )));
        }
        Ok(Arc::new(HostMemory::allocate(bytes, counters)?))
    }
}

/// Cache-line alignment keeps vectorised copies and any element type aligned.
const ALIGNMENT: usize = 64;

/// A zero-initialised, 64-byte-aligned heap allocation.
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
    counters: Arc<MemoryCounters>,
}

// SAFETY: the allocation is plain bytes owned exclusively by this object; all
// access goes through bounds-checked raw copies, ordered by the owning
// buffer's definition event, so sharing the handle between threads is sound.
unsafe impl Send for HostMemory {}
// SAFETY: see `Send` above; no interior references are handed out.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    pub fn allocate(len: usize, counters: Arc<MemoryCounters>) -> Result<HostMemory> {
        let ptr = if len == 0 {
            // A dangling, aligned pointer is valid for zero-sized access.
            NonNull::new(ALIGNMENT as *mut u8).expect("non-zero")
        } else {
            let layout = Layout::from_size_align(len, ALIGNMENT)
                .map_err(|_| resource_exhausted(format!("host allocation of {len} bytes")))?;
            // SAFETY: layout has non-zero size.
            let raw = unsafe { alloc::alloc_zeroed(layout) };
            NonNull::new(raw).ok_or_else(|| {
                resource_exhausted(format!("host allocation of {len} bytes failed"))
            })?
        };
        counters.allocated(len);
        Ok(HostMemory { ptr, len, counters })
    }

    fn check(&self, offset: usize, n: usize, what: &str) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(out_of_range(format!(
                "{what} of {n} bytes at offset {offset} exceeds the {}-byte allocation",
                self.len
            ))),
        }
    }
}

impl DeviceMemory for HostMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len(), "read")?;
        if !dst.is_empty() {
            // SAFETY: [offset, offset+len) is inside the allocation (checked)
            // and `dst` is a distinct, writable slice.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(offset),
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            };
        }
        Ok(())
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len(), "write")?;
        if !src.is_empty() {
            // SAFETY: [offset, offset+len) is inside the allocation (checked);
            // `src` never aliases our private allocation.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    self.ptr.as_ptr().add(offset),
                    src.len(),
                )
            };
        }
        Ok(())
    }

    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        // SAFETY: the allocation holds `len` initialised bytes for our whole
        // life; readers run after the buffer's definition event, so no write
        // is in flight.
        f(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    fn address(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn is_host_memory(&self) -> bool {
        true
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.len != 0 {
            let layout = Layout::from_size_align(self.len, ALIGNMENT).expect("valid at alloc");
            // SAFETY: allocated with exactly this layout in `allocate`.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        self.counters.freed(self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_then_reads_and_rejects_out_of_bounds() {
        let counters = Arc::new(MemoryCounters::default());
        let m = HostMemory::allocate(16, counters.clone()).unwrap();
        m.write(4, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 5];
        m.read(3, &mut out).unwrap();
        assert_eq!(out, [0, 1, 2, 3, 0]);
        assert!(m.write(15, &[1, 2]).is_err());
        assert!(m.read(usize::MAX, &mut out).is_err());
        assert_eq!(counters.snapshot().bytes_in_use, 16);
        drop(m);
        assert_eq!(counters.snapshot().bytes_in_use, 0);
    }

    #[test]
    fn zero_sized_allocation_is_valid() {
        let m = HostMemory::allocate(0, Arc::default()).unwrap();
        m.write(0, &[]).unwrap();
        assert!(m.write(0, &[1]).is_err());
    }
}
