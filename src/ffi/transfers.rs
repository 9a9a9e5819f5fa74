//! The cross-host transfers extension (v1 and v2 entries): argument checks
//! and translation only; the protocol lives in `transfer/` behind
//! `api::transfers`.
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::raw::c_char;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::args::{
    array, buffer_arg, check_default_layout, client_arg, device_arg, event_arg, null_field,
    read_dims, read_str,
};
use super::boundary::Callback;
use super::errors::{error_into_raw, take_error};
use super::handles::{into_raw, route, try_take, BufferHandle, ClientHandle, EventHandle, Route};
use crate::api::client::Client;
use crate::api::element_type::{ElementType, Shape};
use crate::api::transfers::{PeerIncarnations, ReceiveSpec, ReceivedBuffer, SourceBuffer};
use crate::compute_plugin::InnerPtr;
use crate::pjrt::bindings::*;
use crate::status::panic_message;
use crate::status::{invalid_argument, Code, Result, Status};

const MAKE: &str = "PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers";
const COPY: &str = "PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice";
const RECV: &str = "PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers";
const SEND: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";

/// Reads the shape arrays shared by both receive entries.
///
/// # Safety
/// The arrays must each hold `num_shapes` readable entries (or be null).
unsafe fn read_shapes(
    num_shapes: usize,
    shape_num_dims: *const usize,
    num_dims: *const *const i64,
    element_types: *const PJRT_Buffer_Type,
    layouts: *const *mut PJRT_Buffer_MemoryLayout,
    function: &str,
) -> Result<Vec<Shape>> {
    if num_shapes == 0 {
        return Err(invalid_argument(format!(
            "{function}: num_shapes is 0; the shape list must not be empty"
        )));
    }
    // SAFETY: forwarded contract for each array.
    let ranks = unsafe { array(shape_num_dims, num_shapes, function, "shape_num_dims") }?;
    // SAFETY: as above.
    let dims = unsafe { array(num_dims, num_shapes, function, "num_dims") }?;
    // SAFETY: as above.
    let types = unsafe { array(element_types, num_shapes, function, "element_types") }?;
    let layouts = if layouts.is_null() {
        None
    } else {
        // SAFETY: as above.
        Some(unsafe { array(layouts, num_shapes, function, "layouts") }?)
    };
    let mut shapes = Vec::with_capacity(num_shapes);
    for i in 0..num_shapes {
        let context = format!("{function}: shape {i}");
        let element_type = ElementType::from_raw(types[i], &context)?;
        // SAFETY: dims[i] holds ranks[i] entries.
        let d = unsafe { read_dims(dims[i], ranks[i], &context) }?;
        let shape = Shape::new(element_type, d, &context)?;
        if let Some(layouts) = layouts {
            // SAFETY: entries are null (default) or readable layouts.
            unsafe { check_default_layout(layouts[i], &shape, &context) }?;
        }
        shapes.push(shape);
    }
    Ok(shapes)
}

/// A buffer a send reads: ours, or the compute plugin's (one rule for both,
/// see `handles/`).
///
/// # Safety
/// `buffer` must be null or a live buffer handle (ours or the compute
/// plugin's).
unsafe fn source_buffer(
    buffer: *mut PJRT_Buffer,
    function: &str,
    field: &str,
) -> Result<SourceBuffer> {
    // SAFETY: forwarded contract.
    Ok(
        match unsafe { route::<BufferHandle>(buffer, function, field) }? {
            Route::Ours(b) => SourceBuffer::Embedded(b.buffer.clone()),
            Route::Compute(_) => SourceBuffer::Compute(InnerPtr::from(buffer)),
        },
    )
}

/// Hands a received buffer to the caller.
fn hand_out(buffer: ReceivedBuffer, client: &ClientHandle) -> *mut PJRT_Buffer {
    match buffer {
        ReceivedBuffer::Embedded(buffer) => into_raw(BufferHandle::new(
            buffer,
            client.client.clone(),
            client.tables.clone(),
        )),
        ReceivedBuffer::Compute(alias) => alias.into_raw(),
    }
}

