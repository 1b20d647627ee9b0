//! The one generation loop: chunked prefill, decode, sampling and stopping, over a route of
//! stages that may run in this process or on other peers.
//!
//! A [`LayerRoute`] is an embedder (the entry), a list of [`Stage`]s that each run a contiguous
//! span of layers, and a head that turns the last hidden state into logits. Between two
//! stages the hidden states cross a boundary; the [`BoundaryPolicy`] says whether they cross
//! in f32 (bit-identical to one process) or cast to bfloat16 as on the wire.

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use meshnet_wire::chunk::chunk_ranges;
use meshnet_wire::{Activations, PREFILL_CHUNK_TOKENS};

use crate::detokenizer::IncrementalDecoder;
use crate::error::{ModelError, Result};
use crate::kv_cache::SessionId;
use crate::sampling::{
    Sampler, SamplingConfig, StopConditions, TokenLogprobs, TokenMask, token_logprobs,
};
use crate::speculation::{DraftGate, DraftLength, SpeculationStats, prompt_lookup};
use crate::tokenizer::ModelTokenizer;

/// A contiguous span of layers, in this process or behind a network hop.
///
/// Synchronous by design: a remote stage blocks on its HTTP client from a blocking thread.
pub trait Stage {
    /// Runs the span on `hidden` (`[1, tokens, hidden]`) for the chunk starting at absolute
    /// `position` of `session`, appending to that session's KV cache.
    fn forward(&self, session: SessionId, position: usize, hidden: Tensor) -> Result<Tensor>;

    /// Frees whatever the stage holds for `session`.
    fn end_session(&self, session: SessionId);

    /// A short description for error messages ("layers 10..20", a peer's address).
    fn name(&self) -> String;

    /// Starts a prefill chunk like [`Stage::forward`] does, but a stage that can overlap
    /// chunks (a route over other peers) may send it on its way and return `None` at once;
    /// [`Stage::finish_chunks`] then waits for what it sent. Chunks come in order. The default
    /// runs the chunk to the end.
    fn start_chunk(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> Result<Option<Tensor>> {
        self.forward(session, position, hidden).map(Some)
    }

    /// Waits for every chunk [`Stage::start_chunk`] left running and returns the output of the
    /// last of them (`None` when none was left running).
    fn finish_chunks(&self, session: SessionId) -> Result<Option<Tensor>> {
        let _ = session;
        Ok(None)
    }

    /// Whether [`Stage::rewind`] works here, so that drafted tokens may be verified and
    /// taken back (speculative decoding). The default: no.
    fn can_rewind(&self) -> bool {
        false
    }

    /// Cuts the session's KV cache back to its first `len` positions; the next chunk starts
    /// at `len`. A stage may do it at once or with its next chunk. The default refuses.
    fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        let _ = (session, len);
        Err(ModelError::InvalidSpan(format!(
            "{} cannot take cached positions back",
            self.name()
        )))
    }
}

/// Turns token ids into the first hidden states.
pub trait TokenEmbedder {
    /// Embeds `tokens` as `[1, tokens, hidden]`.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor>;
}

/// Turns the last hidden states into logits.
pub trait LogitsHead {
    /// Applies the final norm and LM head to the last position of `hidden` (`[1, tokens,
    /// hidden]`), returning one logit per vocabulary entry.
    fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>>;
}

/// How hidden states cross from one stage to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoundaryPolicy {
    /// Hand over f32 as computed: a split route equals one process bit for bit. Tests only;
    /// the wire does not carry f32.
    F32,
    /// Cast to bfloat16 with the wire's own conversion, as a real hop does: between
    /// consecutive stages, and, when there is more than one stage, once more after the last
    /// (in a mesh the last span's output travels back to the entry over the wire).
    Bf16,
}

impl BoundaryPolicy {
    /// Applies the boundary to hidden states leaving one stage for the next.
    pub fn cross(self, hidden: Tensor) -> Result<Tensor> {
        match self {
            Self::F32 => Ok(hidden),
            Self::Bf16 => {
                let activations = Activations::from_tensor(&hidden)?;
                Ok(activations
                    .into_tensor(&Device::Cpu)?
                    .to_dtype(DType::F32)?)
            }
        }
    }
}

/// An embedder, the stages in order, and a head.
pub struct LayerRoute<'a> {
    /// The entry: token embedding.
    pub embedder: &'a dyn TokenEmbedder,
    /// The spans of layers, in order; together they cover every layer once.
    pub stages: Vec<&'a dyn Stage>,
    /// The exit: final norm and LM head.
    pub head: &'a dyn LogitsHead,
    /// How hidden states cross between consecutive stages.
    pub boundary: BoundaryPolicy,
}

