//! The life of one receive buffer (docs/DESIGN.md §3). Everything that happens to
//! a buffer between "the receiver named its completion key" and "the key is
//! gone from the store" is in this file.
//!
//! ```text
//!  begin ──► Waiting ──(AsyncGet fires, right nonce)──► publish ─► record ─► Retiring ──► Retired
//!               │   └─(wrong nonce: stale)─► re-arm, still Waiting
//!               │
//!               ├─(cancel)──► publish CANCELLED ─► PublishedEarly ──(set CANCEL wakes the AsyncGet)
//!               │                                        │        └─(its callback fires)──► Retiring
//!               │                                        └─(wake-up set failed)──► withdraw the waiter ──► Retiring
//!               └─(deadline)─► publish DEADLINE_EXCEEDED ─► PublishedEarly ─► withdraw the waiter ──► Retiring
//! ```
//!
//! Publish, then retire: the buffer's `Future` (its readiness event) is set
//! before `delete` is even called, so readiness never waits on the store.
//! "Record the event" belongs to publication: a receive may carry a
//! `RecordOutcome` (a delegating client's fulfilment of the compute plugin's
//! alias buffer, docs/DESIGN.md §11), run once with the outcome right after
//! the promise is set, on every path that publishes (receipt, cancel,
//! deadline, shutdown) and always before the keys are deleted. The
//! keys (completion key plus `extra_keys`, the v2 descriptor keys) are
//! deleted after it, for OK and error alike. A failed delete is logged at
//! error level and counted; the published status is not changed.
//!
//! Exactly one thread retires a buffer: the one that moves its phase to
//! `Retiring`. The phase lives under a small lock that is never held across
//! a store call or a promise (user callbacks run on `promise.set`).
//!
//! Cancellation (rule 4): `promise.set(reason)` first, then
//! `store.set(key, Cancel(nonce))` to wake the pending AsyncGet; the woken
//! callback does not publish (the outcome is decided) but still retires the
//! keys. The delete must come *after* that `set` returns, or a late CANCEL
//! receipt would be left in the store: while the wake-up `set` is in flight
//! a firing callback only records `WaiterGoneWakeInFlight` and the canceller
//! retires when its `set` returns.
//!
//! Rule 5, the wake-up `set` fails: the future stays cancelled, `cancel`
//! returns the failure (its code, with a message saying the future is
//! cancelled), and the pending AsyncGet is withdrawn *locally*:
//! `store.cancel_async_get` removes the waiter so its callback never runs,
//! and the canceller retires the keys itself (deleting what is there: a
//! descriptor key we published). If `cancel_async_get` says the waiter
//! already fired, its callback is on its way to the runner and retires
//! instead. If the waiter is being re-armed at that moment (no id yet), the
//! re-arm sees `withdraw_when_registered` and withdraws it as soon as the store
//! hands out the id. Either way no waiter, no tracker entry and no timer
//! entry outlive the receive. On a store that cannot overwrite, a cancel that
//! races the sender's receipt gets ALREADY_EXISTS from the wake-up `set`: it
//! is reported like any wake-up failure (the buffer is cancelled; the waiter,
//! already woken by the receipt, retires the keys).
//!
//! Stale receipts (rule 6): a value whose nonce is not ours (or that does
//! not decode) never completes the buffer. It is counted, and the wait is
//! re-armed with `async_get(key, Some(stale), ..)`: the store calls back only
//! when the key holds something else, so a present stale value cannot make
//! the waiter fire again and again (MemoryStore: exact, event driven;
//! CallbackStore: polling with doubling backoff, see `kv/callback.rs`). We do
//! *not* delete a stale value before re-arming, even where the store can
//! delete: between reading it and deleting it the real sender (or our own
//! cancellation) may have overwritten it, and the delete would destroy the
//! real receipt. On a store that cannot overwrite, a stale value blocks the
//! real sender's `set` (it gets ALREADY_EXISTS) — that is what the epoch in
//! the key name prevents; if it happens anyway the receive ends at its
//! timeout, DEADLINE_EXCEEDED, and is retired like any other.
//!
//! Timeout (rule 7): the deadline publishes DEADLINE_EXCEEDED and retires the
//! waiter locally (no wake-up `set`: nothing needs waking), then the keys.
//! It also serves as a backstop for a cancelled receive whose woken callback
//! never came.
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::kv::{GetCallback, KeyValueStore, WaiterId};
use crate::status::{self, Code, Outcome, Result, Status};
use crate::sync::{AsyncWorkRunner, DeadlineTimer, Future, Metrics, PromiseOnce, TimerId};
use crate::transfer::keys::CompletionKey;
use crate::transfer::receipt::Receipt;

