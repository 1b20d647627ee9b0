//! Q6_K: 256-value super-blocks of 6-bit quants, every 16 values with a signed 8-bit scale.
//!
//! Layout of one super-block (210 bytes, as ggml writes it):
//! - bytes 0..128 (`ql`): the low four bits of each quant;
//! - bytes 128..192 (`qh`): the high two bits;
//! - bytes 192..208 (`scales`): sixteen i8, scale `j` for values `16j..16j + 16`;
//! - bytes 208..210 (`d`): an f16.
//!
//! Value `v` lies in half `h = v / 128` and, within it, in run `r = (v % 128) / 32` at position
//! `l = v % 32`. Its low bits are nibble `r / 2` (the low nibble first) of
//! `ql[64h + 32(r % 2) + l]`, its high bits `(qh[32h + l] >> 2r) & 3`; with
//! `q = low | high << 4` (0..=63) the value is `(d · scales[v / 16]) · (q − 32)`.
//!
//! The dot product of a super-block with one of activations (scale `a`, quants `x`, `sums[j]`
//! the sum of `x` over sub-block `j`) is `(a · d) · I`, in f32 and in that order, with the
//! exact integer `I = Σ_j scales[j] · (Σ_{v in j} q_v · x_v − 32 · sums[j])`. Bound: with
//! |x| ≤ 128 and consistent sums, `|I| ≤ 16 · 128 · 16 · 32 · 128 < 2^28`.
//!
//! The row's dot product keeps four running sums, each from zero: super-block `b`'s part is
//! added to sum `b % 4`, in order, and the result is `(s0 + s2) + (s1 + s3)` ([`add_to_lanes`],
//! [`combined_lanes`]). A SIMD path thus adds four super-blocks' parts with one vector add.
//!
//! Q3_K and Q2_K cut their super-blocks into the same sixteen 16-value sub-blocks and share
//! [`checked_blocks`], [`sub_block_dots`], [`scaled_integer`] and the four sums from here.

use super::{SUPER_BLOCK, half_at};
use crate::super_rows::{SUM_GROUP, SuperRow};

/// Bytes of one super-block.
pub(crate) const BYTES: usize = 210;

/// Where the high two bits of the quants start.
pub(crate) const HIGH_BITS_AT: usize = 128;

/// Where the sixteen signed scales start.
pub(crate) const SCALES_AT: usize = 192;

/// Where the f16 super-block scale is.
pub(crate) const D_AT: usize = 208;

/// What every quant is offset by: the stored 0..=63 stands for −32..=31.
pub(crate) const OFFSET: i32 = 32;

/// Sub-blocks of 16 values in a super-block.
pub(crate) const SUB_BLOCKS: usize = SUPER_BLOCK / SUM_GROUP;

/// Writes one super-block's 256 values.
pub(crate) fn dequantize(block: &[u8], values: &mut [f32]) {
    let d = half_at(block, D_AT);
    let quants = unsigned_quants(block);
    let sub_blocks = values
        .chunks_exact_mut(SUM_GROUP)
        .zip(quants.chunks_exact(SUM_GROUP));
    for ((values, quants), scale) in sub_blocks.zip(&block[SCALES_AT..D_AT]) {
        let scale = d * f32::from(scale.cast_signed());
        for (value, quant) in values.iter_mut().zip(quants) {
            *value = scale * (i32::from(*quant) - OFFSET) as f32;
        }
    }
}

/// One Q6_K row against one activation row.
pub(crate) fn dot(weights: &[u8], activations: SuperRow<'_>) -> f32 {
    lane_summed_dot(weights, activations, BYTES, |block, scale, sums, quants| {
        scaled_integer(
            scale,
            half_at(block, D_AT),
            block_integer(block, sums, quants),
        )
    })
}

/// A row of `bytes`-byte super-blocks against one activation row: each super-block's part
/// (`part(block, activation scale, its 16 sums, its 256 quants)`) added to running sum
/// `index % 4`, the sums then combined ([`combined_lanes`]). Q6_K, Q3_K and Q2_K sum this way.
pub(crate) fn lane_summed_dot(
    weights: &[u8],
    activations: SuperRow<'_>,
    bytes: usize,
    part: impl Fn(&[u8], f32, &[i16], &[i8]) -> f32,
) -> f32 {
    checked_blocks(weights, activations, bytes);
    let blocks = weights
        .chunks_exact(bytes)
        .zip(activations.scales)
        .zip(activations.sums.chunks_exact(SUB_BLOCKS))
        .zip(activations.quants.chunks_exact(SUPER_BLOCK));
    let mut lanes = [0f32; LANES];
    for (index, (((block, scale), sums), quants)) in blocks.enumerate() {
        add_to_lanes(&mut lanes, index, part(block, *scale, sums, quants));
    }
    combined_lanes(lanes)
}

