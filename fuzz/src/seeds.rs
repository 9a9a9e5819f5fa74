//! Seed inputs for each target, made by the plugin's own encoders from fixed
//! values (no randomness, no reading of the local host), so that
//! `cargo run --example gen_seeds` rewrites `fuzz/seeds/` byte for byte.
use pjrt_crosshost::status;
use pjrt_crosshost::transfer::descriptor::{AllocationHandle, Descriptor};
use pjrt_crosshost::transfer::session::ProcessEntry;
use pjrt_crosshost::transfer::{CompletionKey, Receipt};
use pjrt_crosshost::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};
use pjrt_crosshost::transport::control::{encode_frame_for_fuzzing, ControlEndpoint, Secret};
use pjrt_crosshost::transport::host_identity::HostIdentity;
use pjrt_crosshost::transport::tcp::wire::{encode_response, RequestHeader, Response};
use pjrt_crosshost::transport::ucx::wire::{Ack, ChunkHeader, CloseKind, CloseMessage, DataHeader};

/// One seed: the target it is for, a file name, the bytes.
pub struct Seed {
    pub target: &'static str,
    pub name: String,
    pub bytes: Vec<u8>,
}

const SESSION: &str = "5eed0123456789ab";

fn host() -> HostIdentity {
    HostIdentity {
        hostname: "node-a.cluster".into(),
        boot_id: "00f9f763-1569-492a-b11b-d49686ee9a5b".into(),
    }
}

fn control_endpoint() -> ControlEndpoint {
    ControlEndpoint {
        unix_name: "pjrt-crosshost/4242/00000000deadbeef".into(),
        tcp: "10.0.0.7:40123".parse().unwrap(),
    }
}

/// The completion keys the service makes: v1 (`<session>.v1.p<i>`), v2
/// (`<session>.d<src>-<dst>`, with incarnations `.i<a>-<b>` where the caller
/// gave them).
fn completion_keys() -> Vec<(&'static str, CompletionKey)> {
    vec![
        (
            "v1",
            CompletionKey::new(&format!("{SESSION}.v1.p1"), 0, 0).unwrap(),
        ),
        (
            "v2",
            CompletionKey::new(&format!("{SESSION}.d0-2"), 7, 3).unwrap(),
        ),
        (
            "v2-incarnations",
            CompletionKey::new(&format!("{SESSION}.d2048-1.i7-9"), -3, 1).unwrap(),
        ),
    ]
}

fn allocations() -> Vec<(&'static str, AllocationHandle)> {
    vec![
        (
            "inprocess",
            AllocationHandle::InProcess { allocation_id: 99 },
        ),
        (
            "shm",
            AllocationHandle::SharedMemory {
                name: "/crosshost-4026531836-4242-987654-0123456789abcdef0123456789abcdef".into(),
            },
        ),
        (
            "tcp4",
            AllocationHandle::Tcp {
                endpoint: "10.0.0.7:5555".parse().unwrap(),
            },
        ),
        (
            "tcp6",
            AllocationHandle::Tcp {
                endpoint: "[fe80::1:2]:80".parse().unwrap(),
            },
        ),
        ("cudaipc", AllocationHandle::CudaIpc { handle: [3; 64] }),
        (
            "ucx",
            AllocationHandle::Ucx {
                process: 3,
                staged_chunk: 0,
            },
        ),
        (
            "ucx-staged",
            AllocationHandle::Ucx {
                process: 3,
                staged_chunk: 4 << 20,
            },
        ),
    ]
}

fn descriptors() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (api, key) in completion_keys() {
        for (kind, allocation) in allocations() {
            for (shape, element_type, dims, byte_size) in [
                ("f32-2x3", 11u32, vec![2i64, 3], 24u64),
                ("scalar", 4, vec![], 4),
                ("empty", 11, vec![0, 5, 1, 1], 0),
            ] {
                let descriptor = Descriptor {
                    host: host(),
                    process_id: 4242,
                    allocation: allocation.clone(),
                    offset: if byte_size == 0 { 0 } else { 4096 },
                    byte_size,
                    element_type,
                    dims,
                    completion_key: key.as_str().to_string(),
                    nonce: 0x0123_4567_89ab_cdef,
                    auth_token: AuthToken::from_bytes([7; AUTH_TOKEN_LEN]),
                };
                out.push((
                    format!("{api}-{kind}-{shape}"),
                    descriptor.encode().unwrap(),
                ));
            }
        }
    }
    out
}

