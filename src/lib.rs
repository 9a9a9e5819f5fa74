//! pjrt-crosshost: a PJRT C-API plugin that moves device buffers between hosts
//! and processes, with a per-buffer completion lifecycle (see docs/DESIGN.md).
pub mod api;
pub mod backend;
pub mod compute_plugin;
pub mod ffi;
pub mod kv;
pub mod pjrt;
pub mod status;
pub mod sync;
pub mod transfer;
pub mod transport;