/// # Safety
/// When `num_tasks > 0` both arrays must hold `num_tasks` entries.
unsafe fn read_incarnations(
    num_tasks: usize,
    task_ids: *const i32,
    incarnation_ids: *const i64,
    function: &str,
) -> Result<Option<PeerIncarnations>> {
    if num_tasks == 0 {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let tasks = unsafe { array(task_ids, num_tasks, function, "task_ids") }?;
    // SAFETY: forwarded contract.
    let incarnations = unsafe { array(incarnation_ids, num_tasks, function, "incarnation_ids") }?;
    Ok(Some(PeerIncarnations::from_snapshot(tasks, incarnations)))
}

// ------------------------------ v2: receive ----------------------------------

crate::pjrt_entry!(
    /// v2 receive: one buffer per shape on `device`, filled by the send of
    /// `src_global_device_ids[i]` under `transfer_keys[i]`. Writes `num_shapes`
    /// buffers into the caller's `buffers` array; the caller owns them, and each
    /// buffer's ready event carries its own transfer's outcome. With the v8
    /// fields, `task_ids` / `incarnation_ids` are the caller's snapshot of the
    /// job's processes. INVALID_ARGUMENT for an empty or malformed shape list or
    /// a null array.
    cross_host_receive_buffers = "PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers", PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args through buffers, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, RECV) }?;
    // SAFETY: live device per contract.
    let device = unsafe { device_arg(args.device, RECV, "device") }?;
    // SAFETY: the header's arrays of num_shapes entries.
    let shapes = unsafe {
        read_shapes(args.num_shapes, args.shape_num_dims, args.num_dims as *const *const i64, args.element_types, args.layouts, RECV)
    }?;
    // SAFETY: as above.
    let sources = unsafe { array(args.src_global_device_ids, args.num_shapes, RECV, "src_global_device_ids") }?;
    // SAFETY: as above.
    let keys = unsafe { array(args.transfer_keys, args.num_shapes, RECV, "transfer_keys") }?;
    if args.buffers.is_null() {
        return Err(null_field(RECV, "buffers"));
    }
    let incarnations = if crate::has_field!(args, PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args, incarnation_ids) {
        // SAFETY: v8 fields exist (checked) and follow the header's contract.
        unsafe { read_incarnations(args.num_tasks, args.task_ids, args.incarnation_ids, RECV) }?
    } else {
        None
    };
    let specs = shapes
        .into_iter()
        .zip(sources)
        .zip(keys)
        .map(|((shape, &src), &key)| ReceiveSpec { shape, peer_global_device_id: src, transfer_key: key })
        .collect();
    let buffers = client.client.cross_host_receive(&device.device, specs, incarnations, RECV)?;
    // SAFETY: caller-allocated array of num_shapes entries (checked non-null).
    let out = unsafe { std::slice::from_raw_parts_mut(args.buffers, args.num_shapes) };
    for (slot, buffer) in out.iter_mut().zip(buffers) {
        *slot = hand_out(buffer, client);
    }
    Ok(())
});

// ------------------------------- v2: send ------------------------------------

crate::pjrt_entry!(
    /// v2 send: `buffers[i]` (ours or the compute plugin's) to the receive of
    /// `dst_global_device_ids[i]` under `transfer_keys[i]`. Writes `num_buffers`
    /// events into the caller's `send_events`; the caller owns them, each ready
    /// when its send is done. The caller keeps the buffers; one being sent is
    /// held until its send is done. INVALID_ARGUMENT for an empty list or a null
    /// array.
    cross_host_send_buffers = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers", PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args through send_events, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, SEND) }?;
    if args.num_buffers == 0 {
        return Err(invalid_argument(format!("{SEND}: num_buffers is 0; the buffer list must not be empty")));
    }
    // SAFETY: arrays of num_buffers entries per the header.
    let handles = unsafe { array(args.buffers as *const *mut PJRT_Buffer, args.num_buffers, SEND, "buffers") }?;
    // SAFETY: as above.
    let destinations = unsafe { array(args.dst_global_device_ids, args.num_buffers, SEND, "dst_global_device_ids") }?;
    // SAFETY: as above.
    let keys = unsafe { array(args.transfer_keys, args.num_buffers, SEND, "transfer_keys") }?;
    if args.send_events.is_null() {
        return Err(null_field(SEND, "send_events"));
    }
    let incarnations = if crate::has_field!(args, PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args, incarnation_ids) {
        // SAFETY: v8 fields exist (checked) and follow the header's contract.
        unsafe { read_incarnations(args.num_tasks, args.task_ids, args.incarnation_ids, SEND) }?
    } else {
        None
    };
    let mut buffers = Vec::with_capacity(handles.len());
    for (i, &h) in handles.iter().enumerate() {
        // SAFETY: live buffer handles per contract.
        buffers.push(unsafe { source_buffer(h, SEND, &format!("buffers[{i}]")) }?);
    }
    let events = client.client.cross_host_send(buffers, destinations, keys, incarnations, SEND)?;
    // SAFETY: caller-allocated array of num_buffers entries (checked non-null).
    let out = unsafe { std::slice::from_raw_parts_mut(args.send_events, args.num_buffers) };
    for (slot, future) in out.iter_mut().zip(events) {
        *slot = into_raw(EventHandle::from_future(future));
    }
    Ok(())
});

