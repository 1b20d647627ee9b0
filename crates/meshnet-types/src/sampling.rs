//! How a generation chooses its tokens: the settings a request carries from the API to the
//! sampler, whole.

use serde::{Deserialize, Serialize};

/// How to choose tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingConfig {
    /// Softmax temperature; 0 (or below) picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens before sampling.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`.
    pub top_p: Option<f32>,
    /// Drop the tokens whose probability (after temperature) is below `min_p` times the most
    /// likely token's.
    pub min_p: Option<f32>,
    /// Subtracted once from the logit of every token generated at least once so far.
    pub presence_penalty: f32,
    /// Subtracted from the logit of every token once per time it was generated so far.
    pub frequency_penalty: f32,
    /// Added to the logits of the listed token ids, greedy or not; a bias of `-100` or less
    /// bans the token. Ids past the end of the logits are ignored.
    pub logit_bias: Vec<(u32, f32)>,
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
            min_p: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }

    /// Whether this configuration always takes the most likely token (after bias and
    /// penalties).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == Some(1)
    }

    /// Whether logits are changed before choosing: any bias or penalty.
    pub fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self::greedy()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_means_zero_temperature_or_a_single_candidate() {
        assert!(SamplingConfig::greedy().is_greedy());
        let warm = SamplingConfig {
            temperature: 0.7,
            ..SamplingConfig::greedy()
        };
        assert!(!warm.is_greedy());
        let one = SamplingConfig {
            top_k: Some(1),
            ..warm.clone()
        };
        assert!(one.is_greedy());
    }

    #[test]
    fn only_a_bias_or_a_penalty_adjusts_logits() {
        let plain = SamplingConfig {
            temperature: 1.0,
            top_k: Some(5),
            ..SamplingConfig::greedy()
        };
        assert!(!plain.adjusts_logits());
        for adjusted in [
            SamplingConfig {
                presence_penalty: 0.5,
                ..plain.clone()
            },
            SamplingConfig {
                frequency_penalty: -0.5,
                ..plain.clone()
            },
            SamplingConfig {
                logit_bias: vec![(3, 1.0)],
                ..plain.clone()
            },
        ] {
            assert!(adjusted.adjusts_logits(), "{adjusted:?}");
        }
    }
}
