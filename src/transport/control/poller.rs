//! One thread reads every control link of a client, both the links it
//! serves and the ones it made: epoll says which sockets have bytes, and
//! each of those is read without blocking and its whole frames handled. A
//! thread per link was three threads per peer (a reader each way and a
//! server's), the first wall a large job hits; with this, a client's
//! threads do not grow with its peers.
//!
//! Sockets stay blocking, so that writers on other threads keep their
//! blocking writes with timeouts; the poller reads with `MSG_DONTWAIT`
//! (`Nonblocking`). A link's handshake has a deadline: the poller drops a
//! link whose deadline passed (a stranger that connects and says nothing
//! holds a socket until then, and no thread).
//!
//! What a link's frames set off runs on this thread (a waiter's callback, a
//! receipt applied to the store and the readiness it publishes), as it did
//! on each link's own thread before; a handler that panics loses its link,
//! not the thread.
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::status::{self, Result};
use crate::sync::threads::Slice;
use crate::transport::poll::WakeFd;

use super::frame::Stream;
use super::spawn;

/// What a link wants after it was read.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    Keep,
    /// The link is over (closed, refused, broken): the poller drops it.
    Done,
}

/// A link the poller reads.
pub(super) trait Readable: Send {
    /// Reads what the link has (never blocking) and handles it.
    fn readable(&mut self) -> Next;
    /// When the link gives up waiting (its handshake's end); `None`: never.
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// The deadline passed; the link is dropped after this.
    fn expired(&mut self) {}
}

/// A registered link: what `remove` takes back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Token(u64);

type Shared<T> = Arc<Mutex<T>>;

struct Entry {
    fd: RawFd,
    link: Shared<Box<dyn Readable>>,
    deadline: Option<Instant>,
}

struct Inner {
    epoll: OwnedFd,
    /// Wakes the thread (a new deadline, stop).
    wake: WakeFd,
    entries: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
    stopping: AtomicBool,
    thread: Mutex<Option<ThreadId>>,
}

pub struct Poller {
    inner: Arc<Inner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Poller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Poller({} links)", self.link_count())
    }
}

const MAX_EVENTS: usize = 64;

impl Poller {
    /// Starts the thread.
    pub fn start(name: &str) -> Result<Arc<Poller>> {
        // SAFETY: plain syscalls; each fd returned is checked and owned at once.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(status::resource_exhausted(format!(
                "control links: epoll_create1: {}",
                io::Error::last_os_error()
            )));
        }
        // SAFETY: a fresh fd, owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        let wake = WakeFd::new()
            .map_err(|e| status::resource_exhausted(format!("control links: eventfd: {e}")))?;
        let inner = Arc::new(Inner {
            epoll,
            wake,
            entries: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        inner.watch(inner.wake.raw(), 0)?;
        let running = inner.clone();
        let handle = spawn(name, Slice::Short, move || running.run())?;
        *inner.thread.lock() = Some(handle.thread().id());
        Ok(Arc::new(Poller {
            inner,
            thread: Mutex::new(Some(handle)),
        }))
    }

    /// Reads `link` whenever `fd` has bytes (or closed), until it is
    /// `Done`, expired or removed.
    pub(super) fn add(&self, fd: RawFd, link: Box<dyn Readable>) -> Result<Token> {
        let token = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let deadline = link.deadline();
        self.inner.entries.lock().insert(
            token,
            Entry {
                fd,
                link: Arc::new(Mutex::new(link)),
                deadline,
            },
        );
        if let Err(e) = self.inner.watch(fd, token) {
            self.inner.entries.lock().remove(&token);
            return Err(e);
        }
        if deadline.is_some() {
            self.inner.wake.wake();
        }
        Ok(Token(token))
    }

    /// Stops reading the link and drops it; once this returns, it is not
    /// being read (unless called from the poller's own thread, by what the
    /// link itself set off: it is dropped when that returns).
    pub(super) fn remove(&self, token: Token) {
        let Some(entry) = self.inner.entries.lock().remove(&token.0) else {
            return;
        };
        self.inner.unwatch(entry.fd);
        if !self.inner.on_own_thread() {
            // Waits for a read in progress.
            drop(entry.link.lock());
        }
    }

    /// Links being read.
    pub fn link_count(&self) -> usize {
        self.inner.entries.lock().len()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.wake.wake();
        if let Some(handle) = self.thread.lock().take() {
            crate::sync::runner::join_all_except_current(vec![handle], "control link poller");
        }
    }
}

