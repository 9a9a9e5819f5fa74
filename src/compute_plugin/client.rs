//! The inner client a delegating crosshost client owns: created with the
//! options we derive (`cpu_device_count`, `process_id`) plus the caller's
//! `compute.*` options, destroyed when the last holder lets go.
use std::sync::Arc;

use super::{inner_str, ComputePlugin, InnerPtr};
use crate::pjrt::bindings::*;
use crate::pjrt::named_values::{copy_named_values, NamedValue, NamedValues};
use crate::status::{internal, Result};

/// Create options for the inner client, in the order given.
pub type InnerOptions = Vec<(String, NamedValue)>;

/// One memory space of an inner device.
#[derive(Clone, Debug)]
pub struct ComputeMemory {
    pub memory: InnerPtr,
    pub id: i32,
    pub kind: String,
    pub kind_id: i32,
    pub debug_string: String,
    pub to_string: String,
}

/// One addressable device of the inner client.
#[derive(Clone, Debug)]
pub struct ComputeDevice {
    pub device: InnerPtr,
    pub description: InnerPtr,
    /// The inner plugin's own global id.
    pub id: i32,
    pub local_hardware_id: i32,
    pub kind: String,
    /// Its description's attributes.
    pub attributes: Vec<(String, NamedValue)>,
    pub memories: Vec<ComputeMemory>,
    /// Index of the default memory in `memories`.
    pub default_memory: usize,
}

impl ComputeDevice {
    pub fn default_memory(&self) -> &ComputeMemory {
        &self.memories[self.default_memory]
    }
}

/// The inner client. `Drop` destroys it: every object that uses the inner
/// client (our client, a receive waiting to fulfil its alias) holds an Arc.
pub struct ComputeClient {
    plugin: Arc<ComputePlugin>,
    client: InnerPtr,
    platform_name: String,
    platform_version: String,
    devices: Vec<ComputeDevice>,
}

impl std::fmt::Debug for ComputeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ComputeClient({} {}, {} devices)",
            self.platform_name,
            self.platform_version,
            self.devices.len()
        )
    }
}

/// Reads a `(pointer, count)` array of handles the inner plugin owns.
fn handles<T>(ptr: *const *mut T, count: usize) -> Vec<InnerPtr> {
    if ptr.is_null() || count == 0 {
        return Vec::new();
    }
    // SAFETY: PJRT returns arrays of `count` handles valid for the client's
    // lifetime.
    unsafe { std::slice::from_raw_parts(ptr, count) }
        .iter()
        .map(|&p| InnerPtr::from(p))
        .collect()
}

impl ComputeClient {
    /// Creates the inner client. Errors name the plugin.
    pub fn create(
        plugin: Arc<ComputePlugin>,
        options: &InnerOptions,
    ) -> Result<Arc<ComputeClient>> {
        plugin.initialize()?;
        let values = NamedValues::new(options.clone());
        let values = &values.values;
        let mut args = PJRT_Client_Create_Args {
            struct_size: PJRT_Client_Create_Args_STRUCT_SIZE as usize,
            create_options: values.as_ptr(),
            num_options: values.len(),
            ..Default::default()
        };
        crate::inner_call!(&plugin, PJRT_Client_Create, &mut args).map_err(|e| {
            crate::status::Status::new(
                e.code,
                format!(
                    "creating the compute plugin's client ({}): {}",
                    plugin.path().display(),
                    e.message
                ),
            )
        })?;
        if args.client.is_null() {
            return Err(internal(format!(
                "compute plugin {}: PJRT_Client_Create returned no client",
                plugin.path().display()
            )));
        }
        let mut client = ComputeClient {
            plugin,
            client: InnerPtr::from(args.client),
            platform_name: String::new(),
            platform_version: String::new(),
            devices: Vec::new(),
        };
        // From here `client`'s Drop destroys the inner client on any error.
        client.platform_name = client.query_platform_name()?;
        client.platform_version = client.query_platform_version();
        client.devices = client.query_devices()?;
        Ok(Arc::new(client))
    }

    pub fn plugin(&self) -> &Arc<ComputePlugin> {
        &self.plugin
    }

    /// The inner `PJRT_Client*`.
    pub fn raw(&self) -> *mut PJRT_Client {
        self.client.as_mut()
    }

