//! The transfer timeline, two ways.
//!
//! Marks: `mark(point, key)` stamps a step of a transfer (its completion
//! key, hashed) with CLOCK_MONOTONIC nanoseconds into a preallocated ring,
//! when `PJRT_CROSSHOST_TIMELINE=1` was set at load; otherwise it costs one
//! load of a flag. The clock is the machine's, so the marks of two
//! processes line up (also across the two-host bed's namespaces). Read with
//! `pjrt_crosshost_timeline_json()` (the JAX package: `timeline()`), which
//! also empties the ring. This is how a transfer is profiled without
//! disturbing it (docs/profiling.md).
//!
//! API calls: `ApiCall` marks the entry and the return of every PJRT call
//! into the plugin (the boundary's `catch_entry` and callback entries:
//! ours, routed and delegated alike; the two `PJRT_Error_*` entries without
//! an error channel mark themselves), keyed by the function's name instead
//! of a transfer, so a profile can count and time what the framework calls
//! around a transfer's entry calls.
//!
//! Trace lines: `timeline!` writes one log line per step, with the thread
//! it ran on, when `PJRT_CROSSHOST_LOG` enables the `crosshost::timeline`
//! target; each line costs microseconds, so use it to read what happens,
//! not to time it.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

#[macro_export]
#[doc(hidden)]
macro_rules! timeline {
    ($($arg:tt)+) => {
        if log::log_enabled!(target: "crosshost::timeline", log::Level::Trace) {
            log::trace!(
                target: "crosshost::timeline",
                "[{}] {}",
                std::thread::current().name().unwrap_or("caller"),
                format_args!($($arg)+)
            );
        }
    };
}

/// The steps marked, in the order a transfer meets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Point {
    /// The receiver's CrossHostReceiveBuffers / MakeCrossHostReceiveBuffers.
    ReceiveCall = 1,
    /// The compute plugin's alias buffers of a receive call exist (made
    /// once its descriptors are out).
    AliasesMade,
    /// A receive buffer's destination is allocated (and registered).
    DestinationReady,
    /// A receive buffer's AsyncGet is registered.
    WaitRegistered,
    /// A receive buffer's descriptor handed to the store (v2).
    DescriptorPublished,
    ReceiveReturn,
    /// The sender's CrossHostSendBuffers / CopyToRemoteDevice.
    SendCall,
    /// The descriptor reached the sender.
    DescriptorArrived,
    /// The sender starts moving the bytes (copy, TCP or UCX).
    BytesStart,
    /// A UCX worker of the sender picked the send up.
    UcxSendStart,
    /// The bytes are in the receiver's destination (UCX, TCP).
    BytesLanded,
    /// The sender knows the bytes are there (the receiver's ack).
    BytesAcked,
    /// The receipt was set (by the sender, or with the bytes).
    ReceiptSet,
    /// The receiver's AsyncGet saw the completion key.
    AsyncGetFired,
    /// On the lifecycle's runner.
    OnRunner,
    /// The buffer's outcome is published.
    Published,
    /// The compute plugin made its view of the received bytes.
    ViewMade,
    /// The caller's buffer (a compute plugin's alias) is fulfilled.
    Recorded,
    /// The keys are deleted.
    KeysRetired,
    /// A PJRT call into the plugin began (key: the function's name).
    ApiEnter,
    /// That call returned.
    ApiExit,
}

