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

/// How much of an observation of the draft gate survives each decode step: old evidence fades
/// so that a generation whose text turns repetitive later gets to draft again.
const EVIDENCE_KEPT_PER_STEP: f64 = 0.97;

/// The most checks of drafted tokens that a generation's acceptance counts as when the next
/// generation over the route starts from it ([`DraftGate::for_next_generation`]).
pub const CARRIED_CHECKS: f64 = 4.0;

/// Decode steps after which the time a drafted row adds is measured again: a gate that has
/// closed sends no drafted pass that could correct an estimate taken at a bad moment, and the
/// route may have changed since.
pub const ROW_TIMING_LIFETIME: u32 = 64;

/// Passes with up to this many drafts have the cost of their rows timed apart (a product of
/// two rows costs more per row than one of five); a pass with more counts as one with this many.
pub const TIMED_DRAFT_COUNTS: usize = 8;

/// The most drafts a pass sends to time what drafted rows cost, when no timing is known.
pub const LEARNING_DRAFTS: usize = 4;

/// How much of the previous pass-time estimate survives a new measurement.
const TIME_KEPT_PER_PASS: f64 = 0.8;

/// Whether drafts pay for themselves on this route (ADR-0035, ADR-0036): each drafted row
/// makes the verifying pass dearer, and pays back a pass only if it is accepted.
///
/// It learns, as a generation goes on, what a pass of one row costs, what each drafted row adds
/// to it (apart for each number of drafts: rows are cheaper by the batch), what turning an accepted draft's row into logits costs and what a rewind costs (from
/// the wall time of each), and how often a drafted token is accepted (from the checks, with
/// one accepted and one rejected token as the prior; a step that sends no draft still checks
/// the first token the lookup found, at no cost). The timings belong to the route, and a
/// generation may start from an earlier one's ([`DraftGate::for_next_generation`]).
///
/// The `j`-th drafted token is accepted only when the `j - 1` before it were, with probability
/// about `p^j`, and then saves a pass less its logits; some draft of `k` is rejected with
/// probability `1 - p^k`, and that costs a rewind. The gate sends the `k` drafts that give the
/// most of `(pass − logits) × (p + … + p^k) − k × row cost(k) − (1 − p^k) × rewind`, or none
/// when no `k` gives more than nothing. Over a slow link a pass
/// costs the round trip and a row adds almost nothing, so the gate stays open; on a fast
/// route, where a drafted row costs about as much as the pass it may save, it closes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftGate {
    /// Seconds a one-row pass takes, once measured.
    single_row: Option<f64>,
    /// Seconds each drafted row adds to a pass of `k` drafts (at `k - 1`), once measured.
    row_costs: [Option<f64>; TIMED_DRAFT_COUNTS],
    /// Decode steps since a drafted pass was last timed.
    row_age: u32,
    /// Seconds the logits of an accepted draft's row take, once measured.
    head: Option<f64>,
    /// Seconds a rewind after a rejected draft takes, once measured.
    rewind: Option<f64>,
    /// Drafted tokens accepted, fading by [`EVIDENCE_KEPT_PER_STEP`].
    accepted: f64,
    /// Drafted tokens checked (accepted, or the one rejected), fading alike.
    checked: f64,
}

impl DraftGate {
    /// A gate that knows nothing yet and lets every draft through.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a pass that sent one token and `drafts` drafted ones and took `seconds`.
    pub fn record_pass(&mut self, drafts: usize, seconds: f64) {
        if !is_duration(seconds) {
            return;
        }
        if drafts == 0 {
            self.single_row = Some(blend(self.single_row, seconds));
            return;
        }
        if let Some(single) = self.single_row {
            // Timings that have aged out are replaced, not blended.
            if self.row_age >= ROW_TIMING_LIFETIME {
                self.row_costs = Default::default();
            }
            let added = ((seconds - single) / drafts as f64).max(0.0);
            let slot = &mut self.row_costs[drafts.min(TIMED_DRAFT_COUNTS) - 1];
            *slot = Some(blend(*slot, added));
            self.row_age = 0;
        }
    }

    /// Records the `seconds` that the logits of an accepted draft's row took.
    pub fn record_head(&mut self, seconds: f64) {
        if is_duration(seconds) {
            self.head = Some(blend(self.head, seconds));
        }
    }

