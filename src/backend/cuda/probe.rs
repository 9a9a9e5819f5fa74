//! The driver probe: the library and every symbol this backend uses are
//! checked before the first driver call, and the probe runs once.
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use crate::status::{self, Result, Status};

use super::*;

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
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuLaunchHostFunc",
];

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

pub(super) fn probe() -> std::result::Result<Arc<CudaBackend>, Status> {
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
