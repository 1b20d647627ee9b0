//! F32, F16 and BF16 weights against f32 activations.

use super::FloatFormat;

/// Writes the values of `bytes` as f32.
pub(crate) fn dequantize(format: FloatFormat, bytes: &[u8], values: &mut [f32]) {
    todo!("{format:?} {} {}", bytes.len(), values.len())
}

/// One row of weights against one row of activations.
pub(crate) fn dot(format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
    todo!("{format:?} {} {}", weights.len(), activations.len())
}
