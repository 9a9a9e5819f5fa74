//! Delegated slots: a client (or device) argument of ours decides. An
//! embedded client's call goes to our entry; a delegating client's goes to
//! the compute plugin with the client, device and memory arguments replaced
//! by the compute plugin's own for the call (and restored after), device ids
//! in compile options mapped to its numbering, and device assignments mapped
//! back to ours.
//!
//! The contract of each entry here: an embedded client's (or device's) is
//! our entry's, UNIMPLEMENTED where we have none; a delegating client's is
//! the compute plugin's function, with its outputs (buffers, executables,
//! events, topologies) owned by the caller as that function says, its
//! device outputs mapped to ours and its error converted to ours.
//! INVALID_ARGUMENT for a null or dead client or device.
#![allow(non_snake_case)]

use std::os::raw::c_char;
use std::ptr::addr_of_mut;
use std::sync::Arc;

use super::{delegating, inner_device, inner_memory, run_dispatch, substitute, Dispatch, Restore};
use crate::api::device_ids::{assigned_devices, map_compile_options, DeviceIdMap};
use crate::api::element_type::ElementType;
use crate::compute_plugin::ComputeClient;
use crate::ffi::args::{array, device_arg, null_field};
use crate::ffi::boundary::checked_args;
use crate::ffi::handles::ClientHandle;
use crate::ffi::{client, device, unimplemented};
use crate::pjrt::bindings::*;
use crate::status::{invalid_argument, Result};

/// Runs a slot whose client field decides: an embedded client → `ours`,
/// a delegating one → `forward` (with the client already substituted).
///
/// # Safety
/// `raw` must be null or the caller's args struct; `client_field` reads its
/// client field, which `required` bytes cover.
unsafe fn client_slot<T>(
    raw: *mut T,
    name: &'static str,
    required: usize,
    client_field: fn(*mut T) -> *mut *mut PJRT_Client,
    ours: unsafe extern "C" fn(*mut T) -> *mut PJRT_Error,
    forward: impl FnOnce(&ClientHandle, &Arc<ComputeClient>) -> Result<()>,
) -> *mut PJRT_Error {
    run_dispatch(name, || {
        // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
        unsafe { checked_args(raw, name, required) }?;
        let field = client_field(raw);
        // SAFETY: a field the caller's struct covers (checked above).
        let (handle, compute) = unsafe { delegating(field.read(), name) }?;
        let Some(compute) = compute else {
            // SAFETY: our entry, with the caller's args.
            return Ok(Dispatch::Ours(unsafe { ours(raw) }));
        };
        // SAFETY: as above; restored when the guard drops.
        let _client = unsafe { substitute(field, compute.raw()) };
        forward(handle, &compute)?;
        Ok(Dispatch::Forwarded)
    })
}

