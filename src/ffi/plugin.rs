//! PJRT_Plugin_*: initialization and plugin attributes. With a compute
//! plugin, both include it: its `PJRT_Plugin_Initialize` runs once, and its
//! attributes (`xla_version`, the StableHLO versions JAX serializes for)
//! are ours too, with ours added.
use std::ffi::CString;
use std::os::raw::{c_char, c_int};

use once_cell::sync::OnceCell;

use super::boundary::or_on_panic;
use crate::compute_plugin;
use crate::pjrt::named_values::{NamedValue, NamedValues};

/// Built at the first call: after `GetPjrtApi` loaded any compute plugin.
static PLUGIN_ATTRIBUTES: OnceCell<NamedValues> = OnceCell::new();

fn attributes() -> &'static NamedValues {
    PLUGIN_ATTRIBUTES.get_or_init(|| {
        let ours: Vec<(String, NamedValue)> = vec![
            (
                "supports_cross_host_transfers".into(),
                NamedValue::Bool(true),
            ),
            (
                "pjrt_crosshost_version".into(),
                NamedValue::Str(env!("CARGO_PKG_VERSION").into()),
            ),
        ];
        let mut all: Vec<(String, NamedValue)> = compute_plugin::loaded()
            .map(|plugin| {
                plugin
                    .attributes()
                    .iter()
                    .filter(|(name, _)| !ours.iter().any(|(o, _)| o == name))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        all.extend(ours);
        NamedValues::new(all)
    })
}

crate::pjrt_entry!(
    /// Initializes the plugin (logging) and the compute plugin, once. A
    /// compute plugin that fails here is reported by client creation, so
    /// the plugin stays usable with an embedded backend.
    plugin_initialize = "PJRT_Plugin_Initialize", PJRT_Plugin_Initialize_Args through struct_size, |_args| {
    super::logging::init();
    if let Some(plugin) = compute_plugin::loaded() {
        if let Err(e) = plugin.initialize() {
            log::error!("initializing compute plugin {}: {e}", plugin.path().display());
        }
    }
    Ok(())
});

crate::pjrt_entry!(
    /// The plugin's attributes (the compute plugin's first), alive for the
    /// process.
    plugin_attributes = "PJRT_Plugin_Attributes", PJRT_Plugin_Attributes_Args through num_attributes, |args| {
    let attributes = attributes();
    args.attributes = attributes.values.as_ptr();
    args.num_attributes = attributes.values.len();
    Ok(())
});

/// Sets the compute plugin (`path`, NUL-terminated; NULL or "" clears it)
/// before `GetPjrtApi` loads it. Returns 0, or -1 (logged) when a different
/// compute plugin is already loaded or `path` is not UTF-8.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_set_compute_plugin(path: *const c_char) -> c_int {
    or_on_panic(-1, || {
        let path = if path.is_null() {
            None
        } else {
            // SAFETY: the caller passes a NUL-terminated string.
            match unsafe { std::ffi::CStr::from_ptr(path) }.to_str() {
                Ok(p) => Some(p.to_string()),
                Err(_) => {
                    log::error!("pjrt_crosshost_set_compute_plugin: path is not UTF-8");
                    return -1;
                }
            }
        };
        match compute_plugin::configure(path.as_deref()) {
            Ok(()) => 0,
            Err(e) => {
                log::error!("pjrt_crosshost_set_compute_plugin: {e}");
                -1
            }
        }
    })
}

/// The compute plugin this process uses (NUL-terminated, free with
/// `pjrt_crosshost_free_string`), or NULL when there is none.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_compute_plugin() -> *mut c_char {
    or_on_panic(std::ptr::null_mut(), || {
        compute_plugin::loaded()
            .and_then(|plugin| CString::new(plugin.path().to_string_lossy().into_owned()).ok())
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
}
