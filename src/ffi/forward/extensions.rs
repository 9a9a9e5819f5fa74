//! The compute plugin's extensions on our chain. Each is copied (so that its
//! `next` can point along our chain) and classified:
//!
//! - passed as they are: extensions whose functions take only handles the
//!   compute plugin owns (FFI, PhaseCompile, Shardings, Profiler, Triton,
//!   GPU custom calls, custom partitioners, XlaTransform, executable
//!   metadata);
//! - with shims: Layouts (a client argument), MemoryDescriptions (a device
//!   description), Stream (a device): the shim swaps our handle for the
//!   compute plugin's and calls its function;
//! - replaced: CrossHostTransfers (ours is first on the chain);
//! - left out: any other type, whose functions could take one of our handles
//!   unannounced (logged once).
use std::ffi::c_void;

use once_cell::sync::OnceCell;

use super::{inner_device, run_dispatch, substitute, Dispatch};
use crate::compute_plugin::ComputePlugin;
use crate::ffi::args::client_arg;
use crate::ffi::boundary::checked_args;
use crate::ffi::handles::{route, DescriptionHandle, Route};
use crate::pjrt::bindings::*;
use crate::status::unimplemented;

type Entry = unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error;

/// The compute plugin's function behind each shim, set once at load.
static LAYOUTS_CLIENT_DEFAULT: OnceCell<Entry> = OnceCell::new();
static MEMORY_DESCRIPTIONS: OnceCell<Entry> = OnceCell::new();
static STREAM_FOR_DEVICE: OnceCell<Entry> = OnceCell::new();

/// `PJRT_Layouts_PJRT_Client_GetDefaultLayout_Args` up to the client.
#[repr(C)]
struct ClientFirstArgs {
    struct_size: usize,
    extension_start: *mut PJRT_Extension_Base,
    client: *mut PJRT_Client,
}

/// `PJRT_DeviceDescription_MemoryDescriptions_Args` up to the description.
#[repr(C)]
struct DescriptionFirstArgs {
    struct_size: usize,
    extension_start: *mut PJRT_Extension_Base,
    device_description: *mut PJRT_DeviceDescription,
}

/// `PJRT_Get_Stream_For_External_Ready_Events_Args` up to the device (this
/// struct has no `extension_start`).
#[repr(C)]
struct StreamArgs {
    struct_size: usize,
    device: *mut PJRT_Device,
}

/// Layouts extension, client default layout: our client swapped for the
/// compute plugin's, then its function. UNIMPLEMENTED for an embedded
/// client (dense row-major only).
unsafe extern "C" fn layouts_client_default_layout(raw: *mut c_void) -> *mut PJRT_Error {
    const F: &str = "PJRT_Layouts_PJRT_Client_GetDefaultLayout";
    run_dispatch(F, || {
        let args = raw as *mut ClientFirstArgs;
        // SAFETY: a caller's args struct begins with these fields;
        // `checked_args` rejects null and a struct_size that does not cover them.
        unsafe { checked_args(args, F, std::mem::size_of::<ClientFirstArgs>()) }?;
        // SAFETY: as above; a live client per the contract.
        let client = unsafe { client_arg((*args).client, F) }?;
        let compute = client.client.compute().cloned().ok_or_else(|| {
            unimplemented(format!(
                "{F}: an embedded crosshost client has only dense row-major layouts"
            ))
        })?;
        // SAFETY: restored when the guard drops.
        let _client = unsafe { substitute(std::ptr::addr_of_mut!((*args).client), compute.raw()) };
        let inner = LAYOUTS_CLIENT_DEFAULT.get().expect("set with the shim");
        // SAFETY: the compute plugin's function with the caller's args.
        compute.plugin().check(unsafe { inner(raw) }, F)?;
        Ok(Dispatch::Forwarded)
    })
}

/// MemoryDescriptions extension: a description of ours is swapped for the
/// compute plugin's, a topology's goes as it is. UNIMPLEMENTED for an
/// embedded device.
unsafe extern "C" fn memory_descriptions(raw: *mut c_void) -> *mut PJRT_Error {
    const F: &str = "PJRT_DeviceDescription_MemoryDescriptions";
    run_dispatch(F, || {
        let args = raw as *mut DescriptionFirstArgs;
        // SAFETY: a caller's args struct begins with these fields;
        // `checked_args` rejects null and a struct_size that does not cover them.
        unsafe { checked_args(args, F, std::mem::size_of::<DescriptionFirstArgs>()) }?;
        // SAFETY: as above; a live description (ours or a topology's).
        let whose = unsafe {
            route::<DescriptionHandle>((*args).device_description, F, "device_description")
        }?;
        let (plugin, _description) = match whose {
            Route::Ours(ours) => {
                let inner = ours.compute_description().ok_or_else(|| {
                    unimplemented(format!(
                        "{F}: an embedded crosshost device has one memory, \"device\""
                    ))
                })?;
                let plugin = crate::compute_plugin::loaded()
                    .ok_or_else(|| unimplemented(format!("{F}: no compute plugin")))?;
                // SAFETY: restored when the guard drops.
                let guard = unsafe {
                    substitute(std::ptr::addr_of_mut!((*args).device_description), inner)
                };
                (plugin, Some(guard))
            }
            Route::Compute(plugin) => (plugin, None),
        };
        let inner = MEMORY_DESCRIPTIONS.get().expect("set with the shim");
        // SAFETY: the compute plugin's function with the caller's args.
        plugin.check(unsafe { inner(raw) }, F)?;
        Ok(Dispatch::Forwarded)
    })
}

