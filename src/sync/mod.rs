//! Synchronisation primitives shared by every layer.
pub mod promise;

pub use promise::{Future, PromiseOnce};
