//! Chunked sends over UCX: a buffer (or its range) as a stream of CHUNK
//! messages (`wire.rs`), each at most the receiver's staging chunk, sent
//! over the workers in turn, answered by one ACK once every byte landed.
//! What they are for: a receiver that lands the bytes through its staging
//! ring (a GPU buffer, or `stage_host_transfers`) cannot take one large
//! message into a ring slot, and a sender that stages its source (GPU, or
//! `stage_host_transfers`) has only a chunk at a time in host memory.
//!
//! Receiver. The first chunk to arrive claims the range from the registry
//! (`DestinationRegistry::claim_chunk`); each later one must lie in it and
//! overlap none taken before. A destination written directly takes each
//! chunk where it belongs, as a DATA part (`worker.rs`). A staged one gets
//! a `StagedStream`: chunks are queued as they arrive (rendezvous data
//! left with UCX until a ring slot is free for it: that is the
//! backpressure), and a thread of its own lands them in order through the
//! destination's pipeline (`StagedDestination::receive_chunks`, waiting for
//! a chunk before it takes a slot for it). Only when the pipeline returned
//! (the last chunk's copy completed) is the receipt applied and the ACK
//! sent; a failure is ACKed too, and whatever UCX still holds is released.
//! A sender whose endpoint fails, or who is lost, fails its streams at
//! once (UNAVAILABLE naming it); a receive that ends raises its pipeline's
//! stop.
//!
//! Sender (`ChunkSender`): the stream's final ACK is awaited by one worker
//! (its home); each chunk is sent by the next worker, forced to rendezvous
//! for a staged receiver (so the receiver pulls it only once it has a slot
//! for it), and says when UCX is done reading its bytes (`Signal`), so
//! that a staging ring's slot comes back only then. The stream fails at the
//! first refusal, failed message or missed deadline, and raises its stop
//! for the pipeline feeding it.
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::transfer::Transfer;
use super::wire::{Ack, ChunkHeader};
use crate::backend::Allocation;
use crate::status::{self, Result, Status};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::WritableDestination;
use crate::transport::registry::{ClaimedChunk, DestinationRegistry, Landing};
use crate::transport::staging::{
    ChunkSource, CopyCompletion, DeviceCopy, Pending, Slot, Staging, Stop,
};

/// A worker of another process: (process, worker index).
pub type Remote = (u32, u16);

/// How long a staged stream waits for a chunk, or for a chunk's copy or
/// receive, before it gives up (DEADLINE_EXCEEDED). A receive that ends
/// (its own timeout, a cancel, its sender lost) stops it long before.
pub const STAGED_PATIENCE: Duration = Duration::from_secs(300);

/// Slices of a wait, between looks at the stop signal.
const WAIT_SLICE: Duration = Duration::from_millis(5);

/// An outcome told once and waited for: UCX is done with a message's bytes
/// (sender), or wrote a chunk into its slot (receiver).
#[derive(Default)]
pub struct Signal {
    outcome: Mutex<Option<Result<()>>>,
    changed: Condvar,
}

impl Signal {
    pub fn new() -> Arc<Signal> {
        Arc::new(Signal::default())
    }

    /// Tells the outcome (the first one told stays).
    pub fn set(&self, outcome: Result<()>) {
        let mut held = self.outcome.lock();
        if held.is_none() {
            *held = Some(outcome);
            self.changed.notify_all();
        }
    }

    fn peek(&self) -> Option<Result<()>> {
        self.outcome.lock().clone()
    }

    fn wait_until(&self, until: Instant) -> Option<Result<()>> {
        let mut held = self.outcome.lock();
        while held.is_none() {
            if self.changed.wait_until(&mut held, until).timed_out() {
                break;
            }
        }
        held.clone()
    }
}

/// Done once every signal is told; a failure told is the completion's
/// error (the bytes are no longer read either way).
pub struct Signals(pub Vec<Arc<Signal>>);

