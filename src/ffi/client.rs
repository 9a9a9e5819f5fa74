//! PJRT_Client_*: creation, topology queries, buffers from host memory.
use std::sync::Arc;

use super::args::{
    check_default_layout, client_arg, device_arg, memory_arg, null_field, owned_arg, read_dims,
    read_named_values, str_out,
};
use super::handles::{into_raw, BufferHandle, ClientHandle, EventHandle};
use crate::api::buffer::HostArray;
use crate::api::client::{Client, PLATFORM_NAME};
use crate::api::device::Device;
use crate::api::element_type::{ElementType, Shape};
use crate::api::options::ClientOptions;
use crate::pjrt::bindings::*;
use crate::status::{invalid_argument, Result};
use crate::sync::Future;

crate::pjrt_entry!(
    /// Creates a client from `create_options` (named values, see
    /// `api::options`) and, for a multi-process job, the caller's KV callbacks
    /// (kept for the client's life). The caller owns `client`
    /// (`PJRT_Client_Destroy`). INVALID_ARGUMENT for an unknown or ill-typed
    /// option; a compute plugin that failed to load is reported here. The new
    /// client is remembered (weakly) for `pjrt_crosshost_live_clients_metrics_json`.
    client_create = "PJRT_Client_Create", PJRT_Client_Create_Args through client, |args| {
    const F: &str = "PJRT_Client_Create";
    super::logging::init();
    // SAFETY: `create_options` holds `num_options` named values per header.
    let options = unsafe { read_named_values(args.create_options, args.num_options, F) }?;
    let options = ClientOptions::parse(&options)?;
    // Stored for multi-process clients only (see api::client::choose_store).
    // SAFETY: `args` is a readable create-args struct of its struct_size.
    let callbacks = unsafe { super::kv_callbacks::PjrtKvCallbacks::from_create_args(args) }
        .map(|c| Arc::new(c) as Arc<dyn crate::kv::callback::RawKvCallbacks>);
    let client = Client::create_with_callbacks(options, callbacks)?;
    log::info!(
        "{F}: client with {} devices (platform {})",
        client.devices().len(),
        client.platform_version()
    );
    super::live_clients::remember(&client);
    args.client = into_raw(ClientHandle::new(client));
    Ok(())
});

crate::pjrt_entry!(
    /// Destroys the caller's client handle; null is allowed. Its devices and
    /// memories stay valid while buffers of the client live (they share its
    /// tables). INVALID_ARGUMENT for a handle that is not a live client.
    client_destroy = "PJRT_Client_Destroy", PJRT_Client_Destroy_Args through client, |args| {
    // SAFETY: the caller gives up its owned client handle (or null).
    drop(unsafe { owned_arg::<ClientHandle>(args.client, "PJRT_Client_Destroy", "client") }?);
    Ok(())
});

crate::pjrt_entry!(
    /// The platform name, `crosshost`: a static string the caller borrows.
    client_platform_name = "PJRT_Client_PlatformName", PJRT_Client_PlatformName_Args through platform_name_size, |args| {
    // SAFETY: live client per contract.
    unsafe { client_arg(args.client, "PJRT_Client_PlatformName") }?;
    (args.platform_name, args.platform_name_size) = str_out(PLATFORM_NAME);
    Ok(())
});

crate::pjrt_entry!(
    /// This client's process index in its job.
    client_process_index = "PJRT_Client_ProcessIndex", PJRT_Client_ProcessIndex_Args through process_index, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, "PJRT_Client_ProcessIndex") }?;
    args.process_index = client.client.process_index();
    Ok(())
});

crate::pjrt_entry!(
    /// The platform version, borrowed from the client (alive until it is
    /// destroyed).
    client_platform_version = "PJRT_Client_PlatformVersion", PJRT_Client_PlatformVersion_Args through platform_version_size, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, "PJRT_Client_PlatformVersion") }?;
    (args.platform_version, args.platform_version_size) = str_out(client.client.platform_version());
    Ok(())
});

crate::pjrt_entry!(
    /// Every device of the job, this process's and the others'; the array is
    /// borrowed from the client.
    client_devices = "PJRT_Client_Devices", PJRT_Client_Devices_Args through num_devices, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, "PJRT_Client_Devices") }?;
    args.devices = client.tables.all_devices.0.as_ptr();
    args.num_devices = client.tables.all_devices.0.len();
    Ok(())
});

crate::pjrt_entry!(
    /// This process's devices; the array is borrowed from the client.
    client_addressable_devices = "PJRT_Client_AddressableDevices", PJRT_Client_AddressableDevices_Args through num_addressable_devices, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, "PJRT_Client_AddressableDevices") }?;
    args.addressable_devices = client.tables.addressable_devices.0.as_ptr();
    args.num_addressable_devices = client.tables.addressable_devices.0.len();
    Ok(())
});

crate::pjrt_entry!(
    /// The device with global id `id`, borrowed from the client.
    /// INVALID_ARGUMENT for an id the job does not have.
    client_lookup_device = "PJRT_Client_LookupDevice", PJRT_Client_LookupDevice_Args through device, |args| {
    const F: &str = "PJRT_Client_LookupDevice";
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, F) }?;
    let device = client.client.device_by_global_id(args.id, F)?;
    args.device = client.tables.device_ptr(device.global_id);
    Ok(())
});

