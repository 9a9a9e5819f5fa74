//! `PJRT_Client_UpdateGlobalProcessInfo`: the framework tells a client which
//! processes of its job are alive (jaxlib calls it from its coordination
//! service's watch, and aborts the process on an error).
use super::args::{client_arg, null_field};
use crate::api::transfers::ProcessReport;
use crate::pjrt::bindings::*;

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
