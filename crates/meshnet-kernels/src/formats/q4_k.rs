//! Q4_K: 256-value super-blocks (layout as ggml writes it).
//!
//! A super-block is 144 bytes: an f16 scale `d` (bytes 0..2), an f16 minimum scale `dmin`
//! (bytes 2..4), twelve bytes holding eight 6-bit sub-block scales and eight 6-bit sub-block
//! minimums (bytes 4..16, see [`unpack_scales_and_mins`]), then 128 bytes of 4-bit quants
//! (bytes 16..144). The quants come in four runs of 32 bytes, each holding 64 values: the low
//! nibbles are values 0..32 of the run (sub-block `2c` of run `c`), the high nibbles values
//! 32..64 (sub-block `2c + 1`). Value `l` of sub-block `j` is
//! `d · scale_j · q_l − dmin · min_j`.
//!
//! The dot product against a [`SuperRow`] is, per super-block, the exact integers
//! `scaled_dot = Σ_j scale_j · Σ_l q_l · a_l` and `scaled_min_sum = Σ_j min_j · Σ_l a_l`
//! (the second from the activations' sums of 16), combined in f32 by [`super_block_term`] and
//! added to the row's sum super-block by super-block in order. Q5_K shares all of it but the
//! quants.

use crate::formats::{SUPER_BLOCK, half_at};
use crate::super_rows::{SUM_GROUP, SuperRow};

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 144;

/// Values per sub-block (one scale and one minimum each).
pub(crate) const SUB_BLOCK: usize = 32;

/// Sub-blocks per super-block.
pub(crate) const SUB_BLOCKS: usize = SUPER_BLOCK / SUB_BLOCK;

/// Where the f16 minimum scale `dmin` starts (`d` starts at byte 0); Q5_K's is the same.
const DMIN_AT: usize = 2;

/// Where the twelve bytes of packed 6-bit scales and minimums start; Q5_K's is the same.
pub(crate) const PACKED_SCALES_AT: usize = 4;

/// Where the 128 bytes of nibbles start.
pub(crate) const QUANTS_AT: usize = 16;

/// Bytes of nibbles holding one run of two sub-blocks (64 values).
pub(crate) const RUN_BYTES: usize = 32;

/// Activation sums (of 16 quants each) per sub-block.
const SUMS_PER_SUB_BLOCK: usize = SUB_BLOCK / SUM_GROUP;

/// One super-block's eight 6-bit sub-block scales and eight 6-bit sub-block minimums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScalesAndMins {
    /// Scale of sub-block `j` (0..=63).
    pub(crate) scales: [u8; SUB_BLOCKS],
    /// Minimum of sub-block `j` (0..=63).
    pub(crate) mins: [u8; SUB_BLOCKS],
}

/// Bytes of packed scales and minimums.
const PACKED_SCALES: usize = 12;

/// The little-endian u32 at `packed[at..at + 4]`.
#[inline]
fn word_at(packed: &[u8; PACKED_SCALES], at: usize) -> u32 {
    u32::from_le_bytes([packed[at], packed[at + 1], packed[at + 2], packed[at + 3]])
}

