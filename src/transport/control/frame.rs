//! The control links' frames (see the module comment of `control`) and the
//! stream types they travel on.
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::status::Status;

/// Frames larger than this are refused (a descriptor or receipt is a few
/// hundred bytes).
pub const MAX_FRAME: usize = 1 << 20;

pub(super) const OP_HELLO: u8 = 1;
pub(super) const OP_SET: u8 = 2;
pub(super) const OP_DELETE: u8 = 3;
/// An orderly close: the peer closes an idle link, it has not died.
pub(super) const OP_BYE: u8 = 4;
/// The server's answer to HELLO: its nonce and its proof (`sealing.rs`).
pub(super) const OP_CHALLENGE: u8 = 5;
/// The client's proof.
pub(super) const OP_PROOF: u8 = 6;
pub(super) const OP_ACK: u8 = 0x80;
pub(super) const OP_NACK: u8 = 0x81;

pub(super) trait Stream: Read + Write + Send + Sync {
    fn shutdown_both(&self);
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>>;
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()>;
    /// The socket underneath (-1 for one that has none: a test's bytes).
    fn raw_fd(&self) -> RawFd;
}

impl Stream for UnixStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
}

impl Stream for TcpStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
    fn raw_fd(&self) -> RawFd {
        self.as_raw_fd()
    }
}

/// An in-memory `Stream` over `bytes` that hands out at most `max_read` bytes
/// per `read` (a peer's short writes) and writes nowhere: the fuzz hooks'
/// and the tests' peer.
#[cfg(any(test, feature = "fuzzing"))]
pub(super) struct SliceStream<'a> {
    bytes: &'a [u8],
    max_read: usize,
    /// How many `read` calls it answered.
    pub(super) reads: usize,
}

#[cfg(any(test, feature = "fuzzing"))]
impl<'a> SliceStream<'a> {
    pub(super) fn new(bytes: &'a [u8], max_read: usize) -> SliceStream<'a> {
        SliceStream {
            bytes,
            max_read,
            reads: 0,
        }
    }
}

#[cfg(any(test, feature = "fuzzing"))]
impl Read for SliceStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reads += 1;
        let n = buf.len().min(self.max_read.max(1)).min(self.bytes.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

#[cfg(any(test, feature = "fuzzing"))]
impl Write for SliceStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(any(test, feature = "fuzzing"))]
impl Stream for SliceStream<'_> {
    fn shutdown_both(&self) {}
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "in-memory stream",
        ))
    }
    fn raw_fd(&self) -> RawFd {
        -1
    }
    fn set_timeouts(&self, _: Option<Duration>, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

pub(super) fn frame(op: u8, id: u64, payload: &[&[u8]]) -> Vec<u8> {
    let len = 1 + 8 + payload.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(op);
    out.extend_from_slice(&id.to_le_bytes());
    for p in payload {
        out.extend_from_slice(p);
    }
    out
}

/// Reads one frame: `(op, id, payload)`. `deadline` bounds the whole frame.
pub(super) fn read_frame(
    stream: &mut dyn Stream,
    deadline: Option<Instant>,
) -> io::Result<(u8, u64, Vec<u8>)> {
    let mut header = [0u8; 13];
    read_exact_by(stream, &mut header, deadline)?;
    let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    if !(9..=MAX_FRAME).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len}"),
        ));
    }
    let op = header[4];
    let id = u64::from_le_bytes(header[5..13].try_into().expect("8 bytes"));
    let mut payload = vec![0u8; len - 9];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((op, id, payload))
}

/// Reads frames from a stream that stays open (after HELLO): one `read`
/// takes whatever the peer has written, however many frames that is, so a
/// burst (a batch's descriptors, its receipts, their acks) costs one
/// syscall, not two per frame; and the reader can tell whether another frame
/// is already here, which is what lets the server answer a burst at once.
pub(super) struct FrameReader {
    buf: Vec<u8>,
    /// Unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// What one `read` asks for at least.
    chunk: usize,
    /// The longest frame taken (header included).
    max_frame: usize,
}

