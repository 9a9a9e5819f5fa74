//! `PeerStore`: the job's transfer keys, each kept by the process that reads
//! it and written by its peers over control links (`transport/control/`).
//!
//! Every transfer key has exactly one reader: a completion key is awaited by
//! the receiving process, a descriptor key by the sending one. So each
//! process keeps the keys it reads in a local `MemoryStore` (its AsyncGets
//! are event-driven, no polling) and a `set` or `delete` of a key another
//! process reads goes to that process's store over the link, acknowledged
//! before it returns. A router, given by the transfer layer, names each
//! key's reader. The lifecycle is unchanged: one completion key, one
//! AsyncGet, one promise per buffer, the key deleted after publication; it
//! just never leaves the two processes of the transfer, so a framework's
//! coordination service sees no transfer keys at all and no round trip
//! through it sits on a transfer's critical path.
//!
//! Links are made on the first request that needs one, and closed when idle
//! or beyond a bound, least recently used first (`transport/connections/`):
//! a process holds links to the peers it talks to, not to the whole job. A
//! link a process waits on (a receive from its peer, a send waiting for the
//! peer's descriptors: `watch`) stays open, because its closing is how the
//! peer's death shows: a link that closes without BYE (the peer exited or
//! died) is reported to the transfer layer, which fails the receives waiting
//! on that peer at once. Deleting a key held by such a peer succeeds when no
//! new link to it opens: the key was in that process's memory and is gone
//! with it.
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{
    GetCallback, KeyValueStore, MemoryStore, SetCallback, StoreCapabilities, Unless, WaiterId,
};
use crate::status::{self, Result};
use crate::sync::AsyncWorkRunner;
use crate::transport::advertise::Advertised;
use crate::transport::connections::{ConnectionLimits, Connections};
use crate::transport::control::{
    ControlConfig, ControlEndpoint, ControlHandler, ControlLink, ControlServer, LinkThreads, Secret,
};

/// Names the process that reads a key (`None`: not a key of this store).
pub type KeyRouter = Box<dyn Fn(&str) -> Option<u32> + Send + Sync>;

/// How to reach one peer.
#[derive(Clone, Debug)]
pub struct PeerAddress {
    pub endpoint: ControlEndpoint,
    pub same_host: bool,
}

/// Called with a peer whose link closed.
pub type PeerLost = Box<dyn Fn(u32) + Send + Sync>;

struct Local {
    store: MemoryStore,
    /// Called with no lock held: it fails receives, whose retirement comes
    /// back here (a delete over a link), and a link's reader may report the
    /// same loss at the same time.
    on_peer_lost: Mutex<Option<Arc<PeerLost>>>,
    /// Peers whose link closed, until a new link to them opens.
    lost: Mutex<std::collections::HashSet<u32>>,
}

impl ControlHandler for Local {
    fn set(&self, _from: u32, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(key, value)
    }

    fn delete(&self, _from: u32, key: &str) -> Result<()> {
        self.store.delete(key)
    }

    fn peer_closed(&self, process: u32) {
        log::debug!("peer store: process {process} is gone (its link closed)");
        self.lost.lock().insert(process);
        let lost = self.on_peer_lost.lock().clone();
        if let Some(lost) = lost {
            lost(process);
        }
    }
}

/// Whether something of this process waits on a peer (its link stays).
pub type WaitedOn = Box<dyn Fn(u32) -> bool + Send + Sync>;

pub struct PeerStore {
    me: u32,
    secret: Secret,
    local: Arc<Local>,
    server: ControlServer,
    router: Mutex<Option<KeyRouter>>,
    peers: Mutex<HashMap<u32, PeerAddress>>,
    links: Connections<ControlLink>,
    /// The timer that bounds every link's requests (and runs the sweeps of
    /// idle links) and the poller that reads every link, served or made.
    threads: LinkThreads,
    waited_on: Mutex<Option<WaitedOn>>,
    /// Dials the peers a transfer waits on (`watch`), off the caller's
    /// thread.
    dialer: AsyncWorkRunner,
    timeout: Duration,
}

