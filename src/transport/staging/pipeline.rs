//! The two halves of a staged transfer, each one thread driving device
//! copies that run on their own:
//!
//! - `receive`: the wire fills a ring slot with the next chunk, the slot's
//!   host-to-device copy is started, and the wire fills the next slot
//!   meanwhile; chunks are copied in order, and `receive` returns only
//!   once the LAST copy completed (not when it was started), so whoever
//!   reports the bytes landed (and sets the completion key) does so after
//!   the last byte is in device memory.
//! - `send`: device-to-host copies run ahead into free slots while earlier
//!   chunks go on the wire; with every slot taken, the next copy waits for
//!   the wire to hand one back (backpressure).
//!
//! A byte stream (TCP) fills and drains chunks as long as the ring's; a
//! message transport (UCX) says how long each chunk it brings is
//! (`receive_chunks` and its `ChunkSource`, which waits for a chunk before
//! a slot is taken for it) and may read a sent chunk's slot after its call
//! returned (`send_async`: the slot comes back when the wire is done).
//!
//! Either stops at the first failure of the wire or a copy, when its
//! `Stop` is raised (the receive was cancelled, timed out or failed), or
//! when a slot or a copy does not come within `patience`
//! (`DEADLINE_EXCEEDED`). Whatever a copy may still reach when it stops is
//! parked, not reused (`StagingRing::park`).
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::copy::{DeviceCopy, Pending, COMPLETION_SLICE};
use super::ring::{Slot, StagingRing};
use crate::status::{self, Result, Status};

/// Raised once to stop a pipeline, with the reason its steps then return.
#[derive(Clone, Default)]
pub struct Stop {
    raised: Arc<AtomicBool>,
    reason: Arc<Mutex<Option<Status>>>,
}

impl Stop {
    pub fn new() -> Stop {
        Stop::default()
    }

    /// Stops the pipeline; the first reason wins.
    pub fn raise(&self, reason: Status) {
        let mut held = self.reason.lock();
        if held.is_none() {
            *held = Some(reason);
        }
        self.raised.store(true, Ordering::Release);
    }

    pub fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// `Err(reason)` once raised.
    pub fn check(&self) -> Result<()> {
        if !self.is_raised() {
            return Ok(());
        }
        let reason = self.reason.lock().clone();
        Err(reason.unwrap_or_else(|| status::cancelled("the staged transfer was stopped")))
    }
}

/// Where a staged transfer's chunks come from or go: the wire.
pub type Fill<'a> = dyn FnMut(&mut [u8]) -> Result<()> + 'a;
pub type Drain<'a> = dyn FnMut(&[u8]) -> Result<()> + 'a;

/// The wire of a send whose chunks may stay on it after the call: given a
/// chunk's bytes and where they start in the transfer, it puts them on the
/// wire and answers when it is done reading them (`Pending::Done` at once
/// for a wire that copies them out before it returns). The slot is not
/// reused before then.
pub type AsyncDrain<'a> = dyn FnMut(&[u8], usize) -> Result<Pending> + 'a;

/// Where a staged receive's chunks come from, when the wire says how long
/// each is and may read several at once (a message transport; a byte
/// stream is `Fill`).
pub trait ChunkSource {
    /// The next chunk's length (1..=`max`) if it is already on its way,
    /// without waiting.
    fn ready_chunk(&mut self, max: usize) -> Result<Option<usize>>;

    /// Waits until the next chunk is on its way and returns its length
    /// (1..=`max`), holding no slot meanwhile: a ring's slots go only to
    /// chunks that can fill them, so no receive holds one while its sender
    /// waits for a slot of its own.
    fn next_chunk(&mut self, max: usize, stop: &Stop) -> Result<usize>;

    /// Starts reading that chunk into the first `len` bytes of `slot` (its
    /// length exactly); the slot is written until the returned completion
    /// says it is done (`Pending::Done`: already read), and left alone by
    /// the pipeline until then.
    fn read_chunk(&mut self, slot: &mut Slot, len: usize) -> Result<Pending>;
}

/// A byte stream as a `ChunkSource`: every chunk as long as it may be,
/// read before `read_chunk` returns.
struct Stream<'w, 'a> {
    wire: &'w mut Fill<'a>,
}

impl ChunkSource for Stream<'_, '_> {
    fn ready_chunk(&mut self, max: usize) -> Result<Option<usize>> {
        Ok(Some(max))
    }

    fn next_chunk(&mut self, max: usize, _stop: &Stop) -> Result<usize> {
        Ok(max)
    }

    fn read_chunk(&mut self, slot: &mut Slot, len: usize) -> Result<Pending> {
        (self.wire)(&mut slot.bytes_mut()[..len]).map(|()| Pending::Done)
    }
}

