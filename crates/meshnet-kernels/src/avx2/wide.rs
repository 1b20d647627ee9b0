//! Tiles on CPUs with AVX-512 VNNI, for Q4_0, Q5_0, Q5_1, Q8_0 and Q4_1: every lane of a
//! 512-bit vector is one output, weight row `r` against activation row `c` in lane `4r + c`,
//! and `vpdpbusd` adds each four-byte word's products into it, so a block's integer dot needs
//! no horizontal step.
//!
//! Per block, the tile's four weight rows are unpacked once and spread into eight vectors of
//! words: vector `k` holds bytes `4k..4k + 4` of row `r` in lanes `4r..4r + 4`. The activation
//! rows come interleaved in groups of four (`QuantizedRows::interleave`, done once per matmul):
//! per block, 16 bytes per word `k` holding word `k` of rows 0..4, which one broadcast load
//! repeats for every weight row. Eight `vpdpbusd` per group and block then leave the 16 exact
//! dots of the block in one vector.
//!
//! Integer dots, exact (`vpdpbusd` adds in i32 without saturating, far from its range):
//! - signed values (Q4_0 and Q5_0: `w = q − c`, |w| ≤ 16; Q8_0: the quants) meet the
//!   activations lifted by 128 (their sign bits flipped), which exceeds `Σw·a` by `128 · Σw`,
//!   computed once per block and row and taken off;
//! - unsigned quants (Q5_1: 0..=31, Q4_1: 0..=15) meet the activations as they are.
//!
//! The float terms are the reference's, lane by lane, multiplies and adds in its order and
//! never fused: `dot · d · d_a`, plus `m · s_a` for the formats with a minimum. They add up as
//! the reference adds them: for Q4_0, Q5_0 and Q5_1 in eight lanes per output (block `b` into
//! lane `b % 8`, the blocks after the last whole group of eight first) combined in
//! `legacy::combine_lanes`'s order (`formats::legacy`); for Q8_0 and Q4_1 onto one running sum,
//! block after block (`scalar.rs`). So each output has its reference's bits.
//!
//! Rows that come without their groups interleaved (a caller other than a matmul) are
//! interleaved here, per call.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::TOGETHER;
use super::tile::TILE_ROWS;
use crate::activations::ActivationRow;
#[cfg(target_arch = "x86_64")]
use {
    super::GROUP,
    super::legacy::{self, Layout},
    super::outer,
    super::tile::{Q4_1Tile, Q8_0Tile, WIDE_GROUPS},
    crate::activations::{OwnedQuad, QUAD_BLOCK_BYTES, Quad},
    crate::matrix::WeightRow,
    crate::{BLOCK, Q4_1_QUANT_BYTES},
};

/// What the wide tile needs of a format.
#[cfg(target_arch = "x86_64")]
pub(super) trait WideFormat {
    /// The tile's weight rows.
    type Rows<'a>: Copy;

    /// Whether the values are signed (they meet the activations plus 128).
    const BIASED: bool;

    /// Whether a block's term adds `m · s_a`.
    const MIN: bool;

    /// Whether the terms add up in eight lanes per output (the 32-value formats with an offset
    /// or a minimum) rather than onto one running sum.
    const EIGHT_LANES: bool;

    /// Block `block` of every row: its 32 values (signed when [`Self::BIASED`]), and the
    /// rows' scales and minimums (zero without).
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C; block `block` must be in range of every row.
    unsafe fn block(rows: &Self::Rows<'_>, block: usize) -> ([__m256i; TILE_ROWS], __m128, __m128);
}

/// The scales or minimums of block `block` of four parsed rows.
///
/// # Safety
/// Block `block` must be in range of every slice.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn parsed_floats(values: [&[f32]; TILE_ROWS], block: usize) -> __m128 {
    // SAFETY: in range (the caller).
    let at = |r: usize| unsafe { *values[r].get_unchecked(block) };
    _mm_setr_ps(at(0), at(1), at(2), at(3))
}

