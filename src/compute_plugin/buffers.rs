//! Inner buffers the transfer path works with: receive buffers (alias
//! buffers, fulfilled by a view of the bytes we received), send sources
//! (retained through an alias of the caller's buffer, read back straight
//! into the destination), and inner events as our futures.
//!
//! Every shape we hand the inner plugin carries an explicit dense row-major
//! layout: XLA's CPU plugin refuses an alias without one, and an older one
//! compares the alias's layout with the fulfilling buffer's.
use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;

use super::{ComputeClient, ComputeMemory, ComputePlugin, InnerPtr, UserArg};
use crate::pjrt::bindings::*;
use crate::status::{internal, Outcome, Result, Status};
use crate::sync::{Future, PromiseOnce};

/// A dense row-major tiled layout for `rank` dims, kept alive with the
/// pointer handed to the inner plugin.
struct DenseLayout {
    minor_to_major: Vec<i64>,
    layout: PJRT_Buffer_MemoryLayout,
}

impl DenseLayout {
    fn new(rank: usize) -> Box<DenseLayout> {
        let mut boxed = Box::new(DenseLayout {
            minor_to_major: (0..rank as i64).rev().collect(),
            layout: PJRT_Buffer_MemoryLayout {
                struct_size: PJRT_Buffer_MemoryLayout_STRUCT_SIZE as usize,
                type_: PJRT_Buffer_MemoryLayout_Type_Tiled,
                ..Default::default()
            },
        });
        boxed.layout.__bindgen_anon_1.tiled = PJRT_Buffer_MemoryLayout_Tiled {
            struct_size: PJRT_Buffer_MemoryLayout_Tiled_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            minor_to_major: boxed.minor_to_major.as_ptr(),
            minor_to_major_size: boxed.minor_to_major.len(),
            tile_dims: std::ptr::null(),
            tile_dim_sizes: std::ptr::null(),
            num_tiles: 0,
        };
        boxed
    }

    fn as_mut_ptr(&mut self) -> *mut PJRT_Buffer_MemoryLayout {
        &mut self.layout
    }
}

// ---------------------------------- events -----------------------------------

struct OnReadyState {
    plugin: Arc<ComputePlugin>,
    event: InnerPtr,
    promise: PromiseOnce,
}

fn destroy_event(plugin: &ComputePlugin, event: InnerPtr) {
    let mut args = PJRT_Event_Destroy_Args {
        struct_size: PJRT_Event_Destroy_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        event: event.as_mut(),
    };
    if let Err(e) = crate::inner_call!(plugin, PJRT_Event_Destroy, &mut args) {
        log::warn!("{e}");
    }
}

unsafe extern "C" fn event_ready(error: *mut PJRT_Error, user_arg: UserArg) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `user_arg` is the box `InnerEvent::into_future` leaked for
        // this one callback.
        let state = unsafe { Box::from_raw(user_arg as *mut OnReadyState) };
        let outcome = match super::take_inner_error(&state.plugin, error) {
            None => Ok(()),
            Some(status) => Err(status),
        };
        destroy_event(&state.plugin, state.event);
        state.promise.set(outcome);
    }));
}

/// Turns an inner event (which this call owns and destroys) into a future
/// of its outcome.
pub fn event_future(plugin: &Arc<ComputePlugin>, event: *mut PJRT_Event) -> Future {
    if event.is_null() {
        return Future::ready(Err(internal("the compute plugin returned no event")));
    }
    let (promise, future) = PromiseOnce::new();
    let state = Box::into_raw(Box::new(OnReadyState {
        plugin: plugin.clone(),
        event: InnerPtr::from(event),
        promise,
    }));
    let mut args = PJRT_Event_OnReady_Args {
        struct_size: PJRT_Event_OnReady_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        event,
        callback: Some(event_ready),
        user_arg: state as *mut c_void,
    };
    if let Err(e) = crate::inner_call!(plugin.as_ref(), PJRT_Event_OnReady, &mut args) {
        // The callback will never run: the state is still ours.
        // SAFETY: leaked just above and not handed to anyone.
        let state = unsafe { Box::from_raw(state) };
        destroy_event(plugin, state.event);
        state.promise.set(Err(e));
    }
    future
}

