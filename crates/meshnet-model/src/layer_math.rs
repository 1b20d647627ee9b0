//! The arithmetic of a Llama block on plain row-major `f32` buffers: RMSNorm, interleaved
//! rotary embeddings and grouped-query attention over a session's cached keys and values,
//! read where they lie (no head repetition, no concatenation, no tensor per step).
//!
//! Norm and rotation compute exactly what candle's `rms_norm` and `rope_i` compute. Attention
//! is `meshnet_kernels::attend_head`'s, which sums in its own fixed order (the same bits on
//! every kernel), so its results differ from candle's matmul by float rounding (the model
//! tests state the bound on the logits).

use std::ops::Range;

use half::f16;
use meshnet_kernels::{
    CachedHead, Kernel, attend_head, attend_piece, combine_pieces, piece_len, pieces,
};
use rayon::prelude::*;

use crate::Result;
use crate::family::RopeStyle;

/// RMSNorm of each `weight.len()`-wide row of `input`: `x / sqrt(mean(x²) + eps) · weight`,
/// the sum of squares taken left to right as candle does.
pub(crate) fn rms_norm(input: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    let mut output = vec![0f32; input.len()];
    for (row, normed) in input
        .chunks_exact(width)
        .zip(output.chunks_exact_mut(width))
    {
        let squares: f32 = row.iter().map(|value| value * value).sum();
        let root = (squares / width as f32 + eps).sqrt();
        for ((normed, value), weight) in normed.iter_mut().zip(row).zip(weight) {
            *normed = *value / root * *weight;
        }
    }
    output
}

/// Adds `addend` to `target` element by element.
pub(crate) fn add_in_place(target: &mut [f32], addend: &[f32]) {
    for (target, addend) in target.iter_mut().zip(addend) {
        *target += *addend;
    }
}

/// Below this many values SwiGLU runs on the calling thread (a decode step's 1,536 do).
const PARALLEL_ACTIVATIONS: usize = 16 * 1024;

/// SwiGLU as candle computes it, `silu(gate) · up` with `silu(x) = x / (1 + e^-x)`; a
/// prefill chunk's values are split over the pool.
pub(crate) fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut activated = vec![0f32; gate.len()];
    let apply = |activated: &mut [f32], gate: &[f32], up: &[f32]| {
        for ((activated, gate), up) in activated.iter_mut().zip(gate).zip(up) {
            *activated = gate / (1.0 + (-gate).exp()) * up;
        }
    };
    if gate.len() < PARALLEL_ACTIVATIONS {
        apply(&mut activated, gate, up);
    } else {
        let chunk = 4096;
        activated
            .par_chunks_mut(chunk)
            .zip(gate.par_chunks(chunk).zip(up.par_chunks(chunk)))
            .for_each(|(activated, (gate, up))| apply(activated, gate, up));
    }
    activated
}

/// GeGLU as llama.cpp computes it for Gemma: `gelu(gate) · up`, GELU in its tanh
/// approximation `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
pub(crate) fn geglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const CUBIC: f32 = 0.044_715;
    gate.iter()
        .zip(up)
        .map(|(&x, &up)| 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + CUBIC * x * x)).tanh()) * up)
        .collect()
}

/// cos and sin of every rotated pair's angle for the positions of one chunk.
pub(crate) struct Rotary {
    cos: Vec<f32>,
    sin: Vec<f32>,
    pairs: usize,
    style: RopeStyle,
}

impl Rotary {
    /// The tables for positions `position..position + tokens`, one angle per entry of
    /// `inverse_frequencies` (`1 / base^(2i/d)`), cos and sin multiplied by `factor` (1 but
    /// for long-context scalings), pairing dimensions as `style` says.
    pub(crate) fn new(
        inverse_frequencies: &[f32],
        position: usize,
        tokens: usize,
        style: RopeStyle,
        factor: f32,
    ) -> Self {
        let pairs = inverse_frequencies.len();
        let mut cos = Vec::with_capacity(tokens * pairs);
        let mut sin = Vec::with_capacity(tokens * pairs);
        for offset in 0..tokens {
            let at = (position + offset) as f32;
            for &frequency in inverse_frequencies {
                let angle = at * frequency;
                cos.push(angle.cos() * factor);
                sin.push(angle.sin() * factor);
            }
        }
        Self {
            cos,
            sin,
            pairs,
            style,
        }
    }

