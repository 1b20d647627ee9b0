//! AVX2 dot product of Q2_K rows (equal to `formats::q2_k`'s), built as Q6_K's
//! (`avx2::q6_k`): the quants (0..=3) of each run against their activations, scaled per
//! sub-block in `madd`; the minimums meet the activation sums in one more `madd` per
//! super-block.

use super::Avx2;
#[cfg(target_arch = "x86_64")]
use super::q6_k::{
    FOUR, Group, combined_lanes, fold_halves, half_dot, half_scales, sums_of_quarters,
};
use crate::formats::SUPER_BLOCK;
use crate::formats::q2_k::{BYTES, D_AT, DMIN_AT, QUANTS_AT};
use crate::formats::q6_k::{SUB_BLOCKS, checked_blocks};
use crate::super_rows::SuperRow;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One Q2_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    checked_blocks(weights, activations, BYTES);
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2 and F16C; `checked_blocks`
    // checked that the row holds as many super-blocks of weights, sums and quants as scales.
    unsafe { row_dot(weights, activations) }
}

/// The row's dot product as the reference computes it: the parts of four super-blocks are
/// computed side by side (lane-wise, the same operations in the same order as
/// `formats::q2_k::scaled_integers`) and added to the four running sums in one vector add.
///
/// # Safety
/// The CPU must have AVX2 and F16C, and the row must hold as many super-blocks of weights,
/// sums and quants as it has scales.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    let group = Group {
        weights,
        block_bytes: BYTES,
        activation_scales: activations.scales,
    };
    let block_lanes = |block: usize| {
        // SAFETY: only super-blocks of the row are asked for, which are in range of the
        // weights, the sums and the quants.
        unsafe {
            block_lanes(
                weights.as_ptr().add(block * BYTES),
                activations.sums.as_ptr().add(block * SUB_BLOCKS),
                activations.quants.as_ptr().add(block * SUPER_BLOCK),
            )
        }
    };
    let blocks = activations.scales.len();
    let mut lanes = _mm_setzero_ps();
    for first in (0..blocks).step_by(FOUR) {
        let count = FOUR.min(blocks - first);
        // SAFETY: super-blocks `first..first + count` are in the row.
        lanes = _mm_add_ps(lanes, unsafe { parts(group, first, count, &block_lanes) });
    }
    combined_lanes(lanes)
}

/// `(a · d) · S − (a · dmin) · M` of super-blocks `first..first + count` (`count` at most four)
/// lane by lane, as `formats::q2_k::scaled_integers` computes it, with `S` and `M` the lane
/// sums of `block_lanes(block)`; lanes past `count` are zero.
///
/// # Safety
/// The CPU must have AVX2 and F16C, and super-blocks `first..first + count` must be in the row
/// and safe for `block_lanes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn parts(
    group: Group<'_>,
    first: usize,
    count: usize,
    block_lanes: &impl Fn(usize) -> (__m256i, __m256i),
) -> __m128 {
    // (Written out: `array::map` would call the closures, which cannot be inlined into it.)
    let quarters = |k: usize| {
        if k < count {
            let (scaled, minimums) = block_lanes(first + k);
            (fold_halves(scaled), fold_halves(minimums))
        } else {
            (_mm_setzero_si128(), _mm_setzero_si128())
        }
    };
    let (quarters0, quarters1, quarters2, quarters3) =
        (quarters(0), quarters(1), quarters(2), quarters(3));
    let scaled = sums_of_quarters([quarters0.0, quarters1.0, quarters2.0, quarters3.0]);
    let minimums = sums_of_quarters([quarters0.1, quarters1.1, quarters2.1, quarters3.1]);
    // SAFETY: passed on from the caller.
    let (activation_scale, d, dmin) = unsafe {
        (
            group.activation_scales(first, count),
            group.halves(first, count, D_AT),
            group.halves(first, count, DMIN_AT),
        )
    };
    _mm_sub_ps(
        _mm_mul_ps(_mm_mul_ps(activation_scale, d), _mm_cvtepi32_ps(scaled)),
        _mm_mul_ps(
            _mm_mul_ps(activation_scale, dmin),
            _mm_cvtepi32_ps(minimums),
        ),
    )
}

/// The exact integers `(S, M)` of one super-block, as `formats::q2_k` defines them, each
/// spread over eight lanes.
///
/// # Safety
/// The CPU must have AVX2; `block` must point at 84 readable bytes, `sums` at 16 i16 and
/// `quants` at 256 i8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_lanes(block: *const u8, sums: *const i16, quants: *const i8) -> (__m256i, __m256i) {
    // SAFETY: the 16 scale-and-minimum bytes lie at the start of the block; `sums` holds 32
    // bytes.
    let (packed, sums) = unsafe {
        (
            _mm_loadu_si128(block.cast()),
            _mm256_loadu_si256(sums.cast()),
        )
    };
    let nibble = _mm_set1_epi8(0x0F);
    let scales = _mm256_cvtepu8_epi16(_mm_and_si128(packed, nibble));
    let minimums = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed), nibble));
    let [first_scales, second_scales] = half_scales(scales);
    // SAFETY: the two halves' 32 quant bytes lie inside the block, and each half reads 128
    // activations inside `quants`.
    let dots = unsafe {
        let first = half_runs(_mm256_loadu_si256(block.add(QUANTS_AT).cast()));
        let second = half_runs(_mm256_loadu_si256(block.add(QUANTS_AT + 32).cast()));
        _mm256_add_epi32(
            half_dot(first, quants, first_scales),
            half_dot(second, quants.add(SUPER_BLOCK / 2), second_scales),
        )
    };
    (dots, _mm256_madd_epi16(minimums, sums))
}

/// The four runs of quants (0..=3) of one half: bits 2r, 2r + 1 of each byte for run r.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn half_runs(packed: __m256i) -> [__m256i; 4] {
    let two_bits = _mm256_set1_epi8(3);
    [
        _mm256_and_si256(packed, two_bits),
        _mm256_and_si256(_mm256_srli_epi16::<2>(packed), two_bits),
        _mm256_and_si256(_mm256_srli_epi16::<4>(packed), two_bits),
        _mm256_and_si256(_mm256_srli_epi16::<6>(packed), two_bits),
    ]
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn row_dot(_: &[u8], _: SuperRow<'_>) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::avx2::q6_k::tests::{
        assert_extreme_rows_match, assert_random_rows_match, report_timing, token,
    };
    use crate::formats::q2_k;

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        report_timing("Q2_K", q2_k::dot, fast, BYTES, &[D_AT, DMIN_AT]);
    }

    #[test]
    fn random_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_random_rows_match(q2_k::dot, fast, BYTES, &[D_AT, DMIN_AT]);
    }

    #[test]
    fn extreme_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_extreme_rows_match(q2_k::dot, fast, BYTES, &[D_AT, DMIN_AT]);
    }
}
