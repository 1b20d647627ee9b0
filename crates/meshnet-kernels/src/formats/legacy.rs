//! Q4_0, Q5_0 and Q5_1: 32-value blocks (layouts as ggml writes them).
//!
//! Every block starts with an f16 scale `d` (Q5_1 then an f16 minimum `m`); the 5-bit formats
//! follow it with a little-endian u32 of high bits, and every format ends with 16 nibble bytes.
//! Byte `j` of those carries quant `j` in its low nibble and quant `j + 16` in its high nibble;
//! bit `k` of the high bits is bit 4 of quant `k`. A value is `(q − 8) · d` (Q4_0),
//! `(q − 16) · d` (Q5_0) or `q · d + m` (Q5_1).
//!
//! The reference dot products read activations quantized to 32-value blocks (scale `d_a`,
//! scaled sum `s_a`, quants `a`) and compute one term per block:
//! - Q4_0: `Σ(q − 8)·a · d · d_a`
//! - Q5_0: `Σ(q − 16)·a · d · d_a`
//! - Q5_1: `Σq·a · d · d_a + m · s_a`
//!
//! The integer sums are exact (i32). The float part of a term is [`scaled_term`] or
//! [`offset_term`] (multiplies and adds, never fused). The terms are summed in eight lanes:
//! block `b` into lane `b % 8`, each lane starting at `+0.0` and taking first its block among
//! the ones after the last whole group of eight (if it has one), then its other blocks in
//! order; the lanes are then added in one fixed order ([`combine_lanes`]).
//!
//! Why that order: a SIMD path adds eight blocks' terms to its lanes with one vector add,
//! instead of eight dependent scalar adds (which cost more than the rest of a group's float
//! work); and it computes the short last group first, so that its latency overlaps the whole
//! groups' work instead of ending the row. A lane never holds `-0.0` (it starts at `+0.0`,
//! and a correctly rounded sum is `-0.0` only when both terms are), so a SIMD path may add
//! `+0.0` to the lanes the short group leaves out.

use super::half_at;
use crate::BLOCK;
use crate::activations::ActivationRow;

/// Bytes of a Q4_0 block: f16 scale, 16 bytes of nibbles.
pub(crate) const Q4_0_BYTES: usize = 18;
/// Bytes of a Q5_0 block: f16 scale, 4 bytes of high bits, 16 bytes of nibbles.
pub(crate) const Q5_0_BYTES: usize = 22;
/// Bytes of a Q5_1 block: f16 scale, f16 minimum, 4 bytes of high bits, 16 bytes of nibbles.
pub(crate) const Q5_1_BYTES: usize = 24;

/// Where a Q4_0 block's nibbles start.
pub(crate) const Q4_0_NIBBLES: usize = 2;
/// Where a Q5_0 block's high bits start.
pub(crate) const Q5_0_HIGH_BITS: usize = 2;
/// Where a Q5_0 block's nibbles start.
pub(crate) const Q5_0_NIBBLES: usize = 6;
/// Where a Q5_1 block's minimum starts.
pub(crate) const Q5_1_MIN: usize = 2;
/// Where a Q5_1 block's high bits start.
pub(crate) const Q5_1_HIGH_BITS: usize = 4;
/// Where a Q5_1 block's nibbles start.
pub(crate) const Q5_1_NIBBLES: usize = 8;

/// Bytes of nibbles in every block.
const NIBBLE_BYTES: usize = BLOCK / 2;
/// What Q4_0 subtracts from its quants.
const Q4_0_OFFSET: i32 = 8;
/// What Q5_0 subtracts from its quants.
const Q5_0_OFFSET: i32 = 16;

/// The 32 quants of the nibble bytes at `block[at..at + 16]`, in value order.
fn nibbles(block: &[u8], at: usize) -> [u8; BLOCK] {
    let packed = &block[at..at + NIBBLE_BYTES];
    std::array::from_fn(|value| {
        let byte = packed[value % NIBBLE_BYTES];
        if value < NIBBLE_BYTES {
            byte & 0x0F
        } else {
            byte >> 4
        }
    })
}

/// The 32 five-bit quants of a block whose high bits start at `high_at` and nibbles at
/// `nibbles_at`, in value order.
fn five_bit_quants(block: &[u8], high_at: usize, nibbles_at: usize) -> [u8; BLOCK] {
    let high = u32::from_le_bytes([
        block[high_at],
        block[high_at + 1],
        block[high_at + 2],
        block[high_at + 3],
    ]);
    let mut quants = nibbles(block, nibbles_at);
    for (value, quant) in quants.iter_mut().enumerate() {
        *quant |= (((high >> value) & 1) as u8) << 4;
    }
    quants
}

