//! `DestinationRegistry`: the receive destinations a network transport (the
//! TCP server, UCX) may write, by the descriptor's auth token. A token is
//! single-use: the first sender accepted claims it, so a second or replayed
//! sender is refused instead of writing a destination that may already be
//! published. A sender may claim a destination in parts (UCX stripes a large
//! buffer over several connections): then the token takes exactly that many
//! parts, each once. Memory stays valid while a write is in flight because
//! the writer holds its own `Arc` clone.
//!
//! A destination whose completion key this process holds itself (the peer
//! store keeps each key with the process that reads it) may be registered
//! with that key's name: a sender that writes it whole may then carry the
//! receipt in the same message, and the transport applies it once the bytes
//! are in (UCX, `transport/ucx/`; TCP, `transport/tcp/`).
//!
//! A sender may also write a range of a destination as a stream of chunks
//! (UCX's chunk messages, `transport/ucx/stream.rs`), from several
//! connections and in any order: the first chunk claims the range, each
//! later one must lie in it without overlapping one taken before, and the
//! token is used up once chunks cover the whole range. The chunks share one
//! `StreamProgress`, which says when the last byte landed.
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::status::{self, Code, Result, Status};
use crate::sync::timeline::{self, Point};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::WritableDestination;

enum Entry {
    /// Registered, no sender yet; with the name of its completion key when
    /// this process holds it.
    Open(Arc<dyn WritableDestination>, Option<String>),
    /// Claimed by a sender writing it in `parts` parts; `seen` has one bit
    /// per part already taken.
    Parts {
        destination: Arc<dyn WritableDestination>,
        parts: u16,
        seen: u64,
        landing: Option<Arc<Landing>>,
    },
    /// Claimed by a sender writing `range` (offset, length) as a stream of
    /// chunks; `taken` maps each chunk's offset to its length.
    Streaming {
        destination: Arc<dyn WritableDestination>,
        landing: Option<Arc<Landing>>,
        progress: Arc<StreamProgress>,
        taken: BTreeMap<u64, u64>,
        taken_bytes: u64,
    },
}

/// How much of a chunked stream has landed, shared by its chunks.
pub struct StreamProgress {
    /// The destination range the stream writes.
    pub offset: u64,
    pub len: u64,
    remaining: AtomicU64,
    failed: AtomicBool,
}

impl StreamProgress {
    fn new(offset: u64, len: u64) -> StreamProgress {
        StreamProgress {
            offset,
            len,
            remaining: AtomicU64::new(len),
            failed: AtomicBool::new(false),
        }
    }

    /// `bytes` more landed; true for the call that landed the last of the
    /// range (never once the stream failed).
    pub fn landed(&self, bytes: u64) -> bool {
        let before = self.remaining.fetch_sub(bytes, Ordering::AcqRel);
        before == bytes && !self.failed.load(Ordering::Acquire)
    }

    /// The stream failed; true for the first call only (who says so).
    pub fn fail(&self) -> bool {
        !self.failed.swap(true, Ordering::AcqRel)
    }
}

/// What a sender's claim of one chunk of a stream gets.
pub struct ClaimedChunk {
    pub destination: Arc<dyn WritableDestination>,
    pub landing: Option<Arc<Landing>>,
    pub progress: Arc<StreamProgress>,
    /// The stream's first chunk to be claimed (it claimed the range).
    pub first: bool,
}

/// The parts of a destination still to land, and the completion key that a
/// receipt sent with them sets once the last one has.
pub struct Landing {
    pub completion_key: String,
    remaining: std::sync::atomic::AtomicU16,
}

impl Landing {
    /// Sets the completion key to `value` (the receipt that came with the
    /// bytes, all of them in) through `sink`; true when it was. Otherwise
    /// says why in the log: the sender, told so, sets the key itself.
    /// `transport` names the receiver in that line.
    pub fn apply_receipt(
        &self,
        value: &[u8],
        sink: &OnceCell<ReceiptSink>,
        transport: &str,
    ) -> bool {
        let key = &self.completion_key;
        timeline::mark(Point::BytesLanded, key);
        let Some(sink) = sink.get() else {
            log::warn!("{transport} receiver: a receipt came with bytes but none is applied here");
            return false;
        };
        match sink(key, value) {
            Ok(()) => {
                timeline::mark(Point::ReceiptSet, key);
                true
            }
            Err(e) => {
                log::warn!(
                    "{transport} receiver: the receipt for {key} that came with its bytes was not \
                     applied ({e}); its sender sets it"
                );
                false
            }
        }
    }

    /// One part's bytes are in; true for the last of them.
    pub fn part_landed(&self) -> bool {
        self.remaining
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel)
            == 1
    }
}

/// Applies a receipt that came with the bytes: sets `key` (held by this
/// process) to `value`.
pub type ReceiptSink = Arc<dyn Fn(&str, &[u8]) -> Result<()> + Send + Sync>;

