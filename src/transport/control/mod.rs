//! Control links: small authenticated messages between the processes of a
//! job, over connections kept open for the job's life. The peer store
//! (`kv/peer.rs`) carries the transfer keys on them: a receiver's descriptor
//! goes straight to the process that will send, a sender's receipt straight
//! to the process that waits for it, without a round trip through a
//! framework's coordination service.
//!
//! Each process listens on an abstract Unix socket (peers on this host; no
//! file to clean up) and on TCP (peers elsewhere). A connection starts with
//! a handshake that proves, both ways, knowledge of the job's control secret
//! (agreed through the session) without sending it, within `hello_timeout`
//! of accept, or it is closed; then every frame travels encrypted and
//! authenticated under keys of that link and direction (`sealing.rs`). An
//! unauthenticated peer holds a socket and a small buffer until its
//! deadline, no thread, and at most `max_connections` of them exist.
//! After HELLO, requests are pipelined: each carries an id, the receiving
//! side applies it to its handler and acks with the id, and the caller
//! hands the ack to the waiting request. One thread per process reads
//! every link, served or made (`poller.rs`).
//!
//! Links are made on first use and closed when idle (`transport/connections/`);
//! an idle link is closed with BYE, so that its server does not take the
//! close for the death of the process at the other end, as it does any
//! other close of an authenticated link.
//!
//! Frames, little endian: `u32 length` (of what follows) `u8 op` `u64 id`
//! then the op's payload. SET: `u16 key length`, key, value. DELETE: key.
//! ACK: nothing. NACK: `u32 code`, message. BYE: nothing. Handshake, in
//! plain frames: HELLO: 32-byte nonce, `u32` process index; CHALLENGE:
//! 32-byte nonce, 32-byte proof; PROOF: 32-byte proof.
mod cork;
mod frame;
#[cfg(feature = "fuzzing")]
mod fuzz_hooks;
mod link;
mod poller;
mod sealing;
mod secret;
mod server;

use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::status::{self, Result};
use crate::sync::threads::Slice;

pub use cork::{cork, flush_corked, Cork};
pub use frame::*;
#[cfg(feature = "fuzzing")]
pub use fuzz_hooks::*;
pub use link::*;
pub use poller::Poller;
pub use secret::*;
pub use server::*;

/// Where a process listens for control links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlEndpoint {
    /// Abstract Unix socket name (peers on the same host).
    pub unix_name: String,
    pub tcp: SocketAddr,
}

impl ControlEndpoint {
    /// `unix=<name>,tcp=<addr>`.
    pub fn encode(&self) -> String {
        format!("unix={},tcp={}", self.unix_name, self.tcp)
    }

    pub fn decode(text: &str) -> Option<ControlEndpoint> {
        let (unix, tcp) = text.split_once(",tcp=")?;
        Some(ControlEndpoint {
            unix_name: unix.strip_prefix("unix=")?.to_string(),
            tcp: tcp.parse().ok()?,
        })
    }
}

/// What a control server does with the requests it receives.
pub trait ControlHandler: Send + Sync {
    fn set(&self, from: u32, key: &str, value: &[u8]) -> Result<()>;
    fn delete(&self, from: u32, key: &str) -> Result<()>;
    /// An authenticated link from `process` closed (it exited, crashed, or
    /// destroyed its client).
    fn peer_closed(&self, process: u32);
}

#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// HELLO must arrive within this long of accept.
    pub hello_timeout: Duration,
    /// Connections not authenticated yet (HELLO not read) served at once:
    /// what a stranger can hold. Authenticated links are bounded by the
    /// job's processes, each of which keeps few (`transport/connections/`).
    pub max_connections: usize,
    /// Bound on a request's wait for its ack, and on each write.
    pub request_timeout: Duration,
}

impl Default for ControlConfig {
    fn default() -> ControlConfig {
        ControlConfig {
            hello_timeout: Duration::from_secs(5),
            max_connections: 256,
            request_timeout: Duration::from_secs(30),
        }
    }
}

fn spawn(name: &str, slice: Slice, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    crate::sync::threads::spawn(name, slice, f)
        .map_err(|e| status::resource_exhausted(format!("cannot start thread {name}: {e}")))
}

#[cfg(test)]
mod tests;
