//! The active messages of the UCX transport (all integers little-endian).
//!
//! DATA (AM id `AM_DATA`), sender to receiver; the payload is the bytes:
//! magic `"PXU1"`, part u16 and parts u16 (a large buffer is striped over
//! several connections, one part each; 0 of 1 otherwise), auth token (32
//! bytes), offset u64 (of this part in the destination), length u64 (= the
//! payload's length), request id u64, sender's process index u32, index of
//! the sender's worker u16 (the ACK goes back to it), receipt length u16;
//! then that many bytes of receipt (at most `MAX_RECEIPT_LEN`): the value
//! the sender sets the completion key to, carried with the bytes when the
//! receiver holds the key itself (applied once every byte is in, before the
//! ACK). 72 bytes plus the receipt.
//!
//! ACK (AM id `AM_ACK`), receiver to sender, once the bytes are in the
//! destination or the request was refused: magic `"PXUA"`, code u32 (0 =
//! OK, else a `PJRT_Error_Code`), flags u32 (bit 0: the receipt the DATA
//! carried was applied), request id u64, the request's auth token (32
//! bytes: the ACK is only believed by the sender that holds it, so a
//! stranger who can reach the UCX port cannot complete someone's send),
//! message length u32 (at most 4096); the UTF-8 message is the payload.
//!
//! CHUNK (AM id `AM_CHUNK`), sender to receiver, one of the messages of a
//! chunked send (`stream.rs`): the bytes of the range `stream length` bytes
//! from `stream offset` of a destination, each message `length` bytes at
//! `offset` inside that range, the payload. Used where the receiver lands
//! the bytes through its staging ring (the descriptor names the largest
//! chunk it takes) and where the sender stages its own. Magic `"PXUC"`, auth
//! token (32 bytes), stream offset u64, stream length u64, offset u64,
//! length u64, request id u64 (this message's at its sending worker: a
//! refusal of it goes back there), stream request id u64 (the one ACK of the
//! whole stream answers it, sent to the home worker), sender's process
//! index u32, sending worker u16, home worker u16, receipt length u16, then
//! the receipt (as in DATA). 94 bytes plus the receipt.
//!
//! CLOSE (AM id `AM_CLOSE`), either way, the handshake that closes an idle
//! pair of endpoints (`worker.rs`): magic `"PXUX"`, kind u32 (1 = ask,
//! 2 = agree, 3 = decline), sender's process index u32, sender's worker
//! u16, two zero bytes, handshake number u64 (an answer names the ask's).
//! 24 bytes, no payload. Sent with UCX's reply flag: an ask is believed only
//! over the connection it names, and answered over it.
use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};

pub const AM_DATA: u32 = 1;
pub const AM_ACK: u32 = 2;
pub const AM_CHUNK: u32 = 3;
pub const AM_CLOSE: u32 = 4;

pub const DATA_MAGIC: [u8; 4] = *b"PXU1";
pub const ACK_MAGIC: [u8; 4] = *b"PXUA";
pub const CHUNK_MAGIC: [u8; 4] = *b"PXUC";
pub const CLOSE_MAGIC: [u8; 4] = *b"PXUX";
pub const CLOSE_LEN: usize = 4 + 4 + 4 + 2 + 2 + 8;
pub const CHUNK_HEADER_LEN: usize = 4 + AUTH_TOKEN_LEN + 8 * 6 + 4 + 2 + 2 + 2;
pub const DATA_HEADER_LEN: usize = 4 + 4 + AUTH_TOKEN_LEN + 8 + 8 + 8 + 4 + 4;
/// The longest receipt a DATA header may carry.
pub const MAX_RECEIPT_LEN: usize = 1024;
pub const ACK_HEADER_LEN: usize = 4 + 4 + 4 + 8 + AUTH_TOKEN_LEN + 4;
const ACK_RECEIPT_APPLIED: u32 = 1;
pub const MAX_ACK_MESSAGE_LEN: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataHeader {
    pub part: u16,
    pub parts: u16,
    pub token: AuthToken,
    pub offset: u64,
    pub length: u64,
    pub request: u64,
    pub sender: u32,
    pub sender_worker: u16,
    /// Empty, or the receipt to apply once the bytes are in.
    pub receipt: Vec<u8>,
}

