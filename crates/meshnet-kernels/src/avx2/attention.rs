//! AVX2 attention over one cached head (equal to `attention`'s reference bit for bit).
//!
//! - Scores, eight positions at a time: each position's lanes accumulate in their own vector
//!   (`vfmadd`, the query's group loaded once for the eight keys), and the eight
//!   vectors are reduced together by `hadd`s, which add lanes in exactly the reference's
//!   pairs `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`; the positions past the last
//!   eight take the reference's `dot`.
//! - Weights: the maximum (exact in any order), then eight weights at a time through the
//!   reference's polynomial with the same operations lane by lane, their sum in the
//!   reference's eight lanes.
//! - Values: up to 64 outputs kept in registers while the positions stream past, each output
//!   taking `fma(weight, value, sum)` in position order.
//! - Keys and values are half floats, widened by `vcvtph2ps` (exact, as the reference's
//!   `to_f32`).
//!
//! Heads whose size is not a multiple of eight take the reference for scores and values.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use half::f16;

use super::Avx2;
use crate::attention::{self, CachedHead, Group, LANES};
#[cfg(target_arch = "x86_64")]
use crate::attention::{EXP_FLOOR, EXP_TERMS, LN2_HIGH, LN2_LOW, LOG2_E};

/// Positions every query takes in turn: 64 keys of a 64-value head are 16 KiB, in the first
/// level of cache for the next query.
const BLOCK_POSITIONS: usize = 64;

/// Output vectors one pass over the values keeps in registers.
#[cfg(target_arch = "x86_64")]
const VALUE_VECTORS: usize = 8;

impl Avx2 {
    /// `attention::attend_piece` for every query of `group` (`weights.len() / queries`
    /// positions from `group.first` on): scores and weights into `weights` (one row per
    /// query), each query's largest score, total and weighted values into `sums`. Positions go
    /// [`BLOCK_POSITIONS`] at a time, every query taking its turn on a block while its keys or
    /// values are in cache.
    pub(crate) fn attend_piece(
        self,
        head: CachedHead<'_>,
        group: Group<'_>,
        weights: &mut [f32],
        sums: &mut [f32],
    ) {
        let visible = weights.len() / (group.queries.len() / head.head_dim);
        let vectors = head.head_dim.is_multiple_of(LANES);
        for block in (0..visible).step_by(BLOCK_POSITIONS) {
            let positions = block..(block + BLOCK_POSITIONS).min(visible);
            let rows = weights.chunks_exact_mut(visible);
            for (row, query) in rows.zip(group.queries.chunks_exact(head.head_dim)) {
                let first = group.first + positions.start;
                let scores = &mut row[positions.clone()];
                if vectors {
                    // SAFETY: the token exists only when the CPU has AVX2, FMA and F16C
                    // (`Avx2::detect`), and the head's size is a multiple of eight.
                    unsafe { self::scores(head, first, query, group.scale, scores) };
                } else {
                    attention::scores(head, first, query, group.scale, scores);
                }
            }
        }
        let per_query = sums.chunks_exact_mut(head.head_dim + 2);
        for (row, sums) in weights.chunks_exact_mut(visible).zip(per_query) {
            // SAFETY: the CPU has AVX2 and FMA (as above).
            (sums[0], sums[1]) = unsafe { exponentiate(row) };
            sums[2..].fill(0.0);
        }
        for block in (0..visible).step_by(BLOCK_POSITIONS) {
            let positions = block..(block + BLOCK_POSITIONS).min(visible);
            let rows = weights.chunks_exact(visible);
            for (row, sums) in rows.zip(sums.chunks_exact_mut(head.head_dim + 2)) {
                let first = group.first + positions.start;
                let row = &row[positions.clone()];
                if vectors {
                    // SAFETY: as for the scores.
                    unsafe { weighted_values(head, first, row, &mut sums[2..]) };
                } else {
                    attention::add_weighted_values(head, first, row, &mut sums[2..]);
                }
            }
        }
    }
}

/// Eight f32 from `values[at..at + 8]` (bounds checked).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn load(values: &[f32], at: usize) -> __m256 {
    let eight = &values[at..at + LANES];
    // SAFETY: `eight` holds the eight f32 an unaligned load reads.
    unsafe { _mm256_loadu_ps(eight.as_ptr()) }
}

/// Eight half floats from `values[at..at + 8]`, widened to f32 (exactly; bounds checked).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load_half(values: &[f16], at: usize) -> __m256 {
    let eight = &values[at..at + LANES];
    // SAFETY: `eight` holds the sixteen bytes an unaligned load reads.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(eight.as_ptr().cast())) }
}

/// Stores `vector` into `values[at..at + 8]` (bounds checked).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store(values: &mut [f32], at: usize, vector: __m256) {
    let eight = &mut values[at..at + LANES];
    // SAFETY: `eight` holds the eight f32 an unaligned store writes.
    unsafe { _mm256_storeu_ps(eight.as_mut_ptr(), vector) }
}

