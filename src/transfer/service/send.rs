//! The send side: a buffer goes to the destination its descriptor names
//! (shared memory, TCP, UCX, CUDA IPC), and only once its bytes are there
//! does the sender set the buffer's completion key (the receipt).
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::{CopyError, SendSource, TransferService, INLINE_COPY_BYTES};
use crate::status::{self, Code, Outcome, Result, Status};
use crate::sync::{kill_points, ByteRoute, Future, PromiseOnce};
use crate::transfer::cuda_path;
use crate::transfer::descriptor::{AllocationHandle, Descriptor, DESCRIPTOR_MAGIC};
use crate::transfer::host_destination::local_region;
use crate::transfer::keys::{descriptor_key, pair_epoch, BufferIndices};
use crate::transfer::receipt::Receipt;
use crate::transfer::staging_path;
use crate::transport::claim::ClaimRange;
use crate::transport::shm::SharedRegion;
use crate::transport::shm_mappings::{
    forget_segment, forget_segments_of, mapped_segment, receiver_gone,
};
use crate::transport::shm_owner::OwnerWatch;
use crate::transport::staging::{CudaCopy, Drain, HostSource, Staging, Stop};
use crate::transport::stream_copy::copy_past_cache;
use crate::transport::tcp::{Payload as TcpPayload, TcpSender};
use crate::transport::ucx::{KeepAlive, Payload, SendBytes, SendDone};

/// From this size a copy into shared memory populates its range first: one
/// madvise costs less than the page faults it saves.
const POPULATE_BEFORE_COPY_BYTES: u64 = 256 << 10;

/// Copies into another process's shared memory of this size up to
/// `STREAM_COPY_MAX` stream past the cache (`transport/stream_copy.rs`):
/// the receiver reads the bytes, not this core. crosshost-bench, three
/// alternating runs each: 64 x 1 MiB 4.4-5.0 -> 5.2-5.6 GB/s, 16 x 16 MiB
/// 4.9-5.1 -> 6.3-6.8 GB/s.
const STREAM_COPY_BYTES: u64 = 256 << 10;

/// From about here glibc's memcpy streams on its own (its threshold is
/// 3/4 of the last-level cache per thread: 41 MiB on the reference
/// machine), with a loop that beats ours (64 MiB: 7.2-7.4 GB/s against
/// 5.8-6.1).
const STREAM_COPY_MAX: u64 = 32 << 20;

impl TransferService {
    /// Sends one buffer to the destination a descriptor names. Errors before
    /// any byte moved (undecodable descriptor) come back at once; everything
    /// later (mismatch, copy failure) through the returned future, and — when
    /// the descriptor named a completion key — to the receiver too.
    pub fn send_to_descriptor(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: &[u8],
        function: &str,
    ) -> Result<Future> {
        let descriptor = Descriptor::decode(descriptor)
            .map_err(|e| status::invalid_argument(format!("{function}: {}", e.message)))?;
        let lease = self.reserve_send(source.spec.byte_size, function)?;
        let (promise, future) = PromiseOnce::new();
        future.on_ready(move |_| drop(lease));
        self.count_failure(&future);
        let deadline = Instant::now() + self.config.send_timeout;
        self.start_send(source, descriptor, promise, function, deadline);
        Ok(future)
    }

    /// A send that ends with an error counts in `sends_failed`: under JAX,
    /// which drops a send's future, the metric is how a program sees them.
    fn count_failure(&self, future: &Future) {
        let metrics = self.metrics.clone();
        future.on_ready(move |outcome| {
            if outcome.is_err() {
                metrics.add_sends_failed(1);
            }
        });
    }