// ---------------------------- v1: cancellation -------------------------------

/// The cancel notifier's `user_arg` is an id into this table rather than a
/// pointer, so a late or forged cancel after the client is gone is a clean
/// error instead of a use-after-free.
static CANCEL_TARGETS: Lazy<Mutex<HashMap<u64, Weak<Client>>>> = Lazy::new(Default::default);
static NEXT_CANCEL_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn register_cancel_target(client: &Arc<Client>) -> u64 {
    let id = NEXT_CANCEL_ID.fetch_add(1, Ordering::Relaxed);
    let mut targets = CANCEL_TARGETS.lock();
    targets.retain(|_, c| c.strong_count() > 0);
    targets.insert(id, Arc::downgrade(client));
    id
}

/// The v1 cancel notifier we hand to a receive's notifier: fails the receive
/// buffers named by `serialized_descriptor` with `reason` (CANCELLED for 0)
/// and `error_message`, then reports once through `on_canceled`, which owns
/// the error: NOT_FOUND for a buffer already finished or cancelled,
/// INVALID_ARGUMENT once the client is gone, an error for a forged
/// descriptor (which touches nothing).
unsafe extern "C" fn cancel_notifier(
    serialized_descriptor: *const c_char,
    serialized_descriptor_size: usize,
    reason: PJRT_Error_Code,
    error_message: *const c_char,
    error_message_size: usize,
    on_canceled: PJRT_Transfers_CrossHostOnCanceledCallback,
    on_canceled_user_arg: *mut c_void,
    user_arg: *mut c_void,
) {
    const F: &str = "PJRT_Transfers_CrossHostRecvCancelNotifier";
    let outcome = std::panic::catch_unwind(|| -> Result<()> {
        // SAFETY: the caller passes the descriptor bytes it got from us (or
        // garbage, which the decoder rejects) valid for the stated size.
        let descriptor = unsafe {
            array(
                serialized_descriptor as *const u8,
                serialized_descriptor_size,
                F,
                "serialized_descriptor",
            )
        }?;
        // SAFETY: message bytes valid for the stated size.
        let message = unsafe { read_str(error_message, error_message_size, F, "error_message") }
            .unwrap_or_default();
        let code = if reason == 0 {
            Code::Cancelled
        } else {
            Code::from_raw(reason as i32)
        };
        let client = CANCEL_TARGETS
            .lock()
            .get(&(user_arg as u64))
            .and_then(Weak::upgrade)
            .ok_or_else(|| {
                invalid_argument(format!("{F}: the receiving client no longer exists"))
            })?;
        client.cancel_receive(descriptor, Status::new(code, message), F)
    });
    let error = match outcome {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(status)) => error_into_raw(status),
        Err(panic) => error_into_raw(crate::status::internal(format!(
            "{F}: internal error (panic: {})",
            panic_message(&*panic)
        ))),
    };
    match on_canceled {
        // SAFETY: the caller's callback; it takes ownership of `error`.
        Some(f) => unsafe { f(error, on_canceled_user_arg) },
        None => {
            log::error!("{F}: on_canceled is null; cancellation result dropped");
            // SAFETY: nobody else owns the error.
            drop(unsafe { take_error(error) });
        }
    }
}

