//! The four `PJRT_Error_*` entries of the API table, over `errors.rs`:
//! destroy, message, code and payloads of an error, ours or another
//! implementation's (through its vtable).
use std::ptr;

use super::args::null_field;
use super::boundary::or_on_panic;
use super::errors::take_error;
use crate::pjrt::bindings::*;
use crate::status::Code;
use crate::sync::timeline;

/// Frees `error`, ours or another implementation's (through its vtable), which
/// the caller gives up. Null args or a null error do nothing: this function
/// has no way to report.
pub(crate) unsafe extern "C" fn error_destroy(args: *mut PJRT_Error_Destroy_Args) {
    let _call = timeline::api_call("PJRT_Error_Destroy");
    or_on_panic((), || {
        if args.is_null() {
            return;
        }
        // SAFETY: non-null args per the PJRT contract; `error` may be null.
        let error = unsafe { (*args).error };
        // SAFETY: the caller owns `error` and gives it up here.
        drop(unsafe { take_error(error) });
    })
}

/// Borrows the error's message (alive until the error is destroyed), through
/// its vtable. A null error gives an empty message; null args do nothing.
pub(crate) unsafe extern "C" fn error_message(args: *mut PJRT_Error_Message_Args) {
    let _call = timeline::api_call("PJRT_Error_Message");
    or_on_panic((), || {
        if args.is_null() {
            return;
        }
        // SAFETY: non-null args per the PJRT contract.
        let args = unsafe { &mut *args };
        args.message = ptr::null();
        args.message_size = 0;
        if args.error.is_null() {
            return;
        }
        // SAFETY: `error` is a live PJRT_Error; its vtable answers.
        unsafe {
            if let Some(f) = (*args.error).vtable.as_ref().and_then(|t| t.message) {
                f(args.error, &mut args.message, &mut args.message_size);
            }
        }
    })
}

crate::pjrt_entry!(
    /// The error's code, through its vtable (ours or another
    /// implementation's). INVALID_ARGUMENT for a null error.
    error_get_code = "PJRT_Error_GetCode", PJRT_Error_GetCode_Args through code, |args| {
    if args.error.is_null() {
        return Err(super::args::null_field("PJRT_Error_GetCode", "error"));
    }
    // SAFETY: `error` is a live PJRT_Error; its vtable answers.
    args.code = unsafe {
        match (*args.error).vtable.as_ref().and_then(|t| t.get_code) {
            Some(f) => f(args.error),
            None => Code::Unknown as PJRT_Error_Code,
        }
    };
    Ok(())
});

const FOR_EACH_PAYLOAD: &str = "PJRT_Error_ForEachPayload";

crate::pjrt_entry!(
    /// Visits the error's payloads: ours carry none, another implementation's
    /// are visited through its own vtable. INVALID_ARGUMENT only for a null
    /// error: jaxlib converts every PJRT_Error to a Status through GetCode,
    /// Message and ForEachPayload, and an error from ForEachPayload makes it
    /// convert that error too, recursing until the stack overflows.
    error_for_each_payload = "PJRT_Error_ForEachPayload", PJRT_Error_ForEachPayload_Args through user_arg, |args| {
    if args.error.is_null() {
        return Err(null_field(FOR_EACH_PAYLOAD, "error"));
    }
    // SAFETY: `error` is a live PJRT_Error; a live PJRT_Error begins with
    // the header's vtable pointer.
    let for_each = unsafe { (*args.error).vtable.as_ref() }.and_then(|t| t.for_each_payload);
    if let Some(f) = for_each {
        // SAFETY: the error's own vtable function, with the caller's visitor.
        unsafe { f(args.error, args.visitor, args.user_arg) };
    }
    Ok(())
});
