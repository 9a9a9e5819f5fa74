//! Which of our handles wraps a given compute-plugin device or memory: for
//! outputs of forwarded calls (a buffer's device, an executable's devices).
use super::*;

/// The compute plugin's device → (our handle's address, the delegating client
/// that owns it).
pub(super) type ComputeDeviceMap = HashMap<InnerPtr, (usize, Weak<Client>)>;

/// The compute plugin's device and memory handles → ours, for outputs of
/// forwarded calls (a buffer's device, an executable's devices).
pub(super) static COMPUTE_DEVICES: Lazy<RwLock<ComputeDeviceMap>> = Lazy::new(Default::default);
pub(super) static COMPUTE_MEMORIES: Lazy<RwLock<HashMap<InnerPtr, usize>>> =
    Lazy::new(Default::default);

/// Our device handle wrapping the compute plugin's `inner`, if any.
pub(crate) fn device_of_compute(inner: *mut PJRT_Device) -> Option<*mut PJRT_Device> {
    COMPUTE_DEVICES
        .read()
        .get(&InnerPtr::from(inner))
        .map(|(p, _)| *p as *mut PJRT_Device)
}

/// The delegating client that owns the compute plugin's device `inner`.
pub(crate) fn client_of_compute_device(inner: *mut PJRT_Device) -> Option<Arc<Client>> {
    COMPUTE_DEVICES
        .read()
        .get(&InnerPtr::from(inner))
        .and_then(|(_, client)| client.upgrade())
}

/// Our memory handle wrapping the compute plugin's `inner`, if any.
pub(crate) fn memory_of_compute(inner: *mut PJRT_Memory) -> Option<*mut PJRT_Memory> {
    COMPUTE_MEMORIES
        .read()
        .get(&InnerPtr::from(inner))
        .map(|&p| p as *mut PJRT_Memory)
}