/// Waits for an inner event (owned, destroyed here).
pub fn wait_event(plugin: &ComputePlugin, event: *mut PJRT_Event) -> Outcome {
    if event.is_null() {
        return Ok(());
    }
    let mut args = PJRT_Event_Await_Args {
        struct_size: PJRT_Event_Await_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        event,
    };
    let outcome = crate::inner_call!(plugin, PJRT_Event_Await, &mut args);
    destroy_event(plugin, InnerPtr::from(event));
    outcome
}

// ---------------------------------- buffers ----------------------------------

/// An inner `PJRT_Buffer*` we own (destroyed on drop unless handed out).
pub struct InnerBuffer {
    client: Arc<ComputeClient>,
    buffer: InnerPtr,
}

impl InnerBuffer {
    /// Takes ownership of an inner buffer handle.
    pub fn own(client: Arc<ComputeClient>, buffer: *mut PJRT_Buffer) -> InnerBuffer {
        InnerBuffer {
            client,
            buffer: InnerPtr::from(buffer),
        }
    }

    pub fn raw(&self) -> *mut PJRT_Buffer {
        self.buffer.as_mut()
    }

    /// Gives the handle to the caller (who destroys it).
    pub fn into_raw(self) -> *mut PJRT_Buffer {
        let raw = self.raw();
        std::mem::forget(self);
        raw
    }

    /// The buffer's definition event.
    pub fn ready(&self) -> Future {
        let plugin = self.client.plugin();
        let mut args = PJRT_Buffer_ReadyEvent_Args {
            struct_size: PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            buffer: self.raw(),
            event: std::ptr::null_mut(),
        };
        match crate::inner_call!(plugin.as_ref(), PJRT_Buffer_ReadyEvent, &mut args) {
            Ok(()) => event_future(plugin, args.event),
            Err(e) => Future::ready(Err(e)),
        }
    }

    /// Copies the whole buffer, row-major, into `dst` (blocking).
    pub fn read_into(&self, dst: &mut [u8]) -> Outcome {
        let plugin = self.client.plugin();
        let rank = self.dims()?.len();
        let mut layout = DenseLayout::new(rank);
        let mut args = PJRT_Buffer_ToHostBuffer_Args {
            struct_size: PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            src: self.raw(),
            host_layout: layout.as_mut_ptr(),
            dst: dst.as_mut_ptr() as *mut c_void,
            dst_size: dst.len(),
            event: std::ptr::null_mut(),
        };
        crate::inner_call!(plugin.as_ref(), PJRT_Buffer_ToHostBuffer, &mut args)?;
        wait_event(plugin, args.event)
    }

    pub fn dims(&self) -> Result<Vec<i64>> {
        buffer_dims(self.client.plugin(), self.raw())
    }

    pub fn element_type(&self) -> Result<PJRT_Buffer_Type> {
        buffer_element_type(self.client.plugin(), self.raw())
    }
}

/// The dims of an inner buffer (ours or the caller's).
pub fn buffer_dims(plugin: &ComputePlugin, buffer: *mut PJRT_Buffer) -> Result<Vec<i64>> {
    let mut args = PJRT_Buffer_Dimensions_Args {
        struct_size: PJRT_Buffer_Dimensions_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        buffer,
        dims: std::ptr::null(),
        num_dims: 0,
    };
    crate::inner_call!(plugin, PJRT_Buffer_Dimensions, &mut args)?;
    Ok(if args.num_dims == 0 || args.dims.is_null() {
        Vec::new()
    } else {
        // SAFETY: `num_dims` entries, alive as long as the buffer.
        unsafe { std::slice::from_raw_parts(args.dims, args.num_dims) }.to_vec()
    })
}

