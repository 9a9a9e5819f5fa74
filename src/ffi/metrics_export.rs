//! The plugin's own exports declared in include/pjrt_crosshost.h.
use std::ffi::CString;
use std::os::raw::c_char;

use super::args::client_arg;
use super::boundary::or_on_panic;
use crate::pjrt::bindings::PJRT_Client;

/// JSON snapshot of the client's transfer metrics; NULL for a null or
/// invalid client. Free with `pjrt_crosshost_free_string`.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_metrics_json(client: *const PJRT_Client) -> *mut c_char {
    or_on_panic(std::ptr::null_mut(), || {
        // SAFETY: null or a live client handle (the tag check rejects others).
        match unsafe { client_arg(client, "pjrt_crosshost_metrics_json") } {
            Ok(handle) => CString::new(handle.client.metrics_json())
                .map(CString::into_raw)
                .unwrap_or(std::ptr::null_mut()),
            Err(status) => {
                log::warn!("{status}");
                std::ptr::null_mut()
            }
        }
    })
}

/// The transfer timeline's marks recorded so far in this process (JSON,
/// src/sync/timeline.rs; `[]` unless PJRT_CROSSHOST_TIMELINE=1), emptying
/// the record. Free with `pjrt_crosshost_free_string`.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_timeline_json() -> *mut c_char {
    or_on_panic(std::ptr::null_mut(), || {
        CString::new(crate::sync::timeline::take_json())
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
}

/// Frees a string returned by this plugin. NULL is ignored.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_free_string(s: *mut c_char) {
    or_on_panic((), || {
        if !s.is_null() {
            // SAFETY: made by CString::into_raw in this library.
            drop(unsafe { CString::from_raw(s) });
        }
    })
}
