//! `ProcessEntry::decode` on a peer's session entry.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_session_entry(data));
