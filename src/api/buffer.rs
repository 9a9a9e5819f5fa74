//! A device buffer: shape, placement, allocation and definition event.
//!
//! The definition event (a `Future`) says when the bytes are valid: at once
//! for buffers made from host data, when the completion lifecycle publishes
//! for received buffers. Every read waits for it.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::device::Device;
use super::element_type::Shape;
use crate::backend::Allocation;
use crate::status::{failed_precondition, invalid_argument, Outcome, Result};
use crate::sync::{Future, PromiseOnce};

pub struct Buffer {
    shape: Shape,
    device: Arc<Device>,
    /// `None` once deleted.
    data: Mutex<Option<Allocation>>,
    definition: Future,
    external_refs: AtomicUsize,
    /// Keeps the allocation alive while external references exist, even after
    /// `delete`, so a framework's raw pointer never dangles.
    pinned: Mutex<Option<Allocation>>,
}

impl Buffer {
    pub fn new(
        shape: Shape,
        device: Arc<Device>,
        data: Allocation,
        definition: Future,
    ) -> Arc<Self> {
        debug_assert_eq!(data.len(), shape.byte_size());
        Arc::new(Buffer {
            shape,
            device,
            data: Mutex::new(Some(data)),
            definition,
            external_refs: AtomicUsize::new(0),
            pinned: Mutex::new(None),
        })
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn byte_size(&self) -> usize {
        self.shape.byte_size()
    }

    pub fn definition(&self) -> Future {
        self.definition.clone()
    }

    /// The definition event, or an event already failed if the buffer was
    /// deleted (the header: such an event "will immediately indicate an
    /// error").
    pub fn ready_event(&self, context: &str) -> Future {
        match self.allocation(context) {
            Ok(_) => self.definition.clone(),
            Err(status) => Future::ready(Err(status)),
        }
    }

    pub fn is_deleted(&self) -> bool {
        self.data.lock().is_none()
    }

    /// The allocation, or INVALID_ARGUMENT naming `context` if deleted.
    pub fn allocation(&self, context: &str) -> Result<Allocation> {
        self.data.lock().clone().ok_or_else(|| {
            invalid_argument(format!("{context}: buffer has been deleted or donated"))
        })
    }

    /// Releases the device memory (kept only while external references or
    /// in-flight operations still hold it). Idempotent.
    pub fn delete(&self) {
        let released = self.data.lock().take();
        drop(released);
    }

    /// Runs `work` with the allocation once the buffer is defined; the returned
    /// future carries `work`'s outcome, or the definition error.
    pub fn when_defined(
        &self,
        context: &str,
        work: impl FnOnce(&Allocation) -> Outcome + Send + 'static,
    ) -> Result<Future> {
        let data = self.allocation(context)?;
        let (promise, future) = PromiseOnce::new();
        self.definition.on_ready(move |definition| {
            let outcome = match definition {
                Ok(()) => work(&data),
                Err(e) => Err(e.clone()),
            };
            promise.set(outcome);
        });
        Ok(future)
    }

    pub fn increase_external_refs(&self, context: &str) -> Result<()> {
        let data = self.allocation(context)?;
        let mut pinned = self.pinned.lock();
        if self.external_refs.fetch_add(1, Ordering::SeqCst) == 0 {
            *pinned = Some(data);
        }
        Ok(())
    }

    pub fn decrease_external_refs(&self, context: &str) -> Result<()> {
        let mut pinned = self.pinned.lock();
        let current = self.external_refs.load(Ordering::SeqCst);
        if current == 0 {
            return Err(failed_precondition(format!(
                "{context}: external reference count is already zero"
            )));
        }
        self.external_refs.store(current - 1, Ordering::SeqCst);
        if current == 1 {
            *pinned = None;
        }
        Ok(())
    }

    /// Device address of the data; usable while the buffer is alive and not
    /// deleted, or while an external reference is held.
    pub fn address(&self, context: &str) -> Result<usize> {
        if let Some(pinned) = self.pinned.lock().as_ref() {
            return Ok(pinned.address());
        }
        Ok(self.allocation(context)?.address())
    }
}

/// A host array given as bytes plus optional byte strides (numpy-style).
/// `origin` is the byte offset of element [0,...,0] inside `bytes`, so that
/// negative strides stay inside the slice.
pub struct HostArray<'a> {
    pub bytes: &'a [u8],
    pub origin: usize,
    pub byte_strides: Option<&'a [i64]>,
}

