//! Faulting in a mapping's pages before a copy, once per range.
//!
//! A copy into pages not yet faulted in runs page by page (measured here:
//! 0.37 GB/s against 2.2 GB/s pre-faulted). Faulting a whole 256 MiB pooled
//! segment in at creation made a receiver of 4 KiB wait ~100 ms (seconds
//! on a loaded machine) and hold 256 MiB; faulting only what a copy is
//! about to write, once, keeps the speed and drops both. `PopulatedChunks`
//! remembers, per 256 KiB chunk of one mapping, whether this process's page
//! tables already have it, so a range used again costs nothing.
use std::sync::atomic::{AtomicU64, Ordering};

use super::shm_fault::page_size;
use crate::status::Result;

/// Unit of what is remembered as faulted in.
pub const CHUNK_BYTES: usize = 256 << 10;

/// Not in every libc release yet: the value is Linux's ABI (5.14+).
const MADV_POPULATE_WRITE: libc::c_int = 23;

#[derive(Debug, Default)]
pub struct PopulatedChunks {
    bits: Vec<AtomicU64>,
}

impl PopulatedChunks {
    /// For a mapping of `len` bytes, nothing faulted in yet.
    pub fn new(len: usize) -> PopulatedChunks {
        let chunks = len.div_ceil(CHUNK_BYTES);
        PopulatedChunks {
            bits: (0..chunks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    /// Every chunk: a mapping made with `MAP_POPULATE`.
    pub fn all(len: usize) -> PopulatedChunks {
        let chunks = PopulatedChunks::new(len);
        for word in &chunks.bits {
            word.store(u64::MAX, Ordering::Relaxed);
        }
        chunks
    }

    fn is_set(&self, chunk: usize) -> bool {
        self.bits[chunk / 64].load(Ordering::Acquire) & (1 << (chunk % 64)) != 0
    }

    fn set(&self, chunk: usize) {
        self.bits[chunk / 64].fetch_or(1 << (chunk % 64), Ordering::AcqRel);
    }

    /// Faults in the chunks of `[offset, offset + len)` not faulted in yet,
    /// of the region starting at `base` with `region_len` bytes. The caller
    /// checked that the range lies inside the region.
    ///
    /// # Safety
    /// `base` must start a live mapping of at least `region_len` bytes
    /// (rounded down to its page, the mapping's start), writable, whose
    /// bytes in the range nobody else writes now (a fresh destination or
    /// one the caller holds the claim of).
    pub unsafe fn populate(
        &self,
        base: *mut u8,
        region_len: usize,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let last = (offset + len - 1) / CHUNK_BYTES;
        let mut chunk = offset / CHUNK_BYTES;
        while chunk <= last {
            if self.is_set(chunk) {
                chunk += 1;
                continue;
            }
            let run_start = chunk;
            while chunk <= last && !self.is_set(chunk) {
                chunk += 1;
            }
            let from = run_start * CHUNK_BYTES;
            let to = (chunk * CHUNK_BYTES).min(region_len);
            // SAFETY: the caller's contract, for a sub-range of the region.
            unsafe { fault_in(base.add(from), to - from) }?;
            for done in run_start..chunk {
                self.set(done);
            }
        }
        Ok(())
    }
}

/// # Safety
/// As `PopulatedChunks::populate`, for `[start, start + len)`.
unsafe fn fault_in(start: *mut u8, len: usize) -> Result<()> {
    let page = page_size();
    let aligned = start as usize - start as usize % page;
    let end = start as usize + len;
    // SAFETY: `[aligned, end)` lies in the caller's mapping (a mapping starts
    // on a page boundary at or before `start`); populating changes no byte.
    let advised = unsafe {
        libc::madvise(
            aligned as *mut libc::c_void,
            end - aligned,
            MADV_POPULATE_WRITE,
        )
    };
    if advised == 0 {
        return Ok(());
    }
    let error = std::io::Error::last_os_error();
    if error.raw_os_error() != Some(libc::EINVAL) {
        return Err(crate::status::unavailable(format!(
            "madvise(MADV_POPULATE_WRITE) of {len} shared-memory bytes: {error}"
        )));
    }
    // An older kernel: touch each page, rewriting one byte with its own
    // value.
    let mut at = start as usize;
    while at < end {
        let byte = at as *mut u8;
        // SAFETY: inside the range, which nobody else writes now.
        unsafe { byte.write_volatile(byte.read_volatile()) };
        at = at - at % page + page;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_faulted_in_once_and_the_rest_is_left() {
        let len = 4 * CHUNK_BYTES + 100;
        let mut memory = vec![7u8; len];
        let chunks = PopulatedChunks::new(len);
        // SAFETY: `memory` is ours, writable, and nobody else writes it.
        unsafe { chunks.populate(memory.as_mut_ptr(), len, CHUNK_BYTES + 5, 10) }.unwrap();
        assert!(!chunks.is_set(0) && chunks.is_set(1) && !chunks.is_set(2));
        // SAFETY: as above.
        unsafe { chunks.populate(memory.as_mut_ptr(), len, 0, len) }.unwrap();
        assert!((0..5).all(|c| chunks.is_set(c)));
        assert!(memory.iter().all(|&b| b == 7), "populating changed a byte");
        let all = PopulatedChunks::all(len);
        assert!((0..5).all(|c| all.is_set(c)));
    }
}
