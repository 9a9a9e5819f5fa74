//! Key-value stores: the trait the transfer layer talks to, and its
//! implementations (embedded memory store, the PJRT client-create callbacks,
//! etcd, a fault-injecting test wrapper) and the sealing wrapper that keeps
//! a shared store's contents unforgeable (`sealed.rs`).
use std::time::Duration;

use crate::status::Result;

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

/// The store contract.
///
/// Waiters: the callback of `async_get`/`async_get_changed` runs exactly once,
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
    /// it already is).
    fn async_get(&self, key: &str, callback: GetCallback) -> Result<WaiterId>;
    /// Like `async_get`, but a value equal to `stale` does not count: calls
    /// back once `key` holds anything else. This is how a receiver that saw a
    /// stale receipt waits for the real one without spinning on the present
    /// value.
    fn async_get_changed(&self, key: &str, stale: &[u8], callback: GetCallback)
        -> Result<WaiterId>;
    /// Retires a pending waiter locally. `true`: it was pending and its
    /// callback will never run. `false`: it already fired (or is firing).
    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool;
    fn capabilities(&self) -> StoreCapabilities;
}