/// Writes one Q4_0 block's 32 values.
pub(crate) fn dequantize_q4_0(block: &[u8], values: &mut [f32]) {
    let scale = half_at(block, 0);
    let quants = nibbles(block, Q4_0_NIBBLES);
    for (value, quant) in values[..BLOCK].iter_mut().zip(quants) {
        *value = (i32::from(quant) - Q4_0_OFFSET) as f32 * scale;
    }
}

/// Writes one Q5_0 block's 32 values.
pub(crate) fn dequantize_q5_0(block: &[u8], values: &mut [f32]) {
    let scale = half_at(block, 0);
    let quants = five_bit_quants(block, Q5_0_HIGH_BITS, Q5_0_NIBBLES);
    for (value, quant) in values[..BLOCK].iter_mut().zip(quants) {
        *value = (i32::from(quant) - Q5_0_OFFSET) as f32 * scale;
    }
}

/// Writes one Q5_1 block's 32 values.
pub(crate) fn dequantize_q5_1(block: &[u8], values: &mut [f32]) {
    let (scale, min) = (half_at(block, 0), half_at(block, Q5_1_MIN));
    let quants = five_bit_quants(block, Q5_1_HIGH_BITS, Q5_1_NIBBLES);
    for (value, quant) in values[..BLOCK].iter_mut().zip(quants) {
        *value = f32::from(quant) * scale + min;
    }
}

/// The exact `Σ (q − offset) · a` of 32 quants with 32 activations.
fn offset_dot(quants: [u8; BLOCK], offset: i32, activations: &[i8]) -> i32 {
    quants
        .iter()
        .zip(&activations[..BLOCK])
        .map(|(quant, activation)| (i32::from(*quant) - offset) * i32::from(*activation))
        .sum()
}

/// The exact integer dot product of one Q4_0 block with its 32 activations.
pub(crate) fn q4_0_block_dot(block: &[u8], activations: &[i8]) -> i32 {
    offset_dot(nibbles(block, Q4_0_NIBBLES), Q4_0_OFFSET, activations)
}

/// The exact integer dot product of one Q5_0 block with its 32 activations.
pub(crate) fn q5_0_block_dot(block: &[u8], activations: &[i8]) -> i32 {
    let quants = five_bit_quants(block, Q5_0_HIGH_BITS, Q5_0_NIBBLES);
    offset_dot(quants, Q5_0_OFFSET, activations)
}

/// The exact integer dot product of one Q5_1 block's (unsigned) quants with its 32
/// activations.
pub(crate) fn q5_1_block_dot(block: &[u8], activations: &[i8]) -> i32 {
    let quants = five_bit_quants(block, Q5_1_HIGH_BITS, Q5_1_NIBBLES);
    offset_dot(quants, 0, activations)
}

/// One Q4_0 or Q5_0 block's term: `dot · d · d_a`, multiplied left to right.
#[inline]
pub(crate) fn scaled_term(dot: i32, scale: f32, activation_scale: f32) -> f32 {
    dot as f32 * scale * activation_scale
}

/// One Q5_1 block's term: `dot · d · d_a + m · s_a`, each product rounded before the add.
#[inline]
pub(crate) fn offset_term(
    dot: i32,
    scale: f32,
    activation_scale: f32,
    min: f32,
    activation_sum: f32,
) -> f32 {
    scaled_term(dot, scale, activation_scale) + min * activation_sum
}

/// The number of blocks of a row, after checking that the weight bytes and every part of the
/// activation row hold that many.
#[inline]
pub(crate) fn checked_blocks(
    weights: &[u8],
    activations: ActivationRow<'_>,
    block_bytes: usize,
) -> usize {
    let blocks = activations.scales.len();
    assert!(
        blocks.checked_mul(block_bytes) == Some(weights.len())
            && blocks.checked_mul(BLOCK) == Some(activations.quants.len())
            && activations.sums.len() == blocks,
        "kernel operands of unequal length"
    );
    blocks
}

/// Lanes the block terms are summed in.
pub(crate) const LANES: usize = 8;

/// The sum of `term(block bytes, block index)` over a row's blocks: block `b` into lane
/// `b % 8`, the blocks after the last whole group of eight first, then the others in order;
/// then [`combine_lanes`].
fn sum_terms(
    weights: &[u8],
    activations: ActivationRow<'_>,
    block_bytes: usize,
    term: impl Fn(&[u8], usize) -> f32,
) -> f32 {
    let blocks = checked_blocks(weights, activations, block_bytes);
    let whole = blocks / LANES * LANES;
    let mut lanes = [0f32; LANES];
    for block in (whole..blocks).chain(0..whole) {
        let bytes = &weights[block * block_bytes..(block + 1) * block_bytes];
        lanes[block % LANES] += term(bytes, block);
    }
    combine_lanes(lanes)
}

