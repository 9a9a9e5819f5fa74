//! `TcpSender`: the sender's end of the TCP transport. It keeps the
//! connections its receivers answered OK and sends the next request to the
//! same receiver on one of them: a batch pays one connect per connection it
//! needs at once, not one per buffer.
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::socket::{is_timeout, unusable_when_idle};
use super::wire::{
    read_response, RequestHeader, Response, COALESCED_PAYLOAD_BYTES, MAX_RECEIPT_LEN,
};
use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::AuthToken;
use crate::transport::registry::Delivered;
use crate::transport::staging::Drain;

/// Each write call is at most this large so the deadline is re-armed often.
const WRITE_CHUNK: usize = 8 << 20;
/// An idle connection older than this is closed rather than reused: the
/// receiver closes one idle for its header deadline (5 s by default), and a
/// request must not race that close.
const IDLE_REUSE: Duration = Duration::from_secs(1);
/// Idle connections kept per receiver; a batch wider than this reconnects
/// for the rest.
const MAX_IDLE_PER_RECEIVER: usize = 16;

/// The TCP transport's sending side, shared by a client's sends.
#[derive(Default)]
pub struct TcpSender {
    idle: Mutex<HashMap<SocketAddr, Vec<(TcpStream, Instant)>>>,
}

/// What a request carries after its header.
pub enum Payload<'a> {
    Bytes(&'a [u8]),
    /// `len` bytes that `write` hands, in order, to the sink it is given
    /// (each chunk goes on the wire before the call returns).
    Chunks {
        len: usize,
        write: &'a mut dyn FnMut(&mut Drain<'_>) -> Result<()>,
    },
}

