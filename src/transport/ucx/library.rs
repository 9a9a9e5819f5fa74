//! Finding and loading libucp at run time, once per process, so the plugin
//! builds and loads where UCX is not installed.
//!
//! Where it looks, in order: an explicit path (create option `ucx_library`,
//! else `$PJRT_CROSSHOST_UCX_LIBRARY`); the `libucx` Python wheel's copy
//! (`pip install libucx-cu12`, which also carries UCX's CUDA transports;
//! `jax_plugins.crosshost` names its directory in
//! `$PJRT_CROSSHOST_UCX_WHEEL_LIB`); the system's `libucp.so.0` (Debian
//! `libucx0`). An explicit path that does not load is an error, not a reason
//! to take another UCX.
//!
//! Only UCX 1.14 and later is used (`MINIMUM_VERSION`). Before 1.14, a peer
//! that connects and dies in the middle of its wire-up makes the process it
//! talked to abort in an assertion (`ucp_request.c:684` in 1.13.1): anyone
//! who can reach a worker's TCP port could kill the process. Where only an
//! older UCX is found, the plugin says so once and the network transfers go
//! over the TCP transport instead.
//!
//! UCX reads part of its configuration from the environment when its
//! libraries load (their constructors), before any API call could change
//! it. The host process (JAX) owns signals and the allocator, so before the
//! first load we make UCX leave them alone, unless the user set these
//! variables: `UCX_ERROR_SIGNALS=` (no SIGSEGV/SIGBUS handlers),
//! `UCX_MEM_MALLOC_HOOKS=no` and `UCX_MEM_EVENTS=no` (no malloc or mmap
//! interception; UCX then registers memory per transfer instead of caching
//! registrations, which costs nothing on TCP), and `UCX_TCP_RX_SEG_SIZE=512k`
//! (larger fragments over UCX's TCP transport, see `UCX_ENVIRONMENT`).
//! `jax_plugins.crosshost` sets the same when it is imported, before JAX
//! starts its threads: `setenv` is not safe while other threads read the
//! environment, so the library only sets what is still missing.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use libloading::os::unix::{Library as UnixLibrary, RTLD_LOCAL, RTLD_NOW};
use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::sys::UcpApi;
use crate::status::{failed_precondition, Result};

/// Environment variable naming libucp explicitly.
pub const UCX_LIBRARY_ENV: &str = "PJRT_CROSSHOST_UCX_LIBRARY";
/// The `libucx` wheel's library directory (set by `jax_plugins.crosshost`).
pub const UCX_WHEEL_ENV: &str = "PJRT_CROSSHOST_UCX_WHEEL_LIB";
/// The system library's soname.
pub const SYSTEM_LIBUCP: &str = "libucp.so.0";
/// The oldest UCX the plugin exposes to the network (see the module's doc).
pub const MINIMUM_VERSION: (u32, u32) = (1, 14);

/// What to do instead of an older UCX, said in every refusal.
const NEWER_UCX: &str = "transfers between hosts use the TCP transport instead; for UCX, \
     `pip install libucx-cu12` (jax_plugins.crosshost finds it; elsewhere set \
     $PJRT_CROSSHOST_UCX_WHEEL_LIB to its libucx/lib directory) or point ucx_library at a \
     UCX 1.14 or later";

/// Whether UCX `major.minor.release` at `path` may be used: before 1.14 a
/// stranger's failed wire-up aborts the process (see the module's doc).
pub fn check_version(
    path: &str,
    major: u32,
    minor: u32,
    release: u32,
) -> std::result::Result<(), String> {
    if (major, minor) >= MINIMUM_VERSION {
        return Ok(());
    }
    Err(format!(
        "{path} is UCX {major}.{minor}.{release}, which is not used: before UCX 1.14 a peer that \
         connects and dies during its wire-up aborts this process (an assertion in UCX), so \
         anyone who can reach its port could end it; {NEWER_UCX}"
    ))
}

/// UCX settings applied before its libraries load, unless already set.
///
/// `UCX_TCP_RX_SEG_SIZE`: over UCX's TCP transport (no RDMA), a large
/// active message moves as fragments of the receive segment, each read into
/// a segment and copied into the destination, one `epoll_wait` + `recv` per
/// fragment; UCX's 64 KiB default made a 1 MiB buffer 16 of them, with the
/// two hosts' progress threads waking each other between fragments.
/// 512 KiB halved the progress threads' context switches for 64 x 1 MiB on
/// the two-host bed and moved those batches in 51-53 ms against 51-64 ms
/// (alternating runs, 2026-12-03); RDMA transports do not use it.
pub const UCX_ENVIRONMENT: &[(&str, &str)] = &[
    ("UCX_ERROR_SIGNALS", ""),
    ("UCX_MEM_MALLOC_HOOKS", "no"),
    ("UCX_MEM_EVENTS", "no"),
    ("UCX_WARN_UNUSED_ENV_VARS", "n"),
    ("UCX_TCP_RX_SEG_SIZE", "512k"),
];

/// The loaded library (with where it came from), or why none loaded.
#[derive(Clone)]
pub struct LoadedUcx {
    pub api: Arc<UcpApi>,
    pub path: String,
    pub version: String,
}

static LOADED: OnceCell<std::result::Result<LoadedUcx, String>> = OnceCell::new();
/// The explicit path the first load used, so a later client asking for
/// another one hears that UCX is already loaded.
static EXPLICIT: Mutex<Option<String>> = Mutex::new(None);

