//! The value written to a completion key: a `Receipt`. Versioned text,
//! compact and readable in a store dump:
//!
//! ```text
//! xr1 ok <nonce>
//! xr1 err <nonce> <code> <message...>
//! xr1 cancel <nonce>
//! ```
//!
//! `<nonce>` is lowercase hex (the per-buffer nonce from the descriptor),
//! `<code>` the decimal `PJRT_Error_Code` (1..=16), `<message>` the rest of
//! the value, UTF-8. Decoding is strict: anything else is `INVALID_ARGUMENT`.
use crate::status::{self, Code, Result, Status};

const VERSION: &str = "xr1";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Receipt {
    /// The sender finished writing the buffer.
    Ok { nonce: u64 },
    /// The sender failed; the receive takes this status.
    Error { nonce: u64, status: Status },
    /// A cancellation wake-up (the receiver's own, or the sender's).
    Cancel { nonce: u64 },
}

impl Receipt {
    pub fn nonce(&self) -> u64 {
        match self {
            Receipt::Ok { nonce } | Receipt::Error { nonce, .. } | Receipt::Cancel { nonce } => {
                *nonce
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        match self {
            Receipt::Ok { nonce } => format!("{VERSION} ok {nonce:x}"),
            Receipt::Cancel { nonce } => format!("{VERSION} cancel {nonce:x}"),
            Receipt::Error { nonce, status } => format!(
                "{VERSION} err {nonce:x} {} {}",
                status.code as i32, status.message
            ),
        }
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Receipt> {
        let bad = |why: &str| {
            let shown = String::from_utf8_lossy(&bytes[..bytes.len().min(64)]).into_owned();
            status::invalid_argument(format!("receipt {shown:?}: {why}"))
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad("not UTF-8"))?;
        let mut parts = text.splitn(5, ' ');
        let version = parts.next().unwrap_or_default();
        if version != VERSION {
            return Err(bad("unknown version (expected xr1)"));
        }
        let kind = parts.next().ok_or_else(|| bad("missing kind"))?;
        let nonce = parts.next().ok_or_else(|| bad("missing nonce"))?;
        let nonce_ok = !nonce.is_empty()
            && nonce.len() <= 16
            && nonce
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !nonce_ok {
            return Err(bad("nonce is not lowercase hex"));
        }
        let nonce = u64::from_str_radix(nonce, 16).map_err(|_| bad("nonce out of range"))?;
        let code = parts.next();
        let message = parts.next();
        match (kind, code, message) {
            ("ok", None, None) => Ok(Receipt::Ok { nonce }),
            ("cancel", None, None) => Ok(Receipt::Cancel { nonce }),
            ("err", Some(code), message) => {
                let raw: i32 = code
                    .parse()
                    .map_err(|_| bad("error code is not a number"))?;
                if !(1..=16).contains(&raw) {
                    return Err(bad("error code out of range 1..=16"));
                }
                Ok(Receipt::Error {
                    nonce,
                    status: Status::new(Code::from_raw(raw), message.unwrap_or_default()),
                })
            }
            ("ok" | "cancel", _, _) => Err(bad("trailing fields")),
            _ => Err(bad("unknown kind (expected ok, err or cancel)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips() {
        for receipt in [
            Receipt::Ok { nonce: 0 },
            Receipt::Ok { nonce: u64::MAX },
            Receipt::Cancel { nonce: 42 },
            Receipt::Error {
                nonce: 7,
                status: status::data_loss("peer died: a b  c"),
            },
            Receipt::Error {
                nonce: 7,
                status: status::internal(""),
            },
        ] {
            assert_eq!(Receipt::decode(&receipt.encode()).unwrap(), receipt);
        }
        assert_eq!(Receipt::Ok { nonce: 255 }.encode(), b"xr1 ok ff");
    }

    #[test]
    fn garbage_is_rejected_with_invalid_argument_naming_the_problem() {
        for (bytes, why) in [
            (&b""[..], "version"),
            (b"xr2 ok 1", "version"),
            (b"xr1", "kind"),
            (b"xr1 ok", "nonce"),
            (b"xr1 ok 1F", "hex"),
            (b"xr1 ok 11111111111111111", "hex"),
            (b"xr1 ok 1 2", "trailing"),
            (b"xr1 done 1", "unknown kind"),
            (b"xr1 err 1 0 m", "range"),
            (b"xr1 err 1 x m", "number"),
            (b"\xff\xfe", "UTF-8"),
        ] {
            let err = Receipt::decode(bytes).unwrap_err();
            assert_eq!(err.code, Code::InvalidArgument);
            assert!(err.message.contains(why), "{err} should mention {why}");
        }
    }
}
