//! The checks behind the fuzz targets (`fuzz_targets/`), and the generator of
//! their seed inputs (`seeds`).
//!
//! Each `check_*` takes raw bytes from a peer and asserts what the decoder
//! promises: it never panics, a rejection carries the documented status
//! code, and whatever it accepts re-encodes (with the real encoder) to bytes
//! that decode to the same value. A failed assertion is a finding. The
//! checks live here rather than in the targets so that `cargo test` can
//! replay the committed corpus through them without libFuzzer.
use std::io;

use pjrt_crosshost::status::Code;
use pjrt_crosshost::transfer::descriptor::{crc32, Descriptor, TransportKind};
use pjrt_crosshost::transfer::keys::{descriptor_key, reader_of, validate_epoch, KeyReader};
use pjrt_crosshost::transfer::session::{epoch_record, ProcessEntry};
use pjrt_crosshost::transfer::{CompletionKey, Receipt};
use pjrt_crosshost::transport::control::{
    decode_frame_for_fuzzing, decode_frames_for_fuzzing, encode_frame_for_fuzzing,
    split_key_for_fuzzing, ControlEndpoint, MAX_FRAME,
};
use pjrt_crosshost::transport::tcp::wire::{
    encode_response, read_response, RequestHeader, MAX_RESPONSE_MESSAGE_LEN,
};
use pjrt_crosshost::transport::tcp::REQUEST_HEADER_LEN;
use pjrt_crosshost::transport::ucx::wire::{
    Ack, ChunkHeader, CloseMessage, DataHeader, ACK_HEADER_LEN, AM_ACK, AM_CHUNK, AM_DATA,
};

pub mod seeds;

const RECV_PREFIX: &str = "crosshost/recv/";
const DESC_PREFIX: &str = "crosshost/desc/";

// -------------------------------- descriptor ---------------------------------

