//! `TestStore`: wraps any store for the regression tests. It counts calls
//! per operation (and per key), fails the Nth call of an operation on
//! request, can make a key's AsyncGet deliver an error, can hold deletes on a
//! gate (and sets on another), can run a test's action just before the next
//! operation on a key (to race a real writer against the code under test at
//! an exact point), and can play a store that cannot delete at all (capability
//! `can_delete = false`, `delete` returns `UNIMPLEMENTED` without touching
//! the inner store) — the negative control for key retirement.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::{GetCallback, KeyValueStore, StoreCapabilities, Unless, WaiterId};
use crate::status::{self, Result, Status};

/// The operations counted (and made to fail) separately. `AsyncGet` covers
/// every `async_get` registration, with or without `unless`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Get,
    TryGet,
    Set,
    Delete,
    AsyncGet,
    CancelAsyncGet,
}

#[derive(Default)]
struct Faults {
    calls: HashMap<Op, usize>,
    calls_per_key: HashMap<(Op, String), usize>,
    /// Op -> (call number that fails, counted over all calls, and its error).
    fail_at: HashMap<Op, Vec<(usize, Status)>>,
    /// Keys whose next AsyncGet delivers this error through its callback.
    fail_wait: HashMap<String, Status>,
    delete_gate: Option<Receiver<()>>,
    set_gate: Option<Receiver<()>>,
    delete_disabled: bool,
    /// Key -> action run (once) just before the next operation on it.
    before_next_op: HashMap<String, Box<dyn FnOnce() + Send>>,
}

pub struct TestStore {
    inner: Arc<dyn KeyValueStore>,
    faults: Mutex<Faults>,
}

impl TestStore {
    pub fn new(inner: Arc<dyn KeyValueStore>) -> TestStore {
        TestStore {
            inner,
            faults: Mutex::new(Faults::default()),
        }
    }

    pub fn calls(&self, op: Op) -> usize {
        self.faults.lock().calls.get(&op).copied().unwrap_or(0)
    }