/// The reference's `scores`, eight positions at a time.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `head.head_dim` must be a multiple of eight.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores(
    head: CachedHead<'_>,
    first: usize,
    query: &[f32],
    scale: f32,
    scores: &mut [f32],
) {
    let whole = scores.len() - scores.len() % LANES;
    let scale_lanes = _mm256_set1_ps(scale);
    for at in (0..whole).step_by(LANES) {
        let keys: [&[f16]; LANES] = std::array::from_fn(|k| head.key(first + at + k));
        let mut sums = [_mm256_setzero_ps(); LANES];
        for start in (0..head.head_dim).step_by(LANES) {
            let query_part = load(query, start);
            for (sum, key) in sums.iter_mut().zip(keys) {
                *sum = _mm256_fmadd_ps(query_part, load_half(key, start), *sum);
            }
        }
        store(scores, at, _mm256_mul_ps(reduce_eight(sums), scale_lanes));
    }
    for (at, score) in scores.iter_mut().enumerate().skip(whole) {
        *score = attention::dot(query, head.key(first + at)) * scale;
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn scores(_: CachedHead<'_>, _: usize, _: &[f32], _: f32, _: &mut [f32]) {
    unreachable!("no AVX2 outside x86_64")
}

/// Lane `k` of the result is vector `k`'s lanes added as `attention::combine` adds them.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn reduce_eight(sums: [__m256; LANES]) -> __m256 {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7].
    let pairs: [__m256; 4] = std::array::from_fn(|k| _mm256_hadd_ps(sums[2 * k], sums[2 * k + 1]));
    // Lanes 0..4: vectors 0..4's (l0 + l1) + (l2 + l3); lanes 4..8 their (l4 + l5) + (l6 + l7).
    let low_four = _mm256_hadd_ps(pairs[0], pairs[1]);
    // The same for vectors 4..8.
    let high_four = _mm256_hadd_ps(pairs[2], pairs[3]);
    let first_halves = _mm256_permute2f128_ps::<0x20>(low_four, high_four);
    let second_halves = _mm256_permute2f128_ps::<0x31>(low_four, high_four);
    _mm256_add_ps(first_halves, second_halves)
}

/// The reference's `exponentiate`, eight weights at a time.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exponentiate(row: &mut [f32]) -> (f32, f32) {
    let whole = row.len() - row.len() % LANES;
    let mut max_lanes = _mm256_set1_ps(f32::NEG_INFINITY);
    for at in (0..whole).step_by(LANES) {
        max_lanes = _mm256_max_ps(max_lanes, load(row, at));
    }
    let mut lanes = [0f32; LANES];
    store(&mut lanes, 0, max_lanes);
    let max = lanes
        .iter()
        .chain(&row[whole..])
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let max_lanes = _mm256_set1_ps(max);
    let mut totals = _mm256_setzero_ps();
    for at in (0..whole).step_by(LANES) {
        let weights = exp_nonpositive(_mm256_sub_ps(load(row, at), max_lanes));
        store(row, at, weights);
        totals = _mm256_add_ps(totals, weights);
    }
    store(&mut lanes, 0, totals);
    for (lane, weight) in lanes.iter_mut().zip(&mut row[whole..]) {
        *weight = attention::exp_nonpositive(*weight - max);
        *lane += *weight;
    }
    (max, attention::combine(lanes))
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn exponentiate(_: &mut [f32]) -> (f32, f32) {
    unreachable!("no AVX2 outside x86_64")
}

/// `attention::exp_nonpositive` of each lane, the same operations in the same order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp_nonpositive(x: __m256) -> __m256 {
    let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_FLOOR));
    let n = _mm256_floor_ps(_mm256_add_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)),
        _mm256_set1_ps(0.5),
    ));
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HIGH))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LOW)),
    );
    let mut polynomial = _mm256_set1_ps(EXP_TERMS[LANES - 1]);
    for term in EXP_TERMS[..LANES - 1].iter().rev() {
        polynomial = _mm256_fmadd_ps(polynomial, r, _mm256_set1_ps(*term));
    }
    let exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    let power = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
    _mm256_andnot_ps(below, _mm256_mul_ps(polynomial, power))
}

