//! AVX2 dot product of Q6_K rows (equal to `formats::q6_k`'s), and the pieces Q3_K and Q2_K
//! share with it.
//!
//! A super-block is read as two halves of four runs of 32 quants; run `r` of half `h` holds
//! values `128h + 32r..128h + 32r + 32`, that is sub-blocks `8h + 2r` (its low 128-bit lane)
//! and `8h + 2r + 1` (its high lane). Each run's stored quants (unsigned) are multiplied with
//! their activations by `maddubs` into pairs, and the pairs by their sub-block's scale by
//! `madd` into i32 (exact: a Q6_K pair is at most 2 · 63 · 128 = 16128 in size, far from
//! i16's limit, and a scale times two pairs fits an i32 by far). The quants' offset is taken
//! out once per super-block through the activation sums: `madd(scales, sums)` gives
//! `Σ_j scales[j] · sums[j]` in eight lanes.
//!
//! Four super-blocks at a time, their eight lanes each are added up (`hadd`) into their four
//! exact integers, their f32 parts computed lane-wise with the reference's operations in the
//! reference's order, and the four parts added to the reference's four running sums
//! (`formats::q6_k::add_to_lanes`) with one vector add.

use super::Avx2;
use crate::formats::SUPER_BLOCK;
use crate::formats::q6_k::{self, BYTES, D_AT, HIGH_BITS_AT, SCALES_AT, SUB_BLOCKS};
use crate::super_rows::SuperRow;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// One Q6_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q6_k::checked_blocks(weights, activations, BYTES);
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

/// The dot product of a row of Q6_K or Q3_K: `(a · d) · I` of each super-block as
/// `formats::q6_k::scaled_integer` computes it, with `I` the sum of the eight lanes
/// `block_lanes(block)` gives, added into four running sums and combined as
/// `formats::q6_k::{add_to_lanes, combined_lanes}` do. The parts of four super-blocks are
/// computed side by side (lane-wise, the same operations in the same order) and added to the
/// four sums in one vector add.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` must hold one super-block of `block_bytes`
/// bytes, with its f16 scale `d` at `d_at`, for each of the `activation_scales`, and
/// `block_lanes` must be safe to call for each of them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn scaled_integer_row(
    weights: &[u8],
    block_bytes: usize,
    d_at: usize,
    activation_scales: &[f32],
    block_lanes: impl Fn(usize) -> __m256i,
) -> f32 {
    let group = Group {
        weights,
        block_bytes,
        activation_scales,
    };
    let blocks = activation_scales.len();
    let mut lanes = _mm_setzero_ps();
    for first in (0..blocks).step_by(FOUR) {
        let count = FOUR.min(blocks - first);
        // SAFETY: super-blocks `first..first + count` are in the row.
        let parts = unsafe { group.scaled_integers(first, count, d_at, &block_lanes) };
        lanes = _mm_add_ps(lanes, parts);
    }
    combined_lanes(lanes)
}

/// The row that groups of four super-blocks are read from.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Group<'a> {
    /// The row's super-blocks.
    pub(super) weights: &'a [u8],
    /// Bytes of one super-block.
    pub(super) block_bytes: usize,
    /// One activation scale per super-block.
    pub(super) activation_scales: &'a [f32],
}

