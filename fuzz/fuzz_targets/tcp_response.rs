//! `wire::read_response` on what the TCP transfer server answers.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_tcp_response(data));
