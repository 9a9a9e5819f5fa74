#![allow(non_camel_case_types)]
//! The few UCP declarations the UCX transport uses, written from UCX's
//! `ucp/api/ucp.h` and `ucp_def.h` (1.13, the oldest UCX we load): handle
//! types, the parameter structs we fill, their field-mask bits, and the
//! table of functions resolved from `libucp` at run time.
//!
//! Every parameter struct is extensible the UCP way: a `field_mask` says
//! which fields the caller set, new fields are only ever appended, and the
//! library reads nothing the mask does not name. So the 1.13 layout is valid
//! for every later UCX (the `libucx` wheel ships 1.18 and newer).
//! `tests/ucx_layout.rs` compiles a C program against the system header,
//! where it is installed, and compares every size and offset here with it.
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use libloading::Library;

/// `ucs_status_t`: a packed enum, one signed byte.
pub type ucs_status_t = i8;
pub type ucs_status_ptr_t = *mut c_void;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
pub const UCS_ERR_BUSY: ucs_status_t = -15;
pub const UCS_ERR_CANCELED: ucs_status_t = -16;
pub const UCS_ERR_LAST: isize = -100;

#[repr(C)]
pub struct ucp_context {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_worker {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_ep {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_config {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ucp_address {
    _opaque: [u8; 0],
}
pub type ucp_context_h = *mut ucp_context;
pub type ucp_worker_h = *mut ucp_worker;
pub type ucp_ep_h = *mut ucp_ep;

// ucp_params_t.field_mask / features
pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_AM: u64 = 1 << 6;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

#[repr(C)]
pub struct ucp_params_t {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

// ucp_worker_params_t.field_mask
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
pub const UCP_WORKER_PARAM_FIELD_NAME: u64 = 1 << 6;
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;
pub const UCP_WAKEUP_TX: c_uint = 1 << 10;
pub const UCP_WAKEUP_RX: c_uint = 1 << 11;

#[repr(C)]
pub struct ucp_worker_params_t {
    pub field_mask: u64,
    pub thread_mode: c_int,
    /// `ucs_cpu_set_t`: 1024 bits.
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

// ucp_ep_params_t.field_mask
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_EP_PARAM_FIELD_NAME: u64 = 1 << 7;
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;

pub type ucp_err_handler_cb_t = unsafe extern "C" fn(*mut c_void, ucp_ep_h, ucs_status_t);

#[repr(C)]
pub struct ucp_err_handler_t {
    pub cb: Option<ucp_err_handler_cb_t>,
    pub arg: *mut c_void,
}

#[repr(C)]
pub struct ucs_sock_addr_t {
    pub addr: *const c_void,
    pub addrlen: u32,
}

#[repr(C)]
pub struct ucp_ep_params_t {
    pub field_mask: u64,
    pub address: *const ucp_address,
    pub err_mode: c_int,
    pub err_handler: ucp_err_handler_t,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: ucs_sock_addr_t,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: ucs_sock_addr_t,
}

// ucp_request_param_t.op_attr_mask
pub const UCP_OP_ATTR_FIELD_CALLBACK: u32 = 1 << 1;
pub const UCP_OP_ATTR_FIELD_USER_DATA: u32 = 1 << 2;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMORY_TYPE: u32 = 1 << 6;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
pub const UCS_MEMORY_TYPE_HOST: c_int = 0;

// ucp_am_send_nbx flags
pub const UCP_AM_SEND_FLAG_REPLY: u32 = 1 << 0;
pub const UCP_AM_SEND_FLAG_RNDV: u32 = 1 << 2;

pub type ucp_send_nbx_callback_t = unsafe extern "C" fn(*mut c_void, ucs_status_t, *mut c_void);
pub type ucp_am_recv_data_nbx_callback_t =
    unsafe extern "C" fn(*mut c_void, ucs_status_t, usize, *mut c_void);

#[repr(C)]
pub union ucp_request_callback {
    pub send: Option<ucp_send_nbx_callback_t>,
    pub recv_am: Option<ucp_am_recv_data_nbx_callback_t>,
}

#[repr(C)]
pub struct ucp_request_param_t {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: ucp_request_callback,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: *mut c_void,
}

impl ucp_request_param_t {
    /// No fields set: contiguous bytes, host memory.
    pub fn empty() -> ucp_request_param_t {
        ucp_request_param_t {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: ucp_request_callback { send: None },
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: UCS_MEMORY_TYPE_HOST,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

// Active messages.
pub const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
pub const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1 << 0;
pub const UCP_AM_RECV_ATTR_FLAG_DATA: u64 = 1 << 16;
pub const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

#[repr(C)]
pub struct ucp_am_recv_param_t {
    pub recv_attr: u64,
    pub reply_ep: ucp_ep_h,
}

pub type ucp_am_recv_callback_t = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t;

#[repr(C)]
pub struct ucp_am_handler_param_t {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: Option<ucp_am_recv_callback_t>,
    pub arg: *mut c_void,
}

/// `UCS_PTR_IS_ERR`.
pub fn ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (UCS_ERR_LAST as usize)
}

/// `UCS_PTR_IS_PTR`.
pub fn ptr_is_request(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (UCS_ERR_LAST as usize).wrapping_sub(1)
}

/// `UCS_PTR_RAW_STATUS`.
pub fn ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    ptr as isize as ucs_status_t
}

/// The UCP functions, resolved once from the loaded library, which the table
/// keeps loaded for as long as it lives (the whole process: UCX is never
/// unloaded, its threads and handlers could outlive any of our objects).
pub struct UcpApi {
    pub config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config) -> ucs_status_t,
    pub config_release: unsafe extern "C" fn(*mut ucp_config),
    pub config_modify:
        unsafe extern "C" fn(*mut ucp_config, *const c_char, *const c_char) -> ucs_status_t,
    pub get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const ucp_params_t,
        *const ucp_config,
        *mut ucp_context_h,
    ) -> ucs_status_t,
    pub cleanup: unsafe extern "C" fn(ucp_context_h),
    pub worker_create: unsafe extern "C" fn(
        ucp_context_h,
        *const ucp_worker_params_t,
        *mut ucp_worker_h,
    ) -> ucs_status_t,
    pub worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub worker_get_address:
        unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address, *mut usize) -> ucs_status_t,
    pub worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address),
    pub worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub worker_set_am_recv_handler:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_am_handler_param_t) -> ucs_status_t,
    pub ep_create:
        unsafe extern "C" fn(ucp_worker_h, *const ucp_ep_params_t, *mut ucp_ep_h) -> ucs_status_t,
    pub ep_close_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_flush_nbx:
        unsafe extern "C" fn(ucp_ep_h, *const ucp_request_param_t) -> ucs_status_ptr_t,
    pub ep_print_info: unsafe extern "C" fn(ucp_ep_h, *mut libc::FILE),
    pub am_send_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        c_uint,
        *const c_void,
        usize,
        *const c_void,
        usize,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub am_recv_data_nbx: unsafe extern "C" fn(
        ucp_worker_h,
        *mut c_void,
        *mut c_void,
        usize,
        *const ucp_request_param_t,
    ) -> ucs_status_ptr_t,
    pub am_data_release: unsafe extern "C" fn(ucp_worker_h, *mut c_void),
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(ucs_status_t) -> *const c_char,
    _library: Library,
}

impl UcpApi {
    /// Resolves every function from `library`; the first missing one is the
    /// error (a libucp older than 1.13, or not libucp at all).
    ///
    /// # Safety
    ///
    /// `library` must be a UCP library whose symbols have the C signatures
    /// declared above (UCX 1.13 or later).
    pub unsafe fn resolve(library: Library) -> std::result::Result<UcpApi, String> {
        macro_rules! get {
            ($name:literal) => {
                // SAFETY: the caller vouches that the library is libucp, whose
                // symbol of this name has the declared signature.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("symbol {} is missing: {e}", $name))?
            };
        }
        Ok(UcpApi {
            config_read: get!("ucp_config_read"),
            config_release: get!("ucp_config_release"),
            config_modify: get!("ucp_config_modify"),
            get_version: get!("ucp_get_version"),
            init_version: get!("ucp_init_version"),
            cleanup: get!("ucp_cleanup"),
            worker_create: get!("ucp_worker_create"),
            worker_destroy: get!("ucp_worker_destroy"),
            worker_get_address: get!("ucp_worker_get_address"),
            worker_release_address: get!("ucp_worker_release_address"),
            worker_progress: get!("ucp_worker_progress"),
            worker_get_efd: get!("ucp_worker_get_efd"),
            worker_arm: get!("ucp_worker_arm"),
            worker_set_am_recv_handler: get!("ucp_worker_set_am_recv_handler"),
            ep_create: get!("ucp_ep_create"),
            ep_close_nbx: get!("ucp_ep_close_nbx"),
            ep_flush_nbx: get!("ucp_ep_flush_nbx"),
            ep_print_info: get!("ucp_ep_print_info"),
            am_send_nbx: get!("ucp_am_send_nbx"),
            am_recv_data_nbx: get!("ucp_am_recv_data_nbx"),
            am_data_release: get!("ucp_am_data_release"),
            request_check_status: get!("ucp_request_check_status"),
            request_free: get!("ucp_request_free"),
            status_string: get!("ucs_status_string"),
            _library: library,
        })
    }