    /// Rotates, in place, every head of every token row of `rows` (`[tokens, heads · 2 ·
    /// pairs]`), each token by its own position's angles: adjacent pairs `(x[2i], x[2i+1])`
    /// or pairs half a head apart `(x[i], x[i + pairs])`.
    pub(crate) fn rotate(&self, rows: &mut [f32]) {
        let head_dim = 2 * self.pairs;
        let tokens = self.cos.len() / self.pairs.max(1);
        let width = rows.len() / tokens.max(1);
        for (token, row) in rows.chunks_exact_mut(width).enumerate() {
            let cos = &self.cos[token * self.pairs..(token + 1) * self.pairs];
            let sin = &self.sin[token * self.pairs..(token + 1) * self.pairs];
            for head in row.chunks_exact_mut(head_dim) {
                match self.style {
                    RopeStyle::Interleaved => {
                        for ((pair, cos), sin) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                            (pair[0], pair[1]) = turn(pair[0], pair[1], *cos, *sin);
                        }
                    }
                    RopeStyle::Halves => {
                        let (first, second) = head.split_at_mut(self.pairs);
                        for (pair, (cos, sin)) in cos.iter().zip(sin).enumerate() {
                            (first[pair], second[pair]) =
                                turn(first[pair], second[pair], *cos, *sin);
                        }
                    }
                }
            }
        }
    }
}

/// `(x, y)` turned by the angle whose cos and sin are given.
fn turn(x: f32, y: f32, cos: f32, sin: f32) -> (f32, f32) {
    (x * cos - y * sin, x * sin + y * cos)
}

/// The head layout of a grouped-query attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    /// Query heads.
    pub(crate) heads: usize,
    /// Key/value heads; each serves `heads / kv_heads` adjacent query heads.
    pub(crate) kv_heads: usize,
    /// Values per head.
    pub(crate) head_dim: usize,
}

/// How scores are scaled and which earlier positions a query sees.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionRule {
    /// What each query·key product is multiplied by.
    pub(crate) scale: f32,
    /// When set, a query sees only the last `window` positions, its own included.
    pub(crate) window: Option<usize>,
}

impl AttentionRule {
    /// `1/√head_dim`, no window: the plain causal attention.
    #[cfg(test)]
    pub(crate) fn causal(head_dim: usize) -> Self {
        Self {
            scale: (1.0 / (head_dim as f64).sqrt()) as f32,
            window: None,
        }
    }
}

/// Below this many multiply-adds an attention runs on the calling thread.
const PARALLEL_WORK: usize = 64 * 1024;

/// With fewer (token, key/value head) tasks than this many per thread, an attention splits
/// each task's positions into the kernels' pieces and spreads those (a decode step has as
/// many tasks as key/value heads, often fewer than twice the threads).
const TASKS_PER_THREAD: usize = 4;

