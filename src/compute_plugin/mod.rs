#![allow(non_upper_case_globals)]
//! The compute plugin: another PJRT plugin (XLA's CPU plugin here, XLA's CUDA
//! plugin on GPU machines) that compiles and runs programs for a delegating
//! crosshost client (docs/DESIGN.md §11). This is the outbound side of the C
//! boundary, the mirror of `ffi/`: there others call our `PJRT_Api`, here we
//! call another plugin's.
//!
//! One compute plugin per process, loaded once and never unloaded (an XLA
//! plugin keeps threads that outlive any client). Its path comes, in order,
//! from the create option `compute_plugin`, from `configure` (the Python
//! package calls it through `pjrt_crosshost_set_compute_plugin` before JAX
//! loads us), or from `PJRT_CROSSHOST_COMPUTE_PLUGIN`. `GetPjrtApi` loads the
//! configured plugin so that its extensions and attributes are ours before
//! any caller looks; `PJRT_Plugin_Initialize` initializes it.
//!
//! This module owns the raw `PJRT_Api` of the inner plugin: slot lookup
//! bounded by the inner table's `struct_size` (an older plugin's table is
//! shorter than ours), error conversion, and the checks that turn a plugin we
//! cannot serve into a clear client-creation error.
mod buffers;
mod client;
mod errors;
mod holds;
mod receives;

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::pjrt::bindings::*;
use crate::pjrt::named_values::{copy_named_values, NamedValue};
use crate::status::{failed_precondition, invalid_argument, Result, Status};

pub use buffers::{
    buffer_dims, buffer_element_type, event_future, wait_event, AliasBuffer, ComputeReceive,
    InnerBuffer, StagedReceive,
};
pub use client::{ComputeClient, ComputeDevice, ComputeMemory, InnerOptions};
pub use errors::take_inner_error;
pub use holds::{defer_delete, defer_destroy, delete_deferred, HeldSource};
pub use receives::{
    await_receive, check_receive, forget as forget_receive, watch as watch_receive, ReceiveWatch,
};

/// Environment variable naming the compute plugin when neither the create
/// option nor `configure` does.
pub const COMPUTE_PLUGIN_ENV: &str = "PJRT_CROSSHOST_COMPUTE_PLUGIN";

/// `(name, offset in PJRT_Api)` of a slot.
macro_rules! slot {
    ($name:ident) => {
        (stringify!($name), std::mem::offset_of!(PJRT_Api, $name))
    };
}

/// Functions without which a delegating client cannot work: creating the
/// inner client and its devices, receive buffers (alias + view), send
/// (read back + readiness), errors.
const REQUIRED: &[(&str, usize)] = &[
    slot!(PJRT_Error_Destroy),
    slot!(PJRT_Error_Message),
    slot!(PJRT_Error_GetCode),
    slot!(PJRT_Plugin_Initialize),
    slot!(PJRT_Client_Create),
    slot!(PJRT_Client_Destroy),
    slot!(PJRT_Client_PlatformName),
    slot!(PJRT_Client_AddressableDevices),
    slot!(PJRT_Device_GetDescription),
    slot!(PJRT_DeviceDescription_Id),
    slot!(PJRT_DeviceDescription_Kind),
    slot!(PJRT_Device_LocalHardwareId),
    slot!(PJRT_Device_AddressableMemories),
    slot!(PJRT_Device_DefaultMemory),
    slot!(PJRT_Memory_Id),
    slot!(PJRT_Memory_Kind),
    slot!(PJRT_Client_BufferFromHostBuffer),
    slot!(PJRT_Client_CreateAliasBuffer),
    slot!(PJRT_Client_FulfillAliasBuffer),
    slot!(PJRT_Buffer_Destroy),
    slot!(PJRT_Buffer_ReadyEvent),
    slot!(PJRT_Buffer_ToHostBuffer),
    slot!(PJRT_Event_Destroy),
    slot!(PJRT_Event_OnReady),
    slot!(PJRT_Event_Await),
];

