//! `DeviceCopy`: the one thing the staging pipeline asks of device memory,
//! copying a chunk between it and a ring slot, asynchronously, with a
//! completion to poll or wait on. The CUDA implementation would be
//! `cuMemcpyHtoDAsync`/`cuMemcpyDtoHAsync` on the device's stream plus an
//! event recorded after it (`Pending` polls `cuEventQuery`); `HostCopy`
//! is the host one: device memory is host memory and the copy a memcpy
//! that has completed when it returns.
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ring::Slot;
use crate::status::{self, Result};
use crate::transport::destination::WritableDestination;

/// The completion of a copy that may still run.
pub trait CopyCompletion: Send {
    /// True once the copy completed; `Err` if it failed (it is over then).
    fn is_done(&mut self) -> Result<bool>;

    /// Waits until the copy completed or `until`, whichever is first;
    /// false when `until` came first.
    fn wait_until(&mut self, until: Instant) -> Result<bool>;
}

/// A copy's completion: `Done` at once (memcpy), or still to come.
pub enum Pending {
    Done,
    Running(Box<dyn CopyCompletion>),
}

impl Pending {
    pub fn is_done(&mut self) -> Result<bool> {
        match self {
            Pending::Done => Ok(true),
            Pending::Running(completion) => {
                let done = completion.is_done()?;
                if done {
                    *self = Pending::Done;
                }
                Ok(done)
            }
        }
    }

    pub fn wait_until(&mut self, until: Instant) -> Result<bool> {
        match self {
            Pending::Done => Ok(true),
            Pending::Running(completion) => {
                let done = completion.wait_until(until)?;
                if done {
                    *self = Pending::Done;
                }
                Ok(done)
            }
        }
    }
}

/// Copies between one buffer's device memory and ring slots.
pub trait DeviceCopy: Send + Sync {
    /// Bytes of device memory this copier reaches.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts copying the first `len` bytes of `slot` to device memory at
    /// `offset`. The slot must not be reused before the copy completed.
    fn to_device(&self, slot: &Slot, offset: usize, len: usize) -> Result<Pending>;

    /// Starts copying `len` device bytes at `offset` into the start of
    /// `slot`.
    fn to_host(&self, offset: usize, slot: &Slot, len: usize) -> Result<Pending>;
}

/// Checks that `len` bytes at `offset` lie in both the device memory and
/// the slot.
pub fn check_range(device_len: usize, slot: &Slot, offset: usize, len: usize) -> Result<()> {
    let inside = offset.checked_add(len).is_some_and(|end| end <= device_len);
    if !inside || len > slot.len() {
        return Err(status::out_of_range(format!(
            "a staged copy of {len} bytes at {offset}: device memory has {device_len}, the staging \
             buffer {}",
            slot.len()
        )));
    }
    Ok(())
}

/// Host "device" memory: the copy is a memcpy, complete when it returns.
pub struct HostCopy {
    memory: Arc<dyn WritableDestination>,
}

impl HostCopy {
    pub fn new(memory: Arc<dyn WritableDestination>) -> HostCopy {
        HostCopy { memory }
    }
}

impl DeviceCopy for HostCopy {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn to_device(&self, slot: &Slot, offset: usize, len: usize) -> Result<Pending> {
        check_range(self.memory.len(), slot, offset, len)?;
        // SAFETY: `check_range` put `offset + len` inside the memory, which
        // the `WritableDestination` contract keeps valid and writable while
        // `self.memory` lives, and `len` inside the slot; a slot is private
        // memory of this process, so the two ranges never overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(slot.as_ptr(), self.memory.as_mut_ptr().add(offset), len)
        };
        Ok(Pending::Done)
    }

    fn to_host(&self, offset: usize, slot: &Slot, len: usize) -> Result<Pending> {
        check_range(self.memory.len(), slot, offset, len)?;
        // SAFETY: as in `to_device`, in the other direction.
        unsafe {
            std::ptr::copy_nonoverlapping(self.memory.as_mut_ptr().add(offset), slot.as_ptr(), len)
        };
        Ok(Pending::Done)
    }
}

/// Host memory a sender reads from, as `DeviceCopy` for the send
/// pipeline: the bytes are copied out of it.
pub struct HostSource<'a> {
    bytes: &'a [u8],
}

impl<'a> HostSource<'a> {
    pub fn new(bytes: &'a [u8]) -> HostSource<'a> {
        HostSource { bytes }
    }
}

impl DeviceCopy for HostSource<'_> {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn to_device(&self, _slot: &Slot, _offset: usize, _len: usize) -> Result<Pending> {
        Err(status::failed_precondition(
            "a send's source memory is not written",
        ))
    }

    fn to_host(&self, offset: usize, slot: &Slot, len: usize) -> Result<Pending> {
        check_range(self.bytes.len(), slot, offset, len)?;
        // SAFETY: both ranges were checked just above; the slot is private
        // memory of this process (no reference covers it while its owner
        // lends it to a copy) and distinct from the source.
        unsafe {
            std::ptr::copy_nonoverlapping(self.bytes.as_ptr().add(offset), slot.as_ptr(), len)
        };
        Ok(Pending::Done)
    }
}

/// How long a waiter on a completion sleeps at most between looks at its
/// pipeline's stop signal.
pub const COMPLETION_SLICE: Duration = Duration::from_millis(5);
