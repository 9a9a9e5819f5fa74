//! `ShmPool`: the receiver's pool of pre-faulted shared-memory segments.
//! Same-host destinations are carved from a segment (page-aligned, first
//! fit) and their range goes back to the segment's free list when the
//! `ShmLease` drops, so a steady stream of transfers reuses already faulted,
//! already reserved pages instead of creating and faulting a fresh object per
//! buffer (creating + reserving 256 MiB costs ~50 ms on the reference box).
//!
//! Segment names stay linked while the pool lives (senders open them by the
//! name in the descriptor); dropping the `ShmPool` unlinks them all, and the
//! memory goes away with the last lease. A process that dies first leaves
//! them to `shm_reaper` (its watchdog, or the next client's scan).
//!
//! Recycling caveat: a range handed back is reused at once. A receive that
//! ended without its sender's acknowledgement (cancelled, timed out) may
//! still see a late write from that sender; quarantine such leases with
//! `ShmLease::quarantine` so their range is never reused.
use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::claim::{claim_table_len, ClaimSlot};
use super::destination::WritableDestination;
use super::shm::{CreateOptions, SharedRegion};
use crate::status::{self, Result};

/// Carved ranges start on this boundary.
const CARVE_ALIGNMENT: usize = 4096;

#[derive(Clone, Debug)]
pub struct ShmPoolConfig {
    /// Size of each pooled segment. Requests larger than this get a
    /// dedicated, unpooled region.
    pub segment_len: usize,
    /// Upper bound on pooled segments; beyond it requests get dedicated
    /// regions.
    pub max_segments: usize,
}

