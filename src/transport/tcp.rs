//! Cross-host transport: the sender streams the bytes over TCP to the
//! receiver's transfer server, which checks the descriptor's auth token and
//! the bounds, writes straight into the registered destination, sets the
//! completion key when the request carries its value and the key is held
//! here, and acks. The sender treats the bytes as delivered only after that
//! ack, and sets the key itself when the receiver did not.
//!
//! One request at a time per connection, and a connection answered OK is
//! kept for the next (`TcpSender`):
//!
//! ```text
//! sender -> receiver: request header (wire.rs: token, range, receipt), then `length` payload bytes
//! receiver -> sender: response (OK and whether the receipt was applied, or error code + message)
//! ```
mod admission;
mod landing;
mod receive_server;
mod send;
mod server_config;
mod socket;
pub mod wire;

pub use receive_server::TcpReceiveServer;
pub use send::{Payload, TcpSender};
pub use server_config::TcpServerConfig;
pub use wire::{PROTOCOL_VERSION, REQUEST_HEADER_LEN};

#[cfg(test)]
mod tests;