/// Running sums of a row's super-blocks' parts.
pub(crate) const LANES: usize = 4;

/// Adds super-block `index`'s part to running sum `index % 4`.
#[inline]
pub(crate) fn add_to_lanes(lanes: &mut [f32; LANES], index: usize, part: f32) {
    lanes[index % LANES] += part;
}

/// The row's dot product from its four running sums: `(s0 + s2) + (s1 + s3)`.
#[inline]
pub(crate) fn combined_lanes(lanes: [f32; LANES]) -> f32 {
    (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
}

/// The f32 part of one super-block of Q6_K or Q3_K: `(activation_scale · d) · integer`,
/// two separate roundings, the same on every path.
#[inline]
pub(crate) fn scaled_integer(activation_scale: f32, d: f32, integer: i32) -> f32 {
    activation_scale * d * integer as f32
}

/// The super-blocks of a row of 256-value super-blocks of `block_bytes` bytes, after checking
/// that the weights and every part of the activations hold that many.
pub(crate) fn checked_blocks(
    weights: &[u8],
    activations: SuperRow<'_>,
    block_bytes: usize,
) -> usize {
    let blocks = activations.scales.len();
    assert!(
        weights.len() == blocks * block_bytes
            && activations.sums.len() == blocks * SUB_BLOCKS
            && activations.quants.len() == blocks * SUPER_BLOCK,
        "kernel operands of unequal length"
    );
    blocks
}

/// The exact integer `Σ_j scales[j] · (Σ_{v in j} q_v · x_v − 32 · sums[j])` of one super-block.
fn block_integer(block: &[u8], sums: &[i16], quants: &[i8]) -> i32 {
    let dots = sub_block_dots(&unsigned_quants(block), quants);
    let scales = &block[SCALES_AT..D_AT];
    let terms = dots.iter().zip(scales).zip(sums);
    terms
        .map(|((dot, scale), sum)| {
            i32::from(scale.cast_signed()) * (dot - OFFSET * i32::from(*sum))
        })
        .sum()
}

/// The 256 stored quants (0..=63) of a super-block, in value order.
fn unsigned_quants(block: &[u8]) -> [u8; SUPER_BLOCK] {
    let mut quants = [0u8; SUPER_BLOCK];
    for (half, quants) in quants.chunks_exact_mut(SUPER_BLOCK / 2).enumerate() {
        let low_bits = &block[64 * half..64 * half + 64];
        let high_bits = &block[HIGH_BITS_AT + 32 * half..HIGH_BITS_AT + 32 * half + 32];
        for (at, high) in high_bits.iter().enumerate() {
            let (first, second) = (low_bits[at], low_bits[at + 32]);
            quants[at] = first & 0x0F | (high & 3) << 4;
            quants[at + 32] = second & 0x0F | (high >> 2 & 3) << 4;
            quants[at + 64] = first >> 4 | (high >> 4 & 3) << 4;
            quants[at + 96] = second >> 4 | (high >> 6) << 4;
        }
    }
    quants
}

/// The exact dot product of each 16-value sub-block of unsigned weight quants with its
/// activations.
pub(crate) fn sub_block_dots(weights: &[u8; SUPER_BLOCK], activations: &[i8]) -> [i32; SUB_BLOCKS] {
    let mut dots = [0i32; SUB_BLOCKS];
    let groups = weights
        .chunks_exact(SUM_GROUP)
        .zip(activations.chunks_exact(SUM_GROUP));
    for (dot, (weights, activations)) in dots.iter_mut().zip(groups) {
        *dot = weights
            .iter()
            .zip(activations)
            .map(|(weight, activation)| i32::from(*weight) * i32::from(*activation))
            .sum();
    }
    dots
}

#[cfg(test)]
pub(crate) mod tests {
    //! Q6_K's tests, and the helpers that the tests of the other k-quants with 16-value
    //! sub-blocks (Q3_K, Q2_K, and their AVX2 paths) share.

    use super::*;
    use crate::super_rows::SuperRows;

    /// Unit roundoff of f32.
    pub(crate) const ROUNDOFF: f64 = 1.0 / (1u64 << 24) as f64;

    /// A deterministic stream of pseudo-random numbers (splitmix64).
    pub(crate) struct Numbers(u64);

    impl Numbers {
        /// The stream that starts from `seed`.
        pub(crate) fn new(seed: u64) -> Self {
            Self(seed)
        }

        /// The next 64 random bits.
        pub(crate) fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut mixed = self.0;
            mixed = (mixed ^ mixed >> 30).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            mixed = (mixed ^ mixed >> 27).wrapping_mul(0x94D0_49BB_1331_11EB);
            mixed ^ mixed >> 31
        }

        /// `count` random bytes.
        pub(crate) fn bytes(&mut self, count: usize) -> Vec<u8> {
            (0..count).map(|_| self.next() as u8).collect()
        }

        /// A float in -1..1.
        pub(crate) fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Writes `value`, rounded to f16, little-endian at `bytes[at..at + 2]`.
    pub(crate) fn put_half(bytes: &mut [u8], at: usize, value: f32) {
        bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(value).to_le_bytes());
    }

    /// A row of activations a test owns.
    pub(crate) struct Activations {
        /// One scale per super-block.
        pub(crate) scales: Vec<f32>,
        /// The sum of every 16 quants.
        pub(crate) sums: Vec<i16>,
        /// 256 quants per super-block.
        pub(crate) quants: Vec<i8>,
    }

    impl Activations {
        /// Activations with the given scales and quants, and their sums.
        pub(crate) fn from_quants(scales: Vec<f32>, quants: Vec<i8>) -> Self {
            let sums = quants
                .chunks_exact(SUM_GROUP)
                .map(|group| group.iter().map(|quant| i16::from(*quant)).sum())
                .collect();
            Self {
                scales,
                sums,
                quants,
            }
        }

        /// `blocks` super-blocks of random values (each super-block of its own size between
        /// 1e-3 and 1e3), quantized as a matmul quantizes them.
        pub(crate) fn random(numbers: &mut Numbers, blocks: usize) -> Self {
            let mut values = Vec::with_capacity(blocks * SUPER_BLOCK);
            for _ in 0..blocks {
                let size = 10f32.powf(3.0 * numbers.unit());
                values.extend((0..SUPER_BLOCK).map(|_| size * numbers.unit()));
            }
            let rows = SuperRows::quantize(&values, 1, blocks * SUPER_BLOCK);
            let row = rows.row(0);
            Self {
                scales: row.scales.to_vec(),
                sums: row.sums.to_vec(),
                quants: row.quants.to_vec(),
            }
        }

        /// The row the kernels read.
        pub(crate) fn row(&self) -> SuperRow<'_> {
            SuperRow {
                scales: &self.scales,
                sums: &self.sums,
                quants: &self.quants,
            }
        }
    }

    /// `blocks` super-blocks of random bytes of `block_bytes` each, with finite f16 scales
    /// (random, of size up to 0.1) at the offsets `halves`.
    pub(crate) fn random_weights(
        numbers: &mut Numbers,
        blocks: usize,
        block_bytes: usize,
        halves: &[usize],
    ) -> Vec<u8> {
        let mut weights = numbers.bytes(blocks * block_bytes);
        for block in weights.chunks_exact_mut(block_bytes) {
            for at in halves {
                put_half(block, *at, 0.1 * numbers.unit());
            }
        }
        weights
    }

    /// Asserts that `dot` is within `(blocks + 8) · u · Σ_v magnitude_v · |x_v · a|` of the
    /// f64 sum of `value_v · x_v · a` (`values` dequantized, `u` f32's unit roundoff): the
    /// reference rounds each super-block's part a few times and each of its additions (at most
    /// `blocks / 4 + 2` on the way of any part) once.
    pub(crate) fn assert_near_float(dot: f32, values: &[f32], magnitudes: &[f32], row: SuperRow) {
        let (mut exact, mut size) = (0f64, 0f64);
        for (block, scale) in row.scales.iter().enumerate() {
            for at in block * SUPER_BLOCK..(block + 1) * SUPER_BLOCK {
                let activation = f64::from(row.quants[at]) * f64::from(*scale);
                exact += f64::from(values[at]) * activation;
                size += f64::from(magnitudes[at]) * activation.abs();
            }
        }
        let bound = (row.scales.len() + 8) as f64 * ROUNDOFF * size;
        let error = (f64::from(dot) - exact).abs();
        assert!(
            error <= bound,
            "{dot} is {error} from {exact} (bound {bound})"
        );
    }

    /// Every super-block of `weights` dequantized.
    pub(crate) fn dequantized(
        weights: &[u8],
        block_bytes: usize,
        dequantize: fn(&[u8], &mut [f32]),
    ) -> Vec<f32> {
        let mut values = vec![0f32; weights.len() / block_bytes * SUPER_BLOCK];
        for (block, values) in weights
            .chunks_exact(block_bytes)
            .zip(values.chunks_exact_mut(SUPER_BLOCK))
        {
            dequantize(block, values);
        }
        values
    }

    /// A hand-made block: scales `3 − j` but for -128 and 127 at sub-blocks 4 and 6, d = 0.25,
    /// and a few quants set (the others stored as 0, standing for −32).
    fn hand_made_block() -> Vec<u8> {
        let mut block = vec![0u8; BYTES];
        block[0] = 0x21; // low bits: value 0 ← 1, value 64 ← 2
        block[32] = 0x43; // value 32 ← 3, value 96 ← 4
        block[HIGH_BITS_AT] = 0b11_10_01_00; // high bits: 0 ← 0, 32 ← 1, 64 ← 2, 96 ← 3
        block[64 + 5] = 0xF0; // value 133 ← 0, value 197 ← 15
        block[HIGH_BITS_AT + 32 + 5] = 0x03; // value 133 ← 3, the others 0
        for (j, scale) in block[SCALES_AT..D_AT].iter_mut().enumerate() {
            *scale = (3 - j as i8).cast_unsigned();
        }
        block[SCALES_AT + 4] = 0x80;
        block[SCALES_AT + 6] = 0x7F;
        put_half(&mut block, D_AT, 0.25);
        block
    }

    #[test]
    fn a_hand_made_block_dequantizes_to_its_values() {
        let block = hand_made_block();
        let mut scales: Vec<f32> = (0..16).map(|j| (3 - j) as f32).collect();
        scales[4] = -128.0;
        scales[6] = 127.0;
        let mut expected: Vec<f32> = (0..SUPER_BLOCK).map(|v| -8.0 * scales[v / 16]).collect();
        // (value, d · scale · (q − 32))
        let set = [
            (0, 0.25 * 3.0 * -31.0),
            (32, 0.25 * 1.0 * -13.0),
            (64, 0.25 * -128.0 * 2.0),
            (96, 0.25 * 127.0 * 20.0),
            (133, 0.25 * -5.0 * 16.0),
            (197, 0.25 * -9.0 * -17.0),
        ];
        for (value, expected_value) in set {
            expected[value] = expected_value;
        }
        let mut values = vec![f32::NAN; SUPER_BLOCK];
        dequantize(&block, &mut values);
        assert_eq!(values, expected);
    }

    #[test]
    fn the_reference_dot_is_the_float_dot_of_the_dequantized_values() {
        let mut numbers = Numbers::new(6);
        for blocks in [1, 2, 5, 9] {
            let weights = random_weights(&mut numbers, blocks, BYTES, &[D_AT]);
            let activations = Activations::random(&mut numbers, blocks);
            let values = dequantized(&weights, BYTES, dequantize);
            let magnitudes: Vec<f32> = values.iter().map(|value| value.abs()).collect();
            let row = activations.row();
            assert_near_float(dot(&weights, row), &values, &magnitudes, row);
        }
    }

    #[test]
    fn the_hand_made_block_dots_exactly() {
        // Activations 1 at value 0 and 2 at value 96, scale 0.5: 0.5 · (−23.25 + 2 · 635),
        // and the other values of sub-blocks 0 and 6 meet zero activations.
        let mut quants = vec![0i8; SUPER_BLOCK];
        quants[0] = 1;
        quants[96] = 2;
        let activations = Activations::from_quants(vec![0.5], quants);
        assert_eq!(
            dot(&hand_made_block(), activations.row()),
            0.5 * (-23.25 + 1270.0)
        );
    }

    #[test]
    #[should_panic(expected = "unequal length")]
    fn a_row_of_the_wrong_length_is_refused() {
        let activations = Activations::from_quants(vec![1.0], vec![0; SUPER_BLOCK]);
        dot(&[0; BYTES - 1], activations.row());
    }
}