/// Records a buffer's published outcome where the caller sees it (the
/// compute plugin's alias buffer); runs once, before the keys are retired.
pub type RecordOutcome = Box<dyn FnOnce(&Outcome) + Send>;

#[derive(Clone, Debug)]
pub struct ReceiveConfig {
    /// A receive not completed by then becomes DEADLINE_EXCEEDED.
    pub timeout: Option<Duration>,
    /// Delete the keys once the outcome is published. `false` only for the
    /// negative-control tests (and counted as retained keys).
    pub retire_keys: bool,
}

impl Default for ReceiveConfig {
    fn default() -> Self {
        ReceiveConfig {
            timeout: None,
            retire_keys: true,
        }
    }
}

/// One registered AsyncGet. `generation` tells a current callback from one
/// of an earlier (stale-superseded) registration.
#[derive(Clone, Copy, Debug)]
struct Arm {
    generation: u64,
    /// `None` while the store is still registering it.
    waiter: Option<WaiterId>,
    /// Set when a withdrawal found no id yet: withdraw on registration.
    withdraw_when_registered: bool,
}

#[derive(Debug)]
enum Phase {
    /// Nothing published; an AsyncGet is registered on the completion key.
    Waiting(Arm),
    /// Published locally (cancel or deadline) before the key was observed;
    /// the AsyncGet is still registered. `wake_in_flight`: the canceller's
    /// wake-up `set` has not returned yet.
    PublishedEarly { arm: Arm, wake_in_flight: bool },
    /// Published early, and the AsyncGet fired while the wake-up `set` was
    /// still in flight: the canceller retires when its `set` returns.
    WaiterGoneWakeInFlight,
    /// Published; exactly one thread is deleting the keys.
    Retiring,
    /// Keys retired; off the tracker.
    Retired,
}

/// One receive buffer.
struct Receive {
    key: CompletionKey,
    nonce: u64,
    extra_keys: Vec<String>,
    /// The buffer's result; its future is the buffer's readiness event.
    promise: PromiseOnce,
    /// Taken by the one publication.
    record: Mutex<Option<RecordOutcome>>,
    /// Resolved once the keys are retired (deleted, retained, or failed).
    retired: PromiseOnce,
    phase: Mutex<Phase>,
    deadline: Mutex<Option<TimerId>>,
}

/// What a store callback's value means for the buffer.
enum Judged {
    Final(Outcome),
    Stale(Vec<u8>),
}

/// One per client: the receives in flight and what they share.
pub struct ReceiveTracker {
    store: Arc<dyn KeyValueStore>,
    runner: Arc<AsyncWorkRunner>,
    metrics: Arc<Metrics>,
    config: ReceiveConfig,
    timer: Option<DeadlineTimer>,
    receives: Mutex<HashMap<String, Arc<Receive>>>,
}

/// The handle of one receive buffer. Cheap to clone.
#[derive(Clone)]
pub struct PendingReceive {
    tracker: Arc<ReceiveTracker>,
    rx: Arc<Receive>,
}

impl ReceiveTracker {
    pub fn new(
        store: Arc<dyn KeyValueStore>,
        runner: Arc<AsyncWorkRunner>,
        metrics: Arc<Metrics>,
        config: ReceiveConfig,
    ) -> Arc<Self> {
        let timer = config
            .timeout
            .map(|_| DeadlineTimer::new("crosshost-recv-deadline"));
        Arc::new(ReceiveTracker {
            store,
            runner,
            metrics,
            config,
            timer,
            receives: Mutex::new(HashMap::new()),
        })
    }

    /// Receives whose keys are not retired yet.
    pub fn outstanding(&self) -> usize {
        self.receives.lock().len()
    }