impl CopyCompletion for Signals {
    fn is_done(&mut self) -> Result<bool> {
        for signal in &self.0 {
            match signal.peek() {
                None => return Ok(false),
                Some(Err(e)) => return Err(e),
                Some(Ok(())) => {}
            }
        }
        Ok(true)
    }

    fn wait_until(&mut self, until: Instant) -> Result<bool> {
        for signal in &self.0 {
            match signal.wait_until(until) {
                None => return Ok(false),
                Some(Err(e)) => return Err(e),
                Some(Ok(())) => {}
            }
        }
        Ok(true)
    }
}

// ------------------------------- receiver --------------------------------

/// Rendezvous data UCX keeps for us until we receive or release it.
pub struct HeldData(pub *mut c_void);

// SAFETY: an opaque UCX handle, used only under the lock of the worker that
// handed it out (`ChunkPort`).
unsafe impl Send for HeldData {}

/// The worker that holds a chunk's data, as a stream reaches it
/// (`worker.rs`): every call takes that worker's lock.
pub trait ChunkPort: Send + Sync {
    /// Receives `data` into `target` (`len` bytes); `done` is told once the
    /// bytes are there, or the receive failed.
    ///
    /// # Safety
    /// `target` must stay valid for `len` bytes, and unused by anyone else,
    /// until `done` is told.
    unsafe fn receive(&self, data: HeldData, target: *mut u8, len: usize, done: Arc<Signal>);

    /// Gives `data` back to UCX unread.
    fn release(&self, data: HeldData);

    /// Applies the receipt (if the bytes landed and one came) and sends
    /// `ack` to `peer`.
    fn acknowledge(&self, peer: Remote, ack: Ack, receipt: Option<(Arc<Landing>, Vec<u8>)>);
}

/// One chunk as it arrived.
pub enum Arrived {
    /// Eager bytes, copied out of UCX's buffer.
    Eager(Vec<u8>),
    /// Rendezvous data, still with UCX (through `port`).
    Held {
        data: HeldData,
        port: Arc<dyn ChunkPort>,
    },
}

impl Arrived {
    fn discard(self) {
        if let Arrived::Held { data, port } = self {
            port.release(data);
        }
    }
}

struct Queue {
    /// Chunks not landed yet, by offset: (length, chunk).
    chunks: BTreeMap<u64, (u64, Arrived)>,
    /// Why the stream ended early (its sender is gone).
    ended: Option<Status>,
}

/// A stream into a staged destination, landed by a thread of its own.
pub struct StagedStream {
    token: AuthToken,
    sender: u32,
    home: Remote,
    stream_request: u64,
    range: (u64, u64),
    destination: Arc<dyn WritableDestination>,
    receipt: Option<(Arc<Landing>, Vec<u8>)>,
    /// The worker that sends the stream's ACK.
    ack_port: Arc<dyn ChunkPort>,
    queue: Mutex<Queue>,
    arrived: Condvar,
}

impl StagedStream {
    /// Queues a chunk; one for a stream that ended comes back (with why),
    /// for the caller to refuse: from inside a UCX callback it may not
    /// release rendezvous data itself (that takes the worker's lock).
    fn push(&self, offset: u64, length: u64, chunk: Arrived) -> Result<()> {
        let mut queue = self.queue.lock();
        if let Some(reason) = &queue.ended {
            return Err(reason.clone());
        }
        queue.chunks.insert(offset, (length, chunk));
        self.arrived.notify_all();
        Ok(())
    }

    /// The stream cannot land any more (its sender is gone): the queue
    /// says so to its thread, and the pipeline's stop is raised, so that a
    /// wait for a receive already under way ends too (its slot parked).
    fn end(&self, reason: Status) {
        let mut queue = self.queue.lock();
        queue.ended.get_or_insert(reason.clone());
        self.arrived.notify_all();
        drop(queue);
        if let Some(staged) = self.destination.staged() {
            staged.stop(reason);
        }
    }

