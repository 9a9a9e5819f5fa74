//! The panic boundary every exported function goes through, and the args
//! struct checks before it. One boundary per return kind:
//!
//! | the function returns | boundary | a failure goes to | a panic becomes |
//! |---|---|---|---|
//! | `PJRT_Error*` (PJRT and extension entries) | `pjrt_entry!`; the routing entries of `forward/` (extension shims included) through `forward::run_dispatch`, on the same `catch_entry` | the returned error | `INTERNAL` naming the function, logged |
//! | `void`, reporting through a callback in its args (`CopyToRemoteDevice`) | `callback_entry!` | the caller's callback; null args, a struct too short to hold the callback, or a null callback leave nothing to report to and are logged | a log line |
//! | a value with no error channel (`GetPjrtApi`, the `pjrt_crosshost_*` exports, `PJRT_Error_Destroy`, `PJRT_Error_Message`) | `or_on_panic` | the function's own convention (NULL, -1) | the given default |
//!
//! The generated UNIMPLEMENTED entries (`unimplemented.rs`) also use
//! `or_on_panic`, with null: their body only formats the error.
//!
//! Callbacks we hand out are C entry points too, but their signatures are
//! fixed by whoever calls them, so each keeps its own boundary, here listed
//! once:
//! - the v1 cancel notifier (`transfers.rs`) catches a panic and reports it,
//!   as an `INTERNAL` error, to the `on_canceled` callback it was given;
//! - `forwarded_on_ready` (`forward/translated.rs`) catches a panic and drops
//!   it: its caller is the compute plugin, which has no way to hear of it;
//! - the error and memory vtables (`errors.rs`, `handles/memory.rs`), the KV
//!   `callback_error` (`kv_callbacks.rs`) and the attribute and
//!   serialized-bytes deleters catch nothing: they only read, copy, allocate
//!   or free.
//!
//! Where we call a caller's callback (`PJRT_Event_OnReady`'s, `on_done`, the
//! v1 notifier) the call sits in a `catch_unwind` of its own; that guards our
//! thread, it is not an entry's boundary.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;

use super::errors::error_into_raw;
use crate::pjrt::bindings::PJRT_Error;
use crate::status::{internal, invalid_argument, panic_message, Result, Status};
use crate::sync::timeline;

/// The `PJRT_Error*` boundary: `Ok(error)` is returned as it is (null for
/// success), `Err` becomes a `PJRT_Error`, a panic INTERNAL naming the
/// function. Nothing unwinds into the caller. `log_target` is the module the
/// log lines are filed under (`PJRT_CROSSHOST_LOG` filters on it).
pub(crate) fn catch_entry(
    name: &'static str,
    log_target: &'static str,
    body: impl FnOnce() -> Result<*mut PJRT_Error>,
) -> *mut PJRT_Error {
    let _call = timeline::api_call(name);
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(error)) => error,
        Ok(Err(status)) => {
            log::debug!(target: log_target, "{name} failed: {status}");
            error_into_raw(status)
        }
        Err(panic) => {
            let what = panic_message(&*panic);
            log::error!(
                target: log_target,
                "{name}: internal panic caught at the C boundary: {what}"
            );
            error_into_raw(internal(format!("{name}: internal error (panic: {what})")))
        }
    }
}

/// Runs one entry's body: `Ok` → null, `Err` → a `PJRT_Error`, panic →
/// INTERNAL naming the function (see `catch_entry`).
pub(crate) fn run_entry(name: &'static str, body: impl FnOnce() -> Result<()>) -> *mut PJRT_Error {
    catch_entry(name, module_path!(), || body().map(|()| ptr::null_mut()))
}

/// The boundary of a function with no error channel: `body`'s value, or
/// `default` if it panics.
pub(crate) fn or_on_panic<T>(default: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(default)
}

/// The callback a `void` entry reports through, read from its args.
pub(crate) trait Callback<Args>: Copy {
    /// The callback's field in the args, for the log line when it is null.
    const FIELD: &'static str;
    /// The caller's callback; `None` when it is null.
    fn from_args(args: &Args) -> Option<Self>;
    /// Hands the caller a failure of the entry itself.
    fn report(self, status: Status);
}

/// Runs one `void` entry that reports through a callback in its args (see
/// `callback_entry!`). `holder` names the args field that holds the
/// callback, which `required` covers; `log_target` as in `catch_entry`.
///
/// # Safety
/// As `checked_args`.
pub(crate) unsafe fn run_callback_entry<T, C: Callback<T>>(
    name: &'static str,
    log_target: &'static str,
    raw: *mut T,
    required: usize,
    holder: &str,
    body: impl FnOnce(&mut T, C) -> Result<()>,
) {
    let _call = timeline::api_call(name);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        if raw.is_null() {
            log::error!(target: log_target, "{name}: args is null; no {holder} to report to");
            return;
        }
        // SAFETY: forwarded contract.
        let args = match unsafe { checked_args(raw, name, required) } {
            Ok(args) => args,
            Err(status) => {
                log::error!(
                target: log_target,
                    "{status}; {holder} is outside the caller's struct, nothing to report to"
                );
                return;
            }
        };
        let Some(callback) = C::from_args(args) else {
            log::error!(target: log_target, "{name}: {} is null; nothing to report to", C::FIELD);
            return;
        };
        if let Err(status) = body(args, callback) {
            callback.report(status);
        }
    }));
    if let Err(panic) = outcome {
        log::error!(
            target: log_target,
            "{name}: internal panic caught at the C boundary: {}",
            panic_message(&*panic)
        );
    }
}

