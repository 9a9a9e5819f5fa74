//! A roster: lines that every process of the job reads, gathered by process
//! 0 and published once, so that each other process reads the job's table
//! in one store call instead of one per peer (the store's work grows with
//! the job, not with its square).
//!
//! Under `<base>`: key `<base>/0` holds `xr1 <lines> <chunks>` and the first
//! chunk's lines; `<base>/<k>` the k-th chunk. A chunk holds at most
//! `CHUNK_LINES` lines (a store may bound a value's size: etcd's default is
//! 1.5 MiB). Later chunks are written first, so a reader that finds chunk 0
//! finds them all. When process 0 cannot gather the job it publishes
//! `xr1 failed <code> <why>` instead: the waiting processes then fail at
//! once with its reason, rather than at their own deadline with none.
use std::time::{Duration, Instant};

use crate::kv::KeyValueStore;
use crate::status::{self, Code, Result, Status};

/// Lines per key.
pub const CHUNK_LINES: usize = 64;

/// How much longer than process 0 a reader waits: process 0 gives up at
/// the same deadline as the readers would, and its notice of why must
/// still find them waiting.
pub const GRACE: Duration = Duration::from_secs(5);

fn chunk_key(base: &str, k: usize) -> String {
    format!("{base}/{k}")
}

/// Publishes `lines` (none may contain a newline) under `base`.
pub fn publish(store: &dyn KeyValueStore, base: &str, lines: &[String]) -> Result<()> {
    if let Some(line) = lines.iter().find(|l| l.contains('\n')) {
        return Err(status::internal(format!(
            "roster {base}: a line holds a newline: {line:?}"
        )));
    }
    let chunks: Vec<&[String]> = lines.chunks(CHUNK_LINES).collect();
    for (k, chunk) in chunks.iter().enumerate().skip(1) {
        store.set(&chunk_key(base, k), chunk.join("\n").as_bytes())?;
    }
    let first = chunks.first().map(|c| c.join("\n")).unwrap_or_default();
    let head = format!("xr1 {} {}\n{first}", lines.len(), chunks.len().max(1));
    store.set(&chunk_key(base, 0), head.as_bytes())
}

/// Tells the processes waiting on `base` why the job could not be formed.
pub fn publish_failure(store: &dyn KeyValueStore, base: &str, error: &Status) {
    let why = error.message.replace('\n', " ");
    let value = format!("xr1 failed {} {why}", error.code as i32);
    if let Err(e) = store.set(&chunk_key(base, 0), value.as_bytes()) {
        log::warn!("could not tell the job's processes why it failed ({base}): {e}");
    }
}

/// What process 0 gathers: the value of each of `count` processes (its own,
/// process 0's, is `own`), each other's read from `key(i)` and waited for
/// until `deadline` (`waiting(i)` names it in the error), then `decode`d.
pub struct Gathering<'a, T> {
    pub count: usize,
    pub own: T,
    pub deadline: Instant,
    pub key: &'a dyn Fn(usize) -> String,
    pub waiting: &'a dyn Fn(usize) -> String,
    pub decode: &'a dyn Fn(usize, &[u8]) -> Result<T>,
    pub encode: &'a dyn Fn(&T) -> String,
}

/// Process 0's side: gathers every value and publishes them under `base`
/// as one roster, or, if one cannot be had, publishes why (the others then
/// fail at once with that reason) and returns it.
pub fn gather_and_publish<T>(
    store: &dyn KeyValueStore,
    base: &str,
    gathering: Gathering<'_, T>,
) -> Result<Vec<T>> {
    let Gathering {
        count,
        own,
        deadline,
        key,
        waiting,
        decode,
        encode,
    } = gathering;
    let mut values = Vec::with_capacity(count);
    values.push(own);
    let gathered = (1..count).try_for_each(|i| {
        let left = deadline.saturating_duration_since(Instant::now());
        let bytes = store
            .get(&key(i), left)
            .map_err(|e| Status::new(e.code, format!("{}: {}", waiting(i), e.message)))?;
        values.push(decode(i, &bytes)?);
        Ok(())
    });
    if let Err(e) = gathered {
        publish_failure(store, base, &e);
        return Err(e);
    }
    let lines: Vec<String> = values.iter().map(encode).collect();
    publish(store, base, &lines)?;
    Ok(values)
}

