//! The UCX transport's DATA, ACK and CHUNK headers (`transport/ucx/wire.rs`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_ucx_am_header(data));
