//! What both benchmark binaries share: the cases they run, the byte
//! pattern they check, where the plugin is and how long a transfer may take.
use std::time::Duration;

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