/// Causal attention of a chunk's queries (`[tokens, heads · head_dim]`, the chunk starting at
/// absolute `position`) over `keys` and `values` (`[position + tokens, kv_heads · head_dim]`,
/// the cache including this chunk). Query `t` sees positions `0..=position + t`, or only the
/// last `window` of them when the rule has a window; scores are scaled by the rule's scale. Returns
/// `[tokens, heads · head_dim]`.
///
/// Each (token, key/value head) is one task of `meshnet_kernels::attend_head` with the query
/// heads it serves (each cached key and value read once for all of them). The kernels' order
/// of operations is fixed, so the bits depend neither on the kernel nor on the threads: with
/// many tasks they are split over the pool, with few each task's pieces are.
pub(crate) fn attend(
    shape: Heads,
    rule: AttentionRule,
    queries: &[f32],
    keys: &[f16],
    values: &[f16],
    position: usize,
) -> Result<Vec<f32>> {
    let tasks = AttentionTasks::new(shape, rule, queries, keys, values, position);
    let mut output = vec![0f32; queries.len()];
    let count = output.len() / tasks.group_width;
    let work = count * shape.heads / shape.kv_heads * tasks.known * shape.head_dim;
    if work < PARALLEL_WORK {
        let mut weights = Vec::new();
        for (task, attended) in output.chunks_exact_mut(tasks.group_width).enumerate() {
            tasks.attend(task, attended, &mut weights)?;
        }
    } else if count >= TASKS_PER_THREAD * rayon::current_num_threads() {
        output
            .par_chunks_exact_mut(tasks.group_width)
            .enumerate()
            .try_for_each_init(Vec::new, |weights, (task, attended)| {
                tasks.attend(task, attended, weights)
            })?;
    } else {
        tasks.attend_in_pieces(&mut output)?;
    }
    Ok(output)
}

/// The (token, key/value head) tasks of one attention.
struct AttentionTasks<'a> {
    shape: Heads,
    rule: AttentionRule,
    queries: &'a [f32],
    keys: &'a [f16],
    values: &'a [f16],
    position: usize,
    known: usize,
    group_width: usize,
    kernel: Kernel,
}

impl<'a> AttentionTasks<'a> {
    fn new(
        shape: Heads,
        rule: AttentionRule,
        queries: &'a [f32],
        keys: &'a [f16],
        values: &'a [f16],
        position: usize,
    ) -> Self {
        Self {
            shape,
            rule,
            queries,
            keys,
            values,
            position,
            known: keys.len() / (shape.kv_heads * shape.head_dim),
            group_width: shape.heads / shape.kv_heads * shape.head_dim,
            kernel: Kernel::best(),
        }
    }

    /// The cached head task `task` reads, the positions it sees and its queries.
    fn task(&self, task: usize) -> (CachedHead<'a>, Range<usize>, &'a [f32]) {
        let Heads {
            kv_heads, head_dim, ..
        } = self.shape;
        let (token, kv_head) = (task / kv_heads, task % kv_heads);
        let end = (self.position + token + 1).min(self.known);
        let first = self
            .rule
            .window
            .map_or(0, |window| end.saturating_sub(window));
        let head = CachedHead {
            keys: self.keys,
            values: self.values,
            row_width: kv_heads * head_dim,
            offset: kv_head * head_dim,
            head_dim,
        };
        let queries = &self.queries[task * self.group_width..(task + 1) * self.group_width];
        (head, first..end, queries)
    }

    /// Task `task` whole, into `attended`.
    fn attend(&self, task: usize, attended: &mut [f32], weights: &mut Vec<f32>) -> Result<()> {
        let (head, positions, queries) = self.task(task);
        attend_head(
            self.kernel,
            head,
            positions,
            queries,
            self.rule.scale,
            weights,
            attended,
        )?;
        Ok(())
    }

