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
