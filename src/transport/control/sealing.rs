//! Control links sealed with the job's control secret: the handshake proves
//! that each end knows the secret without either sending it, and every frame
//! after it is encrypted and authenticated, so an observer on the wire reads
//! no descriptor, token, nonce or receipt, and cannot write, replay, drop
//! or reorder a frame without the link breaking.
//!
//! Handshake (plain frames, `frame.rs`): the client sends HELLO with a fresh
//! 32-byte nonce and its process index; the server answers CHALLENGE with a
//! nonce of its own and its proof; the client checks that proof and sends
//! its own (PROOF); the server checks it and answers ACK. Proofs and keys all
//! come from HKDF-SHA256 over the control secret, salted with both nonces,
//! with the process index in every label: a recorded handshake proves
//! nothing in a later one, and a proof for one process is no proof for
//! another.
//!
//! After ACK each direction has its own ChaCha20-Poly1305 key and a frame
//! counter as its nonce. A sealed frame is `u32 length` then the ciphertext
//! of one plain frame (its length included) with its 16-byte tag.
//!
//! The control secret is made by the session's first process and travels in
//! the session's epoch record through the job's store: sealed there with
//! `job_secret_file` (`kv/sealed.rs`), in clear without it, where whoever
//! can read the store can also open the links.
use std::io::{self, Read, Write};
use std::time::Duration;

use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};

use super::frame::{Stream, MAX_FRAME};
use super::secret::Secret;

pub(super) const NONCE_LEN: usize = 32;
pub(super) const PROOF_LEN: usize = 32;
const TAG_LEN: usize = 16;
/// The largest sealed frame: a plain frame of `MAX_FRAME`, its length and tag.
const MAX_SEALED: usize = 4 + MAX_FRAME + TAG_LEN;
const LABEL: &[u8] = b"pjrt-crosshost control link v1";

/// What one handshake derives from the secret, both nonces and the process
/// index of the client.
pub(super) struct LinkKeys {
    pub server_proof: [u8; PROOF_LEN],
    pub client_proof: [u8; PROOF_LEN],
    client_to_server: [u8; 32],
    server_to_client: [u8; 32],
}

impl LinkKeys {
    pub fn derive(
        secret: &Secret,
        client_nonce: &[u8; NONCE_LEN],
        server_nonce: &[u8; NONCE_LEN],
        client_process: u32,
    ) -> LinkKeys {
        let mut salt = Vec::with_capacity(2 * NONCE_LEN);
        salt.extend_from_slice(client_nonce);
        salt.extend_from_slice(server_nonce);
        let hkdf = hkdf::Hkdf::<sha2::Sha256>::new(Some(&salt), &secret.0);
        let expand = |what: &[u8]| {
            let mut info = LABEL.to_vec();
            info.push(0);
            info.extend_from_slice(what);
            info.extend_from_slice(&client_process.to_le_bytes());
            let mut out = [0u8; 32];
            hkdf.expand(&info, &mut out)
                .expect("32 bytes is a valid HKDF-SHA256 length");
            out
        };
        LinkKeys {
            server_proof: expand(b"server proof"),
            client_proof: expand(b"client proof"),
            client_to_server: expand(b"client to server"),
            server_to_client: expand(b"server to client"),
        }
    }

    /// The client's end: it seals with the client's key, opens the server's.
    pub fn client_stream(&self, inner: Box<dyn Stream>) -> SealedStream {
        SealedStream::new(inner, &self.client_to_server, &self.server_to_client)
    }

    /// The server's end.
    pub fn server_stream(&self, inner: Box<dyn Stream>) -> SealedStream {
        SealedStream::new(inner, &self.server_to_client, &self.client_to_server)
    }
}

/// Constant-time comparison of a proof.
pub(super) fn proof_matches(expected: &[u8; PROOF_LEN], got: &[u8]) -> bool {
    got.len() == PROOF_LEN
        && expected
            .iter()
            .zip(got)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// One direction's cipher and the count of frames it has done.
struct Direction {
    cipher: ChaCha20Poly1305,
    frames: u64,
}

impl Direction {
    fn new(key: &[u8; 32]) -> Direction {
        Direction {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
            frames: 0,
        }
    }

    /// The next frame's nonce: its number in this direction.
    fn next_nonce(&mut self) -> io::Result<[u8; 12]> {
        let mut nonce = [0u8; 12];
        nonce[..8].copy_from_slice(&self.frames.to_le_bytes());
        self.frames = self.frames.checked_add(1).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "control link: frame counter spent",
            )
        })?;
        Ok(nonce)
    }
}

