//! C handles ↔ Rust objects, and the one handle rule.
//!
//! # The one handle rule
//!
//! Every handle a caller gets from this plugin comes back to it and is
//! understood, because each handle type has one owner:
//!
//! | handle | whose |
//! |---|---|
//! | `PJRT_Client`, `PJRT_Device`, `PJRT_Memory` | always ours; a delegating client wraps the compute plugin's client, devices and memories and unwraps them on the way in |
//! | `PJRT_DeviceDescription` | ours for our devices; a topology's descriptions are the compute plugin's |
//! | `PJRT_Buffer`, `PJRT_Event` | ours for an embedded backend's buffers and for events we make (`PJRT_Event_Create`, send events); the compute plugin's for a delegating client's buffers (receive buffers included: its alias buffers) and their events |
//! | executables, topologies, execute contexts, async transfer managers, copy streams, tracking events, layouts, memory descriptions | always the compute plugin's (we make none) |
//! | `PJRT_Error` | always ours: the compute plugin's errors are converted as they cross |
//!
//! Every handle we make begins with a tag word (`#[repr(C)]`, tag first;
//! a memory's tag follows its vtable pointer, an error is known by its
//! vtable). `route` reads that word: one of our tags of the expected type is
//! ours; another of our tags, or `DEAD` (a destroyed handle), is an error;
//! any other word is the compute plugin's handle when one is loaded (no
//! pointer the inner plugin makes can begin with our tags: they are not
//! canonical addresses), and an error otherwise.
//!
//! Ownership follows rustls-ffi's `Castable`: a handle type says whether C
//! holds a `Box` (made by `into_raw`, destroyed by a `_Destroy` entry through
//! `try_take`) or borrows an object that lives in its client's tables
//! (`try_borrow` only).
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::{Mutex, RwLock};

use crate::api::buffer::Buffer;
use crate::api::client::Client;
use crate::api::device::{Device, Memory};
use crate::compute_plugin::{self, ComputePlugin, InnerPtr};
use crate::pjrt::bindings::*;
use crate::pjrt::named_values::{NamedValue, NamedValues};
use crate::status::{invalid_argument, Result};
use crate::sync::{Future, PromiseOnce};

const DEAD: u64 = 0xdead_dead_dead_dead;
const CLIENT_TAG: u64 = 0x4348_434c_4945_4e54;
const DEVICE_TAG: u64 = 0x4348_4445_5649_4345;
const DESCRIPTION_TAG: u64 = 0x4348_4445_5343_5200;
const MEMORY_TAG: u64 = 0x4348_4d45_4d4f_5259;
const BUFFER_TAG: u64 = 0x4348_4255_4646_4552;
const EVENT_TAG: u64 = 0x4348_4556_454e_5400;
const OUR_TAGS: [u64; 6] = [
    CLIENT_TAG,
    DEVICE_TAG,
    DESCRIPTION_TAG,
    MEMORY_TAG,
    BUFFER_TAG,
    EVENT_TAG,
];

/// C holds a `Box` of the handle and destroys it.
pub(crate) struct OwnedBox;
/// C borrows the handle from its client's tables.
pub(crate) struct Borrowed;

/// Implemented by every handle type.
pub(crate) trait Castable: Sized {
    /// The C type callers see.
    type C;
    /// `OwnedBox` or `Borrowed`.
    type Ownership;
    const TAG: u64;
    /// Byte offset of the tag word.
    const TAG_OFFSET: usize = 0;
    const WHAT: &'static str;
    fn set_dead(&mut self);
}

/// Reads the tag word of a handle-shaped pointer.
///
/// # Safety
/// `ptr` must be non-null and point to at least `offset + 8` readable bytes.
unsafe fn tag_word(ptr: *const c_void, offset: usize) -> u64 {
    // SAFETY: forwarded contract; unaligned read, the word's alignment is
    // not ours to promise for a foreign handle.
    unsafe {
        (ptr as *const u8)
            .add(offset)
            .cast::<u64>()
            .read_unaligned()
    }
}