    /// Records a pass that sent one token and `drafts` drafted ones right after a rewind that
    /// took `rewind_seconds` here: the stages behind a link take the positions back when this
    /// pass reaches them, so what the pass took beyond the estimate of such a pass counts as
    /// part of the rewind, and the pass itself is not used for the estimate.
    pub fn record_rewound_pass(&mut self, drafts: usize, seconds: f64, rewind_seconds: f64) {
        if !is_duration(seconds) || !is_duration(rewind_seconds) {
            return;
        }
        let expected = match (self.single_row, self.row_cost(drafts), drafts) {
            (Some(single), _, 0) => Some(single),
            (Some(single), Some(row_cost), _) => Some(single + drafts as f64 * row_cost),
            _ => None,
        };
        let beyond = expected.map_or(0.0, |expected| (seconds - expected).max(0.0));
        self.rewind = Some(blend(self.rewind, rewind_seconds + beyond));
    }

    /// Records a verified step: `accepted` of `drafted` tokens were taken.
    pub fn record_checks(&mut self, drafted: usize, accepted: usize) {
        let rejected = usize::from(accepted < drafted);
        self.accepted += accepted as f64;
        self.checked += (accepted + rejected) as f64;
    }

    /// The gate a later generation over the same route starts from: the same timings (its
    /// passes cost the same), and the acceptance seen so far weighed as at most
    /// [`CARRIED_CHECKS`] checks, a prior that the new text's own checks soon outweigh.
    pub fn for_next_generation(&self) -> DraftGate {
        let scale = if self.checked > CARRIED_CHECKS {
            CARRIED_CHECKS / self.checked
        } else {
            1.0
        };
        DraftGate {
            accepted: self.accepted * scale,
            checked: self.checked * scale,
            ..self.clone()
        }
    }

    /// Counts a decode step: the evidence about acceptance fades a little, and the time a
    /// drafted row adds ages.
    pub fn fade(&mut self) {
        self.accepted *= EVIDENCE_KEPT_PER_STEP;
        self.checked *= EVIDENCE_KEPT_PER_STEP;
        self.row_age = self.row_age.saturating_add(1);
    }

    /// The estimated chance that a drafted token is accepted when the ones before it were.
    pub fn acceptance(&self) -> f64 {
        (self.accepted + 1.0) / (self.checked + 2.0)
    }

    /// What each drafted row adds to a pass of `drafts` drafts: as timed for that many, else
    /// for the nearest count timed (the smaller one on a tie); `None` before any is timed.
    fn row_cost(&self, drafts: usize) -> Option<f64> {
        let at = drafts.clamp(1, TIMED_DRAFT_COUNTS) - 1;
        (0..TIMED_DRAFT_COUNTS).find_map(|distance| {
            let below = at.checked_sub(distance).and_then(|i| self.row_costs[i]);
            below.or_else(|| self.row_costs.get(at + distance).copied().flatten())
        })
    }

    /// How many of `wanted` drafted tokens are worth sending: once a one-row pass and a
    /// drafted one are timed, the number with the most expected gain (none when none gains).
    /// Before a one-row pass is timed, all of them, except that a step after a rejected draft
    /// sends none (text that drafts at every step would otherwise never show what a pass costs
    /// without drafts); after it, up to [`LEARNING_DRAFTS`], until a drafted pass is timed
    /// too, and again once [`ROW_TIMING_LIFETIME`] steps have passed since the last one was.
    pub fn allowed(&self, wanted: usize) -> usize {
        let Some(single) = self.single_row else {
            let rejected = self.checked > self.accepted;
            return if rejected { 0 } else { wanted };
        };
        if self.row_age >= ROW_TIMING_LIFETIME || self.row_cost(1).is_none() {
            return wanted.min(LEARNING_DRAFTS);
        }
        let saving = single - self.head.unwrap_or(0.0);
        let mut best = (0, 0.0);
        for drafts in 1..=wanted {
            let gain = self.expected_gain(drafts, saving);
            if gain > best.1 {
                best = (drafts, gain);
            }
        }
        best.0
    }

