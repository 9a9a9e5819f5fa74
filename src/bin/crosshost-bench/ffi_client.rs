//! The benchmark's view of the plugin: only the C API, loaded with dlopen
//! like any PJRT runtime. All unsafe code of the benchmark lives here.
use std::ffi::c_void;
use std::os::raw::c_char;
use std::ptr;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use pjrt_crosshost::pjrt::bindings::*;
use pjrt_crosshost::pjrt::named_values::{NamedValue, NamedValues};

pub type Result<T> = std::result::Result<T, String>;

/// Nanoseconds on CLOCK_MONOTONIC: comparable between processes of a host.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub struct Plugin {
    _library: libloading::Library,
    api: &'static PJRT_Api,
    transfers: &'static PJRT_CrossHostTransfers_Extension,
    metrics_json: unsafe extern "C" fn(*const PJRT_Client) -> *mut c_char,
    free_string: unsafe extern "C" fn(*mut c_char),
}

// SAFETY: the PJRT API table is immutable and its functions thread-safe.
unsafe impl Send for Plugin {}
// SAFETY: as above.
unsafe impl Sync for Plugin {}

pub enum OptionValue {
    Int(i64),
    Str(String),
}

/// The KV callbacks a client is created with (see kv.rs).
pub struct KvCallbacks {
    pub get: PJRT_KeyValueGetCallback,
    pub try_get: PJRT_KeyValueTryGetCallback,
    pub put: PJRT_KeyValuePutCallback,
    pub delete: PJRT_CrossHost_KeyValueDeleteCallback,
    pub user_arg: *mut c_void,
}

impl Plugin {
    pub fn load(path: &str) -> Result<Arc<Plugin>> {
        // SAFETY: loading the plugin runs no initialisers beyond Rust statics.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| format!("dlopen {path}: {e}"))?;
        // SAFETY: symbol types as declared in pjrt_c_api.h / pjrt_crosshost.h.
        unsafe {
            let get: libloading::Symbol<unsafe extern "C" fn() -> *const PJRT_Api> =
                library.get(b"GetPjrtApi").map_err(|e| e.to_string())?;
            let api = get().as_ref().ok_or("GetPjrtApi returned NULL")?;
            let mut ext = api.extension_start;
            let mut transfers = None;
            while !ext.is_null() {
                if (*ext).type_ == PJRT_Extension_Type_CrossHostTransfers {
                    transfers = Some(&*(ext as *const PJRT_CrossHostTransfers_Extension));
                }
                ext = (*ext).next;
            }
            let metrics_json = *library
                .get::<unsafe extern "C" fn(*const PJRT_Client) -> *mut c_char>(
                    b"pjrt_crosshost_metrics_json",
                )
                .map_err(|e| e.to_string())?;
            let free_string = *library
                .get::<unsafe extern "C" fn(*mut c_char)>(b"pjrt_crosshost_free_string")
                .map_err(|e| e.to_string())?;
            Ok(Arc::new(Plugin {
                api: &*(api as *const PJRT_Api),
                transfers: transfers.ok_or("no CrossHostTransfers extension in the chain")?,
                metrics_json,
                free_string,
                _library: library,
            }))
        }
    }

    fn check(&self, error: *mut PJRT_Error, what: &str) -> Result<()> {
        if error.is_null() {
            return Ok(());
        }
        // SAFETY: `error` came from the plugin; message args per header.
        unsafe {
            let mut m = PJRT_Error_Message_Args {
                struct_size: PJRT_Error_Message_Args_STRUCT_SIZE as usize,
                error,
                ..Default::default()
            };
            (self.api.PJRT_Error_Message.unwrap())(&mut m);
            let text = String::from_utf8_lossy(std::slice::from_raw_parts(
                m.message as *const u8,
                m.message_size,
            ))
            .into_owned();
            let mut d = PJRT_Error_Destroy_Args {
                struct_size: PJRT_Error_Destroy_Args_STRUCT_SIZE as usize,
                error,
                ..Default::default()
            };
            (self.api.PJRT_Error_Destroy.unwrap())(&mut d);
            Err(format!("{what}: {text}"))
        }
    }

