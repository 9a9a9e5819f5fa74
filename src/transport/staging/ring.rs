//! `StagingRing`: a bounded set of page-aligned host buffers (the slots),
//! each `chunk_bytes` long, at most `depth` of them, allocated on first
//! use and then reused until the ring is dropped. On a GPU these are the
//! pinned buffers a device copy reads or writes (`SlotMemory::Pinned`:
//! `cuMemHostAlloc`, bounded per process by `max_pinned_bytes`); on CPU
//! ordinary memory.
//!
//! A slot is taken whole (`take`) and given back once nothing reads or
//! writes it any more (`give_back`). A slot whose device copy may still
//! run when its pipeline stops (cancelled, timed out, peer gone) is
//! `park`ed with that copy's completion: it returns to the ring only once
//! the copy completed, so a late copy never reaches a slot handed to
//! someone else (the shelf rule of `backend/cuda/shelf.rs`).
use std::alloc::Layout;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::copy::Pending;
use super::pipeline::Stop;
use crate::backend::cuda::PinnedBuffer;
use crate::status::{self, Code, Result};

/// Slots are aligned to this (a page: what pinning registers).
pub const SLOT_ALIGN: usize = 4096;

/// How often a wait for a slot looks at its pipeline's stop signal.
const STOP_CHECK: Duration = Duration::from_millis(5);

/// What a ring's slots are made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotMemory {
    /// Page-aligned heap memory (CPU: the copies are memcpys).
    Heap,
    /// Pinned memory (`cuMemHostAlloc`), the process holding at most
    /// `bound` pinned bytes in all.
    Pinned { bound: usize },
}

/// Where a slot's memory came from (how it is freed).
enum Backing {
    Heap,
    /// Freed when dropped.
    Pinned {
        _buffer: PinnedBuffer,
    },
}

/// One page-aligned host buffer of the ring, owned by whoever took it.
pub struct Slot {
    pointer: *mut u8,
    len: usize,
    backing: Backing,
}

// SAFETY: a slot exclusively owns its allocation; nothing in it is tied to
// the thread that allocated it.
unsafe impl Send for Slot {}

