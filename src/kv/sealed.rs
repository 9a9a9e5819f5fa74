//! `SealedStore`: every value the plugin puts in a shared store, sealed with
//! the job's secret (`job_secret_file`), which never enters any store.
//!
//! Whoever can read and write the store (etcd's port, JAX's coordination
//! service) sees descriptors, receipts, session entries and the control
//! secret of the epoch record. Without a job secret that is enough to
//! forge a completion, steer a sender to another listener, or write into a
//! receiver's buffer with the token a descriptor carries. Sealed, each
//! value is encrypted and authenticated (ChaCha20-Poly1305) with the key
//! name as associated data: reading the store reveals nothing usable (no
//! token, no nonce, no control secret), a value made without the secret,
//! altered, or moved to another key fails to open, and key names carry the
//! session and its epoch, so a value of another session or epoch never
//! opens under this one's keys. A value that fails to open is counted
//! (`forged_values_rejected`), logged, and never published: a get skips it
//! and waits for a value that opens, a try_get sees the key absent.
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use parking_lot::Mutex;

use super::{
    get_by_waiting, GetCallback, KeyValueStore, SetCallback, StoreCapabilities, Unless, WaiterId,
};
use crate::status::{self, Result};
use crate::sync::Metrics;
use crate::transport::random::fill_random;

/// Fewer bytes than this in the secret file is a configuration error.
pub const MIN_JOB_SECRET_BYTES: usize = 32;
/// Larger files are not a secret but a mistake (a wrong path).
const MAX_JOB_SECRET_BYTES: usize = 64 << 10;

const MAGIC: &[u8; 4] = b"xsv1";
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;
/// Domain of the key derived from the file, and of the associated data.
const KEY_INFO: &[u8] = b"pjrt-crosshost sealed store v1";

/// The AEAD key of a job, derived from its secret file.
#[derive(Clone)]
pub struct JobSecret {
    aead: ChaCha20Poly1305,
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

impl JobSecret {
    /// Reads `path`: at least 32 bytes, the same file for every process of
    /// the job. Errors name the path, never the content.
    pub fn from_file(path: &Path) -> Result<JobSecret> {
        let bytes = std::fs::read(path).map_err(|e| {
            status::invalid_argument(format!(
                "job_secret_file {}: cannot read it: {e}",
                path.display()
            ))
        })?;
        if bytes.len() < MIN_JOB_SECRET_BYTES || bytes.len() > MAX_JOB_SECRET_BYTES {
            return Err(status::invalid_argument(format!(
                "job_secret_file {}: holds {} bytes; it must hold {MIN_JOB_SECRET_BYTES} to \
                 {MAX_JOB_SECRET_BYTES} random bytes, the same for every process of the job \
                 (e.g. `head -c 32 /dev/urandom > FILE`)",
                path.display(),
                bytes.len()
            )));
        }
        Ok(JobSecret::from_bytes(&bytes))
    }

    pub fn from_bytes(secret: &[u8]) -> JobSecret {
        let mut key = [0u8; 32];
        hkdf::Hkdf::<sha2::Sha256>::new(None, secret)
            .expand(KEY_INFO, &mut key)
            .expect("32 bytes is a valid HKDF-SHA256 length");
        JobSecret {
            aead: ChaCha20Poly1305::new(Key::from_slice(&key)),
        }
    }

    fn associated_data(key: &str) -> Vec<u8> {
        let mut aad = Vec::with_capacity(KEY_INFO.len() + 1 + key.len());
        aad.extend_from_slice(KEY_INFO);
        aad.push(0);
        aad.extend_from_slice(key.as_bytes());
        aad
    }

