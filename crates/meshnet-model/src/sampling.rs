//! Choosing the next token from logits, apart from any model: logit bias and repetition
//! penalties, then greedy, or top-k, temperature, min-p and top-p with a seeded generator so a
//! seed gives the same text every time. A [`TokenMask`] (from a token constraint) limits the
//! choice to the tokens it allows, before any of these.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::error::{ModelError, Result};

/// A logit bias at or below this bans its token: the token is never chosen.
pub const BAN_BIAS: f32 = -100.0;

pub use meshnet_types::SamplingConfig;

/// Refuses settings no sampler can follow: a NaN temperature, `top_k = 0`, `top_p`
/// outside `(0, 1]`, `min_p` outside `[0, 1]`, and penalties or biases that are not
/// finite numbers.
fn check(config: &SamplingConfig) -> Result<()> {
    let refuse = |reason: String| Err(ModelError::Sampling(reason));
    if config.temperature.is_nan() {
        return refuse("temperature is NaN".into());
    }
    if config.top_k == Some(0) {
        return refuse("top-k must be at least 1".into());
    }
    if let Some(p) = config.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return refuse(format!("top-p {p} is not in (0, 1]"));
    }
    if let Some(p) = config.min_p
        && !(0.0..=1.0).contains(&p)
    {
        return refuse(format!("min-p {p} is not in [0, 1]"));
    }
    for (name, penalty) in [
        ("presence", config.presence_penalty),
        ("frequency", config.frequency_penalty),
    ] {
        if !penalty.is_finite() {
            return refuse(format!("the {name} penalty {penalty} is not finite"));
        }
    }
    if let Some((id, bias)) = config.logit_bias.iter().find(|(_, bias)| !bias.is_finite()) {
        return refuse(format!("the bias {bias} of token {id} is not finite"));
    }
    Ok(())
}