// ------------------------------ v1: receive ----------------------------------

crate::pjrt_entry!(
    /// v1 receive: one buffer per shape on `device`, written into the caller's
    /// `buffers` (`num_buffers` set); the caller owns them. Then the notifier
    /// gets their descriptors exactly once, before this entry returns
    /// (borrowed for that call), and, with `allow_cancel_notifier`, our
    /// `cancel_notifier`. Argument errors are returned without calling the
    /// notifier, so the caller never sees one failure twice.
    make_cross_host_receive_buffers = "PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers", PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args through num_buffers, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, MAKE) }?;
    // SAFETY: live device per contract.
    let device = unsafe { device_arg(args.device, MAKE, "device") }?;
    let notifier = args
        .notifier
        .notifier
        .ok_or_else(|| null_field(MAKE, "notifier.notifier"))?;
    // SAFETY: the header's arrays of num_shapes entries.
    let shapes = unsafe {
        read_shapes(
            args.num_shapes,
            args.shape_num_dims,
            args.num_dims as *const *const i64,
            args.element_types,
            args.layouts,
            MAKE,
        )
    }?;
    if args.buffers.is_null() {
        return Err(null_field(MAKE, "buffers"));
    }
    let allow_cancel = crate::has_field!(
        args,
        PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args,
        allow_cancel_notifier
    ) && args.allow_cancel_notifier;
    let (buffers, descriptors) = client.client.make_receive_buffers(&device.device, shapes, MAKE)?;
    let count = buffers.len();
    // SAFETY: caller-allocated array of num_shapes entries (checked non-null).
    let out = unsafe { std::slice::from_raw_parts_mut(args.buffers, count) };
    for (slot, buffer) in out.iter_mut().zip(buffers) {
        *slot = hand_out(buffer, client);
    }
    args.num_buffers = count;
    let mut pointers: Vec<*const c_char> = descriptors
        .iter()
        .map(|d| d.as_ptr() as *const c_char)
        .collect();
    let mut sizes: Vec<usize> = descriptors.iter().map(Vec::len).collect();
    let (cancel, cancel_arg) = if allow_cancel {
        let id = register_cancel_target(&client.client);
        (
            Some(cancel_notifier as unsafe extern "C" fn(_, _, _, _, _, _, _, _)),
            id as *mut c_void,
        )
    } else {
        (None, std::ptr::null_mut())
    };
    let user_arg = args.notifier.user_arg;
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the caller's notifier; the descriptor arrays live for
        // the duration of the call, as the header requires.
        unsafe {
            notifier(
                std::ptr::null_mut(),
                pointers.as_mut_ptr(),
                sizes.as_mut_ptr(),
                count,
                user_arg,
                cancel,
                cancel_arg,
            )
        }
    }));
    Ok(())
});

// ------------------------------- v1: send ------------------------------------

/// An event handle the caller gave us; destroyed once it is ready.
struct OwnedEvent(usize);

impl OwnedEvent {
    fn destroy(self) {
        // SAFETY: the caller transferred ownership of this live event handle
        // to CopyToRemoteDevice; it is destroyed exactly once, here.
        // `PJRT_Event_Set` works on its own clone of the promise, so freeing
        // the handle from inside the set's callbacks is sound.
        if let Err(e) = unsafe { try_take::<EventHandle>(self.0 as *mut PJRT_Event, COPY, "event") }
        {
            log::error!("{e}");
        }
    }
}

#[derive(Clone, Copy)]
struct OnDone {
    callback: unsafe extern "C" fn(*mut PJRT_Error, bool, *mut c_void),
    user_arg: usize,
}

impl Callback<PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args> for OnDone {
    const FIELD: &'static str = "on_done.on_done";

    fn from_args(args: &PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args) -> Option<OnDone> {
        Some(OnDone {
            callback: args.on_done.on_done?,
            user_arg: args.on_done.user_arg as usize,
        })
    }

    /// A failure before any send was enqueued.
    fn report(self, status: Status) {
        self.call(Err(status), false);
    }
}

