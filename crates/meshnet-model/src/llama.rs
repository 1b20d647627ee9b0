//! Llama-family spans from GGUF: optional token embedding → layers `[a..b)` → optional final
//! norm and LM head, with quantized matmuls, RMSNorm, interleaved RoPE, grouped-query
//! attention and SwiGLU, computed in f32 on the CPU.
//!
//! A span reads only the tensors of the parts it holds. Its KV caches live in a [`KvStore`]
//! beside the weights, so one set of weights serves many sessions.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, IndexOp, Tensor};
use meshnet_kernels::QuantizedMatrix;

use crate::attention::{check_token_ids, hidden_tokens};
use crate::error::{ModelError, Result};
use crate::generation::{LogitsHead, Stage, TokenEmbedder};
use meshnet_types::{LayerSpan, Quantization};

use crate::batch::BatchItem;
use crate::family::{Activation, ArchitectureConfig};
use crate::gguf::{GgufModel, ModelDescription, TensorReader};
use crate::kv_cache::{
    CACHED_VALUE_BYTES, DEFAULT_KV_BUDGET_BYTES, KvStore, SessionId, SessionLease,
};
use crate::layer_math::{
    AttentionRule, Heads, Rotary, add_in_place, attend, geglu, rms_norm, swiglu,
};
use crate::linear::{Projections, kernel_matrix, read_kernel_matrix};

/// Which parts of the model a span holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpanSpec {
    /// The transformer layers (may be empty for an embedding- or head-only span).
    pub layers: LayerSpan,
    /// Whether the span holds the token embedding (the route's entry).
    pub embedding: bool,
    /// Whether the span holds the final norm and LM head.
    pub head: bool,
    /// The format linear weights are held in; `None` keeps the file's own.
    pub quantization: Option<Quantization>,
    /// The KV cache budget of this span over all sessions, in bytes.
    pub kv_budget_bytes: usize,
}

impl SpanSpec {
    /// The whole model in one span: embedding, every layer, head; weights as shipped.
    pub fn whole(description: &ModelDescription) -> Self {
        Self {
            layers: LayerSpan::new(0, description.layers as u32),
            embedding: true,
            head: true,
            quantization: None,
            kv_budget_bytes: DEFAULT_KV_BUDGET_BYTES,
        }
    }

    /// Layers only, no embedding or head; weights as shipped.
    pub fn layers(layers: LayerSpan) -> Self {
        Self {
            layers,
            embedding: false,
            head: false,
            quantization: None,
            kv_budget_bytes: DEFAULT_KV_BUDGET_BYTES,
        }
    }

    /// The same span held in `quantization`.
    pub fn with_quantization(mut self, quantization: Quantization) -> Self {
        self.quantization = Some(quantization);
        self
    }
}

/// The hyper-parameters a layer needs at run time.
#[derive(Clone, Debug)]
struct Hyper {
    hidden: usize,
    /// Query heads, key/value heads and head size, as attention takes them.
    heads: Heads,
    rms_eps: f32,
    /// What the family changes (rotation style, activation, optional norms, windows).
    config: ArchitectureConfig,
    /// The rotary frequencies of the global layers (`[0]`) and, when the model has sliding
    /// layers, of those (`[1]`): `1 / base^(2i/d)`, scaled, one per rotated pair.
    inverse_frequencies: Vec<Vec<f32>>,
}

/// The per-head RMS norms of queries and keys (Qwen 3, Gemma 3).
#[derive(Debug)]
struct HeadNorms {
    query: Vec<f32>,
    key: Vec<f32>,
}

/// One transformer block's weights.
#[derive(Debug)]
struct Layer {
    attention_norm: Vec<f32>,
    /// Query, key and value, in that order (three matrices or one fused).
    query_key_value: Projections,
    /// Query, key and value biases one after another (Qwen 2).
    query_key_value_bias: Option<Vec<f32>>,
    head_norms: Option<HeadNorms>,
    attention_output: Projections,
    /// The norm of the attention output before the residual add (Gemma 3).
    post_attention_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up, in that order (two matrices or one fused).
    gate_up: Projections,
    down: Projections,
    /// The norm of the feed-forward output before the residual add (Gemma 3).
    post_ffn_norm: Option<Vec<f32>>,
    /// Scale and window of this layer's attention.
    attention: AttentionRule,
    /// Which of the span's rotary tables this layer uses.
    rope: usize,
}

/// The final norm and the LM head.
#[derive(Debug)]
struct Head {
    norm: Vec<f32>,
    output: Projections,
}