    /// Lands the stream through the destination's pipeline, then applies
    /// the receipt and ACKs (or ACKs the failure), and gives back whatever
    /// UCX still holds for it.
    fn run(self: Arc<StagedStream>, streams: Arc<StagedStreams>) {
        let outcome = match self.destination.staged() {
            Some(staged) => {
                let mut source = Source {
                    stream: &self,
                    next: self.range.0,
                };
                staged
                    .receive_chunks(
                        self.range.0 as usize,
                        self.range.1 as usize,
                        &mut source,
                        STAGED_PATIENCE,
                    )
                    .map(|_| ())
            }
            None => Err(status::internal(
                "a staged UCX stream into a destination that is not staged",
            )),
        };
        streams.remove(&self.token);
        let leftover = {
            let mut queue = self.queue.lock();
            queue
                .ended
                .get_or_insert_with(|| status::cancelled("the staged stream ended"));
            std::mem::take(&mut queue.chunks)
        };
        for (_, (_, chunk)) in leftover {
            chunk.discard();
        }
        if let Err(e) = &outcome {
            log::warn!(
                "UCX receiver: a staged stream of {} bytes from process {} failed: {e}",
                self.range.1,
                self.sender
            );
        }
        let landed = outcome.is_ok();
        let ack = Ack {
            request: self.stream_request,
            token: self.token,
            outcome,
            receipt_applied: false,
        };
        let receipt = if landed { self.receipt.clone() } else { None };
        self.ack_port.acknowledge(self.home, ack, receipt);
    }
}

/// The pipeline's view of a stream: its chunks, in order of offset.
struct Source<'a> {
    stream: &'a StagedStream,
    /// Offset of the next chunk to read.
    next: u64,
}

impl Source<'_> {
    /// The next chunk's length, if it came (checked against `max`).
    fn arrived(&self, queue: &Queue, max: usize) -> Result<Option<usize>> {
        if let Some(reason) = &queue.ended {
            return Err(reason.clone());
        }
        let Some((length, _)) = queue.chunks.get(&self.next) else {
            return Ok(None);
        };
        let length = *length as usize;
        if length == 0 || length > max {
            return Err(status::invalid_argument(format!(
                "a staged chunk of {length} bytes at {}, where 1..={max} fit (the sender must \
                 send chunks of at most the receiver's staging_chunk_bytes)",
                self.next
            )));
        }
        Ok(Some(length))
    }
}

impl ChunkSource for Source<'_> {
    fn ready_chunk(&mut self, max: usize) -> Result<Option<usize>> {
        let queue = self.stream.queue.lock();
        self.arrived(&queue, max)
    }

    fn next_chunk(&mut self, max: usize, stop: &Stop) -> Result<usize> {
        let deadline = Instant::now() + STAGED_PATIENCE;
        let mut queue = self.stream.queue.lock();
        loop {
            if let Some(length) = self.arrived(&queue, max)? {
                return Ok(length);
            }
            stop.check()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(status::deadline_exceeded(format!(
                    "the chunk at {} of a staged stream from process {} did not come within \
                     {STAGED_PATIENCE:?}",
                    self.next, self.stream.sender
                )));
            }
            // Woken by a chunk or the stream's end; the stop is looked at
            // every slice.
            self.stream
                .arrived
                .wait_until(&mut queue, deadline.min(now + WAIT_SLICE));
        }
    }

    fn read_chunk(&mut self, slot: &mut Slot, len: usize) -> Result<Pending> {
        let taken = self.stream.queue.lock().chunks.remove(&self.next);
        let Some((length, chunk)) = taken else {
            return Err(status::internal("a staged chunk vanished from its queue"));
        };
        if length as usize != len || len > slot.len() {
            chunk.discard();
            return Err(status::internal("a staged chunk changed length"));
        }
        self.next += length;
        match chunk {
            Arrived::Eager(bytes) => {
                slot.bytes_mut()[..len].copy_from_slice(&bytes);
                Ok(Pending::Done)
            }
            Arrived::Held { data, port } => {
                let done = Signal::new();
                // SAFETY: the slot is the pipeline's, lent to this read: it
                // neither touches nor hands it out before `done` is told
                // (a stopped pipeline parks it behind the completion).
                unsafe { port.receive(data, slot.as_ptr(), len, done.clone()) };
                Ok(Pending::Running(Box::new(Signals(vec![done]))))
            }
        }
    }
}

