//! A sender's mappings of other processes' pooled shared-memory segments,
//! each with a liveness watch of its owner (the receiving process). Kept
//! across transfers (mapping and faulting 256 MiB costs more than copying
//! into it); bounded, least recently used first out. Segments of receivers
//! that are gone are dropped at the next lookup, so a dead receiver's memory
//! is not kept alive by our mapping.
use std::sync::Arc;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::status::{self, Result, Status};
use crate::transport::shm::{shm_name_owner, SharedRegion};
use crate::transport::shm_owner::{OwnerWatch, ShmOwner};

struct MappedSegment {
    name: String,
    region: Arc<SharedRegion>,
    receiver: Arc<OwnerWatch>,
}
static REMOTE_SEGMENTS: Lazy<Mutex<Vec<MappedSegment>>> = Lazy::new(Default::default);
const REMOTE_SEGMENT_CACHE: usize = 16;

/// UNAVAILABLE for a send whose receiving process (the owner of the
/// shared-memory object `name`) is gone.
pub fn receiver_gone(function: &str, name: &str, receiver: &OwnerWatch) -> Status {
    status::unavailable(format!(
        "{function}: the receiving process (pid {}, owner of shared-memory region {name}) is gone; \
         the buffer was not delivered",
        receiver.owner().pid
    ))
}

/// A whole-object mapping of `name` that reaches at least `end`, and the
/// watch of its owner. UNAVAILABLE when the owner is gone.
pub fn mapped_segment(
    name: &str,
    end: u64,
    function: &str,
) -> Result<(Arc<SharedRegion>, Arc<OwnerWatch>)> {
    let owner = shm_name_owner(name)?;
    let known = {
        let mut cache = REMOTE_SEGMENTS.lock();
        forget_gone_receivers(&mut cache);
        if let Some(pos) = cache.iter().position(|segment| segment.name == name) {
            let entry = cache.remove(pos);
            if entry.region.len() as u64 >= end {
                let found = (entry.region.clone(), entry.receiver.clone());
                cache.push(entry);
                return Ok(found);
            }
        }
        cache
            .iter()
            .find(|segment| segment.receiver.owner() == owner)
            .map(|segment| segment.receiver.clone())
    };
    let watch = known.unwrap_or_else(|| Arc::new(OwnerWatch::new(owner)));
    if watch.is_gone() {
        return Err(receiver_gone(function, name, &watch));
    }
    let region = Arc::new(SharedRegion::open_whole(name)?);
    let mut cache = REMOTE_SEGMENTS.lock();
    cache.push(MappedSegment {
        name: name.to_string(),
        region: region.clone(),
        receiver: watch.clone(),
    });
    if cache.len() > REMOTE_SEGMENT_CACHE {
        cache.remove(0);
    }
    Ok((region, watch))
}

/// Drops the cached segments of every receiver that is gone, asking each
/// receiver once (a pidfd poll where the kernel has pidfds).
fn forget_gone_receivers(cache: &mut Vec<MappedSegment>) {
    let mut gone: Vec<ShmOwner> = Vec::new();
    let mut alive: Vec<ShmOwner> = Vec::new();
    cache.retain(|segment| {
        let owner = segment.receiver.owner();
        if alive.contains(&owner) {
            return true;
        }
        if gone.contains(&owner) {
            return false;
        }
        let is_gone = segment.receiver.is_gone();
        if is_gone {
            gone.push(owner);
        } else {
            alive.push(owner);
        }
        !is_gone
    });
}

/// Drops our mapping of `name` (its file shrank under a copy: pages of it
/// are now private to us).
pub fn forget_segment(name: &str) {
    REMOTE_SEGMENTS
        .lock()
        .retain(|segment| segment.name != name);
}

/// Drops our mappings of a gone receiver's segments.
pub fn forget_segments_of(receiver: &OwnerWatch) {
    REMOTE_SEGMENTS
        .lock()
        .retain(|segment| segment.receiver.owner() != receiver.owner());
}
