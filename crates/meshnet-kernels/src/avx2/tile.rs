//! Register tiles: [`TILE_ROWS`] weight rows against [`TOGETHER`] activation rows at once (a
//! prefill's matmul), each activation block loaded once for the tile instead of once per
//! output, and each weight block once for up to [`WIDE_GROUPS`] groups of activation rows.
//!
//! Q8_0: every block's 16 integer dots are computed and reduced side by side, and their float
//! terms computed and added in two vectors of eight outputs (lane `4·(r % 2) + c` of vector
//! `r / 2` is weight row `r` against activation row `c`). Each lane takes, block after block
//! in order, `dot · d_w · d_a` (multiplied left to right, never fused) onto its running sum,
//! the reference's own operations (`scalar::dot_q8_0`), so each output has its bits. The
//! integer dots are those of `q8_block` (exact, see `avx2/mod.rs`).
//!
//! Where the CPU has AVX-512 VNNI, Q8_0 and Q4_1 run the 512-bit tiles of `wide.rs` instead
//! of these. Q4_0, Q5_0 and Q5_1 have tiles of their own, as outer products (`outer.rs`, and
//! `wide.rs` with AVX-512 VNNI).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::TOGETHER;
use crate::activations::ActivationRow;
use crate::matrix::WeightRow;
#[cfg(target_arch = "x86_64")]
use {crate::BLOCK, crate::Q4_1_QUANT_BYTES};

/// Weight rows a tile computes at once.
pub(crate) const TILE_ROWS: usize = 4;

/// Groups of [`TOGETHER`] activation rows a tile takes at once (each weight block read once for
/// all of them).
pub(crate) const WIDE_GROUPS: usize = 8;

/// Vectors of eight outputs a tile keeps per group of activation rows (two weight rows each).
#[cfg(target_arch = "x86_64")]
const PAIRS: usize = TILE_ROWS / 2;

