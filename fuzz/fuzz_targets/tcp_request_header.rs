//! `wire::RequestHeader::decode` on what a sender sends the TCP transfer server.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| crosshost_fuzz::check_tcp_request_header(data));