impl PeerStore {
    /// Starts this process's control server; peers and the router come with
    /// the session (`connect`).
    pub fn start(
        me: u32,
        secret: Secret,
        advertised: &Advertised,
        timeout: Duration,
        limits: ConnectionLimits,
    ) -> Result<Arc<PeerStore>> {
        let local = Arc::new(Local {
            store: MemoryStore::new(),
            on_peer_lost: Mutex::new(None),
            lost: Mutex::default(),
        });
        let weak: Weak<dyn ControlHandler> =
            Arc::downgrade(&(local.clone() as Arc<dyn ControlHandler>));
        let threads = LinkThreads::start()?;
        let server = ControlServer::start_sharing(
            advertised.bind,
            advertised.address,
            secret,
            weak,
            ControlConfig {
                request_timeout: timeout,
                ..ControlConfig::default()
            },
            threads.poller.clone(),
        )
        .map_err(|e| {
            // Name where the address came from: an advertised address this
            // host does not own needs tcp_bind to listen on another one.
            crate::status::Status::new(
                e.code,
                format!(
                    "{} (the address was chosen by {}; to advertise an address this host does not hold, set tcp_bind to one it does, e.g. 0.0.0.0)",
                    e.message, advertised.source
                ),
            )
        })?;
        let store = Arc::new(PeerStore {
            me,
            secret,
            local,
            server,
            router: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            links: Connections::new(limits),
            threads,
            waited_on: Mutex::new(None),
            dialer: AsyncWorkRunner::new("crosshost-dial", 2),
            timeout,
        });
        store.schedule_sweep();
        Ok(store)
    }

    /// Sweeps the idle links now and then, for as long as the store lives.
    fn schedule_sweep(self: &Arc<Self>) {
        let limits = self.links.limits();
        let every = (limits.idle_timeout / 2)
            .min(Duration::from_secs(5))
            .max(limits.grace);
        let store = Arc::downgrade(self);
        self.threads.timer.schedule_after(every, move || {
            if let Some(store) = store.upgrade() {
                store.sweep_links(Instant::now());
                store.schedule_sweep();
            }
        });
    }

    /// Closes the links the limits say should go; returns their peers.
    pub fn sweep_links(&self, now: Instant) -> Vec<u32> {
        let waited_on = self.waited_on.lock();
        let closed = self
            .links
            .sweep(now, &|peer| waited_on.as_ref().is_some_and(|w| w(peer)));
        if !closed.is_empty() {
            log::debug!("peer store: closed idle links to processes {closed:?}");
        }
        closed
    }

    /// How to tell whether something of this process waits on a peer.
    pub fn set_waited_on(&self, waited_on: WaitedOn) {
        *self.waited_on.lock() = Some(waited_on);
    }

    /// Links this process opened that are open now.
    pub fn open_links(&self) -> usize {
        self.links.open_count()
    }

    /// Authenticated links from peers being served now.
    pub fn served_links(&self) -> usize {
        self.server.link_count()
    }

    /// Something of this process now waits on `peer` (a send waits for its
    /// descriptors): a link to it is made, off this thread, so that its
    /// death is noticed; a peer that cannot be reached is reported lost,
    /// which fails what waits on it.
    pub fn watch(self: &Arc<Self>, peer: u32) {
        if peer == self.me || self.links.is_open_or_dialling(peer) {
            return;
        }
        let store = Arc::downgrade(self);
        self.dialer.submit(move || {
            let Some(store) = store.upgrade() else { return };
            if let Err(e) = store.link(peer) {
                log::warn!("peer store: process {peer}, which a transfer waits on: {e}");
                store.local.peer_closed(peer);
            }
        });
    }

    /// Where peers reach this process.
    pub fn endpoint(&self) -> &ControlEndpoint {
        self.server.endpoint()
    }

    /// The job's peers, and which process reads each key.
    pub fn connect(&self, peers: HashMap<u32, PeerAddress>, router: KeyRouter) {
        *self.peers.lock() = peers;
        *self.router.lock() = Some(router);
    }

    /// Called with a peer whose link closed.
    pub fn on_peer_lost(&self, lost: PeerLost) {
        *self.local.on_peer_lost.lock() = Some(Arc::new(lost));
    }

    /// Opens a link to `peer` (or finds the one open): OK when it answers.
    pub fn probe(&self, peer: u32) -> Result<()> {
        self.link(peer).map(|_| ())
    }

    /// Sets `key`, which this process reads (FAILED_PRECONDITION otherwise),
    /// in its own part of the store: what a peer's SET over a link does.
    pub fn set_held_here(&self, key: &str, value: &[u8]) -> Result<()> {
        self.local_only(key, "set")?;
        self.local.store.set(key, value)
    }

    /// Keys this process holds for its own reads.
    pub fn local_keys(&self) -> usize {
        self.local.store.len()
    }

    fn reader_of(&self, key: &str) -> Result<u32> {
        let router = self.router.lock();
        let route = router.as_ref().ok_or_else(|| {
            status::failed_precondition("peer store: not connected to the job yet")
        })?;
        route(key).ok_or_else(|| {
            status::invalid_argument(format!("peer store: {key:?} is not a transfer key"))
        })
    }