/// Unpacks the twelve bytes at [`PACKED_SCALES_AT`] of a Q4_K or Q5_K super-block.
///
/// Bytes 0..4 hold the low six bits of scales 0..4, bytes 4..8 those of minimums 0..4.
/// Scales and minimums 4..8 take their low four bits from bytes 8..12 (scale in the low
/// nibble, minimum in the high one) and their top two bits from the top two bits of bytes
/// 0..4 (scales) and 4..8 (minimums). Computed four bytes at a time in u32 words.
#[inline]
pub(crate) fn unpack_scales_and_mins(block: &[u8]) -> ScalesAndMins {
    const LOW_SIX: u32 = 0x3F3F_3F3F;
    const LOW_FOUR: u32 = 0x0F0F_0F0F;
    const TOP_TWO_MOVED: u32 = 0x3030_3030;
    let mut packed = [0u8; PACKED_SCALES];
    packed.copy_from_slice(&block[PACKED_SCALES_AT..PACKED_SCALES_AT + PACKED_SCALES]);
    let first = word_at(&packed, 0);
    let second = word_at(&packed, 4);
    let third = word_at(&packed, 8);
    let low_scales = first & LOW_SIX;
    let low_mins = second & LOW_SIX;
    // `>> 2` moves each byte's top two bits to its bits 4..6 (the mask drops what crosses).
    let high_scales = (third & LOW_FOUR) | ((first >> 2) & TOP_TWO_MOVED);
    let high_mins = ((third >> 4) & LOW_FOUR) | ((second >> 2) & TOP_TWO_MOVED);
    let join = |low: u32, high: u32| (u64::from(high) << 32 | u64::from(low)).to_le_bytes();
    ScalesAndMins {
        scales: join(low_scales, high_scales),
        mins: join(low_mins, high_mins),
    }
}

/// The number of super-blocks of a row after checking that `weights` (of `block_bytes` a
/// super-block) and every slice of `activations` hold exactly that many.
pub(crate) fn checked_super_blocks(
    weights: &[u8],
    block_bytes: usize,
    activations: SuperRow<'_>,
) -> usize {
    let blocks = activations.scales.len();
    assert!(
        weights.len() == blocks * block_bytes
            && activations.sums.len() == blocks * (SUPER_BLOCK / SUM_GROUP)
            && activations.quants.len() == blocks * SUPER_BLOCK,
        "k-quant operands of unequal length"
    );
    blocks
}

/// `Σ_j min_j · (sum of the activation quants of sub-block j)`, exact: `sums` holds one
/// super-block's sixteen sums of 16 quants.
pub(crate) fn scaled_min_sum(mins: &[u8; SUB_BLOCKS], sums: &[i16]) -> i32 {
    mins.iter()
        .zip(sums.chunks_exact(SUMS_PER_SUB_BLOCK))
        .map(|(min, pair)| i32::from(*min) * pair.iter().map(|sum| i32::from(*sum)).sum::<i32>())
        .sum()
}

/// A Q4_K or Q5_K super-block's f16 scale `d` and minimum scale `dmin`, as f32.
#[inline]
pub(crate) fn scale_and_min_scale(block: &[u8]) -> (f32, f32) {
    (half_at(block, 0), half_at(block, DMIN_AT))
}

/// One super-block's part of a Q4_K or Q5_K dot product, from its exact integers and the
/// super-block's `d` and `dmin`: `activation_scale · (d · scaled_dot − dmin · scaled_min_sum)`,
/// each step rounded to f32 (the integers are converted to f32 first, rounding to nearest;
/// nothing is fused).
#[inline]
pub(crate) fn super_block_term(
    (d, dmin): (f32, f32),
    activation_scale: f32,
    scaled_dot: i32,
    scaled_min_sum: i32,
) -> f32 {
    activation_scale * (d * scaled_dot as f32 - dmin * scaled_min_sum as f32)
}

/// Writes values `d · scale_j · q − dmin · min_j` of one super-block, for `quant(j, l)` the
/// unsigned quant of value `l` of sub-block `j` (Q4_K's and Q5_K's dequantization).
pub(crate) fn dequantize_with(
    block: &[u8],
    values: &mut [f32],
    quant: impl Fn(usize, usize) -> u8,
) {
    let (d, dmin) = scale_and_min_scale(block);
    let unpacked = unpack_scales_and_mins(block);
    let sub_blocks = values[..SUPER_BLOCK].chunks_exact_mut(SUB_BLOCK);
    for (j, sub_block) in sub_blocks.enumerate() {
        let scale = d * f32::from(unpacked.scales[j]);
        let min = dmin * f32::from(unpacked.mins[j]);
        for (l, value) in sub_block.iter_mut().enumerate() {
            *value = scale * f32::from(quant(j, l)) - min;
        }
    }
}

