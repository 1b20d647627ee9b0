//! Choosing the next token from logits, apart from any model: greedy, temperature, top-k,
//! top-p, with a seeded generator so a seed gives the same text every time.

use crate::error::{ModelError, Result};

/// How to choose tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 (or below) picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens before sampling.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f32>,
    /// Seed of the random generator.
    pub seed: u64,
}

impl SamplingConfig {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    /// Whether this configuration always takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == Some(1)
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self::greedy()
    }
}

/// A small, fast, seedable generator (SplitMix64); enough for sampling, not for secrets.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform value in `[0, 1)`.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Picks tokens according to a [`SamplingConfig`].
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplingConfig,
    random: SplitMix64,
}

impl Sampler {
    /// A sampler; rejects a NaN temperature, `top_k = 0` and `top_p` outside `(0, 1]`.
    pub fn new(config: SamplingConfig) -> Result<Self> {
        if config.temperature.is_nan() {
            return Err(ModelError::Sampling("temperature is NaN".into()));
        }
        if config.top_k == Some(0) {
            return Err(ModelError::Sampling("top-k must be at least 1".into()));
        }
        if let Some(p) = config.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ModelError::Sampling(format!("top-p {p} is not in (0, 1]")));
        }
        let random = SplitMix64(config.seed);
        Ok(Self { config, random })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Chooses a token from `logits`.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(ModelError::Sampling("empty logits".into()));
        }
        if self.config.is_greedy() {
            return Ok(argmax(logits));
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, logit)| !logit.is_nan())
            .map(|(index, &logit)| (index as u32, logit))
            .collect();
        if candidates.is_empty() {
            return Err(ModelError::Sampling("all logits are NaN".into()));
        }
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = self.config.top_k {
            candidates.truncate(k);
        }
        let max = candidates[0].1;
        let temperature = f64::from(self.config.temperature);
        let mut weights: Vec<f64> = candidates
            .iter()
            .map(|&(_, logit)| ((f64::from(logit) - f64::from(max)) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        if let Some(p) = self.config.top_p {
            let mut cumulative = 0.0;
            let mut keep = weights.len();
            for (index, weight) in weights.iter().enumerate() {
                cumulative += weight / total;
                if cumulative >= f64::from(p) {
                    keep = index + 1;
                    break;
                }
            }
            weights.truncate(keep);
        }
        let total: f64 = weights.iter().sum();
        let mut target = self.random.next_unit() * total;
        for (index, weight) in weights.iter().enumerate() {
            if target < *weight {
                return Ok(candidates[index].0);
            }
            target -= weight;
        }
        Ok(candidates[weights.len() - 1].0)
    }
}

/// The index of the largest logit (the first one on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_value = f32::NEG_INFINITY;
    for (index, &value) in logits.iter().enumerate() {
        if value > best_value {
            best = index;
            best_value = value;
        }
    }
    best as u32
}

/// When generation stops, besides the token limit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConditions {
    /// Tokens that end generation (not included in the output).
    pub tokens: Vec<u32>,
    /// Strings that end generation when the decoded output contains them (the output is cut
    /// before the string).
    pub strings: Vec<String>,
}