impl OnDone {
    fn call(self, outcome: Result<()>, sends_were_enqueued: bool) {
        let error = match outcome {
            Ok(()) => std::ptr::null_mut(),
            Err(status) => error_into_raw(status),
        };
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: the caller's on_done; it takes ownership of `error`.
            unsafe { (self.callback)(error, sends_were_enqueued, self.user_arg as *mut c_void) }
        });
    }
}

/// Where the caller will have written the descriptor, and how to release
/// those two pointers afterwards.
struct DescriptorSlot {
    data: usize,
    size: usize,
    release: Release,
}

/// How the caller's two descriptor pointers are released.
enum Release {
    /// v6+: through the caller's destructor.
    Destructor(unsafe extern "C" fn(*mut *mut c_char, *mut usize)),
    /// v6+ with a NULL destructor: the caller keeps them; nothing to free.
    Nothing,
    /// v5: C++ `delete`, as upstream did.
    CxxDelete,
}

impl DescriptorSlot {
    /// Copies the descriptor out, then releases the caller's pointers exactly
    /// once: through the v6 destructor, or — for v5 callers, whose contract
    /// was that the plugin frees them with C++ `delete` — through the C++
    /// shim built alongside the plugin.
    fn take(self) -> Result<Vec<u8>> {
        let data_ptr = self.data as *mut *mut c_char;
        let size_ptr = self.size as *mut usize;
        // SAFETY: the caller promised both pointers are readable once the
        // event is ready (or at once without an event).
        let bytes = unsafe {
            array(
                *data_ptr as *const u8,
                *size_ptr,
                COPY,
                "*serialized_descriptor",
            )
        }
        .map(<[u8]>::to_vec);
        match self.release {
            // SAFETY: the caller's destructor for exactly these pointers.
            Release::Destructor(destroy) => unsafe { destroy(data_ptr, size_ptr) },
            Release::Nothing => {}
            // SAFETY: v5 callers allocated both with C++ `new`.
            Release::CxxDelete => unsafe {
                super::cxx_delete::delete_v5_descriptor_pointers(data_ptr, size_ptr)
            },
        }
        bytes
    }
}

crate::callback_entry!(
    /// v1 send: `buffer` (ours or the compute plugin's) to the receive buffer
    /// its serialized descriptor names. The descriptor is read at once when
    /// `event` is null, else once `event` is ready (the caller sets it after
    /// writing the descriptor); its two pointers are then released through
    /// `descriptor_destructor` (v6; NULL: the caller keeps them) or C++
    /// `delete` (v5 callers). The caller
    /// gives up `event`: we destroy it once ready. The outcome goes once to
    /// `on_done(error, sends_were_enqueued, user_arg)`, which owns the error;
    /// an event never set ends in DEADLINE_EXCEEDED after the client's send
    /// timeout instead of never.
    copy_to_remote_device = "PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice", PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args through on_done, |args, on_done: OnDone| {
    start_copy_to_remote(args, on_done)
});

fn start_copy_to_remote(
    args: &mut PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args,
    on_done: OnDone,
) -> Result<()> {
    // The event is ours from here on, whatever happens next. The caller may
    // still `PJRT_Event_Set` it (JAX's v1 path does, once the descriptor
    // arrived), so the handle lives until the event is ready and is
    // destroyed then.
    let descriptor_ready = if args.event.is_null() {
        None
    } else {
        // SAFETY: the caller transfers ownership of a live event.
        let event = unsafe { event_arg(args.event, COPY) }?;
        let future = event.future.clone();
        let owned = OwnedEvent(args.event as usize);
        future.on_ready(move |_| owned.destroy());
        Some(future)
    };
    // SAFETY: live buffer per contract.
    let source = unsafe { source_buffer(args.buffer, COPY, "buffer") }?;
    let client = match &source {
        SourceBuffer::Embedded(buffer) => embedded_owner(args.buffer, buffer)?,
        SourceBuffer::Compute(inner) => delegating_owner(*inner)?,
    };
    if args.serialized_descriptor.is_null() || args.serialized_descriptor_size.is_null() {
        return Err(null_field(
            COPY,
            "serialized_descriptor / serialized_descriptor_size",
        ));
    }
    let release = if crate::has_field!(
        args,
        PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args,
        descriptor_destructor
    ) {
        args.descriptor_destructor
            .map_or(Release::Nothing, Release::Destructor)
    } else {
        Release::CxxDelete
    };
    let slot = DescriptorSlot {
        data: args.serialized_descriptor as usize,
        size: args.serialized_descriptor_size as usize,
        release,
    };
    let bounded_client = client.clone();
    let send = move |ready: Result<()>| {
        let descriptor = match ready.and_then(|()| slot.take()) {
            Ok(d) => d,
            Err(status) => return on_done.call(Err(status), false),
        };
        match client.send_to_descriptor(source, &descriptor, COPY) {
            Ok(done) => done.on_ready(move |outcome| on_done.call(outcome.clone(), true)),
            Err(status) => on_done.call(Err(status), false),
        }
    };
    match descriptor_ready {
        None => send(Ok(())),
        // Bounded: an event never set ends in DEADLINE_EXCEEDED through
        // on_done after the client's send timeout, instead of never.
        Some(future) => bounded_client
            .bounded_by_send_timeout(future, "the descriptor event")
            .on_ready(move |outcome| send(outcome.clone())),
    }
    Ok(())
}

