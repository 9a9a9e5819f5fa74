//! `WritableDestination`: raw memory a transport may write received bytes
//! into (a host buffer, a shared-memory window, a pinned staging buffer).
//! Transports hold it through an `Arc`, so the memory stays valid for as long
//! as any in-flight write can touch it, even after the receiver forgot it.
use std::fmt;

/// Memory that transports write into through a raw pointer.
///
/// # Safety
///
/// Implementers guarantee that `as_mut_ptr()` returns the same pointer for
/// the object's whole life, that it points to `len()` bytes this process may
/// write, and that those bytes stay mapped until the object is dropped. Rust
/// code must not hold references into that memory while a transfer may write
/// it (readers copy out through raw pointers once the transfer completed).
/// The one exception is a destination whose `staged()` is `Some` and whose
/// memory is not host memory (a GPU buffer): its pointer is null, and
/// transports must land its bytes through its pipeline, never through
/// `as_mut_ptr` (every writer asks `staged()` first).
pub unsafe trait WritableDestination: Send + Sync {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Start of the writable bytes (dangling but non-null when `len() == 0`).
    fn as_mut_ptr(&self) -> *mut u8;

    /// A destination whose bytes must land through a staging pipeline
    /// (`transport/staging/`) rather than straight through `as_mut_ptr`.
    fn staged(&self) -> Option<&crate::transport::staging::StagedDestination> {
        None
    }
}

/// A destination in this process's heap, zero-initialised.
pub struct HeapDestination {
    pointer: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by the struct and only accessed through raw
// pointers; nothing in it is tied to the creating thread.
unsafe impl Send for HeapDestination {}
// SAFETY: shared access only hands out the raw pointer; writes through it are
// the transports' business under the `WritableDestination` contract.
unsafe impl Sync for HeapDestination {}

impl HeapDestination {
    pub fn new(len: usize) -> HeapDestination {
        let boxed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        HeapDestination {
            pointer: Box::into_raw(boxed).cast::<u8>(),
            len,
        }
    }

    /// A copy of the current contents. Meant for after a transfer completed.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `pointer` is valid for `len` bytes (allocated in `new`,
        // freed only in drop) and `out` is a distinct allocation of `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.pointer, out.as_mut_ptr(), self.len) };
        out
    }
}

// SAFETY: the pointer comes from a boxed slice of exactly `len` bytes that is
// freed only in `drop`, and never moves.
unsafe impl WritableDestination for HeapDestination {
    fn len(&self) -> usize {
        self.len
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.pointer
    }
}

impl Drop for HeapDestination {
    fn drop(&mut self) {
        // SAFETY: `pointer`/`len` came from `Box::into_raw` of a `[u8]` of
        // exactly `len` bytes in `new`, and this is the only place freeing it.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.pointer, self.len)) });
    }
}

impl fmt::Debug for HeapDestination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HeapDestination({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_destination_starts_zeroed_and_reads_back_writes() {
        let destination = HeapDestination::new(16);
        assert_eq!(destination.to_vec(), vec![0u8; 16]);
        // SAFETY: the destination is 16 bytes long and not otherwise accessed.
        unsafe { destination.as_mut_ptr().add(3).write(7) };
        assert_eq!(destination.to_vec()[3], 7);
        let empty = HeapDestination::new(0);
        assert!(empty.is_empty());
        assert!(empty.to_vec().is_empty());
    }
}
