//! Kill points: where a test's kill matrix stops a process so that it can be
//! killed at an exact phase of a transfer (python_tests/test_kill_matrix.py).
//! Off unless the environment names one: `PJRT_CROSSHOST_TEST_KILL_POINT=
//! <point>` makes the first thread that reaches `<point>` write the point's
//! name to the file `PJRT_CROSSHOST_TEST_KILL_POINT_MARKER` (when set) and
//! then stop there for good, for the test to kill the process. Read once;
//! when unset, a kill point costs one load of a flag.
use std::sync::atomic::{AtomicBool, Ordering};

use once_cell::sync::Lazy;

/// The points, in transfer order.
pub const RECEIVER_AFTER_DESCRIPTOR: &str = "receiver_after_descriptor";
pub const SENDER_AFTER_DESCRIPTOR: &str = "sender_after_descriptor";
pub const SENDER_MID_COPY: &str = "sender_mid_copy";
pub const SENDER_AFTER_RECEIPT: &str = "sender_after_receipt";
pub const RECEIVER_BEFORE_DELETE: &str = "receiver_before_delete";

static ARMED: Lazy<Option<String>> =
    Lazy::new(|| std::env::var("PJRT_CROSSHOST_TEST_KILL_POINT").ok());
static FIRED: AtomicBool = AtomicBool::new(false);

/// Whether `point` is the armed kill point (it stays armed until reached).
pub fn armed(point: &str) -> bool {
    ARMED.as_deref() == Some(point) && !FIRED.load(Ordering::Acquire)
}

/// Stops this thread for good if `point` is the armed kill point.
pub fn reached(point: &str) {
    if !armed(point) || FIRED.swap(true, Ordering::AcqRel) {
        return;
    }
    if let Ok(marker) = std::env::var("PJRT_CROSSHOST_TEST_KILL_POINT_MARKER") {
        if let Err(e) = std::fs::write(&marker, point) {
            log::error!("kill point {point}: cannot write the marker {marker}: {e}");
        }
    }
    log::warn!("kill point {point} reached: this thread waits to be killed");
    loop {
        std::thread::park();
    }
}
