//! What the loaded UCX can do on this host: the transports and devices a
//! UCP context finds here (`ucp_context_print_info`, what `ucx_info -d`
//! lists) and the memory types it handles (`ucp_context_query`). The
//! doctor shows them; the data plane does not need them (UCX picks its
//! lanes per peer itself).
//!
//! The two functions are not part of `UcpApi`: they are resolved here from
//! the library already loaded (`RTLD_NOLOAD`), for this one use.
use std::ffi::{c_char, c_int};
use std::io::{Read, Seek};
use std::os::fd::FromRawFd;

use libloading::os::unix::{Library as UnixLibrary, RTLD_NOW};

use super::library::LoadedUcx;
use super::sys::{ucp_context_h, ucs_status_t, UCP_FEATURE_AM, UCS_OK};
use crate::status::{failed_precondition, Result};

/// `UCP_ATTR_FIELD_MEMORY_TYPES`.
const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;
/// `UCP_ENTITY_NAME_MAX`.
const UCP_ENTITY_NAME_MAX: usize = 32;

/// `ucp_context_attr_t` (UCX 1.13 and later; extended by appending only).
#[repr(C)]
struct ucp_context_attr_t {
    field_mask: u64,
    request_size: usize,
    thread_mode: c_int,
    memory_types: u64,
    name: [c_char; UCP_ENTITY_NAME_MAX],
}

/// `ucs_memory_type_t` bits, in UCX's order (stable from 1.13 on for these).
const MEMORY_TYPES: [&str; 5] = ["host", "cuda", "cuda-managed", "rocm", "rocm-managed"];

/// Transports that move bytes over RDMA devices (verbs; EFA's srd).
const RDMA_PREFIXES: [&str; 4] = ["rc", "ud", "dc", "srd"];
/// Transports that move CUDA memory.
const CUDA_TRANSPORTS: [&str; 3] = ["cuda_copy", "cuda_ipc", "gdr_copy"];

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// `(transport, device)` of each resource, as UCX names them
    /// (`tcp`/`eth0`, `rc_mlx5`/`mlx5_0:1`, `cuda_copy`/`cuda`).
    pub resources: Vec<(String, String)>,
    /// The memory types the context handles (`host`, `cuda`, ...).
    pub memory_types: Vec<String>,
}

impl Capabilities {
    /// Each transport once, in UCX's order.
    pub fn transports(&self) -> Vec<String> {
        let mut seen = Vec::new();
        for (transport, _) in &self.resources {
            if !seen.contains(transport) {
                seen.push(transport.clone());
            }
        }
        seen
    }

    /// The RDMA transports among them (rc_verbs, rc_mlx5, ud_*, dc_mlx5, srd).
    pub fn rdma(&self) -> Vec<String> {
        self.transports()
            .into_iter()
            .filter(|t| {
                RDMA_PREFIXES
                    .iter()
                    .any(|p| t == p || t.starts_with(&format!("{p}_")))
            })
            .collect()
    }

    /// The CUDA transports among them.
    pub fn cuda(&self) -> Vec<String> {
        self.transports()
            .into_iter()
            .filter(|t| CUDA_TRANSPORTS.contains(&t.as_str()))
            .collect()
    }

    /// Reads `ucp_context_print_info`'s resource lines:
    /// `#      resource 1  :  md 1  dev 1  flags -- tcp/eth0`.
    pub fn parse_resources(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter(|line| line.contains(" resource ") && line.contains("--"))
            .filter_map(|line| {
                let name = line.rsplit("--").next()?.trim();
                let (transport, device) = name.split_once('/')?;
                Some((transport.to_string(), device.to_string()))
            })
            .collect()
    }
}

type PrintInfo = unsafe extern "C" fn(ucp_context_h, *mut libc::FILE);
type ContextQuery = unsafe extern "C" fn(ucp_context_h, *mut ucp_context_attr_t) -> ucs_status_t;

