//! Attention of a few query heads over one cached key/value head: scores, softmax and the
//! weighted sum of values, in f32, in an order every kernel reproduces bit for bit.
//!
//! The reference's arithmetic, where `fma(a, b, c)` is `a·b + c` rounded once (`f32::mul_add`;
//! every other operation rounded on its own):
//! - a score is `dot(query, key) · scale`; `dot` puts value `i` into lane `i % 8` (`lane =
//!   fma(q, k, lane)`, lanes starting at `+0.0`) for the whole groups of eight, adds the lanes as
//!   `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` ([`combine`]), then takes the values
//!   past the last whole group in order (`sum = fma(q, k, sum)`);
//! - softmax takes the row's maximum, turns each score `s` into `exp(s − max)` by
//!   [`exp_nonpositive`] (a fixed polynomial, not the C library's `expf`), adds the weights
//!   into lane `i % 8` and combines the lanes as above, then divides each weight by that total;
//! - each output value starts at `+0.0` and takes `sum = fma(weight, value, sum)` position
//!   after position.
//!
//! Fused multiply-adds halve the vector instructions of the AVX2 kernel (every AVX2 CPU has
//! FMA); the reference pays for them only on a CPU without FMA, where `f32::mul_add` is a
//! library call.
//!
//! Scores are assumed finite; a NaN anywhere gives NaNs, which NaN is not part of the contract.

use std::ops::Range;

use crate::{Kernel, KernelError, Result};

/// Lanes of the reference's sums: the f32 of one AVX2 vector.
pub(crate) const LANES: usize = 8;

/// `log2(e)`.
pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// `ln 2` split in two: a head with few significant bits (so `n · LN2_HIGH` is exact for every
/// `n` used here: 0.693359375 = 355/512) and the rest.
pub(crate) const LN2_HIGH: f32 = 0.693_359_4;

/// `ln 2 − LN2_HIGH`.
pub(crate) const LN2_LOW: f32 = -2.121_944_4e-4;

/// Below this, `exp_nonpositive` gives `0.0` (e^-87 ≈ 1.6e-38, the edge of the normal f32s).
pub(crate) const EXP_FLOOR: f32 = -87.0;

/// The Taylor coefficients `1/k!` of `e^r` for `k = 0..=7`: on `|r| ≤ ln2/2` the first term
/// left out is below 6e-9, under half an f32 ulp of the result.
pub(crate) const EXP_TERMS: [f32; 8] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// One key/value head of a session's cache: position `p`'s key is
/// `keys[p · row_width + offset..][..head_dim]`, its value likewise in `values`.
#[derive(Clone, Copy, Debug)]
pub struct CachedHead<'a> {
    /// Cached keys, `row_width` values per position.
    pub keys: &'a [f32],
    /// Cached values, laid out as the keys.
    pub values: &'a [f32],
    /// Values per cached position (every key/value head side by side).
    pub row_width: usize,
    /// Where this head starts within a position's row.
    pub offset: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl CachedHead<'_> {
    /// Position `at`'s key.
    pub(crate) fn key(&self, at: usize) -> &[f32] {
        &self.keys[at * self.row_width + self.offset..][..self.head_dim]
    }

    /// Position `at`'s value.
    pub(crate) fn value(&self, at: usize) -> &[f32] {
        &self.values[at * self.row_width + self.offset..][..self.head_dim]
    }

    /// An error unless `positions` are cached, the head fits its rows and `queries` and
    /// `attended` hold whole heads, as many of each.
    fn check(&self, positions: &Range<usize>, queries: &[f32], attended: &[f32]) -> Result<()> {
        let shape_error = |what: String| Err(KernelError::Shape(what));
        if self.head_dim == 0 || self.offset + self.head_dim > self.row_width {
            return shape_error(format!(
                "a head of {} values at {} in rows of {}",
                self.head_dim, self.offset, self.row_width
            ));
        }
        let cached = self.keys.len() / self.row_width;
        if self.keys.len() != self.values.len() || positions.end > cached {
            return shape_error(format!(
                "positions {positions:?} of {} keys and {} values in rows of {}",
                self.keys.len(),
                self.values.len(),
                self.row_width
            ));
        }
        if !queries.len().is_multiple_of(self.head_dim) || queries.len() != attended.len() {
            return shape_error(format!(
                "{} query values and {} outputs for heads of {}",
                queries.len(),
                attended.len(),
                self.head_dim
            ));
        }
        Ok(())
    }
}

