//! Receive buffers the caller holds before their outcome: the compute
//! plugin's alias buffers, which XLA's CPU plugin CHECK-fails on (aborting
//! the host process, `raw_buffer.h: buffer_.IsConcrete()`) when asked for
//! their memory while they are pending or after they were fulfilled with an
//! error, as `np.asarray` does through `PJRT_Buffer_IncreaseExternalReferenceCount`.
//! Until a receive succeeded, the calls that reach a buffer's memory ask
//! here first: they wait for the outcome, and a failed receive answers with
//! the transfer's own status (DEADLINE_EXCEEDED, UNAVAILABLE naming the
//! peer...), never with the plugin's abort. A succeeded receive leaves the
//! table at once; a failed one when the caller destroys its handle.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::InnerPtr;
use crate::pjrt::bindings::PJRT_Buffer;
use crate::status::{Outcome, Result, Status};
use crate::sync::{Future, PromiseOnce};

struct Entry {
    /// Tells a handle's entry from a later one at the same address.
    watch: u64,
    outcome: Future,
}

static RECEIVES: Lazy<Mutex<HashMap<InnerPtr, Entry>>> = Lazy::new(Default::default);
static NEXT_WATCH: AtomicU64 = AtomicU64::new(1);

/// One receive buffer's entry, settled once with the receive's outcome
/// (after the buffer itself was fulfilled or failed).
pub struct ReceiveWatch {
    buffer: InnerPtr,
    watch: u64,
    promise: PromiseOnce,
}

/// Enters `buffer` before its handle reaches the caller.
pub fn watch(buffer: *mut PJRT_Buffer) -> ReceiveWatch {
    let (promise, outcome) = PromiseOnce::new();
    let watch = NEXT_WATCH.fetch_add(1, Ordering::Relaxed);
    let buffer = InnerPtr::from(buffer);
    RECEIVES.lock().insert(buffer, Entry { watch, outcome });
    ReceiveWatch {
        buffer,
        watch,
        promise,
    }
}

impl ReceiveWatch {
    /// The receive is over and the compute plugin's buffer says so.
    pub fn settle(self, outcome: &Outcome) {
        if outcome.is_ok() {
            let mut receives = RECEIVES.lock();
            if receives.get(&self.buffer).map(|e| e.watch) == Some(self.watch) {
                receives.remove(&self.buffer);
            }
        }
        self.promise.set(outcome.clone());
    }
}

impl Drop for ReceiveWatch {
    /// Never left pending: a receive whose setup failed is over.
    fn drop(&mut self) {
        if !self.promise.is_set() {
            self.promise.set(Err(crate::status::cancelled(
                "the receive was abandoned before it started",
            )));
        }
    }
}

/// `PJRT_Buffer_Destroy` of `buffer`: its address may be reused.
pub fn forget(buffer: *mut PJRT_Buffer) {
    RECEIVES.lock().remove(&InnerPtr::from(buffer));
}

fn entry(buffer: *mut PJRT_Buffer) -> Option<Future> {
    RECEIVES
        .lock()
        .get(&InnerPtr::from(buffer))
        .map(|e| e.outcome.clone())
}

fn failure(function: &str, status: Status) -> Status {
    Status::new(
        status.code,
        format!(
            "{function}: the buffer's cross-host receive failed: {}",
            status.message
        ),
    )
}

/// For calls that need the memory itself (pointers, external references):
/// waits for a pending receive (its own deadline bounds the wait); a failed
/// one is its status.
pub fn await_receive(buffer: *mut PJRT_Buffer, function: &str) -> Result<()> {
    match entry(buffer) {
        None => Ok(()),
        Some(outcome) => outcome.wait().map_err(|s| failure(function, s)),
    }
}

/// For calls that take the buffer asynchronously (copies, execution): a
/// receive that already failed is its status; a pending one goes through
/// (the compute plugin waits for it).
pub fn check_receive(buffer: *mut PJRT_Buffer, function: &str) -> Result<()> {
    match entry(buffer).and_then(|outcome| outcome.try_get()) {
        Some(Err(status)) => Err(failure(function, status)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{deadline_exceeded, Code};

    fn fake(address: usize) -> *mut PJRT_Buffer {
        address as *mut PJRT_Buffer
    }

    #[test]
    fn a_failed_receive_answers_with_its_status_until_the_handle_is_destroyed() {
        let b = fake(0x1000_0001);
        let w = watch(b);
        assert!(check_receive(b, "F").is_ok(), "pending goes through");
        w.settle(&Err(deadline_exceeded("no receipt within 3s")));
        let e = await_receive(b, "PJRT_Buffer_IncreaseExternalReferenceCount").unwrap_err();
        assert_eq!(e.code, Code::DeadlineExceeded);
        assert!(e.message.contains("no receipt within 3s"), "{}", e.message);
        assert!(e
            .message
            .starts_with("PJRT_Buffer_IncreaseExternalReferenceCount"));
        assert_eq!(
            check_receive(b, "F").unwrap_err().code,
            Code::DeadlineExceeded
        );
        forget(b);
        assert!(await_receive(b, "F").is_ok() && check_receive(b, "F").is_ok());
    }

    #[test]
    fn a_succeeded_receive_leaves_the_table_and_waiters_go_on() {
        let b = fake(0x1000_0002);
        let w = watch(b);
        let address = b as usize;
        let waiter = std::thread::spawn(move || await_receive(fake(address), "F"));
        w.settle(&Ok(()));
        assert!(waiter.join().unwrap().is_ok());
        assert!(entry(b).is_none());
    }

    #[test]
    fn a_late_outcome_of_a_destroyed_handle_does_not_touch_a_new_buffer_at_its_address() {
        let b = fake(0x1000_0003);
        let old = watch(b);
        forget(b);
        let new = watch(b);
        old.settle(&Ok(()));
        assert!(entry(b).is_some(), "the new buffer's entry stays");
        new.settle(&Err(deadline_exceeded("x")));
        assert!(check_receive(b, "F").is_err());
        forget(b);
    }
}
