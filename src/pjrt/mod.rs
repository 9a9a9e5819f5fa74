//! The ground floor: the PJRT header's types, as bindgen declares them, and
//! the one way to build and copy `PJRT_NamedValue` arrays. Both directions
//! of the C boundary use them: `ffi/` (the plugin others call) and
//! `compute_plugin/` (the plugin we call).
pub mod bindings;
pub mod named_values;
