//! The job's epoch record (`crosshost/session/<name>/epoch`): process 0's
//! random epoch, the control-link secret and when it was written. Bound to
//! this start of the job by that time: process 0 waits at most the session
//! timeout for the others, so a record written longer ago than that (plus
//! `CLOCK_SLACK` for the hosts' clocks) belongs to an earlier start, or was
//! replayed into the store (a sealed store cannot tell a replay from the
//! original). A process that finds one waits for the fresh record instead
//! of joining an epoch nobody else is in.
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::kv::{get_other_than, KeyValueStore};
use crate::status::{self, Result, Status};
use crate::transport::control::Secret;
use crate::transport::random::random_u64;

/// How far the job's hosts' clocks may disagree.
pub const CLOCK_SLACK: Duration = Duration::from_secs(30);

pub fn key(name: &str) -> String {
    format!("crosshost/session/{name}/epoch")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Process 0: a new epoch and secret, written now.
pub fn publish(store: &dyn KeyValueStore, name: &str) -> Result<(String, Secret)> {
    let epoch = format!("{:016x}", random_u64()?);
    let secret = Secret::generate()?;
    let record = Record {
        epoch: epoch.clone(),
        secret,
        written_ms: now_ms(),
    };
    store.set(&key(name), record.encode().as_bytes())?;
    Ok((epoch, secret))
}

/// One epoch record, as process 0 writes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub epoch: String,
    pub secret: Secret,
    /// When it was written (milliseconds since the Unix epoch).
    pub written_ms: u64,
}

impl Record {
    pub fn encode(&self) -> String {
        format!(
            "{} {} {}",
            self.epoch,
            self.secret.to_hex(),
            self.written_ms
        )
    }
}

/// Parses a record of session `name` (DATA_LOSS if it is not one).
pub fn decode(name: &str, bytes: &[u8]) -> Result<Record> {
    let bad = || status::data_loss(format!("session {name:?}: malformed epoch record"));
    let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
    let mut parts = text.split(' ');
    let (Some(epoch), Some(secret), Some(written), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if epoch.is_empty() || !epoch.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Ok(Record {
        epoch: epoch.to_string(),
        secret: Secret::from_hex(secret).ok_or_else(bad)?,
        written_ms: written.parse().map_err(|_| bad())?,
    })
}

/// Any other process: the record of this start of the job, waiting at
/// most `timeout` (the session timeout) for it; older records are passed
/// over, said once in the log and in the error if no fresh one comes.
pub fn await_fresh(
    store: &dyn KeyValueStore,
    name: &str,
    timeout: Duration,
) -> Result<(String, Secret)> {
    let started = Instant::now();
    let started_ms = now_ms();
    let oldest_fresh_ms = started_ms.saturating_sub((timeout + CLOCK_SLACK).as_millis() as u64);
    let mut stale: Option<(Vec<u8>, u64)> = None;
    loop {
        let left = timeout.saturating_sub(started.elapsed());
        let waited = match &stale {
            None => store.get(&key(name), left),
            Some((seen, _)) => get_other_than(store, &key(name), seen, left),
        };
        let bytes = waited.map_err(|e| {
            let mut message = format!(
                "waiting for process 0 to publish session {name:?}: {}",
                e.message
            );
            if let Some((_, written_ms)) = &stale {
                message.push_str(&format!(
                    "; the epoch record in the store was written {} s before this process \
                     started, longer ago than the session timeout ({timeout:?}) plus {CLOCK_SLACK:?} \
                     for clocks: it is from an earlier start of the job (or replayed), and no \
                     fresh one came",
                    started_ms.saturating_sub(*written_ms) / 1000
                ));
            }
            Status::new(e.code, message)
        })?;
        let record = decode(name, &bytes)?;
        if record.written_ms >= oldest_fresh_ms {
            return Ok((record.epoch, record.secret));
        }
        log::warn!(
            "session {name:?}: passing over an epoch record written {} s before this process \
             started (older than the session timeout): an earlier start's, or a replay",
            started_ms.saturating_sub(record.written_ms) / 1000
        );
        stale = Some((bytes, record.written_ms));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::memory::MemoryStore;
    use crate::status::Code;
    use std::sync::Arc;

    fn record_written_at(ms: u64) -> Vec<u8> {
        let secret = Secret::generate().unwrap();
        format!("01d0e90c {} {ms}", secret.to_hex()).into_bytes()
    }

    #[test]
    fn a_fresh_record_is_taken_at_once() {
        let store = MemoryStore::new();
        let (epoch, secret) = publish(&store, "job").unwrap();
        let (seen, seen_secret) = await_fresh(&store, "job", Duration::from_secs(1)).unwrap();
        assert_eq!((seen, seen_secret), (epoch, secret));
    }

    #[test]
    fn a_stale_record_is_passed_over_for_the_fresh_one() {
        let store = Arc::new(MemoryStore::new());
        let hour_ago = now_ms() - 3_600_000;
        store
            .set(&key("job"), &record_written_at(hour_ago))
            .unwrap();
        let waiter = {
            let store = store.clone();
            std::thread::spawn(move || await_fresh(&*store, "job", Duration::from_secs(20)))
        };
        // Process 0 of this start writes its record once the waiter has
        // registered (the memory store's waiters are visible to the test).
        while store.waiter_count() == 0 {
            std::thread::yield_now();
        }
        let (epoch, _) = publish(&*store, "job").unwrap();
        let (joined, _) = waiter.join().unwrap().unwrap();
        assert_eq!(joined, epoch);
    }

    #[test]
    fn only_a_stale_record_fails_at_the_deadline_saying_so() {
        let store = MemoryStore::new();
        store
            .set(&key("job"), &record_written_at(now_ms() - 3_600_000))
            .unwrap();
        let err = await_fresh(&store, "job", Duration::from_millis(50)).unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        assert!(
            err.message
                .contains("earlier start of the job (or replayed)"),
            "{err}"
        );
        assert!(err.message.contains("3600 s before"), "{err}");
    }

    #[test]
    fn malformed_records_are_data_loss() {
        let store = MemoryStore::new();
        let secret = Secret::generate().unwrap().to_hex();
        for text in [
            "e".to_string(),
            format!("e {secret}"),
            format!("e {secret} x"),
            format!("e {secret} 1 2"),
            format!("not/hex {secret} 1"),
            "e zz 1".to_string(),
        ] {
            store.set(&key("bad"), text.as_bytes()).unwrap();
            let err = await_fresh(&store, "bad", Duration::from_secs(1)).unwrap_err();
            assert_eq!(err.code, Code::DataLoss, "{text}");
        }
    }
}
