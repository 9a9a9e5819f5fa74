//! Every routed and delegated slot of `ffi/forward/table.rs` reaches the
//! compute plugin. The compute plugin here is a recording mock, generated
//! from the header's slot list and compiled with the system C compiler: each
//! of its functions counts its calls; the few a delegating client needs at
//! creation (a client, two devices, their memories) answer for real. The
//! test creates a delegating client, then calls each of our slots with a
//! foreign handle (or our client/device) in the deciding field and checks
//! that the mock's function of the same slot ran.
//!
//! One `#[test]`: the compute plugin is per process and must be configured
//! before the first `GetPjrtApi`.
use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use pjrt_crosshost::ffi::forward::table::{args_struct_size, header_slots, roles, Role};
use pjrt_crosshost::pjrt::bindings::*;

/// The mock's functions that must answer for a client to be created.
const MOCK_SPECIALS: &str = r#"
typedef struct { long word; } Fake;
static Fake fake_client = {0x1111}, fake_dev[2] = {{0x2222}, {0x2223}},
            fake_desc[2] = {{0x3333}, {0x3334}}, fake_mem[2] = {{0x4444}, {0x4445}};
static PJRT_Device* devices[2] = {(PJRT_Device*)&fake_dev[0], (PJRT_Device*)&fake_dev[1]};
static PJRT_Memory* memories[2][1] = {{(PJRT_Memory*)&fake_mem[0]}, {(PJRT_Memory*)&fake_mem[1]}};
static int dev_index(void* d) { return d == (void*)&fake_dev[1] ? 1 : 0; }
static int desc_index(void* d) { return d == (void*)&fake_desc[1] ? 1 : 0; }
static int mem_index(void* m) { return m == (void*)&fake_mem[1] ? 1 : 0; }
#define SLOT(name) ((offsetof(PJRT_Api, name) - offsetof(PJRT_Api, PJRT_Error_Destroy)) / sizeof(void*))
#define COUNT(name) __atomic_add_fetch(&calls[SLOT(name)], 1, __ATOMIC_SEQ_CST)

static PJRT_Error* m_client_create(PJRT_Client_Create_Args* a) { COUNT(PJRT_Client_Create); a->client = (PJRT_Client*)&fake_client; return 0; }
static PJRT_Error* m_platform_name(PJRT_Client_PlatformName_Args* a) { COUNT(PJRT_Client_PlatformName); a->platform_name = "mock"; a->platform_name_size = 4; return 0; }
static PJRT_Error* m_addressable(PJRT_Client_AddressableDevices_Args* a) { COUNT(PJRT_Client_AddressableDevices); a->addressable_devices = devices; a->num_addressable_devices = 2; return 0; }
static PJRT_Error* m_get_desc(PJRT_Device_GetDescription_Args* a) { COUNT(PJRT_Device_GetDescription); a->device_description = (PJRT_DeviceDescription*)&fake_desc[dev_index(a->device)]; return 0; }
static PJRT_Error* m_desc_id(PJRT_DeviceDescription_Id_Args* a) { COUNT(PJRT_DeviceDescription_Id); a->id = desc_index(a->device_description); return 0; }
static PJRT_Error* m_desc_kind(PJRT_DeviceDescription_Kind_Args* a) { COUNT(PJRT_DeviceDescription_Kind); a->device_kind = "mock"; a->device_kind_size = 4; return 0; }
static PJRT_Error* m_local_id(PJRT_Device_LocalHardwareId_Args* a) { COUNT(PJRT_Device_LocalHardwareId); a->local_hardware_id = dev_index(a->device); return 0; }
static PJRT_Error* m_default_memory(PJRT_Device_DefaultMemory_Args* a) { COUNT(PJRT_Device_DefaultMemory); a->memory = memories[dev_index(a->device)][0]; return 0; }
static PJRT_Error* m_memories(PJRT_Device_AddressableMemories_Args* a) { COUNT(PJRT_Device_AddressableMemories); a->memories = memories[dev_index(a->device)]; a->num_memories = 1; return 0; }
static PJRT_Error* m_memory_id(PJRT_Memory_Id_Args* a) { COUNT(PJRT_Memory_Id); a->id = mem_index(a->memory); return 0; }
static PJRT_Error* m_memory_kind(PJRT_Memory_Kind_Args* a) { COUNT(PJRT_Memory_Kind); a->kind = "device"; a->kind_size = 6; return 0; }

