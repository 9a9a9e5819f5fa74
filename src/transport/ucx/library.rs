//! Finding and loading libucp at run time, once per process, so the plugin
//! builds and loads where UCX is not installed.
//!
//! An explicit path always wins (create option `ucx_library`, else
//! `$PJRT_CROSSHOST_UCX_LIBRARY`); one that does not load is an error, not a
//! reason to take another UCX. Otherwise the candidates are the `libucx`
//! Python wheel's copy (`pip install libucx-cu12`, which carries UCX's CUDA
//! transports but no verbs; `jax_plugins.crosshost` names its directory in
//! `$PJRT_CROSSHOST_UCX_WHEEL_LIB`) and the system's `libucp.so.0` (Debian
//! `libucx0`, an HPC stack's UCX), and the one taken is chosen by what it can
//! do here (`choose`): one with verbs transports (rc, ud, dc) where this host
//! has RDMA devices, then one with CUDA transports (cuda_copy, cuda_ipc)
//! where the client has CUDA devices, then the wheel before the system's.
//! On an InfiniBand or RoCE cluster whose system UCX has verbs, installing
//! the wheel for its CUDA transports thus no longer moves every byte onto
//! TCP. The choice and why are logged (info) and shown by the doctor.
//!
//! What a candidate can do is read without loading it into the process:
//! its version in a link-map namespace of its own (`probe`: `dlmopen`, so
//! none of its parts can bind to, or be bound by, another UCX), its
//! transports from the modules installed beside it (`ucx/libuct_ib.so`,
//! `ucx/libuct_cuda.so`, which UCX loads from there), and the host's RDMA
//! devices from `/sys/class/infiniband`. A UCX is loaded into the process's
//! own namespace only once chosen, so a refused one never runs there.
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
//! first load (the probes included) we make UCX leave them alone, unless the
//! user set these variables: `UCX_ERROR_SIGNALS=` (no SIGSEGV/SIGBUS
//! handlers), `UCX_MEM_MALLOC_HOOKS=no` and `UCX_MEM_EVENTS=no` (no malloc
//! or mmap interception; UCX then registers memory per transfer instead of
//! caching registrations, which costs nothing on TCP), and
//! `UCX_TCP_RX_SEG_SIZE=512k` (larger fragments over UCX's TCP transport,
//! see `UCX_ENVIRONMENT`). `jax_plugins.crosshost` sets the same when it is
//! imported, before JAX starts its threads: `setenv` is not safe while
//! other threads read the environment, so the library only sets what is
//! still missing.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::ffi::{c_uint, CStr, CString};
use std::os::unix::ffi::OsStrExt;

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
/// Where the kernel lists the host's RDMA devices (InfiniBand, RoCE,
/// iWARP, EFA): verbs transports need one.
pub const RDMA_DEVICES_DIR: &str = "/sys/class/infiniband";
/// Tests only: read this directory instead of `RDMA_DEVICES_DIR` (a test
/// cannot add an RDMA device to a machine that has none).
pub const RDMA_DEVICES_DIR_ENV: &str = "PJRT_CROSSHOST_TEST_RDMA_DEVICES_DIR";
/// The wheel's libucp, in its library directory.
const WHEEL_LIBUCP: &str = "libucp.so";

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
    /// Why this one was taken (the explicit option, or the choice among the
    /// candidates found: `choose`).
    pub why: String,
}

static LOADED: OnceCell<std::result::Result<LoadedUcx, String>> = OnceCell::new();
/// The explicit path the first load used, so a later client asking for
/// another one hears that UCX is already loaded.
static EXPLICIT: Mutex<Option<String>> = Mutex::new(None);

/// libucp, loaded on first use (`explicit`: the `ucx_library` option), for
/// a client without CUDA devices. FAILED_PRECONDITION naming every place it
/// looked when there is none.
pub fn load(explicit: Option<&str>) -> Result<LoadedUcx> {
    load_for(explicit, false)
}

