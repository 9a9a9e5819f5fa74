//! `kv_store=etcd://host:port[,host:port…]`: the etcd members to talk to.
use crate::status::{invalid_argument, Result};

pub const SCHEME: &str = "etcd://";

/// The gRPC endpoints (`http://host:port`) a `kv_store` value names.
pub fn parse(value: &str) -> Result<Vec<String>> {
    let bad = |why: String| {
        invalid_argument(format!(
            "create option 'kv_store' {value:?}: {why} (expected etcd://host:port[,host:port...])"
        ))
    };
    let list = value
        .strip_prefix(SCHEME)
        .ok_or_else(|| bad(format!("does not start with {SCHEME}")))?;
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
        endpoints.push(format!("http://{host}:{port}"));
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
    }

    #[test]
    fn malformed_values_are_invalid_arguments_that_say_what_is_wrong() {
        for (value, says) in [
            ("etcd:/a:1", "does not start"),
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