fn not_live<H: Castable>(function: &str, field: &str) -> crate::status::Status {
    invalid_argument(format!(
        "{function}: {field} is not a live {} handle",
        H::WHAT
    ))
}

/// Borrows the Rust object behind one of our handles.
///
/// # Safety
/// `ptr` must be null or a pointer to a handle-shaped object at least
/// `TAG_OFFSET + 8` bytes long that has not been freed (the tag check
/// catches type confusion and destroyed handles whose memory was not reused,
/// but cannot make a freed pointer readable).
pub(crate) unsafe fn try_borrow<'a, H: Castable>(
    ptr: *const H::C,
    function: &str,
    field: &str,
) -> Result<&'a H> {
    if ptr.is_null() {
        return Err(invalid_argument(format!("{function}: {field} is null")));
    }
    // SAFETY: forwarded contract.
    if unsafe { tag_word(ptr.cast(), H::TAG_OFFSET) } != H::TAG {
        return Err(not_live::<H>(function, field));
    }
    // SAFETY: our tag at our offset: the pointer is an `H` we made.
    Ok(unsafe { &*(ptr as *const H) })
}

/// Gives C an owned handle.
pub(crate) fn into_raw<H: Castable<Ownership = OwnedBox>>(handle: H) -> *mut H::C {
    Box::into_raw(Box::new(handle)) as *mut H::C
}

/// Takes back an owned handle for destruction; its tag is poisoned so a
/// second destroy (or a later use) is caught while the allocator has not
/// reused the memory.
///
/// # Safety
/// Same as `try_borrow`, and the handle must not be used again.
pub(crate) unsafe fn try_take<H: Castable<Ownership = OwnedBox>>(
    ptr: *mut H::C,
    function: &str,
    field: &str,
) -> Result<Box<H>> {
    // SAFETY: forwarded contract.
    unsafe { try_borrow::<H>(ptr, function, field) }?;
    // SAFETY: made by `into_raw` as a Box<H>; the tag was checked.
    let mut boxed = unsafe { Box::from_raw(ptr as *mut H) };
    boxed.set_dead();
    Ok(boxed)
}

/// Whose a routable handle is.
pub(crate) enum Route<'a, H> {
    Ours(&'a H),
    /// The compute plugin's handle: forward it.
    Compute(Arc<ComputePlugin>),
}

/// Decides whose handle `ptr` is (see the module doc).
///
/// # Safety
/// As `try_borrow`.
pub(crate) unsafe fn route<'a, H: Castable>(
    ptr: *const H::C,
    function: &str,
    field: &str,
) -> Result<Route<'a, H>> {
    if ptr.is_null() {
        return Err(invalid_argument(format!("{function}: {field} is null")));
    }
    // SAFETY: forwarded contract (routable handles keep their tag at 0).
    let word = unsafe { tag_word(ptr.cast(), 0) };
    if word == H::TAG {
        // SAFETY: our tag: an `H` we made.
        return Ok(Route::Ours(unsafe { &*(ptr as *const H) }));
    }
    if word == DEAD || OUR_TAGS.contains(&word) {
        return Err(not_live::<H>(function, field));
    }
    match compute_plugin::loaded() {
        Some(plugin) => Ok(Route::Compute(plugin)),
        None => Err(not_live::<H>(function, field)),
    }
}

/// Whether `ptr` is one of our handles of any type (a forwarded call must
/// not hand the compute plugin one of ours).
///
/// # Safety
/// `ptr` must be null or a readable handle-shaped object.
pub(crate) unsafe fn is_ours(ptr: *const c_void) -> bool {
    // SAFETY: forwarded contract.
    !ptr.is_null() && {
        let word = unsafe { tag_word(ptr, 0) };
        word == DEAD || OUR_TAGS.contains(&word)
    }
}