/// Reads the function in slot `$name` of a compute plugin's table, or
/// `None` when that (older or partial) table does not have it.
#[macro_export]
#[doc(hidden)]
macro_rules! inner_fn {
    ($plugin:expr, $name:ident) => {
        $plugin.slot(
            std::mem::offset_of!($crate::pjrt::bindings::PJRT_Api, $name),
            // SAFETY: `slot` checked that the inner table covers this field;
            // the table lives as long as the (never unloaded) library.
            |api| unsafe { std::ptr::addr_of!((*api).$name).read() },
        )
    };
}

/// Calls `$name` of the compute plugin with `$args` (a `*mut` args struct)
/// and converts its error; UNIMPLEMENTED naming the plugin when its table
/// lacks the function.
#[macro_export]
#[doc(hidden)]
macro_rules! inner_call {
    ($plugin:expr, $name:ident, $args:expr) => {{
        let plugin: &$crate::compute_plugin::ComputePlugin = $plugin;
        match $crate::inner_fn!(plugin, $name).flatten() {
            // SAFETY: the function of the plugin's own table, called with an
            // args struct laid out by the header both sides share.
            Some(f) => plugin.check(unsafe { f($args) }, stringify!($name)),
            None => Err(plugin.missing(stringify!($name))),
        }
    }};
}

/// Is the inner plugin's family one whose create options we can fill in
/// (`cpu_device_count`, `process_id`)? GPU plugins take other options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginFamily {
    Cpu,
    Gpu,
}

/// A loaded compute plugin. Lives for the rest of the process.
pub struct ComputePlugin {
    path: PathBuf,
    api: *const PJRT_Api,
    struct_size: usize,
    version: (i32, i32),
    family: PluginFamily,
    extensions: Vec<*mut PJRT_Extension_Base>,
    initialized: OnceCell<std::result::Result<(), Status>>,
    attributes: OnceCell<Vec<(String, NamedValue)>>,
    _library: libloading::Library,
}

// SAFETY: `api` points into the never-unloaded library and is read only;
// PJRT C API functions may be called from any thread.
unsafe impl Send for ComputePlugin {}
// SAFETY: as above.
unsafe impl Sync for ComputePlugin {}

impl std::fmt::Debug for ComputePlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ComputePlugin({}, PJRT {}.{})",
            self.path.display(),
            self.version.0,
            self.version.1
        )
    }
}

