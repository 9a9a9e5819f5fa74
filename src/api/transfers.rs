//! Cross-host transfers on the client: wraps the protocol's destinations and
//! send futures into buffers and events.
use std::sync::Arc;

use super::buffer::Buffer;
use super::client::Client;
use super::device::Device;
use super::element_type::{ElementType, Shape};
use crate::backend::{Allocation, DevicePlacement};
use crate::compute_plugin::{
    buffer_dims, buffer_element_type, watch_receive, ComputeClient, ComputeReceive, HeldSource,
    InnerBuffer, InnerPtr, ReceiveWatch,
};
use crate::status::{internal, invalid_argument, Outcome, Result, Status};
use crate::sync::Future;
use crate::transfer::service::{
    BufferSpec, ReceiveDestination, ReceiveRequest, RecordOutcomeWithBytes, SendSource,
};
use parking_lot::Mutex;

/// A buffer a transfer reads: the embedded backend's, or a compute plugin's
/// (the caller's handle of a delegating client's buffer).
pub enum SourceBuffer {
    Embedded(Arc<Buffer>),
    Compute(InnerPtr),
}

/// A buffer a receive made: the embedded backend's, or the compute plugin's
/// alias buffer (ours until handed to the caller).
pub enum ReceivedBuffer {
    Embedded(Arc<Buffer>),
    Compute(InnerBuffer),
}

impl ReceivedBuffer {
    /// The embedded backend's buffer, if it is one.
    pub fn into_embedded(self) -> Option<Arc<Buffer>> {
        match self {
            ReceivedBuffer::Embedded(buffer) => Some(buffer),
            ReceivedBuffer::Compute(_) => None,
        }
    }
}

impl From<Arc<Buffer>> for SourceBuffer {
    fn from(buffer: Arc<Buffer>) -> SourceBuffer {
        SourceBuffer::Embedded(buffer)
    }
}

/// One buffer of a v2 receive.
pub struct ReceiveSpec {
    pub shape: Shape,
    pub peer_global_device_id: i32,
    pub transfer_key: i64,
}

/// One process as the framework reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessReport {
    pub task: i32,
    pub incarnation: i64,
    /// Disconnected or in error.
    pub lost: bool,
}

/// The caller's snapshot of alive tasks and their incarnations (v8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIncarnations(pub Vec<(i32, i64)>);

impl PeerIncarnations {
    /// Duplicated task ids keep their first incarnation, as upstream does.
    pub fn from_snapshot(tasks: &[i32], incarnations: &[i64]) -> PeerIncarnations {
        let mut out: Vec<(i32, i64)> = Vec::with_capacity(tasks.len());
        for (&task, &incarnation) in tasks.iter().zip(incarnations) {
            if !out.iter().any(|(t, _)| *t == task) {
                out.push((task, incarnation));
            }
        }
        PeerIncarnations(out)
    }
}

fn spec_of(shape: &Shape) -> BufferSpec {
    BufferSpec {
        byte_size: shape.byte_size(),
        element_type: shape.element_type.raw(),
        dims: shape.dims.clone(),
    }
}

impl Client {
    fn own_addressable_device(&self, device: &Arc<Device>, function: &str) -> Result<()> {
        let ours = self.device_by_global_id(device.global_id, function)?;
        if !Arc::ptr_eq(ours, device) {
            return Err(invalid_argument(format!(
                "{function}: device {} belongs to another client",
                device.global_id
            )));
        }
        if !device.addressable {
            return Err(invalid_argument(format!(
                "{function}: device {} is not addressable by this process",
                device.global_id
            )));
        }
        Ok(())
    }

    fn placement(&self, device: &Device, function: &str) -> Result<DevicePlacement> {
        device.placement().ok_or_else(|| {
            invalid_argument(format!(
                "{function}: device {} is not addressable by this process",
                device.global_id
            ))
        })
    }

