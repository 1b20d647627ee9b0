//! Q5_K: 256-value super-blocks (layout as ggml writes it).
//!
//! A super-block is 176 bytes: f16 `d`, f16 `dmin` and twelve bytes of packed 6-bit scales and
//! minimums exactly as Q4_K's (bytes 0..16, unpacked by [`q4_k::unpack_scales_and_mins`]),
//! then 32 bytes of fifth bits (bytes 16..48) and 128 bytes of low nibbles (bytes 48..176)
//! arranged as Q4_K's quants. The quant of value `l` (0..32) of sub-block `j` is its nibble
//! plus 16 times bit `j` of fifth-bit byte `l`; its value is `d · scale_j · q − dmin · min_j`.
//!
//! The dot product is Q4_K's (`q4_k::dot_with`) with these 5-bit quants: per super-block the
//! exact integers `Σ_j scale_j · Σ_l q_l · a_l` and `Σ_j min_j · Σ_l a_l`, combined by
//! [`q4_k::super_block_term`].

use crate::formats::q4_k;
use crate::super_rows::SuperRow;

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 176;

/// Where the 32 bytes of fifth bits start.
pub(crate) const HIGH_BITS_AT: usize = 16;

/// Where the 128 bytes of low nibbles start.
pub(crate) const QUANTS_AT: usize = 48;

/// The 5-bit quant of value `l` of sub-block `j`.
fn quant(block: &[u8], j: usize, l: usize) -> u8 {
    let low = q4_k::nibble_at(&block[QUANTS_AT..], j, l);
    let fifth = (block[HIGH_BITS_AT + l] >> j) & 1;
    low | fifth << 4
}

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    let block = &block[..BYTES];
    q4_k::dequantize_with(block, values, |j, l| quant(block, j, l));
}

/// One Q5_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    q4_k::dot_with(weights, BYTES, activations, quant)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::formats::SUPER_BLOCK;
    use crate::formats::q4_k::tests::{Bits, OwnedRow, exact_dot, random_blocks};
    use crate::formats::q4_k::{PACKED_SCALES_AT, RUN_BYTES, SUB_BLOCK, SUB_BLOCKS};

    #[test]
    fn a_hand_made_block_dequantizes_to_its_values() {
        let mut block = vec![0u8; BYTES];
        block[..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        block[2..4].copy_from_slice(&0x3400u16.to_le_bytes()); // dmin = 0.25
        // Scales 1, 2, …, 8 and minimums 8, 7, …, 1 (all below 16).
        block[PACKED_SCALES_AT..HIGH_BITS_AT]
            .copy_from_slice(&[1, 2, 3, 4, 8, 7, 6, 5, 0x45, 0x36, 0x27, 0x18]);
        for l in 0..SUB_BLOCK {
            // Fifth bit of value l set in sub-blocks j with j == l % 8 or j == 7.
            block[HIGH_BITS_AT + l] = 1 << (l % 8) | 0x80;
        }
        for run in 0..4 {
            for l in 0..RUN_BYTES {
                block[QUANTS_AT + run * RUN_BYTES + l] =
                    (l % 16) as u8 | ((15 - l % 16) as u8) << 4;
            }
        }
        let mut values = [0f32; SUPER_BLOCK];
        dequantize(&block, &mut values);
        for j in 0..SUB_BLOCKS {
            for l in 0..SUB_BLOCK {
                let low = if j % 2 == 0 { l % 16 } else { 15 - l % 16 };
                let fifth = if j == l % 8 || j == 7 { 16 } else { 0 };
                let q = (low + fifth) as f32;
                let expected = 0.5 * (j + 1) as f32 * q - 0.25 * (8 - j) as f32;
                assert_eq!(values[j * SUB_BLOCK + l], expected, "value {l} of {j}");
            }
        }
    }

    #[test]
    fn the_reference_dot_is_the_exact_dot_within_its_rounding_bound() {
        let mut bits = Bits::new(13);
        for blocks in [1, 2, 3, 6, 9] {
            let weights = random_blocks(&mut bits, blocks, BYTES);
            let row = OwnedRow::random(&mut bits, blocks);
            let (exact, magnitude) = exact_dot(&weights, BYTES, row.view(), quant);
            let got = f64::from(dot(&weights, row.view()));
            // Five roundings per super-block term, one per addition to the row's sum.
            let bound = (blocks + 5) as f64 * f64::from(f32::EPSILON) * magnitude;
            assert!(
                (got - exact).abs() <= bound,
                "{got} vs {exact} (bound {bound})"
            );
        }
    }

    #[test]
    fn the_largest_quants_reach_31() {
        let mut block = vec![0xFFu8; BYTES];
        block[..4].copy_from_slice(&[0x00, 0x3C, 0x00, 0x00]); // d = 1, dmin = 0
        let mut values = [0f32; SUPER_BLOCK];
        dequantize(&block, &mut values);
        assert!(values.iter().all(|value| *value == 63.0 * 31.0));
    }
}
