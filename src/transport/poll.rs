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
