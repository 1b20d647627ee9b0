//! AVX2 dot product of Q4_K rows (equal to `formats::q4_k`'s), and the super-block loop and
//! integer helpers that Q5_K's shares.
//!
//! Per super-block the kernel computes the reference's two exact integers and hands them to
//! `q4_k::super_block_term`, adding the terms to the row's sum in super-block order as the
//! reference does, so the bits are the reference's:
//! - `scaled_dot = Σ_j scale_j · Σ_l q_l · a_l`: each run of 32 quant bytes is split into its
//!   low and high nibbles (sub-blocks `2c` and `2c + 1`), `maddubs` multiplies them with the
//!   activations into pairs, and `madd` against the sub-block's scale (in every i16 lane)
//!   scales and adds the pairs into i32 lanes.
//! - `scaled_min_sum = Σ_j min_j · Σ_l a_l`: one `madd` of the sixteen activation sums against
//!   the minimums, each in the two lanes of its sub-block's two sums.
//!
//! The twelve bytes of packed scales and minimums are unpacked in one 128-bit register, the
//! same u32 arithmetic as `q4_k::unpack_scales_and_mins` lane by lane (a test compares them);
//! the scalar unpacking cost this kernel a tenth of its time.
//!
//! Against four activation rows (`dot_together`, prefill) each super-block's run quants and
//! sub-block scales are unpacked once and dotted with the four rows in turn; the four rows'
//! integers are reduced together, and their float terms computed and added to the four running
//! sums lane by lane in one vector, with the same steps in the same order as one row's, so each
//! lane has its row's bits. It takes about 0.55 of the time of four one-row calls.
//!
//! Nothing saturates or wraps: a `maddubs` pair is at most 2 · 31 · 128 = 7936 (Q5_K's 5-bit
//! quants, even against -128), a scaled pair at most 2 · 63 · 7936 < 2^20, and an i32 lane
//! adds eight of those; the minimum products are at most 2 · 63 · 2048 each.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{Avx2, TOGETHER};
#[cfg(target_arch = "x86_64")]
use crate::formats::SUPER_BLOCK;
use crate::formats::q4_k;
#[cfg(target_arch = "x86_64")]
use crate::super_rows::SUM_GROUP;
use crate::super_rows::SuperRow;

/// A format whose super-blocks reduce to Q4_K's two integers (Q4_K and Q5_K).
pub(super) trait ScaledIntegers {
    /// Bytes of one super-block.
    const BYTES: usize;

    /// `(scaled_dot, scaled_min_sum)` of one super-block.
    ///
    /// # Safety
    /// The CPU must have AVX2; `block` must hold [`Self::BYTES`] bytes, `quants` 256 and
    /// `sums` 16.
    unsafe fn integers(block: &[u8], quants: &[i8], sums: &[i16]) -> (i32, i32);

    /// The unsigned quants of run `run` (0..4) of a super-block, 32 bytes of sub-block
    /// `2 · run`, then 32 of sub-block `2 · run + 1`.
    ///
    /// # Safety
    /// The CPU must have AVX2; `block` must hold [`Self::BYTES`] bytes and `run` be below 4.
    #[cfg(target_arch = "x86_64")]
    unsafe fn run_quants(block: &[u8], run: usize) -> [__m256i; 2];
}

/// Runs of 64 values (two sub-blocks sharing 32 quant bytes) in a super-block.
#[cfg(target_arch = "x86_64")]
pub(super) const RUNS: usize = SUPER_BLOCK / 64;

/// Q4_K's super-blocks.
struct Q4K;

