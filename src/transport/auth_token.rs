//! `AuthToken`: the 32-byte secret a receiver puts in a descriptor and a
//! sender must present before it may write into the destination. Compared in
//! constant time; never printed.
use std::fmt;

use super::random::fill_random;
use crate::status::Result;

pub const AUTH_TOKEN_LEN: usize = 32;

/// Equality (`==`, and so `HashMap` lookups) is the constant-time compare.
#[derive(Clone, Copy)]
pub struct AuthToken([u8; AUTH_TOKEN_LEN]);

impl AuthToken {
    /// A fresh token from the kernel's CSPRNG.
    pub fn generate() -> Result<AuthToken> {
        let mut bytes = [0u8; AUTH_TOKEN_LEN];
        fill_random(&mut bytes)?;
        Ok(AuthToken(bytes))
    }

    pub fn from_bytes(bytes: [u8; AUTH_TOKEN_LEN]) -> AuthToken {
        AuthToken(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; AUTH_TOKEN_LEN] {
        &self.0
    }

    /// Equality whose running time does not depend on where the tokens differ.
    pub fn constant_time_eq(&self, other: &AuthToken) -> bool {
        let difference = self
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        // black_box keeps the optimiser from turning the fold into an early exit.
        std::hint::black_box(difference) == 0
    }
}

impl PartialEq for AuthToken {
    fn eq(&self, other: &AuthToken) -> bool {
        self.constant_time_eq(other)
    }
}

impl Eq for AuthToken {}

impl std::hash::Hash for AuthToken {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_differ_and_compare_correctly() {
        let a = AuthToken::generate().unwrap();
        let b = AuthToken::generate().unwrap();
        assert!(a.constant_time_eq(&a));
        assert!(!a.constant_time_eq(&b));
        let mut flipped = *a.as_bytes();
        flipped[31] ^= 1;
        assert!(!a.constant_time_eq(&AuthToken::from_bytes(flipped)));
    }

    #[test]
    fn debug_does_not_leak_the_secret() {
        let token = AuthToken::from_bytes([0xab; AUTH_TOKEN_LEN]);
        assert_eq!(format!("{token:?}"), "AuthToken(<redacted>)");
    }
}