#[cfg(target_arch = "x86_64")]
impl Group<'_> {
    /// `(a · d) · I` of super-blocks `first..first + count` (`count` at most four) lane by lane,
    /// `I` the lane sum of `block_lanes(block)`; lanes past `count` are zero.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C, and super-blocks `first..first + count` must be in the
    /// row (with their f16 scale at `d_at`) and safe for `block_lanes`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn scaled_integers(
        self,
        first: usize,
        count: usize,
        d_at: usize,
        block_lanes: &impl Fn(usize) -> __m256i,
    ) -> __m128 {
        // (Written out: `array::map` would call the closures, which cannot be inlined into it.)
        let quarter = |k: usize| {
            if k < count {
                fold_halves(block_lanes(first + k))
            } else {
                _mm_setzero_si128()
            }
        };
        let quarters = [quarter(0), quarter(1), quarter(2), quarter(3)];
        let integers = _mm_cvtepi32_ps(sums_of_quarters(quarters));
        // SAFETY: passed on from the caller.
        let (activation_scales, d) = unsafe {
            (
                self.activation_scales(first, count),
                self.halves(first, count, d_at),
            )
        };
        _mm_mul_ps(_mm_mul_ps(activation_scales, d), integers)
    }

    /// The activation scales of super-blocks `first..first + count`, zero past `count`.
    ///
    /// # Safety
    /// The CPU must have AVX2, and super-blocks `first..first + count` must be in the row.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn activation_scales(self, first: usize, count: usize) -> __m128 {
        let scales = self.activation_scales.as_ptr();
        if count == FOUR {
            // SAFETY: the caller guarantees the four scales.
            return unsafe { _mm_loadu_ps(scales.add(first)) };
        }
        let scale = |k: usize| {
            if k < count {
                self.activation_scales[first + k]
            } else {
                0.0
            }
        };
        _mm_setr_ps(scale(0), scale(1), scale(2), scale(3))
    }

    /// The f16 at byte `at` of super-blocks `first..first + count` as f32 (zero past `count`):
    /// the values of `formats::half_at` (the conversion is exact, and both quiet NaNs the same
    /// way), by one F16C instruction.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C, and super-blocks `first..first + count` must be in the
    /// row, each with an f16 at byte `at`.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn halves(self, first: usize, count: usize, at: usize) -> __m128 {
        let start = self.weights.as_ptr();
        let half = |k: usize| {
            if k < count {
                // SAFETY: the caller guarantees super-block `first + k` and its f16.
                unsafe {
                    start
                        .add((first + k) * self.block_bytes + at)
                        .cast::<i16>()
                        .read_unaligned()
                }
            } else {
                0
            }
        };
        _mm_cvtph_ps(_mm_setr_epi16(
            half(0),
            half(1),
            half(2),
            half(3),
            0,
            0,
            0,
            0,
        ))
    }
}

/// The exact integer of one super-block, as `formats::q6_k` defines it, spread over eight
/// lanes.
///
/// # Safety
/// The CPU must have AVX2; `block` must point at 210 readable bytes, `sums` at 16 i16 and
/// `quants` at 256 i8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn block_lanes(block: *const u8, sums: *const i16, quants: *const i8) -> __m256i {
    // SAFETY: `block` holds the 16 scale bytes at `SCALES_AT` and `sums` 32 bytes.
    let (packed_scales, sums) = unsafe {
        (
            _mm_loadu_si128(block.add(SCALES_AT).cast()),
            _mm256_loadu_si256(sums.cast()),
        )
    };
    let scales = _mm256_cvtepi8_epi16(packed_scales);
    let offsets = _mm256_madd_epi16(scales, sums);
    let [first_scales, second_scales] = half_scales(scales);
    // SAFETY: each half reads 64 bytes of low bits and 32 of high bits inside the block, and
    // 128 activations inside `quants`.
    let dots = unsafe {
        let first = half_runs(block, block.add(HIGH_BITS_AT));
        let second = half_runs(block.add(64), block.add(HIGH_BITS_AT + 32));
        _mm256_add_epi32(
            half_dot(first, quants, first_scales),
            half_dot(second, quants.add(SUPER_BLOCK / 2), second_scales),
        )
    };
    // `OFFSET` is 32: the offsets are taken 32 times.
    _mm256_sub_epi32(dots, _mm256_slli_epi32::<5>(offsets))
}

/// The four runs of stored quants (0..=63) of one half.
///
/// # Safety
/// `low_bits` must point at 64 readable bytes and `high_bits` at 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn half_runs(low_bits: *const u8, high_bits: *const u8) -> [__m256i; 4] {
    // SAFETY: the caller guarantees the 64 and 32 bytes.
    let (first, second, high) = unsafe {
        (
            _mm256_loadu_si256(low_bits.cast()),
            _mm256_loadu_si256(low_bits.add(32).cast()),
            _mm256_loadu_si256(high_bits.cast()),
        )
    };
    let nibble = _mm256_set1_epi8(0x0F);
    let top = _mm256_set1_epi8(0x30);
    // Bits 2r, 2r + 1 of the high byte become bits 4 and 5; what a 16-bit shift carries over
    // from the neighbouring byte falls outside `top`.
    [
        _mm256_or_si256(
            _mm256_and_si256(first, nibble),
            _mm256_and_si256(_mm256_slli_epi16::<4>(high), top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(second, nibble),
            _mm256_and_si256(_mm256_slli_epi16::<2>(high), top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(first), nibble),
            _mm256_and_si256(high, top),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(second), nibble),
            _mm256_and_si256(_mm256_srli_epi16::<2>(high), top),
        ),
    ]
}