impl HostArray<'_> {
    /// Byte range [lowest, highest+element) touched relative to element 0 for
    /// the given strides; used by `ffi/` to size the slice it forms.
    pub fn extent(shape: &Shape, strides: &[i64]) -> (i64, i64) {
        if shape.element_count() == 0 {
            return (0, 0);
        }
        let (mut low, mut high) = (0i64, 0i64);
        for (&d, &s) in shape.dims.iter().zip(strides) {
            let span = (d - 1).saturating_mul(s);
            if span < 0 {
                low = low.saturating_add(span);
            } else {
                high = high.saturating_add(span);
            }
        }
        (
            low,
            high.saturating_add(shape.element_type.byte_size() as i64),
        )
    }

    /// The array's bytes when they are already dense row-major (no strides,
    /// or strides equal to the dense ones); `None` when a gather is needed.
    pub fn contiguous(&self, shape: &Shape, context: &str) -> Result<Option<&[u8]>> {
        let dense = match self.byte_strides {
            None => true,
            Some(s) => shape.byte_size() == 0 || s == shape.dense_byte_strides().as_slice(),
        };
        if !dense {
            return Ok(None);
        }
        let end = self
            .origin
            .checked_add(shape.byte_size())
            .filter(|e| *e <= self.bytes.len())
            .ok_or_else(|| {
                invalid_argument(format!("{context}: host data shorter than the shape"))
            })?;
        Ok(Some(&self.bytes[self.origin..end]))
    }

    /// Gathers the array into dense row-major bytes.
    pub fn to_dense(&self, shape: &Shape, context: &str) -> Result<Vec<u8>> {
        let size = shape.byte_size();
        let elem = shape.element_type.byte_size();
        let strides = match self.byte_strides {
            None => {
                let end = self
                    .origin
                    .checked_add(size)
                    .filter(|e| *e <= self.bytes.len());
                let end = end.ok_or_else(|| {
                    invalid_argument(format!("{context}: host data shorter than the shape"))
                })?;
                return Ok(self.bytes[self.origin..end].to_vec());
            }
            Some(s) => s,
        };
        if strides.len() != shape.dims.len() {
            return Err(invalid_argument(format!(
                "{context}: num_byte_strides ({}) != num_dims ({})",
                strides.len(),
                shape.dims.len()
            )));
        }
        if size == 0 {
            return Ok(Vec::new());
        }
        let (low, high) = Self::extent(shape, strides);
        let origin = self.origin as i64;
        if origin + low < 0 || origin + high > self.bytes.len() as i64 {
            return Err(invalid_argument(format!(
                "{context}: byte_strides {strides:?} reach outside the host data"
            )));
        }
        let mut out = Vec::with_capacity(size);
        let rank = shape.dims.len();
        // Rows whose innermost stride is dense are copied whole.
        let (row_dims, row_bytes) = if rank > 0 && strides[rank - 1] == elem as i64 {
            (rank - 1, shape.dims[rank - 1] as usize * elem)
        } else {
            (rank, elem)
        };
        let mut index = vec![0i64; row_dims];
        loop {
            let offset: i64 = origin + index.iter().zip(strides).map(|(&i, &s)| i * s).sum::<i64>();
            let start = offset as usize;
            out.extend_from_slice(&self.bytes[start..start + row_bytes]);
            // Advance the row-major index over the outer `row_dims` dims.
            let mut d = row_dims;
            loop {
                if d == 0 {
                    return Ok(out);
                }
                d -= 1;
                index[d] += 1;
                if index[d] < shape.dims[d] {
                    break;
                }
                index[d] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::element_type::ElementType;

    fn shape(dims: &[i64]) -> Shape {
        Shape::new(ElementType::from_raw(6, "t").unwrap(), dims.to_vec(), "t").unwrap()
    }

    #[test]
    fn transposed_strides_gather_in_row_major_order() {
        // 2x3 u8 matrix stored column-major: element (i,j) at j*2 + i.
        let bytes = [0u8, 3, 1, 4, 2, 5];
        let strides = [1i64, 2];
        let arr = HostArray {
            bytes: &bytes,
            origin: 0,
            byte_strides: Some(&strides),
        };
        assert_eq!(
            arr.to_dense(&shape(&[2, 3]), "t").unwrap(),
            vec![0, 1, 2, 3, 4, 5]
        );
    }

    #[test]
    fn negative_strides_are_supported_inside_the_slice() {
        let bytes = [1u8, 2, 3, 4];
        let strides = [-1i64];
        let arr = HostArray {
            bytes: &bytes,
            origin: 3,
            byte_strides: Some(&strides),
        };
        assert_eq!(arr.to_dense(&shape(&[4]), "t").unwrap(), vec![4, 3, 2, 1]);
    }

    #[test]
    fn strides_reaching_outside_are_rejected() {
        let bytes = [1u8, 2, 3];
        let strides = [2i64];
        let arr = HostArray {
            bytes: &bytes,
            origin: 0,
            byte_strides: Some(&strides),
        };
        assert!(arr.to_dense(&shape(&[3]), "t").is_err());
    }
}
