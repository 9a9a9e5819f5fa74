//! Devices and their memories.
use std::sync::Arc;

use crate::backend::{Backend, DevicePlacement, DriverMemoryInfo, MemoryCounters};
use crate::compute_plugin::{ComputeDevice, ComputeMemory};
use crate::pjrt::named_values::NamedValue;

/// The memory space of a device of the embedded backends: its own memory.
pub const DEVICE_MEMORY_KIND: &str = "device";
pub const DEVICE_MEMORY_KIND_ID: i32 = 0;

#[derive(Debug)]
pub struct Device {
    pub global_id: i32,
    pub process_index: i32,
    /// -1 for devices of other processes.
    pub local_hardware_id: i32,
    pub addressable: bool,
    pub kind: String,
    pub debug_string: String,
    pub to_string: String,
    /// Its default memory (embedded backends: same id as the device).
    pub memory: Arc<Memory>,
    /// Every memory it addresses, the default one included.
    pub memories: Vec<Arc<Memory>>,
    pub counters: Arc<MemoryCounters>,
    /// The compute plugin's device behind it (a delegating client's
    /// addressable device).
    pub compute: Option<ComputeDevice>,
    /// Description attributes beyond the id (the compute plugin's).
    pub compute_attributes: Vec<(String, NamedValue)>,
    /// The backend of this process (for a remote device: of this process
    /// too; a job is assumed to use one backend everywhere).
    pub backend: Arc<dyn Backend>,
}

#[derive(Debug)]
pub struct Memory {
    pub id: i32,
    /// Global ids of the devices that address it (the first is its owner).
    pub devices: Vec<i32>,
    pub kind: String,
    pub kind_id: i32,
    pub debug_string: String,
    pub to_string: String,
    /// The compute plugin's memory behind it (a delegating client's).
    pub compute: Option<ComputeMemory>,
}

impl Memory {
    /// The device whose memory this is.
    pub fn device_global_id(&self) -> i32 {
        self.devices[0]
    }

    /// A delegating client's memory: the compute plugin's, as `devices`
    /// (global ids) see it.
    pub fn delegated(memory: &ComputeMemory, devices: Vec<i32>) -> Memory {
        Memory {
            id: memory.id,
            devices,
            kind: memory.kind.clone(),
            kind_id: memory.kind_id,
            debug_string: memory.debug_string.clone(),
            to_string: memory.to_string.clone(),
            compute: Some(memory.clone()),
        }
    }
}

impl Device {
    pub fn new(
        global_id: i32,
        process_index: i32,
        local_hardware_id: i32,
        addressable: bool,
        kind: &str,
        backend: Arc<dyn Backend>,
    ) -> Device {
        let memory = Arc::new(Memory {
            id: global_id,
            devices: vec![global_id],
            kind: DEVICE_MEMORY_KIND.to_string(),
            kind_id: DEVICE_MEMORY_KIND_ID,
            debug_string: format!(
                "crosshost memory {global_id} (kind {DEVICE_MEMORY_KIND}) of device {global_id}"
            ),
            to_string: format!("CrosshostMemory(id={global_id}, kind={DEVICE_MEMORY_KIND})"),
            compute: None,
        });
        Device {
            global_id,
            process_index,
            local_hardware_id,
            addressable,
            kind: kind.to_string(),
            debug_string: format!(
                "crosshost:{global_id} (process {process_index}, {kind}{})",
                if addressable { "" } else { ", remote" }
            ),
            to_string: format!(
                "CrosshostDevice(id={global_id}, process_index={process_index}, kind={kind})"
            ),
            memories: vec![memory.clone()],
            memory,
            counters: Arc::new(MemoryCounters::default()),
            backend,
            compute: None,
            compute_attributes: Vec::new(),
        }
    }

    /// A delegating client's addressable device: the compute plugin's
    /// device `compute` under our global id, with its memories. `backend`
    /// (the host backend) places receive destinations.
    pub fn delegated(
        global_id: i32,
        process_index: i32,
        compute: ComputeDevice,
        memories: Vec<Arc<Memory>>,
        backend: Arc<dyn Backend>,
    ) -> Device {
        let mut device = Device::new(
            global_id,
            process_index,
            compute.local_hardware_id,
            true,
            &compute.kind,
            backend,
        );
        let default = compute.default_memory().memory;
        device.memory = memories
            .iter()
            .find(|m| m.compute.as_ref().is_some_and(|c| c.memory == default))
            .cloned()
            .unwrap_or_else(|| device.memory.clone());
        device.memories = memories;
        device.compute_attributes = compute.attributes.clone();
        device.compute = Some(compute);
        device
    }

    /// Where this device's memory comes from; `None` for another process's
    /// device.
    pub fn placement(&self) -> Option<DevicePlacement> {
        self.addressable.then(|| DevicePlacement {
            backend: self.backend.clone(),
            // Receive destinations of a delegating client are host memory of
            // the host backend's single placement.
            index: if self.compute.is_some() {
                0
            } else {
                self.local_hardware_id as usize
            },
            counters: self.counters.clone(),
        })
    }

    /// The driver's free/total memory of this device (CUDA, addressable).
    pub fn driver_memory_info(&self) -> Option<DriverMemoryInfo> {
        if self.addressable {
            self.backend.memory_info(self.local_hardware_id as usize)
        } else {
            None
        }
    }
}
