//! Routed slots whose arguments or results need translating on the way: a
//! device or memory (ours ↔ the compute plugin's), a callback that receives
//! a compute plugin error (converted to ours before the caller sees it),
//! device ids in what the compute plugin returns.
#![allow(non_snake_case)]

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::addr_of_mut;
use std::sync::Arc;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::{
    foreign_only, inner_device, inner_memory, our_device, our_memory, require_compute_buffer,
    run_dispatch, substitute, Dispatch,
};
use crate::api::device_ids::{map_compile_options, map_device_assignment, DeviceIdMap};
use crate::compute_plugin::{self, take_inner_error, ComputePlugin, InnerPtr};
use crate::ffi::args::null_field;
use crate::ffi::boundary::checked_args;
use crate::ffi::errors::error_into_raw;
use crate::ffi::handles::{route, BufferHandle, Castable, EventHandle, Route};
use crate::ffi::{buffer, events, unimplemented};
use crate::pjrt::bindings::*;
use crate::status::Result;

/// Routes on an event/buffer field like `routed.rs`, then runs `forward`
/// for the compute plugin's handle.
macro_rules! routed_with {
    ($slot:ident, $args:ident . $field:ident : $H:ty => $ours:path, |$raw:ident, $plugin:ident| $forward:block) => {
        /// Routed by its handle argument, as in `routed.rs` (our entry's
        /// contract, or the compute plugin's function with its error
        /// converted to ours); the module doc says what is translated.
        pub(crate) unsafe extern "C" fn $slot($raw: *mut $args) -> *mut PJRT_Error {
            const NAME: &str = stringify!($slot);
            run_dispatch(NAME, || {
                let required = crate::struct_size_through!($args, $field);
                // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
                let handle = unsafe { checked_args($raw, NAME, required) }?.$field;
                if handle.is_null() && NAME.ends_with("_Destroy") {
                    return Ok(Dispatch::Forwarded); // destroying nullptr is allowed
                }
                // SAFETY: a live handle (ours or the compute plugin's).
                let whose = unsafe {
                    route::<$H>(
                        handle as *const <$H as Castable>::C,
                        NAME,
                        stringify!($field),
                    )
                }?;
                let $plugin: Arc<ComputePlugin> = match whose {
                    // SAFETY: our entry, with the caller's args.
                    Route::Ours(_) => return Ok(Dispatch::Ours(unsafe { $ours($raw) })),
                    Route::Compute(plugin) => plugin,
                };
                let forward = || -> Result<()> { $forward };
                forward().map(|()| Dispatch::Forwarded)
            })
        }
    };
}

/// As `routed_with!` for handle types that are always the compute plugin's.
macro_rules! foreign_with {
    ($slot:ident, $args:ident . $field:ident, |$raw:ident, $plugin:ident| $forward:block) => {
        /// The compute plugin's handle type, as in `routed.rs` (its
        /// function's contract, its error converted to ours; UNIMPLEMENTED
        /// without a compute plugin); the module doc says what is translated.
        pub(crate) unsafe extern "C" fn $slot($raw: *mut $args) -> *mut PJRT_Error {
            const NAME: &str = stringify!($slot);
            run_dispatch(NAME, || {
                let required = crate::struct_size_through!($args, $field);
                // SAFETY: the PJRT contract; `checked_args` rejects null and short structs.
                let handle = unsafe { checked_args($raw, NAME, required) }?.$field;
                if handle.is_null() && NAME.ends_with("_Destroy") {
                    return Ok(Dispatch::Forwarded); // destroying nullptr is allowed
                }
                // SAFETY: a live handle of the compute plugin.
                let Some($plugin) =
                    (unsafe { foreign_only(handle as *const _, NAME, stringify!($field)) })?
                else {
                    // SAFETY: the UNIMPLEMENTED entry, with the caller's args.
                    return Ok(Dispatch::Ours(unsafe { unimplemented::$slot($raw) }));
                };
                let forward = || -> Result<()> { $forward };
                forward().map(|()| Dispatch::Forwarded)
            })
        }
    };
}

// ---------------------------------- events -----------------------------------

/// The caller's callback for a compute plugin event.
struct ForwardedOnReady {
    plugin: Arc<ComputePlugin>,
    callback: unsafe extern "C" fn(*mut PJRT_Error, *mut c_void),
    user_arg: usize,
}

