//! Connections to peers: made on the first transfer that needs one, kept
//! few, closed safely, made again after a failure. Control links (`kv/peer.rs`
//! over `transport/control/`) live here; what a process holds toward its
//! peers then grows with the peers it talks to, not with the job.
//!
//! - **On first use.** Nothing is opened at client creation: `get_or_connect`
//!   dials when a transfer first needs the peer, one dial per peer at a time
//!   (a second caller waits for the first's connection instead of making its
//!   own, whose drop would cut the requests already sent on it).
//! - **Made again.** A connection that broke (its peer closed it, a write
//!   failed) is replaced by the next `get_or_connect`; nothing is marked
//!   "never again" while the peer may be alive.
//! - **Bounded.** `sweep` closes connections unused for `idle_timeout`, and,
//!   beyond `max_open`, the least recently used first. Only an idle one is
//!   closed (nothing in flight on it, `Connection::is_idle`, and nothing of
//!   the owner waits on its peer), and never one used within
//!   `grace`, so a connection just handed out is not closed under its
//!   caller. A bound that only busy connections exceed is exceeded: a
//!   transfer never fails because others are under way.
//! - **Closed safely.** `Connection::close` tells the peer it is an orderly
//!   close (a control link's BYE), so the peer does not take it for a death.
mod recency;

pub use recency::{choose_to_close, Use};

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::status::Result;

/// One connection toward one peer.
pub trait Connection: Send + Sync {
    /// It broke: the next use makes a new one.
    fn is_broken(&self) -> bool;
    /// Closing it now would lose nothing (nothing in flight on it).
    fn is_idle(&self) -> bool;
    /// Closes it in an orderly way: the peer hears that this is no death.
    fn close(&self);
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Open connections kept (beyond it, idle ones are closed, least
    /// recently used first).
    pub max_open: usize,
    /// An idle connection unused this long is closed.
    pub idle_timeout: Duration,
    /// A connection used within this long is never closed by a sweep.
    pub grace: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> ConnectionLimits {
        ConnectionLimits {
            max_open: 64,
            idle_timeout: Duration::from_secs(30),
            grace: Duration::from_secs(1),
        }
    }
}

struct Slot<C> {
    connection: Mutex<Option<Arc<C>>>,
    last_used: Mutex<Instant>,
}

/// The connections of one kind (control links, say) toward the job's peers.
pub struct Connections<C> {
    slots: Mutex<HashMap<u32, Arc<Slot<C>>>>,
    limits: ConnectionLimits,
}

impl<C: Connection> Connections<C> {
    pub fn new(limits: ConnectionLimits) -> Connections<C> {
        Connections {
            slots: Mutex::new(HashMap::new()),
            limits,
        }
    }

    pub fn limits(&self) -> &ConnectionLimits {
        &self.limits
    }

    /// The open connection to `peer`, or a new one from `connect` (called
    /// with no lock but the peer's own held: one dial per peer at a time).
    pub fn get_or_connect(
        &self,
        peer: u32,
        connect: impl FnOnce() -> Result<Arc<C>>,
    ) -> Result<Arc<C>> {
        let slot = self
            .slots
            .lock()
            .entry(peer)
            .or_insert_with(|| {
                Arc::new(Slot {
                    connection: Mutex::new(None),
                    last_used: Mutex::new(Instant::now()),
                })
            })
            .clone();
        let mut connection = slot.connection.lock();
        *slot.last_used.lock() = Instant::now();
        if let Some(open) = connection.as_ref().filter(|c| !c.is_broken()) {
            return Ok(open.clone());
        }
        // A broken one is replaced; it is closed once no lock is held, as
        // what still waited on it may call back into this table.
        let broken = connection.take();
        let made = connect();
        if let Ok(made) = &made {
            *connection = Some(made.clone());
            *slot.last_used.lock() = Instant::now();
        }
        drop(connection);
        if let Some(broken) = broken {
            broken.close();
        }
        made
    }

    /// Whether `peer` has a connection that is not broken, or one being
    /// dialled. Never waits: a dial holds the peer's slot for as long as it
    /// takes (up to its timeout), and a caller asking this is on a
    /// transfer's path.
    pub fn is_open_or_dialling(&self, peer: u32) -> bool {
        let Some(slot) = self.slots.lock().get(&peer).cloned() else {
            return false;
        };
        let answer = match slot.connection.try_lock() {
            Some(connection) => connection.as_ref().is_some_and(|c| !c.is_broken()),
            None => true,
        };
        answer
    }

    /// Connections open or being dialled (broken ones not yet replaced
    /// included).
    pub fn open_count(&self) -> usize {
        let slots: Vec<_> = self.slots.lock().values().cloned().collect();
        slots
            .iter()
            .filter(|s| s.connection.try_lock().is_none_or(|c| c.is_some()))
            .count()
    }

    /// Closes what the limits say should go (see the module's doc) and
    /// returns the peers whose connection was closed. `waited_on` names the
    /// peers that something of the owner waits on (a receive from it): their
    /// connections stay, since their closing is how the peer's death shows.
    pub fn sweep(&self, now: Instant, waited_on: &dyn Fn(u32) -> bool) -> Vec<u32> {
        let slots: Vec<(u32, Arc<Slot<C>>)> = self
            .slots
            .lock()
            .iter()
            .map(|(peer, slot)| (*peer, slot.clone()))
            .collect();
        let mut uses = Vec::new();
        for (peer, slot) in &slots {
            // A slot locked by a dial or a use is busy: skip it.
            let Some(connection) = slot.connection.try_lock() else {
                continue;
            };
            if let Some(open) = connection.as_ref() {
                uses.push(Use {
                    peer: *peer,
                    last_used: *slot.last_used.lock(),
                    idle: open.is_broken() || (open.is_idle() && !waited_on(*peer)),
                });
            }
        }
        let chosen = choose_to_close(&uses, &self.limits, now);
        let mut closing = Vec::new();
        for peer in chosen {
            let Some((_, slot)) = slots.iter().find(|(p, _)| *p == peer) else {
                continue;
            };
            let mut connection = slot.connection.lock();
            // Checked again under the peer's lock: a use may have come in.
            let still_idle = *slot.last_used.lock() + self.limits.grace <= now
                && connection
                    .as_ref()
                    .is_some_and(|c| c.is_broken() || (c.is_idle() && !waited_on(peer)));
            if still_idle {
                if let Some(open) = connection.take() {
                    closing.push((peer, open));
                }
            }
        }
        // Closed with no lock held: what still waited may call back in.
        closing
            .into_iter()
            .map(|(peer, open)| {
                open.close();
                peer
            })
            .collect()
    }

    /// Closes every connection (the owner is going away).
    pub fn close_all(&self) {
        let slots: Vec<_> = self.slots.lock().drain().map(|(_, s)| s).collect();
        for slot in slots {
            if let Some(open) = slot.connection.lock().take() {
                open.close();
            }
        }
    }
}

#[cfg(test)]
mod tests;
