//! AVX2 dot product of Q3_K rows (equal to `formats::q3_k`'s), built as Q6_K's
//! (`avx2::q6_k`): the stored quants (0..=7) of each run against their activations, scaled per
//! sub-block in `madd`, and the offset of 4 taken out once per super-block through the
//! activation sums.

use super::Avx2;
#[cfg(target_arch = "x86_64")]
use super::q6_k::{half_dot, half_scales, scaled_integer_row};
use crate::formats::SUPER_BLOCK;
use crate::formats::q3_k::{BYTES, D_AT, LOW_BITS_AT, SCALE_OFFSET, SCALES_AT};
use crate::formats::q6_k::{SUB_BLOCKS, checked_blocks};
use crate::super_rows::SuperRow;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One Q3_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    checked_blocks(weights, activations, BYTES);
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2 and F16C; `checked_blocks`
    // checked that the row holds as many super-blocks of weights, sums and quants as scales.
    unsafe { row_dot(weights, activations) }
}

/// The row's dot product, as the reference computes it.
///
/// # Safety
/// The CPU must have AVX2 and F16C, and the row must hold as many super-blocks of weights,
/// sums and quants as it has scales.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    let block_lanes = |block: usize| {
        // SAFETY: `scaled_integer_row` asks only for super-blocks of the row, which are in
        // range of the weights, the sums and the quants.
        unsafe {
            block_lanes(
                weights.as_ptr().add(block * BYTES),
                activations.sums.as_ptr().add(block * SUB_BLOCKS),
                activations.quants.as_ptr().add(block * SUPER_BLOCK),
            )
        }
    };
    // SAFETY: passed on from the caller.
    unsafe { scaled_integer_row(weights, BYTES, D_AT, activations.scales, block_lanes) }
}

/// The exact integer of one super-block, as `formats::q3_k` defines it, spread over eight
/// lanes.
///
/// # Safety
/// The CPU must have AVX2; `block` must point at 110 readable bytes, `sums` at 16 i16 and
/// `quants` at 256 i8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_lanes(block: *const u8, sums: *const i16, quants: *const i8) -> __m256i {
    // SAFETY: the scales lie inside the block; `sums` holds 32 bytes.
    let (scales, sums) = unsafe { (signed_scales(block), _mm256_loadu_si256(sums.cast())) };
    let scales = _mm256_cvtepi8_epi16(scales);
    let offsets = _mm256_madd_epi16(scales, sums);
    let [first_scales, second_scales] = half_scales(scales);
    // SAFETY: the 32 high-bit bytes and the two halves' 32 low-bit bytes lie inside the block,
    // and each half reads 128 activations inside `quants`.
    let dots = unsafe {
        let high_bits = _mm256_loadu_si256(block.cast());
        let first_low = _mm256_loadu_si256(block.add(LOW_BITS_AT).cast());
        let second_low = _mm256_loadu_si256(block.add(LOW_BITS_AT + 32).cast());
        let first = half_runs(first_low, high_bits);
        let second = half_runs(second_low, _mm256_srli_epi16::<4>(high_bits));
        _mm256_add_epi32(
            half_dot(first, quants, first_scales),
            half_dot(second, quants.add(SUPER_BLOCK / 2), second_scales),
        )
    };
    // `OFFSET` is 4: the offsets are taken 4 times.
    _mm256_sub_epi32(dots, _mm256_slli_epi32::<2>(offsets))
}

/// The sixteen scales of a super-block, offset removed, as bytes in sub-block order.
///
/// # Safety
/// `block` must point at a whole super-block (the twelve scale bytes are read as eight and
/// four, so that nothing past them is).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn signed_scales(block: *const u8) -> __m128i {
    // SAFETY: bytes `SCALES_AT..SCALES_AT + 12` lie inside the block.
    let (low_bytes, high_bytes) = unsafe {
        (
            _mm_loadl_epi64(block.add(SCALES_AT).cast()),
            block.add(SCALES_AT + 8).cast::<i32>().read_unaligned(),
        )
    };
    let nibble = _mm_set1_epi8(0x0F);
    // Scale j's low four bits: the low nibbles of bytes 0..8, then their high nibbles.
    let low = _mm_unpacklo_epi64(
        _mm_and_si128(low_bytes, nibble),
        _mm_and_si128(_mm_srli_epi16::<4>(low_bytes), nibble),
    );
    // Scale j's high two bits: bits 2(j / 4), 2(j / 4) + 1 of byte 8 + j % 4, that is 32-bit
    // lane j / 4 of the four bytes shifted right by 2(j / 4), byte j % 4 of it.
    let shifted = _mm_srlv_epi32(_mm_set1_epi32(high_bytes), _mm_setr_epi32(0, 2, 4, 6));
    let high = _mm_and_si128(shifted, _mm_set1_epi8(3));
    let stored = _mm_or_si128(low, _mm_slli_epi16::<4>(high));
    _mm_sub_epi8(stored, _mm_set1_epi8(SCALE_OFFSET))
}

/// The four runs of stored quants (0..=7) of one half: the low bits from `low_bits` (bits 2r,
/// 2r + 1 for run r) and the high bit from bit r of `high_bits`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn half_runs(low_bits: __m256i, high_bits: __m256i) -> [__m256i; 4] {
    let two_bits = _mm256_set1_epi8(3);
    let third_bit = _mm256_set1_epi8(4);
    // What a 16-bit shift carries over from the neighbouring byte falls outside the masks.
    let run = |low: __m256i, high: __m256i| {
        _mm256_or_si256(
            _mm256_and_si256(low, two_bits),
            _mm256_and_si256(high, third_bit),
        )
    };
    [
        run(low_bits, _mm256_slli_epi16::<2>(high_bits)),
        run(
            _mm256_srli_epi16::<2>(low_bits),
            _mm256_slli_epi16::<1>(high_bits),
        ),
        run(_mm256_srli_epi16::<4>(low_bits), high_bits),
        run(
            _mm256_srli_epi16::<6>(low_bits),
            _mm256_srli_epi16::<1>(high_bits),
        ),
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
    use crate::formats::q3_k;

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        report_timing("Q3_K", q3_k::dot, fast, BYTES, &[D_AT]);
    }

    #[test]
    fn random_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_random_rows_match(q3_k::dot, fast, BYTES, &[D_AT]);
    }

    #[test]
    fn extreme_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_extreme_rows_match(q3_k::dot, fast, BYTES, &[D_AT]);
    }
}
