//! AVX2 dot products of F32, F16 and BF16 rows (equal to `formats::float`'s).

use super::Avx2;
use crate::formats::{FloatFormat, float};

/// One row of weights against one row of f32 activations.
pub(super) fn dot(_: Avx2, format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
    float::dot(format, weights, activations)
}
