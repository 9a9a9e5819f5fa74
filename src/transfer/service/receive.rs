//! The receive side: one destination per buffer, its descriptor, its
//! AsyncGet through the lifecycle (`recv_state`), and v1 cancellation.
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{PendingEntry, ReceiveDestination, ReceiveRequest, TransferService};
use crate::backend::DevicePlacement;
use crate::status::{self, Outcome, Result, Status};
use crate::sync::{kill_points, ByteRoute};
use crate::transfer::cuda_path;
use crate::transfer::descriptor::{AllocationHandle, Descriptor};
use crate::transfer::host_destination::{Destination, HostDestination, HostRoute};
use crate::transfer::keys::{pair_epoch, BufferIndices, CompletionKey};
use crate::transfer::memory_budget::BudgetLease;
use crate::transfer::receipt::Receipt;
use crate::transfer::recv_state::{PendingReceive, RecordOutcome};
use crate::transfer::route::{Reach, Route, TCP_BATCH_MIN_BYTES};
use crate::transfer::staging_path;
use crate::transport::auth_token::AuthToken;
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;

impl TransferService {
    /// v1: the caller routes descriptors itself; the sender is unknown, so
    /// shared memory is offered (same host) unless TCP or UCX is forced.
    pub fn receive_v1(
        self: &Arc<Self>,
        requests: Vec<ReceiveRequest>,
        placement: &DevicePlacement,
    ) -> Result<Vec<ReceiveDestination>> {
        let transfer_id = self.next_v1_transfer.fetch_add(1, Ordering::Relaxed);
        // Each receiving process numbers its own v1 transfers: its index
        // keeps two receivers of one session from sharing key names.
        let epoch = format!("{}.v1.p{}", self.session.epoch, self.session.process_index);
        let keys = (0..requests.len())
            .map(|index| CompletionKey::new(&epoch, transfer_id, index as u64))
            .collect::<Result<Vec<_>>>()?;
        let reservations = self.reserve_batch(&requests, &keys, placement)?;
        let route = Route::unknown_peer(self.config.transport);
        let mut opened = Vec::with_capacity(requests.len());
        for ((request, key), reservation) in requests.into_iter().zip(keys).zip(reservations) {
            opened.push(self.open_destination(request, key, None, route, placement, reservation));
        }
        self.all_or_none(opened)
    }