    pub fn calls_for(&self, op: Op, key: &str) -> usize {
        let faults = self.faults.lock();
        faults
            .calls_per_key
            .get(&(op, key.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// The `n`th call (1-based, counting from now) of `op` returns `error`.
    pub fn fail_nth(&self, op: Op, n: usize, error: Status) {
        assert!(n >= 1, "fail_nth counts from 1");
        let mut faults = self.faults.lock();
        let at = faults.calls.get(&op).copied().unwrap_or(0) + n;
        faults.fail_at.entry(op).or_default().push((at, error));
    }

    pub fn fail_nth_get(&self, n: usize, error: Status) {
        self.fail_nth(Op::Get, n, error)
    }

    pub fn fail_nth_set(&self, n: usize, error: Status) {
        self.fail_nth(Op::Set, n, error)
    }

    pub fn fail_nth_delete(&self, n: usize, error: Status) {
        self.fail_nth(Op::Delete, n, error)
    }

    pub fn fail_nth_async_get(&self, n: usize, error: Status) {
        self.fail_nth(Op::AsyncGet, n, error)
    }

    /// The next AsyncGet registered on `key` succeeds, but its callback gets
    /// `error` at once instead of a value: the store failed while waiting.
    pub fn fail_wait_on(&self, key: &str, error: Status) {
        self.faults.lock().fail_wait.insert(key.to_string(), error);
    }

    /// Every `delete` first takes one message from `gate` (blocking).
    pub fn gate_deletes(&self, gate: Receiver<()>) {
        self.faults.lock().delete_gate = Some(gate);
    }

    /// Every `set` first takes one message from `gate` (blocking).
    pub fn gate_sets(&self, gate: Receiver<()>) {
        self.faults.lock().set_gate = Some(gate);
    }

    /// Runs `action` once, just before the next operation (of any kind,
    /// counted first) on `key` reaches the inner store.
    pub fn before_next_op_on(&self, key: &str, action: impl FnOnce() + Send + 'static) {
        self.faults
            .lock()
            .before_next_op
            .insert(key.to_string(), Box::new(action));
    }

    /// From now on this store cannot delete (see the module doc).
    pub fn disable_delete(&self) {
        self.faults.lock().delete_disabled = true;
    }

    /// Counts the call and returns the injected failure, if this is it.
    fn enter(&self, op: Op, key: &str) -> Result<()> {
        let counted = self.count(op, key);
        let action = self.faults.lock().before_next_op.remove(key);
        if let Some(action) = action {
            action();
        }
        counted
    }

    fn count(&self, op: Op, key: &str) -> Result<()> {
        let mut faults = self.faults.lock();
        let n = {
            let n = faults.calls.entry(op).or_insert(0);
            *n += 1;
            *n
        };
        *faults
            .calls_per_key
            .entry((op, key.to_string()))
            .or_insert(0) += 1;
        if let Some(planned) = faults.fail_at.get_mut(&op) {
            if let Some(i) = planned.iter().position(|(at, _)| *at == n) {
                let (_, error) = planned.swap_remove(i);
                return Err(error);
            }
        }
        Ok(())
    }

    fn take_wait_failure(&self, key: &str) -> Option<Status> {
        self.faults.lock().fail_wait.remove(key)
    }
}

/// The id handed out for a waiter that already fired with an injected error.
const ALREADY_FIRED: WaiterId = WaiterId(u64::MAX);

impl KeyValueStore for TestStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.enter(Op::Get, key)?;
        self.inner.get(key, timeout)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.enter(Op::TryGet, key)?;
        self.inner.try_get(key)
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.enter(Op::Set, key)?;
        let gate = self.faults.lock().set_gate.clone();
        if let Some(gate) = gate {
            let _ = gate.recv();
        }
        self.inner.set(key, value)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.enter(Op::Delete, key)?;
        let (gate, disabled) = {
            let faults = self.faults.lock();
            (faults.delete_gate.clone(), faults.delete_disabled)
        };
        if let Some(gate) = gate {
            let _ = gate.recv();
        }
        if disabled {
            return Err(status::unimplemented(
                "TestStore::delete: this store cannot delete (disabled for the test)",
            ));
        }
        self.inner.delete(key)
    }

    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId> {
        self.enter(Op::AsyncGet, key)?;
        if let Some(error) = self.take_wait_failure(key) {
            callback(Err(error));
            return Ok(ALREADY_FIRED);
        }
        self.inner.async_get(key, unless, callback)
    }

    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool {
        // Never fails: cancelling is local bookkeeping.
        let _ = self.enter(Op::CancelAsyncGet, key);
        id != ALREADY_FIRED && self.inner.cancel_async_get(key, id)
    }

    fn capabilities(&self) -> StoreCapabilities {
        let mut caps = self.inner.capabilities();
        if self.faults.lock().delete_disabled {
            caps.can_delete = false;
        }
        caps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryStore;
    use crate::status::Code;

    #[test]
    fn nth_call_fails_counting_from_now_and_only_once() {
        let store = TestStore::new(Arc::new(MemoryStore::new()));
        store.set("a", b"1").unwrap();
        store.fail_nth_set(2, status::unavailable("boom"));
        store.set("a", b"2").unwrap();
        assert_eq!(store.set("a", b"3").unwrap_err().code, Code::Unavailable);
        store.set("a", b"4").unwrap();
        assert_eq!(store.calls(Op::Set), 4);
        assert_eq!(store.calls_for(Op::Set, "a"), 4);
        assert_eq!(store.try_get("a").unwrap(), b"4");
    }

    #[test]
    fn disabled_delete_reports_capability_and_unimplemented_and_keeps_the_key() {
        let inner = Arc::new(MemoryStore::new());
        let store = TestStore::new(inner.clone());
        store.set("a", b"1").unwrap();
        store.disable_delete();
        assert!(!store.capabilities().can_delete);
        assert_eq!(store.delete("a").unwrap_err().code, Code::Unimplemented);
        assert_eq!(inner.len(), 1);
    }

    #[test]
    fn fail_wait_on_delivers_the_error_through_the_callback() {
        let store = TestStore::new(Arc::new(MemoryStore::new()));
        store.fail_wait_on("k", status::unavailable("lost connection"));
        let (tx, rx) = crossbeam_channel::bounded(1);
        let id = store
            .async_get("k", None, Box::new(move |r| tx.send(r).unwrap()))
            .unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap_err().code, Code::Unavailable);
        assert!(!store.cancel_async_get("k", id));
    }
}
