//! One buffer's send as the UCX workers see it: its bytes (`Payload`, kept
//! alive until UCX is done reading them), its outcome (told once, when the
//! last part is acknowledged or the first fails), and how a large buffer is
//! split into parts for several workers.
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::backend::Allocation;
use crate::status::{self, Result};
use crate::transport::registry::Delivered;

/// The bytes of one send, kept alive (by `_owner`) until UCX is done
/// reading them.
pub struct Payload {
    pointer: *const u8,
    len: usize,
    _owner: Box<dyn Send>,
}

// SAFETY: the pointer is only read, by progress threads, while the owner
// (moved along with it) keeps the bytes alive.
unsafe impl Send for Payload {}
// SAFETY: shared access only reads the bytes (several workers each send a
// part of them); nothing writes them while the payload lives.
unsafe impl Sync for Payload {}

impl Payload {
    /// Bytes this payload owns.
    pub fn owned(bytes: Vec<u8>) -> Payload {
        let bytes = bytes.into_boxed_slice();
        Payload {
            pointer: bytes.as_ptr(),
            len: bytes.len(),
            _owner: Box::new(bytes),
        }
    }

    /// `len` bytes at `pointer`, kept valid and unwritten by `owner`.
    ///
    /// # Safety
    ///
    /// `pointer` must be readable for `len` bytes, nothing may write them,
    /// and they must stay mapped for as long as `owner` lives.
    pub unsafe fn borrowed(owner: Box<dyn Send>, pointer: *const u8, len: usize) -> Payload {
        Payload {
            pointer,
            len,
            _owner: owner,
        }
    }

    /// The first `len` bytes of `memory`: in place where they are host
    /// memory (the allocation kept alive with them), else copied out.
    pub fn of_allocation(memory: &Allocation, len: usize) -> Result<Payload> {
        if memory.len() < len {
            return Err(status::internal(format!(
                "a {}-byte source for a {len}-byte send",
                memory.len()
            )));
        }
        match memory.host_pointer()? {
            // SAFETY: `host_pointer` promises `len()` readable bytes that
            // stay valid, and unwritten once defined, while the allocation
            // lives; the payload owns a clone of it.
            Some(pointer) => Ok(unsafe {
                Payload::borrowed(Box::new(memory.clone()), pointer as *const u8, len)
            }),
            None => {
                let mut staged = vec![0u8; len];
                memory.read(0, &mut staged)?;
                Ok(Payload::owned(staged))
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte (valid for `len()` bytes while the payload lives).
    pub fn as_ptr(&self) -> *const u8 {
        self.pointer
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Told the outcome of one send, exactly once.
pub type SendDone = Box<dyn FnOnce(Result<Delivered>) + Send>;

/// One buffer's send, shared by its parts.
pub struct Transfer {
    pub payload: Payload,
    done: Mutex<Option<SendDone>>,
    /// Parts not acknowledged yet.
    unacked: AtomicUsize,
    receipt_applied: std::sync::atomic::AtomicBool,
}

impl Transfer {
    pub fn new(payload: Payload, parts: usize, done: SendDone) -> Transfer {
        Transfer {
            payload,
            done: Mutex::new(Some(done)),
            unacked: AtomicUsize::new(parts),
            receipt_applied: Default::default(),
        }
    }

    /// Tells a failure, once (unless the send is already over).
    pub fn fail(&self, error: crate::status::Status) {
        self.tell(Err(error));
    }

    fn tell(&self, outcome: Result<Delivered>) {
        let done = self.done.lock().take();
        if let Some(done) = done {
            done(outcome);
        }
    }

    /// One part is in the destination (and its receipt applied, if it
    /// carried one); the last one makes the send OK.
    pub fn part_acked(&self, receipt_applied: bool) {
        if receipt_applied {
            self.receipt_applied.store(true, Ordering::Release);
        }
        if self.unacked.fetch_sub(1, Ordering::AcqRel) == 1 {
            let receipt_applied = self.receipt_applied.load(Ordering::Acquire);
            self.tell(Ok(Delivered { receipt_applied }));
        }
    }
}

/// Workers (each its own progress thread and connections) per process.
/// Small buffers take turns on them; a large one is striped over them: one
/// TCP stream is bound to about one core's worth of packet processing and
/// copying (1.5-2.0 GB/s on the two-host bed's veth, where two streams moved
/// 2.3-3.2 GB/s), and so is one UCX progress thread.
pub fn workers_per_process() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 4)
}

/// Buffers of at least twice this are striped, in parts of at least this.
/// Measured on the two-host bed inside JAX (bench/profile_transfer.py, 100
/// transfers, two runs each): a 1 MiB buffer took 0.91-1.0 ms in two parts
/// and 1.23-1.26 ms whole; from 8 MiB up striping gains more (64 MiB: 46 ->
/// 28 ms).
pub const STRIPE_MIN: usize = 512 << 10;

/// `(start, len)` of each part of a `len`-byte payload over `workers`.
pub fn stripes(len: usize, workers: usize) -> Vec<(usize, usize)> {
    let parts = (len / STRIPE_MIN).clamp(1, workers.max(1));
    if parts == 1 || len < 2 * STRIPE_MIN {
        return vec![(0, len)];
    }
    // Page-aligned parts; the last takes the rest.
    let part = (len / parts) & !4095;
    (0..parts)
        .map(|i| {
            let start = i * part;
            let end = if i + 1 == parts { len } else { start + part };
            (start, end - start)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_payloads_are_striped_into_page_aligned_parts_that_cover_them() {
        assert_eq!(stripes(0, 2), vec![(0, 0)]);
        assert_eq!(stripes(STRIPE_MIN, 4), vec![(0, STRIPE_MIN)]);
        for (len, workers) in [
            (8 << 20, 2),
            ((13 << 20) + 5, 2),
            (256 << 20, 4),
            (9 << 20, 4),
        ] {
            let parts = stripes(len, workers);
            assert!(
                parts.len() > 1 && parts.len() <= workers,
                "{len}: {parts:?}"
            );
            let mut next = 0;
            for &(start, part) in &parts {
                assert_eq!(start, next);
                assert!(part >= STRIPE_MIN && start % 4096 == 0, "{parts:?}");
                next = start + part;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn the_outcome_is_told_once_after_every_part_or_at_the_first_failure() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let t = Transfer::new(Payload::owned(vec![1; 8]), 3, {
            let tx = tx.clone();
            Box::new(move |o| tx.send(o).unwrap())
        });
        t.part_acked(false);
        t.part_acked(false);
        assert!(rx.try_recv().is_err());
        t.part_acked(false);
        assert_eq!(
            rx.try_recv().unwrap(),
            Ok(Delivered {
                receipt_applied: false
            })
        );
        let failed = Transfer::new(
            Payload::owned(vec![]),
            2,
            Box::new(move |o| tx.send(o).unwrap()),
        );
        failed.fail(status::unavailable("part 0 failed"));
        failed.part_acked(true);
        failed.part_acked(true);
        assert!(rx.try_recv().unwrap().is_err());
        assert!(rx.try_recv().is_err(), "told once");
    }
}