impl LayerRoute<'_> {
    /// Runs one chunk of `tokens` at absolute `position` through every stage and returns the
    /// last hidden states.
    pub fn forward_hidden(
        &self,
        session: SessionId,
        position: usize,
        tokens: &[u32],
    ) -> Result<Tensor> {
        let mut hidden = self.embedder.embed(tokens)?;
        for (index, stage) in self.stages.iter().enumerate() {
            if index > 0 {
                hidden = self.boundary.cross(hidden)?;
            }
            hidden = stage.forward(session, position, hidden)?;
        }
        if self.stages.len() > 1 {
            hidden = self.boundary.cross(hidden)?;
        }
        Ok(hidden)
    }

    /// Runs the whole prompt through every stage in chunks of at most `chunk_tokens` and
    /// returns the last chunk's hidden states. The last stage may overlap the chunks
    /// ([`Stage::start_chunk`]): while it works on one, the stages before it compute the next
    /// (pipelined prefill, ADR-0021). The other stages run each chunk to the end.
    pub fn prefill(
        &self,
        session: SessionId,
        prompt: &[u32],
        chunk_tokens: usize,
    ) -> Result<Tensor> {
        let Some((last_stage, first_stages)) = self.stages.split_last() else {
            return Err(ModelError::InvalidSpan("the route has no stage".into()));
        };
        if chunk_tokens == 0 {
            return Err(ModelError::InvalidSpan(
                "prefill chunks need at least one token".into(),
            ));
        }
        let mut last_hidden = None;
        for range in chunk_ranges(prompt.len(), chunk_tokens) {
            let position = range.start;
            let mut hidden = self.embedder.embed(&prompt[range])?;
            for (index, stage) in first_stages.iter().enumerate() {
                if index > 0 {
                    hidden = self.boundary.cross(hidden)?;
                }
                hidden = stage.forward(session, position, hidden)?;
            }
            if !first_stages.is_empty() {
                hidden = self.boundary.cross(hidden)?;
            }
            if let Some(output) = last_stage.start_chunk(session, position, hidden)? {
                last_hidden = Some(output);
            }
        }
        if let Some(output) = last_stage.finish_chunks(session)? {
            last_hidden = Some(output);
        }
        let hidden = last_hidden
            .ok_or_else(|| ModelError::InvalidSpan("the prompt has no tokens".into()))?;
        if self.stages.len() > 1 {
            return self.boundary.cross(hidden);
        }
        Ok(hidden)
    }

    /// Runs the whole prompt through every stage chunk by chunk (not pipelined: every chunk's
    /// output is needed) and scores it: the log-probability of each prompt token after the
    /// ones before it, with `top` of the most likely tokens at its position (the first token
    /// has none). Returns those and the logits after the last prompt token, from which
    /// decoding goes on.
    pub fn prefill_scoring(
        &self,
        session: SessionId,
        prompt: &[u32],
        chunk_tokens: usize,
        top: usize,
    ) -> Result<(Vec<TokenLogprobs>, Vec<f32>)> {
        if prompt.is_empty() || chunk_tokens == 0 {
            return Err(ModelError::InvalidSpan(
                "scoring needs a prompt and chunks of at least one token".into(),
            ));
        }
        let mut scored = Vec::with_capacity(prompt.len() - 1);
        let mut last_logits = Vec::new();
        for range in chunk_ranges(prompt.len(), chunk_tokens) {
            let hidden = self.forward_hidden(session, range.start, &prompt[range.clone()])?;
            for (row, position) in range.enumerate() {
                let logits = self.head.logits(&hidden.narrow(1, row, 1)?)?;
                match prompt.get(position + 1) {
                    Some(&next) => scored.push(token_logprobs(&logits, next, top)),
                    None => last_logits = logits,
                }
            }
        }
        Ok((scored, last_logits))
    }

    /// Runs one chunk and returns the logits of its last position.
    pub fn forward(&self, session: SessionId, position: usize, tokens: &[u32]) -> Result<Vec<f32>> {
        let hidden = self.forward_hidden(session, position, tokens)?;
        self.head.logits(&hidden)
    }

    /// Frees the session on every stage.
    pub fn end_session(&self, session: SessionId) {
        for stage in &self.stages {
            stage.end_session(session);
        }
    }

    /// The logits after position `row` of `hidden` (`[1, tokens, hidden]`), as
    /// [`LogitsHead::logits`] gives them for that position alone.
    pub fn logits_at(&self, hidden: &Tensor, row: usize) -> Result<Vec<f32>> {
        self.head.logits(&hidden.narrow(1, row, 1)?)
    }

    /// Whether every stage can take cached positions back ([`Stage::can_rewind`]).
    pub fn can_rewind(&self) -> bool {
        self.stages.iter().all(|stage| stage.can_rewind())
    }

    /// Cuts the session back to its first `len` positions on every stage.
    pub fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        self.stages
            .iter()
            .try_for_each(|stage| stage.rewind(session, len))
    }
}

/// Limits which tokens may come next (structured output): before each token the generation
/// loop asks it which tokens are allowed and samples among those only; after each token it
/// commits the token; once it is complete, generation stops ([`FinishReason::Complete`]).
///
/// A request holds a constraint in its starting state; each generation runs on a copy
/// ([`TokenConstraint::boxed_clone`]), so a request can be generated more than once.
pub trait TokenConstraint: Send + Sync + std::fmt::Debug {
    /// Writes the set of tokens allowed next into `mask` (end-of-text tokens among them only
    /// where the constrained text may end).
    fn allowed_tokens(&mut self, mask: &mut TokenMask) -> Result<()>;

    /// Advances past `token`, which the last mask allowed.
    fn commit(&mut self, token: u32) -> Result<()>;

    /// Whether the constrained text is complete and allows no further token.
    fn is_complete(&self) -> bool;

    /// A copy in the same state.
    fn boxed_clone(&self) -> Box<dyn TokenConstraint>;
}