    /// The seconds `drafts` drafted tokens are expected to save, each accepted one a pass less
    /// its logits (`saving`), less what their rows add and the rewind when one is rejected.
    fn expected_gain(&self, drafts: usize, saving: f64) -> f64 {
        let acceptance = self.acceptance();
        let rewind = self.rewind.unwrap_or(0.0);
        let row_cost = self.row_cost(drafts).unwrap_or(0.0);
        // p + p^2 + ... + p^k, and p^k: every draft accepted.
        let (accepted, all) = (0..drafts).fold((0.0, 1.0), |(sum, power), _| {
            (sum + power * acceptance, power * acceptance)
        });
        saving * accepted - drafts as f64 * row_cost - (1.0 - all) * rewind
    }
}

impl std::fmt::Display for DraftGate {
    /// The estimates in milliseconds (`-` where not measured yet; rows by number of drafts)
    /// and the acceptance, as in `pass 10.2 rows 1:6.0 4:4.1 head 1.9 rewind 0.8 ms,
    /// acceptance 0.31`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |seconds: Option<f64>| match seconds {
            Some(seconds) => format!("{:.1}", seconds * 1e3),
            None => "-".to_owned(),
        };
        let rows: Vec<String> = (1..=TIMED_DRAFT_COUNTS)
            .filter_map(|k| Some(format!("{k}:{}", ms(Some(self.row_costs[k - 1]?)))))
            .collect();
        let rows = if rows.is_empty() {
            "-".to_owned()
        } else {
            rows.join(" ")
        };
        write!(
            f,
            "pass {} rows {rows} head {} rewind {} ms, acceptance {:.2}",
            ms(self.single_row),
            ms(self.head),
            ms(self.rewind),
            self.acceptance()
        )
    }
}

/// Whether `seconds` can be a measured duration.
fn is_duration(seconds: f64) -> bool {
    seconds.is_finite() && seconds >= 0.0
}