impl Default for ShmPoolConfig {
    fn default() -> ShmPoolConfig {
        ShmPoolConfig {
            segment_len: 256 << 20,
            max_segments: 4,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmPoolStats {
    pub segments: usize,
    pub leased_bytes: usize,
    pub quarantined_bytes: usize,
    pub dedicated_leases_made: u64,
}

struct Segment {
    region: Arc<SharedRegion>,
    /// Free ranges by start offset, never adjacent (coalesced on release).
    free: BTreeMap<usize, usize>,
}

impl Segment {
    fn carve(&mut self, len: usize) -> Option<usize> {
        let (&start, &free_len) = self.free.iter().find(|(_, &free_len)| free_len >= len)?;
        self.free.remove(&start);
        if free_len > len {
            self.free.insert(start + len, free_len - len);
        }
        Some(start)
    }

    fn release(&mut self, start: usize, len: usize) {
        let mut start = start;
        let mut len = len;
        if let Some((&next_start, &next_len)) = self.free.range(start + len..).next() {
            if next_start == start + len {
                self.free.remove(&next_start);
                len += next_len;
            }
        }
        if let Some((&previous_start, &previous_len)) = self.free.range(..start).next_back() {
            if previous_start + previous_len == start {
                self.free.remove(&previous_start);
                start = previous_start;
                len += previous_len;
            }
        }
        self.free.insert(start, len);
    }
}

struct PoolState {
    segments: Vec<Segment>,
    stats: ShmPoolStats,
}

struct PoolInner {
    config: ShmPoolConfig,
    state: Mutex<PoolState>,
}

/// A receiver-side pool of shared-memory destinations.
pub struct ShmPool {
    inner: Arc<PoolInner>,
}

impl ShmPool {
    pub fn new(config: ShmPoolConfig) -> Result<ShmPool> {
        if config.segment_len == 0 || !config.segment_len.is_multiple_of(CARVE_ALIGNMENT) {
            return Err(status::invalid_argument(format!(
                "ShmPoolConfig.segment_len must be a positive multiple of {CARVE_ALIGNMENT}, got {}",
                config.segment_len
            )));
        }
        Ok(ShmPool {
            inner: Arc::new(PoolInner {
                config,
                state: Mutex::new(PoolState {
                    segments: Vec::new(),
                    stats: ShmPoolStats::default(),
                }),
            }),
        })
    }

    /// Creates and pre-faults `count` segments now (at most `max_segments`
    /// in total), so the first transfers do not pay for it.
    pub fn prewarm(&self, count: usize) -> Result<()> {
        let mut state = self.inner.state.lock();
        while state.segments.len() < count.min(self.inner.config.max_segments) {
            state.segments.push(self.inner.new_segment()?);
            state.stats.segments = state.segments.len();
        }
        Ok(())
    }

    /// A destination of `len` bytes, carved from a pooled segment when it
    /// fits, else a dedicated region.
    pub fn allocate(&self, len: usize) -> Result<ShmLease> {
        let carved_len = len
            .checked_next_multiple_of(CARVE_ALIGNMENT)
            .ok_or_else(|| status::invalid_argument(format!("{len} bytes is too large")))?;
        if len == 0 || carved_len > self.inner.config.segment_len {
            return self.allocate_dedicated(len);
        }
        let mut state = self.inner.state.lock();
        // A segment whose file shrank (another process truncated it; its
        // mapping faulted) is never carved from again, nor counted: its
        // leases drain, and a fresh segment may take its place.
        for segment in &state.segments {
            if segment.region.faults() > 0 && !segment.region.is_unlinked() {
                log::warn!(
                    "pooled shared-memory segment {} was truncated by another process: \
                     no longer used",
                    segment.region.name()
                );
                if let Err(e) = segment.region.unlink() {
                    log::warn!("unlinking it: {e}");
                }
            }
        }
        let mut found = state
            .segments
            .iter_mut()
            .enumerate()
            .filter(|(_, segment)| segment.region.faults() == 0)
            .find_map(|(index, segment)| segment.carve(carved_len).map(|start| (index, start)));
        let healthy = state
            .segments
            .iter()
            .filter(|segment| segment.region.faults() == 0)
            .count();
        if found.is_none() && healthy < self.inner.config.max_segments {
            let mut segment = self.inner.new_segment()?;
            let start = segment
                .carve(carved_len)
                .expect("a fresh segment fits the request");
            state.segments.push(segment);
            state.stats.segments = state.segments.len();
            found = Some((state.segments.len() - 1, start));
        }
        let Some((segment_index, start)) = found else {
            drop(state);
            return self.allocate_dedicated(len);
        };
        state.stats.leased_bytes += carved_len;
        let region = state.segments[segment_index].region.clone();
        drop(state);
        let lease = ShmLease {
            region,
            offset: start,
            len,
            origin: LeaseOrigin::Pooled {
                pool: self.inner.clone(),
                segment_index,
                carved_len,
            },
            quarantined: AtomicBool::new(false),
        };
        // Faulted in as it is first carved, not at the segment's creation:
        // a receiver of a few KiB neither waits for nor holds 256 MiB. An
        // error gives the range back (the lease drops).
        let region = &lease.region;
        region
            .guarded(|| region.populate(start, carved_len))
            .map_err(|shrank| {
                shrank.status(&format!("shared-memory segment {}", region.name()))
            })??;
        Ok(lease)
    }

    pub fn stats(&self) -> ShmPoolStats {
        self.inner.state.lock().stats
    }

    fn allocate_dedicated(&self, len: usize) -> Result<ShmLease> {
        let table = claim_table_len(len);
        let region = Arc::new(SharedRegion::create_with(
            table + len,
            CreateOptions { prefault: true },
        )?);
        self.inner.state.lock().stats.dedicated_leases_made += 1;
        Ok(ShmLease {
            region,
            offset: table,
            len,
            origin: LeaseOrigin::Dedicated,
            quarantined: AtomicBool::new(false),
        })
    }
}

impl Drop for ShmPool {
    fn drop(&mut self) {
        for segment in &self.inner.state.lock().segments {
            if let Err(error) = segment.region.unlink() {
                log::error!("unlinking pooled shared-memory segment: {error}");
            }
        }
    }
}

impl PoolInner {
    fn new_segment(&self) -> Result<Segment> {
        let len = self.config.segment_len;
        let table = claim_table_len(len);
        let region = SharedRegion::create_with(table + len, CreateOptions { prefault: false })?;
        region.populate(0, table)?;
        log::debug!(
            "shared-memory pool grew by segment {} ({len} bytes)",
            region.name()
        );
        Ok(Segment {
            region: Arc::new(region),
            free: BTreeMap::from([(table, len)]),
        })
    }
}

enum LeaseOrigin {
    Pooled {
        pool: Arc<PoolInner>,
        segment_index: usize,
        carved_len: usize,
    },
    Dedicated,
    /// Quarantined or already returned: nothing to give back.
    Spent,
}

/// One destination from an `ShmPool`: `len` bytes at `offset` in the
/// shared-memory object `segment_name()`. Dropping it recycles the range.
pub struct ShmLease {
    region: Arc<SharedRegion>,
    offset: usize,
    len: usize,
    origin: LeaseOrigin,
    /// Set by `quarantine_on_drop`: the range is quarantined, not recycled.
    quarantined: AtomicBool,
}

impl ShmLease {
    /// The object name to put in the descriptor.
    pub fn segment_name(&self) -> &str {
        self.region.name()
    }

    /// Where the destination starts inside the object.
    pub fn offset(&self) -> u64 {
        self.offset as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.check_range(offset, bytes.len())?;
        self.region.write_at(self.offset + offset, bytes)
    }

    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        self.region.read_at(self.offset + offset, out)
    }

    /// Marks the lease so that dropping it quarantines its range instead of
    /// recycling it (for a lease shared with in-flight users, where
    /// `quarantine(self)` cannot take it).
    pub fn quarantine_on_drop(&self) {
        self.quarantined.store(true, Ordering::Release);
    }

    /// Whether the range belongs to a pooled segment (whose name stays
    /// linked while the pool lives) rather than a dedicated region.
    pub fn is_pooled(&self) -> bool {
        matches!(self.origin, LeaseOrigin::Pooled { .. })
    }

    /// Unlinks a dedicated region's name once no sender needs to open it;
    /// pooled segments keep their names (a no-op for them).
    pub fn unlink_if_dedicated(&self) -> Result<()> {
        match self.origin {
            LeaseOrigin::Dedicated => self.region.unlink(),
            _ => Ok(()),
        }
    }

    /// The claim slot of this destination (see `claim.rs`).
    pub fn claim_slot(&self) -> ClaimSlot<'_> {
        self.region
            .claim_slot(self.offset as u64)
            .expect("every object the pool makes starts with a claim table covering it")
    }

    /// The segment (or dedicated region) this lease lives in.
    pub fn region(&self) -> &Arc<SharedRegion> {
        &self.region
    }

    /// Quarantines the lease: its range is never recycled (for receives that
    /// ended without the sender's acknowledgement; see the module docs).
    pub fn quarantine(mut self) {
        if let LeaseOrigin::Pooled {
            pool, carved_len, ..
        } = std::mem::replace(&mut self.origin, LeaseOrigin::Spent)
        {
            let mut state = pool.state.lock();
            state.stats.leased_bytes -= carved_len;
            state.stats.quarantined_bytes += carved_len;
        }
    }

    fn check_range(&self, offset: usize, count: usize) -> Result<()> {
        match offset.checked_add(count) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(status::out_of_range(format!(
                "access of {count} bytes at offset {offset} exceeds the {}-byte pooled destination",
                self.len
            ))),
        }
    }
}