macro_rules! castable {
    ($ty:ident, $c:ident, $ownership:ident, $tag:expr, $what:literal) => {
        castable!($ty, $c, $ownership, $tag, $what, 0);
    };
    ($ty:ident, $c:ident, $ownership:ident, $tag:expr, $what:literal, $offset:expr) => {
        impl Castable for $ty {
            type C = $c;
            type Ownership = $ownership;
            const TAG: u64 = $tag;
            const TAG_OFFSET: usize = $offset;
            const WHAT: &'static str = $what;
            fn set_dead(&mut self) {
                self.tag = DEAD;
            }
        }
    };
}

/// A raw pointer table that is immutable after construction.
pub(crate) struct PtrList<T>(pub Vec<*mut T>);
// SAFETY: the pointees are handles owned by the same ClientTables, immutable
// after construction and themselves Sync.
unsafe impl<T> Send for PtrList<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for PtrList<T> {}

// --------------------------------- client -----------------------------------

#[repr(C)]
pub(crate) struct ClientHandle {
    tag: u64,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
}
castable!(
    ClientHandle,
    PJRT_Client,
    OwnedBox,
    CLIENT_TAG,
    "PJRT_Client"
);

/// Device, description and memory handles of one client, alive as long as
/// the client or any of its (embedded) buffers.
pub(crate) struct ClientTables {
    // Boxed so that the addresses handed to C stay fixed.
    #[allow(clippy::vec_box)]
    devices: Vec<Box<DeviceHandle>>,
    #[allow(clippy::vec_box)]
    memories: Vec<Box<MemoryHandle>>,
    pub all_devices: PtrList<PJRT_Device>,
    pub addressable_devices: PtrList<PJRT_Device>,
    pub addressable_memories: PtrList<PJRT_Memory>,
}

impl ClientHandle {
    pub fn new(client: Arc<Client>) -> ClientHandle {
        let mut memories: Vec<Box<MemoryHandle>> = Vec::new();
        for device in client.devices() {
            for memory in &device.memories {
                if !memories.iter().any(|m| Arc::ptr_eq(&m.memory, memory)) {
                    memories.push(Box::new(MemoryHandle::new(memory.clone())));
                }
            }
        }
        let memory_ptr = |memories: &[Box<MemoryHandle>], memory: &Arc<Memory>| {
            memories
                .iter()
                .find(|m| Arc::ptr_eq(&m.memory, memory))
                .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
                .expect("every device memory has a handle")
        };
        let devices: Vec<Box<DeviceHandle>> = client
            .devices()
            .iter()
            .map(|d| {
                let all = d
                    .memories
                    .iter()
                    .map(|m| memory_ptr(&memories, m))
                    .collect();
                DeviceHandle::new(d.clone(), memory_ptr(&memories, &d.memory), PtrList(all))
            })
            .collect();
        let ptr_of = |d: &DeviceHandle| d as *const DeviceHandle as *mut PJRT_Device;
        // Wire memory → device back pointers now that device boxes are fixed.
        for memory in memories.iter_mut() {
            let addressing = memory
                .memory
                .devices
                .iter()
                .filter_map(|id| devices.iter().find(|d| d.device.global_id == *id))
                .map(|d| ptr_of(d))
                .collect();
            memory.devices = PtrList(addressing);
        }
        let all_devices = PtrList(devices.iter().map(|d| ptr_of(d)).collect());
        let addressable_devices = PtrList(
            devices
                .iter()
                .filter(|d| d.device.addressable)
                .map(|d| ptr_of(d))
                .collect(),
        );
        let addressable_memories = PtrList(
            memories
                .iter()
                .filter(|m| {
                    client
                        .device_by_global_id(m.memory.device_global_id(), "")
                        .is_ok_and(|d| d.addressable)
                })
                .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
                .collect(),
        );
        let tables = ClientTables {
            devices,
            memories,
            all_devices,
            addressable_devices,
            addressable_memories,
        };
        tables.register_compute_handles(&client);
        ClientHandle {
            tag: Self::TAG,
            client,
            tables: Arc::new(tables),
        }
    }
}

