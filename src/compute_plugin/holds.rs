//! Send holds: a compute plugin buffer being sent stays alive until its sends
//! are done, even when the caller destroys (or deletes) its handle right
//! after the send call returns, as JAX does with a temporary array. XLA's
//! own clients take a usage hold on the device memory; the C API has no such
//! call, so the hold is here: `PJRT_Buffer_Destroy` and `PJRT_Buffer_Delete`
//! of a held buffer are deferred to the release of its last hold (the caller
//! can no longer tell the difference: a destroyed handle is never used again,
//! and a deleted one reports deleted at once).
//!
//! Aliasing the source instead would not do: XLA's alias fulfilment donates
//! the buffer it is given, so the caller's buffer would be gone after one
//! send (measured: a second send of it CHECK-fails inside XLA).
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::{ComputeClient, ComputePlugin, InnerPtr};
use crate::backend::DeviceMemory;
use crate::pjrt::bindings::*;
use crate::status::{internal, Result};
use crate::sync::Future;

#[derive(Default)]
struct HoldState {
    sends: usize,
    destroy: bool,
    delete: bool,
}

static HOLDS: Lazy<Mutex<HashMap<InnerPtr, HoldState>>> = Lazy::new(Default::default);

fn destroy(plugin: &ComputePlugin, buffer: InnerPtr) {
    let mut args = PJRT_Buffer_Destroy_Args {
        struct_size: PJRT_Buffer_Destroy_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        buffer: buffer.as_mut(),
    };
    if let Err(e) = crate::inner_call!(plugin, PJRT_Buffer_Destroy, &mut args) {
        log::warn!("deferred destroy of a sent buffer: {e}");
    }
}

fn delete(plugin: &ComputePlugin, buffer: InnerPtr) {
    let mut args = PJRT_Buffer_Delete_Args {
        struct_size: PJRT_Buffer_Delete_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        buffer: buffer.as_mut(),
    };
    if let Err(e) = crate::inner_call!(plugin, PJRT_Buffer_Delete, &mut args) {
        log::warn!("deferred delete of a sent buffer: {e}");
    }
}

/// One send's hold on a compute plugin buffer.
pub struct SendHold {
    client: Arc<ComputeClient>,
    buffer: InnerPtr,
}

impl SendHold {
    pub fn new(client: &Arc<ComputeClient>, buffer: *mut PJRT_Buffer) -> SendHold {
        let buffer = InnerPtr::from(buffer);
        HOLDS.lock().entry(buffer).or_default().sends += 1;
        SendHold {
            client: client.clone(),
            buffer,
        }
    }
}

impl Drop for SendHold {
    fn drop(&mut self) {
        let finished = {
            let mut holds = HOLDS.lock();
            let Some(state) = holds.get_mut(&self.buffer) else {
                return;
            };
            state.sends -= 1;
            if state.sends > 0 {
                return;
            }
            holds.remove(&self.buffer)
        };
        let plugin = self.client.plugin();
        match finished {
            Some(HoldState { destroy: true, .. }) => destroy(plugin, self.buffer),
            Some(HoldState { delete: true, .. }) => delete(plugin, self.buffer),
            _ => {}
        }
    }
}

/// `PJRT_Buffer_Destroy` of a compute plugin buffer: `true` if it is held
/// by a send (destroyed when the send is done), `false` if the caller should
/// destroy it now.
pub fn defer_destroy(buffer: *mut PJRT_Buffer) -> bool {
    match HOLDS.lock().get_mut(&InnerPtr::from(buffer)) {
        Some(state) => {
            state.destroy = true;
            true
        }
        None => false,
    }
}

/// `PJRT_Buffer_Delete` likewise.
pub fn defer_delete(buffer: *mut PJRT_Buffer) -> bool {
    match HOLDS.lock().get_mut(&InnerPtr::from(buffer)) {
        Some(state) => {
            state.delete = true;
            true
        }
        None => false,
    }
}

