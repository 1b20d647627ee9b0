//! Q3_K: 256-value super-blocks of 3-bit quants, every 16 values with a signed 6-bit scale.
//!
//! Layout of one super-block (110 bytes, as ggml writes it):
//! - bytes 0..32 (`hmask`): the high bit of each quant;
//! - bytes 32..96 (`qs`): the low two bits;
//! - bytes 96..108 (`scales`): sixteen 6-bit scales, packed;
//! - bytes 108..110 (`d`): an f16.
//!
//! Value `v` lies in half `h = v / 128` and, within it, in run `r = (v % 128) / 32` at position
//! `l = v % 32`. Its low bits are `(qs[32h + l] >> 2r) & 3`, its high bit is bit `4h + r` of
//! `hmask[l]`; with `q = low | high << 2` (0..=7) the value is `(d · s_j) · (q − 4)` for
//! sub-block `j = v / 16`. (ggml says it the other way round: the low bits, minus 4 when the
//! high bit is clear.) Scale `j` is `s_j = (low | high << 4) − 32` with `low` the nibble `j / 8`
//! (the low nibble first) of `scales[j % 8]` and `high = (scales[8 + j % 4] >> 2(j / 4)) & 3`.
//!
//! The dot product of a super-block with one of activations (scale `a`, quants `x`, `sums[j]`
//! the sum of `x` over sub-block `j`) is `(a · d) · I`, in f32 and in that order
//! ([`scaled_integer`], shared with Q6_K), with the exact integer
//! `I = Σ_j s_j · (Σ_{v in j} q_v · x_v − 4 · sums[j])`; the row's dot product adds the
//! super-blocks' parts into four running sums as Q6_K's does. Bound: with |x| ≤ 128 and
//! consistent sums, `|I| ≤ 16 · 32 · 16 · 4 · 128 < 2^23`.

use super::q6_k::{SUB_BLOCKS, lane_summed_dot, scaled_integer, sub_block_dots};
use super::{SUPER_BLOCK, half_at};
use crate::super_rows::{SUM_GROUP, SuperRow};

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 110;

/// Where the low two bits of the quants start.
pub(crate) const LOW_BITS_AT: usize = 32;

/// Where the twelve bytes of packed scales start.
pub(crate) const SCALES_AT: usize = 96;

/// Where the f16 super-block scale is.
pub(crate) const D_AT: usize = 108;

/// What every quant is offset by: the stored 0..=7 stands for −4..=3.
pub(crate) const OFFSET: i32 = 4;

/// What every scale is offset by: the stored 0..=63 stands for −32..=31.
pub(crate) const SCALE_OFFSET: i8 = 32;

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    let d = half_at(block, D_AT);
    let quants = unsigned_quants(block);
    let sub_blocks = values
        .chunks_exact_mut(SUM_GROUP)
        .zip(quants.chunks_exact(SUM_GROUP));
    for ((values, quants), scale) in sub_blocks.zip(signed_scales(block)) {
        let scale = d * f32::from(scale);
        for (value, quant) in values.iter_mut().zip(quants) {
            *value = scale * (i32::from(*quant) - OFFSET) as f32;
        }
    }
}

/// One Q3_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    lane_summed_dot(weights, activations, BYTES, |block, scale, sums, quants| {
        scaled_integer(
            scale,
            half_at(block, D_AT),
            block_integer(block, sums, quants),
        )
    })
}

/// The sixteen scales of a super-block, offset removed (−32..=31).
pub(crate) fn signed_scales(block: &[u8]) -> [i8; SUB_BLOCKS] {
    let packed = &block[SCALES_AT..D_AT];
    let mut scales = [0i8; SUB_BLOCKS];
    for (j, scale) in scales.iter_mut().enumerate() {
        let low = packed[j % 8] >> (4 * (j / 8)) & 0x0F;
        let high = packed[8 + j % 4] >> (2 * (j / 4)) & 3;
        *scale = (low | high << 4).cast_signed() - SCALE_OFFSET;
    }
    scales
}

/// The exact integer `Σ_j s_j · (Σ_{v in j} q_v · x_v − 4 · sums[j])` of one super-block.
fn block_integer(block: &[u8], sums: &[i16], quants: &[i8]) -> i32 {
    let dots = sub_block_dots(&unsigned_quants(block), quants);
    let terms = dots.iter().zip(signed_scales(block)).zip(sums);
    terms
        .map(|((dot, scale), sum)| i32::from(scale) * (dot - OFFSET * i32::from(*sum)))
        .sum()
}