/// Host bytes a chunked send reads in place (`ChunkSender::send_from`).
pub enum SendBytes {
    /// The source allocation itself (host memory readable in place).
    Memory(Allocation),
    /// A copy of the source, made where it could not be read in place.
    Copy(Arc<Vec<u8>>),
}

/// A stream's chunk and where its bytes go.
pub enum ChunkPlace {
    /// Straight into the destination: the claim (its memory, landing and
    /// progress) for the worker to write through.
    Direct(ClaimedChunk),
    /// Queued for its staged stream's thread.
    Staged,
}

/// The staged streams of a UCX transport, shared by its workers.
#[derive(Default)]
pub struct StagedStreams {
    streams: Mutex<HashMap<AuthToken, Arc<StagedStream>>>,
}

impl StagedStreams {
    pub fn new() -> Arc<StagedStreams> {
        Arc::new(StagedStreams::default())
    }

    /// Takes one arrived chunk: claims it from `registry` (under this
    /// table's lock, so a stream's first chunk is in the table before any
    /// other is looked up), and for a staged destination queues it (`take`
    /// makes the chunk: called only then), starting the stream's thread at
    /// its first chunk. A refusal comes back as the error, and nothing of
    /// the chunk is taken.
    pub fn arrive(
        self: &Arc<Self>,
        registry: &DestinationRegistry,
        header: &ChunkHeader,
        ack_port: &Arc<dyn ChunkPort>,
        take: impl FnOnce() -> Arrived,
    ) -> Result<ChunkPlace> {
        let mut streams = self.streams.lock();
        let claimed = registry.claim_chunk(
            &header.token,
            (header.stream_offset, header.stream_length),
            header.offset,
            header.length,
        )?;
        let Some(staged) = claimed.destination.staged() else {
            return Ok(ChunkPlace::Direct(claimed));
        };
        if header.length as usize > staged.chunk_bytes() {
            return Err(status::invalid_argument(format!(
                "a chunk of {} bytes for a destination staged in {}-byte chunks",
                header.length,
                staged.chunk_bytes()
            )));
        }
        let stream = if claimed.first {
            let stream = Arc::new(StagedStream {
                token: header.token,
                sender: header.sender,
                home: (header.sender, header.home_worker),
                stream_request: header.stream_request,
                range: (header.stream_offset, header.stream_length),
                destination: claimed.destination.clone(),
                receipt: match &claimed.landing {
                    Some(landing) if !header.receipt.is_empty() => {
                        Some((landing.clone(), header.receipt.clone()))
                    }
                    _ => None,
                },
                ack_port: ack_port.clone(),
                queue: Mutex::new(Queue {
                    chunks: BTreeMap::new(),
                    ended: None,
                }),
                arrived: Condvar::new(),
            });
            streams.insert(header.token, stream.clone());
            let (running, table) = (stream.clone(), self.clone());
            let started = crate::sync::threads::spawn(
                "crosshost-ucx-stage",
                crate::sync::threads::Slice::Short,
                move || running.run(table),
            );
            if let Err(e) = started {
                streams.remove(&header.token);
                return Err(status::resource_exhausted(format!(
                    "UCX receiver: no thread for a staged stream: {e}"
                )));
            }
            stream
        } else {
            match streams.get(&header.token) {
                Some(stream) if stream.sender == header.sender => stream.clone(),
                _ => {
                    return Err(status::unauthenticated(
                        "no staged stream takes this chunk (it ended, or another sender's)",
                    ))
                }
            }
        };
        drop(streams);
        // Refused (the stream ended) the chunk is dropped unreleased: the
        // refusal returns it to UCX.
        stream.push(header.offset, header.length, take())?;
        Ok(ChunkPlace::Staged)
    }

    fn remove(&self, token: &AuthToken) {
        self.streams.lock().remove(token);
    }