/// The token embedding table: a kernel matrix (whose rows are dequantized on lookup, and
/// which a tied LM head shares), or candle's tensor for other formats.
#[derive(Debug, Clone)]
enum Embedding {
    Kernel(Arc<QuantizedMatrix>),
    Candle(Arc<QTensor>),
}

/// A contiguous span of a Llama-family model, loaded from a GGUF file.
#[derive(Debug)]
pub struct LlamaSpan {
    hyper: Hyper,
    layer_range: LayerSpan,
    vocab_size: usize,
    embedding: Option<Embedding>,
    layers: Vec<Layer>,
    head: Option<Head>,
    cache: KvStore,
    quantization: Option<Quantization>,
}

impl LlamaSpan {
    /// Loads the parts of `model` that `spec` names, and nothing else.
    pub fn load(model: &GgufModel, spec: &SpanSpec) -> Result<Self> {
        Self::load_with_progress(model, spec, &mut |_, _| {})
    }

    /// Like [`Self::load`], calling `progress(layers_loaded, layers_total)` after each layer.
    pub fn load_with_progress(
        model: &GgufModel,
        spec: &SpanSpec,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let description = model.description();
        check_spec(description, spec)?;
        let mut loader = SpanLoader {
            model,
            reader: model.tensor_reader()?,
            requantise: description.requantises(spec.quantization)?,
        };
        let embedding = if spec.embedding || (spec.head && description.tied_embeddings) {
            Some(loader.embedding()?)
        } else {
            None
        };
        let span_layers = spec.layers.len() as usize;
        let mut layers = Vec::with_capacity(span_layers);
        for index in spec.layers.as_range() {
            progress(layers.len(), span_layers);
            layers.push(loader.layer(index)?);
        }
        progress(layers.len(), span_layers);
        let head = if spec.head {
            Some(loader.head(embedding.as_ref())?)
        } else {
            None
        };
        // A head-only span of a tied model borrowed the embedding table for its output.
        let embedding = if spec.embedding { embedding } else { None };
        let hyper = loader.hyper()?;
        let kv_width = description.kv_heads * description.head_dim;
        let bytes_per_position = span_layers * 2 * kv_width * CACHED_VALUE_BYTES;
        Ok(Self {
            hyper,
            layer_range: spec.layers,
            vocab_size: description.vocab_size,
            embedding,
            layers,
            head,
            cache: KvStore::new(span_layers, bytes_per_position, spec.kv_budget_bytes),
            quantization: spec.quantization,
        })
    }

    /// The layers this span runs.
    pub fn layers(&self) -> LayerSpan {
        self.layer_range
    }

    /// Whether the span holds the token embedding.
    pub fn has_embedding(&self) -> bool {
        self.embedding.is_some()
    }

    /// Whether the span holds the final norm and LM head.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// The format the span's linear weights are held in (`None`: the file's own).
    pub fn quantization(&self) -> Option<Quantization> {
        self.quantization
    }

    /// The span's KV caches.
    pub fn kv_store(&self) -> &KvStore {
        &self.cache
    }

    /// Runs the span's layers on `hidden` (`[1, tokens, hidden]`, any float dtype) for the
    /// chunk starting at absolute `position`, appending to the session's KV cache. Returns f32
    /// hidden states of the same shape.
    pub fn forward_layers(
        &self,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
    ) -> Result<Tensor> {
        self.forward_range(session, position, hidden, self.layer_range)
    }

    /// Like [`Self::forward_layers`], but runs only `layers` (absolute indices, within the
    /// span's own range). A session must use the same range on every chunk: the layers it
    /// skips keep no cache for it.
    pub fn forward_range(
        &self,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
        layers: LayerSpan,
    ) -> Result<Tensor> {
        let item = BatchItem {
            session,
            position,
            hidden: hidden.clone(),
        };
        only_result(self.forward_batch(layers, vec![item]))
    }

    /// Runs `layers` (as in [`Self::forward_range`]) over several sessions' chunks in one pass:
    /// every matmul takes all their rows at once, while rotation, the KV cache and attention
    /// stay each session's own. Each chunk's result has the bits it would have alone, and one
    /// refused chunk (a wrong shape or position, no room in the cache) does not hold up the
    /// others. Results come in the order of `items`. A session may appear only once.
    pub fn forward_batch(&self, layers: LayerSpan, items: Vec<BatchItem>) -> Vec<Result<Tensor>> {
        if !self.layer_range.covers(layers) {
            let span = self.layer_range;
            return items
                .iter()
                .map(|_| {
                    Err(ModelError::InvalidSpan(format!(
                        "layers {layers} are not within this span's {span}"
                    )))
                })
                .collect();
        }
        let mut batch = self.admit_batch(layers, items);
        if !batch.parts.is_empty() {
            let outcome = self.run_layers(layers, &mut batch.parts, &mut batch.rows);
            batch.settle(outcome, self.hyper.hidden);
        }
        every_result(batch.results)
    }

