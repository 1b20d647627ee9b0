//! AVX2 dot product of Q2_K rows (equal to `formats::q2_k`'s).

use super::Avx2;
use crate::formats::q2_k;
use crate::super_rows::SuperRow;

/// One Q2_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q2_k::dot(weights, activations)
}
