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
//! for later. The one exception is staging (`async_copy.rs`, `pinned.rs`):
//! a chunk's copy between device memory and a pinned ring buffer returns
//! at once with its own completion, for the staging pipeline of
//! `transport/staging/` to overlap with the wire.
//!
//! Same-node transfers: a receiver exports a destination with
//! `CudaMemory::ipc_handle` (`cuIpcGetMemHandle`); a sender in another
//! process maps it with `IpcImport::open` (`cuIpcOpenMemHandle`, one mapping
//! per handle and device, shared by concurrent users and closed when the last
//! one drops) and copies into it with `copy_into_import`.
mod async_copy;
mod device;
mod ipc_import;
mod memory;
mod pinned;
mod probe;
mod shelf;

use std::fmt;
use std::sync::Arc;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use once_cell::sync::OnceCell;

use crate::backend::{Allocation, Backend, DeviceMemory, DriverMemoryInfo, MemoryCounters};
use crate::pjrt::named_values::NamedValue;
use crate::status::panic_message;
use crate::status::{self, Code, Result, Status};

pub use async_copy::*;
pub use device::*;
pub use ipc_import::*;
pub use memory::*;
pub use pinned::*;
use probe::probe;
use shelf::Shelf;

/// Length of a `CUipcMemHandle`.
pub const IPC_HANDLE_LEN: usize = 64;

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