/// A row's dot product from its lanes, in this order: lane `k` plus lane `k + 4` (`k < 4`),
/// then `k` plus `k + 2` (`k < 2`), then lane 0 plus lane 1.
pub(crate) fn combine_lanes(lanes: [f32; LANES]) -> f32 {
    combine_lanes_with(&lanes, |a, b| a + b)
}

/// [`combine_lanes`]' order of additions over lanes of any kind (a vector of outputs' lanes
/// adds them lane by lane, each output in that order), with `add` adding two.
#[inline]
pub(crate) fn combine_lanes_with<T: Copy>(lanes: &[T; LANES], add: impl Fn(T, T) -> T) -> T {
    let fours: [T; 4] = std::array::from_fn(|k| add(lanes[k], lanes[k + 4]));
    add(add(fours[0], fours[2]), add(fours[1], fours[3]))
}

/// The 32 activations of block `block`.
fn block_activations(activations: ActivationRow<'_>, block: usize) -> &[i8] {
    &activations.quants[block * BLOCK..(block + 1) * BLOCK]
}

/// One Q4_0 row against one activation row.
pub(crate) fn dot_q4_0(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    sum_terms(weights, activations, Q4_0_BYTES, |bytes, block| {
        let dot = q4_0_block_dot(bytes, block_activations(activations, block));
        scaled_term(dot, half_at(bytes, 0), activations.scales[block])
    })
}

/// One Q5_0 row against one activation row.
pub(crate) fn dot_q5_0(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    sum_terms(weights, activations, Q5_0_BYTES, |bytes, block| {
        let dot = q5_0_block_dot(bytes, block_activations(activations, block));
        scaled_term(dot, half_at(bytes, 0), activations.scales[block])
    })
}

