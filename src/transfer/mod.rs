//! The cross-host protocol: key naming, receipts, descriptors, the session,
//! the receive state machine (`recv_state.rs`, the completion lifecycle of
//! docs/DESIGN.md §3) and the send/receive service built on it.
pub mod cuda_path;
pub mod descriptor;
pub mod host_destination;
pub mod keys;
pub mod memory_budget;
pub mod receipt;
pub mod recv_state;
pub mod route;
pub mod service;
pub mod session;
pub mod staging_path;

pub use keys::CompletionKey;
pub use receipt::Receipt;
pub use recv_state::{PendingReceive, ReceiveConfig, ReceiveTracker};
