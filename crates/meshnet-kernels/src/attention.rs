//! Attention of a few query heads over one cached key/value head: scores, softmax and the
//! weighted sum of values, in f32, in an order every kernel reproduces bit for bit, and in
//! pieces of positions that separate threads may compute (the same bits either way).
//!
//! The cache holds keys and values as IEEE half floats (half the bytes a long cache streams
//! per step); each is widened to f32, which is exact, where it is used. The reference's
//! arithmetic, where `fma(a, b, c)` is `a·b + c` rounded once (`f32::mul_add`; every other
//! operation rounded on its own):
//! - a score is `dot(query, key) · scale`; `dot` puts value `i` into lane `i % 8` (`lane =
//!   fma(q, k, lane)`, lanes starting at `+0.0`) for the whole groups of eight, adds the lanes as
//!   `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` ([`combine`]), then takes the values
//!   past the last whole group in order (`sum = fma(q, k, sum)`);
//! - the positions are taken in pieces of [`PIECE_POSITIONS`] from the first one a query sees;
//!   in each piece a query's weights are `exp(s − m)` of its scores `s`, `m` the piece's largest,
//!   by [`exp_nonpositive`] (a fixed polynomial, not the C library's `expf`); their total adds
//!   weight `i` into lane `i % 8` (`lane + w`) and combines the lanes as above; each weighted
//!   value starts at `+0.0` and takes `sum = fma(weight, value, sum)` position after position;
//! - the pieces are joined in order ([`combine_pieces`]): with `M` the largest `m`, each piece's
//!   total and values are scaled by `c = exp(m − M)` and added (`fma(c, part, sum)` from
//!   `+0.0`), and each value is divided by the total.
//!
//! Fused multiply-adds halve the vector instructions of the AVX2 kernel (every AVX2 CPU has
//! FMA). The crate is built for any x86_64, so the scalar code's `f32::mul_add` is a call to
//! the C library's `fmaf` (correctly rounded, hence the same bits): slow in the reference, and
//! in the few scalar steps the AVX2 path keeps (joining pieces, the last positions or values
//! past a group of eight, heads whose size is not a multiple of eight).
//!
//! Scores are assumed finite; a NaN anywhere gives NaNs, which NaN is not part of the contract,
//! and neither is the sign of a piece's largest score when it is zero (`attended` is the same
//! either way).

use std::ops::Range;

