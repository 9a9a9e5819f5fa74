//! `CompletionKey::parse`, `reader_of`, `validate_epoch` on key names.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_keys(data));