/// The element type of an inner buffer.
pub fn buffer_element_type(
    plugin: &ComputePlugin,
    buffer: *mut PJRT_Buffer,
) -> Result<PJRT_Buffer_Type> {
    let mut args = PJRT_Buffer_ElementType_Args {
        struct_size: PJRT_Buffer_ElementType_Args_STRUCT_SIZE as usize,
        extension_start: std::ptr::null_mut(),
        buffer,
        type_: 0,
    };
    crate::inner_call!(plugin, PJRT_Buffer_ElementType, &mut args)?;
    Ok(args.type_)
}

impl Drop for InnerBuffer {
    fn drop(&mut self) {
        let mut args = PJRT_Buffer_Destroy_Args {
            struct_size: PJRT_Buffer_Destroy_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            buffer: self.raw(),
        };
        if let Err(e) = crate::inner_call!(
            self.client.plugin().as_ref(),
            PJRT_Buffer_Destroy,
            &mut args
        ) {
            log::warn!("{e}");
        }
    }
}

// ------------------------------ alias buffers --------------------------------

/// Keeps received bytes alive while an inner view uses them.
type KeepAlive = Box<dyn Any + Send>;

unsafe extern "C" fn release_view(_device_buffer: *mut c_void, user_arg: UserArg) {
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the box `fulfill_with_host_bytes` leaked for this view.
        drop(unsafe { Box::from_raw(user_arg as *mut KeepAlive) });
    });
}

/// A receive buffer: an inner alias buffer, not ready until fulfilled. The
/// alias itself goes to the caller; we keep the fulfil callback.
pub struct AliasBuffer {
    client: Arc<ComputeClient>,
    /// Ours until handed out with `take_handle`.
    alias: Option<InnerBuffer>,
    callback: InnerPtr,
    memory: InnerPtr,
    element_type: PJRT_Buffer_Type,
    dims: Vec<i64>,
    /// A view of the destination made ahead of the bytes (`prepare_view`),
    /// handed to the plugin only when the alias is fulfilled.
    view: Option<InnerBuffer>,
}

// SAFETY: the inner handles are thread-safe per the PJRT C API; the fulfil
// callback is used once, by whichever thread publishes.
unsafe impl Send for AliasBuffer {}

impl AliasBuffer {
    /// `PJRT_Client_CreateAliasBuffer` on `memory`, dense row-major.
    pub fn create(
        client: &Arc<ComputeClient>,
        memory: &ComputeMemory,
        element_type: PJRT_Buffer_Type,
        dims: &[i64],
    ) -> Result<AliasBuffer> {
        let mut layout = DenseLayout::new(dims.len());
        // SAFETY: the layout lives until the call returns.
        unsafe { Self::create_with_layout(client, memory, element_type, dims, layout.as_mut_ptr()) }
    }

    /// `PJRT_Client_CreateAliasBuffer` with an explicit layout.
    ///
    /// # Safety
    /// `layout` must be a valid layout for the duration of the call.
    unsafe fn create_with_layout(
        client: &Arc<ComputeClient>,
        memory: &ComputeMemory,
        element_type: PJRT_Buffer_Type,
        dims: &[i64],
        layout: *mut PJRT_Buffer_MemoryLayout,
    ) -> Result<AliasBuffer> {
        let mut args = PJRT_Client_CreateAliasBuffer_Args {
            struct_size: PJRT_Client_CreateAliasBuffer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            client: client.raw(),
            memory: memory.memory.as_mut(),
            shape_dims: dims.as_ptr(),
            shape_num_dims: dims.len(),
            shape_element_type: element_type,
            shape_layout: layout,
            alias_buffer: std::ptr::null_mut(),
            fulfill_alias_buffer_cb: std::ptr::null_mut(),
        };
        crate::inner_call!(
            client.plugin().as_ref(),
            PJRT_Client_CreateAliasBuffer,
            &mut args
        )?;
        if args.alias_buffer.is_null() || args.fulfill_alias_buffer_cb.is_null() {
            return Err(internal(
                "PJRT_Client_CreateAliasBuffer (compute plugin) returned no buffer or callback",
            ));
        }
        Ok(AliasBuffer {
            client: client.clone(),
            alias: Some(InnerBuffer::own(client.clone(), args.alias_buffer)),
            callback: InnerPtr::from(args.fulfill_alias_buffer_cb),
            memory: memory.memory,
            element_type,
            dims: dims.to_vec(),
            view: None,
        })
    }