impl Inner {
    fn watch(&self, fd: RawFd, token: u64) -> Result<()> {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: token,
        };
        // SAFETY: both fds are open (the caller holds the socket until it
        // removes it); `event` lives through the call.
        let done =
            unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if done < 0 {
            return Err(status::internal(format!(
                "control links: epoll_ctl add: {}",
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    fn unwatch(&self, fd: RawFd) {
        // SAFETY: removing an fd from our own epoll set; a closed or unknown
        // fd only makes the call fail, which changes nothing.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            );
        }
    }

    fn on_own_thread(&self) -> bool {
        *self.thread.lock() == Some(std::thread::current().id())
    }

    fn run(self: Arc<Self>) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; MAX_EVENTS];
        while !self.stopping.load(Ordering::Acquire) {
            let timeout = self.next_deadline().map_or(-1, |deadline| {
                let left = deadline.saturating_duration_since(Instant::now());
                // Rounded up: waking a little early would spin.
                left.as_millis().min(i32::MAX as u128) as i32 + 1
            });
            // SAFETY: `events` has room for MAX_EVENTS entries.
            let ready = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    MAX_EVENTS as i32,
                    timeout,
                )
            };
            if ready < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!("control links: epoll_wait: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            for event in &events[..ready as usize] {
                match event.u64 {
                    0 => self.wake.drain(),
                    token => self.read(token),
                }
            }
            self.expire(Instant::now());
        }
        // The links go with the thread (their sockets close with them).
        self.entries.lock().clear();
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.entries
            .lock()
            .values()
            .filter_map(|e| e.deadline)
            .min()
    }

    fn read(&self, token: u64) {
        let Some(link) = self.entries.lock().get(&token).map(|e| e.link.clone()) else {
            return;
        };
        let (next, deadline) = {
            let mut link = link.lock();
            let next = catch_unwind(AssertUnwindSafe(|| link.readable())).unwrap_or_else(|panic| {
                log::error!(
                    "control link: reading it panicked ({}); dropping the link",
                    status::panic_message(&*panic)
                );
                Next::Done
            });
            (next, link.deadline())
        };
        let mut entries = self.entries.lock();
        match next {
            Next::Done => {
                if let Some(entry) = entries.remove(&token) {
                    self.unwatch(entry.fd);
                    drop(entries);
                    drop(entry);
                }
            }
            Next::Keep => {
                if let Some(entry) = entries.get_mut(&token) {
                    entry.deadline = deadline;
                }
            }
        }
    }

    fn expire(&self, now: Instant) {
        let expired: Vec<Entry> = {
            let mut entries = self.entries.lock();
            let tokens: Vec<u64> = entries
                .iter()
                .filter(|(_, e)| e.deadline.is_some_and(|d| d <= now))
                .map(|(t, _)| *t)
                .collect();
            tokens.iter().filter_map(|t| entries.remove(t)).collect()
        };
        for entry in expired {
            self.unwatch(entry.fd);
            let _ = catch_unwind(AssertUnwindSafe(|| entry.link.lock().expired()));
        }
    }
}

/// Reads a blocking socket without blocking (`MSG_DONTWAIT`): `WouldBlock`
/// when nothing is there. Writes go to the socket as they are (blocking,
/// with its timeout).
pub(super) struct Nonblocking {
    inner: Box<dyn Stream>,
}

impl Nonblocking {
    pub(super) fn new(inner: Box<dyn Stream>) -> Nonblocking {
        Nonblocking { inner }
    }
}

