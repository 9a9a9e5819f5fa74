//! `SharedRegion`: POSIX shared memory for same-host, cross-process
//! destinations. The receiver `create`s a region under an unguessable name
//! that also says who made it (see `shm_name`; mode 0600, `O_EXCL`), the
//! sender `open`s the window the descriptor names and writes into it. Pages
//! are reserved with `posix_fallocate` at creation, so a full `/dev/shm` is a
//! clean `RESOURCE_EXHAUSTED` for the receiver instead of a `SIGBUS` in the
//! sender.
//!
//! Names outlive a process that dies without unlinking them (SIGKILL,
//! `_exit`, a fatal error); the owner tag in the name is what lets
//! `shm_reaper` remove them afterwards (docs/DESIGN.md §6).
use std::ffi::CString;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use super::destination::WritableDestination;
use super::random::random_hex;
use super::shm_fault::{page_size, Registration, Shrank};
pub(crate) use super::shm_name::{os_status, unlink_name, SHM_NAME_RANDOM_HEX_LEN};
pub use super::shm_name::{
    shm_name, shm_name_owner, shm_name_prefix_of, validate_shm_name, SHM_NAME_PREFIX,
};
use super::shm_owner::ShmOwner;
use super::shm_populate::PopulatedChunks;
use crate::status::{self, Result};

/// A mapped window of a shared-memory object.
pub struct SharedRegion {
    name: String,
    /// Base of the mapping (page aligned); null when nothing is mapped
    /// (zero-length regions).
    mapping: *mut u8,
    mapping_len: usize,
    /// Where the region starts inside the mapping (the page-rounding slack).
    start_in_mapping: usize,
    len: usize,
    /// True for the creator, which unlinks the name at the latest on drop.
    owns_name: bool,
    unlinked: AtomicBool,
    /// The mapping's entry in the SIGBUS guard (`shm_fault.rs`).
    guard: Registration,
    /// Which chunks this mapping has faulted in (`populate`).
    populated: PopulatedChunks,
}

// SAFETY: the mapping is process-wide memory owned by this struct and only
// reached through raw pointers; it is not tied to any thread.
unsafe impl Send for SharedRegion {}
// SAFETY: `&self` methods only read immutable fields, copy through raw
// pointers, or flip the atomic `unlinked` flag.
unsafe impl Sync for SharedRegion {}

/// Options for `SharedRegion::create_with`.
#[derive(Clone, Copy, Debug, Default)]
pub struct CreateOptions {
    /// Map with `MAP_POPULATE` so that this process's page tables are filled
    /// up front (for pooled, long-lived segments).
    pub prefault: bool,
}

impl SharedRegion {
    /// Creates a new zero-filled object of `len` bytes and maps all of it.
    pub fn create(len: usize) -> Result<SharedRegion> {
        SharedRegion::create_with(len, CreateOptions::default())
    }

    pub fn create_with(len: usize, options: CreateOptions) -> Result<SharedRegion> {
        let (name, descriptor) = create_unique_object()?;
        let mut region = SharedRegion {
            name,
            mapping: std::ptr::null_mut(),
            mapping_len: 0,
            start_in_mapping: 0,
            len,
            owns_name: true,
            unlinked: AtomicBool::new(false),
            guard: Registration::none(),
            populated: PopulatedChunks::default(),
        };
        // From here on, dropping `region` unlinks the name on every error path.
        let sized = reserve(&descriptor, len, &region.name);
        let mapped = sized.and_then(|()| {
            map(&descriptor, 0, len, options.prefault, &region.name).map(|mapping| {
                region.mapping = mapping;
                region.mapping_len = len;
                region.guard = Registration::new(mapping as usize, len);
                region.populated = if options.prefault {
                    PopulatedChunks::all(len)
                } else {
                    PopulatedChunks::new(len)
                };
            })
        });
        mapped?;
        log::debug!("created shared-memory region {} ({len} bytes)", region.name);
        Ok(region)
    }

    /// Opens the window `[offset, offset + len)` of an existing object made
    /// by `create`, pre-faulting the mapping (the sender writes all of it).
    /// Fails with `INVALID_ARGUMENT` when the name is not one of ours or the
    /// object is smaller than `offset + len`, `NOT_FOUND` when it does not
    /// exist (any more).
    ///
    /// Measured, 256 MiB window, open + first write: 0.37 GB/s faulting page
    /// by page, 2.2 GB/s with `MAP_POPULATE` (warm writes 11 GB/s either way).
    pub fn open(name: &str, offset: u64, len: u64) -> Result<SharedRegion> {
        SharedRegion::open_with(name, offset, len, true)
    }