/// The nibble of value `l` of sub-block `j` in quants laid out as Q4_K's (`quants` starts at
/// the first run): byte `l` of run `j / 2`, its low nibble for even `j`, high for odd.
pub(crate) fn nibble_at(quants: &[u8], j: usize, l: usize) -> u8 {
    (quants[(j / 2) * RUN_BYTES + l] >> (4 * (j % 2))) & 0x0F
}

/// The 4-bit quant of value `l` of sub-block `j`.
fn nibble(block: &[u8], j: usize, l: usize) -> u8 {
    nibble_at(&block[QUANTS_AT..], j, l)
}

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    let block = &block[..BYTES];
    dequantize_with(block, values, |j, l| nibble(block, j, l));
}

/// `Σ_j scale_j · Σ_l quant(j, l) · a_l` over one super-block, exact, for `quants` its 256
/// activation quants.
pub(crate) fn scaled_dot_with(
    scales: &[u8; SUB_BLOCKS],
    quants: &[i8],
    quant: impl Fn(usize, usize) -> u8,
) -> i32 {
    let sub_blocks = quants[..SUPER_BLOCK].chunks_exact(SUB_BLOCK);
    let mut scaled_dot = 0i32;
    for (j, activations) in sub_blocks.enumerate() {
        let dot: i32 = activations
            .iter()
            .enumerate()
            .map(|(l, a)| i32::from(quant(j, l)) * i32::from(*a))
            .sum();
        scaled_dot += i32::from(scales[j]) * dot;
    }
    scaled_dot
}

/// A Q4_K or Q5_K row against one activation row: the sum, super-block by super-block in
/// order, of [`super_block_term`] over the exact integers, for `quant(block, j, l)` the
/// unsigned quant of value `l` of sub-block `j` of a super-block's bytes.
pub(crate) fn dot_with(
    weights: &[u8],
    block_bytes: usize,
    activations: SuperRow<'_>,
    quant: impl Fn(&[u8], usize, usize) -> u8,
) -> f32 {
    let blocks = checked_super_blocks(weights, block_bytes, activations);
    let groups = SUPER_BLOCK / SUM_GROUP;
    let mut sum = 0f32;
    for block in 0..blocks {
        let bytes = &weights[block * block_bytes..(block + 1) * block_bytes];
        let quants = &activations.quants[block * SUPER_BLOCK..(block + 1) * SUPER_BLOCK];
        let sums = &activations.sums[block * groups..(block + 1) * groups];
        let unpacked = unpack_scales_and_mins(bytes);
        let scaled_dot = scaled_dot_with(&unpacked.scales, quants, |j, l| quant(bytes, j, l));
        let min_sum = scaled_min_sum(&unpacked.mins, sums);
        let scales = scale_and_min_scale(bytes);
        sum += super_block_term(scales, activations.scales[block], scaled_dot, min_sum);
    }
    sum
}

