//! C handles ↔ Rust objects. Owned handles (client, buffer, event) are boxes
//! the caller destroys; devices, descriptions and memories are borrowed from
//! their client's tables. Each handle carries a type tag so that a wrong or
//! destroyed handle is an error, not a misread.
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;

use super::bindings::*;
use crate::api::buffer::Buffer;
use crate::api::client::Client;
use crate::api::device::{Device, Memory};
use crate::backend::AttributeValue;
use crate::status::{invalid_argument, Result};
use crate::sync::{Future, PromiseOnce};

const DEAD: u64 = 0xdead_dead_dead_dead;

/// Implemented by every handle type: its C type and its tag.
pub(crate) trait Handle: Sized {
    type C;
    const TAG: u64;
    const WHAT: &'static str;
    fn tag(&self) -> u64;
    fn set_dead(&mut self);
}

/// Borrows the Rust object behind a C handle.
///
/// # Safety
/// `ptr` must be null or a pointer the plugin handed out for `H::C` that has
/// not been destroyed (the tag check catches type confusion and most stale
/// handles, but cannot make a freed pointer readable).
pub(crate) unsafe fn borrow<'a, H: Handle>(
    ptr: *const H::C,
    function: &str,
    field: &str,
) -> Result<&'a H> {
    if ptr.is_null() {
        return Err(invalid_argument(format!("{function}: {field} is null")));
    }
    // SAFETY: per the contract above, `ptr` points at an `H`.
    let handle = unsafe { &*(ptr as *const H) };
    if handle.tag() != H::TAG {
        return Err(invalid_argument(format!(
            "{function}: {field} is not a live {} handle",
            H::WHAT
        )));
    }
    Ok(handle)
}

pub(crate) fn into_raw<H: Handle>(handle: H) -> *mut H::C {
    Box::into_raw(Box::new(handle)) as *mut H::C
}

/// Takes back an owned handle for destruction.
///
/// # Safety
/// Same as `borrow`, and the handle must be owned by the caller (made by
/// `into_raw`) and not used again.
pub(crate) unsafe fn take<H: Handle>(
    ptr: *mut H::C,
    function: &str,
    field: &str,
) -> Result<Box<H>> {
    // SAFETY: forwarded contract.
    unsafe { borrow::<H>(ptr, function, field) }?;
    // SAFETY: made by `into_raw` as a Box<H>; the tag was checked.
    let mut boxed = unsafe { Box::from_raw(ptr as *mut H) };
    // Poison the tag so that a second destroy or a later use is caught while
    // the allocator has not reused the memory.
    boxed.set_dead();
    Ok(boxed)
}

