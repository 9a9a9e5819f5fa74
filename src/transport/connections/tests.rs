use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;
use crate::status;

#[derive(Default)]
struct Fake {
    broken: AtomicBool,
    busy: AtomicBool,
    closed: AtomicBool,
}

impl Connection for Fake {
    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }
    fn is_idle(&self) -> bool {
        !self.busy.load(Ordering::Acquire)
    }
    fn close(&self) {
        assert!(!self.closed.swap(true, Ordering::AcqRel), "closed twice");
    }
}

fn limits(max_open: usize) -> ConnectionLimits {
    ConnectionLimits {
        max_open,
        idle_timeout: Duration::from_secs(30),
        grace: Duration::from_secs(1),
    }
}

fn dial(connections: &Connections<Fake>, peer: u32) -> Arc<Fake> {
    connections
        .get_or_connect(peer, || Ok(Arc::new(Fake::default())))
        .unwrap()
}

#[test]
fn concurrent_first_uses_of_a_peer_dial_it_once() {
    let connections = Connections::<Fake>::new(limits(8));
    let dials = AtomicUsize::new(0);
    let go = std::sync::Barrier::new(8);
    let got: Vec<Arc<Fake>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    go.wait();
                    connections
                        .get_or_connect(3, || {
                            dials.fetch_add(1, Ordering::AcqRel);
                            Ok(Arc::new(Fake::default()))
                        })
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(dials.load(Ordering::Acquire), 1);
    assert!(got.iter().all(|c| Arc::ptr_eq(c, &got[0])));
    assert_eq!(connections.open_count(), 1);
}

#[test]
fn a_broken_connection_is_closed_and_made_again_by_the_next_use() {
    let connections = Connections::<Fake>::new(limits(8));
    let first = dial(&connections, 1);
    first.broken.store(true, Ordering::Release);
    assert!(!connections.is_open_or_dialling(1));
    let second = dial(&connections, 1);
    assert!(!Arc::ptr_eq(&first, &second));
    assert!(first.closed.load(Ordering::Acquire));
    assert!(!second.closed.load(Ordering::Acquire));
}

#[test]
fn asking_whether_a_peer_is_connected_never_waits_for_its_dial() {
    let connections = Arc::new(Connections::<Fake>::new(limits(8)));
    assert!(!connections.is_open_or_dialling(5));
    let (entered, in_dial) = crossbeam_channel::bounded::<()>(1);
    let (release, released) = crossbeam_channel::bounded::<()>(1);
    let dialling = connections.clone();
    let dial = std::thread::spawn(move || {
        dialling
            .get_or_connect(5, || {
                entered.send(()).unwrap();
                released.recv().unwrap();
                Ok(Arc::new(Fake::default()))
            })
            .unwrap()
    });
    in_dial.recv().unwrap();
    let (answer, answered) = crossbeam_channel::bounded(1);
    let asking = connections.clone();
    let ask = std::thread::spawn(move || answer.send(asking.is_open_or_dialling(5)).unwrap());
    let seen = answered.recv_timeout(Duration::from_secs(10));
    release.send(()).unwrap();
    assert_eq!(seen, Ok(true), "the question waited for the dial");
    dial.join().unwrap();
    ask.join().unwrap();
    assert!(connections.is_open_or_dialling(5));
}

#[test]
fn a_failed_dial_is_the_callers_error_and_the_next_use_dials_again() {
    let connections = Connections::<Fake>::new(limits(8));
    let error = connections
        .get_or_connect(2, || Err(status::unavailable("process 2 does not answer")))
        .err()
        .unwrap();
    assert!(error.message.contains("process 2"), "{error}");
    assert_eq!(connections.open_count(), 0);
    dial(&connections, 2);
    assert_eq!(connections.open_count(), 1);
}

#[test]
fn a_sweep_closes_idle_connections_past_the_timeout_and_beyond_the_bound_never_busy_ones() {
    let connections = Connections::<Fake>::new(limits(2));
    let made: Vec<Arc<Fake>> = (0..5).map(|peer| dial(&connections, peer)).collect();
    made[0].busy.store(true, Ordering::Release);
    // Within the grace nothing goes, though 5 are open against a bound of 2.
    assert_eq!(
        connections.sweep(Instant::now(), &|_| false),
        Vec::<u32>::new()
    );
    // Past the grace, the least recently used idle ones go until 2 remain;
    // the busy one stays.
    let later = Instant::now() + Duration::from_secs(2);
    let mut closed = connections.sweep(later, &|_| false);
    closed.sort();
    assert_eq!(closed, vec![1, 2, 3]);
    assert_eq!(connections.open_count(), 2);
    assert!(!made[0].closed.load(Ordering::Acquire));
    // Past the idle timeout every idle one goes; the busy one still stays.
    let much_later = Instant::now() + Duration::from_secs(60);
    assert_eq!(connections.sweep(much_later, &|_| false), vec![4]);
    assert_eq!(connections.open_count(), 1);
    // The next use of a closed peer dials again.
    let again = dial(&connections, 1);
    assert!(!Arc::ptr_eq(&again, &made[1]));
}

fn arbitrary_uses() -> impl Strategy<Value = (Vec<(u64, bool)>, usize)> {
    (
        proptest::collection::vec((0u64..120, any::<bool>()), 0..24),
        0usize..10,
    )
}

proptest! {
    #[test]
    fn a_sweep_never_closes_busy_or_recent_connections_and_keeps_the_bound_when_it_can(
        (entries, max_open) in arbitrary_uses()
    ) {
        let now = Instant::now() + Duration::from_secs(1000);
        let limits = ConnectionLimits {
            max_open,
            idle_timeout: Duration::from_secs(60),
            grace: Duration::from_secs(5),
        };
        let uses: Vec<Use> = entries
            .iter()
            .enumerate()
            .map(|(i, (age, idle))| Use {
                peer: i as u32,
                last_used: now - Duration::from_secs(*age),
                idle: *idle,
            })
            .collect();
        let chosen = choose_to_close(&uses, &limits, now);
        let closable = |u: &Use| u.idle && u.last_used + limits.grace <= now;
        for peer in &chosen {
            let u = uses[*peer as usize];
            prop_assert!(closable(&u), "closed a busy or recent connection: {:?}", u);
        }
        let mut unique = chosen.clone();
        unique.sort();
        unique.dedup();
        prop_assert_eq!(unique.len(), chosen.len());
        for u in &uses {
            if closable(u) && u.last_used + limits.idle_timeout <= now {
                prop_assert!(chosen.contains(&u.peer), "kept one idle past the timeout");
            }
        }
        let left: Vec<&Use> = uses.iter().filter(|u| !chosen.contains(&u.peer)).collect();
        if left.len() > max_open {
            prop_assert!(left.iter().all(|u| !closable(u)), "over the bound with closable ones left");
        }
        // Least recently used first: no kept closable one is older than a
        // closed one.
        for kept in left.iter().filter(|u| closable(u)) {
            for peer in &chosen {
                prop_assert!(uses[*peer as usize].last_used <= kept.last_used);
            }
        }
    }
}
