//! Unpredictable bytes from the kernel (`getrandom(2)`), for auth tokens,
//! nonces and shared-memory names. Never a user-space PRNG: these values guard
//! memory that other processes can write.
use crate::status::{self, Result};

/// Fills `buf` with bytes from the kernel's CSPRNG. Blocks only until the
/// kernel pool is initialised at boot (never afterwards).
pub fn fill_random(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid, writable slice of `rest.len()` bytes that
        // lives across the call; getrandom writes at most that many bytes.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if got < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(status::internal(format!(
                "getrandom failed while generating random bytes: {error}"
            )));
        }
        filled += got as usize;
    }
    Ok(())
}

/// A random `u64` (used for per-buffer nonces).
pub fn random_u64() -> Result<u64> {
    let mut bytes = [0u8; 8];
    fill_random(&mut bytes)?;
    Ok(u64::from_le_bytes(bytes))
}

/// `count` random bytes as lowercase hex (2 × `count` characters).
pub fn random_hex(count: usize) -> Result<String> {
    let mut bytes = vec![0u8; count];
    fill_random(&mut bytes)?;
    Ok(crate::transport::hex::encode(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_draws_differ_and_hex_has_the_right_shape() {
        let first = random_hex(16).unwrap();
        let second = random_hex(16).unwrap();
        assert_eq!(first.len(), 32);
        assert!(first.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(first, second);
        assert_ne!(random_u64().unwrap(), random_u64().unwrap());
    }

    #[test]
    fn fills_large_and_empty_buffers() {
        let mut empty = [];
        fill_random(&mut empty).unwrap();
        let mut large = vec![0u8; 1 << 20];
        fill_random(&mut large).unwrap();
        assert!(large.iter().any(|&byte| byte != 0));
    }
}
