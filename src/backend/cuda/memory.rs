//! Device memory from `cuMemAlloc`, and copies between devices.
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use once_cell::sync::OnceCell;

use crate::backend::{DeviceMemory, MemoryCounters};
use crate::status::{self, Result};

use super::*;

/// One `cuMemAlloc` allocation, zero-initialised, freed when dropped (that
/// is, when the last buffer or transfer holding it lets go), or, for an
/// exported receive destination whose receive succeeded, put on its
/// device's receive shelf for the next receive of the same size.
pub struct CudaMemory {
    pub(super) device: Arc<CudaDevice>,
    /// 0 for a zero-sized allocation (the driver refuses those).
    pub(super) pointer: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) counters: Arc<MemoryCounters>,
    pub(super) ipc_handle: OnceCell<[u8; IPC_HANDLE_LEN]>,
    /// Set once the receive this memory was the destination of succeeded:
    /// its sender's copy completed before the receipt, so no write of that
    /// transfer can still arrive, and the memory may be reused.
    pub(super) reusable: AtomicBool,
}

impl fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaMemory({} bytes at {:#x} on device {})",
            self.len, self.pointer, self.device.ordinal
        )
    }
}

impl CudaMemory {
    pub fn allocate(
        device: Arc<CudaDevice>,
        len: usize,
        counters: Arc<MemoryCounters>,
    ) -> Result<CudaMemory> {
        let pointer = if len == 0 {
            0
        } else {
            let pointer = match device.malloc(len) {
                // Memory on the receive shelf is the first to give back.
                Err(e) if e.code == Code::ResourceExhausted && device.empty_receive_shelf() => {
                    device.malloc(len)
                }
                other => other,
            }?;
            // Zero it like the host backend does, so that no previous
            // process's or buffer's bytes are ever visible.
            // SAFETY: `pointer` holds `len` bytes; the stream belongs to the
            // same context.
            let zeroed = unsafe { result::memset_d8_async(pointer, 0, len, device.stream) }
                .map_err(|e| driver_error("cuMemsetD8Async", e))
                .and_then(|()| device.synchronize("cuMemsetD8Async"));
            if let Err(e) = zeroed {
                // SAFETY: allocated just above, not shared with anyone.
                let _ = unsafe { result::memory_free(pointer) };
                return Err(e);
            }
            pointer
        };
        counters.allocated(len);
        Ok(CudaMemory {
            device,
            pointer,
            len,
            counters,
            ipc_handle: OnceCell::new(),
            reusable: AtomicBool::new(false),
        })
    }

    /// Memory for a receive destination, exported: the newest memory of
    /// this exact size on the device's receive shelf (its IPC handle, and
    /// so every sender's mapping of it, stays the same), else a new
    /// allocation. Shelved memory is not zeroed again: it held a buffer of
    /// this same process, and a destination's bytes are readable only once
    /// its one transfer overwrote all of them (a failed receive's buffer
    /// carries the error instead).
    pub fn allocate_exported(
        device: Arc<CudaDevice>,
        len: usize,
        counters: Arc<MemoryCounters>,
    ) -> Result<CudaMemory> {
        if len > 0 {
            if let Some(shelved) = device.take_shelved_receive_memory(len) {
                counters.allocated(len);
                let memory = CudaMemory {
                    device,
                    pointer: shelved.pointer,
                    len,
                    counters,
                    ipc_handle: OnceCell::with_value(shelved.handle),
                    reusable: AtomicBool::new(false),
                };
                return Ok(memory);
            }
        }
        let memory = CudaMemory::allocate(device, len, counters)?;
        if len > 0 {
            memory.ipc_handle()?;
        }
        Ok(memory)
    }

