//! The C ABI: the `PJRT_Api` table and translation between C handles and the
//! safe layers below. No logic beyond translation lives here.
// PJRT constants keep their C names.
#![allow(non_upper_case_globals)]
mod args;
pub(crate) mod boundary;
mod buffer;
mod client;
mod cxx_delete;
mod device;
mod doctor_export;
mod error_entries;
pub(crate) mod errors;
mod events;
pub mod forward;
pub(crate) mod handles;
pub mod kv_callbacks;
mod kv_delete_route;
mod live_clients;
pub mod logging;
mod memory;
mod metrics_export;
mod plugin;
mod process_infos;
mod transfers;
pub(crate) mod unimplemented;

use once_cell::sync::Lazy;

use crate::pjrt::bindings::*;

struct ApiTable(PJRT_Api);
// SAFETY: built once, never mutated afterwards; holds function pointers and
// pointers to other immutable statics.
unsafe impl Sync for ApiTable {}
// SAFETY: as above.
unsafe impl Send for ApiTable {}

static API: Lazy<ApiTable> = Lazy::new(|| ApiTable(api_table()));

fn api_table() -> PJRT_Api {
    let mut api = PJRT_Api {
        struct_size: PJRT_Api_STRUCT_SIZE as usize,
        extension_start: transfers::extension_chain(),
        pjrt_api_version: PJRT_Api_Version {
            struct_size: PJRT_Api_Version_STRUCT_SIZE as usize,
            extension_start: std::ptr::null_mut(),
            major_version: PJRT_API_MAJOR as i32,
            minor_version: PJRT_API_MINOR as i32,
        },
        ..Default::default()
    };
    unimplemented::fill(&mut api);
    forward::table::install(&mut api);
    api
}

/// The plugin's entry point: the `PJRT_Api` table, static and never freed.
/// The first call loads the configured compute plugin; a failure to load is
/// logged and reported by `PJRT_Client_Create`, so that this never fails.
/// NULL only on an internal panic.
#[no_mangle]
pub extern "C" fn GetPjrtApi() -> *const PJRT_Api {
    boundary::or_on_panic(std::ptr::null(), || {
        logging::init();
        // Before the table exists: the compute plugin's extensions go on our
        // chain. A load failure is remembered and reported by client
        // creation.
        if let Some(Err(e)) = crate::compute_plugin::load_configured() {
            log::error!("{e}");
        }
        &API.0 as *const PJRT_Api
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_api_slot_is_filled() {
        let api = GetPjrtApi();
        assert!(!api.is_null());
        // SAFETY: GetPjrtApi returns a pointer to a static table.
        let api = unsafe { &*api };
        let header = std::mem::offset_of!(PJRT_Api, PJRT_Error_Destroy);
        let slots = (api.struct_size - header) / std::mem::size_of::<usize>();
        // SAFETY: the slot region is `slots` function pointers.
        let words = unsafe {
            std::slice::from_raw_parts(
                (api as *const PJRT_Api as *const u8).add(header) as *const usize,
                slots,
            )
        };
        assert_eq!(slots, unimplemented::PJRT_API_SLOT_COUNT);
        assert!(words.iter().all(|&w| w != 0), "a PJRT_Api slot is null");
    }
}
