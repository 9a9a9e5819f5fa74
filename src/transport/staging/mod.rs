//! Staging: a transfer's bytes pass through a bounded ring of host buffers
//! (`ring.rs`) on their way between device memory and the wire, chunk by
//! chunk, the device copies overlapping the wire (`pipeline.rs`). Device
//! memory is reached only through `DeviceCopy` (`copy.rs`), so the same
//! pipeline runs with a memcpy on CPU (`HostCopy`: what CI exercises, when
//! a client is created with `stage_host_transfers=true`) and with
//! asynchronous CUDA copies on a GPU (issue #38; not built yet).
//!
//! It lives in `transport/` because the transports drive it: a network
//! transport that claims a `StagedDestination` (found through
//! `WritableDestination::staged`) lands the wire's chunks through its
//! pipeline instead of writing the memory directly, and reports the bytes
//! in, the receipt applied, only once `receive` returned. The TCP transport
//! does so on both sides; UCX still writes staged destinations directly.
mod copy;
mod pipeline;
mod ring;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use copy::{check_range, CopyCompletion, DeviceCopy, HostCopy, HostSource, Pending};
pub use pipeline::{receive, send, Drain, Fill, Stop};
pub use ring::{Slot, StagingRing, SLOT_ALIGN};

use crate::status::{Result, Status};
use crate::transport::destination::WritableDestination;

/// `staging_chunk_bytes`, `staging_ring_depth`, `stage_host_transfers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per chunk (and per ring slot).
    pub chunk_bytes: usize,
    /// Slots per ring; a client has one ring per direction, so it holds at
    /// most 2 x chunk_bytes x ring_depth of staging memory.
    pub ring_depth: usize,
    /// Host destinations and sources over TCP stage through the rings too
    /// (to exercise the pipeline on CPU).
    pub stage_host_transfers: bool,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            // UCX's own pipeline stages GPU memory in 4 MiB fragments.
            chunk_bytes: 4 << 20,
            ring_depth: 4,
            stage_host_transfers: false,
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
        Ok(Arc::new(Staging {
            receive_ring: StagingRing::new(config.chunk_bytes, config.ring_depth)?,
            send_ring: StagingRing::new(config.chunk_bytes, config.ring_depth)?,
            config,
            staged: AtomicU64::new(0),
        }))
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
}

/// A receive destination whose bytes must land through the receive ring
/// and `device`'s copies. As a `WritableDestination` it is the host memory
/// (for a transport that does not stage: UCX today).
pub struct StagedDestination {
    memory: Arc<dyn WritableDestination>,
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

    /// `memory` reached through `device` (`memory` is what a transport
    /// that does not stage writes, and bounds what senders may claim).
    pub fn new(
        memory: Arc<dyn WritableDestination>,
        device: Arc<dyn DeviceCopy>,
        staging: Arc<Staging>,
    ) -> StagedDestination {
        StagedDestination {
            memory,
            device,
            staging,
            stop: Stop::new(),
        }
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

    /// The receive ended (any outcome): a pipeline still running stops.
    pub fn stop(&self, reason: Status) {
        self.stop.raise(reason);
    }
}

// SAFETY: the pointer and length are those of `memory`, itself a
// `WritableDestination` kept alive as long as this object.
unsafe impl WritableDestination for StagedDestination {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.memory.as_mut_ptr()
    }

    fn staged(&self) -> Option<&StagedDestination> {
        Some(self)
    }
}

#[cfg(test)]
mod tests;
