//! The epoch record `<epoch> <secret-hex> <written ms>` as a joining process parses it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_session_epoch(data));