    pub fn platform_name(&self) -> &str {
        &self.platform_name
    }

    pub fn platform_version(&self) -> &str {
        &self.platform_version
    }

    pub fn devices(&self) -> &[ComputeDevice] {
        &self.devices
    }

    /// The inner device of one of its buffers.
    pub fn buffer_device(&self, buffer: *mut PJRT_Buffer) -> Result<InnerPtr> {
        let mut args = PJRT_Buffer_Device_Args {
            struct_size: PJRT_Buffer_Device_Args_STRUCT_SIZE as usize,
            buffer,
            ..Default::default()
        };
        crate::inner_call!(&self.plugin, PJRT_Buffer_Device, &mut args)?;
        Ok(InnerPtr::from(args.device))
    }

    /// The inner memory of one of its buffers.
    pub fn buffer_memory(&self, buffer: *mut PJRT_Buffer) -> Result<InnerPtr> {
        let mut args = PJRT_Buffer_Memory_Args {
            struct_size: PJRT_Buffer_Memory_Args_STRUCT_SIZE as usize,
            buffer,
            ..Default::default()
        };
        crate::inner_call!(&self.plugin, PJRT_Buffer_Memory, &mut args)?;
        Ok(InnerPtr::from(args.memory))
    }

    fn query_platform_name(&self) -> Result<String> {
        let mut args = PJRT_Client_PlatformName_Args {
            struct_size: PJRT_Client_PlatformName_Args_STRUCT_SIZE as usize,
            client: self.raw(),
            ..Default::default()
        };
        crate::inner_call!(&self.plugin, PJRT_Client_PlatformName, &mut args)?;
        Ok(inner_str(args.platform_name, args.platform_name_size))
    }

    fn query_platform_version(&self) -> String {
        let mut args = PJRT_Client_PlatformVersion_Args {
            struct_size: PJRT_Client_PlatformVersion_Args_STRUCT_SIZE as usize,
            client: self.raw(),
            ..Default::default()
        };
        match crate::inner_call!(&self.plugin, PJRT_Client_PlatformVersion, &mut args) {
            Ok(()) => inner_str(args.platform_version, args.platform_version_size),
            Err(_) => String::new(),
        }
    }

    fn query_devices(&self) -> Result<Vec<ComputeDevice>> {
        let plugin = &self.plugin;
        let mut args = PJRT_Client_AddressableDevices_Args {
            struct_size: PJRT_Client_AddressableDevices_Args_STRUCT_SIZE as usize,
            client: self.raw(),
            ..Default::default()
        };
        crate::inner_call!(plugin, PJRT_Client_AddressableDevices, &mut args)?;
        let mut devices = Vec::new();
        for device in handles(args.addressable_devices, args.num_addressable_devices) {
            let mut desc = PJRT_Device_GetDescription_Args {
                struct_size: PJRT_Device_GetDescription_Args_STRUCT_SIZE as usize,
                device: device.as_mut(),
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_Device_GetDescription, &mut desc)?;
            let mut id = PJRT_DeviceDescription_Id_Args {
                struct_size: PJRT_DeviceDescription_Id_Args_STRUCT_SIZE as usize,
                device_description: desc.device_description,
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_DeviceDescription_Id, &mut id)?;
            let mut kind = PJRT_DeviceDescription_Kind_Args {
                struct_size: PJRT_DeviceDescription_Kind_Args_STRUCT_SIZE as usize,
                device_description: desc.device_description,
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_DeviceDescription_Kind, &mut kind)?;
            let mut local = PJRT_Device_LocalHardwareId_Args {
                struct_size: PJRT_Device_LocalHardwareId_Args_STRUCT_SIZE as usize,
                device: device.as_mut(),
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_Device_LocalHardwareId, &mut local)?;
            let mut default = PJRT_Device_DefaultMemory_Args {
                struct_size: PJRT_Device_DefaultMemory_Args_STRUCT_SIZE as usize,
                device: device.as_mut(),
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_Device_DefaultMemory, &mut default)?;
            let mut memories_args = PJRT_Device_AddressableMemories_Args {
                struct_size: PJRT_Device_AddressableMemories_Args_STRUCT_SIZE as usize,
                device: device.as_mut(),
                ..Default::default()
            };
            crate::inner_call!(plugin, PJRT_Device_AddressableMemories, &mut memories_args)?;
            let mut memories = Vec::new();
            for memory in handles(memories_args.memories, memories_args.num_memories) {
                memories.push(self.query_memory(memory)?);
            }
            let default_memory = memories
                .iter()
                .position(|m| m.memory == InnerPtr::from(default.memory))
                .ok_or_else(|| {
                    internal(format!(
                        "compute plugin {}: device {}'s default memory is not among its memories",
                        plugin.path().display(),
                        id.id
                    ))
                })?;
            let mut attributes = PJRT_DeviceDescription_Attributes_Args {
                struct_size: PJRT_DeviceDescription_Attributes_Args_STRUCT_SIZE as usize,
                device_description: desc.device_description,
                ..Default::default()
            };
            let attributes = match crate::inner_call!(
                plugin,
                PJRT_DeviceDescription_Attributes,
                &mut attributes
            ) {
                // SAFETY: the description's array, alive with the client.
                Ok(()) => unsafe {
                    copy_named_values(attributes.attributes, attributes.num_attributes)
                },
                Err(_) => Vec::new(),
            };
            devices.push(ComputeDevice {
                device,
                description: InnerPtr::from(desc.device_description),
                id: id.id,
                local_hardware_id: local.local_hardware_id,
                kind: inner_str(kind.device_kind, kind.device_kind_size),
                attributes,
                memories,
                default_memory,
            });
        }
        Ok(devices)
    }