/// A send that reached its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// The receipt sent with the bytes set the completion key (the sender
    /// must not set it again).
    pub receipt_applied: bool,
}

/// The most parts one destination may be written in.
pub const MAX_PARTS: u16 = 64;

/// What a sender's claim of (part of) a destination gets.
pub struct Claimed {
    pub destination: Arc<dyn WritableDestination>,
    /// For a destination registered with its completion key: shared by
    /// its parts, so that the receipt is applied once every part landed.
    pub landing: Option<Arc<Landing>>,
}

#[derive(Default)]
pub struct DestinationRegistry {
    destinations: Mutex<HashMap<AuthToken, Entry>>,
}

impl DestinationRegistry {
    pub fn new() -> Arc<DestinationRegistry> {
        Arc::new(DestinationRegistry::default())
    }

    /// Lets senders presenting `token` write into `destination`.
    /// `ALREADY_EXISTS` if the token is registered already.
    pub fn register(
        &self,
        token: AuthToken,
        destination: Arc<dyn WritableDestination>,
    ) -> Result<()> {
        self.register_with_key(token, destination, None)
    }

    /// `register`, naming the completion key this process holds for it.
    pub fn register_with_key(
        &self,
        token: AuthToken,
        destination: Arc<dyn WritableDestination>,
        completion_key: Option<String>,
    ) -> Result<()> {
        let mut destinations = self.destinations.lock();
        if destinations.contains_key(&token) {
            return Err(status::already_exists(
                "a destination is already registered under this auth token",
            ));
        }
        destinations.insert(token, Entry::Open(destination, completion_key));
        Ok(())
    }

    /// Stops accepting writes for `token` and returns its destination;
    /// `None` when a sender already claimed it (a write may be in progress
    /// and finishes into the still valid memory) or it was never registered.
    pub fn unregister(&self, token: &AuthToken) -> Option<Arc<dyn WritableDestination>> {
        match self.destinations.lock().remove(token)? {
            Entry::Open(destination, _) => Some(destination),
            Entry::Parts { .. } | Entry::Streaming { .. } => None,
        }
    }

    /// Takes part `part` of `parts` (`length` bytes at `offset`) of the
    /// destination registered under `token`. UNAUTHENTICATED for an unknown
    /// or used-up token, a part already taken or a different part count;
    /// OUT_OF_RANGE (nothing claimed) for a range outside the destination.
    /// A whole destination is its one part of one (the TCP transport).
    pub fn claim_part(
        &self,
        token: &AuthToken,
        part: u16,
        parts: u16,
        offset: u64,
        length: u64,
    ) -> Result<Claimed> {
        let refused = || {
            status::unauthenticated(
                "no destination is registered for this auth token (unknown, or the receive already \
                 completed or was cancelled)",
            )
        };
        if parts == 0 || parts > MAX_PARTS || part >= parts {
            return Err(status::invalid_argument(format!(
                "part {part} of {parts}: a destination is written in 1..={MAX_PARTS} parts"
            )));
        }
        // `AuthToken`'s equality is the constant-time compare, and the map's
        // hasher is randomly keyed, so lookup timing reveals nothing useful
        // about registered tokens.
        let mut destinations = self.destinations.lock();
        let entry = destinations.get_mut(token).ok_or_else(refused)?;
        let destination = match entry {
            Entry::Open(destination, _) => destination.clone(),
            Entry::Streaming { .. } => return Err(refused()),
            Entry::Parts {
                destination,
                parts: claimed,
                seen,
                ..
            } => {
                if *claimed != parts || *seen & (1 << part) != 0 {
                    return Err(refused());
                }
                destination.clone()
            }
        };
        let fits = offset
            .checked_add(length)
            .is_some_and(|end| end <= destination.len() as u64);
        if !fits {
            return Err(Status::new(
                Code::OutOfRange,
                format!(
                    "{length} bytes at offset {offset} do not fit the {}-byte destination",
                    destination.len()
                ),
            ));
        }
        let all = if parts == 64 {
            u64::MAX
        } else {
            (1u64 << parts) - 1
        };
        let (seen, landing) = match entry {
            Entry::Open(_, key) => (
                1 << part,
                key.take().map(|completion_key| {
                    Arc::new(Landing {
                        completion_key,
                        remaining: std::sync::atomic::AtomicU16::new(parts),
                    })
                }),
            ),
            Entry::Parts { seen, landing, .. } => (*seen | (1 << part), landing.clone()),
            Entry::Streaming { .. } => return Err(refused()),
        };
        if seen == all {
            destinations.remove(token);
        } else {
            *entry = Entry::Parts {
                destination: destination.clone(),
                parts,
                seen,
                landing: landing.clone(),
            };
        }
        Ok(Claimed {
            destination,
            landing,
        })
    }

