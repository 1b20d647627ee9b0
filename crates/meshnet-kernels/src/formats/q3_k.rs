//! Q3_K: 256-value super-blocks (layout as ggml writes it).

use crate::super_rows::SuperRow;

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 110;

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    todo!("Q3_K {} {}", block.len(), values.len())
}

/// One Q3_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    todo!("Q3_K {} {}", weights.len(), activations.scales.len())
}
