//! A process-wide KV delete callback, for clients whose `PJRT_Client_Create`
//! args carry no `PJRT_CrossHost_KvDeleteExtension`. JAX cannot attach one
//! (the PJRT C API has no delete), but its distributed client can delete:
//! `jax_plugins.crosshost` registers a callback that does, so receipts that
//! go through JAX's coordination service (`kv_store=callbacks`) are deleted
//! for real.
//!
//! The hazards of calling back into a framework:
//! - Threads: the callback only runs on the callback store's delete pool,
//!   after the buffer's outcome is published, never holding a lock that
//!   readiness needs; a framework lock it takes (Python's GIL) delays only
//!   other deletes.
//! - Shutdown: unregistering (NULL) stops new calls at once and returns when
//!   the calls in flight have returned (at most `UNREGISTER_WAIT`), so a
//!   framework that unregisters before it finalizes is never called after.
//! - fork: the registration belongs to the process that made it; a forked
//!   child (whose framework threads are gone) never calls it.
//! - A failing or hanging callback: its error is the delete's outcome
//!   (counted, logged, the buffer's status stands); the store bounds the
//!   wait for it.
use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::boundary::or_on_panic;
use crate::pjrt::bindings::PJRT_CrossHost_KeyValueDeleteCallback_Args;
use crate::pjrt::bindings::PJRT_Error;

pub(crate) type DeleteFn =
    unsafe extern "C" fn(*mut PJRT_CrossHost_KeyValueDeleteCallback_Args) -> *mut PJRT_Error;

/// How long unregistering waits for calls in flight.
const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

struct Route {
    callback: DeleteFn,
    /// The caller's opaque pointer, passed back only to `callback`.
    user_arg: usize,
    pid: u32,
    in_flight: Mutex<usize>,
    returned: Condvar,
}

static ROUTE: Mutex<Option<Arc<Route>>> = Mutex::new(None);

/// Marks one call in flight until dropped.
struct InFlight(Arc<Route>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut calls = self.0.in_flight.lock();
        *calls -= 1;
        if *calls == 0 {
            self.0.returned.notify_all();
        }
    }
}

/// The registered callback of this process, counted in flight while the
/// returned guard lives; `None` when none is registered (or it was
/// registered before a fork).
fn begin_call() -> Option<(InFlight, DeleteFn, *mut c_void)> {
    // Counted under the registration lock, so an unregister that took the
    // route sees every call that can still reach the callback.
    let route = ROUTE.lock();
    let route = route
        .as_ref()
        .filter(|r| r.pid == std::process::id())?
        .clone();
    *route.in_flight.lock() += 1;
    let (callback, user_arg) = (route.callback, route.user_arg as *mut c_void);
    Some((InFlight(route), callback, user_arg))
}

/// Whether a delete callback is registered for this process.
pub(crate) fn registered() -> bool {
    ROUTE
        .lock()
        .as_ref()
        .is_some_and(|r| r.pid == std::process::id())
}

/// Calls the registered callback with `args` (its `user_arg` filled in);
/// `None` when none is registered.
///
/// # Safety
/// `args` is a valid args struct whose pointers live for the call.
pub(crate) unsafe fn call(
    args: &mut PJRT_CrossHost_KeyValueDeleteCallback_Args,
) -> Option<*mut PJRT_Error> {
    let (in_flight, callback, user_arg) = begin_call()?;
    args.user_arg = user_arg;
    // SAFETY: the registered callback, thread-safe per its contract, with
    // valid args (caller) and the user arg it was registered with.
    let error = unsafe { callback(args) };
    drop(in_flight);
    Some(error)
}

/// Replaces the registration; with `None`, waits (bounded) for the calls
/// in flight. Returns whether they all returned in time.
fn set(route: Option<(DeleteFn, *mut c_void)>) -> bool {
    let new = route.map(|(callback, user_arg)| {
        Arc::new(Route {
            callback,
            user_arg: user_arg as usize,
            pid: std::process::id(),
            in_flight: Mutex::new(0),
            returned: Condvar::new(),
        })
    });
    let Some(old) = std::mem::replace(&mut *ROUTE.lock(), new) else {
        return true;
    };
    let deadline = Instant::now() + UNREGISTER_WAIT;
    let mut calls = old.in_flight.lock();
    while *calls > 0 {
        if old.returned.wait_until(&mut calls, deadline).timed_out() {
            log::warn!(
                "pjrt_crosshost_set_kv_delete: {} delete call(s) still in flight after {UNREGISTER_WAIT:?}",
                *calls
            );
            return false;
        }
    }
    true
}