/// Checks that `raw` is non-null and that the caller's `struct_size` covers at
/// least `required` bytes (the fields this function cannot do without).
///
/// # Safety
/// `raw` must be null or point to a readable args struct whose first field is
/// `size_t struct_size` and that is at least `struct_size` bytes long.
pub(crate) unsafe fn checked_args<'a, T>(
    raw: *mut T,
    name: &str,
    required: usize,
) -> Result<&'a mut T> {
    if raw.is_null() {
        return Err(invalid_argument(format!("{name}: args is null")));
    }
    // SAFETY: every PJRT args struct begins with `size_t struct_size`, and the
    // caller guarantees `raw` points to one.
    let struct_size = unsafe { *(raw as *const usize) };
    if struct_size < required {
        return Err(invalid_argument(format!(
            "{name}: args struct_size {struct_size} is smaller than the {required} bytes this function needs"
        )));
    }
    // SAFETY: non-null, and the caller provided at least `required` bytes.
    // Fields beyond `struct_size` are only read after `has_field!` checks.
    Ok(unsafe { &mut *raw })
}

/// Size of a struct up to and including `field`: what a caller's
/// `struct_size` must cover for `field` to exist.
#[macro_export]
#[doc(hidden)]
macro_rules! struct_size_through {
    ($ty:ty, $field:ident) => {{
        fn size_of_pointee<T>(_: *const T) -> usize {
            ::std::mem::size_of::<T>()
        }
        let probe = ::std::mem::MaybeUninit::<$ty>::uninit();
        ::std::mem::offset_of!($ty, $field)
            // SAFETY: addr_of! on an uninitialised value only computes an
            // address; nothing is read.
            + size_of_pointee(unsafe { ::std::ptr::addr_of!((*probe.as_ptr()).$field) })
    }};
}

/// Whether the caller's args struct is large enough to contain `field`.
#[macro_export]
#[doc(hidden)]
macro_rules! has_field {
    ($args:expr, $ty:ty, $field:ident) => {
        $args.struct_size >= $crate::struct_size_through!($ty, $field)
    };
}

/// Defines one `PJRT_Error*`-returning C entry: null/size checks, panic
/// boundary, `Result` → `PJRT_Error`.
#[macro_export]
#[doc(hidden)]
macro_rules! pjrt_entry {
    ($(#[$meta:meta])* $rust_name:ident = $c_name:literal, $ty:ident through $field:ident, |$args:ident| $body:block) => {
        $(#[$meta])*
        pub(crate) unsafe extern "C" fn $rust_name(
            raw: *mut $crate::pjrt::bindings::$ty,
        ) -> *mut $crate::pjrt::bindings::PJRT_Error {
            $crate::ffi::boundary::run_entry($c_name, || {
                let required = $crate::struct_size_through!($crate::pjrt::bindings::$ty, $field);
                // SAFETY: the PJRT contract: `raw` is null or a valid args
                // struct of the caller's `struct_size`; checked_args rejects
                // null and short structs.
                let $args = unsafe {
                    $crate::ffi::boundary::checked_args(raw, $c_name, required)
                }?;
                $body
            })
        }
    };
}

/// Defines one `void` C entry that reports through a callback in its args:
/// null/size checks, panic boundary, `Err` → the caller's callback (see
/// `run_callback_entry`). `$field` is the args field that holds the
/// callback; `$cb_ty` implements `boundary::Callback` for the args.
#[macro_export]
#[doc(hidden)]
macro_rules! callback_entry {
    ($(#[$meta:meta])* $rust_name:ident = $c_name:literal, $ty:ident through $field:ident, |$args:ident, $cb:ident: $cb_ty:ty| $body:block) => {
        $(#[$meta])*
        pub(crate) unsafe extern "C" fn $rust_name(raw: *mut $crate::pjrt::bindings::$ty) {
            let required = $crate::struct_size_through!($crate::pjrt::bindings::$ty, $field);
            // SAFETY: the PJRT contract: `raw` is null or a valid args
            // struct of the caller's `struct_size`; run_callback_entry
            // rejects null and short structs.
            unsafe {
                $crate::ffi::boundary::run_callback_entry::<_, $cb_ty>(
                    $c_name,
                    module_path!(),
                    raw,
                    required,
                    stringify!($field),
                    |$args, $cb| $body,
                )
            }
        }
    };
}
