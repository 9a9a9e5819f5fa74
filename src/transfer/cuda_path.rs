//! The GPU data plane of the protocol: receive destinations in CUDA device
//! memory, exported as CUDA IPC handles, and the send path that copies into
//! them. `service.rs` calls in here from two marked hooks:
//!
//! - receive (`open_destination`): a destination on a CUDA device is a
//!   `cuMemAlloc` allocation whose IPC handle goes into the descriptor
//!   (`AllocationHandle::CudaIpc`, offset 0). When a receive succeeds its
//!   memory, once its buffer is gone, waits on the device's receive shelf
//!   for the next receive of the same size, handle unchanged
//!   (`CudaMemory::allocate_exported`);
//! - send (`copy_to_destination`): a sender on the same node maps the handle
//!   (`IpcImport`, shared per handle; after its last use the mapping waits
//!   on a shelf of idle mappings for the next send to that handle), copies
//!   device-to-device on its device's stream and waits for the copy; the
//!   service sets the completion key only after this returns, so the
//!   receiver never observes the key before the bytes are in its memory.
//!
//! Why the shelves: mapping another process's allocation
//! (`cuIpcOpenMemHandle`) costs hundreds of microseconds, more than the copy
//! itself up to hundreds of MiB on an H200, and a fresh allocation has a
//! fresh handle that every sender must map again. Reuse follows the rule of
//! the shared-memory pool: only memory whose receive succeeded is reused
//! (its sender's copy completed before the receipt); a cancelled, timed-out
//! or failed receive's memory is freed when its buffer goes.
//!
//! A process cannot open its own IPC handles, so destinations are also
//! registered here by handle, and a sender in the receiver's own process
//! (two clients in one process) copies into the allocation directly.
//!
//! Not done yet: destinations for a sender on another node. Those would stage
//! through pinned host memory onto the TCP transport; a CUDA receive that
//! would need one is refused with `UNIMPLEMENTED` when it is opened.
//!
//! Safe Rust only: the driver calls live in `backend/cuda/`.
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::descriptor::{AllocationHandle, Descriptor, CUDA_IPC_HANDLE_LEN};
use crate::backend::cuda::{self, CudaBackend, CudaMemory, IpcImport, IPC_HANDLE_LEN};
use crate::backend::{Allocation, DeviceMemory, DevicePlacement};
use crate::status::{self, Outcome, Result};

// The descriptor format and the driver agree on the handle size.
const _: () = assert!(CUDA_IPC_HANDLE_LEN == IPC_HANDLE_LEN);

type Handle = [u8; IPC_HANDLE_LEN];

/// CUDA receive destinations of this process, by IPC handle, for senders in
/// this same process.
static LOCAL_DESTINATIONS: Lazy<Mutex<HashMap<Handle, Weak<dyn DeviceMemory>>>> =
    Lazy::new(Default::default);

/// A receive destination in CUDA device memory.
pub struct CudaDestination {
    memory: Allocation,
    /// `None` for a zero-sized destination: nothing to map, nothing to copy.
    handle: Option<Handle>,
}

impl CudaDestination {
    /// The buffer's memory.
    pub fn memory(&self) -> Allocation {
        self.memory.clone()
    }

    /// What goes into the descriptor (all-zero handle bytes for a zero-sized
    /// destination; senders never map those).
    pub fn allocation_handle(&self) -> AllocationHandle {
        AllocationHandle::CudaIpc {
            handle: self.handle.unwrap_or([0; IPC_HANDLE_LEN]),
        }
    }

    /// Call once the receive has its terminal outcome: senders in this
    /// process can no longer find the destination. (Senders elsewhere may
    /// still hold a mapping; the memory itself lives as long as the buffer.)
    /// After a success the memory may be reused once its buffer is gone.
    pub fn release(&self, outcome: &Outcome) {
        if let Some(handle) = &self.handle {
            LOCAL_DESTINATIONS.lock().remove(handle);
        }
        if outcome.is_ok() {
            if let Some(cuda) = self.memory.as_cuda() {
                cuda.mark_reusable();
            }
        }
    }
}