impl Clone for Box<dyn TokenConstraint> {
    fn clone(&self) -> Self {
        self.boxed_clone()
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// How to choose tokens.
    pub sampling: SamplingConfig,
    /// When to stop early.
    pub stop: StopConditions,
    /// Tokens per prefill chunk (the wire's 128 by default).
    pub chunk_tokens: usize,
    /// Keep the logits of every step in the result (for tests and diagnostics).
    pub record_logits: bool,
    /// Report each generated token's log-probability with this many of the most likely
    /// tokens at its step ([`token_logprobs`]); `None` reports none.
    pub logprobs: Option<usize>,
    /// The session the generation's KV caches are kept under on every stage.
    pub session: SessionId,
    /// Limits the tokens that may be generated (structured output); `None` allows any.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    /// The most tokens drafted (prompt lookup) and verified in one pass per decode step;
    /// 0 decodes one token per pass. Used only on routes whose stages can all rewind.
    pub max_draft: usize,
    /// Send only the drafts that the route's measured pass times and the acceptance so far
    /// pay for ([`DraftGate`]); `false` sends every draft the lookup finds.
    pub gate_drafts: bool,
    /// The gate the generation starts from: what earlier generations over the same route
    /// timed ([`DraftGate::for_next_generation`]), or a new gate.
    pub draft_gate: DraftGate,
}

impl GenerationRequest {
    /// Greedy generation of up to `max_tokens` after `prompt`, with 128-token prefill chunks.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingConfig::greedy(),
            stop: StopConditions::default(),
            chunk_tokens: PREFILL_CHUNK_TOKENS,
            record_logits: false,
            logprobs: None,
            session: SessionId::new_v4(),
            constraint: None,
            max_draft: 0,
            gate_drafts: true,
            draft_gate: DraftGate::new(),
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The token limit was reached.
    Length,
    /// A stop token was sampled.
    StopToken,
    /// The text reached a stop string.
    StopString,
    /// The observer asked to stop (for example, the client went away).
    Cancelled,
    /// The token constraint is complete and allows no further token.
    Complete,
}

/// The result of a generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated token ids, without the stop token.
    pub tokens: Vec<u32>,
    /// The decoded continuation (cut before any stop string), when a tokenizer was given.
    pub text: Option<String>,
    /// Why it ended.
    pub finish: FinishReason,
    /// The logits of each step (after the prompt, then after each generated token that was fed
    /// back), when `record_logits` was set.
    pub logits: Vec<Vec<f32>>,
    /// The log-probabilities of each generated token, when `logprobs` was set.
    pub logprobs: Vec<TokenLogprobs>,
    /// What speculative decoding drafted and had accepted.
    pub speculation: SpeculationStats,
    /// The draft gate as the generation left it: for the next generation over the route.
    pub draft_gate: DraftGate,
}

/// Generates a continuation of `request.prompt` over `route`: prefill in chunks, then one
/// token at a time, sampling and checking stop conditions after each step. The session is
/// ended on every stage afterwards, also after an error.
pub fn generate(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    tokenizer: Option<&ModelTokenizer>,
) -> Result<Generation> {
    generate_observed(route, request, tokenizer, &mut |_, _| true)
}

/// Like [`generate`], calling `observer` with every token generated so far (and their
/// log-probabilities, when requested) after each new token; when it returns `false`
/// generation stops with [`FinishReason::Cancelled`]. The session is ended on every stage
/// afterwards, also after an error or a cancellation.
pub fn generate_observed(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    tokenizer: Option<&ModelTokenizer>,
    observer: &mut dyn FnMut(&[u32], &[TokenLogprobs]) -> bool,
) -> Result<Generation> {
    let outcome = run(route, request, tokenizer, observer);
    route.end_session(request.session);
    outcome
}

/// Like [`generate_observed`] for a session whose caches already hold the prompt on every
/// stage (forked from a prefill shared by several continuations): decoding starts from
/// `logits`, the logits after the prompt's last token. The session is ended on every stage
/// afterwards, also after an error or a cancellation.
pub fn decode_observed(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    logits: Vec<f32>,
    tokenizer: Option<&ModelTokenizer>,
    observer: &mut dyn FnMut(&[u32], &[TokenLogprobs]) -> bool,
) -> Result<Generation> {
    let outcome = decode(route, request, logits, tokenizer, observer);
    route.end_session(request.session);
    outcome
}

fn run(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    tokenizer: Option<&ModelTokenizer>,
    observer: &mut dyn FnMut(&[u32], &[TokenLogprobs]) -> bool,
) -> Result<Generation> {
    if request.prompt.is_empty() {
        return Err(ModelError::InvalidSpan("the prompt has no tokens".into()));
    }
    let last_hidden = route.prefill(request.session, &request.prompt, request.chunk_tokens)?;
    let logits = route.head.logits(&last_hidden)?;
    decode(route, request, logits, tokenizer, observer)
}

