//! AVX2 kernels, the only `unsafe` code of meshnet.
//!
//! Every function here reproduces the scalar reference (`scalar.rs`) bit for bit: the integer
//! dot product of each block is computed with `maddubs`/`madd` (exact: no intermediate can
//! saturate, see below), eight blocks' sums are reduced together with `hadd`, and the float part
//! is computed lane-wise with separate multiplies and adds (never fused) and then added to the
//! running sum one block at a time, in block order, exactly as the scalar loop does. Attention
//! (`attention.rs`) is the exception: its reference is written with fused multiply-adds, and
//! the kernel uses FMA where the reference does. The prefill tiles of the 32-value formats
//! compute their integer dots as outer products (`outer.rs`), and with `vpdpbusd` in 512-bit
//! vectors where the CPU has AVX-512 VNNI (`wide.rs`), to the same bits.
//!
//! Saturation: `maddubs` adds two products of an unsigned and a signed byte into an i16. For
//! Q4_1 the unsigned side is a nibble (≤ 15) and the signed side an activation (|a| ≤ 128):
//! at most 2 · 15 · 128 = 3840. For Q8_0 the unsigned side is `|w|` (≤ 128) and the signed side
//! `±a` with |a| ≤ 127 (activations are rounded `x / (max|x| / 127)`): at most 2 · 128 · 127 =
//! 32512 < 32767.
//!
//! Safety: the kernels are reachable only through [`Avx2`], which exists only when the running
//! CPU reports AVX2, FMA and F16C, and reaches the 512-bit tiles only when `detect` also saw
//! AVX-512 F, BW and VNNI; every pointer read is inside a slice whose length is checked first.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

mod attention;
mod float;
mod legacy;
mod outer;
mod q2_k;
mod q3_k;
mod q4_k;
mod q5_k;
mod q6_k;
mod quantize;
mod tile;
mod wide;

pub(crate) use tile::{TILE_ROWS, WIDE_GROUPS};

use crate::activations::ActivationRow;
use crate::formats::{BlockFormat, FloatFormat, SuperFormat};
use crate::matrix::WeightRow;
use crate::super_rows::SUPER_BLOCK;
use crate::super_rows::SuperRow;
use crate::{BLOCK, Q4_1_QUANT_BYTES};

/// Blocks reduced together.
const GROUP: usize = 8;

/// Activation rows that [`Avx2::dot_q4_1_four`] and [`Avx2::dot_q8_0_four`] compute against one
/// weight row at once.
pub(crate) const TOGETHER: usize = 4;

/// Proof that the running CPU has AVX2, FMA and F16C: the only way to reach the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Avx2 {
    /// Whether the CPU also has AVX-512 F, BW and VNNI, which the wide tile (`wide.rs`) needs.
    wide: bool,
}

