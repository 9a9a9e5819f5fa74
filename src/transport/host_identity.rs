//! `HostIdentity`: which machine (and which boot of it) a destination lives
//! on. Two descriptors with equal identities can use same-host transports
//! (shared memory, CUDA IPC); anything else must go over the network.
use std::sync::OnceLock;

use crate::status::{self, Result};

const HOSTNAME_PATH: &str = "/proc/sys/kernel/hostname";
const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostIdentity {
    pub hostname: String,
    /// The kernel's per-boot UUID: distinguishes a rebooted host, and two
    /// containers with the same hostname on different machines.
    pub boot_id: String,
}

impl HostIdentity {
    /// This machine's identity, read once from /proc and cached.
    pub fn local() -> Result<HostIdentity> {
        static LOCAL: OnceLock<std::result::Result<HostIdentity, String>> = OnceLock::new();
        LOCAL
            .get_or_init(|| {
                Ok(HostIdentity {
                    hostname: read_trimmed(HOSTNAME_PATH)?,
                    boot_id: read_trimmed(BOOT_ID_PATH)?,
                })
            })
            .clone()
            .map_err(status::internal)
    }

    pub fn is_local(&self) -> Result<bool> {
        Ok(*self == HostIdentity::local()?)
    }
}

fn read_trimmed(path: &str) -> std::result::Result<String, String> {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_string())
        .map_err(|error| format!("cannot read host identity from {path}: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_identity_is_stable_and_local() {
        let identity = HostIdentity::local().unwrap();
        assert!(!identity.hostname.is_empty());
        assert_eq!(identity.boot_id.len(), 36, "boot_id is a UUID");
        assert!(identity.is_local().unwrap());
        let other = HostIdentity {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..identity
        };
        assert!(!other.is_local().unwrap());
    }
}