impl ScaledIntegers for Q4K {
    const BYTES: usize = q4_k::BYTES;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn integers(block: &[u8], quants: &[i8], sums: &[i16]) -> (i32, i32) {
        // SAFETY: `block` holds 144 bytes (the caller's promise).
        let scales_and_mins = unsafe { scales_and_mins(block) };
        let mut scaled = _mm256_setzero_si256();
        for run in 0..RUNS {
            // SAFETY: `block` holds 144 bytes (the caller's promise) and `run < 4`.
            let quants_of_run = unsafe { Self::run_quants(block, run) };
            // SAFETY: `quants` holds 256 activations (the caller's promise).
            scaled = unsafe { add_run(scaled, quants_of_run, quants, run, scales_and_mins) };
        }
        // SAFETY: `sums` holds 16 sums (the caller's promise).
        unsafe { finish(scaled, scales_and_mins, sums) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_quants(block: &[u8], run: usize) -> [__m256i; 2] {
        let nibble_mask = _mm256_set1_epi8(0x0F);
        // SAFETY: `block` holds 144 bytes and `run < 4` (the caller's promise), so the run's
        // 32 bytes at 16 + 32 · run ≤ 112 are in range.
        let packed = unsafe { load(block, q4_k::QUANTS_AT + run * q4_k::RUN_BYTES) };
        let low = _mm256_and_si256(packed, nibble_mask);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), nibble_mask);
        [low, high]
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn integers(_: &[u8], _: &[i8], _: &[i16]) -> (i32, i32) {
        unreachable!("no AVX2 outside x86_64")
    }
}

/// One Q4_K row against one activation row.
pub(super) fn dot(_: Avx2, weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q4_k::checked_super_blocks(weights, q4_k::BYTES, activations);
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2, and the lengths were checked.
    unsafe { row_sum::<Q4K>(weights, activations) }
}

/// A row's sum: `q4_k::super_block_term` of each super-block's integers, added in order.
///
/// # Safety
/// The CPU must have AVX2; `weights` must hold as many super-blocks of `K::BYTES` as
/// `activations` has scales, and the activations' sums and quants as many super-blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn row_sum<K: ScaledIntegers>(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    let blocks = weights
        .chunks_exact(K::BYTES)
        .zip(activations.quants.chunks_exact(SUPER_BLOCK))
        .zip(activations.sums.chunks_exact(SUPER_BLOCK / SUM_GROUP))
        .zip(activations.scales);
    let mut sum = 0f32;
    for (((block, quants), sums), scale) in blocks {
        // SAFETY: AVX2 is the caller's promise; `chunks_exact` gives the lengths `integers` needs.
        let (scaled_dot, min_sum) = unsafe { K::integers(block, quants, sums) };
        let scales = scale_and_min_scale(block);
        sum += q4_k::super_block_term(scales, *scale, scaled_dot, min_sum);
    }
    sum
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn row_sum<K: ScaledIntegers>(_: &[u8], _: SuperRow<'_>) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

/// A super-block's `d` and `dmin` (its first four bytes, two f16) as f32, converted by F16C
/// (exact, like `q4_k::scale_and_min_scale`, without a run-time feature check per call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn scale_and_min_scale(block: &[u8]) -> (f32, f32) {
    let halves = i32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    let floats = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
    (
        _mm_cvtss_f32(floats),
        _mm_cvtss_f32(_mm_movehdup_ps(floats)),
    )
}

/// The 32 bytes that start at element `at` of `elements`.
///
/// # Safety
/// `elements[at..]` must span at least 32 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn load<T>(elements: &[T], at: usize) -> __m256i {
    debug_assert!(size_of_val(&elements[at..]) >= 32);
    // SAFETY: the caller guarantees 32 readable bytes from element `at` on.
    unsafe { _mm256_loadu_si256(elements.as_ptr().add(at).cast()) }
}

