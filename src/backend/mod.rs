//! Device memory. The host backend is always available; a CUDA backend is
//! loaded dynamically where a driver exists.
//!
//! A `Backend` owns a process's devices of one kind: it names them, describes
//! them and allocates their memory. The client picks one at creation
//! (`backend=auto|host|cuda`, see `select`).
pub mod cuda;
pub mod host;

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use crate::pjrt::named_values::NamedValue;
use crate::status::{self, Result};

/// Per-device allocation statistics reported by `PJRT_Device_MemoryStats`.
#[derive(Default, Debug)]
pub struct MemoryCounters {
    bytes_in_use: AtomicI64,
    peak_bytes_in_use: AtomicI64,
    num_allocs: AtomicI64,
    largest_alloc: AtomicI64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: i64,
    pub num_allocs: i64,
    pub largest_alloc_size: i64,
}

impl MemoryCounters {
    pub fn allocated(&self, bytes: usize) {
        let bytes = bytes as i64;
        let now = self.bytes_in_use.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes_in_use.fetch_max(now, Ordering::Relaxed);
        self.num_allocs.fetch_add(1, Ordering::Relaxed);
        self.largest_alloc.fetch_max(bytes, Ordering::Relaxed);
    }

    pub fn freed(&self, bytes: usize) {
        self.bytes_in_use.fetch_sub(bytes as i64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MemoryStats {
        MemoryStats {
            bytes_in_use: self.bytes_in_use.load(Ordering::Relaxed),
            peak_bytes_in_use: self.peak_bytes_in_use.load(Ordering::Relaxed),
            num_allocs: self.num_allocs.load(Ordering::Relaxed),
            largest_alloc_size: self.largest_alloc.load(Ordering::Relaxed),
        }
    }
}

/// One device allocation. Reads and writes are bounds-checked; the owner
/// (a buffer) orders them through its definition event.
pub trait DeviceMemory: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` into the allocation starting at `offset`.
    fn write(&self, offset: usize, src: &[u8]) -> Result<()>;
    /// Lends the whole contents as a host slice for the duration of `f`:
    /// host memory lends itself without a copy, device memory stages.
    fn read_with(&self, f: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let mut staging = vec![0u8; self.len()];
        self.read(0, &mut staging)?;
        f(&staging)
    }
    /// The address a framework may read directly (host memory) or the device
    /// address (GPU memory); stable for the allocation's lifetime.
    fn address(&self) -> usize;
    /// Where the whole contents can be read in place, without a copy: the
    /// address of `len()` bytes of host memory that stay valid while the
    /// allocation lives and, once it is defined, unwritten. `None` where
    /// reading needs a copy (device memory, a layout conversion).
    fn host_pointer(&self) -> Result<Option<usize>> {
        Ok(self.is_host_memory().then(|| self.address()))
    }
    /// True when `address()` is host-addressable memory.
    fn is_host_memory(&self) -> bool;
    /// Whether `read` is a plain memory copy that never waits on another
    /// thread (a device copy or a compute plugin's read-back may), so it
    /// can run on any thread, however latency-sensitive.
    fn reads_without_waiting(&self) -> bool {
        self.is_host_memory()
    }
    /// Shared-memory name under which another process on this host can map
    /// the allocation, if it is backed by shared memory.
    fn shared_name(&self) -> Option<String> {
        None
    }
    /// The CUDA allocation behind this memory, if it is one (device-to-device
    /// copies and IPC export need the device pointer and its device).
    fn as_cuda(&self) -> Option<&cuda::CudaMemory> {
        None
    }
}

pub type Allocation = Arc<dyn DeviceMemory>;

/// Free and total bytes of a device, as its driver reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverMemoryInfo {
    pub free_bytes: usize,
    pub total_bytes: usize,
}

/// The devices of one kind in this process and their memory.
///
/// `index` is the device's local index (`0..device_count()`), which is also
/// its local hardware id.
pub trait Backend: Send + Sync + fmt::Debug {
    /// `"host"` or `"cuda"`.
    fn name(&self) -> &'static str;
    /// True when allocations are host-addressable memory.
    fn is_host(&self) -> bool;
    fn device_count(&self) -> usize;
    /// The device kind PJRT reports (the GPU's name on CUDA).
    fn device_kind(&self, index: usize) -> String;
    /// Extra description attributes (compute capability, memory size...).
    fn device_attributes(&self, index: usize) -> Vec<(String, NamedValue)>;
    /// A zero-initialised (host) or uninitialised-but-owned (device)
    /// allocation of `bytes` on device `index`, counted in `counters`.
    fn allocate(
        &self,
        index: usize,
        bytes: usize,
        counters: Arc<MemoryCounters>,
    ) -> Result<Allocation>;
    /// Copies all of `src` into `dst` (same length). The default stages
    /// through host memory; backends override it with a device copy.
    fn copy(&self, src: &dyn DeviceMemory, dst: &dyn DeviceMemory) -> Result<()> {
        if src.len() != dst.len() {
            return Err(status::invalid_argument(format!(
                "copy of a {}-byte allocation into a {}-byte one",
                src.len(),
                dst.len()
            )));
        }
        src.read_with(&mut |bytes| dst.write(0, bytes))
    }
    /// The driver's view of the device's memory, where there is a driver.
    fn memory_info(&self, _index: usize) -> Option<DriverMemoryInfo> {
        None
    }
}

/// Which backend a client asked for (`backend` create option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a driver and at least one device are present, else host.
    Auto,
    /// Host memory, `num_devices` devices. The default: the host-only tests
    /// and tools (two devices, host addresses) must not change behaviour just
    /// because they run on a GPU machine.
    #[default]
    Host,
    /// CUDA, or an error at client creation when it is unavailable.
    Cuda,
}

impl BackendChoice {
    pub fn parse(text: &str) -> Option<BackendChoice> {
        match text {
            "auto" => Some(BackendChoice::Auto),
            "host" => Some(BackendChoice::Host),
            "cuda" => Some(BackendChoice::Cuda),
            _ => None,
        }
    }
}

/// Picks the backend for a client. `host_devices` is the device count of the
/// host backend (the CUDA backend has the devices the driver shows, as
/// narrowed by `CUDA_VISIBLE_DEVICES`).
pub fn select(choice: BackendChoice, host_devices: usize) -> Result<Arc<dyn Backend>> {
    match choice {
        BackendChoice::Host => Ok(Arc::new(host::HostBackend::new(host_devices))),
        BackendChoice::Cuda => {
            let backend: Arc<dyn Backend> = cuda::CudaBackend::get().map_err(|reason| {
                status::failed_precondition(format!(
                    "PJRT_Client_Create: backend=cuda was requested but CUDA is unavailable: {}",
                    reason.message
                ))
            })?;
            Ok(backend)
        }
        BackendChoice::Auto => match cuda::CudaBackend::get() {
            Ok(backend) => Ok(backend as Arc<dyn Backend>),
            Err(reason) => {
                log::info!("backend=auto: using the host backend ({})", reason.message);
                Ok(Arc::new(host::HostBackend::new(host_devices)))
            }
        },
    }
}

/// Where one addressable device's memory comes from: its backend, its index
/// there, and its allocation counters.
#[derive(Clone, Debug)]
pub struct DevicePlacement {
    pub backend: Arc<dyn Backend>,
    pub index: usize,
    pub counters: Arc<MemoryCounters>,
}

impl DevicePlacement {
    pub fn allocate(&self, bytes: usize) -> Result<Allocation> {
        self.backend
            .allocate(self.index, bytes, self.counters.clone())
    }

    pub fn is_host(&self) -> bool {
        self.backend.is_host()
    }
}
