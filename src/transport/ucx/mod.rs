//! The UCX transport: bytes between hosts on UCX's UCP API, so a job moves
//! them over whatever UCX finds (RDMA on InfiniBand, RoCE or EFA, shared
//! memory, TCP) instead of the project's own TCP stream.
//!
//! libucp is loaded at run time (`library.rs`): the plugin builds and loads
//! without UCX, and without it cross-host transfers use the TCP transport.
//!
//! Which UCP operation carries the bytes was measured, not assumed: over
//! UCX's TCP transport a one-sided put is emulated (27 MB/s for 64 MiB with
//! `ucx_perftest -t ucp_put_bw` on this project's 2-core machine) while
//! active messages moved 663 MB/s there, and 2.0-2.3 GB/s across the
//! two-host bed, the speed of a raw TCP stream over the same veth. So a
//! send is one active message: UCX sends small ones eagerly and large ones
//! with its rendezvous protocol, which is zero-copy RDMA (get into the
//! receiver's destination) where the NIC has it and a pipelined send over
//! TCP where it does not.
//!
//! Protocol (`wire.rs`), per buffer:
//!
//! ```text
//! sender -> receiver: DATA {token, offset, length, request id, sender}, the bytes
//! receiver:           claims the destination registered under the token (single
//!                     use), checks the bounds, lands the bytes in it (eager: copy;
//!                     rendezvous: ucp_am_recv_data_nbx straight into it)
//! receiver -> sender: ACK {request id, token, verdict} once the bytes are there
//! ```
//!
//! A destination the receiver lands through its staging ring (a GPU
//! buffer; `stage_host_transfers`), or a source the sender stages, goes as
//! a stream of CHUNK messages instead, each at most the receiver's staging
//! chunk, answered by one ACK once the last chunk's copy completed
//! (`stream.rs`).
//!
//! The sender reports OK, and only then sets the buffer's completion key
//! (the receipt), after the ACK: UCX's own completion of an eager send
//! only means the bytes left. Destinations are registered with UCX only
//! while a receive into them is in flight (UCX registers per transfer, the
//! registration cache being off, see `library.rs`), and a destination that
//! is released or cancelled is gone from the registry, so no late message or
//! rendezvous can write it.
//!
//! What a party that can reach a process's UCX port can and cannot do (UCX
//! over TCP authenticates nobody): it can connect, send malformed messages
//! (dropped and counted in `rejected_messages`), make UCX buffer an eager
//! message of up to UCX's eager size, and hold connections. It cannot write
//! into a destination (that needs the destination's 32-byte token, which
//! travels only inside descriptors, over the job's control links or its
//! store), cannot complete anyone's send (an ACK is believed only with the
//! same token), and cannot complete a receive (that needs a receipt with the
//! buffer's nonce through the job's store, exactly as on every transport).
//! Whoever can read the job's store can read tokens too: protecting the
//! store protects the data plane.
mod capabilities;
mod library;
mod stream;
pub mod sys;
mod transfer;
mod transport;
pub mod wire;
mod worker;

pub use capabilities::{query, Capabilities};
pub use library::{
    choose, load, load_for, rdma_devices, survey, Candidate, Choice, LoadedUcx, Needs, Source,
    Survey, MINIMUM_VERSION, RDMA_DEVICES_DIR_ENV, UCX_ENVIRONMENT, UCX_LIBRARY_ENV, UCX_WHEEL_ENV,
};
pub use stream::{ChunkSender, KeepAlive, SendBytes, STAGED_PATIENCE};
pub use transfer::{Payload, SendDone};
pub use transport::UcxTransport;
pub use worker::lane_transports;

#[cfg(test)]
mod tests;