/// The compute plugin's device → (our handle's address, the delegating client
/// that owns it).
type ComputeDeviceMap = HashMap<InnerPtr, (usize, Weak<Client>)>;

/// The compute plugin's device and memory handles → ours, for outputs of
/// forwarded calls (a buffer's device, an executable's devices).
static COMPUTE_DEVICES: Lazy<RwLock<ComputeDeviceMap>> = Lazy::new(Default::default);
static COMPUTE_MEMORIES: Lazy<RwLock<HashMap<InnerPtr, usize>>> = Lazy::new(Default::default);

/// Our device handle wrapping the compute plugin's `inner`, if any.
pub(crate) fn device_of_compute(inner: *mut PJRT_Device) -> Option<*mut PJRT_Device> {
    COMPUTE_DEVICES
        .read()
        .get(&InnerPtr::from(inner))
        .map(|(p, _)| *p as *mut PJRT_Device)
}

/// The delegating client that owns the compute plugin's device `inner`.
pub(crate) fn client_of_compute_device(inner: *mut PJRT_Device) -> Option<Arc<Client>> {
    COMPUTE_DEVICES
        .read()
        .get(&InnerPtr::from(inner))
        .and_then(|(_, client)| client.upgrade())
}

/// Our memory handle wrapping the compute plugin's `inner`, if any.
pub(crate) fn memory_of_compute(inner: *mut PJRT_Memory) -> Option<*mut PJRT_Memory> {
    COMPUTE_MEMORIES
        .read()
        .get(&InnerPtr::from(inner))
        .map(|&p| p as *mut PJRT_Memory)
}

impl ClientTables {
    fn register_compute_handles(&self, client: &Arc<Client>) {
        let mut devices = COMPUTE_DEVICES.write();
        for d in &self.devices {
            if let Some(inner) = &d.device.compute {
                devices.insert(
                    inner.device,
                    (&**d as *const DeviceHandle as usize, Arc::downgrade(client)),
                );
            }
        }
        let mut memories = COMPUTE_MEMORIES.write();
        for m in &self.memories {
            if let Some(inner) = &m.memory.compute {
                memories.insert(inner.memory, &**m as *const MemoryHandle as usize);
            }
        }
    }

    pub fn device_ptr(&self, global_id: i32) -> *mut PJRT_Device {
        self.devices
            .iter()
            .find(|d| d.device.global_id == global_id)
            .map(|d| &**d as *const DeviceHandle as *mut PJRT_Device)
            .unwrap_or(std::ptr::null_mut())
    }

    /// Our handle of `memory` (one of this client's memories).
    pub fn memory_ptr(&self, memory: &Arc<Memory>) -> *mut PJRT_Memory {
        self.memories
            .iter()
            .find(|m| Arc::ptr_eq(&m.memory, memory))
            .map(|m| &**m as *const MemoryHandle as *mut PJRT_Memory)
            .unwrap_or(std::ptr::null_mut())
    }
}

impl Drop for ClientTables {
    fn drop(&mut self) {
        let mut devices = COMPUTE_DEVICES.write();
        for d in &self.devices {
            if let Some(inner) = &d.device.compute {
                devices.remove(&inner.device);
            }
        }
        let mut memories = COMPUTE_MEMORIES.write();
        for m in &self.memories {
            if let Some(inner) = &m.memory.compute {
                memories.remove(&inner.memory);
            }
        }
    }
}

// --------------------------------- device -----------------------------------

#[repr(C)]
pub(crate) struct DeviceHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub description: DescriptionHandle,
    default_memory: *mut PJRT_Memory,
    pub memories: PtrList<PJRT_Memory>,
}
castable!(
    DeviceHandle,
    PJRT_Device,
    Borrowed,
    DEVICE_TAG,
    "PJRT_Device"
);

