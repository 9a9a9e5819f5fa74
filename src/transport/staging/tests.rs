//! The pipeline's rules, on CPU: a fake `DeviceCopy` whose completions the
//! test controls stands in for a device's asynchronous copies.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use proptest::prelude::*;

use super::*;
use crate::status::{self, Code};
use crate::transport::destination::HeapDestination;

const PATIENCE: Duration = Duration::from_secs(20);

/// Device memory whose copies complete when the test says so: a copy to
/// the device lands in `memory` only then (as an asynchronous copy would).
struct FakeDevice {
    state: Arc<(Mutex<FakeState>, Condvar)>,
}

#[derive(Default)]
struct FakeState {
    memory: Vec<u8>,
    /// Per started copy: (offset, the bytes it carries, completed).
    copies: Vec<(usize, Vec<u8>, bool)>,
}

struct FakeCompletion {
    state: Arc<(Mutex<FakeState>, Condvar)>,
    index: usize,
}

impl CopyCompletion for FakeCompletion {
    fn is_done(&mut self) -> crate::status::Result<bool> {
        Ok(self.state.0.lock().copies[self.index].2)
    }

    fn wait_until(&mut self, until: Instant) -> crate::status::Result<bool> {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock();
        while !state.copies[self.index].2 {
            if changed.wait_until(&mut state, until).timed_out() {
                return Ok(state.copies[self.index].2);
            }
        }
        Ok(true)
    }
}

impl FakeDevice {
    fn new(len: usize) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            state: Arc::new((
                Mutex::new(FakeState {
                    memory: vec![0; len],
                    copies: Vec::new(),
                }),
                Condvar::new(),
            )),
        })
    }

    /// Blocks until `count` copies were started (a test that waits longer
    /// than PATIENCE fails rather than hangs).
    fn wait_started(&self, count: usize) {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock();
        let deadline = Instant::now() + PATIENCE;
        while state.copies.len() < count {
            assert!(
                !changed.wait_until(&mut state, deadline).timed_out()
                    || state.copies.len() >= count,
                "{count} copies were not started within {PATIENCE:?} ({} were)",
                state.copies.len()
            );
        }
    }

    fn started(&self) -> usize {
        self.state.0.lock().copies.len()
    }

    /// Completes copy `index`: its bytes land.
    fn complete(&self, index: usize) {
        let (lock, changed) = &*self.state;
        let mut state = lock.lock();
        let (offset, bytes, _) = state.copies[index].clone();
        state.memory[offset..offset + bytes.len()].copy_from_slice(&bytes);
        state.copies[index].2 = true;
        changed.notify_all();
    }

    fn memory(&self) -> Vec<u8> {
        self.state.0.lock().memory.clone()
    }

    fn offsets(&self) -> Vec<usize> {
        self.state.0.lock().copies.iter().map(|c| c.0).collect()
    }
}

impl DeviceCopy for FakeDevice {
    fn len(&self) -> usize {
        self.state.0.lock().memory.len()
    }

    fn to_device(&self, slot: &Slot, offset: usize, len: usize) -> crate::status::Result<Pending> {
        check_range(self.len(), slot, offset, len)?;
        let (lock, changed) = &*self.state;
        let mut state = lock.lock();
        let index = state.copies.len();
        state
            .copies
            .push((offset, slot.bytes()[..len].to_vec(), false));
        changed.notify_all();
        Ok(Pending::Running(Box::new(FakeCompletion {
            state: self.state.clone(),
            index,
        })))
    }

