//! Turning C arguments into Rust values: the one place an entry reads a
//! pointer, a (pointer, length) pair, a string or a handle it was given, and
//! hands back a borrowed string. Each helper returns the error an entry
//! returns as it is: null is an `INVALID_ARGUMENT` naming the function and
//! the field, never a crash.
//!
//! Entry files (`client.rs`, `buffer.rs`, ...) import these and only
//! translate; the args struct itself is checked by the boundary
//! (`boundary::checked_args`, through `pjrt_entry!`).
use std::os::raw::c_char;

use super::handles::{
    try_borrow, try_take, BufferHandle, Castable, ClientHandle, DescriptionHandle, DeviceHandle,
    EventHandle, MemoryHandle, OwnedBox,
};
use crate::api::element_type::Shape;
use crate::api::options::OptionValue;
use crate::pjrt::bindings::*;
use crate::status::{invalid_argument, unimplemented, Result, Status};

// ------------------------------ errors ---------------------------------------

/// Names the function for error messages inside an entry body.
pub(crate) fn null_field(function: &str, field: &str) -> Status {
    invalid_argument(format!("{function}: {field} is null"))
}

// ------------------------------ arrays ---------------------------------------

/// # Safety
/// `ptr` must be null or point to `len` readable `T`s.
pub(crate) unsafe fn array<'a, T>(
    ptr: *const T,
    len: usize,
    function: &str,
    field: &str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null_field(function, field));
    }
    // SAFETY: forwarded contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Reads a `num_dims`/`dims` pair.
///
/// # Safety
/// `dims` must be null or point to `num_dims` readable int64s.
pub(crate) unsafe fn read_dims(
    dims: *const i64,
    num_dims: usize,
    function: &str,
) -> Result<Vec<i64>> {
    // SAFETY: forwarded contract.
    Ok(unsafe { array(dims, num_dims, function, "dims") }?.to_vec())
}

/// Only the dense row-major layout exists on this backend.
///
/// # Safety
/// `layout` must be null or a readable `PJRT_Buffer_MemoryLayout`.
pub(crate) unsafe fn check_default_layout(
    layout: *const PJRT_Buffer_MemoryLayout,
    shape: &Shape,
    function: &str,
) -> Result<()> {
    if layout.is_null() {
        return Ok(());
    }
    // SAFETY: forwarded contract.
    let layout = unsafe { &*layout };
    let is_default = match layout.type_ {
        PJRT_Buffer_MemoryLayout_Type_Tiled => {
            // SAFETY: `type_` selects the tiled member of the union.
            let tiled = unsafe { &layout.__bindgen_anon_1.tiled };
            // SAFETY: header promises minor_to_major_size entries.
            let minor_to_major = unsafe {
                array(
                    tiled.minor_to_major,
                    tiled.minor_to_major_size,
                    function,
                    "layout.tiled.minor_to_major",
                )
            }?;
            tiled.num_tiles == 0 && minor_to_major == shape.default_minor_to_major()
        }
        PJRT_Buffer_MemoryLayout_Type_Strides => {
            // SAFETY: `type_` selects the strides member of the union.
            let strides = unsafe { &layout.__bindgen_anon_1.strides };
            // SAFETY: header promises num_byte_strides entries.
            let given = unsafe {
                array(
                    strides.byte_strides,
                    strides.num_byte_strides,
                    function,
                    "layout.strides.byte_strides",
                )
            }?;
            given == shape.dense_byte_strides()
        }
        other => {
            return Err(invalid_argument(format!(
                "{function}: unknown memory layout type {other}"
            )))
        }
    };
    if is_default {
        Ok(())
    } else {
        Err(unimplemented(format!(
            "{function}: only the dense row-major layout is supported on this device"
        )))
    }
}

// ------------------------------ strings --------------------------------------

/// A (pointer, size) pair for a string that outlives the call.
pub(crate) fn str_out(s: &str) -> (*const c_char, usize) {
    (s.as_ptr() as *const c_char, s.len())
}

/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn read_str(
    ptr: *const c_char,
    len: usize,
    function: &str,
    field: &str,
) -> Result<String> {
    if len == 0 {
        return Ok(String::new());
    }
    if ptr.is_null() {
        return Err(null_field(function, field));
    }
    // SAFETY: forwarded contract.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    String::from_utf8(bytes.to_vec())
        .map_err(|_| invalid_argument(format!("{function}: {field} is not valid UTF-8")))
}