    pub fn create_client(
        self: &Arc<Self>,
        options: &[(&str, OptionValue)],
        kv: Option<&KvCallbacks>,
    ) -> Result<Client> {
        let values = NamedValues::new(
            options
                .iter()
                .map(|(name, value)| {
                    let value = match value {
                        OptionValue::Int(i) => NamedValue::Int(*i),
                        OptionValue::Str(s) => NamedValue::Str(s.clone()),
                    };
                    (name.to_string(), value)
                })
                .collect(),
        );
        let values = &values.values;
        let mut delete_ext = PJRT_CrossHost_KvDeleteExtension::default();
        let mut args = PJRT_Client_Create_Args {
            struct_size: PJRT_Client_Create_Args_STRUCT_SIZE as usize,
            create_options: values.as_ptr(),
            num_options: values.len(),
            ..Default::default()
        };
        if let Some(kv) = kv {
            args.kv_get_callback = kv.get;
            args.kv_get_user_arg = kv.user_arg;
            args.kv_put_callback = kv.put;
            args.kv_put_user_arg = kv.user_arg;
            args.kv_try_get_callback = kv.try_get;
            args.kv_try_get_user_arg = kv.user_arg;
            delete_ext.base = PJRT_Extension_Base {
                struct_size: std::mem::size_of::<PJRT_CrossHost_KvDeleteExtension>(),
                type_: PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE as PJRT_Extension_Type,
                next: ptr::null_mut(),
            };
            delete_ext.kv_delete_callback = kv.delete;
            delete_ext.kv_delete_user_arg = kv.user_arg;
            args.extension_start = &mut delete_ext.base;
        }
        // SAFETY: args built per the header; option strings outlive the call.
        self.check(
            unsafe { (self.api.PJRT_Client_Create.unwrap())(&mut args) },
            "PJRT_Client_Create",
        )?;
        let mut client = Client {
            plugin: self.clone(),
            raw: args.client,
            addressable: Vec::new(),
        };
        let mut d = PJRT_Client_AddressableDevices_Args {
            struct_size: PJRT_Client_AddressableDevices_Args_STRUCT_SIZE as usize,
            client: client.raw,
            ..Default::default()
        };
        // SAFETY: live client; the device list lives as long as it.
        unsafe {
            self.check(
                (self.api.PJRT_Client_AddressableDevices.unwrap())(&mut d),
                "AddressableDevices",
            )?;
            client.addressable =
                std::slice::from_raw_parts(d.addressable_devices, d.num_addressable_devices)
                    .to_vec();
        }
        Ok(client)
    }
}

pub struct Client {
    plugin: Arc<Plugin>,
    raw: *mut PJRT_Client,
    addressable: Vec<*mut PJRT_Device>,
}

// SAFETY: PJRT clients are thread-safe.
unsafe impl Send for Client {}
// SAFETY: as above.
unsafe impl Sync for Client {}

/// A buffer handle owned by the benchmark.
pub struct Buffer {
    plugin: Arc<Plugin>,
    pub raw: *mut PJRT_Buffer,
}

// SAFETY: PJRT buffers are thread-safe handles.
unsafe impl Send for Buffer {}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = PJRT_Buffer_Destroy_Args {
            struct_size: PJRT_Buffer_Destroy_Args_STRUCT_SIZE as usize,
            buffer: self.raw,
            ..Default::default()
        };
        // SAFETY: we own the handle and destroy it once.
        let _ = self.plugin.check(
            unsafe { (self.plugin.api.PJRT_Buffer_Destroy.unwrap())(&mut a) },
            "Buffer_Destroy",
        );
    }
}

/// Records when each of a set of events became ready (CLOCK_MONOTONIC ns)
/// and whether it failed.
/// When one event fired, and its failure if any.
type Fired = (u64, Option<String>);

pub struct ReadyTimes {
    slots: Mutex<Vec<Option<Fired>>>,
    all: Condvar,
}

struct ReadySlot {
    times: Arc<ReadyTimes>,
    index: usize,
    plugin: Arc<Plugin>,
}

unsafe extern "C" fn record_ready(error: *mut PJRT_Error, user_arg: *mut c_void) {
    let now = monotonic_ns();
    // SAFETY: `user_arg` is the Box<ReadySlot> leaked in `watch`, used once.
    let slot = unsafe { Box::from_raw(user_arg as *mut ReadySlot) };
    let failure = slot.plugin.check(error, "event").err();
    let mut slots = slot.times.slots.lock();
    slots[slot.index] = Some((now, failure));
    if slots.iter().all(Option::is_some) {
        slot.times.all.notify_all();
    }
}

impl ReadyTimes {
    /// Blocks until every event fired; the times and failures.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<Vec<u64>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut slots = self.slots.lock();
        while !slots.iter().all(Option::is_some) {
            if self.all.wait_until(&mut slots, deadline).timed_out() {
                return Err("timed out waiting for events".into());
            }
        }
        let mut times = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            let (t, failure) = s.as_ref().unwrap();
            if let Some(f) = failure {
                return Err(format!("event {i} failed: {f}"));
            }
            times.push(*t);
        }
        Ok(times)
    }
}

