//! Asynchronous copies between a CUDA allocation and host memory, each
//! with its own completion: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` on
//! the device's stream, then a host function (`cuLaunchHostFunc`) on the
//! same stream that marks the copy complete and wakes whoever waits. The
//! staging pipeline (`transport/staging/`) starts one per chunk and polls or
//! waits on it; with pinned host memory (`pinned.rs`) the call returns
//! before the bytes move, so a chunk's copy overlaps the wire.
//!
//! A completion holds the device memory (an `Allocation` clone) until the
//! copy completed, so memory a late copy may still reach is never freed
//! under it (the rule of `shelf.rs`); the host side is the caller's to keep
//! (a staging ring parks a slot whose copy may still run).
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result;
use cudarc::driver::sys;
use parking_lot::{Condvar, Mutex};

use crate::backend::Allocation;
use crate::status::{self, Result};

use super::*;

/// The completion of one asynchronous copy.
pub struct CopyDone {
    signal: Arc<Signal>,
    /// The device memory the copy reads or writes, kept until it is done.
    memory: Option<Allocation>,
}

#[derive(Default)]
struct Signal {
    done: Mutex<bool>,
    changed: Condvar,
}

impl CopyDone {
    /// True once the copy completed.
    pub fn is_done(&mut self) -> bool {
        let done = *self.signal.done.lock();
        if done {
            self.memory = None;
        }
        done
    }

    /// Waits until the copy completed or `until`; false when `until` came
    /// first.
    pub fn wait_until(&mut self, until: Instant) -> bool {
        let mut done = self.signal.done.lock();
        while !*done {
            if self.signal.changed.wait_until(&mut done, until).timed_out() {
                break;
            }
        }
        let finished = *done;
        drop(done);
        if finished {
            self.memory = None;
        }
        finished
    }
}

/// Runs on a driver thread once everything queued before it on the stream
/// completed: marks the copy done.
unsafe extern "C" fn copy_completed(user_data: *mut c_void) {
    // SAFETY: `user_data` came from `Arc::into_raw` in `after_stream` and
    // this host function runs exactly once; it makes no CUDA call.
    let signal = unsafe { Arc::from_raw(user_data as *const Signal) };
    *signal.done.lock() = true;
    signal.changed.notify_all();
}

impl CudaMemory {
    /// Starts copying `len` bytes from host memory at `source` into this
    /// allocation at `offset`; the copy is done when the returned
    /// completion says so. `memory` is this allocation as its owners hold
    /// it (kept by the completion until the copy is done).
    ///
    /// # Safety
    /// `source` must be valid for reading `len` bytes, and neither written
    /// nor freed until the completion reports the copy done (pinned memory,
    /// for the copy to be asynchronous at all).
    pub unsafe fn copy_from_host_async(
        &self,
        memory: &Allocation,
        offset: usize,
        source: *const u8,
        len: usize,
    ) -> Result<CopyDone> {
        self.check(offset, len, "asynchronous write")?;
        self.device.activate()?;
        if len > 0 {
            // SAFETY: the range lies inside the allocation (checked); the
            // caller keeps `source` valid and unwritten until completion.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.pointer + offset as u64,
                    source.cast(),
                    len,
                    self.device.stream,
                )
            }
            .result()
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e))?;
        }
        self.after_stream(memory)
    }

    /// Starts copying `len` bytes of this allocation at `offset` into host
    /// memory at `target`; see `copy_from_host_async`.
    ///
    /// # Safety
    /// `target` must be valid for writing `len` bytes, and neither read,
    /// written nor freed until the completion reports the copy done.
    pub unsafe fn copy_to_host_async(
        &self,
        memory: &Allocation,
        offset: usize,
        target: *mut u8,
        len: usize,
    ) -> Result<CopyDone> {
        self.check(offset, len, "asynchronous read")?;
        self.device.activate()?;
        if len > 0 {
            // SAFETY: as in `copy_from_host_async`, the other way.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    target.cast(),
                    self.pointer + offset as u64,
                    len,
                    self.device.stream,
                )
            }
            .result()
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
        }
        self.after_stream(memory)
    }

    /// A completion for everything queued on this device's stream so far.
    fn after_stream(&self, memory: &Allocation) -> Result<CopyDone> {
        let signal = Arc::new(Signal::default());
        let raw = Arc::into_raw(signal.clone()) as *mut c_void;
        // SAFETY: the stream lives for the process; `raw` is an owned
        // reference the host function takes back exactly once.
        let launched = unsafe {
            result::stream::launch_host_function(self.device.stream, copy_completed, raw)
        };
        if let Err(e) = launched {
            // SAFETY: not launched: the reference is still ours to drop.
            drop(unsafe { Arc::from_raw(raw as *const Signal) });
            // The copy may still run: wait for the stream before the caller
            // reuses its host memory.
            let _ = self
                .device
                .synchronize("a copy whose completion could not be queued");
            return Err(driver_error("cuLaunchHostFunc", e));
        }
        Ok(CopyDone {
            signal,
            memory: Some(memory.clone()),
        })
    }
}

/// Checks that `memory` is CUDA memory, for the asynchronous copies.
pub fn expect_cuda<'a>(memory: &'a Allocation, what: &str) -> Result<&'a CudaMemory> {
    memory
        .as_cuda()
        .ok_or_else(|| status::invalid_argument(format!("{what}: not CUDA device memory")))
}
