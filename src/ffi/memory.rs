//! PJRT_Memory_*.
use super::args::{memory_arg, str_out};

crate::pjrt_entry!(
    /// The memory's id.
    memory_id = "PJRT_Memory_Id", PJRT_Memory_Id_Args through id, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_Id", "memory") }?;
    args.id = m.memory.id;
    Ok(())
});

crate::pjrt_entry!(
    /// The memory kind (`device`, ...), borrowed from the memory.
    memory_kind = "PJRT_Memory_Kind", PJRT_Memory_Kind_Args through kind_size, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_Kind", "memory") }?;
    (args.kind, args.kind_size) = str_out(&m.memory.kind);
    Ok(())
});

crate::pjrt_entry!(
    /// The id of the memory kind.
    memory_kind_id = "PJRT_Memory_Kind_Id", PJRT_Memory_Kind_Id_Args through kind_id, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_Kind_Id", "memory") }?;
    args.kind_id = m.memory.kind_id;
    Ok(())
});

crate::pjrt_entry!(
    /// A debug string, borrowed from the memory.
    memory_debug_string = "PJRT_Memory_DebugString", PJRT_Memory_DebugString_Args through debug_string_size, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_DebugString", "memory") }?;
    (args.debug_string, args.debug_string_size) = str_out(&m.memory.debug_string);
    Ok(())
});

crate::pjrt_entry!(
    /// A short description string, borrowed from the memory.
    memory_to_string = "PJRT_Memory_ToString", PJRT_Memory_ToString_Args through to_string_size, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_ToString", "memory") }?;
    (args.to_string, args.to_string_size) = str_out(&m.memory.to_string);
    Ok(())
});

crate::pjrt_entry!(
    /// The devices that address this memory, borrowed from the client.
    memory_addressable_by_devices = "PJRT_Memory_AddressableByDevices", PJRT_Memory_AddressableByDevices_Args through num_devices, |args| {
    // SAFETY: live handle per contract.
    let m = unsafe { memory_arg(args.memory, "PJRT_Memory_AddressableByDevices", "memory") }?;
    args.devices = m.devices.0.as_ptr();
    args.num_devices = m.devices.0.len();
    Ok(())
});
