//! AVX2 quantization of a 32-value activation block, with the bits of `activations.rs`'s
//! scalar `quantize_values`: the largest magnitude (NaN values skipped, as `f32::max` skips
//! them), the same scale and inverse, and each quant rounded as `round_to_i8` rounds (clamped to
//! ±200, truncated, moved one away from zero at a dropped fraction of at least one half, clamped
//! to -128..=127, NaN to 0).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::BLOCK;
#[cfg(target_arch = "x86_64")]
use crate::super_rows::SUPER_BLOCK;

/// Quantizes the 32 values at `values` into `quants`; returns the unrounded scale and the sum
/// of the quants.
///
/// # Safety
/// The CPU must have AVX2; `values` and `quants` must hold 32 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn block(values: &[f32], quants: &mut [i8]) -> (f32, i32) {
    debug_assert!(values.len() == BLOCK && quants.len() == BLOCK);
    // SAFETY: the caller guarantees 32 values.
    let scale = unsafe { largest(values) } / 127.0;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    // SAFETY: the caller guarantees 32 values and 32 quants.
    let total = unsafe { thirty_two(values, inverse, quants) };
    (scale, lane_sum(total))
}

/// Quantizes the 256 values at `values` into `quants` (a k-quant's activation super-block, as
/// `super_rows.rs` quantizes one); returns the unrounded scale.
///
/// # Safety
/// The CPU must have AVX2; `values` and `quants` must hold 256 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn super_block(values: &[f32], quants: &mut [i8]) -> f32 {
    debug_assert!(values.len() == SUPER_BLOCK && quants.len() == SUPER_BLOCK);
    // SAFETY: the caller guarantees 256 values.
    let scale = unsafe { largest(values) } / 127.0;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for (values, quants) in values
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
    {
        // SAFETY: `chunks_exact` gives 32 values and 32 quants.
        unsafe { thirty_two(values, inverse, quants) };
    }
    scale
}

/// 32 values times `inverse`, rounded ([`rounded`]) into `quants`; returns the quants as i32
/// summed lane by lane.
///
/// # Safety
/// The CPU must have AVX2; `values` and `quants` must hold at least 32 elements.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn thirty_two(values: &[f32], inverse: f32, quants: &mut [i8]) -> __m256i {
    let inverse = _mm256_set1_ps(inverse);
    let rounded: [__m256i; 4] = std::array::from_fn(|k| {
        // SAFETY: the caller guarantees 32 readable values.
        let values = unsafe { _mm256_loadu_ps(values.as_ptr().add(8 * k)) };
        rounded(_mm256_mul_ps(values, inverse))
    });
    let words = _mm256_packs_epi32(rounded[0], rounded[1]);
    let bytes = _mm256_packs_epi16(words, _mm256_packs_epi32(rounded[2], rounded[3]));
    // The packs interleave the 128-bit halves: put the groups of four back in value order.
    let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: the caller guarantees 32 writable quants.
    unsafe { _mm256_storeu_si256(quants.as_mut_ptr().cast(), ordered) };
    rounded
        .into_iter()
        .fold(_mm256_setzero_si256(), |sum, values| {
            _mm256_add_epi32(sum, values)
        })
}

