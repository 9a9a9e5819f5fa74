//! Single-use shared-memory destinations. Every shared-memory object starts
//! with a claim table: one 64-bit slot per 4 KiB page of the object. The
//! receiver arms the slot of a destination (the page its data starts on)
//! before publishing the descriptor; a sender must swap "armed for my
//! descriptor" for "claimed" before it writes a byte. So exactly one sender
//! ever writes a destination, a duplicated or replayed descriptor is refused,
//! and a stale descriptor of a recycled range (its nonce is no longer the
//! armed one) cannot write into the range's new owner.
//!
//! The armed value pins the destination's exact range, not just its page:
//! it is the descriptor's nonce with the range `[offset, offset + len)`
//! folded in injectively (page-aligned offsets, so the page number and the
//! length fit in 62 bits). A descriptor whose offset or length was moved,
//! even inside the same page, arms a different value and is refused, so the
//! claimed range is exactly the destination and a sender's writes (checked
//! against it, `ClaimRange::check_write`) cannot reach a neighbour.
//! Slots live in the shared mapping, so the compare-and-swap is atomic across
//! processes.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::status::{self, Result};

/// Bytes of data covered by one slot; destinations start on such a page.
pub const CLAIM_PAGE: usize = 4096;
const SLOT_BYTES: usize = 8;
const CLAIMED: u64 = 1 << 63;
/// Bits of the length in the folded range (512 GiB - 1 at most).
const LEN_BITS: u32 = 39;
/// Bits of the page number (offsets below 32 GiB).
const PAGE_BITS: u32 = 62 - LEN_BITS;

/// Size of the claim table at the start of an object whose data part is
/// `data_len` bytes: page-rounded, covering every page of table and data.
pub fn claim_table_len(data_len: usize) -> usize {
    let mut table = 0usize;
    loop {
        let pages = (table + data_len).div_ceil(CLAIM_PAGE) + 1;
        let needed = (pages * SLOT_BYTES).next_multiple_of(CLAIM_PAGE);
        if needed <= table {
            return table;
        }
        table = needed;
    }
}

/// Byte position of the slot of the destination starting at `offset`.
pub fn slot_position(offset: u64) -> u64 {
    (offset / CLAIM_PAGE as u64) * SLOT_BYTES as u64
}

/// One destination, as its descriptor names it: the nonce and the exact
/// byte range in the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimRange {
    pub nonce: u64,
    pub offset: u64,
    pub len: u64,
}

impl ClaimRange {
    /// The slot value that admits this range's sender: the range folded
    /// into bits 1..=62 (injective for a given nonce), bit 0 set so an armed
    /// slot is never 0, bit 63 left for CLAIMED.
    fn armed(&self) -> Result<u64> {
        let page = self.offset / CLAIM_PAGE as u64;
        if !self.offset.is_multiple_of(CLAIM_PAGE as u64)
            || page >= 1 << PAGE_BITS
            || self.len >= 1 << LEN_BITS
        {
            return Err(status::invalid_argument(format!(
                "destination [{}, +{}) cannot be claimed: destinations start on a {CLAIM_PAGE}-byte page \
                 below 32 GiB and are shorter than 512 GiB",
                self.offset, self.len
            )));
        }
        let folded = (page << LEN_BITS) | self.len;
        Ok(((self.nonce ^ (folded << 1)) | 1) & !CLAIMED)
    }

    /// A write of `count` bytes at `offset` of the object stays inside the
    /// claimed range.
    pub fn check_write(&self, offset: u64, count: u64) -> Result<()> {
        let end = offset.checked_add(count);
        if offset < self.offset || end.is_none_or(|end| end > self.offset + self.len) {
            return Err(status::out_of_range(format!(
                "a write of {count} bytes at offset {offset} leaves the claimed destination [{}, +{})",
                self.offset, self.len
            )));
        }
        Ok(())
    }
}

/// One destination's slot.
pub struct ClaimSlot<'a>(pub &'a AtomicU64);