/// The 32-value formats with an offset or a minimum, through their `Layout`.
macro_rules! legacy_wide {
    ($($format:ty),*) => {$(
        #[cfg(target_arch = "x86_64")]
        impl WideFormat for $format {
            type Rows<'a> = [&'a [u8]; TILE_ROWS];
            const BIASED: bool = <$format as Layout>::BIASED;
            const MIN: bool = <$format as Layout>::MIN.is_some();
            const EIGHT_LANES: bool = true;

            #[inline]
            #[target_feature(enable = "avx2,f16c")]
            unsafe fn block(
                rows: &Self::Rows<'_>,
                block: usize,
            ) -> ([__m256i; TILE_ROWS], __m128, __m128) {
                // SAFETY: passed on from the caller.
                unsafe { outer::unpacked_tile::<$format>(rows, block) }
            }
        }
    )*};
}

legacy_wide!(legacy::Q4_0, legacy::Q5_0, legacy::Q5_1);

#[cfg(target_arch = "x86_64")]
impl WideFormat for Q8_0Tile {
    type Rows<'a> = [WeightRow<'a>; TILE_ROWS];
    const BIASED: bool = true;
    const MIN: bool = false;
    const EIGHT_LANES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn block(rows: &Self::Rows<'_>, block: usize) -> ([__m256i; TILE_ROWS], __m128, __m128) {
        // SAFETY: the block's 32 quants and scale of every row are readable (the caller).
        unsafe {
            (
                rows.map(|row| _mm256_loadu_si256(row.quants.as_ptr().add(block * BLOCK).cast())),
                parsed_floats(rows.map(|row| row.scales), block),
                _mm_setzero_ps(),
            )
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl WideFormat for Q4_1Tile {
    type Rows<'a> = [WeightRow<'a>; TILE_ROWS];
    const BIASED: bool = false;
    const MIN: bool = true;
    const EIGHT_LANES: bool = false;

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn block(rows: &Self::Rows<'_>, block: usize) -> ([__m256i; TILE_ROWS], __m128, __m128) {
        // SAFETY: the block's 16 quant bytes, scale and minimum of every row are readable (the
        // caller).
        unsafe {
            (
                rows.map(|row| {
                    super::q4_1_nibbles(row.quants.as_ptr().add(block * Q4_1_QUANT_BYTES))
                }),
                parsed_floats(rows.map(|row| row.scales), block),
                parsed_floats(rows.map(|row| row.mins), block),
            )
        }
    }
}

/// The dot products of [`TILE_ROWS`] rows of format `F` with up to [`WIDE_GROUPS`] groups of
/// [`TOGETHER`] activation rows, into `results` (one tile per group), each with the bits of
/// the format's reference (see the module's notes).
///
/// # Safety
/// The CPU must have AVX2, F16C, AVX-512 F and BW, and AVX-512 VNNI (BW is not used, but every
/// CPU with VNNI has it, and the detection asks for it); `activations` must hold
/// at most [`WIDE_GROUPS`] groups and `results` as many tiles; every weight row must hold
/// `blocks` blocks of `F` and every part of every activation row `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn wide_blocks<F: WideFormat>(
    weights: F::Rows<'_>,
    activations: &[[ActivationRow<'_>; TOGETHER]],
    blocks: usize,
    results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    assert!(
        activations.len() <= WIDE_GROUPS && results.len() == activations.len(),
        "a tile of {} groups for {} results",
        activations.len(),
        results.len()
    );
    // Each group's interleaved rows: those it came with, or made here.
    let made: Vec<Option<OwnedQuad>> = (activations.iter())
        .map(|group| match interleaved(group, F::BIASED, blocks) {
            Some(_) => None,
            None => Some(Quad::of(group, blocks, F::BIASED)),
        })
        .collect();
    let quads: Vec<Quad<'_>> = (activations.iter().zip(&made))
        .map(|(group, made)| match made {
            Some(made) => made.quad(F::BIASED),
            None => interleaved(group, F::BIASED, blocks).expect("checked above"),
        })
        .collect();
    let mut lanes = [[_mm512_setzero_ps(); GROUP]; WIDE_GROUPS];
    let whole = blocks / GROUP * GROUP;
    let order = match F::EIGHT_LANES {
        true => (whole..blocks).chain(0..whole),
        false => (blocks..blocks).chain(0..blocks),
    };
    for block in order {
        // SAFETY: `block < blocks`, in range of every weight row (the caller).
        let columns = unsafe {
            let (values, scales, mins) = F::block(&weights, block);
            WideColumns::of(values, scales, mins, F::BIASED)
        };
        let lane = if F::EIGHT_LANES { block % GROUP } else { 0 };
        for (lanes, quad) in lanes.iter_mut().zip(&quads) {
            // SAFETY: every quad holds `blocks` blocks (`interleaved`, `Quad::of`).
            let terms = unsafe { group_terms::<F>(&columns, quad, block) };
            lanes[lane] = _mm512_add_ps(lanes[lane], terms);
        }
    }
    for (lanes, result) in lanes.iter().zip(results) {
        let sums = if F::EIGHT_LANES {
            combined(lanes)
        } else {
            lanes[0]
        };
        // SAFETY: a tile's 16 outputs are 16 f32 in a row (`[r][c]`, lane `4r + c`), what an
        // unaligned 512-bit store writes.
        unsafe { _mm512_storeu_ps(result.as_mut_ptr().cast(), sums) };
    }
}

/// The group's interleaved rows, when it came with them whole, lifted as asked, and in order
/// (row `c` of the group is member `c` of one and the same group of `blocks` blocks).
#[cfg(target_arch = "x86_64")]
fn interleaved<'a>(
    group: &[ActivationRow<'a>; TOGETHER],
    lifted: bool,
    blocks: usize,
) -> Option<Quad<'a>> {
    let first = group[0].quad?;
    let same = |c: usize| {
        group[c].quad.is_some_and(|quad| {
            quad.member == c && std::ptr::eq(quad.quants.as_ptr(), first.quants.as_ptr())
        })
    };
    let whole = first.quants.len() == blocks * QUAD_BLOCK_BYTES
        && first.scales.len() == blocks
        && first.sums.len() == blocks;
    (first.lifted == lifted && whole && (0..TOGETHER).all(same)).then_some(first)
}

/// Each output's eight lanes combined in the reference's order (`legacy::combine_lanes`),
/// sixteen outputs at a time.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn combined(lanes: &[__m512; GROUP]) -> __m512 {
    crate::formats::legacy::combine_lanes_with(lanes, |a, b| _mm512_add_ps(a, b))
}

