//! `MemoryStore`: the embedded default store. Two maps under one lock — data
//! and waiting callbacks. `set` writes the value, then removes and fires that
//! key's satisfied waiters outside the lock; the entry stays until `delete`.
//! `async_get` on a present key fires at once (which is exactly why stale
//! keys are dangerous). Optionally refuses overwrites. Shareable by name
//! inside one process (several clients, one store).
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use once_cell::sync::Lazy;
use parking_lot::{Condvar, Mutex};

use super::{GetCallback, KeyValueStore, StoreCapabilities, Unless, WaiterId};
use crate::status::{self, Result};

struct Waiter {
    id: u64,
    /// `Some(v)`: a value equal to `v` does not satisfy this waiter.
    unless: Option<Vec<u8>>,
    callback: GetCallback,
}

impl Waiter {
    fn satisfied_by(&self, value: &[u8]) -> bool {
        self.unless.as_deref() != Some(value)
    }
}

#[derive(Default)]
struct Maps {
    data: HashMap<String, Vec<u8>>,
    waiters: HashMap<String, Vec<Waiter>>,
    next_waiter: u64,
}

pub struct MemoryStore {
    maps: Mutex<Maps>,
    /// Signalled on every `set`, for blocking `get`.
    written: Condvar,
    allow_overwrite: bool,
}

/// Process-wide stores by name. Strong references on purpose: like a real
/// coordination service, a named store outlives the clients that use it (so
/// a later client sees what an earlier one left behind).
static NAMED: Lazy<Mutex<HashMap<String, Arc<MemoryStore>>>> = Lazy::new(Default::default);

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// A store that allows overwrites.
    pub fn new() -> MemoryStore {
        MemoryStore::with_overwrite(true)
    }

    /// `allow_overwrite = false`: `set` on a present key is `ALREADY_EXISTS`.
    pub fn with_overwrite(allow_overwrite: bool) -> MemoryStore {
        MemoryStore {
            maps: Mutex::new(Maps::default()),
            written: Condvar::new(),
            allow_overwrite,
        }
    }

    /// The process-wide store called `name`, created on first use.
    pub fn named(name: &str) -> Arc<MemoryStore> {
        NAMED
            .lock()
            .entry(name.to_string())
            .or_insert_with(|| Arc::new(MemoryStore::new()))
            .clone()
    }

    /// Forgets the named store (users holding it keep their reference).
    pub fn remove_named(name: &str) -> bool {
        NAMED.lock().remove(name).is_some()
    }

    pub fn len(&self) -> usize {
        self.maps.lock().data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.maps.lock().data.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// Registered waiters not yet fired or cancelled, over all keys.
    pub fn waiter_count(&self) -> usize {
        self.maps.lock().waiters.values().map(Vec::len).sum()
    }

    fn register(
        &self,
        key: &str,
        unless: Option<&[u8]>,
        callback: GetCallback,
    ) -> Result<WaiterId> {
        let mut maps = self.maps.lock();
        let id = maps.next_waiter;
        maps.next_waiter += 1;
        match maps.data.get(key) {
            Some(value) if unless != Some(value.as_slice()) => {
                let value = value.clone();
                drop(maps);
                callback(Ok(value));
            }
            _ => maps
                .waiters
                .entry(key.to_string())
                .or_default()
                .push(Waiter {
                    id,
                    unless: unless.map(<[u8]>::to_vec),
                    callback,
                }),
        }
        Ok(WaiterId(id))
    }
}