impl DataHeader {
    /// Panics if the receipt is longer than `MAX_RECEIPT_LEN` (ours never is).
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.receipt.len() <= MAX_RECEIPT_LEN, "receipt too long");
        let mut out = vec![0u8; DATA_HEADER_LEN];
        out[0..4].copy_from_slice(&DATA_MAGIC);
        out[4..6].copy_from_slice(&self.part.to_le_bytes());
        out[6..8].copy_from_slice(&self.parts.to_le_bytes());
        out[8..40].copy_from_slice(self.token.as_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..56].copy_from_slice(&self.length.to_le_bytes());
        out[56..64].copy_from_slice(&self.request.to_le_bytes());
        out[64..68].copy_from_slice(&self.sender.to_le_bytes());
        out[68..70].copy_from_slice(&self.sender_worker.to_le_bytes());
        out[70..72].copy_from_slice(&(self.receipt.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.receipt);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<DataHeader> {
        let receipt_len = bytes
            .get(70..72)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
        if receipt_len > MAX_RECEIPT_LEN || bytes.len() != DATA_HEADER_LEN + receipt_len {
            return Err(status::invalid_argument(format!(
                "UCX transfer header is {} bytes, expected {DATA_HEADER_LEN} and a receipt of at most \
                 {MAX_RECEIPT_LEN}",
                bytes.len()
            )));
        }
        if bytes[0..4] != DATA_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost UCX transfer header (bad magic)",
            ));
        }
        let part = u16::from_le_bytes([bytes[4], bytes[5]]);
        let parts = u16::from_le_bytes([bytes[6], bytes[7]]);
        if part >= parts {
            return Err(status::invalid_argument(format!(
                "UCX transfer header names part {part} of {parts}"
            )));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        Ok(DataHeader {
            part,
            parts,
            token: AuthToken::from_bytes(bytes[8..40].try_into().expect("32 bytes")),
            offset: u64_at(40),
            length: u64_at(48),
            request: u64_at(56),
            sender: u32::from_le_bytes(bytes[64..68].try_into().expect("4")),
            sender_worker: u16::from_le_bytes([bytes[68], bytes[69]]),
            receipt: bytes[DATA_HEADER_LEN..].to_vec(),
        })
    }
}

/// The header of one CHUNK message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub token: AuthToken,
    /// The destination range the whole stream writes.
    pub stream_offset: u64,
    pub stream_length: u64,
    /// This message's bytes: where they go in the destination, how many.
    pub offset: u64,
    pub length: u64,
    /// This message's request id at its sending worker.
    pub request: u64,
    /// The stream's request id at its home worker (the final ACK's).
    pub stream_request: u64,
    pub sender: u32,
    pub sender_worker: u16,
    pub home_worker: u16,
    /// Empty, or the receipt to apply once the whole stream landed.
    pub receipt: Vec<u8>,
}