    /// `value` sealed for `key`.
    pub fn seal(&self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        let mut nonce = [0u8; NONCE_LEN];
        fill_random(&mut nonce)?;
        let aad = Self::associated_data(key);
        let sealed = self
            .aead
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: value,
                    aad: &aad,
                },
            )
            .map_err(|_| status::internal(format!("sealing the value of {key} failed")))?;
        let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + sealed.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// The value sealed for `key`, or `None` when `bytes` was not sealed
    /// with this secret for this key.
    pub fn open(&self, key: &str, bytes: &[u8]) -> Option<Vec<u8>> {
        let rest = bytes.strip_prefix(MAGIC)?;
        if rest.len() < NONCE_LEN + TAG_LEN {
            return None;
        }
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let aad = Self::associated_data(key);
        self.aead
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: &aad,
                },
            )
            .ok()
    }
}

/// One waiter of the sealed store: its callback, until it runs or is
/// cancelled, and the inner store's waiter now armed for it.
struct Waiter {
    callback: Option<GetCallback>,
    inner: Option<WaiterId>,
    /// Counts the arms: an arm whose inner waiter fired at once (and armed
    /// again from its callback) must not record its own, spent, id.
    arms: u64,
}

struct Core {
    inner: Arc<dyn KeyValueStore>,
    secret: JobSecret,
    metrics: Arc<Metrics>,
    waiters: Mutex<HashMap<u64, Arc<Mutex<Waiter>>>>,
    next_waiter: AtomicU64,
}

pub struct SealedStore {
    core: Arc<Core>,
}

impl SealedStore {
    pub fn new(
        inner: Arc<dyn KeyValueStore>,
        secret: JobSecret,
        metrics: Arc<Metrics>,
    ) -> SealedStore {
        SealedStore {
            core: Arc::new(Core {
                inner,
                secret,
                metrics,
                waiters: Mutex::new(HashMap::new()),
                next_waiter: AtomicU64::new(1),
            }),
        }
    }
}

impl Core {
    fn rejected(&self, key: &str, bytes: &[u8]) {
        self.metrics.add_forged_values_rejected(1);
        log::warn!(
            "rejected a value at {key} ({} bytes) that was not sealed with this job's secret: \
             someone who can write the store wrote it",
            bytes.len()
        );
    }

    /// Opens a value read from the store; a forged one is counted.
    fn open(&self, key: &str, bytes: &[u8]) -> Option<Vec<u8>> {
        let opened = self.secret.open(key, bytes);
        if opened.is_none() {
            self.rejected(key, bytes);
        }
        opened
    }

    /// Arms the inner store for waiter `id`: its first value (or, with
    /// `seen`, its first value other than those sealed bytes) that opens,
    /// and differs from `stale`, completes the waiter.
    fn arm(
        self: &Arc<Self>,
        key: &str,
        id: u64,
        stale: Option<Arc<Vec<u8>>>,
        seen: Option<Vec<u8>>,
    ) -> Result<()> {
        let core = Arc::downgrade(self);
        let owned_key = key.to_string();
        let on_value: GetCallback =
            Box::new(move |value: Result<Vec<u8>>| on_value(core, owned_key, id, stale, value));
        let Some(waiter) = self.waiters.lock().get(&id).cloned() else {
            return Ok(());
        };
        let arm = {
            let mut waiter = waiter.lock();
            waiter.arms += 1;
            waiter.arms
        };
        let inner_id = self.inner.async_get(key, seen.as_deref(), on_value)?;
        let mut waiter = waiter.lock();
        if waiter.callback.is_none() {
            // Cancelled (or done) meanwhile: the armed waiter is not needed.
            drop(waiter);
            self.inner.cancel_async_get(key, inner_id);
        } else if waiter.arms == arm {
            waiter.inner = Some(inner_id);
        }
        Ok(())
    }

    fn take_callback(&self, id: u64) -> Option<GetCallback> {
        let waiter = self.waiters.lock().remove(&id)?;
        let callback = waiter.lock().callback.take();
        callback
    }
}

