//! `Descriptor`: the serialized description of one receive destination that
//! the receiver hands to the sender (through the caller's notifier in v1, the
//! KV store in v2). Versioned and self-checking: anything truncated, corrupted,
//! of another version, or out of bounds decodes to `INVALID_ARGUMENT`, never a
//! panic.
//!
//! Wire layout, version 1 (all integers little-endian):
//!
//! | size | field |
//! |---|---|
//! | 4 | magic `"PXHD"` |
//! | 2 | version (= 1) |
//! | 1 | transport kind: 1 in-process, 2 shared memory, 3 TCP, 4 CUDA IPC, 5 UCX |
//! | 1 | flags (reserved, must be 0) |
//! | 4 | total length of the encoding, checksum included |
//! | 2 + n | hostname (UTF-8, 1..=255 bytes) |
//! | 2 + n | boot id (UTF-8, 1..=64 bytes) |
//! | 4 | process id |
//! | 2 + n | allocation handle (1..=256 bytes), per kind: in-process = u64 allocation id; shared memory = object name (`/crosshost-<pid namespace>-<pid>-<start time>-<32 hex>`, see `transport/shm.rs`); TCP = `"ip:port"`; CUDA IPC = the 64 opaque handle bytes; UCX = the receiving process's index in the job (u32), whose worker address the sender takes from its own session table, then, for a destination the receiver lands through its staging ring (`transport/staging/`), the most bytes one chunk message may carry (u32; 4 bytes in all for a destination written directly, 8 for a staged one) |
//! | 8 | offset of the destination inside the allocation |
//! | 8 | byte size (offset + size must not overflow) |
//! | 4 | element type (raw `PJRT_Buffer_Type`) |
//! | 2 + 8·rank | rank (≤ 64), then each dim as i64 (≥ 0) |
//! | 2 + n | completion key (UTF-8, 1..=1024 bytes) |
//! | 8 | nonce |
//! | 32 | auth token |
//! | 4 | CRC-32 (IEEE) of every byte before it |
use std::fmt;
use std::net::SocketAddr;

use crate::status::{self, Result, Status};
use crate::transport::auth_token::{AuthToken, AUTH_TOKEN_LEN};
use crate::transport::host_identity::HostIdentity;
use crate::transport::shm::validate_shm_name;

pub const DESCRIPTOR_MAGIC: [u8; 4] = *b"PXHD";
pub const DESCRIPTOR_VERSION: u16 = 1;

pub const MAX_HOSTNAME_LEN: usize = 255;
pub const MAX_BOOT_ID_LEN: usize = 64;
pub const MAX_ALLOCATION_HANDLE_LEN: usize = 256;
pub const MAX_RANK: usize = 64;
pub const MAX_COMPLETION_KEY_LEN: usize = 1024;
pub const CUDA_IPC_HANDLE_LEN: usize = 64;

const FIXED_HEADER_LEN: usize = 4 + 2 + 1 + 1 + 4;
const CHECKSUM_LEN: usize = 4;
/// The largest encoding any valid descriptor can have; longer input is
/// rejected before it is parsed.
pub const MAX_ENCODED_LEN: usize = FIXED_HEADER_LEN
    + (2 + MAX_HOSTNAME_LEN)
    + (2 + MAX_BOOT_ID_LEN)
    + 4
    + (2 + MAX_ALLOCATION_HANDLE_LEN)
    + 8
    + 8
    + 4
    + (2 + 8 * MAX_RANK)
    + (2 + MAX_COMPLETION_KEY_LEN)
    + 8
    + AUTH_TOKEN_LEN
    + CHECKSUM_LEN;

/// How the sender reaches the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TransportKind {
    InProcess = 1,
    SharedMemory = 2,
    Tcp = 3,
    CudaIpc = 4,
    Ucx = 5,
}

