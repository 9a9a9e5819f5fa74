//! The doctor's store for `coordinator=host:port`: process 0 serves a small
//! key-value store on that port, as JAX's coordination service runs in
//! process 0 at `jax.distributed.initialize`'s coordinator address, and
//! every process hands it to its client as the PJRT KV callbacks (session
//! through the callbacks, transfer keys over control links: what a JAX job
//! does). It lives as long as the doctor's run.
//!
//! It authenticates nobody, like JAX's coordination service: whoever
//! reaches the port during the run could read the session's values, the
//! control secret among them, unless `job_secret_file` seals them.
//!
//! Wire: one request per connection, one line each way, keys and values in
//! hex. `PUT key value` → `OK`; `GET key timeout_ms` (waits) and `TRY key`
//! → `VAL value` or `NONE`; `DEL key` → `OK`.
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::kv::callback::RawKvCallbacks;
use crate::status::{self, Result};

#[derive(Default)]
struct Board {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// Process 0's server (its thread ends with the process).
pub struct RendezvousServer {
    pub address: SocketAddr,
}

impl RendezvousServer {
    /// Listens on every interface at `coordinator`'s port.
    pub fn start(coordinator: &str) -> Result<RendezvousServer> {
        let port = coordinator
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .ok_or_else(|| {
                status::invalid_argument(format!("coordinator {coordinator:?}: expected host:port"))
            })?;
        let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            status::unavailable(format!(
                "process 0 cannot serve the coordinator's store on port {port}: {e}"
            ))
        })?;
        let address = listener
            .local_addr()
            .map_err(|e| status::internal(e.to_string()))?;
        let board = Arc::new(Board::default());
        std::thread::Builder::new()
            .name("crosshost-doctor-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let board = board.clone();
                    let _ = std::thread::Builder::new()
                        .name("crosshost-doctor-call".into())
                        .spawn(move || serve(&board, stream));
                }
            })
            .map_err(|e| status::resource_exhausted(e.to_string()))?;
        Ok(RendezvousServer { address })
    }
}

fn serve(board: &Board, stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let reply = match words.as_slice() {
        ["PUT", key, value] => match (unhex(key), unhex(value)) {
            (Some(key), Some(value)) => {
                board.values.lock().insert(text(key), value);
                board.changed.notify_all();
                "OK".to_string()
            }
            _ => "BAD".to_string(),
        },
        ["GET", key, timeout_ms] => {
            let wait = Duration::from_millis(timeout_ms.parse().unwrap_or(0));
            let deadline = Instant::now() + wait;
            let key = unhex(key).map(text).unwrap_or_default();
            let mut values = board.values.lock();
            loop {
                if let Some(v) = values.get(&key) {
                    break format!("VAL {}", hex(v));
                }
                if board.changed.wait_until(&mut values, deadline).timed_out() {
                    break values
                        .get(&key)
                        .map_or("NONE".to_string(), |v| format!("VAL {}", hex(v)));
                }
            }
        }
        ["TRY", key] => {
            let key = unhex(key).map(text).unwrap_or_default();
            board
                .values
                .lock()
                .get(&key)
                .map_or("NONE".to_string(), |v| format!("VAL {}", hex(v)))
        }
        ["DEL", key] => {
            let key = unhex(key).map(text).unwrap_or_default();
            board.values.lock().remove(&key);
            "OK".to_string()
        }
        _ => "BAD".to_string(),
    };
    let _ = (&stream).write_all(format!("{reply}\n").as_bytes());
}

/// A process's way to the coordinator's store, as PJRT KV callbacks.
pub struct RendezvousClient {
    coordinator: String,
    /// Bound on connecting (process 0 may start after us) and on a call.
    timeout: Duration,
}

impl RendezvousClient {
    pub fn new(coordinator: &str, timeout: Duration) -> RendezvousClient {
        RendezvousClient {
            coordinator: coordinator.to_string(),
            timeout,
        }
    }

