//! `pjrt_crosshost_doctor_json`: the doctor's report (api/doctor/) for
//! callers that reach the library only through C, such as
//! `python -m jax_plugins.crosshost doctor`.
use std::ffi::{CStr, CString};
use std::os::raw::c_char;

use super::boundary::or_on_panic;

/// Runs the doctor with `request` (NUL-terminated `key=value` lines: create
/// options, `doctor.coordinator`, `doctor.timeout_ms`; NULL: none) and
/// returns its report as JSON. Free with `pjrt_crosshost_free_string`.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_doctor_json(request: *const c_char) -> *mut c_char {
    or_on_panic(std::ptr::null_mut(), || {
        super::logging::init();
        let request = if request.is_null() {
            String::new()
        } else {
            // SAFETY: the caller passes a NUL-terminated string (header).
            unsafe { CStr::from_ptr(request) }
                .to_string_lossy()
                .into_owned()
        };
        let report = crate::api::doctor::run(&request);
        CString::new(report.json())
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
}
