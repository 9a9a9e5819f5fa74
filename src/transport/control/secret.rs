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
        crate::transport::hex::encode(&self.0)
    }

    pub fn from_hex(text: &str) -> Option<Secret> {
        crate::transport::hex::decode(text)?
            .try_into()
            .ok()
            .map(Secret)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}