/// `Descriptor::decode` on bytes as they arrive (v1: the caller's notifier
/// payload; v2: the value under the descriptor key).
pub fn check_descriptor(bytes: &[u8]) {
    let descriptor = match Descriptor::decode(bytes) {
        Ok(descriptor) => descriptor,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    // What decode accepted, the sender's later checks must handle too.
    assert!(descriptor.dims.iter().all(|&dim| dim >= 0));
    assert!(descriptor
        .offset
        .checked_add(descriptor.byte_size)
        .is_some());
    let _ = descriptor.check_fits_in(u64::MAX);
    let _ = descriptor.check_fits_in(0);
    descriptor
        .validate_against(
            descriptor.byte_size,
            descriptor.element_type,
            &descriptor.dims,
        )
        .expect("a descriptor validates against its own shape");

    let again = descriptor
        .encode()
        .expect("a decoded descriptor must re-encode");
    let decoded_again = Descriptor::decode(&again).expect("the re-encoding must decode");
    assert_eq!(decoded_again, descriptor, "decode(encode(d)) != d");
    if descriptor.transport_kind() == TransportKind::Tcp {
        // "ip:port" has several spellings of one address ("[::0:1]:80" and
        // "[::1]:80"); the encoder writes the canonical one.
        assert_eq!(decoded_again.encode().unwrap(), again);
    } else {
        // Every other field is fixed-size or copied verbatim: one value, one
        // encoding.
        assert_eq!(again, bytes, "an accepted descriptor is not canonical");
    }
}

/// Restamps the declared length and the CRC of `bytes` (the last 4 bytes are
/// taken as the checksum and replaced), so that mutated bodies reach the field
/// parser instead of failing the checksum.
pub fn reseal(bytes: &[u8]) -> Vec<u8> {
    if bytes.len() < 16 {
        return bytes.to_vec();
    }
    let mut out = bytes[..bytes.len() - 4].to_vec();
    out[8..12].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    let checksum = crc32(&out);
    out.extend_from_slice(&checksum.to_le_bytes());
    out
}

// --------------------------------- receipt -----------------------------------

/// `Receipt::decode` on a completion key's value.
pub fn check_receipt(bytes: &[u8]) {
    let receipt = match Receipt::decode(bytes) {
        Ok(receipt) => receipt,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    if let Receipt::Error { status, .. } = &receipt {
        assert!((1..=16).contains(&(status.code as i32)));
    }
    let again = receipt.encode();
    let decoded_again = Receipt::decode(&again).expect("the re-encoding must decode");
    assert_eq!(decoded_again, receipt, "decode(encode(r)) != r");
    assert_eq!(decoded_again.encode(), again);
}

// ------------------------------- UCX wire ------------------------------------

/// The headers of the UCX transport's active messages, which anyone who can
/// reach a worker's port can send: byte 0 picks the message (its AM id, 1
/// DATA, 2 ACK, 3 CHUNK, taken modulo 3), the rest is the header (an ACK's
/// first `ACK_HEADER_LEN` bytes, its message the remainder).
pub fn check_ucx_am_header(bytes: &[u8]) {
    let Some((&which, rest)) = bytes.split_first() else {
        return;
    };
    // Byte 0 names the message by its id, modulo 4 (0 for CLOSE, id 4).
    match u32::from(which % 4) {
        AM_DATA => check_ucx_data_header(rest),
        AM_ACK => check_ucx_ack(rest),
        AM_CHUNK => check_ucx_chunk_header(rest),
        0 => check_ucx_close(rest),
        _ => unreachable!("a byte modulo 4"),
    }
}

fn check_ucx_close(bytes: &[u8]) {
    let message = match CloseMessage::decode(bytes) {
        Ok(message) => message,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    assert_eq!(
        message.encode().as_slice(),
        bytes,
        "an accepted CLOSE message is not canonical"
    );
}

fn check_ucx_data_header(bytes: &[u8]) {
    let header = match DataHeader::decode(bytes) {
        Ok(header) => header,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    assert!(header.part < header.parts, "{header:?}");
    let again = header.encode();
    assert_eq!(again, bytes, "an accepted DATA header is not canonical");
    assert_eq!(DataHeader::decode(&again).unwrap(), header);
}

fn check_ucx_chunk_header(bytes: &[u8]) {
    let header = match ChunkHeader::decode(bytes) {
        Ok(header) => header,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    // Accepted: the message lies inside its stream, with no overflow.
    let stream_end = header.stream_offset.checked_add(header.stream_length);
    let end = header.offset.checked_add(header.length);
    assert!(
        matches!((stream_end, end), (Some(s), Some(e)) if header.offset >= header.stream_offset && e <= s),
        "{header:?}"
    );
    let again = header.encode();
    assert_eq!(again, bytes, "an accepted CHUNK header is not canonical");
    assert_eq!(ChunkHeader::decode(&again).unwrap(), header);
}

fn check_ucx_ack(bytes: &[u8]) {
    let split = bytes.len().min(ACK_HEADER_LEN);
    let (header, payload) = bytes.split_at(split);
    let ack = match Ack::decode(header, payload) {
        Ok(ack) => ack,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    if let Err(status) = &ack.outcome {
        assert!((1..=16).contains(&(status.code as i32)), "{status}");
        assert!(!ack.receipt_applied, "a receipt applied by a failed ACK");
    }
    let (header, payload) = ack.encode();
    let decoded = Ack::decode(&header, &payload).expect("the re-encoding must decode");
    assert_eq!(decoded, ack, "decode(encode(ack)) != ack");
}

// ------------------------------- TCP wire ------------------------------------

/// `RequestHeader::decode` on the first `REQUEST_HEADER_LEN` bytes a sender
/// sends to the TCP transfer server.
pub fn check_tcp_request_header(bytes: &[u8]) {
    let Some(header_bytes) = bytes.get(..REQUEST_HEADER_LEN) else {
        return;
    };
    let header_bytes: &[u8; REQUEST_HEADER_LEN] = header_bytes.try_into().unwrap();
    let header = match RequestHeader::decode(header_bytes) {
        Ok(header) => header,
        Err(error) => {
            assert_eq!(error.code, Code::InvalidArgument, "{error}");
            return;
        }
    };
    let again = header.encode();
    assert_eq!(&again, header_bytes, "an accepted header is not canonical");
    assert_eq!(RequestHeader::decode(&again).unwrap(), header);
}

/// `read_response` on what the TCP transfer server answers a sender.
pub fn check_tcp_response(bytes: &[u8]) {
    let response = match read_response(&mut &bytes[..]) {
        Err(error) => {
            assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
            return;
        }
        Ok(Err(violation)) => {
            assert_eq!(violation.code, Code::DataLoss, "{violation}");
            return;
        }
        Ok(Ok(response)) => response,
    };
    if let Err(status) = &response.outcome {
        assert!(
            status.message.len() <= MAX_RESPONSE_MESSAGE_LEN,
            "read_response returned a {}-byte message (limit {MAX_RESPONSE_MESSAGE_LEN})",
            status.message.len()
        );
        assert!(
            !response.receipt_applied,
            "a refusal that applied a receipt"
        );
    }
    let again = encode_response(&response);
    let decoded_again = read_response(&mut &again[..])
        .expect("the re-encoding must be complete")
        .expect("the re-encoding must be well-formed");
    assert_eq!(decoded_again, response, "read(encode(r)) != r");
    assert_eq!(encode_response(&decoded_again), again);
}

// --------------------------------- session -----------------------------------

/// `ProcessEntry::decode` on a peer's session entry (`xs5 ...`).
pub fn check_session_entry(bytes: &[u8]) {
    let entry = match ProcessEntry::decode(3, bytes) {
        Ok(entry) => entry,
        Err(error) => {
            assert_eq!(error.code, Code::DataLoss, "{error}");
            return;
        }
    };
    assert_eq!(entry.process_index, 3);
    if let Some(ids) = &entry.device_ids {
        assert_eq!(ids.len(), entry.num_devices);
    }
    let again = entry.encode();
    let decoded_again =
        ProcessEntry::decode(3, again.as_bytes()).expect("the re-encoding must decode");
    assert_eq!(decoded_again, entry, "decode(encode(e)) != e");
    assert_eq!(decoded_again.encode(), again);
}

const EPOCH_SESSION: &str = "fuzz";

/// The epoch record (`<epoch> <secret-hex> <written ms>`) as a joining
/// process parses it (`epoch_record::decode`, what `await_fresh` reads);
/// whether it is fresh is a matter of clocks, tested in the crate.
pub fn check_session_epoch(bytes: &[u8]) {
    let record = match epoch_record::decode(EPOCH_SESSION, bytes) {
        Ok(record) => record,
        Err(error) => {
            assert_eq!(error.code, Code::DataLoss, "{error}");
            return;
        }
    };
    // The writer's format (process 0's `epoch_record::publish`).
    let again = epoch_record::decode(EPOCH_SESSION, record.encode().as_bytes())
        .expect("the re-encoding must parse");
    assert_eq!(again, record);
}

// --------------------------------- control -----------------------------------

/// `ControlEndpoint::decode` on the control field of a peer's session entry.
pub fn check_control_endpoint(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let Some(endpoint) = ControlEndpoint::decode(text) else {
        return;
    };
    let again = endpoint.encode();
    let decoded_again = ControlEndpoint::decode(&again).expect("the re-encoding must decode");
    assert_eq!(decoded_again, endpoint, "decode(encode(e)) != e");
    assert_eq!(decoded_again.encode(), again);
}

/// `read_frame` (and `split_key` on its payload) on the bytes of a control
/// link. Byte 0 says how the stream delivers them: its low 7 bits the most
/// bytes one `read` returns (0: no limit), its top bit whether the read runs
/// under a deadline (as HELLO does).
pub fn check_control_frame(bytes: &[u8]) {
    let Some((&how, stream)) = bytes.split_first() else {
        return;
    };
    let max_read = match how & 0x7f {
        0 => usize::MAX,
        n => n as usize,
    };
    let with_deadline = how & 0x80 != 0;
    check_frame_reader(stream, max_read);
    let (op, id, payload) = match decode_frame_for_fuzzing(stream, max_read, with_deadline) {
        Ok(frame) => frame,
        Err(error) => {
            assert!(
                matches!(
                    error.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData
                ),
                "{error}"
            );
            return;
        }
    };
    assert!(9 + payload.len() <= MAX_FRAME);
    let consumed = 4 + 1 + 8 + payload.len();
    assert_eq!(
        encode_frame_for_fuzzing(op, id, &payload),
        stream[..consumed],
        "frame(read_frame(b)) != b"
    );
    if let Some((key, value)) = split_key_for_fuzzing(&payload) {
        let mut again = (key.len() as u16).to_le_bytes().to_vec();
        again.extend_from_slice(key.as_bytes());
        again.extend_from_slice(value);
        assert_eq!(again, payload, "split_key does not cover its payload");
    }
}

/// The buffered `FrameReader` of an open link yields exactly the frames
/// `read_frame` reads one after another, and ends (EOF or a bad length)
/// where they end.
fn check_frame_reader(stream: &[u8], max_read: usize) {
    let (frames, end) = decode_frames_for_fuzzing(stream, max_read);
    assert!(
        matches!(
            end.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData
        ),
        "{end}"
    );
    let mut rest = stream;
    for (op, id, payload) in &frames {
        let (op2, id2, payload2) = decode_frame_for_fuzzing(rest, usize::MAX, false)
            .expect("read_frame reads what FrameReader read");
        assert_eq!((op, id, payload), (&op2, &id2, &payload2));
        rest = &rest[13 + payload.len()..];
    }
    assert!(
        decode_frame_for_fuzzing(rest, usize::MAX, false).is_err(),
        "FrameReader stopped before a frame read_frame reads"
    );
}

// ----------------------------------- keys ------------------------------------

/// `CompletionKey::parse`, `reader_of` and `validate_epoch` on a key name.
pub fn check_keys(bytes: &[u8]) {
    let Ok(name) = std::str::from_utf8(bytes) else {
        return;
    };
    let _ = validate_epoch(name);
    match CompletionKey::parse(name) {
        Err(error) => assert_eq!(error.code, Code::InvalidArgument, "{error}"),
        Ok(key) => {
            assert_eq!(key.as_str(), name, "parse accepted a non-canonical name");
            let rebuilt = CompletionKey::new(key.epoch(), key.transfer_id(), key.index())
                .expect("a parsed key's parts make a key");
            assert_eq!(rebuilt, key);
            assert_eq!(CompletionKey::parse(key.as_str()).unwrap(), key);
            assert_eq!(
                descriptor_key(key.epoch(), key.transfer_id(), key.index()).unwrap(),
                key.descriptor_key()
            );
        }
    }
    // A buffer's completion key and descriptor key name the same pair: the
    // descriptor key has a reader (the sending device) exactly when the
    // completion key's reader is a device.
    let (recv, desc) = if let Some(rest) = name.strip_prefix(RECV_PREFIX) {
        (name.to_string(), format!("{DESC_PREFIX}{rest}"))
    } else if let Some(rest) = name.strip_prefix(DESC_PREFIX) {
        (format!("{RECV_PREFIX}{rest}"), name.to_string())
    } else {
        assert_eq!(reader_of(name), None);
        return;
    };
    let recv_reader = reader_of(&recv);
    let desc_reader = reader_of(&desc);
    assert_eq!(
        desc_reader.is_some(),
        matches!(recv_reader, Some(KeyReader::Device(_))),
        "readers of {recv:?} ({recv_reader:?}) and {desc:?} ({desc_reader:?}) disagree"
    );
    assert!(!matches!(desc_reader, Some(KeyReader::Process(_))));
}

/// The check of the fuzz target `target`, for replaying a corpus.
pub fn check_for(target: &str) -> Option<fn(&[u8])> {
    Some(match target {
        "descriptor_raw" => check_descriptor,
        "descriptor_sealed" => |bytes: &[u8]| check_descriptor(&reseal(bytes)),
        "receipt" => check_receipt,
        "tcp_request_header" => check_tcp_request_header,
        "tcp_response" => check_tcp_response,
        "session_entry" => check_session_entry,
        "session_epoch" => check_session_epoch,
        "control_endpoint" => check_control_endpoint,
        "control_frame" => check_control_frame,
        "keys" => check_keys,
        "ucx_am_header" => check_ucx_am_header,
        _ => return None,
    })
}

/// Every fuzz target, in the order the scripts run them.
pub const TARGETS: [&str; 11] = [
    "descriptor_raw",
    "descriptor_sealed",
    "receipt",
    "tcp_request_header",
    "tcp_response",
    "session_entry",
    "session_epoch",
    "control_endpoint",
    "control_frame",
    "keys",
    "ucx_am_header",
];