/// Text that has no wrong value (an error message the caller sends us):
/// null or empty is "", bytes that are not UTF-8 are replaced.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn lossy_str(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: forwarded contract.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// # Safety
/// `values` must be null or point to `count` readable `PJRT_NamedValue`s whose
/// pointers are valid for the sizes they state.
pub(crate) unsafe fn read_named_values(
    values: *const PJRT_NamedValue,
    count: usize,
    function: &str,
) -> Result<Vec<(String, OptionValue)>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if values.is_null() {
        return Err(null_field(function, "create_options"));
    }
    // SAFETY: forwarded contract.
    let values = unsafe { std::slice::from_raw_parts(values, count) };
    let mut out = Vec::with_capacity(count);
    for v in values {
        // SAFETY: forwarded contract.
        let name = unsafe { read_str(v.name, v.name_size, function, "option name") }?;
        // SAFETY: `type_` selects the union member; pointers are valid for
        // `value_size` per the header.
        let value = unsafe {
            match v.type_ {
                PJRT_NamedValue_kString => OptionValue::Str(read_str(
                    v.__bindgen_anon_1.string_value,
                    v.value_size,
                    function,
                    "option string value",
                )?),
                PJRT_NamedValue_kInt64 => OptionValue::Int(v.__bindgen_anon_1.int64_value),
                PJRT_NamedValue_kInt64List => OptionValue::IntList(
                    array(
                        v.__bindgen_anon_1.int64_array_value,
                        v.value_size,
                        function,
                        "option int64 list",
                    )?
                    .to_vec(),
                ),
                PJRT_NamedValue_kFloat => OptionValue::Float(v.__bindgen_anon_1.float_value),
                PJRT_NamedValue_kBool => OptionValue::Bool(v.__bindgen_anon_1.bool_value),
                other => {
                    return Err(invalid_argument(format!(
                        "{function}: option '{name}' has unknown value type {other}"
                    )))
                }
            }
        };
        out.push((name, value));
    }
    Ok(out)
}

// ------------------------------ handles --------------------------------------
//
// Borrowed handles (`try_borrow`): the caller keeps its handle. Helpers whose
// field name varies between entries take it; the others name it themselves.

/// Borrows the client named in an args struct.
///
/// # Safety
/// `client` must be null or a client handle that has not been destroyed.
pub(crate) unsafe fn client_arg<'a>(
    client: *const PJRT_Client,
    function: &str,
) -> Result<&'a ClientHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<ClientHandle>(client, function, "client") }
}

/// # Safety
/// `device` must be null or a live device handle.
pub(crate) unsafe fn device_arg<'a>(
    device: *mut PJRT_Device,
    function: &str,
    field: &str,
) -> Result<&'a DeviceHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<DeviceHandle>(device, function, field) }
}

/// # Safety
/// `description` must be null or a live description handle.
pub(crate) unsafe fn description_arg<'a>(
    description: *mut PJRT_DeviceDescription,
    function: &str,
) -> Result<&'a DescriptionHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<DescriptionHandle>(description, function, "device_description") }
}

/// # Safety
/// `memory` must be null or a live memory handle.
pub(crate) unsafe fn memory_arg<'a>(
    memory: *mut PJRT_Memory,
    function: &str,
    field: &str,
) -> Result<&'a MemoryHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<MemoryHandle>(memory, function, field) }
}

/// # Safety
/// `buffer` must be null or a live buffer handle.
pub(crate) unsafe fn buffer_arg<'a>(
    buffer: *mut PJRT_Buffer,
    function: &str,
    field: &str,
) -> Result<&'a BufferHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<BufferHandle>(buffer, function, field) }
}

/// # Safety
/// `event` must be null or a live event handle.
pub(crate) unsafe fn event_arg<'a>(
    event: *mut PJRT_Event,
    function: &str,
) -> Result<&'a EventHandle> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<EventHandle>(event, function, "event") }
}

/// Takes back an owned handle (client, buffer, event) a `_Destroy` entry
/// was given; `None` for null, which the header allows destroying.
///
/// # Safety
/// `handle` must be null or a live owned handle of type `H` that the caller
/// gives up here.
pub(crate) unsafe fn owned_arg<H: Castable<Ownership = OwnedBox>>(
    handle: *mut H::C,
    function: &str,
    field: &str,
) -> Result<Option<Box<H>>> {
    if handle.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { try_take::<H>(handle, function, field) }.map(Some)
}