    /// Makes the view of the destination at `address` now, while its bytes
    /// are still on their way, so that fulfilment only hands it over. The
    /// view is nobody's until then. A plugin that cannot view host memory
    /// gets a copy at fulfilment instead, as without this.
    pub fn prepare_view(&mut self, address: usize, keep: KeepAlive) {
        match self.view_of(address, keep) {
            Ok(view) => self.view = Some(view),
            Err(e) => log::debug!("compute plugin cannot view host memory ahead ({e})"),
        }
    }

    /// The alias itself, for the caller; fulfilment stays with us.
    pub fn take_handle(&mut self) -> Option<InnerBuffer> {
        self.alias.take()
    }

    /// Fulfils the alias with the received bytes at `address` (`len`
    /// bytes, row-major), kept alive by `keep` for as long as the inner
    /// plugin uses them: a view where the plugin takes host memory, one copy
    /// where it does not.
    pub fn fulfill_with_host_bytes(
        mut self,
        address: usize,
        len: usize,
        keep: KeepAlive,
    ) -> Outcome {
        let prepared = self.view.take().map(Ok);
        let view = prepared
            .unwrap_or_else(|| self.view_of(address, keep))
            .or_else(|view_error| {
                log::debug!(
                "compute plugin cannot view host memory ({view_error}); copying the received bytes"
            );
                self.copy_of(address, len)
            });
        crate::sync::timeline::mark_call(crate::sync::timeline::Point::ViewMade);
        match view {
            Ok(buffer) => self.fulfill(buffer.raw(), Ok(())),
            Err(e) => {
                let outcome = Err(Status::new(
                    e.code,
                    format!(
                        "received bytes could not be handed to the compute plugin: {}",
                        e.message
                    ),
                ));
                self.fulfill(std::ptr::null_mut(), outcome.clone())?;
                outcome
            }
        }
    }

    /// Fulfils the alias with an error: the receive failed (a prepared view
    /// is dropped with it).
    pub fn fail(mut self, status: &Status) -> Outcome {
        self.view = None;
        self.fulfill(std::ptr::null_mut(), Err(status.clone()))
    }

    fn view_of(&self, address: usize, keep: KeepAlive) -> Result<InnerBuffer> {
        let mut layout = DenseLayout::new(self.dims.len());
        let keep = Box::into_raw(Box::new(keep));
        let mut args = PJRT_Client_CreateViewOfDeviceBuffer_Args {
            struct_size: PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            client: self.client.raw(),
            device_buffer_ptr: address as *mut c_void,
            dims: self.dims.as_ptr(),
            num_dims: self.dims.len(),
            element_type: self.element_type,
            layout: layout.as_mut_ptr(),
            device: std::ptr::null_mut(),
            on_delete_callback: Some(release_view),
            on_delete_callback_arg: keep as *mut c_void,
            stream: 0,
            buffer: std::ptr::null_mut(),
            memory: self.memory.as_mut(),
        };
        let made = crate::inner_call!(
            self.client.plugin().as_ref(),
            PJRT_Client_CreateViewOfDeviceBuffer,
            &mut args
        );
        match made {
            Ok(()) if !args.buffer.is_null() => {
                Ok(InnerBuffer::own(self.client.clone(), args.buffer))
            }
            other => {
                // No view: the callback will never run, the bytes are ours.
                // SAFETY: leaked above and not kept by the plugin.
                drop(unsafe { Box::from_raw(keep) });
                Err(other
                    .err()
                    .unwrap_or_else(|| internal("CreateViewOfDeviceBuffer returned no buffer")))
            }
        }
    }

