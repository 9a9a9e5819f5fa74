//! CUDA backend: device memory from `cuMemAlloc`, through cudarc's driver
//! API with the driver library loaded at run time.
//!
//! Availability. cudarc's dynamic loading panics when `libcuda` or one of
//! its symbols is missing, so the probe first asks cudarc whether the library
//! loads at all, then looks up every driver symbol this file uses, and runs
//! the whole probe under `catch_unwind` as a last guard. Any failure makes
//! the backend unavailable with a reason; it never aborts the process and
//! never fails the plugin's load. The probe runs once per process; devices,
//! their primary contexts and streams live for the rest of the process
//! (several clients share them).
//!
//! Ordering. Each device has one stream. Every copy here is enqueued on that
//! stream and followed by a stream synchronization before the call returns,
//! so a `DeviceMemory` call is complete when it returns, exactly like the
//! host backend, and buffer definition events stay the only ordering
//! mechanism above this layer. Asynchronous completion (events or
//! `cuLaunchHostFunc` feeding the definition futures) would overlap copies
//! with the caller but needs plumbing through the event layer; it is left
//! for later.
//!
//! Same-node transfers: a receiver exports a destination with
//! `CudaMemory::ipc_handle` (`cuIpcGetMemHandle`); a sender in another
//! process maps it with `IpcImport::open` (`cuIpcOpenMemHandle`, one mapping
//! per handle and device, shared by concurrent users and closed when the last
//! one drops) and copies into it with `copy_into_import`.
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::{Allocation, Backend, DeviceMemory, DriverMemoryInfo, MemoryCounters};
use crate::pjrt::named_values::NamedValue;
use crate::status::{self, Code, Result, Status};

/// Length of a `CUipcMemHandle`.
pub const IPC_HANDLE_LEN: usize = 64;

/// Every driver entry point this file reaches through cudarc (the names
/// cudarc's `sys` module resolves). Checked at probe time, so that a driver
/// too old for one of them makes the backend unavailable instead of
/// panicking later inside cudarc's lazy symbol lookup.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemGetInfo_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
];

/// A driver error as a `Status`: out-of-memory is `RESOURCE_EXHAUSTED`,
/// anything else `INTERNAL`, with the driver's name for the error.
fn driver_error(what: &str, error: DriverError) -> Status {
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", error.0 as u32));
    let code = match error.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Code::ResourceExhausted,
        _ => Code::Internal,
    };
    Status::new(code, format!("{what} failed: {name}"))
}

fn unavailable_error(what: &str, error: DriverError) -> Status {
    let e = driver_error(what, error);
    status::unavailable(e.message)
}

/// One CUDA device: its primary context and its stream.
pub struct CudaDevice {
    ordinal: i32,
    context: sys::CUcontext,
    stream: sys::CUstream,
    name: String,
    compute_capability: (i32, i32),
    multiprocessors: i32,
    total_memory: usize,
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
    fn open(ordinal: i32) -> Result<CudaDevice> {
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
        })
    }

    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes this device's context current on the calling thread (cheap when
    /// it already is).
    fn activate(&self) -> Result<()> {
        // SAFETY: the primary context was retained at open and is never
        // released, so it is valid for the process's life.
        unsafe { result::ctx::set_current(self.context) }
            .map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    /// Waits for everything enqueued on this device's stream.
    fn synchronize(&self, what: &str) -> Result<()> {
        // SAFETY: the stream was created at open and is never destroyed.
        unsafe { result::stream::synchronize(self.stream) }
            .map_err(|e| driver_error(&format!("cuStreamSynchronize after {what}"), e))
    }

    fn memory_info(&self) -> Result<DriverMemoryInfo> {
        self.activate()?;
        let (free_bytes, total_bytes) =
            result::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))?;
        Ok(DriverMemoryInfo {
            free_bytes,
            total_bytes,
        })
    }
}

/// The process's CUDA devices. Obtained through `CudaBackend::get`, which
/// probes the driver once.
pub struct CudaBackend {
    devices: Vec<Arc<CudaDevice>>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("devices", &self.devices)
            .finish()
    }
}

