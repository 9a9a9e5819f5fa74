//! Entry points for the cargo-fuzz targets (fuzz/, which enables the
//! `fuzzing` feature); not part of the API and not in the plugin's build.
use std::io;
use std::time::{Duration, Instant};

use super::frame::*;

/// `read_frame` over `bytes`, delivered at most `max_read` bytes per read;
/// with `with_deadline`, under a deadline an hour away (the HELLO path).
#[doc(hidden)]
pub fn decode_frame_for_fuzzing(
    bytes: &[u8],
    max_read: usize,
    with_deadline: bool,
) -> io::Result<(u8, u64, Vec<u8>)> {
    let mut stream = SliceStream::new(bytes, max_read);
    let deadline = with_deadline.then(|| Instant::now() + Duration::from_secs(3600));
    read_frame(&mut stream, deadline)
}

/// Every frame `FrameReader` gets from `bytes` (delivered at most
/// `max_read` bytes per read), and the error that ended them.
#[doc(hidden)]
pub fn decode_frames_for_fuzzing(
    bytes: &[u8],
    max_read: usize,
) -> (Vec<(u8, u64, Vec<u8>)>, io::Error) {
    let mut stream = SliceStream::new(bytes, max_read);
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    loop {
        match reader.next(&mut stream) {
            Ok(frame) => frames.push(frame),
            Err(e) => return (frames, e),
        }
    }
}

/// `frame` with one payload part.
#[doc(hidden)]
pub fn encode_frame_for_fuzzing(op: u8, id: u64, payload: &[u8]) -> Vec<u8> {
    frame(op, id, &[payload])
}

/// `split_key`: a SET/DELETE payload's key and value.
#[doc(hidden)]
pub fn split_key_for_fuzzing(payload: &[u8]) -> Option<(&str, &[u8])> {
    split_key(payload)
}
