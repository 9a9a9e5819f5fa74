//! The TCP transfer protocol's framing (all integers little-endian).
//!
//! Request header, 92 bytes: magic `"PXHT"`, version u16, flags u16 (0),
//! auth token (32 bytes), offset u64, length u64, receipt length u8 (at most
//! `MAX_RECEIPT_LEN`), three zero bytes, then a 32-byte receipt area (that
//! many bytes of receipt, zeros after); the payload follows. A receipt is
//! the value of the buffer's completion key: a receiver that holds that key
//! (and registered it with the destination) sets it once the bytes are in,
//! so the receiver's wait ends without a second trip through the sender.
//!
//! Response: magic `"PXHA"`, code u32 (0 = OK, else a `PJRT_Error_Code`),
//! flags u32 (bit 0, only with OK: the receipt was applied), message length
//! u32 (at most 4096), UTF-8 message.
//!
//! After an OK answer the connection may carry the sender's next request;
//! after a refusal the receiver closes it.
use std::io::Read;

use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};

pub const REQUEST_MAGIC: [u8; 4] = *b"PXHT";
pub const RESPONSE_MAGIC: [u8; 4] = *b"PXHA";
pub const PROTOCOL_VERSION: u16 = 2;
/// The longest receipt a request carries (`xr1 ok <nonce>` is at most 23).
pub const MAX_RECEIPT_LEN: usize = 32;
const RECEIPT_AT: usize = 4 + 2 + 2 + AUTH_TOKEN_LEN + 8 + 8 + 4;
pub const REQUEST_HEADER_LEN: usize = RECEIPT_AT + MAX_RECEIPT_LEN;
pub const MAX_RESPONSE_MESSAGE_LEN: usize = 4096;
/// Payloads up to this size go out in the same write as their header, and
/// the receiver's front door lands them itself.
pub const COALESCED_PAYLOAD_BYTES: usize = 64 << 10;
const RESPONSE_FIXED_LEN: usize = 4 + 4 + 4 + 4;
const RESPONSE_RECEIPT_APPLIED: u32 = 1;

#[derive(Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub token: AuthToken,
    pub offset: u64,
    pub length: u64,
    /// Empty, or the completion key's value to set once the bytes are in.
    pub receipt: Vec<u8>,
}

impl RequestHeader {
    /// Panics if the receipt is longer than `MAX_RECEIPT_LEN` (the sender
    /// checks before it builds one).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        assert!(self.receipt.len() <= MAX_RECEIPT_LEN, "receipt too long");
        let mut out = [0u8; REQUEST_HEADER_LEN];
        out[0..4].copy_from_slice(&REQUEST_MAGIC);
        out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out[6..8].copy_from_slice(&0u16.to_le_bytes());
        out[8..40].copy_from_slice(self.token.as_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..56].copy_from_slice(&self.length.to_le_bytes());
        out[56] = self.receipt.len() as u8;
        out[RECEIPT_AT..RECEIPT_AT + self.receipt.len()].copy_from_slice(&self.receipt);
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
        let receipt_len = bytes[56] as usize;
        if receipt_len > MAX_RECEIPT_LEN {
            return Err(status::invalid_argument(format!(
                "TCP transfer request carries a {receipt_len}-byte receipt (limit {MAX_RECEIPT_LEN})"
            )));
        }
        let padding_is_zero = bytes[57..RECEIPT_AT]
            .iter()
            .chain(&bytes[RECEIPT_AT + receipt_len..])
            .all(|&byte| byte == 0);
        if !padding_is_zero {
            return Err(status::invalid_argument(
                "TCP transfer request has reserved header bytes set",
            ));
        }
        Ok(RequestHeader {
            token: AuthToken::from_bytes(bytes[8..40].try_into().expect("32 bytes")),
            offset: u64::from_le_bytes(bytes[40..48].try_into().expect("8 bytes")),
            length: u64::from_le_bytes(bytes[48..56].try_into().expect("8 bytes")),
            receipt: bytes[RECEIPT_AT..RECEIPT_AT + receipt_len].to_vec(),
        })
    }
}

/// The receiver's answer to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub outcome: Result<()>,
    /// The request's receipt set the completion key (only with `Ok`).
    pub receipt_applied: bool,
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

pub fn encode_response(response: &Response) -> Vec<u8> {
    let (code, message) = match &response.outcome {
        Ok(()) => (0u32, ""),
        Err(error) => (error.code as u32, error.message.as_str()),
    };
    let flags = if response.receipt_applied && response.outcome.is_ok() {
        RESPONSE_RECEIPT_APPLIED
    } else {
        0
    };
    let message = within_message_limit(message).as_bytes();
    let mut out = Vec::with_capacity(RESPONSE_FIXED_LEN + message.len());
    out.extend_from_slice(&RESPONSE_MAGIC);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(message.len() as u32).to_le_bytes());
    out.extend_from_slice(message);
    out
}

/// A refusal, which never comes with an applied receipt.
pub fn encode_refusal(status: Status) -> Vec<u8> {
    encode_response(&Response {
        outcome: Err(status),
        receipt_applied: false,
    })
}