impl Point {
    pub const ALL: [Point; 21] = [
        Point::ReceiveCall,
        Point::AliasesMade,
        Point::DestinationReady,
        Point::WaitRegistered,
        Point::DescriptorPublished,
        Point::ReceiveReturn,
        Point::SendCall,
        Point::DescriptorArrived,
        Point::BytesStart,
        Point::UcxSendStart,
        Point::BytesLanded,
        Point::BytesAcked,
        Point::ReceiptSet,
        Point::AsyncGetFired,
        Point::OnRunner,
        Point::Published,
        Point::ViewMade,
        Point::Recorded,
        Point::KeysRetired,
        Point::ApiEnter,
        Point::ApiExit,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Point::ReceiveCall => "receive_call",
            Point::AliasesMade => "aliases_made",
            Point::DestinationReady => "destination_ready",
            Point::WaitRegistered => "wait_registered",
            Point::DescriptorPublished => "descriptor_published",
            Point::ReceiveReturn => "receive_return",
            Point::SendCall => "send_call",
            Point::DescriptorArrived => "descriptor_arrived",
            Point::BytesStart => "bytes_start",
            Point::UcxSendStart => "ucx_send_start",
            Point::BytesLanded => "bytes_landed",
            Point::BytesAcked => "bytes_acked",
            Point::ReceiptSet => "receipt_set",
            Point::AsyncGetFired => "asyncget_fired",
            Point::OnRunner => "on_runner",
            Point::Published => "published",
            Point::ViewMade => "view_made",
            Point::Recorded => "recorded",
            Point::KeysRetired => "keys_retired",
            Point::ApiEnter => "api_enter",
            Point::ApiExit => "api_exit",
        }
    }

    fn from_raw(raw: u64) -> Option<Point> {
        Point::ALL.into_iter().find(|p| *p as u64 == raw)
    }
}

/// Marks the ring holds; older ones are overwritten.
const CAPACITY: usize = 1 << 16;

struct Ring {
    next: AtomicUsize,
    /// Per slot: nanoseconds, then point << 56 | thread id (56 bits), then
    /// the key's hash.
    slots: Box<[[AtomicU64; 3]]>,
}

/// The names of the functions `ApiCall` marks saw, by their key hash
/// (filled only while marks are recorded).
static API_NAMES: Lazy<Mutex<HashMap<u64, &'static str>>> = Lazy::new(Mutex::default);

static ENABLED: Lazy<bool> =
    Lazy::new(|| std::env::var("PJRT_CROSSHOST_TIMELINE").is_ok_and(|v| v == "1"));
static RING: Lazy<Ring> = Lazy::new(|| Ring {
    next: AtomicUsize::new(0),
    slots: (0..CAPACITY)
        .map(|_| [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)])
        .collect(),
});

/// Whether marks are being recorded.
pub fn enabled() -> bool {
    *ENABLED
}

/// FNV-1a of a key name: the same on both sides of a transfer.
pub fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn thread_id() -> u64 {
    // SAFETY: gettid has no arguments and cannot fail.
    (unsafe { libc::syscall(libc::SYS_gettid) } as u64) & ((1 << 56) - 1)
}

/// Stamps `point` of the transfer whose completion key is `key`.
#[inline]
pub fn mark(point: Point, key: &str) {
    if *ENABLED {
        record(point, key_hash(key));
    }
}

/// The key's hash for a later `mark_hash`, when marks are recorded.
#[inline]
pub fn key_hash_if_enabled(key: &str) -> u64 {
    if *ENABLED {
        key_hash(key)
    } else {
        0
    }
}

/// `mark` with the key's hash already taken.
#[inline]
pub fn mark_hash(point: Point, hash: u64) {
    if *ENABLED {
        record(point, hash);
    }
}

/// `mark` for a step that has no key yet (an entry call).
#[inline]
pub fn mark_call(point: Point) {
    if *ENABLED {
        record(point, 0);
    }
}

/// Marks a PJRT call into the plugin, named `function`, from its entry to
/// its return (the guard's drop, also when the call unwinds).
#[inline]
pub fn api_call(function: &'static str) -> ApiCall {
    if !*ENABLED {
        return ApiCall(0);
    }
    let hash = api_hash(function);
    record(Point::ApiEnter, hash);
    ApiCall(hash)
}

/// `function`'s key hash, its name kept for `take_json`.
fn api_hash(function: &'static str) -> u64 {
    let hash = key_hash(function);
    API_NAMES.lock().entry(hash).or_insert(function);
    hash
}

