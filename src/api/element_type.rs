//! Element types: the raw `PJRT_Buffer_Type` values and their storage size.
use crate::status::{invalid_argument, Result};

/// A validated `PJRT_Buffer_Type`. Sub-byte types (S1/U1/S2/U2/S4/U4/F4E2M1FN)
/// are stored unpacked, one byte per element, which is how host arrays of
/// those types arrive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ElementType(u32);

// Values of the PJRT_Buffer_Type enum (pjrt_c_api.h, 0.114).
const NAMES: &[(u32, &str, usize)] = &[
    (1, "PRED", 1),
    (2, "S8", 1),
    (3, "S16", 2),
    (4, "S32", 4),
    (5, "S64", 8),
    (6, "U8", 1),
    (7, "U16", 2),
    (8, "U32", 4),
    (9, "U64", 8),
    (10, "F16", 2),
    (11, "F32", 4),
    (12, "F64", 8),
    (13, "BF16", 2),
    (14, "C64", 8),
    (15, "C128", 16),
    (16, "F8E5M2", 1),
    (17, "F8E4M3FN", 1),
    (18, "F8E4M3B11FNUZ", 1),
    (19, "F8E5M2FNUZ", 1),
    (20, "F8E4M3FNUZ", 1),
    (21, "S4", 1),
    (22, "U4", 1),
    (24, "S2", 1),
    (25, "U2", 1),
    (26, "F8E4M3", 1),
    (27, "F8E3M4", 1),
    (28, "F8E8M0FNU", 1),
    (29, "F4E2M1FN", 1),
    (30, "S1", 1),
    (31, "U1", 1),
    (32, "F6E2M3FN", 1),
    (33, "F6E3M2FN", 1),
];

impl ElementType {
    pub const F32: ElementType = ElementType(11);

    /// Validates a raw type; INVALID, TOKEN and unknown values are rejected.
    pub fn from_raw(raw: u32, context: &str) -> Result<ElementType> {
        if NAMES.iter().any(|(v, _, _)| *v == raw) {
            Ok(ElementType(raw))
        } else {
            Err(invalid_argument(format!(
                "{context}: element type {raw} is not a fixed-width array type this plugin stores \
                 (INVALID=0, TOKEN=23 and unknown values are rejected)"
            )))
        }
    }

    /// Narrower than a byte on a device (stored unpacked on the host):
    /// S1/U1/S2/U2/S4/U4, F4E2M1FN and the 6-bit floats.
    pub fn is_sub_byte(self) -> bool {
        matches!(self.0, 21 | 22 | 24 | 25 | 29 | 30 | 31 | 32 | 33)
    }

    pub fn raw(self) -> u32 {
        self.0
    }

    fn entry(self) -> &'static (u32, &'static str, usize) {
        NAMES
            .iter()
            .find(|(v, _, _)| *v == self.0)
            .expect("validated at construction")
    }

    pub fn name(self) -> &'static str {
        self.entry().1
    }

    pub fn byte_size(self) -> usize {
        self.entry().2
    }
}

/// Validated dims and the derived element count / byte size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    pub element_type: ElementType,
    pub dims: Vec<i64>,
}

impl Shape {
    pub fn new(element_type: ElementType, dims: Vec<i64>, context: &str) -> Result<Shape> {
        let mut count: usize = 1;
        for (i, &d) in dims.iter().enumerate() {
            if d < 0 {
                return Err(invalid_argument(format!(
                    "{context}: dimension {i} is negative ({d})"
                )));
            }
            count = count
                .checked_mul(d as usize)
                .ok_or_else(|| invalid_argument(format!("{context}: shape {dims:?} overflows")))?;
        }
        count
            .checked_mul(element_type.byte_size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| invalid_argument(format!("{context}: shape {dims:?} overflows")))?;
        Ok(Shape { element_type, dims })
    }

    pub fn element_count(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    pub fn byte_size(&self) -> usize {
        self.element_count() * self.element_type.byte_size()
    }

    /// Row-major (dense) byte strides.
    pub fn dense_byte_strides(&self) -> Vec<i64> {
        let mut strides = vec![0i64; self.dims.len()];
        let mut stride = self.element_type.byte_size() as i64;
        for i in (0..self.dims.len()).rev() {
            strides[i] = stride;
            stride *= self.dims[i].max(1);
        }
        strides
    }

    /// Default layout: minor_to_major = rank-1, ..., 0.
    pub fn default_minor_to_major(&self) -> Vec<i64> {
        (0..self.dims.len() as i64).rev().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_and_invalid_are_rejected() {
        assert!(ElementType::from_raw(0, "t").is_err());
        assert!(ElementType::from_raw(23, "t").is_err());
        assert!(ElementType::from_raw(99, "t").is_err());
        assert_eq!(ElementType::from_raw(15, "t").unwrap().byte_size(), 16);
    }

    #[test]
    fn shape_sizes_and_strides() {
        let s = Shape::new(ElementType::F32, vec![2, 3, 4], "t").unwrap();
        assert_eq!(s.byte_size(), 96);
        assert_eq!(s.dense_byte_strides(), vec![48, 16, 4]);
        assert_eq!(s.default_minor_to_major(), vec![2, 1, 0]);
        let z = Shape::new(ElementType::F32, vec![0, 5], "t").unwrap();
        assert_eq!(z.byte_size(), 0);
        assert!(Shape::new(ElementType::F32, vec![-1], "t").is_err());
        assert!(Shape::new(ElementType::F32, vec![i64::MAX, i64::MAX], "t").is_err());
    }
}
