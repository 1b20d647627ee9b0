//! The contract between the HTTP layer and whatever produces the text.

use futures::future::BoxFuture;
use meshnet_types::SamplingConfig;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

/// What the engine serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The model id clients must name in `model` (e.g. `"gpt2"`).
    pub id: String,
    /// When the model became available, in unix seconds.
    pub created: u64,
    /// Who publishes the model, shown as `owned_by`.
    pub owned_by: String,
    /// The context window in tokens (prompt plus completion).
    pub context_length: usize,
    /// The model's family (GGUF `general.architecture`: `llama`, `qwen2`, `gemma3`, …).
    pub family: String,
    /// The weight format served (`q4_1`, `q8_0`, `q4_k_m`, …).
    pub quantization: String,
    /// How many of the file's tensors are stored in each type (`"Q4_K": 27`, …).
    pub tensor_types: std::collections::BTreeMap<String, usize>,
    /// How many token ids the model's vocabulary has: valid ids are `0..vocab_size`.
    pub vocab_size: usize,
}

/// One chat turn as received.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatTurn {
    /// `"system"`, `"user"`, `"assistant"` or `"tool"` (an OpenAI `"developer"` turn arrives
    /// as `"system"`).
    pub role: String,
    /// The turn's text; multiple text parts are joined with `\n`. Empty for an assistant
    /// turn that only made calls (`null` content).
    pub content: String,
    /// The calls an assistant turn made, in order (none for other turns).
    pub tool_calls: Vec<ToolCallTurn>,
    /// The id of the call a `tool` turn answers.
    pub tool_call_id: Option<String>,
}

impl ChatTurn {
    /// A turn of `role` with text `content` and no tool use.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

/// A call an assistant turn made, as the client sent it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallTurn {
    /// The call's id.
    pub id: String,
    /// The function called.
    pub name: String,
    /// Its arguments: JSON text (checked to be JSON).
    pub arguments: String,
}

/// A function the client offers the model (`tools[i]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// `function.name`: 1 to 64 letters, digits, `_` or `-`, unique in the request.
    pub name: String,
    /// `function.parameters`: the JSON Schema of its arguments (an empty object schema when
    /// the client gave none).
    pub parameters: serde_json::Value,
    /// The whole `{"type": "function", "function": {...}}` object as the client wrote it, so
    /// templates see its keys in the client's order.
    pub json: String,
}

/// Which calls the model is asked to make (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// `"auto"`: calls or text, as the model decides.
    Auto,
    /// `"required"`: at least one call.
    Required,
    /// `{"type": "function", "function": {"name"}}`: a call of this function.
    Function(String),
}

/// The tools a chat request offers and what it asks of them; absent when it offers none or
/// sets `tool_choice` to `"none"`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    /// The functions offered, in the request's order.
    pub tools: Vec<ToolSpec>,
    /// Which calls are asked for.
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true): whether an answer may hold several calls.
    pub parallel: bool,
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// A conversation (from `/v1/chat/completions`); the engine applies its chat template.
    Chat(Vec<ChatTurn>),
    /// Raw text (from `/v1/completions`), continued as is.
    Text(String),
    /// Token ids (from `/v1/completions`), all in the vocabulary, at least one, continued
    /// exactly as given (no BOS is added).
    Tokens(Vec<u32>),
}

/// The shape the generated text must have: a request's `response_format`.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ResponseFormat {
    /// Free text: `{"type": "text"}`, or no `response_format`.
    #[default]
    Text,
    /// Any JSON object: `{"type": "json_object"}`.
    JsonObject,
    /// A JSON value valid under a schema: `{"type": "json_schema", "json_schema": {...}}`.
    JsonSchema(JsonSchemaFormat),
}

/// A `response_format` of type `json_schema`, as received.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonSchemaFormat {
    /// The format's name (1 to 64 of `a-z A-Z 0-9 _ -`).
    pub name: String,
    /// What the format is for, if given.
    pub description: Option<String>,
    /// The JSON Schema, a JSON object; not yet checked for what the engine can compile.
    pub schema: Value,
    /// The client's `strict` (default false). The output is constrained to the schema either
    /// way.
    pub strict: bool,
}

