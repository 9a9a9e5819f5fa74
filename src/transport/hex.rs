//! Bytes as lowercase hex, the one text form the plugin writes binary
//! values in (session entries, secrets, tokens in logs, test tools).

/// `bytes` as lowercase hex, two characters a byte.
pub fn encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes `text` spells in hex (either case); `None` for an odd length
/// or a character that is not a hex digit.
pub fn decode(text: &str) -> Option<Vec<u8>> {
    // `from_str_radix` alone would take a sign ("+1").
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_non_hex_is_refused() {
        let bytes = [0u8, 1, 0x7f, 0x80, 0xff];
        assert_eq!(encode(&bytes), "00017f80ff");
        assert_eq!(decode("00017F80ff").unwrap(), bytes);
        assert_eq!(decode("").unwrap(), Vec::<u8>::new());
        for bad in ["0", "zz", "0g", "é0", "+1"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }
}
