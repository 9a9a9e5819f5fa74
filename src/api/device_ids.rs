//! Device ids between our numbering and the compute plugin's.
//!
//! A delegating client numbers its devices the way XLA does in a
//! multi-process job (`process * 2048 + i`); a compute plugin that ignores
//! `process_id` (XLA's CPU plugin before PJRT 0.11x) numbers them from 0 in
//! every process. Where the two differ, the device ids inside what a caller
//! hands the compute plugin (compile options' device assignment) and inside
//! what it hands back (device assignments, compile options) are rewritten.
//!
//! The protos are rewritten at the wire level, touching only the device-id
//! fields (verified against jaxlib's own `CompileOptions` serialization):
//! `CompileOptionsProto.executable_build_options` = 3,
//! `ExecutableBuildOptionsProto.device_assignment` = 9,
//! `DeviceAssignmentProto.computation_devices` = 3,
//! `ComputationDevice.replica_device_ids` = 1 (repeated int64, packed or not).
use crate::status::{invalid_argument, Result};

/// `(ours, the compute plugin's)` for each addressable device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceIdMap {
    pairs: Vec<(i32, i32)>,
}

impl DeviceIdMap {
    pub fn new(pairs: Vec<(i32, i32)>) -> DeviceIdMap {
        DeviceIdMap { pairs }
    }

    /// Nothing to rewrite: both sides use the same ids.
    pub fn is_identity(&self) -> bool {
        self.pairs.iter().all(|(ours, inner)| ours == inner)
    }

    pub fn to_inner(&self, ours: i64) -> Result<i64> {
        self.pairs
            .iter()
            .find(|(o, _)| *o as i64 == ours)
            .map(|(_, inner)| *inner as i64)
            .ok_or_else(|| {
                invalid_argument(format!(
                    "device {ours} is not addressable by this process's compute plugin"
                ))
            })
    }

    pub fn to_ours(&self, inner: i64) -> Result<i64> {
        self.pairs
            .iter()
            .find(|(_, i)| *i as i64 == inner)
            .map(|(ours, _)| *ours as i64)
            .ok_or_else(|| {
                invalid_argument(format!(
                    "the compute plugin named device {inner}, which is none of ours"
                ))
            })
    }
}

const COMPILE_OPTIONS_BUILD_OPTIONS: u64 = 3;
const BUILD_OPTIONS_DEVICE_ASSIGNMENT: u64 = 9;
const ASSIGNMENT_COMPUTATION_DEVICES: u64 = 3;
const COMPUTATION_DEVICE_REPLICA_IDS: u64 = 1;

const WIRE_VARINT: u64 = 0;
const WIRE_FIXED64: u64 = 1;
const WIRE_LEN: u64 = 2;
const WIRE_FIXED32: u64 = 5;

fn malformed() -> crate::status::Status {
    invalid_argument("malformed serialized compile options or device assignment")
}

fn read_varint(bytes: &[u8], pos: &mut usize) -> Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*pos).ok_or_else(malformed)?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(malformed())
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// One field of a message: its number, wire type and raw bytes (for
/// length-delimited fields, the payload without its length prefix).
struct Field<'a> {
    number: u64,
    wire: u64,
    raw: &'a [u8],
}

fn fields(bytes: &[u8]) -> Result<Vec<Field<'_>>> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < bytes.len() {
        let key = read_varint(bytes, &mut pos)?;
        let (number, wire) = (key >> 3, key & 7);
        let start = pos;
        let raw = match wire {
            WIRE_VARINT => {
                read_varint(bytes, &mut pos)?;
                &bytes[start..pos]
            }
            WIRE_FIXED64 | WIRE_FIXED32 => {
                let len = if wire == WIRE_FIXED64 { 8 } else { 4 };
                pos = pos
                    .checked_add(len)
                    .filter(|&p| p <= bytes.len())
                    .ok_or_else(malformed)?;
                &bytes[start..pos]
            }
            WIRE_LEN => {
                let len = read_varint(bytes, &mut pos)? as usize;
                let begin = pos;
                pos = pos
                    .checked_add(len)
                    .filter(|&p| p <= bytes.len())
                    .ok_or_else(malformed)?;
                &bytes[begin..pos]
            }
            _ => return Err(malformed()),
        };
        out.push(Field { number, wire, raw });
    }
    Ok(out)
}

