//! Per-client transfer metrics: plain atomic counters, read as a snapshot
//! (for tests and logs) or as the JSON object that
//! `pjrt_crosshost_metrics_json` hands out.
use std::sync::atomic::{AtomicU64, Ordering};

/// Which transport moved a buffer's bytes (the `transports` object of the
/// metrics JSON, one entry each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteRoute {
    SharedMemory,
    Tcp,
    Ucx,
    CudaIpc,
}

impl ByteRoute {
    pub const ALL: [ByteRoute; 4] = [
        ByteRoute::SharedMemory,
        ByteRoute::Tcp,
        ByteRoute::Ucx,
        ByteRoute::CudaIpc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ByteRoute::SharedMemory => "shm",
            ByteRoute::Tcp => "tcp",
            ByteRoute::Ucx => "ucx",
            ByteRoute::CudaIpc => "cuda_ipc",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Bytes and buffers one transport moved, each way, and of those the ones
/// that went through this client's staging pipeline (either side).
#[derive(Default, Debug)]
struct RouteCounters {
    bytes_sent: AtomicU64,
    transfers_sent: AtomicU64,
    bytes_received: AtomicU64,
    transfers_received: AtomicU64,
    bytes_staged: AtomicU64,
    transfers_staged: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteSnapshot {
    pub bytes_sent: u64,
    pub transfers_sent: u64,
    pub bytes_received: u64,
    pub transfers_received: u64,
    /// Sent or received through this client's staging ring.
    pub bytes_staged: u64,
    pub transfers_staged: u64,
}

/// Counters. `keys_outstanding` is derived: keys this client created in the
/// store and has not deleted — receives still pending, plus keys retained
/// because the store cannot delete, plus keys whose delete failed.
#[derive(Default, Debug)]
pub struct Metrics {
    keys_created: AtomicU64,
    keys_deleted: AtomicU64,
    delete_failures: AtomicU64,
    retained_keys: AtomicU64,
    stale_receipts_rejected: AtomicU64,
    forged_values_rejected: AtomicU64,
    cancellations: AtomicU64,
    timeouts: AtomicU64,
    sends_failed: AtomicU64,
    bytes_received: AtomicU64,
    bytes_sent: AtomicU64,
    routes: [RouteCounters; 4],
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub keys_created: u64,
    pub keys_deleted: u64,
    pub delete_failures: u64,
    pub keys_outstanding: u64,
    pub retained_keys: u64,
    pub stale_receipts_rejected: u64,
    /// Store values that were not sealed with the job's secret
    /// (`kv/sealed.rs`), each rejected unread.
    pub forged_values_rejected: u64,
    pub cancellations: u64,
    pub timeouts: u64,
    /// Sends that ended with an error (the receiver's or this side's).
    pub sends_failed: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// Per transport, in `ByteRoute::ALL` order.
    pub routes: [RouteSnapshot; 4],
}

macro_rules! counter_adders {
    ($($add:ident => $field:ident),* $(,)?) => {
        $(
            pub fn $add(&self, n: u64) {
                self.$field.fetch_add(n, Ordering::Relaxed);
            }
        )*
    };
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    counter_adders! {
        add_keys_created => keys_created,
        add_keys_deleted => keys_deleted,
        add_delete_failures => delete_failures,
        add_retained_keys => retained_keys,
        add_stale_receipts_rejected => stale_receipts_rejected,
        add_forged_values_rejected => forged_values_rejected,
        add_cancellations => cancellations,
        add_timeouts => timeouts,
        add_sends_failed => sends_failed,
        add_bytes_received => bytes_received,
        add_bytes_sent => bytes_sent,
    }

    /// One buffer of `bytes` went out over `route`.
    pub fn sent_over(&self, route: ByteRoute, bytes: u64) {
        let counters = &self.routes[route.index()];
        counters.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        counters.transfers_sent.fetch_add(1, Ordering::Relaxed);
    }

    /// One buffer of `bytes` came in over `route`.
    pub fn received_over(&self, route: ByteRoute, bytes: u64) {
        let counters = &self.routes[route.index()];
        counters.bytes_received.fetch_add(bytes, Ordering::Relaxed);
        counters.transfers_received.fetch_add(1, Ordering::Relaxed);
    }

    /// One buffer of `bytes` moved over `route` went through this client's
    /// staging pipeline (sent or received).
    pub fn staged_over(&self, route: ByteRoute, bytes: u64) {
        let counters = &self.routes[route.index()];
        counters.bytes_staged.fetch_add(bytes, Ordering::Relaxed);
        counters.transfers_staged.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let route = |r: &RouteCounters| RouteSnapshot {
            bytes_sent: get(&r.bytes_sent),
            transfers_sent: get(&r.transfers_sent),
            bytes_received: get(&r.bytes_received),
            transfers_received: get(&r.transfers_received),
            bytes_staged: get(&r.bytes_staged),
            transfers_staged: get(&r.transfers_staged),
        };
        let keys_created = get(&self.keys_created);
        let keys_deleted = get(&self.keys_deleted);
        MetricsSnapshot {
            keys_created,
            keys_deleted,
            delete_failures: get(&self.delete_failures),
            keys_outstanding: keys_created.saturating_sub(keys_deleted),
            retained_keys: get(&self.retained_keys),
            stale_receipts_rejected: get(&self.stale_receipts_rejected),
            forged_values_rejected: get(&self.forged_values_rejected),
            cancellations: get(&self.cancellations),
            timeouts: get(&self.timeouts),
            sends_failed: get(&self.sends_failed),
            bytes_received: get(&self.bytes_received),
            bytes_sent: get(&self.bytes_sent),
            routes: [
                route(&self.routes[0]),
                route(&self.routes[1]),
                route(&self.routes[2]),
                route(&self.routes[3]),
            ],
        }
    }

    pub fn to_json(&self) -> String {
        self.snapshot().to_json(&[], &[])
    }
}

impl MetricsSnapshot {
    /// A JSON object: the counters as integers, keys in a fixed order, then
    /// `transports`, an object per transport with its six counters and the
    /// `(name, text)` labels given for it (e.g. UCX's lanes). `gauges` are
    /// levels read now (bytes held against a bound, the bound), after the
    /// counters.
    pub fn to_json(&self, labels: &[(ByteRoute, &str, String)], gauges: &[(&str, u64)]) -> String {
        let fields = [
            ("keys_created", self.keys_created),
            ("keys_deleted", self.keys_deleted),
            ("delete_failures", self.delete_failures),
            ("keys_outstanding", self.keys_outstanding),
            ("retained_keys", self.retained_keys),
            ("stale_receipts_rejected", self.stale_receipts_rejected),
            ("forged_values_rejected", self.forged_values_rejected),
            ("cancellations", self.cancellations),
            ("timeouts", self.timeouts),
            ("sends_failed", self.sends_failed),
            ("bytes_received", self.bytes_received),
            ("bytes_sent", self.bytes_sent),
        ];
        let mut body: Vec<String> = fields
            .iter()
            .chain(gauges)
            .map(|(name, value)| format!("\"{name}\":{value}"))
            .collect();
        let routes: Vec<String> = ByteRoute::ALL
            .iter()
            .zip(&self.routes)
            .map(|(route, r)| {
                let mut entry = format!(
                    "\"bytes_sent\":{},\"transfers_sent\":{},\"bytes_received\":{},\"transfers_received\":{},\"bytes_staged\":{},\"transfers_staged\":{}",
                    r.bytes_sent,
                    r.transfers_sent,
                    r.bytes_received,
                    r.transfers_received,
                    r.bytes_staged,
                    r.transfers_staged
                );
                for (_, name, text) in labels.iter().filter(|(l, _, _)| l == route) {
                    entry.push_str(&format!(",\"{name}\":\"{}\"", json_escape(text)));
                }
                format!("\"{}\":{{{entry}}}", route.name())
            })
            .collect();
        body.push(format!("\"transports\":{{{}}}", routes.join(",")));
        format!("{{{}}}", body.join(","))
    }
}

fn json_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outstanding_is_created_minus_deleted_and_json_lists_every_counter() {
        let m = Metrics::new();
        m.add_keys_created(5);
        m.add_keys_deleted(3);
        m.add_bytes_sent(1 << 40);
        let s = m.snapshot();
        assert_eq!(s.keys_outstanding, 2);
        let json = m.to_json();
        assert!(json.starts_with("{\"keys_created\":5,\"keys_deleted\":3,"));
        assert!(json.contains("\"keys_outstanding\":2"));
        assert!(json.contains("\"bytes_sent\":1099511627776,\"transports\""));
        for key in [
            "delete_failures",
            "retained_keys",
            "stale_receipts_rejected",
            "forged_values_rejected",
            "cancellations",
            "timeouts",
            "bytes_received",
        ] {
            assert!(json.contains(&format!("\"{key}\":0")), "{key} in {json}");
        }
    }

    #[test]
    fn each_transport_counts_its_own_bytes_and_carries_its_labels() {
        let m = Metrics::new();
        m.sent_over(ByteRoute::Ucx, 4096);
        m.sent_over(ByteRoute::Ucx, 10);
        m.received_over(ByteRoute::SharedMemory, 7);
        m.staged_over(ByteRoute::Ucx, 10);
        let s = m.snapshot();
        assert_eq!(s.routes[2].bytes_sent, 4106);
        assert_eq!(s.routes[2].transfers_sent, 2);
        assert_eq!(s.routes[0].transfers_received, 1);
        let json = s.to_json(
            &[(ByteRoute::Ucx, "lanes", "tcp/\"eth0\"".into())],
            &[("pending_send_bytes", 7)],
        );
        assert!(
            json.contains(
                "\"ucx\":{\"bytes_sent\":4106,\"transfers_sent\":2,\"bytes_received\":0,\"transfers_received\":0,\"bytes_staged\":10,\"transfers_staged\":1,\"lanes\":\"tcp/\\\"eth0\\\"\"}"
            ),
            "{json}"
        );
        assert!(
            json.contains("\"shm\":{\"bytes_sent\":0,\"transfers_sent\":0,\"bytes_received\":7,")
        );
        assert!(
            json.contains(",\"pending_send_bytes\":7,\"transports\""),
            "{json}"
        );
        assert!(json.ends_with("}}}"), "{json}");
    }
}
