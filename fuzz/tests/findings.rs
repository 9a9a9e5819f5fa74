//! Findings (fuzz/artifacts-found/README.md), fixed, one regression test
//! each over the input that showed it.
use std::fs;
use std::path::Path;

use pjrt_crosshost::status::Code;
use pjrt_crosshost::transfer::session::ProcessEntry;

fn found(path: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts-found")
        .join(path);
    fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// F1: `read_response` decodes the message with `from_utf8_lossy`, which
/// turns each invalid byte into a 3-byte U+FFFD: a 1366-byte message of 0xff
/// came back as 4098 bytes (limit 4096) and did not round-trip.
#[test]
fn f1_tcp_response_message_stays_within_its_limit_and_round_trips() {
    crosshost_fuzz::check_tcp_response(&found("tcp_response/message-expands-past-limit"));
}

/// F2: a peer's session entry stated any `usize` device count, and
/// `Session::device_ids` summed them as `i32` (overflow; in release, billions
/// of devices allocated at client creation). Counts above
/// `MAX_DEVICES_PER_PROCESS` are now malformed entries.
#[test]
fn f2_absurd_peer_device_counts_are_refused_as_malformed() {
    for path in [
        "session_entry/device-count-a",
        "session_entry/device-count-b",
    ] {
        let error = ProcessEntry::decode(1, &found(path)).unwrap_err();
        assert_eq!(error.code, Code::DataLoss, "{path}: {error}");
        crosshost_fuzz::check_session_entry(&found(path));
    }
}