/// A stream whose plain frames travel sealed. Writes take whole plain frames
/// (as `frame()` makes them, any number at once); reads give back plain
/// frames, as many as arrived whole.
pub(super) struct SealedStream {
    inner: Box<dyn Stream>,
    send: Direction,
    receive: Direction,
    /// Sealed bytes read and not yet opened.
    sealed: Vec<u8>,
    /// Opened bytes not yet read, from `opened_at`.
    opened: Vec<u8>,
    opened_at: usize,
}

impl SealedStream {
    fn new(inner: Box<dyn Stream>, send: &[u8; 32], receive: &[u8; 32]) -> SealedStream {
        SealedStream {
            inner,
            send: Direction::new(send),
            receive: Direction::new(receive),
            sealed: Vec::new(),
            opened: Vec::new(),
            opened_at: 0,
        }
    }

    /// Opens every whole sealed frame buffered; true if any was.
    fn open_buffered(&mut self) -> io::Result<bool> {
        let mut at = 0;
        let mut any = false;
        while self.sealed.len() - at >= 4 {
            let len =
                u32::from_le_bytes(self.sealed[at..at + 4].try_into().expect("4 bytes")) as usize;
            if !(TAG_LEN + 13..=MAX_SEALED).contains(&len) {
                return Err(forged(format!("a sealed frame of {len} bytes")));
            }
            if self.sealed.len() - at - 4 < len {
                break;
            }
            let nonce = self.receive.next_nonce()?;
            let plain = self
                .receive
                .cipher
                .decrypt(
                    Nonce::from_slice(&nonce),
                    &self.sealed[at + 4..at + 4 + len],
                )
                .map_err(|_| forged("a frame that does not open with this link's key".into()))?;
            self.opened.extend_from_slice(&plain);
            at += 4 + len;
            any = true;
        }
        self.sealed.drain(..at);
        Ok(any)
    }
}

fn forged(what: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("control link: {what} (altered, replayed or not from the job's peer)"),
    )
}

impl Read for SealedStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.opened_at == self.opened.len() {
            self.opened.clear();
            self.opened_at = 0;
            if self.open_buffered()? {
                break;
            }
            let mut chunk = [0u8; 64 << 10];
            let n = self.inner.read(&mut chunk)?;
            if n == 0 {
                return Ok(0);
            }
            self.sealed.extend_from_slice(&chunk[..n]);
        }
        let n = buf.len().min(self.opened.len() - self.opened_at);
        buf[..n].copy_from_slice(&self.opened[self.opened_at..self.opened_at + n]);
        self.opened_at += n;
        Ok(n)
    }
}

impl Write for SealedStream {
    /// `buf` must hold whole plain frames; all of it is taken.
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let mut out = Vec::with_capacity(buf.len() + 32);
        let mut rest = buf;
        while !rest.is_empty() {
            let len = rest
                .get(0..4)
                .map(|l| u32::from_le_bytes(l.try_into().expect("4 bytes")) as usize)
                .filter(|len| 4 + len <= rest.len())
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "not a whole control frame")
                })?;
            let nonce = self.send.next_nonce()?;
            let sealed = self
                .send
                .cipher
                .encrypt(Nonce::from_slice(&nonce), &rest[..4 + len])
                .map_err(|_| io::Error::other("control link: sealing failed"))?;
            out.extend_from_slice(&(sealed.len() as u32).to_le_bytes());
            out.extend_from_slice(&sealed);
            rest = &rest[4 + len..];
        }
        self.inner.write_all(&out)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Stream for SealedStream {
    fn shutdown_both(&self) {
        self.inner.shutdown_both();
    }

    /// A sealed stream's counters cannot be shared: each end makes its
    /// reading and its writing half from clones of the plain stream.
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a sealed control stream is not cloned",
        ))
    }

    fn raw_fd(&self) -> std::os::fd::RawFd {
        self.inner.raw_fd()
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.inner.set_timeouts(read, write)
    }
}