/// libucp, loaded on first use (`explicit`: the `ucx_library` option).
/// FAILED_PRECONDITION naming every place it looked when there is none.
pub fn load(explicit: Option<&str>) -> Result<LoadedUcx> {
    let loaded = LOADED.get_or_init(|| {
        let explicit = explicit.map(str::to_string).or_else(|| {
            std::env::var(UCX_LIBRARY_ENV)
                .ok()
                .filter(|p| !p.is_empty())
        });
        *EXPLICIT.lock() = explicit.clone();
        load_first(explicit.as_deref())
    });
    let loaded = loaded.clone().map_err(failed_precondition)?;
    if let Some(wanted) = explicit {
        if EXPLICIT.lock().as_deref() != Some(wanted) && loaded.path != wanted {
            log::warn!(
                "ucx_library={wanted}: UCX is already loaded in this process from {}",
                loaded.path
            );
        }
    }
    Ok(loaded)
}

fn load_first(explicit: Option<&str>) -> std::result::Result<LoadedUcx, String> {
    prepare_environment();
    let mut tried = Vec::new();
    if let Some(path) = explicit {
        return open(Path::new(path)).map_err(|e| {
            format!("UCX: the libucp named by ucx_library / ${UCX_LIBRARY_ENV} ({path}) does not load: {e}")
        });
    }
    tried.push(format!("ucx_library and ${UCX_LIBRARY_ENV}: not set"));
    match std::env::var(UCX_WHEEL_ENV).ok().filter(|p| !p.is_empty()) {
        Some(dir) => {
            let path = PathBuf::from(&dir).join("libucp.so");
            match open(&path) {
                Ok(loaded) => return Ok(loaded),
                Err(e) => tried.push(format!("the libucx wheel ({}): {e}", path.display())),
            }
        }
        None => tried.push(format!(
            "the libucx wheel: ${UCX_WHEEL_ENV} not set (jax_plugins.crosshost sets it when `pip install libucx-cu12` is present)"
        )),
    }
    match open(Path::new(SYSTEM_LIBUCP)) {
        Ok(loaded) => return Ok(loaded),
        Err(e) => tried.push(format!(
            "the system's {SYSTEM_LIBUCP} (Debian/Ubuntu package libucx0): {e}"
        )),
    }
    let why = format!(
        "UCX (libucp) is not available; looked at: {}",
        tried.join("; ")
    );
    // Said once per process (this runs once): the job still works, slower.
    if tried.iter().any(|t| t.contains("which is not used")) {
        log::warn!("{why}");
    }
    Err(why)
}

/// A UCX library loaded in this process from somewhere else than `dir`
/// (its path), if any.
fn other_ucx_loaded(dir: &Path) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            let path = Path::new(path);
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libucs.so"))
                && path.parent() != Some(dir)
        })
        .map(str::to_string)
}

fn prepare_environment() {
    for (name, value) in UCX_ENVIRONMENT {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
}

/// Loads libucp at `path` (a bare soname goes through the loader's search
/// path). A wheel's libraries find each other only when loaded in
/// dependency order, so the siblings of a libucp given by path load first.
fn open(path: &Path) -> std::result::Result<LoadedUcx, String> {
    let mut keep = Vec::new();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // libucs first: libucm calls into it without naming it as a
        // dependency, so libucm loads only as libucs's own dependency.
        for sibling in ["libucs.so", "libucs_signal.so", "libuct.so"] {
            let candidate = dir.join(sibling);
            if candidate.is_file() {
                // SAFETY: UCX's own libraries, loaded for their symbols only;
                // their constructors run with the environment prepared above.
                match unsafe { UnixLibrary::open(Some(&candidate), RTLD_NOW | RTLD_LOCAL) } {
                    Ok(library) => keep.push(library),
                    Err(e) => {
                        return Err(format!(
                            "{}: {e}{}",
                            candidate.display(),
                            other_ucx_loaded(dir).map_or(String::new(), |other| format!(
                                " ({other} is already loaded in this process: a UCX library's \
                                 parts are found by name, so the first UCX loaded is the one \
                                 they all bind to; load no other UCX before the plugin's)"
                            ))
                        ))
                    }
                }
            }
        }
    }
    // SAFETY: loading libucp runs UCX's constructors, which read the
    // environment prepared above and touch nothing of ours.
    let library = unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| e.to_string())?;
    // SAFETY: the library is libucp by name; `resolve` checks that each
    // symbol exists, and their signatures are UCP's stable C API.
    let api = unsafe { UcpApi::resolve(library.into()) }?;
    // UCX is never unloaded: its threads and handlers outlive any client.
    std::mem::forget(keep);
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    unsafe { (api.get_version)(&mut major, &mut minor, &mut release) };
    check_version(&path.display().to_string(), major, minor, release)?;
    let version = format!("{major}.{minor}.{release}");
    log::info!("UCX {version} loaded from {}", path.display());
    Ok(LoadedUcx {
        api: Arc::new(api),
        path: path.display().to_string(),
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_before_1_14_is_refused_naming_the_version_and_the_way_out() {
        let refused = check_version("/usr/lib/libucp.so.0", 1, 13, 1).unwrap_err();
        assert!(refused.contains("UCX 1.13.1"), "{refused}");
        assert!(refused.contains("TCP transport"), "{refused}");
        assert!(refused.contains("libucx-cu12"), "{refused}");
        assert!(check_version("x", 0, 9, 0).is_err());
        for (major, minor) in [(1, 14), (1, 22), (2, 0)] {
            assert_eq!(check_version("x", major, minor, 0), Ok(()));
        }
    }
}
