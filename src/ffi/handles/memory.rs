//! Memory handles and the memory function table PJRT reaches them through.
use super::*;

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
    pub(super) fn new(memory: Arc<Memory>) -> MemoryHandle {
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
