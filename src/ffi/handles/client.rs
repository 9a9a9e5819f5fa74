//! The client handle and its tables: the device, description and memory
//! handles of one client, at fixed addresses for as long as C may hold them.
use super::compute_handles::{COMPUTE_DEVICES, COMPUTE_MEMORIES};
use super::*;

#[repr(C)]
pub(crate) struct ClientHandle {
    tag: u64,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
}
castable!(
    ClientHandle,
    PJRT_Client,
    OwnedBox,
    CLIENT_TAG,
    "PJRT_Client"
);

/// Device, description and memory handles of one client, alive as long as
/// the client or any of its (embedded) buffers.
pub(crate) struct ClientTables {
    // Boxed so that the addresses handed to C stay fixed.
    #[allow(clippy::vec_box)]
    devices: Vec<Box<DeviceHandle>>,
    #[allow(clippy::vec_box)]
    memories: Vec<Box<MemoryHandle>>,
    pub all_devices: PtrList<PJRT_Device>,
    pub addressable_devices: PtrList<PJRT_Device>,
    pub addressable_memories: PtrList<PJRT_Memory>,
}

impl ClientHandle {
    pub fn new(client: Arc<Client>) -> ClientHandle {
        let mut memories: Vec<Box<MemoryHandle>> = Vec::new();
        for device in client.devices() {
            for memory in &device.memories {
                if !memories.iter().any(|m| Arc::ptr_eq(&m.memory, memory)) {
                    memories.push(Box::new(MemoryHandle::new(memory.clone())));
                }
            }
        }
        let memory_ptr = |memories: &[Box<MemoryHandle>], memory: &Arc<Memory>| {
            memories
                .iter()
                .find(|m| Arc::ptr_eq(&m.memory, memory))
                .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
                .expect("every device memory has a handle")
        };
        let devices: Vec<Box<DeviceHandle>> = client
            .devices()
            .iter()
            .map(|d| {
                let all = d
                    .memories
                    .iter()
                    .map(|m| memory_ptr(&memories, m))
                    .collect();
                DeviceHandle::new(d.clone(), memory_ptr(&memories, &d.memory), PtrList(all))
            })
            .collect();
        let ptr_of = |d: &DeviceHandle| d as *const DeviceHandle as *mut PJRT_Device;
        // Wire memory → device back pointers now that device boxes are fixed.
        for memory in memories.iter_mut() {
            let addressing = memory
                .memory
                .devices
                .iter()
                .filter_map(|id| devices.iter().find(|d| d.device.global_id == *id))
                .map(|d| ptr_of(d))
                .collect();
            memory.devices = PtrList(addressing);
        }
        let all_devices = PtrList(devices.iter().map(|d| ptr_of(d)).collect());
        let addressable_devices = PtrList(
            devices
                .iter()
                .filter(|d| d.device.addressable)
                .map(|d| ptr_of(d))
                .collect(),
        );
        let addressable_memories = PtrList(
            memories
                .iter()
                .filter(|m| {
                    client
                        .device_by_global_id(m.memory.device_global_id(), "")
                        .is_ok_and(|d| d.addressable)
                })
                .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
                .collect(),
        );
        let tables = ClientTables {
            devices,
            memories,
            all_devices,
            addressable_devices,
            addressable_memories,
        };
        tables.register_compute_handles(&client);
        ClientHandle {
            tag: Self::TAG,
            client,
            tables: Arc::new(tables),
        }
    }
}

impl ClientTables {
    fn register_compute_handles(&self, client: &Arc<Client>) {
        let mut devices = COMPUTE_DEVICES.write();
        for d in &self.devices {
            if let Some(inner) = &d.device.compute {
                devices.insert(
                    inner.device,
                    (&**d as *const DeviceHandle as usize, Arc::downgrade(client)),
                );
            }
        }
        let mut memories = COMPUTE_MEMORIES.write();
        for m in &self.memories {
            if let Some(inner) = &m.memory.compute {
                memories.insert(inner.memory, &**m as *const MemoryHandle as usize);
            }
        }
    }

    pub fn device_ptr(&self, global_id: i32) -> *mut PJRT_Device {
        self.devices
            .iter()
            .find(|d| d.device.global_id == global_id)
            .map(|d| &**d as *const DeviceHandle as *mut PJRT_Device)
            .unwrap_or(std::ptr::null_mut())
    }

    /// Our handle of `memory` (one of this client's memories).
    pub fn memory_ptr(&self, memory: &Arc<Memory>) -> *mut PJRT_Memory {
        self.memories
            .iter()
            .find(|m| Arc::ptr_eq(&m.memory, memory))
            .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
            .unwrap_or(std::ptr::null_mut())
    }
}

impl Drop for ClientTables {
    fn drop(&mut self) {
        let mut devices = COMPUTE_DEVICES.write();
        for d in &self.devices {
            if let Some(inner) = &d.device.compute {
                devices.remove(&inner.device);
            }
        }
        let mut memories = COMPUTE_MEMORIES.write();
        for m in &self.memories {
            if let Some(inner) = &m.memory.compute {
                memories.remove(&inner.memory);
            }
        }
    }
}