/// Samples from `logits` (those after the prompt), then feeds each token back (with drafted
/// tokens after it, when speculating) until a stop condition or the token limit.
fn decode(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    logits: Vec<f32>,
    tokenizer: Option<&ModelTokenizer>,
    observer: &mut dyn FnMut(&[u32], &[TokenLogprobs]) -> bool,
) -> Result<Generation> {
    let mut sampler = Sampler::new(request.sampling.clone())?;
    let mut front = DecodeFront::new(route, request, logits);
    let mut recorded = Vec::new();
    let mut generated = Vec::with_capacity(request.max_tokens);
    let mut logprobs = Vec::new();
    let mut finish = FinishReason::Length;
    let mut text = tokenizer.map(|tokenizer| GeneratedText::new(tokenizer, &request.stop));
    let mut stop_at = None;
    let mut constraint = request.constraint.clone();
    let mut allowed = TokenMask::default();
    while generated.len() < request.max_tokens {
        let logits = front.logits();
        let token = next_token(
            &mut sampler,
            logits,
            front.draft(),
            constraint.as_mut(),
            &mut allowed,
        )?;
        let step_logprobs = request
            .logprobs
            .map(|top| token_logprobs(logits, token, top));
        if request.record_logits {
            recorded.push(logits.to_vec());
        }
        if request.stop.tokens.contains(&token) {
            finish = FinishReason::StopToken;
            break;
        }
        if let Some(constraint) = constraint.as_mut() {
            constraint.commit(token)?;
        }
        generated.push(token);
        logprobs.extend(step_logprobs);
        let found = match text.as_mut() {
            Some(text) => text.push(token)?,
            None => None,
        };
        if !observer(&generated, &logprobs) {
            finish = FinishReason::Cancelled;
            break;
        }
        if found.is_some() {
            stop_at = found;
            finish = FinishReason::StopString;
            break;
        }
        if constraint.as_ref().is_some_and(|c| c.is_complete()) {
            finish = FinishReason::Complete;
            break;
        }
        if generated.len() == request.max_tokens {
            break;
        }
        front.advance(token, request.max_tokens - generated.len())?;
    }
    let text = match text {
        Some(text) => Some(final_text(text, &mut finish, stop_at)?),
        None => None,
    };
    Ok(Generation {
        tokens: generated,
        text,
        finish,
        logits: recorded,
        logprobs,
        speculation: front.stats(),
        draft_gate: front.gate,
    })
}

/// The generation's whole text once it ended as `finish` (cut before the stop string found at
/// `stop_at`, or one its last piece completes, which turns `finish` into a stop string's).
fn final_text(
    text: GeneratedText<'_>,
    finish: &mut FinishReason,
    stop_at: Option<usize>,
) -> Result<String> {
    if *finish == FinishReason::Cancelled {
        return text.into_string();
    }
    let (text, stopped) = text.into_cut_string(stop_at)?;
    if stopped {
        *finish = FinishReason::StopString;
    }
    Ok(text)
}

/// Where decoding stands on the route: the logits the next token is chosen from and, when
/// speculating, the drafted tokens already sent after it with the hidden states after each
/// (their logits are computed only for the drafts that come up for checking: after the first
/// rejection, none are).
struct DecodeFront<'r, 'a> {
    route: &'r LayerRoute<'a>,
    session: SessionId,
    /// The logits for the next token.
    logits: Vec<f32>,
    /// Drafted tokens every stage has cached after the last chosen one, oldest first.
    drafted: VecDeque<u32>,
    /// The last hidden states of the step being verified (`[1, 1 + drafts, hidden]`) and the
    /// row of the next drafted token in it.
    verified: Option<(Tensor, usize)>,
    /// Positions every stage holds.
    cached: usize,
    /// The prompt and every token chosen so far: where drafts are looked up.
    context: Vec<u32>,
    /// How many tokens to draft; `None` when not speculating.
    length: Option<DraftLength>,
    /// Whether drafts pay for themselves on this route, from the passes timed so far.
    gate: DraftGate,
    /// Whether [`DecodeFront::gate`] may hold drafts back.
    gate_drafts: bool,
    /// The first token the lookup found at a step that sent no drafts: checked against the
    /// next choice, so the gate learns how often drafts would be accepted without paying for
    /// a row.
    unsent: Option<u32>,
    /// Drafted and accepted tokens of the step being verified.
    step: (usize, usize),
    stats: SpeculationStats,
}

impl<'r, 'a> DecodeFront<'r, 'a> {
    fn new(route: &'r LayerRoute<'a>, request: &GenerationRequest, logits: Vec<f32>) -> Self {
        let speculate = request.max_draft > 0 && route.can_rewind();
        DecodeFront {
            route,
            session: request.session,
            logits,
            drafted: VecDeque::new(),
            verified: None,
            cached: request.prompt.len(),
            context: if speculate {
                request.prompt.clone()
            } else {
                Vec::new()
            },
            length: speculate.then(|| DraftLength::new(request.max_draft)),
            gate: request.draft_gate.clone(),
            gate_drafts: request.gate_drafts,
            unsent: None,
            step: (0, 0),
            stats: SpeculationStats::default(),
        }
    }

    fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// The drafted token waiting to be checked against the next choice.
    fn draft(&self) -> Option<u32> {
        self.drafted.front().copied()
    }

