pub mod bindings;
pub mod kv_callbacks;