/// Receives `len` bytes from `wire` (which fills each chunk exactly) into
/// device memory at `offset` through `ring`. Returns the chunk count once
/// every host-to-device copy completed.
pub fn receive(
    ring: &StagingRing,
    device: &dyn DeviceCopy,
    offset: usize,
    len: usize,
    wire: &mut Fill<'_>,
    stop: &Stop,
    patience: Duration,
) -> Result<usize> {
    let mut source = Stream { wire };
    receive_chunks(ring, device, offset, len, &mut source, stop, patience)
}

/// Receives `len` bytes from `source`, chunk by chunk in order, into device
/// memory at `offset` through `ring`: reads of chunks already on their way
/// run together (as many as there are free slots), and each chunk's copy
/// to the device starts, in order, once its read completed. Returns the
/// chunk count once every host-to-device copy completed.
pub fn receive_chunks(
    ring: &StagingRing,
    device: &dyn DeviceCopy,
    offset: usize,
    len: usize,
    source: &mut dyn ChunkSource,
    stop: &Stop,
    patience: Duration,
) -> Result<usize> {
    // Reads under way (slot, read's completion, length), oldest first, and
    // the device copies started after them.
    let mut reads = InFlight::new(ring);
    let mut in_flight = InFlight::new(ring);
    let chunk = ring.chunk_bytes();
    // Bytes whose read started, and whose copy started.
    let (mut asked, mut landed) = (0, 0);
    let mut chunks = 0;
    loop {
        stop.check()?;
        // Reads that completed, in order: their copies start.
        while let Some((_, read, _)) = reads.copies.front_mut() {
            if !read.is_done()? {
                break;
            }
            let (slot, _, length) = reads.copies.pop_front().expect("looked at just above");
            match device.to_device(&slot, offset + landed, length) {
                Ok(copy) => in_flight.copies.push_back((slot, copy, length)),
                Err(e) => {
                    ring.give_back(slot);
                    return Err(e);
                }
            }
            landed += length;
            chunks += 1;
        }
        // Slots whose copy is done go back at once, in order.
        in_flight.give_back_done()?;
        // Start reading every chunk already on its way that a slot is free
        // for; with nothing under way, wait for the next chunk, then for a
        // slot (another transfer holds them all).
        while asked < len {
            let max = chunk.min(len - asked);
            let idle = reads.copies.is_empty() && in_flight.copies.is_empty();
            let length = if idle {
                source.next_chunk(max, stop)?
            } else {
                match source.ready_chunk(max)? {
                    Some(length) => length,
                    None => break,
                }
            };
            if length == 0 || length > max {
                return Err(status::internal(format!(
                    "a staged chunk of {length} bytes where 1..={max} were expected"
                )));
            }
            let mut slot = match ring.try_take()? {
                Some(slot) => slot,
                None if idle => ring.take(Instant::now() + patience, stop)?,
                None => break,
            };
            let read = match source.read_chunk(&mut slot, length) {
                Ok(read) => read,
                Err(e) => {
                    ring.give_back(slot);
                    return Err(e);
                }
            };
            asked += length;
            let already_read = matches!(read, Pending::Done);
            reads.copies.push_back((slot, read, length));
            // A chunk read at once (a byte stream) has its copy started
            // before the next is read, so the two overlap.
            if already_read {
                break;
            }
        }
        if landed == len {
            break;
        }
        // Wait for what is next in order: the oldest read; else, with a
        // slot free, the next chunk (copies complete on their own); else
        // the oldest copy, whose slot the next chunk needs.
        if let Some((_, read, _)) = reads.copies.front_mut() {
            wait(read, stop, patience)?;
        } else if let Some((_, copy, _)) = in_flight.copies.front_mut() {
            if asked == len {
                break;
            }
            if ring.available() > 0 {
                source.next_chunk(chunk.min(len - asked), stop)?;
            } else {
                wait(copy, stop, patience)?;
            }
        }
    }
    // The bytes are in only when every copy completed.
    while let Some((slot, mut copy, length)) = in_flight.copies.pop_front() {
        if let Err(e) = wait(&mut copy, stop, patience) {
            in_flight.copies.push_front((slot, copy, length));
            return Err(e);
        }
        ring.give_back(slot);
    }
    Ok(chunks)
}

/// Sends `len` device bytes at `offset` through `ring` to `wire`, chunk by
/// chunk in order, copying ahead while slots are free. Returns the chunk
/// count.
pub fn send(
    ring: &StagingRing,
    device: &dyn DeviceCopy,
    offset: usize,
    len: usize,
    wire: &mut Drain<'_>,
    stop: &Stop,
    patience: Duration,
) -> Result<usize> {
    let mut written = |bytes: &[u8], _at: usize| wire(bytes).map(|()| Pending::Done);
    send_async(ring, device, offset, len, &mut written, stop, patience)
}