/// Makes a UCP context with the loaded library, reads what it found, and
/// drops it.
pub fn query(loaded: &LoadedUcx) -> Result<Capabilities> {
    let api = &loaded.api;
    // SAFETY: the library is loaded already (NOLOAD only finds it); opening
    // it again runs no constructor and keeps it loaded, as it is anyway.
    let library = unsafe { UnixLibrary::open(Some(&loaded.path), RTLD_NOW | libc::RTLD_NOLOAD) }
        .map_err(|e| failed_precondition(format!("UCX at {}: {e}", loaded.path)))?;
    // SAFETY: UCP's C API: `void ucp_context_print_info(const ucp_context_h, FILE*)`.
    let print_info: PrintInfo =
        *unsafe { library.get::<PrintInfo>(b"ucp_context_print_info\0") }
            .map_err(|e| failed_precondition(format!("UCX at {}: {e}", loaded.path)))?;
    // SAFETY: UCP's C API: `ucs_status_t ucp_context_query(ucp_context_h, ucp_context_attr_t*)`.
    let context_query: ContextQuery =
        *unsafe { library.get::<ContextQuery>(b"ucp_context_query\0") }
            .map_err(|e| failed_precondition(format!("UCX at {}: {e}", loaded.path)))?;
    let context = api
        .init_context(parse_major_minor(&loaded.version), UCP_FEATURE_AM, None)
        .map_err(|(call, status)| {
            failed_precondition(format!("UCX: {call}: {}", api.describe(status)))
        })?;
    let printed = print_to_string(|file| {
        // SAFETY: a live context and an open stream.
        unsafe { print_info(context, file) }
    });
    // SAFETY: an all-zero attr is valid (field_mask says what to fill).
    let mut attr: ucp_context_attr_t = unsafe { std::mem::zeroed() };
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    // SAFETY: a live context and an attr whose mask names one field.
    let queried = unsafe { context_query(context, &mut attr) } == UCS_OK;
    // SAFETY: the context made above, no worker on it, cleaned up once.
    unsafe { (api.cleanup)(context) };
    let memory_types = if queried {
        MEMORY_TYPES
            .iter()
            .enumerate()
            .filter(|(bit, _)| attr.memory_types & (1 << bit) != 0)
            .map(|(_, name)| name.to_string())
            .collect()
    } else {
        Vec::new()
    };
    Ok(Capabilities {
        resources: Capabilities::parse_resources(&printed?),
        memory_types,
    })
}

fn parse_major_minor(version: &str) -> (u32, u32) {
    let mut parts = version.split('.').map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(1), parts.next().unwrap_or(0))
}

/// What `write` prints to a `FILE*`, read back (a pipe would fill up; an
/// unlinked temporary file does not).
fn print_to_string(write: impl FnOnce(*mut libc::FILE)) -> Result<String> {
    // SAFETY: tmpfile returns NULL or a stream we own.
    let file = unsafe { libc::tmpfile() };
    if file.is_null() {
        return Err(failed_precondition(format!(
            "UCX: no temporary file for ucp_context_print_info: {}",
            std::io::Error::last_os_error()
        )));
    }
    write(file);
    // SAFETY: the stream from tmpfile, still open.
    let fd = unsafe {
        libc::fflush(file);
        libc::dup(libc::fileno(file))
    };
    // SAFETY: the stream from tmpfile, closed once (its fd's duplicate stays).
    unsafe { libc::fclose(file) };
    if fd < 0 {
        return Err(failed_precondition(format!(
            "UCX: dup: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: a descriptor this function owns from dup.
    let mut copy = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut text = String::new();
    copy.seek(std::io::SeekFrom::Start(0))
        .and_then(|_| copy.read_to_string(&mut text))
        .map_err(|e| failed_precondition(format!("UCX: reading its printed info: {e}")))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_are_read_from_the_printed_context() {
        let printed = "#\n# UCP context\n#\n#            md 1  :  component 1  tcp \n\
                       #      resource 0  :  md 0  dev 0  flags -- self/memory\n\
                       #      resource 1  :  md 1  dev 1  flags -- tcp/eth0\n\
                       #      resource 2  :  md 1  dev 2  flags -- tcp/lo\n\
                       #      resource 3  :  md 4  dev 3  flags -- rc_mlx5/mlx5_0:1\n\
                       #      resource 4  :  md 4  dev 3  flags -- ud_verbs/mlx5_0:1\n\
                       #      resource 5  :  md 5  dev 4  flags -- cuda_copy/cuda\n\
                       #      resource 6  :  md 2  dev 0  flags -- sysv/memory\n";
        let found = Capabilities {
            resources: Capabilities::parse_resources(printed),
            memory_types: vec!["host".into(), "cuda".into()],
        };
        assert_eq!(found.resources[1], ("tcp".into(), "eth0".into()));
        assert_eq!(
            found.transports(),
            ["self", "tcp", "rc_mlx5", "ud_verbs", "cuda_copy", "sysv"]
        );
        assert_eq!(found.rdma(), ["rc_mlx5", "ud_verbs"]);
        assert_eq!(found.cuda(), ["cuda_copy"]);
        let tcp_only = Capabilities {
            resources: Capabilities::parse_resources(
                "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0\n",
            ),
            memory_types: vec![],
        };
        assert!(tcp_only.rdma().is_empty() && tcp_only.cuda().is_empty());
    }
}
