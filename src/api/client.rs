//! The client: devices, memories, and buffer creation on the host backend.
use std::sync::Arc;

use super::buffer::{Buffer, HostArray};
use super::device::Device;
use super::element_type::Shape;
use super::options::ClientOptions;
use crate::backend::host::HostMemory;
use crate::backend::Allocation;
use crate::status::{invalid_argument, Result};
use crate::sync::Future;

pub const PLATFORM_NAME: &str = "crosshost";
pub const HOST_DEVICE_KIND: &str = "crosshost-host";

pub struct Client {
    options: ClientOptions,
    process_index: i32,
    /// Every device of the job, ordered by global id.
    devices: Vec<Arc<Device>>,
    platform_version: String,
}

impl Client {
    pub fn create(options: ClientOptions) -> Result<Arc<Client>> {
        let process_index = 0;
        let devices = (0..options.num_devices as i32)
            .map(|i| Arc::new(Device::new(i, process_index, i, true, HOST_DEVICE_KIND)))
            .collect();
        Ok(Arc::new(Client {
            options,
            process_index,
            devices,
            platform_version: format!(
                "pjrt-crosshost {} (host backend)",
                env!("CARGO_PKG_VERSION")
            ),
        }))
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    pub fn process_index(&self) -> i32 {
        self.process_index
    }

    pub fn platform_version(&self) -> &str {
        &self.platform_version
    }

    pub fn devices(&self) -> &[Arc<Device>] {
        &self.devices
    }

    pub fn addressable_devices(&self) -> impl Iterator<Item = &Arc<Device>> {
        self.devices.iter().filter(|d| d.addressable)
    }

    pub fn device_by_global_id(&self, id: i32, context: &str) -> Result<&Arc<Device>> {
        self.devices
            .iter()
            .find(|d| d.global_id == id)
            .ok_or_else(|| invalid_argument(format!("{context}: no device with global id {id}")))
    }

    pub fn addressable_device_by_local_id(&self, id: i32, context: &str) -> Result<&Arc<Device>> {
        self.addressable_devices()
            .find(|d| d.local_hardware_id == id)
            .ok_or_else(|| {
                invalid_argument(format!(
                    "{context}: no addressable device with local hardware id {id}"
                ))
            })
    }

    fn require_addressable(device: &Device, context: &str) -> Result<()> {
        if device.addressable {
            Ok(())
        } else {
            Err(invalid_argument(format!(
                "{context}: device {} belongs to process {} and is not addressable here",
                device.global_id, device.process_index
            )))
        }
    }

    pub fn allocate(&self, device: &Device, bytes: usize, context: &str) -> Result<Allocation> {
        Self::require_addressable(device, context)?;
        Ok(Arc::new(HostMemory::allocate(
            bytes,
            device.counters.clone(),
        )?))
    }

    /// Copies a host array onto `device`. The data is copied before return,
    /// so the host buffer is free as soon as this returns.
    pub fn buffer_from_host(
        &self,
        host: &HostArray<'_>,
        shape: Shape,
        device: &Arc<Device>,
        context: &str,
    ) -> Result<Arc<Buffer>> {
        let dense = host.to_dense(&shape, context)?;
        let data = self.allocate(device, shape.byte_size(), context)?;
        data.write(0, &dense)?;
        Ok(Buffer::new(
            shape,
            device.clone(),
            data,
            Future::ready(Ok(())),
        ))
    }

    /// Copies `src` to `device`, after `src` is defined. The new buffer's
    /// definition event carries the copy's outcome.
    pub fn copy_buffer(
        &self,
        src: &Buffer,
        device: &Arc<Device>,
        context: &str,
    ) -> Result<Arc<Buffer>> {
        let dst = self.allocate(device, src.byte_size(), context)?;
        let target = dst.clone();
        let size = src.byte_size();
        let definition = src.when_defined(context, move |source| {
            let mut staging = vec![0u8; size];
            source.read(0, &mut staging)?;
            target.write(0, &staging)
        })?;
        Ok(Buffer::new(
            src.shape().clone(),
            device.clone(),
            dst,
            definition,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::element_type::ElementType;

    #[test]
    fn copy_buffer_moves_bytes_to_the_other_device() {
        let client = Client::create(ClientOptions::default()).unwrap();
        let shape = Shape::new(ElementType::F32, vec![2], "t").unwrap();
        let bytes = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let host = HostArray {
            bytes: &bytes,
            origin: 0,
            byte_strides: None,
        };
        let d0 = client.devices()[0].clone();
        let d1 = client.devices()[1].clone();
        let b0 = client.buffer_from_host(&host, shape, &d0, "t").unwrap();
        let b1 = client.copy_buffer(&b0, &d1, "t").unwrap();
        b1.definition().wait().unwrap();
        let mut out = [0u8; 8];
        b1.allocation("t").unwrap().read(0, &mut out).unwrap();
        assert_eq!(out, bytes);
        assert_eq!(b1.device().global_id, 1);
        b0.delete();
        assert!(b0.allocation("t").is_err());
        assert!(client.copy_buffer(&b0, &d1, "t").is_err());
    }
}
