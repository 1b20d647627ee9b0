//! The pure parts of speculative decoding (ADR-0032): drafts looked up in the context, and
//! how many tokens to draft for the next step.
//!
//! A decode step normally sends one token through the whole route. With speculation the
//! entry appends up to k drafted tokens; one pass returns the logits after each, the sampler
//! checks the drafts in order ([`crate::Sampler::sample_against_draft`]), and every stage
//! cuts its KV cache back past the first rejected one. Over a slow network one trip then
//! yields up to k + 1 tokens.

/// The longest n-gram of the context's end that [`prompt_lookup`] looks for.
pub const MAX_NGRAM: usize = 4;

/// The shortest n-gram of the context's end that [`prompt_lookup`] looks for: a single
/// token matches too often to predict much.
pub const MIN_NGRAM: usize = 2;

/// The most tokens drafted for one step unless configured otherwise.
pub const DEFAULT_MAX_DRAFT: usize = 8;

/// Steps in a row whose drafts were all rejected before drafting pauses.
const MISSES_BEFORE_PAUSE: u32 = 3;

/// Steps without drafts after the first pause; each further pause doubles it, up to
/// [`LONGEST_PAUSE`].
const FIRST_PAUSE: u32 = 8;

/// The longest pause, in steps.
const LONGEST_PAUSE: u32 = 128;

/// Up to `count` tokens that followed the latest earlier occurrence of the context's last
/// n tokens, trying n from [`MAX_NGRAM`] down to [`MIN_NGRAM`] (prompt lookup decoding); empty
/// when no such n-gram occurred before.
pub fn prompt_lookup(context: &[u32], count: usize) -> Vec<u32> {
    if count == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if context.len() <= n {
            continue;
        }
        let tail = &context[context.len() - n..];
        // The latest start before the tail's own that repeats it and has a token after it.
        let found = (0..context.len() - n)
            .rev()
            .find(|&start| &context[start..start + n] == tail);
        if let Some(start) = found {
            let from = start + n;
            let to = (from + count).min(context.len());
            return context[from..to].to_vec();
        }
    }
    Vec::new()
}

/// How many tokens to draft next (k), adapted to how many were accepted: it grows while
/// drafts are accepted whole, shrinks to just past what was accepted when a draft is cut,
/// and falls to 0 for a while (longer each time) when drafts keep failing outright.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftLength {
    max: usize,
    current: usize,
    /// Verified steps in a row whose drafts were all rejected.
    misses: u32,
    /// Steps left without drafting.
    paused: u32,
    /// How long the next pause lasts.
    next_pause: u32,
}

impl DraftLength {
    /// Drafts of up to `max` tokens, starting at half of that (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            max,
            current: max.div_ceil(2),
            misses: 0,
            paused: 0,
            next_pause: FIRST_PAUSE,
        }
    }

    /// The number of tokens to draft for this step; a paused drafter counts the step off.
    pub fn take_step(&mut self) -> usize {
        if self.paused > 0 {
            self.paused -= 1;
            return 0;
        }
        self.current
    }

    /// The length the next step drafts, without counting a step.
    pub fn current(&self) -> usize {
        if self.paused > 0 { 0 } else { self.current }
    }

    /// Records a verified step: `accepted` of `drafted` (at least one) tokens were taken.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            self.misses += 1;
            self.current = (self.current / 2).max(1);
            if self.misses >= MISSES_BEFORE_PAUSE {
                self.misses = 0;
                self.paused = self.next_pause;
                self.next_pause = (self.next_pause * 2).min(LONGEST_PAUSE);
            }
            return;
        }
        self.misses = 0;
        self.next_pause = FIRST_PAUSE;
        self.current = if accepted == drafted {
            (self.current + 2).min(self.max)
        } else {
            (accepted + 1).min(self.max)
        };
    }
}

/// What speculation did over one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Tokens drafted and sent for verification.
    pub drafted: usize,
    /// Drafted tokens the sampler accepted.
    pub accepted: usize,
    /// Passes through the route that verified drafts.
    pub verify_steps: usize,
    /// The draft length the generation would have used next.
    pub draft_length: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_longest_repeated_tail_predicts_what_followed_it_last_time() {
        // "1 2 3 4 | 9 9 | 1 2 3 4 | 7 8 | 1 2 3" : the 3-gram 1 2 3 was last followed by 4 7 8.
        let context = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 1, 2, 3];
        assert_eq!(prompt_lookup(&context, 3), vec![4, 7, 8]);
        assert_eq!(prompt_lookup(&context, 10), vec![4, 7, 8, 1, 2, 3]);
        assert_eq!(prompt_lookup(&context, 0), Vec::<u32>::new());
        // Only a 2-gram repeats.
        assert_eq!(prompt_lookup(&[5, 6, 1, 5, 6], 2), vec![1, 5]);
        // A single repeated token is not enough.
        assert_eq!(prompt_lookup(&[5, 6, 1, 6], 2), Vec::<u32>::new());
        assert_eq!(prompt_lookup(&[], 4), Vec::<u32>::new());
    }

    proptest! {
        /// A draft is always what followed an earlier copy of the context's last n tokens.
        #[test]
        fn a_draft_continues_an_earlier_copy_of_the_tail(
            context in proptest::collection::vec(0u32..4, 0..60),
            count in 0usize..10,
        ) {
            let draft = prompt_lookup(&context, count);
            prop_assert!(draft.len() <= count);
            if !draft.is_empty() {
                let matched = (MIN_NGRAM..=MAX_NGRAM).rev().find(|&n| {
                    context.len() > n && (0..context.len() - n).any(|start| {
                        context[start..start + n] == context[context.len() - n..]
                            && context[start + n..].starts_with(&draft)
                    })
                });
                prop_assert!(matched.is_some(), "{context:?} drafted {draft:?}");
            }
        }
    }

    #[test]
    fn whole_acceptance_grows_the_draft_and_a_cut_shrinks_it_to_what_was_accepted() {
        let mut length = DraftLength::new(8);
        assert_eq!(length.take_step(), 4);
        length.record(4, 4);
        assert_eq!(length.take_step(), 6);
        length.record(6, 6);
        length.record(8, 8);
        assert_eq!(length.take_step(), 8, "capped at the maximum");
        length.record(8, 2);
        assert_eq!(length.take_step(), 3);
    }

    #[test]
    fn drafts_that_keep_failing_pause_drafting_longer_each_time() {
        let mut length = DraftLength::new(8);
        for _ in 0..MISSES_BEFORE_PAUSE {
            assert!(length.take_step() > 0);
            length.record(length.current().max(1), 0);
        }
        let paused: Vec<usize> = (0..FIRST_PAUSE).map(|_| length.take_step()).collect();
        assert!(paused.iter().all(|&k| k == 0), "{paused:?}");
        assert_eq!(length.take_step(), 1, "after the pause it tries one token");
        for _ in 0..MISSES_BEFORE_PAUSE {
            length.record(1, 0);
        }
        let second = (0..).take_while(|_| length.take_step() == 0).count();
        assert_eq!(second, 2 * FIRST_PAUSE as usize);
        // An accepted draft ends the streak: the next misses start from the first pause.
        length.record(1, 1);
        for _ in 0..MISSES_BEFORE_PAUSE {
            length.record(1, 0);
        }
        let third = (0..).take_while(|_| length.take_step() == 0).count();
        assert_eq!(third, FIRST_PAUSE as usize);
    }
}