    /// Maps a whole existing object, for senders that keep the mapping of a
    /// receiver's pooled segment across transfers. Not pre-faulted: a pooled
    /// segment is 256 MiB of which a sender may write a few pages (faulting
    /// it all in would also make the receiver's whole object resident); the
    /// sender populates the range it writes (`populate`).
    pub fn open_whole(name: &str) -> Result<SharedRegion> {
        validate_shm_name(name)?;
        let c_name = CString::new(name).expect("validated names contain no NUL");
        // SAFETY: `c_name` is a valid NUL-terminated string for the call.
        let raw = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return SharedRegion::open_with(name, 0, 0, false);
        }
        let descriptor = OwnedFd(raw);
        let len = file_size(&descriptor, name)?;
        drop(descriptor);
        SharedRegion::open_with(name, 0, len, false)
    }

    /// `open`, choosing whether to pre-fault the mapping.
    pub fn open_with(name: &str, offset: u64, len: u64, prefault: bool) -> Result<SharedRegion> {
        validate_shm_name(name)?;
        let end = offset.checked_add(len).ok_or_else(|| {
            status::invalid_argument(format!(
                "shared-memory window [{offset}, +{len}) of {name} overflows"
            ))
        })?;
        let c_name = CString::new(name).expect("validated names contain no NUL");
        // SAFETY: `c_name` is a valid NUL-terminated string for the call.
        let raw = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            let error = std::io::Error::last_os_error();
            return Err(match error.raw_os_error() {
                Some(libc::ENOENT) => status::not_found(format!(
                    "shared-memory region {name} does not exist (already unlinked by its receiver?)"
                )),
                Some(libc::EACCES) => status::permission_denied(format!(
                    "shared-memory region {name}: access denied ({error})"
                )),
                _ => status::internal(format!("shm_open({name}) failed: {error}")),
            });
        }
        let descriptor = OwnedFd(raw);
        let object_len = file_size(&descriptor, name)?;
        if end > object_len {
            return Err(status::invalid_argument(format!(
                "shared-memory window [{offset}, +{len}) lies outside {name}, which has {object_len} bytes"
            )));
        }
        let len = usize::try_from(len).map_err(|_| {
            status::invalid_argument(format!("shared-memory window of {len} bytes is too large"))
        })?;
        let page = page_size();
        let aligned_offset = offset - offset % page as u64;
        let start_in_mapping = (offset - aligned_offset) as usize;
        let mut region = SharedRegion {
            name: name.to_string(),
            mapping: std::ptr::null_mut(),
            mapping_len: 0,
            start_in_mapping,
            len,
            owns_name: false,
            unlinked: AtomicBool::new(false),
            guard: Registration::none(),
            populated: PopulatedChunks::default(),
        };
        if len > 0 {
            let mapping_len = start_in_mapping + len;
            region.mapping = map(&descriptor, aligned_offset, mapping_len, prefault, name)?;
            region.mapping_len = mapping_len;
            region.populated = if prefault {
                PopulatedChunks::all(len)
            } else {
                PopulatedChunks::new(len)
            };
            region.guard = Registration::new(region.mapping as usize, mapping_len);
        }
        Ok(region)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the region (dangling but non-null when empty).
    pub fn as_ptr(&self) -> *mut u8 {
        if self.mapping.is_null() {
            return std::ptr::NonNull::dangling().as_ptr();
        }
        // SAFETY: `start_in_mapping < page size <= mapping_len`, so the result
        // stays inside the mapping.
        unsafe { self.mapping.add(self.start_in_mapping) }
    }

    /// The claim slot (see `claim.rs`) of the destination starting at
    /// `offset` of a region mapped from the start of its object. The slot
    /// must lie in the table, before the destination's data.
    pub fn claim_slot(&self, offset: u64) -> Result<super::claim::ClaimSlot<'_>> {
        let position = super::claim::slot_position(offset);
        let end = position + 8;
        if end > offset || end > self.len as u64 {
            return Err(status::invalid_argument(format!(
                "shared-memory region {}: offset {offset} has no claim slot (outside the claim table)",
                self.name
            )));
        }
        // SAFETY: [position, position+8) lies inside the mapping (checked);
        // the mapping is page aligned and position is a multiple of 8, so the
        // pointer is aligned for AtomicU64; the slot is only ever accessed
        // atomically, by every process mapping the object.
        let word = unsafe {
            &*(self.as_ptr().add(position as usize) as *const std::sync::atomic::AtomicU64)
        };
        Ok(super::claim::ClaimSlot(word))
    }

    /// SIGBUS faults answered in this mapping so far: its file shrank, and
    /// the pages past its end are now private zeroes (`shm_fault.rs`).
    pub fn faults(&self) -> u64 {
        self.guard.faults()
    }

    /// Runs `copy` (which writes into this mapping); `Shrank` if the file
    /// shrank under it.
    pub fn guarded<R>(&self, copy: impl FnOnce() -> R) -> std::result::Result<R, Shrank> {
        self.guard.guarded(copy)
    }

    /// Faults `[offset, offset + len)` in for writing (the parts this
    /// mapping has not faulted in yet), so a copy into it runs at memory
    /// speed instead of page by page, without faulting in the rest of a
    /// large mapping nobody uses yet (`shm_populate.rs`). Run it where a
    /// fault is survivable (`guarded`) if another process could truncate
    /// the object.
    pub fn populate(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len, "populate")?;
        // SAFETY: the range was checked to lie inside our writable mapping;
        // its bytes are the caller's to write (a fresh destination, or one
        // whose claim it holds), and populating changes none of them.
        unsafe {
            self.populated
                .populate(self.as_ptr(), self.len, offset, len)
        }
    }

    /// Copies `bytes` into the region at `offset` (bounds checked).
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.check_range(offset, bytes.len(), "write")?;
        // SAFETY: the range was checked to lie inside the mapped region, and
        // `bytes` is ordinary process memory that cannot overlap a fresh mapping
        // we only reach through raw pointers.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.as_ptr().add(offset), bytes.len())
        };
        Ok(())
    }

    /// Lets `fill` write `len` bytes at `offset` directly (bounds checked):
    /// a source that reads into a slice (a compute plugin's buffer) lands in
    /// the mapping without a staging copy. The caller must hold the right to
    /// write that range (a sender's claim on the destination).
    pub fn fill_at(
        &self,
        offset: usize,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len, "write")?;
        if len == 0 {
            return fill(&mut []);
        }
        // SAFETY: the range lies inside the mapping (checked) and stays mapped
        // while `self` lives; the caller's claim makes this the only writer of
        // it, and nothing in this process reads it before the receipt.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.as_ptr().add(offset), len) };
        fill(slice)
    }

    /// Copies `out.len()` bytes from the region at `offset` (bounds checked).
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len(), "read")?;
        // SAFETY: as in `write_at`, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// Whether `unlink` ran.
    pub fn is_unlinked(&self) -> bool {
        self.unlinked.load(Ordering::Acquire)
    }

    /// Removes the name so no further process can open the region; existing
    /// mappings stay valid. Idempotent. Only the creator unlinks.
    pub fn unlink(&self) -> Result<()> {
        if !self.owns_name {
            return Err(status::failed_precondition(format!(
                "shared-memory region {} was opened, not created, by this process; only its creator unlinks it",
                self.name
            )));
        }
        if self.unlinked.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        unlink_name(&self.name)
    }

    fn check_range(&self, offset: usize, count: usize, verb: &str) -> Result<()> {
        match offset.checked_add(count) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(status::out_of_range(format!(
                "{verb} of {count} bytes at offset {offset} exceeds shared-memory region {} of {} bytes",
                self.name, self.len
            ))),
        }
    }
}

