//! Staging: a transfer's bytes pass through a bounded ring of host buffers
//! (`ring.rs`) on their way between device memory and the wire, chunk by
//! chunk, the device copies overlapping the wire (`pipeline.rs`). Device
//! memory is reached only through `DeviceCopy` (`copy.rs`), so the same
//! pipeline runs with a memcpy on CPU (`HostCopy`: what CI exercises, when
//! a client is created with `stage_host_transfers=true`) and with
//! asynchronous CUDA copies into pinned ring buffers on a GPU (`CudaCopy`,
//! `cuda_copy.rs`, over `backend/cuda/`'s `async_copy.rs` and `pinned.rs`).
//!
//! It lives in `transport/` because the transports drive it: a network
//! transport that claims a `StagedDestination` (found through
//! `WritableDestination::staged`) lands the wire's chunks through its
//! pipeline instead of writing the memory directly, and reports the bytes
//! in, the receipt applied, only once `receive` returned. Both network
//! transports do so: TCP over its byte stream (`receive`), UCX chunk by
//! chunk, one message each (`receive_chunks`, `transport/ucx/stream.rs`).
mod copy;
mod cuda_copy;
mod pipeline;
mod ring;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use copy::{check_range, CopyCompletion, DeviceCopy, HostCopy, HostSource, Pending};
pub use cuda_copy::CudaCopy;
pub use pipeline::{
    receive, receive_chunks, send, send_async, AsyncDrain, ChunkSource, Drain, Fill, Stop,
};
pub use ring::{Slot, SlotMemory, StagingRing, SLOT_ALIGN};

use crate::status::{Result, Status};
use crate::transport::destination::WritableDestination;

/// `staging_chunk_bytes`, `staging_ring_depth`, `stage_host_transfers`,
/// `max_pinned_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per chunk (and per ring slot).
    pub chunk_bytes: usize,
    /// Slots per ring; a client has one ring per direction, so it holds at
    /// most 2 x chunk_bytes x ring_depth of staging memory.
    pub ring_depth: usize,
    /// Host destinations and sources over TCP and UCX stage through the
    /// rings too (to exercise the pipeline on CPU).
    pub stage_host_transfers: bool,
    /// The rings' slots are pinned memory (a client with CUDA devices).
    pub pinned: bool,
    /// Bound on the pinned memory the process holds, all clients' rings
    /// together.
    pub max_pinned_bytes: usize,
}

/// Default of `max_pinned_bytes`: the rings of four clients at the default
/// chunk and depth (2 x 4 MiB x 4 each).
pub const DEFAULT_MAX_PINNED_BYTES: usize = 128 << 20;

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            // UCX's own pipeline stages GPU memory in 4 MiB fragments.
            chunk_bytes: 4 << 20,
            ring_depth: 4,
            stage_host_transfers: false,
            pinned: false,
            max_pinned_bytes: DEFAULT_MAX_PINNED_BYTES,
        }
    }
}

impl StagingConfig {
    /// What the rings' slots are made of.
    pub fn slot_memory(&self) -> SlotMemory {
        if self.pinned {
            SlotMemory::Pinned {
                bound: self.max_pinned_bytes,
            }
        } else {
            SlotMemory::Heap
        }
    }
}

/// A client's staging: its two rings and what it counts.
pub struct Staging {
    pub config: StagingConfig,
    receive_ring: StagingRing,
    send_ring: StagingRing,
    staged: AtomicU64,
}

impl Staging {
    pub fn new(config: StagingConfig) -> Result<Arc<Staging>> {
        let memory = config.slot_memory();
        Ok(Arc::new(Staging {
            receive_ring: StagingRing::with_memory(config.chunk_bytes, config.ring_depth, memory)?,
            send_ring: StagingRing::with_memory(config.chunk_bytes, config.ring_depth, memory)?,
            config,
            staged: AtomicU64::new(0),
        }))
    }

    /// Bytes per chunk (what a receiver's ring slot holds).
    pub fn chunk_bytes(&self) -> usize {
        self.config.chunk_bytes
    }

    /// Transfers (either side) that went through a pipeline to the end.
    pub fn staged(&self) -> u64 {
        self.staged.load(Ordering::Relaxed)
    }

    /// Staging memory allocated now, both rings.
    pub fn bytes_held(&self) -> usize {
        self.receive_ring.held_bytes() + self.send_ring.held_bytes()
    }

    pub fn receive_ring(&self) -> &StagingRing {
        &self.receive_ring
    }

    pub fn send_ring(&self) -> &StagingRing {
        &self.send_ring
    }