impl ChunkHeader {
    /// Panics if the receipt is longer than `MAX_RECEIPT_LEN` (ours never is).
    pub fn encode(&self) -> Vec<u8> {
        assert!(self.receipt.len() <= MAX_RECEIPT_LEN, "receipt too long");
        let mut out = Vec::with_capacity(CHUNK_HEADER_LEN + self.receipt.len());
        out.extend_from_slice(&CHUNK_MAGIC);
        out.extend_from_slice(self.token.as_bytes());
        for value in [
            self.stream_offset,
            self.stream_length,
            self.offset,
            self.length,
            self.request,
            self.stream_request,
        ] {
            out.extend_from_slice(&value.to_le_bytes());
        }
        out.extend_from_slice(&self.sender.to_le_bytes());
        out.extend_from_slice(&self.sender_worker.to_le_bytes());
        out.extend_from_slice(&self.home_worker.to_le_bytes());
        out.extend_from_slice(&(self.receipt.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.receipt);
        out
    }

    /// Decodes and checks a header: its own length, and that the message
    /// lies inside the stream's range (which must not overflow).
    pub fn decode(bytes: &[u8]) -> Result<ChunkHeader> {
        let at = CHUNK_HEADER_LEN - 2;
        let receipt_len = bytes
            .get(at..at + 2)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]) as usize);
        if receipt_len > MAX_RECEIPT_LEN || bytes.len() != CHUNK_HEADER_LEN + receipt_len {
            return Err(status::invalid_argument(format!(
                "UCX chunk header is {} bytes, expected {CHUNK_HEADER_LEN} and a receipt of at \
                 most {MAX_RECEIPT_LEN}",
                bytes.len()
            )));
        }
        if bytes[0..4] != CHUNK_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost UCX chunk header (bad magic)",
            ));
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let fields = 4 + AUTH_TOKEN_LEN;
        let header = ChunkHeader {
            token: AuthToken::from_bytes(bytes[4..fields].try_into().expect("32 bytes")),
            stream_offset: u64_at(fields),
            stream_length: u64_at(fields + 8),
            offset: u64_at(fields + 16),
            length: u64_at(fields + 24),
            request: u64_at(fields + 32),
            stream_request: u64_at(fields + 40),
            sender: u32::from_le_bytes(bytes[fields + 48..fields + 52].try_into().expect("4")),
            sender_worker: u16_at(fields + 52),
            home_worker: u16_at(fields + 54),
            receipt: bytes[CHUNK_HEADER_LEN..].to_vec(),
        };
        let stream_end = header.stream_offset.checked_add(header.stream_length);
        let end = header.offset.checked_add(header.length);
        match (stream_end, end) {
            (Some(stream_end), Some(end))
                if header.offset >= header.stream_offset && end <= stream_end =>
            {
                Ok(header)
            }
            _ => Err(status::invalid_argument(format!(
                "UCX chunk of {} bytes at {} lies outside its stream ({} bytes at {})",
                header.length, header.offset, header.stream_length, header.stream_offset
            ))),
        }
    }
}

/// A receiver's verdict on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ack {
    pub request: u64,
    pub token: AuthToken,
    pub outcome: Result<()>,
    /// The receipt carried with the bytes set the completion key.
    pub receipt_applied: bool,
}

impl Ack {
    /// The header and the payload (the message).
    pub fn encode(&self) -> ([u8; ACK_HEADER_LEN], Vec<u8>) {
        let (code, message) = match &self.outcome {
            Ok(()) => (0u32, String::new()),
            Err(e) => (e.code as u32, within_limit(&e.message).to_string()),
        };
        let flags = if self.receipt_applied {
            ACK_RECEIPT_APPLIED
        } else {
            0
        };
        let mut header = [0u8; ACK_HEADER_LEN];
        header[0..4].copy_from_slice(&ACK_MAGIC);
        header[4..8].copy_from_slice(&code.to_le_bytes());
        header[8..12].copy_from_slice(&flags.to_le_bytes());
        header[12..20].copy_from_slice(&self.request.to_le_bytes());
        header[20..52].copy_from_slice(self.token.as_bytes());
        header[52..56].copy_from_slice(&(message.len() as u32).to_le_bytes());
        (header, message.into_bytes())
    }

