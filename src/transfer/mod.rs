//! The cross-host protocol: key naming, receipts, and the receive state
//! machine (`recv_state.rs`, the completion lifecycle of DESIGN.md §3).
pub mod keys;
pub mod receipt;