impl TransportKind {
    fn from_wire(raw: u8) -> Result<TransportKind> {
        match raw {
            1 => Ok(TransportKind::InProcess),
            2 => Ok(TransportKind::SharedMemory),
            3 => Ok(TransportKind::Tcp),
            4 => Ok(TransportKind::CudaIpc),
            5 => Ok(TransportKind::Ucx),
            other => Err(malformed(format!("unknown transport kind {other}"))),
        }
    }
}

/// Where the destination's memory is, in the terms of its transport.
#[derive(Clone, PartialEq, Eq)]
pub enum AllocationHandle {
    /// An allocation id in the receiver's own process.
    InProcess { allocation_id: u64 },
    /// A POSIX shared-memory object on the receiver's host.
    SharedMemory { name: String },
    /// The receiver's TCP transfer server.
    Tcp { endpoint: SocketAddr },
    /// An opaque `CUipcMemHandle`.
    CudaIpc { handle: [u8; CUDA_IPC_HANDLE_LEN] },
    /// The UCX worker of process `process` of the job. `staged_chunk` > 0:
    /// the receiver lands the bytes through its staging ring, so they must
    /// come as chunk messages of at most that many bytes each
    /// (`transport/ucx/stream.rs`); 0: written directly.
    Ucx { process: u32, staged_chunk: u32 },
}

impl AllocationHandle {
    pub fn transport_kind(&self) -> TransportKind {
        match self {
            AllocationHandle::InProcess { .. } => TransportKind::InProcess,
            AllocationHandle::SharedMemory { .. } => TransportKind::SharedMemory,
            AllocationHandle::Tcp { .. } => TransportKind::Tcp,
            AllocationHandle::CudaIpc { .. } => TransportKind::CudaIpc,
            AllocationHandle::Ucx { .. } => TransportKind::Ucx,
        }
    }

    fn to_wire(&self) -> Vec<u8> {
        match self {
            AllocationHandle::InProcess { allocation_id } => allocation_id.to_le_bytes().to_vec(),
            AllocationHandle::SharedMemory { name } => name.as_bytes().to_vec(),
            AllocationHandle::Tcp { endpoint } => endpoint.to_string().into_bytes(),
            AllocationHandle::CudaIpc { handle } => handle.to_vec(),
            AllocationHandle::Ucx {
                process,
                staged_chunk,
            } => {
                let mut bytes = process.to_le_bytes().to_vec();
                if *staged_chunk > 0 {
                    bytes.extend_from_slice(&staged_chunk.to_le_bytes());
                }
                bytes
            }
        }
    }

    fn from_wire(kind: TransportKind, bytes: &[u8]) -> Result<AllocationHandle> {
        match kind {
            TransportKind::InProcess => {
                let id: [u8; 8] = bytes.try_into().map_err(|_| {
                    malformed(format!(
                        "in-process allocation handle must be 8 bytes, got {}",
                        bytes.len()
                    ))
                })?;
                Ok(AllocationHandle::InProcess {
                    allocation_id: u64::from_le_bytes(id),
                })
            }
            TransportKind::SharedMemory => {
                let name = utf8("shared-memory name", bytes)?;
                validate_shm_name(&name).map_err(|error| malformed(error.message))?;
                Ok(AllocationHandle::SharedMemory { name })
            }
            TransportKind::Tcp => {
                let text = utf8("TCP endpoint", bytes)?;
                let endpoint = text.parse::<SocketAddr>().map_err(|_| {
                    malformed(format!(
                        "TCP endpoint {text:?} is not an \"ip:port\" address"
                    ))
                })?;
                Ok(AllocationHandle::Tcp { endpoint })
            }
            TransportKind::CudaIpc => {
                let handle: [u8; CUDA_IPC_HANDLE_LEN] = bytes.try_into().map_err(|_| {
                    malformed(format!(
                        "CUDA IPC handle must be {CUDA_IPC_HANDLE_LEN} bytes, got {}",
                        bytes.len()
                    ))
                })?;
                Ok(AllocationHandle::CudaIpc { handle })
            }
            TransportKind::Ucx => {
                let u32_at =
                    |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
                let staged_chunk = match bytes.len() {
                    4 => 0,
                    8 if u32_at(4) > 0 => u32_at(4),
                    _ => {
                        return Err(malformed(format!(
                            "UCX allocation handle must be 4 bytes, or 8 with a chunk size above \
                             0, got {}",
                            bytes.len()
                        )))
                    }
                };
                Ok(AllocationHandle::Ucx {
                    process: u32_at(0),
                    staged_chunk,
                })
            }
        }
    }
}