fn write_field(out: &mut Vec<u8>, number: u64, wire: u64, raw: &[u8]) {
    write_varint(out, (number << 3) | wire);
    if wire == WIRE_LEN {
        write_varint(out, raw.len() as u64);
    }
    out.extend_from_slice(raw);
}

/// A field's new (wire type, payload), or `None` to keep it as it is.
type FieldRewrite<'a> = dyn FnMut(u64, u64, &[u8]) -> Result<Option<(u64, Vec<u8>)>> + 'a;

/// Rewrites `message` with `rewrite(number, wire type, payload)` applied to
/// each of its fields.
fn map_message(message: &[u8], rewrite: &mut FieldRewrite<'_>) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(message.len());
    for field in fields(message)? {
        match rewrite(field.number, field.wire, field.raw)? {
            Some((wire, raw)) => write_field(&mut out, field.number, wire, &raw),
            None => write_field(&mut out, field.number, field.wire, field.raw),
        }
    }
    Ok(out)
}

fn map_computation_device(bytes: &[u8], map: &dyn Fn(i64) -> Result<i64>) -> Result<Vec<u8>> {
    map_message(bytes, &mut |number, wire, raw| {
        if number != COMPUTATION_DEVICE_REPLICA_IDS {
            return Ok(None);
        }
        match wire {
            WIRE_VARINT => {
                let mut pos = 0;
                let id = read_varint(raw, &mut pos)? as i64;
                let mut out = Vec::new();
                write_varint(&mut out, map(id)? as u64);
                Ok(Some((WIRE_VARINT, out)))
            }
            WIRE_LEN => {
                let mut pos = 0;
                let mut out = Vec::new();
                while pos < raw.len() {
                    let id = read_varint(raw, &mut pos)? as i64;
                    write_varint(&mut out, map(id)? as u64);
                }
                Ok(Some((WIRE_LEN, out)))
            }
            _ => Err(malformed()),
        }
    })
}

/// Rewrites the device ids of a serialized `DeviceAssignmentProto`.
pub fn map_device_assignment(bytes: &[u8], map: &dyn Fn(i64) -> Result<i64>) -> Result<Vec<u8>> {
    map_message(bytes, &mut |number, wire, raw| match (number, wire) {
        (ASSIGNMENT_COMPUTATION_DEVICES, WIRE_LEN) => {
            Ok(Some((WIRE_LEN, map_computation_device(raw, map)?)))
        }
        _ => Ok(None),
    })
}

/// Rewrites the device ids of the device assignment in a serialized
/// `CompileOptionsProto` (everything else is kept byte for byte).
pub fn map_compile_options(bytes: &[u8], map: &dyn Fn(i64) -> Result<i64>) -> Result<Vec<u8>> {
    map_message(bytes, &mut |number, wire, raw| match (number, wire) {
        (COMPILE_OPTIONS_BUILD_OPTIONS, WIRE_LEN) => Ok(Some((
            WIRE_LEN,
            map_message(raw, &mut |number, wire, raw| match (number, wire) {
                (BUILD_OPTIONS_DEVICE_ASSIGNMENT, WIRE_LEN) => {
                    Ok(Some((WIRE_LEN, map_device_assignment(raw, map)?)))
                }
                _ => Ok(None),
            })?,
        ))),
        _ => Ok(None),
    })
}

