//! The two active messages of the UCX transport (all integers
//! little-endian).
//!
//! DATA (AM id `AM_DATA`), sender to receiver; the payload is the bytes:
//! magic `"PXU1"`, flags u32 (0), auth token (32 bytes), offset u64, length
//! u64 (= the payload's length), request id u64, sender's process index u32,
//! reserved u32 (0). 72 bytes.
//!
//! ACK (AM id `AM_ACK`), receiver to sender, once the bytes are in the
//! destination or the request was refused: magic `"PXUA"`, code u32 (0 =
//! OK, else a `PJRT_Error_Code`), request id u64, the request's auth token
//! (32 bytes: the ACK is only believed by the sender that holds it, so a
//! stranger who can reach the UCX port cannot complete someone's send),
//! message length u32 (at most 4096); the UTF-8 message is the payload.
use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};

pub const AM_DATA: u32 = 1;
pub const AM_ACK: u32 = 2;

pub const DATA_MAGIC: [u8; 4] = *b"PXU1";
pub const ACK_MAGIC: [u8; 4] = *b"PXUA";
pub const DATA_HEADER_LEN: usize = 4 + 4 + AUTH_TOKEN_LEN + 8 + 8 + 8 + 4 + 4;
pub const ACK_HEADER_LEN: usize = 4 + 4 + 8 + AUTH_TOKEN_LEN + 4;
pub const MAX_ACK_MESSAGE_LEN: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataHeader {
    pub token: AuthToken,
    pub offset: u64,
    pub length: u64,
    pub request: u64,
    pub sender: u32,
}

impl DataHeader {
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut out = [0u8; DATA_HEADER_LEN];
        out[0..4].copy_from_slice(&DATA_MAGIC);
        out[8..40].copy_from_slice(self.token.as_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..56].copy_from_slice(&self.length.to_le_bytes());
        out[56..64].copy_from_slice(&self.request.to_le_bytes());
        out[64..68].copy_from_slice(&self.sender.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<DataHeader> {
        if bytes.len() != DATA_HEADER_LEN {
            return Err(status::invalid_argument(format!(
                "UCX transfer header is {} bytes, expected {DATA_HEADER_LEN}",
                bytes.len()
            )));
        }
        if bytes[0..4] != DATA_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost UCX transfer header (bad magic)",
            ));
        }
        if bytes[4..8] != [0; 4] || bytes[68..72] != [0; 4] {
            return Err(status::invalid_argument(
                "UCX transfer header has reserved bits set",
            ));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        Ok(DataHeader {
            token: AuthToken::from_bytes(bytes[8..40].try_into().expect("32 bytes")),
            offset: u64_at(40),
            length: u64_at(48),
            request: u64_at(56),
            sender: u32::from_le_bytes(bytes[64..68].try_into().expect("4")),
        })
    }
}

/// A receiver's verdict on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    pub request: u64,
    pub token: AuthToken,
    pub outcome: Result<()>,
}

impl Ack {
    /// The header and the payload (the message).
    pub fn encode(&self) -> ([u8; ACK_HEADER_LEN], Vec<u8>) {
        let (code, message) = match &self.outcome {
            Ok(()) => (0u32, String::new()),
            Err(e) => (e.code as u32, within_limit(&e.message).to_string()),
        };
        let mut header = [0u8; ACK_HEADER_LEN];
        header[0..4].copy_from_slice(&ACK_MAGIC);
        header[4..8].copy_from_slice(&code.to_le_bytes());
        header[8..16].copy_from_slice(&self.request.to_le_bytes());
        header[16..48].copy_from_slice(self.token.as_bytes());
        header[48..52].copy_from_slice(&(message.len() as u32).to_le_bytes());
        (header, message.into_bytes())
    }

    pub fn decode(header: &[u8], payload: &[u8]) -> Result<Ack> {
        if header.len() != ACK_HEADER_LEN || header[0..4] != ACK_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost UCX acknowledgement",
            ));
        }
        let code = u32::from_le_bytes(header[4..8].try_into().expect("4"));
        let request = u64::from_le_bytes(header[8..16].try_into().expect("8"));
        let token = AuthToken::from_bytes(header[16..48].try_into().expect("32 bytes"));
        let message_len = u32::from_le_bytes(header[48..52].try_into().expect("4")) as usize;
        if message_len > MAX_ACK_MESSAGE_LEN || message_len != payload.len() {
            return Err(status::invalid_argument(format!(
                "UCX acknowledgement message of {} bytes (header says {message_len}, limit \
                 {MAX_ACK_MESSAGE_LEN})",
                payload.len()
            )));
        }
        let outcome = match code {
            0 => Ok(()),
            code => {
                let code = i32::try_from(code)
                    .map(Code::from_raw)
                    .unwrap_or(Code::Unknown);
                Err(Status::new(
                    code,
                    within_limit(&String::from_utf8_lossy(payload)).to_string(),
                ))
            }
        };
        Ok(Ack {
            request,
            token,
            outcome,
        })
    }
}

fn within_limit(message: &str) -> &str {
    let mut end = message.len().min(MAX_ACK_MESSAGE_LEN);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_headers_round_trip_and_foreign_bytes_are_refused() {
        let header = DataHeader {
            token: AuthToken::from_bytes([7; AUTH_TOKEN_LEN]),
            offset: 1 << 33,
            length: 4096,
            request: 42,
            sender: 3,
        };
        let bytes = header.encode();
        assert_eq!(DataHeader::decode(&bytes).unwrap(), header);
        assert!(DataHeader::decode(&bytes[..71]).is_err());
        let mut reserved = bytes;
        reserved[70] = 1;
        assert_eq!(
            DataHeader::decode(&reserved).unwrap_err().code,
            Code::InvalidArgument
        );
        let mut magic = bytes;
        magic[0] = b'G';
        assert!(DataHeader::decode(&magic).is_err());
    }

    #[test]
    fn acks_carry_the_verdict_and_bound_the_message() {
        let token = AuthToken::from_bytes([9; AUTH_TOKEN_LEN]);
        let ok = Ack {
            request: 5,
            token,
            outcome: Ok(()),
        };
        let (header, payload) = ok.encode();
        assert_eq!(Ack::decode(&header, &payload).unwrap(), ok);
        let refused = Ack {
            request: 6,
            token,
            outcome: Err(status::unauthenticated("é".repeat(3000))),
        };
        let (header, payload) = refused.encode();
        let back = Ack::decode(&header, &payload).unwrap();
        let error = back.outcome.unwrap_err();
        assert_eq!(error.code, Code::Unauthenticated);
        assert!(error.message.len() <= MAX_ACK_MESSAGE_LEN);
        assert!(Ack::decode(&header, &payload[1..]).is_err());
        assert!(Ack::decode(&header[1..], &payload).is_err());
    }
}