/// A validated generation request handed to the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    /// The response id (`chatcmpl-…` or `cmpl-…`), for the engine's logs.
    pub request_id: String,
    /// What to generate from.
    pub prompt: PromptInput,
    /// The most tokens to generate; `None` means up to the end of the context window.
    pub max_tokens: Option<usize>,
    /// How to choose tokens: temperature in `0.0..=2.0` (`0.0` is greedy), `top_p` in
    /// `(0.0, 1.0]`, `top_k` at least 1, `min_p` in `0.0..=1.0`, the presence and frequency
    /// penalties in `-2.0..=2.0`, biases in `-100.0..=100.0` on token ids of the vocabulary
    /// (`-100` bans the token), and the seed (random when the client gave none).
    pub sampling: SamplingConfig,
    /// When set, report each generated token's log-probability with this many (0 to 20) of
    /// the most likely tokens at its step, as [`EngineEvent::Logprobs`].
    pub logprobs: Option<usize>,
    /// Echo the prompt before each choice's text (`/v1/completions`' `echo`), with its tokens'
    /// log-probabilities when `logprobs` is set: see [`EngineEvent::Prompt`].
    pub echo: bool,
    /// How many choices to generate (`1..=8`): each samples its own continuation of the
    /// prompt (choice `i` with seed `sampling.seed + i`), all sharing one prefill.
    pub n: usize,
    /// Up to four non-empty stop sequences; generation ends before the first one produced (which
    /// is not part of the output).
    pub stop: Vec<String>,
    /// The tools offered (chat only), when the model may call any.
    pub tools: Option<ToolRequest>,
    /// The shape the text must have; the engine refuses a schema it cannot compile (400
    /// naming `response_format`).
    pub response_format: ResponseFormat,
    /// The most tokens drafted per trip through the mesh (speculative decoding), `0..=64`;
    /// `0` turns drafting off for this request, `None` leaves it to the engine. An engine
    /// drafts no more than it is configured to.
    pub max_draft: Option<usize>,
}

/// One of the most likely tokens at a step, in OpenAI's `top_logprobs` shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    /// The token's text (with U+FFFD where it holds part of a character).
    pub token: String,
    /// Its log-probability: the log-softmax of the model's raw logits.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
}

/// A generated token's log-probability, in OpenAI's `logprobs.content` shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The token's text (with U+FFFD where it holds part of a character).
    pub token: String,
    /// Its log-probability: the log-softmax of the model's raw logits, before bias,
    /// penalties, temperature and truncation.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at its step, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// The log-probabilities of a prompt's tokens, each after the ones before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    /// The first token's text, which has no log-probability (nothing comes before it).
    pub first_token: String,
    /// Every later token's entry, in order.
    pub scored: Vec<TokenLogprob>,
}

/// What the engine streams back.
#[derive(Debug)]
pub enum EngineEvent {
    /// The prompt, echoed before anything else when the request set `echo`: its text (the
    /// prompt's own, or its tokens' text), with its tokens' log-probabilities when
    /// `logprobs` was set too.
    Prompt {
        /// The prompt's text.
        text: String,
        /// Its tokens' log-probabilities, when asked for.
        logprobs: Option<PromptLogprobs>,
    },
    /// The log-probabilities of the tokens whose text the next `Delta` completes (only when
    /// requested); those of a token whose text is cut off by a stop sequence are never sent.
    Logprobs(Vec<TokenLogprob>),
    /// New text, never cut in the middle of a UTF-8 character.
    Delta(String),
    /// The model began a call (only when the request offered tools): its place among the
    /// answer's calls (from 0), a new id, and the function's name.
    ToolCallStart {
        /// The call's place among the answer's calls.
        index: usize,
        /// The call's id (`call_…`).
        id: String,
        /// The function called.
        name: String,
    },
    /// More of a call's arguments (JSON text, appended to what came before).
    ToolCallArguments {
        /// The call's place among the answer's calls.
        index: usize,
        /// The next piece of its arguments.
        text: String,
    },
    /// The generation ended normally; no further events follow.
    Finished {
        /// Why it ended.
        reason: FinishReason,
        /// How many tokens were generated in total.
        completion_tokens: usize,
    },
    /// The generation failed; no further events follow.
    Failed(EngineError),
}