/// `load`, for a client that has CUDA devices when `cuda_client` (a UCX with
/// CUDA transports is then preferred). The first call in the process
/// decides; later ones get the same library.
pub fn load_for(explicit: Option<&str>, cuda_client: bool) -> Result<LoadedUcx> {
    let loaded = LOADED.get_or_init(|| {
        let explicit = explicit.map(str::to_string).or_else(|| {
            std::env::var(UCX_LIBRARY_ENV)
                .ok()
                .filter(|p| !p.is_empty())
        });
        *EXPLICIT.lock() = explicit.clone();
        load_first(explicit.as_deref(), cuda_client)
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

fn load_first(explicit: Option<&str>, cuda_client: bool) -> std::result::Result<LoadedUcx, String> {
    prepare_environment();
    if let Some(path) = explicit {
        let mut loaded = open(Path::new(path)).map_err(|e| {
            format!("UCX: the libucp named by ucx_library / ${UCX_LIBRARY_ENV} ({path}) does not load: {e}")
        })?;
        loaded.why =
            format!("named by ucx_library / ${UCX_LIBRARY_ENV} (an explicit choice always wins)");
        log::info!(
            "UCX {} loaded from {}: {}",
            loaded.version,
            loaded.path,
            loaded.why
        );
        return Ok(loaded);
    }
    let survey = survey(cuda_client);
    let mut tried = vec![format!("ucx_library and ${UCX_LIBRARY_ENV}: not set")];
    tried.extend(survey.absent.iter().cloned());
    let mut refused = false;
    match choose(&survey.candidates, &survey.needs) {
        Ok(choice) => {
            for &index in &choice.order {
                let candidate = &survey.candidates[index];
                match open(Path::new(&candidate.path)) {
                    Ok(mut loaded) => {
                        loaded.why = choice.why.clone();
                        log::info!(
                            "UCX {} loaded from {}: {}",
                            loaded.version,
                            loaded.path,
                            loaded.why
                        );
                        return Ok(loaded);
                    }
                    Err(e) => {
                        refused |= e.contains("which is not used");
                        tried.push(format!("{}: {e}", candidate.name()));
                    }
                }
            }
        }
        Err(why) => {
            refused = survey.candidates.iter().any(|c| c.version.is_ok());
            tried.push(why);
        }
    }
    let why = format!(
        "UCX (libucp) is not available; looked at: {}",
        tried.join("; ")
    );
    // Said once per process (this runs once): the job still works, slower.
    if refused {
        log::warn!("{why}; {NEWER_UCX}");
    }
    Err(why)
}

/// Where a candidate libucp was found. The order is the default order of
/// the choice: the wheel first (its UCX is newer and carries CUDA
/// transports), then the system's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// The `libucx` wheel's directory, `$PJRT_CROSSHOST_UCX_WHEEL_LIB`.
    Wheel,
    /// `libucp.so.0` where the dynamic loader finds it.
    System,
}

/// One libucp found, and what it can do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub source: Source,
    /// The file (resolved by the loader for the system's).
    pub path: String,
    /// `major.minor.release`, read in a namespace of its own (`probe`), or
    /// why it could not be read.
    pub version: std::result::Result<(u32, u32, u32), String>,
    /// UCX's verbs module is installed beside it (`ucx/libuct_ib*.so`: the
    /// rc, ud and dc transports over RDMA devices).
    pub verbs: bool,
    /// UCX's CUDA module is installed beside it (`ucx/libuct_cuda*.so`:
    /// cuda_copy, cuda_ipc).
    pub cuda: bool,
}

impl Candidate {
    /// "the system's libucp.so.0 (/usr/lib/x86_64-linux-gnu/libucp.so.0, UCX 1.13.1)".
    pub fn name(&self) -> String {
        let source = match self.source {
            Source::Wheel => "the libucx wheel's libucp",
            Source::System => "the system's libucp.so.0",
        };
        match &self.version {
            Ok((major, minor, release)) => {
                format!("{source} ({}, UCX {major}.{minor}.{release})", self.path)
            }
            Err(_) => format!("{source} ({}, version unknown)", self.path),
        }
    }
}

/// What the client and the host could use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// This host's RDMA devices (`/sys/class/infiniband`).
    pub rdma_devices: Vec<String>,
    /// The client has CUDA devices.
    pub cuda_client: bool,
}

