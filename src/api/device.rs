//! Devices and their memories.
use std::sync::Arc;

use crate::backend::{Backend, DevicePlacement, DriverMemoryInfo, MemoryCounters};

/// The single memory space of a device: its own memory.
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
    /// Its memory (same id as the device).
    pub memory: Arc<Memory>,
    pub counters: Arc<MemoryCounters>,
    /// The backend of this process (for a remote device: of this process
    /// too; a job is assumed to use one backend everywhere).
    pub backend: Arc<dyn Backend>,
}

#[derive(Debug)]
pub struct Memory {
    pub id: i32,
    pub device_global_id: i32,
    pub kind: &'static str,
    pub kind_id: i32,
    pub debug_string: String,
    pub to_string: String,
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
            device_global_id: global_id,
            kind: DEVICE_MEMORY_KIND,
            kind_id: DEVICE_MEMORY_KIND_ID,
            debug_string: format!(
                "crosshost memory {global_id} (kind {DEVICE_MEMORY_KIND}) of device {global_id}"
            ),
            to_string: format!("CrosshostMemory(id={global_id}, kind={DEVICE_MEMORY_KIND})"),
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
            memory,
            counters: Arc::new(MemoryCounters::default()),
            backend,
        }
    }

    /// Where this device's memory comes from; `None` for another process's
    /// device.
    pub fn placement(&self) -> Option<DevicePlacement> {
        self.addressable.then(|| DevicePlacement {
            backend: self.backend.clone(),
            index: self.local_hardware_id as usize,
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