/// Attention of `queries` (whole heads, each of `head.head_dim` values) over the cached
/// `positions` of `head`, scores scaled by `scale`, into `attended` (as long as `queries`).
/// `weights` is scratch space (it ends holding each query's softmax weights, one row of
/// `positions.len()` per query). Every kernel gives the reference's bits (module docs).
///
/// Give every query head that shares the cached head in one call: the AVX2 kernel then reads
/// each key and value once for all of them (a long cache streams from memory, so that is
/// most of its time).
pub fn attend_head(
    kernel: Kernel,
    head: CachedHead<'_>,
    positions: Range<usize>,
    queries: &[f32],
    scale: f32,
    weights: &mut Vec<f32>,
    attended: &mut [f32],
) -> Result<()> {
    head.check(&positions, queries, attended)?;
    let visible = positions.len();
    weights.clear();
    weights.resize(queries.len() / head.head_dim * visible, 0.0);
    if visible == 0 {
        attended.fill(0.0);
        return Ok(());
    }
    match kernel {
        Kernel::Scalar => {
            let rows = weights.chunks_exact_mut(visible);
            let heads = queries
                .chunks_exact(head.head_dim)
                .zip(attended.chunks_exact_mut(head.head_dim));
            for (row, (query, output)) in rows.zip(heads) {
                scores(head, positions.start, query, scale, row);
                softmax(row);
                weighted_values(head, positions.start, row, output);
            }
        }
        Kernel::Avx2(fast) => {
            let group = Group {
                first: positions.start,
                queries,
                scale,
            };
            fast.0.attend_group(head, group, weights, attended);
        }
    }
    Ok(())
}

/// The queries that share a cached head, and where their positions start.
#[derive(Clone, Copy)]
pub(crate) struct Group<'a> {
    /// The first cached position they see.
    pub(crate) first: usize,
    /// Whole heads of query values.
    pub(crate) queries: &'a [f32],
    /// What each score is multiplied by.
    pub(crate) scale: f32,
}

/// `scores[at] = dot(query, key(first + at)) · scale` for every entry of `scores`.
pub(crate) fn scores(
    head: CachedHead<'_>,
    first: usize,
    query: &[f32],
    scale: f32,
    scores: &mut [f32],
) {
    for (at, score) in scores.iter_mut().enumerate() {
        *score = dot(query, head.key(first + at)) * scale;
    }
}

/// The reference's dot product (module docs).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let whole = a.len() - a.len() % LANES;
    let mut lanes = [0f32; LANES];
    for (a, b) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for lane in 0..LANES {
            lanes[lane] = a[lane].mul_add(b[lane], lanes[lane]);
        }
    }
    let mut sum = combine(lanes);
    for (a, b) in a[whole..].iter().zip(&b[whole..]) {
        sum = a.mul_add(*b, sum);
    }
    sum
}

/// The lanes added pairwise: `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
pub(crate) fn combine(lanes: [f32; LANES]) -> f32 {
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// The scores of `row` turned into softmax weights in place (module docs).
pub(crate) fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0f32; LANES];
    for (index, weight) in row.iter_mut().enumerate() {
        *weight = exp_nonpositive(*weight - max);
        lanes[index % LANES] += *weight;
    }
    let total = combine(lanes);
    for weight in row.iter_mut() {
        *weight /= total;
    }
}

/// `e^x` for `x ≤ 0`, within a few ulps: `x = n·ln2 + r` with `n = ⌊x·log2(e) + 1/2⌋`, the
/// Taylor polynomial of `e^r` by Horner's rule (one `fma` a term), times `2^n` built from its bits; `0.0` below
/// [`EXP_FLOOR`].
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    if x < EXP_FLOOR {
        return 0.0;
    }
    let n = (x * LOG2_E + 0.5).floor();
    let r = (x - n * LN2_HIGH) - n * LN2_LOW;
    let mut polynomial = EXP_TERMS[LANES - 1];
    for term in EXP_TERMS[..LANES - 1].iter().rev() {
        polynomial = polynomial.mul_add(r, *term);
    }
    polynomial * power_of_two(n)
}

