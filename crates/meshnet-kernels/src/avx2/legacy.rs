//! AVX2 dot products of Q4_0, Q5_0 and Q5_1 rows (equal to `formats::legacy`'s).

use super::Avx2;
use crate::activations::ActivationRow;
use crate::formats::legacy;

/// One Q4_0 row against one activation row.
pub(super) fn dot_q4_0(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    legacy::dot_q4_0(weights, activations)
}

/// One Q5_0 row against one activation row.
pub(super) fn dot_q5_0(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    legacy::dot_q5_0(weights, activations)
}

/// One Q5_1 row against one activation row.
pub(super) fn dot_q5_1(_: Avx2, weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    legacy::dot_q5_1(weights, activations)
}