/// The callback we register with the compute plugin for its event: converts
/// its error to ours and calls the caller's callback with it, once.
unsafe extern "C" fn forwarded_on_ready(error: *mut PJRT_Error, user_arg: *mut c_void) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the box `PJRT_Event_OnReady` leaked for this one callback.
        let state = unsafe { Box::from_raw(user_arg as *mut ForwardedOnReady) };
        let ours = match take_inner_error(&state.plugin, error) {
            None => std::ptr::null_mut(),
            Some(status) => error_into_raw(status),
        };
        // SAFETY: the caller's callback; it takes ownership of our error.
        unsafe { (state.callback)(ours, state.user_arg as *mut c_void) };
    }));
}

routed_with!(PJRT_Event_OnReady, PJRT_Event_OnReady_Args.event: EventHandle => events::event_on_ready, |raw, plugin| {
    // SAFETY: fields the caller's struct covers (`checked_args` checked the size).
    let callback = unsafe { (*raw).callback }
        .ok_or_else(|| null_field("PJRT_Event_OnReady", "callback"))?;
    let state = Box::into_raw(Box::new(ForwardedOnReady {
        plugin: plugin.clone(),
        callback,
        // SAFETY: as above.
        user_arg: unsafe { (*raw).user_arg } as usize,
    }));
    // SAFETY: restored when the guards drop.
    let _callback = unsafe { substitute(addr_of_mut!((*raw).callback), Some(forwarded_on_ready)) };
    // SAFETY: as above.
    let _user_arg = unsafe { substitute(addr_of_mut!((*raw).user_arg), state as *mut c_void) };
    let registered = crate::inner_call!(plugin.as_ref(), PJRT_Event_OnReady, raw);
    if registered.is_err() {
        // Not registered: the callback never runs, the state is ours.
        // SAFETY: leaked above and handed to no one.
        drop(unsafe { Box::from_raw(state) });
    }
    registered
});

// ---------------------------------- buffers ----------------------------------

routed_with!(PJRT_Buffer_Device, PJRT_Buffer_Device_Args.buffer: BufferHandle => buffer::buffer_device, |raw, plugin| {
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_Device, raw)?;
    // SAFETY: the output field the caller's struct covers.
    unsafe { (*raw).device = our_device((*raw).device, "PJRT_Buffer_Device")? };
    Ok(())
});

routed_with!(PJRT_Buffer_Memory, PJRT_Buffer_Memory_Args.buffer: BufferHandle => buffer::buffer_memory, |raw, plugin| {
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_Memory, raw)?;
    // SAFETY: the output field the caller's struct covers.
    unsafe { (*raw).memory = our_memory((*raw).memory, "PJRT_Buffer_Memory")? };
    Ok(())
});

routed_with!(PJRT_Buffer_CopyToDevice, PJRT_Buffer_CopyToDevice_Args.buffer: BufferHandle => buffer::buffer_copy_to_device, |raw, plugin| {
    const F: &str = "PJRT_Buffer_CopyToDevice";
    // SAFETY: a field the caller's struct covers.
    compute_plugin::check_receive(unsafe { (*raw).buffer }, F)?;
    // SAFETY: a field the caller's struct covers; restored by the guard.
    let _device = unsafe {
        let inner = inner_device((*raw).dst_device, F, "dst_device")?;
        if inner.is_null() {
            return Err(null_field(F, "dst_device"));
        }
        substitute(addr_of_mut!((*raw).dst_device), inner)
    };
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_CopyToDevice, raw)
});

routed_with!(PJRT_Buffer_CopyToMemory, PJRT_Buffer_CopyToMemory_Args.buffer: BufferHandle => buffer::buffer_copy_to_memory, |raw, plugin| {
    const F: &str = "PJRT_Buffer_CopyToMemory";
    // SAFETY: a field the caller's struct covers.
    compute_plugin::check_receive(unsafe { (*raw).buffer }, F)?;
    // SAFETY: a field the caller's struct covers; restored by the guard.
    let _memory = unsafe {
        let inner = inner_memory((*raw).dst_memory, F, "dst_memory")?;
        if inner.is_null() {
            return Err(null_field(F, "dst_memory"));
        }
        substitute(addr_of_mut!((*raw).dst_memory), inner)
    };
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_CopyToMemory, raw)
});

/// Forwarders that ask `compute_plugin/receives.rs` first: a receive buffer
/// gives its memory only once its receive succeeded (`await_receive`
/// waits), and a failed one answers with the transfer's status
/// (`check_receive` for the asynchronous calls): XLA's CPU plugin aborts
/// the process when the memory of such a buffer is asked for.
macro_rules! after_receive {
    ($($slot:ident($args:ident . $field:ident) => $ours:path, $guard:ident;)*) => {$(
        routed_with!($slot, $args.$field: BufferHandle => $ours, |raw, plugin| {
            // SAFETY: a field the caller's struct covers.
            compute_plugin::$guard(unsafe { (*raw).$field }, stringify!($slot))?;
            crate::inner_call!(plugin.as_ref(), $slot, raw)
        });
    )*};
}

