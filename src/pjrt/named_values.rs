//! `PJRT_NamedValue`, both ways: an owned array built from Rust values (for
//! create options and device descriptions we hand out) and a copy of an array
//! another plugin owns (its attributes, its device descriptions).
// PJRT constants keep their C names.
#![allow(non_upper_case_globals)]
use std::os::raw::c_char;

use super::bindings::*;

/// The value of one `PJRT_NamedValue`: a create option, a plugin attribute or
/// a device description attribute.
#[derive(Clone, Debug, PartialEq)]
pub enum NamedValue {
    Str(String),
    Int(i64),
    IntList(Vec<i64>),
    Float(f32),
    Bool(bool),
}

/// A `PJRT_NamedValue` array plus the names and values it points into.
pub struct NamedValues {
    _owned: Vec<(String, NamedValue)>,
    pub values: Vec<PJRT_NamedValue>,
}
// SAFETY: the raw pointers in `values` point into `_owned`, whose strings and
// lists are never mutated or moved after construction (moving the Vec does
// not move their heap buffers).
unsafe impl Send for NamedValues {}
// SAFETY: as above.
unsafe impl Sync for NamedValues {}

impl NamedValues {
    pub fn new(owned: Vec<(String, NamedValue)>) -> NamedValues {
        let values = owned
            .iter()
            .map(|(name, value)| {
                let mut v = PJRT_NamedValue {
                    struct_size: PJRT_NamedValue_STRUCT_SIZE as usize,
                    name: name.as_ptr() as *const c_char,
                    name_size: name.len(),
                    ..Default::default()
                };
                match value {
                    NamedValue::Str(s) => {
                        v.type_ = PJRT_NamedValue_kString;
                        v.__bindgen_anon_1.string_value = s.as_ptr() as *const c_char;
                        v.value_size = s.len();
                    }
                    NamedValue::Int(i) => {
                        v.type_ = PJRT_NamedValue_kInt64;
                        v.__bindgen_anon_1.int64_value = *i;
                        v.value_size = 1;
                    }
                    NamedValue::IntList(list) => {
                        v.type_ = PJRT_NamedValue_kInt64List;
                        v.__bindgen_anon_1.int64_array_value = list.as_ptr();
                        v.value_size = list.len();
                    }
                    NamedValue::Float(f) => {
                        v.type_ = PJRT_NamedValue_kFloat;
                        v.__bindgen_anon_1.float_value = *f;
                        v.value_size = 1;
                    }
                    NamedValue::Bool(b) => {
                        v.type_ = PJRT_NamedValue_kBool;
                        v.__bindgen_anon_1.bool_value = *b;
                        v.value_size = 1;
                    }
                }
                v
            })
            .collect();
        NamedValues {
            _owned: owned,
            values,
        }
    }
}

/// Copies a `PJRT_NamedValue` array another plugin owns.
///
/// # Safety
/// `values` must be null or point to `count` valid named values.
pub unsafe fn copy_named_values(
    values: *const PJRT_NamedValue,
    count: usize,
) -> Vec<(String, NamedValue)> {
    if values.is_null() || count == 0 {
        return Vec::new();
    }
    // SAFETY: forwarded contract.
    let values = unsafe { std::slice::from_raw_parts(values, count) };
    let text = |ptr: *const c_char, len: usize| {
        if ptr.is_null() || len == 0 {
            String::new()
        } else {
            // SAFETY: a named value's pointers are valid for their sizes.
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
                .into_owned()
        }
    };
    values
        .iter()
        .filter_map(|v| {
            let name = text(v.name, v.name_size);
            // SAFETY: `type_` selects the union member.
            let value = unsafe {
                match v.type_ {
                    PJRT_NamedValue_kString => {
                        NamedValue::Str(text(v.__bindgen_anon_1.string_value, v.value_size))
                    }
                    PJRT_NamedValue_kInt64 => NamedValue::Int(v.__bindgen_anon_1.int64_value),
                    PJRT_NamedValue_kInt64List => {
                        let p = v.__bindgen_anon_1.int64_array_value;
                        NamedValue::IntList(if p.is_null() || v.value_size == 0 {
                            Vec::new()
                        } else {
                            std::slice::from_raw_parts(p, v.value_size).to_vec()
                        })
                    }
                    PJRT_NamedValue_kFloat => NamedValue::Float(v.__bindgen_anon_1.float_value),
                    PJRT_NamedValue_kBool => NamedValue::Bool(v.__bindgen_anon_1.bool_value),
                    _ => return None,
                }
            };
            Some((name, value))
        })
        .collect()
}
