//! The names of the plugin's shared-memory objects: who made each one
//! (`/crosshost-<pid namespace>-<pid>-<start time>-<random>`), how to read
//! that back strictly, and removing a name. Shared by the objects
//! (`shm.rs`) and the reaper that removes a dead owner's (`shm_reaper.rs`).
use std::ffi::CString;

use super::shm_owner::ShmOwner;
use crate::status::{self, Result, Status};

pub const SHM_NAME_PREFIX: &str = "/crosshost-";
/// 128 random bits, lowercase hex.
pub(crate) const SHM_NAME_RANDOM_HEX_LEN: usize = 32;
/// Longest decimal field (`u64::MAX` has 20 digits).
const SHM_NAME_MAX_DIGITS: usize = 20;

/// The name of a new object of `owner`:
/// `/crosshost-<pid namespace>-<pid>-<start time>-<32 lowercase hex>`, the
/// three owner fields in decimal without leading zeros, the hex from the
/// kernel's CSPRNG.
pub fn shm_name(owner: &ShmOwner, random_hex: &str) -> String {
    format!(
        "{SHM_NAME_PREFIX}{}-{}-{}-{random_hex}",
        owner.pid_namespace, owner.pid, owner.start_time
    )
}

/// The prefix of every name `owner` makes (what its objects share).
pub fn shm_name_prefix_of(owner: &ShmOwner) -> String {
    format!(
        "{SHM_NAME_PREFIX}{}-{}-{}-",
        owner.pid_namespace, owner.pid, owner.start_time
    )
}

/// The owner a name made by `shm_name` carries. Strict: exactly that
/// format, anything else is `INVALID_ARGUMENT`.
pub fn shm_name_owner(name: &str) -> Result<ShmOwner> {
    let bad = || {
        status::invalid_argument(format!(
            "shared-memory name {name:?} must be {SHM_NAME_PREFIX:?} followed by \
             <pid namespace>-<pid>-<start time>-<{SHM_NAME_RANDOM_HEX_LEN} lowercase hex digits> \
             (decimal fields without leading zeros)"
        ))
    };
    let suffix = name.strip_prefix(SHM_NAME_PREFIX).ok_or_else(|| {
        status::invalid_argument(format!(
            "shared-memory name {name:?} does not start with {SHM_NAME_PREFIX:?}"
        ))
    })?;
    let fields: Vec<&str> = suffix.split('-').collect();
    let [namespace, pid, start_time, random] = fields[..] else {
        return Err(bad());
    };
    let decimal = |field: &str| -> Option<u64> {
        let canonical = !field.is_empty()
            && field.len() <= SHM_NAME_MAX_DIGITS
            && field.bytes().all(|c| c.is_ascii_digit())
            && (field == "0" || !field.starts_with('0'));
        if canonical {
            field.parse().ok()
        } else {
            None
        }
    };
    let random_ok = random.len() == SHM_NAME_RANDOM_HEX_LEN
        && random
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
    let (Some(namespace), Some(pid), Some(start_time)) =
        (decimal(namespace), decimal(pid), decimal(start_time))
    else {
        return Err(bad());
    };
    let pid = u32::try_from(pid)
        .ok()
        .filter(|&pid| pid > 0 && pid <= i32::MAX as u32);
    match pid {
        Some(pid) if random_ok && namespace > 0 => Ok(ShmOwner {
            pid_namespace: namespace,
            pid,
            start_time,
        }),
        _ => Err(bad()),
    }
}

/// Accepts exactly the names `SharedRegion::create` makes; anything else (a
/// path, another program's object, a name with odd characters) is refused
/// before it reaches `shm_open`.
pub fn validate_shm_name(name: &str) -> Result<()> {
    shm_name_owner(name).map(|_| ())
}

pub(crate) fn unlink_name(name: &str) -> Result<()> {
    let c_name = CString::new(name).expect("validated names contain no NUL");
    // SAFETY: `c_name` is a valid NUL-terminated string for the call.
    if unsafe { libc::shm_unlink(c_name.as_ptr()) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(os_status("shm_unlink", name, error));
    }
    Ok(())
}

pub(crate) fn os_status(operation: &str, name: &str, error: std::io::Error) -> Status {
    let message = format!("{operation} on shared-memory region {name} failed: {error}");
    match error.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::ENOMEM) | Some(libc::EMFILE) | Some(libc::ENFILE) => {
            status::resource_exhausted(message)
        }
        Some(libc::ENOENT) => status::not_found(message),
        Some(libc::EACCES) | Some(libc::EPERM) => status::permission_denied(message),
        _ => status::internal(message),
    }
}