impl KeyValueStore for MemoryStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut maps = self.maps.lock();
        loop {
            if let Some(value) = maps.data.get(key) {
                return Ok(value.clone());
            }
            if self.written.wait_until(&mut maps, deadline).timed_out() {
                return maps.data.get(key).cloned().ok_or_else(|| {
                    status::deadline_exceeded(format!(
                        "MemoryStore::get: key {key:?} not set within {timeout:?}"
                    ))
                });
            }
        }
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.maps
            .lock()
            .data
            .get(key)
            .cloned()
            .ok_or_else(|| status::not_found(format!("MemoryStore::try_get: no key {key:?}")))
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let fired = {
            let mut maps = self.maps.lock();
            if !self.allow_overwrite && maps.data.contains_key(key) {
                return Err(status::already_exists(format!(
                    "MemoryStore::set: key {key:?} exists and this store does not overwrite"
                )));
            }
            maps.data.insert(key.to_string(), value.to_vec());
            match maps.waiters.remove(key) {
                None => Vec::new(),
                Some(waiters) => {
                    let (fired, kept): (Vec<_>, Vec<_>) =
                        waiters.into_iter().partition(|w| w.satisfied_by(value));
                    if !kept.is_empty() {
                        maps.waiters.insert(key.to_string(), kept);
                    }
                    fired
                }
            }
        };
        self.written.notify_all();
        for waiter in fired {
            (waiter.callback)(Ok(value.to_vec()));
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.maps.lock().data.remove(key);
        Ok(())
    }

    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId> {
        self.register(key, unless, callback)
    }

    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool {
        let removed = {
            let mut maps = self.maps.lock();
            let Some(waiters) = maps.waiters.get_mut(key) else {
                return false;
            };
            let removed = waiters
                .iter()
                .position(|w| w.id == id.0)
                .map(|i| waiters.swap_remove(i));
            if waiters.is_empty() {
                maps.waiters.remove(key);
            }
            removed
        };
        // Dropped outside the lock: the callback may own arbitrary state.
        removed.is_some()
    }

    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities {
            can_delete: true,
            can_overwrite: self.allow_overwrite,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use crossbeam_channel::{bounded, Sender};

    fn send_to(tx: Sender<Result<Vec<u8>>>) -> GetCallback {
        Box::new(move |r| tx.send(r).unwrap())
    }

    #[test]
    fn set_fires_waiters_once_and_keeps_the_entry_until_delete() {
        let store = MemoryStore::new();
        let (tx, rx) = bounded(4);
        store.async_get("k", None, send_to(tx.clone())).unwrap();
        assert_eq!(store.waiter_count(), 1);
        store.set("k", b"v").unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), b"v");
        assert_eq!(store.waiter_count(), 0);
        store.set("k", b"w").unwrap();
        assert!(rx.try_recv().is_err(), "fired once only");
        assert_eq!(store.try_get("k").unwrap(), b"w");
        store.delete("k").unwrap();
        assert_eq!(store.try_get("k").unwrap_err().code, Code::NotFound);
        store.delete("k").unwrap();
    }

    #[test]
    fn async_get_on_a_present_key_fires_at_once() {
        let store = MemoryStore::new();
        store.set("k", b"old").unwrap();
        let (tx, rx) = bounded(1);
        store.async_get("k", None, send_to(tx)).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), b"old");
    }

    #[test]
    fn async_get_changed_ignores_the_stale_value_and_fires_on_a_new_one() {
        let store = MemoryStore::new();
        store.set("k", b"stale").unwrap();
        let (tx, rx) = bounded(1);
        store.async_get("k", Some(b"stale"), send_to(tx)).unwrap();
        assert!(rx.try_recv().is_err());
        store.set("k", b"stale").unwrap();
        assert!(
            rx.try_recv().is_err(),
            "same stale value re-set does not count"
        );
        store.set("k", b"fresh").unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), b"fresh");
    }

    #[test]
    fn cancelled_waiter_never_fires_and_cancel_reports_whether_it_was_pending() {
        let store = MemoryStore::new();
        let (tx, rx) = bounded(1);
        let id = store.async_get("k", None, send_to(tx)).unwrap();
        assert!(store.cancel_async_get("k", id));
        assert!(!store.cancel_async_get("k", id));
        store.set("k", b"v").unwrap();
        assert!(rx.try_recv().is_err());
        assert_eq!(store.waiter_count(), 0);
    }

    #[test]
    fn no_overwrite_mode_rejects_set_on_a_present_key() {
        let store = MemoryStore::with_overwrite(false);
        assert!(!store.capabilities().can_overwrite);
        store.set("k", b"1").unwrap();
        assert_eq!(store.set("k", b"2").unwrap_err().code, Code::AlreadyExists);
        store.delete("k").unwrap();
        store.set("k", b"2").unwrap();
    }

    #[test]
    fn blocking_get_wakes_on_set_and_times_out_when_absent() {
        let store = Arc::new(MemoryStore::new());
        let err = store.get("absent", Duration::from_millis(5)).unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        let (started_tx, started_rx) = bounded(1);
        let s = store.clone();
        let t = std::thread::spawn(move || {
            started_tx.send(()).unwrap();
            s.get("k", Duration::from_secs(30))
        });
        started_rx.recv().unwrap();
        store.set("k", b"v").unwrap();
        assert_eq!(t.join().unwrap().unwrap(), b"v");
    }

    #[test]
    fn named_stores_are_shared_within_the_process() {
        let a = MemoryStore::named("memory-test-shared");
        let b = MemoryStore::named("memory-test-shared");
        a.set("k", b"v").unwrap();
        assert_eq!(b.keys(), vec!["k".to_string()]);
        assert_eq!(b.len(), 1);
        assert!(MemoryStore::remove_named("memory-test-shared"));
        assert!(MemoryStore::named("memory-test-shared").is_empty());
        MemoryStore::remove_named("memory-test-shared");
    }
}
