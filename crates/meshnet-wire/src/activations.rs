//! Activations as bfloat16 values with a shape, and their little-endian byte form.

use half::bf16;

use crate::{Shape, WireError};

/// A bfloat16 tensor: a shape and exactly `shape.elements()` values, outermost dimension first.
#[derive(Debug, Clone, PartialEq)]
pub struct Activations {
    shape: Shape,
    values: Vec<bf16>,
}

impl Activations {
    /// Pairs a shape with its values, checking the element count.
    pub fn new(shape: Shape, values: Vec<bf16>) -> Result<Self, WireError> {
        if values.len() != shape.elements() {
            return Err(WireError::ElementCount {
                shape: shape.to_string(),
                expected: shape.elements(),
                got: values.len(),
            });
        }
        Ok(Activations { shape, values })
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The values, row-major.
    pub fn values(&self) -> &[bf16] {
        &self.values
    }

    /// The size of the values as raw little-endian bf16 bytes (before any compression).
    pub fn raw_len(&self) -> usize {
        self.values.len() * 2
    }

    /// Takes the shape and values apart.
    pub fn into_parts(self) -> (Shape, Vec<bf16>) {
        (self.shape, self.values)
    }

    /// The values as little-endian bytes, copied once.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        bf16_to_le_bytes(&self.values)
    }
}

/// Copies bfloat16 values into their little-endian byte form (one allocation, no per-element work
/// on little-endian machines).
pub fn bf16_to_le_bytes(values: &[bf16]) -> Vec<u8> {
    let mut bytes = vec![0u8; values.len() * 2];
    write_le_bytes(values, &mut bytes);
    bytes
}

/// Writes bfloat16 values as little-endian bytes into `out`, which must be exactly twice as long.
pub fn write_le_bytes(values: &[bf16], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        values.len() * 2,
        "output must hold 2 bytes per value"
    );
    if cfg!(target_endian = "little") {
        out.copy_from_slice(bytemuck::cast_slice(values));
    } else {
        for (chunk, value) in out.chunks_exact_mut(2).zip(values) {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }
}

/// Reads little-endian bytes into bfloat16 values (one allocation).
///
/// Fails when the byte count is odd.
pub fn bf16_from_le_bytes(bytes: &[u8]) -> Result<Vec<bf16>, WireError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(WireError::LengthMismatch {
            shape: "(unknown)".to_owned(),
            expected: bytes.len() + 1,
            got: bytes.len(),
        });
    }
    let mut values = vec![bf16::ZERO; bytes.len() / 2];
    bf16_bytes_mut(&mut values).copy_from_slice(bytes);
    fix_endianness(&mut values);
    Ok(values)
}

/// The byte view of a bfloat16 buffer, for filling it in place from the wire.
pub(crate) fn bf16_bytes_mut(values: &mut [bf16]) -> &mut [u8] {
    bytemuck::cast_slice_mut(values)
}

/// After bytes were copied into a bfloat16 buffer, turns them from little-endian into native order.
pub(crate) fn fix_endianness(values: &mut [bf16]) {
    if cfg!(target_endian = "big") {
        for value in values {
            *value = bf16::from_bits(u16::from_le(value.to_bits()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn little_endian_layout_is_low_byte_first() {
        let one = bf16::from_f32(1.0); // 0x3F80
        assert_eq!(bf16_to_le_bytes(&[one]), vec![0x80, 0x3F]);
        assert_eq!(bf16_from_le_bytes(&[0x80, 0x3F]).unwrap(), vec![one]);
    }

    #[test]
    fn odd_byte_counts_are_rejected() {
        assert!(bf16_from_le_bytes(&[1, 2, 3]).is_err());
    }

    #[test]
    fn element_count_is_checked() {
        let shape = Shape::new(&[2, 3]).unwrap();
        assert!(Activations::new(shape.clone(), vec![bf16::ZERO; 5]).is_err());
        assert!(Activations::new(shape, vec![bf16::ZERO; 6]).is_ok());
    }
}
