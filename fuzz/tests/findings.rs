//! Open findings (fuzz/artifacts-found/README.md), one test each. They state
//! the behaviour the code should have and fail today, so they are ignored;
//! `cargo test -- --ignored` in fuzz/ shows them failing. Once a finding is
//! fixed, drop its `#[ignore]` and move its input into fuzz/corpus/<target>/.
use std::fs;
use std::path::Path;

use pjrt_crosshost::transfer::session::{ProcessEntry, Session};
use pjrt_crosshost::transport::control::Secret;

fn found(path: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("artifacts-found")
        .join(path);
    fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// F1: `read_response` documents messages of at most 4096 bytes, but it
/// decodes them with `from_utf8_lossy`, which turns each invalid byte into a
/// 3-byte U+FFFD: a 1366-byte message of 0xff comes back as 4098 bytes, and
/// re-encoding it (`encode_response` cuts at 4096) gives a different verdict.
#[test]
#[ignore = "open finding F1 (fuzz/artifacts-found/README.md)"]
fn f1_tcp_response_message_stays_within_its_limit_and_round_trips() {
    crosshost_fuzz::check_tcp_response(&found("tcp_response/message-expands-past-limit"));
}

/// F2: `ProcessEntry::decode` accepts any `usize` device count from a peer,
/// and `Session::device_ids` adds the counts as `i32`: with these two
/// entries the sum overflows (a panic where overflow checks are on). In a
/// release build it wraps, and one entry with a count near `i32::MAX` makes
/// every process allocate billions of ids (and devices) at client creation.
/// Debug builds only: in release the same input asks for ~8 GiB.
#[cfg(debug_assertions)]
#[test]
#[ignore = "open finding F2 (fuzz/artifacts-found/README.md)"]
fn f2_peer_device_counts_do_not_overflow_device_ids() {
    let processes = [
        "session_entry/device-count-a",
        "session_entry/device-count-b",
    ]
    .iter()
    .enumerate()
    .map(|(i, path)| ProcessEntry::decode(i as i32 + 1, &found(path)).unwrap())
    .collect();
    let session = Session {
        epoch: "5eed0123456789ab".into(),
        secret: Secret([0; 32]),
        process_index: 0,
        processes,
    };
    let _ = session.device_ids();
}
