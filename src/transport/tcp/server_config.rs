//! `TcpServerConfig`: the receive server's bounds (threads, deadlines,
//! queue), shared by the server and its admission of connections.
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct TcpServerConfig {
    /// Authenticated transfers received at once; more wait in a queue.
    pub handler_threads: usize,
    /// Time a connection has, from accept, to deliver its whole request
    /// header and be authenticated (and, when refused, to take its answer).
    /// Past it the server closes the connection. Until authenticated a
    /// connection holds no handler thread, only a slot among
    /// `max_pending_connections`. Default 5 s: a sender writes the 56-byte
    /// header as soon as it is connected, so it needs one trip of a small
    /// segment, and 5 s still covers two retransmissions of a lost one
    /// (Linux starts the retransmission timeout at 1 s, then doubles it);
    /// yet a peer that never authenticates gives its slot back quickly.
    pub header_deadline: Duration,
    /// Unauthenticated connections kept waiting for their header at once;
    /// beyond this the oldest is closed (see admission.rs for why the oldest).
    pub max_pending_connections: usize,
    /// Bound on every blocking read or write of an authenticated
    /// connection's payload and ack; a stalled or dead sender costs at most
    /// this long per operation, a slow but steady one is fine.
    pub io_timeout: Duration,
    /// After refusing a request, up to this many payload bytes are read and
    /// discarded (within `header_deadline`) so the sender can still read the
    /// refusal; beyond it the connection is simply closed.
    pub max_discard_bytes: u64,
}

impl Default for TcpServerConfig {
    fn default() -> TcpServerConfig {
        TcpServerConfig {
            handler_threads: 4,
            header_deadline: Duration::from_secs(5),
            max_pending_connections: 256,
            io_timeout: Duration::from_secs(30),
            max_discard_bytes: 64 << 20,
        }
    }
}
