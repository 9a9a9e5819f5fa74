//! Reading C strings and named values; handing out borrowed strings.
use std::os::raw::c_char;

use super::bindings::*;
use super::boundary::null_field;
use crate::api::options::OptionValue;
use crate::status::{invalid_argument, Result};

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
                PJRT_NamedValue_kInt64List => {
                    let p = v.__bindgen_anon_1.int64_array_value;
                    if v.value_size > 0 && p.is_null() {
                        return Err(null_field(function, "option int64 list"));
                    }
                    let list = if v.value_size == 0 {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(p, v.value_size).to_vec()
                    };
                    OptionValue::IntList(list)
                }
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
