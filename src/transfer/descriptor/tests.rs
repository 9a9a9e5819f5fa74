use super::*;
use crate::status::Code;
use proptest::prelude::*;

fn sample(allocation: AllocationHandle) -> Descriptor {
    Descriptor {
        host: HostIdentity {
            hostname: "host-a".into(),
            boot_id: "00f9f763-1569-492a-b11b-d49686ee9a5b".into(),
        },
        process_id: 4242,
        allocation,
        offset: 4096,
        byte_size: 24,
        element_type: 11,
        dims: vec![2, 3],
        completion_key: "crosshost/recv/epoch/7/0".into(),
        nonce: 0x0123_4567_89ab_cdef,
        auth_token: AuthToken::from_bytes([7; AUTH_TOKEN_LEN]),
    }
}

fn all_kinds() -> Vec<Descriptor> {
    vec![
        sample(AllocationHandle::InProcess { allocation_id: 99 }),
        sample(AllocationHandle::SharedMemory {
            name: "/crosshost-4026531836-4242-987654-0123456789abcdef0123456789abcdef".into(),
        }),
        sample(AllocationHandle::Tcp {
            endpoint: "127.0.0.1:5555".parse().unwrap(),
        }),
        sample(AllocationHandle::Tcp {
            endpoint: "[::1]:80".parse().unwrap(),
        }),
        sample(AllocationHandle::CudaIpc { handle: [3; 64] }),
        sample(AllocationHandle::Ucx {
            process: 7,
            staged_chunk: 0,
        }),
        sample(AllocationHandle::Ucx {
            process: 7,
            staged_chunk: 4 << 20,
        }),
    ]
}

fn assert_invalid(bytes: &[u8], needle: &str) {
    let error = Descriptor::decode(bytes).unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument, "{error}");
    assert!(
        error.message.contains(needle),
        "expected {needle:?} in {:?}",
        error.message
    );
}