/// A block of the tile's four weight rows, ready for any number of activation rows.
#[cfg(target_arch = "x86_64")]
struct WideColumns {
    /// Vector `k`: bytes `4k..4k + 4` of row `r` in lanes `4r..4r + 4`.
    values: [__m512i; 8],
    /// `128 · Σw` of row `r` in lanes `4r..4r + 4` (zero unless the values are signed).
    bias: __m512i,
    /// Row `r`'s scale in lanes `4r..4r + 4`.
    scales: __m512,
    /// Row `r`'s minimum in lanes `4r..4r + 4` (zero for the formats without).
    mins: __m512,
}

#[cfg(target_arch = "x86_64")]
impl WideColumns {
    /// A block of the tile's four rows (`F::block`) laid out in columns, with `128 · Σw` of
    /// each row when `biased`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn of(rows: [__m256i; TILE_ROWS], scales: __m128, mins: __m128, biased: bool) -> Self {
        let joined = |first: __m256i, second: __m256i| {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(first), second)
        };
        let (low, high) = (joined(rows[0], rows[1]), joined(rows[2], rows[3]));
        // Four-byte word `k` of rows 0 and 1 (from `low`, words `k` and `8 + k`) and of rows 2
        // and 3 (from `high`, selected by `16 + k` and `24 + k`), four lanes each.
        let values: [__m512i; 8] = std::array::from_fn(|k| {
            let k = k as i32;
            let at = _mm512_setr_epi32(
                k,
                k,
                k,
                k,
                8 + k,
                8 + k,
                8 + k,
                8 + k,
                16 + k,
                16 + k,
                16 + k,
                16 + k,
                24 + k,
                24 + k,
                24 + k,
                24 + k,
            );
            _mm512_permutex2var_epi32(low, at, high)
        });
        let bias = if biased {
            let ones = _mm512_set1_epi8(1);
            let sums = (values.iter()).fold(_mm512_setzero_si512(), |sums, column| {
                _mm512_dpbusd_epi32(sums, ones, *column)
            });
            _mm512_slli_epi32::<7>(sums)
        } else {
            _mm512_setzero_si512()
        };
        Self {
            values,
            bias,
            scales: spread_rows(scales),
            mins: spread_rows(mins),
        }
    }
}