/// The candidates to try, in order, and why the first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// Indices into the candidates.
    pub order: Vec<usize>,
    pub why: String,
}

/// Picks among `candidates` (in the default order, `Source`'s) by what each
/// can do here: refused below `MINIMUM_VERSION`; then one with verbs
/// transports over one without when the host has RDMA devices; then one
/// with CUDA transports over one without when the client has CUDA devices;
/// then the default order. When a version could not be read, only the
/// default order is kept (a UCX loaded and then refused would leave its
/// libraries for the next one to bind to). `Err`: none usable, and why.
pub fn choose(candidates: &[Candidate], needs: &Needs) -> std::result::Result<Choice, String> {
    let mut refused = Vec::new();
    let mut unread = Vec::new();
    let mut usable = Vec::new();
    for (index, candidate) in candidates.iter().enumerate() {
        match &candidate.version {
            Ok((major, minor, release)) => {
                if check_version(&candidate.path, *major, *minor, *release).is_ok() {
                    usable.push(index);
                } else {
                    refused.push(format!(
                        "{} is older than UCX {}.{}, not used",
                        candidate.name(),
                        MINIMUM_VERSION.0,
                        MINIMUM_VERSION.1
                    ));
                }
            }
            Err(e) => {
                usable.push(index);
                unread.push(format!("{}: {e}", candidate.name()));
            }
        }
    }
    let refused_note = if refused.is_empty() {
        String::new()
    } else {
        format!("; {}", refused.join("; "))
    };
    let Some(&first) = usable.first() else {
        return Err(if refused.is_empty() {
            "no libucp found".to_string()
        } else {
            refused.join("; ")
        });
    };
    if !unread.is_empty() {
        return Ok(Choice {
            why: format!(
                "{}: first in the default order (the libucx wheel's, then the system's), as \
                 the version of {} could not be read{refused_note}",
                candidates[first].name(),
                unread.join("; ")
            ),
            order: usable,
        });
    }
    let rdma = |i: usize| candidates[i].verbs && !needs.rdma_devices.is_empty();
    let cuda = |i: usize| candidates[i].cuda && needs.cuda_client;
    usable.sort_by_key(|&i| (!rdma(i), !cuda(i), candidates[i].source, i));
    let first = usable[0];
    let others = &usable[1..];
    let lacking = |has: &dyn Fn(usize) -> bool| {
        others
            .iter()
            .filter(|&&i| !has(i))
            .map(|&i| candidates[i].name())
            .collect::<Vec<_>>()
            .join(" and ")
    };
    let reason = if others.is_empty() {
        "the only usable one found".to_string()
    } else if rdma(first) && others.iter().any(|&i| !rdma(i)) {
        format!(
            "it has verbs transports (rc, ud, dc) for this host's RDMA devices ({}), which {} lacks",
            needs.rdma_devices.join(", "),
            lacking(&rdma)
        )
    } else if cuda(first) && others.iter().any(|&i| !cuda(i)) {
        format!(
            "it has CUDA transports (cuda_copy, cuda_ipc) for this client's CUDA devices, which {} lacks",
            lacking(&cuda)
        )
    } else {
        let rdma_note = if needs.rdma_devices.is_empty() {
            "no RDMA device on this host"
        } else if rdma(first) {
            "every one has verbs transports"
        } else {
            "none has verbs transports"
        };
        let cuda_note = if !needs.cuda_client {
            "no CUDA device in this client"
        } else if cuda(first) {
            "every one has CUDA transports"
        } else {
            "none has CUDA transports"
        };
        format!(
            "first in the default order (the libucx wheel's, then the system's); the others \
             can do no more here ({rdma_note}, {cuda_note})"
        )
    };
    Ok(Choice {
        why: format!("{}: {reason}{refused_note}", candidates[first].name()),
        order: usable,
    })
}