/// The dot products of [`TILE_ROWS`] Q8_0 or Q4_1 (`T`) weight rows with up to
/// [`WIDE_GROUPS`] groups of [`TOGETHER`] activation rows, into `results` (one tile per group);
/// each weight block is prepared once for all the groups. Each output adds its block's term to
/// its running sum block after block, as the reference does.
///
/// # Safety
/// The CPU must have AVX2; `activations` must hold at most [`WIDE_GROUPS`] groups and
/// `results` as many tiles; every slice of every row must hold at least `blocks` blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn parsed<T: ParsedTile>(
    weights: [WeightRow<'_>; TILE_ROWS],
    activations: &[[ActivationRow<'_>; TOGETHER]],
    blocks: usize,
    results: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    let mut sums = [[_mm256_setzero_ps(); PAIRS]; WIDE_GROUPS];
    for block in 0..blocks {
        // SAFETY: `block < blocks`, in range of every weight row (the caller).
        let weights = unsafe { T::weights(&weights, block) };
        for (sums, group) in sums.iter_mut().zip(activations) {
            // SAFETY: as above, for every activation row.
            let terms = unsafe { T::terms(&weights, group, block) };
            for (sum, terms) in sums.iter_mut().zip(terms) {
                *sum = _mm256_add_ps(*sum, terms);
            }
        }
    }
    for (sums, result) in sums.iter().zip(results) {
        for (pair, sum) in sums.iter().enumerate() {
            let mut lanes = [0f32; 2 * TOGETHER];
            // SAFETY: `lanes` holds eight f32, what an unaligned 256-bit store writes.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *sum) };
            result[2 * pair].copy_from_slice(&lanes[..TOGETHER]);
            result[2 * pair + 1].copy_from_slice(&lanes[TOGETHER..]);
        }
    }
}

/// What differs between the Q8_0 and the Q4_1 tile.
#[cfg(target_arch = "x86_64")]
pub(super) trait ParsedTile {
    /// A block of the tile's weight rows, prepared once for all the groups.
    type Weights;

    /// Block `block` of every weight row.
    ///
    /// # Safety
    /// The CPU must have AVX2; block `block` must be in range of every weight row.
    unsafe fn weights(rows: &[WeightRow<'_>; TILE_ROWS], block: usize) -> Self::Weights;

    /// Block `block`'s terms of a group's outputs, the reference's float operations lane by
    /// lane (lane `4·(r % 2) + c` of vector `r / 2` is weight row `r` against activation row
    /// `c`).
    ///
    /// # Safety
    /// The CPU must have AVX2; block `block` must be in range of every part of every
    /// activation row.
    unsafe fn terms(
        weights: &Self::Weights,
        activations: &[ActivationRow<'_>; TOGETHER],
        block: usize,
    ) -> [__m256; PAIRS];
}

/// The Q8_0 tile: terms `dot · d_w · d_a` (`scalar::dot_q8_0`).
pub(super) struct Q8_0Tile;

/// The Q4_1 tile: terms `dot · d_w · d_a + m_w · s_a` (`scalar::dot_q4_1`).
pub(super) struct Q4_1Tile;

/// A tile's Q8_0 block: each weight row's 32 signed bytes and their magnitudes, and per pair
/// of rows their scales (lanes 0..4 the first row's, 4..8 the second's).
#[cfg(target_arch = "x86_64")]
pub(super) struct Q8Weights {
    quants: [__m256i; TILE_ROWS],
    magnitudes: [__m256i; TILE_ROWS],
    scales: [__m256; PAIRS],
}

/// A tile's Q4_1 block: each weight row's 32 quants in value order, and per pair of rows their
/// scales and minimums (lanes 0..4 the first row's, 4..8 the second's).
#[cfg(target_arch = "x86_64")]
pub(super) struct Q4_1Weights {
    nibbles: [__m256i; TILE_ROWS],
    scales: [__m256; PAIRS],
    mins: [__m256; PAIRS],
}

/// Per pair of rows, `values[2 · pair]` in lanes 0..4 and `values[2 · pair + 1]` in 4..8.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn pair_lanes(values: [f32; TILE_ROWS]) -> [__m256; PAIRS] {
    std::array::from_fn(|pair| {
        _mm256_set_m128(
            _mm_set1_ps(values[2 * pair + 1]),
            _mm_set1_ps(values[2 * pair]),
        )
    })
}

/// Block `block`'s 32 quants of every activation row, and their scales and sums as four
/// lanes repeated in both halves.
///
/// # Safety
/// The CPU must have AVX2; block `block` must be in range of every part of every activation
/// row.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn activation_block(
    activations: &[ActivationRow<'_>; TOGETHER],
    block: usize,
) -> ([__m256i; TOGETHER], __m256, __m256) {
    // SAFETY: the block's 32 quants, scale and sum of every activation row are readable (the
    // caller).
    unsafe {
        let quants: [__m256i; TOGETHER] = std::array::from_fn(|c| {
            _mm256_loadu_si256(activations[c].quants.as_ptr().add(block * BLOCK).cast())
        });
        let scale = |c: usize| *activations[c].scales.get_unchecked(block);
        let sum = |c: usize| *activations[c].sums.get_unchecked(block);
        let scales = _mm_setr_ps(scale(0), scale(1), scale(2), scale(3));
        let sums = _mm_setr_ps(sum(0), sum(1), sum(2), sum(3));
        (
            quants,
            _mm256_set_m128(scales, scales),
            _mm256_set_m128(sums, sums),
        )
    }
}

#[cfg(target_arch = "x86_64")]
impl ParsedTile for Q8_0Tile {
    type Weights = Q8Weights;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn weights(rows: &[WeightRow<'_>; TILE_ROWS], block: usize) -> Q8Weights {
        // SAFETY: the block's 32 quants and scale of every row are readable (the caller).
        let (quants, scales) = unsafe {
            (
                rows.map(|row| _mm256_loadu_si256(row.quants.as_ptr().add(block * BLOCK).cast())),
                rows.map(|row| *row.scales.get_unchecked(block)),
            )
        };
        Q8Weights {
            quants,
            magnitudes: quants.map(|quants| _mm256_sign_epi8(quants, quants)),
            scales: pair_lanes(scales),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn terms(
        weights: &Q8Weights,
        activations: &[ActivationRow<'_>; TOGETHER],
        block: usize,
    ) -> [__m256; PAIRS] {
        // SAFETY: passed on from the caller.
        let (quants, activation_scales, _) = unsafe { activation_block(activations, block) };
        let mut terms = [_mm256_setzero_ps(); PAIRS];
        for (pair, terms) in terms.iter_mut().enumerate() {
            let (upper, lower) = (2 * pair, 2 * pair + 1);
            let dots = halves_added(
                q8_0_four_dots(weights.quants[upper], weights.magnitudes[upper], &quants),
                q8_0_four_dots(weights.quants[lower], weights.magnitudes[lower], &quants),
            );
            *terms = _mm256_mul_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(dots), weights.scales[pair]),
                activation_scales,
            );
        }
        terms
    }
}

#[cfg(target_arch = "x86_64")]
impl ParsedTile for Q4_1Tile {
    type Weights = Q4_1Weights;

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn weights(rows: &[WeightRow<'_>; TILE_ROWS], block: usize) -> Q4_1Weights {
        // SAFETY: the block's 16 quant bytes, scale and minimum of every row are readable (the
        // caller).
        unsafe {
            Q4_1Weights {
                nibbles: rows.map(|row| {
                    super::q4_1_nibbles(row.quants.as_ptr().add(block * Q4_1_QUANT_BYTES))
                }),
                scales: pair_lanes(rows.map(|row| *row.scales.get_unchecked(block))),
                mins: pair_lanes(rows.map(|row| *row.mins.get_unchecked(block))),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn terms(
        weights: &Q4_1Weights,
        activations: &[ActivationRow<'_>; TOGETHER],
        block: usize,
    ) -> [__m256; PAIRS] {
        // SAFETY: passed on from the caller.
        let (quants, activation_scales, activation_sums) =
            unsafe { activation_block(activations, block) };
        let mut terms = [_mm256_setzero_ps(); PAIRS];
        for (pair, terms) in terms.iter_mut().enumerate() {
            let dots = halves_added(
                unsigned_four_dots(weights.nibbles[2 * pair], &quants),
                unsigned_four_dots(weights.nibbles[2 * pair + 1], &quants),
            );
            let scaled = _mm256_mul_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(dots), weights.scales[pair]),
                activation_scales,
            );
            *terms = _mm256_add_ps(scaled, _mm256_mul_ps(weights.mins[pair], activation_sums));
        }
        terms
    }
}

/// One block of 32 unsigned 4-bit quants against four activation blocks, laid out as
/// [`q8_0_four_dots`] lays its dots out. A `maddubs` pair is at most 2 · 15 · 128 in magnitude
/// (any activation byte), so three rounds of `hadd` (16 products, at most 30720) are exact
/// before `madd` widens the sums.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn unsigned_four_dots(nibbles: __m256i, activations: &[__m256i; TOGETHER]) -> __m256i {
    let pairs = |c: usize| _mm256_maddubs_epi16(nibbles, activations[c]);
    let sums = _mm256_hadd_epi16(
        _mm256_hadd_epi16(pairs(0), pairs(1)),
        _mm256_hadd_epi16(pairs(2), pairs(3)),
    );
    _mm256_madd_epi16(sums, _mm256_set1_epi16(1))
}

/// One Q8_0 weight block (its 32 signed bytes `weights` and their `magnitudes`) against four
/// activation blocks: in each 128-bit half, lane `c` holds part of the dot with activation block
/// `c` (the two halves add up to it, see [`halves_added`]).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn q8_0_four_dots(
    weights: __m256i,
    magnitudes: __m256i,
    activations: &[__m256i; TOGETHER],
) -> __m256i {
    let dot = |c: usize| {
        let pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(activations[c], weights));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    };
    _mm256_hadd_epi32(
        _mm256_hadd_epi32(dot(0), dot(1)),
        _mm256_hadd_epi32(dot(2), dot(3)),
    )
}

/// The four dots of `upper` (lanes 0..4) and of `lower` (lanes 4..8), each the sum of its two
/// halves.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn halves_added(upper: __m256i, lower: __m256i) -> __m256i {
    _mm256_add_epi32(
        _mm256_permute2x128_si256(upper, lower, 0x20),
        _mm256_permute2x128_si256(upper, lower, 0x31),
    )
}

/// Stand-in where there is no x86_64: `Avx2::detect` never returns a token there.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn parsed<T>(
    _: [WeightRow<'_>; TILE_ROWS],
    _: &[[ActivationRow<'_>; TOGETHER]],
    _: usize,
    _: &mut [[[f32; TOGETHER]; TILE_ROWS]],
) {
    unreachable!("no AVX2 outside x86_64")
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::activations::QuantizedRows;
    use crate::avx2::Avx2;
    use half::f16;

    use crate::formats::BlockFormat;

    /// Bytes of `len` from a small generator.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 56) as u8
            })
            .collect()
    }

    /// `rows` input rows of `cols` values, each row (shifted by `round`) either random and
    /// large (the activations' extremes once quantized), ±3 alternating every `period` values,
    /// or small and random.
    fn mixed_input(rows: usize, cols: usize, round: usize, period: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| match (i / cols + round) % 3 {
                0 => (i as f32 * 0.37).sin() * 40.0,
                1 => {
                    if i % period == 0 {
                        3.0
                    } else {
                        -3.0
                    }
                }
                _ => (i as f32).cos(),
            })
            .collect()
    }

    #[test]
    fn the_q8_0_tile_gives_the_bits_of_every_reference_dot() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        for (round, blocks) in [1, 2, 7, 8, 9, 18, 48].into_iter().enumerate() {
            let cols = blocks * BLOCK;
            // Activations at their extremes (±127) and random; weights random, all -128 or 127.
            let input = mixed_input(2 * TOGETHER, cols, round, 2);
            let rows = QuantizedRows::quantize(&input, 2 * TOGETHER, cols);
            let sets = with_interleaved(&rows, true);
            let mut quants = bytes(TILE_ROWS * cols, round as u64);
            quants[..cols].fill(0x80);
            quants[cols..2 * cols].fill(0x7F);
            let scales: Vec<f32> = bytes(TILE_ROWS * blocks, 9)
                .into_iter()
                .map(|b| f32::from(b) * 1e-3 - 0.1)
                .collect();
            let weight = |r: usize| WeightRow {
                scales: &scales[r * blocks..(r + 1) * blocks],
                mins: &[],
                quants: &quants[r * cols..(r + 1) * cols],
            };
            // Both groups at once, and the second alone, by every tile this CPU has.
            for (token, groups) in cases(token, &sets) {
                let mut tiles = [[[0f32; TOGETHER]; TILE_ROWS]; 3];
                let weights = std::array::from_fn(weight);
                token.dot_q8_0_tile(weights, &groups, &mut tiles[..2]);
                token.dot_q8_0_tile(weights, &groups[1..], &mut tiles[2..]);
                for (g, tile) in tiles.iter().enumerate() {
                    let group = groups[g.min(1)];
                    for (r, outputs) in tile.iter().enumerate() {
                        for (c, got) in outputs.iter().enumerate() {
                            let want = crate::scalar::dot_q8_0(weight(r), group[c]);
                            let at = format!("{token:?}, {blocks} blocks, tile {g}, ({r}, {c})");
                            assert_eq!(want.to_bits(), got.to_bits(), "{at}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_q4_1_tile_gives_the_bits_of_every_reference_dot() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        for (round, blocks) in [1, 2, 7, 8, 9, 18, 48].into_iter().enumerate() {
            let cols = blocks * BLOCK;
            // Activations at their extremes (±127, and -128 by hand) and random.
            let input: Vec<f32> = (0..2 * TOGETHER * cols)
                .map(|i| match (i / cols + round) % 2 {
                    0 => (i as f32 * 0.37).sin() * 40.0,
                    _ => 3.0 - 6.0 * (i % 2) as f32,
                })
                .collect();
            let mut rows = QuantizedRows::quantize(&input, 2 * TOGETHER, cols);
            rows.quants[..BLOCK].fill(-128);
            let sets = with_interleaved(&rows, false);
            let mut quants = bytes(TILE_ROWS * cols / 2, round as u64);
            quants[..cols / 2].fill(0xFF);
            let floats = |seed: u64| -> Vec<f32> {
                let values = bytes(TILE_ROWS * blocks, seed).into_iter();
                values.map(|b| f32::from(b) * 1e-3 - 0.1).collect()
            };
            let (scales, mins) = (floats(9), floats(10));
            let weight = |r: usize| WeightRow {
                scales: &scales[r * blocks..(r + 1) * blocks],
                mins: &mins[r * blocks..(r + 1) * blocks],
                quants: &quants[r * cols / 2..(r + 1) * cols / 2],
            };
            for (token, groups) in cases(token, &sets) {
                let mut tiles = [[[0f32; TOGETHER]; TILE_ROWS]; 2];
                token.dot_q4_1_tile(std::array::from_fn(weight), &groups, &mut tiles);
                for (g, tile) in tiles.iter().enumerate() {
                    for (r, outputs) in tile.iter().enumerate() {
                        for (c, got) in outputs.iter().enumerate() {
                            let want = crate::scalar::dot_q4_1(weight(r), groups[g][c]);
                            let at = format!("{token:?}, {blocks} blocks, tile {g}, ({r}, {c})");
                            assert_eq!(want.to_bits(), got.to_bits(), "{at}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_32_value_tiles_give_the_bits_of_every_reference_dot() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        type Reference = fn(&[u8], ActivationRow<'_>) -> f32;
        let formats: [(BlockFormat, Reference); 3] = [
            (BlockFormat::Q4_0, crate::formats::legacy::dot_q4_0),
            (BlockFormat::Q5_0, crate::formats::legacy::dot_q5_0),
            (BlockFormat::Q5_1, crate::formats::legacy::dot_q5_1),
        ];
        for (format, reference) in formats {
            for (round, blocks) in [1, 2, 7, 8, 9, 17, 18, 48].into_iter().enumerate() {
                let cols = blocks * BLOCK;
                let input = mixed_input(2 * TOGETHER, cols, round, 3);
                let rows = QuantizedRows::quantize(&input, 2 * TOGETHER, cols);
                let sets = with_interleaved(&rows, format != BlockFormat::Q5_1);
                let row_bytes = blocks * format.block_bytes();
                // Random bytes, then row 0 all quants 0 (the most negative values) and row 1
                // all bits set; every scale finite.
                let mut weights = bytes(TILE_ROWS * row_bytes, 11 + round as u64);
                weights[2..row_bytes].fill(0);
                weights[row_bytes..2 * row_bytes].fill(0xFF);
                for block in weights.chunks_exact_mut(format.block_bytes()) {
                    let scale = f16::from_f32(f32::from(block[5]) * 1e-3 - 0.1);
                    let min = f16::from_f32(f32::from(block[7]) * 1e-2 - 1.0);
                    block[..2].copy_from_slice(&scale.to_le_bytes());
                    if format == BlockFormat::Q5_1 {
                        block[2..4].copy_from_slice(&min.to_le_bytes());
                    }
                }
                let row = |r: usize| &weights[r * row_bytes..(r + 1) * row_bytes];
                // Both groups at once, and the second alone, by every tile this CPU has.
                for (token, groups) in cases(token, &sets) {
                    let mut tiles = [[[0f32; TOGETHER]; TILE_ROWS]; 3];
                    let weights = std::array::from_fn(row);
                    token.dot_blocks_tile(format, weights, &groups, &mut tiles[..2]);
                    token.dot_blocks_tile(format, weights, &groups[1..], &mut tiles[2..]);
                    for (g, tile) in tiles.iter().enumerate() {
                        let group = groups[g.min(1)];
                        for (r, outputs) in tile.iter().enumerate() {
                            for (c, got) in outputs.iter().enumerate() {
                                let want = reference(row(r), group[c]);
                                assert_eq!(
                                    want.to_bits(),
                                    got.to_bits(),
                                    "{format:?} ({token:?}), {blocks} blocks, tile {g}, ({r}, {c})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// `rows` as they come, and interleaved as a matmul interleaves them for the 512-bit tiles
    /// (lifted by 128 when `lifted`).
    fn with_interleaved(rows: &QuantizedRows, lifted: bool) -> [QuantizedRows; 2] {
        let mut interleaved = rows.clone();
        interleaved.interleave(lifted);
        [rows.clone(), interleaved]
    }

    /// Every tile of `token` (see [`tokens`]) against the first two groups of each of `sets`.
    fn cases(
        token: Avx2,
        sets: &[QuantizedRows; 2],
    ) -> Vec<(Avx2, [[ActivationRow<'_>; TOGETHER]; 2])> {
        let mut cases = Vec::new();
        for token in tokens(token) {
            for rows in sets {
                let groups =
                    std::array::from_fn(|g| std::array::from_fn(|k| rows.row(g * TOGETHER + k)));
                cases.push((token, groups));
            }
        }
        cases
    }

    /// The token, and when it has the 512-bit paths also the token without them.
    fn tokens(token: Avx2) -> Vec<Avx2> {
        if token.is_wide() {
            vec![token, token.narrow()]
        } else {
            vec![token]
        }
    }

    /// `input` quantized, twice.
    fn quantized_twice(input: &[f32], rows: usize, cols: usize) -> (QuantizedRows, QuantizedRows) {
        let rows = QuantizedRows::quantize(input, rows, cols);
        (rows.clone(), rows)
    }

    /// Prints, for every tile of `token` ([`tokens`]), its time per block (`per` of the tiles
    /// of 16 weight rows, `tile(token, first)` computing rows `first..first + TILE_ROWS`)
    /// beside the four-row dots' `four`.
    fn print_tile_times(
        label: &str,
        four: f64,
        token: Avx2,
        per: &dyn Fn(&dyn Fn() -> f32) -> f64,
        tile: &dyn Fn(Avx2, usize) -> f32,
    ) {
        for token in tokens(token) {
            let tiled = per(&|| (0..16).step_by(TILE_ROWS).map(|t| tile(token, t)).sum());
            println!("{label}: four-row {four:.3} ns, tile {tiled:.3} ns per block ({token:?})");
        }
    }

    /// The shortest of 20 timings, in seconds, of 50 calls of `run`.
    fn best_of_runs(run: &dyn Fn() -> f32) -> f64 {
        let mut best = f64::MAX;
        for _ in 0..20 {
            let start = std::time::Instant::now();
            let mut total = 0f32;
            for _ in 0..50 {
                total += run();
            }
            std::hint::black_box(total);
            best = best.min(start.elapsed().as_secs_f64());
        }
        best
    }

    /// Times the tiles against the one-row, four-activation-row kernels on data that stays in
    /// L1 (16 weight rows of 18 and of 48 blocks, 16 activation rows); prints ns per weight
    /// row × activation row × block.
    /// `cargo test --release -p meshnet-kernels --lib tile_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn tile_timing() {
        let Some(token) = Avx2::detect() else {
            return;
        };
        const GROUPS: usize = 4;
        for blocks in [18, 48] {
            let cols = blocks * BLOCK;
            let input: Vec<f32> = (0..GROUPS * TOGETHER * cols)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            // Interleaved as a matmul interleaves them for the wide tiles: lifted for the
            // formats whose values are signed, as they are for the others.
            let (mut rows, mut unsigned) = quantized_twice(&input, GROUPS * TOGETHER, cols);
            rows.interleave(true);
            unsigned.interleave(false);
            let groups: [[ActivationRow<'_>; TOGETHER]; GROUPS] =
                std::array::from_fn(|g| std::array::from_fn(|k| rows.row(g * TOGETHER + k)));
            let unsigned_groups: [[ActivationRow<'_>; TOGETHER]; GROUPS] =
                std::array::from_fn(|g| std::array::from_fn(|k| unsigned.row(g * TOGETHER + k)));
            let scales: Vec<f32> = (0..16 * blocks).map(|i| (i % 7) as f32 * 0.01).collect();
            let quants = bytes(16 * cols, 3);
            let weight = |r: usize| WeightRow {
                scales: &scales[r * blocks..(r + 1) * blocks],
                mins: &[],
                quants: &quants[r * cols..(r + 1) * cols],
            };
            let per = |run: &dyn Fn() -> f32| {
                best_of_runs(run) * 1e9 / (50 * 16 * GROUPS * TOGETHER * blocks) as f64
            };
            let four = per(&|| {
                let row = |r: usize| groups.map(|g| token.dot_q8_0_four(weight(r), g)[0]);
                (0..16).map(|r| row(r).iter().sum::<f32>()).sum()
            });
            print_tile_times(
                &format!("Q8_0 {blocks} blocks"),
                four,
                token,
                &per,
                &|token, t| {
                    let mut results = [[[0f32; TOGETHER]; TILE_ROWS]; GROUPS];
                    token.dot_q8_0_tile(
                        std::array::from_fn(|r| weight(t + r)),
                        &groups,
                        &mut results,
                    );
                    results[0][0][0]
                },
            );
            let nibbles = |r: usize| WeightRow {
                scales: &scales[r * blocks..(r + 1) * blocks],
                mins: &scales[r * blocks..(r + 1) * blocks],
                quants: &quants[r * cols / 2..(r + 1) * cols / 2],
            };
            let four = per(&|| {
                let row = |r: usize| groups.map(|g| token.dot_q4_1_four(nibbles(r), g)[0]);
                (0..16).map(|r| row(r).iter().sum::<f32>()).sum()
            });
            print_tile_times(
                &format!("Q4_1 {blocks} blocks"),
                four,
                token,
                &per,
                &|token, t| {
                    let mut results = [[[0f32; TOGETHER]; TILE_ROWS]; GROUPS];
                    let rows = std::array::from_fn(|r| nibbles(t + r));
                    token.dot_q4_1_tile(rows, &unsigned_groups, &mut results);
                    results[0][0][0]
                },
            );
            for format in [BlockFormat::Q4_0, BlockFormat::Q5_0, BlockFormat::Q5_1] {
                let groups = match format {
                    BlockFormat::Q5_1 => unsigned_groups,
                    _ => groups,
                };
                let row_bytes = blocks * format.block_bytes();
                let mut weights = bytes(16 * row_bytes, 5);
                for block in weights.chunks_exact_mut(format.block_bytes()) {
                    block[..4].copy_from_slice(&[0x1F, 0x21, 0x1F, 0x21]);
                }
                let row = |r: usize| &weights[r * row_bytes..(r + 1) * row_bytes];
                let four = per(&|| {
                    let one =
                        |r: usize| groups.map(|g| token.dot_blocks_together(format, row(r), g)[0]);
                    (0..16).map(|r| one(r).iter().sum::<f32>()).sum()
                });
                let label = format!("{format:?} {blocks} blocks");
                print_tile_times(&label, four, token, &per, &|token, t| {
                    let mut results = [[[0f32; TOGETHER]; TILE_ROWS]; GROUPS];
                    let rows = std::array::from_fn(|r| row(t + r));
                    token.dot_blocks_tile(format, rows, &groups, &mut results);
                    results[0][0][0]
                });
            }
        }
    }
}
