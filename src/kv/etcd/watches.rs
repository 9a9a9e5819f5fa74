//! Every wait of one etcd store, on one multiplexed watch stream.
//!
//! A wait on a key is a watch of that key from "now", then — once etcd has
//! confirmed the watch — a Range: a write before the watch shows in the
//! Range, a write after it comes as an event, so none is missed. (The other
//! order, a Range and then a watch from its revision + 1, makes etcd serve
//! the watch from history whenever any write landed in between, and etcd
//! catches such "unsynced" watches up only every 100 ms: a 100 ms stall on
//! most transfers, where the receiver's own descriptor write is that write.)
//! All watches of a store share one gRPC stream, each under an id we choose.
//! When the stream breaks (etcd restarted, a network cut), every key's watch
//! is gone: the key is "uncovered", is re-armed (a new watch, a new Range)
//! as soon as a stream is back, and its waiters fail UNAVAILABLE if it stays
//! uncovered longer than the call timeout. A watch that etcd cancels (a
//! compacted start revision) is re-armed the same way.
//!
//! Liveness: each process of the job keeps its session entry under its
//! lease, all entries under one prefix, watched by one prefix watch (not
//! one per peer: etcd's work then grows with the job, not its square). An
//! entry's deletion (lease revoked or expired) marks its process lost; waits on keys that process writes (the key names say who writes
//! them) then end UNAVAILABLE, naming it, instead of at their deadline. A
//! value the lost process wrote before it went is still delivered: the check
//! reads the key as it was just before the deletion.
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, GetOptions, WatchOptions, WatchResponse};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use super::runtime::{self, status_of};
use crate::kv::{GetCallback, WaiterId};
use crate::status::{self, Result, Status};

/// Which process writes a key, from its name (`None`: cannot tell).
pub type WriterOf = Box<dyn Fn(&str) -> Option<u32> + Send + Sync>;

/// The stream is opened with a watch on this key, which nothing writes.
/// Under the store's key prefix, like every key it watches.
const ANCHOR_KEY: &str = "crosshost/.watch-anchor";
const ANCHOR_WATCH_ID: i64 = 1;
const MAINTENANCE_PERIOD: Duration = Duration::from_millis(100);

enum Waiter {
    Value {
        id: u64,
        /// A value equal to this one does not satisfy the waiter.
        unless: Option<Vec<u8>>,
        callback: GetCallback,
    },
}

#[derive(Default)]
struct KeyEntry {
    waiters: Vec<Waiter>,
    /// For a prefix of liveness keys: each key's process (its absence
    /// means the process is gone). Such an entry is watched as a prefix.
    members: Option<HashMap<String, u32>>,
    /// The watch covering this key on the live stream.
    watch: Option<i64>,
    /// etcd confirmed that watch: a Range now sees everything before it.
    confirmed: bool,
    /// Since when no watch covers the key (stream down, a failed Range).
    uncovered_since: Option<Instant>,
    /// A maintenance re-arm is in flight.
    rearming: bool,
}

impl KeyEntry {
    fn has_value_waiters(&self) -> bool {
        !self.waiters.is_empty()
    }

    fn is_idle(&self) -> bool {
        self.waiters.is_empty() && self.members.as_ref().is_none_or(HashMap::is_empty)
    }

    /// Removes the waiters `value` satisfies, for delivery.
    fn take_satisfied(&mut self, value: &[u8], fires: &mut Vec<Fire>) {
        let mut kept = Vec::with_capacity(self.waiters.len());
        for waiter in self.waiters.drain(..) {
            match waiter {
                Waiter::Value {
                    unless, callback, ..
                } if unless.as_deref() != Some(value) => {
                    fires.push((callback, Ok(value.to_vec())));
                }
                other => kept.push(other),
            }
        }
        self.waiters = kept;
    }

    /// Removes every value waiter, each to be failed with `error`.
    fn take_value_waiters(&mut self, error: &Status, fires: &mut Vec<Fire>) {
        for Waiter::Value { callback, .. } in self.waiters.drain(..) {
            fires.push((callback, Err(error.clone())));
        }
    }

    /// The member whose liveness key is `key`, gone.
    fn take_member(&mut self, key: &str) -> Option<u32> {
        self.members.as_mut()?.remove(key)
    }