    /// Reads each chunk's rows as f32 and, when `layers` is not empty, checks out its
    /// session's cache and builds its rotary tables. A chunk refused on the way gets its error
    /// as its result; with no layers to run, every chunk's result is its own rows.
    fn admit_batch(&self, layers: LayerSpan, items: Vec<BatchItem>) -> AdmittedBatch<'_> {
        let width = self.hyper.hidden;
        let mut batch = AdmittedBatch {
            results: items.iter().map(|_| None).collect(),
            parts: Vec::with_capacity(items.len()),
            rows: Vec::new(),
        };
        for (index, item) in items.into_iter().enumerate() {
            let (tokens, chunk) = match chunk_rows(&item.hidden, width) {
                Ok(prepared) => prepared,
                Err(error) => {
                    batch.results[index] = Some(Err(error));
                    continue;
                }
            };
            if layers.is_empty() {
                batch.results[index] = Some(hidden_tensor(chunk, tokens, width));
                continue;
            }
            // Checked before the rotary tables are built: their size grows with the
            // position, which a frame from the network declares.
            match self.cache.check_out(item.session, item.position, tokens) {
                Ok(lease) => {
                    batch.rows.extend_from_slice(&chunk);
                    batch.parts.push(BatchPart {
                        index,
                        tokens,
                        position: item.position,
                        rotaries: self.rotaries(item.position, tokens),
                        lease,
                    });
                }
                Err(error) => batch.results[index] = Some(Err(error)),
            }
        }
        batch
    }

    /// Runs `layers` over the batch's `rows` (the parts' chunks one after another), each
    /// layer's output feeding the next, leaving the last one's output in `rows`.
    fn run_layers(
        &self,
        layers: LayerSpan,
        parts: &mut [BatchPart<'_>],
        rows: &mut Vec<f32>,
    ) -> Result<()> {
        let first = (layers.start - self.layer_range.start) as usize;
        let selected = &self.layers[first..first + layers.len() as usize];
        // The layers run on a thread of the compute pool, so the matmuls' own splits are
        // cheap forks there rather than a hand-off from this thread and back each time.
        meshnet_kernels::on_compute_pool(|| {
            for (offset, layer) in selected.iter().enumerate() {
                *rows = self.layer_forward(layer, first + offset, parts, std::mem::take(rows))?;
            }
            Ok(())
        })
    }

    /// The rotary tables of a chunk of `tokens` starting at `position`, one per kind of layer.
    fn rotaries(&self, position: usize, tokens: usize) -> Vec<Rotary> {
        let config = &self.hyper.config;
        self.hyper
            .inverse_frequencies
            .iter()
            .map(|frequencies| {
                Rotary::new(
                    frequencies,
                    position,
                    tokens,
                    config.rope_style,
                    config.rope_attention_factor,
                )
            })
            .collect()
    }

    /// One block over the hidden rows of a batch (`[tokens, hidden]`, the parts' chunks one
    /// after another).
    fn layer_forward(
        &self,
        layer: &Layer,
        index: usize,
        parts: &mut [BatchPart<'_>],
        mut hidden: Vec<f32>,
    ) -> Result<Vec<f32>> {
        let hyper = &self.hyper;
        let tokens = hidden.len() / hyper.hidden;
        let normed = rms_norm(&hidden, &layer.attention_norm, hyper.rms_eps);
        let [query, key, value] = self.query_key_value(layer, &normed, tokens)?;
        let attended = attend_parts(layer, hyper.heads, parts, index, [query, key, value])?;
        let [projected] = take_parts(layer.attention_output.forward_values(&attended, tokens)?)?;
        add_in_place(
            &mut hidden,
            &self.post_norm(projected, &layer.post_attention_norm),
        );

        let normed = rms_norm(&hidden, &layer.ffn_norm, hyper.rms_eps);
        let [gate, up] = take_parts(layer.gate_up.forward_values(&normed, tokens)?)?;
        let activated = match hyper.config.activation {
            Activation::Silu => swiglu(&gate, &up),
            Activation::GeluTanh => geglu(&gate, &up),
        };
        let [down] = take_parts(layer.down.forward_values(&activated, tokens)?)?;
        add_in_place(&mut hidden, &self.post_norm(down, &layer.post_ffn_norm));
        Ok(hidden)
    }

    /// Queries, keys and values of normed rows: projected, biased and head-normed as the
    /// family does (rotation comes later, per session).
    fn query_key_value(
        &self,
        layer: &Layer,
        normed: &[f32],
        tokens: usize,
    ) -> Result<[Vec<f32>; 3]> {
        let [mut query, mut key, mut value] =
            take_parts(layer.query_key_value.forward_values(normed, tokens)?)?;
        if let Some(bias) = &layer.query_key_value_bias {
            let (query_bias, rest) = bias.split_at(query.len() / tokens);
            let (key_bias, value_bias) = rest.split_at(key.len() / tokens);
            add_row_bias(&mut query, query_bias);
            add_row_bias(&mut key, key_bias);
            add_row_bias(&mut value, value_bias);
        }
        if let Some(norms) = &layer.head_norms {
            query = rms_norm(&query, &norms.query, self.hyper.rms_eps);
            key = rms_norm(&key, &norms.key, self.hyper.rms_eps);
        }
        Ok([query, key, value])
    }

    /// A sub-block's output normed before the residual add, when the family does that.
    fn post_norm(&self, output: Vec<f32>, norm: &Option<Vec<f32>>) -> Vec<f32> {
        match norm {
            Some(weight) => rms_norm(&output, weight, self.hyper.rms_eps),
            None => output,
        }
    }

    /// The next-token logits of several sessions at once, one per hidden state of `hiddens`
    /// (each `[1, tokens, hidden]`, its last position used): one matmul of the LM head for
    /// all, each result with the bits of [`LogitsHead::logits`] alone.
    pub fn logits_batch(&self, hiddens: &[Tensor]) -> Vec<Result<Vec<f32>>> {
        let Some(head) = self.head.as_ref() else {
            return hiddens
                .iter()
                .map(|_| Err(ModelError::PartNotLoaded("LM head")))
                .collect();
        };
        let width = self.hyper.hidden;
        let mut results: Vec<Option<Result<Vec<f32>>>> = hiddens.iter().map(|_| None).collect();
        let mut rows = Vec::new();
        let mut taken = Vec::new();
        for (index, hidden) in hiddens.iter().enumerate() {
            match last_row(hidden, width) {
                Ok(last) => {
                    rows.extend(rms_norm(&last, &head.norm, self.hyper.rms_eps));
                    taken.push(index);
                }
                Err(error) => results[index] = Some(Err(error)),
            }
        }
        if !taken.is_empty() {
            let computed =
                meshnet_kernels::on_compute_pool(|| head.output.forward_values(&rows, taken.len()))
                    .and_then(take_parts::<1>);
            match computed {
                Ok([mut logits]) => {
                    if let Some(cap) = self.hyper.config.final_logit_softcap {
                        logits
                            .iter_mut()
                            .for_each(|logit| *logit = cap * (*logit / cap).tanh());
                    }
                    let vocab = logits.len() / taken.len();
                    for (index, own) in taken.iter().zip(logits.chunks_exact(vocab)) {
                        results[*index] = Some(Ok(own.to_vec()));
                    }
                }
                Err(error) => {
                    let reason = error.to_string();
                    for index in taken {
                        results[index] = Some(Err(ModelError::PassFailed(reason.clone())));
                    }
                }
            }
        }
        every_result(results)
    }
}

/// One session's chunk inside a running batch: where its rows sit and what it needs of its
/// own.
struct BatchPart<'a> {
    /// Its place in the batch's inputs.
    index: usize,
    tokens: usize,
    position: usize,
    /// The chunk's rotary tables, one per kind of layer (see [`Hyper::inverse_frequencies`]).
    rotaries: Vec<Rotary>,
    lease: SessionLease<'a>,
}