/// Re-stamps length and checksum so that a deliberately edited body reaches
/// the field checks instead of failing the checksum.
fn reseal(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes.truncate(bytes.len() - 4);
    let total = (bytes.len() + 4) as u32;
    bytes[8..12].copy_from_slice(&total.to_le_bytes());
    let checksum = crc32(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    bytes
}

#[test]
fn a_ucx_handle_is_four_bytes_or_eight_with_a_chunk_size() {
    let direct = AllocationHandle::Ucx {
        process: 3,
        staged_chunk: 0,
    };
    assert_eq!(direct.to_wire(), 3u32.to_le_bytes());
    let staged = AllocationHandle::Ucx {
        process: 3,
        staged_chunk: 4096,
    };
    assert_eq!(staged.to_wire().len(), 8);
    assert_eq!(
        AllocationHandle::from_wire(TransportKind::Ucx, &staged.to_wire()).unwrap(),
        staged
    );
    for bad in [&[0u8; 3][..], &[1, 0, 0, 0, 0, 0, 0, 0], &[0; 6], &[0; 12]] {
        let error = AllocationHandle::from_wire(TransportKind::Ucx, bad).unwrap_err();
        assert_eq!(error.code, Code::InvalidArgument, "{bad:?}");
    }
}

#[test]
fn crc32_matches_the_standard_check_value() {
    assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    assert_eq!(crc32(b""), 0);
}

#[test]
fn every_transport_kind_round_trips() {
    for descriptor in all_kinds() {
        let bytes = descriptor.encode().unwrap();
        assert!(bytes.len() <= MAX_ENCODED_LEN);
        let decoded = Descriptor::decode(&bytes).unwrap();
        assert_eq!(decoded, descriptor);
        assert_eq!(decoded.auth_token.as_bytes(), &[7; AUTH_TOKEN_LEN]);
    }
}

#[test]
fn the_largest_descriptor_round_trips_at_the_maximum_length() {
    let descriptor = Descriptor {
        host: HostIdentity {
            hostname: "h".repeat(MAX_HOSTNAME_LEN),
            boot_id: "b".repeat(MAX_BOOT_ID_LEN),
        },
        dims: vec![1; MAX_RANK],
        completion_key: "k".repeat(MAX_COMPLETION_KEY_LEN),
        allocation: AllocationHandle::Tcp {
            endpoint: "[::1]:1".parse().unwrap(),
        },
        ..sample(AllocationHandle::InProcess { allocation_id: 0 })
    };
    let bytes = descriptor.encode().unwrap();
    assert_eq!(Descriptor::decode(&bytes).unwrap(), descriptor);
}

#[test]
fn encode_refuses_fields_decode_would_reject() {
    let base = sample(AllocationHandle::InProcess { allocation_id: 1 });
    let cases = [
        Descriptor {
            completion_key: String::new(),
            ..base.clone()
        },
        Descriptor {
            completion_key: "k".repeat(MAX_COMPLETION_KEY_LEN + 1),
            ..base.clone()
        },
        Descriptor {
            dims: vec![1; MAX_RANK + 1],
            ..base.clone()
        },
        Descriptor {
            dims: vec![2, -1],
            ..base.clone()
        },
        Descriptor {
            offset: u64::MAX,
            byte_size: 1,
            ..base.clone()
        },
        Descriptor {
            allocation: AllocationHandle::SharedMemory {
                name: "/etc/passwd".into(),
            },
            ..base.clone()
        },
    ];
    for case in cases {
        assert_eq!(case.encode().unwrap_err().code, Code::InvalidArgument);
    }
}

#[test]
fn clear_errors_for_each_kind_of_bad_input() {
    let good = sample(AllocationHandle::InProcess { allocation_id: 1 })
        .encode()
        .unwrap();
    assert_invalid(&[], "truncated");
    assert_invalid(&good[..good.len() - 1], "length mismatch");
    let mut padded = good.clone();
    padded.push(0);
    assert_invalid(&padded, "length mismatch");
    assert_invalid(&vec![0u8; MAX_ENCODED_LEN + 1], "bad magic");

    let mut wrong_magic = good.clone();
    wrong_magic[0] = b'X';
    assert_invalid(&wrong_magic, "bad magic");

    let mut wrong_version = good.clone();
    wrong_version[4] = 2;
    assert_invalid(&wrong_version, "unsupported version 2");

    let mut corrupted = good.clone();
    let middle = corrupted.len() / 2;
    corrupted[middle] ^= 0x40;
    assert_invalid(&corrupted, "checksum mismatch");

    let mut unknown_kind = good.clone();
    unknown_kind[6] = 9;
    assert_invalid(&reseal(unknown_kind), "unknown transport kind 9");

    let mut flags = good.clone();
    flags[7] = 1;
    assert_invalid(&reseal(flags), "reserved flags");

    // Claims a hostname longer than the rest of the input.
    let mut long_field = good.clone();
    long_field[12..14].copy_from_slice(&200u16.to_le_bytes());
    assert_invalid(&reseal(long_field), "truncated in hostname");
    // Claims a hostname longer than any hostname may be.
    let mut oversized = good.clone();
    oversized[12..14].copy_from_slice(&300u16.to_le_bytes());
    assert_invalid(&reseal(oversized), "hostname length 300");

    // Shared-memory descriptor whose name is not one of ours.
    let shm = sample(AllocationHandle::SharedMemory {
        name: "/crosshost-4026531836-4242-987654-0123456789abcdef0123456789abcdef".into(),
    })
    .encode()
    .unwrap();
    let at = shm
        .windows(5)
        .position(|window| window == b"/cros")
        .unwrap();
    let mut foreign = shm.clone();
    foreign[at + 1] = b'x';
    assert_invalid(&reseal(foreign), "does not start with");
}

#[test]
fn overflowing_offset_in_a_resealed_descriptor_is_rejected() {
    let descriptor = sample(AllocationHandle::InProcess { allocation_id: 1 });
    let bytes = descriptor.encode().unwrap();
    let offset_at = bytes
        .windows(8)
        .position(|window| window == 4096u64.to_le_bytes())
        .unwrap();
    let mut forged = bytes.clone();
    forged[offset_at..offset_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_invalid(&reseal(forged), "overflows");
}

#[test]
fn validate_against_names_both_sides() {
    let descriptor = sample(AllocationHandle::InProcess { allocation_id: 1 });
    descriptor.validate_against(24, 11, &[2, 3]).unwrap();

    let size = descriptor.validate_against(25, 11, &[2, 3]).unwrap_err();
    assert_eq!(size.code, Code::InvalidArgument);
    assert!(size.message.contains("expects 24 bytes") && size.message.contains("has 25"));

    let dtype = descriptor.validate_against(24, 12, &[2, 3]).unwrap_err();
    assert!(dtype.message.contains("element type 11") && dtype.message.contains("element type 12"));

    let shape = descriptor.validate_against(24, 11, &[3, 2]).unwrap_err();
    assert!(shape.message.contains("[2, 3]") && shape.message.contains("[3, 2]"));
}

#[test]
fn check_fits_in_refuses_destinations_outside_the_allocation() {
    let descriptor = sample(AllocationHandle::InProcess { allocation_id: 1 });
    descriptor.check_fits_in(4096 + 24).unwrap();
    let error = descriptor.check_fits_in(4096 + 23).unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument);
}

#[test]
fn debug_output_hides_the_token() {
    let descriptor = sample(AllocationHandle::InProcess { allocation_id: 1 });
    let text = format!("{descriptor:?}");
    assert!(text.contains("redacted"));
    assert!(!text.contains("[7, 7"));
}

/// Every truncation and every single-byte change of a valid encoding decodes
/// to an error (or, for the unchanged bytes, the same descriptor), never a
/// panic.
#[test]
fn exhaustive_truncations_and_byte_flips_never_panic() {
    for descriptor in all_kinds() {
        let bytes = descriptor.encode().unwrap();
        for len in 0..bytes.len() {
            assert_eq!(
                Descriptor::decode(&bytes[..len]).unwrap_err().code,
                Code::InvalidArgument
            );
        }
        for index in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut mutated = bytes.clone();
                mutated[index] ^= flip;
                assert_eq!(
                    Descriptor::decode(&mutated).unwrap_err().code,
                    Code::InvalidArgument
                );
                // With a fresh checksum the parser itself must cope.
                let _ = Descriptor::decode(&reseal(mutated));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        prop_assert!(Descriptor::decode(&bytes).is_err());
        if bytes.len() >= 16 {
            let mut with_header = bytes.clone();
            with_header[0..4].copy_from_slice(&DESCRIPTOR_MAGIC);
            with_header[4..6].copy_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
            let _ = Descriptor::decode(&reseal(with_header));
        }
    }

    #[test]
    fn random_mutations_of_valid_descriptors_never_panic(
        kind in 0usize..5,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let bytes = all_kinds()[kind].encode().unwrap();
        let mut mutated = bytes.clone();
        for (at, value) in edits {
            let at = at % mutated.len();
            mutated[at] = value;
        }
        let mutated = reseal(mutated);
        let _ = Descriptor::decode(&mutated);
        let _ = Descriptor::decode(&mutated[..cut % (mutated.len() + 1)]);
    }

    #[test]
    fn arbitrary_valid_descriptors_round_trip(
        hostname in "[a-z0-9.-]{1,255}",
        process_id in any::<u32>(),
        allocation_id in any::<u64>(),
        offset in 0u64..(1 << 40),
        byte_size in 0u64..(1 << 40),
        element_type in any::<u32>(),
        dims in proptest::collection::vec(0i64..i64::MAX, 0..=MAX_RANK),
        completion_key in "\\PC{1,200}",
        nonce in any::<u64>(),
        token in proptest::array::uniform32(any::<u8>()),
    ) {
        let descriptor = Descriptor {
            host: HostIdentity { hostname, boot_id: "boot".into() },
            process_id,
            allocation: AllocationHandle::InProcess { allocation_id },
            offset,
            byte_size,
            element_type,
            dims,
            completion_key,
            nonce,
            auth_token: AuthToken::from_bytes(token),
        };
        let bytes = descriptor.encode().unwrap();
        prop_assert_eq!(Descriptor::decode(&bytes).unwrap(), descriptor);
    }
}
