//! PJRT_Buffer_*: queries, reads back to the host, copies between devices.
use super::args::{
    buffer_arg, check_default_layout, device_arg, memory_arg, null_field, owned_arg,
};
use super::handles::{into_raw, BufferHandle, EventHandle};
use crate::api::buffer::Buffer;
use crate::pjrt::bindings::*;
use crate::status::{invalid_argument, out_of_range, Result};

/// The caller's host memory a read writes into (its pointer), carried to
/// whichever thread completes the read.
#[derive(Clone, Copy)]
struct CallerHostBuffer(usize);

impl CallerHostBuffer {
    /// # Safety
    /// The pointer must be writable for `len` bytes until the read's event is
    /// ready (the PJRT contract for ToHostBuffer / CopyRawToHost).
    unsafe fn as_slice<'a>(self, len: usize) -> &'a mut [u8] {
        if len == 0 {
            return &mut [];
        }
        // SAFETY: forwarded contract.
        unsafe { std::slice::from_raw_parts_mut(self.0 as *mut u8, len) }
    }
}

crate::pjrt_entry!(
    /// Destroys the caller's buffer handle; null is allowed. The data stays
    /// while a send or an external reference still holds it.
    buffer_destroy = "PJRT_Buffer_Destroy", PJRT_Buffer_Destroy_Args through buffer, |args| {
    // SAFETY: the caller gives up its owned buffer handle (or null).
    drop(unsafe { owned_arg::<BufferHandle>(args.buffer, "PJRT_Buffer_Destroy", "buffer") }?);
    Ok(())
});

crate::pjrt_entry!(
    /// The buffer's element type.
    buffer_element_type = "PJRT_Buffer_ElementType", PJRT_Buffer_ElementType_Args through type_, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_ElementType", "buffer") }?;
    args.type_ = b.buffer.shape().element_type.raw();
    Ok(())
});

crate::pjrt_entry!(
    /// The buffer's dims, borrowed from the handle (alive until it is destroyed).
    buffer_dimensions = "PJRT_Buffer_Dimensions", PJRT_Buffer_Dimensions_Args through num_dims, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_Dimensions", "buffer") }?;
    args.dims = b.dims.as_ptr();
    args.num_dims = b.dims.len();
    Ok(())
});

crate::pjrt_entry!(
    /// The same dims as `PJRT_Buffer_Dimensions`: buffers are never padded.
    buffer_unpadded_dimensions = "PJRT_Buffer_UnpaddedDimensions", PJRT_Buffer_UnpaddedDimensions_Args through num_dims, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_UnpaddedDimensions", "buffer") }?;
    args.unpadded_dims = b.dims.as_ptr();
    args.num_dims = b.dims.len();
    Ok(())
});

crate::pjrt_entry!(
    /// None: every dimension is static.
    buffer_dynamic_dimension_indices = "PJRT_Buffer_DynamicDimensionIndices", PJRT_Buffer_DynamicDimensionIndices_Args through num_dynamic_dims, |args| {
    // SAFETY: live handle per contract.
    unsafe { buffer_arg(args.buffer, "PJRT_Buffer_DynamicDimensionIndices", "buffer") }?;
    args.dynamic_dim_indices = std::ptr::null();
    args.num_dynamic_dims = 0;
    Ok(())
});

crate::pjrt_entry!(
    /// The dense row-major layout (tiled, no tiles); `minor_to_major` is
    /// borrowed from the handle.
    buffer_get_memory_layout = "PJRT_Buffer_GetMemoryLayout", PJRT_Buffer_GetMemoryLayout_Args through layout, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_GetMemoryLayout", "buffer") }?;
    let mut layout = PJRT_Buffer_MemoryLayout {
        struct_size: PJRT_Buffer_MemoryLayout_STRUCT_SIZE as usize,
        type_: PJRT_Buffer_MemoryLayout_Type_Tiled,
        ..Default::default()
    };
    layout.__bindgen_anon_1.tiled = PJRT_Buffer_MemoryLayout_Tiled {
        struct_size: PJRT_Buffer_MemoryLayout_Tiled_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        minor_to_major: b.minor_to_major.as_ptr(),
        minor_to_major_size: b.minor_to_major.len(),
        tile_dims: std::ptr::null(),
        tile_dim_sizes: std::ptr::null(),
        num_tiles: 0,
    };
    args.layout = layout;
    Ok(())
});

crate::pjrt_entry!(
    /// The size of the buffer's data on its device.
    buffer_on_device_size_in_bytes = "PJRT_Buffer_OnDeviceSizeInBytes", PJRT_Buffer_OnDeviceSizeInBytes_Args through on_device_size_in_bytes, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_OnDeviceSizeInBytes", "buffer") }?;
    args.on_device_size_in_bytes = b.buffer.byte_size();
    Ok(())
});