fn on_value(
    core: Weak<Core>,
    key: String,
    id: u64,
    stale: Option<Arc<Vec<u8>>>,
    value: Result<Vec<u8>>,
) {
    let Some(core) = core.upgrade() else {
        return;
    };
    let bytes = match value {
        Ok(bytes) => bytes,
        Err(error) => {
            if let Some(callback) = core.take_callback(id) {
                callback(Err(error));
            }
            return;
        }
    };
    match core.open(&key, &bytes) {
        Some(value) if stale.as_deref() != Some(&value) => {
            if let Some(callback) = core.take_callback(id) {
                callback(Ok(value));
            }
        }
        // Forged, or the stale value again: wait for the next one.
        _ => {
            if let Err(error) = core.arm(&key, id, stale, Some(bytes)) {
                if let Some(callback) = core.take_callback(id) {
                    callback(Err(error));
                }
            }
        }
    }
}

impl KeyValueStore for SealedStore {
    fn async_get(&self, key: &str, stale: Unless, callback: GetCallback) -> Result<WaiterId> {
        let id = self.core.next_waiter.fetch_add(1, Ordering::Relaxed);
        self.core.waiters.lock().insert(
            id,
            Arc::new(Mutex::new(Waiter {
                callback: Some(callback),
                inner: None,
                arms: 0,
            })),
        );
        let stale = stale.map(|s| Arc::new(s.to_vec()));
        if let Err(error) = self.core.arm(key, id, stale, None) {
            self.core.waiters.lock().remove(&id);
            return Err(error);
        }
        Ok(WaiterId(id))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        get_by_waiting(self, key, timeout, || {
            status::deadline_exceeded(format!(
                "key {key} did not hold a value sealed with this job's secret within \
                 {timeout:?}"
            ))
        })
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let bytes = self.core.inner.try_get(key)?;
        self.core.open(key, &bytes).ok_or_else(|| {
            status::not_found(format!("{key}: no value sealed with this job's secret"))
        })
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.core
            .inner
            .set(key, &self.core.secret.seal(key, value)?)
    }