/// The chunks of a batch once admitted: the results known before the pass (refused chunks),
/// the parts that run, and the parts' hidden rows one after another.
struct AdmittedBatch<'a> {
    /// One per input chunk, in their order; `None` until known.
    results: Vec<Option<Result<Tensor>>>,
    parts: Vec<BatchPart<'a>>,
    rows: Vec<f32>,
}

impl AdmittedBatch<'_> {
    /// Gives each part its own rows of the pass's output, or, when the pass failed, the error
    /// (to the first part; the others learn that another chunk failed), and puts its session
    /// back.
    fn settle(&mut self, outcome: Result<()>, width: usize) {
        let succeeded = outcome.is_ok();
        let mut failure = outcome.err();
        // A failed pass may have left no rows at all: they are sliced only after a success.
        let mut rest = if succeeded { self.rows.as_slice() } else { &[] };
        for part in self.parts.drain(..) {
            let (own, after) = rest.split_at(rest.len().min(part.tokens * width));
            rest = after;
            self.results[part.index] = Some(match failure.take() {
                None if succeeded => hidden_tensor(own.to_vec(), part.tokens, width),
                Some(error) => Err(error),
                None => Err(ModelError::PassFailed(
                    "another session's chunk in the same pass failed".into(),
                )),
            });
            part.lease.finish(succeeded);
        }
    }
}