/// Block `block`'s terms of a group's outputs (lane `4r + c`: weight row `r` against activation
/// row `c`), from the group's interleaved rows.
///
/// # Safety
/// The CPU must have the features of [`wide_blocks`]; `quad` must hold block `block`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn group_terms<F: WideFormat>(
    columns: &WideColumns,
    quad: &Quad<'_>,
    block: usize,
) -> __m512 {
    // SAFETY: the block's interleaved quants, scales and sums are readable (the caller).
    let (quants, activation_scales, activation_sums) = unsafe {
        (
            quad.quants.as_ptr().add(block * QUAD_BLOCK_BYTES),
            _mm512_broadcast_f32x4(_mm_loadu_ps(quad.scales.as_ptr().add(block).cast())),
            _mm512_broadcast_f32x4(_mm_loadu_ps(quad.sums.as_ptr().add(block).cast())),
        )
    };
    let mut dots = _mm512_setzero_si512();
    for (k, column) in columns.values.iter().enumerate() {
        // SAFETY: bytes `16k..16k + 16` of the block's 128 are readable (as above): word `k`
        // of the four rows, broadcast to the lanes of every weight row.
        let words = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(quants.add(16 * k).cast()) });
        dots = if F::BIASED {
            _mm512_dpbusd_epi32(dots, words, *column)
        } else {
            _mm512_dpbusd_epi32(dots, *column, words)
        };
    }
    let dots = if F::BIASED {
        _mm512_sub_epi32(dots, columns.bias)
    } else {
        dots
    };
    let scaled = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtepi32_ps(dots), columns.scales),
        activation_scales,
    );
    if F::MIN {
        _mm512_add_ps(scaled, _mm512_mul_ps(columns.mins, activation_sums))
    } else {
        scaled
    }
}

/// A value of each of the four weight rows (lane `r` of `values`) in lanes `4r..4r + 4`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
fn spread_rows(values: __m128) -> __m512 {
    let at = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm512_permutexvar_ps(at, _mm512_castps128_ps512(values))
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn wide_blocks<F>(
    _: impl Copy,
    _: &[[ActivationRow<'_>; TOGETHER]],
    _: usize,
    _: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::activations::QuantizedRows;

    #[test]
    fn a_group_is_read_interleaved_only_whole_in_order_and_lifted_as_asked() {
        let (blocks, cols) = (3, 3 * BLOCK);
        let input: Vec<f32> = (0..6 * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut rows = QuantizedRows::quantize(&input, 6, cols);
        rows.interleave(true);
        let group = |first: usize| std::array::from_fn(|c| rows.row(first + c));
        assert!(interleaved(&group(0), true, blocks).is_some());
        assert!(
            interleaved(&group(0), false, blocks).is_none(),
            "lifted otherwise"
        );
        assert!(
            interleaved(&group(0), true, blocks - 1).is_none(),
            "another length"
        );
        let rotated = std::array::from_fn(|c| rows.row((c + 1) % TOGETHER));
        assert!(
            interleaved(&rotated, true, blocks).is_none(),
            "members out of order"
        );
        // Rows 4 and 5 are a partial group: no interleaved view of them.
        assert!(rows.row(4).quad.is_none() && rows.row(5).quad.is_none());
        assert!(
            interleaved(&group(2), true, blocks).is_none(),
            "straddling two groups"
        );
    }

    #[test]
    fn interleaving_puts_word_k_of_row_c_at_sixteen_k_plus_four_c() {
        let cols = BLOCK;
        let input: Vec<f32> = (0..TOGETHER * cols).map(|i| i as f32 - 60.0).collect();
        for lifted in [false, true] {
            let mut rows = QuantizedRows::quantize(&input, TOGETHER, cols);
            rows.interleave(lifted);
            let quad = rows.row(0).quad.expect("a whole group");
            for c in 0..TOGETHER {
                let own = rows.row(c);
                assert_eq!(quad.scales[0][c].to_bits(), own.scales[0].to_bits());
                assert_eq!(quad.sums[0][c].to_bits(), own.sums[0].to_bits());
                for (at, quant) in own.quants.iter().enumerate() {
                    let (k, byte) = (at / 4, at % 4);
                    let want = (*quant as u8) ^ if lifted { 0x80 } else { 0 };
                    assert_eq!(
                        quad.quants[16 * k + 4 * c + byte],
                        want,
                        "row {c}, value {at}"
                    );
                }
            }
        }
    }
}
