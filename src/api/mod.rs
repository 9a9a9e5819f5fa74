//! Safe Rust model of PJRT: client, devices, memories, buffers.
pub mod buffer;
pub mod client;
pub mod device;
pub mod device_ids;
pub mod doctor;
pub mod element_type;
pub mod options;
pub mod programs;
pub mod transfers;