impl Read for Nonblocking {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is valid for `buf.len()` bytes; the fd is the open
        // socket `inner` owns.
        let n = unsafe {
            libc::recv(
                self.inner.raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl Write for Nonblocking {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Stream for Nonblocking {
    fn shutdown_both(&self) {
        self.inner.shutdown_both()
    }

    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(Nonblocking::new(self.inner.try_clone_box()?)))
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.inner.set_timeouts(read, write)
    }

    fn raw_fd(&self) -> RawFd {
        self.inner.raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    /// Sends what it reads to a channel; Done at EOF.
    struct Echo {
        stream: Nonblocking,
        seen: mpsc::Sender<Vec<u8>>,
        deadline: Option<Instant>,
        expired: Option<mpsc::Sender<()>>,
    }

    impl Readable for Echo {
        fn readable(&mut self) -> Next {
            let mut buf = [0u8; 64];
            loop {
                match self.stream.read(&mut buf) {
                    Ok(0) => return Next::Done,
                    Ok(n) => {
                        if &buf[..n] == b"panic" {
                            panic!("asked to");
                        }
                        let _ = self.seen.send(buf[..n].to_vec());
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Next::Keep,
                    Err(_) => return Next::Done,
                }
            }
        }

        fn deadline(&self) -> Option<Instant> {
            self.deadline
        }

        fn expired(&mut self) {
            if let Some(tx) = self.expired.take() {
                let _ = tx.send(());
            }
        }
    }

    fn echo(
        deadline: Option<Instant>,
    ) -> (
        UnixStream,
        Echo,
        mpsc::Receiver<Vec<u8>>,
        mpsc::Receiver<()>,
    ) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (seen, rx) = mpsc::channel();
        let (expired, expired_rx) = mpsc::channel();
        let link = Echo {
            stream: Nonblocking::new(Box::new(theirs)),
            seen,
            deadline,
            expired: Some(expired),
        };
        (ours, link, rx, expired_rx)
    }

    const WAIT: Duration = Duration::from_secs(10);

    #[test]
    fn one_thread_reads_many_links_and_drops_each_at_its_close() {
        let poller = Poller::start("test-poller").unwrap();
        let mut peers = Vec::new();
        for i in 0..50u8 {
            let (ours, link, rx, _) = echo(None);
            let fd = link.stream.raw_fd();
            poller.add(fd, Box::new(link)).unwrap();
            peers.push((i, ours, rx));
        }
        assert_eq!(poller.link_count(), 50);
        for (i, ours, _) in &mut peers {
            ours.write_all(&[*i; 3]).unwrap();
        }
        for (i, _, rx) in &peers {
            let mut got = Vec::new();
            while got.len() < 3 {
                got.extend(rx.recv_timeout(WAIT).unwrap());
            }
            assert_eq!(got, vec![*i; 3]);
        }
        peers.truncate(10); // the others' ends close
        let deadline = Instant::now() + WAIT;
        while poller.link_count() != 10 {
            assert!(Instant::now() < deadline, "{} links", poller.link_count());
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_link_past_its_deadline_is_dropped_and_told() {
        let poller = Poller::start("test-poller").unwrap();
        let (_ours, link, _, expired) = echo(Some(Instant::now() + Duration::from_millis(50)));
        let fd = link.stream.raw_fd();
        poller.add(fd, Box::new(link)).unwrap();
        expired.recv_timeout(WAIT).unwrap();
        assert_eq!(poller.link_count(), 0);
    }

    #[test]
    fn a_panicking_link_is_dropped_and_the_others_still_read() {
        let poller = Poller::start("test-poller").unwrap();
        let (mut bad, link, _, _) = echo(None);
        poller.add(link.stream.raw_fd(), Box::new(link)).unwrap();
        let (mut good, link, rx, _) = echo(None);
        poller.add(link.stream.raw_fd(), Box::new(link)).unwrap();
        bad.write_all(b"panic").unwrap();
        let deadline = Instant::now() + WAIT;
        while poller.link_count() != 1 {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
        good.write_all(b"ok").unwrap();
        assert_eq!(rx.recv_timeout(WAIT).unwrap(), b"ok");
    }

    #[test]
    fn removed_links_are_not_read_and_the_poller_stops_with_its_last_owner() {
        let poller = Poller::start("test-poller").unwrap();
        let (mut ours, link, rx, _) = echo(None);
        let token = poller.add(link.stream.raw_fd(), Box::new(link)).unwrap();
        poller.remove(token);
        assert_eq!(poller.link_count(), 0);
        // The link (and its end of the socket) went with the removal.
        assert!(ours.write_all(b"x").is_err());
        assert!(rx.try_recv().is_err());
        drop(poller); // joins its thread
    }
}