/// The client of one of our buffers.
fn embedded_owner(
    raw: *mut PJRT_Buffer,
    _buffer: &Arc<crate::api::buffer::Buffer>,
) -> Result<Arc<Client>> {
    // SAFETY: `source_buffer` just established that `raw` is our live buffer.
    Ok(unsafe { buffer_arg(raw, COPY, "buffer") }?.client.clone())
}

/// The delegating client whose compute plugin made `buffer`.
fn delegating_owner(buffer: InnerPtr) -> Result<Arc<Client>> {
    let plugin = crate::compute_plugin::loaded().ok_or_else(|| {
        invalid_argument(format!("{COPY}: buffer is not a live PJRT_Buffer handle"))
    })?;
    let mut args = PJRT_Buffer_Device_Args {
        struct_size: PJRT_Buffer_Device_Args_STRUCT_SIZE as usize,
        buffer: buffer.as_mut(),
        ..Default::default()
    };
    crate::inner_call!(plugin.as_ref(), PJRT_Buffer_Device, &mut args)?;
    super::handles::client_of_compute_device(args.device).ok_or_else(|| {
        invalid_argument(format!(
            "{COPY}: the buffer belongs to no live client of this plugin"
        ))
    })
}

// ------------------------------- the table ----------------------------------

struct ExtensionTable(PJRT_CrossHostTransfers_Extension);
// SAFETY: immutable after construction; function pointers only.
unsafe impl Sync for ExtensionTable {}
// SAFETY: as above.
unsafe impl Send for ExtensionTable {}

static EXTENSION: Lazy<ExtensionTable> = Lazy::new(|| {
    ExtensionTable(PJRT_CrossHostTransfers_Extension {
        base: PJRT_Extension_Base {
            struct_size: std::mem::size_of::<PJRT_CrossHostTransfers_Extension>(),
            type_: PJRT_Extension_Type_CrossHostTransfers,
            // The compute plugin's extensions follow ours.
            next: crate::compute_plugin::loaded()
                .map(|plugin| super::forward::extensions::compute_chain(&plugin))
                .unwrap_or(std::ptr::null_mut()),
        },
        PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers: Some(
            make_cross_host_receive_buffers,
        ),
        PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice: Some(copy_to_remote_device),
        PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers: Some(cross_host_receive_buffers),
        PJRT_Transfers_PJRT_Client_CrossHostSendBuffers: Some(cross_host_send_buffers),
    })
});

/// The head of the extension chain for `PJRT_Api.extension_start`.
pub(crate) fn extension_chain() -> *mut PJRT_Extension_Base {
    &EXTENSION.0.base as *const PJRT_Extension_Base as *mut PJRT_Extension_Base
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_struct_sizes_match_the_abi_document() {
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args,
                send_events
            ),
            64
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args,
                incarnation_ids
            ),
            88
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args,
                buffers
            ),
            96
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args,
                incarnation_ids
            ),
            120
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args,
                num_buffers
            ),
            104
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args,
                allow_cancel_notifier
            ),
            105
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args,
                on_done
            ),
            64
        );
        assert_eq!(
            crate::struct_size_through!(
                PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args,
                descriptor_destructor
            ),
            72
        );
    }
}