after_receive! {
    PJRT_Buffer_IncreaseExternalReferenceCount(PJRT_Buffer_IncreaseExternalReferenceCount_Args.buffer) => buffer::buffer_increase_external_reference_count, await_receive;
    PJRT_Buffer_OpaqueDeviceMemoryDataPointer(PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args.buffer) => buffer::buffer_opaque_device_memory_data_pointer, await_receive;
    PJRT_Buffer_UnsafePointer(PJRT_Buffer_UnsafePointer_Args.buffer) => buffer::buffer_unsafe_pointer, await_receive;
    PJRT_Buffer_ToHostBuffer(PJRT_Buffer_ToHostBuffer_Args.src) => buffer::buffer_to_host_buffer, check_receive;
    PJRT_Buffer_CopyRawToHost(PJRT_Buffer_CopyRawToHost_Args.buffer) => buffer::buffer_copy_raw_to_host, check_receive;
}

// A buffer being sent is held: its destroy or delete waits for the send
// (`compute_plugin/holds.rs`).
routed_with!(PJRT_Buffer_Destroy, PJRT_Buffer_Destroy_Args.buffer: BufferHandle => buffer::buffer_destroy, |raw, plugin| {
    // SAFETY: a field the caller's struct covers.
    compute_plugin::forget_receive(unsafe { (*raw).buffer });
    // SAFETY: as above.
    if compute_plugin::defer_destroy(unsafe { (*raw).buffer }) {
        return Ok(());
    }
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_Destroy, raw)
});

routed_with!(PJRT_Buffer_Delete, PJRT_Buffer_Delete_Args.buffer: BufferHandle => buffer::buffer_delete, |raw, plugin| {
    // SAFETY: a field the caller's struct covers.
    if compute_plugin::defer_delete(unsafe { (*raw).buffer }) {
        return Ok(());
    }
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_Delete, raw)
});

routed_with!(PJRT_Buffer_IsDeleted, PJRT_Buffer_IsDeleted_Args.buffer: BufferHandle => buffer::buffer_is_deleted, |raw, plugin| {
    // SAFETY: fields the caller's struct covers.
    unsafe {
        if compute_plugin::delete_deferred((*raw).buffer) {
            (*raw).is_deleted = true;
            return Ok(());
        }
    }
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_IsDeleted, raw)
});

// -------------------------------- executables --------------------------------

/// Our device arrays handed out for each executable (device handle
/// addresses), freed with it.
static EXECUTABLE_DEVICES: Lazy<Mutex<HashMap<InnerPtr, Vec<usize>>>> = Lazy::new(Default::default);

foreign_with!(
    PJRT_LoadedExecutable_AddressableDevices,
    PJRT_LoadedExecutable_AddressableDevices_Args.executable,
    |raw, plugin| {
        const F: &str = "PJRT_LoadedExecutable_AddressableDevices";
        crate::inner_call!(
            plugin.as_ref(),
            PJRT_LoadedExecutable_AddressableDevices,
            raw
        )?;
        // SAFETY: the output fields the caller's struct covers; the inner array
        // holds `num_addressable_devices` entries.
        let ours = unsafe {
            let count = (*raw).num_addressable_devices;
            let inner = (*raw).addressable_devices;
            let inner = if count == 0 || inner.is_null() {
                &[][..]
            } else {
                std::slice::from_raw_parts(inner, count)
            };
            inner
                .iter()
                .map(|&d| our_device(d, F).map(|p| p as usize))
                .collect::<Result<Vec<usize>>>()?
        };
        let mut cache = EXECUTABLE_DEVICES.lock();
        // SAFETY: as above.
        let key = InnerPtr::from(unsafe { (*raw).executable });
        let stored = cache.entry(key).or_default();
        *stored = ours;
        // SAFETY: as above; the array (addresses, laid out as pointers) lives
        // until the executable is destroyed.
        unsafe { (*raw).addressable_devices = stored.as_ptr() as *const *mut PJRT_Device };
        Ok(())
    }
);