// SAFETY: the memory pointers point into the same ClientTables, which is
// immutable after construction; `Device` is Sync.
unsafe impl Send for DeviceHandle {}
// SAFETY: as above.
unsafe impl Sync for DeviceHandle {}

impl DeviceHandle {
    fn new(
        device: Arc<Device>,
        default_memory: *mut PJRT_Memory,
        memories: PtrList<PJRT_Memory>,
    ) -> Box<DeviceHandle> {
        Box::new(DeviceHandle {
            tag: Self::TAG,
            description: DescriptionHandle::new(device.clone()),
            device,
            default_memory,
            memories,
        })
    }

    pub fn memory_ptr(&self) -> *mut PJRT_Memory {
        self.default_memory
    }

    pub fn description_ptr(&self) -> *mut PJRT_DeviceDescription {
        &self.description as *const DescriptionHandle as *mut PJRT_DeviceDescription
    }

    /// The compute plugin's device behind a delegating client's device.
    pub fn compute_device(&self) -> Option<*mut PJRT_Device> {
        self.device.compute.as_ref().map(|c| c.device.as_mut())
    }
}

#[repr(C)]
pub(crate) struct DescriptionHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub attributes: NamedValues,
}
castable!(
    DescriptionHandle,
    PJRT_DeviceDescription,
    Borrowed,
    DESCRIPTION_TAG,
    "PJRT_DeviceDescription"
);

impl DescriptionHandle {
    fn new(device: Arc<Device>) -> DescriptionHandle {
        let mut named = vec![
            (
                "backend".into(),
                NamedValue::Str(device.backend.name().into()),
            ),
            (
                "global_device_id".into(),
                NamedValue::Int(device.global_id as i64),
            ),
        ];
        if device.compute.is_some() {
            named[0].1 = NamedValue::Str("compute_plugin".into());
            named.extend(
                device
                    .compute_attributes
                    .iter()
                    .filter(|(name, _)| name != "backend" && name != "global_device_id")
                    .cloned(),
            );
        } else if device.addressable {
            let index = device.local_hardware_id as usize;
            named.extend(device.backend.device_attributes(index));
        }
        DescriptionHandle {
            tag: Self::TAG,
            device,
            attributes: NamedValues::new(named),
        }
    }

    /// The compute plugin's description behind a delegating client's device.
    pub fn compute_description(&self) -> Option<*mut PJRT_DeviceDescription> {
        self.device.compute.as_ref().map(|c| c.description.as_mut())
    }
}

// --------------------------------- memory -----------------------------------

/// `PJRT_Memory` must begin with its vtable pointer (pjrt_c_api.h 0.114).
#[repr(C)]
pub(crate) struct MemoryHandle {
    base: PJRT_Memory,
    tag: u64,
    pub memory: Arc<Memory>,
    pub devices: PtrList<PJRT_Device>,
    user_data: Mutex<HashMap<usize, UserData>>,
}
castable!(
    MemoryHandle,
    PJRT_Memory,
    Borrowed,
    MEMORY_TAG,
    "PJRT_Memory",
    std::mem::size_of::<PJRT_Memory>()
);

// SAFETY: `base` points at an immutable static vtable; user data is guarded by
// its mutex; everything else is immutable after construction.
unsafe impl Send for MemoryHandle {}
// SAFETY: as above.
unsafe impl Sync for MemoryHandle {}

struct UserData {
    data: usize,
    dtor: Option<unsafe extern "C" fn(*mut c_void)>,
}

impl Drop for UserData {
    fn drop(&mut self) {
        if let Some(dtor) = self.dtor {
            // SAFETY: the framework registered this destructor for this data.
            unsafe { dtor(self.data as *mut c_void) };
        }
    }
}

struct MemoryTable(PJRT_Memory_FunctionTable);
// SAFETY: immutable function table with a null extension pointer.
unsafe impl Sync for MemoryTable {}