    /// Receive requests for `shapes` on `device`. On a delegating client
    /// each request records its outcome into an `AliasSlot`: the compute
    /// plugin's alias buffer the caller will hold is made after the
    /// destinations are open and their descriptors are out (`attach_aliases`),
    /// so that the senders start while it is made.
    fn receive_requests(
        &self,
        device: &Arc<Device>,
        shapes: &[Shape],
    ) -> (Vec<ReceiveRequest>, Option<Vec<Arc<AliasSlot>>>) {
        if self.compute().is_none() || device.compute.is_none() {
            return (shapes.iter().map(|s| spec_of(s).into()).collect(), None);
        }
        let slots: Vec<Arc<AliasSlot>> = shapes
            .iter()
            .map(|_| Arc::new(AliasSlot::default()))
            .collect();
        let requests = shapes
            .iter()
            .zip(&slots)
            .map(|(shape, slot)| {
                let slot = slot.clone();
                let record: RecordOutcomeWithBytes =
                    Box::new(move |outcome: &Outcome, bytes: &Allocation| {
                        slot.record(outcome, bytes)
                    });
                ReceiveRequest {
                    spec: spec_of(shape),
                    record: Some(record),
                }
            })
            .collect();
        (requests, Some(slots))
    }

    /// The alias buffers of a delegating client's receive, one per slot,
    /// each with its view of the destination made ahead of the bytes, and
    /// each attached to its slot (fulfilled at once if its receive already
    /// ended). If one cannot be made, every receive of the call is
    /// cancelled with that error, and the call fails with it.
    fn attach_aliases(
        &self,
        device: &Arc<Device>,
        shapes: &[Shape],
        slots: Option<Vec<Arc<AliasSlot>>>,
        destinations: &[ReceiveDestination],
    ) -> Result<Vec<Option<InnerBuffer>>> {
        let Some(slots) = slots else {
            return Ok(shapes.iter().map(|_| None).collect());
        };
        let made = self.make_aliases(device, shapes, &slots, destinations);
        if let Err(e) = &made {
            for destination in destinations {
                let _ = destination.receive.cancel(Status::new(
                    e.code,
                    format!("the receive's buffer could not be made: {}", e.message),
                ));
            }
        }
        made
    }

    fn make_aliases(
        &self,
        device: &Arc<Device>,
        shapes: &[Shape],
        slots: &[Arc<AliasSlot>],
        destinations: &[ReceiveDestination],
    ) -> Result<Vec<Option<InnerBuffer>>> {
        let compute = self
            .compute()
            .ok_or_else(|| internal("a delegating receive without its compute plugin"))?;
        let memory = device
            .memory
            .compute
            .as_ref()
            .ok_or_else(|| internal("a delegating client's device has no compute memory"))?;
        let mut handles = Vec::with_capacity(shapes.len());
        for ((shape, slot), destination) in shapes.iter().zip(slots).zip(destinations) {
            let mut alias = ComputeReceive::create(
                compute,
                memory,
                shape.element_type.raw(),
                &shape.dims,
                shape.element_type.is_sub_byte(),
            )?;
            let bytes = &destination.memory;
            alias.prepare_view(bytes.address(), Box::new(bytes.clone()));
            let handle = alias.take_handle();
            // Entered before the caller sees the handle: until the receive
            // succeeded, reading its memory waits, or fails with its status.
            let watch = handle.as_ref().map(|h| watch_receive(h.raw()));
            handles.push(handle);
            slot.attach(AliasTarget {
                alias,
                watch,
                byte_size: shape.byte_size(),
            });
        }
        Ok(handles)
    }