foreign_with!(
    PJRT_LoadedExecutable_Destroy,
    PJRT_LoadedExecutable_Destroy_Args.executable,
    |raw, plugin| {
        // SAFETY: a field the caller's struct covers.
        let key = InnerPtr::from(unsafe { (*raw).executable });
        crate::inner_call!(plugin.as_ref(), PJRT_LoadedExecutable_Destroy, raw)?;
        EXECUTABLE_DEVICES.lock().remove(&key);
        Ok(())
    }
);

foreign_with!(
    PJRT_LoadedExecutable_Execute,
    PJRT_LoadedExecutable_Execute_Args.executable,
    |raw, plugin| {
        const F: &str = "PJRT_LoadedExecutable_Execute";
        let has_device = crate::has_field!(
            // SAFETY: the caller's struct, checked by `args`.
            unsafe { &*raw },
            PJRT_LoadedExecutable_Execute_Args,
            execute_device
        );
        // SAFETY: fields the caller's struct covers; the argument lists hold
        // `num_devices` lists of `num_args` buffers each.
        let _device = unsafe {
            let lists = (*raw).argument_lists;
            if !lists.is_null() {
                for d in 0..(*raw).num_devices {
                    let list = *lists.add(d);
                    if list.is_null() {
                        continue;
                    }
                    for a in 0..(*raw).num_args {
                        let argument = *list.add(a);
                        require_compute_buffer(argument, F, "argument_lists")?;
                        // A failed receive: its own status, not the
                        // plugin's INTERNAL from inside the execution.
                        compute_plugin::check_receive(argument, F)?;
                    }
                }
            }
            if has_device && !(*raw).execute_device.is_null() {
                let inner = inner_device((*raw).execute_device, F, "execute_device")?;
                Some(substitute(addr_of_mut!((*raw).execute_device), inner))
            } else {
                None
            }
        };
        crate::inner_call!(plugin.as_ref(), PJRT_LoadedExecutable_Execute, raw)
    }
);

/// The id map of this process's delegating clients, where it is not the
/// identity (a compute plugin that numbers its devices from 0).
fn process_id_map() -> Option<DeviceIdMap> {
    crate::ffi::live_clients::live_clients()
        .iter()
        .map(|c| DeviceIdMap::new(c.compute_device_ids()))
        .find(|m| !m.is_identity())
}

/// Serialized bytes we rewrote, handed out with our deleter.
struct Rewritten(Vec<u8>);

/// Deleter of a device assignment we rewrote.
unsafe extern "C" fn free_rewritten_assignment(backing: *mut PJRT_DeviceAssignmentSerialized) {
    // SAFETY: made by Box::into_raw of a `Rewritten` below.
    drop(unsafe { Box::from_raw(backing as *mut Rewritten) });
}

/// Deleter of compile options we rewrote.
unsafe extern "C" fn free_rewritten_options(backing: *mut PJRT_SerializedCompileOptions) {
    // SAFETY: made by Box::into_raw of a `Rewritten` below.
    drop(unsafe { Box::from_raw(backing as *mut Rewritten) });
}

/// Copies the compute plugin's serialized output through `rewrite`, frees
/// its backing object and returns ours.
fn rewritten(
    bytes: *const std::os::raw::c_char,
    size: usize,
    rewrite: impl FnOnce(&[u8]) -> Result<Vec<u8>>,
) -> Result<*mut Rewritten> {
    let slice = if bytes.is_null() || size == 0 {
        &[][..]
    } else {
        // SAFETY: the plugin's output bytes, valid while its backing lives.
        unsafe { std::slice::from_raw_parts(bytes as *const u8, size) }
    };
    Ok(Box::into_raw(Box::new(Rewritten(rewrite(slice)?))))
}

foreign_with!(
    PJRT_LoadedExecutable_GetDeviceAssignment,
    PJRT_LoadedExecutable_GetDeviceAssignment_Args.executable,
    |raw, plugin| {
        crate::inner_call!(
            plugin.as_ref(),
            PJRT_LoadedExecutable_GetDeviceAssignment,
            raw
        )?;
        let Some(map) = process_id_map() else {
            return Ok(());
        };
        // SAFETY: the output fields the caller's struct covers.
        unsafe {
            let ours = rewritten((*raw).serialized_bytes, (*raw).serialized_bytes_size, |b| {
                map_device_assignment(b, &|id| map.to_ours(id))
            })?;
            if let Some(deleter) = (*raw).serialized_device_assignment_deleter {
                deleter((*raw).serialized_device_assignment);
            }
            (*raw).serialized_bytes = (*ours).0.as_ptr() as *const _;
            (*raw).serialized_bytes_size = (*ours).0.len();
            (*raw).serialized_device_assignment = ours as *mut PJRT_DeviceAssignmentSerialized;
            (*raw).serialized_device_assignment_deleter = Some(free_rewritten_assignment);
        }
        Ok(())
    }
);