// SAFETY: the lease's range lies inside its region's mapping (carved within
// the segment, or the whole dedicated region), which the `Arc` keeps mapped
// until the lease drops; the range is handed to no one else until then.
unsafe impl WritableDestination for ShmLease {
    fn len(&self) -> usize {
        self.len
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        if self.len == 0 {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        // SAFETY: `offset + len` lies inside the region (see above).
        unsafe { self.region.as_ptr().add(self.offset) }
    }
}

impl Drop for ShmLease {
    fn drop(&mut self) {
        if self.quarantined.load(Ordering::Acquire) {
            if let LeaseOrigin::Pooled {
                pool, carved_len, ..
            } = std::mem::replace(&mut self.origin, LeaseOrigin::Spent)
            {
                let mut state = pool.state.lock();
                state.stats.leased_bytes -= carved_len;
                state.stats.quarantined_bytes += carved_len;
            }
            return;
        }
        if let LeaseOrigin::Pooled {
            pool,
            segment_index,
            carved_len,
        } = std::mem::replace(&mut self.origin, LeaseOrigin::Spent)
        {
            let mut state = pool.state.lock();
            state.segments[segment_index].release(self.offset, carved_len);
            state.stats.leased_bytes -= carved_len;
        }
    }
}

impl fmt::Debug for ShmLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmLease")
            .field("segment", &self.region.name())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests;
