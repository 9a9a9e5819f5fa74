//! One CUDA device: its primary context, its stream, and its shelf of
//! exported receive memory kept for reuse.
use std::fmt;

use cudarc::driver::result;
use cudarc::driver::sys;
use parking_lot::Mutex;

use crate::backend::DriverMemoryInfo;
use crate::status::Result;

use super::*;

/// One CUDA device: its primary context, its stream, and its receive shelf.
pub struct CudaDevice {
    pub(super) ordinal: i32,
    pub(super) context: sys::CUcontext,
    pub(super) stream: sys::CUstream,
    pub(super) name: String,
    pub(super) compute_capability: (i32, i32),
    pub(super) multiprocessors: i32,
    pub(super) total_memory: usize,
    /// Exported receive memory no buffer holds any more, by length (see
    /// `CudaMemory::allocate_exported`), bounded by `reuse_bound`.
    receive_shelf: Mutex<Shelf<usize, ShelvedMemory>>,
}

// SAFETY: a CUcontext and a CUstream are driver handles that the CUDA driver
// API allows to be used from any thread (a context may be current on several
// threads at once; work may be enqueued on a stream from any thread). Both
// live until the process exits (never destroyed), and the other fields are
// plain data.
unsafe impl Send for CudaDevice {}
// SAFETY: see `Send`; no method hands out interior references.
unsafe impl Sync for CudaDevice {}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("total_memory", &self.total_memory)
            .finish()
    }
}

impl CudaDevice {
    pub(super) fn open(ordinal: i32) -> Result<CudaDevice> {
        let what = |call: &str| format!("{call} (device {ordinal})");
        let device =
            result::device::get(ordinal).map_err(|e| unavailable_error(&what("cuDeviceGet"), e))?;
        let name = result::device::get_name(device)
            .map_err(|e| unavailable_error(&what("cuDeviceGetName"), e))?;
        let attribute = |attribute: sys::CUdevice_attribute, call: &str| {
            // SAFETY: `device` was returned by cuDeviceGet.
            unsafe { result::device::get_attribute(device, attribute) }
                .map_err(|e| unavailable_error(&what(call), e))
        };
        use sys::CUdevice_attribute as A;
        let major = attribute(
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)",
        )?;
        let minor = attribute(
            A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)",
        )?;
        let multiprocessors = attribute(
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
        )?;
        // SAFETY: `device` was returned by cuDeviceGet.
        let total_memory = unsafe { result::device::total_mem(device) }
            .map_err(|e| unavailable_error(&what("cuDeviceTotalMem"), e))?;
        // The primary context is retained for the life of the process (never
        // released): streams and allocations of every client depend on it.
        // SAFETY: `device` was returned by cuDeviceGet.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| unavailable_error(&what("cuDevicePrimaryCtxRetain"), e))?;
        // SAFETY: `context` is the primary context just retained.
        unsafe { result::ctx::set_current(context) }
            .map_err(|e| unavailable_error(&what("cuCtxSetCurrent"), e))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| unavailable_error(&what("cuStreamCreate"), e))?;
        Ok(CudaDevice {
            ordinal,
            context,
            stream,
            name,
            compute_capability: (major, minor),
            multiprocessors,
            total_memory,
            receive_shelf: Mutex::new(Shelf::new(reuse_bound(total_memory))),
        })
    }

    /// `cuMemAlloc` of `len` (> 0) bytes in this device's context.
    pub(super) fn malloc(&self, len: usize) -> Result<sys::CUdeviceptr> {
        self.activate()?;
        // SAFETY: a plain allocation in the (current) primary context; the
        // caller owns the pointer and frees it with `free`.
        unsafe { result::malloc_sync(len) }.map_err(|e| {
            driver_error(
                &format!("cuMemAlloc of {len} bytes on device {}", self.ordinal),
                e,
            )
        })
    }

    /// Gives `pointer` (`len` bytes, for the log) back to the driver.
    ///
    /// # Safety
    /// `pointer` came from `malloc` on this device, nothing of this process
    /// uses it any more and no copy into it is in flight.
    pub(super) unsafe fn free(&self, pointer: sys::CUdeviceptr, len: usize) {
        let freed = self.activate().and_then(|()| {
            // SAFETY: the caller's contract.
            unsafe { result::memory_free(pointer) }.map_err(|e| driver_error("cuMemFree", e))
        });
        if let Err(e) = freed {
            log::error!("freeing {len} CUDA bytes: {e}");
        }
    }

    pub(super) fn take_shelved_receive_memory(&self, len: usize) -> Option<ShelvedMemory> {
        self.receive_shelf.lock().take(&len)
    }

    /// Keeps `memory` for the next receive of its size; what the shelf's
    /// bound pushes out goes back to the driver.
    pub(super) fn shelve_receive_memory(&self, memory: ShelvedMemory) {
        let evicted = self
            .receive_shelf
            .lock()
            .put(memory.len, memory.len, memory);
        self.free_shelved(evicted);
    }

    /// Frees everything on the receive shelf; whether there was anything.
    pub(super) fn empty_receive_shelf(&self) -> bool {
        let shelved = self.receive_shelf.lock().drain();
        let any = !shelved.is_empty();
        self.free_shelved(shelved);
        any
    }

    /// Bytes on the receive shelf now.
    pub fn shelved_receive_bytes(&self) -> usize {
        self.receive_shelf.lock().held()
    }

    fn free_shelved(&self, memory: Vec<ShelvedMemory>) {
        for m in memory {
            // SAFETY: shelved memory came from `malloc` on this device and no
            // buffer of this process holds it; off the shelf, nothing can
            // take it again.
            unsafe { self.free(m.pointer, m.len) };
        }
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes this device's context current on the calling thread (cheap when
    /// it already is).
    pub(super) fn activate(&self) -> Result<()> {
        // SAFETY: the primary context was retained at open and is never
        // released, so it is valid for the process's life.
        unsafe { result::ctx::set_current(self.context) }
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// Waits for everything enqueued on this device's stream.
    pub(super) fn synchronize(&self, what: &str) -> Result<()> {
        // SAFETY: the stream was created at open and is never destroyed.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| driver_error(&format!("cuStreamSynchronize after {what}"), e))
    }

    pub(super) fn memory_info(&self) -> Result<DriverMemoryInfo> {
        self.activate()?;
        let (free_bytes, total_bytes) =
            result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(DriverMemoryInfo {
            free_bytes,
            total_bytes,
        })
    }
}

/// Bytes each CUDA reuse shelf may hold (a device's receive shelf, and the
/// process's idle IPC mappings): `$PJRT_CROSSHOST_CUDA_REUSE_BYTES` (0 turns
/// reuse off), else a sixteenth of the device's memory.
pub(super) fn reuse_bound(total_memory: usize) -> usize {
    match std::env::var("PJRT_CROSSHOST_CUDA_REUSE_BYTES") {
        Ok(value) => value.trim().parse().unwrap_or_else(|_| {
            log::warn!(
                "PJRT_CROSSHOST_CUDA_REUSE_BYTES={value:?} is not a byte count; using the default"
            );
            total_memory / 16
        }),
        Err(_) => total_memory / 16,
    }
}
