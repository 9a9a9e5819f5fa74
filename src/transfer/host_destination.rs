//! Receive destinations in host memory: a lease of the receiver's pool of
//! pre-faulted shared memory, offered to a sender on this host by name (it
//! writes the mapping directly) or to a sender elsewhere through a network
//! transport, the TCP receive server or UCX (single-use token). The GPU counterpart is
//! `cuda_path::CudaDestination`; `service.rs` treats both as `Destination`.
use std::collections::HashMap;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::cuda_path::CudaDestination;
use super::descriptor::AllocationHandle;
use super::memory_budget::BudgetLease;
use crate::backend::{Allocation, MemoryCounters};
use crate::status::{Outcome, Result};
use crate::transport::auth_token::AuthToken;
use crate::transport::claim::ClaimRange;
use crate::transport::destination::WritableDestination;
use crate::transport::registry::DestinationRegistry;
use crate::transport::shm::SharedRegion;
use crate::transport::shm_device_memory::SharedHostMemory;
use crate::transport::shm_pool::{ShmLease, ShmPool};
use crate::transport::staging::{StagedDestination, Staging};

/// Receive destinations of this process, by shared-memory name, so that a
/// sender in the same process writes them directly instead of mapping them
/// a second time.
static LOCAL_REGIONS: Lazy<Mutex<HashMap<String, Weak<SharedRegion>>>> =
    Lazy::new(Default::default);

/// This process's own destination region called `name`, if it is one.
pub fn local_region(name: &str) -> Option<Arc<SharedRegion>> {
    LOCAL_REGIONS.lock().get(name).and_then(Weak::upgrade)
}

fn register_local(region: &Arc<SharedRegion>) {
    let mut local = LOCAL_REGIONS.lock();
    if local.len() > 64 {
        local.retain(|_, r| r.strong_count() > 0);
    }
    local.insert(region.name().to_string(), Arc::downgrade(region));
}

/// How the sender will reach a host destination.
pub enum HostRoute<'a> {
    /// Same host: the shared-memory object by name.
    SharedMemory,
    /// Another host (or `transport=tcp|ucx`): a network transport that
    /// writes what senders presenting `token` send into the destinations of
    /// `registry`; the descriptor names the transport by `allocation`.
    Network {
        registry: &'a Arc<DestinationRegistry>,
        token: AuthToken,
        allocation: AllocationHandle,
        /// The buffer's completion key, when this process holds it and the
        /// transport can apply a receipt sent with the bytes.
        completion_key: Option<String>,
        /// Land the bytes through these staging rings (a transport that
        /// stages copies them in chunk by chunk: transport/staging/).
        staging: Option<Arc<Staging>>,
    },
}

/// The token under which a network transport may write a destination.
struct NetworkOffer {
    token: AuthToken,
    registry: Arc<DestinationRegistry>,
    /// The pipeline the bytes land through, when staged.
    staged: Option<Arc<StagedDestination>>,
}

pub struct HostDestination {
    memory: Arc<SharedHostMemory>,
    lease: Arc<ShmLease>,
    claim: ClaimRange,
    /// Where a network transport may write this destination, if offered
    /// over one.
    offer: Option<NetworkOffer>,
    allocation: AllocationHandle,
    offset: u64,
}

impl HostDestination {
    /// Leases `byte_size` bytes and arms the destination's claim for `nonce`
    /// before any descriptor exists, so only the descriptor's holder can
    /// take it.
    pub fn open(
        pool: &ShmPool,
        byte_size: usize,
        counters: Arc<MemoryCounters>,
        nonce: u64,
        route: HostRoute<'_>,
        reservation: BudgetLease,
    ) -> Result<HostDestination> {
        let memory = Arc::new(
            SharedHostMemory::new(pool.allocate(byte_size)?, counters)
                .holding(Box::new(reservation)),
        );
        let lease = memory.lease().clone();
        let claim = ClaimRange {
            nonce,
            offset: lease.offset(),
            len: byte_size as u64,
        };
        lease.claim_slot().arm(&claim)?;
        let (allocation, offset, offer) = match route {
            HostRoute::Network {
                registry,
                token,
                allocation,
                completion_key,
                staging,
            } => {
                let staged = staging
                    .map(|staging| Arc::new(StagedDestination::host(lease.clone(), staging)));
                let written: Arc<dyn WritableDestination> = match &staged {
                    Some(staged) => staged.clone(),
                    None => lease.clone(),
                };
                registry.register_with_key(token, written, completion_key)?;
                let offer = NetworkOffer {
                    token,
                    registry: registry.clone(),
                    staged,
                };
                (allocation, 0, Some(offer))
            }
            HostRoute::SharedMemory => {
                let region = lease.region();
                register_local(region);
                let name = region.name().to_string();
                (
                    AllocationHandle::SharedMemory { name },
                    lease.offset(),
                    None,
                )
            }
        };
        Ok(HostDestination {
            memory,
            lease,
            claim,
            offer,
            allocation,
            offset,
        })
    }

    /// Ends the destination once the receive has its one outcome: an
    /// unclaimed destination is closed so no sender can take it any more; a
    /// claimed one that failed is quarantined (the sender's write may still
    /// land, so the range is never handed out again); a dedicated region
    /// loses its name (the buffer keeps the mapping).
    pub fn release(&self, outcome: &Outcome) {
        let mut claimed = !self.lease.claim_slot().close_unclaimed(&self.claim);
        if let Some(offer) = &self.offer {
            if offer.registry.unregister(&offer.token).is_none() {
                claimed = true;
            }
            // A pipeline still landing chunks stops (its copies in flight
            // finish into the quarantined range).
            if let Some(staged) = &offer.staged {
                staged.stop(match outcome {
                    Err(reason) => reason.clone(),
                    Ok(()) => crate::status::cancelled("the receive already completed"),
                });
            }
        }
        if outcome.is_ok() {
            self.lease.claim_slot().close();
        } else if claimed {
            self.lease.quarantine_on_drop();
        }
        if let Err(e) = self.lease.unlink_if_dedicated() {
            log::warn!(
                "unlinking receive destination {}: {e}",
                self.lease.segment_name()
            );
        }
    }
}

/// A receive destination of either kind.
pub enum Destination {
    Host(HostDestination),
    Cuda(CudaDestination),
}

impl Destination {
    /// Whether its bytes land through the staging ring.
    pub fn is_staged(&self) -> bool {
        match self {
            Destination::Host(host) => host.offer.as_ref().is_some_and(|o| o.staged.is_some()),
            Destination::Cuda(cuda) => cuda.is_staged(),
        }
    }

    /// The buffer's memory.
    pub fn memory(&self) -> Allocation {
        match self {
            Destination::Host(host) => host.memory.clone(),
            Destination::Cuda(cuda) => cuda.memory(),
        }
    }

    /// What the descriptor names: the allocation and the offset in it.
    pub fn location(&self) -> (AllocationHandle, u64) {
        match self {
            Destination::Host(host) => (host.allocation.clone(), host.offset),
            Destination::Cuda(cuda) => (cuda.allocation_handle(), 0),
        }
    }

    /// Ends the destination with the receive's outcome (see
    /// `HostDestination::release`).
    pub fn release(&self, outcome: &Outcome) {
        match self {
            Destination::Host(host) => host.release(outcome),
            Destination::Cuda(cuda) => cuda.release(outcome),
        }
    }
}
