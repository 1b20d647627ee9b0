//! The layers this peer serves: loading a span when told to, dropping it gracefully, and
//! running frames on it for the activation plane.
//!
//! A peer holds at most one current span. Replacing or dropping it moves the old span to a
//! draining list: sessions that already have KV cache on it finish there, new sessions go to
//! the current span only, and a draining span is freed once its last session ends or its drain
//! time runs out. Freeing happens only in [`SpanHost::reap`], which the control loop calls on
//! its timer: every other method only reads, so a `/status` scrape changes nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use candle_core::{DType, Device};
use meshnet_model::{
    BatchItem, LogitsHead, ModelError, ModelSpan, SessionId, SpanSpec, Stage, TokenEmbedder,
};
use meshnet_node::{ExecutorError, SpanExecutor};
use meshnet_types::{LayerSpan, Quantization, SpanState};
use meshnet_wire::{Activations, FrameMeta, PREFILL_CHUNK_TOKENS};
use serde::Serialize;

use crate::batcher::{BatchingReport, DEFAULT_MAX_BATCH_TOKENS, SpanBatcher};
use crate::chunk_order::{CHUNK_TURN_WAIT, ChunkOrder};
use crate::error::PeerError;
use crate::mesh_model::MeshModel;

/// What a peer is asked to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SpanTarget {
    /// The transformer layers.
    pub layers: LayerSpan,
    /// The format they are held in.
    pub quantization: Quantization,
    /// Whether the span also holds the token embedding, final norm and LM head (the tracker's
    /// span).
    pub entry: bool,
}

impl SpanTarget {
    /// The target as announced, in `state`.
    pub fn status(&self, state: SpanState) -> meshnet_p2p::SpanStatus {
        meshnet_p2p::SpanStatus {
            layers: self.layers,
            quantization: self.quantization,
            state,
        }
    }
}

/// A span in memory, with the compute thread that batches its sessions' work.
#[derive(Debug)]
pub struct LoadedSpan {
    /// What was loaded.
    pub target: SpanTarget,
    /// The weights and the KV caches.
    pub span: Arc<ModelSpan>,
    batcher: SpanBatcher,
    order: ChunkOrder,
}

impl LoadedSpan {
    /// Holds `span` as `target` and starts its compute thread, whose passes take at most
    /// `max_batch_tokens` rows.
    pub fn new(
        target: SpanTarget,
        span: ModelSpan,
        max_batch_tokens: usize,
    ) -> std::io::Result<Self> {
        let span = Arc::new(span);
        Ok(LoadedSpan {
            target,
            batcher: SpanBatcher::start(Arc::clone(&span), max_batch_tokens)?,
            span,
            order: ChunkOrder::default(),
        })
    }

    /// Runs `layers` over a session's chunk, in one pass with whatever other sessions have
    /// waiting on this span (see [`crate::batcher`]). A chunk that arrives before the one
    /// ahead of it waits its turn (see [`crate::chunk_order`]). Blocking.
    pub fn forward_range(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
        layers: LayerSpan,
    ) -> Result<Tensor, ModelError> {
        let tokens = hidden.dim(1)?;
        if !self.order.wait_turn(session, position, CHUNK_TURN_WAIT) {
            tracing::debug!(%session, position, "the chunks before this one never came");
        }
        let item = BatchItem {
            session,
            position,
            hidden,
        };
        let answer = self.batcher.submit(layers, item)?;
        self.order.entered(session, position + tokens);
        answer.wait()
    }

    /// Starts `child` on this span as a copy of the first `len` cached positions of
    /// `parent` (see [`meshnet_model::KvStore::fork`]); its chunks then continue from `len`.
    pub fn fork_session(
        &self,
        parent: SessionId,
        child: SessionId,
        len: usize,
    ) -> Result<(), ModelError> {
        self.span.kv_store().fork(parent, child, len)?;
        self.order.entered(child, len);
        Ok(())
    }