    fn link(&self, peer: u32) -> Result<Arc<ControlLink>> {
        let address = self.peers.lock().get(&peer).cloned().ok_or_else(|| {
            status::invalid_argument(format!("peer store: process {peer} is not in this job"))
        })?;
        let mut made = false;
        let link = self.links.get_or_connect(peer, || {
            made = true;
            ControlLink::connect_sharing(
                peer,
                &address.endpoint,
                address.same_host,
                self.me,
                self.secret,
                self.timeout,
                Some(self.on_link_closed()),
                &self.threads,
            )
        })?;
        if made {
            self.local.lost.lock().remove(&peer);
            // A new link may take the count past the bound.
            if self.links.open_count() > self.links.limits().max_open {
                self.sweep_links(Instant::now());
            }
        }
        Ok(link)
    }

    /// A closed link from our side means the same as one from theirs.
    fn on_link_closed(&self) -> crate::transport::control::LinkClosed {
        let local = Arc::downgrade(&self.local);
        Arc::new(move |peer| {
            if let Some(local) = local.upgrade() {
                local.peer_closed(peer);
            }
        })
    }

    /// The store of `key`'s reader: ours, or the link to it.
    fn remote(&self, key: &str) -> Result<Option<Arc<ControlLink>>> {
        let reader = self.reader_of(key)?;
        if reader == self.me {
            Ok(None)
        } else {
            self.link(reader).map(Some)
        }
    }

    fn local_only(&self, key: &str, what: &str) -> Result<()> {
        match self.reader_of(key) {
            Ok(reader) if reader == self.me => Ok(()),
            Ok(reader) => Err(status::failed_precondition(format!(
                "peer store: {what} of {key:?}, which process {reader} reads"
            ))),
            Err(e) => Err(e),
        }
    }
}

impl Drop for PeerStore {
    fn drop(&mut self) {
        self.dialer.shutdown();
        // The links close with the table, without BYE: to their peers this
        // client is gone, as it is.
    }
}

