//! Device and device-description handles.
use super::*;

#[repr(C)]
pub(crate) struct DeviceHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub description: DescriptionHandle,
    default_memory: *mut PJRT_Memory,
    pub memories: PtrList<PJRT_Memory>,
}
castable!(
    DeviceHandle,
    PJRT_Device,
    Borrowed,
    DEVICE_TAG,
    "PJRT_Device"
);

// SAFETY: the memory pointers point into the same ClientTables, which is
// immutable after construction; `Device` is Sync.
unsafe impl Send for DeviceHandle {}
// SAFETY: as above.
unsafe impl Sync for DeviceHandle {}

impl DeviceHandle {
    pub(super) fn new(
        device: Arc<Device>,
        default_memory: *mut PJRT_Memory,
        memories: PtrList<PJRT_Memory>,
    ) -> Box<DeviceHandle> {
        Box::new(DeviceHandle {
            tag: Self::TAG,
            description: DescriptionHandle::new(device.clone()),
            device,
            default_memory,
            memories,
        })
    }

    pub fn memory_ptr(&self) -> *mut PJRT_Memory {
        self.default_memory
    }

    pub fn description_ptr(&self) -> *mut PJRT_DeviceDescription {
        &self.description as *const DescriptionHandle as *mut PJRT_DeviceDescription
    }

    /// The compute plugin's device behind a delegating client's device.
    pub fn compute_device(&self) -> Option<*mut PJRT_Device> {
        self.device.compute.as_ref().map(|c| c.device.as_mut())
    }
}

#[repr(C)]
pub(crate) struct DescriptionHandle {
    tag: u64,
    pub device: Arc<Device>,
    pub attributes: NamedValues,
}
castable!(
    DescriptionHandle,
    PJRT_DeviceDescription,
    Borrowed,
    DESCRIPTION_TAG,
    "PJRT_DeviceDescription"
);

impl DescriptionHandle {
    pub(super) fn new(device: Arc<Device>) -> DescriptionHandle {
        let mut named = vec![
            (
                "backend".into(),
                NamedValue::Str(device.backend.name().into()),
            ),
            (
                "global_device_id".into(),
                NamedValue::Int(device.global_id as i64),
            ),
        ];
        if device.compute.is_some() {
            named[0].1 = NamedValue::Str("compute_plugin".into());
            named.extend(
                device
                    .compute_attributes
                    .iter()
                    .filter(|(name, _)| name != "backend" && name != "global_device_id")
                    .cloned(),
            );
        } else if device.addressable {
            let index = device.local_hardware_id as usize;
            named.extend(device.backend.device_attributes(index));
        }
        DescriptionHandle {
            tag: Self::TAG,
            device,
            attributes: NamedValues::new(named),
        }
    }

    /// The compute plugin's description behind a delegating client's device.
    pub fn compute_description(&self) -> Option<*mut PJRT_DeviceDescription> {
        self.device.compute.as_ref().map(|c| c.description.as_mut())
    }
}
