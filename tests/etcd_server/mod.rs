//! A real etcd server for the tests: the Debian `etcd` binary (3.4, set up
//! by scripts/setup.sh) on free localhost ports, its data on tmpfs
//! (/dev/shm). `stop` kills it (SIGKILL, like a crash) keeping the data;
//! `start` brings it back on the same ports and data. Drop kills it and
//! removes the data; a watchdog shell does the same if the test process
//! itself is killed.
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub struct EtcdServer {
    pub client_port: u16,
    peer_port: u16,
    data: PathBuf,
    etcd: Option<Child>,
    watchdog: Option<Child>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn etcd_binary() -> &'static str {
    for candidate in ["/usr/bin/etcd", "/usr/local/bin/etcd"] {
        if std::path::Path::new(candidate).exists() {
            return candidate;
        }
    }
    panic!(
        "no etcd server binary: scripts/setup.sh installs Debian's etcd-server (make test runs it)"
    )
}

impl EtcdServer {
    pub fn start_new() -> EtcdServer {
        static N: AtomicUsize = AtomicUsize::new(0);
        let data = PathBuf::from(format!(
            "/dev/shm/etcd-test-crosshost-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let mut server = EtcdServer {
            client_port: free_port(),
            peer_port: free_port(),
            data,
            etcd: None,
            watchdog: None,
        };
        server.start();
        server
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn start(&mut self) {
        assert!(self.etcd.is_none(), "already running");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let etcd = Command::new(etcd_binary())
            .args(["--name", "crosshost-test", "--data-dir"])
            .arg(&self.data)
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .arg("--initial-cluster")
            .arg(format!("crosshost-test={peer}"))
            .args(["--logger", "zap", "--log-level", "error"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting etcd");
        let watchdog = Command::new("/bin/sh")
            .arg("-c")
            .arg(
                "while kill -0 \"$1\" 2>/dev/null && kill -0 \"$2\" 2>/dev/null; do sleep 0.5; done; \
                 if ! kill -0 \"$1\" 2>/dev/null; then kill -9 \"$2\" 2>/dev/null; rm -rf \"$3\"; fi",
            )
            .arg("etcd-test-watchdog")
            .arg(std::process::id().to_string())
            .arg(etcd.id().to_string())
            .arg(&self.data)
            .stdin(Stdio::null())
            .spawn()
            .expect("starting the etcd watchdog");
        self.etcd = Some(etcd);
        self.watchdog = Some(watchdog);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.client_port)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not listen within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Listening is not serving: a restarted member elects itself first.
        while !self.healthy() {
            assert!(Instant::now() < deadline, "etcd not healthy within 20 s");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn healthy(&self) -> bool {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &self.endpoint(),
                "--command-timeout=1s",
                "endpoint",
                "health",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Kills the server (a crash), keeping its data for `start`.
    pub fn stop(&mut self) {
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }

    /// `etcdctl get --prefix <prefix> --keys-only`: the keys there now.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args([
                "--endpoints",
                &self.endpoint(),
                "get",
                "--prefix",
                prefix,
                "--keys-only",
            ])
            .output()
            .expect("running etcdctl (Debian etcd-client)");
        assert!(
            out.status.success(),
            "etcdctl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// `etcdctl` with these arguments; its stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(self.endpoint())
            .args(args)
            .output()
            .expect("running etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