/// Rotates each session's queries and keys by its own positions, appends its keys and values
/// to its cache for layer `index`, and attends over the cache: the batch's attention output,
/// `[tokens, heads · head_dim]`.
fn attend_parts(
    layer: &Layer,
    heads: Heads,
    parts: &mut [BatchPart<'_>],
    index: usize,
    [mut query, mut key, value]: [Vec<f32>; 3],
) -> Result<Vec<f32>> {
    let tokens: usize = parts.iter().map(|part| part.tokens).sum();
    let query_width = query.len() / tokens.max(1);
    let key_width = key.len() / tokens.max(1);
    let mut attended = Vec::with_capacity(query.len());
    let mut row = 0;
    for part in parts.iter_mut() {
        let rows = row..row + part.tokens;
        row = rows.end;
        let query = &mut query[rows.start * query_width..rows.end * query_width];
        let key = &mut key[rows.start * key_width..rows.end * key_width];
        let value = &value[rows.start * key_width..rows.end * key_width];
        let rotary = &part.rotaries[layer.rope];
        rotary.rotate(query);
        rotary.rotate(key);
        let cached = part.lease.cache().append_rows(index, key, value)?;
        attended.extend(attend(
            heads,
            layer.attention,
            query,
            cached.keys(),
            cached.values(),
            part.position,
        )?);
    }
    Ok(attended)
}

/// Adds `bias` to every `bias.len()`-wide row of `rows`.
fn add_row_bias(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len()) {
        add_in_place(row, bias);
    }
}

/// The one result of a batch of one.
fn only_result<T>(mut results: Vec<Result<T>>) -> Result<T> {
    results.pop().unwrap_or_else(|| {
        Err(ModelError::InvalidSpan(
            "a batch of one gave nothing".into(),
        ))
    })
}

/// A batch's results, in order, once every slot has been filled (an empty one is a failure).
fn every_result<T>(results: Vec<Option<Result<T>>>) -> Vec<Result<T>> {
    results
        .into_iter()
        .map(|result| result.unwrap_or_else(|| Err(ModelError::PassFailed("no result".into()))))
        .collect()
}

/// The last position's hidden values of `[1, tokens, width]`, as f32.
fn last_row(hidden: &Tensor, width: usize) -> Result<Vec<f32>> {
    let tokens = hidden_tokens(hidden, width)?;
    values(
        &hidden
            .to_dtype(DType::F32)?
            .i((.., tokens - 1..tokens, ..))?,
    )
}

/// A tensor's values in row-major order, as f32.
fn values(tensor: &Tensor) -> Result<Vec<f32>> {
    Ok(tensor.flatten_all()?.to_vec1::<f32>()?)
}

/// The number of tokens of a `[1, tokens, width]` chunk and its values as f32.
fn chunk_rows(hidden: &Tensor, width: usize) -> Result<(usize, Vec<f32>)> {
    let tokens = hidden_tokens(hidden, width)?;
    Ok((tokens, values(&hidden.to_dtype(DType::F32)?.contiguous()?)?))
}

/// `[1, tokens, width]` from row-major values.
fn hidden_tensor(values: Vec<f32>, tokens: usize, width: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, (1, tokens, width), &Device::Cpu)?)
}

/// The `N` outputs of a group of projections.
fn take_parts<const N: usize>(parts: Vec<Vec<f32>>) -> Result<[Vec<f32>; N]> {
    let count = parts.len();
    parts.try_into().map_err(|_| {
        ModelError::InvalidSpan(format!("expected {N} projection outputs, got {count}"))
    })
}

impl TokenEmbedder for LlamaSpan {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let table = self
            .embedding
            .as_ref()
            .ok_or(ModelError::PartNotLoaded("token embedding"))?;
        check_token_ids(tokens, self.vocab_size)?;
        let hidden = self.hyper.hidden;
        let mut rows = match table {
            Embedding::Kernel(matrix) => {
                let mut rows = vec![0f32; tokens.len() * hidden];
                for (token, row) in tokens.iter().zip(rows.chunks_exact_mut(hidden)) {
                    matrix.dequantize_row(*token as usize, row)?;
                }
                rows
            }
            Embedding::Candle(table) => {
                let ids = Tensor::new(tokens, &Device::Cpu)?;
                values(&table.embedding(&ids)?.to_dtype(DType::F32)?)?
            }
        };
        if let Some(scale) = self.hyper.config.embedding_scale {
            rows.iter_mut().for_each(|value| *value *= scale);
        }
        hidden_tensor(rows, tokens.len(), hidden)
    }
}