/// A super-block's unpacked scales (bytes 0..8) and minimums (bytes 8..16), in both halves:
/// `q4_k::unpack_scales_and_mins` on the packed bytes as four u32 lanes.
///
/// # Safety
/// `block` must hold at least 20 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn scales_and_mins(block: &[u8]) -> __m256i {
    // SAFETY: the caller guarantees bytes 4..20 (the packing and four bytes after it).
    let words = unsafe { load_128(block, q4_k::PACKED_SCALES_AT) };
    // Lanes [w0, w2, w1, w2 >> 4], masked: low bits of scales 0..4, 4..8, minimums 0..4, 4..8.
    let low = _mm_shuffle_epi32::<0b10_01_10_00>(words);
    let low = _mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4));
    let low = _mm_and_si128(
        low,
        _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F),
    );
    // Lanes [w0, w0, w1, w1] >> 2, masked to each byte's bits 4..6 in lanes 1 and 3: the top
    // two bits of scales 4..8 and minimums 4..8.
    let top = _mm_srli_epi32::<2>(_mm_shuffle_epi32::<0b01_01_00_00>(words));
    let top = _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    _mm256_broadcastsi128_si256(_mm_or_si128(low, top))
}

/// The 16 bytes at `bytes[at..at + 16]`.
///
/// # Safety
/// `bytes` must hold at least `at + 16` bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn load_128(bytes: &[u8], at: usize) -> __m128i {
    debug_assert!(bytes.len() >= at + 16);
    // SAFETY: the caller guarantees 16 readable bytes from `at` on.
    unsafe { _mm_loadu_si128(bytes.as_ptr().add(at).cast()) }
}

/// Adds run `run`'s two sub-blocks (`quants[0]` is sub-block `2 · run`, `quants[1]` the next,
/// each as 32 unsigned bytes), each dotted with its activations and scaled, to `scaled`.
///
/// # Safety
/// `activations` must hold at least `64 · (run + 1)` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn add_run(
    scaled: __m256i,
    quants: [__m256i; 2],
    activations: &[i8],
    run: usize,
    scales_and_mins: __m256i,
) -> __m256i {
    let mut scaled = scaled;
    for (half, quants) in quants.into_iter().enumerate() {
        let sub_block = 2 * run + half;
        // SAFETY: the caller guarantees the 32 activations of `sub_block` are in range.
        let activations = unsafe { load(activations, 32 * sub_block) };
        let pairs = _mm256_maddubs_epi16(quants, activations);
        // Every i16 lane takes byte `sub_block` (the scale) and a zero (index with top bit set).
        let scale = i16::from_le_bytes([sub_block as u8, 0x80]);
        let scales = _mm256_shuffle_epi8(scales_and_mins, _mm256_set1_epi16(scale));
        scaled = _mm256_add_epi32(scaled, _mm256_madd_epi16(pairs, scales));
    }
    scaled
}

/// `(Σ scaled, Σ_j min_j · (sums[2j] + sums[2j + 1]))` of a super-block whose scaled sub-block
/// dots are spread over the lanes of `scaled`.
///
/// # Safety
/// `sums` must hold at least 16 sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn finish(scaled: __m256i, scales_and_mins: __m256i, sums: &[i16]) -> (i32, i32) {
    let mins = min_pairs(scales_and_mins);
    // SAFETY: the caller guarantees 16 sums (32 bytes).
    let min_products = _mm256_madd_epi16(unsafe { load(sums, 0) }, mins);
    let pairs = _mm256_hadd_epi32(scaled, min_products);
    let halves = _mm_add_epi32(
        _mm256_castsi256_si128(pairs),
        _mm256_extracti128_si256::<1>(pairs),
    );
    let totals = _mm_hadd_epi32(halves, halves);
    (_mm_cvtsi128_si32(totals), _mm_extract_epi32::<1>(totals))
}

/// The minimums as sixteen i16 lanes, each next to the sum of 16 activations it multiplies:
/// lane `k` holds minimum `k / 2` (the sums `2j` and `2j + 1` cover sub-block `j`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn min_pairs(scales_and_mins: __m256i) -> __m256i {
    // i16 lane k of the low half takes minimum k / 2, of the high half minimum 4 + k / 2.
    let pick = |min: u8| i16::from_le_bytes([8 + min, 0x80]);
    let pairs = _mm256_setr_epi16(
        pick(0),
        pick(0),
        pick(1),
        pick(1),
        pick(2),
        pick(2),
        pick(3),
        pick(3),
        pick(4),
        pick(4),
        pick(5),
        pick(5),
        pick(6),
        pick(6),
        pick(7),
        pick(7),
    );
    _mm256_shuffle_epi8(scales_and_mins, pairs)
}