/// Allocates a receive destination of `byte_size` bytes on `placement`'s
/// CUDA device and exports it. `use_tcp` (the sender is on another node, or
/// `transport=tcp`) is `UNIMPLEMENTED` for now.
pub fn open_destination(
    placement: &DevicePlacement,
    byte_size: usize,
    use_tcp: bool,
    function: &str,
) -> Result<CudaDestination> {
    if use_tcp {
        return Err(status::unimplemented(format!(
            "{function}: receiving into CUDA memory from another node (or with transport=tcp) is not \
             implemented yet (it needs staging through pinned host memory onto TCP); same-node \
             senders use CUDA IPC, or create the client with backend=host"
        )));
    }
    if byte_size == 0 {
        return Ok(CudaDestination {
            memory: placement.allocate(0)?,
            handle: None,
        });
    }
    if placement.backend.name() != "cuda" {
        return Err(status::internal(format!(
            "{function}: a CUDA destination on the {} backend",
            placement.backend.name()
        )));
    }
    let device = CudaBackend::get()?.device(placement.index)?.clone();
    let exported = CudaMemory::allocate_exported(device, byte_size, placement.counters.clone())?;
    let handle = exported.ipc_handle()?;
    let memory: Allocation = Arc::new(exported);
    LOCAL_DESTINATIONS
        .lock()
        .insert(handle, Arc::downgrade(&memory));
    Ok(CudaDestination {
        memory,
        handle: Some(handle),
    })
}

/// Copies all of `source` into the CUDA IPC destination `descriptor` names
/// and returns once the bytes are there. The caller has validated the
/// descriptor against the source (byte size, type, dims).
pub fn copy_to_destination(
    source: &Allocation,
    descriptor: &Descriptor,
    function: &str,
) -> Outcome {
    let AllocationHandle::CudaIpc { handle } = &descriptor.allocation else {
        return Err(status::invalid_argument(format!(
            "{function}: not a CUDA IPC descriptor"
        )));
    };
    if source.len() as u64 != descriptor.byte_size {
        return Err(status::invalid_argument(format!(
            "{function}: the source has {} bytes, the destination {}",
            source.len(),
            descriptor.byte_size
        )));
    }
    let offset = usize::try_from(descriptor.offset).map_err(|_| {
        status::invalid_argument(format!(
            "{function}: destination offset {} does not fit this machine",
            descriptor.offset
        ))
    })?;
    if descriptor.byte_size == 0 {
        return Ok(());
    }
    if !descriptor.host.is_local()? {
        return Err(status::failed_precondition(format!(
            "{function}: the destination is CUDA memory on host {}; CUDA IPC only reaches this node \
             (cross-node GPU transfers are not implemented yet)",
            descriptor.host.hostname
        )));
    }
    if descriptor.process_id == std::process::id() {
        return copy_within_process(source, handle, offset, function);
    }
    let device = match source.as_cuda() {
        Some(cuda) => cuda.device().clone(),
        // A host-memory source (host-backend sender) copies from host memory
        // through this process's first CUDA device.
        None => CudaBackend::get()
            .map_err(|e| {
                status::failed_precondition(format!(
                    "{function}: the destination is CUDA memory but this process has no CUDA: {}",
                    e.message
                ))
            })?
            .device(0)?
            .clone(),
    };
    let import = IpcImport::open(&device, handle)
        .map_err(|e| status::Status::new(e.code, format!("{function}: {}", e.message)))?;
    crate::timeline!(
        "send to {}: CUDA IPC handle mapped",
        descriptor.completion_key
    );
    cuda::copy_into_import(&**source, &import, offset)
        .map_err(|e| status::Status::new(e.code, format!("{function}: {}", e.message)))?;
    crate::timeline!("send to {}: CUDA copy done", descriptor.completion_key);
    Ok(())
}

fn copy_within_process(
    source: &Allocation,
    handle: &Handle,
    offset: usize,
    function: &str,
) -> Outcome {
    let destination = LOCAL_DESTINATIONS
        .lock()
        .get(handle)
        .and_then(Weak::upgrade)
        .ok_or_else(|| {
            status::not_found(format!(
                "{function}: no CUDA destination of this process has this IPC handle (already \
                 completed, cancelled or freed)"
            ))
        })?;
    let dst = destination.as_cuda().ok_or_else(|| {
        status::internal(format!(
            "{function}: a registered CUDA destination is not CUDA memory"
        ))
    })?;
    match source.as_cuda() {
        Some(src) => cuda::copy_device_to_device(src, dst, offset),
        None => source.read_with(&mut |bytes| dst.write(offset, bytes)),
    }
}

/// Number of CUDA destinations senders in this process can still reach
/// (for tests: each is removed when its receive completes).
pub fn local_destinations() -> usize {
    LOCAL_DESTINATIONS
        .lock()
        .values()
        .filter(|w| w.strong_count() > 0)
        .count()
}
