//! F32, F16 and BF16 weights against f32 activations.
//!
//! Widening: F32 values are their four bytes; F16 values are widened exactly (every pattern is
//! checked against the `half` crate), NaNs keeping their sign, payload and quiet bit as numpy's
//! conversion keeps them; BF16 values are the top 16 bits of an f32.
//!
//! The dot product's arithmetic, which every path reproduces bit for bit:
//! - value `i` goes into lane `i % 8` of accumulator `(i / 8) % 4` (four accumulators of
//!   eight lanes, one AVX2 vector each, so four sums advance independently);
//! - each lane starts at `+0.0` and takes its values in order, `lane = lane + w·a`: the
//!   product rounded to f32, then the sum rounded (never fused), see [`step`];
//! - a row of any length works: a last group shorter than eight values goes into the first
//!   lanes of its accumulator and leaves the others as they were;
//! - the lanes are then added in one fixed order, see [`combine`].
//!
//! A lane never holds `-0.0` (it starts at `+0.0`, and a correctly rounded sum is `-0.0` only
//! when both terms are), so a SIMD path may add `0·0` to lanes a short last group leaves out.
//! A NaN among the operands gives a NaN on every path; which NaN (its payload) is not part of
//! the contract.
//!
//! Multiply-then-add was chosen over a fused multiply-add: the AVX2 kernel ran at the same
//! speed either way (the rows stream from memory), while the reference, compiled for any
//! x86_64, ran 3.5 times slower with `f32::mul_add` (a library call per value without FMA).

use super::FloatFormat;

/// Lanes of one accumulator: the f32 of one AVX2 vector.
pub(crate) const LANES: usize = 8;

/// Independent accumulators.
pub(crate) const ACCUMULATORS: usize = 4;

/// Values one round over every accumulator takes.
pub(crate) const STRIDE: usize = LANES * ACCUMULATORS;

/// The running sums of a dot product: `[accumulator][lane]`.
pub(crate) type Lanes = [[f32; LANES]; ACCUMULATORS];

/// The value of one step of an F16 subnormal's significand: 2^-24.
const HALF_SUBNORMAL_STEP: f32 = 1.0 / (1u32 << 24) as f32;

/// Writes the values of `bytes` (whole values) as f32, bit for bit as gguf's numpy
/// dequantization gives them (NaNs and infinities kept).
pub(crate) fn dequantize(format: FloatFormat, bytes: &[u8], values: &mut [f32]) {
    assert_eq!(
        bytes.len(),
        values.len() * format.value_bytes(),
        "{format:?} bytes for a different number of values"
    );
    match format {
        FloatFormat::F32 => widen::<4>(bytes, values, f32::from_le_bytes),
        FloatFormat::F16 => widen::<2>(bytes, values, |b| f16_to_f32(u16::from_le_bytes(b))),
        FloatFormat::Bf16 => widen::<2>(bytes, values, |b| bf16_to_f32(u16::from_le_bytes(b))),
    }
}

/// Writes `value(bytes of value i)` into `values[i]` for every value of `WIDTH` bytes.
#[inline]
fn widen<const WIDTH: usize>(bytes: &[u8], values: &mut [f32], value: impl Fn([u8; WIDTH]) -> f32) {
    for (out, chunk) in values.iter_mut().zip(bytes.chunks_exact(WIDTH)) {
        *out = value(std::array::from_fn(|k| chunk[k]));
    }
}

/// The f32 of an F16's bits, exact. A NaN keeps its sign, payload and quiet bit as they are
/// (hardware conversions and `half` set the quiet bit; numpy does not).
#[inline]
fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exponent = u32::from(bits >> 10) & 0x1F;
    let significand = u32::from(bits & 0x3FF);
    let magnitude = match exponent {
        // Zeros and subnormals: significand · 2^-24, a normal f32 (or zero), exact.
        0 => (significand as f32 * HALF_SUBNORMAL_STEP).to_bits(),
        // Infinities and NaNs: every exponent bit set, the significand as it is.
        0x1F => 0x7F80_0000 | significand << 13,
        // Normal numbers: the exponent rebiased from 15 to 127.
        _ => (exponent + 127 - 15) << 23 | significand << 13,
    };
    f32::from_bits(sign | magnitude)
}