/// Whether a deferred delete is pending (the buffer reads as deleted).
pub fn delete_deferred(buffer: *mut PJRT_Buffer) -> bool {
    HOLDS
        .lock()
        .get(&InnerPtr::from(buffer))
        .is_some_and(|s| s.delete || s.destroy)
}

/// A compute plugin buffer as a send source: held, and read straight into
/// the destination: one memcpy from its memory where it is host memory in
/// dense row-major layout (XLA's CPU plugin), else `PJRT_Buffer_ToHostBuffer`
/// (which converts the layout).
pub struct HeldSource {
    hold: SendHold,
    len: usize,
    /// Its bytes are host memory, dense row-major: read by address.
    direct: bool,
}

// SAFETY: the inner buffer handle is thread-safe per the PJRT C API, and the
// hold keeps it alive.
unsafe impl Send for HeldSource {}
// SAFETY: reads only, through the inner plugin's thread-safe functions.
unsafe impl Sync for HeldSource {}

impl HeldSource {
    /// Holds `buffer` (`len` row-major bytes) for a send; `sub_byte`
    /// element types are packed on the device, so never read by address.
    pub fn new(
        client: &Arc<ComputeClient>,
        buffer: *mut PJRT_Buffer,
        len: usize,
        sub_byte: bool,
    ) -> HeldSource {
        let direct = !sub_byte && is_dense_host_memory(client.plugin(), buffer);
        HeldSource {
            hold: SendHold::new(client, buffer),
            len,
            direct,
        }
    }

    /// The buffer's definition event.
    pub fn ready(&self) -> Future {
        let plugin = self.hold.client.plugin();
        let mut args = PJRT_Buffer_ReadyEvent_Args {
            struct_size: PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            buffer: self.hold.buffer.as_mut(),
            event: std::ptr::null_mut(),
        };
        match crate::inner_call!(plugin.as_ref(), PJRT_Buffer_ReadyEvent, &mut args) {
            Ok(()) => super::event_future(plugin, args.event),
            Err(e) => Future::ready(Err(e)),
        }
    }

    /// The buffer's address, where its bytes are dense host memory.
    fn direct_pointer(&self) -> Result<Option<usize>> {
        if !self.direct {
            return Ok(None);
        }
        let plugin = self.hold.client.plugin();
        let mut args = PJRT_Buffer_UnsafePointer_Args {
            struct_size: PJRT_Buffer_UnsafePointer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            buffer: self.hold.buffer.as_mut(),
            buffer_pointer: 0,
        };
        crate::inner_call!(plugin.as_ref(), PJRT_Buffer_UnsafePointer, &mut args)?;
        if args.buffer_pointer == 0 && self.len > 0 {
            return Err(internal("the compute plugin gave a null buffer pointer"));
        }
        Ok(Some(args.buffer_pointer))
    }

    fn read_all(&self, dst: &mut [u8]) -> Result<()> {
        let plugin = self.hold.client.plugin();
        if let Some(pointer) = self.direct_pointer()? {
            if !dst.is_empty() {
                // SAFETY: the buffer is defined (sends read after its ready
                // event), held (its memory cannot be freed), host memory of
                // `len` dense bytes (checked at `new`), and `dst` is ours.
                unsafe {
                    std::ptr::copy_nonoverlapping(pointer as *const u8, dst.as_mut_ptr(), dst.len())
                };
            }
            return Ok(());
        }
        let rank = super::buffer_dims(plugin, self.hold.buffer.as_mut())?.len();
        let minor_to_major: Vec<i64> = (0..rank as i64).rev().collect();
        let mut layout = PJRT_Buffer_MemoryLayout {
            struct_size: PJRT_Buffer_MemoryLayout_STRUCT_SIZE as usize,
            type_: PJRT_Buffer_MemoryLayout_Type_Tiled,
            ..Default::default()
        };
        layout.__bindgen_anon_1.tiled = PJRT_Buffer_MemoryLayout_Tiled {
            struct_size: PJRT_Buffer_MemoryLayout_Tiled_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            minor_to_major: minor_to_major.as_ptr(),
            minor_to_major_size: minor_to_major.len(),
            tile_dims: std::ptr::null(),
            tile_dim_sizes: std::ptr::null(),
            num_tiles: 0,
        };
        let mut args = PJRT_Buffer_ToHostBuffer_Args {
            struct_size: PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            src: self.hold.buffer.as_mut(),
            host_layout: &mut layout,
            dst: dst.as_mut_ptr() as *mut c_void,
            dst_size: dst.len(),
            event: std::ptr::null_mut(),
        };
        crate::inner_call!(plugin.as_ref(), PJRT_Buffer_ToHostBuffer, &mut args)?;
        super::wait_event(plugin, args.event)
    }
}

