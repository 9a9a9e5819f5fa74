//! Which transport a receive destination is offered over: the `transport`
//! option, where the peer is, whether both ends have UCX and what its lanes
//! are, and, where UCX's only lane is TCP, the shape of the batch.
use crate::sync::ByteRoute;

/// The `transport` create option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory on one host; between hosts UCX where both processes
    /// have it, else TCP; where this host's UCX has no RDMA lane, batches
    /// of large buffers take TCP (see `Route::for_buffer`).
    #[default]
    Auto,
    /// TCP destinations only, even on one host.
    Tcp,
    /// UCX everywhere, even on one host (FAILED_PRECONDITION without UCX).
    Ucx,
}

impl TransportChoice {
    pub fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Ucx => "ucx",
        }
    }

    pub fn parse(text: &str) -> Option<TransportChoice> {
        [
            TransportChoice::Auto,
            TransportChoice::Tcp,
            TransportChoice::Ucx,
        ]
        .into_iter()
        .find(|choice| choice.name() == text)
    }

    /// Whether this process and a peer (on `same_host` or not) move bytes
    /// over UCX, if both can.
    pub fn wants_ucx(self, same_host: bool) -> bool {
        match self {
            TransportChoice::Auto => !same_host,
            TransportChoice::Tcp => false,
            TransportChoice::Ucx => true,
        }
    }
}

/// What carries UCX's bytes from this host, as its UCX sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UcxLanes {
    /// An RDMA transport (verbs, EFA): what a TCP stream cannot use.
    Rdma,
    /// TCP only, as the plugin's own TCP transport.
    TcpOnly,
}

/// Where a peer is, from this process, and what reaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reach {
    pub same_host: bool,
    /// This process's UCX, `None` without one.
    pub ucx: Option<UcxLanes>,
    pub peer_has_ucx: bool,
}

/// Buffers of at least `TCP_BATCH_MIN_BYTES`, `TCP_BATCH_MIN_COUNT` or
/// more of them from one peer in one receive batch, go over the TCP
/// transport where UCX's only lane is TCP. Measured on the two-host bed
/// inside JAX, UCX 1.22 against the TCP transport with the kernel's socket
/// buffer autotuning (`bench/jax_device_put.py --hosts --variant
/// ucx=transport=ucx --variant tcp=transport=tcp --cases ...`, medians over
/// three and five alternating rounds in ms, UCX / TCP; docs/benchmarks.md):
/// from 2 such buffers on, TCP was ahead for buffers up to 2 MiB (2 x 256
/// KiB 0.63 / 0.48, 4 x 1 MiB 2.25 / 1.71, 4 x 2 MiB 3.85 / 3.08, 64 x 1
/// MiB 26.2 / 19.2): its handler threads receive several buffers straight
/// into their destinations at once; batches of 4 MiB buffers were even (4 x
/// 4 MiB 5.91 / 5.59, 16 x 4 MiB 21.5 / 20.4). A lone buffer stays on UCX:
/// from 4 MiB UCX stripes it over its workers (4 MiB 1.82 / 2.18, 16 MiB
/// 5.88 / 8.97), and below that the two were within run-to-run spread (1
/// MiB 0.80 / 0.76, 2 MiB 1.15 / 1.24). Below 256 KiB UCX was ahead or even
/// (64 x 4 KiB 2.98 / 3.52, 16 x 64 KiB 1.43 / 1.36).
pub const TCP_BATCH_MIN_BYTES: usize = 256 << 10;
pub const TCP_BATCH_MIN_COUNT: usize = 2;

/// How one destination is offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    SharedMemory,
    Tcp,
    Ucx,
}