/// The device ids of the device assignment in a serialized
/// `CompileOptionsProto`, in the order they appear (none when the options
/// carry no assignment).
pub fn assigned_devices(bytes: &[u8]) -> Result<Vec<i64>> {
    let seen = std::cell::RefCell::new(Vec::new());
    map_compile_options(bytes, &|id| {
        seen.borrow_mut().push(id);
        Ok(id)
    })?;
    Ok(seen.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What jaxlib's CompileOptions serializes for a 2-replica assignment
    /// [[7777], [8888]] (with the debug options elided to one field).
    fn compile_options(ids: &[i64]) -> Vec<u8> {
        let mut device = Vec::new();
        let mut packed = Vec::new();
        for &id in ids {
            write_varint(&mut packed, id as u64);
        }
        write_field(&mut device, 1, WIRE_LEN, &packed);
        let mut assignment = Vec::new();
        write_field(&mut assignment, 1, WIRE_VARINT, &[2]);
        write_field(&mut assignment, 2, WIRE_VARINT, &[1]);
        write_field(&mut assignment, 3, WIRE_LEN, &device);
        let mut build = Vec::new();
        write_field(&mut build, 1, WIRE_VARINT, &[0x7f]);
        write_field(&mut build, 3, WIRE_LEN, b"\xf8\x01\x03");
        write_field(&mut build, 9, WIRE_LEN, &assignment);
        let mut options = Vec::new();
        write_field(&mut options, 3, WIRE_LEN, &build);
        write_field(&mut options, 4, WIRE_VARINT, &[1]);
        options
    }

    #[test]
    fn compile_options_device_ids_are_rewritten_and_nothing_else() {
        let map = DeviceIdMap::new(vec![(2048, 0), (2049, 1)]);
        let ours = compile_options(&[2048, 2049]);
        let inner = map_compile_options(&ours, &|id| map.to_inner(id)).unwrap();
        assert_eq!(inner, compile_options(&[0, 1]));
        let back = map_compile_options(&inner, &|id| map.to_ours(id)).unwrap();
        assert_eq!(back, ours);
    }

    #[test]
    fn the_assigned_devices_are_read_from_compile_options() {
        assert_eq!(
            assigned_devices(&compile_options(&[0, 1, 2048, 2049])).unwrap(),
            vec![0, 1, 2048, 2049]
        );
        assert_eq!(assigned_devices(&[]).unwrap(), Vec::<i64>::new());
        assert!(assigned_devices(&[0x1a, 0x05, 0x01]).is_err());
    }

    #[test]
    fn an_unknown_device_and_malformed_bytes_are_errors() {
        let map = DeviceIdMap::new(vec![(2048, 0)]);
        let err = map_compile_options(&compile_options(&[5]), &|id| map.to_inner(id)).unwrap_err();
        assert!(err.message.contains("device 5"), "{}", err.message);
        assert!(map_compile_options(b"\x1a\x05\x01", &|id| Ok(id)).is_err());
        assert!(
            map_compile_options(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", &|id| Ok(
                id
            ))
            .is_err()
        );
    }

    #[test]
    fn unpacked_replica_ids_are_rewritten_too() {
        let mut device = Vec::new();
        write_field(&mut device, 1, WIRE_VARINT, &[3]);
        let mut assignment = Vec::new();
        write_field(&mut assignment, 3, WIRE_LEN, &device);
        let out = map_device_assignment(&assignment, &|id| Ok(id + 1)).unwrap();
        let mut expected_device = Vec::new();
        write_field(&mut expected_device, 1, WIRE_VARINT, &[4]);
        let mut expected = Vec::new();
        write_field(&mut expected, 3, WIRE_LEN, &expected_device);
        assert_eq!(out, expected);
    }

    #[test]
    fn identity_maps_are_recognised() {
        assert!(DeviceIdMap::new(vec![(0, 0), (1, 1)]).is_identity());
        assert!(!DeviceIdMap::new(vec![(2048, 0)]).is_identity());
    }
}
