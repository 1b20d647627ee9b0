//! Activations quantized once per matmul: each row cut into 32-value blocks of signed bytes
//! with a scale and the block's scaled sum (the layout ggml calls Q8_1).
//!
//! The arithmetic is ggml's `quantize_row_q8_1` as candle 0.11 writes it: the scale is
//! `max|x| / 127` rounded to f16, values are `round(x / scale)` with the unrounded scale, and
//! the sum is `f16(Σq) · f16(scale)` rounded to f16. Scales and sums are kept as the f32 values
//! of those f16 numbers, so the dot products see exactly what candle's would.
//!
//! For the AVX-512 VNNI tiles a matmul also interleaves its rows in groups of four
//! ([`QuantizedRows::interleave`]): the same bytes, four at a time from each row in turn, and
//! lifted by 128 for weights that enter as signed values; the tiles' outputs do not change.

use half::f16;
use rayon::prelude::*;

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
    /// Every whole group of [`QUAD`] rows interleaved ([`Self::interleave`]), when asked for.
    quads: Option<Interleaved>,
}

/// Rows an interleaved group holds: a group of the tiles.
pub(crate) const QUAD: usize = 4;
const _: () = assert!(QUAD == crate::TOGETHER);

/// Bytes of one block of an interleaved group.
pub(crate) const QUAD_BLOCK_BYTES: usize = QUAD * BLOCK;

/// Groups of [`QUAD`] consecutive rows interleaved for the wide tiles, group after group.
#[derive(Clone, Debug)]
struct Interleaved {
    /// Per group and block, [`QUAD_BLOCK_BYTES`] bytes: bytes `16k + 4c..16k + 4c + 4` are
    /// bytes `4k..4k + 4` of row `c`'s block, plus 128 each (as unsigned bytes) when `lifted`.
    quants: Vec<u8>,
    /// Per group and block, the four rows' scales.
    scales: Vec<[f32; QUAD]>,
    /// Per group and block, the four rows' scaled sums.
    sums: Vec<[f32; QUAD]>,
    /// Whether the quants are lifted by 128.
    lifted: bool,
}

/// One group of [`QUAD`] rows interleaved (see [`QuantizedRows::interleave`]), seen from row
/// `member` of it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Quad<'a> {
    /// The group's interleaved quants, [`QUAD_BLOCK_BYTES`] per block.
    pub(crate) quants: &'a [u8],
    /// The four rows' scales, block by block.
    pub(crate) scales: &'a [[f32; QUAD]],
    /// The four rows' scaled sums, block by block.
    pub(crate) sums: &'a [[f32; QUAD]],
    /// Whether the quants are lifted by 128.
    pub(crate) lifted: bool,
    /// Which of the four rows this row is.
    pub(crate) member: usize,
}

impl<'a> Quad<'a> {
    /// The group of `rows` interleaved here and now (for rows that come without one): their
    /// first `blocks` blocks, which every row must hold.
    pub(crate) fn of(rows: &[ActivationRow<'_>; QUAD], blocks: usize, lifted: bool) -> OwnedQuad {
        let mut quants = vec![0; blocks * QUAD_BLOCK_BYTES];
        interleave_group(rows.map(|row| row.quants), lifted, &mut quants);
        OwnedQuad {
            quants,
            scales: side_by_side(rows.map(|row| row.scales), blocks).collect(),
            sums: side_by_side(rows.map(|row| row.sums), blocks).collect(),
        }
    }
}

/// A [`Quad`]'s data owned (see [`Quad::of`]).
#[derive(Debug)]
pub(crate) struct OwnedQuad {
    quants: Vec<u8>,
    scales: Vec<[f32; QUAD]>,
    sums: Vec<[f32; QUAD]>,
}

impl OwnedQuad {
    /// The group as a [`Quad`] (its first row's view).
    pub(crate) fn quad(&self, lifted: bool) -> Quad<'_> {
        Quad {
            quants: &self.quants,
            scales: &self.scales,
            sums: &self.sums,
            lifted,
            member: 0,
        }
    }
}

