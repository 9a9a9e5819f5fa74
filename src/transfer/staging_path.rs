//! Which buffers go through the staging pipeline (`transport/staging/`), on
//! either side of a transfer, decided from where their memory is, the route
//! their destination is offered over and `stage_host_transfers`:
//!
//! - a receive destination in device memory (CUDA) offered over a network
//!   transport (its sender on another node, or `transport=tcp|ucx`) lands
//!   through the receive ring: no network transport here writes GPU memory
//!   (same node: CUDA IPC, no staging);
//! - a host destination does so only with `stage_host_transfers` (the
//!   pipeline on CPU, for tests and measurement);
//! - a sender stages a device source (its device-to-host copies feed the
//!   send ring) and, with `stage_host_transfers`, a host one, over either
//!   network transport; over UCX the bytes go as chunk messages
//!   (`transport/ucx/stream.rs`) whenever the sender stages or the
//!   receiver does (its descriptor names its chunk size).
use super::route::Route;

/// How a receive destination's bytes land.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    /// Straight into its memory (shared memory, CUDA IPC, a network
    /// transport writing host memory).
    Direct,
    /// Chunk by chunk through the receive ring and the device's copies.
    Staged,
}

/// How a destination in `device_memory` (or host memory) offered over
/// `route` lands.
pub fn landing(device_memory: bool, route: Route, stage_host_transfers: bool) -> Landing {
    match route {
        Route::SharedMemory => Landing::Direct,
        Route::Tcp | Route::Ucx if device_memory || stage_host_transfers => Landing::Staged,
        Route::Tcp | Route::Ucx => Landing::Direct,
    }
}

/// How a sender moves one buffer over a network transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendPlan {
    /// The source goes through the send ring (device-to-host copies, or
    /// memcpys for a host source), chunk by chunk.
    pub stage_source: bool,
    /// Over UCX: chunk messages (else one message per part).
    pub chunked: bool,
}

/// The plan for a source in `device_memory` (or host memory) sent to a
/// destination whose receiver stages it over UCX in chunks of
/// `receiver_chunk` bytes (0: it does not; TCP: always 0), where this
/// client `has_staging` rings.
pub fn send_plan(
    device_memory: bool,
    stage_host_transfers: bool,
    has_staging: bool,
    receiver_chunk: u32,
) -> SendPlan {
    let stage_source = has_staging && (device_memory || stage_host_transfers);
    SendPlan {
        stage_source,
        chunked: stage_source || receiver_chunk > 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_memory_stages_on_a_network_route_and_host_memory_only_when_asked() {
        for stage_host in [false, true] {
            // Same node: CUDA IPC or shared memory, never staged.
            assert_eq!(
                landing(true, Route::SharedMemory, stage_host),
                Landing::Direct
            );
            assert_eq!(
                landing(false, Route::SharedMemory, stage_host),
                Landing::Direct
            );
            for network in [Route::Tcp, Route::Ucx] {
                // A GPU buffer from another node: staged, whatever the option.
                assert_eq!(landing(true, network, stage_host), Landing::Staged);
                let host = if stage_host {
                    Landing::Staged
                } else {
                    Landing::Direct
                };
                assert_eq!(landing(false, network, stage_host), host);
            }
        }
    }

    #[test]
    fn a_sender_stages_device_sources_and_chunks_whenever_either_side_stages() {
        // GPU source: staged and chunked, whatever the receiver does.
        for receiver_chunk in [0, 4 << 20] {
            let plan = send_plan(true, false, true, receiver_chunk);
            assert!(plan.stage_source && plan.chunked, "{receiver_chunk}");
        }
        // Host source to a staging receiver: chunked straight from its memory.
        assert_eq!(
            send_plan(false, false, false, 4096),
            SendPlan {
                stage_source: false,
                chunked: true
            }
        );
        // Host to host, no option: as before (one message per part).
        assert_eq!(
            send_plan(false, false, true, 0),
            SendPlan {
                stage_source: false,
                chunked: false
            }
        );
        // stage_host_transfers stages a host source too.
        assert!(send_plan(false, true, true, 0).stage_source);
        // Without rings (they could not be made) nothing is staged here.
        assert!(!send_plan(true, true, false, 0).stage_source);
    }
}
