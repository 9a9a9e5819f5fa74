//! The etcd server of `--kv etcd` when no `--etcd` is given: the Debian
//! `etcd` binary (3.4, set up by scripts/setup.sh) on free localhost ports,
//! its data on tmpfs (/dev/shm). Drop kills it and removes the data, on
//! every way out of the benchmark that unwinds; a watchdog shell does the
//! same if the benchmark itself is killed.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::ffi_client::Result;

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "etcdctl";
const READY_WITHIN: Duration = Duration::from_secs(20);

pub struct EtcdServer {
    pub client_port: u16,
    data: PathBuf,
    etcd: Option<Child>,
    watchdog: Option<Child>,
}

fn free_port() -> Result<u16> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free localhost port for etcd: {e}"))
}

/// `etcdctl` with API v3 against `endpoints` (comma-separated http URLs).
fn etcdctl(endpoints: &str) -> Command {
    let mut c = Command::new(ETCDCTL);
    c.env("ETCDCTL_API", "3")
        .args(["--endpoints", endpoints, "--command-timeout=1s"]);
    c
}

/// Whether `etcdctl endpoint health` says every endpoint is healthy.
pub fn healthy(endpoints: &str) -> bool {
    etcdctl(endpoints)
        .args(["endpoint", "health"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `etcdctl get --prefix <prefix> --keys-only`: the keys there now.
pub fn keys(endpoints: &str, prefix: &str) -> Result<Vec<String>> {
    let out = etcdctl(endpoints)
        .args(["get", "--prefix", prefix, "--keys-only"])
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("running {ETCDCTL}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{ETCDCTL} get --prefix {prefix} --keys-only against {endpoints}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

impl EtcdServer {
    /// Starts a one-member cluster and waits until it serves (20 s at most).
    pub fn start() -> Result<EtcdServer> {
        if !Path::new(ETCD).exists() {
            return Err(format!(
                "--kv etcd without --etcd starts its own etcd server, and there is no {ETCD}: \
                 scripts/setup.sh installs Debian's etcd-server (or pass --etcd etcd://HOST:PORT)"
            ));
        }
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let data = PathBuf::from(format!(
            "/dev/shm/etcd-bench-crosshost-{}",
            std::process::id()
        ));
        // A leftover of an earlier process with this id would be reused.
        let _ = std::fs::remove_dir_all(&data);
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let etcd = Command::new(ETCD)
            .args(["--name", "bench", "--data-dir"])
            .arg(&data)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("bench={peer}"),
                "--logger",
                "zap",
                "--log-level",
                "error",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {ETCD}: {e}"))?;
        // From here on Drop cleans up, whatever fails next.
        let mut server = EtcdServer {
            client_port,
            data,
            etcd: Some(etcd),
            watchdog: None,
        };
        let etcd_pid = server.etcd.as_ref().map(Child::id).unwrap_or_default();
        server.watchdog = Command::new("/bin/sh")
            .arg("-c")
            .arg(
                "while kill -0 \"$1\" 2>/dev/null && kill -0 \"$2\" 2>/dev/null; do sleep 0.5; done; \
                 if ! kill -0 \"$1\" 2>/dev/null; then kill -9 \"$2\" 2>/dev/null; rm -rf \"$3\"; fi",
            )
            .arg("etcd-bench-watchdog")
            .arg(std::process::id().to_string())
            .arg(etcd_pid.to_string())
            .arg(&server.data)
            .stdin(Stdio::null())
            .spawn()
            .ok();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(Ok(Some(status))) = server.etcd.as_mut().map(Child::try_wait) {
                return Err(format!(
                    "{ETCD} exited ({status}) before serving on {client} (see its messages above)"
                ));
            }
            if healthy(&client) {
                return Ok(server);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{ETCD} on {client} not healthy within {READY_WITHIN:?} \
                     ({ETCDCTL} endpoint health)"
                ));
            }
            // Polling readiness: etcd offers no notification of it.
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The `kv_store` value naming this server.
    pub fn kv_store(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