/// Sixteen i16 sub-block scales as two vectors, each holding one half's eight scales in both
/// 128-bit lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn half_scales(scales: __m256i) -> [__m256i; 2] {
    [
        _mm256_permute2x128_si256::<0x00>(scales, scales),
        _mm256_permute2x128_si256::<0x11>(scales, scales),
    ]
}

/// `Σ scale · quant · activation` of one half's four runs (unsigned quants, at most 127 so
/// that `maddubs` reads them right), spread over eight i32 lanes.
///
/// # Safety
/// `activations` must point at 128 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn half_dot(
    runs: [__m256i; 4],
    activations: *const i8,
    scales: __m256i,
) -> __m256i {
    let mut total = _mm256_setzero_si256();
    for (run, quants) in runs.into_iter().enumerate() {
        // SAFETY: run `run` reads activations `32 run..32 run + 32` of the caller's 128.
        let activations = unsafe { _mm256_loadu_si256(activations.add(32 * run).cast()) };
        let pairs = _mm256_maddubs_epi16(quants, activations);
        let run_scales = _mm256_shuffle_epi8(scales, scale_pick(run));
        total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, run_scales));
    }
    total
}

/// The byte shuffle that spreads the i16 scale of sub-block `2 run` (of a half's eight) over
/// the low lane and that of sub-block `2 run + 1` over the high lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn scale_pick(run: usize) -> __m256i {
    let bytes_of = |scale: usize| ((2 * scale) | ((2 * scale + 1) << 8)) as i16;
    _mm256_set_m128i(
        _mm_set1_epi16(bytes_of(2 * run + 1)),
        _mm_set1_epi16(bytes_of(2 * run)),
    )
}

/// Super-blocks whose parts are computed side by side.
pub(super) const FOUR: usize = 4;

/// Eight i32 lanes added pairwise into four (lane `k` with lane `k + 4`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fold_halves(lanes: __m256i) -> __m128i {
    _mm_add_epi32(
        _mm256_castsi256_si128(lanes),
        _mm256_extracti128_si256::<1>(lanes),
    )
}

/// The lane sums of four vectors of four i32, in order (wrapping, which the exact integers
/// never need).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn sums_of_quarters(quarters: [__m128i; FOUR]) -> __m128i {
    _mm_hadd_epi32(
        _mm_hadd_epi32(quarters[0], quarters[1]),
        _mm_hadd_epi32(quarters[2], quarters[3]),
    )
}

