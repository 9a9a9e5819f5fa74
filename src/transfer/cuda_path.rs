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
//! A sender on another node (or `transport=tcp|ucx`): the destination is a
//! plain allocation offered over the network transport, landed through the
//! client's staging ring of pinned buffers (`transport/staging/`, the
//! device's copies by `CudaCopy`): the TCP server or UCX lands each chunk in
//! a ring slot and copies it host-to-device on the device's stream, and the
//! receipt is applied only once the last copy completed
//! (`staging_path::landing` decides). Its memory is never reused: a copy
//! that may still run after a failed receive keeps it (the copy's
//! completion holds it) and its slot is parked.
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
use crate::transport::auth_token::AuthToken;
use crate::transport::registry::DestinationRegistry;
use crate::transport::staging::{CudaCopy, StagedDestination, Staging};

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
    /// Offered over a network transport: staged through the ring.
    offer: Option<StagedOffer>,
}

/// A CUDA destination as a network transport reaches it.
struct StagedOffer {
    token: AuthToken,
    registry: Arc<DestinationRegistry>,
    allocation: AllocationHandle,
    staged: Arc<StagedDestination>,
}

/// Where a network transport may reach a CUDA destination (the sender is
/// on another node, or `transport=tcp|ucx`).
pub struct NetworkRoute<'a> {
    pub registry: &'a Arc<DestinationRegistry>,
    pub token: AuthToken,
    /// What the descriptor names (the TCP server, or the UCX process with
    /// the staging chunk size).
    pub allocation: AllocationHandle,
    /// The completion key, when this process holds it.
    pub completion_key: Option<String>,
    /// The client's staging rings (pinned).
    pub staging: Option<Arc<Staging>>,
}

impl CudaDestination {
    /// The buffer's memory.
    pub fn memory(&self) -> Allocation {
        self.memory.clone()
    }

    /// What goes into the descriptor (all-zero handle bytes for a zero-sized
    /// destination; senders never map those).
    pub fn allocation_handle(&self) -> AllocationHandle {
        if let Some(offer) = &self.offer {
            return offer.allocation.clone();
        }
        AllocationHandle::CudaIpc {
            handle: self.handle.unwrap_or([0; IPC_HANDLE_LEN]),
        }
    }

    /// Whether its bytes land through the staging ring.
    pub fn is_staged(&self) -> bool {
        self.offer.is_some()
    }

    /// Call once the receive has its terminal outcome: senders in this
    /// process can no longer find the destination. (Senders elsewhere may
    /// still hold a mapping; the memory itself lives as long as the buffer.)
    /// After a success the memory may be reused once its buffer is gone.
    pub fn release(&self, outcome: &Outcome) {
        if let Some(offer) = &self.offer {
            // No sender may claim it any more, and a pipeline still landing
            // chunks stops (copies in flight keep the memory until done).
            offer.registry.unregister(&offer.token);
            offer.staged.stop(match outcome {
                Err(reason) => reason.clone(),
                Ok(()) => status::cancelled("the receive already completed"),
            });
            return;
        }
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
/// CUDA device: exported as a CUDA IPC handle for a sender on this node
/// (`network` is `None`), else offered over `network`, staged.
pub fn open_destination(
    placement: &DevicePlacement,
    byte_size: usize,
    network: Option<NetworkRoute<'_>>,
    function: &str,
) -> Result<CudaDestination> {
    if let Some(network) = network {
        return open_staged(placement, byte_size, network, function);
    }
    if byte_size == 0 {
        return Ok(CudaDestination {
            memory: placement.allocate(0)?,
            handle: None,
            offer: None,
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
        offer: None,
    })
}

/// A destination for a sender on another node: device memory landed
/// through the staging ring by whichever network transport `network` names.
fn open_staged(
    placement: &DevicePlacement,
    byte_size: usize,
    network: NetworkRoute<'_>,
    function: &str,
) -> Result<CudaDestination> {
    let staging = network.staging.ok_or_else(|| {
        status::failed_precondition(format!(
            "{function}: a CUDA buffer from another node lands through pinned staging buffers, \
             and this client has none (see the log for why they could not be made)"
        ))
    })?;
    let memory = if byte_size == 0 {
        placement.allocate(0)?
    } else {
        if placement.backend.name() != "cuda" {
            return Err(status::internal(format!(
                "{function}: a CUDA destination on the {} backend",
                placement.backend.name()
            )));
        }
        let device = CudaBackend::get()?.device(placement.index)?.clone();
        let memory: Allocation = Arc::new(CudaMemory::allocate(
            device,
            byte_size,
            placement.counters.clone(),
        )?);
        memory
    };
    let device: Arc<dyn crate::transport::staging::DeviceCopy> = if byte_size == 0 {
        // Nothing to copy: an empty host range stands in.
        Arc::new(crate::transport::staging::HostCopy::new(Arc::new(
            crate::transport::destination::HeapDestination::new(0),
        )))
    } else {
        Arc::new(CudaCopy::new(memory.clone())?)
    };
    let staged = Arc::new(StagedDestination::device(device, staging));
    network
        .registry
        .register_with_key(network.token, staged.clone(), network.completion_key)?;
    Ok(CudaDestination {
        memory,
        handle: None,
        offer: Some(StagedOffer {
            token: network.token,
            registry: network.registry.clone(),
            allocation: network.allocation,
            staged,
        }),
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