/// `sample` folded into the running estimate `previous`.
fn blend(previous: Option<f64>, sample: f64) -> f64 {
    match previous {
        Some(previous) => TIME_KEPT_PER_PASS * previous + (1.0 - TIME_KEPT_PER_PASS) * sample,
        None => sample,
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

    /// A gate that has timed a one-row pass at `single` seconds and drafted rows at
    /// `per_draft` seconds each.
    fn timed_gate(single: f64, per_draft: f64) -> DraftGate {
        let mut gate = DraftGate::new();
        gate.record_pass(0, single);
        gate.record_pass(4, single + 4.0 * per_draft);
        gate
    }

    #[test]
    fn until_both_costs_are_measured_the_gate_sends_drafts_that_time_them() {
        let mut gate = DraftGate::new();
        gate.record_checks(4, 4);
        assert_eq!(gate.allowed(6), 6, "nothing timed");
        gate.record_pass(3, 0.030);
        assert_eq!(
            gate.allowed(6),
            6,
            "a drafted pass alone says nothing of its cost"
        );
        for _ in 0..20 {
            gate.record_checks(4, 0);
        }
        assert_eq!(
            gate.allowed(6),
            0,
            "after a rejection, a one-row pass is timed first"
        );
        gate.record_pass(0, 0.010);
        assert_eq!(
            gate.allowed(6),
            LEARNING_DRAFTS,
            "no drafted pass after the one-row one yet: a few rows time their cost"
        );
        gate.record_pass(2, 0.014);
        assert_eq!(gate.allowed(6), 0);
    }

    #[test]
    fn a_draft_is_sent_while_its_chance_times_a_pass_beats_its_cost() {
        // A row adds 0.275 of a pass: with the prior (p = 1/2) one draft is worth it
        // (1/2 > 0.275) and two are not (1/4 < 0.275).
        let gate = timed_gate(0.012, 0.0033);
        assert_eq!(gate.acceptance(), 0.5);
        assert_eq!(gate.allowed(8), 1);
        // Three accepted of three checked: p = 4/5, and 0.8^5 = 0.328 > 0.275 > 0.8^6 = 0.262.
        let mut accepting = gate.clone();
        accepting.record_checks(3, 3);
        assert_eq!(accepting.acceptance(), 0.8);
        assert_eq!(accepting.allowed(8), 5);
        assert_eq!(accepting.allowed(2), 2, "never more than wanted");
        // Two outright rejections: p = 1/4, below the cost.
        let mut rejecting = gate.clone();
        rejecting.record_checks(4, 0);
        rejecting.record_checks(2, 0);
        assert_eq!(rejecting.acceptance(), 0.25);
        assert_eq!(rejecting.allowed(8), 0);
    }

    #[test]
    fn an_accepted_draft_saves_a_pass_less_its_logits() {
        // One draft is worth 1/2 × 12 ms = 6 ms against 3.3 ms of cost (see above).
        let mut gate = timed_gate(0.012, 0.0033);
        assert_eq!(gate.allowed(8), 1);
        // With 9 ms of logits a saved pass is worth 3 ms, less than a row costs: no draft,
        // however often drafts are accepted.
        gate.record_head(0.009);
        assert_eq!(gate.allowed(8), 0);
        for _ in 0..50 {
            gate.record_checks(8, 8);
        }
        assert!(gate.acceptance() > 0.99, "{}", gate.acceptance());
        assert_eq!(gate.allowed(8), 0);
    }

    #[test]
    fn a_batch_of_drafts_can_pay_where_one_does_not() {
        // One drafted row adds 8 ms to a 10 ms pass; in a pass of four, each adds 2 ms.
        let mut gate = DraftGate::new();
        gate.record_pass(0, 0.010);
        gate.record_pass(1, 0.018);
        gate.record_pass(4, 0.018);
        for _ in 0..3 {
            gate.record_checks(4, 4);
        }
        // p = 13/14: one draft gains 9.3 ms for 8; four gain 33 ms for 8.
        assert_eq!(gate.allowed(4), 4);
        // The counts not timed take the nearest timed one's cost: two and three rows cost
        // 8 ms each (as one), five to eight 2 ms each (as four).
        let close = |cost: Option<f64>, expected: f64| (cost.unwrap() - expected).abs() < 1e-12;
        assert!(close(gate.row_cost(2), 0.008));
        assert!(close(gate.row_cost(3), 0.002));
        assert!(close(gate.row_cost(12), 0.002));
        assert_eq!(gate.allowed(8), 8);
        // At p = 1/2 one draft alone would lose (5 ms for 8); three (priced as four, 2 ms a
        // row) gain 10 × (1/2 + 1/4 + 1/8) = 8.75 ms for 6, more than four's 9.4 for 8.
        let mut doubtful = gate.clone();
        doubtful.accepted = 0.0;
        doubtful.checked = 0.0;
        assert_eq!(doubtful.allowed(1), 0);
        assert_eq!(doubtful.allowed(4), 3);
    }

    #[test]
    fn a_rejected_draft_costs_its_rewind() {
        // p = 1/2: the first draft gains 6 ms and costs 3.3 ms plus half a rewind.
        let mut slow = timed_gate(0.012, 0.0033);
        slow.record_rewound_pass(2, 0.012 + 2.0 * 0.0033, 0.006);
        assert_eq!(slow.allowed(8), 0, "3.3 + 3 ms > 6 ms");
        let mut quick = timed_gate(0.012, 0.0033);
        quick.record_rewound_pass(0, 0.012, 0.005);
        assert_eq!(quick.allowed(8), 1, "3.3 + 2.5 ms < 6 ms");
        // The pass after a rewind takes 1 ms longer than a one-row pass: that counts as part
        // of the rewind (3.3 + 3 ms > 6 ms), and the one-row estimate stays where it was.
        let mut late = timed_gate(0.012, 0.0033);
        late.record_rewound_pass(0, 0.013, 0.005);
        assert_eq!(late.allowed(8), 0);
        assert_eq!(late.single_row, Some(0.012));
    }

    #[test]
    fn over_a_slow_link_rejected_drafts_still_go_through() {
        // 300 ms a pass, 1 ms a row: even at p = 1/12 one draft beats its cost.
        let mut gate = timed_gate(0.300, 0.001);
        for _ in 0..5 {
            gate.record_checks(2, 0);
        }
        assert_eq!(gate.acceptance(), 1.0 / 7.0);
        assert_eq!(gate.allowed(8), 2, "(1/7)^2 = 0.020 > 1/300 > (1/7)^3");
    }

    #[test]
    fn old_rejections_fade_so_that_drafting_is_tried_again() {
        let mut gate = timed_gate(0.012, 0.004);
        gate.record_checks(4, 0);
        gate.record_checks(4, 0);
        assert_eq!(gate.allowed(4), 0);
        let steps = (1..200).find(|_| {
            gate.fade();
            gate.allowed(4) > 0
        });
        // p = 1 / (2 + 2 × 0.97^n) rises above 1/3 once 0.97^n < 1/2: at n = 23.
        assert_eq!(steps, Some(23));
    }

    #[test]
    fn the_next_generation_keeps_the_timings_and_a_weak_prior_of_the_acceptance() {
        let mut gate = timed_gate(0.012, 0.004);
        gate.record_head(0.002);
        gate.record_rewound_pass(0, 0.012, 0.001);
        gate.record_checks(3, 1);
        // Two checks (1 accepted, 1 rejected): fewer than CARRIED_CHECKS, carried whole.
        assert_eq!(gate.for_next_generation(), gate);
        for _ in 0..9 {
            gate.record_checks(4, 0);
        }
        // 1 accepted of 11 checked, weighed as 4 checks: 4/11 accepted.
        let next = gate.for_next_generation();
        assert_eq!(
            (next.single_row, next.row_costs, next.head, next.rewind),
            (gate.single_row, gate.row_costs, gate.head, gate.rewind)
        );
        assert_eq!(next.checked, CARRIED_CHECKS);
        assert!(
            (next.accepted - 4.0 / 11.0).abs() < 1e-12,
            "{}",
            next.accepted
        );
        assert!((gate.acceptance() - 2.0 / 13.0).abs() < 1e-12);
        assert!((next.acceptance() - (4.0 / 11.0 + 1.0) / 6.0).abs() < 1e-12);
    }

    #[test]
    fn a_closed_gate_times_a_drafted_row_again_when_its_timing_is_old() {
        // A row timed at 20 ms (say, at a bad moment) against a 10 ms pass: no draft pays.
        let mut gate = timed_gate(0.010, 0.020);
        gate.record_checks(8, 8);
        let closed = (0..ROW_TIMING_LIFETIME - 1).all(|_| {
            gate.fade();
            gate.allowed(4) == 0
        });
        assert!(closed);
        gate.fade();
        assert_eq!(
            gate.allowed(8),
            LEARNING_DRAFTS,
            "drafts to time a row again"
        );
        // Timed again at 2 ms a row: the new timing replaces the old one, and drafts pay.
        gate.record_pass(4, 0.010 + 4.0 * 0.002);
        assert_eq!(
            gate.to_string(),
            "pass 10.0 rows 4:2.0 head - rewind - ms, acceptance 0.68"
        );
        assert_eq!(gate.allowed(4), 4);
    }

    #[test]
    fn the_gate_shows_its_estimates_in_milliseconds() {
        let mut gate = DraftGate::new();
        assert_eq!(
            gate.to_string(),
            "pass - rows - head - rewind - ms, acceptance 0.50"
        );
        gate.record_pass(0, 0.0102);
        gate.record_pass(2, 0.0184);
        gate.record_head(0.0019);
        gate.record_checks(2, 2);
        assert_eq!(
            gate.to_string(),
            "pass 10.2 rows 2:4.1 head 1.9 rewind - ms, acceptance 0.75"
        );
        gate.record_pass(5, 0.0202);
        assert_eq!(
            gate.to_string(),
            "pass 10.2 rows 2:4.1 5:2.0 head 1.9 rewind - ms, acceptance 0.75"
        );
    }

    #[test]
    fn a_pass_time_that_is_not_a_duration_is_ignored() {
        let mut gate = DraftGate::new();
        gate.record_pass(0, f64::NAN);
        gate.record_pass(0, -1.0);
        gate.record_pass(2, f64::INFINITY);
        gate.record_head(f64::NAN);
        gate.record_rewound_pass(0, 0.01, -0.5);
        gate.record_rewound_pass(1, f64::NAN, 0.001);
        assert_eq!(gate, DraftGate::new());
    }
}