impl ComputePlugin {
    fn load(path: &Path) -> Result<ComputePlugin> {
        let shown = path.display();
        let bad = |what: String| failed_precondition(format!("compute plugin {shown}: {what}"));
        // SAFETY: loading a PJRT plugin runs its initializers; that is what
        // configuring it as the compute plugin asks for.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| bad(format!("cannot be loaded: {e}")))?;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin.
        let get_api =
            unsafe { library.get::<unsafe extern "C" fn() -> *const PJRT_Api>(b"GetPjrtApi\0") }
                .map_err(|e| {
                    bad(format!(
                        "has no GetPjrtApi entry point ({e}); is it a PJRT plugin?"
                    ))
                })?;
        // SAFETY: the plugin's entry point, no arguments.
        let api = unsafe { get_api() };
        if api.is_null() {
            return Err(bad("GetPjrtApi returned NULL".into()));
        }
        // SAFETY: a PJRT_Api begins with struct_size, extension_start and
        // the version struct in every 0.x version.
        let (struct_size, extension_start, version) = unsafe {
            (
                (*api).struct_size,
                (*api).extension_start,
                (
                    (*api).pjrt_api_version.major_version,
                    (*api).pjrt_api_version.minor_version,
                ),
            )
        };
        if version.0 != PJRT_API_MAJOR as i32 {
            return Err(bad(format!(
                "speaks PJRT C API {}.{}; pjrt-crosshost serves major version {} only",
                version.0, version.1, PJRT_API_MAJOR
            )));
        }
        let mut extensions = Vec::new();
        let mut next = extension_start;
        while !next.is_null() && extensions.len() < 64 {
            extensions.push(next);
            // SAFETY: every extension begins with PJRT_Extension_Base.
            next = unsafe { (*next).next };
        }
        let mut plugin = ComputePlugin {
            path: path.to_path_buf(),
            api,
            struct_size,
            version,
            family: PluginFamily::Cpu,
            extensions,
            initialized: OnceCell::new(),
            attributes: OnceCell::new(),
            _library: library,
        };
        let missing: Vec<&str> = REQUIRED
            .iter()
            .filter(|(_, offset)| !plugin.has_slot(*offset))
            .map(|(name, _)| *name)
            .collect();
        if !missing.is_empty() {
            return Err(bad(format!(
                "(PJRT {}.{}) lacks functions a delegating client needs: {}",
                version.0,
                version.1,
                missing.join(", ")
            )));
        }
        plugin.family = if plugin
            .extension(PJRT_Extension_Type_Gpu_Custom_Call)
            .is_some()
        {
            PluginFamily::Gpu
        } else {
            PluginFamily::Cpu
        };
        log::info!(
            "compute plugin {shown}: PJRT {}.{}, {} slots, {} extensions, {:?} family",
            version.0,
            version.1,
            plugin.slot_count(),
            plugin.extensions.len(),
            plugin.family
        );
        Ok(plugin)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    pub fn family(&self) -> PluginFamily {
        self.family
    }

    /// The inner plugin's raw table (for `ffi/`, which forwards to it).
    pub fn raw_api(&self) -> *const PJRT_Api {
        self.api
    }

    /// Number of function slots of the inner table.
    pub fn slot_count(&self) -> usize {
        let header = std::mem::offset_of!(PJRT_Api, PJRT_Error_Destroy);
        self.struct_size.saturating_sub(header) / std::mem::size_of::<usize>()
    }

    fn has_slot(&self, offset: usize) -> bool {
        self.slot(offset, |api| {
            // SAFETY: `slot` checked that the inner table covers `offset`.
            unsafe { ((api as *const u8).add(offset) as *const usize).read() }
        })
        .is_some_and(|word| word != 0)
    }

    /// Reads a slot through `read` when the inner table covers `offset`.
    pub fn slot<T>(&self, offset: usize, read: impl FnOnce(*const PJRT_Api) -> T) -> Option<T> {
        (offset + std::mem::size_of::<usize>() <= self.struct_size).then(|| read(self.api))
    }

    /// The inner plugin's extensions, in chain order.
    pub fn extensions(&self) -> &[*mut PJRT_Extension_Base] {
        &self.extensions
    }

    pub fn extension(&self, kind: PJRT_Extension_Type) -> Option<*mut PJRT_Extension_Base> {
        self.extensions
            .iter()
            .copied()
            // SAFETY: chain entries begin with PJRT_Extension_Base.
            .find(|&e| unsafe { (*e).type_ } == kind)
    }

    /// Converts an error the inner plugin returned (null: success).
    pub fn check(&self, error: *mut PJRT_Error, function: &str) -> Result<()> {
        match take_inner_error(self, error) {
            None => Ok(()),
            Some(status) => Err(Status::new(
                status.code,
                format!("{function} (compute plugin): {}", status.message),
            )),
        }
    }

    /// The error for a function the inner table does not have.
    pub fn missing(&self, function: &str) -> Status {
        crate::status::unimplemented(format!(
            "{function}: the compute plugin {} (PJRT {}.{}) does not provide it",
            self.path.display(),
            self.version.0,
            self.version.1
        ))
    }

    /// `PJRT_Plugin_Initialize` of the inner plugin, once per process.
    pub fn initialize(&self) -> Result<()> {
        self.initialized
            .get_or_init(|| {
                let mut args = PJRT_Plugin_Initialize_Args {
                    struct_size: PJRT_Plugin_Initialize_Args_STRUCT_SIZE as usize,
                    extension_start: std::ptr::null_mut(),
                };
                crate::inner_call!(self, PJRT_Plugin_Initialize, &mut args)
            })
            .clone()
    }

    /// The inner plugin's attributes (`xla_version`, StableHLO versions...),
    /// copied once.
    pub fn attributes(&self) -> &[(String, NamedValue)] {
        self.attributes.get_or_init(|| {
            let mut args = PJRT_Plugin_Attributes_Args {
                struct_size: PJRT_Plugin_Attributes_Args_STRUCT_SIZE as usize,
                ..Default::default()
            };
            if let Err(e) = crate::inner_call!(self, PJRT_Plugin_Attributes, &mut args) {
                log::warn!("compute plugin attributes: {e}");
                return Vec::new();
            }
            // SAFETY: the plugin's array of `num_attributes` named values,
            // alive for the plugin's lifetime.
            unsafe { copy_named_values(args.attributes, args.num_attributes) }
        })
    }
}

// ------------------------------ the process's one ----------------------------

/// What `configure` set (the Python package's configuration).
static CONFIGURED: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The process's compute plugin, once a load was attempted: the path it
/// was asked for and the outcome.
static LOADED: OnceCell<(PathBuf, std::result::Result<Arc<ComputePlugin>, Status>)> =
    OnceCell::new();

/// Sets the compute plugin path before the plugin is loaded (an empty path
/// clears it). Refused once a plugin was loaded: there is one per process.
pub fn configure(path: Option<&str>) -> Result<()> {
    if let Some((loaded, _)) = LOADED.get() {
        let same = path.is_some_and(|p| canonical(Path::new(p)) == *loaded);
        if !same {
            return Err(failed_precondition(format!(
                "the compute plugin is already loaded from {}; configure it before GetPjrtApi",
                loaded.display()
            )));
        }
    }
    *CONFIGURED.lock() = path.filter(|p| !p.is_empty()).map(PathBuf::from);
    Ok(())
}

/// The path configured for this process: `configure`, else the environment.
pub fn configured_path() -> Option<PathBuf> {
    if let Some(path) = CONFIGURED.lock().clone() {
        return Some(path);
    }
    std::env::var_os(COMPUTE_PLUGIN_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Loads (once) and returns the compute plugin at `path`. A second, different
/// path is refused: a process has one compute plugin.
pub fn load(path: &Path) -> Result<Arc<ComputePlugin>> {
    let wanted = canonical(path);
    let (loaded_path, outcome) = LOADED.get_or_init(|| {
        let outcome = ComputePlugin::load(&wanted).map(Arc::new);
        if let Err(e) = &outcome {
            log::error!("{e}");
        }
        (wanted.clone(), outcome)
    });
    if *loaded_path != wanted {
        return Err(invalid_argument(format!(
            "compute plugin {}: this process already uses the compute plugin {} (one per process)",
            path.display(),
            loaded_path.display()
        )));
    }
    outcome.clone()
}

/// The process's compute plugin if one was loaded successfully.
pub fn loaded() -> Option<Arc<ComputePlugin>> {
    LOADED
        .get()
        .and_then(|(_, outcome)| outcome.as_ref().ok().cloned())
}

/// Loads the configured compute plugin, if any (at `GetPjrtApi`).
pub fn load_configured() -> Option<Result<Arc<ComputePlugin>>> {
    configured_path().map(|path| load(&path))
}

/// Reads a C string the inner plugin returned as (pointer, size).
pub(crate) fn inner_str(ptr: *const std::os::raw::c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: PJRT string outputs are valid for their stated size.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
        .into_owned()
}

/// An opaque pointer the inner plugin handed out, movable between threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InnerPtr(pub usize);

impl InnerPtr {
    pub fn from<T>(ptr: *mut T) -> InnerPtr {
        InnerPtr(ptr as usize)
    }

    pub fn as_mut<T>(self) -> *mut T {
        self.0 as *mut T
    }

    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// `user_arg` type of the inner plugin's callbacks.
pub(crate) type UserArg = *mut c_void;
