//! `tcp_send`: the sender's end of the TCP transport.
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::socket::{is_timeout, set_large_buffers};
use super::wire::{read_response, RequestHeader};
use crate::status::{self, Result, Status};
use crate::transport::auth_token::AuthToken;

/// Payloads up to this size go out in the same write as the header.
const COALESCE_LIMIT: usize = 64 << 10;
/// Each write call is at most this large so the deadline is re-armed often.
const WRITE_CHUNK: usize = 8 << 20;

/// Writes `bytes` into the destination registered under `token` at the
/// receiver `endpoint`, starting `offset` bytes into it, and waits for the
/// receiver's acknowledgement. `Ok` means the bytes are in the destination;
/// only then may the caller publish the completion key. The whole exchange
/// is bounded by `timeout` (`DEADLINE_EXCEEDED`). A refusal by the receiver
/// comes back with the receiver's code and message; a lost connection is
/// `UNAVAILABLE`.
pub fn tcp_send(
    endpoint: SocketAddr,
    token: &AuthToken,
    offset: u64,
    bytes: &[u8],
    timeout: Duration,
) -> Result<()> {
    let deadline = Deadline::after(endpoint, timeout);
    let stream = TcpStream::connect_timeout(&endpoint, deadline.remaining()?)
        .map_err(|error| connection_status(endpoint, "connect", &error, &deadline))?;
    stream
        .set_nodelay(true)
        .map_err(|error| connection_status(endpoint, "configure", &error, &deadline))?;
    set_large_buffers(&stream);

    let header = RequestHeader {
        token: *token,
        offset,
        length: bytes.len() as u64,
    }
    .encode();
    let sent = if bytes.len() <= COALESCE_LIMIT {
        let mut message = Vec::with_capacity(header.len() + bytes.len());
        message.extend_from_slice(&header);
        message.extend_from_slice(bytes);
        write_with_deadline(&stream, &message, &deadline)
    } else {
        write_with_deadline(&stream, &header, &deadline)
            .and_then(|()| write_with_deadline(&stream, bytes, &deadline))
    };
    if let Err(write_error) = sent {
        // The receiver may have refused the transfer and closed; its answer
        // explains more than the broken pipe does.
        if let Ok(Ok(Err(verdict))) = read_verdict(&stream, Duration::from_millis(100)) {
            return Err(refused(endpoint, verdict));
        }
        return Err(write_error);
    }

    let wait = deadline.remaining()?;
    match read_verdict(&stream, wait) {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(verdict))) => Err(refused(endpoint, verdict)),
        Ok(Err(protocol_error)) => Err(protocol_error),
        Err(error) => Err(connection_status(
            endpoint,
            "receive the acknowledgement from",
            &error,
            &deadline,
        )),
    }
}

fn read_verdict(
    stream: &TcpStream,
    wait: Duration,
) -> io::Result<std::result::Result<Result<()>, Status>> {
    stream.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
    read_response(&mut &*stream)
}

fn refused(endpoint: SocketAddr, verdict: Status) -> Status {
    Status::new(
        verdict.code,
        format!(
            "TCP receiver at {endpoint} refused the transfer: {}",
            verdict.message
        ),
    )
}

struct Deadline {
    endpoint: SocketAddr,
    timeout: Duration,
    at: Instant,
}

impl Deadline {
    fn after(endpoint: SocketAddr, timeout: Duration) -> Deadline {
        Deadline {
            endpoint,
            timeout,
            at: Instant::now() + timeout,
        }
    }

    fn remaining(&self) -> Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.exceeded());
        }
        Ok(left)
    }

    fn exceeded(&self) -> Status {
        status::deadline_exceeded(format!(
            "TCP transfer to {} did not complete within {:?}",
            self.endpoint, self.timeout
        ))
    }
}

fn write_with_deadline(stream: &TcpStream, bytes: &[u8], deadline: &Deadline) -> Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        let left = deadline.remaining()?;
        stream
            .set_write_timeout(Some(left))
            .map_err(|error| status::internal(format!("set_write_timeout: {error}")))?;
        let end = (written + WRITE_CHUNK).min(bytes.len());
        match (&*stream).write(&bytes[written..end]) {
            Ok(0) => {
                return Err(status::unavailable(format!(
                    "TCP receiver at {} stopped accepting data after {written} of {} bytes",
                    deadline.endpoint,
                    bytes.len()
                )))
            }
            Ok(count) => written += count,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => {
                let status = if is_timeout(&error) {
                    deadline.exceeded()
                } else {
                    status::unavailable(format!(
                        "lost the connection to TCP receiver at {} after {written} of {} bytes: {error}",
                        deadline.endpoint,
                        bytes.len()
                    ))
                };
                return Err(status);
            }
        }
    }
    Ok(())
}

fn connection_status(
    endpoint: SocketAddr,
    what: &str,
    error: &io::Error,
    deadline: &Deadline,
) -> Status {
    if is_timeout(error) {
        return deadline.exceeded();
    }
    let message = if what == "connect" {
        format!(
            "cannot connect to the TCP receiver at {endpoint}, the address the receiving process \
             advertised: {error}; if this host cannot reach {}, give that process the create option \
             advertise_address=<an address of its host that this host can reach>",
            endpoint.ip()
        )
    } else {
        format!("cannot {what} TCP receiver at {endpoint}: {error}")
    };
    match error.kind() {
        io::ErrorKind::UnexpectedEof => status::unavailable(format!(
            "TCP receiver at {endpoint} closed the connection without acknowledging the transfer"
        )),
        _ => status::unavailable(message),
    }
}