/// The candidates found, what this host and client could use, and the
/// places that had none.
#[derive(Clone, Debug, Default)]
pub struct Survey {
    pub candidates: Vec<Candidate>,
    pub needs: Needs,
    pub absent: Vec<String>,
}

/// Finds the candidates (`ucx_library` aside) and what each can do,
/// loading none of them into this process's namespace.
pub fn survey(cuda_client: bool) -> Survey {
    prepare_environment();
    let mut survey = Survey {
        needs: Needs {
            rdma_devices: rdma_devices(),
            cuda_client,
        },
        ..Survey::default()
    };
    match std::env::var(UCX_WHEEL_ENV).ok().filter(|p| !p.is_empty()) {
        Some(dir) => {
            let path = PathBuf::from(&dir).join(WHEEL_LIBUCP);
            if path.is_file() {
                survey.add(Source::Wheel, &path, probe(&path));
            } else {
                survey.absent.push(format!(
                    "the libucx wheel ({}): no such file",
                    path.display()
                ));
            }
        }
        None => survey.absent.push(format!(
            "the libucx wheel: ${UCX_WHEEL_ENV} not set (jax_plugins.crosshost sets it when `pip install libucx-cu12` is present)"
        )),
    }
    survey.add(
        Source::System,
        Path::new(SYSTEM_LIBUCP),
        probe(Path::new(SYSTEM_LIBUCP)),
    );
    survey
}

impl Survey {
    /// A probed candidate: found (its version read, or not, when only the
    /// namespace failed), or absent (it does not load: not there, not a
    /// library) with why.
    fn add(
        &mut self,
        source: Source,
        path: &Path,
        probed: std::result::Result<(String, (u32, u32, u32)), String>,
    ) {
        match probed {
            Ok((file, version)) => {
                self.candidates
                    .push(describe(source, Path::new(&file), Ok(version)))
            }
            // The library may load in the process's own namespace: tried by
            // name, in the default order.
            Err(e) if namespace_failed(&e) => self.candidates.push(describe(source, path, Err(e))),
            Err(e) => self.absent.push(match source {
                Source::Wheel => format!("the libucx wheel ({}): {e}", path.display()),
                Source::System => {
                    format!("the system's {SYSTEM_LIBUCP} (Debian/Ubuntu package libucx0): {e}")
                }
            }),
        }
    }
}

/// Whether a probe failed for want of a namespace (or of static TLS in
/// one), not because of the library.
fn namespace_failed(error: &str) -> bool {
    error.contains("static TLS") || error.contains("namespace")
}

fn describe(
    source: Source,
    path: &Path,
    version: std::result::Result<(u32, u32, u32), String>,
) -> Candidate {
    let modules: Vec<String> = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .and_then(|dir| std::fs::read_dir(dir.join("ucx")).ok())
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    let has = |prefix: &str| {
        modules
            .iter()
            .any(|m| m.starts_with(prefix) && m.contains(".so"))
    };
    Candidate {
        source,
        path: path.display().to_string(),
        version,
        verbs: has("libuct_ib"),
        cuda: has("libuct_cuda"),
    }
}

/// The host's RDMA devices, by name.
pub fn rdma_devices() -> Vec<String> {
    let dir = std::env::var(RDMA_DEVICES_DIR_ENV)
        .ok()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| RDMA_DEVICES_DIR.to_string());
    let mut devices: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    devices.sort();
    devices
}

