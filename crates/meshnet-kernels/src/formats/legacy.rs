//! Q4_0, Q5_0 and Q5_1: 32-value blocks (layouts as ggml writes them).

use crate::activations::ActivationRow;

/// Bytes of a Q4_0 block: f16 scale, 16 bytes of nibbles.
pub(crate) const Q4_0_BYTES: usize = 18;
/// Bytes of a Q5_0 block: f16 scale, 4 bytes of high bits, 16 bytes of nibbles.
pub(crate) const Q5_0_BYTES: usize = 22;
/// Bytes of a Q5_1 block: f16 scale, f16 minimum, 4 bytes of high bits, 16 bytes of nibbles.
pub(crate) const Q5_1_BYTES: usize = 24;

/// Writes one Q4_0 block's 32 values.
pub(crate) fn dequantize_q4_0(block: &[u8], values: &mut [f32]) {
    todo!("Q4_0 {} {}", block.len(), values.len())
}

/// Writes one Q5_0 block's 32 values.
pub(crate) fn dequantize_q5_0(block: &[u8], values: &mut [f32]) {
    todo!("Q5_0 {} {}", block.len(), values.len())
}

/// Writes one Q5_1 block's 32 values.
pub(crate) fn dequantize_q5_1(block: &[u8], values: &mut [f32]) {
    todo!("Q5_1 {} {}", block.len(), values.len())
}

/// One Q4_0 row against one activation row.
pub(crate) fn dot_q4_0(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    todo!("Q4_0 {} {}", weights.len(), activations.scales.len())
}

/// One Q5_0 row against one activation row.
pub(crate) fn dot_q5_0(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    todo!("Q5_0 {} {}", weights.len(), activations.scales.len())
}

/// One Q5_1 row against one activation row.
pub(crate) fn dot_q5_1(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    todo!("Q5_1 {} {}", weights.len(), activations.scales.len())
}
