//! Socket-level helpers the TCP transport needs beyond `std::net`: receiving
//! straight into destination memory.
//!
//! Socket buffer sizes are left to the kernel. Setting `SO_SNDBUF` and
//! `SO_RCVBUF` turns off its autotuning and caps the window at
//! `net.core.{w,r}mem_max` (212,992 bytes on a stock kernel). On the two-host
//! bed, 4 MiB buffers on both ends moved 64 x 1 MiB inside JAX in 21.93 ms
//! against 18.56 ms autotuned, and 256 MiB in 133 against 122 ms (medians of
//! three alternating rounds, docs/benchmarks.md); setting either one alone
//! was as slow as both.
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Largest single `recv` (keeps each call's timeout meaningful).
const MAX_RECV_CHUNK: usize = 16 << 20;

/// Receives exactly `len` bytes from `stream` into raw memory at `target`,
/// honouring the stream's read timeout. Returns `UnexpectedEof` if the peer
/// closes first.
///
/// # Safety
///
/// `target` must be valid for writes of `len` bytes for the whole call, and
/// no Rust reference may cover that memory meanwhile.
pub unsafe fn recv_exact_into(stream: &TcpStream, target: *mut u8, len: usize) -> io::Result<()> {
    let mut received = 0usize;
    while received < len {
        let chunk = (len - received).min(MAX_RECV_CHUNK);
        // SAFETY: `received + chunk <= len`, so the written range lies inside
        // the caller's valid range; `recv` writes at most `chunk` bytes.
        let got = unsafe { libc::recv(stream.as_raw_fd(), target.add(received).cast(), chunk, 0) };
        if got < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("peer closed the connection after {received} of {len} payload bytes"),
            ));
        }
        received += got as usize;
    }
    Ok(())
}

/// One `recv` of at most `len` bytes into raw memory at `target`, without
/// waiting: `WouldBlock` when nothing is there, `Ok(0)` (for `len > 0`)
/// when the peer closed.
///
/// # Safety
///
/// `target` must be valid for writes of `len` bytes for the whole call, and
/// no Rust reference may cover that memory meanwhile.
pub unsafe fn recv_now_into(stream: &TcpStream, target: *mut u8, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: the caller's range is valid for `len` bytes, and `recv`
        // writes at most `len`.
        let got = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                target.cast(),
                len.min(MAX_RECV_CHUNK),
                libc::MSG_DONTWAIT,
            )
        };
        if got >= 0 {
            return Ok(got as usize);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// True when an idle connection's peer has closed it or sent something
/// unasked (either way it cannot carry another request), without waiting.
pub fn unusable_when_idle(stream: &TcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: one byte of `byte`, which lives across the call; MSG_PEEK
    // leaves the socket's data as it is.
    let got = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if got < 0 {
        let error = io::Error::last_os_error();
        return !matches!(
            error.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        );
    }
    true
}

/// True for the errors a socket timeout produces.
pub fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
