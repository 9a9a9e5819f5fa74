//! IPC imports (sender side): a receiver's exported memory mapped into this
//! process, one mapping per handle and device, shared by concurrent users.
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::backend::DeviceMemory;
use crate::status::{self, Code, Result, Status};

use super::*;

type ImportKey = ([u8; IPC_HANDLE_LEN], i32);

struct ImportEntry {
    pub(super) pointer: sys::CUdeviceptr,
    pub(super) len: usize,
    pub(super) users: usize,
}

/// Open IPC mappings of this process, by handle and importing device. A
/// handle opened twice in one context is an error for the driver, so
/// concurrent users share one mapping; the last one closes it.
static IMPORTS: Lazy<Mutex<HashMap<ImportKey, ImportEntry>>> = Lazy::new(Default::default);

/// Another process's allocation, mapped into this process through its IPC
/// handle on one of our devices. Closed when the last user drops it.
pub struct IpcImport {
    pub(super) device: Arc<CudaDevice>,
    pub(super) key: ImportKey,
    pub(super) pointer: sys::CUdeviceptr,
    pub(super) len: usize,
}

impl fmt::Debug for IpcImport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IpcImport({} bytes at {:#x} on device {})",
            self.len, self.pointer, self.device.ordinal
        )
    }
}

impl IpcImport {
    /// Maps `handle` on `device` (or shares the mapping already open). The
    /// exporting process must be another process: the driver refuses to
    /// open a process's own handles.
    pub fn open(device: &Arc<CudaDevice>, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcImport> {
        let key = (*handle, device.ordinal);
        let mut imports = IMPORTS.lock();
        if let Some(entry) = imports.get_mut(&key) {
            entry.users += 1;
            return Ok(IpcImport {
                device: device.clone(),
                key,
                pointer: entry.pointer,
                len: entry.len,
            });
        }
        device.activate()?;
        let raw = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as _),
        };
        let mut pointer: sys::CUdeviceptr = 0;
        // SAFETY: `pointer` is a valid out-parameter; the driver validates
        // the handle bytes (a forged handle is an error, not a mapping).
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut pointer,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| {
            let e = driver_error("cuIpcOpenMemHandle", e);
            Status::new(
                if e.code == Code::Internal {
                    Code::InvalidArgument
                } else {
                    e.code
                },
                format!("{} (stale or foreign CUDA IPC handle?)", e.message),
            )
        })?;
        // The mapping's real extent, so that the caller can check a
        // descriptor's offset and size against it.
        let mut base: sys::CUdeviceptr = 0;
        let mut len: usize = 0;
        // SAFETY: `pointer` was just mapped; both out-parameters are valid.
        let range = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, pointer) }
            .result()
            .map_err(|e| driver_error("cuMemGetAddressRange", e));
        let len = match range {
            Ok(()) => len.saturating_sub((pointer - base) as usize),
            Err(e) => {
                // SAFETY: mapped just above, not shared yet.
                let _ = unsafe { sys::cuIpcCloseMemHandle(pointer) };
                return Err(e);
            }
        };
        imports.insert(
            key,
            ImportEntry {
                pointer,
                len,
                users: 1,
            },
        );
        Ok(IpcImport {
            device: device.clone(),
            key,
            pointer,
            len,
        })
    }

    /// Bytes the mapping spans.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }
}

impl Drop for IpcImport {
    fn drop(&mut self) {
        let mut imports = IMPORTS.lock();
        let Some(entry) = imports.get_mut(&self.key) else {
            return;
        };
        entry.users -= 1;
        if entry.users > 0 {
            return;
        }
        imports.remove(&self.key);
        let closed = self.device.activate().and_then(|()| {
            // SAFETY: opened by cuIpcOpenMemHandle in `open`; the last user is
            // gone and every copy into it was synchronized.
            unsafe { sys::cuIpcCloseMemHandle(self.pointer) }
                .result()
                .map_err(|e| driver_error("cuIpcCloseMemHandle", e))
        });
        if let Err(e) = closed {
            log::error!("closing a CUDA IPC mapping: {e}");
        }
    }
}

/// Copies all of `src` into `import` at `offset` and waits for it: a
/// device-to-device copy when `src` is CUDA memory, else host-to-device.
/// `OUT_OF_RANGE` when the copy would leave the mapping.
pub fn copy_into_import(src: &dyn DeviceMemory, import: &IpcImport, offset: usize) -> Result<()> {
    let len = src.len();
    match offset.checked_add(len) {
        Some(end) if end <= import.len => {}
        _ => {
            return Err(status::out_of_range(format!(
                "copy of {len} bytes at offset {offset} exceeds the {}-byte CUDA IPC destination",
                import.len
            )))
        }
    }
    if len == 0 {
        return Ok(());
    }
    let device = &import.device;
    let target = import.pointer + offset as u64;
    device.activate()?;
    match src.as_cuda() {
        Some(source) => {
            // SAFETY: the source range is a live allocation and the target
            // range lies inside the mapping (checked); both stay alive until
            // the synchronization below. With unified addressing the copy may
            // cross devices (peer access was enabled lazily at open).
            unsafe { result::memcpy_dtod_async(target, source.pointer, len, device.stream) }
                .map_err(|e| driver_error("cuMemcpyDtoDAsync into a CUDA IPC mapping", e))?;
            device.synchronize("cuMemcpyDtoDAsync into a CUDA IPC mapping")
        }
        None => src.read_with(&mut |bytes| {
            // SAFETY: the target range lies inside the mapping (checked);
            // `bytes` stays borrowed until the synchronization below.
            unsafe { result::memcpy_htod_async(target, bytes, device.stream) }
                .map_err(|e| driver_error("cuMemcpyHtoDAsync into a CUDA IPC mapping", e))?;
            device.synchronize("cuMemcpyHtoDAsync into a CUDA IPC mapping")
        }),
    }
}