crate::pjrt_entry!(
    /// This process's device with `local_hardware_id`, borrowed from the client.
    /// INVALID_ARGUMENT for an id this process does not have.
    client_lookup_addressable_device = "PJRT_Client_LookupAddressableDevice", PJRT_Client_LookupAddressableDevice_Args through addressable_device, |args| {
    const F: &str = "PJRT_Client_LookupAddressableDevice";
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, F) }?;
    let device = client.client.addressable_device_by_local_id(args.local_hardware_id, F)?;
    args.addressable_device = client.tables.device_ptr(device.global_id);
    Ok(())
});

crate::pjrt_entry!(
    /// The memories of this process's devices; the array is borrowed from the
    /// client.
    client_addressable_memories = "PJRT_Client_AddressableMemories", PJRT_Client_AddressableMemories_Args through num_addressable_memories, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, "PJRT_Client_AddressableMemories") }?;
    args.addressable_memories = client.tables.addressable_memories.0.as_ptr();
    args.num_addressable_memories = client.tables.addressable_memories.0.len();
    Ok(())
});

/// Resolves a destination given as a device, a memory, or both.
///
/// # Safety
/// `device` / `memory` must each be null or live handles.
pub(crate) unsafe fn destination_device(
    client: &ClientHandle,
    device: *mut PJRT_Device,
    memory: *mut PJRT_Memory,
    function: &str,
) -> Result<Arc<Device>> {
    let from_device = if device.is_null() {
        None
    } else {
        // SAFETY: forwarded contract.
        Some(
            unsafe { device_arg(device, function, "device") }?
                .device
                .clone(),
        )
    };
    let from_memory = if memory.is_null() {
        None
    } else {
        // SAFETY: forwarded contract.
        let memory = unsafe { memory_arg(memory, function, "memory") }?;
        Some(
            client
                .client
                .device_by_global_id(memory.memory.device_global_id(), function)?
                .clone(),
        )
    };
    let device = match (from_device, from_memory) {
        (Some(d), Some(m)) if d.global_id != m.global_id => {
            return Err(invalid_argument(format!(
                "{function}: device {} and memory of device {} disagree",
                d.global_id, m.global_id
            )))
        }
        (Some(d), _) => d,
        (None, Some(m)) => m,
        (None, None) => {
            return Err(invalid_argument(format!(
                "{function}: neither device nor memory is set"
            )))
        }
    };
    if !Arc::ptr_eq(
        &device,
        client
            .client
            .device_by_global_id(device.global_id, function)?,
    ) {
        return Err(invalid_argument(format!(
            "{function}: device {} belongs to another client",
            device.global_id
        )));
    }
    Ok(device)
}

crate::pjrt_entry!(
    /// An embedded client's buffer from host data (dense, or numpy-style
    /// `byte_strides`) on `device` or `memory` (given both, they must agree). The
    /// bytes are copied before return, so `done_with_host_buffer` is ready at
    /// once; the caller owns it and `buffer`. INVALID_ARGUMENT for a bad element
    /// type, dims, strides or destination, UNIMPLEMENTED for a `device_layout`
    /// other than dense row-major. A delegating client's call goes to the compute
    /// plugin instead (`forward/delegated.rs`).
    client_buffer_from_host_buffer = "PJRT_Client_BufferFromHostBuffer", PJRT_Client_BufferFromHostBuffer_Args through buffer, |args| {
    const F: &str = "PJRT_Client_BufferFromHostBuffer";
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, F) }?;
    let element_type = ElementType::from_raw(args.type_, F)?;
    // SAFETY: header: `dims` has `num_dims` entries.
    let dims = unsafe { read_dims(args.dims, args.num_dims, F) }?;
    let shape = Shape::new(element_type, dims, F)?;
    // SAFETY: device/memory are null or live handles of this client.
    let device = unsafe { destination_device(client, args.device, args.memory, F) }?;
    // SAFETY: null or a readable layout.
    unsafe { check_default_layout(args.device_layout, &shape, F) }?;
    let strides = if args.byte_strides.is_null() || args.num_byte_strides == 0 && shape.dims.is_empty() {
        None
    } else {
        // SAFETY: header: `byte_strides` has `num_byte_strides` entries.
        Some(unsafe { std::slice::from_raw_parts(args.byte_strides, args.num_byte_strides) })
    };
    if let Some(s) = strides {
        if s.len() != shape.dims.len() {
            return Err(invalid_argument(format!(
                "{F}: num_byte_strides ({}) != num_dims ({})",
                s.len(),
                shape.dims.len()
            )));
        }
    }
    let (low, high) = match strides {
        None => (0i64, shape.byte_size() as i64),
        Some(s) => HostArray::extent(&shape, s),
    };
    let span = (high - low) as usize;
    if span > 0 && args.data.is_null() {
        return Err(null_field(F, "data"));
    }
    let bytes: &[u8] = if span == 0 {
        &[]
    } else {
        // SAFETY: the caller's array (data pointer + strides, as described by
        // the header) covers exactly [data+low, data+high).
        unsafe { std::slice::from_raw_parts((args.data as *const u8).offset(low as isize), span) }
    };
    let host = HostArray {
        bytes,
        origin: (-low) as usize,
        byte_strides: strides,
    };
    let buffer = client.client.buffer_from_host(&host, shape, &device, F)?;
    // The bytes were copied before return: the host buffer is free at once.
    args.done_with_host_buffer = into_raw(EventHandle::from_future(Future::ready(Ok(()))));
    args.buffer = into_raw(BufferHandle::new(buffer, client.client.clone(), client.tables.clone()));
    Ok(())
});
