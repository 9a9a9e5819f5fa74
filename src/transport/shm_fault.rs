//! Surviving a shared-memory segment that shrinks under its mappings.
//!
//! Senders write into receivers' segments through mappings they keep
//! across transfers, and receivers (and the frameworks reading their
//! buffers) read their own. If any process of the same user truncates a
//! segment (`ftruncate`), every access past the new end raises SIGBUS,
//! which would kill the process. Every mapping a `SharedRegion` makes is
//! registered here for its life (`Registration`); a SIGBUS inside a
//! registered mapping is answered, in the handler, by mapping a private
//! anonymous page over the faulting one (the access then completes, into
//! memory no other process sees) and counting a fault for that mapping. A
//! sender's copy that saw the count move fails `DATA_LOSS` and drops its
//! mapping (`guarded`); a receiver's pool stops carving from a segment that
//! faulted. Any other SIGBUS goes to the handler installed before ours (or
//! the default action), exactly as before.
//!
//! The registry is a fixed table of atomics (any thread may fault: a
//! compute plugin may copy on its own threads), and the handler only reads
//! and bumps atomics and calls mmap(2): nothing it does allocates or takes
//! a lock. A handler that a framework installs later, without chaining to
//! ours, takes SIGBUS back: mappings are then unguarded, as without this
//! module; so are mappings beyond the table's size.
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

use crate::status::{Code, Status};

/// Mappings guarded at once.
const SLOTS: usize = 256;

struct Slot {
    /// Start of the registered mapping; 0 when the slot is free,
    /// `usize::MAX` while it is being filled in.
    start: AtomicUsize,
    len: AtomicUsize,
    faults: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faults: AtomicU64::new(0),
};
static TABLE: [Slot; SLOTS] = [FREE; SLOTS];

/// The mapping's file shrank under a guarded copy.
#[derive(Debug, PartialEq, Eq)]
pub struct Shrank;

impl Shrank {
    /// `DATA_LOSS` for the copy into `what`.
    pub fn status(&self, what: &str) -> Status {
        Status::new(
            Code::DataLoss,
            format!(
                "{what} shrank under the copy (another process truncated it): the bytes did not \
                 all land, and this sender's mapping of it is dropped"
            ),
        )
    }
}

/// A mapping's entry in the table, for as long as the mapping lives.
pub struct Registration {
    slot: Option<&'static Slot>,
}

impl Registration {
    /// Registers the mapping `[start, start + len)` (installing the handler
    /// the first time). Unguarded (`faults` stays 0) when the table is full
    /// or SIGBUS cannot be ours.
    pub fn new(start: usize, len: usize) -> Registration {
        install_once();
        Registration {
            slot: claim(start, len),
        }
    }

    /// An entry for no mapping (empty regions).
    pub fn none() -> Registration {
        Registration { slot: None }
    }

    /// Faults answered in the mapping so far.
    pub fn faults(&self) -> u64 {
        self.slot
            .map_or(0, |slot| slot.faults.load(Ordering::Acquire))
    }

    /// Runs `copy`, which writes into the mapping; `Shrank` if the mapping
    /// faulted meanwhile (its file shrank; pages of it are now private).
    pub fn guarded<R>(&self, copy: impl FnOnce() -> R) -> std::result::Result<R, Shrank> {
        let before = self.faults();
        compiler_fence(Ordering::SeqCst);
        let result = copy();
        compiler_fence(Ordering::SeqCst);
        if self.faults() != before {
            return Err(Shrank);
        }
        Ok(result)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            slot.len.store(0, Ordering::Release);
            slot.start.store(0, Ordering::Release);
        }
    }
}

/// Whether SIGBUS is ours (the handler is installed).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

fn claim(start: usize, len: usize) -> Option<&'static Slot> {
    if start == 0 || len == 0 || !installed() {
        return None;
    }
    for slot in &TABLE {
        if slot
            .start
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            slot.faults.store(0, Ordering::Relaxed);
            slot.len.store(len, Ordering::Release);
            slot.start.store(start, Ordering::Release);
            return Some(slot);
        }
    }
    log::debug!("{SLOTS} shared-memory mappings guarded already: this one is not");
    None
}

