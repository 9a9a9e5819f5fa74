//! An UNIMPLEMENTED entry for every `PJRT_Api` slot, generated from the
//! header by build.rs; `api_table` overrides the ones the plugin offers.
#![allow(non_snake_case)]

use super::bindings::*;
use super::boundary::or_on_panic;
use super::errors::error_into_raw;
use crate::status::unimplemented;

pub(crate) fn unimplemented_error(function: &str) -> *mut PJRT_Error {
    let purpose = if function.contains("Compile")
        || function.contains("Executable")
        || function.contains("Execute")
    {
        " pjrt-crosshost is a data-movement plugin: it moves buffers between hosts and \
         processes and does not compile or run programs; use another backend for compute."
    } else {
        ""
    };
    error_into_raw(unimplemented(format!(
        "{function} is not implemented by pjrt-crosshost.{purpose}"
    )))
}

macro_rules! define_unimplemented {
    ($name:ident, $args:ident) => {
        /// UNIMPLEMENTED naming the function; the caller owns the error.
        pub(crate) unsafe extern "C" fn $name(_args: *mut $args) -> *mut PJRT_Error {
            or_on_panic(std::ptr::null_mut(), || {
                unimplemented_error(stringify!($name))
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
