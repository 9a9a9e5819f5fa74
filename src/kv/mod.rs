//! Key-value stores: the trait the transfer layer talks to, and its
//! implementations (embedded memory store, the PJRT client-create callbacks,
//! etcd, a fault-injecting test wrapper) and the sealing wrapper that keeps
//! a shared store's contents unforgeable (`sealed.rs`).
use std::time::Duration;

use crate::status::{Result, Status};

pub mod callback;
pub mod etcd;
pub mod memory;
pub mod peer;
pub mod sealed;
pub mod test_store;

pub use callback::{CallbackStore, CallbackStoreOptions, RawKvCallbacks};
pub use memory::MemoryStore;
pub use test_store::{Op, TestStore};

/// Identifies one registered `async_get` waiter, for `cancel_async_get`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WaiterId(pub u64);

/// What a store can do. Stores that cannot delete keep every receipt forever
/// (the nonce in the receipt is then the only defence against stale values);
/// stores that cannot overwrite reject a `set` on a present key with
/// `ALREADY_EXISTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreCapabilities {
    pub can_delete: bool,
    pub can_overwrite: bool,
}

/// Called once with the value (or the store's error) of an `async_get`.
pub type GetCallback = Box<dyn FnOnce(Result<Vec<u8>>) + Send + 'static>;

/// Called once with the outcome of a `set_async`.
pub type SetCallback = Box<dyn FnOnce(Result<()>) + Send + 'static>;

/// A value that does not count for `async_get` (a stale one already seen).
pub type Unless<'a> = Option<&'a [u8]>;

/// `get` for stores whose waiting is `async_get`: the value (or the store's
/// error) if it comes within `timeout`, else `late()`'s error. A waiter
/// that could not be cancelled as the wait ended is firing: its value is
/// taken if it comes at once.
pub(crate) fn get_by_waiting(
    store: &dyn KeyValueStore,
    key: &str,
    timeout: Duration,
    late: impl FnOnce() -> Status,
) -> Result<Vec<u8>> {
    wait_for_value(store, key, None, timeout, late)
}

/// `get`, except that a value equal to `seen` does not count: the value
/// that replaces it, if one comes within `timeout` (`DEADLINE_EXCEEDED`
/// otherwise).
pub(crate) fn get_other_than(
    store: &dyn KeyValueStore,
    key: &str,
    seen: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>> {
    wait_for_value(store, key, Some(seen), timeout, || {
        crate::status::deadline_exceeded(format!(
            "{key} still holds the value already seen after {timeout:?}"
        ))
    })
}

fn wait_for_value(
    store: &dyn KeyValueStore,
    key: &str,
    unless: Unless,
    timeout: Duration,
    late: impl FnOnce() -> Status,
) -> Result<Vec<u8>> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let id = store.async_get(
        key,
        unless,
        Box::new(move |value| {
            let _ = tx.send(value);
        }),
    )?;
    if let Ok(value) = rx.recv_timeout(timeout) {
        return value;
    }
    if !store.cancel_async_get(key, id) {
        if let Ok(value) = rx.recv_timeout(Duration::from_millis(100)) {
            return value;
        }
    }
    Err(late())
}

/// The store contract.
///
/// Waiters: the callback of `async_get` runs exactly once,
/// unless `cancel_async_get` returned `true` for it, in which case it is
/// dropped without running. It may run on any thread, including the caller's
/// (when the value is already there), and never while the store holds a lock.
pub trait KeyValueStore: Send + Sync {
    /// Blocks until `key` is present or `timeout` passes (`DEADLINE_EXCEEDED`).
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// The value now, or `NOT_FOUND`.
    fn try_get(&self, key: &str) -> Result<Vec<u8>>;
    /// Stores `value`; `ALREADY_EXISTS` if present and the store cannot overwrite.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// `set`, reporting to `done` once the value is stored, without blocking
    /// the caller where the store can avoid it (the peer store writes to a
    /// peer and returns; the ack completes `done`). `done` may run on the
    /// caller's thread.
    fn set_async(&self, key: &str, value: &[u8], done: SetCallback) {
        done(self.set(key, value));
    }
    /// Removes `key`; deleting an absent key is not an error. `UNIMPLEMENTED`
    /// if `capabilities().can_delete` is false.
    fn delete(&self, key: &str) -> Result<()>;
    /// `delete`, reporting to `done`; stores whose delete waits on another
    /// process or a framework's callback run it off the caller's thread.
    /// `done` may run on the caller's thread.
    fn delete_async(&self, key: &str, done: SetCallback) {
        done(self.delete(key));
    }
    /// Calls back with the value of `key` as soon as it is present (at once if
    /// it already is); with `unless`, a value equal to it does not count and
    /// the callback waits for anything else: this is how a receiver that saw
    /// a stale receipt waits for the real one without spinning on the present
    /// value. The one waiting primitive each store implements.
    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId>;
    /// Withdraws a pending waiter (locally, no store call). `true`: it was pending and its
    /// callback will never run. `false`: it already fired (or is firing).
    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool;
    fn capabilities(&self) -> StoreCapabilities;
}