/// The file and the version of the libucp at `path` (a bare soname goes
/// through the loader's search), read in a new link-map namespace
/// (`dlmopen`): nothing of it binds to what this process has loaded, or
/// will load, and its constructors run with the environment prepared
/// above. The namespace stays (never unloaded, like UCX itself); a process
/// makes at most two, once.
fn probe(path: &Path) -> std::result::Result<(String, (u32, u32, u32)), String> {
    let mut namespace = libc::LM_ID_NEWLM;
    let mut open_in_namespace = |file: &Path| -> std::result::Result<*mut libc::c_void, String> {
        let name = CString::new(file.as_os_str().as_bytes())
            .map_err(|_| format!("{}: a NUL in the path", file.display()))?;
        // SAFETY: a NUL-terminated path; the library is loaded into a
        // namespace of its own, where only UCX's libraries and their
        // dependencies live, and its constructors read the environment
        // prepared before (no signal handlers, no allocator hooks).
        let handle =
            unsafe { libc::dlmopen(namespace, name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dl_error());
        }
        if namespace == libc::LM_ID_NEWLM {
            let mut id: libc::Lmid_t = 0;
            // SAFETY: a live handle and an out-pointer of the type
            // RTLD_DI_LMID writes.
            if unsafe {
                libc::dlinfo(
                    handle,
                    libc::RTLD_DI_LMID,
                    (&mut id as *mut libc::Lmid_t).cast(),
                )
            } != 0
            {
                return Err(dl_error());
            }
            namespace = id;
        }
        Ok(handle)
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // The wheel's parts find each other only when loaded in dependency
        // order (see `open`).
        for sibling in ["libucs.so", "libucs_signal.so", "libuct.so"] {
            let candidate = dir.join(sibling);
            if candidate.is_file() {
                open_in_namespace(&candidate)?;
            }
        }
    }
    let handle = open_in_namespace(path)?;
    // SAFETY: a live handle and a NUL-terminated symbol name.
    let symbol = unsafe { libc::dlsym(handle, c"ucp_get_version".as_ptr()) };
    if symbol.is_null() {
        return Err(format!(
            "{}: no ucp_get_version: {}",
            path.display(),
            dl_error()
        ));
    }
    // SAFETY: libucp's `void ucp_get_version(unsigned*, unsigned*, unsigned*)`.
    let get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint) =
        unsafe { std::mem::transmute(symbol) };
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    unsafe { get_version(&mut major, &mut minor, &mut release) };
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: an address inside the library just loaded, and an out-pointer.
    let found = unsafe { libc::dladdr(symbol, info.as_mut_ptr()) } != 0;
    // SAFETY: dladdr filled the struct when it answered non-zero.
    let file = unsafe { info.assume_init() }.dli_fname;
    let file = if found && !file.is_null() {
        // SAFETY: a NUL-terminated name owned by the loader, alive while the
        // library is (for good).
        unsafe { CStr::from_ptr(file) }
            .to_string_lossy()
            .into_owned()
    } else {
        path.display().to_string()
    };
    Ok((file, (major, minor, release)))
}