/// The f32 of a bfloat16's bits: they are its top half.
#[inline]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// One row of weights against one row of activations: see the module doc for the arithmetic.
pub(crate) fn dot(format: FloatFormat, weights: &[u8], activations: &[f32]) -> f32 {
    check_lengths(format, weights, activations);
    let mut lanes: Lanes = [[0.0; LANES]; ACCUMULATORS];
    let mut widened = [0f32; STRIDE];
    let whole = activations.len() / STRIDE * STRIDE;
    let (body, tail) = weights.split_at(whole * format.value_bytes());
    let (body_activations, tail_activations) = activations.split_at(whole);
    for (bytes, activations) in body
        .chunks_exact(STRIDE * format.value_bytes())
        .zip(body_activations.chunks_exact(STRIDE))
    {
        dequantize(format, bytes, &mut widened);
        accumulate(&mut lanes, &widened, activations);
    }
    let widened = &mut widened[..tail_activations.len()];
    dequantize(format, tail, widened);
    accumulate(&mut lanes, widened, tail_activations);
    combine(&lanes)
}

/// Checks that `weights` holds one value of `format` per activation.
pub(crate) fn check_lengths(format: FloatFormat, weights: &[u8], activations: &[f32]) {
    assert!(
        weights.len() == activations.len() * format.value_bytes(),
        "kernel operands of unequal length"
    );
}

/// Adds the products of up to one stride of values (starting at a multiple of [`STRIDE`]) to
/// their lanes: value `i` of the slices into lane `i % 8` of accumulator `i / 8`.
#[inline]
fn accumulate(lanes: &mut Lanes, weights: &[f32], activations: &[f32]) {
    let groups = weights.chunks(LANES).zip(activations.chunks(LANES));
    for (lanes, (weights, activations)) in lanes.iter_mut().zip(groups) {
        for (lane, (weight, activation)) in lanes.iter_mut().zip(weights.iter().zip(activations)) {
            *lane = step(*lane, *weight, *activation);
        }
    }
}

/// One value into its lane: `lane + weight · activation`, the product rounded, then the sum.
#[inline]
fn step(lane: f32, weight: f32, activation: f32) -> f32 {
    lane + weight * activation
}