    /// Starts copying `source` to the descriptor's destination; the copy
    /// ends by `deadline`, the send's own (set when the send was called:
    /// waiting for the descriptor, the hop to a sending thread and the copy
    /// all count against one `send_timeout_ms`).
    fn start_send(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        promise: PromiseOnce,
        function: &str,
        deadline: Instant,
    ) {
        let function = function.to_string();
        if let Err(mismatch) = descriptor.validate_against(
            source.spec.byte_size as u64,
            source.spec.element_type,
            &source.spec.dims,
        ) {
            let status = status::invalid_argument(format!("{function}: {}", mismatch.message));
            let receipt = Receipt::Error {
                nonce: descriptor.nonce,
                status: status.clone(),
            };
            promise.set(Err(status));
            self.publish_receipt_best_effort(&descriptor, receipt);
            return;
        }
        let service = self.clone();
        let ready = source.ready.clone();
        if let AllocationHandle::Ucx { process, .. } = descriptor.allocation {
            ready.on_ready(move |defined| match defined {
                Ok(()) => {
                    service.send_over_ucx(source, descriptor, process, promise, function, deadline)
                }
                Err(status) => {
                    let failed = Err(CopyError::Failed(status.clone()));
                    service.finish_send(&source, &descriptor, failed, promise, function)
                }
            });
            return;
        }
        // Small copies into shared memory from memory we read without
        // waiting run where the source became ready: a hop to the copy pool
        // costs more than the copy (measured: ~0.2-0.4 ms on 2 cores).
        let inline = source.spec.byte_size <= INLINE_COPY_BYTES
            && source.memory.reads_without_waiting()
            && matches!(descriptor.allocation, AllocationHandle::SharedMemory { .. });
        let over_tcp = matches!(descriptor.allocation, AllocationHandle::Tcp { .. });
        ready.on_ready(move |defined| {
            let defined = defined.clone();
            let runner = if over_tcp {
                service.tcp_sends()
            } else {
                service.copies.clone()
            };
            let copy = move || {
                crate::timeline!("send to {}: copy starts", descriptor.completion_key);
                crate::sync::timeline::mark(
                    crate::sync::timeline::Point::BytesStart,
                    &descriptor.completion_key,
                );
                kill_points::reached(kill_points::SENDER_AFTER_DESCRIPTOR);
                let copied = match (defined, &descriptor.allocation) {
                    (Ok(()), AllocationHandle::Tcp { endpoint }) => {
                        let endpoint = *endpoint;
                        return service.send_over_tcp(
                            source, descriptor, endpoint, promise, function, deadline,
                        );
                    }
                    (Ok(()), _) => service.copy_into_destination(&source, &descriptor, &function),
                    (Err(status), _) => Err(CopyError::Failed(status)),
                };
                service.finish_send(&source, &descriptor, copied, promise, function);
            };
            if inline {
                copy();
            } else {
                runner.submit(copy);
            }
        });
    }

