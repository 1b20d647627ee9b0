//! Q2_K: 256-value super-blocks of 2-bit quants, every 16 values with a 4-bit scale and a 4-bit
//! minimum.
//!
//! Layout of one super-block (84 bytes, as ggml writes it):
//! - bytes 0..16 (`scales`): byte `j` for values `16j..16j + 16`, the scale in its low nibble
//!   and the minimum in its high nibble;
//! - bytes 16..80 (`qs`): the quants, four to a byte;
//! - bytes 80..82 (`d`) and 82..84 (`dmin`): f16.
//!
//! Value `v` lies in half `h = v / 128` and, within it, in run `r = (v % 128) / 32` at position
//! `l = v % 32`. Its quant is `q = (qs[32h + l] >> 2r) & 3`; with `c = scales[v / 16]` the value
//! is `(d · (c & 15)) · q − dmin · (c >> 4)`.
//!
//! The dot product of a super-block with one of activations (scale `a`, quants `x`, `sums[j]`
//! the sum of `x` over sub-block `j`) is `(a · d) · S − (a · dmin) · M`, in f32 and in that
//! order ([`scaled_integers`]), with the exact integers
//! `S = Σ_j (c_j & 15) · Σ_{v in j} q_v · x_v` and `M = Σ_j (c_j >> 4) · sums[j]`; the row's
//! dot product adds the super-blocks' parts into four running sums as Q6_K's does. Bounds: with
//! |x| ≤ 128 and consistent sums, `|S| ≤ 16 · 15 · 16 · 3 · 128 < 2^21` and
//! `|M| ≤ 16 · 15 · 16 · 128 < 2^19`.

use super::q6_k::{lane_summed_dot, sub_block_dots};
use super::{SUPER_BLOCK, half_at};
use crate::super_rows::{SUM_GROUP, SuperRow};

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 84;

/// Where the quants start (after the sixteen scale-and-minimum bytes).
pub(crate) const QUANTS_AT: usize = 16;

/// Where the f16 scale of the scales is.
pub(crate) const D_AT: usize = 80;

/// Where the f16 scale of the minimums is.
pub(crate) const DMIN_AT: usize = 82;

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    let (d, dmin) = (half_at(block, D_AT), half_at(block, DMIN_AT));
    let quants = unsigned_quants(block);
    let sub_blocks = values
        .chunks_exact_mut(SUM_GROUP)
        .zip(quants.chunks_exact(SUM_GROUP));
    for ((values, quants), packed) in sub_blocks.zip(&block[..QUANTS_AT]) {
        let scale = d * f32::from(packed & 0x0F);
        let min = dmin * f32::from(packed >> 4);
        for (value, quant) in values.iter_mut().zip(quants) {
            *value = scale * f32::from(*quant) - min;
        }
    }
}

/// One Q2_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    lane_summed_dot(weights, activations, BYTES, |block, scale, sums, quants| {
        let (scaled, minimums) = block_integers(block, sums, quants);
        let (d, dmin) = (half_at(block, D_AT), half_at(block, DMIN_AT));
        scaled_integers(scale, d, dmin, scaled, minimums)
    })
}

/// The f32 part of one super-block: `(activation_scale · d) · scaled − (activation_scale ·
/// dmin) · minimums`, every operation rounded separately, the same on every path.
#[inline]
pub(crate) fn scaled_integers(
    activation_scale: f32,
    d: f32,
    dmin: f32,
    scaled: i32,
    minimums: i32,
) -> f32 {
    activation_scale * d * scaled as f32 - activation_scale * dmin * minimums as f32
}

/// The exact integers `(S, M)` of one super-block: `S = Σ_j (c_j & 15) · Σ_{v in j} q_v · x_v`
/// and `M = Σ_j (c_j >> 4) · sums[j]`.
fn block_integers(block: &[u8], sums: &[i16], quants: &[i8]) -> (i32, i32) {
    let dots = sub_block_dots(&unsigned_quants(block), quants);
    let packed = &block[..QUANTS_AT];
    let scaled = dots
        .iter()
        .zip(packed)
        .map(|(dot, packed)| i32::from(packed & 0x0F) * dot)
        .sum();
    let minimums = sums
        .iter()
        .zip(packed)
        .map(|(sum, packed)| i32::from(packed >> 4) * i32::from(*sum))
        .sum();
    (scaled, minimums)
}