/// One row against [`TOGETHER`] activation rows: the bits of as many [`dot`] calls, each
/// super-block unpacked once for the four rows ([`rows_sum`]).
pub(super) fn dot_together(
    _: Avx2,
    weights: &[u8],
    activations: [SuperRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    for row in activations {
        q4_k::checked_super_blocks(weights, q4_k::BYTES, row);
    }
    // SAFETY: the `Avx2` token exists only when the CPU has AVX2, and the lengths were checked.
    unsafe { rows_sum::<Q4K>(weights, activations) }
}

/// [`TOGETHER`] rows' sums against one weight row: [`row_sum`] of each, with the four running
/// sums in the lanes of one vector.
///
/// Per super-block the quants of each run and the scales of its two sub-blocks are unpacked
/// once and dotted with the four rows' activations in turn ([`four_integers`]); the four rows'
/// integers then go through `q4_k::super_block_term`'s float steps lane by lane (the same
/// multiplies and subtraction in the same order, never fused), and each lane's term is added
/// to its row's sum in super-block order, so every lane holds its row's [`row_sum`] bits.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `weights` must hold as many super-blocks of `K::BYTES` as
/// every row of `activations` has scales, and each row's sums and quants as many super-blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn rows_sum<K: ScaledIntegers>(
    weights: &[u8],
    activations: [SuperRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    let mut sums = _mm_setzero_ps();
    for (index, block) in weights.chunks_exact(K::BYTES).enumerate() {
        // SAFETY: AVX2 is the caller's promise; `block` holds `K::BYTES` bytes and every row
        // holds super-block `index` (the caller's promise on the lengths).
        let (scaled_dots, min_sums) = unsafe { four_integers::<K>(block, &activations, index) };
        let (d, dmin) = scale_and_min_scale(block);
        let [a, b, c, e] = activations.map(|row| row.scales[index]);
        let activation_scales = _mm_setr_ps(a, b, c, e);
        let dots = _mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(scaled_dots));
        let mins = _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(min_sums));
        let terms = _mm_mul_ps(activation_scales, _mm_sub_ps(dots, mins));
        sums = _mm_add_ps(sums, terms);
    }
    let mut results = [0f32; TOGETHER];
    // SAFETY: `results` holds four f32, what an unaligned 128-bit store writes.
    unsafe { _mm_storeu_ps(results.as_mut_ptr(), sums) };
    results
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn rows_sum<K: ScaledIntegers>(
    _: &[u8],
    _: [SuperRow<'_>; TOGETHER],
) -> [f32; TOGETHER] {
    unreachable!("no AVX2 outside x86_64")
}

/// Super-block `index`'s `(scaled_dot, scaled_min_sum)` against each of the four rows, lane
/// `k` for row `k`: `K::integers`' sums, each run's quants and each sub-block's scales
/// unpacked once for the four rows.
///
/// # Safety
/// The CPU must have AVX2; `block` must hold `K::BYTES` bytes, and every row at least
/// `index + 1` super-blocks of quants and sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn four_integers<K: ScaledIntegers>(
    block: &[u8],
    activations: &[SuperRow<'_>; TOGETHER],
    index: usize,
) -> (__m128i, __m128i) {
    // SAFETY: `block` holds `K::BYTES` ≥ 144 bytes (the caller's promise).
    let scales_and_mins = unsafe { scales_and_mins(block) };
    let mut scaled = [_mm256_setzero_si256(); TOGETHER];
    for run in 0..RUNS {
        // SAFETY: `block` holds `K::BYTES` bytes (the caller's promise) and `run < 4`.
        let quants = unsafe { K::run_quants(block, run) };
        for (half, quants) in quants.into_iter().enumerate() {
            let sub_block = 2 * run + half;
            let scale = i16::from_le_bytes([sub_block as u8, 0x80]);
            let scales = _mm256_shuffle_epi8(scales_and_mins, _mm256_set1_epi16(scale));
            let at = index * SUPER_BLOCK + 32 * sub_block;
            for (scaled, row) in scaled.iter_mut().zip(activations) {
                // SAFETY: every row holds super-block `index` (the caller's promise), so its
                // 32 quants of `sub_block` at `at` are in range.
                let pairs = _mm256_maddubs_epi16(quants, unsafe { load(row.quants, at) });
                *scaled = _mm256_add_epi32(*scaled, _mm256_madd_epi16(pairs, scales));
            }
        }
    }
    let mins = min_pairs(scales_and_mins);
    let min_products = activations.map(|row| {
        // SAFETY: every row holds super-block `index`'s 16 sums (the caller's promise).
        let sums = unsafe { load(row.sums, index * (SUPER_BLOCK / SUM_GROUP)) };
        _mm256_madd_epi16(sums, mins)
    });
    (lane_totals(scaled), lane_totals(min_products))
}

/// The sums of the eight i32 lanes of each of four vectors, in the four lanes of one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lane_totals(vectors: [__m256i; TOGETHER]) -> __m128i {
    let first = _mm256_hadd_epi32(vectors[0], vectors[1]);
    let second = _mm256_hadd_epi32(vectors[2], vectors[3]);
    // Each half: [vector 0, 1, 2, 3]'s sums of that half's four lanes.
    let halves = _mm256_hadd_epi32(first, second);
    _mm_add_epi32(
        _mm256_castsi256_si128(halves),
        _mm256_extracti128_si256::<1>(halves),
    )
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::formats::q4_k::tests::{Bits, OwnedRow, random_blocks};

    /// The reference and the AVX2 dot product of one format.
    pub(in crate::avx2) struct Paths {
        /// Bytes of one super-block.
        pub(in crate::avx2) block_bytes: usize,
        /// The scalar reference.
        pub(in crate::avx2) reference: fn(&[u8], SuperRow<'_>) -> f32,
        /// The AVX2 kernel.
        pub(in crate::avx2) fast: fn(Avx2, &[u8], SuperRow<'_>) -> f32,
        /// The AVX2 kernel against four activation rows at once.
        pub(in crate::avx2) together: Together,
    }

    /// A kernel of one weight row against four activation rows.
    pub(in crate::avx2) type Together =
        fn(Avx2, &[u8], [SuperRow<'_>; TOGETHER]) -> [f32; TOGETHER];

    impl Paths {
        /// Asserts that both paths give the same bits on `weights` against `row`.
        pub(in crate::avx2) fn assert_same(&self, avx2: Avx2, weights: &[u8], row: &OwnedRow) {
            let reference = (self.reference)(weights, row.view());
            let fast = (self.fast)(avx2, weights, row.view());
            assert_eq!(fast.to_bits(), reference.to_bits(), "{fast} vs {reference}");
        }

        /// Asserts that the four-row kernel gives the reference's bits for each of `rows`.
        fn assert_same_together(&self, avx2: Avx2, weights: &[u8], rows: [&OwnedRow; TOGETHER]) {
            let together = (self.together)(avx2, weights, rows.map(OwnedRow::view));
            for (k, (row, got)) in rows.into_iter().zip(together).enumerate() {
                let reference = (self.reference)(weights, row.view());
                assert_eq!(
                    got.to_bits(),
                    reference.to_bits(),
                    "row {k}: {got} vs {reference}"
                );
            }
        }

        /// Four random rows against one weight row, of many lengths.
        pub(in crate::avx2) fn check_random_rows_together(&self, avx2: Avx2) {
            let mut bits = Bits::new(0xF0F0);
            for blocks in (0..=13).chain([17, 31, 64]) {
                for _ in 0..4 {
                    let weights = random_blocks(&mut bits, blocks, self.block_bytes);
                    let rows: [OwnedRow; TOGETHER] =
                        std::array::from_fn(|_| OwnedRow::random(&mut bits, blocks));
                    self.assert_same_together(avx2, &weights, rows.each_ref());
                }
            }
        }

        /// The extreme rows of [`Self::extreme_cases`], four at a time in every rotation,
        /// against each extreme weight row.
        pub(in crate::avx2) fn check_extremes_together(&self, avx2: Avx2) {
            let (rows, weights) = self.extreme_cases();
            for weights in &weights {
                for first in 0..rows.len() {
                    let four = std::array::from_fn(|k| &rows[(first + k) % rows.len()]);
                    self.assert_same_together(avx2, weights, four);
                }
            }
        }

        /// Random rows of many lengths.
        pub(in crate::avx2) fn check_random_rows(&self, avx2: Avx2) {
            let mut bits = Bits::new(0x5EED);
            for blocks in (0..=13).chain([17, 31, 64]) {
                for _ in 0..8 {
                    let weights = random_blocks(&mut bits, blocks, self.block_bytes);
                    self.assert_same(avx2, &weights, &OwnedRow::random(&mut bits, blocks));
                }
            }
        }

        /// Zero blocks, the largest scales and quants, and activations at ±127.
        pub(in crate::avx2) fn check_extremes(&self, avx2: Avx2) {
            let (rows, weights) = self.extreme_cases();
            for row in &rows {
                for weights in &weights {
                    self.assert_same(avx2, weights, row);
                }
            }
        }

        /// Four activation rows of five super-blocks (every quant 127, every quant -127,
        /// random signs at ±127, random) and four weight rows (zero blocks, every scale,
        /// minimum and quant at its largest with `d` = `dmin` = 65504 and with -65504, random).
        fn extreme_cases(&self) -> (Vec<OwnedRow>, Vec<Vec<u8>>) {
            let mut bits = Bits::new(0xE87E);
            let blocks = 5;
            let extremes = |a: i8| OwnedRow::new(vec![1e3; blocks], vec![a; blocks * SUPER_BLOCK]);
            let signs = (0..blocks * SUPER_BLOCK)
                .map(|_| if bits.below(2) == 0 { 127 } else { -127 })
                .collect();
            let rows = [
                extremes(127),
                extremes(-127),
                OwnedRow::new(vec![0.5; blocks], signs),
                OwnedRow::random(&mut bits, blocks),
            ];
            let zero = vec![0u8; blocks * self.block_bytes];
            // Every scale, minimum and quant at its largest, with d = dmin = ±65504 (the
            // largest f16).
            let largest = |half: [u8; 2]| {
                let mut weights = vec![0xFFu8; blocks * self.block_bytes];
                for block in weights.chunks_exact_mut(self.block_bytes) {
                    block[..2].copy_from_slice(&half);
                    block[2..4].copy_from_slice(&half);
                }
                weights
            };
            let (largest, smallest) = (largest([0xFF, 0x7B]), largest([0xFF, 0xFB]));
            let random = random_blocks(&mut bits, blocks, self.block_bytes);
            (rows.into(), vec![zero, largest, smallest, random])
        }

        /// The best of twenty runs, in nanoseconds per 256 values per activation row, of four
        /// one-row AVX2 calls and of one four-row call, over 576 weight rows of `width` values
        /// against four activation rows.
        pub(in crate::avx2) fn time_together(&self, avx2: Avx2, width: usize) -> (f64, f64) {
            let (rows, blocks) = (576, width / SUPER_BLOCK);
            let mut bits = Bits::new(0x74);
            let weights = random_blocks(&mut bits, rows * blocks, self.block_bytes);
            let activations: [OwnedRow; TOGETHER] =
                std::array::from_fn(|_| OwnedRow::random(&mut bits, blocks));
            let views = activations.each_ref().map(OwnedRow::view);
            let time = |dot: &dyn Fn(&[u8]) -> [f32; TOGETHER]| {
                let mut best = f64::INFINITY;
                for _ in 0..20 {
                    let start = std::time::Instant::now();
                    for weights in weights.chunks_exact(blocks * self.block_bytes) {
                        std::hint::black_box(dot(std::hint::black_box(weights)));
                    }
                    let nanos = start.elapsed().as_nanos() as f64;
                    best = best.min(nanos / (rows * blocks * TOGETHER) as f64);
                }
                best
            };
            let one_row = time(&|weights| views.map(|row| (self.fast)(avx2, weights, row)));
            let four_rows = time(&|weights| (self.together)(avx2, weights, views));
            (one_row, four_rows)
        }

        /// The best of twenty runs, in nanoseconds per 256 values per row, of each path (the
        /// reference, then AVX2) over 576 rows of 1536 values against one activation row.
        pub(in crate::avx2) fn time(&self, avx2: Avx2) -> (f64, f64) {
            let (rows, blocks) = (576, 1536 / SUPER_BLOCK);
            let mut bits = Bits::new(0x71);
            let weights = random_blocks(&mut bits, rows * blocks, self.block_bytes);
            let row = OwnedRow::random(&mut bits, blocks);
            let time = |dot: &dyn Fn(&[u8]) -> f32| {
                let mut best = f64::INFINITY;
                for _ in 0..20 {
                    let start = std::time::Instant::now();
                    for weights in weights.chunks_exact(blocks * self.block_bytes) {
                        std::hint::black_box(dot(std::hint::black_box(weights)));
                    }
                    let nanos = start.elapsed().as_nanos() as f64;
                    best = best.min(nanos / (rows * blocks) as f64);
                }
                best
            };
            let reference = time(&|weights| (self.reference)(weights, row.view()));
            let fast = time(&|weights| (self.fast)(avx2, weights, row.view()));
            (reference, fast)
        }
    }

    /// Q4_K's two paths.
    const Q4_K: Paths = Paths {
        block_bytes: q4_k::BYTES,
        reference: q4_k::dot,
        fast: dot,
        together: dot_together,
    };

    #[test]
    fn the_vector_unpacking_is_the_reference_unpacking() {
        let Some(_) = Avx2::detect() else { return };
        let mut bits = Bits::new(0xACC);
        let mut blocks = random_blocks(&mut bits, 500, q4_k::BYTES);
        blocks[..16].fill(0xFF);
        for block in blocks.chunks_exact(q4_k::BYTES) {
            let reference = q4_k::unpack_scales_and_mins(block);
            let mut lanes = [0u8; 32];
            // SAFETY: the CPU has AVX2 (checked above), `block` holds 144 bytes and `lanes` 32.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), scales_and_mins(block)) };
            for half in lanes.chunks_exact(16) {
                assert_eq!(half[..8], reference.scales);
                assert_eq!(half[8..], reference.mins);
            }
        }
    }

    #[test]
    fn random_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q4_K.check_random_rows(avx2);
        }
    }

    #[test]
    fn extreme_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q4_K.check_extremes(avx2);
        }
    }

    #[test]
    fn four_random_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q4_K.check_random_rows_together(avx2);
        }
    }

    #[test]
    fn four_extreme_rows_give_the_reference_bits() {
        if let Some(avx2) = Avx2::detect() {
            Q4_K.check_extremes_together(avx2);
        }
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing_together() {
        if let Some(avx2) = Avx2::detect() {
            for width in [1536, 768] {
                let (one_row, four_rows) = Q4_K.time_together(avx2, width);
                println!(
                    "Q4_K {width} wide, ns per 256 values per activation row: four one-row \
                     calls {one_row:.1}, four-row kernel {four_rows:.1}"
                );
            }
        }
    }

    #[test]
    #[ignore = "timing: run in release mode with --nocapture"]
    fn timing() {
        if let Some(avx2) = Avx2::detect() {
            let (reference, fast) = Q4_K.time(avx2);
            println!("Q4_K ns per 256 values per row: reference {reference:.1}, AVX2 {fast:.1}");
        }
    }
}