    /// v2 receive: one buffer per spec on `device`, each ready when its own
    /// sender's bytes landed.
    pub fn cross_host_receive(
        &self,
        device: &Arc<Device>,
        specs: Vec<ReceiveSpec>,
        incarnations: Option<PeerIncarnations>,
        function: &str,
    ) -> Result<Vec<ReceivedBuffer>> {
        crate::timeline!("{function}: {} buffers requested", specs.len());
        crate::sync::timeline::mark_call(crate::sync::timeline::Point::ReceiveCall);
        self.own_addressable_device(device, function)?;
        let shapes: Vec<Shape> = specs.iter().map(|s| s.shape.clone()).collect();
        let peers: Vec<(i32, i64)> = specs
            .iter()
            .map(|s| (s.peer_global_device_id, s.transfer_key))
            .collect();
        let placement = self.placement(device, function)?;
        let (requests, slots) = self.receive_requests(device, &shapes);
        let destinations = self.transfers().receive_v2(
            requests,
            device.global_id,
            &peers,
            incarnations.as_ref().map(|p| p.0.as_slice()),
            &placement,
        )?;
        let handles = self.attach_aliases(device, &shapes, slots, &destinations)?;
        crate::sync::timeline::mark_call(crate::sync::timeline::Point::AliasesMade);
        let received = received(device, shapes, destinations, handles).0;
        crate::timeline!("{function}: returning {} buffers", received.len());
        crate::sync::timeline::mark_call(crate::sync::timeline::Point::ReceiveReturn);
        Ok(received)
    }

    /// The transfer's view of a buffer to send: its bytes, readiness, shape
    /// and device. A compute plugin's buffer is held until its send is done,
    /// so the caller may destroy its handle as soon as the send call returns.
    fn send_source(&self, buffer: SourceBuffer, function: &str) -> Result<SendSource> {
        match buffer {
            SourceBuffer::Embedded(buffer) => {
                self.own_addressable_device(buffer.device(), function)?;
                Ok(SendSource {
                    memory: buffer.allocation(function)?,
                    ready: buffer.definition(),
                    spec: spec_of(buffer.shape()),
                    global_device_id: buffer.device().global_id,
                })
            }
            SourceBuffer::Compute(raw) => {
                let compute = self.compute().ok_or_else(|| {
                    invalid_argument(format!(
                        "{function}: the buffer belongs to a compute plugin, this client has none"
                    ))
                })?;
                compute_source(self, compute, raw, function)
            }
        }
    }

    /// v2 send: one event per buffer, ready when that buffer's bytes are in
    /// the receiver's memory and its completion key is set.
    pub fn cross_host_send(
        &self,
        buffers: Vec<SourceBuffer>,
        destinations: &[i32],
        transfer_keys: &[i64],
        incarnations: Option<PeerIncarnations>,
        function: &str,
    ) -> Result<Vec<Future>> {
        crate::timeline!("{function}: {} buffers to send", buffers.len());
        crate::sync::timeline::mark_call(crate::sync::timeline::Point::SendCall);
        let mut sources = Vec::with_capacity(buffers.len());
        for buffer in buffers {
            sources.push(self.send_source(buffer, function)?);
        }
        self.transfers().send_v2(
            sources,
            destinations,
            transfer_keys,
            incarnations.as_ref().map(|p| p.0.as_slice()),
        )
    }

    /// v1 receive: the buffers and their serialized descriptors.
    pub fn make_receive_buffers(
        &self,
        device: &Arc<Device>,
        shapes: Vec<Shape>,
        function: &str,
    ) -> Result<(Vec<ReceivedBuffer>, Vec<Vec<u8>>)> {
        self.own_addressable_device(device, function)?;
        let placement = self.placement(device, function)?;
        let (requests, slots) = self.receive_requests(device, &shapes);
        let destinations = self.transfers().receive_v1(requests, &placement)?;
        let handles = self.attach_aliases(device, &shapes, slots, &destinations)?;
        Ok(received(device, shapes, destinations, handles))
    }

    /// v1 cancel of the buffer a descriptor names.
    pub fn cancel_receive(&self, descriptor: &[u8], reason: Status, function: &str) -> Result<()> {
        self.transfers().cancel_v1(descriptor, reason, function)
    }

    /// v1 send of `buffer` to a descriptor's destination.
    pub fn send_to_descriptor(
        &self,
        buffer: SourceBuffer,
        descriptor: &[u8],
        function: &str,
    ) -> Result<Future> {
        let source = self.send_source(buffer, function)?;
        self.transfers()
            .send_to_descriptor(source, descriptor, function)
    }

