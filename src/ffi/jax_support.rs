//! Entries that JAX (jaxlib 0.10.2, PJRT 0.112) calls while it wraps the
//! client and that must succeed there: a failure in these aborts the process.
use std::ffi::CString;
use std::os::raw::c_char;
use std::sync::{Arc, Weak};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::args::{client_arg, null_field};
use super::boundary::or_on_panic;
use crate::api::client::Client;
use crate::api::transfers::ProcessReport;
use crate::pjrt::bindings::*;

const FOR_EACH_PAYLOAD: &str = "PJRT_Error_ForEachPayload";

crate::pjrt_entry!(
    /// Visits the error's payloads: ours carry none, another implementation's
    /// are visited through its own vtable. INVALID_ARGUMENT only for a null
    /// error: jaxlib converts every PJRT_Error to a Status through GetCode,
    /// Message and ForEachPayload, and an error from ForEachPayload makes it
    /// convert that error too, recursing until the stack overflows.
    error_for_each_payload = "PJRT_Error_ForEachPayload", PJRT_Error_ForEachPayload_Args through user_arg, |args| {
    if args.error.is_null() {
        return Err(null_field(FOR_EACH_PAYLOAD, "error"));
    }
    // SAFETY: `error` is a live PJRT_Error; a live PJRT_Error begins with
    // the header's vtable pointer.
    let for_each = unsafe { (*args.error).vtable.as_ref() }.and_then(|t| t.for_each_payload);
    if let Some(f) = for_each {
        // SAFETY: the error's own vtable function, with the caller's visitor.
        unsafe { f(args.error, args.visitor, args.user_arg) };
    }
    Ok(())
});

const UPDATE_PROCESS_INFO: &str = "PJRT_Client_UpdateGlobalProcessInfo";

/// Reads an array of `PJRT_ProcessInfo`, stepping by the caller's own
/// `struct_size` (an older caller's entries may be shorter than ours).
///
/// # Safety
/// `infos` must point to `count` entries, each `infos[0].struct_size` bytes.
unsafe fn read_process_infos(
    infos: *const PJRT_ProcessInfo,
    count: usize,
) -> crate::status::Result<Vec<ProcessReport>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: non-null (checked by the caller) and at least one entry.
    let stride = unsafe { (*infos).struct_size };
    let needed = crate::struct_size_through!(PJRT_ProcessInfo, state);
    if stride < needed {
        return Err(crate::status::invalid_argument(format!(
            "{UPDATE_PROCESS_INFO}: process_infos[0].struct_size {stride} is smaller than the {needed} bytes needed"
        )));
    }
    let base = infos as *const u8;
    Ok((0..count)
        .map(|i| {
            // SAFETY: entry i starts i * stride bytes in and holds at least
            // `needed` bytes (all entries share the caller's struct size).
            let info = unsafe { &*(base.add(i * stride) as *const PJRT_ProcessInfo) };
            ProcessReport {
                task: info.task_id,
                incarnation: info.incarnation_id as i64,
                lost: matches!(
                    info.state,
                    PJRT_ProcessState_kDisconnected | PJRT_ProcessState_kError
                ),
            }
        })
        .collect())
}

crate::pjrt_entry!(
    /// Hands the job's processes (`PJRT_ProcessInfo`s, stepped by the
    /// caller's own `struct_size`) to the client's transfers: the incarnations
    /// are recorded, and pending receives from a task reported disconnected or
    /// failed fail with UNAVAILABLE. jaxlib's multi-process client calls this
    /// from a background thread whenever its coordination service reports a
    /// change, and aborts the process on an error, so the only errors are
    /// INVALID_ARGUMENT for null or too short `process_infos`.
    client_update_global_process_info = "PJRT_Client_UpdateGlobalProcessInfo", PJRT_Client_UpdateGlobalProcessInfo_Args through num_process_infos, |args| {
    // SAFETY: live client per contract.
    let client = unsafe { client_arg(args.client, UPDATE_PROCESS_INFO) }?;
    if args.num_process_infos > 0 && args.process_infos.is_null() {
        return Err(null_field(UPDATE_PROCESS_INFO, "process_infos"));
    }
    // SAFETY: `num_process_infos` entries of the caller's struct size.
    let reports = unsafe { read_process_infos(args.process_infos, args.num_process_infos) }?;
    log::debug!(
        "{UPDATE_PROCESS_INFO}: process {} told {:?}",
        client.client.process_index(),
        reports
    );
    client.client.observe_processes(&reports);
    Ok(())
});

/// Clients created through the C API and possibly still alive. JAX never
/// hands out its `PJRT_Client*`, so a program that loaded the plugin through
/// JAX reads its clients' metrics through
/// `pjrt_crosshost_live_clients_metrics_json` instead.
static LIVE_CLIENTS: Lazy<Mutex<Vec<Weak<Client>>>> = Lazy::new(|| Mutex::new(Vec::new()));

crate::pjrt_entry!(
    /// `PJRT_Client_Create` as the table offers it: `client::client_create`,
    /// then the new client is remembered (weakly) for
    /// `pjrt_crosshost_live_clients_metrics_json`. Same contract and errors.
    client_create_registering = "PJRT_Client_Create", PJRT_Client_Create_Args through client, |args| {
    let raw: *mut PJRT_Client_Create_Args = args;
    // SAFETY: `raw` is the caller's checked args struct, passed on unchanged.
    let error = unsafe { super::client::client_create(raw) };
    // SAFETY: null or an error just made by client_create, owned by us now.
    if let Some(status) = unsafe { super::errors::take_error(error) } {
        return Err(status);
    }
    // SAFETY: client_create succeeded, so `client` is the live handle it made.
    let handle = unsafe { client_arg(args.client, "PJRT_Client_Create") }?;
    let mut live = LIVE_CLIENTS.lock();
    live.retain(|c| c.strong_count() > 0);
    live.push(Arc::downgrade(&handle.client));
    Ok(())
});

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