    /// The members whose liveness keys are not in `present`, gone.
    fn take_missing(&mut self, present: &HashSet<String>) -> Vec<u32> {
        let Some(members) = self.members.as_mut() else {
            return Vec::new();
        };
        let missing: Vec<String> = members
            .keys()
            .filter(|k| !present.contains(*k))
            .cloned()
            .collect();
        missing.iter().filter_map(|k| members.remove(k)).collect()
    }
}

type Fire = (GetCallback, Result<Vec<u8>>);

#[derive(Default)]
struct State {
    keys: HashMap<String, KeyEntry>,
    by_watch: HashMap<i64, String>,
    next_waiter: u64,
    next_watch_id: i64,
    /// Generation of the live stream; `None` while there is none.
    stream: Option<u64>,
    /// Streams opened so far (the last generation).
    opened: u64,
    last_error: String,
    lost: HashSet<u32>,
    writer_of: Option<WriterOf>,
    closed: bool,
}

impl State {
    fn writer(&self, key: &str) -> Option<u32> {
        self.writer_of.as_ref().and_then(|w| w(key))
    }

    fn lost_writer(&self, key: &str) -> Option<u32> {
        self.writer(key).filter(|p| self.lost.contains(p))
    }

    /// Asks for a watch of `key` from now, if a stream is up and none is
    /// there; the Range follows etcd's confirmation.
    fn open_watch(&mut self, key: &str, requests: &mpsc::UnboundedSender<StreamRequest>) {
        self.open_watch_from(key, 0, requests)
    }

    /// `open_watch` from `start_revision` (0: now).
    fn open_watch_from(
        &mut self,
        key: &str,
        start_revision: i64,
        requests: &mpsc::UnboundedSender<StreamRequest>,
    ) {
        let Some(generation) = self.stream else {
            if let Some(entry) = self.keys.get_mut(key) {
                entry.uncovered_since.get_or_insert_with(Instant::now);
            }
            return;
        };
        let watch_id = self.next_watch_id;
        let Some(entry) = self.keys.get_mut(key) else {
            return;
        };
        if entry.watch.is_some() {
            return;
        }
        entry.watch = Some(watch_id);
        entry.confirmed = false;
        let prefix = entry.members.is_some();
        self.next_watch_id += 1;
        self.by_watch.insert(watch_id, key.to_string());
        let _ = requests.send(StreamRequest::Create {
            generation,
            key: key.to_string(),
            prefix,
            watch_id,
            start_revision,
        });
    }

    /// Drops an entry nobody waits on, and its watch.
    fn forget_if_idle(&mut self, key: &str, requests: &mpsc::UnboundedSender<StreamRequest>) {
        let idle = self.keys.get(key).is_some_and(KeyEntry::is_idle);
        if !idle {
            return;
        }
        if let Some(entry) = self.keys.remove(key) {
            if let (Some(id), Some(generation)) = (entry.watch, self.stream) {
                self.by_watch.remove(&id);
                let _ = requests.send(StreamRequest::Cancel {
                    generation,
                    watch_id: id,
                });
            }
        }
    }
}

enum StreamRequest {
    Create {
        generation: u64,
        key: String,
        /// Watch every key under `key`.
        prefix: bool,
        watch_id: i64,
        start_revision: i64,
    },
    Cancel {
        generation: u64,
        watch_id: i64,
    },
}

pub(super) struct Watches {
    state: Mutex<State>,
    /// Ranges started and not yet settled (tests wait for 0).
    arms_in_flight: AtomicUsize,
    requests: mpsc::UnboundedSender<StreamRequest>,
    client: Client,
    call_timeout: Duration,
    endpoints: String,
    /// The key the stream's first watch is on (the prefix + ANCHOR_KEY).
    anchor_key: String,
}

fn lost_status(process: u32, key: &str) -> Status {
    status::unavailable(format!(
        "process {process} of the job is gone (its etcd lease was revoked or expired: it was \
         killed, exited or destroyed its client) before it wrote {key}"
    ))
}

fn fire_all(fires: Vec<Fire>) {
    for (callback, value) in fires {
        runtime::deliver(move || callback(value));
    }
}