impl Route {
    /// The route of one buffer of `bytes` from a peer at `reach`, in a
    /// batch holding `large_from_peer` buffers of at least
    /// `TCP_BATCH_MIN_BYTES` from that peer.
    pub fn for_buffer(
        choice: TransportChoice,
        reach: Reach,
        bytes: usize,
        large_from_peer: usize,
    ) -> Route {
        match (choice, reach.ucx) {
            (TransportChoice::Tcp, _) => Route::Tcp,
            (TransportChoice::Ucx, _) => Route::Ucx,
            (TransportChoice::Auto, _) if reach.same_host => Route::SharedMemory,
            (TransportChoice::Auto, None) => Route::Tcp,
            (TransportChoice::Auto, Some(_)) if !reach.peer_has_ucx => Route::Tcp,
            (TransportChoice::Auto, Some(UcxLanes::Rdma)) => Route::Ucx,
            (TransportChoice::Auto, Some(UcxLanes::TcpOnly)) => {
                if bytes >= TCP_BATCH_MIN_BYTES && large_from_peer >= TCP_BATCH_MIN_COUNT {
                    Route::Tcp
                } else {
                    Route::Ucx
                }
            }
        }
    }

    /// v1: the sender is not known, so the receiver cannot tell where it
    /// is; shared memory unless a network transport is forced.
    pub fn unknown_peer(choice: TransportChoice) -> Route {
        match choice {
            TransportChoice::Tcp => Route::Tcp,
            TransportChoice::Ucx => Route::Ucx,
            TransportChoice::Auto => Route::SharedMemory,
        }
    }

    pub fn byte_route(self) -> ByteRoute {
        match self {
            Route::SharedMemory => ByteRoute::SharedMemory,
            Route::Tcp => ByteRoute::Tcp,
            Route::Ucx => ByteRoute::Ucx,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(same_host: bool, ucx: Option<UcxLanes>, peer_has_ucx: bool) -> Reach {
        Reach {
            same_host,
            ucx,
            peer_has_ucx,
        }
    }

    #[test]
    fn auto_takes_shared_memory_on_one_host_and_ucx_between_hosts_only_when_both_have_it() {
        use TransportChoice::*;
        let rdma = Some(UcxLanes::Rdma);
        let lone = |choice, reach| Route::for_buffer(choice, reach, 4 << 20, 1);
        assert_eq!(lone(Auto, reach(true, rdma, true)), Route::SharedMemory);
        assert_eq!(lone(Auto, reach(false, rdma, true)), Route::Ucx);
        assert_eq!(lone(Auto, reach(false, rdma, false)), Route::Tcp);
        assert_eq!(lone(Auto, reach(false, None, true)), Route::Tcp);
        assert_eq!(lone(Tcp, reach(false, rdma, true)), Route::Tcp);
        assert_eq!(lone(Ucx, reach(true, rdma, true)), Route::Ucx);
        assert_eq!(Route::unknown_peer(Auto), Route::SharedMemory);
        assert!(Auto.wants_ucx(false) && !Auto.wants_ucx(true) && Ucx.wants_ucx(true));
        assert_eq!(TransportChoice::parse("ucx"), Some(Ucx));
        assert_eq!(TransportChoice::parse("rdma"), None);
    }

    #[test]
    fn where_ucx_has_only_tcp_batches_of_large_buffers_take_the_tcp_transport() {
        use TransportChoice::*;
        let tcp_only = reach(false, Some(UcxLanes::TcpOnly), true);
        let large = TCP_BATCH_MIN_BYTES;
        let count = TCP_BATCH_MIN_COUNT;
        assert_eq!(Route::for_buffer(Auto, tcp_only, large, count), Route::Tcp);
        assert_eq!(Route::for_buffer(Auto, tcp_only, large, 1), Route::Ucx);
        assert_eq!(Route::for_buffer(Auto, tcp_only, 64 << 20, 16), Route::Tcp);
        // A lone large buffer is striped over UCX's workers; small ones
        // cost UCX less, in a batch or not.
        assert_eq!(Route::for_buffer(Auto, tcp_only, 64 << 20, 1), Route::Ucx);
        assert_eq!(Route::for_buffer(Auto, tcp_only, large - 1, 16), Route::Ucx);
        // With RDMA lanes, or a transport named, the batch does not matter.
        let rdma = reach(false, Some(UcxLanes::Rdma), true);
        assert_eq!(Route::for_buffer(Auto, rdma, large, 16), Route::Ucx);
        assert_eq!(Route::for_buffer(Ucx, tcp_only, large, 16), Route::Ucx);
        // On one host shared memory, whatever the batch.
        let here = reach(true, Some(UcxLanes::TcpOnly), true);
        assert_eq!(
            Route::for_buffer(Auto, here, large, 16),
            Route::SharedMemory
        );
    }
}
