//! How a process proves itself to etcd and which keys it may touch, as
//! clusters run it: TLS (`kv_store=etcds://…` with `etcd_ca_file`, and a
//! client certificate with `etcd_cert_file` + `etcd_key_file` for etcd's
//! `--client-cert-auth`), etcd's RBAC (`etcd_user` + `etcd_password_file`),
//! and `etcd_key_prefix`, under which every key of the job lives, so that
//! a role granting that prefix is all the job needs.
//!
//! Paths are kept until client creation; `load` reads the files then. The
//! password is only ever held as `Password`, whose `Debug` prints nothing
//! of it, and no error built here quotes a file's contents.
use std::fmt;
use std::path::{Path, PathBuf};

use crate::status::{invalid_argument, Result, Status};

/// The `etcd_*` create options, as given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EtcdAccess {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
    /// Prepended to every key the store reads, writes, deletes or watches.
    pub key_prefix: String,
}

/// A password read from `etcd_password_file`.
#[derive(Clone, PartialEq)]
pub struct Password(String);

impl Password {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Password(<not shown>)")
    }
}

/// PEM files for TLS, read.
#[derive(Clone, Debug, PartialEq)]
pub struct TlsFiles {
    pub ca_pem: Vec<u8>,
    /// Certificate and key, for client-certificate authentication.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// What `load` read: what the connection needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadedAccess {
    pub tls: Option<TlsFiles>,
    pub credentials: Option<(String, Password)>,
    pub key_prefix: String,
}

impl EtcdAccess {
    /// Whether any `etcd_*` access option was given.
    pub fn any_given(&self) -> bool {
        *self != EtcdAccess::default()
    }

    /// The options make sense together, for these endpoints (`https://…`
    /// when `etcds://` was given).
    pub fn check(&self, endpoints: &[String]) -> Result<()> {
        let tls = endpoints.iter().all(|e| e.starts_with("https://"));
        let named = |given: bool, name: &str| given.then(|| name.to_string());
        let tls_options: Vec<String> = [
            named(self.ca_file.is_some(), "etcd_ca_file"),
            named(self.cert_file.is_some(), "etcd_cert_file"),
            named(self.key_file.is_some(), "etcd_key_file"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !tls && !tls_options.is_empty() {
            return Err(bad(format!(
                "{} given, but kv_store names etcd:// (in clear): use etcds://host:port for TLS",
                tls_options.join(", ")
            )));
        }
        if tls && self.ca_file.is_none() {
            return Err(bad(
                "kv_store=etcds://... needs etcd_ca_file=<PEM file of the CA that signed etcd's \
                 server certificate>"
                    .into(),
            ));
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(bad(
                "etcd_cert_file and etcd_key_file go together (the client certificate and its key)"
                    .into(),
            ));
        }
        if self.user.is_some() != self.password_file.is_some() {
            return Err(bad(
                "etcd_user and etcd_password_file go together (etcd's RBAC user and a file \
                 holding its password)"
                    .into(),
            ));
        }
        if self.user.as_deref().is_some_and(str::is_empty) {
            return Err(bad("etcd_user must not be empty".into()));
        }
        let prefix_ok = self
            .key_prefix
            .chars()
            .all(|c| c.is_ascii_graphic() && c != '\\');
        if !prefix_ok || self.key_prefix.len() > 256 {
            return Err(bad(format!(
                "etcd_key_prefix must be at most 256 printable ASCII characters, got {:?}",
                self.key_prefix
            )));
        }
        Ok(())
    }

    /// Reads the files the options name.
    pub fn load(&self) -> Result<LoadedAccess> {
        let tls = match &self.ca_file {
            None => None,
            Some(ca) => Some(TlsFiles {
                ca_pem: read_pem(ca, "etcd_ca_file", "CERTIFICATE")?,
                identity: match (&self.cert_file, &self.key_file) {
                    (Some(cert), Some(key)) => Some((
                        read_pem(cert, "etcd_cert_file", "CERTIFICATE")?,
                        read_pem(key, "etcd_key_file", "PRIVATE KEY")?,
                    )),
                    _ => None,
                },
            }),
        };
        let credentials = match (&self.user, &self.password_file) {
            (Some(user), Some(file)) => Some((user.clone(), read_password(file)?)),
            _ => None,
        };
        Ok(LoadedAccess {
            tls,
            credentials,
            key_prefix: self.key_prefix.clone(),
        })
    }
}

fn bad(why: String) -> Status {
    invalid_argument(format!("PJRT_Client_Create: {why}"))
}

fn read_file(path: &Path, option: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        Status::new(
            crate::status::Code::NotFound,
            format!(
                "PJRT_Client_Create: create option {option}: cannot read {}: {e}",
                path.display()
            ),
        )
    })
}