/// Whether the compute plugin keeps `buffer` in host memory, dense
/// row-major (then its bytes can be read by address).
fn is_dense_host_memory(plugin: &ComputePlugin, buffer: *mut PJRT_Buffer) -> bool {
    let mut on_cpu = PJRT_Buffer_IsOnCpu_Args {
        struct_size: PJRT_Buffer_IsOnCpu_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        buffer,
        is_on_cpu: false,
    };
    if crate::inner_call!(plugin, PJRT_Buffer_IsOnCpu, &mut on_cpu).is_err() || !on_cpu.is_on_cpu {
        return false;
    }
    let Ok(rank) = super::buffer_dims(plugin, buffer).map(|d| d.len()) else {
        return false;
    };
    let mut layout = PJRT_Buffer_GetMemoryLayout_Args {
        struct_size: PJRT_Buffer_GetMemoryLayout_Args_STRUCT_SIZE as usize,
        buffer,
        ..Default::default()
    };
    if crate::inner_call!(plugin, PJRT_Buffer_GetMemoryLayout, &mut layout).is_err()
        || layout.layout.type_ != PJRT_Buffer_MemoryLayout_Type_Tiled
    {
        return false;
    }
    // SAFETY: `type_` says the tiled member is the live one; its arrays live
    // as long as the buffer.
    let tiled = unsafe { &layout.layout.__bindgen_anon_1.tiled };
    if tiled.num_tiles != 0 || tiled.minor_to_major_size != rank {
        return false;
    }
    if rank == 0 {
        return true;
    }
    // SAFETY: as above, `minor_to_major_size` entries.
    let order = unsafe { std::slice::from_raw_parts(tiled.minor_to_major, rank) };
    order.iter().rev().enumerate().all(|(i, &d)| d == i as i64)
}

impl DeviceMemory for HeldSource {
    fn len(&self) -> usize {
        self.len
    }

    fn reads_without_waiting(&self) -> bool {
        self.direct
    }

    fn host_pointer(&self) -> Result<Option<usize>> {
        self.direct_pointer()
    }

    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        match self.direct_pointer()? {
            Some(_) if self.len == 0 => f(&[]),
            // SAFETY: as in `read_all`: defined, held, `len` dense host bytes
            // that nothing writes while the send reads them.
            Some(pointer) => {
                f(unsafe { std::slice::from_raw_parts(pointer as *const u8, self.len) })
            }
            None => {
                let mut staging = vec![0u8; self.len];
                self.read_all(&mut staging)?;
                f(&staging)
            }
        }
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset == 0 && dst.len() == self.len {
            return self.read_all(dst);
        }
        let end = offset
            .checked_add(dst.len())
            .filter(|end| *end <= self.len)
            .ok_or_else(|| crate::status::out_of_range("read past the end of a send source"))?;
        let mut staging = vec![0u8; self.len];
        self.read_all(&mut staging)?;
        dst.copy_from_slice(&staging[offset..end]);
        Ok(())
    }

    fn write(&self, _offset: usize, _src: &[u8]) -> Result<()> {
        Err(internal("a send source is read-only"))
    }

    fn address(&self) -> usize {
        0
    }

    fn is_host_memory(&self) -> bool {
        false
    }
}
