//! AVX2 dot product of Q6_K rows (equal to `formats::q6_k`'s).

use super::Avx2;
use crate::formats::q6_k;
use crate::super_rows::SuperRow;

/// One Q6_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q6_k::dot(weights, activations)
}
