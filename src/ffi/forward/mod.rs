//! Delegation at the C boundary: everything a delegating client does that is
//! not a cross-host transfer, the job's topology or one of our exports goes
//! to the compute plugin (docs/DESIGN.md §11). Which slot goes where is
//! `table.rs`; the handle rule that decides it per call is `handles/`.
//!
//! Three kinds of slots:
//! - *ours*: answered here (errors, plugin attributes, client topology,
//!   devices and memories, events we make);
//! - *routed*: the first handle argument decides: ours → our entry (which
//!   may be UNIMPLEMENTED, e.g. executables of an embedded client), the
//!   compute plugin's → its function, with the caller's args unchanged;
//! - *delegated*: a client, device or memory argument of ours is replaced
//!   by the compute plugin's own for the call (and put back after), and
//!   device/memory outputs are mapped back to ours.
//!
//! Forwarding hands the caller's struct to the compute plugin as it came
//! (JAX 0.10.2 sends PJRT 0.112-sized structs; the plugin reads what its
//! `struct_size` covers). Errors the compute plugin returns become ours.
pub(crate) mod delegated;
pub(crate) mod extensions;
pub(crate) mod routed;
pub mod table;
pub(crate) mod translated;

use std::sync::Arc;

use super::args::{client_arg, device_arg, memory_arg, null_field};
use super::boundary::catch_entry;
use super::handles::{device_of_compute, is_ours, memory_of_compute, ClientHandle};
use crate::compute_plugin::{self, ComputeClient, ComputePlugin};
use crate::pjrt::bindings::*;
use crate::status::{internal, invalid_argument, Result};

/// What a routing entry did.
pub(crate) enum Dispatch {
    /// Called our own entry; this is its result.
    Ours(*mut PJRT_Error),
    /// Forwarded to the compute plugin, which succeeded.
    Forwarded,
}

/// Runs a routing entry: `Ours` returns our entry's result, `Forwarded`
/// success, `Err` our error; a panic becomes INTERNAL naming the function
/// (the boundary of `pjrt_entry!`, `boundary::catch_entry`).
pub(crate) fn run_dispatch(
    name: &'static str,
    body: impl FnOnce() -> Result<Dispatch>,
) -> *mut PJRT_Error {
    catch_entry(name, module_path!(), || {
        body().map(|dispatch| match dispatch {
            Dispatch::Ours(error) => error,
            Dispatch::Forwarded => std::ptr::null_mut(),
        })
    })
}

/// Puts a field of the caller's args back when dropped.
pub(crate) struct Restore<T: Copy> {
    slot: *mut T,
    original: T,
}

impl<T: Copy> Drop for Restore<T> {
    fn drop(&mut self) {
        // SAFETY: `slot` is a field of the caller's args struct, which
        // outlives the call this guard lives in.
        unsafe { self.slot.write(self.original) };
    }
}

/// Replaces `*slot` by `value` for the guard's lifetime.
///
/// # Safety
/// `slot` must be a readable, writable field of an args struct that
/// outlives the guard.
pub(crate) unsafe fn substitute<T: Copy>(slot: *mut T, value: T) -> Restore<T> {
    // SAFETY: forwarded contract.
    let original = unsafe { slot.read() };
    // SAFETY: as above.
    unsafe { slot.write(value) };
    Restore { slot, original }
}

/// The compute plugin's handle of a routable type: whose is it? `Ok(None)`:
/// ours (`ours` decides; always, when no compute plugin is loaded),
/// `Ok(Some(plugin))`: forward.
///
/// # Safety
/// `handle` must be null or a readable handle-shaped object.
pub(crate) unsafe fn foreign_only(
    handle: *const std::ffi::c_void,
    function: &str,
    field: &str,
) -> Result<Option<Arc<ComputePlugin>>> {
    // Without a compute plugin no such handle exists: the UNIMPLEMENTED
    // entry answers, whatever the argument holds.
    let Some(plugin) = compute_plugin::loaded() else {
        return Ok(None);
    };
    if handle.is_null() {
        return Err(null_field(function, field));
    }
    // SAFETY: forwarded contract.
    if unsafe { is_ours(handle) } {
        return Err(invalid_argument(format!(
            "{function}: {field} is a handle of another type, or destroyed"
        )));
    }
    Ok(Some(plugin))
}

/// A client argument: `None` for an embedded client (our entry answers),
/// else the compute plugin's client behind it.
///
/// # Safety
/// `client` must be null or a live client handle.
pub(crate) unsafe fn delegating<'a>(
    client: *mut PJRT_Client,
    function: &str,
) -> Result<(&'a ClientHandle, Option<Arc<ComputeClient>>)> {
    // SAFETY: forwarded contract.
    let handle = unsafe { client_arg(client, function) }?;
    Ok((handle, handle.client.compute().cloned()))
}

/// The compute plugin's device behind one of our devices (null stays null).
///
/// # Safety
/// `device` must be null or a live device handle.
pub(crate) unsafe fn inner_device(
    device: *mut PJRT_Device,
    function: &str,
    field: &str,
) -> Result<*mut PJRT_Device> {
    if device.is_null() {
        return Ok(device);
    }
    // SAFETY: forwarded contract.
    let ours = unsafe { device_arg(device, function, field) }?;
    ours.compute_device().ok_or_else(|| {
        invalid_argument(format!(
            "{function}: {field} (device {}) is not addressable by this process's compute plugin",
            ours.device.global_id
        ))
    })
}

/// The compute plugin's memory behind one of our memories (null stays null).
///
/// # Safety
/// `memory` must be null or a live memory handle.
pub(crate) unsafe fn inner_memory(
    memory: *mut PJRT_Memory,
    function: &str,
    field: &str,
) -> Result<*mut PJRT_Memory> {
    if memory.is_null() {
        return Ok(memory);
    }
    // SAFETY: forwarded contract.
    let ours = unsafe { memory_arg(memory, function, field) }?;
    ours.compute_memory().ok_or_else(|| {
        invalid_argument(format!(
            "{function}: {field} (memory {}) is not one of the compute plugin's",
            ours.memory.id
        ))
    })
}

/// Our handle of a device the compute plugin returned.
pub(crate) fn our_device(inner: *mut PJRT_Device, function: &str) -> Result<*mut PJRT_Device> {
    if inner.is_null() {
        return Ok(inner);
    }
    device_of_compute(inner).ok_or_else(|| {
        internal(format!(
            "{function}: the compute plugin returned a device no live client of ours wraps"
        ))
    })
}

/// Our handle of a memory the compute plugin returned.
pub(crate) fn our_memory(inner: *mut PJRT_Memory, function: &str) -> Result<*mut PJRT_Memory> {
    if inner.is_null() {
        return Ok(inner);
    }
    memory_of_compute(inner).ok_or_else(|| {
        internal(format!(
            "{function}: the compute plugin returned a memory no live client of ours wraps"
        ))
    })
}

/// Rejects one of our buffers where the compute plugin's is required (an
/// embedded client's buffer passed to a delegating client's executable).
///
/// # Safety
/// `buffer` must be null or a readable handle-shaped object.
pub(crate) unsafe fn require_compute_buffer(
    buffer: *mut PJRT_Buffer,
    function: &str,
    field: &str,
) -> Result<()> {
    // SAFETY: forwarded contract.
    if unsafe { is_ours(buffer.cast()) } {
        return Err(invalid_argument(format!(
            "{function}: {field} is a buffer of an embedded crosshost client (or destroyed); \
             the compute plugin's programs take only its own buffers"
        )));
    }
    Ok(())
}
