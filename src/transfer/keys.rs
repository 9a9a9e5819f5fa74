//! Key names of the cross-host protocol (docs/DESIGN.md §3 rule 6):
//!
//! - completion key `crosshost/recv/<epoch>/<transfer_id>/<index>`: the
//!   sender (or a cancel) writes the buffer's `Receipt` there;
//! - descriptor key `crosshost/desc/<epoch>/<transfer_id>/<index>` (v2 API):
//!   the receiver publishes the buffer's descriptor there.
//!
//! `<epoch>` is the temporal identity the client supplies: the session id all
//! processes agreed on, plus the peers' incarnation ids where the caller gave
//! them. JAX's transfer keys restart at 0 in every job; the epoch keeps one
//! job's keys from meeting another's.
use std::collections::HashMap;
use std::fmt;

use crate::status::{self, Result};

const RECV_PREFIX: &str = "crosshost/recv/";
const DESC_PREFIX: &str = "crosshost/desc/";

/// Checks that `epoch` can be one path segment: non-empty, printable ASCII,
/// no `/` and no whitespace.
pub fn validate_epoch(epoch: &str) -> Result<()> {
    if epoch.is_empty() {
        return Err(status::invalid_argument("key epoch: empty"));
    }
    if let Some(c) = epoch.chars().find(|c| !c.is_ascii_graphic() || *c == '/') {
        return Err(status::invalid_argument(format!(
            "key epoch {epoch:?}: character {c:?} not allowed (printable ASCII, no '/')"
        )));
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompletionKey {
    epoch: String,
    transfer_id: i64,
    index: u64,
    name: String,
}

impl CompletionKey {
    pub fn new(epoch: &str, transfer_id: i64, index: u64) -> Result<CompletionKey> {
        validate_epoch(epoch)?;
        Ok(CompletionKey {
            epoch: epoch.to_string(),
            transfer_id,
            index,
            name: format!("{RECV_PREFIX}{epoch}/{transfer_id}/{index}"),
        })
    }

    /// Parses a completion key name; `INVALID_ARGUMENT` for anything else.
    pub fn parse(name: &str) -> Result<CompletionKey> {
        let bad = |why: &str| status::invalid_argument(format!("completion key {name:?}: {why}"));
        let rest = name
            .strip_prefix(RECV_PREFIX)
            .ok_or_else(|| bad("does not start with crosshost/recv/"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [epoch, transfer_id, index] = parts[..] else {
            return Err(bad("expected <epoch>/<transfer_id>/<index>"));
        };
        let transfer_id = transfer_id
            .parse::<i64>()
            .map_err(|_| bad("transfer id is not an int64"))?;
        let index = index
            .parse::<u64>()
            .map_err(|_| bad("index is not a u64"))?;
        let key = CompletionKey::new(epoch, transfer_id, index)?;
        if key.name != name {
            return Err(bad("not in canonical form"));
        }
        Ok(key)
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }

    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    pub fn transfer_id(&self) -> i64 {
        self.transfer_id
    }

    pub fn index(&self) -> u64 {
        self.index
    }

    /// The v2 descriptor key of the same buffer.
    pub fn descriptor_key(&self) -> String {
        format!(
            "{DESC_PREFIX}{}/{}/{}",
            self.epoch, self.transfer_id, self.index
        )
    }
}

/// `crosshost/desc/<epoch>/<transfer_id>/<index>`.
pub fn descriptor_key(epoch: &str, transfer_id: i64, index: u64) -> Result<String> {
    Ok(CompletionKey::new(epoch, transfer_id, index)?.descriptor_key())
}

/// Who reads a transfer key, as its name says: the receiving device of a v2
/// pair (completion keys), the receiving process of a v1 transfer, or the
/// sending device of a v2 pair (descriptor keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyReader {
    Device(i32),
    Process(i32),
}

/// The temporal identity of one sender/receiver pair: the session epoch,
/// the two devices, and the two processes' incarnations when the caller gave
/// them (a restarted peer never matches an old key).
pub fn pair_epoch(
    session_epoch: &str,
    (src, dst): (i32, i32),
    (src_process, dst_process): (i32, i32),
    incarnations: Option<&[(i32, i64)]>,
) -> String {
    let mut epoch = format!("{session_epoch}.d{src}-{dst}");
    if let Some(snapshot) = incarnations {
        let find = |task: i32| snapshot.iter().find(|(t, _)| *t == task).map(|(_, i)| *i);
        if let (Some(a), Some(b)) = (find(src_process), find(dst_process)) {
            epoch.push_str(&format!(".i{a}-{b}"));
        }
    }
    epoch
}

/// The `<index>` of a call's buffers: counted per device pair (sending,
/// receiving) and transfer key, so that the send call and the receive call
/// of a pair number the same buffers alike whichever devices either call
/// mixes.
#[derive(Default)]
pub struct BufferIndices(HashMap<((i32, i32), i64), u64>);

impl BufferIndices {
    /// The index of the next buffer under `transfer_id` between the devices
    /// `(src, dst)`.
    pub fn next(&mut self, devices: (i32, i32), transfer_id: i64) -> u64 {
        let count = self.0.entry((devices, transfer_id)).or_insert(0);
        *count += 1;
        *count - 1
    }
}

/// Whether `name` is a transfer key (completion or descriptor), as opposed
/// to a session key or anything else in the store.
pub fn is_transfer_key(name: &str) -> bool {
    name.starts_with(RECV_PREFIX) || name.starts_with(DESC_PREFIX)
}

/// What a transfer key's epoch segment says about its two sides.
enum KeySides {
    /// A v2 pair's key: completion (`true`) or descriptor, between devices.
    Pair {
        completion: bool,
        src: i32,
        dst: i32,
    },
    /// A v1 completion key, read by this process.
    V1 { reader: i32 },
}

/// The sides of a key named by this module, from its epoch segment
/// (`<session>.d<src>-<dst>[.i<a>-<b>]` for v2 pairs, `<session>.v1.p<i>`
/// for v1); `None` for any other name.
fn sides_of(key: &str) -> Option<KeySides> {
    let (completion, rest) = match (key.strip_prefix(RECV_PREFIX), key.strip_prefix(DESC_PREFIX)) {
        (Some(rest), _) => (true, rest),
        (_, Some(rest)) => (false, rest),
        _ => return None,
    };
    let epoch = rest.split('/').next()?;
    let mut parts = epoch.split('.').skip(1);
    match parts.next()? {
        "v1" if completion => {
            let process = parts.next()?.strip_prefix('p')?;
            Some(KeySides::V1 {
                reader: process.parse().ok()?,
            })
        }
        pair => {
            let (src, dst) = pair.strip_prefix('d')?.split_once('-')?;
            Some(KeySides::Pair {
                completion,
                src: src.parse().ok()?,
                dst: dst.parse().ok()?,
            })
        }
    }
}

/// The reader of a key named by this module; `None` for any other name.
pub fn reader_of(key: &str) -> Option<KeyReader> {
    match sides_of(key)? {
        KeySides::V1 { reader } => Some(KeyReader::Process(reader)),
        KeySides::Pair {
            completion,
            src,
            dst,
        } => Some(KeyReader::Device(if completion { dst } else { src })),
    }
}

/// The device whose process writes a v2 pair's key: the sender writes the
/// completion key, the receiver the descriptor key. `None` for v1 keys (any
/// holder of the descriptor may send) and any other name.
pub fn writer_device_of(key: &str) -> Option<i32> {
    match sides_of(key)? {
        KeySides::V1 { .. } => None,
        KeySides::Pair {
            completion,
            src,
            dst,
        } => Some(if completion { src } else { dst }),
    }
}

impl fmt::Display for CompletionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn completion_and_descriptor_keys_follow_the_documented_layout() {
        let key = CompletionKey::new("s1a2.i0-3", -7, 2).unwrap();
        assert_eq!(key.as_str(), "crosshost/recv/s1a2.i0-3/-7/2");
        assert_eq!(key.descriptor_key(), "crosshost/desc/s1a2.i0-3/-7/2");
        assert_eq!(descriptor_key("e", 1, 0).unwrap(), "crosshost/desc/e/1/0");
        assert_eq!(CompletionKey::parse(key.as_str()).unwrap(), key);
    }

    #[test]
    fn the_reader_of_each_kind_of_key_comes_from_its_name() {
        let v2 = CompletionKey::new("5eed.d0-2048.i7-9", 3, 1).unwrap();
        assert_eq!(reader_of(v2.as_str()), Some(KeyReader::Device(2048)));
        assert!(is_transfer_key(v2.as_str()) && is_transfer_key(&v2.descriptor_key()));
        assert_eq!(reader_of(&v2.descriptor_key()), Some(KeyReader::Device(0)));
        let v1 = CompletionKey::new("5eed.v1.p1", 0, 0).unwrap();
        assert_eq!(reader_of(v1.as_str()), Some(KeyReader::Process(1)));
        // The writer is the other side of a pair; nobody in particular for v1.
        assert_eq!(writer_device_of(v2.as_str()), Some(0));
        assert_eq!(writer_device_of(&v2.descriptor_key()), Some(2048));
        assert_eq!(writer_device_of(v1.as_str()), None);
        for other in [
            "crosshost/session/job/epoch",
            "crosshost/recv/5eed/1/0",
            "crosshost/desc/5eed.v1.p1/0/0",
            "crosshost/recv/5eed.dx-1/0/0",
            "unrelated",
        ] {
            assert_eq!(reader_of(other), None, "{other}");
            assert_eq!(writer_device_of(other), None, "{other}");
            assert_eq!(
                is_transfer_key(other),
                other.starts_with("crosshost/recv/") || other.starts_with("crosshost/desc/"),
                "{other}"
            );
        }
    }

    #[test]
    fn bad_epochs_and_malformed_names_are_invalid_argument() {
        for epoch in ["", "a/b", "a b", "é"] {
            let err = CompletionKey::new(epoch, 0, 0).unwrap_err();
            assert_eq!(err.code, Code::InvalidArgument, "{epoch:?}");
        }
        for name in [
            "crosshost/desc/e/1/0",
            "crosshost/recv/e/1",
            "crosshost/recv/e/x/0",
            "crosshost/recv/e/1/0/extra",
            "crosshost/recv/e/01/0",
        ] {
            let err = CompletionKey::parse(name).unwrap_err();
            assert_eq!(err.code, Code::InvalidArgument, "{name}");
        }
    }

    #[test]
    fn buffer_indices_count_per_device_pair_and_transfer_key() {
        let mut indices = BufferIndices::default();
        let counted: Vec<u64> = [
            ((0, 2), 7),
            ((1, 2), 7),
            ((0, 2), 7),
            ((0, 2), 8),
            ((1, 2), 7),
        ]
        .into_iter()
        .map(|(devices, key)| indices.next(devices, key))
        .collect();
        assert_eq!(counted, vec![0, 0, 1, 0, 1]);
    }
}
