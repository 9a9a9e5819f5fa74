//! Which transport a receive destination is offered over, per peer: the
//! `transport` option, where the peer is, and whether both ends have UCX.
use crate::sync::ByteRoute;

/// The `transport` create option.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory on one host; between hosts UCX where both processes
    /// have it, else TCP.
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

/// How one destination is offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    SharedMemory,
    Tcp,
    Ucx,
}

impl Route {
    /// The route to a peer on `same_host` (or not) of which `peer_has_ucx`,
    /// when this process `has_ucx`.
    pub fn to_peer(
        choice: TransportChoice,
        same_host: bool,
        has_ucx: bool,
        peer_has_ucx: bool,
    ) -> Route {
        match choice {
            TransportChoice::Tcp => Route::Tcp,
            TransportChoice::Ucx => Route::Ucx,
            TransportChoice::Auto if same_host => Route::SharedMemory,
            TransportChoice::Auto if has_ucx && peer_has_ucx => Route::Ucx,
            TransportChoice::Auto => Route::Tcp,
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

    #[test]
    fn auto_takes_shared_memory_on_one_host_and_ucx_between_hosts_only_when_both_have_it() {
        use TransportChoice::*;
        assert_eq!(Route::to_peer(Auto, true, true, true), Route::SharedMemory);
        assert_eq!(Route::to_peer(Auto, false, true, true), Route::Ucx);
        assert_eq!(Route::to_peer(Auto, false, true, false), Route::Tcp);
        assert_eq!(Route::to_peer(Auto, false, false, true), Route::Tcp);
        assert_eq!(Route::to_peer(Tcp, false, true, true), Route::Tcp);
        assert_eq!(Route::to_peer(Ucx, true, true, true), Route::Ucx);
        assert_eq!(Route::unknown_peer(Auto), Route::SharedMemory);
        assert!(Auto.wants_ucx(false) && !Auto.wants_ucx(true) && Ucx.wants_ucx(true));
        assert_eq!(TransportChoice::parse("ucx"), Some(Ucx));
        assert_eq!(TransportChoice::parse("rdma"), None);
    }
}