/// `2^n` for a whole `n` in `-126..=127`, from its exponent bits.
pub(crate) fn power_of_two(n: f32) -> f32 {
    f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `output[d] = Σ weights[at] · value(first + at)[d]`, position by position from `+0.0`, one
/// `fma` each.
pub(crate) fn weighted_values(
    head: CachedHead<'_>,
    first: usize,
    weights: &[f32],
    output: &mut [f32],
) {
    output.fill(0.0);
    for (at, weight) in weights.iter().enumerate() {
        for (sum, value) in output.iter_mut().zip(head.value(first + at)) {
            *sum = weight.mul_add(*value, *sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ln2_splits_into_its_two_parts() {
        let sum = f64::from(LN2_HIGH) + f64::from(LN2_LOW);
        assert!((sum - std::f64::consts::LN_2).abs() < 1e-11, "{sum}");
        // The head's product with every n the exponent meets is exact.
        for n in -126..=1 {
            let product = n as f32 * LN2_HIGH;
            assert_eq!(
                f64::from(product),
                f64::from(n) * f64::from(LN2_HIGH),
                "n {n}"
            );
        }
    }

    #[test]
    fn the_exponent_is_within_three_ulps_of_the_true_one() {
        let mut x = 0.0f32;
        while x >= EXP_FLOOR {
            let ours = exp_nonpositive(x);
            let exact = f64::from(x).exp();
            let ulp = f64::from(f32::from_bits((exact as f32).to_bits() + 1)) - exact;
            assert!(
                (f64::from(ours) - exact).abs() <= 3.0 * ulp.abs(),
                "e^{x}: {ours} against {exact}"
            );
            x -= 0.001_37;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn dot_adds_its_lanes_pairwise_then_the_rest_in_order() {
        // Lanes 1e8, 1, -1e8, 1: pairwise (1e8 + 1) + (-1e8 + 1) rounds to 0, left to right
        // to 1. The two values past the last whole group are added after the lanes.
        let a = [1e8, 1.0, -1e8, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 3.0];
        let b = [1.0; 10];
        assert_eq!(dot(&a, &b), 3.5);
        assert_eq!(combine([1e8, 1.0, -1e8, 1.0, 0.0, 0.0, 0.0, 0.0]), 0.0);
        assert_eq!(combine([0.0, 0.0, 0.0, 0.0, 1e8, 1.0, -1e8, 1.0]), 0.0);
        assert_eq!(combine([1e8, 0.0, 1.0, 0.0, -1e8, 0.0, 1.0, 0.0]), 0.0);
        assert_eq!(dot(&a[..8], &b[..8]), 0.0);
    }

    #[test]
    fn softmax_weights_add_to_one_and_keep_their_order() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let scores = row.clone();
        softmax(&mut row);
        let total: f64 = row.iter().map(|w| f64::from(*w)).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exact_total: f64 = scores.iter().map(|s| f64::from(s - max).exp()).sum();
        for (weight, score) in row.iter().zip(&scores) {
            let exact = f64::from(score - max).exp() / exact_total;
            assert!(
                (f64::from(*weight) - exact).abs() < 1e-6,
                "{weight} vs {exact}"
            );
        }
    }

    #[test]
    fn operands_that_do_not_fit_are_refused() {
        let keys = vec![0f32; 4 * 12];
        let head = CachedHead {
            keys: &keys,
            values: &keys,
            row_width: 12,
            offset: 8,
            head_dim: 4,
        };
        let mut out = vec![0f32; 4];
        fn attend(head: CachedHead<'_>, positions: Range<usize>, out: &mut [f32]) -> Result<()> {
            let mut weights = Vec::new();
            attend_head(
                Kernel::Scalar,
                head,
                positions,
                &[1.0; 4],
                1.0,
                &mut weights,
                out,
            )
        }
        assert!(attend(head, 0..4, &mut out).is_ok());
        assert!(attend(head, 0..5, &mut out).is_err());
        assert!(attend(head, 0..4, &mut out[..3]).is_err());
        let wide = CachedHead { offset: 9, ..head };
        assert!(attend(wide, 0..4, &mut out).is_err());
        let short = CachedHead {
            values: &keys[..12],
            ..head
        };
        assert!(attend(short, 0..1, &mut out).is_err());
    }
}