/// Why a generation ended. Serialises as `"stop"` / `"length"` / `"tool_calls"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-text token or a stop sequence.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
    /// The model ended its answer after calling tools.
    ToolCalls,
}

impl FinishReason {
    /// The OpenAI spelling: `"stop"`, `"length"` or `"tool_calls"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
        }
    }
}

/// An accepted generation: the prompt's token count, the members it runs on and one event
/// stream per choice.
///
/// Dropping a choice's receiver cancels that choice (the engine notices and frees its session
/// everywhere).
#[derive(Debug)]
pub struct EngineStream {
    /// How many tokens the prompt took after templating and tokenization.
    pub prompt_tokens: usize,
    /// The members the generation runs on, in the order its activations pass through them,
    /// as chosen when it started (a failover may later move a member's layers to another);
    /// empty when the engine does not name them.
    pub route: Vec<RouteMember>,
    /// One receiver per choice, in choice order (`n` of them): deltas, then exactly one
    /// `Finished` or `Failed`.
    pub choices: Vec<mpsc::Receiver<EngineEvent>>,
}

/// One member on a generation's route and the layers it runs for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteMember {
    /// The member's peer id (`12D3KooW…`).
    pub peer: String,
    /// The transformer layers it runs: `start` inclusive, `end` exclusive.
    pub layers: std::ops::Range<u32>,
}

/// Something that turns prompts into text: the tracker peer's view of the mesh.
pub trait CompletionEngine: Send + Sync + 'static {
    /// The model this engine serves.
    fn model_info(&self) -> ModelInfo;

    /// Starts a generation once it is admitted: it may wait for a slot in a bounded queue
    /// (dropping the future gives up its place), then checks the request and reserves the
    /// slot; the generation runs elsewhere.
    fn start(&self, request: EngineRequest) -> BoxFuture<'_, Result<EngineStream, EngineError>>;

    /// The token ids of `text` as the model's tokenizer reads it: control tokens written in
    /// it (`<|im_start|>`) become their ids, and with `add_special` BOS (and EOS) are added
    /// as the model's file says.
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineError>;

    /// The text of `tokens` (all in the vocabulary), control tokens written out.
    fn detokenize(&self, tokens: &[u32]) -> Result<String, EngineError>;
}

/// Why the engine refused or abandoned a generation.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request cannot be served as asked (e.g. the prompt plus `max_tokens` exceeds the
    /// context window). Answered with 400.
    #[error("{message}")]
    InvalidRequest {
        /// The request field at fault, if one is.
        param: Option<String>,
        /// What is wrong, for the client.
        message: String,
    },
    /// All generation slots are taken and the queue for them is full, or the request waited
    /// in it for as long as allowed. Answered with 429 and `Retry-After`.
    #[error("the mesh is busy: {reason}; retry in {retry_after_seconds} s")]
    Busy {
        /// What is full, for the client.
        reason: String,
        /// Suggested wait before retrying.
        retry_after_seconds: u64,
    },
    /// The peers currently online do not cover every layer of the model. Answered with 503 and
    /// `Retry-After`.
    #[error("the mesh does not cover the model: {0}")]
    NotCovered(String),
    /// A peer on the route failed. Answered with 502.
    #[error("a peer on the route failed: {0}")]
    Upstream(String),
    /// A peer on the route failed and every failover to other peers failed too (or no peer
    /// took over its layers in time). Answered with 503 and `Retry-After`; the message names
    /// the failed hop.
    #[error("the route failed and could not be repaired: {0}")]
    RouteLost(String),
    /// Anything else. Answered with 500.
    #[error("internal error: {0}")]
    Internal(String),
}