/// Substitutes a device field (if the caller's struct covers it).
///
/// # Safety
/// `field` must be a field of the caller's args struct, or `covered` false.
unsafe fn swap_device(
    field: *mut *mut PJRT_Device,
    covered: bool,
    name: &str,
    what: &str,
) -> Result<Option<super::Restore<*mut PJRT_Device>>> {
    if !covered {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let inner = unsafe { inner_device(field.read(), name, what) }?;
    // SAFETY: as above.
    Ok(Some(unsafe { substitute(field, inner) }))
}

/// Substitutes a memory field (if the caller's struct covers it).
///
/// # Safety
/// `field` must be a field of the caller's args struct, or `covered` false.
unsafe fn swap_memory(
    field: *mut *mut PJRT_Memory,
    covered: bool,
    name: &str,
    what: &str,
) -> Result<Option<super::Restore<*mut PJRT_Memory>>> {
    if !covered {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let inner = unsafe { inner_memory(field.read(), name, what) }?;
    // SAFETY: as above.
    Ok(Some(unsafe { substitute(field, inner) }))
}

/// The delegating client's id map, when it is not the identity.
fn id_map(handle: &ClientHandle) -> Option<DeviceIdMap> {
    let map = DeviceIdMap::new(handle.client.compute_device_ids());
    (!map.is_identity()).then_some(map)
}

/// Compile options with our device ids turned into the compute plugin's,
/// if they differ; `Ok(None)`: pass the caller's bytes as they are. A
/// program on other processes' devices is refused here, with the one error
/// that says why (`api/programs.rs`), before the compute plugin sees it.
///
/// # Safety
/// `options` must point to `size` readable bytes (or be null with size 0).
unsafe fn compile_options_for_inner(
    handle: &ClientHandle,
    options: *const c_char,
    size: usize,
    name: &str,
) -> Result<Option<Vec<u8>>> {
    // SAFETY: forwarded contract.
    let bytes = unsafe { array(options as *const u8, size, name, "compile_options") }?;
    if bytes.is_empty() {
        return Ok(None);
    }
    let assigned =
        assigned_devices(bytes).map_err(|e| invalid_argument(format!("{name}: {}", e.message)))?;
    handle.client.check_program_runs_here(&assigned, name)?;
    let Some(map) = id_map(handle) else {
        return Ok(None);
    };
    map_compile_options(bytes, &|id| map.to_inner(id))
        .map(Some)
        .map_err(|e| invalid_argument(format!("{name}: {}", e.message)))
}

/// The caller's compile options in the compute plugin's numbering, in
/// place for the forwarded call: the bytes, and the two fields' guards
/// (dropped first, so the fields are restored before the bytes are freed).
struct SwappedOptions {
    _fields: (Restore<*const c_char>, Restore<usize>),
    _bytes: Vec<u8>,
}

/// Puts `compile_options_for_inner`'s bytes, where they differ, into the
/// caller's `options`/`size` fields until the result drops.
///
/// # Safety
/// `options` and `size` must be the fields of the caller's args struct,
/// describing readable bytes.
unsafe fn swap_compile_options(
    handle: &ClientHandle,
    options: *mut *const c_char,
    size: *mut usize,
    name: &str,
) -> Result<Option<SwappedOptions>> {
    // SAFETY: forwarded contract.
    let Some(bytes) = (unsafe { compile_options_for_inner(handle, *options, *size, name) })? else {
        return Ok(None);
    };
    // SAFETY: the caller's fields; restored when the guards drop, before
    // `bytes` is freed.
    let fields = unsafe {
        (
            substitute(options, bytes.as_ptr() as *const c_char),
            substitute(size, bytes.len()),
        )
    };
    Ok(Some(SwappedOptions {
        _fields: fields,
        _bytes: bytes,
    }))
}

/// The address of a field of the caller's args (no dereference).
macro_rules! field_ptr {
    ($raw:expr, $args:ident . $field:ident) => {
        $raw.cast::<u8>()
            .wrapping_add(std::mem::offset_of!($args, $field))
            .cast()
    };
}

macro_rules! client_field {
    ($args:ident) => {
        |raw: *mut $args| -> *mut *mut PJRT_Client { field_ptr!(raw, $args.client) }
    };
}

/// A slot whose client field decides (see `client_slot`): `ours` for an
/// embedded client; for a delegating one, `forward` (by default the compute
/// plugin's function with the caller's args, after `prepare`'s checks and
/// substitutions) once the client is substituted. `F` is the slot's name
/// inside `forward` and `prepare`.
macro_rules! client_forward {
    ($(#[$meta:meta])* $slot:ident($raw:ident: $args:ident through $through:ident), ours $ours:path) => {
        client_forward!(
            $(#[$meta])* $slot($raw: $args through $through), ours $ours,
            forward |_, compute| { crate::inner_call!(compute.plugin().as_ref(), $slot, $raw) }
        );
    };
    ($(#[$meta:meta])* $slot:ident($raw:ident: $args:ident through $through:ident), ours $ours:path,
     prepare { $($prepare:tt)* }) => {
        client_forward!(
            $(#[$meta])* $slot($raw: $args through $through), ours $ours,
            forward |_, compute| {
                $($prepare)*
                crate::inner_call!(compute.plugin().as_ref(), $slot, $raw)
            }
        );
    };
    ($(#[$meta:meta])* $slot:ident($raw:ident: $args:ident through $through:ident), ours $ours:path,
     forward |$handle:tt, $compute:tt| { $($body:tt)* }) => {
        $(#[$meta])*
        pub(crate) unsafe extern "C" fn $slot($raw: *mut $args) -> *mut PJRT_Error {
            const F: &str = stringify!($slot);
            let required = crate::struct_size_through!($args, $through);
            let forward = |$handle: &ClientHandle, $compute: &Arc<ComputeClient>| -> Result<()> { $($body)* };
            // SAFETY: the caller's args struct; `client_slot` checks it before
            // `forward` reads any field.
            unsafe { client_slot($raw, F, required, client_field!($args), $ours, forward) }
        }
    };
}

client_forward!(
    /// Compiles on the compute plugin (device ids mapped where they differ).
    PJRT_Client_Compile(raw: PJRT_Client_Compile_Args through compile_options_size),
    ours unimplemented::PJRT_Client_Compile,
    forward |handle, compute| {
        let options = addr_of_mut!((*raw).compile_options);
        let size = addr_of_mut!((*raw).compile_options_size);
        let _options = swap_compile_options(handle, options, size, F)?;
        crate::inner_call!(compute.plugin().as_ref(), PJRT_Client_Compile, raw)
    }
);

client_forward!(
    /// The compute plugin's default assignment, in our device ids.
    PJRT_Client_DefaultDeviceAssignment(raw: PJRT_Client_DefaultDeviceAssignment_Args through default_assignment),
    ours unimplemented::PJRT_Client_DefaultDeviceAssignment,
    forward |handle, compute| {
        crate::inner_call!(
            compute.plugin().as_ref(),
            PJRT_Client_DefaultDeviceAssignment,
            raw
        )?;
        let (Some(map), false) = (id_map(handle), (*raw).default_assignment.is_null()) else {
            return Ok(());
        };
        let ids = std::slice::from_raw_parts_mut(
            (*raw).default_assignment,
            (*raw).default_assignment_size,
        );
        for id in ids {
            *id = map.to_ours(*id as i64)? as i32;
        }
        Ok(())
    }
);

client_forward!(
    /// Host data onto a device or memory of the compute plugin.
    PJRT_Client_BufferFromHostBuffer(raw: PJRT_Client_BufferFromHostBuffer_Args through buffer),
    ours client::client_buffer_from_host_buffer,
    prepare {
        // XLA aborts the process on an unknown element type.
        ElementType::from_raw((*raw).type_, F)?;
        // Zero-copy is a permission, not an order: JAX asks a platform it
        // does not know as CPU for it with numpy arrays the program may
        // still change, and XLA's CPU plugin would alias them (measured,
        // JAX 0.10.2 and 0.12). The bytes are copied, as JAX's own CPU
        // backend does.
        let _semantics = ((*raw).host_buffer_semantics
            == PJRT_HostBufferSemantics_kImmutableZeroCopy)
            .then(|| {
                substitute(
                    addr_of_mut!((*raw).host_buffer_semantics),
                    PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes,
                )
            });
        if (*raw).num_dims > 0 && (*raw).dims.is_null() {
            return Err(null_field(F, "dims"));
        }
        let _device = swap_device(addr_of_mut!((*raw).device), true, F, "device")?;
        let _memory = swap_memory(addr_of_mut!((*raw).memory), true, F, "memory")?;
    }
);

client_forward!(
    /// Loads a serialized executable on the compute plugin.
    PJRT_Executable_DeserializeAndLoad(raw: PJRT_Executable_DeserializeAndLoad_Args through loaded_executable),
    ours unimplemented::PJRT_Executable_DeserializeAndLoad
);

client_forward!(
    /// A compute plugin buffer viewing memory the caller owns.
    PJRT_Client_CreateViewOfDeviceBuffer(raw: PJRT_Client_CreateViewOfDeviceBuffer_Args through buffer),
    ours unimplemented::PJRT_Client_CreateViewOfDeviceBuffer,
    prepare {
        ElementType::from_raw((*raw).element_type, F)?;
        let covers_memory =
            crate::has_field!(*raw, PJRT_Client_CreateViewOfDeviceBuffer_Args, memory);
        let _device = swap_device(addr_of_mut!((*raw).device), true, F, "device")?;
        let _memory = swap_memory(addr_of_mut!((*raw).memory), covers_memory, F, "memory")?;
    }
);

client_forward!(
    /// The compute plugin's topology of this process's devices.
    PJRT_Client_TopologyDescription(raw: PJRT_Client_TopologyDescription_Args through topology),
    ours unimplemented::PJRT_Client_TopologyDescription
);

client_forward!(
    /// The compute plugin's asynchronous host-to-device transfer manager.
    PJRT_Client_CreateBuffersForAsyncHostToDevice(raw: PJRT_Client_CreateBuffersForAsyncHostToDevice_Args through transfer_manager),
    ours unimplemented::PJRT_Client_CreateBuffersForAsyncHostToDevice,
    prepare {
        let _memory = swap_memory(addr_of_mut!((*raw).memory), true, F, "memory")?;
    }
);

client_forward!(
    /// Registers host memory for DMA with the compute plugin.
    PJRT_Client_DmaMap(raw: PJRT_Client_DmaMap_Args through size),
    ours unimplemented::PJRT_Client_DmaMap
);

client_forward!(
    /// Unregisters host memory registered with `PJRT_Client_DmaMap`.
    PJRT_Client_DmaUnmap(raw: PJRT_Client_DmaUnmap_Args through data),
    ours unimplemented::PJRT_Client_DmaUnmap
);

client_forward!(
    /// An uninitialized compute plugin buffer on a device or memory.
    PJRT_Client_CreateUninitializedBuffer(raw: PJRT_Client_CreateUninitializedBuffer_Args through buffer),
    ours unimplemented::PJRT_Client_CreateUninitializedBuffer,
    prepare {
        ElementType::from_raw((*raw).shape_element_type, F)?;
        let _device = swap_device(addr_of_mut!((*raw).device), true, F, "device")?;
        let _memory = swap_memory(addr_of_mut!((*raw).memory), true, F, "memory")?;
    }
);

client_forward!(
    /// An alias buffer of the compute plugin.
    PJRT_Client_CreateAliasBuffer(raw: PJRT_Client_CreateAliasBuffer_Args through fulfill_alias_buffer_cb),
    ours unimplemented::PJRT_Client_CreateAliasBuffer,
    prepare {
        ElementType::from_raw((*raw).shape_element_type, F)?;
        let _memory = swap_memory(addr_of_mut!((*raw).memory), true, F, "memory")?;
    }
);

client_forward!(
    /// Fulfils an alias buffer of the compute plugin.
    PJRT_Client_FulfillAliasBuffer(raw: PJRT_Client_FulfillAliasBuffer_Args through fulfill_alias_buffer_cb),
    ours unimplemented::PJRT_Client_FulfillAliasBuffer,
    prepare {
        super::require_compute_buffer((*raw).buffer, F, "buffer")?;
    }
);

client_forward!(
    /// A compute plugin buffer that carries an error.
    PJRT_Client_CreateErrorBuffer(raw: PJRT_Client_CreateErrorBuffer_Args through buffer),
    ours unimplemented::PJRT_Client_CreateErrorBuffer,
    prepare {
        ElementType::from_raw((*raw).shape_element_type, F)?;
        let _memory = swap_memory(addr_of_mut!((*raw).memory), true, F, "memory")?;
    }
);

client_forward!(
    /// Loads a compiled executable on the compute plugin.
    PJRT_Client_Load(raw: PJRT_Client_Load_Args through loaded_executable),
    ours unimplemented::PJRT_Client_Load,
    forward |handle, compute| {
        let options = addr_of_mut!((*raw).compile_options);
        let size = addr_of_mut!((*raw).compile_options_size);
        let _options = swap_compile_options(handle, options, size, F)?;
        crate::inner_call!(compute.plugin().as_ref(), PJRT_Client_Load, raw)
    }
);

/// Compiles against a topology; the client, when given, is ours.
pub(crate) unsafe extern "C" fn PJRT_Compile(raw: *mut PJRT_Compile_Args) -> *mut PJRT_Error {
    const F: &str = "PJRT_Compile";
    run_dispatch(F, || {
        let required = crate::struct_size_through!(PJRT_Compile_Args, executable);
        // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
        let topology = unsafe { checked_args(raw, F, required) }?.topology;
        // SAFETY: the topology is the compute plugin's (we make none).
        let Some(plugin) = (unsafe { super::foreign_only(topology.cast(), F, "topology") })? else {
            // SAFETY: the UNIMPLEMENTED entry, with the caller's args.
            return Ok(Dispatch::Ours(unsafe { unimplemented::PJRT_Compile(raw) }));
        };
        // SAFETY: a field the caller's struct covers.
        let client = unsafe { (*raw).client };
        let _client = if client.is_null() {
            None
        } else {
            // SAFETY: a live client per the contract.
            let (_, compute) = unsafe { delegating(client, F) }?;
            let compute = compute.ok_or_else(|| {
                invalid_argument(format!(
                    "{F}: client is an embedded crosshost client, it cannot load programs"
                ))
            })?;
            // SAFETY: restored when the guard drops.
            Some(unsafe { substitute(addr_of_mut!((*raw).client), compute.raw()) })
        };
        crate::inner_call!(plugin.as_ref(), PJRT_Compile, raw)?;
        Ok(Dispatch::Forwarded)
    })
}

/// Runs a slot whose device field decides: an embedded client's device →
/// `ours`, a delegating client's → the compute plugin with its device.
///
/// # Safety
/// As `client_slot`, for the device field.
unsafe fn device_slot<T>(
    raw: *mut T,
    name: &'static str,
    required: usize,
    device_field: fn(*mut T) -> *mut *mut PJRT_Device,
    ours: unsafe extern "C" fn(*mut T) -> *mut PJRT_Error,
    forward: impl FnOnce(&Arc<crate::compute_plugin::ComputePlugin>) -> Result<()>,
) -> *mut PJRT_Error {
    run_dispatch(name, || {
        // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
        unsafe { checked_args(raw, name, required) }?;
        let field = device_field(raw);
        // SAFETY: a field the caller's struct covers (checked above).
        let device = unsafe { device_arg(field.read(), name, "device") }?;
        let (Some(inner), Some(plugin)) =
            (device.compute_device(), crate::compute_plugin::loaded())
        else {
            // SAFETY: our entry, with the caller's args.
            return Ok(Dispatch::Ours(unsafe { ours(raw) }));
        };
        // SAFETY: as above; restored when the guard drops.
        let _device = unsafe { substitute(field, inner) };
        forward(&plugin)?;
        Ok(Dispatch::Forwarded)
    })
}

macro_rules! device_field {
    ($args:ident) => {
        |raw: *mut $args| -> *mut *mut PJRT_Device { field_ptr!(raw, $args.device) }
    };
}

macro_rules! device_forward {
    ($(#[$meta:meta])* $slot:ident, $args:ident through $through:ident, ours $ours:path) => {
        $(#[$meta])*
        pub(crate) unsafe extern "C" fn $slot(raw: *mut $args) -> *mut PJRT_Error {
            let required = crate::struct_size_through!($args, $through);
            let forward = |plugin: &Arc<crate::compute_plugin::ComputePlugin>| {
                crate::inner_call!(plugin.as_ref(), $slot, raw)
            };
            // SAFETY: the caller's args struct; `device_slot` checks it.
            unsafe { device_slot(raw, stringify!($slot), required, device_field!($args), $ours, forward) }
        }
    };
}

device_forward!(
    /// The compute plugin's memory statistics of its device.
    PJRT_Device_MemoryStats, PJRT_Device_MemoryStats_Args through bytes_in_use, ours device::device_memory_stats
);
device_forward!(
    /// Poisons executions on the compute plugin's device.
    PJRT_Device_PoisonExecution, PJRT_Device_PoisonExecution_Args through device, ours unimplemented::PJRT_Device_PoisonExecution
);
device_forward!(
    /// A tracking event of the compute plugin's device.
    PJRT_Device_CreateAsyncTrackingEvent, PJRT_Device_CreateAsyncTrackingEvent_Args through event, ours unimplemented::PJRT_Device_CreateAsyncTrackingEvent
);
device_forward!(
    /// Clears the compute plugin's memory statistics of its device.
    PJRT_Device_ClearMemoryStats, PJRT_Device_ClearMemoryStats_Args through device, ours unimplemented::PJRT_Device_ClearMemoryStats
);

macro_rules! delegated_table {
    ($( $slot:ident ( $args:ident . $field:ident ) ),* $(,)?) => {
        /// `(slot, offset of the deciding client/device field)` of every
        /// delegated slot, for the table's test.
        pub(crate) const DELEGATED: &[(&str, usize)] = &[
            $( (stringify!($slot), std::mem::offset_of!($args, $field)) ),*
        ];

        pub(crate) fn install(api: &mut PJRT_Api) {
            $( api.$slot = Some($slot); )*
        }
    };
}

delegated_table! {
    PJRT_Client_Compile(PJRT_Client_Compile_Args.client),
    PJRT_Client_DefaultDeviceAssignment(PJRT_Client_DefaultDeviceAssignment_Args.client),
    PJRT_Client_BufferFromHostBuffer(PJRT_Client_BufferFromHostBuffer_Args.client),
    PJRT_Executable_DeserializeAndLoad(PJRT_Executable_DeserializeAndLoad_Args.client),
    PJRT_Client_CreateViewOfDeviceBuffer(PJRT_Client_CreateViewOfDeviceBuffer_Args.client),
    PJRT_Client_TopologyDescription(PJRT_Client_TopologyDescription_Args.client),
    PJRT_Client_CreateBuffersForAsyncHostToDevice(PJRT_Client_CreateBuffersForAsyncHostToDevice_Args.client),
    PJRT_Client_DmaMap(PJRT_Client_DmaMap_Args.client),
    PJRT_Client_DmaUnmap(PJRT_Client_DmaUnmap_Args.client),
    PJRT_Client_CreateUninitializedBuffer(PJRT_Client_CreateUninitializedBuffer_Args.client),
    PJRT_Client_CreateAliasBuffer(PJRT_Client_CreateAliasBuffer_Args.client),
    PJRT_Client_FulfillAliasBuffer(PJRT_Client_FulfillAliasBuffer_Args.client),
    PJRT_Client_CreateErrorBuffer(PJRT_Client_CreateErrorBuffer_Args.client),
    PJRT_Client_Load(PJRT_Client_Load_Args.client),
    PJRT_Compile(PJRT_Compile_Args.client),
    PJRT_Device_MemoryStats(PJRT_Device_MemoryStats_Args.device),
    PJRT_Device_PoisonExecution(PJRT_Device_PoisonExecution_Args.device),
    PJRT_Device_CreateAsyncTrackingEvent(PJRT_Device_CreateAsyncTrackingEvent_Args.device),
    PJRT_Device_ClearMemoryStats(PJRT_Device_ClearMemoryStats_Args.device),
}
