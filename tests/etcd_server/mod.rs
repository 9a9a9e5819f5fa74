//! The tests' etcd server: the library's `LocalEtcd` (a real Debian etcd
//! on free ports, data on tmpfs), with panics instead of errors.
use pjrt_crosshost::kv::etcd::local_server::{self, LocalEtcd};

pub struct EtcdServer(LocalEtcd);

impl EtcdServer {
    pub fn start_new() -> EtcdServer {
        EtcdServer(LocalEtcd::start("test").unwrap_or_else(|e| panic!("{e}")))
    }

    pub fn endpoint(&self) -> String {
        self.0.endpoint()
    }

    /// Brings a stopped server back on the same ports and data.
    pub fn start(&mut self) {
        self.0.restart().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Kills the server (a crash), keeping its data.
    pub fn stop(&mut self) {
        self.0.stop();
    }

    /// Freezes the server (SIGSTOP): connected, answering nothing.
    pub fn pause(&self) {
        self.0.pause().unwrap_or_else(|e| panic!("{e}"));
    }

    pub fn resume(&self) {
        self.0.resume().unwrap_or_else(|e| panic!("{e}"));
    }

    /// `etcdctl get --prefix <prefix> --keys-only`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        local_server::keys(&self.endpoint(), prefix).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn ctl(&self, args: &[&str]) -> String {
        local_server::ctl(&self.endpoint(), args).unwrap_or_else(|e| panic!("{e}"))
    }
}