use half::f16;

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
/// `keys[p · row_width + offset..][..head_dim]`, its value likewise in `values`. The cache
/// holds IEEE half floats; every kernel widens them to f32 exactly before any arithmetic.
#[derive(Clone, Copy, Debug)]
pub struct CachedHead<'a> {
    /// Cached keys, `row_width` values per position.
    pub keys: &'a [f16],
    /// Cached values, laid out as the keys.
    pub values: &'a [f16],
    /// Values per cached position (every key/value head side by side).
    pub row_width: usize,
    /// Where this head starts within a position's row.
    pub offset: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl CachedHead<'_> {
    /// Position `at`'s key.
    pub(crate) fn key(&self, at: usize) -> &[f16] {
        &self.keys[at * self.row_width + self.offset..][..self.head_dim]
    }

    /// Position `at`'s value.
    pub(crate) fn value(&self, at: usize) -> &[f16] {
        &self.values[at * self.row_width + self.offset..][..self.head_dim]
    }

    /// An error unless `positions` are cached, the head fits its rows and `queries` and
    /// `attended` hold whole heads, as many of each.
    fn check(&self, positions: &Range<usize>, queries: &[f32], attended: &[f32]) -> Result<()> {
        let shape_error = |what: String| Err(KernelError::Shape(what));
        let head_end = self.offset.checked_add(self.head_dim);
        if self.head_dim == 0 || head_end.is_none_or(|end| end > self.row_width) {
            return shape_error(format!(
                "a head of {} values at {} in rows of {}",
                self.head_dim, self.offset, self.row_width
            ));
        }
        let cached = self.keys.len() / self.row_width;
        let ordered = positions.start <= positions.end;
        if self.keys.len() != self.values.len() || !ordered || positions.end > cached {
            return shape_error(format!(
                "positions {positions:?} of {} keys and {} values in rows of {}",
                self.keys.len(),
                self.values.len(),
                self.row_width
            ));
        }
        let whole_heads = !queries.is_empty() && queries.len().is_multiple_of(self.head_dim);
        if !whole_heads || queries.len() != attended.len() {
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

/// Positions one piece of an attention covers: a query's positions are taken a piece at a
/// time from the first it sees, and the pieces combined, so that the pieces of a long cache
/// can run on different threads and still give the same bits.
pub const PIECE_POSITIONS: usize = 256;

/// The pieces of `positions`: [`PIECE_POSITIONS`] each from the start, the last shorter.
pub fn pieces(positions: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    positions
        .clone()
        .step_by(PIECE_POSITIONS)
        .map(move |start| start..start.saturating_add(PIECE_POSITIONS).min(positions.end))
}

/// Floats one piece's sums take for `queries` queries of `head_dim` values: per query its
/// largest score, the sum of its weights and its weighted values (not yet divided).
pub fn piece_len(queries: usize, head_dim: usize) -> usize {
    queries.saturating_mul(head_dim.saturating_add(2))
}

/// Attention of `queries` (whole heads, each of `head.head_dim` values) over the cached
/// `positions` of `head`, scores scaled by `scale`, into `attended` (as long as `queries`):
/// [`attend_piece`] of each of [`pieces`], then [`combine_pieces`]. `weights` is scratch
/// space. Every kernel gives the reference's bits (module docs).
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
    if positions.is_empty() {
        attended.fill(0.0);
        return Ok(());
    }
    let one = piece_len(queries.len() / head.head_dim, head.head_dim);
    let mut sums = vec![0f32; pieces(positions.clone()).count() * one];
    for (piece, sums) in pieces(positions).zip(sums.chunks_exact_mut(one)) {
        attend_piece(kernel, head, piece, queries, scale, weights, sums)?;
    }
    combine_pieces(&sums, head.head_dim, attended)
}

/// One piece of an attention: for each query, its scores over `positions` (at most
/// [`PIECE_POSITIONS`]), their largest `m`, the weights `exp(score − m)` and their total, and
/// the weighted values, into `sums` ([`piece_len`] long: per query `m`, the total, the
/// values). `weights` is scratch space.
pub fn attend_piece(
    kernel: Kernel,
    head: CachedHead<'_>,
    positions: Range<usize>,
    queries: &[f32],
    scale: f32,
    weights: &mut Vec<f32>,
    sums: &mut [f32],
) -> Result<()> {
    head.check(&positions, queries, queries)?;
    let members = queries.len() / head.head_dim;
    let fits = (1..=PIECE_POSITIONS).contains(&positions.len());
    if !fits || sums.len() != piece_len(members, head.head_dim) {
        return Err(KernelError::Shape(format!(
            "a piece of {} positions into {} sums for {members} queries of {}",
            positions.len(),
            sums.len(),
            head.head_dim
        )));
    }
    weights.clear();
    weights.resize(members * positions.len(), 0.0);
    let group = Group {
        first: positions.start,
        queries,
        scale,
    };
    match kernel {
        Kernel::Scalar => attend_piece_reference(head, group, weights, sums),
        Kernel::Avx2(fast) => fast.0.attend_piece(head, group, weights, sums),
    }
    Ok(())
}

/// The reference of [`attend_piece`], one query after another.
fn attend_piece_reference(
    head: CachedHead<'_>,
    group: Group<'_>,
    weights: &mut [f32],
    sums: &mut [f32],
) {
    let visible = weights.len() / (group.queries.len() / head.head_dim);
    let queries = group.queries.chunks_exact(head.head_dim);
    for (query, sums) in queries.zip(sums.chunks_exact_mut(head.head_dim + 2)) {
        let (stats, values) = sums.split_at_mut(2);
        let row = &mut weights[..visible];
        scores(head, group.first, query, group.scale, row);
        (stats[0], stats[1]) = exponentiate(row);
        weighted_values(head, group.first, row, values);
    }
}

/// Joins the pieces' sums (`pieces`, one [`piece_len`] after another, in position order) into
/// each query's attention: with `M` the largest of the pieces' maxima and `c = exp(m − M)` for
/// each piece in order, `total = fma(c, piece total, total)` and `value = fma(c, piece value,
/// value)` from `+0.0`, then `value / total`.
pub fn combine_pieces(pieces: &[f32], head_dim: usize, attended: &mut [f32]) -> Result<()> {
    let one = piece_len(attended.len() / head_dim.max(1), head_dim);
    let fits = head_dim > 0 && attended.len().is_multiple_of(head_dim) && one > 0;
    if !fits || pieces.is_empty() || !pieces.len().is_multiple_of(one) {
        return Err(KernelError::Shape(format!(
            "{} piece sums for {} outputs in heads of {head_dim}",
            pieces.len(),
            attended.len()
        )));
    }
    for (member, output) in attended.chunks_exact_mut(head_dim).enumerate() {
        let at = member * (head_dim + 2);
        let of_member = || {
            pieces
                .chunks_exact(one)
                .map(|piece| &piece[at..at + head_dim + 2])
        };
        let max = of_member()
            .map(|sums| sums[0])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        output.fill(0.0);
        for sums in of_member() {
            let factor = exp_nonpositive(sums[0] - max);
            total = factor.mul_add(sums[1], total);
            for (value, part) in output.iter_mut().zip(&sums[2..]) {
                *value = factor.mul_add(*part, *value);
            }
        }
        for value in output.iter_mut() {
            *value /= total;
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

/// The reference's dot product (module docs) of a query and a cached key.
pub(crate) fn dot(a: &[f32], b: &[f16]) -> f32 {
    let whole = a.len() - a.len() % LANES;
    let mut lanes = [0f32; LANES];
    for (a, b) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for lane in 0..LANES {
            lanes[lane] = a[lane].mul_add(b[lane].to_f32(), lanes[lane]);
        }
    }
    let mut sum = combine(lanes);
    for (a, b) in a[whole..].iter().zip(&b[whole..]) {
        sum = a.mul_add(b.to_f32(), sum);
    }
    sum
}

/// The lanes added pairwise: `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
pub(crate) fn combine(lanes: [f32; LANES]) -> f32 {
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// The scores of `row` turned into weights `exp(score − max)` in place; returns the row's
/// largest score and the weights' total, added in lane `i % 8` and combined (module docs).
pub(crate) fn exponentiate(row: &mut [f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0f32; LANES];
    for (index, weight) in row.iter_mut().enumerate() {
        *weight = exp_nonpositive(*weight - max);
        lanes[index % LANES] += *weight;
    }
    (max, combine(lanes))
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
    add_weighted_values(head, first, weights, output);
}

/// [`weighted_values`] added onto what `output` holds, position by position.
pub(crate) fn add_weighted_values(
    head: CachedHead<'_>,
    first: usize,
    weights: &[f32],
    output: &mut [f32],
) {
    for (at, weight) in weights.iter().enumerate() {
        for (sum, value) in output.iter_mut().zip(head.value(first + at)) {
            *sum = weight.mul_add(value.to_f32(), *sum);
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
        let b = [f16::ONE; 10];
        assert_eq!(dot(&a, &b), 3.5);
        assert_eq!(combine([1e8, 1.0, -1e8, 1.0, 0.0, 0.0, 0.0, 0.0]), 0.0);
        assert_eq!(combine([0.0, 0.0, 0.0, 0.0, 1e8, 1.0, -1e8, 1.0]), 0.0);
        assert_eq!(combine([1e8, 0.0, 1.0, 0.0, -1e8, 0.0, 1.0, 0.0]), 0.0);
        assert_eq!(dot(&a[..8], &b[..8]), 0.0);
    }

    #[test]
    fn exponentiate_gives_the_largest_score_and_the_total_of_the_weights() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let scores = row.clone();
        let (max, total) = exponentiate(&mut row);
        assert_eq!(
            max,
            scores.iter().copied().fold(f32::NEG_INFINITY, f32::max)
        );
        let mut lanes = [0f32; LANES];
        for (index, (weight, score)) in row.iter().zip(&scores).enumerate() {
            assert_eq!(weight.to_bits(), exp_nonpositive(score - max).to_bits());
            lanes[index % LANES] += weight;
        }
        assert_eq!(total.to_bits(), combine(lanes).to_bits());
    }

    /// Attention in f64 the textbook way: one softmax over every position.
    fn textbook(
        head: CachedHead<'_>,
        positions: Range<usize>,
        query: &[f32],
        scale: f32,
    ) -> Vec<f64> {
        let scores: Vec<f64> = positions
            .clone()
            .map(|at| {
                let key = head.key(at);
                query
                    .iter()
                    .zip(key)
                    .map(|(q, k)| f64::from(*q) * f64::from(k.to_f32()))
                    .sum::<f64>()
                    * f64::from(scale)
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut output = vec![0f64; head.head_dim];
        for (at, weight) in positions.zip(&weights) {
            for (sum, value) in output.iter_mut().zip(head.value(at)) {
                *sum += weight / total * f64::from(value.to_f32());
            }
        }
        output
    }

    #[test]
    fn attention_in_pieces_is_the_textbook_attention() {
        let head_dim = 16;
        let cached = 3 * PIECE_POSITIONS + 37;
        let filler = |seed: usize, count: usize| -> Vec<f16> {
            (0..count)
                .map(|i| f16::from_f32(((i * 7919 + seed * 104_729) % 2003) as f32 / 500.0 - 2.0))
                .collect()
        };
        let (keys, values) = (
            filler(1, cached * 2 * head_dim),
            filler(2, cached * 2 * head_dim),
        );
        let head = CachedHead {
            keys: &keys,
            values: &values,
            row_width: 2 * head_dim,
            offset: head_dim,
            head_dim,
        };
        let queries: Vec<f32> = filler(3, 2 * head_dim).iter().map(|q| q.to_f32()).collect();
        for positions in [0..1, 0..PIECE_POSITIONS, 5..PIECE_POSITIONS + 9, 40..cached] {
            let mut attended = vec![0f32; queries.len()];
            attend_head(
                Kernel::Scalar,
                head,
                positions.clone(),
                &queries,
                0.3,
                &mut Vec::new(),
                &mut attended,
            )
            .expect("the shape fits");
            for (query, ours) in queries
                .chunks_exact(head_dim)
                .zip(attended.chunks_exact(head_dim))
            {
                let reference = textbook(head, positions.clone(), query, 0.3);
                for (ours, reference) in ours.iter().zip(&reference) {
                    assert!(
                        (f64::from(*ours) - reference).abs() < 1e-5,
                        "{positions:?}: {ours} vs {reference}"
                    );
                }
            }
        }
    }

    #[test]
    fn pieces_are_joined_by_their_maxima() {
        // One query of two values; each piece: its largest score, its total, its values.
        let equal = [0.0, 2.0, 4.0, 1.0, 0.0, 5.0, 7.0, 3.0];
        let mut attended = [0f32; 2];
        combine_pieces(&equal, 2, &mut attended).expect("whole pieces");
        assert_eq!(attended, [11.0 / 7.0, 4.0 / 7.0]);
        // A piece whose largest score is far below the other's adds nothing.
        let far = [0.0, 2.0, 4.0, 1.0, -1000.0, 5.0, 7.0, 3.0];
        combine_pieces(&far, 2, &mut attended).expect("whole pieces");
        assert_eq!(attended, [2.0, 0.5]);
        let far_first = [-100.0, 5.0, 7.0, 3.0, 0.0, 2.0, 4.0, 1.0];
        combine_pieces(&far_first, 2, &mut attended).expect("whole pieces");
        assert_eq!(attended, [2.0, 0.5]);
        // One below by ln 2 counts half: (4 + 7/2) / (2 + 5/2).
        let half = [0.0, 2.0, 4.0, 1.0, -std::f32::consts::LN_2, 5.0, 7.0, 3.0];
        combine_pieces(&half, 2, &mut attended).expect("whole pieces");
        assert!((attended[0] - 7.5 / 4.5).abs() < 1e-6, "{attended:?}");
        assert!(combine_pieces(&equal[..7], 2, &mut attended).is_err());
        assert!(combine_pieces(&[], 2, &mut attended).is_err());
    }

    #[test]
    fn pieces_cover_the_positions_in_order() {
        let all: Vec<Range<usize>> = pieces(3..3 + 2 * PIECE_POSITIONS + 1).collect();
        assert_eq!(
            all,
            [
                3..3 + PIECE_POSITIONS,
                3 + PIECE_POSITIONS..3 + 2 * PIECE_POSITIONS,
                3 + 2 * PIECE_POSITIONS..4 + 2 * PIECE_POSITIONS
            ]
        );
        assert_eq!(pieces(7..7).count(), 0);
    }

    #[test]
    fn operands_that_do_not_fit_are_refused() {
        let keys = vec![f16::ZERO; 4 * 12];
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
        assert!(
            attend_head(
                Kernel::Scalar,
                head,
                0..4,
                &[],
                1.0,
                &mut Vec::new(),
                &mut []
            )
            .is_err()
        );
        let mut sums = vec![0f32; piece_len(1, 4)];
        let mut piece = |positions: Range<usize>| {
            attend_piece(
                Kernel::Scalar,
                head,
                positions,
                &[1.0; 4],
                1.0,
                &mut Vec::new(),
                &mut sums,
            )
        };
        assert!(piece(0..4).is_ok());
        assert!(piece(2..2).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 3..1;
        assert!(attend(head, backwards, &mut out).is_err());
        let far = CachedHead {
            offset: usize::MAX,
            ..head
        };
        assert!(attend(far, 0..4, &mut out).is_err());
        assert!(combine_pieces(&[0.0; 6], usize::MAX, &mut out).is_err());
        assert_eq!(pieces(usize::MAX - 1..usize::MAX).count(), 1);
    }
}