static MEMORY_TABLE: MemoryTable = MemoryTable(PJRT_Memory_FunctionTable {
    struct_size: std::mem::size_of::<PJRT_Memory_FunctionTable>(),
    extension_start: std::ptr::null_mut(),
    instance_struct_size: std::mem::size_of::<PJRT_Memory>(),
    get_user_data: Some(memory_get_user_data),
    set_user_data: Some(memory_set_user_data),
});

/// Memory vtable `get_user_data`: what the framework stored under `key`,
/// or null.
unsafe extern "C" fn memory_get_user_data(
    memory: *mut PJRT_Memory,
    key: *const c_void,
) -> *mut c_void {
    // SAFETY: our vtable is only installed on MemoryHandles.
    let handle = unsafe { &*(memory as *const MemoryHandle) };
    handle
        .user_data
        .lock()
        .get(&(key as usize))
        .map(|u| u.data as *mut c_void)
        .unwrap_or(std::ptr::null_mut())
}

/// Memory vtable `set_user_data`: stores `data` under `key`; the value it
/// replaces is handed to its own destructor.
unsafe extern "C" fn memory_set_user_data(
    memory: *mut PJRT_Memory,
    key: *const c_void,
    data: *mut c_void,
    dtor: Option<unsafe extern "C" fn(*mut c_void)>,
) {
    // SAFETY: our vtable is only installed on MemoryHandles.
    let handle = unsafe { &*(memory as *const MemoryHandle) };
    let replaced = handle.user_data.lock().insert(
        key as usize,
        UserData {
            data: data as usize,
            dtor,
        },
    );
    // The previous value's destructor runs outside the lock.
    drop(replaced);
}

impl MemoryHandle {
    fn new(memory: Arc<Memory>) -> MemoryHandle {
        MemoryHandle {
            base: PJRT_Memory {
                vtable: &MEMORY_TABLE.0,
            },
            tag: Self::TAG,
            memory,
            devices: PtrList(Vec::new()),
            user_data: Mutex::new(HashMap::new()),
        }
    }

    /// The compute plugin's memory behind a delegating client's memory.
    pub fn compute_memory(&self) -> Option<*mut PJRT_Memory> {
        self.memory.compute.as_ref().map(|c| c.memory.as_mut())
    }
}

// --------------------------------- buffer -----------------------------------

#[repr(C)]
pub(crate) struct BufferHandle {
    tag: u64,
    pub buffer: Arc<Buffer>,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
    /// Stable storage for the dims/layout pointers handed to callers.
    pub dims: Vec<i64>,
    pub minor_to_major: Vec<i64>,
}
castable!(
    BufferHandle,
    PJRT_Buffer,
    OwnedBox,
    BUFFER_TAG,
    "PJRT_Buffer"
);

impl BufferHandle {
    pub fn new(
        buffer: Arc<Buffer>,
        client: Arc<Client>,
        tables: Arc<ClientTables>,
    ) -> BufferHandle {
        let dims = buffer.shape().dims.clone();
        let minor_to_major = buffer.shape().default_minor_to_major();
        BufferHandle {
            tag: Self::TAG,
            buffer,
            client,
            tables,
            dims,
            minor_to_major,
        }
    }
}

// --------------------------------- event ------------------------------------

#[repr(C)]
pub(crate) struct EventHandle {
    tag: u64,
    pub future: Future,
    /// Set only for events made by `PJRT_Event_Create`, which the caller
    /// completes with `PJRT_Event_Set`.
    pub promise: Option<PromiseOnce>,
}
castable!(EventHandle, PJRT_Event, OwnedBox, EVENT_TAG, "PJRT_Event");

impl EventHandle {
    pub fn from_future(future: Future) -> EventHandle {
        EventHandle {
            tag: Self::TAG,
            future,
            promise: None,
        }
    }

    pub fn settable() -> EventHandle {
        let (promise, future) = PromiseOnce::new();
        EventHandle {
            tag: Self::TAG,
            future,
            promise: Some(promise),
        }
    }
}