/// All seeds, for every target.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        seeds.push(Seed {
            target,
            name: name.to_string(),
            bytes,
        })
    };

    for (name, bytes) in descriptors() {
        add("descriptor_raw", &name, bytes.clone());
        add("descriptor_sealed", &name, bytes);
    }

    for (name, receipt) in [
        (
            "ok",
            Receipt::Ok {
                nonce: 0x0123_4567_89ab_cdef,
            },
        ),
        ("ok-max", Receipt::Ok { nonce: u64::MAX }),
        ("cancel", Receipt::Cancel { nonce: 42 }),
        (
            "err",
            Receipt::Error {
                nonce: 7,
                status: status::data_loss("peer died: a b  c"),
            },
        ),
        (
            "err-empty",
            Receipt::Error {
                nonce: 0,
                status: status::internal(""),
            },
        ),
    ] {
        add("receipt", name, receipt.encode());
    }

    for (name, header) in [
        (
            "small",
            RequestHeader {
                token: AuthToken::from_bytes([5; AUTH_TOKEN_LEN]),
                offset: 17,
                length: 1 << 20,
                receipt: Vec::new(),
            },
        ),
        (
            "receipt",
            RequestHeader {
                token: AuthToken::from_bytes([7; AUTH_TOKEN_LEN]),
                offset: 0,
                length: 4096,
                receipt: b"xr1 ok 1f".to_vec(),
            },
        ),
        (
            "max",
            RequestHeader {
                token: AuthToken::from_bytes([0xff; AUTH_TOKEN_LEN]),
                offset: u64::MAX,
                length: u64::MAX,
                receipt: vec![0xff; 32],
            },
        ),
    ] {
        // The payload follows the header on the wire.
        let mut bytes = header.encode().to_vec();
        bytes.extend_from_slice(b"payload");
        add("tcp_request_header", name, bytes);
    }

    for (name, outcome, receipt_applied) in [
        ("ok", Ok(()), false),
        ("ok-receipt-applied", Ok(()), true),
        (
            "unauthenticated",
            Err(status::unauthenticated("no destination is registered")),
            false,
        ),
        (
            "out-of-range",
            Err(status::out_of_range(
                "8 bytes at offset 4096 do not fit the 24-byte destination",
            )),
            false,
        ),
        ("utf8", Err(status::internal("é".repeat(40))), false),
    ] {
        let response = Response {
            outcome,
            receipt_applied,
        };
        add("tcp_response", name, encode_response(&response));
    }

    for (name, entry) in [
        (
            "sequential",
            ProcessEntry {
                process_index: 1,
                num_devices: 2,
                device_ids: None,
                device_kind: "crosshost-host".into(),
                host: host(),
                pid: 4242,
                control: None,
                tcp_data: None,
                transport: "ucx".into(),
            },
        ),
        (
            "stated-ids-control",
            ProcessEntry {
                process_index: 1,
                num_devices: 2,
                device_ids: Some(vec![2048, 2049]),
                device_kind: "NVIDIA H200 (141 GB)".into(),
                host: host(),
                pid: 7,
                control: Some(control_endpoint()),
                tcp_data: Some("10.0.0.7:41554".parse().unwrap()),
                transport: "tcp".into(),
            },
        ),
        (
            "ipv6-control",
            ProcessEntry {
                process_index: 0,
                num_devices: 1,
                device_ids: Some(vec![-1]),
                device_kind: "cpu".into(),
                host: host(),
                pid: 1,
                control: Some(ControlEndpoint {
                    unix_name: "pjrt-crosshost/1/ffffffffffffffff".into(),
                    tcp: "[::1]:9".parse().unwrap(),
                }),
                tcp_data: Some("[::1]:10".parse().unwrap()),
                transport: "shm".into(),
            },
        ),
    ] {
        add("session_entry", name, entry.encode().into_bytes());
    }

    for (name, epoch, secret) in [
        ("typical", SESSION, Secret([0xa5; 32])),
        ("zero", "0000000000000000", Secret([0; 32])),
    ] {
        // The format process 0 writes in `Session::establish`.
        add(
            "session_epoch",
            name,
            format!("{epoch} {}", secret.to_hex()).into_bytes(),
        );
    }

    add(
        "control_endpoint",
        "ipv4",
        control_endpoint().encode().into_bytes(),
    );
    add(
        "control_endpoint",
        "ipv6",
        ControlEndpoint {
            unix_name: "pjrt-crosshost/1/ffffffffffffffff".into(),
            tcp: "[2001:db8::7]:40123".parse().unwrap(),
        }
        .encode()
        .into_bytes(),
    );

    // Control frames, as the ops of control.rs lay them out; byte 0 is the
    // target's delivery mode (see `check_control_frame`).
    let key = completion_keys()[1].1.descriptor_key();
    let set_payload = [
        &(key.len() as u16).to_le_bytes()[..],
        key.as_bytes(),
        &descriptors()[0].1,
    ]
    .concat();
    let delete_payload = [&(key.len() as u16).to_le_bytes()[..], key.as_bytes()].concat();
    let hello_payload = [&[0x5a; 32][..], &1u32.to_le_bytes()].concat();
    let nack_payload = [&16u32.to_le_bytes()[..], b"control link: bad HELLO"].concat();
    for (name, how, op, id, payload) in [
        ("hello", 0x80u8, 1u8, 0u64, hello_payload),
        ("set", 0x00, 2, 1, set_payload),
        (
            "set-trickled",
            0x03,
            2,
            2,
            Receipt::Ok { nonce: 9 }.encode(),
        ),
        ("delete", 0x00, 3, 3, delete_payload),
        ("ack", 0x00, 0x80, 3, Vec::new()),
        ("nack", 0x01, 0x81, 0, nack_payload),
    ] {
        let mut bytes = vec![how];
        bytes.extend_from_slice(&encode_frame_for_fuzzing(op, id, &payload));
        add("control_frame", name, bytes);
    }

    // UCX active-message headers; byte 0 picks the message (see
    // `check_ucx_am_header`): 1 DATA, 2 ACK, 3 CHUNK, 4 CLOSE.
    let token = AuthToken::from_bytes([9; AUTH_TOKEN_LEN]);
    for (name, receipt) in [
        ("data", Vec::new()),
        ("data-receipt", b"xr1 ok 1f".to_vec()),
    ] {
        let header = DataHeader {
            part: 1,
            parts: 3,
            token,
            offset: 4096,
            length: 1 << 20,
            request: 77,
            sender: 2,
            sender_worker: 1,
            receipt,
        };
        add(
            "ucx_am_header",
            name,
            [&[1u8][..], &header.encode()].concat(),
        );
    }
    for (name, outcome, receipt_applied) in [
        ("ack-ok", Ok(()), true),
        (
            "ack-refused",
            Err(status::unauthenticated("no destination for that token")),
            false,
        ),
    ] {
        let (header, payload) = Ack {
            request: 77,
            token,
            outcome,
            receipt_applied,
        }
        .encode();
        add(
            "ucx_am_header",
            name,
            [&[2u8][..], &header, &payload].concat(),
        );
    }
    for (name, offset, receipt) in [
        ("chunk-first", 64, Vec::new()),
        ("chunk-last", 64 + (8 << 20), b"xr1 ok 1f".to_vec()),
    ] {
        let header = ChunkHeader {
            token,
            stream_offset: 64,
            stream_length: 10 << 20,
            offset,
            length: if offset == 64 { 4 << 20 } else { 2 << 20 },
            request: 5,
            stream_request: 4,
            sender: 2,
            sender_worker: 1,
            home_worker: 0,
            receipt,
        };
        add(
            "ucx_am_header",
            name,
            [&[3u8][..], &header.encode()].concat(),
        );
    }
    for (name, kind) in [
        ("close-ask", CloseKind::Ask),
        ("close-agree", CloseKind::Agree),
        ("close-decline", CloseKind::Decline),
    ] {
        let message = CloseMessage {
            kind,
            sender: 2,
            sender_worker: 1,
            handshake: 12,
        };
        add(
            "ucx_am_header",
            name,
            [&[4u8][..], &message.encode()].concat(),
        );
    }

    for (api, key) in completion_keys() {
        add(
            "keys",
            &format!("{api}-recv"),
            key.as_str().as_bytes().to_vec(),
        );
        add(
            "keys",
            &format!("{api}-desc"),
            key.descriptor_key().into_bytes(),
        );
    }
    add(
        "keys",
        "session-entry",
        format!("crosshost/session/job/{SESSION}/process/1").into_bytes(),
    );

    seeds
}
