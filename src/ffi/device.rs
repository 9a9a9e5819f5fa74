//! PJRT_Device_* and PJRT_DeviceDescription_*.
use super::args::{description_arg, device_arg, str_out};

crate::pjrt_entry!(
    /// The device's description, borrowed from its client.
    device_get_description = "PJRT_Device_GetDescription", PJRT_Device_GetDescription_Args through device_description, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_GetDescription", "device") }?;
    args.device_description = device.description_ptr();
    Ok(())
});

crate::pjrt_entry!(
    /// Whether the device belongs to this process.
    device_is_addressable = "PJRT_Device_IsAddressable", PJRT_Device_IsAddressable_Args through is_addressable, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_IsAddressable", "device") }?;
    args.is_addressable = device.device.addressable;
    Ok(())
});

crate::pjrt_entry!(
    /// The device's id within its process.
    device_local_hardware_id = "PJRT_Device_LocalHardwareId", PJRT_Device_LocalHardwareId_Args through local_hardware_id, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_LocalHardwareId", "device") }?;
    args.local_hardware_id = device.device.local_hardware_id;
    Ok(())
});

crate::pjrt_entry!(
    /// The device's memories, borrowed from its client; none for a device of
    /// another process.
    device_addressable_memories = "PJRT_Device_AddressableMemories", PJRT_Device_AddressableMemories_Args through num_memories, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_AddressableMemories", "device") }?;
    if device.device.addressable {
        args.memories = device.memories.0.as_ptr();
        args.num_memories = device.memories.0.len();
    } else {
        args.memories = std::ptr::null();
        args.num_memories = 0;
    }
    Ok(())
});

crate::pjrt_entry!(
    /// The device's default memory, borrowed from its client.
    device_default_memory = "PJRT_Device_DefaultMemory", PJRT_Device_DefaultMemory_Args through memory, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_DefaultMemory", "device") }?;
    args.memory = device.memory_ptr();
    Ok(())
});

crate::pjrt_entry!(
    /// Allocation counters of an embedded client's device. Optional fields are
    /// written only where the caller's struct has them; `bytes_limit` only
    /// where there is a driver to ask (CUDA).
    device_memory_stats = "PJRT_Device_MemoryStats", PJRT_Device_MemoryStats_Args through bytes_in_use, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_MemoryStats", "device") }?;
    let stats = device.device.counters.snapshot();
    args.bytes_in_use = stats.bytes_in_use;
    // Optional fields exist only when the caller's struct is large enough.
    if crate::has_field!(args, crate::pjrt::bindings::PJRT_Device_MemoryStats_Args, largest_alloc_size_is_set) {
        args.peak_bytes_in_use = stats.peak_bytes_in_use;
        args.peak_bytes_in_use_is_set = true;
        args.num_allocs = stats.num_allocs;
        args.num_allocs_is_set = true;
        args.largest_alloc_size = stats.largest_alloc_size;
        args.largest_alloc_size_is_set = true;
    }
    // Each optional field is cleared only if the caller's struct has it: an
    // older caller (jaxlib 0.10.2 sends PJRT 0.112's shorter struct) does not
    // zero the struct, so an untouched `*_is_set` reads as garbage there.
    macro_rules! not_set {
        ($($field:ident),*) => {$(
            if crate::has_field!(args, crate::pjrt::bindings::PJRT_Device_MemoryStats_Args, $field) {
                args.$field = false;
            }
        )*};
    }
    not_set!(
        bytes_limit_is_set,
        bytes_reserved_is_set,
        peak_bytes_reserved_is_set,
        bytes_reservable_limit_is_set,
        largest_free_block_bytes_is_set,
        pool_bytes_is_set,
        peak_pool_bytes_is_set,
        peak_allocated_bytes_is_set
    );
    if crate::has_field!(args, crate::pjrt::bindings::PJRT_Device_MemoryStats_Args, bytes_limit_is_set) {
        // The driver's total memory where there is a driver (CUDA).
        if let Some(info) = device.device.driver_memory_info() {
            args.bytes_limit = info.total_bytes as i64;
            args.bytes_limit_is_set = true;
        }
    }
    Ok(())
});

crate::pjrt_entry!(
    /// The device's global id.
    device_description_id = "PJRT_DeviceDescription_Id", PJRT_DeviceDescription_Id_Args through id, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_Id") }?;
    args.id = d.device.global_id;
    Ok(())
});

crate::pjrt_entry!(
    /// The index of the process the device belongs to.
    device_description_process_index = "PJRT_DeviceDescription_ProcessIndex", PJRT_DeviceDescription_ProcessIndex_Args through process_index, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_ProcessIndex") }?;
    args.process_index = d.device.process_index;
    Ok(())
});

crate::pjrt_entry!(
    /// The device's attributes (`backend`, `global_device_id`, and the
    /// backend's or the compute plugin's own), borrowed from the device.
    device_description_attributes = "PJRT_DeviceDescription_Attributes", PJRT_DeviceDescription_Attributes_Args through attributes, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_Attributes") }?;
    args.attributes = d.attributes.values.as_ptr();
    args.num_attributes = d.attributes.values.len();
    Ok(())
});

crate::pjrt_entry!(
    /// The device kind, borrowed from the device.
    device_description_kind = "PJRT_DeviceDescription_Kind", PJRT_DeviceDescription_Kind_Args through device_kind_size, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_Kind") }?;
    (args.device_kind, args.device_kind_size) = str_out(&d.device.kind);
    Ok(())
});

crate::pjrt_entry!(
    /// A debug string, borrowed from the device.
    device_description_debug_string = "PJRT_DeviceDescription_DebugString", PJRT_DeviceDescription_DebugString_Args through debug_string_size, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_DebugString") }?;
    (args.debug_string, args.debug_string_size) = str_out(&d.device.debug_string);
    Ok(())
});

crate::pjrt_entry!(
    /// A short description string, borrowed from the device.
    device_description_to_string = "PJRT_DeviceDescription_ToString", PJRT_DeviceDescription_ToString_Args through to_string_size, |args| {
    // SAFETY: live handle per contract.
    let d = unsafe { description_arg(args.device_description, "PJRT_DeviceDescription_ToString") }?;
    (args.to_string, args.to_string_size) = str_out(&d.device.to_string);
    Ok(())
});

/// `attributes_deleter` handed out by PJRT_Device_GetAttributes: the
/// attributes live as long as the device, so there is nothing to free.
unsafe extern "C" fn device_attributes_keep(
    _attributes: *mut crate::pjrt::bindings::PJRT_Device_Attributes,
) {
}

crate::pjrt_entry!(
    /// The device's attributes: the description's, alive as long as the device,
    /// so `attributes_deleter` is a no-op. jaxlib calls this for every device and
    /// aborts on an error.
    device_get_attributes = "PJRT_Device_GetAttributes", PJRT_Device_GetAttributes_Args through num_attributes, |args| {
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.device, "PJRT_Device_GetAttributes", "device") }?;
    args.attributes = device.description.attributes.values.as_ptr();
    args.num_attributes = device.description.attributes.values.len();
    if crate::has_field!(args, crate::pjrt::bindings::PJRT_Device_GetAttributes_Args, attributes_deleter) {
        args.device_attributes = std::ptr::null_mut();
        args.attributes_deleter = Some(device_attributes_keep);
    }
    Ok(())
});