impl KeyValueStore for PeerStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.local_only(key, "get")?;
        self.local.store.get(key, timeout)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.local_only(key, "try_get")?;
        self.local.store.try_get(key)
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.remote(key)? {
            None => self.local.store.set(key, value),
            Some(link) => link.set(key, value),
        }
    }

    fn set_async(&self, key: &str, value: &[u8], done: SetCallback) {
        match self.remote(key) {
            Err(e) => done(Err(e)),
            Ok(None) => done(self.local.store.set(key, value)),
            Ok(Some(link)) => link.set_async(key, value, done),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.delete_async(
            key,
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        );
        // The link answers every request: acked, failed, or at its deadline.
        rx.recv()
            .unwrap_or_else(|_| Err(status::internal("peer store: a delete was never answered")))
    }

    fn delete_async(&self, key: &str, done: SetCallback) {
        let reader = match self.reader_of(key) {
            Ok(reader) => reader,
            Err(e) => return done(Err(e)),
        };
        if reader == self.me {
            return done(self.local.store.delete(key));
        }
        match self.link(reader) {
            Ok(link) => {
                // A link can break under the delete when its peer dies: the
                // key went with that process's memory.
                let local = self.local.clone();
                let key_name = key.to_string();
                link.delete_async(
                    key,
                    Box::new(move |outcome| match outcome {
                        Err(e) if local.lost.lock().contains(&reader) => {
                            log::debug!(
                                "peer store: {key_name:?} went with process {reader} ({e})"
                            );
                            done(Ok(()))
                        }
                        other => done(other),
                    }),
                )
            }
            // The key lived in that process's memory: a peer whose link
            // closed and that takes no new one is gone, and the key with it.
            Err(e) if self.local.lost.lock().contains(&reader) => {
                log::debug!("peer store: {key:?} went with process {reader} ({e})");
                done(Ok(()))
            }
            Err(e) => done(Err(e)),
        }
    }

    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId> {
        self.local_only(key, "async_get")?;
        self.local.store.async_get(key, unless, callback)
    }

    fn cancel_async_get(&self, key: &str, id: WaiterId) -> bool {
        self.local.store.cancel_async_get(key, id)
    }

    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities {
            can_delete: true,
            can_overwrite: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;
    use std::net::{IpAddr, Ipv4Addr};

    /// Processes 0 and 1 of one job; a key `for<N>/...` is read by process N.
    fn pair() -> (Arc<PeerStore>, Arc<PeerStore>) {
        let secret = Secret::generate().unwrap();
        let start = |me| {
            let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
            let advertised = Advertised {
                bind: loopback,
                address: loopback,
                source: "test".into(),
            };
            PeerStore::start(
                me,
                secret,
                &advertised,
                Duration::from_secs(10),
                ConnectionLimits::default(),
            )
            .unwrap()
        };
        let stores = [start(0), start(1)];
        let addresses: HashMap<u32, PeerAddress> = stores
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let address = PeerAddress {
                    endpoint: s.endpoint().clone(),
                    same_host: true,
                };
                (i as u32, address)
            })
            .collect();
        for store in &stores {
            let router: KeyRouter =
                Box::new(|key: &str| key.strip_prefix("for")?.split('/').next()?.parse().ok());
            store.connect(addresses.clone(), router);
        }
        let [a, b] = stores;
        (a, b)
    }

    #[test]
    fn a_key_lives_only_with_its_reader_and_is_set_and_deleted_there() {
        let (p0, p1) = pair();
        p0.set("for1/receipt", b"r").unwrap();
        assert_eq!((p0.local_keys(), p1.local_keys()), (0, 1));
        assert_eq!(p1.try_get("for1/receipt").unwrap(), b"r");
        let err = p0.try_get("for1/receipt").unwrap_err();
        assert_eq!(err.code, Code::FailedPrecondition, "{err}");
        let (tx, rx) = crossbeam_channel::bounded(1);
        p1.set_async(
            "for0/descriptor",
            b"d",
            Box::new(move |r| tx.send(r).unwrap()),
        );
        rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(
            p0.get("for0/descriptor", Duration::from_secs(1)).unwrap(),
            b"d"
        );
        p0.delete("for1/receipt").unwrap();
        assert_eq!(p1.local_keys(), 0);
        let err = p0.set("elsewhere", b"x").unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument, "{err}");
    }

    #[test]
    fn concurrent_first_writes_to_a_peer_share_one_link_and_all_land() {
        let (p0, p1) = pair();
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::scope(|scope| {
            for t in 0..8 {
                let (p0, tx) = (&p0, tx.clone());
                scope.spawn(move || {
                    let tx = tx.clone();
                    p0.set_async(
                        &format!("for1/{t}"),
                        b"v",
                        Box::new(move |r| tx.send(r).unwrap()),
                    );
                });
            }
        });
        for _ in 0..8 {
            rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap();
        }
        assert_eq!(p1.local_keys(), 8);
        assert_eq!(p1.server.connection_count(), 1);
    }

    #[test]
    fn links_are_made_on_first_use_and_an_idle_one_closes_without_looking_like_a_death() {
        let (p0, p1) = pair();
        assert_eq!((p0.open_links(), p1.served_links()), (0, 0));
        let (tx, rx) = crossbeam_channel::unbounded();
        p1.on_peer_lost(Box::new(move |process| {
            let _ = tx.send(process);
        }));
        p0.set("for1/receipt", b"r").unwrap();
        assert_eq!(p0.open_links(), 1);
        // Waited on, it stays, however idle.
        let waited = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let waiting = waited.clone();
        p0.set_waited_on(Box::new(move |peer| {
            peer == 1 && waiting.load(std::sync::atomic::Ordering::Acquire)
        }));
        let later = Instant::now() + Duration::from_secs(3600);
        assert_eq!(p0.sweep_links(later), Vec::<u32>::new());
        waited.store(false, std::sync::atomic::Ordering::Release);
        assert_eq!(p0.sweep_links(later), vec![1]);
        assert_eq!(p0.open_links(), 0);
        // The server saw BYE: the link's end is no news of a death.
        let deadline = Instant::now() + Duration::from_secs(10);
        while p1.served_links() > 0 {
            assert!(Instant::now() < deadline, "the served link never ended");
            std::thread::yield_now();
        }
        assert_eq!(rx.try_recv(), Err(crossbeam_channel::TryRecvError::Empty));
        // The next request makes a new link.
        p0.delete("for1/receipt").unwrap();
        assert_eq!((p0.open_links(), p1.local_keys()), (1, 0));
    }

    #[test]
    fn a_peer_that_goes_away_is_reported_and_its_keys_go_with_it() {
        let (p0, p1) = pair();
        let (tx, rx) = crossbeam_channel::unbounded();
        p0.on_peer_lost(Box::new(move |process| {
            let _ = tx.send(process);
        }));
        p0.set("for1/receipt", b"r").unwrap();
        drop(p1);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)), Ok(1));
        // Deleting what the gone process held succeeds; writing to it fails.
        p0.delete("for1/receipt").unwrap();
        let err = p0.set("for1/receipt", b"again").unwrap_err();
        assert_eq!(err.code, Code::Unavailable, "{err}");
    }
}