    fn copy_of(&self, address: usize, len: usize) -> Result<InnerBuffer> {
        let mut layout = DenseLayout::new(self.dims.len());
        let mut args = PJRT_Client_BufferFromHostBuffer_Args {
            struct_size: PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE as usize,
            client: self.client.raw(),
            data: address as *const c_void,
            type_: self.element_type,
            dims: self.dims.as_ptr(),
            num_dims: self.dims.len(),
            host_buffer_semantics: PJRT_HostBufferSemantics_kImmutableOnlyDuringCall,
            device_layout: layout.as_mut_ptr(),
            memory: self.memory.as_mut(),
            ..Default::default()
        };
        let _ = len;
        let plugin = self.client.plugin();
        crate::inner_call!(plugin.as_ref(), PJRT_Client_BufferFromHostBuffer, &mut args)?;
        // kImmutableOnlyDuringCall: the bytes were copied before return.
        if !args.done_with_host_buffer.is_null() {
            wait_event(plugin, args.done_with_host_buffer)?;
        }
        Ok(InnerBuffer::own(self.client.clone(), args.buffer))
    }

    fn fulfill(&mut self, buffer: *mut PJRT_Buffer, outcome: Outcome) -> Outcome {
        let callback = std::mem::replace(&mut self.callback, InnerPtr(0));
        if callback.is_null() {
            return Err(internal("alias buffer fulfilled twice"));
        }
        let (code, message) = match &outcome {
            Ok(()) => (PJRT_Error_Code_OK, String::new()),
            Err(status) => (status.code as PJRT_Error_Code, status.message.clone()),
        };
        let mut args = PJRT_Client_FulfillAliasBuffer_Args {
            struct_size: PJRT_Client_FulfillAliasBuffer_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            client: self.client.raw(),
            buffer,
            status_code: code,
            error_message: message.as_ptr() as *const _,
            error_message_size: message.len(),
            fulfill_alias_buffer_cb: callback.as_mut(),
        };
        let fulfilled = crate::inner_call!(
            self.client.plugin().as_ref(),
            PJRT_Client_FulfillAliasBuffer,
            &mut args
        );
        match (&outcome, fulfilled) {
            (_, Ok(())) => Ok(()),
            // XLA answers an error fulfilment with that same error.
            (Err(sent), Err(back)) if back.code == sent.code => Ok(()),
            (_, Err(e)) => {
                log::error!("fulfilling a receive buffer: {e}");
                Err(e)
            }
        }
    }
}

impl Drop for AliasBuffer {
    /// Never left pending: an alias dropped unfulfilled (a receive whose
    /// setup failed) is failed, so nothing waits on it forever.
    fn drop(&mut self) {
        if !self.callback.is_null() {
            let _ = self.fulfill(
                std::ptr::null_mut(),
                Err(crate::status::cancelled(
                    "the receive was abandoned before it started",
                )),
            );
        }
    }
}

// --------------------------- staged receive buffers ---------------------------

/// A receive buffer the compute plugin fills from host bytes (its
/// asynchronous host-to-device transfer manager): for element types its
/// alias buffers cannot serve (XLA's CPU plugin packs sub-byte types in a
/// layout the C API's layout struct cannot express). One copy, made by the
/// plugin itself from our unpacked bytes.
pub struct StagedReceive {
    client: Arc<ComputeClient>,
    manager: InnerPtr,
    buffer: Option<InnerBuffer>,
    element_type: PJRT_Buffer_Type,
    dims: Vec<i64>,
    done: bool,
}

