//! The TCP transfer protocol's framing (all integers little-endian).
//!
//! Request header, 56 bytes: magic `"PXHT"`, version u16, flags u16 (0),
//! auth token (32 bytes), offset u64, length u64; the payload follows.
//!
//! Response: magic `"PXHA"`, code u32 (0 = OK, else a `PJRT_Error_Code`),
//! message length u32 (at most 4096), UTF-8 message.
use std::io::Read;

use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};

pub const REQUEST_MAGIC: [u8; 4] = *b"PXHT";
pub const RESPONSE_MAGIC: [u8; 4] = *b"PXHA";
pub const PROTOCOL_VERSION: u16 = 1;
pub const REQUEST_HEADER_LEN: usize = 4 + 2 + 2 + AUTH_TOKEN_LEN + 8 + 8;
pub const MAX_RESPONSE_MESSAGE_LEN: usize = 4096;
const RESPONSE_FIXED_LEN: usize = 4 + 4 + 4;

#[derive(Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub token: AuthToken,
    pub offset: u64,
    pub length: u64,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut out = [0u8; REQUEST_HEADER_LEN];
        out[0..4].copy_from_slice(&REQUEST_MAGIC);
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&0u16.to_le_bytes());
        out[8..40].copy_from_slice(self.token.as_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..56].copy_from_slice(&self.length.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8; REQUEST_HEADER_LEN]) -> Result<RequestHeader> {
        if bytes[0..4] != REQUEST_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost TCP transfer request (bad magic)",
            ));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(status::invalid_argument(format!(
                "unsupported TCP transfer protocol version {version}; this receiver speaks {PROTOCOL_VERSION}"
            )));
        }
        let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
        if flags != 0 {
            return Err(status::invalid_argument(format!(
                "TCP transfer request has reserved flags {flags:#06x} set"
            )));
        }
        Ok(RequestHeader {
            token: AuthToken::from_bytes(bytes[8..40].try_into().expect("32 bytes")),
            offset: u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes")),
            length: u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes")),
        })
    }
}

/// The longest prefix of `message` within the wire's limit that ends on a
/// character boundary.
fn within_message_limit(message: &str) -> &str {
    let mut end = message.len().min(MAX_RESPONSE_MESSAGE_LEN);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

pub fn encode_response(outcome: &Result<()>) -> Vec<u8> {
    let (code, message) = match outcome {
        Ok(()) => (0u32, ""),
        Err(error) => (error.code as u32, error.message.as_str()),
    };
    let message = within_message_limit(message).as_bytes();
    let mut out = Vec::with_capacity(RESPONSE_FIXED_LEN + message.len());
    out.extend_from_slice(&RESPONSE_MAGIC);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&(message.len() as u32).to_le_bytes());
    out.extend_from_slice(message);
    out
}

/// Reads one response. The outer `Result` is the I/O (`std::io::Error`) or a
/// protocol violation (`Status`); the inner one is the receiver's verdict.
pub fn read_response(
    reader: &mut impl Read,
) -> std::io::Result<std::result::Result<Result<()>, Status>> {
    let mut fixed = [0u8; RESPONSE_FIXED_LEN];
    reader.read_exact(&mut fixed)?;
    if fixed[0..4] != RESPONSE_MAGIC {
        return Ok(Err(status::data_loss(
            "TCP transfer receiver answered with a malformed acknowledgement (bad magic)",
        )));
    }
    let code = u32::from_le_bytes(fixed[4..8].try_into().expect("4 bytes"));
    let message_len = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes")) as usize;
    if message_len > MAX_RESPONSE_MESSAGE_LEN {
        return Ok(Err(status::data_loss(format!(
            "TCP transfer receiver's acknowledgement claims a {message_len}-byte message (limit {MAX_RESPONSE_MESSAGE_LEN})"
        ))));
    }
    let mut message = vec![0u8; message_len];
    reader.read_exact(&mut message)?;
    // Each invalid byte becomes a 3-byte U+FFFD: cut back to the limit.
    let message = within_message_limit(&String::from_utf8_lossy(&message)).to_string();
    if code == 0 {
        return Ok(Ok(Ok(())));
    }
    let code = i32::try_from(code)
        .map(Code::from_raw)
        .unwrap_or(Code::Unknown);
    Ok(Ok(Err(Status::new(code, message))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_foreign_bytes() {
        let header = RequestHeader {
            token: AuthToken::from_bytes([5; AUTH_TOKEN_LEN]),
            offset: 17,
            length: 1 << 40,
        };
        let bytes = header.encode();
        assert_eq!(RequestHeader::decode(&bytes).unwrap(), header);
        let mut wrong_version = bytes;
        wrong_version[4] = 9;
        assert!(RequestHeader::decode(&wrong_version)
            .unwrap_err()
            .message
            .contains("version 9"));
        let mut http = bytes;
        http[0..4].copy_from_slice(b"GET ");
        assert_eq!(
            RequestHeader::decode(&http).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn responses_round_trip_and_long_messages_are_cut_on_a_char_boundary() {
        let ok = encode_response(&Ok(()));
        assert_eq!(read_response(&mut &ok[..]).unwrap().unwrap(), Ok(()));
        let error = status::unauthenticated("nope");
        let bytes = encode_response(&Err(error.clone()));
        assert_eq!(read_response(&mut &bytes[..]).unwrap().unwrap(), Err(error));
        let long = status::internal("é".repeat(3000));
        let bytes = encode_response(&Err(long));
        let verdict = read_response(&mut &bytes[..])
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert!(verdict.message.len() <= MAX_RESPONSE_MESSAGE_LEN);
        assert!(verdict.message.chars().all(|c| c == 'é'));
        let truncated = &bytes[..5];
        assert!(read_response(&mut &truncated[..]).is_err());
    }
}
