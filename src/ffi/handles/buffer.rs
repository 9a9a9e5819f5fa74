//! Buffer handles.
use super::*;

#[repr(C)]
pub(crate) struct BufferHandle {
    tag: u64,
    pub buffer: Arc<Buffer>,
    pub client: Arc<Client>,
    pub tables: Arc<ClientTables>,
    /// Stable storage for the dims/layout pointers handed to callers.
    pub dims: Vec<i64>,
    pub minor_to_major: Vec<i64>,
}
castable!(
    BufferHandle,
    PJRT_Buffer,
    OwnedBox,
    BUFFER_TAG,
    "PJRT_Buffer"
);

impl BufferHandle {
    pub fn new(
        buffer: Arc<Buffer>,
        client: Arc<Client>,
        tables: Arc<ClientTables>,
    ) -> BufferHandle {
        let dims = buffer.shape().dims.clone();
        let minor_to_major = buffer.shape().default_minor_to_major();
        BufferHandle {
            tag: Self::TAG,
            buffer,
            client,
            tables,
            dims,
            minor_to_major,
        }
    }
}