    pub fn decode(header: &[u8], payload: &[u8]) -> Result<Ack> {
        if header.len() != ACK_HEADER_LEN || header[0..4] != ACK_MAGIC {
            return Err(status::invalid_argument(
                "not a crosshost UCX acknowledgement",
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4"));
        let code = u32_at(4);
        let flags = u32_at(8);
        let request = u64::from_le_bytes(header[12..20].try_into().expect("8"));
        let token = AuthToken::from_bytes(header[20..52].try_into().expect("32 bytes"));
        let message_len = u32_at(52) as usize;
        if flags & !ACK_RECEIPT_APPLIED != 0 {
            return Err(status::invalid_argument(
                "UCX acknowledgement has unknown flags set",
            ));
        }
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
            receipt_applied: flags & ACK_RECEIPT_APPLIED != 0 && outcome.is_ok(),
            outcome,
        })
    }
}

/// What a CLOSE message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseKind {
    /// "I would close my endpoint of this pair; will you stop using yours?"
    Ask,
    /// "Nothing of mine rides on this pair any more: close it."
    Agree,
    /// "I still use it": the asker keeps its endpoint.
    Decline,
}

/// One message of the close handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloseMessage {
    pub kind: CloseKind,
    pub sender: u32,
    pub sender_worker: u16,
    /// The asker's number for this handshake; an answer carries it back.
    pub handshake: u64,
}

