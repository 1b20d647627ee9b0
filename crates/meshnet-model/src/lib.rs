//! Real layer execution for meshnet.
//!
//! A peer runs a contiguous span of a model's transformer layers. This crate loads such spans
//! of Llama-family models from GGUF files with candle ([`LlamaSpan`]), reading only the
//! tensors a span needs; keeps each session's keys and values in a [`KvStore`] beside the
//! weights; rebuilds the model's tokenizer and chat format from the file's metadata
//! ([`ModelTokenizer`], [`ChatTemplate`]) and turns generated ids back into text as they come
//! ([`IncrementalDecoder`]); samples tokens apart from the model ([`Sampler`]), within the
//! tokens a [`TokenConstraint`] allows when a request has one (structured output);
//! and runs the one generation loop ([`generate`]) over a [`LayerRoute`] of [`Stage`]s, with the
//! hand-off between stages either f32 (bit-identical to one process) or bfloat16 as on the
//! wire ([`BoundaryPolicy`]).
//!
//! [`Model`] opens either family behind one type, loads [`ModelSpan`]s of it and builds its
//! [`TextSide`] (tokenizer, chat format, stop tokens).
//!
//! It is synchronous and does no I/O besides reading model files.

mod attention;
mod batch;
mod chat;
mod detokenizer;
mod error;
mod family;
mod generation;
mod gguf;
mod gguf_check;
mod gpt2;
mod known_models;
mod kv_cache;
mod layer_math;
mod linear;
mod llama;
mod metadata;
mod model;
mod sampling;
mod speculation;
mod strftime;
mod template_env;
mod tokenizer;
mod tool_calls;

pub use batch::BatchItem;
pub use chat::{
    BuiltInFormat, ChatMessage, ChatTemplate, IM_END, IM_START, SpecialTokens, TemplateSource,
};
pub use detokenizer::IncrementalDecoder;
pub use error::{ModelError, Result};
pub use family::{
    Activation, ArchitectureConfig, Family, RopeFrequencies, RopeStyle, SlidingWindow,
};
pub use generation::{
    BoundaryPolicy, FinishReason, Generation, GenerationRequest, LayerRoute, LogitsHead, Stage,
    TokenConstraint, TokenEmbedder, decode_observed, generate, generate_observed,
};
pub use gguf::{GgufModel, ModelDescription, WeightBytes};
pub use gguf_check::{
    GgufLayout, MAX_METADATA_MEMORY, TensorEntry, check_declared_sizes, check_gguf_layout,
    ggml_type_name, loadable_type, read_gguf_header,
};
pub use gpt2::{GPT2_CONFIG_FILE, GPT2_WEIGHTS_FILE, Gpt2Config, Gpt2Model, Gpt2Span};
pub use known_models::{DEFAULT_MODEL_NAME, KNOWN_MODELS, KnownModel, PinnedWheel, known_model};
pub use kv_cache::{CACHED_VALUE_BYTES, DEFAULT_KV_BUDGET_BYTES, KvStore, SessionCache, SessionId};
pub use llama::{LlamaSpan, SpanSpec, SplitModel, split_specs};
pub use model::{GPT2_TOKENIZER_FILE, Model, ModelSpan, TextSide};
pub use sampling::{
    BAN_BIAS, Sampler, SamplingConfig, StopConditions, TokenLogprobs, TokenMask, argmax,
    token_logprobs,
};
pub use speculation::{
    DEFAULT_MAX_DRAFT, DraftGate, DraftLength, MAX_NGRAM, MIN_NGRAM, SpeculationStats,
    prompt_lookup,
};
pub use tokenizer::{EncodeOptions, ModelTokenizer};
pub use tool_calls::{
    ParsedAnswer, ParsedCall, ToolCall, ToolCallParser, ToolDefinition, ToolEvent, ToolFormat,
    generic_tools_prompt, parse_answer,
};

/// File name of the default model, SmolLM2-135M-Instruct quantised to Q4_1.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The directory models are fetched into: `$MESHNET_MODELS`, or `~/.cache/meshnet`.
pub fn models_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("MESHNET_MODELS").filter(|d| !d.is_empty()) {
        return dir.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    std::path::Path::new(&home).join(".cache").join("meshnet")
}

/// Where `scripts/fetch-model.sh` puts the default model.
pub fn default_model_path() -> std::path::PathBuf {
    models_dir().join(DEFAULT_MODEL_FILE)
}
