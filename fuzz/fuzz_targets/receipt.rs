//! `Receipt::decode` on a completion key's value.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_receipt(data));