    /// Moves past the chosen `token`, of which `remaining` more may follow: a draft it equals
    /// is accepted (its logits are already here); otherwise the drafts left are dropped on
    /// every stage and `token` goes through the route with new drafts after it.
    fn advance(&mut self, token: u32, remaining: usize) -> Result<()> {
        if self.length.is_some() {
            self.context.push(token);
        }
        if let Some(unsent) = self.unsent.take() {
            self.gate.record_checks(1, usize::from(unsent == token));
        }
        let mut rewind_seconds = None;
        match self.drafted.pop_front() {
            Some(draft) if draft == token => {
                let (hidden, row) = self
                    .verified
                    .as_mut()
                    .ok_or_else(|| ModelError::InvalidSpan("a draft without its step".into()))?;
                let started = Instant::now();
                self.logits = self.route.logits_at(hidden, *row)?;
                self.gate.record_head(started.elapsed().as_secs_f64());
                *row += 1;
                self.step.1 += 1;
                if self.drafted.is_empty() {
                    self.end_step();
                }
                return Ok(());
            }
            Some(_) => {
                let kept = self.cached - self.drafted.len() - 1;
                self.drafted.clear();
                self.end_step();
                let started = Instant::now();
                self.route.rewind(self.session, kept)?;
                rewind_seconds = Some(started.elapsed().as_secs_f64());
                self.cached = kept;
            }
            None => {}
        }
        let draft = self.next_draft(remaining);
        let started = Instant::now();
        let drafts = draft.len();
        self.send(token, draft)?;
        let seconds = started.elapsed().as_secs_f64();
        match rewind_seconds {
            Some(rewind) => self.gate.record_rewound_pass(drafts, seconds, rewind),
            None => self.gate.record_pass(drafts, seconds),
        }
        Ok(())
    }

    /// The drafted tokens to send after the chosen token, of which `remaining` more may follow:
    /// as many as the draft length and the gate allow. When none are sent, the first token
    /// the lookup finds is kept in [`DecodeFront::unsent`].
    fn next_draft(&mut self, remaining: usize) -> Vec<u32> {
        let Some(length) = self.length.as_mut() else {
            return Vec::new();
        };
        self.gate.fade();
        let wanted = length.take_step().min(remaining - 1);
        let allowed = if self.gate_drafts {
            self.gate.allowed(wanted)
        } else {
            wanted
        };
        if allowed == 0 {
            self.unsent = prompt_lookup(&self.context, 1).first().copied();
            return Vec::new();
        }
        prompt_lookup(&self.context, allowed)
    }

    /// Sends `token` and `draft` after it through the route at the end of the cache.
    fn send(&mut self, token: u32, draft: Vec<u32>) -> Result<()> {
        if draft.is_empty() {
            self.logits = self.route.forward(self.session, self.cached, &[token])?;
            self.cached += 1;
            return Ok(());
        }
        let mut tokens = Vec::with_capacity(draft.len() + 1);
        tokens.push(token);
        tokens.extend_from_slice(&draft);
        let hidden = self
            .route
            .forward_hidden(self.session, self.cached, &tokens)?;
        self.cached += tokens.len();
        self.logits = self.route.logits_at(&hidden, 0)?;
        self.verified = Some((hidden, 1));
        self.drafted = draft.iter().copied().collect();
        self.step = (draft.len(), 0);
        self.stats.drafted += draft.len();
        self.stats.verify_steps += 1;
        Ok(())
    }

    /// Records how the step being verified went.
    fn end_step(&mut self) {
        self.verified = None;
        let (drafted, accepted) = std::mem::take(&mut self.step);
        self.stats.accepted += accepted;
        self.gate.record_checks(drafted, accepted);
        if let Some(length) = self.length.as_mut() {
            length.record(drafted, accepted);
        }
    }

    fn stats(&self) -> SpeculationStats {
        SpeculationStats {
            draft_length: self.length.as_ref().map_or(0, DraftLength::current),
            ..self.stats
        }
    }
}

/// The next token from `logits`: among the tokens `constraint` allows (written into
/// `allowed`) when there is one, checked against `draft` when one was drafted.
fn next_token(
    sampler: &mut Sampler,
    logits: &[f32],
    draft: Option<u32>,
    constraint: Option<&mut Box<dyn TokenConstraint>>,
    allowed: &mut TokenMask,
) -> Result<u32> {
    let allowed = match constraint {
        Some(constraint) => {
            constraint.allowed_tokens(allowed)?;
            Some(&*allowed)
        }
        None => None,
    };
    match draft {
        Some(draft) => sampler.sample_against_draft(logits, allowed, draft),
        None => sampler.sample_within(logits, allowed),
    }
}

/// The text of the generated ids, decoded as they come, and the search for stop strings in it.
///
/// Each id costs the same whatever the length of the text: the decoder looks at a few recent
/// ids, and a stop string is searched for only where the newest piece could have completed
/// one (the longest stop string, less a byte, before the piece; then the piece and the
/// decoder's lookahead).
struct GeneratedText<'a> {
    decoder: IncrementalDecoder<'a>,
    stop: &'a StopConditions,
    /// How far back before a new piece a stop string ending in it can start.
    reach: usize,
    text: String,
}

impl<'a> GeneratedText<'a> {
    fn new(tokenizer: &'a ModelTokenizer, stop: &'a StopConditions) -> Self {
        let longest = stop.strings.iter().map(String::len).max().unwrap_or(0);
        GeneratedText {
            decoder: IncrementalDecoder::new(tokenizer),
            stop,
            reach: longest.saturating_sub(1),
            text: String::new(),
        }
    }

    /// Adds a generated id; returns where the first stop string starts if the text (with the
    /// decoder's lookahead) now has one.
    fn push(&mut self, id: u32) -> Result<Option<usize>> {
        let searched = self.text.len();
        let piece = self.decoder.push(id)?;
        self.text.push_str(&piece);
        Ok(find_stop_after(
            self.stop,
            self.reach,
            &self.text,
            searched,
            self.decoder.lookahead(),
        ))
    }

    /// The whole text, without looking for stop strings in its last piece.
    fn into_string(self) -> Result<String> {
        let mut text = self.text;
        text.push_str(&self.decoder.finish()?);
        Ok(text)
    }