    fn query_memory(&self, memory: InnerPtr) -> Result<ComputeMemory> {
        let plugin = &self.plugin;
        let mut id = PJRT_Memory_Id_Args {
            struct_size: PJRT_Memory_Id_Args_STRUCT_SIZE as usize,
            memory: memory.as_mut(),
            ..Default::default()
        };
        crate::inner_call!(plugin, PJRT_Memory_Id, &mut id)?;
        let mut kind = PJRT_Memory_Kind_Args {
            struct_size: PJRT_Memory_Kind_Args_STRUCT_SIZE as usize,
            memory: memory.as_mut(),
            ..Default::default()
        };
        crate::inner_call!(plugin, PJRT_Memory_Kind, &mut kind)?;
        let mut kind_id = PJRT_Memory_Kind_Id_Args {
            struct_size: PJRT_Memory_Kind_Id_Args_STRUCT_SIZE as usize,
            memory: memory.as_mut(),
            ..Default::default()
        };
        let kind_id = match crate::inner_call!(plugin, PJRT_Memory_Kind_Id, &mut kind_id) {
            Ok(()) => kind_id.kind_id,
            Err(_) => -1,
        };
        let mut debug = PJRT_Memory_DebugString_Args {
            struct_size: PJRT_Memory_DebugString_Args_STRUCT_SIZE as usize,
            memory: memory.as_mut(),
            ..Default::default()
        };
        let debug_string = match crate::inner_call!(plugin, PJRT_Memory_DebugString, &mut debug) {
            Ok(()) => inner_str(debug.debug_string, debug.debug_string_size),
            Err(_) => String::new(),
        };
        let mut to_string = PJRT_Memory_ToString_Args {
            struct_size: PJRT_Memory_ToString_Args_STRUCT_SIZE as usize,
            memory: memory.as_mut(),
            ..Default::default()
        };
        let to_string = match crate::inner_call!(plugin, PJRT_Memory_ToString, &mut to_string) {
            Ok(()) => inner_str(to_string.to_string, to_string.to_string_size),
            Err(_) => String::new(),
        };
        Ok(ComputeMemory {
            memory,
            id: id.id,
            kind: inner_str(kind.kind, kind.kind_size),
            kind_id,
            debug_string,
            to_string,
        })
    }
}

impl Drop for ComputeClient {
    fn drop(&mut self) {
        let mut args = PJRT_Client_Destroy_Args {
            struct_size: PJRT_Client_Destroy_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            client: self.raw(),
        };
        if let Err(e) = crate::inner_call!(&self.plugin, PJRT_Client_Destroy, &mut args) {
            log::error!("destroying the compute plugin's client: {e}");
        }
    }
}
