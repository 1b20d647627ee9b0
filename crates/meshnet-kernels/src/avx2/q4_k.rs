//! AVX2 dot product of Q4_K rows (equal to `formats::q4_k`'s).

use super::Avx2;
use crate::formats::q4_k;
use crate::super_rows::SuperRow;

/// One Q4_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q4_k::dot(weights, activations)
}