    fn set_async(&self, key: &str, value: &[u8], done: SetCallback) {
        match self.core.secret.seal(key, value) {
            Ok(sealed) => self.core.inner.set_async(key, &sealed, done),
            Err(error) => done(Err(error)),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.core.inner.delete(key)
    }

    fn delete_async(&self, key: &str, done: SetCallback) {
        self.core.inner.delete_async(key, done)
    }

    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool {
        let Some(waiter) = self.core.waiters.lock().remove(&id.0) else {
            return false;
        };
        let mut waiter = waiter.lock();
        if waiter.callback.take().is_none() {
            return false;
        }
        if let Some(inner) = waiter.inner.take() {
            self.core.inner.cancel_async_get(key, inner);
        }
        true
    }

    fn capabilities(&self) -> StoreCapabilities {
        self.core.inner.capabilities()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryStore;
    use crate::status::Code;

    fn sealed() -> (Arc<MemoryStore>, SealedStore, Arc<Metrics>) {
        let inner = Arc::new(MemoryStore::new());
        let metrics = Arc::new(Metrics::new());
        let store = SealedStore::new(
            inner.clone(),
            JobSecret::from_bytes(&[7u8; 32]),
            metrics.clone(),
        );
        (inner, store, metrics)
    }

    fn forged_count(metrics: &Metrics) -> u64 {
        metrics.snapshot().forged_values_rejected
    }

    #[test]
    fn values_round_trip_and_the_store_sees_neither_them_nor_a_usable_copy() {
        let (inner, store, metrics) = sealed();
        store
            .set("crosshost/desc/e/1/0", b"token-and-nonce")
            .unwrap();
        let raw = inner.try_get("crosshost/desc/e/1/0").unwrap();
        assert!(
            !raw.windows(5).any(|w| w == b"token"),
            "the value is in clear"
        );
        assert_eq!(
            store.try_get("crosshost/desc/e/1/0").unwrap(),
            b"token-and-nonce"
        );
        assert_eq!(
            store.get("crosshost/desc/e/1/0", Duration::ZERO).unwrap(),
            b"token-and-nonce"
        );
        // The same bytes under another key do not open.
        inner.set("crosshost/desc/e/2/0", &raw).unwrap();
        assert_eq!(
            store.try_get("crosshost/desc/e/2/0").unwrap_err().code,
            Code::NotFound
        );
        assert_eq!(forged_count(&metrics), 1);
    }

    #[test]
    fn a_value_sealed_with_another_secret_or_altered_is_rejected_and_counted() {
        let (inner, store, metrics) = sealed();
        let other = JobSecret::from_bytes(&[8u8; 32]);
        inner.set("k1", &other.seal("k1", b"x").unwrap()).unwrap();
        let mut altered = store.core.secret.seal("k2", b"ok").unwrap();
        *altered.last_mut().unwrap() ^= 1;
        inner.set("k2", &altered).unwrap();
        inner.set("k3", b"xr1 ok 0123456789abcdef").unwrap();
        for key in ["k1", "k2", "k3"] {
            assert_eq!(
                store.try_get(key).unwrap_err().code,
                Code::NotFound,
                "{key}"
            );
        }
        assert_eq!(forged_count(&metrics), 3);
    }

    #[test]
    fn a_waiter_skips_a_forged_value_and_completes_with_the_sealed_one() {
        let (inner, store, metrics) = sealed();
        let (tx, rx) = crossbeam_channel::unbounded();
        store
            .async_get(
                "r",
                None,
                Box::new(move |v| {
                    tx.send(v).unwrap();
                }),
            )
            .unwrap();
        inner.set("r", b"forged receipt").unwrap();
        assert!(rx.try_recv().is_err(), "a forged value completed the wait");
        assert_eq!(forged_count(&metrics), 1);
        inner.delete("r").unwrap();
        store.set("r", b"real receipt").unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap(),
            b"real receipt"
        );
        assert!(rx.try_recv().is_err(), "the callback ran twice");
    }

    #[test]
    fn a_changed_waiter_ignores_the_stale_value_and_cancel_stops_a_rearmed_waiter() {
        let (inner, store, _) = sealed();
        store.set("k", b"stale").unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        let tx2 = tx.clone();
        store
            .async_get("k", Some(b"stale"), Box::new(move |v| tx.send(v).unwrap()))
            .unwrap();
        assert!(rx.try_recv().is_err());
        inner.delete("k").unwrap();
        store.set("k", b"fresh").unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap(),
            b"fresh"
        );

        let id = store
            .async_get("absent", None, Box::new(move |v| tx2.send(v).unwrap()))
            .unwrap();
        inner.set("absent", b"forged").unwrap();
        assert!(store.cancel_async_get("absent", id));
        assert!(!store.cancel_async_get("absent", id));
        inner.delete("absent").unwrap();
        store.set("absent", b"late").unwrap();
        assert!(rx.try_recv().is_err(), "a cancelled waiter ran");
        assert!(store.core.waiters.lock().is_empty());
    }

    #[test]
    fn a_blocking_get_times_out_on_a_forged_value() {
        let (inner, store, metrics) = sealed();
        inner.set("k", b"forged").unwrap();
        let err = store.get("k", Duration::from_millis(50)).unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        assert_eq!(forged_count(&metrics), 1);
    }

    #[test]
    fn the_secret_file_must_hold_at_least_32_bytes_and_errors_never_show_it() {
        let dir = std::env::temp_dir().join(format!("crosshost-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let short = dir.join("short");
        std::fs::write(&short, b"hunter2-but-short").unwrap();
        let err = JobSecret::from_file(&short).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument);
        assert!(
            err.message.contains("17 bytes") && !err.message.contains("hunter2"),
            "{err}"
        );
        let missing = JobSecret::from_file(&dir.join("missing")).unwrap_err();
        assert_eq!(missing.code, Code::InvalidArgument);
        let good = dir.join("good");
        std::fs::write(&good, [9u8; 32]).unwrap();
        let a = JobSecret::from_file(&good).unwrap();
        let b = JobSecret::from_bytes(&[9u8; 32]);
        assert_eq!(b.open("k", &a.seal("k", b"v").unwrap()).unwrap(), b"v");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