impl CloseMessage {
    pub fn encode(&self) -> [u8; CLOSE_LEN] {
        let mut out = [0u8; CLOSE_LEN];
        out[0..4].copy_from_slice(&CLOSE_MAGIC);
        let kind: u32 = match self.kind {
            CloseKind::Ask => 1,
            CloseKind::Agree => 2,
            CloseKind::Decline => 3,
        };
        out[4..8].copy_from_slice(&kind.to_le_bytes());
        out[8..12].copy_from_slice(&self.sender.to_le_bytes());
        out[12..14].copy_from_slice(&self.sender_worker.to_le_bytes());
        out[16..24].copy_from_slice(&self.handshake.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<CloseMessage> {
        if bytes.len() != CLOSE_LEN {
            return Err(status::invalid_argument(format!(
                "UCX close message is {} bytes, expected {CLOSE_LEN}",
                bytes.len()
            )));
        }
        if bytes[0..4] != CLOSE_MAGIC || bytes[14..16] != [0, 0] {
            return Err(status::invalid_argument(
                "not a crosshost UCX close message (bad magic or padding)",
            ));
        }
        let kind = match u32::from_le_bytes(bytes[4..8].try_into().expect("4")) {
            1 => CloseKind::Ask,
            2 => CloseKind::Agree,
            3 => CloseKind::Decline,
            other => {
                return Err(status::invalid_argument(format!(
                    "UCX close message of unknown kind {other}"
                )))
            }
        };
        Ok(CloseMessage {
            kind,
            sender: u32::from_le_bytes(bytes[8..12].try_into().expect("4")),
            sender_worker: u16::from_le_bytes([bytes[12], bytes[13]]),
            handshake: u64::from_le_bytes(bytes[16..24].try_into().expect("8")),
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
            part: 1,
            parts: 2,
            token: AuthToken::from_bytes([7; AUTH_TOKEN_LEN]),
            offset: 1 << 33,
            length: 4096,
            request: 42,
            sender: 3,
            sender_worker: 1,
            receipt: b"xr1 ok 5".to_vec(),
        };
        let bytes = header.encode();
        assert_eq!(bytes.len(), DATA_HEADER_LEN + 8);
        assert_eq!(DataHeader::decode(&bytes).unwrap(), header);
        assert!(DataHeader::decode(&bytes[..79]).is_err());
        let mut long = bytes.clone();
        long[70] = 9;
        assert_eq!(
            DataHeader::decode(&long).unwrap_err().code,
            Code::InvalidArgument
        );
        let mut magic = bytes.clone();
        magic[0] = b'G';
        assert!(DataHeader::decode(&magic).is_err());
        let mut no_part = bytes;
        no_part[4] = 2;
        assert!(DataHeader::decode(&no_part).is_err());
        let bare = DataHeader {
            receipt: Vec::new(),
            ..header
        };
        assert_eq!(DataHeader::decode(&bare.encode()).unwrap(), bare);
    }

    #[test]
    fn chunk_headers_round_trip_and_a_chunk_outside_its_stream_is_refused() {
        let header = ChunkHeader {
            token: AuthToken::from_bytes([5; AUTH_TOKEN_LEN]),
            stream_offset: 64,
            stream_length: 10 << 20,
            offset: 64 + (4 << 20),
            length: 4 << 20,
            request: 9,
            stream_request: 8,
            sender: 2,
            sender_worker: 1,
            home_worker: 0,
            receipt: b"xr1 ok 5".to_vec(),
        };
        let bytes = header.encode();
        assert_eq!(bytes.len(), CHUNK_HEADER_LEN + 8);
        assert_eq!(ChunkHeader::decode(&bytes).unwrap(), header);
        assert!(ChunkHeader::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut magic = bytes.clone();
        magic[3] = b'1';
        assert!(ChunkHeader::decode(&magic).is_err());
        for outside in [
            ChunkHeader {
                offset: 0,
                ..header.clone()
            },
            ChunkHeader {
                offset: 64 + (8 << 20),
                ..header.clone()
            },
            ChunkHeader {
                offset: u64::MAX,
                ..header.clone()
            },
            ChunkHeader {
                stream_offset: u64::MAX,
                ..header.clone()
            },
        ] {
            let error = ChunkHeader::decode(&outside.encode()).unwrap_err();
            assert_eq!(error.code, Code::InvalidArgument, "{outside:?}");
        }
        let bare = ChunkHeader {
            receipt: Vec::new(),
            ..header
        };
        assert_eq!(ChunkHeader::decode(&bare.encode()).unwrap(), bare);
    }

    #[test]
    fn acks_carry_the_verdict_and_bound_the_message() {
        let token = AuthToken::from_bytes([9; AUTH_TOKEN_LEN]);
        let ok = Ack {
            request: 5,
            token,
            outcome: Ok(()),
            receipt_applied: true,
        };
        let (header, payload) = ok.encode();
        assert_eq!(Ack::decode(&header, &payload).unwrap(), ok);
        let refused = Ack {
            request: 6,
            token,
            outcome: Err(status::unauthenticated("é".repeat(3000))),
            receipt_applied: false,
        };
        let (header, payload) = refused.encode();
        let back = Ack::decode(&header, &payload).unwrap();
        let error = back.outcome.unwrap_err();
        assert_eq!(error.code, Code::Unauthenticated);
        assert!(error.message.len() <= MAX_ACK_MESSAGE_LEN);
        assert!(Ack::decode(&header, &payload[1..]).is_err());
        assert!(Ack::decode(&header[1..], &payload).is_err());
    }

    #[test]
    fn close_messages_round_trip_and_anything_else_is_refused() {
        for kind in [CloseKind::Ask, CloseKind::Agree, CloseKind::Decline] {
            let message = CloseMessage {
                kind,
                sender: 7,
                sender_worker: 3,
                handshake: u64::MAX - 1,
            };
            let bytes = message.encode();
            assert_eq!(CloseMessage::decode(&bytes).unwrap(), message);
        }
        let good = CloseMessage {
            kind: CloseKind::Ask,
            sender: 1,
            sender_worker: 0,
            handshake: 9,
        }
        .encode();
        let refused = |bytes: &[u8]| {
            let error = CloseMessage::decode(bytes).unwrap_err();
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
        };
        refused(&good[..CLOSE_LEN - 1]);
        refused(&[&good[..], &[0]].concat());
        let mut bad_magic = good;
        bad_magic[0] = b'Q';
        refused(&bad_magic);
        let mut bad_kind = good;
        bad_kind[4] = 4;
        refused(&bad_kind);
        let mut bad_padding = good;
        bad_padding[15] = 1;
        refused(&bad_padding);
    }
}