/// What one `read` asks for at least (a burst of frames, a descriptor or
/// receipt being a few hundred bytes).
const READ_CHUNK: usize = 64 << 10;

/// The longest handshake frame (HELLO, CHALLENGE, PROOF are under 80 bytes).
const HANDSHAKE_FRAME: usize = 128;

impl FrameReader {
    pub(super) fn new() -> FrameReader {
        FrameReader {
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            chunk: READ_CHUNK,
            max_frame: 4 + MAX_FRAME,
        }
    }

    /// A reader for a handshake's few small frames: what a stranger makes
    /// the server hold is this, not a link's buffer.
    pub(super) fn for_handshake() -> FrameReader {
        FrameReader {
            buf: vec![0; HANDSHAKE_FRAME],
            start: 0,
            end: 0,
            chunk: HANDSHAKE_FRAME,
            max_frame: HANDSHAKE_FRAME,
        }
    }

    /// Bytes read past the frames taken.
    pub(super) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The next frame, `(op, id, payload)`: a buffered one, else what the
    /// stream delivers next (blocking).
    pub(super) fn next(&mut self, stream: &mut dyn Stream) -> io::Result<(u8, u64, Vec<u8>)> {
        loop {
            if let Some(frame) = self.take()? {
                return Ok(frame);
            }
            let wanted = self
                .pending_len()?
                .map_or(self.chunk, |len| len.max(self.chunk));
            if self.buf.len() - self.start < wanted {
                // Move what is unread to the front, and grow for a frame
                // larger than the buffer (bounded by MAX_FRAME).
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                if self.buf.len() < wanted {
                    self.buf.resize(wanted, 0);
                }
            }
            match stream.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "control link closed",
                    ))
                }
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether a whole frame is buffered: `next` would return without
    /// reading.
    pub(super) fn has_frame(&self) -> bool {
        matches!(self.pending_len(), Ok(Some(len)) if self.end - self.start >= len)
    }

    /// The whole length (header included) of the frame that starts the
    /// unread bytes, once its length is here; an error for a length no
    /// frame has.
    fn pending_len(&self) -> io::Result<Option<usize>> {
        if self.end - self.start < 4 {
            return Ok(None);
        }
        let header = &self.buf[self.start..self.start + 4];
        let len = u32::from_le_bytes(header.try_into().expect("4 bytes")) as usize;
        if !(9..=self.max_frame - 4).contains(&len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame length {len}"),
            ));
        }
        Ok(Some(4 + len))
    }

    fn take(&mut self) -> io::Result<Option<(u8, u64, Vec<u8>)>> {
        let Some(len) = self.pending_len()? else {
            return Ok(None);
        };
        if self.end - self.start < len {
            return Ok(None);
        }
        let bytes = &self.buf[self.start..self.start + len];
        let op = bytes[4];
        let id = u64::from_le_bytes(bytes[5..13].try_into().expect("8 bytes"));
        let payload = bytes[13..].to_vec();
        self.start += len;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        Ok(Some((op, id, payload)))
    }
}

/// `read_exact`, with one deadline for all of it (a peer trickling a byte at
/// a time cannot extend it).
pub(super) fn read_exact_by(
    stream: &mut dyn Stream,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    while !buf.is_empty() {
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "control frame deadline",
                ));
            }
            stream.set_timeouts(Some(left), None)?;
        }
        match stream.read(buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "control link closed",
                ))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(super) fn split_key(payload: &[u8]) -> Option<(&str, &[u8])> {
    let len = u16::from_le_bytes(payload.get(0..2)?.try_into().ok()?) as usize;
    let key = std::str::from_utf8(payload.get(2..2 + len)?).ok()?;
    Some((key, &payload[2 + len..]))
}

pub(super) fn nack_payload(status: &Status) -> Vec<u8> {
    let mut out = (status.code as u32).to_le_bytes().to_vec();
    out.extend_from_slice(status.message.as_bytes());
    out
}