    /// v2: one destination per buffer, its descriptor published under the
    /// pair's descriptor key for the sender to pick up.
    pub fn receive_v2(
        self: &Arc<Self>,
        requests: Vec<ReceiveRequest>,
        my_device: i32,
        peers: &[(i32, i64)],
        incarnations: Option<&[(i32, i64)]>,
        placement: &DevicePlacement,
    ) -> Result<Vec<ReceiveDestination>> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers";
        crate::timeline!("receive_v2 of {} buffers", requests.len());
        if let Some(snapshot) = incarnations {
            self.observe_incarnations(snapshot);
        }
        let me = self.session.process_index;
        let local_host = HostIdentity::local()?;
        // Check every peer before opening anything. A batch names few peer
        // devices: each one's process, epoch and reach are worked out once.
        let mut pairs: HashMap<i32, (i32, String, Reach)> = HashMap::new();
        let mut peer_of_buffer = Vec::with_capacity(peers.len());
        for &(peer_device, _) in peers {
            if let Entry::Vacant(slot) = pairs.entry(peer_device) {
                let peer = self.remote_process(peer_device, F)?;
                let epoch = pair_epoch(
                    &self.session.epoch,
                    (peer_device, my_device),
                    (peer.process_index, me),
                    incarnations,
                );
                let reach = Reach {
                    same_host: peer.host == local_host,
                    ucx: self.ucx_lanes(),
                    peer_has_ucx: self.session.ucx.contains_key(&peer.process_index),
                };
                slot.insert((peer.process_index, epoch, reach));
            }
            peer_of_buffer.push(pairs[&peer_device].0);
        }
        // `auto` weighs how many large buffers come from each process.
        let mut large_from: HashMap<i32, usize> = HashMap::new();
        for (request, process) in requests.iter().zip(&peer_of_buffer) {
            if request.spec.byte_size >= TCP_BATCH_MIN_BYTES {
                *large_from.entry(*process).or_default() += 1;
            }
        }
        let mut plan = Vec::with_capacity(peers.len());
        let mut indices = BufferIndices::default();
        for (&(peer_device, transfer_key), request) in peers.iter().zip(&requests) {
            let (peer_process, epoch, reach) = &pairs[&peer_device];
            let route = Route::for_buffer(
                self.config.transport,
                *reach,
                request.spec.byte_size,
                large_from.get(peer_process).copied().unwrap_or(0),
            );
            let index = indices.next((peer_device, my_device), transfer_key);
            let key = CompletionKey::new(epoch, transfer_key, index)?;
            let desc_key = key.descriptor_key();
            plan.push((key, desc_key, *peer_process, route));
        }
        let desc_keys: Vec<String> = plan.iter().map(|(_, d, _, _)| d.clone()).collect();
        // A batch past max_receive_bytes is refused before any destination
        // exists, so its senders can be told.
        let keys: Vec<&CompletionKey> = plan.iter().map(|(key, ..)| key).collect();
        let reservations = match self.reserve_batch(&requests, &keys, placement) {
            Ok(reservations) => reservations,
            Err(refused) => {
                self.refuse_senders(&desc_keys, &refused);
                return Err(refused);
            }
        };
        let mut opened = Vec::with_capacity(plan.len());
        let batch = requests.into_iter().zip(plan).zip(reservations);
        for ((request, (key, desc_key, peer_process, route)), reservation) in batch {
            opened.push(self.open_destination(
                request,
                key,
                Some((desc_key, peer_process)),
                route,
                placement,
                reservation,
            ));
        }
        // Every destination open, or none: only then does a sender learn of
        // any. A refused receive tells its senders why at the keys they
        // wait on, instead of leaving them to their send timeout (a key
        // whose receive opened and was cancelled may lose its refusal to
        // that receive's retirement: that sender waits for its timeout).
        let opened = match self.all_or_none(opened) {
            Ok(opened) => opened,
            Err(failure) => {
                self.refuse_senders(&desc_keys, &failure);
                return Err(failure);
            }
        };
        // The first descriptor goes at once, so its sender starts; the rest
        // go out together, one write per sending process.
        let mut destinations = Vec::with_capacity(opened.len());
        let mut together = None;
        for (destination, desc_key) in opened.into_iter().zip(&desc_keys) {
            let receive = destination.receive.clone();
            self.publish_descriptor(desc_key, &destination.descriptor, receive);
            // Armed by the kill tests: this process dies with one
            // descriptor out and the rest not yet published.
            kill_points::reached(kill_points::RECEIVER_AFTER_DESCRIPTOR);
            together.get_or_insert_with(crate::transport::control::cork);
            destinations.push(destination);
        }
        drop(together);
        Ok(destinations)
    }

    /// The whole batch's host memory, reserved before anything is allocated
    /// (or faulted in): one entry per request, `None` for device memory; the
    /// first request past `max_receive_bytes` fails the batch, and the
    /// reservations made before it are given back.
    fn reserve_batch<K: std::borrow::Borrow<CompletionKey>>(
        &self,
        requests: &[ReceiveRequest],
        keys: &[K],
        placement: &DevicePlacement,
    ) -> Result<Vec<Option<BudgetLease>>> {
        requests
            .iter()
            .zip(keys)
            .map(|(request, key)| {
                if !placement.is_host() {
                    return Ok(None);
                }
                let what = format!("receive {}", key.borrow());
                self.receive_budget
                    .reserve(request.spec.byte_size as u64, &what)
                    .map(Some)
            })
            .collect()
    }

    /// Publishes one destination's descriptor, without waiting: a store
    /// that fails to take it fails this buffer (and retires its keys).
    fn publish_descriptor(&self, desc_key: &str, descriptor: &[u8], receive: PendingReceive) {
        let mark_key = crate::sync::timeline::key_hash_if_enabled(receive.key().as_str());
        self.store.set_async(
            desc_key,
            descriptor,
            Box::new(move |published| {
                if let Err(e) = published {
                    let _ = receive.cancel(Status::new(
                        e.code,
                        format!("publishing the descriptor failed: {}", e.message),
                    ));
                }
            }),
        );
        crate::sync::timeline::mark_hash(
            crate::sync::timeline::Point::DescriptorPublished,
            mark_key,
        );
    }

    /// A refusal (`Receipt::Error`, nonce 0) at each descriptor key of a
    /// receive that could not be set up: its senders fail with this
    /// process's reason at once. The sender that reads one deletes it.
    fn refuse_senders(&self, desc_keys: &[String], failure: &Status) {
        let me = self.session.process_index;
        let refusal = Receipt::Error {
            nonce: 0,
            status: Status::new(
                failure.code,
                format!("process {me} refused the receive: {}", failure.message),
            ),
        }
        .encode();
        for key in desc_keys {
            let key_name = key.clone();
            self.store.set_async(
                key,
                &refusal,
                Box::new(move |stored| {
                    if let Err(e) = stored {
                        log::warn!("telling the sender at {key_name} of a refused receive: {e}");
                    }
                }),
            );
        }
    }

    /// All destinations, or the first error after cancelling the ones that
    /// did open (so none waits for a sender until its deadline).
    fn all_or_none(
        &self,
        opened: Vec<Result<ReceiveDestination>>,
    ) -> Result<Vec<ReceiveDestination>> {
        let Some(failure) = opened.iter().find_map(|o| o.as_ref().err()).cloned() else {
            return Ok(opened.into_iter().filter_map(|o| o.ok()).collect());
        };
        for destination in opened.into_iter().flatten() {
            let _ = destination.receive.cancel(Status::new(
                failure.code,
                format!(
                    "another buffer of this receive could not be set up: {}",
                    failure.message
                ),
            ));
        }
        Err(failure)
    }

    fn open_destination(
        self: &Arc<Self>,
        request: ReceiveRequest,
        key: CompletionKey,
        // v2: the descriptor key and the sending process.
        sender: Option<(String, i32)>,
        route: Route,
        placement: &DevicePlacement,
        reservation: Option<BudgetLease>,
    ) -> Result<ReceiveDestination> {
        const F: &str = "receive";
        let ReceiveRequest { spec, record } = request;
        crate::timeline!(
            "receive {key}: opening a {}-byte destination",
            spec.byte_size
        );
        let token = AuthToken::generate()?;
        let nonce = random_u64()?;
        // Through the staging ring, or straight in (staging_path.rs).
        let staged = staging_path::landing(
            !placement.is_host(),
            route,
            self.config.staging.stage_host_transfers,
        ) == staging_path::Landing::Staged;
        let staging = if staged { self.staging.clone() } else { None };
        let staged_chunk = match &staging {
            Some(staging) => u32::try_from(staging.chunk_bytes()).map_err(|_| {
                status::invalid_argument(format!(
                    "{F}: staging_chunk_bytes {} does not fit a descriptor",
                    staging.chunk_bytes()
                ))
            })?,
            None => 0,
        };
        // As over UCX: the receipt may come with the bytes, this process
        // holding the key it sets.
        let completion_key = self
            .config
            .completion_keys_local
            .then(|| key.as_str().to_string());
        let destination = if placement.is_host() {
            let reservation = reservation.ok_or_else(|| {
                status::internal(format!(
                    "receive {key}: a host destination without its memory reservation"
                ))
            })?;
            let host_route = match route {
                Route::SharedMemory => HostRoute::SharedMemory,
                Route::Tcp => {
                    let server = self.tcp_server()?;
                    HostRoute::Network {
                        registry: server.registry(),
                        token,
                        allocation: AllocationHandle::Tcp {
                            endpoint: self.tcp_endpoint(server),
                        },
                        completion_key,
                        // `stage_host_transfers`: landed through the rings.
                        staging,
                    }
                }
                Route::Ucx => HostRoute::Network {
                    registry: self.ucx(F)?.registry(),
                    token,
                    // A staged destination takes chunk messages of at most
                    // its ring's chunk (transport/ucx/stream.rs).
                    allocation: AllocationHandle::Ucx {
                        process: self.session.process_index as u32,
                        staged_chunk,
                    },
                    completion_key,
                    staging,
                },
            };
            Destination::Host(HostDestination::open(
                &self.pool,
                spec.byte_size,
                placement.counters.clone(),
                nonce,
                host_route,
                reservation,
            )?)
        } else {
            // CUDA backend (transfer/cuda_path.rs): same node, device memory
            // exported as a CUDA IPC handle; another node, landed through
            // the pinned staging ring by the network transport.
            let network = match route {
                Route::SharedMemory => None,
                Route::Tcp => {
                    let server = self.tcp_server()?;
                    Some(cuda_path::NetworkRoute {
                        registry: server.registry(),
                        token,
                        allocation: AllocationHandle::Tcp {
                            endpoint: self.tcp_endpoint(server),
                        },
                        completion_key,
                        staging,
                    })
                }
                Route::Ucx => Some(cuda_path::NetworkRoute {
                    registry: self.ucx(F)?.registry(),
                    token,
                    allocation: AllocationHandle::Ucx {
                        process: self.session.process_index as u32,
                        staged_chunk,
                    },
                    completion_key,
                    staging,
                }),
            };
            Destination::Cuda(cuda_path::open_destination(
                placement,
                spec.byte_size,
                network,
                F,
            )?)
        };
        let byte_route = match (&destination, route) {
            (Destination::Cuda(_), Route::SharedMemory) => ByteRoute::CudaIpc,
            _ => route.byte_route(),
        };
        let staged = destination.is_staged();
        let (allocation, offset) = destination.location();
        crate::timeline!("receive {key}: destination ready");
        crate::sync::timeline::mark(crate::sync::timeline::Point::DestinationReady, key.as_str());
        let descriptor = Descriptor {
            host: HostIdentity::local()?,
            process_id: std::process::id(),
            allocation,
            offset,
            byte_size: spec.byte_size as u64,
            element_type: spec.element_type,
            dims: spec.dims.clone(),
            completion_key: key.as_str().to_string(),
            nonce,
            auth_token: token,
        }
        .encode()?;
        let key_name = key.as_str().to_string();
        let mark_key = crate::sync::timeline::key_hash_if_enabled(&key_name);
        let (extra_keys, peer_process) = match sender {
            Some((descriptor_key, peer)) => (vec![descriptor_key], Some(peer)),
            None => (Vec::new(), None),
        };
        let memory = destination.memory();
        let record: Option<RecordOutcome> = record.map(|record| {
            let memory = memory.clone();
            Box::new(move |outcome: &Outcome| record(outcome, &memory)) as RecordOutcome
        });
        // Wait first, publish second: the sender can only act on the
        // descriptor after our AsyncGet is registered.
        let receive = self
            .tracker
            .begin_recording(key, nonce, extra_keys, record)?;
        crate::timeline!("receive {key_name}: AsyncGet registered");
        crate::sync::timeline::mark_hash(crate::sync::timeline::Point::WaitRegistered, mark_key);
        self.pending.lock().insert(
            key_name.clone(),
            PendingEntry {
                receive: receive.clone(),
                peer_process,
            },
        );
        let service = Arc::downgrade(self);
        let byte_size = spec.byte_size as u64;
        let definition = receive.future();
        definition.on_ready(move |outcome| {
            let service = service.upgrade();
            if let Some(service) = &service {
                service.pending.lock().remove(&key_name);
                if outcome.is_ok() {
                    service.metrics.add_bytes_received(byte_size);
                    service.metrics.received_over(byte_route, byte_size);
                    if staged {
                        service.metrics.staged_over(byte_route, byte_size);
                    }
                }
            }
            destination.release(outcome);
        });
        Ok(ReceiveDestination {
            memory,
            definition,
            descriptor,
            receive,
        })
    }

    /// v1 cancellation of one descriptor's buffer.
    pub fn cancel_v1(&self, descriptor: &[u8], reason: Status, function: &str) -> Result<()> {
        let descriptor = Descriptor::decode(descriptor)
            .map_err(|e| status::invalid_argument(format!("{function}: {}", e.message)))?;
        let receive = {
            let pending = self.pending.lock();
            let entry = pending.get(&descriptor.completion_key).ok_or_else(|| {
                status::not_found(format!(
                    "{function}: no pending receive for this descriptor (unknown, already completed or cancelled)"
                ))
            })?;
            if entry.receive.nonce() != descriptor.nonce {
                return Err(status::invalid_argument(format!(
                    "{function}: descriptor nonce does not match the pending receive (stale or forged descriptor)"
                )));
            }
            entry.receive.clone()
        };
        // A receive whose outcome was published an instant ago is still in
        // `pending` until its hop removes it: for the caller it is as gone
        // as one already removed (NOT_FOUND, the v1 contract), not a
        // different answer to the same race.
        receive.cancel(reason).map_err(|e| {
            if e.code == crate::status::Code::FailedPrecondition
                && receive.future().try_get().is_some()
            {
                status::not_found(format!(
                    "{function}: no pending receive for this descriptor ({})",
                    e.message
                ))
            } else {
                e
            }
        })
    }
}
