//! The tile of the 32-value formats with an offset or a minimum (Q4_0, Q5_0, Q5_1), computed
//! as outer products: no horizontal sums inside a block.
//!
//! Per block, the tile's four weight rows are unpacked once and transposed into four vectors
//! of columns: vector `k` holds values `8k..8k + 8` of rows 0, 1, 2 and 3, one 8-byte quarter
//! each. An activation row's eight values `8k..8k + 8`, broadcast to all four quarters, meet
//! vector `k` in one `maddubs`; the four `maddubs` are added in i16 and widened once by
//! `madd`, which leaves each row's dot in two adjacent i32 lanes. One `hadd` of two activation
//! rows' vectors finishes both: lanes `[r0·c, r1·c, r0·c', r1·c' | r2·c, r3·c, r2·c', r3·c']`
//! ([`LAYOUT`]), the layout every float operand of the block is spread to.
//!
//! Integer dots, exact:
//! - Q4_0 and Q5_0 enter `maddubs` as the signed values `w = q − c` (|w| ≤ 16) against the
//!   activations plus 128 (their sign bit flipped, 0..=255); that exceeds `Σw·a` by `128 · Σw`,
//!   computed once per block and row and subtracted. A pair of products is at most
//!   2 · 255 · 16 = 8160 in magnitude and an i16 lane of eight products at most 32640.
//! - Q5_1 enters its quants `q` (0..=31) unsigned against the signed activations: eight
//!   products at most 8 · 31 · 128 = 31744.
//!
//! No step saturates or wraps, for any activation byte. The float terms are the reference's
//! (`legacy::scaled_term`, `legacy::offset_term`: multiplies and adds in its order, never
//! fused), added to the reference's eight lanes per output (block `b` into lane `b % 8`, the
//! blocks after the last whole group of eight first) and combined by its `combine_lanes`, so
//! each output has the bits of `formats::legacy`'s dot.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::TOGETHER;
use super::tile::TILE_ROWS;
use crate::activations::ActivationRow;
#[cfg(target_arch = "x86_64")]
use {super::GROUP, super::legacy::Layout, super::tile::WIDE_GROUPS, crate::BLOCK};

/// Lane `i` of a pair's vector of outputs: weight row `LAYOUT[i].0` against the pair's first
/// (`0`) or second (`1`) activation row.
#[cfg(target_arch = "x86_64")]
const LAYOUT: [(usize, usize); 8] = [
    (0, 0),
    (1, 0),
    (0, 1),
    (1, 1),
    (2, 0),
    (3, 0),
    (2, 1),
    (3, 1),
];

/// Pairs of activation rows a call takes at most.
#[cfg(target_arch = "x86_64")]
const MOST_PAIRS: usize = WIDE_GROUPS * TOGETHER / 2;

/// The dot products of [`TILE_ROWS`] rows of Q4_0, Q5_0 or Q5_1 (`F`, block bytes) with up to
/// [`WIDE_GROUPS`] groups of [`TOGETHER`] activation rows, into `results` (one tile per group),
/// each with the bits of `formats::legacy`'s reference (see the module's notes).
///
/// # Safety
/// The CPU must have AVX2 and F16C; `activations` must hold at most [`WIDE_GROUPS`] groups
/// and `results` as many tiles; every weight row must hold `blocks` blocks of `F` and every
/// part of every activation row `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn outer_blocks<F: Layout>(
    weights: [&[u8]; TILE_ROWS],
    activations: &[[ActivationRow<'_>; TOGETHER]],
    blocks: usize,
    results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    let pairs = activations.len() * TOGETHER / 2;
    let pair = |p: usize| {
        let (group, first) = (2 * p / TOGETHER, 2 * p % TOGETHER);
        (activations[group][first], activations[group][first + 1])
    };
    let mut lanes = [[_mm256_setzero_ps(); GROUP]; MOST_PAIRS];
    let whole = blocks / GROUP * GROUP;
    let mut lifted = [[0u8; BLOCK]; 2 * MOST_PAIRS];
    for block in (whole..blocks).chain(0..whole) {
        // SAFETY: `block < blocks`, in range of every weight row and every part of every
        // activation row (the caller).
        let columns = unsafe {
            if F::BIASED {
                lift(activations, block, &mut lifted);
            }
            Columns::load::<F>(&weights, block)
        };
        for (p, lanes) in lanes[..pairs].iter_mut().enumerate() {
            let (first, second) = pair(p);
            let quants = if F::BIASED {
                [lifted[2 * p].as_ptr(), lifted[2 * p + 1].as_ptr()]
            } else {
                [first, second].map(|row| row.quants[block * BLOCK..].as_ptr().cast())
            };
            // SAFETY: as above; `quants` point at 32 readable bytes each.
            let terms = unsafe { pair_terms::<F>(&columns, quants, first, second, block) };
            lanes[block % GROUP] = _mm256_add_ps(lanes[block % GROUP], terms);
        }
    }
    for (p, lanes) in lanes[..pairs].iter().enumerate() {
        let mut sums = [0f32; 8];
        // SAFETY: `sums` holds eight f32, what an unaligned 256-bit store writes.
        unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), combined(lanes)) };
        for ((row, which), sum) in LAYOUT.into_iter().zip(sums) {
            let column = 2 * p + which;
            results[column / TOGETHER][row][column % TOGETHER] = sum;
        }
    }
}