foreign_with!(
    PJRT_Executable_GetCompileOptions,
    PJRT_Executable_GetCompileOptions_Args.executable,
    |raw, plugin| {
        crate::inner_call!(plugin.as_ref(), PJRT_Executable_GetCompileOptions, raw)?;
        let Some(map) = process_id_map() else {
            return Ok(());
        };
        // SAFETY: the output fields the caller's struct covers.
        unsafe {
            let ours = rewritten((*raw).serialized_bytes, (*raw).serialized_bytes_size, |b| {
                map_compile_options(b, &|id| map.to_ours(id))
            })?;
            if let Some(deleter) = (*raw).serialized_compile_options_deleter {
                deleter((*raw).serialized_compile_options);
            }
            (*raw).serialized_bytes = (*ours).0.as_ptr() as *const _;
            (*raw).serialized_bytes_size = (*ours).0.len();
            (*raw).serialized_compile_options = ours as *mut PJRT_SerializedCompileOptions;
            (*raw).serialized_compile_options_deleter = Some(free_rewritten_options);
        }
        Ok(())
    }
);

foreign_with!(
    PJRT_AsyncHostToDeviceTransferManager_Device,
    PJRT_AsyncHostToDeviceTransferManager_Device_Args.transfer_manager,
    |raw, plugin| {
        crate::inner_call!(
            plugin.as_ref(),
            PJRT_AsyncHostToDeviceTransferManager_Device,
            raw
        )?;
        // SAFETY: the output field the caller's struct covers.
        unsafe {
            (*raw).device_out = our_device(
                (*raw).device_out,
                "PJRT_AsyncHostToDeviceTransferManager_Device",
            )?
        };
        Ok(())
    }
);

macro_rules! translated_table {
    ($( $slot:ident ( $args:ident . $field:ident ) ),* $(,)?) => {
        /// `(slot, offset of the routing handle)` of every translated slot.
        pub(crate) const TRANSLATED: &[(&str, usize)] = &[
            $( (stringify!($slot), std::mem::offset_of!($args, $field)) ),*
        ];

        pub(crate) fn install(api: &mut PJRT_Api) {
            $( api.$slot = Some($slot); )*
        }
    };
}

translated_table! {
    PJRT_Event_OnReady(PJRT_Event_OnReady_Args.event),
    PJRT_Buffer_Destroy(PJRT_Buffer_Destroy_Args.buffer),
    PJRT_Buffer_Delete(PJRT_Buffer_Delete_Args.buffer),
    PJRT_Buffer_IsDeleted(PJRT_Buffer_IsDeleted_Args.buffer),
    PJRT_Buffer_Device(PJRT_Buffer_Device_Args.buffer),
    PJRT_Buffer_Memory(PJRT_Buffer_Memory_Args.buffer),
    PJRT_Buffer_CopyToDevice(PJRT_Buffer_CopyToDevice_Args.buffer),
    PJRT_Buffer_CopyToMemory(PJRT_Buffer_CopyToMemory_Args.buffer),
    PJRT_Buffer_IncreaseExternalReferenceCount(PJRT_Buffer_IncreaseExternalReferenceCount_Args.buffer),
    PJRT_Buffer_OpaqueDeviceMemoryDataPointer(PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args.buffer),
    PJRT_Buffer_UnsafePointer(PJRT_Buffer_UnsafePointer_Args.buffer),
    PJRT_Buffer_ToHostBuffer(PJRT_Buffer_ToHostBuffer_Args.src),
    PJRT_Buffer_CopyRawToHost(PJRT_Buffer_CopyRawToHost_Args.buffer),
    PJRT_LoadedExecutable_AddressableDevices(PJRT_LoadedExecutable_AddressableDevices_Args.executable),
    PJRT_LoadedExecutable_Destroy(PJRT_LoadedExecutable_Destroy_Args.executable),
    PJRT_LoadedExecutable_Execute(PJRT_LoadedExecutable_Execute_Args.executable),
    PJRT_LoadedExecutable_GetDeviceAssignment(PJRT_LoadedExecutable_GetDeviceAssignment_Args.executable),
    PJRT_Executable_GetCompileOptions(PJRT_Executable_GetCompileOptions_Args.executable),
    PJRT_AsyncHostToDeviceTransferManager_Device(PJRT_AsyncHostToDeviceTransferManager_Device_Args.transfer_manager),
}