/// A set of token ids: the tokens a token constraint allows at one step.
///
/// Bit `id % 32` of word `id / 32` stands for token `id`; ids past the last word are not in
/// the set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// The set whose members are the set bits of `words` (bit `id % 32` of word `id / 32`).
    pub fn from_words(words: Vec<u32>) -> Self {
        Self { words }
    }

    /// Makes this the set of the set bits of `words`, reusing its memory.
    pub fn set_words(&mut self, words: &[u32]) {
        self.words.clear();
        self.words.extend_from_slice(words);
    }

    /// The set of exactly `ids`.
    pub fn of(ids: &[u32]) -> Self {
        let mut mask = Self::default();
        for &id in ids {
            mask.allow(id);
        }
        mask
    }

    /// Adds `id` to the set.
    pub fn allow(&mut self, id: u32) {
        let word = id as usize / 32;
        if self.words.len() <= word {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (id % 32);
    }

    /// Whether `id` is in the set.
    pub fn allows(&self, id: u32) -> bool {
        self.words
            .get(id as usize / 32)
            .is_some_and(|word| word & (1 << (id % 32)) != 0)
    }

    /// How many ids the set holds.
    pub fn count(&self) -> usize {
        self.words
            .iter()
            .map(|word| word.count_ones() as usize)
            .sum()
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

/// Picks tokens according to a [`SamplingConfig`], one after another for one completion: the
/// penalties count the tokens it has picked so far.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: SamplingConfig,
    random: SplitMix64,
    /// How often each token was picked so far.
    counts: HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler; rejects a NaN temperature, `top_k = 0`, `top_p` outside `(0, 1]`, `min_p`
    /// outside `[0, 1]`, and penalties or biases that are not finite.
    pub fn new(config: SamplingConfig) -> Result<Self> {
        check(&config)?;
        let random = SplitMix64(config.seed);
        Ok(Self {
            config,
            random,
            counts: HashMap::new(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Chooses the next token from `logits` and counts it for the penalties of later choices.
    /// Fails when the logits are empty, or when every token is NaN or banned.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        self.sample_within(logits, None)
    }

    /// Like [`Sampler::sample`], choosing only among the tokens `allowed` holds (all tokens
    /// when `None`): every other token is banned before bias, penalties, top-k, min-p and
    /// top-p, so they work on the allowed tokens alone. Fails, with
    /// [`ModelError::Constraint`], when every allowed token is NaN or banned.
    pub fn sample_within(&mut self, logits: &[f32], allowed: Option<&TokenMask>) -> Result<u32> {
        if logits.is_empty() {
            return Err(ModelError::Sampling("empty logits".into()));
        }
        let logits = self.adjusted_within(logits, allowed);
        let token = if self.config.is_greedy() {
            best_token(&logits)
        } else {
            self.weighted_candidates(&logits)
                .map(|weighted| self.pick(&weighted, None))
        };
        self.count(token, allowed)
    }

    /// Like [`Sampler::sample_within`] where a draft proposed `draft` for this step, keeping
    /// the distribution exactly: greedy takes the best token as always; sampling takes the
    /// draft with its probability under the sampler, else draws among the other candidates
    /// in proportion (the accept/resample rule of speculative sampling, for a draft that
    /// proposes its token with certainty). The draft is accepted when the result equals it.
    pub fn sample_against_draft(
        &mut self,
        logits: &[f32],
        allowed: Option<&TokenMask>,
        draft: u32,
    ) -> Result<u32> {
        if self.config.is_greedy() {
            return self.sample_within(logits, allowed);
        }
        if logits.is_empty() {
            return Err(ModelError::Sampling("empty logits".into()));
        }
        let logits = self.adjusted_within(logits, allowed);
        let token = self.weighted_candidates(&logits).map(|weighted| {
            let total: f64 = weighted.iter().map(|&(_, weight)| weight).sum();
            let draft_weight = weighted
                .iter()
                .find(|&&(token, _)| token == draft)
                .map_or(0.0, |&(_, weight)| weight);
            let accepted = self.random.next_unit() * total < draft_weight;
            if accepted || draft_weight >= total {
                draft
            } else {
                self.pick(&weighted, Some(draft))
            }
        });
        self.count(token, allowed)
    }

    /// Counts a chosen `token` for the penalties, or explains why none could be chosen.
    fn count(&mut self, token: Option<u32>, allowed: Option<&TokenMask>) -> Result<u32> {
        let token = match (token, allowed) {
            (Some(token), _) => token,
            (None, None) => {
                return Err(ModelError::Sampling("every token is NaN or banned".into()));
            }
            (None, Some(_)) => {
                return Err(ModelError::Constraint(
                    "every token the constraint allows next is banned by the logit bias or NaN"
                        .into(),
                ));
            }
        };
        *self.counts.entry(token).or_default() += 1;
        Ok(token)
    }

    /// `logits` with the bias and the penalties for the tokens picked so far applied: a
    /// banned token's logit is negative infinity.
    pub fn adjusted<'a>(&self, logits: &'a [f32]) -> Cow<'a, [f32]> {
        self.adjusted_within(logits, None)
    }

    /// [`Sampler::adjusted`], with every token `allowed` does not hold banned too.
    fn adjusted_within<'a>(
        &self,
        logits: &'a [f32],
        allowed: Option<&TokenMask>,
    ) -> Cow<'a, [f32]> {
        if !self.config.adjusts_logits() && allowed.is_none() {
            return Cow::Borrowed(logits);
        }
        let mut adjusted = logits.to_vec();
        if let Some(allowed) = allowed {
            for (token, logit) in adjusted.iter_mut().enumerate() {
                if !allowed.allows(token as u32) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        let (presence, frequency) = (self.config.presence_penalty, self.config.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            for (&token, &count) in &self.counts {
                if let Some(logit) = adjusted.get_mut(token as usize) {
                    *logit -= frequency * count as f32 + presence;
                }
            }
        }
        for &(token, bias) in &self.config.logit_bias {
            if let Some(logit) = adjusted.get_mut(token as usize) {
                *logit = if bias <= BAN_BIAS {
                    f32::NEG_INFINITY
                } else {
                    *logit + bias
                };
            }
        }
        Cow::Owned(adjusted)
    }

    /// The candidates top-k, min-p and top-p leave, best first, each with its weight
    /// `exp((logit − best) / temperature)`; `None` when every token is NaN or banned.
    fn weighted_candidates(&self, logits: &[f32]) -> Option<Vec<(u32, f64)>> {
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|&(_, &logit)| !logit.is_nan() && logit != f32::NEG_INFINITY)
            .map(|(index, &logit)| (index as u32, logit))
            .collect();
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = self.config.top_k {
            candidates.truncate(k);
        }
        let max = candidates.first()?.1;
        let temperature = f64::from(self.config.temperature);
        // Relative to the most likely token, whose weight is 1.
        let mut weights: Vec<f64> = candidates
            .iter()
            .map(|&(_, logit)| ((f64::from(logit) - f64::from(max)) / temperature).exp())
            .collect();
        if let Some(min_p) = self.config.min_p {
            let keep = weights
                .iter()
                .position(|&weight| weight < f64::from(min_p))
                .unwrap_or(weights.len());
            weights.truncate(keep.max(1));
        }
        if let Some(p) = self.config.top_p {
            weights.truncate(nucleus_size(&weights, f64::from(p)));
        }
        Some(
            candidates
                .iter()
                .zip(weights)
                .map(|(&(token, _), weight)| (token, weight))
                .collect(),
        )
    }

    /// A random token of `weighted` (not empty) in proportion to the weights, leaving out
    /// `skip`.
    fn pick(&mut self, weighted: &[(u32, f64)], skip: Option<u32>) -> u32 {
        let kept = || weighted.iter().filter(|&&(token, _)| Some(token) != skip);
        let total: f64 = kept().map(|&(_, weight)| weight).sum();
        let mut target = self.random.next_unit() * total;
        let mut last = weighted[0].0;
        for &(token, weight) in kept() {
            if target < weight {
                return token;
            }
            target -= weight;
            last = token;
        }
        last
    }
}

/// How many of the descending `weights` make up the smallest set whose share of their total
/// reaches `p`.
fn nucleus_size(weights: &[f64], p: f64) -> usize {
    let total: f64 = weights.iter().sum();
    let mut cumulative = 0.0;
    for (index, weight) in weights.iter().enumerate() {
        cumulative += weight / total;
        if cumulative >= p {
            return index + 1;
        }
    }
    weights.len()
}

/// The index of the largest logit (the first one on ties), or `None` when every logit is NaN
/// or negative infinity.
fn best_token(logits: &[f32]) -> Option<u32> {
    let best = argmax(logits);
    (logits[best as usize] > f32::NEG_INFINITY).then_some(best)
}

/// A generated token's log-probability and the most likely tokens at its step, from the
/// log-softmax of the raw logits (before bias, penalties, temperature and truncation).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first (ties: lower id
    /// first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `token` under `softmax(logits)` and the `top` most likely tokens;
/// NaN logits count as impossible (negative infinity).
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let clean = |logit: f32| {
        if logit.is_nan() {
            f32::NEG_INFINITY
        } else {
            logit
        }
    };
    let max = logits
        .iter()
        .map(|&logit| clean(logit))
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .map(|&logit| (f64::from(clean(logit)) - f64::from(max)).exp())
        .sum();
    let log_total = f64::from(max) + sum.ln();
    let logprob = |id: u32| {
        let logit = logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| clean(l));
        (f64::from(logit) - log_total) as f32
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_likelihood = |a: &u32, b: &u32| {
        clean(logits[*b as usize])
            .total_cmp(&clean(logits[*a as usize]))
            .then(a.cmp(b))
    };
    let top = top.min(ids.len());
    if top > 0 && top < ids.len() {
        ids.select_nth_unstable_by(top - 1, by_likelihood);
    }
    ids.truncate(top);
    ids.sort_by(by_likelihood);
    TokenLogprobs {
        token,
        logprob: logprob(token),
        top: ids.into_iter().map(|id| (id, logprob(id))).collect(),
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
    use proptest::prelude::*;

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
            ..SamplingConfig::greedy()
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
            ..SamplingConfig::greedy()
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
            ..SamplingConfig::greedy()
        }
    }

    /// Counts of tokens drawn against `draft` (one draw per seed `0..DRAWS`), and how often the
    /// draft was the result.
    fn counts_against_draft(config: &SamplingConfig, logits: &[f32], draft: u32) -> Vec<u64> {
        let mut counts = vec![0u64; logits.len()];
        for seed in 0..DRAWS {
            let mut sampler = Sampler::new(SamplingConfig {
                seed,
                ..config.clone()
            })
            .unwrap();
            let token = sampler.sample_against_draft(logits, None, draft).unwrap();
            counts[token as usize] += 1;
        }
        counts
    }

    #[test]
    fn verifying_any_draft_keeps_the_tempered_softmax_and_top_k() {
        let degrees = LOGITS.len() - 1;
        let critical = CHI_SQUARE_CRITICAL_P001[degrees];
        // The most likely token, a middling one and the least likely one as drafts.
        for draft in [1u32, 3, 5] {
            let config = sampling(1.0, None, None);
            let counts = counts_against_draft(&config, &LOGITS, draft);
            let expected = softmax(&LOGITS, 1.0);
            let statistic = chi_square(&counts, &expected);
            println!("draft {draft}: counts {counts:?}, chi-square {statistic:.2}");
            assert!(
                statistic < critical,
                "draft {draft}: chi-square {statistic:.2} >= {critical} (counts {counts:?})"
            );
        }
        // Top-k 3 keeps tokens 1, 4, 0: a draft outside them is never the answer.
        let counts = counts_against_draft(&sampling(1.0, Some(3), None), &LOGITS, 2);
        assert_eq!(counts[2], 0, "{counts:?}");
        let kept = [LOGITS[0], LOGITS[1], LOGITS[4]];
        let shares = softmax(&kept, 1.0);
        let mut expected = vec![0.0; LOGITS.len()];
        (expected[0], expected[1], expected[4]) = (shares[0], shares[1], shares[2]);
        let statistic = chi_square(&counts, &expected);
        assert!(
            statistic < CHI_SQUARE_CRITICAL_P001[2],
            "top-k with a draft outside it: chi-square {statistic:.2} (counts {counts:?})"
        );
    }

    #[test]
    fn greedy_ignores_the_draft() {
        let mut sampler = Sampler::new(SamplingConfig::greedy()).unwrap();
        for draft in 0..LOGITS.len() as u32 {
            assert_eq!(
                sampler.sample_against_draft(&LOGITS, None, draft).unwrap(),
                1
            );
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
        for min_p in [-0.1, 1.5, f32::NAN] {
            assert!(bad(SamplingConfig {
                min_p: Some(min_p),
                ..SamplingConfig::greedy()
            }));
        }
        assert!(bad(SamplingConfig {
            presence_penalty: f32::NAN,
            ..SamplingConfig::greedy()
        }));
        assert!(bad(SamplingConfig {
            frequency_penalty: f32::INFINITY,
            ..SamplingConfig::greedy()
        }));
        assert!(bad(SamplingConfig {
            logit_bias: vec![(1, f32::NEG_INFINITY)],
            ..SamplingConfig::greedy()
        }));
        assert!(!bad(SamplingConfig {
            min_p: Some(1.0),
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            logit_bias: vec![(1, -100.0), (2, 100.0)],
            ..SamplingConfig::greedy()
        }));
    }

    fn biased(config: SamplingConfig, logit_bias: &[(u32, f32)]) -> SamplingConfig {
        SamplingConfig {
            logit_bias: logit_bias.to_vec(),
            ..config
        }
    }

    #[test]
    fn greedy_follows_the_bias_and_never_takes_a_banned_token() {
        let greedy = |bias: &[(u32, f32)]| {
            Sampler::new(biased(SamplingConfig::greedy(), bias))
                .unwrap()
                .sample(&LOGITS)
                .unwrap()
        };
        // LOGITS ranks 1 (2.5), 4 (1.8), 0 (1.0), ...
        assert_eq!(greedy(&[]), 1);
        assert_eq!(greedy(&[(1, -100.0)]), 4);
        assert_eq!(greedy(&[(1, -100.0), (4, -100.0)]), 0);
        // A bias short of a ban only moves the logit.
        assert_eq!(greedy(&[(1, -0.5)]), 1);
        assert_eq!(greedy(&[(1, -0.8)]), 4);
        assert_eq!(greedy(&[(5, 3.8)]), 5);
        // Ids past the vocabulary are ignored.
        assert_eq!(greedy(&[(99, 100.0)]), 1);
        // A ban beats any logit, however large.
        let mut sampler = Sampler::new(biased(SamplingConfig::greedy(), &[(0, -100.0)])).unwrap();
        assert_eq!(sampler.sample(&[1e30, -1e30]).unwrap(), 1);
    }

    #[test]
    fn a_banned_token_is_never_drawn_and_the_rest_keep_their_proportions() {
        let banned = 1;
        let config = biased(sampling(1.0, None, None), &[(banned, -100.0)]);
        let counts = counts(&config, &LOGITS);
        assert_eq!(counts[banned as usize], 0, "{counts:?}");
        let full = softmax(&LOGITS, 1.0);
        let rest = 1.0 - full[banned as usize];
        let expected: Vec<f64> = (0..LOGITS.len())
            .map(|token| {
                if token == banned as usize {
                    0.0
                } else {
                    full[token] / rest
                }
            })
            .collect();
        let statistic = chi_square(&counts, &expected);
        assert!(
            statistic < CHI_SQUARE_CRITICAL_P001[LOGITS.len() - 2],
            "chi-square {statistic:.2} (counts {counts:?}, expected {expected:?})"
        );
    }

    #[test]
    fn a_positive_bias_of_100_makes_its_token_the_only_one_drawn() {
        let config = biased(sampling(2.0, None, None), &[(5, 100.0)]);
        assert_eq!(counts(&config, &LOGITS)[5], DRAWS);
    }

    #[test]
    fn banning_every_token_is_an_error_not_a_choice() {
        let all: Vec<(u32, f32)> = (0..LOGITS.len() as u32).map(|id| (id, -100.0)).collect();
        for config in [SamplingConfig::greedy(), sampling(1.0, Some(3), Some(0.9))] {
            let mut sampler = Sampler::new(biased(config, &all)).unwrap();
            assert!(sampler.sample(&LOGITS).is_err());
        }
    }

    #[test]
    fn a_frequency_penalty_grows_with_each_repeat() {
        let mut sampler = Sampler::new(SamplingConfig {
            frequency_penalty: 1.0,
            ..SamplingConfig::greedy()
        })
        .unwrap();
        let logits = [2.0, 1.5, 0.0];
        let picks: Vec<u32> = (0..6).map(|_| sampler.sample(&logits).unwrap()).collect();
        // Adjusted logits before each pick, worked by hand:
        // [2, 1.5, 0] [1, 1.5, 0] [1, .5, 0] [0, .5, 0] [0, -.5, 0] (tie: first) [-1, -.5, 0]
        assert_eq!(picks, [0, 1, 0, 1, 0, 2]);
        assert_eq!(sampler.adjusted(&logits).as_ref(), [-1.0, -0.5, -1.0]);
    }

    #[test]
    fn a_presence_penalty_counts_a_token_once() {
        let mut sampler = Sampler::new(SamplingConfig {
            presence_penalty: 1.0,
            ..SamplingConfig::greedy()
        })
        .unwrap();
        let logits = [2.0, 1.5, 0.0];
        let picks: Vec<u32> = (0..5).map(|_| sampler.sample(&logits).unwrap()).collect();
        // [2, 1.5, 0] then [1, 1.5, 0] then [1, .5, 0] from then on.
        assert_eq!(picks, [0, 1, 0, 0, 0]);
        // A negative penalty favours what was said: token 1, once said, is worth 2 more.
        let mut sampler = Sampler::new(SamplingConfig {
            presence_penalty: -2.0,
            ..SamplingConfig::greedy()
        })
        .unwrap();
        let steps = [[0.0, 1.0], [1.5, 0.0], [2.5, 0.0]];
        let picks: Vec<u32> = steps
            .iter()
            .map(|logits| sampler.sample(logits).unwrap())
            .collect();
        assert_eq!(picks, [1, 1, 0]);
    }

    #[test]
    fn min_p_keeps_the_tokens_near_the_best_in_proportion() {
        let min_p = 0.2;
        let full = softmax(&LOGITS, 1.0);
        let best = full.iter().copied().fold(0.0, f64::max);
        let kept: Vec<usize> = (0..LOGITS.len())
            .filter(|&token| full[token] >= f64::from(min_p) * best)
            .collect();
        assert_eq!(kept, [0, 1, 4]);
        let config = SamplingConfig {
            min_p: Some(min_p),
            ..sampling(1.0, None, None)
        };
        let counts = counts(&config, &LOGITS);
        let mass: f64 = kept.iter().map(|&token| full[token]).sum();
        let expected: Vec<f64> = (0..LOGITS.len())
            .map(|token| {
                if kept.contains(&token) {
                    full[token] / mass
                } else {
                    0.0
                }
            })
            .collect();
        let statistic = chi_square(&counts, &expected);
        println!("min-p {min_p}: counts {counts:?}, chi-square {statistic:.2}");
        assert!(
            statistic < CHI_SQUARE_CRITICAL_P001[kept.len() - 1],
            "min-p {min_p}: chi-square {statistic:.2} (counts {counts:?}, expected {expected:?})"
        );
        // min-p 1 keeps only the best.
        let only_best = SamplingConfig {
            min_p: Some(1.0),
            ..sampling(1.0, None, None)
        };
        assert_eq!(super::tests::counts(&only_best, &LOGITS)[1], DRAWS);
    }

    /// Any sampling settings, greedy ones included.
    fn any_config() -> impl Strategy<Value = SamplingConfig> {
        (
            prop_oneof![Just(0.0f32), 0.05f32..2.0],
            proptest::option::of(1usize..8),
            proptest::option::of(0.05f32..=1.0),
            proptest::option::of(0.0f32..=1.0),
            -2.0f32..=2.0,
            -2.0f32..=2.0,
            any::<u64>(),
        )
            .prop_map(
                |(temperature, top_k, top_p, min_p, presence, frequency, seed)| SamplingConfig {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    presence_penalty: presence,
                    frequency_penalty: frequency,
                    logit_bias: Vec::new(),
                    seed,
                },
            )
    }

    proptest! {
        #[test]
        fn a_banned_token_is_never_chosen(
            config in any_config(),
            logits in proptest::collection::vec(-1e4f32..1e4, 2..40),
            banned_at in any::<prop::sample::Index>(),
        ) {
            let banned = banned_at.index(logits.len()) as u32;
            let mut sampler = Sampler::new(biased(config, &[(banned, -100.0)])).unwrap();
            for _ in 0..20 {
                prop_assert_ne!(sampler.sample(&logits).unwrap(), banned);
            }
        }

        #[test]
        fn a_token_outside_the_mask_is_never_chosen_whatever_its_bias(
            config in any_config(),
            logits in proptest::collection::vec(-1e4f32..1e4, 2..70),
            allowed_bits in proptest::collection::vec(any::<bool>(), 70),
            favoured_at in any::<prop::sample::Index>(),
        ) {
            let ids: Vec<u32> = (0..logits.len() as u32)
                .filter(|&id| allowed_bits[id as usize])
                .collect();
            prop_assume!(!ids.is_empty());
            let mask = TokenMask::of(&ids);
            // The largest bias on some token, most often one the mask leaves out.
            let favoured = favoured_at.index(logits.len()) as u32;
            let mut sampler = Sampler::new(biased(config, &[(favoured, 100.0)])).unwrap();
            for _ in 0..20 {
                let token = sampler.sample_within(&logits, Some(&mask)).unwrap();
                prop_assert!(mask.allows(token), "token {} is outside {:?}", token, ids);
            }
        }

        #[test]
        fn penalties_change_exactly_the_counted_tokens_logits(
            config in any_config(),
            logits in proptest::collection::vec(-10f32..10.0, 2..12),
            steps in 0usize..30,
        ) {
            let mut sampler = Sampler::new(config.clone()).unwrap();
            let mut counts = vec![0u32; logits.len()];
            for _ in 0..steps {
                counts[sampler.sample(&logits).unwrap() as usize] += 1;
            }
            let adjusted = sampler.adjusted(&logits);
            for (token, (&raw, &now)) in logits.iter().zip(adjusted.iter()).enumerate() {
                let count = counts[token];
                let penalty = if count == 0 {
                    0.0
                } else {
                    config.frequency_penalty * count as f32 + config.presence_penalty
                };
                prop_assert!(
                    (raw - penalty - now).abs() <= 1e-4,
                    "token {token}: raw {raw}, count {count}, adjusted {now}"
                );
            }
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_of_the_raw_logits() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        // softmax over e^1, e^3, 0, e^3, e^-2, worked out in f64.
        let total = 1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp();
        let expected = |logit: f64| (logit - total.ln()) as f32;
        let result = token_logprobs(&logits, 0, 3);
        assert_eq!(result.token, 0);
        assert!((result.logprob - expected(1.0)).abs() < 1e-6, "{result:?}");
        let ids: Vec<u32> = result.top.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, [1, 3, 0], "ties keep the lower id first");
        for &(id, logprob) in &result.top {
            let logit = f64::from(logits[id as usize]);
            assert!((logprob - expected(logit)).abs() < 1e-6, "{result:?}");
        }
        assert_eq!(token_logprobs(&logits, 2, 0).logprob, f32::NEG_INFINITY);
        assert!(token_logprobs(&logits, 2, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 4, 9).top.len(), logits.len());
        // The probabilities add up to one.
        let all = token_logprobs(&LOGITS, 0, LOGITS.len());
        let mass: f64 = all.top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-5, "{mass}");
    }

    #[test]
    fn a_mask_is_a_set_of_ids() {
        let mask = TokenMask::of(&[0, 31, 32, 100]);
        let members: Vec<u32> = (0..200).filter(|&id| mask.allows(id)).collect();
        assert_eq!(members, [0, 31, 32, 100]);
        assert_eq!(mask.count(), 4);
        assert_eq!(
            TokenMask::from_words(vec![0b101, 1]),
            TokenMask::of(&[0, 2, 32])
        );
        let mut reused = TokenMask::of(&[500]);
        reused.set_words(&[0b10]);
        assert_eq!(reused, TokenMask::of(&[1]));
        assert!(!TokenMask::default().allows(0));
    }

    #[test]
    fn a_mask_keeps_top_k_and_top_p_to_the_allowed_tokens_in_proportion() {
        // LOGITS ranks 1, 4, 0, 3, 2, 5: without 1 and 4, top-k 2 keeps 0 and 3.
        let mask = TokenMask::of(&[0, 2, 3, 5]);
        let config = sampling(1.0, Some(2), None);
        let mut counts = [0u64; 6];
        for seed in 0..DRAWS {
            let mut sampler = Sampler::new(SamplingConfig {
                seed,
                ..config.clone()
            })
            .unwrap();
            counts[sampler.sample_within(&LOGITS, Some(&mask)).unwrap() as usize] += 1;
        }
        let full = softmax(&LOGITS, 1.0);
        let kept = full[0] + full[3];
        let expected: Vec<f64> = (0..LOGITS.len())
            .map(|token| match token {
                0 | 3 => full[token] / kept,
                _ => 0.0,
            })
            .collect();
        let statistic = chi_square(&counts, &expected);
        assert!(
            statistic < CHI_SQUARE_CRITICAL_P001[1],
            "chi-square {statistic:.2} (counts {counts:?}, expected {expected:?})"
        );
        // Greedy takes the best allowed token.
        let mut greedy = Sampler::new(SamplingConfig::greedy()).unwrap();
        assert_eq!(greedy.sample_within(&LOGITS, Some(&mask)).unwrap(), 0);
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
