//! `kv_store=etcd://host:port[,host:port…]`: the etcd members to talk to,
//! in clear; `etcds://…`: the same over TLS.
use crate::status::{invalid_argument, Result};

pub const SCHEME: &str = "etcd://";
pub const TLS_SCHEME: &str = "etcds://";

/// Whether a `kv_store` value names etcd members (either scheme).
pub fn names_etcd(value: &str) -> bool {
    value.starts_with(SCHEME) || value.starts_with(TLS_SCHEME)
}

/// The gRPC endpoints a `kv_store` value names: `http://host:port` for
/// `etcd://`, `https://host:port` for `etcds://`.
pub fn parse(value: &str) -> Result<Vec<String>> {
    let bad = |why: String| {
        invalid_argument(format!(
            "create option 'kv_store' {value:?}: {why} (expected etcd://host:port[,host:port...] \
             or, over TLS, etcds://host:port[,host:port...])"
        ))
    };
    let (list, grpc_scheme) = if let Some(list) = value.strip_prefix(TLS_SCHEME) {
        (list, "https")
    } else {
        let list = value
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad(format!("does not start with {SCHEME} or {TLS_SCHEME}")))?;
        (list, "http")
    };
    let mut endpoints = Vec::new();
    for member in list.split(',') {
        let (host, port) = member
            .rsplit_once(':')
            .ok_or_else(|| bad(format!("member {member:?} has no :port")))?;
        let host_ok = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-_[]:".contains(c));
        if !host_ok {
            return Err(bad(format!("member {member:?}: bad host {host:?}")));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(bad(format!("member {member:?}: bad port {port:?}"))),
        }
        endpoints.push(format!("{grpc_scheme}://{host}:{port}"));
    }
    Ok(endpoints)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn members_become_grpc_endpoints() {
        assert_eq!(
            parse("etcd://127.0.0.1:2379").unwrap(),
            vec!["http://127.0.0.1:2379"]
        );
        assert_eq!(
            parse("etcd://a:1,b.example:2,[::1]:3").unwrap(),
            vec!["http://a:1", "http://b.example:2", "http://[::1]:3"]
        );
        assert_eq!(
            parse("etcds://etcd-a:2379,10.0.0.2:2379").unwrap(),
            vec!["https://etcd-a:2379", "https://10.0.0.2:2379"]
        );
        assert!(names_etcd("etcds://a:1") && names_etcd("etcd://a:1"));
        assert!(!names_etcd("memory:x"));
    }

    #[test]
    fn malformed_values_are_invalid_arguments_that_say_what_is_wrong() {
        for (value, says) in [
            ("etcd:/a:1", "does not start"),
            ("https://a:1", "does not start"),
            ("etcds://", "no :port"),
            ("etcd://", "no :port"),
            ("etcd://a", "no :port"),
            ("etcd://a:0", "bad port"),
            ("etcd://a:70000", "bad port"),
            ("etcd://a:1,", "no :port"),
            ("etcd://a/b:1", "bad host"),
            ("etcd://:1", "bad host"),
        ] {
            let e = parse(value).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.contains(says), "{value}: {e}");
        }
    }
}