/// The 256 quants (0..=3) of a super-block, in value order.
fn unsigned_quants(block: &[u8]) -> [u8; SUPER_BLOCK] {
    let mut quants = [0u8; SUPER_BLOCK];
    for (half, quants) in quants.chunks_exact_mut(SUPER_BLOCK / 2).enumerate() {
        let packed = &block[QUANTS_AT + 32 * half..QUANTS_AT + 32 * half + 32];
        for (run, quants) in quants.chunks_exact_mut(32).enumerate() {
            for (quant, packed) in quants.iter_mut().zip(packed) {
                *quant = packed >> (2 * run) & 3;
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

    /// A hand-made block: d = 0.5, dmin = 0.25, scale and minimum 2 and 1 but for sub-blocks 0
    /// (1, 3), 2 (0, 15) and 9 (15, 0), and a few quants set (the others 0).
    fn hand_made_block() -> Vec<u8> {
        let mut block = vec![0x12u8; QUANTS_AT];
        block[0] = 0x31;
        block[2] = 0xF0;
        block[9] = 0x0F;
        block.resize(BYTES, 0);
        block[QUANTS_AT] = 0b11_10_01_00; // value 0 ← 0, 32 ← 1, 64 ← 2, 96 ← 3
        block[QUANTS_AT + 32 + 20] = 0b00_01_10_11; // value 148 ← 3, 180 ← 2, 212 ← 1, 244 ← 0
        put_half(&mut block, D_AT, 0.5);
        put_half(&mut block, DMIN_AT, 0.25);
        block
    }

    #[test]
    fn a_hand_made_block_dequantizes_to_its_values() {
        let mut minimums = [1.0f32; 16];
        minimums[0] = 3.0;
        minimums[2] = 15.0;
        minimums[9] = 0.0;
        let mut expected: Vec<f32> = (0..SUPER_BLOCK).map(|v| -0.25 * minimums[v / 16]).collect();
        // (value, d · scale · q − dmin · minimum)
        let set = [
            (0, 0.5 * 1.0 * 0.0 - 0.25 * 3.0),
            (32, 0.5 * 0.0 * 1.0 - 0.25 * 15.0),
            (64, 0.5 * 2.0 * 2.0 - 0.25),
            (96, 0.5 * 2.0 * 3.0 - 0.25),
            (148, 0.5 * 15.0 * 3.0),
            (180, 0.5 * 2.0 * 2.0 - 0.25),
            (212, 0.5 * 2.0 * 1.0 - 0.25),
            (244, -0.25),
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
        // Activations 2 at value 148 and −4 at value 32, scale 0.5: S = 15 · 3 · 2 = 90,
        // M = 3 · 0 + 15 · (−4) + 0 · 2 = −60, so 0.25 · 90 − 0.125 · (−60).
        let mut quants = vec![0i8; SUPER_BLOCK];
        quants[148] = 2;
        quants[32] = -4;
        let activations = Activations::from_quants(vec![0.5], quants);
        assert_eq!(dot(&hand_made_block(), activations.row()), 22.5 + 7.5);
    }

    #[test]
    fn the_reference_dot_is_the_float_dot_of_the_dequantized_values() {
        let mut numbers = Numbers::new(2);
        for blocks in [1, 2, 5, 9] {
            let weights = random_weights(&mut numbers, blocks, BYTES, &[D_AT, DMIN_AT]);
            let activations = Activations::random(&mut numbers, blocks);
            let values = dequantized(&weights, BYTES, dequantize);
            let row = activations.row();
            assert_near_float(dot(&weights, row), &values, &magnitudes(&weights), row);
        }
    }

    /// `|d · scale · q| + |dmin · minimum|` of every value: the size of each value's two
    /// parts, which may cancel.
    fn magnitudes(weights: &[u8]) -> Vec<f32> {
        let mut magnitudes = Vec::new();
        for block in weights.chunks_exact(BYTES) {
            let (d, dmin) = (half_at(block, D_AT), half_at(block, DMIN_AT));
            let quants = unsigned_quants(block);
            for (v, quant) in quants.iter().enumerate() {
                let packed = block[v / 16];
                let scaled = d * f32::from(packed & 0x0F) * f32::from(*quant);
                magnitudes.push(scaled.abs() + (dmin * f32::from(packed >> 4)).abs());
            }
        }
        magnitudes
    }
}
