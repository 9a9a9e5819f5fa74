//! `EtcdStore`: transfer keys in an etcd cluster (`kv_store=etcd://…`).
//!
//! - async get: a watch from now first, then, once etcd confirms the
//!   watch, one Range (a value written before the watch began); all of a
//!   store's waits on one watch stream (`watches.rs`);
//! - delete: DeleteRange;
//! - one lease per store with keep-alive (`lease.rs`); every key it writes
//!   is attached to it, so a dead process's keys vanish within the TTL, and
//!   destroying the client revokes it (nothing of this process is left);
//! - liveness: peers' session entries live under their leases, so a peer's
//!   death ends the waits on keys it would have written (`track_processes`).
//!
//! Every call is bounded by the call timeout (`kv_call_timeout_ms`).
pub mod access;
pub mod endpoints;
#[cfg(feature = "etcd")]
mod lease;
pub mod local_server;
#[cfg(feature = "etcd")]
mod runtime;
#[cfg(feature = "etcd")]
mod store;
#[cfg(feature = "etcd")]
mod watches;

#[cfg(feature = "etcd")]
pub use store::{EtcdConfig, EtcdStore};
#[cfg(feature = "etcd")]
pub use watches::WriterOf;
