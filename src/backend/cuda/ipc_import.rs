//! IPC imports (sender side): a receiver's exported memory mapped into this
//! process, one mapping per handle and device, shared by concurrent users,
//! and kept on a shelf of idle mappings after its last use: receivers reuse
//! exported memory (the receive shelf, `CudaMemory::allocate_exported`), so
//! the next send to the same handle finds it mapped.
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
    device: Arc<CudaDevice>,
    pointer: sys::CUdeviceptr,
    len: usize,
    users: usize,
}

/// This process's IPC mappings. A handle opened twice in one context is an
/// error for the driver, so concurrent users share one mapping (`in_use`);
/// after the last one it moves to `idle` until a send to that handle takes
/// it back or the shelf's bound closes it. A receiver frees memory another
/// process may still have on its idle shelf only when the memory leaves its
/// own receive shelf or its receive failed; the driver keeps memory a
/// mapping still holds until that mapping is closed, so the idle shelf's
/// bound also bounds what it keeps of other processes' freed memory.
struct Imports {
    in_use: HashMap<ImportKey, ImportEntry>,
    idle: Option<Shelf<ImportKey, ImportEntry>>,
}

impl Imports {
    fn idle(&mut self, device: &CudaDevice) -> &mut Shelf<ImportKey, ImportEntry> {
        self.idle
            .get_or_insert_with(|| Shelf::new(reuse_bound(device.total_memory)))
    }
}

static IMPORTS: Lazy<Mutex<Imports>> = Lazy::new(|| {
    Mutex::new(Imports {
        in_use: HashMap::new(),
        idle: None,
    })
});

/// Closes mappings no user holds (off the shelf already).
fn close_all(entries: Vec<ImportEntry>) {
    for entry in entries {
        let closed = entry.device.activate().and_then(|()| {
            // SAFETY: opened by cuIpcOpenMemHandle in `open`; no user holds
            // it (it left the idle shelf) and every copy into it was
            // synchronized before its user let go.
            unsafe { sys::cuIpcCloseMemHandle(entry.pointer) }
                .result()
                .map_err(|e| driver_error("cuIpcCloseMemHandle", e))
        });
        if let Err(e) = closed {
            log::error!("closing a CUDA IPC mapping: {e}");
        }
    }
}

/// Another process's allocation, mapped into this process through its IPC
/// handle on one of our devices. Back on the idle shelf when the last user
/// drops it.
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
        if let Some(entry) = imports.in_use.get_mut(&key) {
            entry.users += 1;
            return Ok(IpcImport {
                device: device.clone(),
                key,
                pointer: entry.pointer,
                len: entry.len,
            });
        }
        if let Some(mut entry) = imports.idle(device).take(&key) {
            entry.users = 1;
            let import = IpcImport {
                device: device.clone(),
                key,
                pointer: entry.pointer,
                len: entry.len,
            };
            imports.in_use.insert(key, entry);
            return Ok(import);
        }
        device.activate()?;
        let pointer = match map_handle(handle) {
            // An idle mapping may be what stands in the way: a mapping of
            // memory its exporter freed, whose address range a new
            // allocation of the exporter now reuses, or simply resources.
            // Close them all and try once more.
            Err(e) if !imports.idle(device).is_empty() => {
                let idle = imports.idle(device).drain();
                log::info!(
                    "mapping a CUDA IPC handle failed ({}); closing {} idle mappings and trying again",
                    driver_error("cuIpcOpenMemHandle", e).message,
                    idle.len()
                );
                close_all(idle);
                device.activate()?;
                map_handle(handle)
            }
            other => other,
        }
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
        imports.in_use.insert(
            key,
            ImportEntry {
                device: device.clone(),
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
        let Some(entry) = imports.in_use.get_mut(&self.key) else {
            return;
        };
        entry.users -= 1;
        if entry.users > 0 {
            return;
        }
        let Some(entry) = imports.in_use.remove(&self.key) else {
            return;
        };
        let evicted = imports.idle(&self.device).put(self.key, entry.len, entry);
        drop(imports);
        close_all(evicted);
    }
}

/// `cuIpcOpenMemHandle` of `handle` in the current context.
fn map_handle(
    handle: &[u8; IPC_HANDLE_LEN],
) -> std::result::Result<sys::CUdeviceptr, result::DriverError> {
    let raw = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as _),
    };
    let mut pointer: sys::CUdeviceptr = 0;
    // SAFETY: `pointer` is a valid out-parameter; the driver validates the
    // handle bytes (a forged handle is an error, not a mapping).
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut pointer,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()?;
    Ok(pointer)
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