    /// Process `process` is gone (its endpoint failed, or its link closed):
    /// its staged streams fail now with `reason`.
    pub fn end_from(&self, process: u32, reason: &Status) {
        let ended: Vec<Arc<StagedStream>> = self
            .streams
            .lock()
            .values()
            .filter(|s| s.sender == process)
            .cloned()
            .collect();
        for stream in ended {
            stream.end(reason.clone());
        }
    }

    /// Every stream fails now with `reason` (the transport stops).
    pub fn end_all(&self, reason: &Status) {
        let ended: Vec<Arc<StagedStream>> = self.streams.lock().values().cloned().collect();
        for stream in ended {
            stream.end(reason.clone());
        }
    }

    /// Streams under way (for tests and metrics).
    pub fn count(&self) -> usize {
        self.streams.lock().len()
    }
}

// -------------------------------- sender ---------------------------------

/// What keeps a chunk's bytes mapped while UCX may read them (a staging
/// ring's owner, or the source buffer).
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// How a `ChunkSender` reaches its transport's workers (`transport.rs`).
pub trait ChunkPoster: Send + Sync {
    /// Workers of this process.
    fn workers(&self) -> usize;

    /// Sends one chunk message from worker `worker`.
    fn post(&self, worker: usize, chunk: ChunkOrder);

    /// The stream failed on this side: its home worker stops waiting.
    fn abandon(&self, home: usize, stream_request: u64);
}

/// One CHUNK message for a worker to send.
pub struct ChunkOrder {
    pub peer: u32,
    /// The stream's send, failed by a refusal or a failed message.
    pub transfer: Arc<Transfer>,
    pub deadline: Instant,
    pub timeout: Duration,
    pub header: ChunkHeader,
    pub bytes: *const u8,
    pub keep: KeepAlive,
    /// Told when UCX is done reading the bytes.
    pub sent: Arc<Signal>,
    /// Forced to rendezvous (a staged receiver pulls it when it has room).
    pub rendezvous: bool,
}

// SAFETY: `bytes` is only read, by UCX, while `keep` holds it mapped and
// the sender leaves it unwritten until `sent` is told.
unsafe impl Send for ChunkOrder {}

/// The sending side of one chunked stream.
pub struct ChunkSender {
    pub(super) poster: Arc<dyn ChunkPoster>,
    pub(super) peer: u32,
    pub(super) transfer: Arc<Transfer>,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) header: ChunkHeader,
    pub(super) chunk_limit: usize,
    pub(super) rendezvous: bool,
    pub(super) keep: KeepAlive,
    pub(super) stop: Stop,
    pub(super) next_worker: usize,
}

impl ChunkSender {
    /// Raised when the stream fails (refused, a message failed, its
    /// deadline passed): a pipeline feeding it stops.
    pub fn stop(&self) -> &Stop {
        &self.stop
    }

    /// The largest message: the receiver's chunk (or any size).
    pub fn chunk_limit(&self) -> usize {
        self.chunk_limit
    }

    /// Sends `len` bytes at `bytes`, which belong at `at` in the stream,
    /// as one or more chunk messages; the completion is done once UCX no
    /// longer reads any of them.
    ///
    /// # Safety
    /// `bytes` must be readable for `len` bytes, stay unwritten until the
    /// completion is done, and stay mapped while `keep` (given at opening)
    /// lives.
    pub unsafe fn send(&mut self, bytes: *const u8, len: usize, at: usize) -> Result<Pending> {
        self.stop.check()?;
        let end = (at as u64)
            .checked_add(len as u64)
            .filter(|&end| end <= self.header.stream_length);
        if end.is_none() || len == 0 {
            return Err(status::internal(format!(
                "{len} bytes at {at} of a {}-byte stream",
                self.header.stream_length
            )));
        }
        let mut signals = Vec::new();
        let mut done = 0;
        while done < len {
            let length = self.chunk_limit.min(len - done);
            let sent = Signal::new();
            let mut header = self.header.clone();
            header.offset = self.header.stream_offset + (at + done) as u64;
            header.length = length as u64;
            let worker = self.next_worker % self.poster.workers().max(1);
            self.next_worker += 1;
            self.poster.post(
                worker,
                ChunkOrder {
                    peer: self.peer,
                    transfer: self.transfer.clone(),
                    deadline: self.deadline,
                    timeout: self.timeout,
                    header,
                    // SAFETY: inside the caller's `len` readable bytes.
                    bytes: unsafe { bytes.add(done) },
                    keep: self.keep.clone(),
                    sent: sent.clone(),
                    rendezvous: self.rendezvous,
                },
            );
            signals.push(sent);
            done += length;
        }
        Ok(Pending::Running(Box::new(Signals(signals))))
    }