impl StopConditions {
    /// The earliest byte offset in `text` where a stop string starts, if any.
    pub fn find_stop_string(&self, text: &str) -> Option<usize> {
        self.strings
            .iter()
            .filter(|stop| !stop.is_empty())
            .filter_map(|stop| text.find(stop.as_str()))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut sampler = Sampler::new(SamplingConfig::greedy()).unwrap();
        assert_eq!(sampler.sample(&[0.1, 3.0, f32::NAN, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let config = SamplingConfig {
            temperature: 5.0,
            top_k: Some(1),
            top_p: None,
            seed: 7,
        };
        let mut sampler = Sampler::new(config).unwrap();
        for _ in 0..20 {
            assert_eq!(sampler.sample(&[0.0, 1.0, 0.5]).unwrap(), 1);
        }
    }

    #[test]
    fn same_seed_same_choices_and_top_p_limits_the_set() {
        let config = SamplingConfig {
            temperature: 1.0,
            top_k: None,
            top_p: Some(0.6),
            seed: 42,
        };
        // Probabilities ~ [0.66, 0.24, 0.09, ...]: top-p 0.6 keeps only the first.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut first = Sampler::new(config.clone()).unwrap();
        for _ in 0..50 {
            assert_eq!(first.sample(&logits).unwrap(), 0);
        }
        let wide = SamplingConfig {
            top_p: None,
            ..config
        };
        let run = |config: &SamplingConfig| {
            let mut sampler = Sampler::new(config.clone()).unwrap();
            (0..100)
                .map(|_| sampler.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        let a = run(&wide);
        assert_eq!(a, run(&wide));
        assert!(
            a.iter().any(|&t| t != 0),
            "temperature 1 should not be greedy"
        );
        assert!(a.iter().all(|&t| t < 4));
    }

    /// Logits with distinct values, so every token has its own probability and the order of
    /// the tokens by probability is unambiguous.
    const LOGITS: [f32; 6] = [1.0, 2.5, -0.5, 0.3, 1.8, -1.2];

    /// Draws per distribution check: one draw from each of this many seeds.
    const DRAWS: u64 = 4000;

    /// `softmax(logits / temperature)` in `f64`.
    fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logits
            .iter()
            .map(|&logit| ((f64::from(logit) - f64::from(max)) / temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        weights.iter().map(|weight| weight / total).collect()
    }

    /// Token indices from the most to the least likely.
    fn ranked(logits: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order
    }

    /// How often each token comes out of one draw per seed `0..DRAWS`.
    fn counts(config: &SamplingConfig, logits: &[f32]) -> Vec<u64> {
        let mut counts = vec![0u64; logits.len()];
        for seed in 0..DRAWS {
            let mut sampler = Sampler::new(SamplingConfig {
                seed,
                ..config.clone()
            })
            .unwrap();
            counts[sampler.sample(logits).unwrap() as usize] += 1;
        }
        counts
    }

    /// Pearson's chi-square statistic of `counts` against `expected` probabilities, over the
    /// tokens whose expected probability is not zero; a count on a zero-probability token
    /// makes it infinite.
    fn chi_square(counts: &[u64], expected: &[f64]) -> f64 {
        let total = counts.iter().sum::<u64>() as f64;
        counts
            .iter()
            .zip(expected)
            .map(|(&count, &probability)| {
                let wanted = probability * total;
                if wanted == 0.0 {
                    if count == 0 { 0.0 } else { f64::INFINITY }
                } else {
                    (count as f64 - wanted).powi(2) / wanted
                }
            })
            .sum()
    }

    /// Upper critical values of the chi-square distribution at p = 0.001, indexed by degrees
    /// of freedom (index 0 unused).
    const CHI_SQUARE_CRITICAL_P001: [f64; 6] = [f64::NAN, 10.83, 13.82, 16.27, 18.47, 20.52];

    fn sampling(temperature: f32, top_k: Option<usize>, top_p: Option<f32>) -> SamplingConfig {
        SamplingConfig {
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    #[test]
    fn frequencies_follow_the_tempered_softmax() {
        let degrees = LOGITS.len() - 1;
        let critical = CHI_SQUARE_CRITICAL_P001[degrees];
        let mut observed = Vec::new();
        for temperature in [0.5f32, 1.5] {
            let counts = counts(&sampling(temperature, None, None), &LOGITS);
            let expected = softmax(&LOGITS, f64::from(temperature));
            let statistic = chi_square(&counts, &expected);
            println!("temperature {temperature}: counts {counts:?}, chi-square {statistic:.2}");
            assert!(
                statistic < critical,
                "temperature {temperature}: chi-square {statistic:.2} >= {critical} \
                 (counts {counts:?}, expected probabilities {expected:?})"
            );
            observed.push((temperature, counts));
        }
        // The two temperatures give clearly different distributions: each sample is far from
        // the other temperature's softmax.
        for ((temperature, counts), (other, _)) in observed.iter().zip(observed.iter().rev()) {
            let statistic = chi_square(counts, &softmax(&LOGITS, f64::from(*other)));
            println!(
                "temperature {temperature} against softmax at {other}: chi-square {statistic:.2}"
            );
            assert!(
                statistic > 10.0 * critical,
                "temperature {temperature} samples look like temperature {other}: \
                 chi-square {statistic:.2}"
            );
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best_in_proportion() {
        let k = 3;
        let order = ranked(&LOGITS);
        let allowed = &order[..k];
        let counts = counts(&sampling(1.0, Some(k), None), &LOGITS);
        for (token, &count) in counts.iter().enumerate() {
            assert!(
                count == 0 || allowed.contains(&token),
                "top-k {k} emitted token {token} ({count} times) outside {allowed:?}"
            );
        }
        // Within the k best, the softmax renormalised over those k.
        let full = softmax(&LOGITS, 1.0);
        let kept: f64 = allowed.iter().map(|&token| full[token]).sum();
        let expected: Vec<f64> = (0..LOGITS.len())
            .map(|token| {
                if allowed.contains(&token) {
                    full[token] / kept
                } else {
                    0.0
                }
            })
            .collect();
        let statistic = chi_square(&counts, &expected);
        println!("top-k {k}: counts {counts:?}, chi-square {statistic:.2}");
        assert!(
            statistic < CHI_SQUARE_CRITICAL_P001[k - 1],
            "top-k {k}: chi-square {statistic:.2} (counts {counts:?}, expected {expected:?})"
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus_in_proportion() {
        let temperature = 1.0;
        let full = softmax(&LOGITS, temperature);
        let order = ranked(&LOGITS);
        for p in [0.7f32, 0.85, 0.95] {
            // The nucleus: the smallest set of most likely tokens whose mass reaches `p`.
            let mut mass = 0.0;
            let mut size = 0;
            while mass < f64::from(p) {
                mass += full[order[size]];
                size += 1;
            }
            let nucleus = &order[..size];
            assert!(
                size >= 2 && size < LOGITS.len(),
                "p {p}: nucleus {nucleus:?}"
            );
            let counts = counts(&sampling(temperature as f32, None, Some(p)), &LOGITS);
            for (token, &count) in counts.iter().enumerate() {
                assert!(
                    count == 0 || nucleus.contains(&token),
                    "top-p {p} emitted token {token} ({count} times) outside the nucleus \
                     {nucleus:?}"
                );
            }
            let expected: Vec<f64> = (0..LOGITS.len())
                .map(|token| {
                    if nucleus.contains(&token) {
                        full[token] / mass
                    } else {
                        0.0
                    }
                })
                .collect();
            let statistic = chi_square(&counts, &expected);
            println!(
                "top-p {p}: nucleus {nucleus:?}, counts {counts:?}, chi-square {statistic:.2}"
            );
            assert!(
                statistic < CHI_SQUARE_CRITICAL_P001[size - 1],
                "top-p {p}: chi-square {statistic:.2} (counts {counts:?}, expected {expected:?})"
            );
        }
    }

    #[test]
    fn a_seed_fixes_the_sequence_and_different_seeds_differ() {
        let run = |seed: u64| {
            let mut sampler = Sampler::new(SamplingConfig {
                seed,
                ..sampling(1.0, None, None)
            })
            .unwrap();
            (0..64)
                .map(|_| sampler.sample(&LOGITS).unwrap())
                .collect::<Vec<_>>()
        };
        let sequences: Vec<Vec<u32>> = (0..8).map(run).collect();
        for (seed, sequence) in sequences.iter().enumerate() {
            assert_eq!(
                *sequence,
                run(seed as u64),
                "seed {seed} is not reproducible"
            );
            for (other, other_sequence) in sequences.iter().enumerate().skip(seed + 1) {
                assert_ne!(
                    sequence, other_sequence,
                    "seeds {seed} and {other} give the same sequence"
                );
            }
        }
        // A sampler continues its own stream: a draw depends on the ones before it.
        let first = &sequences[0];
        assert!(
            first.windows(2).any(|pair| pair[0] != pair[1]),
            "one seed gives a constant sequence: {first:?}"
        );
    }

    #[test]
    fn rejects_bad_settings() {
        let bad = |config: SamplingConfig| Sampler::new(config).is_err();
        assert!(bad(SamplingConfig {
            top_k: Some(0),
            ..SamplingConfig::greedy()
        }));
        assert!(bad(SamplingConfig {
            top_p: Some(1.5),
            ..SamplingConfig::greedy()
        }));
        assert!(bad(SamplingConfig {
            temperature: f32::NAN,
            ..SamplingConfig::greedy()
        }));
    }

    #[test]
    fn finds_earliest_stop_string() {
        let stop = StopConditions {
            tokens: vec![],
            strings: vec!["\n\n".into(), "User:".into()],
        };
        assert_eq!(stop.find_stop_string("abc User: x\n\n"), Some(4));
        assert_eq!(stop.find_stop_string("abc"), None);
    }
}