    /// Frees the session's KV cache and tells the compute thread it has ended.
    pub fn end_session(&self, session: SessionId) {
        self.span.kv_store().end_session(session);
        self.batcher.forget(session);
        self.order.forget(session);
    }

    /// What the span's compute thread has done so far.
    pub fn batching(&self) -> BatchingReport {
        self.batcher.report()
    }

    fn covers(&self, layers: LayerSpan) -> bool {
        self.target.layers.covers(layers)
    }

    /// Tokens per second through this span, from one 16-token chunk on a scratch session
    /// (1.0 when the measurement fails). Blocking: call it off the async workers.
    pub fn measure_throughput(&self, hidden_size: usize) -> f64 {
        let tokens = 16;
        let Ok(input) =
            candle_core::Tensor::zeros((1, tokens, hidden_size), DType::F32, &Device::Cpu)
        else {
            return 1.0;
        };
        let session = SessionId::new_v4();
        let started = Instant::now();
        let ran = self.forward_range(session, 0, input, self.span.layers());
        let elapsed = started.elapsed().as_secs_f64();
        self.span.kv_store().end_session(session);
        match ran {
            Ok(_) if elapsed > 0.0 => tokens as f64 / elapsed,
            _ => 1.0,
        }
    }
}

/// The span as a stage of a generation's route at the entry: its layers and its LM head go
/// through the span's compute thread, batched with the other sessions'.
impl Stage for LoadedSpan {
    fn forward(
        &self,
        session: SessionId,
        position: usize,
        hidden: Tensor,
    ) -> Result<Tensor, ModelError> {
        self.forward_range(session, position, hidden, self.target.layers)
    }

    fn end_session(&self, session: SessionId) {
        LoadedSpan::end_session(self, session);
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn rewind(&self, session: SessionId, len: usize) -> Result<(), ModelError> {
        self.span.kv_store().rewind(session, len)
    }

    fn name(&self) -> String {
        self.span.name()
    }
}

impl TokenEmbedder for LoadedSpan {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        self.span.embed(tokens)
    }
}

impl LogitsHead for LoadedSpan {
    fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>, ModelError> {
        self.batcher.logits(hidden.clone())
    }
}

/// How far the current load has got, readable from any thread.
#[derive(Clone, Debug, Default)]
pub struct LoadProgress {
    counts: Arc<(AtomicUsize, AtomicUsize)>,
}

impl LoadProgress {
    /// `(layers loaded, layers to load)` while a load runs, `None` otherwise.
    pub fn get(&self) -> Option<(usize, usize)> {
        let total = self.counts.1.load(Ordering::Relaxed);
        (total > 0).then(|| (self.counts.0.load(Ordering::Relaxed).min(total), total))
    }