/// The dot product from its lanes, in this order: per lane `(a0 + a1) + (a2 + a3)` over the
/// four accumulators, then lane `k` plus lane `k + 4` (`k < 4`), then `k` plus `k + 2`
/// (`k < 2`), then lane 0 plus lane 1.
pub(crate) fn combine(lanes: &Lanes) -> f32 {
    let [first, second, third, fourth] = lanes;
    let mut column = [0f32; LANES];
    for (lane, sum) in column.iter_mut().enumerate() {
        *sum = (first[lane] + second[lane]) + (third[lane] + fourth[lane]);
    }
    let quarters: [f32; 4] = std::array::from_fn(|k| column[k] + column[k + 4]);
    let halves: [f32; 2] = std::array::from_fn(|k| quarters[k] + quarters[k + 2]);
    halves[0] + halves[1]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small deterministic generator (splitmix64) for test rows.
    pub(crate) struct Random(pub(crate) u64);

    impl Random {
        /// The next 64 random bits.
        pub(crate) fn bits(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// A value of either sign with magnitude in `[2^low, 2^high)`.
        pub(crate) fn spread(&mut self, low: i32, high: i32) -> f32 {
            let bits = self.bits();
            let exponent = low + (bits % (high - low) as u64) as i32;
            let mantissa = 1.0 + ((bits >> 32) as u32 >> 8) as f32 / (1u32 << 24) as f32;
            let sign = if bits >> 63 == 1 { -1.0 } else { 1.0 };
            sign * mantissa * 2f32.powi(exponent)
        }
    }

    /// The bytes of `values` in `format` (rounded to it), and the values as stored.
    pub(crate) fn encode(format: FloatFormat, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = Vec::new();
        for value in values {
            match format {
                FloatFormat::F32 => bytes.extend_from_slice(&value.to_le_bytes()),
                FloatFormat::F16 => {
                    bytes.extend_from_slice(&half::f16::from_f32(*value).to_le_bytes())
                }
                FloatFormat::Bf16 => {
                    bytes.extend_from_slice(&half::bf16::from_f32(*value).to_le_bytes())
                }
            }
        }
        let mut stored = vec![0f32; values.len()];
        dequantize(format, &bytes, &mut stored);
        (bytes, stored)
    }

    /// Every format.
    pub(crate) const FORMATS: [FloatFormat; 3] =
        [FloatFormat::F32, FloatFormat::F16, FloatFormat::Bf16];

    /// The bits of `format`'s dequantization of `bytes`.
    fn dequantized_bits(format: FloatFormat, bytes: &[u8]) -> Vec<u32> {
        let mut values = vec![0f32; bytes.len() / format.value_bytes()];
        dequantize(format, bytes, &mut values);
        values.iter().map(|value| value.to_bits()).collect()
    }

    /// Little-endian bytes of 16-bit patterns.
    fn halves(patterns: &[u16]) -> Vec<u8> {
        patterns
            .iter()
            .flat_map(|bits| bits.to_le_bytes())
            .collect()
    }

    #[test]
    fn f32_values_are_their_bytes() {
        let patterns = [
            0x3FC0_0000u32,
            0x8000_0000,
            0x7F80_0000,
            0x7F80_0001,
            0x0000_0001,
        ];
        let bytes: Vec<u8> = patterns
            .iter()
            .flat_map(|bits| bits.to_le_bytes())
            .collect();
        assert_eq!(dequantized_bits(FloatFormat::F32, &bytes), patterns);
    }

    #[test]
    fn f16_values_widen_exactly_with_nans_as_they_are() {
        let cases = [
            (0x3C00, 0x3F80_0000), // 1.0
            (0xC000, 0xC000_0000), // -2.0
            (0x3555, 0x3EAA_A000), // 2^-2 · (1 + 0x155 / 1024)
            (0x0001, 0x3380_0000), // 2^-24, the smallest subnormal
            (0x03FF, 0x387F_C000), // 1023 · 2^-24, the largest subnormal
            (0x7BFF, 0x477F_E000), // 65504, the largest finite
            (0x8000, 0x8000_0000), // -0.0
            (0x7C00, 0x7F80_0000), // +inf
            (0xFC00, 0xFF80_0000), // -inf
            (0x7C01, 0x7F80_2000), // signalling NaN stays signalling
            (0xFE00, 0xFFC0_0000), // quiet NaN, negative
        ];
        let patterns: Vec<u16> = cases.iter().map(|(half, _)| *half).collect();
        let expected: Vec<u32> = cases.iter().map(|(_, single)| *single).collect();
        assert_eq!(
            dequantized_bits(FloatFormat::F16, &halves(&patterns)),
            expected
        );
    }

    #[test]
    fn every_f16_pattern_widens_to_its_value() {
        for bits in 0..=u16::MAX {
            let value = f16_to_f32(bits);
            let exact = half::f16::from_bits(bits).to_f32();
            if exact.is_nan() {
                let expected =
                    u32::from(bits & 0x8000) << 16 | 0x7F80_0000 | u32::from(bits & 0x3FF) << 13;
                assert_eq!(value.to_bits(), expected, "{bits:#06x}");
            } else {
                assert_eq!(value.to_bits(), exact.to_bits(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn bf16_values_are_the_top_half_of_an_f32() {
        let cases = [
            (0x3F80, 0x3F80_0000), // 1.0
            (0xC040, 0xC040_0000), // -3.0
            (0x0001, 0x0001_0000), // a subnormal
            (0xFF80, 0xFF80_0000), // -inf
            (0x7F81, 0x7F81_0000), // signalling NaN stays signalling
        ];
        let patterns: Vec<u16> = cases.iter().map(|(half, _)| *half).collect();
        let expected: Vec<u32> = cases.iter().map(|(_, single)| *single).collect();
        assert_eq!(
            dequantized_bits(FloatFormat::Bf16, &halves(&patterns)),
            expected
        );
    }

    /// The documented arithmetic written out value by value.
    fn documented_dot(weights: &[f32], activations: &[f32]) -> f32 {
        let mut lanes: Lanes = [[0.0; LANES]; ACCUMULATORS];
        for (i, (weight, activation)) in weights.iter().zip(activations).enumerate() {
            let lane = &mut lanes[(i / LANES) % ACCUMULATORS][i % LANES];
            *lane += weight * activation;
        }
        combine(&lanes)
    }

    #[test]
    fn dot_puts_value_i_into_lane_i_mod_8_of_accumulator_i_div_8_mod_4() {
        let mut random = Random(7);
        for format in FORMATS {
            for count in (0..140).chain([511, 1000]) {
                let values: Vec<f32> = (0..count).map(|_| random.spread(-12, 12)).collect();
                let (bytes, stored) = encode(format, &values);
                let activations: Vec<f32> = (0..count).map(|_| random.spread(-12, 12)).collect();
                let expected = documented_dot(&stored, &activations);
                let got = dot(format, &bytes, &activations);
                assert_eq!(got.to_bits(), expected.to_bits(), "{format:?} × {count}");
            }
        }
    }

    #[test]
    fn dot_is_within_the_rounding_bound_of_the_exact_sum() {
        let mut random = Random(11);
        for format in FORMATS {
            for count in [1usize, 7, 8, 33, 255, 576, 1536, 4099] {
                let values: Vec<f32> = (0..count).map(|_| random.spread(-8, 8)).collect();
                let (bytes, stored) = encode(format, &values);
                let activations: Vec<f32> = (0..count).map(|_| random.spread(-8, 8)).collect();
                let products = stored
                    .iter()
                    .zip(&activations)
                    .map(|(w, a)| f64::from(*w) * f64::from(*a));
                let exact: f64 = products.clone().sum();
                let magnitude: f64 = products.map(f64::abs).sum();
                // Each lane rounds once per value (at most ceil(n / 32) times), `combine` five
                // more times: |error| <= (ceil(n / 32) + 5) · 2^-24 · Σ|w·a| (to first order).
                let roundings = count.div_ceil(STRIDE) + 5;
                let bound = roundings as f64 * 2f64.powi(-24) * magnitude * 1.001;
                let got = f64::from(dot(format, &bytes, &activations));
                assert!(
                    (got - exact).abs() <= bound,
                    "{format:?} × {count}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn dot_of_small_integers_is_exact() {
        let weights: Vec<f32> = (0..45).map(|i| (i % 7) as f32 - 3.0).collect();
        let activations: Vec<f32> = (0..45).map(|i| (i % 5) as f32).collect();
        let exact: f32 = weights.iter().zip(&activations).map(|(w, a)| w * a).sum();
        for format in FORMATS {
            let (bytes, _) = encode(format, &weights);
            assert_eq!(dot(format, &bytes, &activations), exact, "{format:?}");
        }
    }

    #[test]
    fn combine_adds_accumulators_in_pairs() {
        // (2^24 + 1) + (1 + 1) = 2^24 + 2; added one after another the ones would be lost
        // (2^24 + 1 rounds to 2^24).
        let mut lanes: Lanes = [[0.0; LANES]; ACCUMULATORS];
        lanes[0][0] = 16_777_216.0;
        lanes[1][0] = 1.0;
        lanes[2][0] = 1.0;
        lanes[3][0] = 1.0;
        assert_eq!(combine(&lanes), 16_777_218.0);
    }

    #[test]
    fn combine_adds_lane_k_to_lane_k_plus_4_first() {
        // (lane 0 + lane 4) + (lane 2 + lane 6) = 2^24 and (lane 1 + lane 5) + … = 1, so the
        // result is 2^24; neighbours first ((lane 4 + lane 5) = 2) would give 2^24 + 2.
        let mut lanes: Lanes = [[0.0; LANES]; ACCUMULATORS];
        lanes[0][0] = 16_777_216.0;
        lanes[0][4] = 1.0;
        lanes[0][5] = 1.0;
        assert_eq!(combine(&lanes), 16_777_216.0);
    }
}