crate::pjrt_entry!(
    /// The buffer's device, borrowed from its client.
    buffer_device = "PJRT_Buffer_Device", PJRT_Buffer_Device_Args through device, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_Device", "buffer") }?;
    args.device = b.tables.device_ptr(b.buffer.device().global_id);
    Ok(())
});

crate::pjrt_entry!(
    /// The buffer's memory, borrowed from its client.
    buffer_memory = "PJRT_Buffer_Memory", PJRT_Buffer_Memory_Args through memory, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_Memory", "buffer") }?;
    args.memory = b.tables.memory_ptr(&b.buffer.device().memory);
    Ok(())
});

crate::pjrt_entry!(
    /// Releases the data (kept while a read, a send or an external reference
    /// still holds it); the handle stays until `PJRT_Buffer_Destroy`, and later
    /// reads of it are INVALID_ARGUMENT.
    buffer_delete = "PJRT_Buffer_Delete", PJRT_Buffer_Delete_Args through buffer, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_Delete", "buffer") }?;
    b.buffer.delete();
    Ok(())
});

crate::pjrt_entry!(
    /// Whether `PJRT_Buffer_Delete` released the data.
    buffer_is_deleted = "PJRT_Buffer_IsDeleted", PJRT_Buffer_IsDeleted_Args through is_deleted, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_IsDeleted", "buffer") }?;
    args.is_deleted = b.buffer.is_deleted();
    Ok(())
});

crate::pjrt_entry!(
    /// Whether the data is in host memory; true for a deleted buffer, whose
    /// memory cannot be asked.
    buffer_is_on_cpu = "PJRT_Buffer_IsOnCpu", PJRT_Buffer_IsOnCpu_Args through is_on_cpu, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_IsOnCpu", "buffer") }?;
    args.is_on_cpu = b.buffer.allocation("PJRT_Buffer_IsOnCpu").map(|a| a.is_host_memory()).unwrap_or(true);
    Ok(())
});

crate::pjrt_entry!(
    /// An event that is ready when the data is defined (for a receive buffer:
    /// when its transfer finished), carrying that outcome. The caller owns it.
    buffer_ready_event = "PJRT_Buffer_ReadyEvent", PJRT_Buffer_ReadyEvent_Args through event, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_ReadyEvent", "buffer") }?;
    args.event = into_raw(EventHandle::from_future(b.buffer.ready_event("PJRT_Buffer_ReadyEvent")));
    Ok(())
});

/// Starts an asynchronous read of `len` bytes at `offset` into `dst`.
fn read_to_host(
    buffer: &Buffer,
    offset: usize,
    len: usize,
    dst: CallerHostBuffer,
    function: &str,
) -> Result<*mut PJRT_Event> {
    let future = buffer.when_defined(function, move |data| {
        // SAFETY: the caller keeps `dst` writable for `len` bytes until the
        // returned event is ready, which happens after this closure.
        let dst = unsafe { dst.as_slice(len) };
        data.read(offset, dst)
    })?;
    Ok(into_raw(EventHandle::from_future(future)))
}

crate::pjrt_entry!(
    /// Starts copying the whole buffer to `dst`; with `dst` null it only sets
    /// `dst_size`. The caller owns `event` and keeps `dst` writable until it is
    /// ready. INVALID_ARGUMENT when `dst_size` is too small, UNIMPLEMENTED for a
    /// `host_layout` other than dense row-major.
    buffer_to_host_buffer = "PJRT_Buffer_ToHostBuffer", PJRT_Buffer_ToHostBuffer_Args through event, |args| {
    const F: &str = "PJRT_Buffer_ToHostBuffer";
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.src, F, "src") }?;
    let size = b.buffer.byte_size();
    // SAFETY: null or a readable layout.
    unsafe { check_default_layout(args.host_layout, b.buffer.shape(), F) }?;
    if args.dst.is_null() {
        // Size query.
        args.dst_size = size;
        return Ok(());
    }
    if args.dst_size < size {
        return Err(invalid_argument(format!(
            "{F}: dst_size {} is smaller than the buffer's {size} bytes",
            args.dst_size
        )));
    }
    args.event = read_to_host(&b.buffer, 0, size, CallerHostBuffer(args.dst as usize), F)?;
    Ok(())
});