/// The first `blocks` values of four rows (`rows`, one value per block), block by block.
fn side_by_side(rows: [&[f32]; QUAD], blocks: usize) -> impl Iterator<Item = [f32; QUAD]> + '_ {
    (0..blocks).map(move |block| rows.map(|row| row[block]))
}

/// Writes a group's four rows (`rows`, their quants) interleaved into `interleaved` (the
/// group's [`QUAD_BLOCK_BYTES`] per block), plus 128 when `lifted`.
fn interleave_group(rows: [&[i8]; QUAD], lifted: bool, interleaved: &mut [u8]) {
    let flip = if lifted { 0x8080_8080u32 } else { 0 };
    for (block, out) in interleaved.chunks_exact_mut(QUAD_BLOCK_BYTES).enumerate() {
        let words: [[u32; BLOCK / 4]; QUAD] = rows.map(|row| {
            let quants = &row[block * BLOCK..(block + 1) * BLOCK];
            std::array::from_fn(|k| {
                u32::from_le_bytes(std::array::from_fn(|i| quants[4 * k + i] as u8)) ^ flip
            })
        });
        for (at, bytes) in out.chunks_exact_mut(4).enumerate() {
            bytes.copy_from_slice(&words[at % QUAD][at / QUAD].to_le_bytes());
        }
    }
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
            quads: None,
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

    /// Row `row`'s scales, sums and quants, and its group of [`QUAD`] when the rows are
    /// interleaved and the group is whole.
    pub(crate) fn row(&self, row: usize) -> ActivationRow<'_> {
        let blocks = row * self.blocks_per_row..(row + 1) * self.blocks_per_row;
        ActivationRow {
            scales: &self.scales[blocks.clone()],
            sums: &self.sums[blocks.clone()],
            quants: &self.quants[blocks.start * BLOCK..blocks.end * BLOCK],
            quad: self.quad(row),
        }
    }

    /// Interleaves every whole group of [`QUAD`] consecutive rows (rows `4g..4g + 4`) for the
    /// wide tiles, their quants lifted by 128 when `lifted` (for weights that enter as signed
    /// values).
    pub(crate) fn interleave(&mut self, lifted: bool) {
        let groups = self.rows / QUAD;
        let blocks = self.blocks_per_row;
        let group_bytes = blocks * QUAD_BLOCK_BYTES;
        let mut quants = vec![0u8; groups * group_bytes];
        quants
            .par_chunks_mut(group_bytes.max(1))
            .enumerate()
            .for_each(|(group, bytes)| {
                let rows = std::array::from_fn(|c| self.row(group * QUAD + c).quants);
                interleave_group(rows, lifted, bytes);
            });
        // Each group's rows' values (scales or sums), block by block.
        let groups_side_by_side = |values: &[f32]| -> Vec<[f32; QUAD]> {
            let group = |g: usize| std::array::from_fn(|c| &values[(g * QUAD + c) * blocks..]);
            (0..groups)
                .flat_map(|g| side_by_side(group(g), blocks))
                .collect()
        };
        self.quads = Some(Interleaved {
            quants,
            scales: groups_side_by_side(&self.scales),
            sums: groups_side_by_side(&self.sums),
            lifted,
        });
    }

    /// Row `row`'s interleaved group, when there is one.
    fn quad(&self, row: usize) -> Option<Quad<'_>> {
        let quads = self.quads.as_ref()?;
        let group = row / QUAD;
        if group >= self.rows / QUAD {
            return None;
        }
        let blocks = self.blocks_per_row;
        let bytes = blocks * QUAD_BLOCK_BYTES;
        Some(Quad {
            quants: &quads.quants[group * bytes..(group + 1) * bytes],
            scales: &quads.scales[group * blocks..(group + 1) * blocks],
            sums: &quads.sums[group * blocks..(group + 1) * blocks],
            lifted: quads.lifted,
            member: row % QUAD,
        })
    }
}

/// One row of quantized activations.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ActivationRow<'a> {
    pub(crate) scales: &'a [f32],
    pub(crate) sums: &'a [f32],
    pub(crate) quants: &'a [i8],
    /// The row's interleaved group, when the rows were interleaved (the wide tiles read it).
    pub(crate) quad: Option<Quad<'a>>,
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