impl Client {
    pub fn addressable_device_ids(&self) -> Result<Vec<i32>> {
        self.addressable
            .iter()
            .map(|&d| self.device_id(d))
            .collect()
    }

    fn device_id(&self, device: *mut PJRT_Device) -> Result<i32> {
        let api = self.plugin.api;
        // SAFETY: live device of this client.
        unsafe {
            let mut g = PJRT_Device_GetDescription_Args {
                struct_size: PJRT_Device_GetDescription_Args_STRUCT_SIZE as usize,
                device,
                ..Default::default()
            };
            self.plugin.check(
                (api.PJRT_Device_GetDescription.unwrap())(&mut g),
                "GetDescription",
            )?;
            let mut i = PJRT_DeviceDescription_Id_Args {
                struct_size: PJRT_DeviceDescription_Id_Args_STRUCT_SIZE as usize,
                device_description: g.device_description,
                ..Default::default()
            };
            self.plugin.check(
                (api.PJRT_DeviceDescription_Id.unwrap())(&mut i),
                "DeviceDescription_Id",
            )?;
            Ok(i.id)
        }
    }

    pub fn buffer_from_host(&self, data: &[u8], device: usize) -> Result<Buffer> {
        let dims = [data.len() as i64];
        let mut a = PJRT_Client_BufferFromHostBuffer_Args {
            struct_size: PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE as usize,
            client: self.raw,
            data: data.as_ptr() as *const c_void,
            type_: PJRT_Buffer_Type_U8,
            dims: dims.as_ptr(),
            num_dims: 1,
            host_buffer_semantics: PJRT_HostBufferSemantics_kImmutableOnlyDuringCall,
            device: self.addressable[device],
            ..Default::default()
        };
        // SAFETY: args per header; data outlives the call (copied inside).
        self.plugin.check(
            unsafe { (self.plugin.api.PJRT_Client_BufferFromHostBuffer.unwrap())(&mut a) },
            "BufferFromHostBuffer",
        )?;
        self.destroy_event(a.done_with_host_buffer);
        Ok(Buffer {
            plugin: self.plugin.clone(),
            raw: a.buffer,
        })
    }

    fn destroy_event(&self, event: *mut PJRT_Event) {
        let mut d = PJRT_Event_Destroy_Args {
            struct_size: PJRT_Event_Destroy_Args_STRUCT_SIZE as usize,
            event,
            ..Default::default()
        };
        // SAFETY: we own the event.
        let _ = self.plugin.check(
            unsafe { (self.plugin.api.PJRT_Event_Destroy.unwrap())(&mut d) },
            "Event_Destroy",
        );
    }

    /// Registers OnReady on each event (taking ownership of the events).
    pub fn watch(&self, events: Vec<*mut PJRT_Event>) -> Result<Arc<ReadyTimes>> {
        let times = Arc::new(ReadyTimes {
            slots: Mutex::new(vec![None; events.len()]),
            all: Condvar::new(),
        });
        for (index, event) in events.into_iter().enumerate() {
            let slot = Box::into_raw(Box::new(ReadySlot {
                times: times.clone(),
                index,
                plugin: self.plugin.clone(),
            }));
            let mut a = PJRT_Event_OnReady_Args {
                struct_size: PJRT_Event_OnReady_Args_STRUCT_SIZE as usize,
                event,
                callback: Some(record_ready),
                user_arg: slot as *mut c_void,
                ..Default::default()
            };
            // SAFETY: live event; the callback frees `slot` exactly once.
            self.plugin.check(
                unsafe { (self.plugin.api.PJRT_Event_OnReady.unwrap())(&mut a) },
                "Event_OnReady",
            )?;
            self.destroy_event(event);
        }
        Ok(times)
    }

    pub fn ready_event(&self, buffer: &Buffer) -> Result<*mut PJRT_Event> {
        let mut a = PJRT_Buffer_ReadyEvent_Args {
            struct_size: PJRT_Buffer_ReadyEvent_Args_STRUCT_SIZE as usize,
            buffer: buffer.raw,
            ..Default::default()
        };
        // SAFETY: live buffer.
        self.plugin.check(
            unsafe { (self.plugin.api.PJRT_Buffer_ReadyEvent.unwrap())(&mut a) },
            "ReadyEvent",
        )?;
        Ok(a.event)
    }