crate::pjrt_entry!(
    /// Starts copying `transfer_size` bytes at `offset` to `dst`. The caller
    /// owns `event` and keeps `dst` writable until it is ready. OUT_OF_RANGE for
    /// bytes outside the buffer.
    buffer_copy_raw_to_host = "PJRT_Buffer_CopyRawToHost", PJRT_Buffer_CopyRawToHost_Args through event, |args| {
    const F: &str = "PJRT_Buffer_CopyRawToHost";
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    let size = b.buffer.byte_size() as i64;
    if args.offset < 0 || args.transfer_size < 0 || args.offset.checked_add(args.transfer_size).is_none_or(|end| end > size) {
        return Err(out_of_range(format!(
            "{F}: offset {} + transfer_size {} is outside the buffer's {size} bytes",
            args.offset, args.transfer_size
        )));
    }
    if args.dst.is_null() && args.transfer_size > 0 {
        return Err(null_field(F, "dst"));
    }
    args.event = read_to_host(
        &b.buffer,
        args.offset as usize,
        args.transfer_size as usize,
        CallerHostBuffer(args.dst as usize),
        F,
    )?;
    Ok(())
});

fn copy_to(
    b: &BufferHandle,
    device: &std::sync::Arc<crate::api::device::Device>,
    function: &str,
) -> Result<*mut PJRT_Buffer> {
    let copy = b.client.copy_buffer(&b.buffer, device, function)?;
    Ok(into_raw(BufferHandle::new(
        copy,
        b.client.clone(),
        b.tables.clone(),
    )))
}

crate::pjrt_entry!(
    /// A copy of the buffer on `dst_device` (a device of the same client); the
    /// caller owns `dst_buffer`.
    buffer_copy_to_device = "PJRT_Buffer_CopyToDevice", PJRT_Buffer_CopyToDevice_Args through dst_buffer, |args| {
    const F: &str = "PJRT_Buffer_CopyToDevice";
    // SAFETY: live handles per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    // SAFETY: live handle per contract.
    let device = unsafe { device_arg(args.dst_device, F, "dst_device") }?;
    args.dst_buffer = copy_to(b, &device.device, F)?;
    Ok(())
});

crate::pjrt_entry!(
    /// A copy of the buffer in `dst_memory` (a memory of the same client); the
    /// caller owns `dst_buffer`.
    buffer_copy_to_memory = "PJRT_Buffer_CopyToMemory", PJRT_Buffer_CopyToMemory_Args through dst_buffer, |args| {
    const F: &str = "PJRT_Buffer_CopyToMemory";
    // SAFETY: live handles per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    // SAFETY: live handle per contract.
    let memory = unsafe { memory_arg(args.dst_memory, F, "dst_memory") }?;
    let device = b.client.device_by_global_id(memory.memory.device_global_id(), F)?.clone();
    args.dst_buffer = copy_to(b, &device, F)?;
    Ok(())
});

crate::pjrt_entry!(
    /// The data's device address, valid while the buffer is alive and not
    /// deleted (or an external reference holds it). INVALID_ARGUMENT once
    /// deleted.
    buffer_unsafe_pointer = "PJRT_Buffer_UnsafePointer", PJRT_Buffer_UnsafePointer_Args through buffer_pointer, |args| {
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, "PJRT_Buffer_UnsafePointer", "buffer") }?;
    args.buffer_pointer = b.buffer.address("PJRT_Buffer_UnsafePointer")?;
    Ok(())
});

crate::pjrt_entry!(
    /// As `PJRT_Buffer_UnsafePointer`, as an opaque pointer.
    buffer_opaque_device_memory_data_pointer = "PJRT_Buffer_OpaqueDeviceMemoryDataPointer", PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args through device_memory_ptr, |args| {
    const F: &str = "PJRT_Buffer_OpaqueDeviceMemoryDataPointer";
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    args.device_memory_ptr = b.buffer.address(F)? as *mut std::ffi::c_void;
    Ok(())
});

crate::pjrt_entry!(
    /// Pins the data for a user outside PJRT (DLPack): `PJRT_Buffer_Delete`
    /// no longer releases it until the count is back to zero. INVALID_ARGUMENT
    /// for a deleted buffer.
    buffer_increase_external_reference_count = "PJRT_Buffer_IncreaseExternalReferenceCount", PJRT_Buffer_IncreaseExternalReferenceCount_Args through buffer, |args| {
    const F: &str = "PJRT_Buffer_IncreaseExternalReferenceCount";
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    b.buffer.increase_external_refs(F)
});

crate::pjrt_entry!(
    /// Drops one external reference. FAILED_PRECONDITION when there is none.
    buffer_decrease_external_reference_count = "PJRT_Buffer_DecreaseExternalReferenceCount", PJRT_Buffer_DecreaseExternalReferenceCount_Args through buffer, |args| {
    const F: &str = "PJRT_Buffer_DecreaseExternalReferenceCount";
    // SAFETY: live handle per contract.
    let b = unsafe { buffer_arg(args.buffer, F, "buffer") }?;
    b.buffer.decrease_external_refs(F)
});
