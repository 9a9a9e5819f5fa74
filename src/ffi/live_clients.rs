//! The clients of this process that may still be alive, and their metrics
//! as one JSON array: a program that loaded the plugin through a framework
//! that never hands out its `PJRT_Client*` (JAX) reads them this way.
use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::boundary::or_on_panic;
use crate::api::client::Client;

/// Clients created through the C API and possibly still alive. JAX never
/// hands out its `PJRT_Client*`, so a program that loaded the plugin through
/// JAX reads its clients' metrics through
/// `pjrt_crosshost_live_clients_metrics_json` instead.
static LIVE_CLIENTS: Lazy<Mutex<Vec<Weak<Client>>>> = Lazy::new(|| Mutex::new(Vec::new()));

/// Remembers `client` (weakly) for `pjrt_crosshost_live_clients_metrics_json`.
pub(crate) fn remember(client: &Arc<Client>) {
    let mut live = LIVE_CLIENTS.lock();
    live.retain(|c| c.strong_count() > 0);
    live.push(Arc::downgrade(client));
}

/// The live clients of this process, in creation order.
pub(crate) fn live_clients() -> Vec<Arc<Client>> {
    LIVE_CLIENTS
        .lock()
        .iter()
        .filter_map(Weak::upgrade)
        .collect()
}

/// JSON array with one object per live client of this process:
/// `{"process_index":N,"metrics":{...pjrt_crosshost_metrics_json...}}`, in
/// creation order. Free with `pjrt_crosshost_free_string`; NULL only on an
/// internal error.
#[no_mangle]
pub extern "C" fn pjrt_crosshost_live_clients_metrics_json() -> *mut c_char {
    or_on_panic(std::ptr::null_mut(), || {
        let clients = live_clients();
        let entries: Vec<String> = clients
            .iter()
            .map(|c| {
                format!(
                    "{{\"process_index\":{},\"metrics\":{}}}",
                    c.process_index(),
                    c.metrics_json()
                )
            })
            .collect();
        CString::new(format!("[{}]", entries.join(",")))
            .map(CString::into_raw)
            .unwrap_or(std::ptr::null_mut())
    })
}