    pub fn to_host(&self, buffer: &Buffer, out: &mut [u8]) -> Result<()> {
        let mut a = PJRT_Buffer_ToHostBuffer_Args {
            struct_size: PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE as usize,
            src: buffer.raw,
            dst: out.as_mut_ptr() as *mut c_void,
            dst_size: out.len(),
            ..Default::default()
        };
        // SAFETY: `out` stays valid until the event is awaited below.
        unsafe {
            self.plugin.check(
                (self.plugin.api.PJRT_Buffer_ToHostBuffer.unwrap())(&mut a),
                "ToHostBuffer",
            )?;
            let mut w = PJRT_Event_Await_Args {
                struct_size: PJRT_Event_Await_Args_STRUCT_SIZE as usize,
                event: a.event,
                ..Default::default()
            };
            let awaited = self
                .plugin
                .check((self.plugin.api.PJRT_Event_Await.unwrap())(&mut w), "Await");
            self.destroy_event(a.event);
            awaited
        }
    }

    /// v2 receive of `sizes[i]` bytes (u8 vectors) from `src_device`.
    pub fn receive(
        &self,
        device: usize,
        sizes: &[usize],
        src_device: i32,
        keys: &[i64],
    ) -> Result<Vec<Buffer>> {
        let n = sizes.len();
        let dims: Vec<[i64; 1]> = sizes.iter().map(|&s| [s as i64]).collect();
        let dim_ptrs: Vec<*const i64> = dims.iter().map(|d| d.as_ptr()).collect();
        let mut ranks = vec![1usize; n];
        let mut types = vec![PJRT_Buffer_Type_U8; n];
        let sources = vec![src_device; n];
        let mut out = vec![ptr::null_mut::<PJRT_Buffer>(); n];
        let mut a = PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args {
            struct_size: std::mem::size_of::<PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args>(
            ),
            client: self.raw,
            num_shapes: n,
            shape_num_dims: ranks.as_mut_ptr(),
            num_dims: dim_ptrs.as_ptr() as *mut *const i64,
            element_types: types.as_mut_ptr(),
            device: self.addressable[device],
            src_global_device_ids: sources.as_ptr(),
            transfer_keys: keys.as_ptr(),
            buffers: out.as_mut_ptr(),
            ..Default::default()
        };
        // SAFETY: arrays of n entries that outlive the call.
        self.plugin.check(
            unsafe {
                (self
                    .plugin
                    .transfers
                    .PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers
                    .unwrap())(&mut a)
            },
            "CrossHostReceiveBuffers",
        )?;
        Ok(out
            .into_iter()
            .map(|raw| Buffer {
                plugin: self.plugin.clone(),
                raw,
            })
            .collect())
    }

    /// v2 send; one event per buffer.
    pub fn send(
        &self,
        buffers: &[&Buffer],
        dst_device: i32,
        keys: &[i64],
    ) -> Result<Vec<*mut PJRT_Event>> {
        let n = buffers.len();
        let mut raws: Vec<*mut PJRT_Buffer> = buffers.iter().map(|b| b.raw).collect();
        let destinations = vec![dst_device; n];
        let mut events = vec![ptr::null_mut::<PJRT_Event>(); n];
        let mut a = PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args {
            struct_size: std::mem::size_of::<PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args>(
            ),
            client: self.raw,
            num_buffers: n,
            buffers: raws.as_mut_ptr(),
            dst_global_device_ids: destinations.as_ptr(),
            transfer_keys: keys.as_ptr(),
            send_events: events.as_mut_ptr(),
            ..Default::default()
        };
        // SAFETY: arrays of n entries that outlive the call.
        self.plugin.check(
            unsafe {
                (self
                    .plugin
                    .transfers
                    .PJRT_Transfers_PJRT_Client_CrossHostSendBuffers
                    .unwrap())(&mut a)
            },
            "CrossHostSendBuffers",
        )?;
        Ok(events)
    }

    pub fn metrics_json(&self) -> String {
        // SAFETY: live client; the string is freed with the plugin's free.
        unsafe {
            let s = (self.plugin.metrics_json)(self.raw);
            if s.is_null() {
                return "{}".into();
            }
            let text = std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned();
            (self.plugin.free_string)(s);
            text
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let mut a = PJRT_Client_Destroy_Args {
            struct_size: PJRT_Client_Destroy_Args_STRUCT_SIZE as usize,
            client: self.raw,
            ..Default::default()
        };
        // SAFETY: we own the client; its buffers were destroyed first.
        let _ = self.plugin.check(
            unsafe { (self.plugin.api.PJRT_Client_Destroy.unwrap())(&mut a) },
            "Client_Destroy",
        );
    }
}