impl fmt::Debug for AllocationHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocationHandle::InProcess { allocation_id } => {
                write!(f, "InProcess({allocation_id})")
            }
            AllocationHandle::SharedMemory { name } => write!(f, "SharedMemory({name})"),
            AllocationHandle::Tcp { endpoint } => write!(f, "Tcp({endpoint})"),
            AllocationHandle::CudaIpc { .. } => f.write_str("CudaIpc(<64 bytes>)"),
            AllocationHandle::Ucx {
                process,
                staged_chunk: 0,
            } => write!(f, "Ucx(process {process})"),
            AllocationHandle::Ucx {
                process,
                staged_chunk,
            } => write!(
                f,
                "Ucx(process {process}, staged in {staged_chunk}-byte chunks)"
            ),
        }
    }
}

/// One receive destination, as the sender needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub host: HostIdentity,
    pub process_id: u32,
    pub allocation: AllocationHandle,
    pub offset: u64,
    pub byte_size: u64,
    /// Raw `PJRT_Buffer_Type`.
    pub element_type: u32,
    pub dims: Vec<i64>,
    pub completion_key: String,
    pub nonce: u64,
    pub auth_token: AuthToken,
}

impl Descriptor {
    pub fn transport_kind(&self) -> TransportKind {
        self.allocation.transport_kind()
    }