    /// A descriptor read from a store names a destination of process
    /// `peer`, whatever the store says: its host, its pid, its TCP address
    /// (as far as the session table knows it), its UCX process, the owner
    /// in its shared-memory name. A descriptor that names anything else
    /// (someone who can write the store pointing this send at another
    /// listener or segment) is refused. The session entries hold no port
    /// of the TCP server, so a descriptor naming another port at the
    /// receiver's own address passes here: only `job_secret_file`, which
    /// seals every value, keeps such a descriptor out.
    fn check_destination_process(
        &self,
        descriptor: &Descriptor,
        peer: i32,
        desc_key: &str,
    ) -> Result<()> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        let refuse = |what: String| {
            Err(Status::new(
                Code::PermissionDenied,
                format!(
                    "{F}: the descriptor at {desc_key} names {what}, not a destination of \
                     process {peer} (its session entry says otherwise); refused, nothing was \
                     sent. Someone who can write the job's store wrote it: set \
                     job_secret_file to seal the store's values"
                ),
            ))
        };
        let Some(entry) = self
            .session
            .processes
            .iter()
            .find(|p| p.process_index == peer)
        else {
            return refuse(format!("a process ({peer}) the session does not have"));
        };
        if descriptor.host != entry.host || descriptor.process_id != entry.pid {
            return refuse(format!(
                "host {} pid {}",
                descriptor.host.hostname, descriptor.process_id
            ));
        }
        match &descriptor.allocation {
            // The session entry names the receiver's TCP receive server:
            // bytes go there or nowhere.
            AllocationHandle::Tcp { endpoint } => match (&entry.tcp_data, &entry.control) {
                (Some(server), _) if server != endpoint => {
                    refuse(format!("the TCP endpoint {endpoint}"))
                }
                (None, Some(control)) if control.tcp.ip() != endpoint.ip() => {
                    refuse(format!("the TCP address {endpoint}"))
                }
                _ => Ok(()),
            },
            AllocationHandle::Ucx { process, .. } if *process as i64 != peer as i64 => {
                refuse(format!("the UCX worker of process {process}"))
            }
            AllocationHandle::SharedMemory { name } => {
                match crate::transport::shm::shm_name_owner(name) {
                    Ok(owner) if owner.pid == entry.pid => Ok(()),
                    _ => refuse(format!("the shared-memory object {name}")),
                }
            }
            AllocationHandle::InProcess { .. } => refuse("an allocation of this process".into()),
            _ => Ok(()),
        }
    }

    /// After the bytes went (or did not): the receipt, and the send's
    /// outcome once the store has it. `copied` is the watch of a receiving
    /// process whose shared memory was written, if any.
    fn finish_send(
        &self,
        source: &SendSource,
        descriptor: &Descriptor,
        copied: std::result::Result<Option<Arc<OwnerWatch>>, CopyError>,
        promise: PromiseOnce,
        function: String,
    ) {
        match copied {
            Ok(receiver) => {
                let bytes = source.spec.byte_size as u64;
                self.metrics.add_bytes_sent(bytes);
                self.metrics
                    .sent_over(byte_route_of(&descriptor.allocation), bytes);
                // Bytes first, receipt second: the receiver may read the
                // destination as soon as it observes the key.
                let receipt = Receipt::Ok {
                    nonce: descriptor.nonce,
                };
                let name = match (&receiver, &descriptor.allocation) {
                    (Some(_), AllocationHandle::SharedMemory { name }) => name.clone(),
                    _ => String::new(),
                };
                self.publish_receipt(descriptor, receipt, move |outcome| {
                    // A store nobody reads any more (the framework's, after
                    // the receiver died) takes the receipt too: OK only if
                    // the receiver outlived it.
                    let outcome = match &receiver {
                        Some(receiver) if outcome.is_ok() && receiver.is_gone() => {
                            forget_segments_of(receiver);
                            Err(receiver_gone(&function, &name, receiver))
                        }
                        _ => outcome,
                    };
                    promise.set(outcome);
                });
            }
            Err(CopyError::Failed(status)) => {
                let receipt = Receipt::Error {
                    nonce: descriptor.nonce,
                    status: status.clone(),
                };
                promise.set(Err(status));
                self.publish_receipt_best_effort(descriptor, receipt);
            }
            // Not this sender's destination (another sender took it, or the
            // receive is over): its key is not ours to write.
            Err(CopyError::Refused(status)) => {
                promise.set(Err(status));
            }
        }
    }

    /// Sends the source over UCX to the destination process `process`
    /// offered; the receipt follows the receiver's acknowledgement. Where
    /// either side stages (`staging_path::send_plan`) the bytes go as a
    /// chunked stream, on a thread of the staged sends (`send_ucx_chunked`).
    fn send_over_ucx(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        process: u32,
        promise: PromiseOnce,
        function: String,
        deadline: Instant,
    ) {
        let receiver_chunk = match descriptor.allocation {
            AllocationHandle::Ucx { staged_chunk, .. } => staged_chunk,
            _ => 0,
        };
        let plan = staging_path::send_plan(
            source.memory.as_cuda().is_some(),
            self.config.staging.stage_host_transfers,
            self.staging.is_some(),
            receiver_chunk,
        );
        if plan.chunked && source.spec.byte_size > 0 {
            let service = self.clone();
            self.staged_sends().submit(move || {
                service.send_ucx_chunked(
                    source,
                    descriptor,
                    process,
                    receiver_chunk,
                    plan.stage_source,
                    promise,
                    function,
                    deadline,
                )
            });
            return;
        }
        let prepared = self
            .check_ucx_destination(&descriptor, process, &function)
            .and_then(|()| Payload::of_allocation(&source.memory, source.spec.byte_size));
        let payload = match prepared {
            Ok(payload) => payload,
            Err(status) => {
                let failed = Err(CopyError::Failed(status));
                return self.finish_send(&source, &descriptor, failed, promise, function);
            }
        };
        let ucx = match self.ucx(&function) {
            Ok(ucx) => ucx,
            Err(status) => {
                let failed = Err(CopyError::Failed(status));
                return self.finish_send(&source, &descriptor, failed, promise, function);
            }
        };
        crate::timeline!("send to {}: UCX send starts", descriptor.completion_key);
        crate::sync::timeline::mark(
            crate::sync::timeline::Point::BytesStart,
            &descriptor.completion_key,
        );
        kill_points::reached(kill_points::SENDER_AFTER_DESCRIPTOR);
        // With the key held by the receiver, the receipt goes with the bytes
        // and is applied there once they are in: no second trip.
        let receipt = self.receipt_with_bytes(&descriptor);
        let token = descriptor.auth_token;
        let offset = descriptor.offset;
        let mark_key = crate::sync::timeline::key_hash_if_enabled(&descriptor.completion_key);
        let done = self.ucx_send_done(source, descriptor, promise, function);
        ucx.send(
            process,
            token,
            offset,
            payload,
            receipt,
            left_until(deadline),
            done,
            mark_key,
        );
    }

    /// How a UCX send ends: the receiver's verdict (or a failure) becomes
    /// the send's outcome, with the receipt set here unless the receiver
    /// applied the one that came with the bytes.
    fn ucx_send_done(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        promise: PromiseOnce,
        function: String,
    ) -> SendDone {
        let service = self.clone();
        Box::new(move |outcome| match outcome {
            Ok(delivered) if delivered.receipt_applied => {
                service.delivered_with_receipt(&source, &descriptor, ByteRoute::Ucx, promise)
            }
            Ok(_) => service.finish_send(&source, &descriptor, Ok(None), promise, function),
            // The receiver refused the token: another sender took the
            // destination, or the receive is over.
            Err(e) if e.code == Code::Unauthenticated => service.finish_send(
                &source,
                &descriptor,
                Err(CopyError::Refused(e)),
                promise,
                function,
            ),
            Err(e) => {
                let failed =
                    CopyError::Failed(Status::new(e.code, format!("{function}: {}", e.message)));
                service.finish_send(&source, &descriptor, Err(failed), promise, function)
            }
        })
    }

    /// A UCX send as a chunked stream (`transport/ucx/stream.rs`): through
    /// the send ring where this side stages (`stage_source`: device-to-host
    /// copies, or memcpys, run ahead while earlier chunks are on the wire),
    /// else straight from the source's host memory; each message at most
    /// the receiver's staging chunk (`receiver_chunk`, 0: any size).
    /// Blocks: runs on a thread of the staged sends.
    #[allow(clippy::too_many_arguments)]
    fn send_ucx_chunked(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        process: u32,
        receiver_chunk: u32,
        stage_source: bool,
        promise: PromiseOnce,
        function: String,
        deadline: Instant,
    ) {
        let fail = |status: Status, source: SendSource, descriptor: Descriptor, promise| {
            let failed = Err(CopyError::Failed(status));
            self.finish_send(&source, &descriptor, failed, promise, function.clone())
        };
        if let Err(e) = self.check_ucx_destination(&descriptor, process, &function) {
            return fail(e, source, descriptor, promise);
        }
        let ucx = match self.ucx(&function) {
            Ok(ucx) => ucx,
            Err(e) => return fail(e, source, descriptor, promise),
        };
        let memory = source.memory.clone();
        let len = source.spec.byte_size;
        let staging = if stage_source {
            self.staging.clone()
        } else {
            None
        };
        // Where the chunks are read from while UCX may read them: the send
        // ring, else the source itself (a copy of it where it is not host
        // memory readable in place).
        let (direct, keep): (Option<SendBytes>, KeepAlive) = match &staging {
            Some(staging) => (None, staging.clone()),
            None => match memory.host_pointer() {
                Ok(Some(_)) => (
                    Some(SendBytes::Memory(memory.clone())),
                    Arc::new(memory.clone()),
                ),
                Ok(None) => {
                    let mut copy = vec![0u8; len];
                    if let Err(e) = memory.read(0, &mut copy) {
                        return fail(e, source, descriptor, promise);
                    }
                    let copy = Arc::new(copy);
                    (Some(SendBytes::Copy(copy.clone())), copy)
                }
                Err(e) => return fail(e, source, descriptor, promise),
            },
        };
        crate::timeline!(
            "send to {}: UCX chunked send starts",
            descriptor.completion_key
        );
        crate::sync::timeline::mark(
            crate::sync::timeline::Point::BytesStart,
            &descriptor.completion_key,
        );
        kill_points::reached(kill_points::SENDER_AFTER_DESCRIPTOR);
        let timeout = left_until(deadline);
        let receipt = self.receipt_with_bytes(&descriptor);
        let (token, offset) = (descriptor.auth_token, descriptor.offset);
        let chunk_limit = match receiver_chunk {
            0 => usize::MAX,
            chunk => chunk as usize,
        };
        let done = self.ucx_send_done(source, descriptor, promise, function.clone());
        let Ok(mut stream) = ucx.open_stream(
            process,
            token,
            offset,
            len,
            chunk_limit,
            // A staging receiver pulls each chunk once it has a slot.
            receiver_chunk > 0,
            receipt,
            timeout,
            keep,
            done,
        ) else {
            // Its failure was told to the send already.
            return;
        };
        let sent = match (&staging, direct) {
            (Some(staging), _) => match memory.as_cuda() {
                Some(_) => CudaCopy::new(memory.clone())
                    .and_then(|copier| stream.send_through_ring(staging, &copier, timeout)),
                None => {
                    let mut chunks = 0;
                    memory
                        .read_with(&mut |bytes| {
                            chunks = stream.send_through_ring(
                                staging,
                                &HostSource::new(bytes),
                                timeout,
                            )?;
                            Ok(())
                        })
                        .map(|()| chunks)
                }
            }
            .map(|_| {
                self.metrics.staged_over(ByteRoute::Ucx, len as u64);
            }),
            (None, Some(bytes)) => stream.send_from(bytes, timeout),
            (None, None) => Err(status::internal("a chunked send with nothing to send")),
        };
        if let Err(e) = sent {
            stream.fail(Status::new(e.code, format!("{function}: {}", e.message)));
        }
    }

    /// Sends the source over TCP to the receiver's server at `endpoint`, with
    /// the receipt when the receiver holds the key (it applies it once the
    /// bytes are in); otherwise, or if it did not, the receipt follows the
    /// receiver's acknowledgement through the store.
    fn send_over_tcp(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        endpoint: std::net::SocketAddr,
        promise: PromiseOnce,
        function: String,
        deadline: Instant,
    ) {
        let timeout = left_until(deadline);
        let receipt = self.receipt_with_bytes(&descriptor);
        let mut delivered = None;
        // The connection this send keeps is closed once it is too old to
        // reuse, whether or not another send comes.
        self.sweep_tcp_connections_later();
        let plan = staging_path::send_plan(
            source.memory.as_cuda().is_some(),
            self.config.staging.stage_host_transfers,
            self.staging.is_some(),
            0,
        );
        let staging: Option<&Arc<Staging>> = self.staging.as_ref().filter(|_| plan.stage_source);
        let len = source.spec.byte_size;
        let mut send = |payload: &mut TcpPayload<'_>| -> Result<()> {
            delivered = Some(self.tcp.send_payload(
                endpoint,
                &descriptor.auth_token,
                descriptor.offset,
                payload,
                receipt.as_deref(),
                timeout,
            )?);
            Ok(())
        };
        let sent = match (staging, source.memory.as_cuda()) {
            // A GPU source: device-to-host copies into the send ring run
            // ahead while earlier chunks are on the wire.
            (Some(staging), Some(_)) => CudaCopy::new(source.memory.clone()).and_then(|copier| {
                let mut staged = |wire: &mut Drain<'_>| {
                    staging
                        .send(&copier, 0, len, wire, &Stop::new(), timeout)
                        .map(|_| ())
                };
                send(&mut TcpPayload::Chunks {
                    len,
                    write: &mut staged,
                })
            }),
            _ => source.memory.read_with(&mut |bytes| {
                // `stage_host_transfers`: out through the send ring, chunk
                // by chunk (transport/staging/).
                let mut staged = |wire: &mut Drain<'_>| match staging {
                    Some(staging) => staging
                        .send(
                            &HostSource::new(bytes),
                            0,
                            bytes.len(),
                            wire,
                            &Stop::new(),
                            timeout,
                        )
                        .map(|_| ()),
                    None => wire(bytes),
                };
                let mut payload = match staging {
                    Some(_) => TcpPayload::Chunks {
                        len: bytes.len(),
                        write: &mut staged,
                    },
                    None => TcpPayload::Bytes(bytes),
                };
                send(&mut payload)
            }),
        };
        if sent.is_ok() && staging.is_some() {
            self.metrics.staged_over(ByteRoute::Tcp, len as u64);
        }
        let copied = match (sent, delivered) {
            (Ok(()), Some(delivered)) if delivered.receipt_applied => {
                return self.delivered_with_receipt(&source, &descriptor, ByteRoute::Tcp, promise);
            }
            (Ok(()), _) => Ok(None),
            // The receiver refused the token: another sender took the
            // destination, or the receive is over.
            (Err(e), _) if e.code == Code::Unauthenticated => Err(CopyError::Refused(e)),
            (Err(e), _) => Err(CopyError::Failed(e)),
        };
        self.finish_send(&source, &descriptor, copied, promise, function);
    }

    /// Schedules a sweep of the TCP sender's kept connections, unless one
    /// is scheduled; each sweep schedules the next while some are kept.
    fn sweep_tcp_connections_later(self: &Arc<Self>) {
        if self.tcp_sweep_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let service = Arc::downgrade(self);
        let after = TcpSender::reuse_window() * 2;
        self.timer.schedule_after(after, move || {
            let Some(service) = service.upgrade() else {
                return;
            };
            service.tcp_sweep_scheduled.store(false, Ordering::Release);
            if service.tcp.close_stale(std::time::Instant::now()) > 0 {
                service.sweep_tcp_connections_later();
            }
        });
    }

    /// The receipt to send with the bytes: only where the receiver holds the
    /// completion key (and so can apply it once they are in).
    fn receipt_with_bytes(&self, descriptor: &Descriptor) -> Option<Vec<u8>> {
        self.config.completion_keys_local.then(|| {
            Receipt::Ok {
                nonce: descriptor.nonce,
            }
            .encode()
        })
    }

    /// The receiver applied the receipt that came with the bytes: the send
    /// is done, with nothing left to set.
    fn delivered_with_receipt(
        &self,
        source: &SendSource,
        descriptor: &Descriptor,
        route: ByteRoute,
        promise: PromiseOnce,
    ) {
        let bytes = source.spec.byte_size as u64;
        self.metrics.add_bytes_sent(bytes);
        self.metrics.sent_over(route, bytes);
        crate::timeline!(
            "send to {}: delivered with its receipt",
            descriptor.completion_key
        );
        crate::sync::timeline::mark(
            crate::sync::timeline::Point::BytesAcked,
            &descriptor.completion_key,
        );
        kill_points::reached(kill_points::SENDER_AFTER_RECEIPT);
        promise.set(Ok(()));
    }

    /// The receiver's refusal, when its descriptor key holds one
    /// (`receive.rs::refuse_senders`): the send fails with the receiver's
    /// reason and code, and the key, read, is deleted.
    fn refused(&self, value: &[u8], desc_key: &str, peer: i32) -> Result<()> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        if value.starts_with(&DESCRIPTOR_MAGIC) {
            return Ok(());
        }
        let Ok(Receipt::Error { status, .. }) = Receipt::decode(value) else {
            return Ok(());
        };
        let key = desc_key.to_string();
        self.store.delete_async(
            desc_key,
            Box::new(move |deleted| {
                if let Err(e) = deleted {
                    log::debug!("deleting the refusal at {key}: {e}");
                }
            }),
        );
        Err(Status::new(
            status.code,
            format!(
                "{F}: the receiving process {peer} did not take this transfer ({desc_key}): {}",
                status.message
            ),
        ))
    }

    /// A UCX descriptor must name the process that wrote it: the session's
    /// process `process` must be the descriptor's host and pid.
    fn check_ucx_destination(
        &self,
        descriptor: &Descriptor,
        process: u32,
        function: &str,
    ) -> Result<()> {
        let entry = self
            .session
            .processes
            .iter()
            .find(|p| p.process_index as u32 == process)
            .ok_or_else(|| {
                status::invalid_argument(format!(
                    "{function}: the descriptor offers a UCX destination of process {process}, which is not in this job"
                ))
            })?;
        if entry.pid != descriptor.process_id || entry.host != descriptor.host {
            return Err(status::invalid_argument(format!(
                "{function}: the descriptor says it is process {process}'s (pid {} on {}), but this job's process \
                 {process} is pid {} on {}",
                descriptor.process_id, descriptor.host.hostname, entry.pid, entry.host.hostname
            )));
        }
        Ok(())
    }

    /// Tells the receiver that a send failed, after the send's own outcome
    /// is set: a failure is the sender's outcome when it happens (at its
    /// deadline, say), not once a store behind a cut link has the receipt.
    /// The receiver fails anyway at its own deadline without it.
    fn publish_receipt_best_effort(&self, descriptor: &Descriptor, receipt: Receipt) {
        // publish_receipt logs a receipt that could not be set.
        self.publish_receipt(descriptor, receipt, |_| {});
    }

    /// Sets the completion key; `done` gets the outcome once the store has
    /// it (without blocking this thread where the store can avoid it).
    fn publish_receipt(
        &self,
        descriptor: &Descriptor,
        receipt: Receipt,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) {
        crate::timeline!(
            "send to {}: copied, setting the receipt",
            descriptor.completion_key
        );
        let key = descriptor.completion_key.clone();
        self.store.set_async(
            &descriptor.completion_key,
            &receipt.encode(),
            Box::new(move |outcome| {
                if outcome.is_ok() {
                    crate::sync::timeline::mark(crate::sync::timeline::Point::ReceiptSet, &key);
                    kill_points::reached(kill_points::SENDER_AFTER_RECEIPT);
                }
                done(outcome.map_err(|e| {
                    log::error!("setting completion key {key}: {e}");
                    Status::new(
                        e.code,
                        format!("setting the completion key failed: {}", e.message),
                    )
                }))
            }),
        );
    }

    /// Writes the source into the destination. For another process's shared
    /// memory, returns the watch of that receiving process, which was alive
    /// after the write.
    /// Takes the destination's exact range (single use) before writing a
    /// byte, then writes the source into it and nothing outside it.
    fn claim_and_fill(
        &self,
        region: &SharedRegion,
        source: &SendSource,
        descriptor: &Descriptor,
        function: &str,
    ) -> std::result::Result<(), CopyError> {
        let claim = ClaimRange {
            nonce: descriptor.nonce,
            offset: descriptor.offset,
            len: descriptor.byte_size,
        };
        region
            .claim_slot(descriptor.offset)?
            .claim(&claim)
            .map_err(|e| {
                CopyError::Refused(Status::new(e.code, format!("{function}: {}", e.message)))
            })?;
        let len = source.spec.byte_size as u64;
        claim.check_write(descriptor.offset, len)?;
        // Straight into the mapping: a host source is one memcpy, a compute
        // plugin's buffer is read back into it directly.
        let offset = descriptor.offset as usize;
        // The sender maps a receiver's segment lazily: a large destination
        // is faulted in at once, not page by page during the copy.
        if len >= POPULATE_BEFORE_COPY_BYTES {
            region.populate(offset, len as usize)?;
        }
        if kill_points::armed(kill_points::SENDER_MID_COPY) && len > 1 {
            // Half the bytes in, then the test kills this process.
            let half = len as usize / 2;
            region.fill_at(offset, half, |dst| source.memory.read(0, dst))?;
            kill_points::reached(kill_points::SENDER_MID_COPY);
        }
        let lent_whole =
            source.memory.len() as u64 == len && source.memory.host_pointer()?.is_some();
        if (STREAM_COPY_BYTES..STREAM_COPY_MAX).contains(&len) && lent_whole {
            // Host bytes readable in place (read_with lends them, no
            // staging copy).
            region.fill_at(offset, len as usize, |dst| {
                source
                    .memory
                    .read_with(&mut |src| copy_past_cache(dst, src))
            })?;
        } else {
            region.fill_at(offset, len as usize, |dst| source.memory.read(0, dst))?;
        }
        Ok(())
    }

    fn copy_into_destination(
        &self,
        source: &SendSource,
        descriptor: &Descriptor,
        function: &str,
    ) -> std::result::Result<Option<Arc<OwnerWatch>>, CopyError> {
        match &descriptor.allocation {
            AllocationHandle::SharedMemory { name } => {
                if !descriptor.host.is_local()? {
                    return Err(CopyError::Failed(status::failed_precondition(format!(
                        "{function}: the destination is shared memory on host {}; this sender is on another \
                         host (create the receiving client with transport=tcp)",
                        descriptor.host.hostname
                    ))));
                }
                // Another process's memory: also the watch of that process
                // (a receiver that is gone gets no bytes and no receipt).
                let (region, receiver) = match local_region(name) {
                    Some(region) => (region, None),
                    None => {
                        let (region, receiver) = mapped_segment(
                            name,
                            descriptor.offset + descriptor.byte_size,
                            function,
                        )
                        .map_err(CopyError::Refused)?;
                        (region, Some(receiver))
                    }
                };
                descriptor.check_fits_in(region.len() as u64)?;
                // Another process of the user may truncate the segment under
                // our mapping: that fails this copy, never the process.
                let copied =
                    region.guarded(|| self.claim_and_fill(&region, source, descriptor, function));
                match copied {
                    Ok(filled) => filled?,
                    Err(shrank) => {
                        forget_segment(name);
                        return Err(CopyError::Failed(shrank.status(&format!(
                            "{function}: the receiver's shared-memory segment {name}"
                        ))));
                    }
                }
                if let Some(receiver) = &receiver {
                    if receiver.is_gone() {
                        forget_segments_of(receiver);
                        return Err(CopyError::Refused(receiver_gone(function, name, receiver)));
                    }
                }
                Ok(receiver)
            }
            // Sent by `send_over_tcp` and `send_over_ucx`, never copied here.
            AllocationHandle::Tcp { .. } | AllocationHandle::Ucx { .. } => {
                Err(CopyError::Failed(status::internal(format!(
                    "{function}: a network destination reached the copy path"
                ))))
            }
            // CUDA backend: same-node GPU destinations (CUDA IPC).
            AllocationHandle::CudaIpc { .. } => {
                cuda_path::copy_to_destination(&source.memory, descriptor, function)?;
                Ok(None)
            }
            AllocationHandle::InProcess { .. } => {
                Err(CopyError::Failed(status::unimplemented(format!(
                    "{function}: destination transport {:?} is not offered by this plugin",
                    descriptor.transport_kind()
                ))))
            }
        }
    }

    /// v2: each buffer waits for its destination's descriptor under the
    /// pair's descriptor key, then goes out through `start_send`.
    pub fn send_v2(
        self: &Arc<Self>,
        sources: Vec<SendSource>,
        destinations: &[i32],
        transfer_keys: &[i64],
        incarnations: Option<&[(i32, i64)]>,
    ) -> Result<Vec<Future>> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        crate::timeline!("send_v2 of {} buffers", sources.len());
        if let Some(snapshot) = incarnations {
            self.observe_incarnations(snapshot);
        }
        let me = self.session.process_index;
        // Check every buffer before starting any, so a bad argument leaves
        // nothing half-sent.
        // A batch names few device pairs: each one's receiving process and
        // epoch are worked out once.
        let mut plan = Vec::with_capacity(sources.len());
        let mut pairs: HashMap<(i32, i32), (i32, String)> = HashMap::new();
        let mut indices = BufferIndices::default();
        for (source, (&dst, &key)) in sources.iter().zip(destinations.iter().zip(transfer_keys)) {
            let (peer, epoch) = match pairs.entry((source.global_device_id, dst)) {
                Entry::Occupied(known) => known.into_mut(),
                Entry::Vacant(slot) => {
                    let peer = self.remote_process(dst, F)?;
                    let epoch = pair_epoch(
                        &self.session.epoch,
                        (source.global_device_id, dst),
                        (me, peer.process_index),
                        incarnations,
                    );
                    slot.insert((peer.process_index, epoch))
                }
            };
            let index = indices.next((source.global_device_id, dst), key);
            plan.push((descriptor_key(epoch, key, index)?, *peer));
        }
        // A receiver known to be gone gets no new sends (unless it answers
        // again): each would wait its full timeout for a descriptor. Its
        // buffers fail at once, each through its own event.
        let mut gone: HashMap<i32, Status> = HashMap::new();
        let mut alive = HashSet::new();
        for (_, peer) in &plan {
            if !gone.contains_key(peer) && !alive.contains(peer) {
                match self.check_receiver_alive(*peer, F) {
                    Err(e) => {
                        gone.insert(*peer, e);
                    }
                    Ok(()) => {
                        alive.insert(*peer);
                    }
                }
            }
        }
        // Each send holds its bytes until delivered: past the bound a send
        // fails at once rather than queueing behind a receiver that stopped.
        // Sends whose descriptors are here already copy and set their
        // receipts on this thread: the receipts go out together.
        let together = crate::transport::control::cork();
        let mut futures = Vec::with_capacity(plan.len());
        for ((source, (desc_key, peer)), dst) in sources.into_iter().zip(plan).zip(destinations) {
            if let Some(e) = gone.get(&peer) {
                futures.push(Future::ready(Err(e.clone())));
                continue;
            }
            let what = format!("{F}: the send to device {dst} (process {peer})");
            match self.reserve_send(source.spec.byte_size, &what) {
                Ok(lease) => {
                    let future = self.send_when_described(source, desc_key, peer);
                    future.on_ready(move |_| drop(lease));
                    futures.push(future);
                }
                Err(e) => futures.push(Future::ready(Err(e))),
            }
        }
        drop(together);
        // The sends wait for these receivers' descriptors: their death must
        // show, through a link to each. Asked once the waits are registered,
        // so that a receiver found dead fails them.
        for peer in alive {
            self.watch(peer);
        }
        for future in &futures {
            self.count_failure(future);
        }
        Ok(futures)
    }

    fn send_when_described(
        self: &Arc<Self>,
        source: SendSource,
        desc_key: String,
        peer: i32,
    ) -> Future {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        let deadline = Instant::now() + self.config.send_timeout;
        let (promise, future) = PromiseOnce::new();
        let slot = Arc::new(Mutex::new(Some(source)));
        let service = self.clone();
        let on_descriptor = {
            let promise = promise.clone();
            let slot = slot.clone();
            let desc_key = desc_key.clone();
            move |value: Result<Vec<u8>>| {
                crate::timeline!("send: descriptor {desc_key} arrived");
                let Some(source) = slot.lock().take() else {
                    return;
                };
                let started = value
                    .and_then(|bytes| {
                        service.refused(&bytes, &desc_key, peer)?;
                        Descriptor::decode(&bytes).map_err(|e| {
                            status::invalid_argument(format!(
                                "{F}: descriptor at {desc_key}: {}",
                                e.message
                            ))
                        })
                    })
                    .and_then(|descriptor| {
                        service.check_destination_process(&descriptor, peer, &desc_key)?;
                        Ok(descriptor)
                    });
                match started {
                    Ok(descriptor) => {
                        crate::sync::timeline::mark(
                            crate::sync::timeline::Point::DescriptorArrived,
                            &descriptor.completion_key,
                        );
                        service.start_send(source, descriptor, promise, F, deadline)
                    }
                    Err(status) => {
                        promise.set(Err(status));
                    }
                }
            }
        };
        let waiter = match self
            .store
            .async_get(&desc_key, None, Box::new(on_descriptor))
        {
            Ok(id) => id,
            Err(e) => {
                promise.set(Err(Status::new(
                    e.code,
                    format!("{F}: waiting for the descriptor: {}", e.message),
                )));
                return future;
            }
        };
        // Ended, once, by its descriptor, its deadline, or its receiver's
        // loss, whichever comes first.
        let end_wait: Arc<dyn Fn(Status) + Send + Sync> = {
            let store = self.store.clone();
            let desc_key = desc_key.clone();
            Arc::new(move |reason: Status| {
                if slot.lock().take().is_some() {
                    store.cancel_async_get(&desc_key, waiter);
                    promise.set(Err(reason));
                }
            })
        };
        let timeout = self.config.send_timeout;
        let on_deadline = end_wait.clone();
        let key = desc_key.clone();
        let timer_id = self.timer.schedule_after(timeout, move || {
            on_deadline(status::deadline_exceeded(format!(
                "{F}: the receiver's descriptor ({key}) did not arrive within {timeout:?} (is \
                 the receiving process calling CrossHostReceiveBuffers for this transfer key? \
                 JAX sends uncommitted arrays only when they are committed to a device)"
            )));
        });
        let wait_id = self.described_waits.register(peer, end_wait);
        let service = Arc::downgrade(self);
        future.on_ready(move |_| {
            if let Some(service) = service.upgrade() {
                service.timer.cancel(timer_id);
                service.described_waits.remove(wait_id);
            }
        });
        future
    }
}

/// The transport a descriptor's destination is reached by.
fn byte_route_of(allocation: &AllocationHandle) -> ByteRoute {
    match allocation {
        AllocationHandle::SharedMemory { .. } | AllocationHandle::InProcess { .. } => {
            ByteRoute::SharedMemory
        }
        AllocationHandle::Tcp { .. } => ByteRoute::Tcp,
        AllocationHandle::Ucx { .. } => ByteRoute::Ucx,
        AllocationHandle::CudaIpc { .. } => ByteRoute::CudaIpc,
    }
}

/// What is left of a send's time at `deadline` (nothing once it passed).
fn left_until(deadline: Instant) -> std::time::Duration {
    deadline.saturating_duration_since(Instant::now())
}
