//! PJRT_Error: our status behind the header's self-describing error layout
//! (a vtable pointer first), and taking one back (ours or another
//! implementation's). The `PJRT_Error_*` entries are in `error_entries.rs`.
use std::os::raw::c_char;
use std::ptr;

use crate::pjrt::bindings::*;
use crate::status::{Code, Status};

/// Our error object. `base` must stay first: callers may read `vtable`.
#[repr(C)]
pub(crate) struct ErrorObject {
    base: PJRT_Error,
    status: Status,
}

struct ErrorTable(PJRT_Error_FunctionTable);
// SAFETY: the table is immutable after construction and holds only function
// pointers and a null extension pointer.
unsafe impl Sync for ErrorTable {}

static ERROR_TABLE: ErrorTable = ErrorTable(PJRT_Error_FunctionTable {
    struct_size: std::mem::size_of::<PJRT_Error_FunctionTable>(),
    instance_size: std::mem::size_of::<ErrorObject>(),
    extension_start: ptr::null_mut(),
    destroy: Some(vt_destroy),
    message: Some(vt_message),
    get_code: Some(vt_get_code),
    for_each_payload: Some(vt_for_each_payload),
});

pub(crate) fn error_into_raw(status: Status) -> *mut PJRT_Error {
    let object = Box::new(ErrorObject {
        base: PJRT_Error {
            vtable: &ERROR_TABLE.0,
        },
        status,
    });
    Box::into_raw(object) as *mut PJRT_Error
}

/// Reads an error of ours; `None` for null or a foreign error.
///
/// # Safety
/// `error` must be null or a live `PJRT_Error`.
pub(crate) unsafe fn error_status<'a>(error: *const PJRT_Error) -> Option<&'a Status> {
    if error.is_null() {
        return None;
    }
    // SAFETY: a live PJRT_Error begins with its vtable pointer.
    let vtable = unsafe { (*error).vtable };
    if ptr::eq(vtable, &ERROR_TABLE.0) {
        // SAFETY: our vtable ⇒ allocated by error_into_raw as an ErrorObject.
        Some(unsafe { &(*(error as *const ErrorObject)).status })
    } else {
        None
    }
}

/// Converts any live PJRT_Error (ours or one made by another implementation
/// of the header's vtable) into a Status and frees it.
///
/// # Safety
/// `error` must be null or a live `PJRT_Error` that the caller owns.
pub(crate) unsafe fn take_error(error: *mut PJRT_Error) -> Option<Status> {
    if error.is_null() {
        return None;
    }
    // SAFETY: forwarded contract.
    if let Some(status) = unsafe { error_status(error) } {
        let status = status.clone();
        // SAFETY: ours, allocated as a Box<ErrorObject>.
        drop(unsafe { Box::from_raw(error as *mut ErrorObject) });
        return Some(status);
    }
    // SAFETY: a foreign error still carries the header's vtable.
    let table = unsafe { (*error).vtable.as_ref() };
    let status = match table {
        Some(t) => {
            let code = t.get_code.map(|f| unsafe { f(error) }).unwrap_or(2);
            let mut message: *const c_char = ptr::null();
            let mut size = 0usize;
            if let Some(f) = t.message {
                // SAFETY: vtable function of a live error, out-params valid.
                unsafe { f(error, &mut message, &mut size) };
            }
            // SAFETY: the vtable promises `size` readable bytes.
            let text = unsafe { super::args::lossy_str(message, size) };
            if let Some(f) = t.destroy {
                // SAFETY: we own the error and destroy it once.
                unsafe { f(error) };
            }
            Status::new(Code::from_raw(code as i32), text)
        }
        None => Status::new(Code::Unknown, "foreign PJRT_Error without a vtable"),
    };
    Some(status)
}

/// vtable `destroy`: frees one of our errors (null is ignored).
unsafe extern "C" fn vt_destroy(error: *mut PJRT_Error) {
    if !error.is_null() {
        // SAFETY: our vtable is only installed on Box<ErrorObject>s.
        drop(unsafe { Box::from_raw(error as *mut ErrorObject) });
    }
}

/// vtable `message`: borrows the message (alive until the error is
/// destroyed); null out-pointers are skipped.
unsafe extern "C" fn vt_message(
    error: *const PJRT_Error,
    message: *mut *const c_char,
    size: *mut usize,
) {
    // SAFETY: our vtable ⇒ `error` is an ErrorObject; out-params per header.
    unsafe {
        let status = &(*(error as *const ErrorObject)).status;
        if !message.is_null() {
            *message = status.message.as_ptr() as *const c_char;
        }
        if !size.is_null() {
            *size = status.message.len();
        }
    }
}

/// vtable `get_code`.
unsafe extern "C" fn vt_get_code(error: *const PJRT_Error) -> PJRT_Error_Code {
    // SAFETY: our vtable ⇒ `error` is an ErrorObject.
    unsafe { (*(error as *const ErrorObject)).status.code as PJRT_Error_Code }
}

/// vtable `for_each_payload`: visits nothing.
unsafe extern "C" fn vt_for_each_payload(
    _error: *const PJRT_Error,
    _visitor: PJRT_Error_PayloadVisitor,
    _user_arg: *mut std::ffi::c_void,
) {
    // Our errors carry no payloads.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_round_trip_through_the_vtable() {
        let raw = error_into_raw(Status::new(Code::NotFound, "missing key"));
        // SAFETY: freshly made error.
        let status = unsafe { take_error(raw) }.unwrap();
        assert_eq!(status.code, Code::NotFound);
        assert_eq!(status.message, "missing key");
    }
}