/// `send` over a wire that may still read a chunk's slot after it returned
/// (`AsyncDrain`): such slots come back once the wire is done with them,
/// and the send returns once the wire is done with every chunk.
pub fn send_async(
    ring: &StagingRing,
    device: &dyn DeviceCopy,
    offset: usize,
    len: usize,
    wire: &mut AsyncDrain<'_>,
    stop: &Stop,
    patience: Duration,
) -> Result<usize> {
    let mut in_flight = InFlight::new(ring);
    // Chunks the wire still reads, oldest first (the length is unused).
    let mut on_wire = InFlight::new(ring);
    let chunk = ring.chunk_bytes();
    let mut copied = 0;
    let mut sent = 0;
    let mut chunks = 0;
    loop {
        on_wire.give_back_done()?;
        // Copy ahead into every free slot; with none in flight, wait for
        // one: from the wire if it holds some, else from another transfer.
        while copied < len {
            stop.check()?;
            let slot = match ring.try_take()? {
                Some(slot) => slot,
                None if !in_flight.copies.is_empty() => break,
                None => match on_wire.copies.pop_front() {
                    Some((slot, mut reading, _)) => {
                        if let Err(e) = wait(&mut reading, stop, patience) {
                            on_wire.copies.push_front((slot, reading, 0));
                            return Err(e);
                        }
                        slot
                    }
                    None => ring.take(Instant::now() + patience, stop)?,
                },
            };
            let length = chunk.min(len - copied);
            match device.to_host(offset + copied, &slot, length) {
                Ok(copy) => in_flight.copies.push_back((slot, copy, length)),
                Err(e) => {
                    ring.give_back(slot);
                    return Err(e);
                }
            }
            copied += length;
        }
        let Some((slot, mut copy, length)) = in_flight.copies.pop_front() else {
            // Every chunk is on the wire: done once it read them all.
            while let Some((slot, mut reading, _)) = on_wire.copies.pop_front() {
                if let Err(e) = wait(&mut reading, stop, patience) {
                    on_wire.copies.push_front((slot, reading, 0));
                    return Err(e);
                }
                ring.give_back(slot);
            }
            return Ok(chunks);
        };
        if let Err(e) = wait(&mut copy, stop, patience) {
            in_flight.copies.push_front((slot, copy, length));
            return Err(e);
        }
        match wire(&slot.bytes()[..length], sent) {
            Ok(Pending::Done) => ring.give_back(slot),
            Ok(reading) => on_wire.copies.push_back((slot, reading, 0)),
            // A wire that fails leaves nothing reading the slot (one that
            // put part of a chunk out answers Ok with its completion, and
            // fails the next call).
            Err(e) => {
                ring.give_back(slot);
                return Err(e);
            }
        }
        sent += length;
        chunks += 1;
    }
}

/// A pipeline's chunks whose device copy was started and whose slot it has
/// not given back yet: `(slot, copy, chunk length)`, oldest first. However
/// the pipeline ends, what is left is settled when this is dropped: slots
/// whose copy is over go back, the others are parked until it is.
struct InFlight<'a> {
    ring: &'a StagingRing,
    copies: VecDeque<(Slot, Pending, usize)>,
}

impl<'a> InFlight<'a> {
    fn new(ring: &'a StagingRing) -> InFlight<'a> {
        InFlight {
            ring,
            copies: VecDeque::new(),
        }
    }

    /// Gives back, oldest first, the slots whose copy (or wire) is done.
    fn give_back_done(&mut self) -> Result<()> {
        while let Some((_, copy, _)) = self.copies.front_mut() {
            if !copy.is_done()? {
                break;
            }
            if let Some((slot, _, _)) = self.copies.pop_front() {
                self.ring.give_back(slot);
            }
        }
        Ok(())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        for (slot, mut copy, _) in self.copies.drain(..) {
            match copy.is_done() {
                Ok(false) => self.ring.park(slot, copy),
                Ok(true) | Err(_) => self.ring.give_back(slot),
            }
        }
    }
}

/// Waits for `copy` to complete, looking at `stop` in between, for at most
/// `patience`.
fn wait(copy: &mut Pending, stop: &Stop, patience: Duration) -> Result<()> {
    let deadline = Instant::now() + patience;
    loop {
        stop.check()?;
        let now = Instant::now();
        if copy.wait_until(deadline.min(now + COMPLETION_SLICE))? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(status::deadline_exceeded(format!(
                "a staged chunk's device copy did not complete within {patience:?}"
            )));
        }
    }
}