    /// Every task, its pieces spread over the pool, then joined task by task into `output`.
    fn attend_in_pieces(&self, output: &mut [f32]) -> Result<()> {
        let count = output.len() / self.group_width;
        let one = piece_len(self.shape.heads / self.shape.kv_heads, self.shape.head_dim);
        let all: Vec<(usize, Range<usize>)> = (0..count)
            .flat_map(|task| pieces(self.task(task).1).map(move |piece| (task, piece)))
            .collect();
        let mut sums = vec![0f32; all.len() * one];
        sums.par_chunks_exact_mut(one)
            .zip(all.par_iter())
            .try_for_each_init(Vec::new, |weights, (sums, (task, piece))| {
                let (head, _, queries) = self.task(*task);
                let scale = self.rule.scale;
                attend_piece(
                    self.kernel,
                    head,
                    piece.clone(),
                    queries,
                    scale,
                    weights,
                    sums,
                )
            })?;
        let mut first = 0;
        for (task, attended) in output.chunks_exact_mut(self.group_width).enumerate() {
            let end = first + pieces(self.task(task).1).count();
            if first == end {
                attended.fill(0.0);
                continue;
            }
            combine_pieces(&sums[first * one..end * one], self.shape.head_dim, attended)?;
            first = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention written out in f64 the textbook way, keys and values repeated per group.
    fn reference_attention(
        shape: Heads,
        queries: &[f32],
        keys: &[f16],
        values: &[f16],
        position: usize,
        window: Option<usize>,
    ) -> Vec<f64> {
        let Heads {
            heads,
            kv_heads,
            head_dim,
        } = shape;
        let tokens = queries.len() / (heads * head_dim);
        let mut output = vec![0f64; queries.len()];
        for token in 0..tokens {
            for head in 0..heads {
                let kv = head / (heads / kv_heads);
                let query = &queries[(token * heads + head) * head_dim..][..head_dim];
                let visible = position + token + 1;
                let first = window.map_or(0, |window| visible.saturating_sub(window));
                let scores: Vec<f64> = (first..visible)
                    .map(|at| {
                        let key = &keys[(at * kv_heads + kv) * head_dim..][..head_dim];
                        query
                            .iter()
                            .zip(key)
                            .map(|(q, k)| f64::from(*q) * f64::from(k.to_f32()))
                            .sum::<f64>()
                            / (head_dim as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for (at, weight) in (first..visible).zip(&exps) {
                    let value = &values[(at * kv_heads + kv) * head_dim..][..head_dim];
                    for (i, v) in value.iter().enumerate() {
                        output[(token * heads + head) * head_dim + i] +=
                            weight / total * f64::from(v.to_f32());
                    }
                }
            }
        }
        output
    }

    /// [`filler`]'s values as the cache keeps them.
    fn half_filler(count: usize, seed: u32) -> Vec<f16> {
        filler(count, seed).into_iter().map(f16::from_f32).collect()
    }

    /// Deterministic values in about [-2, 2].
    fn filler(count: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..count)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state % 4001) as f32 / 1000.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn attention_matches_the_textbook_in_f64_for_prefill_and_decode() {
        let shape = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: 12,
        };
        // A decode step at position 9, a chunk of 5 after 4 cached, a large chunk that takes
        // the parallel path.
        for (position, tokens) in [(9, 1), (4, 5), (0, 1), (30, 70)] {
            let known = position + tokens;
            let queries = filler(tokens * 6 * 12, 1);
            let keys = half_filler(known * 2 * 12, 2);
            let values = half_filler(known * 2 * 12, 3);
            let ours = attend(
                shape,
                AttentionRule::causal(shape.head_dim),
                &queries,
                &keys,
                &values,
                position,
            )
            .expect("the buffers fit");
            let reference = reference_attention(shape, &queries, &keys, &values, position, None);
            for (index, (ours, reference)) in ours.iter().zip(&reference).enumerate() {
                assert!(
                    (f64::from(*ours) - reference).abs() < 1e-4,
                    "position {position} tokens {tokens} value {index}: {ours} vs {reference}"
                );
            }
        }
    }

    /// One decode step's queries and a cache of `known` positions' keys and values, filled
    /// from seeds `seed`, `seed + 1` and `seed + 2`.
    fn decode_operands(shape: Heads, known: usize, seed: u32) -> (Vec<f32>, [Vec<f16>; 2]) {
        let cached = known * shape.kv_heads * shape.head_dim;
        (
            filler(shape.heads * shape.head_dim, seed),
            [half_filler(cached, seed + 1), half_filler(cached, seed + 2)],
        )
    }

    #[test]
    fn a_decode_step_over_a_long_cache_gives_the_bits_of_whole_tasks() {
        let shape = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: 16,
        };
        // One token over 1,000 positions: enough work for the pool, too few tasks for it, so
        // the tasks' pieces are spread instead.
        let known = 1000;
        let (queries, [keys, values]) = decode_operands(shape, known, 21);
        let rule = AttentionRule::causal(16);
        let ours =
            attend(shape, rule, &queries, &keys, &values, known - 1).expect("the buffers fit");
        let tasks = AttentionTasks::new(shape, rule, &queries, &keys, &values, known - 1);
        let mut whole = vec![0f32; queries.len()];
        for (task, attended) in whole.chunks_exact_mut(3 * 16).enumerate() {
            tasks
                .attend(task, attended, &mut Vec::new())
                .expect("the buffers fit");
        }
        let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ours), bits(&whole));
        let reference = reference_attention(shape, &queries, &keys, &values, known - 1, None);
        for (ours, reference) in ours.iter().zip(&reference) {
            assert!(
                (f64::from(*ours) - reference).abs() < 1e-4,
                "{ours} vs {reference}"
            );
        }
    }