    /// Serializes the descriptor. Fails with `INVALID_ARGUMENT` when a field
    /// is outside what `decode` accepts, so every encoding decodes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.check_fields()?;
        let mut out = Vec::with_capacity(256 + self.completion_key.len() + 8 * self.dims.len());
        out.extend_from_slice(&DESCRIPTOR_MAGIC);
        out.extend_from_slice(&DESCRIPTOR_VERSION.to_le_bytes());
        out.push(self.transport_kind() as u8);
        out.push(0); // flags
        out.extend_from_slice(&0u32.to_le_bytes()); // total length, patched below
        put_bytes(&mut out, self.host.hostname.as_bytes());
        put_bytes(&mut out, self.host.boot_id.as_bytes());
        out.extend_from_slice(&self.process_id.to_le_bytes());
        put_bytes(&mut out, &self.allocation.to_wire());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.byte_size.to_le_bytes());
        out.extend_from_slice(&self.element_type.to_le_bytes());
        out.extend_from_slice(&(self.dims.len() as u16).to_le_bytes());
        for dim in &self.dims {
            out.extend_from_slice(&dim.to_le_bytes());
        }
        put_bytes(&mut out, self.completion_key.as_bytes());
        out.extend_from_slice(&self.nonce.to_le_bytes());
        out.extend_from_slice(self.auth_token.as_bytes());
        let total_len = (out.len() + CHECKSUM_LEN) as u32;
        out[8..12].copy_from_slice(&total_len.to_le_bytes());
        let checksum = crc32(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        Ok(out)
    }

    /// Parses and checks an encoding produced by `encode`.
    pub fn decode(bytes: &[u8]) -> Result<Descriptor> {
        if bytes.len() < FIXED_HEADER_LEN + CHECKSUM_LEN {
            return Err(malformed(format!(
                "truncated: {} bytes, a descriptor has at least {}",
                bytes.len(),
                FIXED_HEADER_LEN + CHECKSUM_LEN
            )));
        }
        if bytes[0..4] != DESCRIPTOR_MAGIC {
            return Err(malformed(format!(
                "bad magic {:02x?}, expected {:02x?} (\"PXHD\"); not a crosshost descriptor",
                &bytes[0..4],
                DESCRIPTOR_MAGIC
            )));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != DESCRIPTOR_VERSION {
            return Err(malformed(format!(
                "unsupported version {version}; this plugin reads version {DESCRIPTOR_VERSION}"
            )));
        }
        let declared_len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
        if bytes.len() > MAX_ENCODED_LEN {
            return Err(malformed(format!(
                "{} bytes is longer than any valid descriptor ({MAX_ENCODED_LEN})",
                bytes.len()
            )));
        }
        if declared_len != bytes.len() {
            return Err(malformed(format!(
                "length mismatch: header says {declared_len} bytes, got {} (truncated or padded)",
                bytes.len()
            )));
        }
        let (body, checksum_bytes) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
        let stored = u32::from_le_bytes(checksum_bytes.try_into().expect("4 bytes"));
        let computed = crc32(body);
        if stored != computed {
            return Err(malformed(format!(
                "checksum mismatch: stored {stored:#010x}, computed {computed:#010x} (corrupted)"
            )));
        }
        let kind = TransportKind::from_wire(bytes[6])?;
        if bytes[7] != 0 {
            return Err(malformed(format!(
                "reserved flags byte is {:#04x}, must be 0",
                bytes[7]
            )));
        }

        let mut reader = Reader {
            bytes: body,
            position: FIXED_HEADER_LEN,
        };
        let hostname = utf8(
            "hostname",
            reader.bytes_field("hostname", MAX_HOSTNAME_LEN)?,
        )?;
        let boot_id = utf8("boot id", reader.bytes_field("boot id", MAX_BOOT_ID_LEN)?)?;
        let process_id = reader.u32("process id")?;
        let allocation = AllocationHandle::from_wire(
            kind,
            reader.bytes_field("allocation handle", MAX_ALLOCATION_HANDLE_LEN)?,
        )?;
        let offset = reader.u64("offset")?;
        let byte_size = reader.u64("byte size")?;
        let element_type = reader.u32("element type")?;
        let rank = reader.u16("rank")? as usize;
        if rank > MAX_RANK {
            return Err(malformed(format!(
                "rank {rank} exceeds the maximum {MAX_RANK}"
            )));
        }
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            dims.push(reader.u64("dims")? as i64);
        }
        let completion_key = utf8(
            "completion key",
            reader.bytes_field("completion key", MAX_COMPLETION_KEY_LEN)?,
        )?;
        let nonce = reader.u64("nonce")?;
        let auth_token = AuthToken::from_bytes(
            reader
                .take("auth token", AUTH_TOKEN_LEN)?
                .try_into()
                .expect("took exactly AUTH_TOKEN_LEN bytes"),
        );
        if reader.position != body.len() {
            return Err(malformed(format!(
                "{} unexpected bytes after the auth token",
                body.len() - reader.position
            )));
        }
        let descriptor = Descriptor {
            host: HostIdentity { hostname, boot_id },
            process_id,
            allocation,
            offset,
            byte_size,
            element_type,
            dims,
            completion_key,
            nonce,
            auth_token,
        };
        descriptor.check_fields()?;
        Ok(descriptor)
    }

    /// The sender's check: the destination must describe exactly the buffer
    /// being sent. Mismatches name both sides.
    pub fn validate_against(&self, byte_size: u64, element_type: u32, dims: &[i64]) -> Result<()> {
        if self.byte_size != byte_size {
            return Err(status::invalid_argument(format!(
                "cross-host send: destination (key {}) expects {} bytes but the source buffer has {byte_size}",
                self.completion_key, self.byte_size
            )));
        }
        if self.element_type != element_type {
            return Err(status::invalid_argument(format!(
                "cross-host send: destination (key {}) expects element type {} but the source buffer has element type {element_type}",
                self.completion_key, self.element_type
            )));
        }
        if self.dims != dims {
            return Err(status::invalid_argument(format!(
                "cross-host send: destination (key {}) expects shape {:?} but the source buffer has shape {dims:?}",
                self.completion_key, self.dims
            )));
        }
        Ok(())
    }

    /// Checks that the destination lies inside an allocation of
    /// `allocation_len` bytes (what the sender actually mapped or opened).
    pub fn check_fits_in(&self, allocation_len: u64) -> Result<()> {
        match self.offset.checked_add(self.byte_size) {
            Some(end) if end <= allocation_len => Ok(()),
            _ => Err(status::invalid_argument(format!(
                "cross-host descriptor (key {}): destination [{}, +{}) lies outside its {allocation_len}-byte allocation {:?}",
                self.completion_key, self.offset, self.byte_size, self.allocation
            ))),
        }
    }

    fn check_fields(&self) -> Result<()> {
        check_len("hostname", self.host.hostname.len(), 1, MAX_HOSTNAME_LEN)?;
        check_len("boot id", self.host.boot_id.len(), 1, MAX_BOOT_ID_LEN)?;
        check_len(
            "completion key",
            self.completion_key.len(),
            1,
            MAX_COMPLETION_KEY_LEN,
        )?;
        check_len("rank", self.dims.len(), 0, MAX_RANK)?;
        check_len(
            "allocation handle",
            self.allocation.to_wire().len(),
            1,
            MAX_ALLOCATION_HANDLE_LEN,
        )?;
        if let AllocationHandle::SharedMemory { name } = &self.allocation {
            validate_shm_name(name).map_err(|error| malformed(error.message))?;
        }
        if let Some(dim) = self.dims.iter().find(|&&dim| dim < 0) {
            return Err(malformed(format!(
                "dims {:?} contain the negative extent {dim}",
                self.dims
            )));
        }
        if self.offset.checked_add(self.byte_size).is_none() {
            return Err(malformed(format!(
                "offset {} + byte size {} overflows",
                self.offset, self.byte_size
            )));
        }
        Ok(())
    }
}

