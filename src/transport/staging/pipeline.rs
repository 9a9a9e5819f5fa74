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
    let mut in_flight = InFlight::new(ring);
    let chunk = ring.chunk_bytes();
    let mut landed = 0;
    let mut chunks = 0;
    while landed < len {
        stop.check()?;
        let length = chunk.min(len - landed);
        let mut slot = next_slot(ring, &mut in_flight, stop, patience)?;
        if let Err(e) = wire(&mut slot.bytes_mut()[..length]) {
            ring.give_back(slot);
            return Err(e);
        }
        match device.to_device(&slot, offset + landed, length) {
            Ok(copy) => in_flight.copies.push_back((slot, copy, length)),
            Err(e) => {
                ring.give_back(slot);
                return Err(e);
            }
        }
        landed += length;
        chunks += 1;
        // Slots whose copy is done go back at once, in order.
        while let Some((_, copy, _)) = in_flight.copies.front_mut() {
            if !copy.is_done()? {
                break;
            }
            if let Some((slot, _, _)) = in_flight.copies.pop_front() {
                ring.give_back(slot);
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
    let mut in_flight = InFlight::new(ring);
    let chunk = ring.chunk_bytes();
    let mut copied = 0;
    let mut chunks = 0;
    loop {
        // Copy ahead into every free slot; with none in flight, wait for
        // one (another transfer holds them all).
        while copied < len {
            stop.check()?;
            let slot = if in_flight.copies.is_empty() {
                ring.take(Instant::now() + patience, stop)?
            } else {
                match ring.try_take()? {
                    Some(slot) => slot,
                    None => break,
                }
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
            return Ok(chunks);
        };
        if let Err(e) = wait(&mut copy, stop, patience) {
            in_flight.copies.push_front((slot, copy, length));
            return Err(e);
        }
        let sent = wire(&slot.bytes()[..length]);
        ring.give_back(slot);
        sent?;
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

/// A slot for the next chunk: a free one, else the oldest in flight once
/// its copy completed, else one another transfer gives back.
fn next_slot(
    ring: &StagingRing,
    in_flight: &mut InFlight<'_>,
    stop: &Stop,
    patience: Duration,
) -> Result<Slot> {
    if let Some(slot) = ring.try_take()? {
        return Ok(slot);
    }
    match in_flight.copies.front_mut() {
        Some((_, copy, _)) => {
            wait(copy, stop, patience)?;
            Ok(in_flight
                .copies
                .pop_front()
                .expect("looked at just above")
                .0)
        }
        None => ring.take(Instant::now() + patience, stop),
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