impl Watches {
    /// Starts the stream task; it runs until `stop` changes.
    pub(super) fn start(
        client: Client,
        call_timeout: Duration,
        endpoints: String,
        key_prefix: &str,
        stop: watch::Receiver<bool>,
    ) -> Arc<Watches> {
        let (requests, pending) = mpsc::unbounded_channel();
        let watches = Arc::new(Watches {
            state: Mutex::new(State {
                next_watch_id: ANCHOR_WATCH_ID + 1,
                last_error: "no stream yet".into(),
                ..State::default()
            }),
            requests,
            arms_in_flight: AtomicUsize::new(0),
            client,
            call_timeout,
            endpoints,
            anchor_key: format!("{key_prefix}{ANCHOR_KEY}"),
        });
        runtime::handle().spawn(watches.clone().run(pending, stop));
        watches
    }

    pub(super) fn register(
        self: &Arc<Self>,
        key: &str,
        unless: Option<&[u8]>,
        callback: GetCallback,
    ) -> Result<WaiterId> {
        let id = {
            let mut state = self.state.lock();
            if state.closed {
                return Err(status::unavailable(format!(
                    "etcd store ({}) is closed: cannot wait on {key}",
                    self.endpoints
                )));
            }
            let id = state.next_waiter;
            state.next_waiter += 1;
            state
                .keys
                .entry(key.to_string())
                .or_default()
                .waiters
                .push(Waiter::Value {
                    id,
                    unless: unless.map(<[u8]>::to_vec),
                    callback,
                });
            let confirmed = state.keys.get(key).is_some_and(|e| e.confirmed);
            if !confirmed {
                // The Range runs when etcd confirms the watch (a watch being
                // opened covers this waiter too).
                state.open_watch(key, &self.requests);
                return Ok(WaiterId(id));
            }
            id
        };
        self.spawn_arm(key.to_string(), None, false);
        Ok(WaiterId(id))
    }

    /// Waits on `key` with a watch from `start_revision`, no Range first:
    /// how tests reach the compaction path (an old revision already
    /// compacted away). UNAVAILABLE while no stream is up.
    pub(super) fn register_from_revision(
        &self,
        key: &str,
        start_revision: i64,
        callback: GetCallback,
    ) -> Result<WaiterId> {
        let mut state = self.state.lock();
        if state.stream.is_none() {
            return Err(status::unavailable("etcd watch stream is down"));
        }
        if state.keys.get(key).is_some_and(|e| e.watch.is_some()) {
            return Err(status::failed_precondition(format!(
                "{key} is already watched"
            )));
        }
        let id = state.next_waiter;
        state.next_waiter += 1;
        state
            .keys
            .entry(key.to_string())
            .or_default()
            .waiters
            .push(Waiter::Value {
                id,
                unless: None,
                callback,
            });
        state.open_watch_from(key, start_revision, &self.requests);
        Ok(WaiterId(id))
    }

    pub(super) fn stream_is_up(&self) -> bool {
        self.state.lock().stream.is_some()
    }

    pub(super) fn streams_opened(&self) -> u64 {
        self.state.lock().opened
    }

    pub(super) fn cancel(&self, key: &str, id: WaiterId) -> bool {
        let mut state = self.state.lock();
        let Some(entry) = state.keys.get_mut(key) else {
            return false;
        };
        let before = entry.waiters.len();
        entry
            .waiters
            .retain(|Waiter::Value { id: mine, .. }| *mine != id.0);
        let found = entry.waiters.len() < before;
        state.forget_if_idle(key, &self.requests);
        found
    }

    /// From now on, the processes whose liveness keys are given (all under
    /// `prefix`) are watched, with one watch of the prefix; `writer_of` says
    /// whose keys a lost process leaves unwritten.
    pub(super) fn track_processes(
        self: &Arc<Self>,
        prefix: &str,
        entries: Vec<(u32, String)>,
        writer_of: WriterOf,
    ) -> Result<()> {
        if let Some((_, key)) = entries.iter().find(|(_, key)| !key.starts_with(prefix)) {
            return Err(status::invalid_argument(format!(
                "liveness key {key} is not under the tracked prefix {prefix}"
            )));
        }
        let mut state = self.state.lock();
        state.writer_of = Some(writer_of);
        let entry = state.keys.entry(prefix.to_string()).or_default();
        if entry.has_value_waiters() {
            return Err(status::failed_precondition(format!(
                "{prefix} is waited on as a key: it cannot also be a prefix of liveness keys"
            )));
        }
        entry
            .members
            .get_or_insert_with(HashMap::new)
            .extend(entries.into_iter().map(|(process, key)| (key, process)));
        state.open_watch(prefix, &self.requests);
        Ok(())
    }

