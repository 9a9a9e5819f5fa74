//! `Descriptor::decode` past the checksum: length and CRC restamped on every input.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_descriptor(&crosshost_fuzz::reseal(data)));