    fn set(&self, done: usize, total: usize) {
        self.counts.0.store(done, Ordering::Relaxed);
        self.counts.1.store(total, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
struct HostState {
    current: Option<Arc<LoadedSpan>>,
    loading: Option<SpanTarget>,
    draining: Vec<(Arc<LoadedSpan>, Instant)>,
}

/// The peer's span slot.
#[derive(Debug)]
pub struct SpanHost {
    model: Arc<MeshModel>,
    kv_tokens: u64,
    drain_timeout: Duration,
    state: Mutex<HostState>,
    progress: LoadProgress,
    /// Smoothed milliseconds per decode-sized `/forward` call (at most
    /// [`LATENCY_SAMPLE_TOKENS`] tokens), once one has run.
    decode_latency_ms: Mutex<Option<f64>>,
    max_batch_tokens: usize,
    #[cfg(feature = "faulty-member")]
    faulty: Option<Arc<crate::faulty::FaultyFrames>>,
}

/// Calls of at most this many tokens are decode steps, timed for [`SpanHost::forward_latency_ms`].
pub const LATENCY_SAMPLE_TOKENS: usize = 4;

/// The weight of the newest call in the smoothed latency.
const LATENCY_SMOOTHING: f64 = 0.2;

impl SpanHost {
    /// An empty slot for spans of `model`, reserving `kv_tokens` tokens of KV cache per held
    /// layer; a dropped span keeps serving its running sessions for at most `drain_timeout`.
    pub fn new(model: Arc<MeshModel>, kv_tokens: u64, drain_timeout: Duration) -> Self {
        SpanHost {
            model,
            kv_tokens,
            drain_timeout,
            state: Mutex::new(HostState::default()),
            progress: LoadProgress::default(),
            decode_latency_ms: Mutex::new(None),
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            #[cfg(feature = "faulty-member")]
            faulty: None,
        }
    }

    /// Corrupts a fraction of the frames this host's spans answer with (tests only).
    #[cfg(feature = "faulty-member")]
    pub fn with_faulty_frames(mut self, faulty: Option<Arc<crate::faulty::FaultyFrames>>) -> Self {
        self.faulty = faulty;
        self
    }

    /// The most rows one pass of a span's compute thread takes (see [`crate::batcher`]).
    pub fn with_max_batch_tokens(mut self, max_batch_tokens: usize) -> Self {
        self.max_batch_tokens = max_batch_tokens.max(1);
        self
    }

    /// Smoothed milliseconds this peer spends on a decode step of its layers (0 before the
    /// first one): what routing compares between holders of the same layers.
    pub fn forward_latency_ms(&self) -> f64 {
        crate::locking::lock(&self.decode_latency_ms).unwrap_or(0.0)
    }

    fn record_latency(&self, tokens: usize, elapsed: Duration) {
        if tokens > LATENCY_SAMPLE_TOKENS {
            return;
        }
        let sample = elapsed.as_secs_f64() * 1000.0;
        let mut latency = crate::locking::lock(&self.decode_latency_ms);
        *latency = Some(match *latency {
            Some(smoothed) => smoothed + LATENCY_SMOOTHING * (sample - smoothed),
            None => sample,
        });
    }

    /// The model this slot serves.
    pub fn model(&self) -> &Arc<MeshModel> {
        &self.model
    }

    /// The progress of the running load.
    pub fn progress(&self) -> LoadProgress {
        self.progress.clone()
    }

    /// The span serving new sessions, if any.
    pub fn current(&self) -> Option<Arc<LoadedSpan>> {
        self.lock().current.clone()
    }

    /// The span being loaded right now, if any.
    pub fn loading(&self) -> Option<SpanTarget> {
        self.lock().loading
    }

    /// The span to announce: the one loading, else the current one.
    pub fn span_status(&self) -> Option<meshnet_p2p::SpanStatus> {
        let state = self.lock();
        if let Some(target) = state.loading {
            return Some(target.status(SpanState::Loading));
        }
        state
            .current
            .as_ref()
            .map(|held_span| held_span.target.status(SpanState::Ready))
    }

    /// [`SpanHost::span_status`], counting only an entry span (embedding and head): what a
    /// tracker holds as the first layers. A member that just took the tracker role still
    /// holds its old span; the planner must not see it as the tracker's.
    pub fn entry_span_status(&self) -> Option<meshnet_p2p::SpanStatus> {
        let state = self.lock();
        if let Some(target) = state.loading.filter(|target| target.entry) {
            return Some(target.status(SpanState::Loading));
        }
        state
            .current
            .as_ref()
            .filter(|held_span| held_span.target.entry)
            .map(|held_span| held_span.target.status(SpanState::Ready))
    }

    /// Loads `target` (blocking; call it off the async workers) and makes it current. Loading
    /// what is already current does nothing. The previous span drains.
    pub fn load(&self, target: SpanTarget) -> Result<Arc<LoadedSpan>, PeerError> {
        if let Some(current) = self.current()
            && current.target == target
        {
            return Ok(current);
        }
        let layers = target.layers;
        if layers.end > self.model.num_layers() {
            return Err(PeerError::Config(format!(
                "layers {layers} do not fit a model of {} layers",
                self.model.num_layers()
            )));
        }
        self.model.check_format(target.quantization)?;
        let kv_budget = self
            .kv_tokens
            .saturating_mul(self.model.kv_bytes_per_token_per_layer())
            .saturating_mul(u64::from(layers.len().max(1)));
        let spec = SpanSpec {
            layers,
            embedding: target.entry,
            head: target.entry,
            quantization: Some(target.quantization),
            kv_budget_bytes: usize::try_from(kv_budget).unwrap_or(usize::MAX),
        };
        self.lock().loading = Some(target);
        let started = Instant::now();
        let loaded = self.model.model().load_span(&spec, &mut |done, total| {
            self.progress.set(done, total.max(1));
        });
        self.progress.set(0, 0);
        let mut state = self.lock();
        state.loading = None;
        let span = loaded?;
        let held_span = Arc::new(
            LoadedSpan::new(target, span, self.max_batch_tokens).map_err(|source| {
                PeerError::Io {
                    what: format!("starting the compute thread of layers {layers}"),
                    source,
                }
            })?,
        );
        if let Some(previous) = state.current.replace(Arc::clone(&held_span)) {
            state.draining.push((previous, Instant::now()));
        }
        tracing::info!(
            %layers,
            quantization = %target.quantization,
            entry = target.entry,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "span loaded"
        );
        Ok(held_span)
    }

    /// Stops serving new sessions; running ones finish on the dropped span until they end or
    /// the drain time runs out.
    pub fn unload(&self) {
        let mut state = self.lock();
        if let Some(previous) = state.current.take() {
            tracing::info!(
                layers = %previous.target.layers,
                "span dropped; running sessions drain"
            );
            state.draining.push((previous, Instant::now()));
        }
    }

    /// Sessions holding KV cache on any span here.
    pub fn active_sessions(&self) -> usize {
        all_spans(&self.lock())
            .map(|held_span| held_span.span.kv_store().session_count())
            .sum()
    }

    /// Spans still finishing sessions after being replaced or dropped.
    pub fn draining(&self) -> usize {
        self.lock().draining.len()
    }

    /// Frees, as of `now`, sessions idle for longer than [`SESSION_IDLE_TIMEOUT`] and draining
    /// spans that have no session left or whose drain time ran out. The only method that
    /// frees anything; the control loop calls it on its timer.
    pub fn reap(&self, now: Instant) {
        let mut state = self.lock();
        if let Some(cutoff) = now.checked_sub(SESSION_IDLE_TIMEOUT) {
            for held_span in all_spans(&state) {
                let dropped = held_span.span.kv_store().end_sessions_idle_since(cutoff);
                if dropped > 0 {
                    tracing::info!(sessions = dropped, "idle sessions dropped");
                }
            }
        }
        let timeout = self.drain_timeout;
        state.draining.retain(|(held_span, since)| {
            let busy = held_span.span.kv_store().session_count() > 0;
            let keep = busy && now.saturating_duration_since(*since) < timeout;
            if !keep && busy {
                tracing::warn!(
                    sessions = held_span.span.kv_store().session_count(),
                    "drain time over: freeing a dropped span with sessions still open"
                );
            }
            keep
        });
    }

    /// Tokens of KV cache the current span can still take (over all its layers).
    pub fn free_kv_tokens(&self) -> u64 {
        self.current().map_or(0, |held_span| {
            let store = held_span.span.kv_store();
            let free = store.budget_bytes().saturating_sub(store.used_bytes());
            (free / store.bytes_per_position().max(1)) as u64
        })
    }

    /// KV cache bytes `(held by sessions on every span here, still free on the current span)`.
    pub fn kv_bytes(&self) -> (u64, u64) {
        let state = self.lock();
        let used = all_spans(&state)
            .map(|held_span| held_span.span.kv_store().used_bytes() as u64)
            .sum();
        let free = state.current.as_ref().map_or(0, |held_span| {
            let store = held_span.span.kv_store();
            store.budget_bytes().saturating_sub(store.used_bytes()) as u64
        });
        (used, free)
    }

    /// The span that should run `meta`: the one already holding the session's cache, else the
    /// current span when it covers the layers.
    fn span_for(&self, meta: &FrameMeta) -> Option<Arc<LoadedSpan>> {
        let state = self.lock();
        // A forked session starts where its parent's cache is.
        let holding = all_spans(&state).find(|held_span| {
            let store = held_span.span.kv_store();
            held_span.covers(meta.layers)
                && (store.has_session(meta.session)
                    || meta
                        .fork_from
                        .is_some_and(|parent| store.has_session(parent)))
        });
        if let Some(held_span) = holding {
            return Some(Arc::clone(held_span));
        }
        state
            .current
            .as_ref()
            .filter(|held_span| held_span.covers(meta.layers))
            .cloned()
    }

    fn lock(&self) -> MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn all_spans(state: &HostState) -> impl Iterator<Item = &Arc<LoadedSpan>> {
    state
        .current
        .iter()
        .chain(state.draining.iter().map(|(held_span, _)| held_span))
}

/// Sessions untouched this long are dropped: their entry went away without ending them.
pub const SESSION_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl SpanExecutor for SpanHost {
    fn served_layers(&self) -> Option<LayerSpan> {
        self.current().map(|current| current.target.layers)
    }

    fn accepts(&self, meta: &FrameMeta) -> bool {
        self.span_for(meta).is_some()
    }

    fn forward(&self, meta: &FrameMeta, input: Activations) -> Result<Activations, ExecutorError> {
        let held_span = self
            .span_for(meta)
            .ok_or_else(|| ExecutorError::LayersNotServed {
                requested: meta.layers,
                served: self.served_layers(),
            })?;
        let hidden_size = self.model.description().hidden;
        let dims = input.shape().dims().to_vec();
        let tokens = match dims.as_slice() {
            [tokens, hidden] | [1, tokens, hidden] if *hidden == hidden_size => *tokens,
            _ => {
                return Err(ExecutorError::BadActivations(format!(
                    "shape {dims:?} is not [tokens, {hidden_size}] or [1, tokens, {hidden_size}]"
                )));
            }
        };
        if tokens > PREFILL_CHUNK_TOKENS {
            return Err(ExecutorError::BadActivations(format!(
                "{tokens} tokens in one frame; prefill travels in chunks of at most \
                 {PREFILL_CHUNK_TOKENS}"
            )));
        }
        let hidden = input
            .into_tensor(&Device::Cpu)
            .and_then(|t| Ok(t.reshape((1, tokens, hidden_size))?))
            .map_err(|e| ExecutorError::BadActivations(e.to_string()))?;
        let hidden = hidden
            .to_dtype(DType::F32)
            .map_err(|e| ExecutorError::Compute(e.to_string()))?;
        let position = usize::try_from(meta.position)
            .map_err(|_| ExecutorError::BadActivations("position too large".into()))?;
        if let Some(parent) = meta.fork_from
            && !held_span.span.kv_store().has_session(meta.session)
        {
            held_span
                .fork_session(parent, meta.session, position)
                .map_err(executor_error)?;
        }
        if meta.rewind {
            held_span
                .span
                .kv_store()
                .rewind(meta.session, position)
                .map_err(executor_error)?;
        }
        let started = Instant::now();
        let output = held_span
            .forward_range(meta.session, position, hidden, meta.layers)
            .map_err(executor_error)?;
        self.record_latency(tokens, started.elapsed());
        let output =
            Activations::from_tensor(&output).map_err(|e| ExecutorError::Compute(e.to_string()))?;
        #[cfg(feature = "faulty-member")]
        if let Some(faulty) = &self.faulty {
            return faulty
                .apply(output)
                .map_err(|e| ExecutorError::Compute(e.to_string()));
        }
        Ok(output)
    }

    fn end_session(&self, session: SessionId) {
        let state = self.lock();
        for held_span in all_spans(&state) {
            held_span.end_session(session);
        }
    }
}

/// How a model error looks to the activation plane.
fn executor_error(error: ModelError) -> ExecutorError {
    match error {
        ModelError::PositionMismatch {
            position, cached, ..
        } => ExecutorError::PositionConflict {
            expected: cached as u64,
            got: position as u64,
        },
        ModelError::CacheBudget { .. } => ExecutorError::Overloaded,
        ModelError::Fork(reason) => ExecutorError::ForkSource(reason),
        error @ (ModelError::HiddenShape { .. }
        | ModelError::Wire(_)
        | ModelError::InvalidSpan(_)) => ExecutorError::BadActivations(error.to_string()),
        other => ExecutorError::Compute(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A slot for the default model holding layers 0..2 in the shipped format.
    fn host() -> SpanHost {
        let path = meshnet_model::default_model_path();
        assert!(
            path.is_file(),
            "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
            path.display()
        );
        let model = Arc::new(MeshModel::open(&path).unwrap());
        let format = model.shipped_format();
        let host = SpanHost::new(model, 64, Duration::from_secs(3600));
        host.load(SpanTarget {
            layers: LayerSpan::new(0, 2),
            quantization: format,
            entry: false,
        })
        .unwrap();
        host
    }

    /// Runs one 4-token frame of a new session on the current span.
    fn run_one_frame(host: &SpanHost) -> SessionId {
        let held_span = host.current().unwrap();
        let hidden = host.model().description().hidden;
        let input = candle_core::Tensor::zeros((1, 4, hidden), DType::F32, &Device::Cpu).unwrap();
        let session = SessionId::new_v4();
        held_span
            .forward_range(session, 0, input, held_span.target.layers)
            .unwrap();
        session
    }

    #[test]
    fn reap_frees_a_session_its_entry_left_only_after_the_idle_timeout() {
        let host = host();
        let empty = host.free_kv_tokens();
        run_one_frame(&host);
        let now = Instant::now();
        assert_eq!(host.active_sessions(), 1);
        assert!(host.free_kv_tokens() < empty);

        host.reap(now + Duration::from_secs(5));
        assert_eq!(host.active_sessions(), 1, "freed a session still in use");

        host.reap(now + SESSION_IDLE_TIMEOUT + Duration::from_secs(1));
        assert_eq!(host.active_sessions(), 0, "kept an abandoned session");
        assert_eq!(
            host.free_kv_tokens(),
            empty,
            "the abandoned session's KV cache is still held"
        );
    }

    #[test]
    fn reap_frees_a_dropped_span_once_its_last_session_is_gone() {
        let host = host();
        let session = run_one_frame(&host);
        host.unload();
        let now = Instant::now();
        assert_eq!(host.draining(), 1);

        host.reap(now + Duration::from_secs(1));
        assert_eq!(
            host.draining(),
            1,
            "freed a dropped span with a session open"
        );

        host.end_session(session);
        host.reap(now + Duration::from_secs(1));
        assert_eq!(host.draining(), 0, "kept a dropped span with no session");
    }

    #[test]
    fn reap_frees_an_abandoned_session_and_then_its_dropped_span() {
        let host = host();
        run_one_frame(&host);
        host.unload();
        let now = Instant::now();
        host.reap(now + SESSION_IDLE_TIMEOUT + Duration::from_secs(1));
        assert_eq!(host.active_sessions(), 0);
        assert_eq!(host.draining(), 0);
    }
}
