//! The C ABI: the `PJRT_Api` table and translation between C handles and the
//! safe layers below. No logic beyond translation lives here.
// PJRT constants keep their C names.
#![allow(non_upper_case_globals)]
pub mod bindings;
pub(crate) mod boundary;
mod buffer;
mod client;
mod cxx_delete;
mod device;
pub(crate) mod errors;
mod events;
pub(crate) mod handles;
mod jax_support;
pub mod kv_callbacks;
pub mod logging;
mod memory;
mod metrics_export;
mod plugin;
mod strings;
mod transfers;
mod unimplemented;

use once_cell::sync::Lazy;

use bindings::*;

struct ApiTable(PJRT_Api);
// SAFETY: built once, never mutated afterwards; holds function pointers and
// pointers to other immutable statics.
unsafe impl Sync for ApiTable {}
// SAFETY: as above.
unsafe impl Send for ApiTable {}

static API: Lazy<ApiTable> = Lazy::new(|| ApiTable(api_table()));

fn api_table() -> PJRT_Api {
    let mut api = PJRT_Api {
        struct_size: PJRT_Api_STRUCT_SIZE as usize,
        extension_start: transfers::extension_chain(),
        pjrt_api_version: PJRT_Api_Version {
            struct_size: PJRT_Api_Version_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            major_version: PJRT_API_MAJOR as i32,
            minor_version: PJRT_API_MINOR as i32,
        },
        ..Default::default()
    };
    unimplemented::fill(&mut api);

    api.PJRT_Error_Destroy = Some(errors::error_destroy);
    api.PJRT_Error_Message = Some(errors::error_message);
    api.PJRT_Error_GetCode = Some(errors::error_get_code);
    api.PJRT_Error_ForEachPayload = Some(jax_support::error_for_each_payload);

    api.PJRT_Plugin_Initialize = Some(plugin::plugin_initialize);
    api.PJRT_Plugin_Attributes = Some(plugin::plugin_attributes);

    api.PJRT_Event_Destroy = Some(events::event_destroy);
    api.PJRT_Event_IsReady = Some(events::event_is_ready);
    api.PJRT_Event_Error = Some(events::event_error);
    api.PJRT_Event_Await = Some(events::event_await);
    api.PJRT_Event_OnReady = Some(events::event_on_ready);
    api.PJRT_Event_Create = Some(events::event_create);
    api.PJRT_Event_Set = Some(events::event_set);

    api.PJRT_Client_Create = Some(jax_support::client_create_registering);
    api.PJRT_Client_Destroy = Some(client::client_destroy);
    api.PJRT_Client_PlatformName = Some(client::client_platform_name);
    api.PJRT_Client_ProcessIndex = Some(client::client_process_index);
    api.PJRT_Client_PlatformVersion = Some(client::client_platform_version);
    api.PJRT_Client_Devices = Some(client::client_devices);
    api.PJRT_Client_AddressableDevices = Some(client::client_addressable_devices);
    api.PJRT_Client_LookupDevice = Some(client::client_lookup_device);
    api.PJRT_Client_LookupAddressableDevice = Some(client::client_lookup_addressable_device);
    api.PJRT_Client_AddressableMemories = Some(client::client_addressable_memories);
    api.PJRT_Client_BufferFromHostBuffer = Some(client::client_buffer_from_host_buffer);
    api.PJRT_Client_UpdateGlobalProcessInfo = Some(jax_support::client_update_global_process_info);

    api.PJRT_DeviceDescription_Id = Some(device::device_description_id);
    api.PJRT_DeviceDescription_ProcessIndex = Some(device::device_description_process_index);
    api.PJRT_DeviceDescription_Attributes = Some(device::device_description_attributes);
    api.PJRT_DeviceDescription_Kind = Some(device::device_description_kind);
    api.PJRT_DeviceDescription_DebugString = Some(device::device_description_debug_string);
    api.PJRT_DeviceDescription_ToString = Some(device::device_description_to_string);

    api.PJRT_Device_GetDescription = Some(device::device_get_description);
    api.PJRT_Device_IsAddressable = Some(device::device_is_addressable);
    api.PJRT_Device_LocalHardwareId = Some(device::device_local_hardware_id);
    api.PJRT_Device_AddressableMemories = Some(device::device_addressable_memories);
    api.PJRT_Device_DefaultMemory = Some(device::device_default_memory);
    api.PJRT_Device_MemoryStats = Some(device::device_memory_stats);
    api.PJRT_Device_GetAttributes = Some(device::device_get_attributes);

    api.PJRT_Memory_Id = Some(memory::memory_id);
    api.PJRT_Memory_Kind = Some(memory::memory_kind);
    api.PJRT_Memory_Kind_Id = Some(memory::memory_kind_id);
    api.PJRT_Memory_DebugString = Some(memory::memory_debug_string);
    api.PJRT_Memory_ToString = Some(memory::memory_to_string);
    api.PJRT_Memory_AddressableByDevices = Some(memory::memory_addressable_by_devices);

    api.PJRT_Buffer_Destroy = Some(buffer::buffer_destroy);
    api.PJRT_Buffer_ElementType = Some(buffer::buffer_element_type);
    api.PJRT_Buffer_Dimensions = Some(buffer::buffer_dimensions);
    api.PJRT_Buffer_UnpaddedDimensions = Some(buffer::buffer_unpadded_dimensions);
    api.PJRT_Buffer_DynamicDimensionIndices = Some(buffer::buffer_dynamic_dimension_indices);
    api.PJRT_Buffer_GetMemoryLayout = Some(buffer::buffer_get_memory_layout);
    api.PJRT_Buffer_OnDeviceSizeInBytes = Some(buffer::buffer_on_device_size_in_bytes);
    api.PJRT_Buffer_Device = Some(buffer::buffer_device);
    api.PJRT_Buffer_Memory = Some(buffer::buffer_memory);
    api.PJRT_Buffer_Delete = Some(buffer::buffer_delete);
    api.PJRT_Buffer_IsDeleted = Some(buffer::buffer_is_deleted);
    api.PJRT_Buffer_CopyToDevice = Some(buffer::buffer_copy_to_device);
    api.PJRT_Buffer_CopyToMemory = Some(buffer::buffer_copy_to_memory);
    api.PJRT_Buffer_ToHostBuffer = Some(buffer::buffer_to_host_buffer);
    api.PJRT_Buffer_CopyRawToHost = Some(buffer::buffer_copy_raw_to_host);
    api.PJRT_Buffer_IsOnCpu = Some(buffer::buffer_is_on_cpu);
    api.PJRT_Buffer_ReadyEvent = Some(buffer::buffer_ready_event);
    api.PJRT_Buffer_UnsafePointer = Some(buffer::buffer_unsafe_pointer);
    api.PJRT_Buffer_OpaqueDeviceMemoryDataPointer =
        Some(buffer::buffer_opaque_device_memory_data_pointer);
    api.PJRT_Buffer_IncreaseExternalReferenceCount =
        Some(buffer::buffer_increase_external_reference_count);
    api.PJRT_Buffer_DecreaseExternalReferenceCount =
        Some(buffer::buffer_decrease_external_reference_count);
    api
}

/// The plugin's entry point.
#[no_mangle]
pub extern "C" fn GetPjrtApi() -> *const PJRT_Api {
    match std::panic::catch_unwind(|| {
        logging::init();
        &API.0 as *const PJRT_Api
    }) {
        Ok(api) => api,
        Err(_) => std::ptr::null(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_slot_is_filled() {
        let api = GetPjrtApi();
        assert!(!api.is_null());
        // SAFETY: GetPjrtApi returns a pointer to a static table.
        let api = unsafe { &*api };
        let header = std::mem::offset_of!(PJRT_Api, PJRT_Error_Destroy);
        let slots = (api.struct_size - header) / std::mem::size_of::<usize>();
        // SAFETY: the slot region is `slots` function pointers.
        let words = unsafe {
            std::slice::from_raw_parts(
                (api as *const PJRT_Api as *const u8).add(header) as *const usize,
                slots,
            )
        };
        assert_eq!(slots, unimplemented::PJRT_API_SLOT_COUNT);
        assert!(words.iter().all(|&w| w != 0), "a PJRT_Api slot is null");
    }
}
