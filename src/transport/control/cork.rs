//! Corking: the asynchronous requests one thread makes on control links
//! while it holds a `Cork` go out together when the cork is dropped, one
//! write per link instead of one per request. A batch's descriptors, the
//! receipts of a burst of small sends, the work a control server does for a
//! burst of frames: each would otherwise cost a syscall (and, across hosts,
//! a packet) per buffer.
//!
//! A cork only delays writes until the end of a step the thread is already
//! doing; it never holds one across a wait. A blocking request flushes the
//! thread's cork before it writes (its answer may depend on what is corked),
//! and an error writing a corked request fails that request's waiter, as an
//! error writing it at once would.
use std::cell::RefCell;
use std::sync::Arc;

use super::ControlLink;

/// The requests corked on one link: their frames, back to back, and their
/// ids (whose waiters fail if the write does).
struct Corked {
    link: Arc<ControlLink>,
    bytes: Vec<u8>,
    ids: Vec<u64>,
}

thread_local! {
    /// `Some` while this thread holds a cork.
    static CORKED: RefCell<Option<Vec<Corked>>> = const { RefCell::new(None) };
}

/// Held while a thread's control-link writes wait to go out together; they
/// go when the outermost cork of the thread is dropped.
#[must_use = "the writes go out when the cork is dropped"]
pub struct Cork {
    outermost: bool,
}

/// Corks this thread's control-link writes until the returned `Cork` drops.
/// Nested corks are one cork.
pub fn cork() -> Cork {
    let outermost = CORKED.with(|corked| {
        let mut corked = corked.borrow_mut();
        if corked.is_some() {
            return false;
        }
        *corked = Some(Vec::new());
        true
    });
    Cork { outermost }
}

impl Drop for Cork {
    fn drop(&mut self) {
        if self.outermost {
            let corked = CORKED.with(|corked| corked.borrow_mut().take());
            write_out(corked.unwrap_or_default());
        }
    }
}

/// Keeps `frame` (request `id` on `link`) for the cork's end, if this thread
/// holds one; else gives it back to be written now.
pub(super) fn defer(link: &Arc<ControlLink>, id: u64, frame: Vec<u8>) -> Option<Vec<u8>> {
    CORKED.with(|corked| {
        let mut corked = corked.borrow_mut();
        let Some(corked) = corked.as_mut() else {
            return Some(frame);
        };
        match corked.iter_mut().find(|c| Arc::ptr_eq(&c.link, link)) {
            Some(entry) => {
                entry.bytes.extend_from_slice(&frame);
                entry.ids.push(id);
            }
            None => corked.push(Corked {
                link: link.clone(),
                bytes: frame,
                ids: vec![id],
            }),
        }
        None
    })
}

/// Writes what this thread has corked so far, keeping the cork: a blocking
/// request (or a caller's wait, `PJRT_Event_Await` from inside one of our
/// callbacks) must not wait behind its own thread's corked writes.
pub fn flush_corked() {
    let corked = CORKED.with(|corked| corked.borrow_mut().as_mut().map(std::mem::take));
    write_out(corked.unwrap_or_default());
}

fn write_out(corked: Vec<Corked>) {
    for Corked { link, bytes, ids } in corked {
        link.write_corked(&bytes, &ids);
    }
}

/// How many requests this thread holds corked.
#[cfg(test)]
pub(super) fn corked_requests() -> usize {
    CORKED.with(|corked| {
        corked
            .borrow()
            .as_ref()
            .map_or(0, |corked| corked.iter().map(|c| c.ids.len()).sum())
    })
}
