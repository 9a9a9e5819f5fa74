//! `ControlEndpoint::decode` on the control field of a session entry.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_control_endpoint(data));