impl Slot {
    fn allocate(len: usize, memory: SlotMemory) -> Result<Slot> {
        if let SlotMemory::Pinned { bound } = memory {
            let pinned = PinnedBuffer::allocate(len.max(1), bound)?;
            return Ok(Slot {
                pointer: pinned.as_ptr(),
                len,
                backing: Backing::Pinned { _buffer: pinned },
            });
        }
        let layout = Layout::from_size_align(len.max(1), SLOT_ALIGN)
            .map_err(|e| status::invalid_argument(format!("staging slot of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let pointer = unsafe { std::alloc::alloc(layout) };
        if pointer.is_null() {
            return Err(status::resource_exhausted(format!(
                "cannot allocate a {len}-byte staging buffer"
            )));
        }
        Ok(Slot {
            pointer,
            len,
            backing: Backing::Heap,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the slot (page-aligned), for device copies.
    pub fn as_ptr(&self) -> *mut u8 {
        self.pointer
    }

    /// The slot's bytes. Only its owner holds the slot, and a slot is owned
    /// only while no device copy uses it.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `pointer` is valid for `len` bytes for the slot's life,
        // and `&mut self` makes this the only reference to them.
        unsafe { std::slice::from_raw_parts_mut(self.pointer, self.len) }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: as in `bytes_mut`; shared access reads only.
        unsafe { std::slice::from_raw_parts(self.pointer, self.len) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // A pinned buffer frees itself when its field drops.
        if let Backing::Heap = self.backing {
            let layout = Layout::from_size_align(self.len.max(1), SLOT_ALIGN)
                .expect("the layout was valid when allocated");
            // SAFETY: `pointer` came from `alloc` with this very layout and
            // is freed only here.
            unsafe { std::alloc::dealloc(self.pointer, layout) };
        }
    }
}

struct Slots {
    free: Vec<Slot>,
    /// Slots whose device copy may still run, oldest first.
    parked: VecDeque<(Slot, Pending)>,
    allocated: usize,
}

pub struct StagingRing {
    chunk_bytes: usize,
    depth: usize,
    memory: SlotMemory,
    slots: Mutex<Slots>,
    returned: Condvar,
    held_bytes: AtomicUsize,
}

impl StagingRing {
    /// A ring of at most `depth` heap slots of `chunk_bytes` each (both at
    /// least 1); nothing is allocated yet.
    pub fn new(chunk_bytes: usize, depth: usize) -> Result<StagingRing> {
        StagingRing::with_memory(chunk_bytes, depth, SlotMemory::Heap)
    }

    /// A ring whose slots are `memory`.
    pub fn with_memory(
        chunk_bytes: usize,
        depth: usize,
        memory: SlotMemory,
    ) -> Result<StagingRing> {
        if chunk_bytes == 0 || depth == 0 {
            return Err(status::invalid_argument(format!(
                "a staging ring needs chunks and depth of at least 1 (got {chunk_bytes} bytes x {depth})"
            )));
        }
        Ok(StagingRing {
            chunk_bytes,
            depth,
            memory,
            slots: Mutex::new(Slots {
                free: Vec::new(),
                parked: VecDeque::new(),
                allocated: 0,
            }),
            returned: Condvar::new(),
            held_bytes: AtomicUsize::new(0),
        })
    }

    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    pub fn depth(&self) -> usize {
        self.depth
    }

    /// What the slots are made of.
    pub fn memory(&self) -> SlotMemory {
        self.memory
    }

    /// Bytes of staging memory allocated (never more than chunk x depth).
    pub fn held_bytes(&self) -> usize {
        self.held_bytes.load(Ordering::Relaxed)
    }

    /// Slots parked behind a copy that has not completed yet.
    pub fn parked(&self) -> usize {
        let mut slots = self.slots.lock();
        Self::reclaim(&mut slots);
        slots.parked.len()
    }

    /// Slots free now (allocated or not), after reclaiming parked ones whose
    /// copy completed.
    pub fn available(&self) -> usize {
        let mut slots = self.slots.lock();
        Self::reclaim(&mut slots);
        slots.free.len() + (self.depth - slots.allocated)
    }

    /// A free slot now, if there is one.
    pub fn try_take(&self) -> Result<Option<Slot>> {
        let mut slots = self.slots.lock();
        self.take_locked(&mut slots)
    }

    /// A free slot, waiting while all are taken: until `deadline`
    /// (`DEADLINE_EXCEEDED`) or `stop` (its reason).
    pub fn take(&self, deadline: Instant, stop: &Stop) -> Result<Slot> {
        let mut slots = self.slots.lock();
        loop {
            if let Some(slot) = self.take_locked(&mut slots)? {
                return Ok(slot);
            }
            stop.check()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(status::deadline_exceeded(format!(
                    "no staging buffer became free in time (all {} of {} bytes in use)",
                    self.depth, self.chunk_bytes
                )));
            }
            // Parked slots come back by polling: look again soon.
            let wake = deadline.min(now + STOP_CHECK);
            self.returned.wait_until(&mut slots, wake);
        }
    }

    fn take_locked(&self, slots: &mut Slots) -> Result<Option<Slot>> {
        Self::reclaim(slots);
        if let Some(slot) = slots.free.pop() {
            return Ok(Some(slot));
        }
        if slots.allocated < self.depth {
            let slot = match Slot::allocate(self.chunk_bytes, self.memory) {
                Ok(slot) => slot,
                // Past the process's bound on pinned memory a ring that has
                // slots already makes do with them: wait for one.
                Err(e) if e.code == Code::ResourceExhausted && slots.allocated > 0 => {
                    log::debug!("staging ring stays at {} slots: {e}", slots.allocated);
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
            slots.allocated += 1;
            self.held_bytes
                .fetch_add(self.chunk_bytes, Ordering::Relaxed);
            return Ok(Some(slot));
        }
        Ok(None)
    }

    /// Parked slots whose copy is over go back to the free list.
    fn reclaim(slots: &mut Slots) {
        let mut index = 0;
        while index < slots.parked.len() {
            // A copy that failed is over too: its slot is reusable.
            if slots.parked[index].1.is_done().unwrap_or(true) {
                if let Some((slot, _)) = slots.parked.remove(index) {
                    slots.free.push(slot);
                }
            } else {
                index += 1;
            }
        }
    }

    /// Returns a slot nothing uses any more.
    pub fn give_back(&self, slot: Slot) {
        self.slots.lock().free.push(slot);
        self.returned.notify_one();
    }

    /// Keeps `slot` out of use until `copy` (which may still read or write
    /// it) completed.
    pub fn park(&self, slot: Slot, copy: Pending) {
        self.slots.lock().parked.push_back((slot, copy));
        self.returned.notify_one();
    }
}

impl Drop for StagingRing {
    fn drop(&mut self) {
        let slots = self.slots.get_mut();
        Self::reclaim(slots);
        // A copy still running when the ring goes may still reach its slot:
        // that memory is never freed (leaked, and said so).
        for (slot, _) in slots.parked.drain(..) {
            log::warn!(
                "staging ring dropped with a device copy still running on a {}-byte buffer: kept",
                slot.len()
            );
            std::mem::forget(slot);
        }
    }
}