    /// Takes the chunk of `length` bytes at `offset` of the stream that
    /// writes `range` (offset, length) of the destination registered under
    /// `token`. The first chunk claims the range (it must fit the
    /// destination: OUT_OF_RANGE, nothing claimed); a later one must name
    /// the same range and overlap no chunk taken before (UNAUTHENTICATED
    /// otherwise, as for an unknown or used-up token). A chunk is empty
    /// only in a stream of no bytes. Once chunks cover the range the token
    /// is used up.
    pub fn claim_chunk(
        &self,
        token: &AuthToken,
        range: (u64, u64),
        offset: u64,
        length: u64,
    ) -> Result<ClaimedChunk> {
        let refused = |why: &str| {
            status::unauthenticated(format!(
                "no stream of chunks may write this chunk ({why}; or the receive already \
                 completed or was cancelled)"
            ))
        };
        let (start, len) = range;
        let inside = start
            .checked_add(len)
            .zip(offset.checked_add(length))
            .is_some_and(|(end, chunk_end)| offset >= start && chunk_end <= end);
        if !inside || (length == 0 && len > 0) {
            return Err(status::invalid_argument(format!(
                "a chunk of {length} bytes at {offset} does not lie in its stream ({len} bytes at \
                 {start})"
            )));
        }
        let mut destinations = self.destinations.lock();
        let entry = destinations
            .get_mut(token)
            .ok_or_else(|| refused("unknown or used-up token"))?;
        let first = match entry {
            Entry::Open(destination, key) => {
                let fits = start + len <= destination.len() as u64;
                if !fits {
                    return Err(Status::new(
                        Code::OutOfRange,
                        format!(
                            "a stream of {len} bytes at offset {start} does not fit the {}-byte \
                             destination",
                            destination.len()
                        ),
                    ));
                }
                let landing = key.take().map(|completion_key| {
                    Arc::new(Landing {
                        completion_key,
                        remaining: std::sync::atomic::AtomicU16::new(1),
                    })
                });
                *entry = Entry::Streaming {
                    destination: destination.clone(),
                    landing,
                    progress: Arc::new(StreamProgress::new(start, len)),
                    taken: BTreeMap::new(),
                    taken_bytes: 0,
                };
                true
            }
            Entry::Parts { .. } => return Err(refused("the destination is written in parts")),
            Entry::Streaming { progress, .. } if (progress.offset, progress.len) != range => {
                return Err(refused("another range is being streamed"))
            }
            Entry::Streaming { .. } => false,
        };
        let Entry::Streaming {
            destination,
            landing,
            progress,
            taken,
            taken_bytes,
        } = entry
        else {
            unreachable!("the entry is a stream (made or found above)");
        };
        let before = taken.range(..=offset).next_back();
        let after = taken.range(offset..).next();
        let overlaps = before.is_some_and(|(&at, &n)| at + n > offset || (at == offset && n == 0))
            || after.is_some_and(|(&at, _)| at < offset + length || (at == offset));
        if overlaps {
            return Err(refused("it overlaps a chunk already taken"));
        }
        taken.insert(offset, length);
        *taken_bytes += length;
        let claimed = ClaimedChunk {
            destination: destination.clone(),
            landing: landing.clone(),
            progress: progress.clone(),
            first,
        };
        if *taken_bytes == len {
            destinations.remove(token);
        }
        Ok(claimed)
    }