    fn to_host(&self, offset: usize, slot: &Slot, len: usize) -> crate::status::Result<Pending> {
        check_range(self.len(), slot, offset, len)?;
        // The device bytes are read when the copy starts; completion says
        // when the slot may be read.
        let (lock, changed) = &*self.state;
        let mut state = lock.lock();
        let bytes = state.memory[offset..offset + len].to_vec();
        // SAFETY: `len` fits the slot (checked), which nothing else uses.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), slot.as_ptr(), len) };
        let index = state.copies.len();
        state.copies.push((offset, bytes, false));
        changed.notify_all();
        Ok(Pending::Running(Box::new(FakeCompletion {
            state: self.state.clone(),
            index,
        })))
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A wire that hands out `bytes` chunk by chunk and counts the chunks.
fn wire_from(
    bytes: Vec<u8>,
    calls: Arc<AtomicUsize>,
) -> impl FnMut(&mut [u8]) -> crate::status::Result<()> {
    let mut at = 0;
    move |into: &mut [u8]| {
        into.copy_from_slice(&bytes[at..at + into.len()]);
        at += into.len();
        calls.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn run_receive(
    ring: Arc<StagingRing>,
    device: Arc<FakeDevice>,
    bytes: Vec<u8>,
    stop: Stop,
    patience: Duration,
    calls: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<crate::status::Result<usize>> {
    std::thread::spawn(move || {
        let len = bytes.len();
        let mut wire = wire_from(bytes, calls);
        receive(&ring, &*device, 0, len, &mut wire, &stop, patience)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any length, chunk size and depth: every byte arrives where it
    /// belongs, in ceil(len / chunk) chunks, copied in order, and every
    /// slot is back in the ring afterwards.
    #[test]
    fn chunks_arrive_whole_and_in_order(len in 0usize..20_000, chunk in 1usize..5_000, depth in 1usize..5, seed: u8) {
        let ring = StagingRing::new(chunk, depth).unwrap();
        let bytes = pattern(len, seed);
        let memory = Arc::new(HeapDestination::new(len));
        let device = HostCopy::new(memory.clone());
        let calls = Arc::new(AtomicUsize::new(0));
        let mut wire = wire_from(bytes.clone(), calls.clone());
        let chunks = receive(&ring, &device, 0, len, &mut wire, &Stop::new(), PATIENCE).unwrap();
        prop_assert_eq!(chunks, len.div_ceil(chunk));
        prop_assert_eq!(memory.to_vec(), bytes.clone());

        let mut sent = Vec::new();
        let source = HostSource::new(&bytes);
        let chunks = send(&ring, &source, 0, len, &mut |c: &[u8]| { sent.extend_from_slice(c); Ok(()) }, &Stop::new(), PATIENCE).unwrap();
        prop_assert_eq!(chunks, len.div_ceil(chunk));
        prop_assert_eq!(sent, bytes.clone());

        // An asynchronous wire that reads each chunk later: the same bytes.
        let mut late = Vec::new();
        let mut put = |c: &[u8], at: usize| { late.push((at, c.to_vec())); Ok(Pending::Done) };
        let chunks = send_async(&ring, &source, 0, len, &mut put, &Stop::new(), PATIENCE).unwrap();
        prop_assert_eq!(chunks, len.div_ceil(chunk));
        let late: Vec<u8> = late.into_iter().flat_map(|(_, c)| c).collect();
        prop_assert_eq!(late, bytes);
        prop_assert_eq!(ring.available(), depth);
        prop_assert!(ring.held_bytes() <= chunk * depth);
    }

    /// Copies that complete in any order: the receive still ends with
    /// every byte in place, the copies were started in order.
    #[test]
    fn completions_in_any_order_land_every_byte(order in Just((0..6usize).collect::<Vec<_>>()).prop_shuffle()) {
        let ring = Arc::new(StagingRing::new(100, 6).unwrap());
        let device = FakeDevice::new(600);
        let bytes = pattern(600, 7);
        let calls = Arc::new(AtomicUsize::new(0));
        let running = run_receive(ring.clone(), device.clone(), bytes.clone(), Stop::new(), PATIENCE, calls);
        device.wait_started(6);
        for index in order {
            device.complete(index);
        }
        prop_assert_eq!(running.join().unwrap().unwrap(), 6);
        prop_assert_eq!(device.offsets(), vec![0, 100, 200, 300, 400, 500]);
        prop_assert_eq!(device.memory(), bytes);
    }
}

#[test]
fn slots_are_page_aligned_allocated_once_and_reused() {
    let ring = StagingRing::new(1000, 2).unwrap();
    assert_eq!(ring.held_bytes(), 0, "nothing allocated before first use");
    let stop = Stop::new();
    let a = ring.take(Instant::now() + PATIENCE, &stop).unwrap();
    let b = ring.take(Instant::now() + PATIENCE, &stop).unwrap();
    assert_eq!(a.as_ptr() as usize % SLOT_ALIGN, 0);
    assert_eq!(b.as_ptr() as usize % SLOT_ALIGN, 0);
    assert!(ring.try_take().unwrap().is_none(), "bounded by the depth");
    assert_eq!(ring.held_bytes(), 2000);
    let pointers = [a.as_ptr(), b.as_ptr()];
    ring.give_back(a);
    ring.give_back(b);
    let again = ring.take(Instant::now() + PATIENCE, &stop).unwrap();
    assert!(
        pointers.contains(&again.as_ptr()),
        "reused, not allocated anew"
    );
    assert_eq!(ring.held_bytes(), 2000);
    assert!(StagingRing::new(0, 1).is_err());
    assert!(StagingRing::new(1, 0).is_err());
}

#[test]
fn the_receive_ends_only_after_the_last_copy_completed() {
    let ring = Arc::new(StagingRing::new(64, 8).unwrap());
    let device = FakeDevice::new(64 * 5);
    let bytes = pattern(64 * 5, 3);
    let calls = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let running = {
        let (ring, device, bytes, calls) =
            (ring.clone(), device.clone(), bytes.clone(), calls.clone());
        std::thread::spawn(move || {
            let len = bytes.len();
            let mut wire = wire_from(bytes, calls);
            let result = receive(&ring, &*device, 0, len, &mut wire, &Stop::new(), PATIENCE);
            // What a transport does next: report the bytes landed (set the
            // completion key).
            done_tx.send(device.memory()).unwrap();
            result
        })
    };
    device.wait_started(5);
    assert_eq!(calls.load(Ordering::SeqCst), 5, "the whole wire was read");
    for index in 0..4 {
        device.complete(index);
    }
    // Every copy but the last completed and all were queued: not landed,
    // however long it is given (a pipeline that reported the bytes once the
    // last copy was queued would at once).
    assert!(
        done_rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "landed before the last copy completed"
    );
    device.complete(4);
    let landed = done_rx.recv().unwrap();
    assert_eq!(landed, bytes, "what was reported landed is all there");
    assert_eq!(running.join().unwrap().unwrap(), 5);
    assert_eq!(ring.parked(), 0);
}

#[test]
fn a_full_ring_holds_the_wire_back_until_a_copy_completes() {
    let ring = Arc::new(StagingRing::new(10, 2).unwrap());
    let device = FakeDevice::new(50);
    let bytes = pattern(50, 9);
    let calls = Arc::new(AtomicUsize::new(0));
    let running = run_receive(
        ring.clone(),
        device.clone(),
        bytes.clone(),
        Stop::new(),
        PATIENCE,
        calls.clone(),
    );
    device.wait_started(2);
    // Both slots carry a running copy: the third chunk is not read.
    assert_eq!(ring.available(), 0);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(device.started(), 2);
    device.complete(0);
    device.wait_started(3);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    for index in 1..5 {
        device.wait_started(index + 1);
        device.complete(index);
    }
    assert_eq!(running.join().unwrap().unwrap(), 5);
    assert_eq!(device.memory(), bytes);
    assert_eq!(ring.available(), 2);
}

#[test]
fn a_send_copies_ahead_only_into_free_slots() {
    let ring = Arc::new(StagingRing::new(10, 3).unwrap());
    let device = FakeDevice::new(100);
    device.state.0.lock().memory = pattern(100, 5);
    let (wire_tx, wire_rx) = crossbeam_channel::bounded::<Vec<u8>>(0);
    let running = {
        let (ring, device) = (ring.clone(), device.clone());
        std::thread::spawn(move || {
            let mut wire = |chunk: &[u8]| {
                wire_tx.send(chunk.to_vec()).unwrap();
                Ok(())
            };
            send(&ring, &*device, 0, 100, &mut wire, &Stop::new(), PATIENCE)
        })
    };
    // Three copies ahead (the ring's depth), none further while the
    // first is not on the wire.
    device.wait_started(3);
    assert_eq!(ring.available(), 0);
    assert_eq!(device.started(), 3);
    let mut received = Vec::new();
    for index in 0..10 {
        device.wait_started(index + 1);
        device.complete(index);
        let chunk = wire_rx.recv().unwrap();
        received.extend_from_slice(&chunk);
        // At most the depth of copies ahead of what the wire took.
        assert!(device.started() <= index + 1 + 3);
    }
    assert_eq!(running.join().unwrap().unwrap(), 10);
    assert_eq!(received, pattern(100, 5));
    assert_eq!(ring.available(), 3);
}

#[test]
fn a_cancel_mid_pipeline_stops_it_and_parks_slots_a_late_copy_may_reach() {
    let ring = Arc::new(StagingRing::new(16, 4).unwrap());
    let device = FakeDevice::new(64);
    let stop = Stop::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let running = run_receive(
        ring.clone(),
        device.clone(),
        pattern(64, 1),
        stop.clone(),
        PATIENCE,
        calls,
    );
    device.wait_started(4);
    device.complete(0);
    stop.raise(status::cancelled("the receive was cancelled"));
    let result = running.join().unwrap();
    assert_eq!(result.unwrap_err().code, Code::Cancelled);
    // Three copies still run into three slots: none of them is reusable.
    assert_eq!(ring.parked(), 3);
    assert_eq!(ring.available(), 1);
    device.complete(1);
    device.complete(2);
    assert_eq!(ring.available(), 3, "a completed copy gives its slot back");
    device.complete(3);
    assert_eq!(ring.available(), 4);
    assert_eq!(ring.parked(), 0);
}

#[test]
fn a_cancel_while_the_wire_is_read_stops_before_the_next_chunk() {
    let ring = StagingRing::new(8, 4).unwrap();
    let memory = Arc::new(HeapDestination::new(32));
    let device = HostCopy::new(memory.clone());
    let stop = Stop::new();
    let mut reads = 0;
    let mut wire = |into: &mut [u8]| {
        reads += 1;
        into.fill(0xAB);
        if reads == 2 {
            stop.raise(status::deadline_exceeded("the receive timed out"));
        }
        Ok(())
    };
    let error = receive(&ring, &device, 0, 32, &mut wire, &stop, PATIENCE).unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded);
    assert_eq!(reads, 2, "no chunk is read after the stop");
    assert_eq!(ring.available(), 4);
}

#[test]
fn a_peer_that_dies_mid_pipeline_fails_it_with_the_wires_error() {
    let ring = Arc::new(StagingRing::new(10, 4).unwrap());
    let device = FakeDevice::new(60);
    let (ring2, device2) = (ring.clone(), device.clone());
    let running = std::thread::spawn(move || {
        let mut reads = 0;
        let mut wire = |into: &mut [u8]| {
            reads += 1;
            if reads == 3 {
                return Err(status::unavailable(
                    "sender 1 closed the connection after 20 of 60 bytes",
                ));
            }
            into.fill(1);
            Ok(())
        };
        receive(&ring2, &*device2, 0, 60, &mut wire, &Stop::new(), PATIENCE)
    });
    let error = running.join().unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert!(error.message.contains("sender 1"), "{error}");
    assert_eq!(device.started(), 2);
    // The two copies started before the death still run: parked.
    assert_eq!(ring.parked(), 2);
    device.complete(0);
    device.complete(1);
    assert_eq!(ring.parked(), 0);
    assert_eq!(ring.available(), 4);

    // On the send side, a receiver gone: the wire's error, slots back.
    let source = pattern(60, 2);
    let mut sent = 0;
    let error = send(
        &ring,
        &HostSource::new(&source),
        0,
        60,
        &mut |_: &[u8]| {
            sent += 1;
            if sent == 2 {
                return Err(status::unavailable("receiver 0 is gone"));
            }
            Ok(())
        },
        &Stop::new(),
        PATIENCE,
    )
    .unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert_eq!(ring.available(), 4);
}

#[test]
fn a_copy_that_never_completes_times_out_and_its_slot_stays_parked() {
    let ring = Arc::new(StagingRing::new(10, 2).unwrap());
    let device = FakeDevice::new(20);
    let calls = Arc::new(AtomicUsize::new(0));
    let patience = Duration::from_millis(50);
    let running = run_receive(
        ring.clone(),
        device.clone(),
        pattern(20, 4),
        Stop::new(),
        patience,
        calls,
    );
    let error = running.join().unwrap().unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded, "{error}");
    assert_eq!(ring.parked(), 2);
    // Nobody gets a slot a late copy may still write.
    let waited = ring.take(Instant::now() + patience, &Stop::new());
    assert_eq!(waited.err().unwrap().code, Code::DeadlineExceeded);
    device.complete(0);
    device.complete(1);
    assert_eq!(ring.available(), 2);
}

#[test]
fn a_staged_destination_counts_what_it_landed() {
    let staging = Staging::new(StagingConfig {
        chunk_bytes: 4096,
        ring_depth: 2,
        stage_host_transfers: true,
        ..StagingConfig::default()
    })
    .unwrap();
    let memory = Arc::new(HeapDestination::new(10_000));
    let destination = StagedDestination::host(memory.clone(), staging.clone());
    assert!(crate::transport::destination::WritableDestination::staged(&destination).is_some());
    let bytes = pattern(10_000, 8);
    let mut wire = wire_from(bytes.clone(), Arc::new(AtomicUsize::new(0)));
    assert_eq!(
        destination.receive(0, 10_000, &mut wire, PATIENCE).unwrap(),
        3
    );
    assert_eq!(memory.to_vec(), bytes);
    assert_eq!(staging.staged(), 1);
    // A memcpy completes at once: its slot is the next chunk's.
    assert_eq!(staging.bytes_held(), 4096);
    destination.stop(status::cancelled("over"));
    let mut wire = wire_from(bytes, Arc::new(AtomicUsize::new(0)));
    assert_eq!(
        destination
            .receive(0, 10_000, &mut wire, PATIENCE)
            .unwrap_err()
            .code,
        Code::Cancelled
    );
}

/// A message wire for `receive_chunks`: hands out the chunks it was given
/// (all already on their way), and records how many slots were free each
/// time the pipeline waited for a chunk. With `gate`, every read completes
/// only when the test opens it.
struct Messages {
    chunks: std::collections::VecDeque<Vec<u8>>,
    ring: Arc<StagingRing>,
    free_while_waiting: Vec<usize>,
    gate: Option<Arc<(Mutex<bool>, Condvar)>>,
    reads: usize,
}

struct Gated(Arc<(Mutex<bool>, Condvar)>);

impl CopyCompletion for Gated {
    fn is_done(&mut self) -> crate::status::Result<bool> {
        Ok(*self.0 .0.lock())
    }

    fn wait_until(&mut self, until: Instant) -> crate::status::Result<bool> {
        let (lock, changed) = &*self.0;
        let mut done = lock.lock();
        while !*done {
            if changed.wait_until(&mut done, until).timed_out() {
                break;
            }
        }
        Ok(*done)
    }
}

impl Messages {
    fn new(chunks: Vec<Vec<u8>>, ring: &Arc<StagingRing>) -> Messages {
        Messages {
            chunks: chunks.into(),
            ring: ring.clone(),
            free_while_waiting: Vec::new(),
            gate: None,
            reads: 0,
        }
    }
}

impl ChunkSource for Messages {
    fn ready_chunk(&mut self, max: usize) -> crate::status::Result<Option<usize>> {
        Ok(self.chunks.front().map(|next| next.len().min(max + 1)))
    }

    fn next_chunk(&mut self, max: usize, _stop: &Stop) -> crate::status::Result<usize> {
        self.free_while_waiting.push(self.ring.available());
        self.ready_chunk(max)?
            .ok_or_else(|| status::unavailable("no more chunks"))
    }

    fn read_chunk(&mut self, slot: &mut Slot, len: usize) -> crate::status::Result<Pending> {
        let chunk = self.chunks.pop_front().expect("announced");
        slot.bytes_mut()[..len].copy_from_slice(&chunk);
        self.reads += 1;
        Ok(match &self.gate {
            Some(gate) => Pending::Running(Box::new(Gated(gate.clone()))),
            None => Pending::Done,
        })
    }
}

#[test]
fn chunks_of_the_senders_own_sizes_land_in_order_and_no_slot_waits_for_the_wire() {
    let ring = Arc::new(StagingRing::new(100, 2).unwrap());
    let bytes = pattern(330, 6);
    // The sender's chunks: smaller than the ring's, uneven.
    let sizes = [100, 60, 100, 40, 30];
    let mut at = 0;
    let chunks = sizes
        .iter()
        .map(|&n| {
            at += n;
            bytes[at - n..at].to_vec()
        })
        .collect();
    let memory = Arc::new(HeapDestination::new(340));
    let device = HostCopy::new(memory.clone());
    let mut wire = Messages::new(chunks, &ring);
    let count = receive_chunks(&ring, &device, 10, 330, &mut wire, &Stop::new(), PATIENCE).unwrap();
    assert_eq!(count, 5);
    assert_eq!(&memory.to_vec()[10..], &bytes[..]);
    assert_eq!(memory.to_vec()[..10], [0; 10]);
    // Whenever the pipeline waited for a chunk it held no slot.
    assert!(!wire.free_while_waiting.is_empty());
    assert!(
        wire.free_while_waiting.iter().all(|&free| free == 2),
        "{:?}",
        wire.free_while_waiting
    );
    assert_eq!(ring.available(), 2);

    // A chunk longer than what is left (or than a slot) is refused.
    let mut long = Messages::new(vec![vec![1; 101]], &ring);
    let error =
        receive_chunks(&ring, &device, 0, 340, &mut long, &Stop::new(), PATIENCE).unwrap_err();
    assert_eq!(error.code, Code::Internal, "{error}");
    assert_eq!(ring.available(), 2);
}

#[test]
fn chunks_already_on_their_way_are_read_together_and_copied_in_order() {
    let ring = Arc::new(StagingRing::new(10, 3).unwrap());
    let bytes = pattern(50, 4);
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let device = FakeDevice::new(50);
    let running = {
        let (ring, device, bytes, gate) =
            (ring.clone(), device.clone(), bytes.clone(), gate.clone());
        std::thread::spawn(move || {
            let mut wire = Messages::new(bytes.chunks(10).map(<[u8]>::to_vec).collect(), &ring);
            wire.gate = Some(gate);
            let landed = receive_chunks(&ring, &*device, 0, 50, &mut wire, &Stop::new(), PATIENCE);
            (landed, wire.reads)
        })
    };
    // Three slots: three reads under way at once, no copy before one ends.
    while ring.available() > 0 {
        std::thread::yield_now();
    }
    assert_eq!(
        device.started(),
        0,
        "a copy started before its read completed"
    );
    *gate.0.lock() = true;
    gate.1.notify_all();
    for index in 0..5 {
        device.wait_started(index + 1);
        device.complete(index);
    }
    let (landed, reads) = running.join().unwrap();
    assert_eq!(landed.unwrap(), 5);
    assert_eq!(reads, 5);
    assert_eq!(device.offsets(), vec![0, 10, 20, 30, 40], "copied in order");
    assert_eq!(device.memory(), bytes);
    assert_eq!(ring.available(), 3);
}

/// Chunks that arrive one at a time, when the test lets each in.
struct Trickle {
    arrived: Arc<(Mutex<Vec<Vec<u8>>>, Condvar)>,
    next: usize,
}

impl ChunkSource for Trickle {
    fn ready_chunk(&mut self, max: usize) -> crate::status::Result<Option<usize>> {
        let arrived = self.arrived.0.lock();
        Ok(arrived.get(self.next).map(|c| c.len().min(max)))
    }

    fn next_chunk(&mut self, max: usize, stop: &Stop) -> crate::status::Result<usize> {
        let (lock, changed) = &*self.arrived;
        let mut arrived = lock.lock();
        while arrived.len() <= self.next {
            stop.check()?;
            changed.wait_for(&mut arrived, Duration::from_millis(5));
        }
        Ok(arrived[self.next].len().min(max))
    }

    fn read_chunk(&mut self, slot: &mut Slot, len: usize) -> crate::status::Result<Pending> {
        let chunk = self.arrived.0.lock()[self.next].clone();
        slot.bytes_mut()[..len].copy_from_slice(&chunk);
        self.next += 1;
        Ok(Pending::Done)
    }
}

#[test]
fn a_chunk_that_arrives_while_copies_run_is_read_into_a_free_slot_at_once() {
    // Five slots, five chunks, copies that complete only at the end: each
    // chunk, arriving while earlier copies still run, must be read and
    // copied without waiting for them (the sender waits for its chunks to
    // be taken).
    let ring = Arc::new(StagingRing::new(10, 5).unwrap());
    let device = FakeDevice::new(50);
    let bytes = pattern(50, 8);
    let arrived = Arc::new((Mutex::new(Vec::<Vec<u8>>::new()), Condvar::new()));
    let running = {
        let (ring, device, arrived) = (ring.clone(), device.clone(), arrived.clone());
        std::thread::spawn(move || {
            let mut wire = Trickle { arrived, next: 0 };
            receive_chunks(&ring, &*device, 0, 50, &mut wire, &Stop::new(), PATIENCE)
        })
    };
    for index in 0..5 {
        arrived
            .0
            .lock()
            .push(bytes[index * 10..index * 10 + 10].to_vec());
        arrived.1.notify_all();
        // Its copy starts though none before it completed.
        device.wait_started(index + 1);
    }
    for index in 0..5 {
        device.complete(index);
    }
    assert_eq!(running.join().unwrap().unwrap(), 5);
    assert_eq!(device.memory(), bytes);
}

#[test]
fn a_stop_while_a_chunk_is_read_parks_the_slot_the_read_may_still_write() {
    let ring = Arc::new(StagingRing::new(64, 2).unwrap());
    let memory = Arc::new(HeapDestination::new(128));
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let stop = Stop::new();
    let running = {
        let (ring, memory, gate, stop) = (ring.clone(), memory.clone(), gate.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut wire = Messages::new(vec![vec![3; 64], vec![4; 64]], &ring);
            wire.gate = Some(gate);
            let device = HostCopy::new(memory);
            receive_chunks(&ring, &device, 0, 128, &mut wire, &stop, PATIENCE)
        })
    };
    while ring.available() > 0 {
        std::thread::yield_now();
    }
    stop.raise(status::unavailable("the sending process 0 is gone"));
    let error = running.join().unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert_eq!(ring.parked(), 2, "the reads may still write both slots");
    *gate.0.lock() = true;
    assert_eq!(ring.available(), 2, "back once the reads are over");
    assert_eq!(memory.to_vec(), vec![0; 128], "nothing was copied in");
}

/// Whether the wire read a chunk (`Some(true)`), failed to (`Some(false)`)
/// or still may.
type ReadGate = Arc<(Mutex<Option<bool>>, Condvar)>;

/// The chunks a `SlowWire` took (where each starts, its bytes), and their
/// read gates.
type WireState = (Vec<(usize, Vec<u8>)>, Vec<ReadGate>);

/// A wire that keeps each chunk's slot until the test lets it go, as UCX
/// keeps a rendezvous send's bytes until its receiver pulled them.
#[derive(Default)]
struct SlowWire {
    /// Each chunk (where it starts, its bytes) and its read gate.
    state: Mutex<WireState>,
    changed: Condvar,
}

struct WireRead(ReadGate);

impl CopyCompletion for WireRead {
    fn is_done(&mut self) -> crate::status::Result<bool> {
        match *self.0 .0.lock() {
            Some(true) => Ok(true),
            Some(false) => Err(status::unavailable("the receiver is gone")),
            None => Ok(false),
        }
    }

    fn wait_until(&mut self, until: Instant) -> crate::status::Result<bool> {
        let (lock, changed) = &*self.0;
        let mut read = lock.lock();
        while read.is_none() {
            if changed.wait_until(&mut read, until).timed_out() {
                return Ok(false);
            }
        }
        drop(read);
        self.is_done()
    }
}

impl SlowWire {
    fn put(&self, bytes: &[u8], at: usize) -> Pending {
        let gate = Arc::new((Mutex::new(None), Condvar::new()));
        let mut state = self.state.lock();
        state.0.push((at, bytes.to_vec()));
        state.1.push(gate.clone());
        self.changed.notify_all();
        Pending::Running(Box::new(WireRead(gate)))
    }

    fn wait_for(&self, count: usize) {
        let mut state = self.state.lock();
        while state.0.len() < count {
            self.changed.wait(&mut state);
        }
    }

    fn put_count(&self) -> usize {
        self.state.lock().0.len()
    }

    fn release(&self, index: usize, ok: bool) {
        let gate = self.state.lock().1[index].clone();
        *gate.0.lock() = Some(ok);
        gate.1.notify_all();
    }

    fn bytes(&self) -> Vec<u8> {
        let mut chunks = self.state.lock().0.clone();
        chunks.sort();
        chunks.into_iter().flat_map(|(_, b)| b).collect()
    }
}

#[test]
fn a_send_gets_its_slots_back_only_once_the_wire_read_them_and_ends_after_the_last() {
    let ring = Arc::new(StagingRing::new(10, 2).unwrap());
    let source = pattern(45, 2);
    let wire = Arc::new(SlowWire::default());
    let (done_tx, done_rx) = crossbeam_channel::bounded(1);
    let running = {
        let (ring, wire, source) = (ring.clone(), wire.clone(), source.clone());
        std::thread::spawn(move || {
            let mut put = |bytes: &[u8], at: usize| Ok(wire.put(bytes, at));
            let sent = send_async(
                &ring,
                &HostSource::new(&source),
                0,
                45,
                &mut put,
                &Stop::new(),
                PATIENCE,
            );
            done_tx.send(()).unwrap();
            sent
        })
    };
    // Two slots: two chunks on the wire, the third waits for the first to
    // be read (backpressure), not merely handed over.
    wire.wait_for(2);
    assert_eq!(ring.available(), 0);
    assert_eq!(wire.put_count(), 2);
    for index in 0..3 {
        wire.release(index, true);
        wire.wait_for(index + 3);
        assert!(wire.put_count() <= index + 3, "at most the depth ahead");
    }
    // Every chunk is out; the send is not over while the wire reads.
    assert_eq!(wire.put_count(), 5);
    wire.release(3, true);
    assert!(
        done_rx.try_recv().is_err(),
        "ended before the wire read the last chunk"
    );
    wire.release(4, true);
    assert_eq!(running.join().unwrap().unwrap(), 5);
    assert_eq!(wire.bytes(), source);
    let offsets: Vec<usize> = wire.state.lock().0.iter().map(|c| c.0).collect();
    assert_eq!(
        offsets,
        vec![0, 10, 20, 30, 40],
        "in order, each where it belongs"
    );
    assert_eq!(ring.available(), 2);
}

#[test]
fn a_send_stopped_while_the_wire_reads_parks_the_slots_it_still_reads() {
    let ring = Arc::new(StagingRing::new(8, 3).unwrap());
    let source = pattern(64, 1);
    let wire = Arc::new(SlowWire::default());
    let stop = Stop::new();
    let running = {
        let (ring, wire, source, stop) = (ring.clone(), wire.clone(), source.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut put = |bytes: &[u8], at: usize| Ok(wire.put(bytes, at));
            send_async(
                &ring,
                &HostSource::new(&source),
                0,
                64,
                &mut put,
                &stop,
                PATIENCE,
            )
        })
    };
    wire.wait_for(3);
    stop.raise(status::unavailable("receiver 1 is gone"));
    let error = running.join().unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unavailable);
    assert_eq!(ring.parked(), 3, "the wire may still read all three");
    wire.release(0, true);
    wire.release(1, false);
    assert_eq!(
        ring.available(),
        2,
        "a read that ended (even failed) gives its slot back"
    );
    wire.release(2, true);
    assert_eq!(ring.available(), 3);

    // A wire whose read fails fails the send with its error.
    let failing = Arc::new(SlowWire::default());
    let running = {
        let (ring, failing, source) = (ring.clone(), failing.clone(), source.clone());
        std::thread::spawn(move || {
            let mut put = |bytes: &[u8], at: usize| Ok(failing.put(bytes, at));
            send_async(
                &ring,
                &HostSource::new(&source),
                0,
                64,
                &mut put,
                &Stop::new(),
                PATIENCE,
            )
        })
    };
    failing.wait_for(3);
    failing.release(0, false);
    let error = running.join().unwrap().unwrap_err();
    assert!(error.message.contains("receiver is gone"), "{error}");
    for index in 1..failing.put_count() {
        failing.release(index, true);
    }
    assert_eq!(ring.available(), 3);
}

#[test]
fn a_pinned_ring_is_bounded_by_the_process_and_says_why_without_a_driver() {
    let ring = StagingRing::with_memory(4096, 2, SlotMemory::Pinned { bound: 1 << 20 }).unwrap();
    assert_eq!(ring.memory(), SlotMemory::Pinned { bound: 1 << 20 });
    match ring.try_take() {
        // A GPU machine: page-aligned pinned memory, counted.
        Ok(Some(slot)) => {
            assert_eq!(slot.as_ptr() as usize % SLOT_ALIGN, 0);
            assert!(crate::backend::cuda::pinned_bytes_held() >= 4096);
            ring.give_back(slot);
        }
        Ok(None) => panic!("an empty ring had no slot"),
        Err(e) => {
            eprintln!("SKIPPED (no CUDA driver/device): {e}");
            assert_eq!(e.code, Code::Unavailable, "{e}");
        }
    }
    // A bound below one chunk: refused before any driver call.
    let none = StagingRing::with_memory(4096, 2, SlotMemory::Pinned { bound: 0 }).unwrap();
    assert_eq!(none.try_take().err().unwrap().code, Code::ResourceExhausted);
}