/// The `expected` lines published under `base`, waiting at most `timeout`
/// for them; `waiting` names what is awaited, for the errors.
pub fn read(
    store: &dyn KeyValueStore,
    base: &str,
    expected: usize,
    timeout: Duration,
    waiting: &str,
) -> Result<Vec<String>> {
    let head = store
        .get(&chunk_key(base, 0), timeout)
        .map_err(|e| Status::new(e.code, format!("{waiting}: {}", e.message)))?;
    let bad = || status::data_loss(format!("{waiting}: the roster at {base} is malformed"));
    let text = String::from_utf8(head).map_err(|_| bad())?;
    let (first_line, rest) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    if let Some(failure) = first_line.strip_prefix("xr1 failed ") {
        let (code, why) = failure.split_once(' ').ok_or_else(bad)?;
        let code = Code::from_raw(code.parse().map_err(|_| bad())?);
        return Err(Status::new(
            code,
            format!("{waiting}: process 0 gave up: {why}"),
        ));
    }
    let mut head = first_line.strip_prefix("xr1 ").ok_or_else(bad)?.split(' ');
    let (Some(count), Some(chunks), None) = (head.next(), head.next(), head.next()) else {
        return Err(bad());
    };
    let count: usize = count.parse().map_err(|_| bad())?;
    let chunks: usize = chunks.parse().map_err(|_| bad())?;
    if count != expected {
        return Err(status::failed_precondition(format!(
            "{waiting}: process 0 counts {count} entries and this process expects {expected}: \
             every process of a job needs the same number of processes"
        )));
    }
    if chunks != count.div_ceil(CHUNK_LINES).max(1) {
        return Err(bad());
    }
    let mut lines: Vec<String> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split('\n').map(str::to_string).collect()
    };
    for k in 1..chunks {
        let chunk = store.try_get(&chunk_key(base, k)).map_err(|e| {
            status::data_loss(format!("{waiting}: roster chunk {base}/{k}: {}", e.message))
        })?;
        let chunk = String::from_utf8(chunk).map_err(|_| bad())?;
        lines.extend(chunk.split('\n').map(str::to_string));
    }
    if lines.len() != count {
        return Err(bad());
    }
    Ok(lines)
}

/// The keys a roster of `lines` lines takes (for cleanup and tests).
pub fn keys(base: &str, lines: usize) -> Vec<String> {
    (0..lines.div_ceil(CHUNK_LINES).max(1))
        .map(|k| chunk_key(base, k))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::memory::MemoryStore;

    fn lines(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("entry {i} with spaces")).collect()
    }

    #[test]
    fn lines_come_back_whole_across_chunks() {
        for n in [0, 1, CHUNK_LINES, CHUNK_LINES + 1, 3 * CHUNK_LINES + 5] {
            let store = MemoryStore::new();
            publish(&store, "r", &lines(n)).unwrap();
            let back = read(&store, "r", n, Duration::from_secs(1), "test").unwrap();
            assert_eq!(back, lines(n), "{n} lines");
            for key in keys("r", n) {
                assert!(store.try_get(&key).is_ok(), "{key} for {n} lines");
            }
        }
    }

    #[test]
    fn a_failure_reaches_the_readers_with_its_code_and_reason() {
        let store = MemoryStore::new();
        let why = status::deadline_exceeded("process 7 did not join\nwithin 3s");
        publish_failure(&store, "r", &why);
        let err = read(&store, "r", 8, Duration::from_secs(1), "joining").unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        assert!(
            err.message.contains("process 7 did not join within 3s"),
            "{err}"
        );
    }

    #[test]
    fn a_short_wrong_sized_or_garbled_roster_is_refused() {
        let store = MemoryStore::new();
        publish(&store, "r", &lines(3)).unwrap();
        let err = read(&store, "r", 4, Duration::from_secs(1), "t").unwrap_err();
        assert_eq!(err.code, Code::FailedPrecondition, "{err}");
        for garbled in [
            "xr1 3 1\na\nb",
            "xr1 3 2\na\nb\nc",
            "xr2 3 1\na\nb\nc",
            "xr1 x 1",
            "xr1 failed x why",
        ] {
            store.set("g/0", garbled.as_bytes()).unwrap();
            let err = read(&store, "g", 3, Duration::from_secs(1), "t").unwrap_err();
            assert_eq!(err.code, Code::DataLoss, "{garbled}: {err}");
        }
        // A missing later chunk is data loss, not a wait.
        publish(&store, "m", &lines(CHUNK_LINES + 1)).unwrap();
        store.delete("m/1").unwrap();
        let err = read(&store, "m", CHUNK_LINES + 1, Duration::from_secs(1), "t").unwrap_err();
        assert_eq!(err.code, Code::DataLoss, "{err}");
        assert!(publish(&store, "n", &["a\nb".to_string()]).is_err());
    }

    #[test]
    fn a_reader_waits_for_the_roster_within_its_timeout() {
        let store = MemoryStore::new();
        let err = read(
            &store,
            "late",
            1,
            Duration::from_millis(20),
            "waiting for 0",
        )
        .unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded);
        assert!(err.message.starts_with("waiting for 0"), "{err}");
    }
}
