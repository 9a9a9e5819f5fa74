//! The epoch record `<epoch> <secret-hex>` as `Session::establish` parses it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_session_epoch(data));