impl LogitsHead for LlamaSpan {
    fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        only_result(self.logits_batch(std::slice::from_ref(hidden)))
    }
}

impl Stage for LlamaSpan {
    fn forward(&self, session: SessionId, position: usize, hidden: Tensor) -> Result<Tensor> {
        self.forward_layers(session, position, &hidden)
    }

    fn end_session(&self, session: SessionId) {
        self.cache.end_session(session);
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        self.cache.rewind(session, len)
    }

    fn name(&self) -> String {
        format!("layers {}", self.layer_range)
    }
}

/// Refuses a spec that names layers past the model's end or holds nothing.
fn check_spec(description: &ModelDescription, spec: &SpanSpec) -> Result<()> {
    if spec.layers.end as usize > description.layers {
        return Err(ModelError::InvalidSpan(format!(
            "layers {}..{} do not fit a model of {} layers",
            spec.layers.start, spec.layers.end, description.layers
        )));
    }
    if spec.layers.is_empty() && !spec.embedding && !spec.head {
        return Err(ModelError::InvalidSpan(
            "a span must hold at least one layer, the embedding or the head".into(),
        ));
    }
    Ok(())
}

/// Reads a span's tensors from one open file, each checked against the shape the metadata
/// implies.
struct SpanLoader<'a> {
    model: &'a GgufModel,
    reader: TensorReader<'a>,
    requantise: bool,
}