/// One Q4_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    dot_with(weights, BYTES, activations, nibble)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small deterministic generator of test bits (xorshift64*).
    pub(crate) struct Bits(u64);

    impl Bits {
        /// A generator started from `seed`.
        pub(crate) fn new(seed: u64) -> Self {
            Self(seed | 1)
        }

        /// The next 64 bits.
        pub(crate) fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// A number in `0..bound`.
        pub(crate) fn below(&mut self, bound: u64) -> u64 {
            self.next() % bound
        }

        /// A finite f16 (either sign, magnitudes from 2^-14 to 2^15), as its bytes.
        pub(crate) fn finite_half(&mut self) -> [u8; 2] {
            let exponent = 1 + self.below(30) as u16;
            let bits = (self.below(2) as u16) << 15 | exponent << 10 | self.below(1024) as u16;
            bits.to_le_bytes()
        }
    }

    /// Owned activations in 256-value super-blocks, viewed as a [`SuperRow`].
    pub(crate) struct OwnedRow {
        /// One scale per super-block.
        pub(crate) scales: Vec<f32>,
        /// Sixteen exact sums per super-block.
        pub(crate) sums: Vec<i16>,
        /// 256 quants per super-block.
        pub(crate) quants: Vec<i8>,
    }

    impl OwnedRow {
        /// A row of the given quants (whole super-blocks), one scale per super-block.
        pub(crate) fn new(scales: Vec<f32>, quants: Vec<i8>) -> Self {
            let sums = quants
                .chunks_exact(SUM_GROUP)
                .map(|group| group.iter().map(|q| i16::from(*q)).sum())
                .collect();
            Self {
                scales,
                sums,
                quants,
            }
        }

        /// `blocks` super-blocks of random quants in -127..=127 and random positive scales.
        pub(crate) fn random(bits: &mut Bits, blocks: usize) -> Self {
            let scales = (0..blocks)
                .map(|_| (1 + bits.below(1000)) as f32 / 7919.0)
                .collect();
            let quants = (0..blocks * SUPER_BLOCK)
                .map(|_| (bits.below(255) as i32 - 127) as i8)
                .collect();
            Self::new(scales, quants)
        }

        /// The borrowed view the kernels read.
        pub(crate) fn view(&self) -> SuperRow<'_> {
            SuperRow {
                scales: &self.scales,
                sums: &self.sums,
                quants: &self.quants,
            }
        }
    }

    /// `blocks` random super-blocks of `block_bytes` bytes with finite f16 `d` and `dmin`.
    pub(crate) fn random_blocks(bits: &mut Bits, blocks: usize, block_bytes: usize) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..blocks * block_bytes)
            .map(|_| bits.next() as u8)
            .collect();
        for block in bytes.chunks_exact_mut(block_bytes) {
            block[..2].copy_from_slice(&bits.finite_half());
            block[DMIN_AT..DMIN_AT + 2].copy_from_slice(&bits.finite_half());
        }
        bytes
    }

    /// The exact (f64) dot product of dequantized weights with dequantized activations, and
    /// the sum over super-blocks of `activation_scale · (|d · scaled_dot| + |dmin · min_sum|)`
    /// that bounds the reference's rounding.
    pub(crate) fn exact_dot(
        weights: &[u8],
        block_bytes: usize,
        row: SuperRow<'_>,
        quant: impl Fn(&[u8], usize, usize) -> u8,
    ) -> (f64, f64) {
        let (mut exact, mut magnitude) = (0f64, 0f64);
        for (block, bytes) in weights.chunks_exact(block_bytes).enumerate() {
            let unpacked = unpack_scales_and_mins(bytes);
            let d = f64::from(half_at(bytes, 0));
            let dmin = f64::from(half_at(bytes, DMIN_AT));
            let scale = f64::from(row.scales[block]);
            let (mut scaled, mut mins) = (0f64, 0f64);
            for j in 0..SUB_BLOCKS {
                for l in 0..SUB_BLOCK {
                    let a = f64::from(row.quants[block * SUPER_BLOCK + j * SUB_BLOCK + l]);
                    let q = f64::from(quant(bytes, j, l));
                    exact += (d * f64::from(unpacked.scales[j]) * q
                        - dmin * f64::from(unpacked.mins[j]))
                        * scale
                        * a;
                    scaled += f64::from(unpacked.scales[j]) * q * a;
                    mins += f64::from(unpacked.mins[j]) * a;
                }
            }
            magnitude += scale * ((d * scaled).abs() + (dmin * mins).abs());
        }
        (exact, magnitude)
    }

    /// A block with `d` = 0.5, `dmin` = 0.25 and the given packed scales.
    fn block_with_scales(packed: [u8; 12]) -> Vec<u8> {
        let mut block = vec![0u8; BYTES];
        block[..2].copy_from_slice(&0x3800u16.to_le_bytes());
        block[DMIN_AT..DMIN_AT + 2].copy_from_slice(&0x3400u16.to_le_bytes());
        block[PACKED_SCALES_AT..PACKED_SCALES_AT + PACKED_SCALES].copy_from_slice(&packed);
        block
    }

    #[test]
    fn scales_and_mins_unpack_as_the_layout_says() {
        let packed = [
            0b01_000001, // scale 0 = 1; top bits 01 of scale 4
            0b10_000010, // scale 1 = 2; top bits 10 of scale 5
            0b11_111111, // scale 2 = 63; top bits 11 of scale 6
            0b00_000100, // scale 3 = 4; top bits 00 of scale 7
            0b11_000101, // min 0 = 5; top bits 11 of min 4
            0b00_000110, // min 1 = 6; top bits 00 of min 5
            0b01_000111, // min 2 = 7; top bits 01 of min 6
            0b10_001000, // min 3 = 8; top bits 10 of min 7
            0x21,        // scale 4 low bits 1, min 4 low bits 2
            0x43,        // scale 5 low bits 3, min 5 low bits 4
            0x65,        // scale 6 low bits 5, min 6 low bits 6
            0x87,        // scale 7 low bits 7, min 7 low bits 8
        ];
        let unpacked = unpack_scales_and_mins(&block_with_scales(packed));
        assert_eq!(unpacked.scales, [1, 2, 63, 4, 16 + 1, 32 + 3, 48 + 5, 7]);
        assert_eq!(unpacked.mins, [5, 6, 7, 8, 48 + 2, 4, 16 + 6, 32 + 8]);
    }

    #[test]
    fn random_packings_unpack_like_the_byte_by_byte_rule() {
        let mut bits = Bits::new(7);
        for _ in 0..200 {
            let block = random_blocks(&mut bits, 1, BYTES);
            let q = &block[PACKED_SCALES_AT..PACKED_SCALES_AT + PACKED_SCALES];
            let unpacked = unpack_scales_and_mins(&block);
            for j in 0..4 {
                assert_eq!(unpacked.scales[j], q[j] & 63);
                assert_eq!(unpacked.mins[j], q[j + 4] & 63);
                let high = j + 4;
                assert_eq!(unpacked.scales[high], (q[j + 8] & 15) | (q[j] >> 6) << 4);
                assert_eq!(unpacked.mins[high], (q[j + 8] >> 4) | (q[j + 4] >> 6) << 4);
            }
        }
    }

    #[test]
    fn a_hand_made_block_dequantizes_to_its_values() {
        // Scales 1, 2, 3, 4, 5, 6, 7, 8 and minimums 8, 7, …, 1 (all below 16).
        let mut block = block_with_scales([1, 2, 3, 4, 8, 7, 6, 5, 0x45, 0x36, 0x27, 0x18]);
        for run in 0..4 {
            for l in 0..RUN_BYTES {
                // Low nibble l % 16 (sub-block 2·run), high nibble 15 − l % 16.
                block[QUANTS_AT + run * RUN_BYTES + l] =
                    (l % 16) as u8 | ((15 - l % 16) as u8) << 4;
            }
        }
        let mut values = [0f32; SUPER_BLOCK];
        dequantize(&block, &mut values);
        for j in 0..SUB_BLOCKS {
            for l in 0..SUB_BLOCK {
                let q = if j % 2 == 0 { l % 16 } else { 15 - l % 16 };
                let expected = 0.5 * (j + 1) as f32 * q as f32 - 0.25 * (8 - j) as f32;
                assert_eq!(values[j * SUB_BLOCK + l], expected, "value {l} of {j}");
            }
        }
    }

    #[test]
    fn the_reference_dot_is_the_exact_dot_within_its_rounding_bound() {
        let mut bits = Bits::new(11);
        for blocks in [1, 2, 3, 6, 9] {
            let weights = random_blocks(&mut bits, blocks, BYTES);
            let row = OwnedRow::random(&mut bits, blocks);
            let (exact, magnitude) = exact_dot(&weights, BYTES, row.view(), nibble);
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
    fn a_row_of_zero_blocks_is_zero() {
        let row = OwnedRow::random(&mut Bits::new(3), 2);
        assert_eq!(dot(&[0u8; 2 * BYTES], row.view()), 0.0);
    }
}
