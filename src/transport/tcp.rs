//! Cross-host transport: the sender streams the bytes over TCP to the
//! receiver's transfer server, which checks the descriptor's auth token and
//! the bounds, writes straight into the registered destination, and acks.
//! The sender treats the bytes as delivered only after that ack.
//!
//! One transfer per connection:
//!
//! ```text
//! sender -> receiver: request header (wire.rs), then `length` payload bytes
//! receiver -> sender: response (OK, or error code + message)
//! ```
mod admission;
mod receive_server;
mod send;
mod server_config;
mod socket;
pub mod wire;

pub use receive_server::TcpReceiveServer;
pub use send::tcp_send;
pub use server_config::TcpServerConfig;
pub use wire::{PROTOCOL_VERSION, REQUEST_HEADER_LEN};

#[cfg(test)]
mod tests;