macro_rules! tagged_handle {
    ($ty:ident, $c:ident, $tag:expr, $what:literal) => {
        impl Handle for $ty {
            type C = $c;
            const TAG: u64 = $tag;
            const WHAT: &'static str = $what;
            fn tag(&self) -> u64 {
                self.tag
            }
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

pub(crate) struct ClientHandle {
    tag: u64,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
}
tagged_handle!(
    ClientHandle,
    PJRT_Client,
    0x4348_434c_4945_4e54,
    "PJRT_Client"
);

/// Device, description and memory handles of one client, alive as long as the
/// client or any of its buffers.
pub(crate) struct ClientTables {
    // Boxed so that the addresses handed to C stay fixed.
    #[allow(clippy::vec_box)]
    devices: Vec<Box<DeviceHandle>>,
    pub all_devices: PtrList<PJRT_Device>,
    pub addressable_devices: PtrList<PJRT_Device>,
    pub addressable_memories: PtrList<PJRT_Memory>,
}

impl ClientHandle {
    pub fn new(client: Arc<Client>) -> ClientHandle {
        let mut devices: Vec<Box<DeviceHandle>> = client
            .devices()
            .iter()
            .map(|d| DeviceHandle::new(d.clone()))
            .collect();
        // Wire memory → device back pointers now that device boxes are fixed.
        for device in devices.iter_mut() {
            let device_ptr = &mut **device as *mut DeviceHandle as *mut PJRT_Device;
            device.memory.devices = PtrList(vec![device_ptr]);
        }
        let ptr_of = |d: &DeviceHandle| d as *const DeviceHandle as *mut PJRT_Device;
        let all_devices = PtrList(devices.iter().map(|d| ptr_of(d)).collect());
        let addressable_devices = PtrList(
            devices
                .iter()
                .filter(|d| d.device.addressable)
                .map(|d| ptr_of(d))
                .collect(),
        );
        let addressable_memories = PtrList(
            devices
                .iter()
                .filter(|d| d.device.addressable)
                .map(|d| d.memory_ptr())
                .collect(),
        );
        ClientHandle {
            tag: Self::TAG,
            client,
            tables: Arc::new(ClientTables {
                devices,
                all_devices,
                addressable_devices,
                addressable_memories,
            }),
        }
    }
}

impl ClientTables {
    pub fn device_ptr(&self, global_id: i32) -> *mut PJRT_Device {
        self.devices
            .iter()
            .find(|d| d.device.global_id == global_id)
            .map(|d| &**d as *const DeviceHandle as *mut PJRT_Device)
            .unwrap_or(std::ptr::null_mut())
    }

    pub fn memory_ptr(&self, memory_id: i32) -> *mut PJRT_Memory {
        self.devices
            .iter()
            .find(|d| d.memory.memory.id == memory_id)
            .map(|d| d.memory_ptr())
            .unwrap_or(std::ptr::null_mut())
    }
}

// --------------------------------- device -----------------------------------

pub(crate) struct DeviceHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub description: DescriptionHandle,
    pub memory: Box<MemoryHandle>,
    pub memories: PtrList<PJRT_Memory>,
}
tagged_handle!(
    DeviceHandle,
    PJRT_Device,
    0x4348_4445_5649_4345,
    "PJRT_Device"
);

impl DeviceHandle {
    fn new(device: Arc<Device>) -> Box<DeviceHandle> {
        let mut memory = Box::new(MemoryHandle::new(device.memory.clone()));
        let memory_ptr = &mut *memory as *mut MemoryHandle as *mut PJRT_Memory;
        Box::new(DeviceHandle {
            tag: Self::TAG,
            description: DescriptionHandle::new(device.clone()),
            device,
            memory,
            memories: PtrList(vec![memory_ptr]),
        })
    }

    pub fn memory_ptr(&self) -> *mut PJRT_Memory {
        &*self.memory as *const MemoryHandle as *mut PJRT_Memory
    }

    pub fn description_ptr(&self) -> *mut PJRT_DeviceDescription {
        &self.description as *const DescriptionHandle as *mut PJRT_DeviceDescription
    }
}

pub(crate) struct DescriptionHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub attributes: NamedValues,
}
tagged_handle!(
    DescriptionHandle,
    PJRT_DeviceDescription,
    0x4348_4445_5343_5200,
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
        if device.addressable {
            let index = device.local_hardware_id as usize;
            named.extend(device.backend.device_attributes(index).into_iter().map(
                |(name, value)| {
                    let value = match value {
                        AttributeValue::Str(s) => NamedValue::Str(s),
                        AttributeValue::Int(i) => NamedValue::Int(i),
                        AttributeValue::Bool(b) => NamedValue::Bool(b),
                    };
                    (name, value)
                },
            ));
        }
        let attributes = NamedValues::new(named);
        DescriptionHandle {
            tag: Self::TAG,
            device,
            attributes,
        }
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
tagged_handle!(
    MemoryHandle,
    PJRT_Memory,
    0x4348_4d45_4d4f_5259,
    "PJRT_Memory"
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
}

// --------------------------------- buffer -----------------------------------

pub(crate) struct BufferHandle {
    tag: u64,
    pub buffer: Arc<Buffer>,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
    /// Stable storage for the dims/layout pointers handed to callers.
    pub dims: Vec<i64>,
    pub minor_to_major: Vec<i64>,
}
tagged_handle!(
    BufferHandle,
    PJRT_Buffer,
    0x4348_4255_4646_4552,
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

pub(crate) struct EventHandle {
    tag: u64,
    pub future: Future,
    /// Set only for events made by `PJRT_Event_Create`, which the caller
    /// completes with `PJRT_Event_Set`.
    pub promise: Option<PromiseOnce>,
}
tagged_handle!(EventHandle, PJRT_Event, 0x4348_4556_454e_5400, "PJRT_Event");

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

// ------------------------------ named values ---------------------------------

pub(crate) enum NamedValue {
    Str(String),
    Int(i64),
    Bool(bool),
}

/// A `PJRT_NamedValue` array plus the strings it points into.
pub(crate) struct NamedValues {
    _names: Vec<(String, NamedValue)>,
    pub values: Vec<PJRT_NamedValue>,
}
// SAFETY: the raw pointers in `values` point into `_names`, which is never
// mutated after construction.
unsafe impl Send for NamedValues {}
// SAFETY: as above.
unsafe impl Sync for NamedValues {}

impl NamedValues {
    pub fn new(names: Vec<(String, NamedValue)>) -> NamedValues {
        let values = names
            .iter()
            .map(|(name, value)| {
                let mut v = PJRT_NamedValue {
                    struct_size: PJRT_NamedValue_STRUCT_SIZE as usize,
                    name: name.as_ptr() as *const _,
                    name_size: name.len(),
                    ..Default::default()
                };
                match value {
                    NamedValue::Str(s) => {
                        v.type_ = PJRT_NamedValue_kString;
                        v.__bindgen_anon_1.string_value = s.as_ptr() as *const _;
                        v.value_size = s.len();
                    }
                    NamedValue::Int(i) => {
                        v.type_ = PJRT_NamedValue_kInt64;
                        v.__bindgen_anon_1.int64_value = *i;
                        v.value_size = 1;
                    }
                    NamedValue::Bool(b) => {
                        v.type_ = PJRT_NamedValue_kBool;
                        v.__bindgen_anon_1.bool_value = *b;
                        v.value_size = 1;
                    }
                }
                v
            })
            .collect();
        NamedValues {
            _names: names,
            values,
        }
    }
}
