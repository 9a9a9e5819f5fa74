//! Per-client transfer metrics: plain atomic counters, read as a snapshot
//! (for tests and logs) or as the JSON object that
//! `pjrt_crosshost_metrics_json` hands out.
use std::sync::atomic::{AtomicU64, Ordering};

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
    cancellations: AtomicU64,
    timeouts: AtomicU64,
    bytes_received: AtomicU64,
    bytes_sent: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub keys_created: u64,
    pub keys_deleted: u64,
    pub delete_failures: u64,
    pub keys_outstanding: u64,
    pub retained_keys: u64,
    pub stale_receipts_rejected: u64,
    pub cancellations: u64,
    pub timeouts: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
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
        add_cancellations => cancellations,
        add_timeouts => timeouts,
        add_bytes_received => bytes_received,
        add_bytes_sent => bytes_sent,
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let keys_created = get(&self.keys_created);
        let keys_deleted = get(&self.keys_deleted);
        MetricsSnapshot {
            keys_created,
            keys_deleted,
            delete_failures: get(&self.delete_failures),
            keys_outstanding: keys_created.saturating_sub(keys_deleted),
            retained_keys: get(&self.retained_keys),
            stale_receipts_rejected: get(&self.stale_receipts_rejected),
            cancellations: get(&self.cancellations),
            timeouts: get(&self.timeouts),
            bytes_received: get(&self.bytes_received),
            bytes_sent: get(&self.bytes_sent),
        }
    }

    pub fn to_json(&self) -> String {
        self.snapshot().to_json()
    }
}

impl MetricsSnapshot {
    /// A flat JSON object of integers, keys in a fixed order.
    pub fn to_json(&self) -> String {
        let fields = [
            ("keys_created", self.keys_created),
            ("keys_deleted", self.keys_deleted),
            ("delete_failures", self.delete_failures),
            ("keys_outstanding", self.keys_outstanding),
            ("retained_keys", self.retained_keys),
            ("stale_receipts_rejected", self.stale_receipts_rejected),
            ("cancellations", self.cancellations),
            ("timeouts", self.timeouts),
            ("bytes_received", self.bytes_received),
            ("bytes_sent", self.bytes_sent),
        ];
        let body: Vec<String> = fields
            .iter()
            .map(|(name, value)| format!("\"{name}\":{value}"))
            .collect();
        format!("{{{}}}", body.join(","))
    }
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
        assert!(json.contains("\"bytes_sent\":1099511627776}"));
        for key in [
            "delete_failures",
            "retained_keys",
            "stale_receipts_rejected",
            "cancellations",
            "timeouts",
            "bytes_received",
        ] {
            assert!(json.contains(&format!("\"{key}\":0")), "{key} in {json}");
        }
    }
}