/// `formats::q6_k::combined_lanes` of the four running sums: `(s0 + s2) + (s1 + s3)`.
///
/// A group of fewer than four super-blocks adds +0.0 to the sums it has no part for, which
/// leaves every sum as it is: a sum that starts from +0.0 is never −0.0 (x + y is −0.0 only
/// when both are), and x + (+0.0) is x for every other x, NaNs included.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn combined_lanes(lanes: __m128) -> f32 {
    let pairs = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn row_dot(_: &[u8], _: SuperRow<'_>) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

/// One row against [`TOGETHER`](super::TOGETHER) activation rows: the bits of as many [`dot`]
/// calls.
///
/// Each super-block's quants are unpacked and its scales spread once for the four rows; each
/// row's exact integer and its f32 part are then computed as [`dot`] computes them (the integer
/// by other, equally exact, steps), and its four running sums advance as [`dot`]'s do.
pub(super) fn dot_together(
    _: Avx2,
    weights: &[u8],
    activations: [SuperRow<'_>; super::TOGETHER],
) -> [f32; super::TOGETHER] {
    for row in activations {
        q6_k::checked_blocks(weights, row, BYTES);
    }
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2 and F16C; `checked_blocks`
    // checked that every row holds as many super-blocks of sums and quants as the weights
    // hold super-blocks (one per scale of the row).
    unsafe { rows_dot(weights, activations) }
}

/// The dot products of one weight row with four activation rows, each as [`row_dot`] computes
/// it: super-blocks taken four at a time, their integers added up lane-wise, scaled, and added
/// to the row's four running sums.
///
/// # Safety
/// The CPU must have AVX2 and F16C, and every activation row must hold as many super-blocks of
/// scales, sums and quants as `weights` holds super-blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn rows_dot(
    weights: &[u8],
    activations: [SuperRow<'_>; super::TOGETHER],
) -> [f32; super::TOGETHER] {
    let blocks = weights.len() / BYTES;
    let group = |row: usize| Group {
        weights,
        block_bytes: BYTES,
        activation_scales: activations[row].scales,
    };
    let mut lanes = [_mm_setzero_ps(); super::TOGETHER];
    for first in (0..blocks).step_by(FOUR) {
        let count = FOUR.min(blocks - first);
        // Quarter `k` of row `row`: super-block `first + k`'s eight lanes folded into four.
        let mut quarters = [[_mm_setzero_si128(); FOUR]; super::TOGETHER];
        for (k, block) in (first..first + count).enumerate() {
            // SAFETY: super-block `block` is in the weights and in every activation row.
            let rows = unsafe { rows_block_lanes(weights, activations, block) };
            for (quarters, lanes) in quarters.iter_mut().zip(rows) {
                quarters[k] = fold_halves(lanes);
            }
        }
        // SAFETY: super-blocks `first..first + count` are in the row, their f16 `d` at `D_AT`.
        let d = unsafe { group(0).halves(first, count, D_AT) };
        for (row, quarters) in quarters.into_iter().enumerate() {
            let integers = _mm_cvtepi32_ps(sums_of_quarters(quarters));
            // SAFETY: super-blocks `first..first + count` are in every activation row.
            let activation_scales = unsafe { group(row).activation_scales(first, count) };
            let parts = _mm_mul_ps(_mm_mul_ps(activation_scales, d), integers);
            lanes[row] = _mm_add_ps(lanes[row], parts);
        }
    }
    lanes.map(|lanes| combined_lanes(lanes))
}

/// The eight lanes of super-block `block` against each of the four activation rows, whose sum
/// is the super-block's exact integer with that row (as [`block_lanes`]'s is).
///
/// # Safety
/// The CPU must have AVX2, and super-block `block` must be in `weights` and in every
/// activation row's sums and quants.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rows_block_lanes(
    weights: &[u8],
    activations: [SuperRow<'_>; super::TOGETHER],
    block: usize,
) -> [__m256i; super::TOGETHER] {
    // SAFETY: the caller guarantees the super-block's 210 bytes, of which the 16 scale bytes
    // start at `SCALES_AT`.
    let block_start = unsafe { weights.as_ptr().add(block * BYTES) };
    // SAFETY: as above.
    let packed_scales = unsafe { _mm_loadu_si128(block_start.add(SCALES_AT).cast()) };
    let scales = _mm256_cvtepi8_epi16(packed_scales);
    let mut totals = [_mm256_setzero_si256(); super::TOGETHER];
    for (half, half_scales) in half_scales(scales).into_iter().enumerate() {
        // SAFETY: half `half` reads 64 bytes of low bits from `64 half` and 32 of high bits
        // from `HIGH_BITS_AT + 32 half`, inside the super-block.
        let runs = unsafe {
            half_runs(
                block_start.add(64 * half),
                block_start.add(HIGH_BITS_AT + 32 * half),
            )
        };
        let run_scales = [0, 1, 2, 3].map(|run| _mm256_shuffle_epi8(half_scales, scale_pick(run)));
        for (total, row) in totals.iter_mut().zip(activations) {
            // SAFETY: the half's 128 activations lie inside the row's super-block `block`.
            let quants = unsafe { row.quants.as_ptr().add(block * SUPER_BLOCK + 128 * half) };
            // SAFETY: as above.
            *total = _mm256_add_epi32(*total, unsafe { scaled_runs(runs, quants, run_scales) });
        }
    }
    for (total, row) in totals.iter_mut().zip(activations) {
        // SAFETY: the row's super-block `block` has 16 sums, 32 bytes.
        let sums = unsafe { _mm256_loadu_si256(row.sums.as_ptr().add(block * SUB_BLOCKS).cast()) };
        // `OFFSET` is 32: the offsets are taken 32 times.
        let offsets = _mm256_madd_epi16(scales, sums);
        *total = _mm256_sub_epi32(*total, _mm256_slli_epi32::<5>(offsets));
    }
    totals
}

/// [`half_dot`] with the four runs' scales already spread (`run_scales[run]` is
/// `shuffle(scales, scale_pick(run))`).
///
/// # Safety
/// The CPU must have AVX2, and `activations` must point at 128 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn scaled_runs(
    runs: [__m256i; 4],
    activations: *const i8,
    run_scales: [__m256i; 4],
) -> __m256i {
    let mut total = _mm256_setzero_si256();
    for (run, (quants, scales)) in runs.into_iter().zip(run_scales).enumerate() {
        // SAFETY: run `run` reads activations `32 run..32 run + 32` of the caller's 128.
        let activations = unsafe { _mm256_loadu_si256(activations.add(32 * run).cast()) };
        let pairs = _mm256_maddubs_epi16(quants, activations);
        total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs, scales));
    }
    total
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn rows_dot(_: &[u8], _: [SuperRow<'_>; super::TOGETHER]) -> [f32; super::TOGETHER] {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(test)]
pub(super) mod tests {
    //! Q6_K's AVX2 tests, and the checks that Q3_K's and Q2_K's share.

    use super::*;
    use crate::avx2::TOGETHER;
    use crate::formats::q6_k::tests::{Activations, Numbers, put_half, random_weights};

    /// Asserts that `fast` gives `reference`'s bits on random rows of 1 to 17 and of 33
    /// super-blocks (`block_bytes` each, finite f16 scales at the offsets `halves`).
    pub(in crate::avx2) fn assert_random_rows_match(
        reference: fn(&[u8], SuperRow<'_>) -> f32,
        fast: impl Fn(&[u8], SuperRow<'_>) -> f32,
        block_bytes: usize,
        halves: &[usize],
    ) {
        let mut numbers = Numbers::new(block_bytes as u64);
        for blocks in (1..=17).chain([33]) {
            for _ in 0..4 {
                let weights = random_weights(&mut numbers, blocks, block_bytes, halves);
                let activations = Activations::random(&mut numbers, blocks);
                let row = activations.row();
                let (expected, got) = (reference(&weights, row), fast(&weights, row));
                assert_eq!(
                    got.to_bits(),
                    expected.to_bits(),
                    "{blocks} blocks: {got} ≠ {expected}"
                );
            }
        }
    }

    /// Asserts that `fast` gives `reference`'s bits on rows of extreme weights (zero bytes, every
    /// byte 0xFF, 0x80, 0x7F, 0x55 or random, with f16 scales of 0, ±65504 or the smallest
    /// subnormal) against extreme activations (quants all 127, all −128, alternating ±127, zero
    /// or random, with scales from 0 to 1e30).
    pub(in crate::avx2) fn assert_extreme_rows_match(
        reference: fn(&[u8], SuperRow<'_>) -> f32,
        fast: impl Fn(&[u8], SuperRow<'_>) -> f32,
        block_bytes: usize,
        halves: &[usize],
    ) {
        let mut numbers = Numbers::new(7);
        for blocks in [1, 3, 8] {
            let activation_rows = extreme_activations(&mut numbers, blocks);
            for weights in extreme_weights(&mut numbers, blocks, block_bytes, halves) {
                for activations in &activation_rows {
                    let row = activations.row();
                    let (expected, got) = (reference(&weights, row), fast(&weights, row));
                    assert_eq!(got.to_bits(), expected.to_bits(), "{got} ≠ {expected}");
                }
            }
        }
    }

    /// Rows of extreme weights: every byte pattern with every choice of f16 scales.
    fn extreme_weights(
        numbers: &mut Numbers,
        blocks: usize,
        block_bytes: usize,
        halves: &[usize],
    ) -> Vec<Vec<u8>> {
        let mut rows = vec![vec![0u8; blocks * block_bytes]];
        let random = numbers.bytes(blocks * block_bytes);
        for pattern in [vec![0xFF], vec![0x80], vec![0x7F], vec![0x55], random] {
            for scale in [0.0, 65504.0, -65504.0, 6e-8, 1.0] {
                let mut weights: Vec<u8> = pattern
                    .iter()
                    .copied()
                    .cycle()
                    .take(blocks * block_bytes)
                    .collect();
                for block in weights.chunks_exact_mut(block_bytes) {
                    for (index, at) in halves.iter().enumerate() {
                        // Alternate the sign between d and dmin so that Q2_K's parts add up.
                        let sign = if index % 2 == 0 { 1.0 } else { -1.0 };
                        put_half(block, *at, sign * scale);
                    }
                }
                rows.push(weights);
            }
        }
        rows
    }

    /// Rows of extreme activations, their super-blocks' scales cycling through 1, 1e30, 0 and
    /// 3e-5.
    fn extreme_activations(numbers: &mut Numbers, blocks: usize) -> Vec<Activations> {
        let scales: Vec<f32> = [1.0, 1e30, 0.0, 3e-5]
            .into_iter()
            .cycle()
            .take(blocks)
            .collect();
        let length = blocks * SUPER_BLOCK;
        let patterns: [Vec<i8>; 4] = [
            vec![127; length],
            vec![-128; length],
            (0..length)
                .map(|at| if at % 3 == 0 { 127 } else { -127 })
                .collect(),
            vec![0; length],
        ];
        let mut rows: Vec<Activations> = patterns
            .into_iter()
            .map(|quants| Activations::from_quants(scales.clone(), quants))
            .collect();
        rows.push(Activations::random(numbers, blocks));
        rows
    }

    /// The AVX2 token, when this CPU has AVX2 (the tests pass vacuously without).
    pub(in crate::avx2) fn token() -> Option<Avx2> {
        let token = Avx2::detect();
        if token.is_none() {
            eprintln!("no AVX2 on this CPU: nothing to compare");
        }
        token
    }

    /// Prints the time of the reference and of `fast` per super-block (256 values of one row),
    /// over a 576 × 1536 matrix (six super-blocks a row) against one activation row.
    pub(in crate::avx2) fn report_timing(
        name: &str,
        reference: fn(&[u8], SuperRow<'_>) -> f32,
        fast: impl Fn(&[u8], SuperRow<'_>) -> f32,
        block_bytes: usize,
        halves: &[usize],
    ) {
        let (rows, blocks) = (576, 6);
        let mut numbers = Numbers::new(1);
        let weights = random_weights(&mut numbers, rows * blocks, block_bytes, halves);
        let activations = Activations::random(&mut numbers, blocks);
        // The fastest of many short passes over the matrix: other work on the machine only
        // ever slows a pass down.
        let time = |dot: &dyn Fn(&[u8], SuperRow<'_>) -> f32| {
            let mut fastest = f64::INFINITY;
            for _ in 0..200 {
                let start = std::time::Instant::now();
                let mut total = 0f32;
                for row in weights.chunks_exact(blocks * block_bytes) {
                    total += dot(std::hint::black_box(row), activations.row());
                }
                std::hint::black_box(total);
                fastest = fastest.min(start.elapsed().as_nanos() as f64);
            }
            fastest / (rows * blocks) as f64
        };
        let (slow, quick) = (time(&reference), time(&fast));
        println!("{name}: reference {slow:.1} ns, avx2 {quick:.1} ns per 256 values of a row");
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        report_timing("Q6_K", q6_k::dot, fast, BYTES, &[D_AT]);
    }

    #[test]
    fn f16c_reads_every_half_as_formats_half_at_does() {
        let Some(_) = token() else { return };
        let weights: Vec<u8> = (0..=u16::MAX).flat_map(u16::to_le_bytes).collect();
        let group = Group {
            weights: &weights,
            block_bytes: 2,
            activation_scales: &[],
        };
        for first in (0..=usize::from(u16::MAX)).step_by(FOUR) {
            let mut got = [0f32; FOUR];
            // SAFETY: the token exists only when the CPU has AVX2 and F16C; halves
            // `first..first + 4` are in `weights` and `got` holds four f32.
            unsafe { _mm_storeu_ps(got.as_mut_ptr(), group.halves(first, FOUR, 0)) };
            for (k, got) in got.iter().enumerate() {
                let expected = crate::formats::half_at(&weights, 2 * (first + k));
                assert_eq!(got.to_bits(), expected.to_bits(), "{:#06x}", first + k);
            }
        }
    }

    #[test]
    fn random_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_random_rows_match(q6_k::dot, fast, BYTES, &[D_AT]);
    }

    #[test]
    fn extreme_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let fast = |weights: &[u8], row: SuperRow<'_>| dot(token, weights, row);
        assert_extreme_rows_match(q6_k::dot, fast, BYTES, &[D_AT]);
    }

    /// Asserts that [`dot_together`] gives, for each of its four rows, the bits of the
    /// reference's one-row dot product.
    fn assert_together_matches(token: Avx2, weights: &[u8], rows: [SuperRow<'_>; TOGETHER]) {
        let got = dot_together(token, weights, rows);
        for (row, (got, activations)) in got.into_iter().zip(rows).enumerate() {
            let expected = q6_k::dot(weights, activations);
            let blocks = activations.scales.len();
            assert_eq!(
                got.to_bits(),
                expected.to_bits(),
                "row {row} of {blocks} blocks: {got} ≠ {expected}"
            );
        }
    }

    #[test]
    fn four_random_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let mut numbers = Numbers::new(46);
        for blocks in (1..=17).chain([32, 33, 35]) {
            for _ in 0..3 {
                let weights = random_weights(&mut numbers, blocks, BYTES, &[D_AT]);
                let owned: Vec<Activations> = (0..TOGETHER)
                    .map(|_| Activations::random(&mut numbers, blocks))
                    .collect();
                let rows = [0, 1, 2, 3].map(|row| owned[row].row());
                assert_together_matches(token, &weights, rows);
            }
        }
    }

    #[test]
    fn four_extreme_rows_give_the_reference_bits() {
        let Some(token) = token() else { return };
        let mut numbers = Numbers::new(47);
        for blocks in [1, 3, 4, 5, 8, 9] {
            let owned = extreme_activations(&mut numbers, blocks);
            for weights in extreme_weights(&mut numbers, blocks, BYTES, &[D_AT]) {
                // Every activation row in every one of the four places.
                for shift in 0..owned.len() {
                    let rows = [0, 1, 2, 3].map(|row| owned[(shift + row) % owned.len()].row());
                    assert_together_matches(token, &weights, rows);
                }
            }
        }
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing_together() {
        let Some(token) = token() else { return };
        for width in [1536, 768, 4096] {
            let blocks = width / SUPER_BLOCK;
            let rows = 256;
            let mut numbers = Numbers::new(2);
            let weights = random_weights(&mut numbers, rows * blocks, BYTES, &[D_AT]);
            let owned: Vec<Activations> = (0..TOGETHER)
                .map(|_| Activations::random(&mut numbers, blocks))
                .collect();
            let activations = [0, 1, 2, 3].map(|row| owned[row].row());
            // The fastest of many passes: other work on the machine only slows a pass down.
            let time = |dot: &dyn Fn(&[u8]) -> [f32; TOGETHER]| {
                let mut fastest = f64::INFINITY;
                for _ in 0..300 {
                    let start = std::time::Instant::now();
                    let mut total = 0f32;
                    for row in weights.chunks_exact(blocks * BYTES) {
                        total += dot(std::hint::black_box(row)).iter().sum::<f32>();
                    }
                    std::hint::black_box(total);
                    fastest = fastest.min(start.elapsed().as_nanos() as f64);
                }
                fastest / (rows * blocks * TOGETHER) as f64
            };
            let single = time(&|row| activations.map(|activations| dot(token, row, activations)));
            let together = time(&|row| dot_together(token, row, activations));
            println!(
                "Q6_K {width} wide: four one-row calls {single:.2} ns, four-row kernel \
                 {together:.2} ns per 256 values per activation row"
            );
        }
    }
}