/// The dynamic loader's last error.
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message of this thread.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        return "the dynamic loader gave no reason".into();
    }
    // SAFETY: non-null, NUL-terminated.
    unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned()
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
    Ok(LoadedUcx {
        api: Arc::new(api),
        path: path.display().to_string(),
        version,
        why: String::new(),
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

    fn candidate(source: Source, version: (u32, u32, u32), verbs: bool, cuda: bool) -> Candidate {
        Candidate {
            source,
            path: match source {
                Source::Wheel => "/site-packages/libucx/lib/libucp.so".into(),
                Source::System => "/usr/lib/libucp.so.0".into(),
            },
            version: Ok(version),
            verbs,
            cuda,
        }
    }

    fn needs(rdma: &[&str], cuda_client: bool) -> Needs {
        Needs {
            rdma_devices: rdma.iter().map(|d| d.to_string()).collect(),
            cuda_client,
        }
    }

    /// What `choose` makes of `candidates` for `needs`, which must be to try
    /// them in `order`.
    #[track_caller]
    fn chosen(candidates: &[Candidate], needs: &Needs, order: &[usize]) -> Choice {
        let choice = choose(candidates, needs).unwrap();
        assert_eq!(choice.order, order);
        choice
    }

    /// `choice.why` says `words` (all of it is shown where it does not).
    #[track_caller]
    fn says(choice: &Choice, words: &str) {
        assert!(choice.why.contains(words), "{}", choice.why);
    }

    /// The wheel as pip ships it (CUDA, no verbs) and an HPC system UCX
    /// (verbs, no CUDA).
    fn wheel_and_system() -> Vec<Candidate> {
        vec![
            candidate(Source::Wheel, (1, 22, 0), false, true),
            candidate(Source::System, (1, 16, 0), true, false),
        ]
    }

    #[test]
    fn verbs_win_where_the_host_has_rdma_devices() {
        let choice = chosen(&wheel_and_system(), &needs(&["mlx5_0"], false), &[1, 0]);
        assert!(
            choice.why.starts_with("the system's libucp.so.0"),
            "{}",
            choice.why
        );
        says(&choice, "verbs transports (rc, ud, dc)");
        says(&choice, "mlx5_0");
        says(&choice, "the libucx wheel's libucp");
        // Even for a client with CUDA devices: RDMA to other hosts first.
        chosen(&wheel_and_system(), &needs(&["mlx5_0"], true), &[1, 0]);
    }

    #[test]
    fn without_rdma_devices_a_verbs_module_counts_for_nothing() {
        let choice = chosen(&wheel_and_system(), &needs(&[], false), &[0, 1]);
        says(&choice, "first in the default order");
        says(&choice, "no RDMA device on this host");
    }

    #[test]
    fn cuda_transports_win_for_a_client_with_cuda_devices() {
        let system_first = vec![
            candidate(Source::Wheel, (1, 22, 0), false, false),
            candidate(Source::System, (1, 16, 0), false, true),
        ];
        let choice = chosen(&system_first, &needs(&[], true), &[1, 0]);
        says(&choice, "CUDA transports (cuda_copy, cuda_ipc)");
        // A client without CUDA devices keeps the default order.
        chosen(&system_first, &needs(&[], false), &[0, 1]);
        // Both with verbs on an RDMA host: CUDA decides between them.
        let both_verbs = vec![
            candidate(Source::Wheel, (1, 22, 0), true, false),
            candidate(Source::System, (1, 16, 0), true, true),
        ];
        let choice = chosen(&both_verbs, &needs(&["mlx5_0"], true), &[1, 0]);
        says(&choice, "CUDA transports");
    }

    #[test]
    fn a_ucx_older_than_1_14_is_never_chosen_whatever_it_can_do() {
        let old_system = vec![
            candidate(Source::Wheel, (1, 22, 0), false, true),
            candidate(Source::System, (1, 13, 1), true, true),
        ];
        let choice = chosen(&old_system, &needs(&["mlx5_0"], true), &[0]);
        says(&choice, "the only usable one");
        says(&choice, "UCX 1.13.1) is older than UCX 1.14, not used");
        let only_old = vec![candidate(Source::System, (1, 13, 1), true, false)];
        let none = choose(&only_old, &needs(&[], false)).unwrap_err();
        assert!(
            none.contains("1.13.1") && none.contains("not used"),
            "{none}"
        );
        assert_eq!(
            choose(&[], &needs(&[], false)).unwrap_err(),
            "no libucp found"
        );
    }

    #[test]
    fn a_version_that_could_not_be_read_keeps_the_default_order() {
        let mut unread = wheel_and_system();
        unread[1].version = Err("cannot allocate memory in static TLS block".into());
        let choice = chosen(&unread, &needs(&["mlx5_0"], false), &[0, 1]);
        says(&choice, "could not be read");
        says(&choice, "static TLS");
    }

    #[test]
    fn a_candidate_is_described_by_the_modules_installed_beside_it() {
        let dir =
            std::env::temp_dir().join(format!("crosshost-ucx-modules-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("ucx")).unwrap();
        for module in ["libuct_ib.so.0", "libuct_cma.so"] {
            std::fs::write(dir.join("ucx").join(module), b"").unwrap();
        }
        let described = describe(Source::Wheel, &dir.join("libucp.so"), Ok((1, 22, 0)));
        assert!(described.verbs && !described.cuda, "{described:?}");
        std::fs::write(dir.join("ucx").join("libuct_cuda.so"), b"").unwrap();
        assert!(describe(Source::Wheel, &dir.join("libucp.so"), Ok((1, 22, 0))).cuda);
        let bare = describe(Source::System, Path::new(SYSTEM_LIBUCP), Err("x".into()));
        assert!(!bare.verbs && !bare.cuda);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