fn malformed(message: impl fmt::Display) -> Status {
    status::invalid_argument(format!("malformed cross-host descriptor: {message}"))
}

fn check_len(field: &str, len: usize, min: usize, max: usize) -> Result<()> {
    if len < min || len > max {
        return Err(malformed(format!(
            "{field} length {len} is outside [{min}, {max}]"
        )));
    }
    Ok(())
}

fn utf8(field: &str, bytes: &[u8]) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| malformed(format!("{field} is not UTF-8")))
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    // Lengths were bounded by check_fields (all maxima fit in u16).
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A cursor that never reads past the end: every read is bounds-checked and
/// fails with a message naming the field.
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, field: &str, count: usize) -> Result<&'a [u8]> {
        let remaining = self.bytes.len() - self.position;
        if count > remaining {
            return Err(malformed(format!(
                "truncated in {field}: needs {count} bytes, {remaining} left"
            )));
        }
        let slice = &self.bytes[self.position..self.position + count];
        self.position += count;
        Ok(slice)
    }

    fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(
            self.take(field, 2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(field, 4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(field, 8)?.try_into().expect("8 bytes"),
        ))
    }

    fn bytes_field(&mut self, field: &str, max_len: usize) -> Result<&'a [u8]> {
        let len = self.u16(field)? as usize;
        if len == 0 || len > max_len {
            return Err(malformed(format!(
                "{field} length {len} is outside [1, {max_len}]"
            )));
        }
        self.take(field, len)
    }
}

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), table-driven.
pub fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut index = 0;
        while index < 256 {
            let mut value = index as u32;
            let mut bit = 0;
            while bit < 8 {
                value = if value & 1 != 0 {
                    (value >> 1) ^ 0xEDB8_8320
                } else {
                    value >> 1
                };
                bit += 1;
            }
            table[index] = value;
            index += 1;
        }
        table
    };
    let mut crc = 0xFFFF_FFFFu32;
    for &byte in bytes {
        crc = TABLE[((crc ^ byte as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

#[cfg(test)]
mod tests;