static void install_specials(PJRT_Api* api) {
  api->PJRT_Client_Create = m_client_create;
  api->PJRT_Client_PlatformName = m_platform_name;
  api->PJRT_Client_AddressableDevices = m_addressable;
  api->PJRT_Device_GetDescription = m_get_desc;
  api->PJRT_DeviceDescription_Id = m_desc_id;
  api->PJRT_DeviceDescription_Kind = m_desc_kind;
  api->PJRT_Device_LocalHardwareId = m_local_id;
  api->PJRT_Device_DefaultMemory = m_default_memory;
  api->PJRT_Device_AddressableMemories = m_memories;
  api->PJRT_Memory_Id = m_memory_id;
  api->PJRT_Memory_Kind = m_memory_kind;
}
"#;

/// C source of the mock: one counting function per slot, the specials, and
/// `GetPjrtApi` / `mock_calls`.
fn mock_source() -> String {
    let slots = header_slots();
    let mut c = String::new();
    writeln!(c, "#include <stddef.h>").unwrap();
    writeln!(c, "#include \"xla/pjrt/c/pjrt_c_api.h\"").unwrap();
    writeln!(c, "static long calls[{}];", slots.len()).unwrap();
    writeln!(
        c,
        "long mock_calls(int slot) {{ return __atomic_load_n(&calls[slot], __ATOMIC_SEQ_CST); }}"
    )
    .unwrap();
    for i in 0..slots.len() {
        writeln!(
            c,
            "static PJRT_Error* f{i}(void* a) {{ (void)a; __atomic_add_fetch(&calls[{i}], 1, __ATOMIC_SEQ_CST); return 0; }}"
        )
        .unwrap();
    }
    c.push_str(MOCK_SPECIALS);
    writeln!(c, "static PJRT_Api api;").unwrap();
    writeln!(c, "const PJRT_Api* GetPjrtApi(void) {{").unwrap();
    writeln!(c, "  api.struct_size = PJRT_Api_STRUCT_SIZE;").unwrap();
    writeln!(
        c,
        "  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;"
    )
    .unwrap();
    writeln!(c, "  api.pjrt_api_version.major_version = PJRT_API_MAJOR;").unwrap();
    writeln!(c, "  api.pjrt_api_version.minor_version = PJRT_API_MINOR;").unwrap();
    writeln!(
        c,
        "  void** slot = (void**)((char*)&api + offsetof(PJRT_Api, PJRT_Error_Destroy));"
    )
    .unwrap();
    for i in 0..slots.len() {
        writeln!(c, "  slot[{i}] = (void*)f{i};").unwrap();
    }
    writeln!(c, "  install_specials(&api);").unwrap();
    writeln!(c, "  return &api;\n}}").unwrap();
    c
}

fn build_mock() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // Under cargo's scratch directory (inside `target/`), not the system's
    // temp dir, where every run would leave a directory behind.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("mock-compute-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("mock_compute_plugin.c");
    std::fs::write(&source, mock_source()).unwrap();
    let lib = dir.join("libmock_compute_plugin.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args([
            "-std=c11",
            "-shared",
            "-fPIC",
            "-Wno-incompatible-pointer-types",
            "-I",
        ])
        .arg(root.join("pjrt_c_api"))
        .arg(&source)
        .arg("-o")
        .arg(&lib)
        .output()
        .unwrap_or_else(|e| panic!("cannot run C compiler `{cc}`: {e}"));
    assert!(
        out.status.success(),
        "compiling the mock compute plugin failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lib
}

type Entry = unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error;

/// Our table's function in `slot`.
fn our_entry(api: *const PJRT_Api, slot: usize) -> Entry {
    let header = std::mem::offset_of!(PJRT_Api, PJRT_Error_Destroy);
    // SAFETY: every slot of our table is filled (a unit test checks it).
    unsafe {
        let word = ((api as *const u8).add(header) as *const usize)
            .add(slot)
            .read();
        std::mem::transmute::<usize, Entry>(word)
    }
}

