//! The client: devices, memories, and buffer creation on its backend.
use std::sync::Arc;

use super::buffer::{Buffer, HostArray};
use super::device::Device;
use super::element_type::Shape;
use super::options::{ClientOptions, StoreChoice};
use crate::backend::{self, Allocation, Backend};
use crate::kv::callback::{CallbackStore, CallbackStoreOptions, RawKvCallbacks};
use crate::kv::memory::MemoryStore;
use crate::kv::KeyValueStore;
use crate::status::{invalid_argument, Result};
use crate::sync::Future;
use crate::transfer::service::{TransferConfig, TransferService};
use crate::transfer::session::Session;

pub const PLATFORM_NAME: &str = "crosshost";
pub use crate::backend::host::HOST_DEVICE_KIND;

pub struct Client {
    options: ClientOptions,
    process_index: i32,
    /// Every device of the job, ordered by global id.
    devices: Vec<Arc<Device>>,
    platform_version: String,
    transfers: Arc<TransferService>,
    backend: Arc<dyn Backend>,
}

/// Picks the store: a named in-process store when asked for; the creator's
/// KV callbacks in a multi-process job; a private store otherwise. The
/// callbacks are never used by a single-process client (JAX passes them even
/// then, and calling them there crashes).
fn choose_store(
    options: &ClientOptions,
    callbacks: Option<Arc<dyn RawKvCallbacks>>,
) -> Result<Arc<dyn KeyValueStore>> {
    Ok(match &options.store {
        StoreChoice::NamedMemory(name) => MemoryStore::named(name),
        StoreChoice::Default if options.num_nodes > 1 => {
            let raw = callbacks.ok_or_else(|| {
                invalid_argument(
                    "PJRT_Client_Create: num_nodes > 1 needs the KV callbacks (kv_get/kv_put/kv_try_get) \
                     or the create option kv_store=memory:<name>",
                )
            })?;
            Arc::new(CallbackStore::new(raw, CallbackStoreOptions::default()))
        }
        StoreChoice::Default => Arc::new(MemoryStore::new()),
    })
}

impl Client {
    pub fn create(options: ClientOptions) -> Result<Arc<Client>> {
        Client::create_with_callbacks(options, None)
    }

    /// Creates the client; in a multi-process job this blocks until every
    /// process joined the session (bounded by `session_timeout`).
    pub fn create_with_callbacks(
        options: ClientOptions,
        callbacks: Option<Arc<dyn RawKvCallbacks>>,
    ) -> Result<Arc<Client>> {
        let backend = backend::select(options.backend, options.num_devices)?;
        let num_devices = backend.device_count();
        let store = choose_store(&options, callbacks)?;
        let session = if options.num_nodes > 1 {
            Session::establish(
                &*store,
                &options.session,
                options.node_id,
                options.num_nodes,
                num_devices,
                options.session_timeout,
            )?
        } else {
            Session::local(num_devices)?
        };
        let process_index = session.process_index;
        let mut devices = Vec::new();
        for (process, first) in session.processes.iter().zip(session.first_global_ids()) {
            let mine = process.process_index == process_index;
            for i in 0..process.num_devices as i32 {
                let local_id = if mine { i } else { -1 };
                // Another process's device kind is not exchanged; a job is
                // assumed to run one kind of device everywhere.
                let kind = backend.device_kind(if mine { i as usize } else { 0 });
                devices.push(Arc::new(Device::new(
                    first + i,
                    process.process_index,
                    local_id,
                    mine,
                    &kind,
                    backend.clone(),
                )));
            }
        }
        let transfers = TransferService::new(
            store,
            session,
            TransferConfig {
                receive_timeout: options.receive_timeout,
                send_timeout: options.send_timeout,
                force_tcp: options.force_tcp,
                tcp_bind: options.tcp_bind,
                shm_pool_bytes: options.shm_pool_bytes,
                ..TransferConfig::default()
            },
        );
        Ok(Arc::new(Client {
            options,
            process_index,
            devices,
            transfers,
            platform_version: format!(
                "pjrt-crosshost {} ({} backend)",
                env!("CARGO_PKG_VERSION"),
                backend.name()
            ),
            backend,
        }))
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn transfers(&self) -> &Arc<TransferService> {
        &self.transfers
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
        self.backend.allocate(
            device.local_hardware_id as usize,
            bytes,
            device.counters.clone(),
        )
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
        let data = self.allocate(device, shape.byte_size(), context)?;
        match host.contiguous(&shape, context)? {
            // Row-major input is copied once, straight into device memory.
            Some(bytes) => data.write(0, bytes)?,
            None => data.write(0, &host.to_dense(&shape, context)?)?,
        }
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
        if Arc::ptr_eq(src.device(), device) {
            return Err(invalid_argument(format!(
                "{context}: the buffer is already on device {} (its memory)",
                device.global_id
            )));
        }
        let dst = self.allocate(device, src.byte_size(), context)?;
        let target = dst.clone();
        let backend = self.backend.clone();
        let definition =
            src.when_defined(context, move |source| backend.copy(&**source, &*target))?;
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