// SAFETY: `as_ptr()` is fixed for the region's life and points to `len`
// mapped, writable bytes that are unmapped only in `drop`.
unsafe impl WritableDestination for SharedRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn as_mut_ptr(&self) -> *mut u8 {
        self.as_ptr()
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        if !self.mapping.is_null() {
            // SAFETY: `mapping`/`mapping_len` are exactly what mmap returned and
            // nothing else unmaps them; no references into the mapping outlive
            // `self` (the API only copies through raw pointers).
            let result = unsafe { libc::munmap(self.mapping.cast(), self.mapping_len) };
            // Out of the SIGBUS guard only once unmapped.
            self.guard = Registration::none();
            if result != 0 {
                log::error!(
                    "munmap of shared-memory region {} failed: {}",
                    self.name,
                    std::io::Error::last_os_error()
                );
            }
        }
        if self.owns_name && !self.unlinked.swap(true, Ordering::AcqRel) {
            if let Err(error) = unlink_name(&self.name) {
                log::error!("{error}");
            }
        }
    }
}

impl fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedRegion")
            .field("name", &self.name)
            .field("len", &self.len)
            .field("owns_name", &self.owns_name)
            .finish()
    }
}

/// Closes the file descriptor on drop.
struct OwnedFd(libc::c_int);