/// `output[d] += weights[at] · value(first + at)[d]` position by position (the reference's
/// `weighted_values` on outputs that start at zero): the outputs [`VALUE_VECTORS`] vectors at
/// a time (then one at a time), each pass over every position.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `head.head_dim` must be a multiple of eight.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_values(head: CachedHead<'_>, first: usize, weights: &[f32], output: &mut [f32]) {
    let wide = VALUE_VECTORS * LANES;
    let whole = head.head_dim - head.head_dim % wide;
    for start in (0..whole).step_by(wide) {
        add_weighted::<VALUE_VECTORS>(head, first, weights, output, start);
    }
    for start in (whole..head.head_dim).step_by(LANES) {
        add_weighted::<1>(head, first, weights, output, start);
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn weighted_values(_: CachedHead<'_>, _: usize, _: &[f32], _: &mut [f32]) {
    unreachable!("no AVX2 outside x86_64")
}

/// Outputs `start..start + 8·N`: each adds `weight · value` over the positions, in order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_weighted<const N: usize>(
    head: CachedHead<'_>,
    first: usize,
    weights: &[f32],
    output: &mut [f32],
    start: usize,
) {
    let mut sums: [__m256; N] = std::array::from_fn(|k| load(output, start + k * LANES));
    for (at, weight) in weights.iter().enumerate() {
        let value = head.value(first + at);
        let weight = _mm256_set1_ps(*weight);
        for (k, sum) in sums.iter_mut().enumerate() {
            let part = load_half(value, start + k * LANES);
            *sum = _mm256_fmadd_ps(weight, part, *sum);
        }
    }
    for (k, sum) in sums.into_iter().enumerate() {
        store(output, start + k * LANES, sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kernel;
    use crate::attention::attend_head;

    /// Values spread over several binades, from a small xorshift.
    struct Random(u64);

    impl Random {
        fn value(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            let unit = (self.0 >> 40) as f32 / (1u64 << 24) as f32;
            (unit * 2.0 - 1.0) * 4f32.powi((self.0 % 3) as i32)
        }

        fn values(&mut self, count: usize) -> Vec<f32> {
            (0..count).map(|_| self.value()).collect()
        }

        fn halves(&mut self, count: usize) -> Vec<f16> {
            (0..count).map(|_| f16::from_f32(self.value())).collect()
        }
    }

    /// Both kernels' outputs for one shape, as bits.
    fn both(
        token: Avx2,
        shape: (usize, usize, usize, usize),
        positions: std::ops::Range<usize>,
        scale: f32,
        seed: u64,
    ) -> [Vec<u32>; 2] {
        let (kv_heads, head_dim, members, cached) = shape;
        let mut random = Random(seed | 1);
        let row_width = kv_heads * head_dim;
        let keys = random.halves(cached * row_width);
        let values = random.halves(cached * row_width);
        let queries = random.values(members * head_dim);
        let head = CachedHead {
            keys: &keys,
            values: &values,
            row_width,
            offset: (kv_heads - 1) * head_dim,
            head_dim,
        };
        [Kernel::Scalar, Kernel::Avx2(crate::Avx2Kernel(token))].map(|kernel| {
            let mut weights = Vec::new();
            let mut attended = vec![f32::NAN; queries.len()];
            attend_head(
                kernel,
                head,
                positions.clone(),
                &queries,
                scale,
                &mut weights,
                &mut attended,
            )
            .expect("the shape fits");
            attended.iter().map(|v| v.to_bits()).collect()
        })
    }

    #[test]
    fn avx2_attention_gives_the_reference_bits() {
        let Some(token) = Avx2::detect() else { return };
        let mut seed = 1;
        for head_dim in [8, 12, 16, 64, 72, 128, 256] {
            for cached in [1, 7, 8, 9, 17, 100, 300] {
                for first in [0, cached / 3] {
                    seed += 1;
                    let [scalar, fast] =
                        both(token, (2, head_dim, 3, cached), first..cached, 0.125, seed);
                    assert_eq!(scalar, fast, "head {head_dim}, positions {first}..{cached}");
                }
            }
        }
    }

    #[test]
    fn the_vector_exponent_is_the_reference_exponent() {
        let Some(_) = Avx2::detect() else { return };
        let mut x = 1.0f32;
        let mut inputs = vec![
            0.0,
            -0.0,
            -87.0,
            -87.000_01,
            -86.999_99,
            f32::NEG_INFINITY,
            -1e30,
        ];
        while x > -90.0 {
            inputs.push(x);
            x -= 0.000_731;
        }
        for chunk in inputs.chunks(LANES) {
            let mut lanes = [0f32; LANES];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut out = [0f32; LANES];
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { store(&mut out, 0, exp_nonpositive(load(&lanes, 0))) };
            for (input, fast) in lanes.iter().zip(out) {
                let reference = attention::exp_nonpositive(*input);
                assert_eq!(fast.to_bits(), reference.to_bits(), "e^{input}");
            }
        }
    }

    #[test]
    fn extreme_scores_give_the_reference_bits() {
        let Some(token) = Avx2::detect() else { return };
        // A score scale that pushes most weights under the exponent's floor, and one that
        // leaves them all near 1.
        for scale in [1e4, 1e-6, 0.0] {
            let [scalar, fast] = both(token, (3, 64, 3, 203), 0..203, scale, 9);
            assert_eq!(scalar, fast, "scale {scale}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_shape_gives_the_reference_bits(
            kv_heads in 1usize..4,
            eighths in 1usize..20,
            extra in 0usize..2,
            members in 1usize..5,
            cached in 1usize..600,
            skipped in 0usize..600,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let Some(token) = Avx2::detect() else { return Ok(()) };
            let head_dim = eighths * 8 + extra * 3;
            let first = skipped.min(cached - 1);
            let [scalar, fast] = both(token, (kv_heads, head_dim, members, cached), first..cached, 0.3, seed);
            proptest::prop_assert_eq!(scalar, fast);
        }
    }
}
