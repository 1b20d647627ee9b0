//! Activations quantized once per matmul: each row cut into 32-value blocks of signed bytes
//! with a scale and the block's scaled sum (the layout ggml calls Q8_1).
//!
//! The arithmetic is ggml's `quantize_row_q8_1` as candle 0.11 writes it: the scale is
//! `max|x| / 127` rounded to f16, values are `round(x / scale)` with the unrounded scale, and
//! the sum is `f16(Σq) · f16(scale)` rounded to f16. Scales and sums are kept as the f32 values
//! of those f16 numbers, so the dot products see exactly what candle's would.

use half::f16;

use crate::{BLOCK, Kernel};

/// Rows of activations in quantized blocks.
#[derive(Clone, Debug, Default)]
pub struct QuantizedRows {
    rows: usize,
    blocks_per_row: usize,
    /// One scale per block, row after row.
    pub(crate) scales: Vec<f32>,
    /// One scaled sum per block.
    pub(crate) sums: Vec<f32>,
    /// 32 signed bytes per block.
    pub(crate) quants: Vec<i8>,
}

impl QuantizedRows {
    /// [`Self::quantize_with`] the reference kernel.
    #[cfg(test)]
    pub(crate) fn quantize(input: &[f32], rows: usize, cols: usize) -> Self {
        Self::quantize_with(Kernel::Scalar, input, rows, cols)
    }

    /// Quantizes `input`, `rows` rows of `cols` values each, with `kernel` (every kernel gives
    /// the same bits); `cols` must be a multiple of 32 and `input.len()` equal `rows × cols`
    /// (the caller checks both).
    pub(crate) fn quantize_with(kernel: Kernel, input: &[f32], rows: usize, cols: usize) -> Self {
        let blocks_per_row = cols / BLOCK;
        let blocks = rows * blocks_per_row;
        let mut quantized = Self {
            rows,
            blocks_per_row,
            scales: vec![0.0; blocks],
            sums: vec![0.0; blocks],
            quants: vec![0; blocks * BLOCK],
        };
        for (block, values) in input.chunks_exact(BLOCK).enumerate() {
            let quants = &mut quantized.quants[block * BLOCK..(block + 1) * BLOCK];
            let (scale, sum) = quantize_block(kernel, values, quants);
            quantized.scales[block] = scale;
            quantized.sums[block] = sum;
        }
        quantized
    }

    /// Joins quantized rows of `cols` values each, in order.
    pub(crate) fn concat(parts: Vec<Self>, cols: usize) -> Self {
        let mut joined = Self {
            rows: 0,
            blocks_per_row: cols / BLOCK,
            ..Self::default()
        };
        for part in parts {
            joined.rows += part.rows;
            joined.scales.extend(part.scales);
            joined.sums.extend(part.sums);
            joined.quants.extend(part.quants);
        }
        joined
    }

    /// Row `row`'s scales, sums and quants.
    pub(crate) fn row(&self, row: usize) -> ActivationRow<'_> {
        let blocks = row * self.blocks_per_row..(row + 1) * self.blocks_per_row;
        ActivationRow {
            scales: &self.scales[blocks.clone()],
            sums: &self.sums[blocks.clone()],
            quants: &self.quants[blocks.start * BLOCK..blocks.end * BLOCK],
        }
    }
}

/// One row of quantized activations.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActivationRow<'a> {
    pub(crate) scales: &'a [f32],
    pub(crate) sums: &'a [f32],
    pub(crate) quants: &'a [i8],
}

/// Quantizes 32 values into `quants` with `kernel`; returns the block's scale and scaled sum.
fn quantize_block(kernel: Kernel, values: &[f32], quants: &mut [i8]) -> (f32, f32) {
    let (scale, sum) = kernel.quantize_values(values, quants);
    let scale = f16::from_f32(scale);
    let scaled_sum = f16::from_f32(f16::from_f32(sum as f32).to_f32() * scale.to_f32());
    (scale.to_f32(), scaled_sum.to_f32())
}

/// Quantizes 32 values into `quants` (the reference): returns the unrounded scale
/// `max|x| / 127` and the sum of the quants `round(x / scale)`.
pub(crate) fn quantize_values(values: &[f32], quants: &mut [i8]) -> (f32, i32) {
    let largest = values.iter().fold(0f32, |largest, x| largest.max(x.abs()));
    let scale = largest / 127.0;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (quant, value) in quants.iter_mut().zip(values) {
        *quant = round_to_i8(value * inverse);
        sum += i32::from(*quant);
    }
    (scale, sum)
}

/// `x.round() as i8` (halves away from zero, saturating, NaN to 0) without a call to the C
/// library's `roundf`, so that a block's loop stays inline: `x` clamped to ±200 (beyond which
/// both saturate alike), truncated, and moved one away from zero when the dropped fraction
/// (exact) is at least one half.
#[inline]
pub(crate) fn round_to_i8(x: f32) -> i8 {
    let x = x.clamp(-200.0, 200.0);
    let whole = x as i32;
    let fraction = x - whole as f32;
    let rounded = whole + i32::from(fraction >= 0.5) - i32::from(fraction <= -0.5);
    rounded.clamp(i32::from(i8::MIN), i32::from(i8::MAX)) as i8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_to_i8_equals_rounding_then_casting() {
        let halves = (-600..=600).map(|k| k as f32 * 0.5);
        let near_halves = (-600..=600).flat_map(|k| {
            let half = k as f32 * 0.5;
            [half.next_down(), half.next_up()]
        });
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            -0.0,
        ];
        let spread = (0..=u32::MAX).step_by(4099).map(f32::from_bits);
        for x in halves.chain(near_halves).chain(special).chain(spread) {
            assert_eq!(round_to_i8(x), x.round() as i8, "{x}");
        }
    }

    #[test]
    fn a_block_round_trips_within_half_a_step() {
        let values: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) * 0.37).collect();
        let rows = QuantizedRows::quantize(&values, 1, 32);
        let scale = rows.scales[0];
        assert!(scale > 0.0);
        for (value, quant) in values.iter().zip(&rows.quants) {
            let back = f32::from(*quant) * scale;
            // Half a step, plus the f16 rounding of the scale over the whole range.
            assert!(
                (back - value).abs() <= scale * 0.5 + value.abs() * 1e-3,
                "{value} {back}"
            );
        }
        let sum: i32 = rows.quants.iter().map(|q| i32::from(*q)).sum();
        assert!((rows.sums[0] - sum as f32 * scale).abs() <= (sum as f32 * scale).abs() * 2e-3);
    }

    #[test]
    fn a_zero_block_has_a_zero_scale_and_zero_quants() {
        let rows = QuantizedRows::quantize(&[0.0; 64], 2, 32);
        assert_eq!(rows.scales, vec![0.0, 0.0]);
        assert!(rows.quants.iter().all(|q| *q == 0));
        assert_eq!(rows.row(1).quants.len(), 32);
    }
}
