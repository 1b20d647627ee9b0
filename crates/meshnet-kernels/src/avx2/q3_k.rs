//! AVX2 dot product of Q3_K rows (equal to `formats::q3_k`'s).

use super::Avx2;
use crate::formats::q3_k;
use crate::super_rows::SuperRow;

/// One Q3_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q3_k::dot(weights, activations)
}
