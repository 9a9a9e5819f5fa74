//! A shelf of values kept for reuse, each under a key and a size in bytes:
//! the newest value of a key is taken first, and the oldest values leave
//! once the sizes on the shelf add up past a bound. The CUDA backend keeps
//! two: receive memory already exported through IPC (keyed by its length),
//! so that a later receive of the same size reuses it and its handle, and a
//! sender's IPC mappings no longer in use (keyed by handle), so that the
//! next copy into that handle does not map it again. Plain data structure:
//! what leaves the shelf is handed back to the caller to free or close.
use std::collections::VecDeque;

pub struct Shelf<K, V> {
    bound: usize,
    held: usize,
    /// Oldest first.
    entries: VecDeque<(K, usize, V)>,
}

impl<K: PartialEq, V> Shelf<K, V> {
    /// A shelf that holds at most `bound` bytes (0: holds nothing).
    pub fn new(bound: usize) -> Shelf<K, V> {
        Shelf {
            bound,
            held: 0,
            entries: VecDeque::new(),
        }
    }

    /// Bytes on the shelf now.
    pub fn held(&self) -> usize {
        self.held
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Puts `value` (`bytes` large) on the shelf and returns what no longer
    /// fits, oldest first: `value` itself when it alone exceeds the bound.
    #[must_use = "what leaves the shelf must be freed or closed"]
    pub fn put(&mut self, key: K, bytes: usize, value: V) -> Vec<V> {
        if bytes > self.bound {
            return vec![value];
        }
        let mut evicted = Vec::new();
        while self.held + bytes > self.bound {
            let Some((_, size, old)) = self.entries.pop_front() else {
                break;
            };
            self.held -= size;
            evicted.push(old);
        }
        self.held += bytes;
        self.entries.push_back((key, bytes, value));
        evicted
    }

    /// Takes the newest value under `key`, if any.
    pub fn take(&mut self, key: &K) -> Option<V> {
        let at = self.entries.iter().rposition(|(k, _, _)| k == key)?;
        let (_, size, value) = self.entries.remove(at)?;
        self.held -= size;
        Some(value)
    }

    /// Empties the shelf (for example before retrying an allocation the
    /// driver refused for lack of memory).
    #[must_use = "what leaves the shelf must be freed or closed"]
    pub fn drain(&mut self) -> Vec<V> {
        self.held = 0;
        self.entries.drain(..).map(|(_, _, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_value_of_a_key_is_taken_first() {
        let mut shelf = Shelf::new(100);
        assert!(shelf.put(8, 8, "a").is_empty());
        assert!(shelf.put(4, 4, "b").is_empty());
        assert!(shelf.put(8, 8, "c").is_empty());
        assert_eq!(shelf.held(), 20);
        assert_eq!(shelf.take(&8), Some("c"));
        assert_eq!(shelf.take(&8), Some("a"));
        assert_eq!(shelf.take(&8), None);
        assert_eq!(shelf.held(), 4);
        assert_eq!(shelf.take(&4), Some("b"));
        assert!(shelf.is_empty());
        assert_eq!(shelf.held(), 0);
    }

    #[test]
    fn the_oldest_values_leave_past_the_bound() {
        let mut shelf = Shelf::new(10);
        assert!(shelf.put(1, 4, "a").is_empty());
        assert!(shelf.put(2, 4, "b").is_empty());
        assert_eq!(shelf.put(3, 4, "c"), vec!["a"]);
        assert_eq!(shelf.held(), 8);
        assert_eq!(shelf.put(4, 10, "d"), vec!["b", "c"]);
        assert_eq!(shelf.held(), 10);
        assert_eq!(shelf.len(), 1);
    }

    #[test]
    fn a_value_larger_than_the_bound_is_handed_straight_back() {
        let mut shelf = Shelf::new(10);
        assert!(shelf.put(1, 4, "a").is_empty());
        assert_eq!(shelf.put(2, 11, "big"), vec!["big"]);
        assert_eq!(shelf.held(), 4);
        let mut off = Shelf::new(0);
        assert_eq!(off.put(1, 1, "x"), vec!["x"]);
        assert!(off.is_empty());
    }

    #[test]
    fn drain_hands_back_everything() {
        let mut shelf = Shelf::new(100);
        let _ = shelf.put(1, 4, "a");
        let _ = shelf.put(2, 4, "b");
        assert_eq!(shelf.drain(), vec!["a", "b"]);
        assert_eq!(shelf.held(), 0);
        assert!(shelf.take(&1).is_none());
    }
}