/// The action SIGBUS had before ours (a `libc::sigaction`, leaked).
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn install_once() {
    INSTALL.call_once(|| {
        // SAFETY: `action` is fully initialised before use; sigaction
        // writes the previous action into `previous`, which is leaked so
        // the handler may read it for the life of the process.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let previous: *mut libc::sigaction =
                Box::into_raw(Box::new(std::mem::zeroed::<libc::sigaction>()));
            if libc::sigaction(libc::SIGBUS, &action, previous) == 0 {
                PREVIOUS.store(previous, Ordering::Release);
                INSTALLED.store(true, Ordering::Release);
            } else {
                drop(Box::from_raw(previous));
                log::warn!(
                    "cannot handle SIGBUS ({}): a shared-memory segment truncated under a copy \
                     would kill this process",
                    std::io::Error::last_os_error()
                );
            }
        }
    });
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    let page = page_size();
    let page_start = address & !(page - 1);
    let mut ours = false;
    for slot in &TABLE {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start == 0 || start == usize::MAX || len == 0 {
            continue;
        }
        // Every mapping holding a byte of the replaced page lost it.
        if page_start < start + len && start < page_start + page {
            slot.faults.fetch_add(1, Ordering::AcqRel);
            ours = ours || (start..start + len).contains(&address);
        }
    }
    if ours {
        // SAFETY: the page lies inside a registered mapping, which stays
        // mapped while registered (the registration is dropped after the
        // munmap); a fixed private anonymous mapping replaces that one page
        // and goes with the mapping's munmap. mmap is a plain system call.
        let remapped = unsafe {
            libc::mmap(
                page_start as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if remapped != libc::MAP_FAILED {
            return;
        }
    }
    forward(signal, info, context);
}

/// Hands a SIGBUS that is not ours to the action installed before ours.
fn forward(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: `previous` was written by sigaction and is never freed.
    let action = unsafe { &*previous };
    let handler = action.sa_sigaction;
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // A SIGBUS from a fault cannot be ignored: restore the default and
        // return; the access faults again and the process ends as it would
        // have without us.
        // SAFETY: resetting a signal's disposition is async-signal-safe.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
        return;
    }
    if action.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO, so it
        // has this signature.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(handler) };
        f(signal, info, context);
    } else {
        // SAFETY: installed without SA_SIGINFO: a one-argument handler.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
        f(signal);
    }
}

/// The page size (4096 where sysconf cannot say); safe in a signal handler.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions and is async-signal-safe.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        page as usize
    } else {
        4096
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::SharedRegion;

    #[test]
    fn a_segment_truncated_under_its_mappings_fails_the_copy_and_not_the_process() {
        let owner = SharedRegion::create(1 << 20).unwrap();
        let sender = SharedRegion::open_whole(owner.name()).unwrap();
        let bytes = vec![7u8; 1 << 20];
        // Intact: the copy lands.
        sender
            .guarded(|| sender.write_at(0, &bytes))
            .unwrap()
            .unwrap();
        let mut back = vec![0u8; 16];
        owner.read_at((1 << 20) - 16, &mut back).unwrap();
        assert_eq!(back, vec![7u8; 16]);
        // Another process of the user truncates it to one page.
        let path = format!("/dev/shm{}", owner.name());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let shrank = sender.guarded(|| sender.write_at(0, &bytes)).unwrap_err();
        let e = shrank.status("segment /x");
        assert_eq!(e.code, Code::DataLoss);
        assert!(e.message.contains("segment /x shrank"), "{e}");
        // The first page was still there: the bytes before the end landed.
        owner.read_at(4088, &mut back[..8]).unwrap();
        assert_eq!(&back[..8], &[7u8; 8]);
        // The owner reading past the end survives too, and sees it counted.
        assert_eq!(owner.faults(), 0);
        owner.read_at((1 << 20) - 16, &mut back).unwrap();
        assert!(owner.faults() > 0);
        // Another region is not marked by those faults.
        let other = SharedRegion::create(4096).unwrap();
        other
            .guarded(|| other.write_at(0, &[1; 4096]))
            .unwrap()
            .unwrap();
        assert_eq!(other.faults(), 0);
    }
}