    /// Sends `len` bytes of `device` from `offset` to `wire` through the
    /// send ring (`pipeline::send`).
    pub fn send(
        &self,
        device: &dyn DeviceCopy,
        offset: usize,
        len: usize,
        wire: &mut Drain<'_>,
        stop: &Stop,
        patience: Duration,
    ) -> Result<usize> {
        let chunks = send(&self.send_ring, device, offset, len, wire, stop, patience)?;
        self.staged.fetch_add(1, Ordering::Relaxed);
        Ok(chunks)
    }

    /// `send` over a wire that may read a chunk's slot after it returned
    /// (`pipeline::send_async`).
    pub fn send_async(
        &self,
        device: &dyn DeviceCopy,
        offset: usize,
        len: usize,
        wire: &mut AsyncDrain<'_>,
        stop: &Stop,
        patience: Duration,
    ) -> Result<usize> {
        let chunks = send_async(&self.send_ring, device, offset, len, wire, stop, patience)?;
        self.staged.fetch_add(1, Ordering::Relaxed);
        Ok(chunks)
    }
}

/// A receive destination whose bytes must land through the receive ring
/// and `device`'s copies. As a `WritableDestination` it is `device`'s
/// length, and its host memory where it has some (none for device memory:
/// its pointer is null, and every transport lands it through `receive`).
pub struct StagedDestination {
    memory: Option<Arc<dyn WritableDestination>>,
    device: Arc<dyn DeviceCopy>,
    staging: Arc<Staging>,
    stop: Stop,
}

impl StagedDestination {
    /// Host memory reached through `HostCopy`.
    pub fn host(memory: Arc<dyn WritableDestination>, staging: Arc<Staging>) -> StagedDestination {
        let device = Arc::new(HostCopy::new(memory.clone()));
        StagedDestination::new(memory, device, staging)
    }

    /// Host `memory` reached through `device` (a test's copier).
    pub fn new(
        memory: Arc<dyn WritableDestination>,
        device: Arc<dyn DeviceCopy>,
        staging: Arc<Staging>,
    ) -> StagedDestination {
        StagedDestination {
            memory: Some(memory),
            device,
            staging,
            stop: Stop::new(),
        }
    }

    /// Device memory, reached only through `device` (`CudaCopy`).
    pub fn device(device: Arc<dyn DeviceCopy>, staging: Arc<Staging>) -> StagedDestination {
        StagedDestination {
            memory: None,
            device,
            staging,
            stop: Stop::new(),
        }
    }

    /// The most a chunk may carry: one receive-ring slot.
    pub fn chunk_bytes(&self) -> usize {
        self.staging.receive_ring.chunk_bytes()
    }

    /// Lands `len` bytes at `offset` from `wire`; returns once the last
    /// chunk's copy completed (`pipeline::receive`).
    pub fn receive(
        &self,
        offset: usize,
        len: usize,
        wire: &mut Fill<'_>,
        patience: Duration,
    ) -> Result<usize> {
        let chunks = receive(
            &self.staging.receive_ring,
            &*self.device,
            offset,
            len,
            wire,
            &self.stop,
            patience,
        )?;
        self.staging.staged.fetch_add(1, Ordering::Relaxed);
        Ok(chunks)
    }

    /// Lands `len` bytes at `offset` from a source that brings them in
    /// chunks of its own length (at most `chunk_bytes`); returns once the
    /// last chunk's copy completed (`pipeline::receive_chunks`).
    pub fn receive_chunks(
        &self,
        offset: usize,
        len: usize,
        source: &mut dyn ChunkSource,
        patience: Duration,
    ) -> Result<usize> {
        let chunks = receive_chunks(
            &self.staging.receive_ring,
            &*self.device,
            offset,
            len,
            source,
            &self.stop,
            patience,
        )?;
        self.staging.staged.fetch_add(1, Ordering::Relaxed);
        Ok(chunks)
    }

    /// The receive ended (any outcome): a pipeline still running stops.
    pub fn stop(&self, reason: Status) {
        self.stop.raise(reason);
    }

    /// The stop a pipeline landing this destination looks at.
    pub fn stop_signal(&self) -> &Stop {
        &self.stop
    }
}

// SAFETY: the length is the device memory's; the pointer is that of
// `memory`, itself a `WritableDestination` kept alive as long as this
// object, or null where there is no host memory, which the trait's
// contract allows for a staged destination (never written through it).
unsafe impl WritableDestination for StagedDestination {
    fn len(&self) -> usize {
        self.device.len()
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.memory
            .as_ref()
            .map_or(std::ptr::null_mut(), |memory| memory.as_mut_ptr())
    }

    fn staged(&self) -> Option<&StagedDestination> {
        Some(self)
    }
}

#[cfg(test)]
mod tests;