impl Payload<'_> {
    pub fn len(&self) -> usize {
        match self {
            Payload::Bytes(bytes) => bytes.len(),
            Payload::Chunks { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How one attempt on one connection ended, when not with an answer.
enum Broken {
    /// A kept connection failed before any answer: the receiver had closed
    /// it (idle too long, evicted, restarted). The request goes again on a
    /// new connection.
    Stale(Status),
    Failed(Status),
}

impl TcpSender {
    pub fn new() -> TcpSender {
        TcpSender::default()
    }

    /// Writes `bytes` into the destination registered under `token` at the
    /// receiver `endpoint`, starting `offset` bytes into it, and waits for the
    /// receiver's acknowledgement. `Ok` means the bytes are in the
    /// destination, and says whether `receipt` (the completion key's value,
    /// at most `MAX_RECEIPT_LEN` bytes, else not sent) was applied by the
    /// receiver; if not, only now may the caller publish it. The whole
    /// exchange is bounded by `timeout` (`DEADLINE_EXCEEDED`). A refusal by
    /// the receiver comes back with the receiver's code and message; a lost
    /// connection is `UNAVAILABLE`.
    pub fn send(
        &self,
        endpoint: SocketAddr,
        token: &AuthToken,
        offset: u64,
        bytes: &[u8],
        receipt: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Delivered> {
        let mut payload = Payload::Bytes(bytes);
        self.send_payload(endpoint, token, offset, &mut payload, receipt, timeout)
    }

    /// `send`, with a payload that may be written chunk by chunk (a staged
    /// source, transport/staging/). A retry on a new connection writes it
    /// again from its start.
    pub fn send_payload(
        &self,
        endpoint: SocketAddr,
        token: &AuthToken,
        offset: u64,
        payload: &mut Payload<'_>,
        receipt: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Delivered> {
        let deadline = Deadline::after(endpoint, timeout);
        let header = RequestHeader {
            token: *token,
            offset,
            length: payload.len() as u64,
            receipt: receipt
                .filter(|receipt| receipt.len() <= MAX_RECEIPT_LEN)
                .map(<[u8]>::to_vec)
                .unwrap_or_default(),
        }
        .encode();
        let mut stale = None;
        if let Some(stream) = self.take_idle(endpoint) {
            match exchange(&stream, &header, payload, &deadline, true) {
                Ok(delivered) => {
                    self.keep(endpoint, stream);
                    return Ok(delivered);
                }
                Err(Broken::Failed(status)) => return Err(status),
                Err(Broken::Stale(status)) => {
                    log::debug!(
                        "TCP sender: a kept connection to {endpoint} was closed ({status}); reconnecting"
                    );
                    stale = Some(status);
                }
            }
        }
        let stream = connect(endpoint, &deadline)?;
        match exchange(&stream, &header, payload, &deadline, false) {
            Ok(delivered) => {
                self.keep(endpoint, stream);
                Ok(delivered)
            }
            // The closed connection may have claimed the destination before
            // it broke: this send failed, it was not somebody else's.
            Err(Broken::Failed(status)) if status.code == Code::Unauthenticated => match stale {
                Some(first) => Err(status::unavailable(format!(
                    "{first}; sent again on a new connection, the destination was no longer \
                         open (the first attempt may have claimed it): {}",
                    status.message
                ))),
                None => Err(status),
            },
            Err(Broken::Failed(status) | Broken::Stale(status)) => Err(status),
        }
    }

    /// The newest idle connection to `endpoint` that is still open; older
    /// or closed ones are dropped.
    fn take_idle(&self, endpoint: SocketAddr) -> Option<TcpStream> {
        let mut idle = self.idle.lock();
        let kept = idle.get_mut(&endpoint)?;
        let now = Instant::now();
        kept.retain(|(_, since)| now.duration_since(*since) < IDLE_REUSE);
        while let Some((stream, _)) = kept.pop() {
            if !unusable_when_idle(&stream) {
                return Some(stream);
            }
        }
        None
    }

    fn keep(&self, endpoint: SocketAddr, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let kept = idle.entry(endpoint).or_default();
        if kept.len() < MAX_IDLE_PER_RECEIVER {
            kept.push((stream, Instant::now()));
        }
    }

    /// Closes every kept connection that will not be reused (too old, or
    /// closed by its receiver, which closes idle ones): kept, each would sit
    /// in CLOSE_WAIT until the next send to that receiver. Returns how many
    /// are still kept.
    pub fn close_stale(&self, now: Instant) -> usize {
        let mut idle = self.idle.lock();
        idle.retain(|_, kept| {
            kept.retain(|(stream, since)| {
                now.duration_since(*since) < IDLE_REUSE && !unusable_when_idle(stream)
            });
            !kept.is_empty()
        });
        idle.values().map(Vec::len).sum()
    }

    /// How long a kept connection may be reused: past it a sweep closes it.
    pub fn reuse_window() -> Duration {
        IDLE_REUSE
    }

    /// Idle connections kept (for tests).
    pub fn idle_connections(&self) -> usize {
        self.idle.lock().values().map(Vec::len).sum()
    }
}

fn connect(endpoint: SocketAddr, deadline: &Deadline) -> Result<TcpStream> {
    let left = deadline.remaining().map_err(|_| {
        status::deadline_exceeded(format!(
            "TCP transfer to {endpoint}: the send's deadline passed before a connection could \
             be tried (it waited for its descriptor and for the sends queued before it)"
        ))
    })?;
    let stream = TcpStream::connect_timeout(&endpoint, left)
        .map_err(|error| connection_status(endpoint, "connect", &error, deadline))?;
    stream
        .set_nodelay(true)
        .map_err(|error| connection_status(endpoint, "configure", &error, deadline))?;
    Ok(stream)
}

/// One request and its answer on `stream`. On a `reused` connection, a
/// failure before any answer that says the receiver closed it is `Stale`.
fn exchange(
    stream: &TcpStream,
    header: &[u8],
    payload: &mut Payload<'_>,
    deadline: &Deadline,
    reused: bool,
) -> std::result::Result<Delivered, Broken> {
    let endpoint = deadline.endpoint;
    let sent = match payload {
        Payload::Bytes(bytes) if bytes.len() <= COALESCED_PAYLOAD_BYTES => {
            let mut message = Vec::with_capacity(header.len() + bytes.len());
            message.extend_from_slice(header);
            message.extend_from_slice(bytes);
            write_with_deadline(stream, &message, deadline)
        }
        Payload::Bytes(bytes) => write_with_deadline(stream, header, deadline)
            .and_then(|()| write_with_deadline(stream, bytes, deadline)),
        Payload::Chunks { write, .. } => {
            write_with_deadline(stream, header, deadline).and_then(|()| {
                let mut socket_error = None;
                let written = write(&mut |chunk: &[u8]| {
                    write_with_deadline(stream, chunk, deadline).map_err(|(status, error)| {
                        socket_error = error;
                        status
                    })
                });
                written.map_err(|status| (status, socket_error))
            })
        }
    };
    if let Err((write_error, cause)) = sent {
        // The receiver may have refused the transfer and closed; its answer
        // explains more than the broken pipe does.
        if let Ok(Ok(response)) = read_verdict(stream, Duration::from_millis(100)) {
            if let Err(verdict) = response.outcome {
                return Err(Broken::Failed(refused(endpoint, verdict)));
            }
        }
        return Err(if reused && cause.as_ref().is_some_and(closed_by_peer) {
            Broken::Stale(write_error)
        } else {
            Broken::Failed(write_error)
        });
    }

    let wait = deadline.remaining().map_err(Broken::Failed)?;
    match read_verdict(stream, wait) {
        Ok(Ok(Response {
            outcome: Ok(()),
            receipt_applied,
        })) => Ok(Delivered { receipt_applied }),
        Ok(Ok(Response {
            outcome: Err(verdict),
            ..
        })) => Err(Broken::Failed(refused(endpoint, verdict))),
        Ok(Err(protocol_error)) => Err(Broken::Failed(protocol_error)),
        Err(error) if reused && closed_by_peer(&error) => Err(Broken::Stale(connection_status(
            endpoint,
            "receive the acknowledgement from",
            &error,
            deadline,
        ))),
        Err(error) => Err(Broken::Failed(connection_status(
            endpoint,
            "receive the acknowledgement from",
            &error,
            deadline,
        ))),
    }
}

/// The errors of writing to, or reading from, a connection its peer closed.
fn closed_by_peer(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
    )
}

fn read_verdict(
    stream: &TcpStream,
    wait: Duration,
) -> io::Result<std::result::Result<Response, Status>> {
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
        // `timeout` is what was left of the send's own time when the
        // transfer began.
        let left = Duration::from_millis(self.timeout.as_millis() as u64);
        status::deadline_exceeded(format!(
            "TCP transfer to {} did not complete by the send's deadline ({left:?} were left when \
             it began)",
            self.endpoint
        ))
    }
}

/// Writes all of `bytes`; an error comes with the socket's own error, if
/// it was one.
fn write_with_deadline(
    stream: &TcpStream,
    bytes: &[u8],
    deadline: &Deadline,
) -> std::result::Result<(), (Status, Option<io::Error>)> {
    let mut written = 0;
    while written < bytes.len() {
        let left = deadline.remaining().map_err(|status| (status, None))?;
        stream.set_write_timeout(Some(left)).map_err(|error| {
            (
                status::internal(format!("set_write_timeout: {error}")),
                None,
            )
        })?;
        let end = (written + WRITE_CHUNK).min(bytes.len());
        match (&*stream).write(&bytes[written..end]) {
            Ok(0) => {
                return Err((
                    status::unavailable(format!(
                        "TCP receiver at {} stopped accepting data after {written} of {} bytes",
                        deadline.endpoint,
                        bytes.len()
                    )),
                    None,
                ))
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
                return Err((status, Some(error)));
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
    if is_timeout(error) && what == "connect" {
        // The deadline came first, but the cause is likely the address.
        return status::deadline_exceeded(format!(
            "{}: no connection to it was made in the time left; if this host cannot reach {}, \
             give the receiving process the create option advertise_address=<an address of its \
             host that this host can reach>",
            deadline.exceeded().message,
            endpoint.ip()
        ));
    }
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