/// The largest magnitude of `values` (a multiple of eight), ignoring NaN (as a fold of
/// `f32::max` from 0 does).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn largest(values: &[f32]) -> f32 {
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let mut most = _mm256_setzero_ps();
    for eight in values.chunks_exact(8) {
        // SAFETY: `chunks_exact` gives eight readable values.
        let eight = unsafe { _mm256_loadu_ps(eight.as_ptr()) };
        // `max_ps` returns its second operand when either is NaN: the running maximum.
        most = _mm256_max_ps(_mm256_and_ps(eight, magnitude), most);
    }
    let halves = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    let pairs = _mm_max_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// Eight values rounded as `round_to_i8` rounds them, as i32.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn rounded(values: __m256) -> __m256i {
    let not_a_number = _mm256_castps_si256(_mm256_cmp_ps(values, values, _CMP_UNORD_Q));
    let clamped = _mm256_min_ps(
        _mm256_max_ps(values, _mm256_set1_ps(-200.0)),
        _mm256_set1_ps(200.0),
    );
    let whole = _mm256_cvttps_epi32(clamped);
    let fraction = _mm256_sub_ps(clamped, _mm256_cvtepi32_ps(whole));
    // The comparisons are all ones (-1) where true.
    let up = _mm256_castps_si256(_mm256_cmp_ps(fraction, _mm256_set1_ps(0.5), _CMP_GE_OQ));
    let down = _mm256_castps_si256(_mm256_cmp_ps(fraction, _mm256_set1_ps(-0.5), _CMP_LE_OQ));
    let moved = _mm256_add_epi32(_mm256_sub_epi32(whole, up), down);
    let saturated = _mm256_min_epi32(
        _mm256_max_epi32(moved, _mm256_set1_epi32(-128)),
        _mm256_set1_epi32(127),
    );
    _mm256_andnot_si256(not_a_number, saturated)
}

/// The sum of eight i32 lanes.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn lane_sum(values: __m256i) -> i32 {
    let halves = _mm_add_epi32(
        _mm256_castsi256_si128(values),
        _mm256_extracti128_si256(values, 1),
    );
    let pairs = _mm_add_epi32(halves, _mm_unpackhi_epi64(halves, halves));
    _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0b01)))
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn block(_: &[f32], _: &mut [i8]) -> (f32, i32) {
    unreachable!("no AVX2 outside x86_64")
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn super_block(_: &[f32], _: &mut [i8]) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::activations::quantize_values;
    use crate::avx2::Avx2;
    use crate::super_rows::{SUPER_BLOCK, quantize_super_block};

    #[test]
    fn avx2_blocks_quantize_as_the_scalar_blocks_do() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            f32::MAX,
            0.5,
            -0.5,
            2.5,
        ];
        let mut state = 0x1234_5678_u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 32) as u32
        };
        for round in 0..20_000 {
            let values: [f32; BLOCK] = std::array::from_fn(|_| match (round % 4, next() % 8) {
                (0, _) => f32::from_bits(next()),
                (1, 0) => special[next() as usize % special.len()],
                (_, 1) if round % 3 == 0 => (next() % 255) as f32 - 127.0,
                _ => (next() as f32 / u32::MAX as f32 - 0.5) * 10.0,
            });
            let mut values = values;
            if round % 5 == 0 {
                // A scale of exactly 1: every other value a tie between two quants.
                values = std::array::from_fn(|i| match i {
                    0 => -127.0,
                    _ => (next() % 254) as f32 - 127.0 + 0.5,
                });
            }
            let (mut fast, mut slow) = ([0i8; BLOCK], [0i8; BLOCK]);
            let want = quantize_values(&values, &mut slow);
            let got = token.quantize_values(&values, &mut fast);
            assert_eq!(want.0.to_bits(), got.0.to_bits(), "{values:?}");
            assert_eq!((want.1, slow), (got.1, fast), "{values:?}");
        }
    }

    #[test]
    fn avx2_super_blocks_quantize_as_the_scalar_super_blocks_do() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        let mut state = 0x8765_4321_u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 32) as u32
        };
        for round in 0..2_000 {
            let values: Vec<f32> = (0..SUPER_BLOCK)
                .map(|_| match round % 3 {
                    0 => f32::from_bits(next()),
                    1 => (next() % 255) as f32 - 127.0 + 0.5,
                    _ => (next() as f32 / u32::MAX as f32 - 0.5) * 10.0,
                })
                .collect();
            let (mut fast, mut slow) = ([0i8; SUPER_BLOCK], [0i8; SUPER_BLOCK]);
            let want = quantize_super_block(&values, &mut slow);
            let got = token.quantize_super_values(&values, &mut fast);
            assert_eq!(want.to_bits(), got.to_bits());
            assert_eq!(slow, fast);
        }
    }
}