/// The open span of `api_call`; 0 when marks are off.
#[must_use]
pub struct ApiCall(u64);

impl Drop for ApiCall {
    fn drop(&mut self) {
        if self.0 != 0 {
            record(Point::ApiExit, self.0);
        }
    }
}

#[cold]
fn record(point: Point, key: u64) {
    let ring = &*RING;
    let slot = &ring.slots[ring.next.fetch_add(1, Ordering::Relaxed) % CAPACITY];
    slot[1].store(((point as u64) << 56) | thread_id(), Ordering::Relaxed);
    slot[2].store(key, Ordering::Relaxed);
    // The time last: a reader skips slots whose time is 0.
    slot[0].store(now_ns(), Ordering::Release);
}

/// The marks recorded so far, oldest first, as a JSON array of
/// `[nanoseconds, "point", "key hash", thread]` (for `api_enter` and
/// `api_exit` the function's name instead of the hash); the ring is
/// emptied.
pub fn take_json() -> String {
    let ring = &*RING;
    let end = ring.next.swap(0, Ordering::AcqRel);
    let start = end.saturating_sub(CAPACITY);
    let mut marks: Vec<(u64, Point, u64, u64)> = Vec::with_capacity(end - start);
    for i in start..end {
        let slot = &ring.slots[i % CAPACITY];
        let ns = slot[0].swap(0, Ordering::Acquire);
        if ns == 0 {
            continue;
        }
        let tagged = slot[1].load(Ordering::Relaxed);
        let Some(point) = Point::from_raw(tagged >> 56) else {
            continue;
        };
        marks.push((
            ns,
            point,
            slot[2].load(Ordering::Relaxed),
            tagged & ((1 << 56) - 1),
        ));
    }
    marks.sort_by_key(|m| m.0);
    let names = API_NAMES.lock();
    let items: Vec<String> = marks
        .iter()
        .map(|(ns, point, key, thread)| {
            let name = match point {
                Point::ApiEnter | Point::ApiExit => names.get(key),
                _ => None,
            };
            // PJRT function names are C identifiers: nothing to escape.
            let key = name.map_or_else(|| format!("{key:016x}"), |name| name.to_string());
            format!("[{ns},\"{}\",\"{key}\",{thread}]", point.name())
        })
        .collect();
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_hash_is_stable_and_points_round_trip() {
        assert_eq!(key_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(key_hash("a/1"), key_hash("a/2"));
        for point in Point::ALL {
            assert_eq!(Point::from_raw(point as u64), Some(point));
        }
        assert_eq!(Point::from_raw(0), None);
    }

    /// The ring is global: tests that take it run one at a time.
    static RING_TESTS: Mutex<()> = Mutex::new(());

    #[test]
    fn recorded_marks_come_back_in_time_order_once() {
        let _serial = RING_TESTS.lock();
        record(Point::Published, 7);
        record(Point::Recorded, 7);
        let json = take_json();
        let published = json.find("\"published\"").expect(&json);
        let recorded = json.find("\"recorded\"").expect(&json);
        assert!(published < recorded, "{json}");
        assert!(!take_json().contains("\"recorded\""));
    }

    #[test]
    fn an_api_mark_is_named_by_its_function() {
        let _serial = RING_TESTS.lock();
        let hash = api_hash("PJRT_Buffer_Destroy");
        record(Point::ApiEnter, hash);
        record(Point::ApiExit, hash);
        record(Point::Published, hash);
        let json = take_json();
        assert!(
            json.contains("\"api_enter\",\"PJRT_Buffer_Destroy\""),
            "{json}"
        );
        assert!(
            json.contains("\"api_exit\",\"PJRT_Buffer_Destroy\""),
            "{json}"
        );
        assert!(
            json.contains(&format!("\"published\",\"{hash:016x}\"")),
            "{json}"
        );
    }
}