impl Avx2 {
    /// `Some` when the CPU this process runs on has AVX2, FMA and F16C (every CPU with AVX2
    /// that x86 vendors have shipped has the other two; the kernels may use all three).
    pub(crate) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            let wide = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni");
            return Some(Self { wide });
        }
        None
    }

    /// Whether the 512-bit tile runs here (the CPU has AVX-512 F, BW and VNNI).
    pub(crate) fn is_wide(self) -> bool {
        self.wide
    }

    /// This token without its 512-bit paths: the AVX2 kernels alone (the same bits).
    pub(crate) fn narrow(self) -> Self {
        Self { wide: false }
    }

    /// One Q4_1 weight row against one activation row (equal to `scalar::dot_q4_1`).
    pub(crate) fn dot_q4_1(self, weights: WeightRow<'_>, activations: ActivationRow<'_>) -> f32 {
        let blocks = checked_blocks(weights, activations, Q4_1_QUANT_BYTES);
        // SAFETY: `self` exists only when the CPU has AVX2 (`detect`), and `checked_blocks`
        // checked that every slice holds `blocks` blocks.
        unsafe { q4_1_groups(weights, activations, blocks) }
    }

    /// One Q4_1 weight row against four activation rows: the bits of four `dot_q4_1` calls.
    /// Each weight block is unpacked once for the four, and the four running sums advance side
    /// by side in one vector, so their block-by-block additions overlap instead of waiting on
    /// each other.
    pub(crate) fn dot_q4_1_four(
        self,
        weights: WeightRow<'_>,
        activations: [ActivationRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        let blocks = checked_rows(weights, &activations, Q4_1_QUANT_BYTES);
        // SAFETY: as in `dot_q4_1`, for each of the four activation rows.
        unsafe { q4_1_four(weights, activations, blocks) }
    }

    /// One Q8_0 weight row against four activation rows: the bits of four `dot_q8_0` calls.
    pub(crate) fn dot_q8_0_four(
        self,
        weights: WeightRow<'_>,
        activations: [ActivationRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        let blocks = checked_rows(weights, &activations, BLOCK);
        // SAFETY: as in `dot_q8_0`, for each of the four activation rows.
        unsafe { q8_0_four(weights, activations, blocks) }
    }

    /// [`TILE_ROWS`] Q8_0 weight rows against groups of [`TOGETHER`] activation rows (at most
    /// [`WIDE_GROUPS`]), one tile of results per group: the bits of as many `dot_q8_0` calls,
    /// each weight block read once for all the groups.
    pub(crate) fn dot_q8_0_tile(
        self,
        weights: [WeightRow<'_>; TILE_ROWS],
        activations: &[[ActivationRow<'_>; TOGETHER]],
        results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
    ) {
        let blocks = checked_groups(&weights, activations, results.len(), BLOCK);
        // SAFETY: as in `dot_q8_0`, for every weight row and every activation row; the groups
        // and results are as many, at most `WIDE_GROUPS`; `wide` only when the CPU has
        // AVX-512 F, BW and VNNI (`detect`).
        unsafe {
            match self.wide {
                true => wide::wide_blocks::<tile::Q8_0Tile>(weights, activations, blocks, results),
                false => tile::parsed::<tile::Q8_0Tile>(weights, activations, blocks, results),
            }
        }
    }

    /// [`Self::dot_q8_0_tile`] for Q4_1: the bits of as many `dot_q4_1` calls.
    pub(crate) fn dot_q4_1_tile(
        self,
        weights: [WeightRow<'_>; TILE_ROWS],
        activations: &[[ActivationRow<'_>; TOGETHER]],
        results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
    ) {
        let blocks = checked_groups(&weights, activations, results.len(), Q4_1_QUANT_BYTES);
        assert!(
            weights.iter().all(|row| row.mins.len() == blocks),
            "kernel operands of unequal length"
        );
        // SAFETY: as in `dot_q4_1`, for every weight row and every activation row; the groups
        // and results are as many, at most `WIDE_GROUPS`; `wide` only when the CPU has
        // AVX-512 F, BW and VNNI (`detect`).
        unsafe {
            match self.wide {
                true => wide::wide_blocks::<tile::Q4_1Tile>(weights, activations, blocks, results),
                false => tile::parsed::<tile::Q4_1Tile>(weights, activations, blocks, results),
            }
        }
    }

    /// One row of a 32-value format's block bytes against one activation row (equal to
    /// [`BlockFormat::dot`]).
    pub(crate) fn dot_blocks(
        self,
        format: BlockFormat,
        weights: &[u8],
        activations: ActivationRow<'_>,
    ) -> f32 {
        match format {
            BlockFormat::Q4_0 => legacy::dot_q4_0(self, weights, activations),
            BlockFormat::Q5_0 => legacy::dot_q5_0(self, weights, activations),
            BlockFormat::Q5_1 => legacy::dot_q5_1(self, weights, activations),
        }
    }

    /// One row of a k-quant's super-block bytes against one activation row (equal to
    /// [`SuperFormat::dot`]).
    pub(crate) fn dot_super(
        self,
        format: SuperFormat,
        weights: &[u8],
        activations: SuperRow<'_>,
    ) -> f32 {
        match format {
            SuperFormat::Q2K => q2_k::dot(self, weights, activations),
            SuperFormat::Q3K => q3_k::dot(self, weights, activations),
            SuperFormat::Q4K => q4_k::dot(self, weights, activations),
            SuperFormat::Q5K => q5_k::dot(self, weights, activations),
            SuperFormat::Q6K => q6_k::dot(self, weights, activations),
        }
    }

    /// One row of a 32-value format's block bytes against [`TOGETHER`] activation rows: the
    /// bits of as many [`Self::dot_blocks`] calls.
    pub(crate) fn dot_blocks_together(
        self,
        format: BlockFormat,
        weights: &[u8],
        activations: [ActivationRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        match format {
            BlockFormat::Q4_0 => legacy::dot_q4_0_together(self, weights, activations),
            BlockFormat::Q5_0 => legacy::dot_q5_0_together(self, weights, activations),
            BlockFormat::Q5_1 => legacy::dot_q5_1_together(self, weights, activations),
        }
    }

    /// [`TILE_ROWS`] rows of a 32-value format's block bytes against groups of [`TOGETHER`]
    /// activation rows (at most [`WIDE_GROUPS`]), one tile of results per group: the bits of
    /// as many [`Self::dot_blocks`] calls, each weight block unpacked once for all the groups
    /// (in 512-bit vectors where the CPU has AVX-512 VNNI, `wide.rs`; else `outer.rs`).
    pub(crate) fn dot_blocks_tile(
        self,
        format: BlockFormat,
        weights: [&[u8]; TILE_ROWS],
        activations: &[[ActivationRow<'_>; TOGETHER]],
        results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
    ) {
        assert!(
            activations.len() == results.len() && activations.len() <= WIDE_GROUPS,
            "a tile of {} groups for {} results",
            activations.len(),
            results.len()
        );
        let mut blocks = 0;
        for row in weights {
            for group in activations {
                blocks = legacy::checked_rows(row, group, format.block_bytes());
            }
        }
        let tile = match (format, self.wide) {
            (BlockFormat::Q4_0, true) => wide::wide_blocks::<legacy::Q4_0>,
            (BlockFormat::Q5_0, true) => wide::wide_blocks::<legacy::Q5_0>,
            (BlockFormat::Q5_1, true) => wide::wide_blocks::<legacy::Q5_1>,
            (BlockFormat::Q4_0, false) => outer::outer_blocks::<legacy::Q4_0>,
            (BlockFormat::Q5_0, false) => outer::outer_blocks::<legacy::Q5_0>,
            (BlockFormat::Q5_1, false) => outer::outer_blocks::<legacy::Q5_1>,
        };
        // SAFETY: the token exists only when the CPU has AVX2, FMA and F16C, and `wide` only
        // when it also has AVX-512 F, BW and VNNI (`detect`); `checked_rows` checked that every
        // weight row and every part of every activation row hold `blocks` blocks, and the
        // groups and results are as many, at most `WIDE_GROUPS`.
        unsafe { tile(weights, activations, blocks, results) }
    }

    /// One row of a k-quant's super-block bytes against [`TOGETHER`] activation rows: the bits
    /// of as many [`Self::dot_super`] calls.
    pub(crate) fn dot_super_together(
        self,
        format: SuperFormat,
        weights: &[u8],
        activations: [SuperRow<'_>; TOGETHER],
    ) -> [f32; TOGETHER] {
        match format {
            SuperFormat::Q4K => q4_k::dot_together(self, weights, activations),
            SuperFormat::Q5K => q5_k::dot_together(self, weights, activations),
            SuperFormat::Q6K => q6_k::dot_together(self, weights, activations),
            _ => activations.map(|row| self.dot_super(format, weights, row)),
        }
    }

    /// One row of unquantized weights against one row of f32 activations (equal to
    /// [`FloatFormat::dot`]).
    pub(crate) fn dot_floats(
        self,
        format: FloatFormat,
        weights: &[u8],
        activations: &[f32],
    ) -> f32 {
        float::dot(self, format, weights, activations)
    }

    /// Quantizes 32 activations into `quants` (equal to `activations::quantize_values`).
    pub(crate) fn quantize_values(self, values: &[f32], quants: &mut [i8]) -> (f32, i32) {
        assert!(
            values.len() == BLOCK && quants.len() == BLOCK,
            "a block of {} values into {} quants",
            values.len(),
            quants.len()
        );
        // SAFETY: `self` exists only when the CPU has AVX2; both slices hold 32 elements.
        unsafe { quantize::block(values, quants) }
    }

    /// Quantizes 256 activations into `quants` (equal to `super_rows::quantize_super_block`).
    pub(crate) fn quantize_super_values(self, values: &[f32], quants: &mut [i8]) -> f32 {
        assert!(
            values.len() == SUPER_BLOCK && quants.len() == SUPER_BLOCK,
            "a super-block of {} values into {} quants",
            values.len(),
            quants.len()
        );
        // SAFETY: `self` exists only when the CPU has AVX2; both slices hold 256 elements.
        unsafe { quantize::super_block(values, quants) }
    }

    /// One Q8_0 weight row against one activation row (equal to `scalar::dot_q8_0`).
    pub(crate) fn dot_q8_0(self, weights: WeightRow<'_>, activations: ActivationRow<'_>) -> f32 {
        let blocks = checked_blocks(weights, activations, BLOCK);
        // SAFETY: as in `dot_q4_1`.
        unsafe { q8_0_groups(weights, activations, blocks) }
    }
}

/// The number of blocks of the row, after checking that every slice holds that many.
fn checked_blocks(
    weights: WeightRow<'_>,
    activations: ActivationRow<'_>,
    quant_bytes: usize,
) -> usize {
    let blocks = weights.scales.len();
    assert!(
        activations.scales.len() == blocks
            && activations.sums.len() == blocks
            && activations.quants.len() == blocks * BLOCK
            && weights.quants.len() == blocks * quant_bytes
            && (weights.mins.is_empty() || weights.mins.len() == blocks),
        "kernel operands of unequal length"
    );
    blocks
}

/// [`checked_blocks`] for every one of several activation rows against one weight row.
fn checked_rows(
    weights: WeightRow<'_>,
    activations: &[ActivationRow<'_>],
    quant_bytes: usize,
) -> usize {
    let mut blocks = weights.scales.len();
    for row in activations {
        blocks = checked_blocks(weights, *row, quant_bytes);
    }
    blocks
}

/// [`checked_tile`] for every group of a tile, after checking that there are as many groups
/// as `results`, at most [`WIDE_GROUPS`].
fn checked_groups(
    weights: &[WeightRow<'_>],
    activations: &[[ActivationRow<'_>; TOGETHER]],
    results: usize,
    quant_bytes: usize,
) -> usize {
    assert!(
        activations.len() == results && results <= WIDE_GROUPS,
        "a tile of {} groups for {results} results",
        activations.len()
    );
    let mut blocks = 0;
    for group in activations {
        blocks = checked_tile(weights, group, quant_bytes);
    }
    blocks
}

/// [`checked_rows`] for every one of several weight rows.
fn checked_tile(
    weights: &[WeightRow<'_>],
    activations: &[ActivationRow<'_>],
    quant_bytes: usize,
) -> usize {
    let mut blocks = 0;
    for row in weights {
        blocks = checked_rows(*row, activations, quant_bytes);
    }
    blocks
}

/// Adds the float terms of eight blocks to `sum` in block order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_in_order(mut sum: f32, terms: __m256) -> f32 {
    let mut lanes = [0f32; GROUP];
    // SAFETY: `lanes` holds eight f32, what an unaligned 256-bit store writes.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), terms) };
    for term in lanes {
        sum += term;
    }
    sum
}

/// The sums of the eight i32 lanes of each of eight vectors, as one vector in input order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn reduce_eight(sums: [__m256i; GROUP]) -> __m256i {
    let pairs01 = _mm256_hadd_epi32(sums[0], sums[1]);
    let pairs23 = _mm256_hadd_epi32(sums[2], sums[3]);
    let pairs45 = _mm256_hadd_epi32(sums[4], sums[5]);
    let pairs67 = _mm256_hadd_epi32(sums[6], sums[7]);
    let quads0123 = _mm256_hadd_epi32(pairs01, pairs23);
    let quads4567 = _mm256_hadd_epi32(pairs45, pairs67);
    let low_halves = _mm256_permute2x128_si256(quads0123, quads4567, 0x20);
    let high_halves = _mm256_permute2x128_si256(quads0123, quads4567, 0x31);
    _mm256_add_epi32(low_halves, high_halves)
}

/// The integer dot product of one Q4_1 block with its activations, spread over eight lanes.
///
/// # Safety
/// `quants` must point at 16 readable bytes and `activations` at 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_1_block(quants: *const u8, activations: *const i8) -> __m256i {
    // SAFETY: passed on from the caller.
    unsafe { nibble_block_dot(q4_1_nibbles(quants), activations) }
}

/// One Q4_1 block's 32 quants as bytes in value order: the 16 low nibbles (values 0..16), then
/// the 16 high nibbles (values 16..32).
///
/// # Safety
/// `quants` must point at 16 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_1_nibbles(quants: *const u8) -> __m256i {
    let low_nibbles = _mm_set1_epi8(0x0F);
    // SAFETY: the caller guarantees 16 readable bytes at `quants`.
    let packed = unsafe { _mm_loadu_si128(quants.cast()) };
    let low = _mm_and_si128(packed, low_nibbles);
    let high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
    _mm256_set_m128i(high, low)
}

/// The integer dot product of 32 unpacked nibbles with 32 activations, spread over eight lanes.
///
/// # Safety
/// `activations` must point at 32 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nibble_block_dot(nibbles: __m256i, activations: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `activations`.
    let activations = unsafe { _mm256_loadu_si256(activations.cast()) };
    let pairs = _mm256_maddubs_epi16(nibbles, activations);
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// The integer dot product of one block of 32 signed weight bytes with its activations.
///
/// # Safety
/// `quants` and `activations` must each point at 32 readable bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_block(quants: *const u8, activations: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at each pointer.
    let (weights, activations) = unsafe {
        (
            _mm256_loadu_si256(quants.cast()),
            _mm256_loadu_si256(activations.cast()),
        )
    };
    let magnitudes = _mm256_sign_epi8(weights, weights);
    let signed = _mm256_sign_epi8(activations, weights);
    let pairs = _mm256_maddubs_epi16(magnitudes, signed);
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// The dot products of blocks `first..first + count` (`count` < 8) as f32, the rest zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn tail_dots(count: usize, block_dot: impl Fn(usize) -> __m256i) -> [f32; GROUP] {
    let mut dots = [_mm256_setzero_si256(); GROUP];
    for (offset, dot) in dots.iter_mut().take(count).enumerate() {
        *dot = block_dot(offset);
    }
    let mut lanes = [0i32; GROUP];
    // SAFETY: `lanes` holds eight i32, what an unaligned 256-bit store writes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), reduce_eight(dots)) };
    lanes.map(|lane| lane as f32)
}

/// The dot product of a whole Q4_1 row.
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_1_groups(
    weights: WeightRow<'_>,
    activations: ActivationRow<'_>,
    blocks: usize,
) -> f32 {
    let mut sum = 0f32;
    let whole = blocks / GROUP * GROUP;
    for first in (0..whole).step_by(GROUP) {
        let mut dots = [_mm256_setzero_si256(); GROUP];
        for (offset, dot) in dots.iter_mut().enumerate() {
            let block = first + offset;
            // SAFETY: `block < blocks`, so 16 quant bytes and 32 activation bytes are in range.
            *dot = unsafe {
                q4_1_block(
                    weights.quants.as_ptr().add(block * Q4_1_QUANT_BYTES),
                    activations.quants.as_ptr().add(block * BLOCK),
                )
            };
        }
        let dots = _mm256_cvtepi32_ps(reduce_eight(dots));
        // SAFETY: blocks `first..first + 8` are in range of every per-block slice.
        let (scales, activation_scales, mins, activation_sums) = unsafe {
            (
                _mm256_loadu_ps(weights.scales.as_ptr().add(first)),
                _mm256_loadu_ps(activations.scales.as_ptr().add(first)),
                _mm256_loadu_ps(weights.mins.as_ptr().add(first)),
                _mm256_loadu_ps(activations.sums.as_ptr().add(first)),
            )
        };
        let scaled = _mm256_mul_ps(_mm256_mul_ps(dots, scales), activation_scales);
        let terms = _mm256_add_ps(scaled, _mm256_mul_ps(mins, activation_sums));
        sum = add_in_order(sum, terms);
    }
    // SAFETY: passed on from the caller.
    unsafe { q4_1_tail(weights, activations, whole..blocks, sum) }
}

/// Adds the terms of the last blocks of a Q4_1 row (fewer than eight) to `sum`, in order.
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `tail.end` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_1_tail(
    weights: WeightRow<'_>,
    activations: ActivationRow<'_>,
    tail: std::ops::Range<usize>,
    mut sum: f32,
) -> f32 {
    if tail.is_empty() {
        return sum;
    }
    let dots = tail_dots(tail.len(), |offset| {
        let block = tail.start + offset;
        // SAFETY: `block < tail.end`, so 16 quant bytes and 32 activation bytes are in range.
        unsafe {
            q4_1_block(
                weights.quants.as_ptr().add(block * Q4_1_QUANT_BYTES),
                activations.quants.as_ptr().add(block * BLOCK),
            )
        }
    });
    for (block, dot) in tail.zip(dots) {
        sum += dot * weights.scales[block] * activations.scales[block]
            + weights.mins[block] * activations.sums[block];
    }
    sum
}

/// Adds four running sums' next eight terms to them, block by block in order: lane `k` of
/// `sums` is row `k`'s sum and `terms[k]` holds its terms for eight blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_columns_in_order(mut sums: __m128, terms: [__m256; TOGETHER]) -> __m128 {
    // Turn the 4 × 8 terms around into eight columns of four (block b, and b + 4 above it).
    let rows01_low = _mm256_unpacklo_ps(terms[0], terms[1]);
    let rows01_high = _mm256_unpackhi_ps(terms[0], terms[1]);
    let rows23_low = _mm256_unpacklo_ps(terms[2], terms[3]);
    let rows23_high = _mm256_unpackhi_ps(terms[2], terms[3]);
    let join = |low: __m256, high: __m256, upper: bool| {
        let (low, high) = (_mm256_castps_pd(low), _mm256_castps_pd(high));
        _mm256_castpd_ps(if upper {
            _mm256_unpackhi_pd(low, high)
        } else {
            _mm256_unpacklo_pd(low, high)
        })
    };
    let columns = [
        join(rows01_low, rows23_low, false),
        join(rows01_low, rows23_low, true),
        join(rows01_high, rows23_high, false),
        join(rows01_high, rows23_high, true),
    ];
    for column in columns {
        sums = _mm_add_ps(sums, _mm256_castps256_ps128(column));
    }
    for column in columns {
        sums = _mm_add_ps(sums, _mm256_extractf128_ps(column, 1));
    }
    sums
}

/// One Q4_1 weight row against four activation rows.
///
/// Each group of eight blocks is unpacked once into registers and used by the four rows in
/// turn; the last blocks (fewer than eight) are added row by row exactly as `q4_1_groups` adds
/// them. A group with a run-time block count kept its 32 partial dots in memory and ran slower
/// than one row at a time.
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q4_1_four(
    weights: WeightRow<'_>,
    activations: [ActivationRow<'_>; TOGETHER],
    blocks: usize,
) -> [f32; TOGETHER] {
    let mut sums = _mm_setzero_ps();
    let whole = blocks / GROUP * GROUP;
    for first in (0..whole).step_by(GROUP) {
        let mut nibbles = [_mm256_setzero_si256(); GROUP];
        for (offset, nibbles) in nibbles.iter_mut().enumerate() {
            let block = first + offset;
            // SAFETY: `block < blocks`, so 16 quant bytes are in range.
            *nibbles =
                unsafe { q4_1_nibbles(weights.quants.as_ptr().add(block * Q4_1_QUANT_BYTES)) };
        }
        // SAFETY: blocks `first..first + 8` are in range of every per-block slice.
        let (scales, mins) = unsafe {
            (
                _mm256_loadu_ps(weights.scales.as_ptr().add(first)),
                _mm256_loadu_ps(weights.mins.as_ptr().add(first)),
            )
        };
        let mut terms = [_mm256_setzero_ps(); TOGETHER];
        for (terms, row) in terms.iter_mut().zip(&activations) {
            let mut dots = [_mm256_setzero_si256(); GROUP];
            for (offset, dot) in dots.iter_mut().enumerate() {
                let block = first + offset;
                // SAFETY: `block < blocks`, so 32 activation bytes are in range.
                *dot = unsafe {
                    nibble_block_dot(nibbles[offset], row.quants.as_ptr().add(block * BLOCK))
                };
            }
            let dots = _mm256_cvtepi32_ps(reduce_eight(dots));
            // SAFETY: as above.
            let (activation_scales, activation_sums) = unsafe {
                (
                    _mm256_loadu_ps(row.scales.as_ptr().add(first)),
                    _mm256_loadu_ps(row.sums.as_ptr().add(first)),
                )
            };
            let scaled = _mm256_mul_ps(_mm256_mul_ps(dots, scales), activation_scales);
            *terms = _mm256_add_ps(scaled, _mm256_mul_ps(mins, activation_sums));
        }
        sums = add_columns_in_order(sums, terms);
    }
    let mut results = [0f32; TOGETHER];
    // SAFETY: `results` holds four f32, what an unaligned 128-bit store writes.
    unsafe { _mm_storeu_ps(results.as_mut_ptr(), sums) };
    for (result, row) in results.iter_mut().zip(activations) {
        // SAFETY: passed on from the caller.
        *result = unsafe { q4_1_tail(weights, row, whole..blocks, *result) };
    }
    results
}

/// The dot product of a whole Q8_0 row.
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_groups(
    weights: WeightRow<'_>,
    activations: ActivationRow<'_>,
    blocks: usize,
) -> f32 {
    let mut sum = 0f32;
    let whole = blocks / GROUP * GROUP;
    for first in (0..whole).step_by(GROUP) {
        let mut dots = [_mm256_setzero_si256(); GROUP];
        for (offset, dot) in dots.iter_mut().enumerate() {
            let block = first + offset;
            // SAFETY: `block < blocks`, so 32 bytes of each are in range.
            *dot = unsafe {
                q8_block(
                    weights.quants.as_ptr().add(block * BLOCK),
                    activations.quants.as_ptr().add(block * BLOCK),
                )
            };
        }
        let dots = _mm256_cvtepi32_ps(reduce_eight(dots));
        // SAFETY: blocks `first..first + 8` are in range of both scale slices.
        let (scales, activation_scales) = unsafe {
            (
                _mm256_loadu_ps(weights.scales.as_ptr().add(first)),
                _mm256_loadu_ps(activations.scales.as_ptr().add(first)),
            )
        };
        sum = add_in_order(
            sum,
            _mm256_mul_ps(_mm256_mul_ps(dots, scales), activation_scales),
        );
    }
    // SAFETY: passed on from the caller.
    unsafe { q8_0_tail(weights, activations, whole..blocks, sum) }
}

/// Adds the terms of the last blocks of a Q8_0 row (fewer than eight) to `sum`, in order.
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `tail.end` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_tail(
    weights: WeightRow<'_>,
    activations: ActivationRow<'_>,
    tail: std::ops::Range<usize>,
    mut sum: f32,
) -> f32 {
    if tail.is_empty() {
        return sum;
    }
    let dots = tail_dots(tail.len(), |offset| {
        let block = tail.start + offset;
        // SAFETY: `block < tail.end`, so 32 bytes of each are in range.
        unsafe {
            q8_block(
                weights.quants.as_ptr().add(block * BLOCK),
                activations.quants.as_ptr().add(block * BLOCK),
            )
        }
    });
    for (block, dot) in tail.zip(dots) {
        sum += dot * weights.scales[block] * activations.scales[block];
    }
    sum
}

/// One Q8_0 weight row against four activation rows, built as `q4_1_four`: the four running sums
/// advance side by side in one vector, and the last blocks are added row by row as
/// `q8_0_groups` adds them. The weight blocks are read again for each row (from L1).
///
/// # Safety
/// The CPU must have AVX2, and every slice must hold at least `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_four(
    weights: WeightRow<'_>,
    activations: [ActivationRow<'_>; TOGETHER],
    blocks: usize,
) -> [f32; TOGETHER] {
    let mut sums = _mm_setzero_ps();
    let whole = blocks / GROUP * GROUP;
    for first in (0..whole).step_by(GROUP) {
        // SAFETY: blocks `first..first + 8` are in range of every per-block slice.
        let scales = unsafe { _mm256_loadu_ps(weights.scales.as_ptr().add(first)) };
        let mut terms = [_mm256_setzero_ps(); TOGETHER];
        for (terms, row) in terms.iter_mut().zip(&activations) {
            let mut dots = [_mm256_setzero_si256(); GROUP];
            for (offset, dot) in dots.iter_mut().enumerate() {
                let block = first + offset;
                // SAFETY: `block < blocks`, so 32 bytes of each are in range.
                *dot = unsafe {
                    q8_block(
                        weights.quants.as_ptr().add(block * BLOCK),
                        row.quants.as_ptr().add(block * BLOCK),
                    )
                };
            }
            let dots = _mm256_cvtepi32_ps(reduce_eight(dots));
            // SAFETY: as above.
            let activation_scales = unsafe { _mm256_loadu_ps(row.scales.as_ptr().add(first)) };
            *terms = _mm256_mul_ps(_mm256_mul_ps(dots, scales), activation_scales);
        }
        sums = add_columns_in_order(sums, terms);
    }
    let mut results = [0f32; TOGETHER];
    // SAFETY: `results` holds four f32, what an unaligned 128-bit store writes.
    unsafe { _mm_storeu_ps(results.as_mut_ptr(), sums) };
    for (result, row) in results.iter_mut().zip(activations) {
        // SAFETY: passed on from the caller.
        *result = unsafe { q8_0_tail(weights, row, whole..blocks, *result) };
    }
    results
}

/// Stand-ins where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn q4_1_groups(_: WeightRow<'_>, _: ActivationRow<'_>, _: usize) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}

/// Stand-ins where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn q4_1_four(
    _: WeightRow<'_>,
    _: [ActivationRow<'_>; TOGETHER],
    _: usize,
) -> [f32; TOGETHER] {
    unreachable!("no AVX2 outside x86_64")
}

/// Stand-ins where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn q8_0_four(
    _: WeightRow<'_>,
    _: [ActivationRow<'_>; TOGETHER],
    _: usize,
) -> [f32; TOGETHER] {
    unreachable!("no AVX2 outside x86_64")
}

/// Stand-ins where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn q8_0_groups(_: WeightRow<'_>, _: ActivationRow<'_>, _: usize) -> f32 {
    unreachable!("no AVX2 outside x86_64")
}
