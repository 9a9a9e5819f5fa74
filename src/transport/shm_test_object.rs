//! Test support: a POSIX shared-memory object made under a chosen name (a
//! name another process would use, or one that is not ours at all), so the
//! reaper and the sender's liveness checks can be tested against objects
//! owned by other processes. Unlinked on drop, so a failing test leaves
//! nothing in /dev/shm.
use std::ffi::CString;
use std::path::Path;

use super::random::random_hex;
use super::shm::{shm_name, unlink_name};
use super::shm_owner::ShmOwner;
use super::shm_reaper::SHM_DIR;

pub struct NamedShmObject(pub String);

impl NamedShmObject {
    /// An object of `len` bytes named as `owner` would name one.
    pub fn create(owner: &ShmOwner, len: usize) -> NamedShmObject {
        NamedShmObject::create_named(shm_name(owner, &random_hex(16).unwrap()), len)
    }

    /// An object of `len` bytes under exactly `name`.
    pub fn create_named(name: String, len: usize) -> NamedShmObject {
        let c_name = CString::new(name.as_str()).unwrap();
        // SAFETY: valid NUL-terminated name; the descriptor is closed below.
        let fd = unsafe {
            libc::shm_open(
                c_name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600 as libc::mode_t,
            )
        };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: our fresh descriptor: sized, then closed.
        unsafe {
            assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
            libc::close(fd);
        }
        NamedShmObject(name)
    }

    /// Takes over an object someone else made, to unlink it on drop.
    pub fn adopt(name: String) -> NamedShmObject {
        NamedShmObject(name)
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    pub fn exists(&self) -> bool {
        exists(&self.0)
    }
}

/// Whether a shared-memory object of this name is in /dev/shm.
pub fn exists(name: &str) -> bool {
    Path::new(&format!("{SHM_DIR}{name}")).exists()
}

impl Drop for NamedShmObject {
    fn drop(&mut self) {
        let _ = unlink_name(&self.0);
    }
}
