//! What both benchmark binaries share: the cases they run, the byte
//! pattern they check, where the plugin is and how long a transfer may take.
use std::io::Write;
use std::time::Duration;

use crate::ffi_client::{Client, Result};

/// Bound on one measured transfer (a stuck one fails the run, never hangs it).
pub const WAIT: Duration = Duration::from_secs(120);

/// One row of a benchmark: `repeats` transfers of `batch` buffers of `bytes`.
pub struct Case {
    pub bytes: usize,
    pub batch: usize,
    pub repeats: usize,
}

impl Case {
    /// Cases from `(bytes, batch, repeats)` rows.
    pub fn list(rows: &[(usize, usize, usize)]) -> Vec<Case> {
        rows.iter()
            .map(|&(bytes, batch, repeats)| Case {
                bytes,
                batch,
                repeats,
            })
            .collect()
    }
}

/// Period-251 byte pattern (seeded per transfer), built by repetition so
/// that 1 GiB takes milliseconds.
pub fn pattern(bytes: usize, seed: usize) -> Vec<u8> {
    let block: Vec<u8> = (0..251)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect();
    let mut out = Vec::with_capacity(bytes);
    while out.len() < bytes {
        let n = (bytes - out.len()).min(block.len());
        out.extend_from_slice(&block[..n]);
    }
    out
}

/// The plugin: `--lib`, else `libpjrt_crosshost.so` beside the binary.
pub fn library_path(explicit: Option<String>) -> String {
    if let Some(p) = explicit {
        return p;
    }
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .expect("exe dir")
        .join("libpjrt_crosshost.so")
        .to_string_lossy()
        .into_owned()
}

/// One `recv` of a benchmark child: `batch` buffers of `bytes` from device
/// `peer` under keys `key_base..`, "armed" on `out` once they are waited
/// for, every byte checked against `pattern(bytes, seed)` outside the timed
/// part, then "ready" with each buffer's ready time.
pub fn receive_and_check(
    client: &Client,
    out: &mut impl Write,
    (bytes, batch, key_base, seed): (usize, usize, usize, usize),
    peer: i32,
) -> Result<()> {
    let keys: Vec<i64> = (0..batch).map(|i| (key_base + i) as i64).collect();
    let buffers = client.receive(0, &vec![bytes; batch], peer, &keys)?;
    let events = buffers
        .iter()
        .map(|b| client.ready_event(b))
        .collect::<Result<Vec<_>>>()?;
    let times = client.watch(events)?;
    writeln!(out, "armed").map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    let ready = times.wait(WAIT)?;
    let expected = pattern(bytes, seed);
    let mut got = vec![0u8; bytes];
    for (i, b) in buffers.iter().enumerate() {
        client.to_host(b, &mut got)?;
        if got != expected {
            return Err(format!(
                "buffer {i} of {bytes} bytes: received bytes differ from what was sent"
            ));
        }
    }
    drop(buffers);
    let list: Vec<String> = ready.iter().map(u64::to_string).collect();
    writeln!(out, "ready {}", list.join(" ")).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}