/// The 256 stored quants (0..=7) of a super-block, in value order.
fn unsigned_quants(block: &[u8]) -> [u8; SUPER_BLOCK] {
    let mut quants = [0u8; SUPER_BLOCK];
    let high_bits = &block[..LOW_BITS_AT];
    for (half, quants) in quants.chunks_exact_mut(SUPER_BLOCK / 2).enumerate() {
        let low_bits = &block[LOW_BITS_AT + 32 * half..LOW_BITS_AT + 32 * half + 32];
        for (run, quants) in quants.chunks_exact_mut(32).enumerate() {
            let high_bit = 4 * half + run;
            for ((quant, low), high) in quants.iter_mut().zip(low_bits).zip(high_bits) {
                *quant = low >> (2 * run) & 3 | (high >> high_bit & 1) << 2;
            }
        }
    }
    quants
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::q6_k::tests::{
        Activations, Numbers, assert_near_float, dequantized, put_half, random_weights,
    };

    /// The scales of [`hand_made_block`], offset removed.
    const HAND_MADE_SCALES: [i8; 16] = [
        -31, -32, -32, -32, -1, -25, -32, -32, 2, -32, -32, -32, 21, -16, -32, -32,
    ];

    /// A hand-made block: d = 0.5, the scales [`HAND_MADE_SCALES`], and a few quants set (the
    /// others stored as 0, standing for −4).
    fn hand_made_block() -> Vec<u8> {
        let mut block = vec![0u8; BYTES];
        block[SCALES_AT] = 0x21; // low bits: scale 0 ← 1, scale 8 ← 2
        block[SCALES_AT + 4] = 0x5F; // scale 4 ← 15, scale 12 ← 5
        block[SCALES_AT + 5] = 0x07; // scale 5 ← 7, scale 13 ← 0
        block[SCALES_AT + 8] = 0b11_10_01_00; // high bits: 0 ← 0, 4 ← 1, 8 ← 2, 12 ← 3
        block[SCALES_AT + 9] = 0b01_00_00_00; // scale 13 ← 1
        block[3] = 0b1001_0011; // high bits of values 3, 35, 131 and 227 (bits 0, 1, 4, 7)
        block[LOW_BITS_AT + 3] = 0b11_10_01_11; // value 3 ← 3, 35 ← 1, 67 ← 2, 99 ← 3
        block[LOW_BITS_AT + 32 + 3] = 0b11_00_00_00; // value 227 ← 3
        put_half(&mut block, D_AT, 0.5);
        block
    }

    #[test]
    fn a_hand_made_block_unpacks_its_scales() {
        assert_eq!(signed_scales(&hand_made_block()), HAND_MADE_SCALES);
    }

    #[test]
    fn a_hand_made_block_dequantizes_to_its_values() {
        let scales = HAND_MADE_SCALES.map(f32::from);
        let mut expected: Vec<f32> = (0..SUPER_BLOCK).map(|v| -2.0 * scales[v / 16]).collect();
        let value_of = |scale: f32, offset_quant: f32| 0.5 * scale * offset_quant;
        // (value, d · scale · (q − 4))
        let set = [
            (3, value_of(-31.0, 3.0)),
            (35, value_of(-32.0, 1.0)),
            (67, value_of(-1.0, -2.0)),
            (99, value_of(-32.0, -1.0)),
            (131, value_of(2.0, 0.0)),
            (227, value_of(-32.0, 3.0)),
        ];
        for (value, expected_value) in set {
            expected[value] = expected_value;
        }
        let mut values = vec![f32::NAN; SUPER_BLOCK];
        dequantize(&hand_made_block(), &mut values);
        assert_eq!(values, expected);
    }

    #[test]
    fn the_hand_made_block_dots_exactly() {
        // Activations −1 at value 3 and 3 at value 67, scale 0.25: 0.25 · (46.5 + 3 · 1).
        let mut quants = vec![0i8; SUPER_BLOCK];
        quants[3] = -1;
        quants[67] = 3;
        let activations = Activations::from_quants(vec![0.25], quants);
        assert_eq!(dot(&hand_made_block(), activations.row()), 0.25 * 49.5);
    }

    #[test]
    fn the_reference_dot_is_the_float_dot_of_the_dequantized_values() {
        let mut numbers = Numbers::new(3);
        for blocks in [1, 2, 5, 9] {
            let weights = random_weights(&mut numbers, blocks, BYTES, &[D_AT]);
            let activations = Activations::random(&mut numbers, blocks);
            let values = dequantized(&weights, BYTES, dequantize);
            let magnitudes: Vec<f32> = values.iter().map(|value| value.abs()).collect();
            let row = activations.row();
            assert_near_float(dot(&weights, row), &values, &magnitudes, row);
        }
    }
}