/// Reads one response. The outer `Result` is the I/O (`std::io::Error`) or a
/// protocol violation (`Status`); the inner one is the receiver's answer.
pub fn read_response(
    reader: &mut impl Read,
) -> std::io::Result<std::result::Result<Response, Status>> {
    let mut fixed = [0u8; RESPONSE_FIXED_LEN];
    reader.read_exact(&mut fixed)?;
    if fixed[0..4] != RESPONSE_MAGIC {
        return Ok(Err(status::data_loss(
            "TCP transfer receiver answered with a malformed acknowledgement (bad magic)",
        )));
    }
    let code = u32::from_le_bytes(fixed[4..8].try_into().expect("4 bytes"));
    let flags = u32::from_le_bytes(fixed[8..12].try_into().expect("4 bytes"));
    let message_len = u32::from_le_bytes(fixed[12..16].try_into().expect("4 bytes")) as usize;
    if message_len > MAX_RESPONSE_MESSAGE_LEN {
        return Ok(Err(status::data_loss(format!(
            "TCP transfer receiver's acknowledgement claims a {message_len}-byte message (limit {MAX_RESPONSE_MESSAGE_LEN})"
        ))));
    }
    let known = if code == 0 {
        RESPONSE_RECEIPT_APPLIED
    } else {
        0
    };
    if flags & !known != 0 {
        return Ok(Err(status::data_loss(format!(
            "TCP transfer receiver's acknowledgement has flags {flags:#x} with code {code}"
        ))));
    }
    let mut message = vec![0u8; message_len];
    reader.read_exact(&mut message)?;
    // Each invalid byte becomes a 3-byte U+FFFD: cut back to the limit.
    let message = within_message_limit(&String::from_utf8_lossy(&message)).to_string();
    if code == 0 {
        return Ok(Ok(Response {
            outcome: Ok(()),
            receipt_applied: flags & RESPONSE_RECEIPT_APPLIED != 0,
        }));
    }
    let code = i32::try_from(code)
        .map(Code::from_raw)
        .unwrap_or(Code::Unknown);
    Ok(Ok(Response {
        outcome: Err(Status::new(code, message)),
        receipt_applied: false,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(receipt_applied: bool) -> Response {
        Response {
            outcome: Ok(()),
            receipt_applied,
        }
    }

    #[test]
    fn header_round_trips_and_rejects_foreign_bytes() {
        for receipt in [
            Vec::new(),
            b"xr1 ok 5".to_vec(),
            vec![b'r'; MAX_RECEIPT_LEN],
        ] {
            let header = RequestHeader {
                token: AuthToken::from_bytes([5; AUTH_TOKEN_LEN]),
                offset: 17,
                length: 1 << 40,
                receipt,
            };
            let bytes = header.encode();
            assert_eq!(RequestHeader::decode(&bytes).unwrap(), header);
        }
        let bytes = RequestHeader {
            token: AuthToken::from_bytes([5; AUTH_TOKEN_LEN]),
            offset: 17,
            length: 1 << 40,
            receipt: b"xr1 ok 5".to_vec(),
        }
        .encode();
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
        let mut too_long = bytes;
        too_long[56] = MAX_RECEIPT_LEN as u8 + 1;
        assert!(RequestHeader::decode(&too_long)
            .unwrap_err()
            .message
            .contains("33-byte receipt"));
        // Bytes past the receipt, or in the reserved gap, make it another
        // header: refused rather than read two ways.
        for reserved in [57, RECEIPT_AT + 8, REQUEST_HEADER_LEN - 1] {
            let mut dirty = bytes;
            dirty[reserved] = 1;
            assert!(
                RequestHeader::decode(&dirty)
                    .unwrap_err()
                    .message
                    .contains("reserved header bytes"),
                "byte {reserved}"
            );
        }
    }

    #[test]
    fn responses_round_trip_and_long_messages_are_cut_on_a_char_boundary() {
        for response in [ok(false), ok(true)] {
            let bytes = encode_response(&response);
            assert_eq!(read_response(&mut &bytes[..]).unwrap().unwrap(), response);
        }
        let error = status::unauthenticated("nope");
        let bytes = encode_refusal(error.clone());
        let refused = read_response(&mut &bytes[..]).unwrap().unwrap();
        assert_eq!(refused.outcome, Err(error.clone()));
        assert!(!refused.receipt_applied);
        // A refusal never says a receipt was applied, even if asked to.
        let bytes = encode_response(&Response {
            outcome: Err(error),
            receipt_applied: true,
        });
        assert!(
            !read_response(&mut &bytes[..])
                .unwrap()
                .unwrap()
                .receipt_applied
        );
        let long = status::internal("é".repeat(3000));
        let bytes = encode_refusal(long);
        let verdict = read_response(&mut &bytes[..])
            .unwrap()
            .unwrap()
            .outcome
            .unwrap_err();
        assert!(verdict.message.len() <= MAX_RESPONSE_MESSAGE_LEN);
        assert!(verdict.message.chars().all(|c| c == 'é'));
        let truncated = &bytes[..5];
        assert!(read_response(&mut &truncated[..]).is_err());
    }

    #[test]
    fn unknown_response_flags_are_a_protocol_violation() {
        let mut bytes = encode_response(&ok(true));
        bytes[8] |= 2;
        let violation = read_response(&mut &bytes[..]).unwrap().unwrap_err();
        assert_eq!(violation.code, Code::DataLoss);
        // "Receipt applied" on a refusal is a lie, not a detail.
        let mut bytes = encode_refusal(status::internal("no"));
        bytes[8] = 1;
        let violation = read_response(&mut &bytes[..]).unwrap().unwrap_err();
        assert_eq!(violation.code, Code::DataLoss);
    }
}