    fn call(&self, request: String, wait: Duration) -> Result<String> {
        let deadline = Instant::now() + self.timeout;
        let stream = loop {
            let tried = self
                .coordinator
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut addrs| addrs.next().ok_or_else(|| "no address".to_string()))
                .and_then(|addr| {
                    TcpStream::connect_timeout(&addr, self.timeout).map_err(|e| e.to_string())
                });
            match tried {
                Ok(stream) => break stream,
                // Process 0 (which serves it) may not have started yet.
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => {
                    return Err(status::unavailable(format!(
                        "cannot reach the coordinator's store at {} (process 0 serves it): {e}",
                        self.coordinator
                    )))
                }
            }
        };
        let _ = stream.set_read_timeout(Some(wait + self.timeout));
        (&stream)
            .write_all(format!("{request}\n").as_bytes())
            .map_err(|e| status::unavailable(format!("coordinator {}: {e}", self.coordinator)))?;
        let mut reply = String::new();
        BufReader::new(&stream)
            .read_line(&mut reply)
            .map_err(|e| status::unavailable(format!("coordinator {}: {e}", self.coordinator)))?;
        Ok(reply.trim().to_string())
    }

    fn value(reply: &str, key: &str, missing: status::Code) -> Result<Vec<u8>> {
        match reply.strip_prefix("VAL ") {
            Some(v) => unhex(v).ok_or_else(|| status::internal("coordinator: a bad value")),
            None => Err(status::Status::new(
                missing,
                format!("coordinator: no value at {key}"),
            )),
        }
    }
}

impl RawKvCallbacks for RendezvousClient {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let reply = self.call(
            format!("GET {} {}", hex(key.as_bytes()), timeout.as_millis()),
            timeout,
        )?;
        Self::value(&reply, key, status::Code::DeadlineExceeded)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let reply = self.call(format!("TRY {}", hex(key.as_bytes())), Duration::ZERO)?;
        Self::value(&reply, key, status::Code::NotFound)
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let reply = self.call(
            format!("PUT {} {}", hex(key.as_bytes()), hex(value)),
            Duration::ZERO,
        )?;
        match reply.as_str() {
            "OK" => Ok(()),
            other => Err(status::internal(format!("coordinator: {other}"))),
        }
    }

    fn delete(&self, key: &str) -> Option<Result<()>> {
        Some(
            self.call(format!("DEL {}", hex(key.as_bytes())), Duration::ZERO)
                .map(|_| ()),
        )
    }

    fn has_delete(&self) -> bool {
        true
    }
}

/// Hex, with "-" for nothing (a field that must not be empty).
pub(super) fn hex(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "-".into();
    }
    crate::transport::hex::encode(bytes)
}

pub(super) fn unhex(text: &str) -> Option<Vec<u8>> {
    if text == "-" {
        return Some(Vec::new());
    }
    crate::transport::hex::decode(text)
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn puts_gets_that_wait_and_deletes_go_through_the_coordinator() {
        let server = RendezvousServer::start("127.0.0.1:0").unwrap();
        let address = format!("127.0.0.1:{}", server.address.port());
        let client = RendezvousClient::new(&address, Duration::from_secs(5));
        assert_eq!(
            client.try_get("a").unwrap_err().code,
            status::Code::NotFound
        );
        assert_eq!(
            client.get("a", Duration::from_millis(50)).unwrap_err().code,
            status::Code::DeadlineExceeded
        );
        let writer = RendezvousClient::new(&address, Duration::from_secs(5));
        let waiting = std::thread::spawn(move || writer_put_after_get(writer));
        assert_eq!(client.get("b", Duration::from_secs(5)).unwrap(), b"\x00two");
        waiting.join().unwrap();
        client.put("empty", b"").unwrap();
        assert_eq!(client.try_get("empty").unwrap(), b"");
        client.delete("b").unwrap().unwrap();
        assert!(client.try_get("b").is_err());
    }

    fn writer_put_after_get(writer: RendezvousClient) {
        writer.put("b", b"\x00two").unwrap();
    }
}