    /// Deadline timers still armed (0 once every receive is retired).
    pub fn deadline_timers_pending(&self) -> usize {
        self.timer.as_ref().map_or(0, DeadlineTimer::pending)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    // -- begin ----------------------------------------------------------------

    /// Registers the AsyncGet for one buffer. `extra_keys` are retired
    /// together with the completion key (v2 descriptor keys).
    pub fn begin(
        self: &Arc<Self>,
        key: CompletionKey,
        nonce: u64,
        extra_keys: Vec<String>,
    ) -> Result<PendingReceive> {
        self.begin_recording(key, nonce, extra_keys, None)
    }

    /// `begin`, with the step that records the published outcome.
    pub fn begin_recording(
        self: &Arc<Self>,
        key: CompletionKey,
        nonce: u64,
        extra_keys: Vec<String>,
        record: Option<RecordOutcome>,
    ) -> Result<PendingReceive> {
        let (promise, _) = PromiseOnce::new();
        let (retired, _) = PromiseOnce::new();
        let rx = Arc::new(Receive {
            key,
            nonce,
            extra_keys,
            promise,
            record: Mutex::new(record),
            retired,
            phase: Mutex::new(Phase::Waiting(Arm {
                generation: 0,
                waiter: None,
                withdraw_when_registered: false,
            })),
            deadline: Mutex::new(None),
        });
        let name = rx.key.as_str().to_string();
        {
            let mut receives = self.receives.lock();
            if receives.contains_key(&name) {
                return Err(status::already_exists(format!(
                    "begin receive {name}: a receive on this key is still in flight"
                )));
            }
            receives.insert(name.clone(), rx.clone());
        }
        self.schedule_deadline(&rx);
        if let Err(e) = self.arm_waiter(&rx, 0, None) {
            self.cancel_deadline(&rx);
            self.receives.lock().remove(&name);
            return Err(Status::new(
                e.code,
                format!("begin receive {name}: could not register the AsyncGet: {e}"),
            ));
        }
        self.metrics
            .add_keys_created(1 + rx.extra_keys.len() as u64);
        Ok(PendingReceive {
            tracker: self.clone(),
            rx,
        })
    }

    fn schedule_deadline(self: &Arc<Self>, rx: &Arc<Receive>) {
        let (Some(timeout), Some(timer)) = (self.config.timeout, &self.timer) else {
            return;
        };
        let tracker = Arc::downgrade(self);
        let target = rx.clone();
        let id = timer.schedule_after(timeout, move || {
            if let Some(tracker) = tracker.upgrade() {
                let runner = tracker.runner.clone();
                runner.submit(move || tracker.on_deadline(&target));
            }
        });
        *rx.deadline.lock() = Some(id);
    }

    fn cancel_deadline(&self, rx: &Receive) {
        if let (Some(id), Some(timer)) = (rx.deadline.lock().take(), &self.timer) {
            timer.cancel(id);
        }
    }

    // -- the AsyncGet -------------------------------------------------------

    /// Registers AsyncGet number `generation` (`stale`: wait past that value).
    fn arm_waiter(
        self: &Arc<Self>,
        rx: &Arc<Receive>,
        generation: u64,
        stale: Option<Vec<u8>>,
    ) -> Result<()> {
        let callback = self.signal_callback(rx, generation);
        let key = rx.key.as_str();
        let id = self.store.async_get(key, stale.as_deref(), callback)?;
        self.waiter_registered(rx, generation, id);
        Ok(())
    }

    /// The store callback: from whatever thread the store fires on, hop onto
    /// the runner. Holds the tracker weakly (no store → tracker cycle); if
    /// the tracker is gone, its `Drop` already retired the buffer.
    fn signal_callback(self: &Arc<Self>, rx: &Arc<Receive>, generation: u64) -> GetCallback {
        let tracker: Weak<ReceiveTracker> = Arc::downgrade(self);
        let rx = rx.clone();
        Box::new(move |result| {
            crate::timeline!("receive {}: AsyncGet fired", rx.key);
            crate::sync::timeline::mark(
                crate::sync::timeline::Point::AsyncGetFired,
                rx.key.as_str(),
            );
            if let Some(tracker) = tracker.upgrade() {
                let runner = tracker.runner.clone();
                runner.submit(move || tracker.on_signal(&rx, generation, result));
            }
        })
    }

    fn waiter_registered(self: &Arc<Self>, rx: &Arc<Receive>, generation: u64, id: WaiterId) {
        let withdraw_now = {
            let mut phase = rx.phase.lock();
            match &mut *phase {
                Phase::Waiting(arm) | Phase::PublishedEarly { arm, .. }
                    if arm.generation == generation =>
                {
                    arm.waiter = Some(id);
                    arm.withdraw_when_registered
                }
                _ => false,
            }
        };
        if withdraw_now {
            self.withdraw_waiter(rx);
        }
    }

    // -- the AsyncGet fired (on the runner) -----------------------------------

    fn on_signal(self: &Arc<Self>, rx: &Arc<Receive>, generation: u64, result: Result<Vec<u8>>) {
        crate::timeline!("receive {}: signal on the runner", rx.key);
        crate::sync::timeline::mark(crate::sync::timeline::Point::OnRunner, rx.key.as_str());
        enum Next {
            Publish(Outcome),
            Rearm(Vec<u8>),
            Retire,
            Nothing,
        }
        let judged = self.judge(rx, result);
        let next = {
            let mut phase = rx.phase.lock();
            match &mut *phase {
                Phase::Waiting(arm) if arm.generation == generation => match judged {
                    Judged::Final(outcome) => {
                        *phase = Phase::Retiring;
                        Next::Publish(outcome)
                    }
                    Judged::Stale(value) => {
                        *arm = Arm {
                            generation: generation + 1,
                            waiter: None,
                            withdraw_when_registered: false,
                        };
                        Next::Rearm(value)
                    }
                },
                Phase::PublishedEarly {
                    arm,
                    wake_in_flight,
                } if arm.generation == generation => {
                    if *wake_in_flight {
                        *phase = Phase::WaiterGoneWakeInFlight;
                        Next::Nothing
                    } else {
                        *phase = Phase::Retiring;
                        Next::Retire
                    }
                }
                other => {
                    log::debug!(
                        "receive {}: ignoring a signal of AsyncGet #{generation} in {other:?}",
                        rx.key
                    );
                    Next::Nothing
                }
            }
        };
        match next {
            Next::Publish(outcome) => {
                self.publish(rx, outcome);
                self.retire(rx);
            }
            Next::Rearm(stale) => self.rearm_after_stale(rx, generation + 1, stale),
            Next::Retire => self.retire(rx),
            Next::Nothing => {}
        }
    }

    /// A value decides the buffer only if it is a receipt carrying our nonce.
    fn judge(&self, rx: &Receive, result: Result<Vec<u8>>) -> Judged {
        let value = match result {
            Ok(value) => value,
            Err(e) => {
                return Judged::Final(Err(Status::new(
                    e.code,
                    format!(
                        "receive {}: the key-value store failed while waiting: {e}",
                        rx.key
                    ),
                )))
            }
        };
        match Receipt::decode(&value) {
            Ok(receipt) if receipt.nonce() == rx.nonce => Judged::Final(match receipt {
                Receipt::Ok { .. } => Ok(()),
                Receipt::Error { status, .. } => Err(status),
                Receipt::Cancel { .. } => Err(status::cancelled(format!(
                    "receive {}: cancelled (cancel receipt)",
                    rx.key
                ))),
            }),
            Ok(receipt) => {
                log::warn!(
                    "receive {}: stale receipt with nonce {:x} (ours is {:x}) rejected",
                    rx.key,
                    receipt.nonce(),
                    rx.nonce
                );
                Judged::Stale(value)
            }
            Err(e) => {
                log::warn!("receive {}: foreign value rejected: {e}", rx.key);
                Judged::Stale(value)
            }
        }
    }

    fn rearm_after_stale(self: &Arc<Self>, rx: &Arc<Receive>, generation: u64, stale: Vec<u8>) {
        self.metrics.add_stale_receipts_rejected(1);
        if let Err(e) = self.arm_waiter(rx, generation, Some(stale)) {
            // The store cannot wait for us any more: that is the outcome.
            self.on_signal(rx, generation, Err(e));
        }
    }

    // -- publish, then retire -------------------------------------------------

    /// The buffer's readiness event fires here (its future is set), then the
    /// outcome is recorded where the caller sees it.
    fn publish(&self, rx: &Receive, outcome: Outcome) {
        rx.promise.set(outcome.clone());
        crate::timeline!("receive {}: published ({})", rx.key, outcome.is_ok());
        crate::sync::timeline::mark(crate::sync::timeline::Point::Published, rx.key.as_str());
        let record = rx.record.lock().take();
        if let Some(record) = record {
            record(&outcome);
            crate::timeline!("receive {}: recorded", rx.key);
            crate::sync::timeline::mark(crate::sync::timeline::Point::Recorded, rx.key.as_str());
        }
    }

    /// Deletes the buffer's keys. Only the thread that moved the phase to
    /// `Retiring` calls this, after the outcome was published. The deletes
    /// run asynchronously (a peer's store or a framework's callback answers
    /// them), so no lifecycle thread waits on one; the receive is retired
    /// once every delete answered.
    fn retire(self: &Arc<Self>, rx: &Arc<Receive>) {
        self.cancel_deadline(rx);
        crate::sync::kill_points::reached(crate::sync::kill_points::RECEIVER_BEFORE_DELETE);
        let tracker = Arc::downgrade(self);
        let retiring = rx.clone();
        self.delete_keys(rx, move |failure| {
            // Off the map first: a new receive may reuse the key name.
            if let Some(tracker) = tracker.upgrade() {
                let mut receives = tracker.receives.lock();
                if receives
                    .get(retiring.key.as_str())
                    .is_some_and(|r| Arc::ptr_eq(r, &retiring))
                {
                    receives.remove(retiring.key.as_str());
                }
            }
            Self::retired(&retiring, failure);
        });
    }

    /// Deletes (or retains) `rx`'s keys, counting each outcome; `done` gets
    /// the first delete failure once every delete answered.
    fn delete_keys(&self, rx: &Receive, done: impl FnOnce(Option<Status>) + Send + 'static) {
        let keys: Vec<String> = std::iter::once(rx.key.as_str().to_string())
            .chain(rx.extra_keys.iter().cloned())
            .collect();
        if !self.config.retire_keys || !self.store.capabilities().can_delete {
            log::debug!(
                "receive {}: {} key(s) retained (store cannot delete, or retirement disabled)",
                rx.key,
                keys.len()
            );
            self.metrics.add_retained_keys(keys.len() as u64);
            return done(None);
        }
        struct Deletes {
            remaining: usize,
            failure: Option<Status>,
            done: Option<Box<dyn FnOnce(Option<Status>) + Send>>,
        }
        let deletes = Arc::new(Mutex::new(Deletes {
            remaining: keys.len(),
            failure: None,
            done: Some(Box::new(done)),
        }));
        for key in keys {
            let (metrics, deletes) = (self.metrics.clone(), deletes.clone());
            let receive = rx.key.as_str().to_string();
            let deleted_key = key.clone();
            self.store.delete_async(
                &key,
                Box::new(move |outcome| {
                    let mut state = deletes.lock();
                    match outcome {
                        Ok(()) => metrics.add_keys_deleted(1),
                        Err(e) => {
                            log::error!(
                                "receive {receive}: could not delete key {deleted_key}: {e} (the \
                                 buffer's status stands; the key stays in the store)"
                            );
                            metrics.add_delete_failures(1);
                            state.failure.get_or_insert(e);
                        }
                    }
                    state.remaining -= 1;
                    if state.remaining == 0 {
                        let (done, failure) = (state.done.take(), state.failure.take());
                        drop(state);
                        if let Some(done) = done {
                            done(failure);
                        }
                    }
                }),
            );
        }
    }

    /// The end of a receive: its keys are deleted, retained or failed.
    fn retired(rx: &Receive, failure: Option<Status>) {
        crate::timeline!("receive {}: keys retired", rx.key);
        crate::sync::timeline::mark(crate::sync::timeline::Point::KeysRetired, rx.key.as_str());
        *rx.phase.lock() = Phase::Retired;
        rx.retired.set(failure.map_or(Ok(()), Err));
    }

    // -- cancellation ---------------------------------------------------------

    fn cancel(self: &Arc<Self>, rx: &Arc<Receive>, reason: Status) -> Result<()> {
        {
            let mut phase = rx.phase.lock();
            match &*phase {
                Phase::Waiting(arm) => {
                    *phase = Phase::PublishedEarly {
                        arm: *arm,
                        wake_in_flight: true,
                    };
                }
                _ => {
                    drop(phase);
                    return Err(self.already_decided("cancel", rx));
                }
            }
        }
        self.metrics.add_cancellations(1);
        self.publish(rx, Err(reason));
        let woke = self.store.set(
            rx.key.as_str(),
            &Receipt::Cancel { nonce: rx.nonce }.encode(),
        );
        enum Next {
            Retire,
            WithdrawWaiter,
            Nothing,
        }
        let next = {
            let mut phase = rx.phase.lock();
            match &mut *phase {
                Phase::PublishedEarly { wake_in_flight, .. } => {
                    *wake_in_flight = false;
                    if woke.is_err() {
                        Next::WithdrawWaiter
                    } else {
                        Next::Nothing // the woken callback retires
                    }
                }
                Phase::WaiterGoneWakeInFlight => {
                    *phase = Phase::Retiring;
                    Next::Retire
                }
                other => {
                    log::error!("receive {}: unexpected {other:?} after cancel", rx.key);
                    Next::Nothing
                }
            }
        };
        match next {
            Next::Retire => self.retire(rx),
            Next::WithdrawWaiter => self.withdraw_waiter(rx),
            Next::Nothing => {}
        }
        woke.map_err(|e| {
            Status::new(
                e.code,
                format!(
                    "cancel receive {}: the buffer is cancelled, but the wake-up set failed \
                     ({e}); its AsyncGet was withdrawn locally",
                    rx.key
                ),
            )
        })
    }

    fn already_decided(&self, what: &str, rx: &Receive) -> Status {
        let outcome = match rx.promise.future().try_get() {
            Some(Ok(())) => "it already completed".to_string(),
            Some(Err(e)) if e.code == Code::Cancelled => format!("it is already cancelled ({e})"),
            Some(Err(e)) => format!("it already failed ({e})"),
            None => "its outcome is already decided".to_string(),
        };
        status::failed_precondition(format!("{what} receive {}: {outcome}", rx.key))
    }

    /// Withdraws a published-early buffer's AsyncGet without any store
    /// wake-up, then its keys (see the module doc, rule 5).
    fn withdraw_waiter(self: &Arc<Self>, rx: &Arc<Receive>) {
        let waiter = {
            let mut phase = rx.phase.lock();
            match &mut *phase {
                Phase::PublishedEarly {
                    arm,
                    wake_in_flight: false,
                } => match arm.waiter {
                    Some(id) => id,
                    None => {
                        arm.withdraw_when_registered = true;
                        return;
                    }
                },
                _ => return,
            }
        };
        if !self.store.cancel_async_get(rx.key.as_str(), waiter) {
            return; // it fired: its callback retires
        }
        {
            let mut phase = rx.phase.lock();
            match &*phase {
                Phase::PublishedEarly { arm, .. } if arm.waiter == Some(waiter) => {
                    *phase = Phase::Retiring;
                }
                _ => return,
            }
        }
        self.retire(rx);
    }

    // -- deadline -------------------------------------------------------------

    fn on_deadline(self: &Arc<Self>, rx: &Arc<Receive>) {
        let timed_out = {
            let mut phase = rx.phase.lock();
            match &*phase {
                Phase::Waiting(arm) => {
                    *phase = Phase::PublishedEarly {
                        arm: *arm,
                        wake_in_flight: false,
                    };
                    true
                }
                Phase::PublishedEarly {
                    wake_in_flight: false,
                    ..
                } => false, // backstop for a cancel whose wake-up never arrived
                _ => return,
            }
        };
        if timed_out {
            self.metrics.add_timeouts(1);
            let timeout = self.config.timeout.unwrap_or_default();
            self.publish(
                rx,
                Err(status::deadline_exceeded(format!(
                    "receive {}: no receipt within {timeout:?} (receive_timeout_ms): the sender \
                     never sent, or its bytes never arrived. A JAX sender sends only committed \
                     arrays: one made under jax.default_device(...) and not jax.device_put to a \
                     device is never sent",
                    rx.key
                ))),
            );
        }
        self.withdraw_waiter(rx);
    }
}

impl Drop for ReceiveTracker {
    /// The client is going away with receives in flight: each is cancelled
    /// (if still pending), its waiter retired, its keys deleted. Nobody else
    /// can be working on them: every other path holds the tracker alive.
    fn drop(&mut self) {
        let receives: Vec<Arc<Receive>> = self.receives.lock().drain().map(|(_, rx)| rx).collect();
        for rx in receives {
            let waiter = {
                let mut phase = rx.phase.lock();
                let arm = match &*phase {
                    Phase::Waiting(arm) | Phase::PublishedEarly { arm, .. } => *arm,
                    _ => continue,
                };
                let was_waiting = matches!(*phase, Phase::Waiting(_));
                *phase = Phase::Retiring;
                drop(phase);
                if was_waiting {
                    self.publish(
                        &rx,
                        Err(status::cancelled(format!(
                            "receive {}: the client's receive tracker shut down",
                            rx.key
                        ))),
                    );
                }
                arm.waiter
            };
            if let Some(id) = waiter {
                self.store.cancel_async_get(rx.key.as_str(), id);
            }
            self.cancel_deadline(&rx);
            let retiring = rx.clone();
            self.delete_keys(&rx, move |failure| Self::retired(&retiring, failure));
        }
    }
}

impl PendingReceive {
    /// The buffer's readiness event: resolves with its one terminal outcome.
    pub fn future(&self) -> Future {
        self.rx.promise.future()
    }

