//! `poll`: waiting on several descriptors at once (the TCP server's front
//! door, the UCX progress thread).
use std::io;
use std::time::Duration;

/// Waits until one of `fds` is ready or `timeout` passes (`None`: no limit),
/// filling in each entry's `revents`. Returns how many entries are ready;
/// an interrupted wait counts as a timeout (0), so callers simply loop.
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let timeout_ms: libc::c_int = match timeout {
        None => -1,
        // Rounded up, so a deadline is not polled for again just before it.
        Some(timeout) => timeout
            .as_nanos()
            .div_ceil(1_000_000)
            .try_into()
            .unwrap_or(libc::c_int::MAX),
    };
    // SAFETY: `fds` is an exclusively borrowed slice of initialised
    // `pollfd`s that outlives the call, and its true length is passed, so
    // the kernel reads and writes only inside it.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if ready < 0 {
        let error = io::Error::last_os_error();
        if error.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(error);
    }
    Ok(ready as usize)
}

/// An eventfd another thread writes to wake a thread asleep in `poll` or
/// epoll (new work, a new deadline, stop).
pub struct WakeFd(std::os::fd::OwnedFd);

impl WakeFd {
    pub fn new() -> io::Result<WakeFd> {
        // SAFETY: eventfd with valid flags; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        Ok(WakeFd(unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) }))
    }

    /// The descriptor to wait on (readable once woken).
    pub fn raw(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.0)
    }

    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a live u64 to our own eventfd.
        unsafe {
            libc::write(
                self.raw(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            );
        }
    }

    /// Takes the wake-ups so far (the descriptor is quiet again).
    pub fn drain(&self) {
        let mut count: u64 = 0;
        // SAFETY: reading 8 bytes into a live u64 from our own non-blocking
        // eventfd (at most it fails with EAGAIN).
        unsafe {
            libc::read(
                self.raw(),
                (&mut count as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            );
        }
    }
}