    /// Destinations registered or partly claimed.
    pub fn len(&self) -> usize {
        self.destinations.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::destination::HeapDestination;

    #[test]
    fn a_destination_is_taken_once_whole_or_once_per_part() {
        let registry = DestinationRegistry::new();
        let token = AuthToken::generate().unwrap();
        registry
            .register(token, Arc::new(HeapDestination::new(100)))
            .unwrap();
        let outside = registry.claim_part(&token, 0, 2, 60, 50).err().unwrap();
        assert_eq!(outside.code, Code::OutOfRange);
        registry.claim_part(&token, 1, 2, 50, 50).unwrap();
        // Partly claimed: no whole claim, no second part 1, no other count.
        assert!(registry.claim_part(&token, 0, 1, 0, 100).is_err());
        let again = registry.claim_part(&token, 1, 2, 50, 50).err().unwrap();
        assert_eq!(again.code, Code::Unauthenticated);
        assert!(registry.claim_part(&token, 0, 3, 0, 50).is_err());
        // A receive that ends now finds it claimed (its memory may be written).
        assert_eq!(registry.len(), 1);
        registry.claim_part(&token, 0, 2, 0, 50).unwrap();
        assert!(
            registry.is_empty(),
            "every part taken: the token is used up"
        );
        assert!(registry.claim_part(&token, 0, 2, 0, 50).is_err());

        let whole = AuthToken::generate().unwrap();
        registry
            .register(whole, Arc::new(HeapDestination::new(8)))
            .unwrap();
        registry.claim_part(&whole, 0, 2, 0, 4).unwrap();
        assert!(
            registry.unregister(&whole).is_none(),
            "a partly claimed destination is not unclaimed"
        );
        assert!(registry.is_empty());
        assert!(registry.claim_part(&whole, 1, 2, 4, 4).is_err());
        assert!(registry.claim_part(&whole, 5, 2, 0, 4).is_err());
    }

    #[test]
    fn a_stream_claims_its_range_then_each_chunk_once_in_any_order() {
        let registry = DestinationRegistry::new();
        let token = AuthToken::generate().unwrap();
        registry
            .register_with_key(token, Arc::new(HeapDestination::new(100)), Some("k".into()))
            .unwrap();
        let outside = registry
            .claim_chunk(&token, (50, 60), 50, 10)
            .err()
            .unwrap();
        assert_eq!(
            outside.code,
            Code::OutOfRange,
            "the range must fit: {outside}"
        );
        let stray = registry.claim_chunk(&token, (10, 80), 5, 10).err().unwrap();
        assert_eq!(stray.code, Code::InvalidArgument, "{stray}");
        // Chunks of [10, 90), out of order.
        let third = registry.claim_chunk(&token, (10, 80), 70, 20).unwrap();
        assert!(third.first);
        assert_eq!(third.landing.as_ref().unwrap().completion_key, "k");
        for (offset, length) in [(65, 10), (80, 5), (60, 15), (70, 20)] {
            let overlap = registry
                .claim_chunk(&token, (10, 80), offset, length)
                .err()
                .unwrap();
            assert_eq!(overlap.code, Code::Unauthenticated, "{offset}+{length}");
        }
        assert!(
            registry.claim_chunk(&token, (10, 70), 10, 10).is_err(),
            "the same range, or nothing"
        );
        assert!(registry.claim_part(&token, 0, 1, 0, 100).is_err());
        let first = registry.claim_chunk(&token, (10, 80), 10, 30).unwrap();
        assert!(!first.first);
        assert!(Arc::ptr_eq(&first.progress, &third.progress));
        assert!(
            registry.unregister(&token).is_none() && registry.is_empty(),
            "a stream under way is claimed: its memory may still be written"
        );
        // Landing: true once, for the last bytes.
        assert!(!first.progress.landed(30));
        assert!(!first.progress.landed(20));
        assert!(first.progress.landed(30));

        let whole = AuthToken::generate().unwrap();
        registry
            .register(whole, Arc::new(HeapDestination::new(8)))
            .unwrap();
        let a = registry.claim_chunk(&whole, (0, 8), 4, 4).unwrap();
        assert_eq!(registry.len(), 1);
        registry.claim_chunk(&whole, (0, 8), 0, 4).unwrap();
        assert!(registry.is_empty(), "covered: the token is used up");
        assert!(registry.claim_chunk(&whole, (0, 8), 0, 4).is_err());
        assert!(a.progress.fail(), "the first failure is the one told");
        assert!(!a.progress.fail());
        assert!(!a.progress.landed(8), "a failed stream never lands");

        let empty = AuthToken::generate().unwrap();
        registry
            .register(empty, Arc::new(HeapDestination::new(0)))
            .unwrap();
        let nothing = registry.claim_chunk(&empty, (0, 0), 0, 0).unwrap();
        assert!(nothing.progress.landed(0));
        assert!(registry.is_empty());
    }

    #[test]
    fn the_parts_share_one_landing_whose_last_part_applies_the_receipt() {
        let registry = DestinationRegistry::new();
        let (one, two, bare) = (
            AuthToken::generate().unwrap(),
            AuthToken::generate().unwrap(),
            AuthToken::generate().unwrap(),
        );
        for token in [one, two] {
            registry
                .register_with_key(token, Arc::new(HeapDestination::new(8)), Some("k".into()))
                .unwrap();
        }
        registry
            .register(bare, Arc::new(HeapDestination::new(8)))
            .unwrap();
        let whole = registry
            .claim_part(&one, 0, 1, 0, 8)
            .unwrap()
            .landing
            .unwrap();
        assert_eq!(whole.completion_key, "k");
        assert!(whole.part_landed());
        let first = registry
            .claim_part(&two, 1, 2, 4, 4)
            .unwrap()
            .landing
            .unwrap();
        let last = registry
            .claim_part(&two, 0, 2, 0, 4)
            .unwrap()
            .landing
            .unwrap();
        assert!(Arc::ptr_eq(&first, &last));
        assert!(!last.part_landed(), "one part is still on its way");
        assert!(first.part_landed());
        assert!(registry
            .claim_part(&bare, 0, 1, 0, 8)
            .unwrap()
            .landing
            .is_none());
    }
}