impl ClaimSlot<'_> {
    /// Receiver: expect the sender holding `range`'s descriptor.
    pub fn arm(&self, range: &ClaimRange) -> Result<()> {
        self.0.store(range.armed()?, Ordering::Release);
        Ok(())
    }

    /// Sender: take the destination, or learn why not.
    pub fn claim(&self, range: &ClaimRange) -> Result<()> {
        let expected = range.armed()?;
        match self
            .0
            .compare_exchange(expected, expected | CLAIMED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(current) if current == expected | CLAIMED => Err(status::already_exists(
                "the destination was already claimed by another sender (duplicated or replayed descriptor)",
            )),
            Err(_) => Err(status::failed_precondition(
                "the destination does not expect this descriptor (completed, cancelled, stale, or its \
                 range was altered)",
            )),
        }
    }

    /// Receiver, after a receive ended without the sender's receipt: closes
    /// the slot if no sender claimed it. `false` means a sender claimed it
    /// and may still be writing: the range must not be reused.
    pub fn close_unclaimed(&self, range: &ClaimRange) -> bool {
        let Ok(armed) = range.armed() else {
            return true;
        };
        self.0
            .compare_exchange(armed, 0, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Receiver, after the sender's receipt: the slot is done.
    pub fn close(&self) {
        self.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(nonce: u64) -> ClaimRange {
        ClaimRange {
            nonce,
            offset: 8192,
            len: 4096,
        }
    }

    #[test]
    fn only_the_armed_descriptor_claims_and_only_once() {
        let word = AtomicU64::new(0);
        let slot = ClaimSlot(&word);
        assert!(
            slot.claim(&range(7)).is_err(),
            "an unarmed slot admits nobody"
        );
        slot.arm(&range(7)).unwrap();
        assert_eq!(
            slot.claim(&range(8)).unwrap_err().code,
            status::Code::FailedPrecondition
        );
        slot.claim(&range(7)).unwrap();
        assert_eq!(
            slot.claim(&range(7)).unwrap_err().code,
            status::Code::AlreadyExists
        );
        assert!(
            !slot.close_unclaimed(&range(7)),
            "a claimed slot reports the claim"
        );
        slot.arm(&range(9)).unwrap();
        assert!(slot.close_unclaimed(&range(9)));
        assert!(
            slot.claim(&range(9)).is_err(),
            "a closed slot admits nobody"
        );
    }

    #[test]
    fn a_descriptor_whose_range_moved_inside_the_page_or_grew_is_refused() {
        let word = AtomicU64::new(0);
        let slot = ClaimSlot(&word);
        let real = range(0x5eed_1234_abcd_0001);
        slot.arm(&real).unwrap();
        for shift in [1, 8, 4088] {
            let moved = ClaimRange {
                offset: real.offset + shift,
                len: real.len - shift,
                ..real
            };
            assert!(slot.claim(&moved).is_err(), "shift {shift} claimed");
        }
        for len in [real.len + 1, real.len * 2, real.len - 1, 0] {
            let resized = ClaimRange { len, ..real };
            assert!(slot.claim(&resized).is_err(), "len {len} claimed");
        }
        slot.claim(&real).unwrap();
    }

    #[test]
    fn different_ranges_of_one_nonce_never_arm_the_same_value() {
        // The fold is injective: spot-check neighbours of every kind.
        let nonce = 0xffff_ffff_ffff_ffff;
        let mut seen = std::collections::HashSet::new();
        for page in [0u64, 1, 2, 255, 1 << 20, (1 << PAGE_BITS) - 1] {
            for len in [0u64, 1, 2, 4095, 4096, 4097, (1 << LEN_BITS) - 1] {
                let armed = ClaimRange {
                    nonce,
                    offset: page * CLAIM_PAGE as u64,
                    len,
                }
                .armed()
                .unwrap();
                assert!(seen.insert(armed), "page {page} len {len}");
                assert_eq!(armed & CLAIMED, 0);
                assert_ne!(armed, 0);
            }
        }
    }

    #[test]
    fn unaligned_or_oversized_ranges_and_writes_outside_the_claim_are_errors() {
        let slot_word = AtomicU64::new(0);
        let slot = ClaimSlot(&slot_word);
        let unaligned = ClaimRange {
            offset: 4097,
            ..range(1)
        };
        assert_eq!(
            slot.arm(&unaligned).unwrap_err().code,
            status::Code::InvalidArgument
        );
        let huge = ClaimRange {
            len: 1 << LEN_BITS,
            ..range(1)
        };
        assert_eq!(
            slot.claim(&huge).unwrap_err().code,
            status::Code::InvalidArgument
        );
        let r = range(1);
        r.check_write(8192, 4096).unwrap();
        r.check_write(8192 + 100, 10).unwrap();
        for (offset, count) in [(8191, 1), (8192, 4097), (12288, 1), (u64::MAX, 2)] {
            let err = r.check_write(offset, count).unwrap_err();
            assert_eq!(err.code, status::Code::OutOfRange, "{offset} {count}");
        }
    }

    #[test]
    fn the_table_covers_every_page_of_the_object() {
        for data in [0usize, 1, 4096, 1 << 20, 256 << 20, (256 << 20) + 1] {
            let table = claim_table_len(data);
            assert_eq!(table % CLAIM_PAGE, 0);
            let last_page_slot = slot_position((table + data) as u64);
            assert!(last_page_slot + SLOT_BYTES as u64 <= table as u64, "{data}");
        }
    }
}