impl Drop for OwnedFd {
    fn drop(&mut self) {
        // SAFETY: the descriptor came from a successful shm_open and is closed
        // exactly once, here.
        unsafe { libc::close(self.0) };
    }
}

fn create_unique_object() -> Result<(String, OwnedFd)> {
    // 128 random bits make a collision practically impossible; retry a few
    // times anyway rather than fail on one.
    let owner = ShmOwner::current()?;
    super::shm_reaper::ensure_watchdog(&owner);
    for _ in 0..4 {
        let name = shm_name(&owner, &random_hex(SHM_NAME_RANDOM_HEX_LEN / 2)?);
        let c_name = CString::new(name.as_str()).expect("hex names contain no NUL");
        // SAFETY: `c_name` is a valid NUL-terminated string for the call.
        let raw = unsafe {
            libc::shm_open(
                c_name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600 as libc::mode_t,
            )
        };
        if raw >= 0 {
            return Ok((name, OwnedFd(raw)));
        }
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EEXIST) {
            return Err(os_status("shm_open(O_CREAT|O_EXCL)", &name, error));
        }
    }
    Err(status::internal(
        "shm_open kept finding existing objects under fresh random names",
    ))
}

/// Sizes the object and reserves its pages.
fn reserve(descriptor: &OwnedFd, len: usize, name: &str) -> Result<()> {
    let len_as_off = libc::off_t::try_from(len)
        .map_err(|_| status::invalid_argument(format!("shared-memory size {len} is too large")))?;
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(descriptor.0, len_as_off) } != 0 {
        return Err(os_status(
            "ftruncate",
            name,
            std::io::Error::last_os_error(),
        ));
    }
    if len > 0 {
        // SAFETY: plain syscall on a descriptor we own.
        let error = unsafe { libc::posix_fallocate(descriptor.0, 0, len_as_off) };
        if error != 0 {
            return Err(os_status(
                "posix_fallocate",
                name,
                std::io::Error::from_raw_os_error(error),
            ));
        }
    }
    Ok(())
}

fn map(
    descriptor: &OwnedFd,
    offset: u64,
    len: usize,
    prefault: bool,
    name: &str,
) -> Result<*mut u8> {
    if len == 0 {
        return Ok(std::ptr::null_mut());
    }
    let flags = if prefault {
        libc::MAP_SHARED | libc::MAP_POPULATE
    } else {
        libc::MAP_SHARED
    };
    let offset = libc::off_t::try_from(offset)
        .map_err(|_| status::invalid_argument(format!("offset {offset} is too large")))?;
    // SAFETY: a fresh mapping chosen by the kernel (addr = null) of a
    // descriptor we own; nothing existing is replaced.
    let mapping = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            descriptor.0,
            offset,
        )
    };
    if mapping == libc::MAP_FAILED {
        return Err(os_status("mmap", name, std::io::Error::last_os_error()));
    }
    Ok(mapping.cast())
}

/// The object's size, once it is known to be this user's: /dev/shm is
/// writable by everyone, so another user could plant an object under a name
/// that claims a receiver of ours, for a sender to write its bytes into.
fn file_size(descriptor: &OwnedFd, name: &str) -> Result<u64> {
    // SAFETY: `stat` is plain old data; all-zero is a valid value to overwrite.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `stat` is a valid out-pointer for the call; the descriptor is ours.
    if unsafe { libc::fstat(descriptor.0, &mut stat) } != 0 {
        return Err(os_status("fstat", name, std::io::Error::last_os_error()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if stat.st_uid != me {
        return Err(status::permission_denied(format!(
            "shared-memory region {name} belongs to uid {}, not to this process's user ({me}): \
             it is not a destination of this job",
            stat.st_uid
        )));
    }
    Ok(stat.st_size.max(0) as u64)
}

#[cfg(test)]
mod tests;