/// A zeroed args buffer of `size` bytes with its `struct_size` set.
struct Args(Vec<u64>);

impl Args {
    fn new(size: usize) -> Args {
        let mut words = vec![0u64; size.div_ceil(8) + 8];
        words[0] = size as u64;
        Args(words)
    }

    fn put<T: Copy>(&mut self, offset: usize, value: T) {
        // SAFETY: inside the buffer (it is larger than the args struct).
        unsafe { ((self.0.as_mut_ptr() as *mut u8).add(offset) as *mut T).write_unaligned(value) };
    }

    fn ptr(&mut self) -> *mut c_void {
        self.0.as_mut_ptr() as *mut c_void
    }
}

unsafe extern "C" fn ignore_event(error: *mut PJRT_Error, _user_arg: *mut c_void) {
    assert!(error.is_null());
}

/// Inputs a slot checks before it forwards (a valid element type, a
/// destination, a callback), so that the call reaches the compute plugin.
fn prepare(
    slot: &str,
    args: &mut Args,
    device: *mut PJRT_Device,
    memory: *mut PJRT_Memory,
    foreign: *mut c_void,
) {
    const F32: u32 = 11;
    match slot {
        "PJRT_Event_OnReady" => args.put(
            std::mem::offset_of!(PJRT_Event_OnReady_Args, callback),
            Some(ignore_event as unsafe extern "C" fn(*mut PJRT_Error, *mut c_void)),
        ),
        "PJRT_Client_BufferFromHostBuffer" => args.put(
            std::mem::offset_of!(PJRT_Client_BufferFromHostBuffer_Args, type_),
            F32,
        ),
        "PJRT_Client_CreateViewOfDeviceBuffer" => args.put(
            std::mem::offset_of!(PJRT_Client_CreateViewOfDeviceBuffer_Args, element_type),
            F32,
        ),
        "PJRT_Client_CreateUninitializedBuffer" => args.put(
            std::mem::offset_of!(
                PJRT_Client_CreateUninitializedBuffer_Args,
                shape_element_type
            ),
            F32,
        ),
        "PJRT_Client_CreateAliasBuffer" => args.put(
            std::mem::offset_of!(PJRT_Client_CreateAliasBuffer_Args, shape_element_type),
            F32,
        ),
        "PJRT_Client_CreateErrorBuffer" => args.put(
            std::mem::offset_of!(PJRT_Client_CreateErrorBuffer_Args, shape_element_type),
            F32,
        ),
        "PJRT_Compile" => args.put(std::mem::offset_of!(PJRT_Compile_Args, topology), foreign),
        "PJRT_Buffer_CopyToDevice" => args.put(
            std::mem::offset_of!(PJRT_Buffer_CopyToDevice_Args, dst_device),
            device,
        ),
        "PJRT_Buffer_CopyToMemory" => args.put(
            std::mem::offset_of!(PJRT_Buffer_CopyToMemory_Args, dst_memory),
            memory,
        ),
        _ => {}
    }
}

