//! An UNIMPLEMENTED entry for every `PJRT_Api` slot, generated from the
//! header by build.rs; `api_table` overrides the ones the plugin offers.
#![allow(non_snake_case)]

use super::boundary::catch_entry;
use super::errors::error_into_raw;
use crate::pjrt::bindings::*;
use crate::status::unimplemented;

pub(crate) fn unimplemented_error(function: &str) -> *mut PJRT_Error {
    #[cfg(test)]
    if tests::PANIC_IN_ENTRIES.get() {
        panic!("injected by a test");
    }
    let purpose = if function.contains("Compile")
        || function.contains("Executable")
        || function.contains("Execute")
    {
        " pjrt-crosshost moves buffers between hosts and processes; programs are compiled \
         and run by a compute plugin it delegates to (create option compute_plugin, \
         PJRT_CROSSHOST_COMPUTE_PLUGIN, or pip install pjrt-crosshost[cpu]), and none is \
         configured for this client."
    } else {
        ""
    };
    error_into_raw(unimplemented(format!(
        "{function} is not implemented by pjrt-crosshost.{purpose}"
    )))
}

macro_rules! define_unimplemented {
    ($name:ident, $args:ident) => {
        /// UNIMPLEMENTED naming the function (INTERNAL if building that
        /// error panicked, never null); the caller owns the error.
        pub(crate) unsafe extern "C" fn $name(_args: *mut $args) -> *mut PJRT_Error {
            catch_entry(stringify!($name), module_path!(), || {
                Ok(unimplemented_error(stringify!($name)))
            })
        }
    };
}

include!(concat!(env!("OUT_DIR"), "/pjrt_api_slots.rs"));
for_each_pjrt_api_slot!(define_unimplemented);

/// Fills every slot with its UNIMPLEMENTED entry.
pub(crate) fn fill(api: &mut PJRT_Api) {
    macro_rules! set_unimplemented {
        ($name:ident, $args:ident) => {
            api.$name = Some($name);
        };
    }
    for_each_pjrt_api_slot!(set_unimplemented);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::errors::take_error;
    use std::cell::Cell;

    thread_local! {
        pub(super) static PANIC_IN_ENTRIES: Cell<bool> = const { Cell::new(false) };
    }

    #[test]
    fn an_entry_whose_body_panics_returns_an_internal_error_not_success() {
        PANIC_IN_ENTRIES.set(true);
        // SAFETY: the entry ignores its args.
        let error = unsafe { PJRT_Compile(std::ptr::null_mut()) };
        PANIC_IN_ENTRIES.set(false);
        assert!(
            !error.is_null(),
            "a panicking UNIMPLEMENTED entry reported success"
        );
        // SAFETY: a live error we own.
        let status = unsafe { take_error(error) }.expect("an error");
        assert_eq!(status.code, crate::status::Code::Internal, "{status}");
        assert!(status.message.contains("PJRT_Compile"), "{status}");
        // SAFETY: as above.
        let error = unsafe { PJRT_Compile(std::ptr::null_mut()) };
        // SAFETY: as above.
        let status = unsafe { take_error(error) }.expect("an error");
        assert_eq!(status.code, crate::status::Code::Unimplemented, "{status}");
    }
}
