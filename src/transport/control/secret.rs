//! The job's shared secret for control links: made by the process that
//! founds the session, carried in its epoch record; the links' handshake
//! proves it and their keys come from it (`sealing.rs`), it never crosses
//! a link.

use crate::status::Result;
use crate::transport::random::random_u64;

pub const SECRET_LEN: usize = 32;

/// The job's shared secret for control links.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Secret(pub [u8; SECRET_LEN]);

impl Secret {
    pub fn generate() -> Result<Secret> {
        let mut bytes = [0u8; SECRET_LEN];
        for chunk in bytes.chunks_mut(8) {
            chunk.copy_from_slice(&random_u64()?.to_le_bytes());
        }
        Ok(Secret(bytes))
    }

    pub fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<Secret> {
        if text.len() != 2 * SECRET_LEN {
            return None;
        }
        let mut bytes = [0u8; SECRET_LEN];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Secret(bytes))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}