    /// The framework's report on the job's processes
    /// (`PJRT_Client_UpdateGlobalProcessInfo`): a changed incarnation or a
    /// lost process fails the receives waiting on it now, not at the
    /// deadline.
    pub fn observe_processes(&self, reports: &[ProcessReport]) {
        let snapshot: Vec<(i32, i64)> = reports.iter().map(|r| (r.task, r.incarnation)).collect();
        self.transfers().observe_incarnations(&snapshot);
        for r in reports.iter().filter(|r| r.lost) {
            let failed = self.transfers().fail_receives_from(
                r.task,
                crate::status::unavailable(format!(
                    "peer task {} was reported disconnected or failed before the transfer completed",
                    r.task
                )),
            );
            if failed > 0 {
                log::warn!("peer task {} lost; failed {failed} receives", r.task);
            }
        }
    }

    /// `future`, or DEADLINE_EXCEEDED once the client's send timeout passed.
    pub fn bounded_by_send_timeout(&self, future: Future, what: &str) -> Future {
        self.transfers().bounded_by_send_timeout(future, what)
    }

    /// The transfer metrics as a JSON object.
    pub fn metrics_json(&self) -> String {
        self.transfers().metrics_json()
    }
}

/// The caller's buffers of a receive, and the descriptors.
fn received(
    device: &Arc<Device>,
    shapes: Vec<Shape>,
    destinations: Vec<ReceiveDestination>,
    handles: Vec<Option<InnerBuffer>>,
) -> (Vec<ReceivedBuffer>, Vec<Vec<u8>>) {
    let mut buffers = Vec::with_capacity(shapes.len());
    let mut descriptors = Vec::with_capacity(shapes.len());
    for ((shape, d), handle) in shapes.into_iter().zip(destinations).zip(handles) {
        buffers.push(match handle {
            Some(alias) => ReceivedBuffer::Compute(alias),
            None => {
                ReceivedBuffer::Embedded(Buffer::new(shape, device.clone(), d.memory, d.definition))
            }
        });
        descriptors.push(d.descriptor);
    }
    (buffers, descriptors)
}

/// A send source for a compute plugin's buffer `raw` of `client`.
fn compute_source(
    client: &Client,
    compute: &Arc<ComputeClient>,
    raw: InnerPtr,
    function: &str,
) -> Result<SendSource> {
    let buffer = raw.as_mut();
    let plugin = compute.plugin();
    let inner_device = compute.buffer_device(buffer)?;
    let device = client.device_of_compute(inner_device).ok_or_else(|| {
        invalid_argument(format!(
            "{function}: the buffer is on a device this client does not address"
        ))
    })?;
    let element_type = ElementType::from_raw(buffer_element_type(plugin, buffer)?, function)?;
    let shape = Shape::new(element_type, buffer_dims(plugin, buffer)?, function)?;
    let held = HeldSource::new(
        compute,
        buffer,
        shape.byte_size(),
        shape.element_type.is_sub_byte(),
    );
    let ready = held.ready();
    Ok(SendSource {
        memory: Arc::new(held),
        ready,
        spec: spec_of(&shape),
        global_device_id: device.global_id,
    })
}

/// A delegating receive's alias buffer, what settles it, and its size.
struct AliasTarget {
    alias: ComputeReceive,
    watch: Option<ReceiveWatch>,
    byte_size: usize,
}

/// What the receive's outcome does to what the caller holds, once both exist.
trait Settle {
    fn settle(self, outcome: &Outcome, bytes: &Allocation);
}

impl Settle for AliasTarget {
    /// Fulfils the alias with the received bytes, or fails it with the
    /// receive's error; the watch settles with both.
    fn settle(self, outcome: &Outcome, bytes: &Allocation) {
        let fulfilled = match outcome {
            Ok(()) => self.alias.fulfill_with_host_bytes(
                bytes.address(),
                self.byte_size,
                Box::new(bytes.clone()),
            ),
            Err(status) => self.alias.fail(status),
        };
        if let Err(e) = &fulfilled {
            log::error!("recording a received buffer in the compute plugin: {e}");
        }
        if let Some(watch) = self.watch {
            watch.settle(&outcome.clone().and(fulfilled));
        }
    }
}