/// A PEM file holding at least one block whose label ends with `label`
/// (`PRIVATE KEY` takes `EC PRIVATE KEY`, `RSA PRIVATE KEY` too).
fn read_pem(path: &Path, option: &str, label: &str) -> Result<Vec<u8>> {
    let pem = read_file(path, option)?;
    let text = String::from_utf8_lossy(&pem);
    let holds = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("-----BEGIN "))
        .any(|l| l.trim_end_matches('-').ends_with(label));
    if !holds {
        return Err(bad(format!(
            "create option {option}: {} holds no PEM block '{label}'",
            path.display()
        )));
    }
    Ok(pem)
}

/// The password file's first line (a trailing newline is not part of it).
fn read_password(path: &Path) -> Result<Password> {
    let bytes = read_file(path, "etcd_password_file")?;
    let text = String::from_utf8(bytes).map_err(|_| {
        bad(format!(
            "create option etcd_password_file: {} is not UTF-8",
            path.display()
        ))
    })?;
    let password = text.lines().next().unwrap_or("").to_string();
    if password.is_empty() {
        return Err(bad(format!(
            "create option etcd_password_file: {} holds no password",
            path.display()
        )));
    }
    Ok(Password(password))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    fn tls_endpoints() -> Vec<String> {
        vec!["https://127.0.0.1:2379".into()]
    }

    #[test]
    fn options_that_do_not_go_together_are_refused_saying_why() {
        let ca = Some(PathBuf::from("/ca.pem"));
        let cases = [
            (
                EtcdAccess {
                    ca_file: ca.clone(),
                    ..Default::default()
                },
                vec!["http://a:1".to_string()],
                "use etcds://",
            ),
            (EtcdAccess::default(), tls_endpoints(), "needs etcd_ca_file"),
            (
                EtcdAccess {
                    ca_file: ca.clone(),
                    cert_file: Some("/c.pem".into()),
                    ..Default::default()
                },
                tls_endpoints(),
                "go together",
            ),
            (
                EtcdAccess {
                    user: Some("job".into()),
                    ..Default::default()
                },
                vec!["http://a:1".to_string()],
                "etcd_password_file go together",
            ),
            (
                EtcdAccess {
                    key_prefix: "a b".into(),
                    ..Default::default()
                },
                vec!["http://a:1".to_string()],
                "etcd_key_prefix",
            ),
        ];
        for (access, endpoints, says) in cases {
            let e = access.check(&endpoints).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.contains(says), "{access:?}: {e}");
        }
        EtcdAccess {
            ca_file: ca,
            key_prefix: "jobs/a/".into(),
            ..Default::default()
        }
        .check(&tls_endpoints())
        .unwrap();
    }

    #[test]
    fn the_password_is_read_without_its_newline_and_never_printed() {
        let dir = std::env::temp_dir().join(format!("crosshost-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cr3t-value\n").unwrap();
        let loaded = EtcdAccess {
            user: Some("job".into()),
            password_file: Some(file.clone()),
            ..Default::default()
        }
        .load()
        .unwrap();
        let (user, password) = loaded.credentials.clone().unwrap();
        assert_eq!((user.as_str(), password.expose()), ("job", "s3cr3t-value"));
        assert!(!format!("{loaded:?}").contains("s3cr3t"));
        std::fs::write(&file, "\n").unwrap();
        let e = EtcdAccess {
            user: Some("job".into()),
            password_file: Some(file.clone()),
            ..Default::default()
        }
        .load()
        .unwrap_err();
        assert!(e.message.contains("holds no password"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_wrong_pem_file_is_named() {
        let e = EtcdAccess {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        }
        .load()
        .unwrap_err();
        assert_eq!(e.code, Code::NotFound);
        assert!(e.message.contains("etcd_ca_file") && e.message.contains("/nonexistent/ca.pem"));
        let dir = std::env::temp_dir().join(format!("crosshost-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ca.pem");
        std::fs::write(&file, "not a certificate").unwrap();
        let e = EtcdAccess {
            ca_file: Some(file),
            ..Default::default()
        }
        .load()
        .unwrap_err();
        assert!(e.message.contains("no PEM block 'CERTIFICATE'"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