static BACKEND: OnceCell<std::result::Result<Arc<CudaBackend>, Status>> = OnceCell::new();

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Checks that the driver library loads and has every symbol we use.
fn check_driver_library() -> Result<()> {
    // SAFETY: only tries to load the library (libloading); no driver call.
    if !unsafe { sys::is_culib_present() } {
        return Err(status::unavailable(
            "no CUDA driver library (libcuda.so / libcuda.so.1) could be loaded",
        ));
    }
    // SAFETY: the library is present (checked above), so cudarc's loader
    // returns it instead of panicking.
    let library = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up, never called through this
        // (wrongly typed but unused) function pointer type.
        .filter(|name| unsafe { library.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(status::unavailable(format!(
            "the CUDA driver library lacks {missing:?} (driver too old?)"
        )));
    }
    Ok(())
}

fn probe() -> std::result::Result<Arc<CudaBackend>, Status> {
    check_driver_library()?;
    result::init().map_err(|e| unavailable_error("cuInit", e))?;
    let count =
        result::device::get_count().map_err(|e| unavailable_error("cuDeviceGetCount", e))?;
    if count <= 0 {
        return Err(status::unavailable("the CUDA driver reports no devices"));
    }
    let devices = (0..count)
        .map(|ordinal| CudaDevice::open(ordinal).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    for d in &devices {
        log::info!(
            "CUDA device {}: {} (compute capability {}.{}, {} bytes)",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.total_memory
        );
    }
    Ok(Arc::new(CudaBackend { devices }))
}

impl CudaBackend {
    /// The process's CUDA backend, or `UNAVAILABLE` with the reason (no
    /// driver library, missing symbols, `cuInit` failure, no device). The
    /// probe runs once; its outcome is remembered.
    pub fn get() -> Result<Arc<CudaBackend>> {
        BACKEND
            .get_or_init(|| match std::panic::catch_unwind(probe) {
                Ok(outcome) => outcome,
                Err(panic) => Err(status::unavailable(format!(
                    "the CUDA driver probe panicked: {}",
                    panic_message(&*panic)
                ))),
            })
            .clone()
    }

    /// Why CUDA is unavailable, or `None` when it is available.
    pub fn unavailable_reason() -> Option<String> {
        CudaBackend::get().err().map(|e| e.message)
    }

    pub fn device(&self, index: usize) -> Result<&Arc<CudaDevice>> {
        self.devices.get(index).ok_or_else(|| {
            status::invalid_argument(format!(
                "CUDA backend has {} devices, no device {index}",
                self.devices.len()
            ))
        })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn is_host(&self) -> bool {
        false
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn device_kind(&self, index: usize) -> String {
        self.devices
            .get(index)
            .map(|d| d.name.clone())
            .unwrap_or_else(|| "cuda".to_string())
    }

    fn device_attributes(&self, index: usize) -> Vec<(String, NamedValue)> {
        let Some(d) = self.devices.get(index) else {
            return Vec::new();
        };
        let (major, minor) = d.compute_capability;
        vec![
            (
                "compute_capability".into(),
                NamedValue::Str(format!("{major}.{minor}")),
            ),
            (
                "compute_capability_major".into(),
                NamedValue::Int(major as i64),
            ),
            (
                "compute_capability_minor".into(),
                NamedValue::Int(minor as i64),
            ),
            (
                "total_memory_bytes".into(),
                NamedValue::Int(d.total_memory as i64),
            ),
            (
                "core_count".into(),
                NamedValue::Int(d.multiprocessors as i64),
            ),
            (
                "cuda_device_ordinal".into(),
                NamedValue::Int(d.ordinal as i64),
            ),
        ]
    }

    fn allocate(
        &self,
        index: usize,
        bytes: usize,
        counters: Arc<MemoryCounters>,
    ) -> Result<Allocation> {
        Ok(Arc::new(CudaMemory::allocate(
            self.device(index)?.clone(),
            bytes,
            counters,
        )?))
    }

    fn copy(&self, src: &dyn DeviceMemory, dst: &dyn DeviceMemory) -> Result<()> {
        if src.len() != dst.len() {
            return Err(status::invalid_argument(format!(
                "copy of a {}-byte allocation into a {}-byte one",
                src.len(),
                dst.len()
            )));
        }
        match (src.as_cuda(), dst.as_cuda()) {
            (Some(s), Some(d)) => copy_device_to_device(s, d, 0),
            _ => src.read_with(&mut |bytes| dst.write(0, bytes)),
        }
    }

    fn memory_info(&self, index: usize) -> Option<DriverMemoryInfo> {
        let device = self.devices.get(index)?;
        match device.memory_info() {
            Ok(info) => Some(info),
            Err(e) => {
                log::warn!("memory info of CUDA device {index}: {e}");
                None
            }
        }
    }
}

/// One `cuMemAlloc` allocation, zero-initialised, freed when dropped (that
/// is, when the last buffer or transfer holding it lets go).
pub struct CudaMemory {
    device: Arc<CudaDevice>,
    /// 0 for a zero-sized allocation (the driver refuses those).
    pointer: sys::CUdeviceptr,
    len: usize,
    counters: Arc<MemoryCounters>,
    ipc_handle: OnceCell<[u8; IPC_HANDLE_LEN]>,
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
            device.activate()?;
            // SAFETY: a plain allocation in the (current) primary context;
            // the pointer is owned by the returned object and freed in drop.
            let pointer = unsafe { result::malloc_sync(len) }.map_err(|e| {
                driver_error(
                    &format!("cuMemAlloc of {len} bytes on device {}", device.ordinal),
                    e,
                )
            })?;
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
        })
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    fn check(&self, offset: usize, n: usize, what: &str) -> Result<()> {
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
        if self.pointer != 0 {
            // Every copy of this process touching the allocation was
            // synchronized before its call returned, so nothing is in flight
            // on our streams. A sender in another process that still has the
            // allocation mapped through IPC is not waited for: the receive
            // holds the memory until its outcome is published (a sender's
            // bytes land before its receipt), but after a cancellation or a
            // timeout the buffer may be freed while a late sender still
            // copies; what the driver does then is not documented.
            let freed = self.device.activate().and_then(|()| {
                // SAFETY: allocated by cuMemAlloc in `allocate`, freed only
                // here, no copy in flight (see above).
                unsafe { result::memory_free(self.pointer) }
                    .map_err(|e| driver_error("cuMemFree", e))
            });
            if let Err(e) = freed {
                log::error!("freeing {} CUDA bytes: {e}", self.len);
            }
        }
        self.counters.freed(self.len);
    }
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

// --------------------------- IPC imports (sender) ----------------------------

type ImportKey = ([u8; IPC_HANDLE_LEN], i32);

struct ImportEntry {
    pointer: sys::CUdeviceptr,
    len: usize,
    users: usize,
}

/// Open IPC mappings of this process, by handle and importing device. A
/// handle opened twice in one context is an error for the driver, so
/// concurrent users share one mapping; the last one closes it.
static IMPORTS: Lazy<Mutex<HashMap<ImportKey, ImportEntry>>> = Lazy::new(Default::default);

/// Another process's allocation, mapped into this process through its IPC
/// handle on one of our devices. Closed when the last user drops it.
pub struct IpcImport {
    device: Arc<CudaDevice>,
    key: ImportKey,
    pointer: sys::CUdeviceptr,
    len: usize,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_explains_unavailability() {
        match CudaBackend::get() {
            Ok(backend) => assert!(backend.device_count() > 0),
            Err(e) => {
                assert_eq!(e.code, Code::Unavailable);
                assert!(!e.message.is_empty());
                // The outcome is remembered, not re-probed.
                assert_eq!(CudaBackend::get().unwrap_err(), e);
            }
        }
    }
}
