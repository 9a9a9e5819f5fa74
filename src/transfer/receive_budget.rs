//! `ReceiveBudget`: a bound on the memory a client's received buffers hold
//! at once (create option `max_receive_bytes`). A receive's size comes from
//! the caller (or, through JAX, from a peer's array), and without a bound a
//! 20 GiB receive on a 24 GiB machine is granted, faulted in for a minute
//! and ends with the OOM killer. Each destination reserves its bytes before
//! anything is allocated; the reservation lives as long as the memory (the
//! received buffer), and a receive that would exceed the bound fails at once
//! with RESOURCE_EXHAUSTED, naming its size and the bound.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::status::{self, Result};

/// Half of the machine's physical memory (16 GiB where /proc/meminfo cannot
/// be read): room for the process's own data beside what it receives.
pub fn default_max_receive_bytes() -> u64 {
    physical_memory_bytes().unwrap_or(32 << 30) / 2
}

fn physical_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[derive(Debug)]
pub struct ReceiveBudget {
    limit: u64,
    live: AtomicU64,
}

/// Bytes reserved for one destination, given back when dropped.
#[derive(Debug)]
pub struct BudgetLease {
    budget: Arc<ReceiveBudget>,
    bytes: u64,
}

impl Drop for BudgetLease {
    fn drop(&mut self) {
        self.budget.live.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl ReceiveBudget {
    pub fn new(limit: u64) -> Arc<ReceiveBudget> {
        Arc::new(ReceiveBudget {
            limit,
            live: AtomicU64::new(0),
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// Reserves `bytes`, or RESOURCE_EXHAUSTED when the live total would
    /// pass the bound.
    pub fn reserve(self: &Arc<Self>, bytes: u64, what: &str) -> Result<BudgetLease> {
        let mut live = self.live.load(Ordering::Acquire);
        loop {
            let total = live.saturating_add(bytes);
            if total > self.limit {
                return Err(status::resource_exhausted(format!(
                    "{what}: a {bytes}-byte receive would bring this client's received buffers \
                     to {total} bytes, above max_receive_bytes = {} ({live} bytes held now; \
                     raise the create option max_receive_bytes or free received buffers)",
                    self.limit
                )));
            }
            match self
                .live
                .compare_exchange_weak(live, total, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(BudgetLease {
                        budget: self.clone(),
                        bytes,
                    })
                }
                Err(now) => live = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn reservations_are_bounded_and_given_back_when_dropped() {
        let budget = ReceiveBudget::new(100);
        let a = budget.reserve(60, "receive").unwrap();
        let error = budget.reserve(41, "receive").unwrap_err();
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(
            error.message.contains("41-byte") && error.message.contains("max_receive_bytes = 100"),
            "{error}"
        );
        let b = budget.reserve(40, "receive").unwrap();
        assert_eq!(budget.live(), 100);
        drop(a);
        assert_eq!(budget.live(), 40);
        assert!(budget.reserve(u64::MAX, "receive").is_err());
        drop(b);
        assert_eq!(budget.live(), 0);
    }

    #[test]
    fn the_default_is_half_the_machine() {
        let total = physical_memory_bytes().expect("/proc/meminfo on Linux");
        assert_eq!(default_max_receive_bytes(), total / 2);
        assert!(total > 1 << 28, "{total}");
    }
}
