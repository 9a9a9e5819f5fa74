//! Errors of the compute plugin become ours as they cross: a caller only
//! ever holds `PJRT_Error`s of this plugin, so `PJRT_Error_*` never has to
//! guess whose an error is. The inner plugin's own functions read and free
//! it (an XLA error has no vtable to go by).
use std::os::raw::c_char;

use super::ComputePlugin;
use crate::pjrt::bindings::*;
use crate::status::{Code, Status};

/// Reads `error` through the inner plugin's functions and destroys it.
/// `None` for null (success).
pub fn take_inner_error(plugin: &ComputePlugin, error: *mut PJRT_Error) -> Option<Status> {
    if error.is_null() {
        return None;
    }
    let mut message_args = PJRT_Error_Message_Args {
        struct_size: PJRT_Error_Message_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        error,
        message: std::ptr::null::<c_char>(),
        message_size: 0,
    };
    let message = match crate::inner_fn!(plugin, PJRT_Error_Message).flatten() {
        Some(f) => {
            // SAFETY: the inner plugin's function on its own live error.
            unsafe { f(&mut message_args) };
            super::inner_str(message_args.message, message_args.message_size)
        }
        None => String::from("(the compute plugin gave no message)"),
    };
    let mut code_args = PJRT_Error_GetCode_Args {
        struct_size: PJRT_Error_GetCode_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        error,
        code: PJRT_Error_Code_UNKNOWN,
    };
    let destroy = |e: *mut PJRT_Error| {
        let mut args = PJRT_Error_Destroy_Args {
            struct_size: PJRT_Error_Destroy_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            error: e,
        };
        if let Some(f) = crate::inner_fn!(plugin, PJRT_Error_Destroy).flatten() {
            // SAFETY: we own the error and destroy it once.
            unsafe { f(&mut args) };
        }
    };
    let code = match crate::inner_fn!(plugin, PJRT_Error_GetCode).flatten() {
        Some(f) => {
            // SAFETY: the inner plugin's function on its own live error.
            let failed = unsafe { f(&mut code_args) };
            if failed.is_null() {
                Code::from_raw(code_args.code as i32)
            } else {
                destroy(failed);
                Code::Unknown
            }
        }
        None => Code::Unknown,
    };
    destroy(error);
    Some(Status::new(code, message))
}
