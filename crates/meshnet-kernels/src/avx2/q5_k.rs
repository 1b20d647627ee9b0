//! AVX2 dot product of Q5_K rows (equal to `formats::q5_k`'s).

use super::Avx2;
use crate::formats::q5_k;
use crate::super_rows::SuperRow;

/// One Q5_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q5_k::dot(weights, activations)
}