// SAFETY: the inner handles are thread-safe per the PJRT C API; the manager
// is used once, by whichever thread publishes.
unsafe impl Send for StagedReceive {}

impl StagedReceive {
    pub fn create(
        client: &Arc<ComputeClient>,
        memory: &ComputeMemory,
        element_type: PJRT_Buffer_Type,
        dims: &[i64],
    ) -> Result<StagedReceive> {
        let plugin = client.plugin();
        let mut spec = PJRT_ShapeSpec {
            struct_size: PJRT_ShapeSpec_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            dims: dims.as_ptr(),
            num_dims: dims.len(),
            element_type,
        };
        let mut args = PJRT_Client_CreateBuffersForAsyncHostToDevice_Args {
            struct_size: PJRT_Client_CreateBuffersForAsyncHostToDevice_Args_STRUCT_SIZE as usize,
            client: client.raw(),
            shape_specs: &mut spec,
            num_shape_specs: 1,
            memory: memory.memory.as_mut(),
            ..Default::default()
        };
        crate::inner_call!(
            plugin.as_ref(),
            PJRT_Client_CreateBuffersForAsyncHostToDevice,
            &mut args
        )?;
        let mut staged = StagedReceive {
            client: client.clone(),
            manager: InnerPtr::from(args.transfer_manager),
            buffer: None,
            element_type,
            dims: dims.to_vec(),
            done: false,
        };
        let mut retrieve = PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer_Args {
            struct_size: PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer_Args_STRUCT_SIZE
                as usize,
            transfer_manager: args.transfer_manager,
            buffer_index: 0,
            ..Default::default()
        };
        crate::inner_call!(
            plugin.as_ref(),
            PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer,
            &mut retrieve
        )?;
        staged.buffer = Some(InnerBuffer::own(client.clone(), retrieve.buffer_out));
        Ok(staged)
    }

    /// The buffer itself, for the caller.
    pub fn take_handle(&mut self) -> Option<InnerBuffer> {
        self.buffer.take()
    }

    /// Fills the buffer from the received (row-major, unpacked) bytes,
    /// kept alive by `keep` until the plugin copied them.
    pub fn fill(mut self, address: usize, keep: KeepAlive) -> Outcome {
        self.done = true;
        let plugin = self.client.plugin().clone();
        let mut layout = DenseLayout::new(self.dims.len());
        let mut args = PJRT_AsyncHostToDeviceTransferManager_TransferLiteral_Args {
            struct_size: PJRT_AsyncHostToDeviceTransferManager_TransferLiteral_Args_STRUCT_SIZE
                as usize,
            extension_start: std::ptr::null_mut(),
            transfer_manager: self.manager.as_mut(),
            buffer_index: 0,
            data: address as *const c_void,
            shape_dims: self.dims.as_ptr(),
            shape_num_dims: self.dims.len(),
            shape_element_type: self.element_type,
            shape_layout: layout.as_mut_ptr(),
            done_with_h2d_transfer: std::ptr::null_mut(),
        };
        if let Err(e) = crate::inner_call!(
            plugin.as_ref(),
            PJRT_AsyncHostToDeviceTransferManager_TransferLiteral,
            &mut args
        ) {
            self.set_error(&e);
            return Err(e);
        }
        // The bytes and the manager stay until the plugin is done with them.
        let manager = StagedManager {
            client: self.client.clone(),
            manager: self.manager,
        };
        event_future(&plugin, args.done_with_h2d_transfer).on_ready(move |_| {
            drop(keep);
            drop(manager);
        });
        self.manager = InnerPtr(0);
        Ok(())
    }

    /// The receive failed: the buffer carries `status`.
    pub fn fail(mut self, status: &Status) -> Outcome {
        self.done = true;
        self.set_error(status);
        Ok(())
    }

