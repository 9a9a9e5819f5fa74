//! Binding to the two-line C++ shim (src/ffi/cxx/delete_shim.cc) that frees
//! the descriptor out-pointers of v5 CopyToRemoteDevice callers the way
//! upstream did: with C++ `delete`.
use std::os::raw::c_char;

extern "C" {
    fn pjrt_crosshost_cxx_delete_descriptor_pointers(data: *mut *mut c_char, size: *mut usize);
}

/// # Safety
/// Both pointers must have been allocated with C++ `new` by the caller (the
/// pre-v6 contract) and not be used afterwards.
pub(crate) unsafe fn delete_v5_descriptor_pointers(data: *mut *mut c_char, size: *mut usize) {
    // SAFETY: forwarded contract.
    unsafe { pjrt_crosshost_cxx_delete_descriptor_pointers(data, size) }
}
