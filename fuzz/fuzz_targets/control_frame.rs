//! The control link's `read_frame` (short reads, deadline), its buffered
//! `FrameReader` against it, and `split_key`.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_control_frame(data));