/// Each output's eight lanes combined in the reference's order (`legacy::combine_lanes`),
/// eight outputs at a time.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn combined(lanes: &[__m256; GROUP]) -> __m256 {
    crate::formats::legacy::combine_lanes_with(lanes, |a, b| _mm256_add_ps(a, b))
}

/// A block of the tile's four weight rows, ready for any number of activation rows.
#[cfg(target_arch = "x86_64")]
struct Columns {
    /// Vector `k`: values `8k..8k + 8` of each row, row `r` in quarter `r`.
    values: [__m256i; 4],
    /// `128 · Σw` of each row, in [`LAYOUT`] (zero for Q5_1, which is not biased).
    bias: __m256i,
    /// The rows' scales in [`LAYOUT`].
    scales: __m256,
    /// The rows' minimums in [`LAYOUT`] (zero for the formats without).
    mins: __m256,
}

#[cfg(target_arch = "x86_64")]
impl Columns {
    /// Block `block` of every weight row, unpacked (`Layout::unpack`) and transposed.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; block `block` must be in range of every weight row.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load<F: Layout>(weights: &[&[u8]; TILE_ROWS], block: usize) -> Self {
        // SAFETY: passed on from the caller.
        let (rows, scales, mins) = unsafe { unpacked_tile::<F>(weights, block) };
        let values = transposed(rows);
        let bias = if F::BIASED {
            let ones = _mm256_set1_epi8(1);
            let sums = quarter_sums(values.map(|column| _mm256_maddubs_epi16(ones, column)));
            _mm256_slli_epi32(_mm256_hadd_epi32(sums, sums), 7)
        } else {
            _mm256_setzero_si256()
        };
        Self {
            values,
            bias,
            scales: spread_rows(scales),
            mins: spread_rows(mins),
        }
    }
}

/// Block `block` of four rows of a 32-value format with an offset or a minimum: each row's 32
/// values (`Layout::unpack`), and the rows' scales and minimums (zero without).
///
/// # Safety
/// The CPU must have AVX2 and F16C; block `block` must be in range of every row.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn unpacked_tile<F: Layout>(
    rows: &[&[u8]; TILE_ROWS],
    block: usize,
) -> ([__m256i; TILE_ROWS], __m128, __m128) {
    // SAFETY: the block's bytes in every row are readable (the caller); the scale is at 0 and
    // the minimum at `F::MIN`, inside the block.
    unsafe {
        let blocks = rows.map(|row| row.as_ptr().add(block * F::BYTES));
        (
            blocks.map(|block| F::unpack(block)),
            tile_halves(&blocks, 0),
            F::MIN.map_or(_mm_setzero_ps(), |at| tile_halves(&blocks, at)),
        )
    }
}

/// Four rows of 32 bytes as four vectors of 8-byte columns: vector `k` holds bytes
/// `8k..8k + 8` of row `r` in its quarter `r`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn transposed(rows: [__m256i; TILE_ROWS]) -> [__m256i; 4] {
    // Quarters [0, 2] and [1, 3] of rows 0 and 1, then of rows 2 and 3.
    let even_01 = _mm256_unpacklo_epi64(rows[0], rows[1]);
    let odd_01 = _mm256_unpackhi_epi64(rows[0], rows[1]);
    let even_23 = _mm256_unpacklo_epi64(rows[2], rows[3]);
    let odd_23 = _mm256_unpackhi_epi64(rows[2], rows[3]);
    [
        _mm256_permute2x128_si256(even_01, even_23, 0x20),
        _mm256_permute2x128_si256(odd_01, odd_23, 0x20),
        _mm256_permute2x128_si256(even_01, even_23, 0x31),
        _mm256_permute2x128_si256(odd_01, odd_23, 0x31),
    ]
}

/// Four vectors of i16 pair sums added (exact within the module's bounds) and widened: each
/// quarter's four lanes become two i32 lanes, so quarter `r` sums to lanes `2r` and `2r + 1`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn quarter_sums(pairs: [__m256i; 4]) -> __m256i {
    let sums = _mm256_add_epi16(
        _mm256_add_epi16(pairs[0], pairs[1]),
        _mm256_add_epi16(pairs[2], pairs[3]),
    );
    _mm256_madd_epi16(sums, _mm256_set1_epi16(1))
}