    /// Decode attention over a long cache at the default model's shape, timed (run with
    /// `--ignored --nocapture`): what one layer's attention costs a token at ~1,900 positions.
    #[test]
    #[ignore]
    fn long_context_decode_timing() {
        let shape = Heads {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        let known = 1900;
        let (queries, [keys, values]) = decode_operands(shape, known, 1);
        let rule = AttentionRule::causal(64);
        let mut best = f64::MAX;
        for _ in 0..200 {
            let start = std::time::Instant::now();
            std::hint::black_box(
                attend(shape, rule, &queries, &keys, &values, known - 1).expect("the buffers fit"),
            );
            best = best.min(start.elapsed().as_secs_f64());
        }
        println!(
            "decode attention over {known} positions: {:.1} µs",
            best * 1e6
        );
    }

    #[test]
    fn a_sliding_window_sees_only_its_last_positions() {
        let shape = Heads {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let rule = AttentionRule {
            scale: 0.25,
            window: Some(3),
        };
        for (position, tokens) in [(9, 1), (0, 6), (2, 5)] {
            let known = position + tokens;
            let queries = filler(tokens * 4 * 8, 11);
            let keys = half_filler(known * 2 * 8, 12);
            let values = half_filler(known * 2 * 8, 13);
            let ours =
                attend(shape, rule, &queries, &keys, &values, position).expect("the buffers fit");
            // The reference scales by 1/√8; the rule's 0.25 is larger, so scale the queries.
            let scaled: Vec<f32> = queries.iter().map(|q| q * 0.25 * 8f32.sqrt()).collect();
            let reference = reference_attention(shape, &scaled, &keys, &values, position, Some(3));
            for (ours, reference) in ours.iter().zip(&reference) {
                assert!(
                    (f64::from(*ours) - reference).abs() < 1e-4,
                    "{ours} vs {reference}"
                );
            }
            let unwindowed = reference_attention(shape, &scaled, &keys, &values, position, None);
            if known > 3 {
                assert!(
                    reference
                        .iter()
                        .zip(&unwindowed)
                        .any(|(a, b)| (a - b).abs() > 1e-3),
                    "the window changed nothing at position {position}"
                );
            }
        }
    }

    /// `input` (`[tokens, heads · head_dim]`) rotated by one of candle's rope functions with
    /// `rotary`'s tables, back in our layout.
    fn candle_rotation(
        input: &[f32],
        rotary: &Rotary,
        heads: usize,
        rope: fn(
            &candle_core::Tensor,
            &candle_core::Tensor,
            &candle_core::Tensor,
        ) -> candle_core::Result<candle_core::Tensor>,
    ) -> Vec<f32> {
        use candle_core::{Device, Tensor};
        let pairs = rotary.pairs;
        let tokens = rotary.cos.len() / pairs;
        let shape = (1, tokens, heads, 2 * pairs);
        let heads_first = Tensor::from_slice(input, shape, &Device::Cpu)
            .and_then(|t| t.transpose(1, 2)?.contiguous())
            .unwrap();
        let cos = Tensor::from_slice(&rotary.cos, (tokens, pairs), &Device::Cpu).unwrap();
        let sin = Tensor::from_slice(&rotary.sin, (tokens, pairs), &Device::Cpu).unwrap();
        rope(&heads_first, &cos, &sin)
            .and_then(|t| t.transpose(1, 2)?.flatten_all()?.to_vec1::<f32>())
            .unwrap()
    }

    #[test]
    fn halves_rotation_matches_candles_rope() {
        let (tokens, heads, head_dim) = (3, 2, 8);
        let input = filler(tokens * heads * head_dim, 21);
        let frequencies: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        let rotary = Rotary::new(&frequencies, 7, tokens, RopeStyle::Halves, 1.0);
        let mut ours = input.clone();
        rotary.rotate(&mut ours);
        let theirs = candle_rotation(&input, &rotary, heads, candle_nn::rotary_emb::rope);
        assert_eq!(ours, theirs, "rotation of halves");
    }

    #[test]
    fn geglu_follows_the_tanh_approximation() {
        let gate = [-3.0f32, -0.5, 0.0, 0.5, 2.0];
        let up = [1.0f32, 2.0, 3.0, -1.0, 0.5];
        for ((ours, x), up) in geglu(&gate, &up).iter().zip(gate).zip(up) {
            let x = f64::from(x);
            let gelu = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
            assert!(
                (f64::from(*ours) - gelu * f64::from(up)).abs() < 1e-6,
                "{x}"
            );
        }
    }

    #[test]
    fn a_query_ignores_keys_after_its_position() {
        let shape = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let queries = filler(2 * 2 * 4, 4);
        let keys = half_filler(5 * 4, 5);
        let values = half_filler(5 * 4, 6);
        let before = attend(
            shape,
            AttentionRule::causal(shape.head_dim),
            &queries,
            &keys,
            &values,
            3,
        )
        .expect("the buffers fit");
        // Changing the last position's key and value moves only the last token's output.
        let (mut keys, mut values) = (keys, values);
        keys[16..].iter_mut().for_each(|k| *k += f16::ONE);
        values[16..]
            .iter_mut()
            .for_each(|v| *v -= f16::from_f32(3.0));
        let after = attend(
            shape,
            AttentionRule::causal(shape.head_dim),
            &queries,
            &keys,
            &values,
            3,
        )
        .expect("the buffers fit");
        assert_eq!(before[..8], after[..8], "token 0 (position 3) moved");
        assert_ne!(before[8..], after[8..], "token 1 (position 4) did not move");
    }

    #[test]
    fn norm_and_rotation_match_candle() {
        use candle_core::{Device, Tensor};
        let (tokens, heads, head_dim) = (3, 2, 8);
        let input = filler(tokens * heads * head_dim, 7);
        let weight = filler(heads * head_dim, 8);
        let ours = rms_norm(&input, &weight, 1e-5);
        let theirs = candle_nn::ops::rms_norm(
            &Tensor::from_slice(&input, (1, tokens, heads * head_dim), &Device::Cpu).unwrap(),
            &Tensor::from_slice(&weight, heads * head_dim, &Device::Cpu).unwrap(),
            1e-5,
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        assert_eq!(ours, theirs, "RMSNorm");

        let frequencies: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / head_dim as f32))
            .collect();
        let rotary = Rotary::new(&frequencies, 5, tokens, RopeStyle::Interleaved, 1.0);
        let mut ours = input.clone();
        rotary.rotate(&mut ours);
        let theirs = candle_rotation(&input, &rotary, heads, candle_nn::rotary_emb::rope_i);
        assert_eq!(ours, theirs, "interleaved rotation");
    }
}
