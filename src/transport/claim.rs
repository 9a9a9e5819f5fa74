//! Single-use shared-memory destinations. Every shared-memory object starts
//! with a claim table: one 64-bit slot per 4 KiB page of the object. The
//! receiver arms the slot of a destination (the page its data starts on)
//! with the descriptor's nonce before publishing the descriptor; a sender
//! must swap "armed with my nonce" for "claimed" before it writes a byte.
//! So exactly one sender ever writes a destination, a duplicated or replayed
//! descriptor is refused, and a stale descriptor of a recycled range (its
//! nonce is no longer the armed one) cannot write into the range's new owner.
//! Slots live in the shared mapping, so the compare-and-swap is atomic across
//! processes.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::status::{self, Result};

/// Bytes of data covered by one slot.
pub const CLAIM_PAGE: usize = 4096;
const SLOT_BYTES: usize = 8;
const CLAIMED: u64 = 1 << 63;

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

fn armed(nonce: u64) -> u64 {
    (nonce | 1) & !CLAIMED
}

/// One destination's slot.
pub struct ClaimSlot<'a>(pub &'a AtomicU64);

impl ClaimSlot<'_> {
    /// Receiver: expect the sender holding `nonce`.
    pub fn arm(&self, nonce: u64) {
        self.0.store(armed(nonce), Ordering::Release);
    }

    /// Sender: take the destination, or learn why not.
    pub fn claim(&self, nonce: u64) -> Result<()> {
        let expected = armed(nonce);
        match self
            .0
            .compare_exchange(expected, expected | CLAIMED, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Ok(()),
            Err(current) if current == expected | CLAIMED => Err(status::already_exists(
                "the destination was already claimed by another sender (duplicated or replayed descriptor)",
            )),
            Err(_) => Err(status::failed_precondition(
                "the destination no longer expects this descriptor (completed, cancelled, or a stale descriptor)",
            )),
        }
    }

    /// Receiver, after a receive ended without the sender's receipt: closes
    /// the slot if no sender claimed it. `false` means a sender claimed it
    /// and may still be writing: the range must not be reused.
    pub fn close_unclaimed(&self, nonce: u64) -> bool {
        self.0
            .compare_exchange(armed(nonce), 0, Ordering::AcqRel, Ordering::Acquire)
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

    #[test]
    fn only_the_armed_nonce_claims_and_only_once() {
        let word = AtomicU64::new(0);
        let slot = ClaimSlot(&word);
        assert!(slot.claim(7).is_err(), "an unarmed slot admits nobody");
        slot.arm(7);
        assert_eq!(
            slot.claim(8).unwrap_err().code,
            status::Code::FailedPrecondition
        );
        slot.claim(7).unwrap();
        assert_eq!(slot.claim(7).unwrap_err().code, status::Code::AlreadyExists);
        assert!(!slot.close_unclaimed(7), "a claimed slot reports the claim");
        slot.arm(9);
        assert!(slot.close_unclaimed(9));
        assert!(slot.claim(9).is_err(), "a closed slot admits nobody");
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