/// Registers `callback` (with `user_arg`) as this process's KV delete for
/// clients without a `PJRT_CrossHost_KvDeleteExtension`; NULL unregisters.
/// Returns 0; 1 when unregistering found calls to the old callback still in
/// flight after 5 s (no new call starts either way); -1 on an internal
/// error. Deleting an absent key must not be an error.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_set_kv_delete(
    callback: Option<DeleteFn>,
    user_arg: *mut c_void,
) -> c_int {
    or_on_panic(-1, || match set(callback.map(|c| (c, user_arg))) {
        true => 0,
        false => 1,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Serializes the tests that touch the process-wide registration.
    pub(crate) static REGISTRATION: Mutex<()> = Mutex::new(());

    static CALLS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn counting(
        _args: *mut PJRT_CrossHost_KeyValueDeleteCallback_Args,
    ) -> *mut PJRT_Error {
        CALLS.fetch_add(1, Ordering::SeqCst);
        std::ptr::null_mut()
    }

    fn args() -> PJRT_CrossHost_KeyValueDeleteCallback_Args {
        PJRT_CrossHost_KeyValueDeleteCallback_Args {
            struct_size: std::mem::size_of::<PJRT_CrossHost_KeyValueDeleteCallback_Args>(),
            extension_start: std::ptr::null_mut(),
            key: c"k".as_ptr(),
            key_size: 1,
            callback_error: std::ptr::null_mut(),
            user_arg: std::ptr::null_mut(),
        }
    }

    #[test]
    fn registered_callback_is_called_until_unregistered_and_never_after_a_fork() {
        let _serial = REGISTRATION.lock();
        assert_eq!(
            pjrt_crosshost_set_kv_delete(Some(counting), std::ptr::null_mut()),
            0
        );
        assert!(registered());
        let before = CALLS.load(Ordering::SeqCst);
        // SAFETY: valid args.
        assert!(unsafe { call(&mut args()) }.is_some_and(|e| e.is_null()));
        assert_eq!(CALLS.load(Ordering::SeqCst), before + 1);
        // A registration made by another process (what a forked child
        // inherits) is not this process's.
        if let Some(r) = ROUTE.lock().as_mut() {
            *r = Arc::new(Route {
                callback: counting,
                user_arg: 0,
                pid: std::process::id() + 1,
                in_flight: Mutex::new(0),
                returned: Condvar::new(),
            });
        }
        assert!(!registered());
        // SAFETY: valid args.
        assert!(unsafe { call(&mut args()) }.is_none());
        assert_eq!(pjrt_crosshost_set_kv_delete(None, std::ptr::null_mut()), 0);
        assert!(!registered());
        // SAFETY: valid args.
        assert!(unsafe { call(&mut args()) }.is_none());
        assert_eq!(CALLS.load(Ordering::SeqCst), before + 1);
    }

    static ENTERED: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());
    static RELEASE: (Mutex<bool>, Condvar) = (Mutex::new(false), Condvar::new());

    unsafe extern "C" fn blocking(
        _args: *mut PJRT_CrossHost_KeyValueDeleteCallback_Args,
    ) -> *mut PJRT_Error {
        *ENTERED.0.lock() = true;
        ENTERED.1.notify_all();
        let mut released = RELEASE.0.lock();
        while !*released {
            RELEASE.1.wait(&mut released);
        }
        std::ptr::null_mut()
    }

    #[test]
    fn unregistering_waits_for_the_call_in_flight_and_stops_new_ones() {
        let _serial = REGISTRATION.lock();
        assert_eq!(
            pjrt_crosshost_set_kv_delete(Some(blocking), std::ptr::null_mut()),
            0
        );
        let in_flight = std::thread::spawn(|| {
            // SAFETY: valid args.
            unsafe { call(&mut args()) }.is_some()
        });
        let mut entered = ENTERED.0.lock();
        while !*entered {
            ENTERED.1.wait(&mut entered);
        }
        drop(entered);
        let unregister =
            std::thread::spawn(|| pjrt_crosshost_set_kv_delete(None, std::ptr::null_mut()));
        // The route is gone for new calls at once, though the old call runs.
        let deadline = Instant::now() + Duration::from_secs(5);
        while registered() {
            assert!(
                Instant::now() < deadline,
                "unregistering did not stop new calls"
            );
            std::thread::yield_now();
        }
        assert!(
            !unregister.is_finished(),
            "unregister returned with a call in flight"
        );
        *RELEASE.0.lock() = true;
        RELEASE.1.notify_all();
        assert_eq!(unregister.join().unwrap(), 0);
        assert!(in_flight.join().unwrap());
    }
}