/// Stream extension, stream of a device: our device swapped for the
/// compute plugin's. UNIMPLEMENTED without a compute plugin.
unsafe extern "C" fn stream_for_device(raw: *mut c_void) -> *mut PJRT_Error {
    const F: &str = "PJRT_Get_Stream_For_External_Ready_Events";
    run_dispatch(F, || {
        let args = raw as *mut StreamArgs;
        // SAFETY: a caller's args struct begins with these fields;
        // `checked_args` rejects null and a struct_size that does not cover them.
        unsafe { checked_args(args, F, std::mem::size_of::<StreamArgs>()) }?;
        // SAFETY: as above; a live device per the contract.
        let inner = unsafe { inner_device((*args).device, F, "device") }?;
        let plugin = crate::compute_plugin::loaded()
            .ok_or_else(|| unimplemented(format!("{F}: no compute plugin")))?;
        // SAFETY: restored when the guard drops.
        let _device = unsafe { substitute(std::ptr::addr_of_mut!((*args).device), inner) };
        let f = STREAM_FOR_DEVICE.get().expect("set with the shim");
        // SAFETY: the compute plugin's function with the caller's args.
        plugin.check(unsafe { f(raw) }, F)?;
        Ok(Dispatch::Forwarded)
    })
}

/// A function of an extension replaced by our shim: its byte offset, the
/// shim, and where the compute plugin's function is kept.
type Shim = (usize, Entry, &'static OnceCell<Entry>);

const BASE: usize = std::mem::size_of::<PJRT_Extension_Base>();
const WORD: usize = std::mem::size_of::<usize>();
// Layouts: destroy, serialize, client default (third), ...
static LAYOUTS_SHIMS: [Shim; 1] = [(
    BASE + 2 * WORD,
    layouts_client_default_layout,
    &LAYOUTS_CLIENT_DEFAULT,
)];
// MemoryDescriptions: description → memory descriptions (first).
static MEMORY_DESCRIPTIONS_SHIMS: [Shim; 1] = [(BASE, memory_descriptions, &MEMORY_DESCRIPTIONS)];
// Stream: stream of a device (first); waiting on a buffer takes theirs.
static STREAM_SHIMS: [Shim; 1] = [(BASE, stream_for_device, &STREAM_FOR_DEVICE)];

/// What we do with an extension type.
enum Treatment {
    Pass,
    Shim(&'static [Shim]),
    Leave,
}

fn treatment(kind: PJRT_Extension_Type) -> Treatment {
    match kind {
        PJRT_Extension_Type_Gpu_Custom_Call
        | PJRT_Extension_Type_Profiler
        | PJRT_Extension_Type_Custom_Partitioner
        | PJRT_Extension_Type_FFI
        | PJRT_Extension_Type_Triton
        | PJRT_Extension_Type_PhaseCompile
        | PJRT_Extension_Type_ExecutableMetadata
        | PJRT_Extension_Type_Shardings
        | PJRT_Extension_Type_XlaTransform => Treatment::Pass,
        PJRT_Extension_Type_Layouts => Treatment::Shim(&LAYOUTS_SHIMS),
        PJRT_Extension_Type_MemoryDescriptions => Treatment::Shim(&MEMORY_DESCRIPTIONS_SHIMS),
        PJRT_Extension_Type_Stream => Treatment::Shim(&STREAM_SHIMS),
        _ => Treatment::Leave,
    }
}

/// A copy of one of the compute plugin's extensions, 8-byte aligned.
struct Copied(Box<[u64]>);

/// Builds the compute plugin's part of our chain; returns its head (null if
/// none). The copies live for the rest of the process (like the table).
pub(crate) fn compute_chain(plugin: &ComputePlugin) -> *mut PJRT_Extension_Base {
    let mut copies: Vec<Copied> = Vec::new();
    for &extension in plugin.extensions() {
        // SAFETY: chain entries begin with PJRT_Extension_Base.
        let (kind, size) = unsafe { ((*extension).type_, (*extension).struct_size) };
        if kind == PJRT_Extension_Type_CrossHostTransfers {
            continue; // ours replaces it
        }
        let shims = match treatment(kind) {
            Treatment::Leave => {
                log::info!("compute plugin extension type {kind} is not offered through crosshost");
                continue;
            }
            Treatment::Pass => &[][..],
            Treatment::Shim(shims) => shims,
        };
        let size = size.max(std::mem::size_of::<PJRT_Extension_Base>());
        let mut words = vec![0u64; size.div_ceil(8)].into_boxed_slice();
        // SAFETY: the extension is `size` readable bytes; `words` holds at
        // least that many.
        unsafe {
            std::ptr::copy_nonoverlapping(
                extension as *const u8,
                words.as_mut_ptr() as *mut u8,
                size,
            )
        };
        for &(offset, shim, cell) in shims {
            if offset + 8 > size {
                continue;
            }
            let slot = (words.as_mut_ptr() as *mut u8).wrapping_add(offset) as *mut Option<Entry>;
            // SAFETY: inside the copy (checked), a function-pointer field.
            let inner = unsafe { slot.read() };
            if let Some(inner) = inner {
                let _ = cell.set(inner);
                // SAFETY: as above.
                unsafe { slot.write(Some(shim)) };
            }
        }
        copies.push(Copied(words));
    }
    // Link the copies in order, then keep them forever.
    let heads: Vec<*mut PJRT_Extension_Base> = copies
        .iter_mut()
        .map(|c| c.0.as_mut_ptr() as *mut PJRT_Extension_Base)
        .collect();
    for pair in heads.windows(2) {
        // SAFETY: each head begins with PJRT_Extension_Base (copied).
        unsafe { (*pair[0]).next = pair[1] };
    }
    if let Some(&last) = heads.last() {
        // SAFETY: as above.
        unsafe { (*last).next = std::ptr::null_mut() };
    }
    let head = heads.first().copied().unwrap_or(std::ptr::null_mut());
    std::mem::forget(copies);
    head
}