impl<'a> SpanLoader<'a> {
    fn description(&self) -> &'a ModelDescription {
        self.model.description()
    }

    fn config(&self) -> &'a ArchitectureConfig {
        self.model.config()
    }

    /// The token embedding table.
    fn embedding(&mut self) -> Result<Embedding> {
        let dims = [self.description().vocab_size, self.description().hidden];
        let name = "token_embd.weight";
        if let Some(matrix) = read_kernel_matrix(&mut self.reader, name, dims, self.requantise)? {
            return Ok(Embedding::Kernel(Arc::new(matrix)));
        }
        let table = load_matrix(&mut self.reader, name, &dims, self.requantise)?;
        Ok(match kernel_matrix(&table)? {
            Some(matrix) => Embedding::Kernel(Arc::new(matrix)),
            None => Embedding::Candle(Arc::new(table)),
        })
    }

    /// One group of projections that read the same input, as one matmul where it can be:
    /// the named tensors one under the other, or one fused tensor split into `widths`.
    fn projections(&mut self, parts: &[(String, [usize; 2])]) -> Result<Projections> {
        let tensors = parts
            .iter()
            .map(|(name, dims)| load_matrix(&mut self.reader, name, dims, self.requantise))
            .collect::<Result<Vec<_>>>()?;
        Projections::new(tensors).map_err(|error| model_error(self.model, &parts[0].0, error))
    }

    /// A fused tensor of `widths` rows in all, used as that many projections.
    fn fused(&mut self, name: String, widths: Vec<usize>, input: usize) -> Result<Projections> {
        let rows = widths.iter().sum();
        let tensor = load_matrix(&mut self.reader, &name, &[rows, input], self.requantise)?;
        Projections::fused(tensor, widths).map_err(|error| model_error(self.model, &name, error))
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        load_vector(&mut self.reader, name, len)
    }

    /// The attention's projections: fused (`attn_qkv`, Phi-3) or three matrices.
    fn query_key_value(&mut self, index: usize) -> Result<Projections> {
        let description = self.description();
        let (hidden, query) = (description.hidden, description.heads * description.head_dim);
        let kv_width = description.kv_heads * description.head_dim;
        let name = |suffix: &str| format!("blk.{index}.{suffix}");
        if self.model.has_tensor(&name("attn_qkv.weight")) {
            return self.fused(
                name("attn_qkv.weight"),
                vec![query, kv_width, kv_width],
                hidden,
            );
        }
        self.projections(&[
            (name("attn_q.weight"), [query, hidden]),
            (name("attn_k.weight"), [kv_width, hidden]),
            (name("attn_v.weight"), [kv_width, hidden]),
        ])
    }

    /// The feed-forward gate and up: two matrices, or one fused `ffn_up` twice as tall with
    /// the gate first (Phi-3).
    fn gate_up(&mut self, index: usize) -> Result<Projections> {
        let (hidden, inner) = (self.description().hidden, self.description().intermediate);
        let name = |suffix: &str| format!("blk.{index}.{suffix}");
        if !self.model.has_tensor(&name("ffn_gate.weight")) {
            return self.fused(name("ffn_up.weight"), vec![inner, inner], hidden);
        }
        self.projections(&[
            (name("ffn_gate.weight"), [inner, hidden]),
            (name("ffn_up.weight"), [inner, hidden]),
        ])
    }

    /// The biases of the query, key and value projections, one after another.
    fn query_key_value_bias(&mut self, index: usize) -> Result<Option<Vec<f32>>> {
        if !self.config().qkv_bias {
            return Ok(None);
        }
        let description = self.description();
        let query = description.heads * description.head_dim;
        let kv_width = description.kv_heads * description.head_dim;
        let mut bias = self.vector(&format!("blk.{index}.attn_q.bias"), query)?;
        bias.extend(self.vector(&format!("blk.{index}.attn_k.bias"), kv_width)?);
        bias.extend(self.vector(&format!("blk.{index}.attn_v.bias"), kv_width)?);
        Ok(Some(bias))
    }

    fn head_norms(&mut self, index: usize) -> Result<Option<HeadNorms>> {
        if !self.config().qk_norm {
            return Ok(None);
        }
        let head_dim = self.description().head_dim;
        Ok(Some(HeadNorms {
            query: self.vector(&format!("blk.{index}.attn_q_norm.weight"), head_dim)?,
            key: self.vector(&format!("blk.{index}.attn_k_norm.weight"), head_dim)?,
        }))
    }

    /// The norm after a Gemma block's attention (`post_attention_norm`) or feed-forward
    /// (`post_ffw_norm`) output.
    fn post_norm(&mut self, index: usize, name: &str) -> Result<Option<Vec<f32>>> {
        if !self.config().post_norms {
            return Ok(None);
        }
        let hidden = self.description().hidden;
        self.vector(&format!("blk.{index}.{name}.weight"), hidden)
            .map(Some)
    }

    /// Block `index`'s weights.
    fn layer(&mut self, index: usize) -> Result<Layer> {
        let description = self.description();
        let (hidden, inner) = (description.hidden, description.intermediate);
        let query = description.heads * description.head_dim;
        let name = |suffix: &str| format!("blk.{index}.{suffix}");
        let attention = AttentionRule {
            scale: self.config().attention_scale,
            window: self.config().window(index),
        };
        let rope = usize::from(self.config().is_sliding(index));
        Ok(Layer {
            attention_norm: self.vector(&name("attn_norm.weight"), hidden)?,
            query_key_value: self.query_key_value(index)?,
            query_key_value_bias: self.query_key_value_bias(index)?,
            head_norms: self.head_norms(index)?,
            attention_output: self.projections(&[(name("attn_output.weight"), [hidden, query])])?,
            post_attention_norm: self.post_norm(index, "post_attention_norm")?,
            ffn_norm: self.vector(&name("ffn_norm.weight"), hidden)?,
            gate_up: self.gate_up(index)?,
            down: self.projections(&[(name("ffn_down.weight"), [hidden, inner])])?,
            post_ffn_norm: self.post_norm(index, "post_ffw_norm")?,
            attention,
            rope,
        })
    }

    /// The final norm and LM head (sharing the embedding table when the model ties them).
    fn head(&mut self, embedding: Option<&Embedding>) -> Result<Head> {
        let description = self.description();
        let (hidden, vocab) = (description.hidden, description.vocab_size);
        let norm = self.vector("output_norm.weight", hidden)?;
        let output = match (embedding, description.tied_embeddings) {
            (Some(Embedding::Kernel(shared)), true) => Projections::shared(Arc::clone(shared)),
            (Some(Embedding::Candle(shared)), true) => {
                Projections::candle_shared(Arc::clone(shared))
                    .map_err(|error| model_error(self.model, "token_embd.weight", error))?
            }
            _ => self.projections(&[("output.weight".to_owned(), [vocab, hidden])])?,
        };
        Ok(Head { norm, output })
    }

    /// The run-time hyper-parameters, with the rotary tables of every kind of layer.
    fn hyper(&mut self) -> Result<Hyper> {
        let description = self.description();
        let head_dim = description.head_dim;
        let config = self.config().clone();
        let mut inverse_frequencies = Vec::new();
        let ropes = std::iter::once(&config.global_rope)
            .chain(config.sliding.as_ref().map(|sliding| &sliding.rope));
        for rope in ropes {
            let factors = match &rope.factors_tensor {
                Some(name) => self.vector(name, head_dim / 2)?,
                None => Vec::new(),
            };
            inverse_frequencies.push(rope.inverse_frequencies(head_dim, &factors));
        }
        Ok(Hyper {
            hidden: description.hidden,
            heads: Heads {
                heads: description.heads,
                kv_heads: description.kv_heads,
                head_dim,
            },
            rms_eps: description.rms_eps as f32,
            config,
            inverse_frequencies,
        })
    }
}