#[test]
fn every_routed_and_delegated_slot_reaches_the_compute_plugin() {
    let mock = build_mock();
    std::env::set_var("PJRT_CROSSHOST_COMPUTE_PLUGIN", &mock);
    let api = pjrt_crosshost::ffi::GetPjrtApi();
    assert!(!api.is_null());
    // SAFETY: the mock we just built; `mock_calls` has this signature.
    let library = unsafe { libloading::Library::new(&mock) }.unwrap();
    let calls =
        unsafe { library.get::<unsafe extern "C" fn(i32) -> i64>(b"mock_calls\0") }.unwrap();
    let slots = header_slots();
    let index = |name: &str| slots.iter().position(|s| *s == name).unwrap();
    let call = |name: &str, args: &mut Args| -> *mut PJRT_Error {
        // SAFETY: our entry with an args buffer of its struct's size.
        unsafe { our_entry(api, index(name))(args.ptr()) }
    };

    // A delegating client (the mock's two devices), one of its devices and
    // that device's memory.
    let mut create = Args::new(args_struct_size("PJRT_Client_Create").unwrap());
    assert!(
        call("PJRT_Client_Create", &mut create).is_null(),
        "client creation failed"
    );
    let client: *mut PJRT_Client =
        // SAFETY: the out field of the args we passed.
        unsafe { (create.ptr() as *const u8).add(std::mem::offset_of!(PJRT_Client_Create_Args, client)).cast::<*mut PJRT_Client>().read() };
    let mut devices = Args::new(args_struct_size("PJRT_Client_AddressableDevices").unwrap());
    devices.put(
        std::mem::offset_of!(PJRT_Client_AddressableDevices_Args, client),
        client,
    );
    assert!(call("PJRT_Client_AddressableDevices", &mut devices).is_null());
    // SAFETY: the out fields of the args we passed.
    let device: *mut PJRT_Device = unsafe {
        let list = (devices.ptr() as *const u8)
            .add(std::mem::offset_of!(
                PJRT_Client_AddressableDevices_Args,
                addressable_devices
            ))
            .cast::<*const *mut PJRT_Device>()
            .read();
        *list
    };
    let mut default = Args::new(args_struct_size("PJRT_Device_DefaultMemory").unwrap());
    default.put(
        std::mem::offset_of!(PJRT_Device_DefaultMemory_Args, device),
        device,
    );
    assert!(call("PJRT_Device_DefaultMemory", &mut default).is_null());
    // SAFETY: as above.
    let memory: *mut PJRT_Memory = unsafe {
        (default.ptr() as *const u8)
            .add(std::mem::offset_of!(PJRT_Device_DefaultMemory_Args, memory))
            .cast::<*mut PJRT_Memory>()
            .read()
    };

    // A handle the compute plugin would have made: readable, and not
    // beginning with any of our tags.
    let mut foreign_object = vec![0x7777_7777_u64; 8];
    let foreign = foreign_object.as_mut_ptr() as *mut c_void;
    let mut missed = Vec::new();
    let mut checked = 0;
    for (slot, role) in roles() {
        let decider: Option<(usize, *mut c_void)> = match role {
            Role::Ours => continue,
            Role::Routed(None) => None,
            Role::Routed(Some(offset)) => Some((offset, foreign)),
            Role::Delegated(offset) if slot.starts_with("PJRT_Device_") => {
                Some((offset, device.cast()))
            }
            Role::Delegated(offset) => Some((offset, client.cast())),
        };
        let mut args = Args::new(args_struct_size(slot).unwrap());
        if let Some((offset, handle)) = decider {
            args.put(offset, handle);
        }
        prepare(slot, &mut args, device, memory, foreign);
        // SAFETY: `mock_calls` reads a counter.
        let before = unsafe { calls(index(slot) as i32) };
        let error = call(slot, &mut args);
        // SAFETY: as above.
        let after = unsafe { calls(index(slot) as i32) };
        if after != before + 1 {
            missed.push(format!("{slot} ({role:?}): error {}", describe(api, error)));
        } else if !error.is_null() {
            destroy(api, error);
        }
        checked += 1;
    }
    assert!(
        missed.is_empty(),
        "slots that did not reach the compute plugin:\n{}",
        missed.join("\n")
    );
    assert!(checked > 90, "only {checked} slots checked");
}

fn describe(api: *const PJRT_Api, error: *mut PJRT_Error) -> String {
    if error.is_null() {
        return "none".into();
    }
    let mut args = PJRT_Error_Message_Args {
        struct_size: PJRT_Error_Message_Args_STRUCT_SIZE as usize,
        error,
        ..Default::default()
    };
    // SAFETY: our table's error functions on our error.
    let text = unsafe {
        ((*api).PJRT_Error_Message.unwrap())(&mut args);
        String::from_utf8_lossy(std::slice::from_raw_parts(
            args.message as *const u8,
            args.message_size,
        ))
        .into_owned()
    };
    destroy(api, error);
    text
}

fn destroy(api: *const PJRT_Api, error: *mut PJRT_Error) {
    let mut args = PJRT_Error_Destroy_Args {
        struct_size: PJRT_Error_Destroy_Args_STRUCT_SIZE as usize,
        error,
        ..Default::default()
    };
    // SAFETY: our table's destroy on our error.
    unsafe { ((*api).PJRT_Error_Destroy.unwrap())(&mut args) };
}