/// Where a delegating receive's outcome meets its alias buffer, whichever
/// comes first: the receive's record step (on the lifecycle runner) or the
/// receive call attaching the alias it made after the descriptors went out.
/// The second of the two settles the alias, once, outside the lock.
struct AliasSlot<T = AliasTarget>(Mutex<AliasState<T>>);

enum AliasState<T> {
    Empty,
    Attached(T),
    Ended(Outcome, Allocation),
    Settled,
}

impl<T> Default for AliasSlot<T> {
    fn default() -> AliasSlot<T> {
        AliasSlot(Mutex::new(AliasState::Empty))
    }
}

impl<T: Settle> AliasSlot<T> {
    fn record(&self, outcome: &Outcome, bytes: &Allocation) {
        let mut state = self.0.lock();
        match std::mem::replace(&mut *state, AliasState::Settled) {
            AliasState::Attached(target) => {
                drop(state);
                target.settle(outcome, bytes);
            }
            AliasState::Empty => *state = AliasState::Ended(outcome.clone(), bytes.clone()),
            other => *state = other,
        }
    }

    fn attach(&self, target: T) {
        let mut state = self.0.lock();
        match std::mem::replace(&mut *state, AliasState::Settled) {
            AliasState::Ended(outcome, bytes) => {
                drop(state);
                target.settle(&outcome, &bytes);
            }
            AliasState::Empty => *state = AliasState::Attached(target),
            other => *state = other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::backend::{host::HostBackend, Backend, MemoryCounters};
    use crate::status::cancelled;

    /// How often a probe was settled, and with what last.
    type Seen = Arc<(AtomicUsize, Mutex<Option<Outcome>>)>;

    /// Counts its settlements and remembers the last outcome.
    struct Probe(Seen);

    impl Settle for Probe {
        fn settle(self, outcome: &Outcome, _bytes: &Allocation) {
            self.0 .0.fetch_add(1, Ordering::SeqCst);
            *self.0 .1.lock() = Some(outcome.clone());
        }
    }

    fn probe() -> (Probe, Seen) {
        let seen = Arc::new((AtomicUsize::new(0), Mutex::new(None)));
        (Probe(seen.clone()), seen)
    }

    fn bytes() -> Allocation {
        HostBackend::new(1)
            .allocate(0, 16, Arc::new(MemoryCounters::default()))
            .unwrap()
    }

    #[test]
    fn an_outcome_before_the_alias_settles_it_when_it_is_attached_once() {
        let slot = AliasSlot::<Probe>::default();
        slot.record(&Err(cancelled("gone")), &bytes());
        let (target, seen) = probe();
        assert_eq!(seen.0.load(Ordering::SeqCst), 0);
        slot.attach(target);
        assert_eq!(seen.0.load(Ordering::SeqCst), 1);
        assert_eq!(seen.1.lock().clone().unwrap().unwrap_err().message, "gone");
        slot.record(&Ok(()), &bytes());
        assert_eq!(seen.0.load(Ordering::SeqCst), 1, "settled once");
    }

    #[test]
    fn an_alias_before_the_outcome_is_settled_by_the_record_step_once() {
        let slot = AliasSlot::<Probe>::default();
        let (target, seen) = probe();
        slot.attach(target);
        assert_eq!(
            seen.0.load(Ordering::SeqCst),
            0,
            "nothing to settle with yet"
        );
        slot.record(&Ok(()), &bytes());
        assert_eq!(seen.0.load(Ordering::SeqCst), 1);
        assert_eq!(seen.1.lock().clone(), Some(Ok(())));
        let (late, late_seen) = probe();
        slot.attach(late);
        assert_eq!(
            late_seen.0.load(Ordering::SeqCst),
            0,
            "a settled slot takes no second alias"
        );
    }
}