/// A tensor that loaded but could not become a matmul, named with its file.
fn model_error(model: &GgufModel, tensor: &str, error: ModelError) -> ModelError {
    ModelError::TensorData {
        path: model.path().to_path_buf(),
        tensor: tensor.to_owned(),
        reason: error.to_string(),
    }
}

/// Loads a matrix, requantising it to Q8_0 when asked (and when its rows allow it).
fn load_matrix(
    reader: &mut TensorReader<'_>,
    name: &str,
    dims: &[usize],
    requantise: bool,
) -> Result<QTensor> {
    let tensor = reader.load(name, dims)?;
    let row = dims.last().copied().unwrap_or(0);
    let requantise =
        requantise && tensor.dtype() != GgmlDType::Q8_0 && row % GgmlDType::Q8_0.block_size() == 0;
    if !requantise {
        return Ok(tensor);
    }
    let convert = || -> candle_core::Result<QTensor> {
        let dense = tensor.dequantize(&Device::Cpu)?;
        QTensor::quantize(&dense, GgmlDType::Q8_0)
    };
    convert().map_err(|error| reader.data_error(name, error))
}

/// Loads a vector (a norm's weight) as f32.
fn load_vector(reader: &mut TensorReader<'_>, name: &str, len: usize) -> Result<Vec<f32>> {
    let tensor = reader.load(name, &[len])?;
    tensor
        .dequantize(&Device::Cpu)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|error| reader.data_error(name, error))
}

/// A model loaded as consecutive spans, ready to be joined into a [`crate::LayerRoute`]: the
/// single-process reference for a split mesh.
#[derive(Debug)]
pub struct SplitModel<S = LlamaSpan> {
    spans: Vec<S>,
}

/// The specs of spans `[0..b1)`, `[b1..b2)`, …, `[bn..layers)`, the first with the embedding and
/// the last with the head. `boundaries` must be strictly increasing and inside `1..layers`;
/// empty means one span.
pub fn split_specs(
    layers: usize,
    boundaries: &[usize],
    quantization: Option<Quantization>,
    kv_budget_bytes: usize,
) -> Result<Vec<SpanSpec>> {
    let mut edges = Vec::with_capacity(boundaries.len() + 2);
    edges.push(0);
    for &boundary in boundaries {
        let previous = edges.last().copied().unwrap_or(0);
        if boundary <= previous || boundary >= layers {
            return Err(ModelError::InvalidSpan(format!(
                "boundary {boundary} must be greater than {previous} and less than {layers}, \
                 the number of layers"
            )));
        }
        edges.push(boundary);
    }
    edges.push(layers);
    let count = edges.len() - 1;
    Ok(edges
        .windows(2)
        .enumerate()
        .map(|(index, pair)| SpanSpec {
            layers: LayerSpan::new(pair[0] as u32, pair[1] as u32),
            embedding: index == 0,
            head: index + 1 == count,
            quantization,
            kv_budget_bytes,
        })
        .collect())
}

impl SplitModel<LlamaSpan> {
    /// Loads a Llama GGUF model as spans split at `boundaries` (see [`split_specs`]).
    pub fn load(
        model: &GgufModel,
        boundaries: &[usize],
        quantization: Option<Quantization>,
        kv_budget_bytes: usize,
    ) -> Result<Self> {
        let specs = split_specs(
            model.description().layers,
            boundaries,
            quantization,
            kv_budget_bytes,
        )?;
        let spans = specs
            .iter()
            .map(|spec| LlamaSpan::load(model, spec))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { spans })
    }
}

impl<S: Stage + TokenEmbedder + LogitsHead> SplitModel<S> {
    /// Wraps spans that are already loaded, in order.
    pub fn from_spans(spans: Vec<S>) -> Self {
        Self { spans }
    }

    /// The spans in order.
    pub fn spans(&self) -> &[S] {
        &self.spans
    }

    /// A route over the spans with the given boundary policy.
    pub fn route(
        &self,
        boundary: crate::generation::BoundaryPolicy,
    ) -> Result<crate::LayerRoute<'_>> {
        let (Some(first), Some(last)) = (self.spans.first(), self.spans.last()) else {
            return Err(ModelError::InvalidSpan("no spans loaded".into()));
        };
        Ok(crate::LayerRoute {
            embedder: first,
            stages: self.spans.iter().map(|span| span as &dyn Stage).collect(),
            head: last,
            boundary,
        })
    }
}
