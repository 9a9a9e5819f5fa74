//! Moving bytes into a receive destination.
//!
//! The transport is chosen per descriptor, from where the destination lives
//! relative to the sender:
//!
//! - same process: a direct copy into the destination (`copy`);
//! - same host, another process: the receiver allocates the destination in
//!   POSIX shared memory (`shm`, optionally carved from a pre-faulted
//!   `shm_pool`) and the sender maps it and copies (GPU: CUDA IPC);
//! - another host: the sender streams the bytes to the receiver's TCP
//!   transfer server (`tcp`), which checks the descriptor's auth token and
//!   the bounds before writing into the destination (GPU: staged through
//!   pinned host memory).
//!
//! "Same host" is decided by `HostIdentity` (hostname + boot id); "same
//! process" additionally by the process id in the descriptor.
//!
//! Shared-memory names carry their creator (`shm_owner`), so the objects of
//! a process that died without unlinking them are removed (`shm_reaper`),
//! and a sender can tell that the receiver it wrote to is gone.
pub mod advertise;
pub mod auth_token;
pub mod claim;
pub mod connections;
pub mod control;
pub mod copy;
pub mod destination;
pub mod fd_limit;
pub mod hex;
pub mod host_identity;
pub mod poll;
pub mod random;
pub mod registry;
pub mod shm;
pub mod shm_device_memory;
pub mod shm_fault;
pub mod shm_mappings;
pub mod shm_name;
pub mod shm_owner;
pub mod shm_pool;
pub mod shm_populate;
pub mod shm_reaper;
#[cfg(test)]
pub mod shm_test_object;
pub mod staging;
pub mod stream_copy;
pub mod tcp;
pub mod ucx;