    /// Sends the whole stream straight from host memory at `bytes` (the
    /// source itself, no staging on this side) and waits until UCX read
    /// it all.
    ///
    /// # Safety
    /// As `send`, for the stream's whole length.
    pub unsafe fn send_all(&mut self, bytes: *const u8, patience: Duration) -> Result<()> {
        let len = self.header.stream_length as usize;
        // SAFETY: the caller's promise covers the whole stream.
        let mut pending = unsafe { self.send(bytes, len, 0) }?;
        let deadline = Instant::now() + patience;
        loop {
            self.stop.check()?;
            let now = Instant::now();
            if pending.wait_until(deadline.min(now + WAIT_SLICE))? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(status::deadline_exceeded(format!(
                    "UCX did not send a {len}-byte stream within {patience:?}"
                )));
            }
        }
    }

    /// Sends the stream through `staging`'s send ring, `device` copying the
    /// source into it chunk by chunk, each slot on the wire while the next
    /// is filled; returns the number of chunks.
    pub fn send_through_ring(
        &mut self,
        staging: &Arc<Staging>,
        device: &dyn DeviceCopy,
        patience: Duration,
    ) -> Result<usize> {
        let len = self.header.stream_length as usize;
        // The ring outlives every message of the stream that reads a slot.
        self.keep = staging.clone();
        let stop = self.stop.clone();
        let mut wire = |bytes: &[u8], at: usize| {
            // SAFETY: a send-ring slot: the pipeline leaves it unwritten
            // until the completion returned here is done (it parks the slot
            // if it stops first), and the ring lives as long as the stream's
            // keep-alive, set to it above.
            unsafe { self.send(bytes.as_ptr(), bytes.len(), at) }
        };
        staging.send_async(device, 0, len, &mut wire, &stop, patience)
    }

    /// Sends the whole stream straight from `source`, with no staging on
    /// this side, and waits until UCX read it all.
    pub fn send_from(&mut self, source: SendBytes, patience: Duration) -> Result<()> {
        let len = self.header.stream_length as usize;
        let (pointer, keep): (*const u8, KeepAlive) = match source {
            SendBytes::Memory(memory) => match memory.host_pointer()? {
                Some(address) if memory.len() >= len => (address as *const u8, Arc::new(memory)),
                _ => {
                    return Err(status::internal(format!(
                        "a {len}-byte UCX stream from memory that is not {len} bytes of host \
                         memory readable in place"
                    )))
                }
            },
            SendBytes::Copy(bytes) if bytes.len() >= len => (bytes.as_ptr(), bytes),
            SendBytes::Copy(bytes) => {
                return Err(status::internal(format!(
                    "a {len}-byte UCX stream from a {}-byte copy",
                    bytes.len()
                )))
            }
        };
        self.keep = keep;
        // SAFETY: `len` bytes of host memory at `pointer` (checked above):
        // an allocation's `host_pointer` stays valid while the allocation
        // lives and unwritten once defined (`DeviceMemory::host_pointer`),
        // a copy is never written after it was made, and either is the
        // stream's keep-alive, held by every message still read.
        unsafe { self.send_all(pointer, patience) }
    }

    /// The stream failed on this side (its source, its pipeline): the
    /// send is told, and its home worker stops waiting for the ACK.
    pub fn fail(&self, reason: Status) {
        self.stop.raise(reason.clone());
        self.transfer.fail(reason);
        self.poster
            .abandon(self.header.home_worker as usize, self.header.stream_request);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use crate::transport::destination::HeapDestination;
    use crate::transport::staging::{StagedDestination, Staging, StagingConfig};

    /// A worker stand-in: held data is a number naming bytes it keeps.
    struct FakePort {
        held: Mutex<HashMap<usize, Vec<u8>>>,
        released: Mutex<Vec<usize>>,
        acks: crossbeam_channel::Sender<(Remote, Ack, bool)>,
    }

    impl ChunkPort for FakePort {
        unsafe fn receive(&self, data: HeldData, target: *mut u8, len: usize, done: Arc<Signal>) {
            let bytes = self.held.lock().remove(&(data.0 as usize)).unwrap();
            assert_eq!(bytes.len(), len);
            // SAFETY: the caller lends `len` bytes at `target`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), target, len) };
            done.set(Ok(()));
        }

        fn release(&self, data: HeldData) {
            self.released.lock().push(data.0 as usize);
        }

        fn acknowledge(&self, peer: Remote, ack: Ack, receipt: Option<(Arc<Landing>, Vec<u8>)>) {
            self.acks.send((peer, ack, receipt.is_some())).unwrap();
        }
    }

    struct Bed {
        streams: Arc<StagedStreams>,
        registry: Arc<DestinationRegistry>,
        port: Arc<FakePort>,
        acks: crossbeam_channel::Receiver<(Remote, Ack, bool)>,
        memory: Arc<HeapDestination>,
        token: AuthToken,
    }

    fn bed(len: usize, chunk: usize) -> Bed {
        let (tx, acks) = crossbeam_channel::unbounded();
        let registry = DestinationRegistry::new();
        let memory = Arc::new(HeapDestination::new(len));
        let staging = Staging::new(StagingConfig {
            chunk_bytes: chunk,
            ring_depth: 2,
            stage_host_transfers: true,
            ..StagingConfig::default()
        })
        .unwrap();
        let token = AuthToken::generate().unwrap();
        registry
            .register_with_key(
                token,
                Arc::new(StagedDestination::host(memory.clone(), staging)),
                Some("k".into()),
            )
            .unwrap();
        Bed {
            streams: StagedStreams::new(),
            registry,
            port: Arc::new(FakePort {
                held: Mutex::new(HashMap::new()),
                released: Mutex::new(Vec::new()),
                acks: tx,
            }),
            acks,
            memory,
            token,
        }
    }

    impl Bed {
        /// Chunk `index` (`chunk` bytes each) of a stream of `len` bytes
        /// from process 7, held (rendezvous) data named `index + 1`.
        fn arrive(&self, index: usize, chunk: usize, len: usize, bytes: &[u8]) -> Result<()> {
            let offset = index * chunk;
            let length = chunk.min(len - offset);
            let header = ChunkHeader {
                token: self.token,
                stream_offset: 0,
                stream_length: len as u64,
                offset: offset as u64,
                length: length as u64,
                request: 100 + index as u64,
                stream_request: 42,
                sender: 7,
                sender_worker: 1,
                home_worker: 0,
                receipt: b"xr1 ok 9".to_vec(),
            };
            let name = index + 1;
            self.port
                .held
                .lock()
                .insert(name, bytes[offset..offset + length].to_vec());
            let port: Arc<dyn ChunkPort> = self.port.clone();
            self.streams
                .arrive(&self.registry, &header, &port, || Arrived::Held {
                    data: HeldData(name as *mut c_void),
                    port: port.clone(),
                })
                .map(|placed| assert!(matches!(placed, ChunkPlace::Staged)))
        }
    }

    #[test]
    fn chunks_arriving_in_any_order_land_in_order_and_the_stream_is_acked_once() {
        let bed = bed(10_000, 4096);
        let bytes: Vec<u8> = (0..10_000).map(|i| (i % 251) as u8).collect();
        // The last chunk first: the first to arrive claims the stream.
        for index in [2, 0, 1] {
            bed.arrive(index, 4096, 10_000, &bytes).unwrap();
        }
        let (peer, ack, receipt) = bed
            .acks
            .recv_timeout(Duration::from_secs(20))
            .expect("acknowledged");
        assert_eq!(peer, (7, 0), "to the sender's home worker");
        assert_eq!((ack.request, ack.outcome.clone()), (42, Ok(())));
        assert!(receipt, "the receipt goes with a stream that landed");
        assert_eq!(bed.memory.to_vec(), bytes);
        assert!(bed.port.held.lock().is_empty(), "every chunk received");
        assert!(bed.port.released.lock().is_empty());
        assert!(bed.registry.is_empty(), "the token is used up");
        let deadline = Instant::now() + Duration::from_secs(20);
        while bed.streams.count() > 0 {
            assert!(Instant::now() < deadline, "the stream leaves the table");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(bed.acks.try_recv().is_err(), "acknowledged once");
    }

    #[test]
    fn a_sender_gone_mid_stream_fails_it_naming_the_sender_and_gives_back_what_ucx_holds() {
        let bed = bed(10_000, 4096);
        let bytes = vec![5u8; 10_000];
        // Chunks 0 and 2 came; 1 never will.
        bed.arrive(2, 4096, 10_000, &bytes).unwrap();
        bed.arrive(0, 4096, 10_000, &bytes).unwrap();
        bed.streams.end_from(
            7,
            &status::unavailable("the sending process 7 is gone (its control link closed)"),
        );
        let (_, ack, receipt) = bed.acks.recv_timeout(Duration::from_secs(20)).unwrap();
        let error = ack.outcome.unwrap_err();
        assert_eq!(error.code, Code::Unavailable);
        assert!(error.message.contains("process 7"), "{error}");
        assert!(!receipt, "no receipt for a stream that did not land");
        let deadline = Instant::now() + Duration::from_secs(20);
        while bed.port.released.lock().is_empty() {
            assert!(Instant::now() < deadline, "held data is released");
            std::thread::sleep(Duration::from_millis(1));
        }
        let released = bed.port.released.lock().clone();
        assert!(
            released.contains(&3),
            "chunk 2's data goes back to UCX: {released:?}"
        );
        // Chunk 0 was received before the end, or given back too.
        assert!(released.contains(&1) || !bed.port.held.lock().contains_key(&1));
        // A chunk that comes after: refused, nothing taken.
        // (Its stream's end, or no stream any more once it left the table.)
        let late = bed.arrive(1, 4096, 10_000, &bytes).unwrap_err();
        assert!(
            matches!(late.code, Code::Unavailable | Code::Unauthenticated),
            "{late}"
        );
    }

    #[test]
    fn a_chunk_larger_than_the_receivers_slot_is_refused() {
        let bed = bed(10_000, 4096);
        let bytes = vec![1u8; 10_000];
        let refused = bed.arrive(0, 8192, 10_000, &bytes).unwrap_err();
        assert_eq!(refused.code, Code::InvalidArgument, "{refused}");
        assert!(refused.message.contains("4096-byte chunks"), "{refused}");
        assert_eq!(bed.streams.count(), 0);
    }

    #[test]
    fn signals_are_done_once_all_are_told_and_fail_with_the_first_failure() {
        let (a, b) = (Signal::new(), Signal::new());
        let mut both = Signals(vec![a.clone(), b.clone()]);
        assert!(!both.is_done().unwrap());
        a.set(Ok(()));
        assert!(!both
            .wait_until(Instant::now() + Duration::from_millis(1))
            .unwrap());
        b.set(Err(status::unavailable("the endpoint failed")));
        b.set(Ok(()));
        assert_eq!(both.is_done().unwrap_err().code, Code::Unavailable);
        let c = Signal::new();
        c.set(Ok(()));
        assert!(Signals(vec![c]).wait_until(Instant::now()).unwrap());
    }
}
