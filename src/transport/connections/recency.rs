//! Which connections a sweep closes: a pure choice over when each was last
//! used and whether it is idle, so that it can be tested on its own.
use std::time::Instant;

use super::ConnectionLimits;

/// One open connection as a sweep sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Use {
    pub peer: u32,
    pub last_used: Instant,
    /// Nothing in flight on it and nobody waiting on its peer (or broken).
    pub idle: bool,
}

/// The peers whose connections to close at `now`: every idle one unused
/// for `idle_timeout`, then, while more than `max_open` stay open, idle
/// ones least recently used first. Never a busy one, never one used
/// within `grace`.
pub fn choose_to_close(uses: &[Use], limits: &ConnectionLimits, now: Instant) -> Vec<u32> {
    let closable = |u: &Use| u.idle && u.last_used + limits.grace <= now;
    let mut chosen: Vec<u32> = uses
        .iter()
        .filter(|u| closable(u) && u.last_used + limits.idle_timeout <= now)
        .map(|u| u.peer)
        .collect();
    let mut open = uses.len() - chosen.len();
    if open > limits.max_open {
        let mut oldest: Vec<&Use> = uses
            .iter()
            .filter(|u| closable(u) && !chosen.contains(&u.peer))
            .collect();
        oldest.sort_by_key(|u| (u.last_used, u.peer));
        for u in oldest {
            if open <= limits.max_open {
                break;
            }
            chosen.push(u.peer);
            open -= 1;
        }
    }
    chosen
}
