//! A throwaway one-member etcd server on this host, for the tests and the
//! benchmark: the Debian `etcd` binary (3.4, installed by scripts/setup.sh)
//! on free localhost ports, its data on tmpfs (/dev/shm). `stop` kills it
//! like a crash and keeps the data; `restart` brings it back on the same
//! ports. Drop kills it and removes the data; a watchdog shell does the same
//! if the owning process is killed. Only std: it never links the client.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const ETCD_CANDIDATES: [&str; 2] = ["/usr/bin/etcd", "/usr/local/bin/etcd"];
const ETCDCTL: &str = "etcdctl";
const READY_WITHIN: Duration = Duration::from_secs(20);

pub struct LocalEtcd {
    pub client_port: u16,
    peer_port: u16,
    data: PathBuf,
    etcd: Option<Child>,
    watchdog: Option<Child>,
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free localhost port for etcd: {e}"))
}

fn etcd_binary() -> Result<&'static str, String> {
    ETCD_CANDIDATES
        .into_iter()
        .find(|p| Path::new(p).exists())
        .ok_or_else(|| {
            format!(
                "no etcd server binary ({}): scripts/setup.sh installs Debian's etcd-server",
                ETCD_CANDIDATES.join(", ")
            )
        })
}

/// `etcdctl` with API v3 against `endpoints` (comma-separated http URLs).
pub fn etcdctl(endpoints: &str) -> Command {
    let mut c = Command::new(ETCDCTL);
    c.env("ETCDCTL_API", "3")
        .args(["--endpoints", endpoints, "--command-timeout=2s"]);
    c
}

/// Whether `etcdctl endpoint health` says every endpoint serves.
pub fn healthy(endpoints: &str) -> bool {
    etcdctl(endpoints)
        .args(["endpoint", "health"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `etcdctl` with `args`; its stdout, or what it said on failure.
pub fn ctl(endpoints: &str, args: &[&str]) -> Result<String, String> {
    let out = etcdctl(endpoints)
        .args(args)
        .output()
        .map_err(|e| format!("running {ETCDCTL} (Debian etcd-client): {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{ETCDCTL} {args:?} against {endpoints}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `etcdctl get --prefix <prefix> --keys-only`: the keys there now.
pub fn keys(endpoints: &str, prefix: &str) -> Result<Vec<String>, String> {
    Ok(ctl(endpoints, &["get", "--prefix", prefix, "--keys-only"])?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect())
}

impl LocalEtcd {
    /// Starts a server whose data dir is `/dev/shm/etcd-<label>-crosshost-…`
    /// and waits until it serves (20 s at most).
    pub fn start(label: &str) -> Result<LocalEtcd, String> {
        static N: AtomicUsize = AtomicUsize::new(0);
        let data = PathBuf::from(format!(
            "/dev/shm/etcd-{label}-crosshost-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        // A leftover of an earlier process with this id would be reused.
        let _ = std::fs::remove_dir_all(&data);
        let mut server = LocalEtcd {
            client_port: free_port()?,
            peer_port: free_port()?,
            data,
            etcd: None,
            watchdog: None,
        };
        server.restart()?;
        Ok(server)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The `kv_store` value naming this server.
    pub fn kv_store(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// (Re)starts the server on its ports and data; returns once it serves.
    pub fn restart(&mut self) -> Result<(), String> {
        if self.etcd.is_some() {
            return Err("etcd is already running".into());
        }
        let etcd = etcd_binary()?;
        let client = self.endpoint();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(etcd)
            .args(["--name", "crosshost", "--data-dir"])
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .arg("--initial-cluster")
            .arg(format!("crosshost={peer}"))
            .args(["--logger", "zap", "--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {etcd}: {e}"))?;
        let etcd_pid = child.id();
        // From here on Drop cleans up, whatever fails next.
        self.etcd = Some(child);
        self.watchdog = Command::new("/bin/sh")
            .arg("-c")
            .arg(
                "while kill -0 \"$1\" 2>/dev/null && kill -0 \"$2\" 2>/dev/null; do sleep 0.5; done; \
                 if ! kill -0 \"$1\" 2>/dev/null; then kill -9 \"$2\" 2>/dev/null; rm -rf \"$3\"; fi",
            )
            .arg("etcd-watchdog")
            .arg(std::process::id().to_string())
            .arg(etcd_pid.to_string())
            .arg(&self.data)
            .stdin(Stdio::null())
            .spawn()
            .ok();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if let Some(Ok(Some(status))) = self.etcd.as_mut().map(Child::try_wait) {
                return Err(format!(
                    "{etcd} exited ({status}) before serving on {client} (see its messages above)"
                ));
            }
            // Listening is not serving: a restarted member elects itself first.
            if healthy(&client) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{etcd} on {client} not healthy within {READY_WITHIN:?} ({ETCDCTL} endpoint health)"
                ));
            }
            // Polling readiness: etcd offers no notification of it.
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Freezes the server (SIGSTOP): its sockets stay open and nothing is
    /// answered, as an etcd starved of CPU; `resume` thaws it.
    pub fn pause(&self) -> Result<(), String> {
        self.signal("-STOP")
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) -> Result<(), String> {
        self.signal("-CONT")
    }

    fn signal(&self, which: &str) -> Result<(), String> {
        let pid = self.etcd.as_ref().ok_or("etcd is not running")?.id();
        let status = Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .map_err(|e| format!("kill {which} {pid}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("kill {which} {pid}: {status}"))
        }
    }

    /// Kills the server (a crash), keeping its data for `restart`.
    pub fn stop(&mut self) {
        for mut child in [self.etcd.take(), self.watchdog.take()]
            .into_iter()
            .flatten()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