    /// Ends every wait: value waiters are failed (their callbacks run once,
    /// as the store contract says), and no new wait is accepted.
    pub(super) fn close(&self) {
        let mut fires = Vec::new();
        {
            let mut state = self.state.lock();
            state.closed = true;
            let error = status::unavailable(format!(
                "etcd store ({}) closed while waiting",
                self.endpoints
            ));
            for (_, mut entry) in state.keys.drain() {
                entry.take_value_waiters(&error, &mut fires);
            }
            state.by_watch.clear();
        }
        fire_all(fires);
    }

    pub(super) fn pending_waiters(&self) -> usize {
        self.state
            .lock()
            .keys
            .values()
            .map(|e| e.waiters.len())
            .sum()
    }

    /// Number of watches on the live stream (the anchor not counted).
    pub(super) fn active_watches(&self) -> usize {
        self.state.lock().by_watch.len()
    }

    /// Waits not settled yet: Ranges in flight, and keys without a watch
    /// etcd confirmed (their Range is still to come).
    pub(super) fn arms_in_flight(&self) -> usize {
        let unconfirmed = {
            let state = self.state.lock();
            state.keys.values().filter(|e| !e.confirmed).count()
        };
        unconfirmed + self.arms_in_flight.load(Ordering::Acquire)
    }

    fn spawn_arm(self: &Arc<Self>, key: String, at_revision: Option<i64>, rearm: bool) {
        let watches = self.clone();
        self.arms_in_flight.fetch_add(1, Ordering::AcqRel);
        runtime::handle().spawn(async move {
            watches.clone().arm(key, at_revision, rearm).await;
            watches.arms_in_flight.fetch_sub(1, Ordering::AcqRel);
        });
    }

    /// Range(key) (at `at_revision` for a lost writer's check; every key
    /// under it, names only, for a prefix of liveness keys), then settles
    /// the key's waiters. The key's watch covers everything after.
    async fn arm(self: Arc<Self>, key: String, at_revision: Option<i64>, rearm: bool) {
        let mut client = self.client.clone();
        let prefix = self
            .state
            .lock()
            .keys
            .get(&key)
            .is_some_and(|e| e.members.is_some());
        let mut options =
            at_revision.map_or_else(GetOptions::new, |r| GetOptions::new().with_revision(r));
        if prefix {
            options = options.with_prefix().with_keys_only();
        }
        let what = format!("etcd range {key}");
        let range = runtime::bounded(&what, self.call_timeout, async {
            client
                .get(key.as_str(), Some(options))
                .await
                .map(|answer| {
                    let present: HashSet<String> = answer
                        .kvs()
                        .iter()
                        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
                        .collect();
                    let value = answer.kvs().first().map(|kv| kv.value().to_vec());
                    (value, present)
                })
                .map_err(|e| status_of(&what, e))
        })
        .await;
        let mut fires = Vec::new();
        let mut gone = Vec::new();
        {
            let mut guard = self.state.lock();
            let state = &mut *guard;
            let lost_writer = state.lost_writer(&key);
            let Some(entry) = state.keys.get_mut(&key) else {
                return;
            };
            if rearm {
                entry.rearming = false;
            }
            match range {
                Ok((value, present)) => {
                    if prefix {
                        gone = entry.take_missing(&present);
                    } else if let Some(v) = &value {
                        entry.take_satisfied(v, &mut fires);
                    }
                    if let Some(process) = lost_writer {
                        entry.take_value_waiters(&lost_status(process, &key), &mut fires);
                    }
                    if entry.confirmed {
                        entry.uncovered_since = None;
                    }
                }
                Err(error) => {
                    match lost_writer {
                        Some(process) => {
                            entry.take_value_waiters(&lost_status(process, &key), &mut fires)
                        }
                        // Maintenance ranges again while the stream is up.
                        None => {
                            entry.uncovered_since.get_or_insert_with(Instant::now);
                        }
                    }
                    state.last_error = error.message;
                }
            }
            state.forget_if_idle(&key, &self.requests);
        }
        fire_all(fires);
        for process in gone {
            self.process_lost(process, None);
        }
    }

