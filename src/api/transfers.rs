//! Cross-host transfers on the client: wraps the protocol's destinations and
//! send futures into buffers and events.
use std::sync::Arc;

use super::buffer::Buffer;
use super::client::Client;
use super::device::Device;
use super::element_type::Shape;
use crate::backend::DevicePlacement;
use crate::status::{invalid_argument, Result, Status};
use crate::sync::Future;
use crate::transfer::service::{BufferSpec, SendSource};

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

/// A v1 receive: the buffers and the serialized descriptor of each.
pub type ReceiveBuffersAndDescriptors = (Vec<Arc<Buffer>>, Vec<Vec<u8>>);

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

    /// v2 receive: one buffer per spec on `device`, each ready when its own
    /// sender's bytes landed.
    pub fn cross_host_receive(
        &self,
        device: &Arc<Device>,
        specs: Vec<ReceiveSpec>,
        incarnations: Option<PeerIncarnations>,
        function: &str,
    ) -> Result<Vec<Arc<Buffer>>> {
        self.own_addressable_device(device, function)?;
        let buffer_specs: Vec<BufferSpec> = specs.iter().map(|s| spec_of(&s.shape)).collect();
        let peers: Vec<(i32, i64)> = specs
            .iter()
            .map(|s| (s.peer_global_device_id, s.transfer_key))
            .collect();
        let destinations = self.transfers().receive_v2(
            &buffer_specs,
            device.global_id,
            &peers,
            incarnations.as_ref().map(|p| p.0.as_slice()),
            &self.placement(device, function)?,
        )?;
        Ok(specs
            .into_iter()
            .zip(destinations)
            .map(|(spec, d)| Buffer::new(spec.shape, device.clone(), d.memory, d.definition))
            .collect())
    }

    /// v2 send: one event per buffer, ready when that buffer's bytes are in
    /// the receiver's memory and its completion key is set.
    pub fn cross_host_send(
        &self,
        buffers: Vec<Arc<Buffer>>,
        destinations: &[i32],
        transfer_keys: &[i64],
        incarnations: Option<PeerIncarnations>,
        function: &str,
    ) -> Result<Vec<Future>> {
        let mut sources = Vec::with_capacity(buffers.len());
        for buffer in &buffers {
            self.own_addressable_device(buffer.device(), function)?;
            sources.push(SendSource {
                memory: buffer.allocation(function)?,
                ready: buffer.definition(),
                spec: spec_of(buffer.shape()),
                global_device_id: buffer.device().global_id,
            });
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
    ) -> Result<ReceiveBuffersAndDescriptors> {
        self.own_addressable_device(device, function)?;
        let specs: Vec<BufferSpec> = shapes.iter().map(spec_of).collect();
        let destinations = self
            .transfers()
            .receive_v1(&specs, &self.placement(device, function)?)?;
        let mut buffers = Vec::with_capacity(shapes.len());
        let mut descriptors = Vec::with_capacity(shapes.len());
        for (shape, d) in shapes.into_iter().zip(destinations) {
            buffers.push(Buffer::new(shape, device.clone(), d.memory, d.definition));
            descriptors.push(d.descriptor);
        }
        Ok((buffers, descriptors))
    }

    /// v1 cancel of the buffer a descriptor names.
    pub fn cancel_receive(&self, descriptor: &[u8], reason: Status, function: &str) -> Result<()> {
        self.transfers().cancel_v1(descriptor, reason, function)
    }

    /// v1 send of `buffer` to a descriptor's destination.
    pub fn send_to_descriptor(
        &self,
        buffer: Arc<Buffer>,
        descriptor: &[u8],
        function: &str,
    ) -> Result<Future> {
        self.own_addressable_device(buffer.device(), function)?;
        let source = SendSource {
            memory: buffer.allocation(function)?,
            ready: buffer.definition(),
            spec: spec_of(buffer.shape()),
            global_device_id: buffer.device().global_id,
        };
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
        self.transfers().metrics().to_json()
    }
}
