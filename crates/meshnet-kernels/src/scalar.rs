//! The scalar reference kernels: the arithmetic every other path must reproduce bit for bit.
//!
//! Per block the integer dot product is exact; the float part is ggml's, as candle 0.11 writes
//! it, accumulated block after block in order:
//! - Q4_1 × Q8_1: `sum += dot · d_w · d_a + m_w · s_a`
//! - Q8_0 × Q8_1: `sum += dot · d_w · d_a`

use crate::activations::ActivationRow;
use crate::matrix::WeightRow;
use crate::{BLOCK, Q4_1_QUANT_BYTES};

/// The exact integer dot product of one Q4_1 block's quants with 32 activation bytes: byte
/// `j`'s low nibble pairs with value `j`, its high nibble with value `j + 16`.
pub(crate) fn q4_1_block_dot(quants: &[u8], activations: &[i8]) -> i32 {
    let (low, high) = activations.split_at(Q4_1_QUANT_BYTES);
    quants
        .iter()
        .zip(low.iter().zip(high))
        .map(|(byte, (a_low, a_high))| {
            i32::from(byte & 0x0F) * i32::from(*a_low) + i32::from(byte >> 4) * i32::from(*a_high)
        })
        .sum()
}

/// The exact integer dot product of two blocks of 32 signed bytes.
pub(crate) fn q8_block_dot(quants: &[u8], activations: &[i8]) -> i32 {
    quants
        .iter()
        .zip(activations)
        .map(|(weight, activation)| i32::from(*weight as i8) * i32::from(*activation))
        .sum()
}

/// One Q4_1 weight row against one activation row.
pub(crate) fn dot_q4_1(weights: WeightRow<'_>, activations: ActivationRow<'_>) -> f32 {
    let mut sum = 0f32;
    for block in 0..weights.scales.len() {
        let dot = q4_1_block_dot(
            &weights.quants[block * Q4_1_QUANT_BYTES..(block + 1) * Q4_1_QUANT_BYTES],
            &activations.quants[block * BLOCK..(block + 1) * BLOCK],
        );
        sum += dot as f32 * weights.scales[block] * activations.scales[block]
            + weights.mins[block] * activations.sums[block];
    }
    sum
}

/// One Q8_0 weight row against one activation row.
pub(crate) fn dot_q8_0(weights: WeightRow<'_>, activations: ActivationRow<'_>) -> f32 {
    let mut sum = 0f32;
    for block in 0..weights.scales.len() {
        let dot = q8_block_dot(
            &weights.quants[block * BLOCK..(block + 1) * BLOCK],
            &activations.quants[block * BLOCK..(block + 1) * BLOCK],
        );
        sum += dot as f32 * weights.scales[block] * activations.scales[block];
    }
    sum
}