    /// The whole text cut before the stop string found at `stop_at` or, without one, before
    /// a stop string that the decoder's last piece completes; says whether it was cut.
    fn into_cut_string(self, stop_at: Option<usize>) -> Result<(String, bool)> {
        let GeneratedText {
            decoder,
            stop,
            reach,
            mut text,
        } = self;
        if let Some(cut) = stop_at {
            text.push_str(decoder.lookahead());
            text.truncate(cut);
            return Ok((text, true));
        }
        let searched = text.len();
        text.push_str(&decoder.finish()?);
        let found = find_stop_after(stop, reach, &text, searched, "");
        if let Some(cut) = found {
            text.truncate(cut);
        }
        Ok((text, found.is_some()))
    }
}

/// Where the first stop string starts in `text` followed by `lookahead`, given that none ends
/// within `text[..searched]`: only the text from `reach` bytes before `searched` on is
/// searched.
fn find_stop_after(
    stop: &StopConditions,
    reach: usize,
    text: &str,
    searched: usize,
    lookahead: &str,
) -> Option<usize> {
    if stop.strings.is_empty() {
        return None;
    }
    let mut from = searched.saturating_sub(reach);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let mut window = String::with_capacity(text.len() - from + lookahead.len());
    window.push_str(&text[from..]);
    window.push_str(lookahead);
    stop.find_stop_string(&window).map(|at| from + at)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route over a small vocabulary whose logits are the same at every step.
    struct Fixed {
        logits: Vec<f32>,
    }

    /// A route of one stage that is also the route's embedder and head.
    fn one_stage_route<T: TokenEmbedder + Stage + LogitsHead>(part: &T) -> LayerRoute<'_> {
        LayerRoute {
            embedder: part,
            stages: vec![part],
            head: part,
            boundary: BoundaryPolicy::F32,
        }
    }

    /// One zero of width 1 per token: the test routes' embedding.
    fn zero_embedding(tokens: &[u32]) -> Result<Tensor> {
        Ok(Tensor::zeros(
            (1, tokens.len(), 1),
            DType::F32,
            &Device::Cpu,
        )?)
    }

    impl Fixed {
        fn route(&self) -> LayerRoute<'_> {
            one_stage_route(self)
        }
    }

    impl TokenEmbedder for Fixed {
        fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
            zero_embedding(tokens)
        }
    }

    impl Stage for Fixed {
        fn forward(&self, _: SessionId, _: usize, hidden: Tensor) -> Result<Tensor> {
            Ok(hidden)
        }

        fn end_session(&self, _: SessionId) {}

        fn name(&self) -> String {
            "fixed".to_owned()
        }
    }

    impl LogitsHead for Fixed {
        fn logits(&self, _: &Tensor) -> Result<Vec<f32>> {
            Ok(self.logits.clone())
        }
    }

    /// A route over the vocabulary {0, 1} that can rewind, whose next token is `token_after`
    /// the position, and whose passes cost `per_pass` of wall time and `per_draft` more for
    /// every row past the first.
    struct Costly {
        per_pass: std::time::Duration,
        per_draft: std::time::Duration,
        token_after: fn(usize) -> u32,
    }

    impl Costly {
        /// Passes that cost only `per_draft` for each drafted row, over pseudo-random bits (so
        /// prompt lookup always finds a draft and about half of the drafted tokens are right).
        fn random(per_draft: std::time::Duration) -> Self {
            Costly {
                per_pass: std::time::Duration::ZERO,
                per_draft,
                token_after: costly_token_after,
            }
        }

        /// The first `count` tokens after the prompt of `prompt_length` tokens.
        fn continuation(&self, prompt_length: usize, count: usize) -> Vec<u32> {
            (prompt_length..prompt_length + count)
                .map(|p| (self.token_after)(p - 1))
                .collect()
        }
    }

    /// The token [`Costly`] gives after `position`.
    fn costly_token_after(position: usize) -> u32 {
        ((0xB5E3_9A17_4C2D_F086_u64 >> (position % 64)) & 1) as u32
    }

    impl TokenEmbedder for Costly {
        fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
            zero_embedding(tokens)
        }
    }

    impl Stage for Costly {
        /// Each row's hidden state becomes its position.
        fn forward(&self, _: SessionId, position: usize, hidden: Tensor) -> Result<Tensor> {
            let rows = hidden.dim(1)?;
            std::thread::sleep(self.per_pass + self.per_draft * (rows as u32 - 1));
            let positions: Vec<f32> = (position..position + rows).map(|p| p as f32).collect();
            Ok(Tensor::from_vec(positions, (1, rows, 1), &Device::Cpu)?)
        }

        fn end_session(&self, _: SessionId) {}

        fn name(&self) -> String {
            "costly".to_owned()
        }

        fn can_rewind(&self) -> bool {
            true
        }

        fn rewind(&self, _: SessionId, _: usize) -> Result<()> {
            Ok(())
        }
    }

    impl LogitsHead for Costly {
        fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>> {
            let position = hidden.flatten_all()?.to_vec1::<f32>()?[hidden.dim(1)? - 1];
            let mut logits = vec![0.0; 2];
            logits[(self.token_after)(position as usize) as usize] = 1.0;
            Ok(logits)
        }
    }

    #[test]
    fn drafts_that_cost_more_than_they_save_stop_once_the_gate_has_timed_both_passes() {
        let costly = Costly::random(std::time::Duration::from_millis(5));
        let route = one_stage_route(&costly);
        let prompt: Vec<u32> = (0..6).map(costly_token_after).collect();
        let expected = costly.continuation(6, 48);
        let request = GenerationRequest {
            max_draft: 8,
            ..GenerationRequest::greedy(prompt, 48)
        };
        let ungated = generate(
            &route,
            &GenerationRequest {
                gate_drafts: false,
                ..request.clone()
            },
            None,
        )
        .unwrap();
        let gated = generate(&route, &request, None).unwrap();
        println!(
            "ungated {:?}, gated {:?}",
            ungated.speculation, gated.speculation
        );
        assert_eq!(ungated.tokens, expected);
        assert_eq!(gated.tokens, expected);
        assert!(
            ungated.speculation.verify_steps > 4,
            "{:?}",
            ungated.speculation
        );
        // A draft of one is accepted and one of six is cut; the next step sends no draft, to
        // time a one-row pass; the one after (a drafted row is not timed yet) drafts the three
        // that the draft length allows after the cut, up to LEARNING_DRAFTS, and is timed. A
        // drafted row then costs thousands of one-row passes, and no draft is sent again.
        assert_eq!(gated.speculation.verify_steps, 3, "{:?}", gated.speculation);
        assert_eq!(gated.speculation.drafted, 10, "{:?}", gated.speculation);
        // A generation that starts from what this one timed drafts once only: when the row's
        // timing, last renewed early in the first generation, has aged out, one drafted pass
        // times it again.
        let carried = generate(
            &route,
            &GenerationRequest {
                draft_gate: gated.draft_gate.for_next_generation(),
                ..request.clone()
            },
            None,
        )
        .unwrap();
        assert_eq!(carried.tokens, expected);
        assert_eq!(
            carried.speculation.verify_steps, 1,
            "{:?}",
            carried.speculation
        );
        assert_eq!(
            carried.speculation.drafted,
            crate::speculation::LEARNING_DRAFTS,
            "{:?}",
            carried.speculation
        );
    }

    /// Tokens 0, 0, 1 over and over: prompt lookup always drafts right.
    fn repeating_token_after(position: usize) -> u32 {
        u32::from(position % 3 == 2)
    }

    #[test]
    fn steps_that_send_no_draft_still_check_one_so_a_closed_gate_can_open() {
        // A drafted row costs 0.7 of a one-row pass: at the prior acceptance (1/2) no draft is
        // worth it; at the acceptance of this text (all right) one is.
        let pass = std::time::Duration::from_millis(10);
        let costly = Costly {
            per_pass: pass,
            per_draft: pass * 7 / 10,
            token_after: repeating_token_after,
        };
        let route = one_stage_route(&costly);
        let mut closed = DraftGate::new();
        closed.record_pass(0, 0.010);
        closed.record_pass(1, 0.017);
        assert_eq!(closed.allowed(8), 0);
        // Token `i` of the prompt is what follows position `i - 1`, as after it.
        let prompt: Vec<u32> = (2..8).map(repeating_token_after).collect();
        let request = GenerationRequest {
            max_draft: 8,
            draft_gate: closed,
            ..GenerationRequest::greedy(prompt, 24)
        };
        let generation = generate(&route, &request, None).unwrap();
        assert_eq!(generation.tokens, costly.continuation(6, 24));
        let stats = generation.speculation;
        assert!(stats.drafted > 0, "{stats:?}");
        assert_eq!(stats.accepted, stats.drafted, "{stats:?}");
        assert!(generation.draft_gate.acceptance() > 0.9);
    }

    /// A constraint that allows exactly the next id of `ids`; after the last, only `end`
    /// when there is one, else nothing (complete).
    #[derive(Clone, Debug)]
    struct Scripted {
        ids: Vec<u32>,
        end: Option<u32>,
        at: usize,
    }

    impl TokenConstraint for Scripted {
        fn allowed_tokens(&mut self, mask: &mut TokenMask) -> Result<()> {
            let next = self.ids.get(self.at).copied().or(self.end);
            *mask = TokenMask::of(next.as_slice());
            Ok(())
        }

        fn commit(&mut self, token: u32) -> Result<()> {
            if self.ids.get(self.at) != Some(&token) {
                return Err(ModelError::Constraint(format!("{token} was not allowed")));
            }
            self.at += 1;
            Ok(())
        }

        fn is_complete(&self) -> bool {
            self.at == self.ids.len() && self.end.is_none()
        }

        fn boxed_clone(&self) -> Box<dyn TokenConstraint> {
            Box::new(self.clone())
        }
    }

    /// Logits of eight tokens, token 0 by far the most likely, then 1, 2, ...
    const RAW: [f32; 8] = [9.0, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0];

    /// The ids the constraint forces: never token 0, some of the least likely, one twice.
    const FORCED: [u32; 5] = [7, 3, 6, 3, 5];

    fn constrained(sampling: SamplingConfig, end: Option<u32>) -> GenerationRequest {
        GenerationRequest {
            sampling,
            constraint: Some(Box::new(Scripted {
                ids: FORCED.to_vec(),
                end,
                at: 0,
            })),
            ..GenerationRequest::greedy(vec![1, 2], 20)
        }
    }

    /// Greedy and sampled settings of every kind, with biases that favour masked tokens.
    fn every_kind_of_sampling() -> Vec<SamplingConfig> {
        let hot = |seed| SamplingConfig {
            temperature: 1.5,
            seed,
            ..SamplingConfig::greedy()
        };
        let mut configs = vec![
            SamplingConfig::greedy(),
            SamplingConfig {
                logit_bias: vec![(0, 100.0), (1, 50.0), (7, -20.0)],
                ..SamplingConfig::greedy()
            },
            SamplingConfig {
                top_k: Some(1),
                ..hot(1)
            },
            SamplingConfig {
                top_k: Some(2),
                top_p: Some(0.3),
                min_p: Some(0.9),
                ..hot(2)
            },
            SamplingConfig {
                presence_penalty: -2.0,
                frequency_penalty: 2.0,
                logit_bias: vec![(0, 100.0), (2, 100.0)],
                ..hot(3)
            },
        ];
        configs.extend((10..30).map(hot));
        configs
    }

    #[test]
    fn a_constraint_forces_its_tokens_under_greedy_and_every_kind_of_sampling() {
        let route = Fixed {
            logits: RAW.to_vec(),
        };
        for sampling in every_kind_of_sampling() {
            let request = constrained(sampling.clone(), None);
            let generation = generate(&route.route(), &request, None).unwrap();
            assert_eq!(generation.tokens, FORCED, "{sampling:?}");
            assert_eq!(generation.finish, FinishReason::Complete, "{sampling:?}");
            // The request's constraint is left in its starting state: it runs again.
            let again = generate(&route.route(), &request, None).unwrap();
            assert_eq!(again.tokens, FORCED, "{sampling:?}");
        }
        // Without the constraint the same settings choose other tokens.
        let free = GenerationRequest {
            constraint: None,
            ..constrained(SamplingConfig::greedy(), None)
        };
        let generation = generate(&route.route(), &free, None).unwrap();
        assert_eq!(generation.tokens, [0; 20]);
    }

    #[test]
    fn logprobs_of_a_constrained_generation_are_those_of_the_raw_logits() {
        let route = Fixed {
            logits: RAW.to_vec(),
        };
        let request = GenerationRequest {
            logprobs: Some(2),
            ..constrained(SamplingConfig::greedy(), None)
        };
        let generation = generate(&route.route(), &request, None).unwrap();
        assert_eq!(generation.logprobs.len(), FORCED.len());
        for (entry, &token) in generation.logprobs.iter().zip(&FORCED) {
            assert_eq!(*entry, token_logprobs(&RAW, token, 2));
            // The masked-out favourite is still listed first.
            assert_eq!(entry.top[0].0, 0);
        }
    }

    #[test]
    fn an_end_token_the_constraint_allows_stops_and_max_tokens_cuts_with_length() {
        let route = Fixed {
            logits: RAW.to_vec(),
        };
        let end = 4;
        for sampling in every_kind_of_sampling() {
            let mut request = constrained(sampling.clone(), Some(end));
            request.stop.tokens = vec![end];
            let generation = generate(&route.route(), &request, None).unwrap();
            assert_eq!(generation.tokens, FORCED, "{sampling:?}");
            assert_eq!(generation.finish, FinishReason::StopToken, "{sampling:?}");
            request.max_tokens = 3;
            let generation = generate(&route.route(), &request, None).unwrap();
            assert_eq!(generation.tokens, FORCED[..3], "{sampling:?}");
            assert_eq!(generation.finish, FinishReason::Length, "{sampling:?}");
        }
    }

    #[test]
    fn banning_every_token_the_constraint_allows_is_a_constraint_error() {
        let route = Fixed {
            logits: RAW.to_vec(),
        };
        for temperature in [0.0, 1.0] {
            let sampling = SamplingConfig {
                temperature,
                logit_bias: vec![(FORCED[1], crate::sampling::BAN_BIAS)],
                ..SamplingConfig::greedy()
            };
            let outcome = generate(&route.route(), &constrained(sampling, None), None);
            assert!(
                matches!(outcome, Err(ModelError::Constraint(_))),
                "{outcome:?}"
            );
        }
    }

    fn stops(strings: &[&str]) -> StopConditions {
        StopConditions {
            tokens: vec![],
            strings: strings.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn stop_strings_are_found_across_the_newest_piece_and_the_lookahead() {
        let stop = stops(&["cde", "xy"]);
        // "cde" starts two bytes before the new piece "def".
        assert_eq!(find_stop_after(&stop, 2, "abcdef", 3, ""), Some(2));
        // ... and ends in the lookahead.
        assert_eq!(find_stop_after(&stop, 2, "abcd", 3, "ef"), Some(2));
        // Of two, the earlier.
        assert_eq!(find_stop_after(&stop, 2, "abxycde", 3, ""), Some(2));
        assert_eq!(find_stop_after(&stop, 2, "abcdef", 6, "g"), None);
        assert_eq!(find_stop_after(&stops(&[]), 2, "abcde", 0, ""), None);
    }

    #[test]
    fn the_search_window_starts_on_a_character_boundary() {
        // Five bytes before the new piece "!" is inside "本": the window backs up to its start.
        let stop = stops(&["本語!"]);
        assert_eq!(find_stop_after(&stop, 5, "日本語!", 9, ""), Some(3));
        let stop = stops(&["日本"]);
        assert_eq!(find_stop_after(&stop, 5, "日本語!", 9, ""), None);
    }
}