    /// Marks this memory as the destination of a receive that succeeded:
    /// when its last holder lets go it goes on the receive shelf (if it was
    /// exported and fits) instead of back to the driver.
    pub fn mark_reusable(&self) {
        self.reusable.store(true, Ordering::Release);
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    pub(super) fn check(&self, offset: usize, n: usize, what: &str) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(status::out_of_range(format!(
                "{what} of {n} bytes at offset {offset} exceeds the {}-byte CUDA allocation",
                self.len
            ))),
        }
    }

    /// The allocation's CUDA IPC handle (exported once, then remembered).
    /// `FAILED_PRECONDITION` for a zero-sized allocation, which has no
    /// device memory to share.
    pub fn ipc_handle(&self) -> Result<[u8; IPC_HANDLE_LEN]> {
        if self.len == 0 {
            return Err(status::failed_precondition(
                "a zero-sized CUDA allocation has no IPC handle",
            ));
        }
        self.ipc_handle
            .get_or_try_init(|| {
                self.device.activate()?;
                let mut handle = sys::CUipcMemHandle {
                    reserved: [0; IPC_HANDLE_LEN],
                };
                // SAFETY: `pointer` is a live cuMemAlloc allocation of this
                // context and `handle` is a valid out-parameter.
                unsafe { sys::cuIpcGetMemHandle(&mut handle, self.pointer) }
                    .result()
                    .map_err(|e| driver_error("cuIpcGetMemHandle", e))?;
                Ok(handle.reserved.map(|b| b as u8))
            })
            .copied()
    }
}

impl DeviceMemory for CudaMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len(), "read")?;
        if dst.is_empty() {
            return Ok(());
        }
        self.device.activate()?;
        // SAFETY: [offset, offset + dst.len()) lies inside the allocation
        // (checked); `dst` stays borrowed until the stream synchronization
        // below, after which the copy is complete.
        unsafe { result::memcpy_dtoh_async(dst, self.pointer + offset as u64, self.device.stream) }
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
        self.device.synchronize("cuMemcpyDtoHAsync")
    }

    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len(), "write")?;
        if src.is_empty() {
            return Ok(());
        }
        self.device.activate()?;
        // SAFETY: [offset, offset + src.len()) lies inside the allocation
        // (checked); `src` stays borrowed until the synchronization below.
        unsafe { result::memcpy_htod_async(self.pointer + offset as u64, src, self.device.stream) }
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        self.device.synchronize("cuMemcpyHtoDAsync")
    }

    fn address(&self) -> usize {
        self.pointer as usize
    }

    fn is_host_memory(&self) -> bool {
        false
    }

    fn as_cuda(&self) -> Option<&CudaMemory> {
        Some(self)
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.counters.freed(self.len);
        if self.pointer != 0 && self.reusable.load(Ordering::Acquire) {
            if let Some(handle) = self.ipc_handle.get() {
                self.device.shelve_receive_memory(ShelvedMemory {
                    pointer: self.pointer,
                    len: self.len,
                    handle: *handle,
                });
                return;
            }
        }
        if self.pointer != 0 {
            // Every copy of this process touching the allocation was
            // synchronized before its call returned, so nothing is in flight
            // on our streams. A sender in another process that still has the
            // allocation mapped through IPC is not waited for: the receive
            // holds the memory until its outcome is published (a sender's
            // bytes land before its receipt), but after a cancellation or a
            // timeout the buffer may be freed while a late sender still
            // copies; what the driver does then is not documented.
            // SAFETY: allocated by cuMemAlloc in `allocate`, freed only
            // here, no copy in flight (see above).
            unsafe { self.device.free(self.pointer, self.len) };
        }
    }
}

/// Exported receive memory on its device's shelf: no buffer holds it, its
/// IPC handle is unchanged, senders may still have it mapped.
pub(super) struct ShelvedMemory {
    pub(super) pointer: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) handle: [u8; IPC_HANDLE_LEN],
}

/// Copies all of `src` into `dst` at `dst_offset`, both in this process, on
/// `dst`'s device stream (a peer copy when the devices differ).
pub fn copy_device_to_device(src: &CudaMemory, dst: &CudaMemory, dst_offset: usize) -> Result<()> {
    dst.check(dst_offset, src.len, "device-to-device copy")?;
    if src.len == 0 {
        return Ok(());
    }
    let target = dst.pointer + dst_offset as u64;
    let stream = dst.device.stream;
    dst.device.activate()?;
    let copied = if Arc::ptr_eq(&src.device, &dst.device) {
        // SAFETY: both ranges are live allocations of this context, inside
        // bounds (checked); synchronized below before they can be freed.
        unsafe { result::memcpy_dtod_async(target, src.pointer, src.len, stream) }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))
    } else {
        // SAFETY: as above, each pointer with the context it belongs to.
        unsafe {
            result::memcpy_peer_async(
                dst.device.context,
                target,
                src.device.context,
                src.pointer,
                src.len,
                stream,
            )
        }
        .map_err(|e| driver_error("cuMemcpyPeerAsync", e))
    };
    copied?;
    dst.device.synchronize("device-to-device copy")
}