/// One activation row's block (32 signed bytes at `quants`) against the four columns: each
/// weight row's dot in two i32 lanes (see [`quarter_sums`]), plus `128 · Σw` when `F` is biased.
///
/// # Safety
/// The CPU must have AVX2; 32 bytes must be readable at `quants`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn row_dots<F: Layout>(columns: &[__m256i; 4], quants: *const u8) -> __m256i {
    let pairs = std::array::from_fn(|k| {
        // SAFETY: bytes `8k..8k + 8` of the 32 at `quants` are readable (the caller).
        let eight = unsafe { quants.add(8 * k).cast::<i64>().read_unaligned() };
        let broadcast = _mm256_set1_epi64x(eight);
        if F::BIASED {
            _mm256_maddubs_epi16(broadcast, columns[k])
        } else {
            _mm256_maddubs_epi16(columns[k], broadcast)
        }
    });
    quarter_sums(pairs)
}

/// Block `block`'s terms of the outputs of two activation rows, in [`LAYOUT`].
///
/// # Safety
/// The CPU must have AVX2; block `block` must be in range of every part of both rows.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_terms<F: Layout>(
    columns: &Columns,
    quants: [*const u8; 2],
    first: ActivationRow<'_>,
    second: ActivationRow<'_>,
    block: usize,
) -> __m256 {
    // SAFETY: the block's 32 quants, scale and sum of both rows are readable (the caller).
    let (dots, activation_scales, activation_sums) = unsafe {
        let dots = _mm256_hadd_epi32(
            row_dots::<F>(&columns.values, quants[0]),
            row_dots::<F>(&columns.values, quants[1]),
        );
        let scales = (
            first.scales.get_unchecked(block),
            second.scales.get_unchecked(block),
        );
        let sums = (
            first.sums.get_unchecked(block),
            second.sums.get_unchecked(block),
        );
        (
            dots,
            spread_pair(*scales.0, *scales.1),
            spread_pair(*sums.0, *sums.1),
        )
    };
    let dots = if F::BIASED {
        _mm256_sub_epi32(dots, columns.bias)
    } else {
        dots
    };
    let scaled = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(dots), columns.scales),
        activation_scales,
    );
    match F::MIN {
        Some(_) => _mm256_add_ps(scaled, _mm256_mul_ps(columns.mins, activation_sums)),
        None => scaled,
    }
}

/// Block `block` of every activation row plus 128 (sign bits flipped), into `lifted` in the
/// rows' order.
///
/// # Safety
/// The CPU must have AVX2; block `block` must be in range of every activation row's quants.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lift(
    activations: &[[ActivationRow<'_>; TOGETHER]],
    block: usize,
    lifted: &mut [[u8; BLOCK]; 2 * MOST_PAIRS],
) {
    let rows = activations.iter().flatten();
    for (row, lifted) in rows.zip(lifted.iter_mut()) {
        // SAFETY: the block's 32 quants are readable (the caller); `lifted` holds 32 bytes.
        unsafe {
            let quants = _mm256_loadu_si256(row.quants.as_ptr().add(block * BLOCK).cast());
            let flipped = _mm256_xor_si256(quants, _mm256_set1_epi8(i8::MIN));
            _mm256_storeu_si256(lifted.as_mut_ptr().cast(), flipped);
        }
    }
}

/// A value of each of the four weight rows (lane `r` of `values`) spread to [`LAYOUT`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn spread_rows(values: __m128) -> __m256 {
    let at = _mm256_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3);
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(values), at)
}

/// A value of each of the two activation rows spread to [`LAYOUT`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn spread_pair(first: f32, second: f32) -> __m256 {
    let half = _mm_shuffle_ps::<0>(_mm_set1_ps(first), _mm_set1_ps(second));
    _mm256_set_m128(half, half)
}

/// The f16 numbers at byte `at` of the tile's four blocks, widened to f32 (exactly, as
/// `half_at` widens one).
///
/// # Safety
/// The CPU must have AVX2 and F16C; two bytes must be readable at `at` of every block.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tile_halves(blocks: &[*const u8; TILE_ROWS], at: usize) -> __m128 {
    let half = |r: usize| {
        // SAFETY: the caller guarantees two readable bytes at `at` of block `r`.
        u64::from(unsafe { blocks[r].add(at).cast::<u16>().read_unaligned() })
    };
    let packed = half(0) | half(1) << 16 | half(2) << 32 | half(3) << 48;
    _mm_cvtph_ps(_mm_set_epi64x(0, packed as i64))
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn outer_blocks<F>(
    _: [&[u8]; TILE_ROWS],
    _: &[[ActivationRow<'_>; TOGETHER]],
    _: usize,
    _: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    unreachable!("no AVX2 outside x86_64")
}