    /// A UCP context for `features`, named `name` where given, with UCX's
    /// defaults and environment (`ucp_config_read`) and the API version
    /// `major.minor` asked of `ucp_init`. The error is the call that failed
    /// (`ucp_config_read`, `ucp_init`) and its status.
    pub fn init_context(
        &self,
        (major, minor): (c_uint, c_uint),
        features: u64,
        name: Option<&CStr>,
    ) -> std::result::Result<ucp_context_h, (&'static str, ucs_status_t)> {
        let mut config: *mut ucp_config = std::ptr::null_mut();
        // SAFETY: null prefix and file mean UCX's defaults and environment;
        // `config` is a valid out-pointer.
        let status = unsafe { (self.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        if status != UCS_OK {
            return Err(("ucp_config_read", status));
        }
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES
                | if name.is_some() {
                    UCP_PARAM_FIELD_NAME
                } else {
                    0
                },
            features,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.map_or(std::ptr::null(), CStr::as_ptr),
        };
        let mut context: ucp_context_h = std::ptr::null_mut();
        // SAFETY: params (whose name, if any, outlives the call) and config
        // are valid for the call; an out-pointer.
        let status = unsafe { (self.init_version)(major, minor, &params, config, &mut context) };
        // SAFETY: the config from config_read, no longer needed, released once.
        unsafe { (self.config_release)(config) };
        if status != UCS_OK {
            return Err(("ucp_init", status));
        }
        Ok(context)
    }

    /// UCX's name for a status.
    pub fn describe(&self, status: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a static string for any value.
        let text = unsafe { (self.status_string)(status) };
        if text.is_null() {
            return format!("UCX status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Sizes and offsets of the declarations above, for the layout test.
#[doc(hidden)]
pub fn layout_report() -> Vec<(&'static str, usize)> {
    use std::mem::{offset_of, size_of};
    vec![
        ("sizeof ucs_status_t", size_of::<ucs_status_t>()),
        ("sizeof ucp_params_t", size_of::<ucp_params_t>()),
        ("ucp_params_t.features", offset_of!(ucp_params_t, features)),
        ("ucp_params_t.name", offset_of!(ucp_params_t, name)),
        (
            "sizeof ucp_worker_params_t",
            size_of::<ucp_worker_params_t>(),
        ),
        (
            "ucp_worker_params_t.thread_mode",
            offset_of!(ucp_worker_params_t, thread_mode),
        ),
        (
            "ucp_worker_params_t.cpu_mask",
            offset_of!(ucp_worker_params_t, cpu_mask),
        ),
        (
            "ucp_worker_params_t.events",
            offset_of!(ucp_worker_params_t, events),
        ),
        (
            "ucp_worker_params_t.name",
            offset_of!(ucp_worker_params_t, name),
        ),
        (
            "ucp_worker_params_t.client_id",
            offset_of!(ucp_worker_params_t, client_id),
        ),
        ("sizeof ucp_ep_params_t", size_of::<ucp_ep_params_t>()),
        (
            "ucp_ep_params_t.address",
            offset_of!(ucp_ep_params_t, address),
        ),
        (
            "ucp_ep_params_t.err_mode",
            offset_of!(ucp_ep_params_t, err_mode),
        ),
        (
            "ucp_ep_params_t.err_handler",
            offset_of!(ucp_ep_params_t, err_handler),
        ),
        (
            "ucp_ep_params_t.user_data",
            offset_of!(ucp_ep_params_t, user_data),
        ),
        ("ucp_ep_params_t.flags", offset_of!(ucp_ep_params_t, flags)),
        (
            "ucp_ep_params_t.sockaddr",
            offset_of!(ucp_ep_params_t, sockaddr),
        ),
        ("ucp_ep_params_t.name", offset_of!(ucp_ep_params_t, name)),
        (
            "sizeof ucp_request_param_t",
            size_of::<ucp_request_param_t>(),
        ),
        (
            "ucp_request_param_t.flags",
            offset_of!(ucp_request_param_t, flags),
        ),
        (
            "ucp_request_param_t.request",
            offset_of!(ucp_request_param_t, request),
        ),
        (
            "ucp_request_param_t.cb",
            offset_of!(ucp_request_param_t, cb),
        ),
        (
            "ucp_request_param_t.datatype",
            offset_of!(ucp_request_param_t, datatype),
        ),
        (
            "ucp_request_param_t.user_data",
            offset_of!(ucp_request_param_t, user_data),
        ),
        (
            "ucp_request_param_t.reply_buffer",
            offset_of!(ucp_request_param_t, reply_buffer),
        ),
        (
            "ucp_request_param_t.memory_type",
            offset_of!(ucp_request_param_t, memory_type),
        ),
        (
            "ucp_request_param_t.recv_info",
            offset_of!(ucp_request_param_t, recv_info),
        ),
        (
            "ucp_request_param_t.memh",
            offset_of!(ucp_request_param_t, memh),
        ),
        (
            "sizeof ucp_am_handler_param_t",
            size_of::<ucp_am_handler_param_t>(),
        ),
        (
            "ucp_am_handler_param_t.id",
            offset_of!(ucp_am_handler_param_t, id),
        ),
        (
            "ucp_am_handler_param_t.flags",
            offset_of!(ucp_am_handler_param_t, flags),
        ),
        (
            "ucp_am_handler_param_t.cb",
            offset_of!(ucp_am_handler_param_t, cb),
        ),
        (
            "ucp_am_handler_param_t.arg",
            offset_of!(ucp_am_handler_param_t, arg),
        ),
        (
            "sizeof ucp_am_recv_param_t",
            size_of::<ucp_am_recv_param_t>(),
        ),
        (
            "ucp_am_recv_param_t.reply_ep",
            offset_of!(ucp_am_recv_param_t, reply_ep),
        ),
    ]
}
