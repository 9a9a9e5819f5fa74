//! `Descriptor::decode` on raw bytes (v1 notifier payload / v2 descriptor-key value).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_descriptor(data));
