//! Activations quantized once per matmul for the k-quant formats: each row cut into 256-value
//! super-blocks of signed bytes with one f32 scale and the sum of every 16 quants (the layout
//! ggml calls Q8_K).
//!
//! A super-block's scale is `max|x| / 127` and its quants `round(x / scale)`, so every quant
//! lies in -127..=127 (a zero block has scale 0 and zero quants). The sums are exact, so a
//! kernel can fold a format's minimums or offsets into integer arithmetic.

use crate::Kernel;
use crate::activations::round_to_i8;

/// Values per super-block: the k-quants' block, and so their activations'.
pub(crate) const SUPER_BLOCK: usize = 256;

/// Values summed into one entry of a super-block's sums.
pub(crate) const SUM_GROUP: usize = 16;

/// Rows of activations in quantized super-blocks.
#[derive(Clone, Debug, Default)]
pub(crate) struct SuperRows {
    blocks_per_row: usize,
    /// One scale per super-block, row after row.
    scales: Vec<f32>,
    /// One sum per 16 quants.
    sums: Vec<i16>,
    /// 256 signed bytes per super-block.
    quants: Vec<i8>,
}

/// One row of activations in super-blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SuperRow<'a> {
    /// One scale per super-block.
    pub(crate) scales: &'a [f32],
    /// Sixteen sums per super-block: entry `j` is the sum of quants `16j..16j + 16`.
    pub(crate) sums: &'a [i16],
    /// 256 quants per super-block.
    pub(crate) quants: &'a [i8],
}

impl SuperRows {
    /// [`Self::quantize_with`] the reference kernel.
    #[cfg(test)]
    pub(crate) fn quantize(input: &[f32], rows: usize, cols: usize) -> Self {
        Self::quantize_with(Kernel::Scalar, input, rows, cols)
    }

    /// Quantizes `input`, `rows` rows of `cols` values each, with `kernel` (every kernel gives
    /// the same bits); `cols` must be a multiple of 256 and `input.len()` equal `rows × cols`
    /// (the caller checks both).
    pub(crate) fn quantize_with(kernel: Kernel, input: &[f32], rows: usize, cols: usize) -> Self {
        let blocks_per_row = cols / SUPER_BLOCK;
        let blocks = rows * blocks_per_row;
        let mut quantized = Self {
            blocks_per_row,
            scales: vec![0.0; blocks],
            sums: vec![0; blocks * SUPER_BLOCK / SUM_GROUP],
            quants: vec![0; blocks * SUPER_BLOCK],
        };
        for (block, values) in input.chunks_exact(SUPER_BLOCK).enumerate() {
            let quants = &mut quantized.quants[block * SUPER_BLOCK..(block + 1) * SUPER_BLOCK];
            quantized.scales[block] = kernel.quantize_super_values(values, quants);
            let sums = &mut quantized.sums
                [block * SUPER_BLOCK / SUM_GROUP..(block + 1) * SUPER_BLOCK / SUM_GROUP];
            for (sum, group) in sums.iter_mut().zip(quants.chunks_exact(SUM_GROUP)) {
                *sum = group.iter().map(|quant| i16::from(*quant)).sum();
            }
        }
        quantized
    }

    /// Row `row`'s scales, sums and quants.
    pub(crate) fn row(&self, row: usize) -> SuperRow<'_> {
        let blocks = row * self.blocks_per_row..(row + 1) * self.blocks_per_row;
        let groups = SUPER_BLOCK / SUM_GROUP;
        SuperRow {
            scales: &self.scales[blocks.clone()],
            sums: &self.sums[blocks.start * groups..blocks.end * groups],
            quants: &self.quants[blocks.start * SUPER_BLOCK..blocks.end * SUPER_BLOCK],
        }
    }
}

/// Quantizes 256 values into `quants` (the reference); returns the scale.
pub(crate) fn quantize_super_block(values: &[f32], quants: &mut [i8]) -> f32 {
    let largest = values.iter().fold(0f32, |largest, x| largest.max(x.abs()));
    let scale = largest / 127.0;
    let inverse = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for (quant, value) in quants.iter_mut().zip(values) {
        *quant = round_to_i8(value * inverse);
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quants_round_trip_within_half_a_step_and_sums_are_exact() {
        let values: Vec<f32> = (0..512).map(|i| ((i * 37) % 101) as f32 - 50.5).collect();
        let rows = SuperRows::quantize(&values, 1, 512);
        let row = rows.row(0);
        assert_eq!(row.scales.len(), 2);
        for (block, chunk) in values.chunks_exact(SUPER_BLOCK).enumerate() {
            let scale = row.scales[block];
            assert_eq!(scale, 50.5 / 127.0);
            for (value, quant) in chunk.iter().zip(&row.quants[block * SUPER_BLOCK..]) {
                assert!((f32::from(*quant) * scale - value).abs() <= scale * 0.5 + 1e-5);
            }
        }
        for (group, sum) in row.sums.iter().enumerate() {
            let quants = &row.quants[group * SUM_GROUP..(group + 1) * SUM_GROUP];
            assert_eq!(*sum, quants.iter().map(|q| i16::from(*q)).sum::<i16>());
        }
        assert!(row.quants.iter().all(|q| (-127..=127).contains(q)));
    }

    #[test]
    fn a_zero_super_block_has_a_zero_scale() {
        let rows = SuperRows::quantize(&[0.0; 256], 1, 256);
        assert_eq!(rows.row(0).scales, &[0.0]);
        assert!(rows.row(0).sums.iter().all(|s| *s == 0));
    }
}