    /// Resolves once the keys are retired (`Err`: the first delete failure).
    pub fn retired(&self) -> Future {
        self.rx.retired.future()
    }

    pub fn key(&self) -> &CompletionKey {
        &self.rx.key
    }

    pub fn nonce(&self) -> u64 {
        self.rx.nonce
    }

    pub fn extra_keys(&self) -> &[String] {
        &self.rx.extra_keys
    }

    /// Cancels the receive with `reason` (an error status). FAILED_PRECONDITION
    /// if it already has an outcome; the wake-up failure if that `set` failed
    /// (the buffer is cancelled all the same, see the module doc).
    pub fn cancel(&self, reason: Status) -> Result<()> {
        self.tracker.cancel(&self.rx, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryStore;

    fn tracker(store: Arc<MemoryStore>, config: ReceiveConfig) -> Arc<ReceiveTracker> {
        ReceiveTracker::new(
            store,
            Arc::new(AsyncWorkRunner::new("recv-test", 2)),
            Arc::new(Metrics::new()),
            config,
        )
    }

    fn key(i: u64) -> CompletionKey {
        CompletionKey::new("unit", 1, i).unwrap()
    }

    #[test]
    fn ok_receipt_publishes_ok_then_retires_both_keys() {
        let store = Arc::new(MemoryStore::new());
        let t = tracker(store.clone(), ReceiveConfig::default());
        let desc = key(0).descriptor_key();
        store.set(&desc, b"descriptor").unwrap();
        let rx = t.begin(key(0), 9, vec![desc]).unwrap();
        store
            .set(key(0).as_str(), &Receipt::Ok { nonce: 9 }.encode())
            .unwrap();
        assert_eq!(rx.future().wait(), Ok(()));
        assert_eq!(rx.retired().wait(), Ok(()));
        assert!(store.is_empty());
        assert_eq!(t.outstanding(), 0);
        let m = t.metrics().snapshot();
        assert_eq!(
            (m.keys_created, m.keys_deleted, m.keys_outstanding),
            (2, 2, 0)
        );
    }

    #[test]
    fn error_receipt_publishes_the_senders_status_and_still_retires() {
        let store = Arc::new(MemoryStore::new());
        let t = tracker(store.clone(), ReceiveConfig::default());
        let rx = t.begin(key(0), 1, vec![]).unwrap();
        let receipt = Receipt::Error {
            nonce: 1,
            status: status::data_loss("sender lost its buffer"),
        };
        store.set(key(0).as_str(), &receipt.encode()).unwrap();
        let err = rx.future().wait().unwrap_err();
        assert_eq!(err, status::data_loss("sender lost its buffer"));
        rx.retired().wait().unwrap();
        assert!(store.is_empty());
    }

    #[test]
    fn a_second_begin_on_a_key_in_flight_is_already_exists() {
        let store = Arc::new(MemoryStore::new());
        let t = tracker(store, ReceiveConfig::default());
        let _rx = t.begin(key(0), 1, vec![]).unwrap();
        let err = t.begin(key(0), 2, vec![]).err().unwrap();
        assert_eq!(err.code, Code::AlreadyExists);
        assert_eq!(t.outstanding(), 1);
    }

    #[test]
    fn dropping_the_tracker_cancels_pending_receives_and_retires_their_waiters() {
        let store = Arc::new(MemoryStore::new());
        let t = tracker(store.clone(), ReceiveConfig::default());
        let future = t.begin(key(0), 1, vec![]).unwrap().future();
        assert_eq!(store.waiter_count(), 1);
        drop(t);
        assert_eq!(future.wait().unwrap_err().code, Code::Cancelled);
        assert_eq!(store.waiter_count(), 0);
    }
}