    fn set_error(&self, status: &Status) {
        let message = status.message.clone();
        let mut args = PJRT_AsyncHostToDeviceTransferManager_SetBufferError_Args {
            struct_size: PJRT_AsyncHostToDeviceTransferManager_SetBufferError_Args_STRUCT_SIZE
                as usize,
            extension_start: std::ptr::null_mut(),
            transfer_manager: self.manager.as_mut(),
            buffer_index: 0,
            error_code: status.code as PJRT_Error_Code,
            error_message: message.as_ptr() as *const _,
            error_message_size: message.len(),
        };
        if let Err(e) = crate::inner_call!(
            self.client.plugin().as_ref(),
            PJRT_AsyncHostToDeviceTransferManager_SetBufferError,
            &mut args
        ) {
            log::error!("failing a receive buffer: {e}");
        }
    }
}

/// Destroys a transfer manager when dropped.
struct StagedManager {
    client: Arc<ComputeClient>,
    manager: InnerPtr,
}

// SAFETY: a thread-safe inner handle, destroyed once.
unsafe impl Send for StagedManager {}

impl Drop for StagedManager {
    fn drop(&mut self) {
        let mut args = PJRT_AsyncHostToDeviceTransferManager_Destroy_Args {
            struct_size: PJRT_AsyncHostToDeviceTransferManager_Destroy_Args_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            transfer_manager: self.manager.as_mut(),
        };
        if let Err(e) = crate::inner_call!(
            self.client.plugin().as_ref(),
            PJRT_AsyncHostToDeviceTransferManager_Destroy,
            &mut args
        ) {
            log::warn!("{e}");
        }
    }
}

impl Drop for StagedReceive {
    /// Never left pending (see `AliasBuffer`'s drop); the manager goes too.
    fn drop(&mut self) {
        if !self.done {
            self.set_error(&crate::status::cancelled(
                "the receive was abandoned before it started",
            ));
        }
        if !self.manager.is_null() {
            drop(StagedManager {
                client: self.client.clone(),
                manager: self.manager,
            });
        }
    }
}

/// A delegating client's receive buffer, until its outcome is recorded.
pub enum ComputeReceive {
    Alias(AliasBuffer),
    Staged(StagedReceive),
}

impl ComputeReceive {
    /// The compute plugin's buffer for the caller: an alias buffer, or a
    /// staged one for sub-byte element types.
    pub fn create(
        client: &Arc<ComputeClient>,
        memory: &ComputeMemory,
        element_type: PJRT_Buffer_Type,
        dims: &[i64],
        sub_byte: bool,
    ) -> Result<ComputeReceive> {
        if sub_byte {
            return StagedReceive::create(client, memory, element_type, dims)
                .map(ComputeReceive::Staged);
        }
        AliasBuffer::create(client, memory, element_type, dims).map(ComputeReceive::Alias)
    }

    pub fn take_handle(&mut self) -> Option<InnerBuffer> {
        match self {
            ComputeReceive::Alias(alias) => alias.take_handle(),
            ComputeReceive::Staged(staged) => staged.take_handle(),
        }
    }

    /// Records the received bytes (`len` at `address`, kept alive by `keep`).
    /// A view of the destination ahead of its bytes, where the buffer is an
    /// alias (see `AliasBuffer::prepare_view`); a staged buffer copies.
    pub fn prepare_view(&mut self, address: usize, keep: KeepAlive) {
        if let ComputeReceive::Alias(alias) = self {
            alias.prepare_view(address, keep);
        }
    }

    pub fn fulfill_with_host_bytes(self, address: usize, len: usize, keep: KeepAlive) -> Outcome {
        match self {
            ComputeReceive::Alias(alias) => alias.fulfill_with_host_bytes(address, len, keep),
            ComputeReceive::Staged(staged) => staged.fill(address, keep),
        }
    }

    /// Records a failed receive.
    pub fn fail(self, status: &Status) -> Outcome {
        match self {
            ComputeReceive::Alias(alias) => alias.fail(status),
            ComputeReceive::Staged(staged) => staged.fail(status),
        }
    }
}