    /// `process`'s liveness key was deleted at `revision` (`None`: found
    /// absent). Waits on keys it writes are checked as of just before.
    fn process_lost(self: &Arc<Self>, process: u32, revision: Option<i64>) {
        let keys: Vec<String> = {
            let mut state = self.state.lock();
            if !state.lost.insert(process) {
                return;
            }
            state
                .keys
                .iter()
                .filter(|(_, e)| e.has_value_waiters())
                .map(|(k, _)| k.clone())
                .filter(|k| state.writer(k) == Some(process))
                .collect()
        };
        log::warn!(
            "etcd: process {process} of the job is gone (its lease ended); failing {} waits on \
             keys it writes",
            keys.len()
        );
        for key in keys {
            self.spawn_arm(key, revision.map(|r| r - 1), false);
        }
    }

    async fn run(
        self: Arc<Self>,
        mut requests: mpsc::UnboundedReceiver<StreamRequest>,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut generation = 0u64;
        let mut backoff = Duration::from_millis(50);
        let mut tick = tokio::time::interval(MAINTENANCE_PERIOD);
        loop {
            let mut client = self.client.clone();
            let opened = tokio::select! {
                _ = stop.changed() => return,
                r = tokio::time::timeout(
                    self.call_timeout,
                    client.watch(self.anchor_key.as_str(), Some(WatchOptions::new().with_watch_id(ANCHOR_WATCH_ID))),
                ) => r,
            };
            let stream = match opened {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    self.stream_lost(&status_of("etcd watch stream", e).message);
                    if !self
                        .wait_before_retry(&mut stop, &mut tick, &mut backoff)
                        .await
                    {
                        return;
                    }
                    continue;
                }
                Err(_) => {
                    self.stream_lost("etcd watch stream: no answer within the call timeout");
                    if !self
                        .wait_before_retry(&mut stop, &mut tick, &mut backoff)
                        .await
                    {
                        return;
                    }
                    continue;
                }
            };
            generation += 1;
            backoff = Duration::from_millis(50);
            {
                let mut state = self.state.lock();
                state.stream = Some(generation);
                state.opened = generation;
                let keys: Vec<String> = state.keys.keys().cloned().collect();
                if generation > 1 {
                    log::info!(
                        "etcd watch stream re-established; re-arming {} keys",
                        keys.len()
                    );
                }
                for key in keys {
                    state.open_watch(&key, &self.requests);
                }
            }
            let (mut sender, mut responses) = stream.split();
            let broken = loop {
                tokio::select! {
                    _ = stop.changed() => return,
                    message = responses.message() => match message {
                        Ok(Some(response)) => self.on_response(response),
                        Ok(None) => break "etcd closed the watch stream".to_string(),
                        Err(e) => break status_of("etcd watch stream", e).message,
                    },
                    request = requests.recv() => match request {
                        None => return,
                        Some(StreamRequest::Create { generation: g, key, prefix, watch_id, start_revision })
                            if g == generation =>
                        {
                            let mut options = WatchOptions::new()
                                .with_watch_id(watch_id)
                                .with_start_revision(start_revision);
                            if prefix {
                                options = options.with_prefix();
                            }
                            if let Err(e) = sender.watch(key, Some(options)).await {
                                break status_of("etcd watch create", e).message;
                            }
                        }
                        Some(StreamRequest::Cancel { generation: g, watch_id }) if g == generation => {
                            if let Err(e) = sender.cancel(watch_id).await {
                                break status_of("etcd watch cancel", e).message;
                            }
                        }
                        Some(_) => {} // meant for a stream that is gone
                    },
                    _ = tick.tick() => self.maintain(),
                }
            };
            log::warn!("{broken}; reconnecting");
            self.stream_lost(&broken);
        }
    }

    /// Sleeps the backoff while keeping maintenance going; false: stop.
    async fn wait_before_retry(
        self: &Arc<Self>,
        stop: &mut watch::Receiver<bool>,
        tick: &mut tokio::time::Interval,
        backoff: &mut Duration,
    ) -> bool {
        let until = tokio::time::Instant::now() + *backoff;
        *backoff = (*backoff * 2).min(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = stop.changed() => return false,
                _ = tokio::time::sleep_until(until) => return true,
                _ = tick.tick() => self.maintain(),
            }
        }
    }

    fn stream_lost(&self, why: &str) {
        let mut state = self.state.lock();
        state.stream = None;
        state.last_error = why.to_string();
        state.by_watch.clear();
        let now = Instant::now();
        for entry in state.keys.values_mut() {
            entry.watch = None;
            entry.confirmed = false;
            entry.uncovered_since.get_or_insert(now);
        }
    }

    /// Re-arms uncovered keys while a stream is up; fails the waits of keys
    /// uncovered for longer than the call timeout.
    fn maintain(self: &Arc<Self>) {
        let mut fires = Vec::new();
        let mut rearm = Vec::new();
        let mut reopen = Vec::new();
        {
            let mut state = self.state.lock();
            let up = state.stream.is_some();
            let last_error = state.last_error.clone();
            let mut emptied = Vec::new();
            for (key, entry) in state.keys.iter_mut() {
                let Some(since) = entry.uncovered_since else {
                    continue;
                };
                if since.elapsed() > self.call_timeout && entry.has_value_waiters() {
                    let error = status::unavailable(format!(
                        "etcd ({}) unreachable: the wait on {key} had no watch for {:?} (last \
                         error: {last_error})",
                        self.endpoints, self.call_timeout
                    ));
                    entry.take_value_waiters(&error, &mut fires);
                    emptied.push(key.clone());
                } else if up && entry.watch.is_none() {
                    reopen.push(key.clone());
                } else if up && entry.confirmed && !entry.rearming {
                    entry.rearming = true;
                    rearm.push(key.clone());
                }
            }
            for key in emptied {
                state.forget_if_idle(&key, &self.requests);
            }
            for key in reopen {
                state.open_watch(&key, &self.requests);
            }
        }
        fire_all(fires);
        for key in rearm {
            self.spawn_arm(key, None, true);
        }
    }

    fn on_response(self: &Arc<Self>, response: WatchResponse) {
        let id = response.watch_id();
        if id == ANCHOR_WATCH_ID {
            return;
        }
        let mut fires = Vec::new();
        let mut gone = Vec::new();
        let mut confirmed = None;
        {
            let mut state = self.state.lock();
            if response.created() && !response.canceled() {
                if let Some(key) = state.by_watch.get(&id).cloned() {
                    if let Some(entry) = state.keys.get_mut(&key) {
                        if entry.watch == Some(id) {
                            entry.confirmed = true;
                            confirmed = Some(key);
                        }
                    }
                }
            } else if response.canceled() {
                // Compacted past our start revision, or refused: maintenance
                // opens a new watch (at its pace: a watch etcd keeps refusing
                // must not spin), and the waits fail after the call timeout.
                if let Some(key) = state.by_watch.remove(&id) {
                    if let Some(entry) = state.keys.get_mut(&key) {
                        if entry.watch == Some(id) {
                            entry.watch = None;
                            entry.confirmed = false;
                            entry.uncovered_since.get_or_insert_with(Instant::now);
                            log::debug!(
                                "etcd watch on {key} cancelled (compact revision {}, {:?}); re-arming",
                                response.compact_revision(),
                                response.cancel_reason()
                            );
                            state.last_error = format!(
                                "etcd cancelled the watch on {key} (compact revision {}): {}",
                                response.compact_revision(),
                                response.cancel_reason()
                            );
                        }
                    }
                }
            } else if let Some(key) = state.by_watch.get(&id).cloned() {
                if let Some(entry) = state.keys.get_mut(&key) {
                    let prefix = entry.members.is_some();
                    for event in response.events() {
                        match (event.event_type(), event.kv()) {
                            (EventType::Put, Some(kv)) if !prefix => {
                                entry.take_satisfied(kv.value(), &mut fires)
                            }
                            (EventType::Delete, Some(kv)) if prefix => {
                                let name = String::from_utf8_lossy(kv.key());
                                if let Some(process) = entry.take_member(&name) {
                                    gone.push((process, kv.mod_revision()));
                                }
                            }
                            _ => {}
                        }
                    }
                }
                state.forget_if_idle(&key, &self.requests);
            }
        }
        fire_all(fires);
        for (process, revision) in gone {
            self.process_lost(process, Some(revision));
        }
        if let Some(key) = confirmed {
            self.spawn_arm(key, None, false);
        }
    }
}