/// One Q5_1 row against one activation row.
pub(crate) fn dot_q5_1(weights: &[u8], activations: ActivationRow<'_>) -> f32 {
    sum_terms(weights, activations, Q5_1_BYTES, |bytes, block| {
        let dot = q5_1_block_dot(bytes, block_activations(activations, block));
        let min = half_at(bytes, Q5_1_MIN);
        offset_term(
            dot,
            half_at(bytes, 0),
            activations.scales[block],
            min,
            activations.sums[block],
        )
    })
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::activations::QuantizedRows;

    /// A small deterministic generator (xorshift64*) for random operands.
    struct Random(u64);

    impl Random {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// Uniform in `-1..1`.
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// The little-endian bytes of `value` rounded to f16.
    fn half_bytes(value: f32) -> [u8; 2] {
        f16::from_f32(value).to_le_bytes()
    }

    /// 16 nibble bytes: byte `j` holds `j` low and `15 − j` high, so quant `v` is `v` for
    /// `v < 16` and `31 − v` above.
    fn counting_nibbles() -> Vec<u8> {
        (0..16u8).map(|j| j | ((15 - j) << 4)).collect()
    }

    /// High bits `0xF0F0_0F0F`: bits 0-3, 8-11, 20-23 and 28-31 set.
    const HIGH_BITS: [u8; 4] = [0x0F, 0x0F, 0xF0, 0xF0];

    #[test]
    fn a_q4_0_block_dequantizes_to_its_quants_minus_eight_times_the_scale() {
        let mut block = half_bytes(0.5).to_vec();
        block.extend(counting_nibbles());
        let mut values = [0f32; BLOCK];
        dequantize_q4_0(&block, &mut values);
        // Values 0..16: quant v, (v − 8) / 2; values 16..32: quant 31 − v, (23 − v) / 2.
        assert_eq!(values[..4], [-4.0, -3.5, -3.0, -2.5]);
        assert_eq!(values[8], 0.0);
        assert_eq!(values[15], 3.5);
        assert_eq!(values[16], 3.5);
        assert_eq!(values[23], 0.0);
        assert_eq!(values[31], -4.0);
    }

    #[test]
    fn a_q5_0_block_takes_bit_four_of_each_quant_from_its_high_bits() {
        let mut block = half_bytes(2.0).to_vec();
        block.extend(HIGH_BITS);
        block.extend(counting_nibbles());
        let mut values = [0f32; BLOCK];
        dequantize_q5_0(&block, &mut values);
        // (quant − 16) · 2, quant = nibble + 16 where the high bit is set.
        let expected = [
            (0, 0.0),    // nibble 0, bit set: 16
            (3, 6.0),    // nibble 3, bit set: 19
            (4, -24.0),  // nibble 4, bit clear: 4
            (11, 22.0),  // nibble 11, bit set: 27
            (15, -2.0),  // nibble 15, bit clear: 15
            (16, -2.0),  // nibble 15, bit clear: 15
            (20, 22.0),  // nibble 11, bit set: 27
            (27, -24.0), // nibble 4, bit clear: 4
            (31, 0.0),   // nibble 0, bit set: 16
        ];
        for (value, want) in expected {
            assert_eq!(values[value], want, "value {value}");
        }
    }

    #[test]
    fn a_q5_1_block_dequantizes_to_quant_times_scale_plus_minimum() {
        let mut block = half_bytes(0.25).to_vec();
        block.extend(half_bytes(-1.5));
        block.extend(HIGH_BITS);
        block.extend(counting_nibbles());
        let mut values = [0f32; BLOCK];
        dequantize_q5_1(&block, &mut values);
        let expected = [
            (0, 2.5),   // 16
            (4, -0.5),  // 4
            (11, 5.25), // 27
            (15, 2.25), // 15
            (20, 5.25), // 27
            (25, 0.0),  // nibble 6, bit clear: 6
            (30, 2.75), // nibble 1, bit set: 17
            (31, 2.5),  // 16
        ];
        for (value, want) in expected {
            assert_eq!(values[value], want, "value {value}");
        }
    }

    /// Random block bytes of `block_bytes` each, scales (and minimums) drawn from `scale`.
    fn random_blocks(
        random: &mut Random,
        blocks: usize,
        block_bytes: usize,
        scale: f32,
    ) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(blocks * block_bytes);
        for _ in 0..blocks {
            bytes.extend(half_bytes(random.unit() * scale));
            if block_bytes == Q5_1_BYTES {
                bytes.extend(half_bytes(random.unit() * scale * 16.0));
            }
            while bytes.len() % block_bytes != 0 {
                bytes.push(random.next() as u8);
            }
        }
        bytes
    }

    type Dequantize = fn(&[u8], &mut [f32]);
    type Dot = fn(&[u8], ActivationRow<'_>) -> f32;

    const FORMATS: [(usize, Dequantize, Dot); 3] = [
        (Q4_0_BYTES, dequantize_q4_0, dot_q4_0),
        (Q5_0_BYTES, dequantize_q5_0, dot_q5_0),
        (Q5_1_BYTES, dequantize_q5_1, dot_q5_1),
    ];

    /// The f64 sum of `w · a · d_a` over a row, with the dequantized weights `w` and the
    /// quantized activations, and a bound on the reference's error: f32 rounding of
    /// `blocks + 4` operations over the magnitude of the terms, plus the f16 rounding of each
    /// scaled activation sum `s_a` (at most 2⁻⁹ of `|m · d_a · Σa|`) for Q5_1.
    fn float_evaluation(
        dequantize: Dequantize,
        weights: &[u8],
        rows: &QuantizedRows,
    ) -> (f64, f64) {
        let row = rows.row(0);
        let block_bytes = weights.len() / row.scales.len();
        let (mut sum, mut magnitude, mut sums_error) = (0f64, 0f64, 0f64);
        for (block, bytes) in weights.chunks_exact(block_bytes).enumerate() {
            let mut values = [0f32; BLOCK];
            dequantize(bytes, &mut values);
            let activation_scale = f64::from(row.scales[block]);
            let quants = block_activations(row, block);
            let min = if block_bytes == Q5_1_BYTES {
                f64::from(half_at(bytes, Q5_1_MIN))
            } else {
                0.0
            };
            let quant_sum: f64 = quants.iter().map(|a| f64::from(*a)).sum();
            for (value, quant) in values.iter().zip(quants) {
                let product = f64::from(*value) * f64::from(*quant) * activation_scale;
                sum += product;
                magnitude += (product - min * f64::from(*quant) * activation_scale).abs();
            }
            magnitude += (min * quant_sum * activation_scale).abs();
            sums_error += (min * quant_sum * activation_scale).abs() / 512.0;
        }
        let blocks = row.scales.len() as f64;
        (
            sum,
            (blocks + 4.0) * magnitude / f64::from(1u32 << 23) + sums_error,
        )
    }

    #[test]
    fn the_reference_dots_equal_a_float_evaluation_of_the_same_operands() {
        let mut random = Random(0x9E37_79B9_7F4A_7C15);
        for (block_bytes, dequantize, dot) in FORMATS {
            for blocks in [1, 2, 7, 8, 9, 31, 48] {
                let weights = random_blocks(&mut random, blocks, block_bytes, 0.1);
                let input: Vec<f32> = (0..blocks * BLOCK).map(|_| random.unit() * 3.0).collect();
                let rows = QuantizedRows::quantize(&input, 1, blocks * BLOCK);
                let (want, bound) = float_evaluation(dequantize, &weights, &rows);
                let got = f64::from(dot(&weights, rows.row(0)));
                assert!(
                    (got - want).abs() <= bound,
                    "{block_bytes}-byte blocks × {blocks}: {got} vs {want} (bound {bound})"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "unequal length")]
    fn a_row_of_the_wrong_length_is_refused() {
        let rows = QuantizedRows::quantize(&[1.0; 64], 1, 64);
        dot_q5_0(&[0; Q5_0_BYTES], rows.row(0));
    }
}
