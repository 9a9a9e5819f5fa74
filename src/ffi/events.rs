//! PJRT_Event_*: events are futures of an outcome; caller-made events carry
//! the promise that `PJRT_Event_Set` fulfils.
use std::ffi::c_void;

use super::args::{event_arg, lossy_str, null_field, owned_arg};
use super::errors::error_into_raw;
use super::handles::{into_raw, EventHandle};
use crate::pjrt::bindings::*;
use crate::status::{failed_precondition, invalid_argument, Code, Status};

const SET: &str = "PJRT_Event_Set";

crate::pjrt_entry!(
    /// Destroys the caller's event handle; null is allowed. Callbacks already
    /// registered still run.
    event_destroy = "PJRT_Event_Destroy", PJRT_Event_Destroy_Args through event, |args| {
    // SAFETY: `event` is an owned event handle the caller gives up (or null).
    drop(unsafe { owned_arg::<EventHandle>(args.event, "PJRT_Event_Destroy", "event") }?);
    Ok(())
});

crate::pjrt_entry!(
    /// Whether the event's outcome is published.
    event_is_ready = "PJRT_Event_IsReady", PJRT_Event_IsReady_Args through is_ready, |args| {
    // SAFETY: caller passes a live event.
    let event = unsafe { event_arg(args.event, "PJRT_Event_IsReady") }?;
    args.is_ready = event.future.is_ready();
    Ok(())
});

crate::pjrt_entry!(
    /// The outcome of a ready event: null, or a new error the caller owns.
    /// FAILED_PRECONDITION while it is not ready.
    event_error = "PJRT_Event_Error", PJRT_Event_Error_Args through event, |args| {
    // SAFETY: caller passes a live event.
    let event = unsafe { event_arg(args.event, "PJRT_Event_Error") }?;
    match event.future.try_get() {
        Some(outcome) => outcome,
        None => Err(failed_precondition("PJRT_Event_Error: event is not ready yet")),
    }
});

crate::pjrt_entry!(
    /// Blocks until the event is ready, then returns its outcome as
    /// `PJRT_Event_Error` does.
    event_await = "PJRT_Event_Await", PJRT_Event_Await_Args through event, |args| {
    // SAFETY: caller passes a live event.
    let event = unsafe { event_arg(args.event, "PJRT_Event_Await") }?;
    // Awaited from inside a callback of ours (a thread holding a cork):
    // what that thread corked may be what the event waits for.
    crate::transport::control::flush_corked();
    event.future.wait()
});

/// The user's callback and argument, moved to whichever thread publishes.
struct OnReadyCallback {
    callback: unsafe extern "C" fn(*mut PJRT_Error, *mut c_void),
    user_arg: usize,
}

crate::pjrt_entry!(
    /// Calls `callback(error, user_arg)` once with the outcome: now if the
    /// event is ready, else on the thread that completes it. The callback owns
    /// the error it gets. INVALID_ARGUMENT for a null callback.
    event_on_ready = "PJRT_Event_OnReady", PJRT_Event_OnReady_Args through user_arg, |args| {
    // SAFETY: caller passes a live event.
    let event = unsafe { event_arg(args.event, "PJRT_Event_OnReady") }?;
    let callback = args
        .callback
        .ok_or_else(|| null_field("PJRT_Event_OnReady", "callback"))?;
    let cb = OnReadyCallback {
        callback,
        user_arg: args.user_arg as usize,
    };
    event.future.on_ready(move |outcome| {
        let error = match outcome {
            Ok(()) => std::ptr::null_mut(),
            Err(status) => error_into_raw(status.clone()),
        };
        let cb = cb;
        // A panic in user code must not unwind through us either.
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: the caller's callback; it takes ownership of `error`.
            unsafe { (cb.callback)(error, cb.user_arg as *mut c_void) }
        });
    });
    Ok(())
});

crate::pjrt_entry!(
    /// A new event that the caller completes with `PJRT_Event_Set`; the caller
    /// owns it.
    event_create = "PJRT_Event_Create", PJRT_Event_Create_Args through event, |args| {
    args.event = into_raw(EventHandle::settable());
    Ok(())
});

crate::pjrt_entry!(
    /// Completes an event of `PJRT_Event_Create`: `error_code` 0 is success,
    /// else an error with `error_message`. Its callbacks run before this
    /// returns, and may destroy the handle. FAILED_PRECONDITION when already
    /// set, INVALID_ARGUMENT for an event that `PJRT_Event_Create` did not
    /// make.
    event_set = "PJRT_Event_Set", PJRT_Event_Set_Args through error_message_size, |args| {
    // SAFETY: caller passes a live event.
    let event = unsafe { event_arg(args.event, SET) }?;
    // A clone: setting may run callbacks that destroy the handle (an event
    // handed to CopyToRemoteDevice), so nothing of it is touched after.
    let promise = event.promise.clone().ok_or_else(|| {
        invalid_argument("PJRT_Event_Set: event was not created by PJRT_Event_Create")
    })?;
    let outcome = if args.error_code == 0 {
        Ok(())
    } else {
        // SAFETY: the header promises `error_message_size` readable bytes.
        let message = unsafe { lossy_str(args.error_message, args.error_message_size) };
        Err(Status::new(Code::from_raw(args.error_code as i32), message))
    };
    if promise.set(outcome) {
        Ok(())
    } else {
        Err(failed_precondition("PJRT_Event_Set: event was already set"))
    }
});
