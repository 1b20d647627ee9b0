//! The OpenAI-style HTTP API of a meshnet tracker peer.
//!
//! A tracker peer answers users with the endpoints OpenAI clients expect, while the text itself
//! comes from the mesh. This crate knows nothing about the model or the network: it talks to a
//! [`CompletionEngine`] trait object, and [`openai_router`] turns one into an [`axum::Router`]
//! serving
//!
//! - `GET /v1/models` and `GET /v1/models/{id}`: the one model the mesh runs;
//! - `POST /v1/chat/completions`: chat turns in, text out, whole or as server-sent events;
//! - `POST /v1/completions`: raw text or token ids continued, whole or streamed;
//! - `POST /tokenize` and `POST /detokenize`: the model's tokenizer, as llama-server offers it.
//!
//! Request bodies are parsed and validated here, so the engine only ever sees a well-formed
//! [`EngineRequest`]; every failure, including the engine's own [`EngineError`]s, reaches the
//! client in the OpenAI error shape `{"error": {"message", "type", "param", "code"}}` with the
//! status given by [`ApiError`]'s single `IntoResponse` mapping.
//!
//! A generation is owned by its [`EngineStream`]'s receiver, and the receiver by the response:
//! when a client disconnects, the response future or body is dropped, the receiver with it, and
//! the engine sees its sender closed and frees the session across the mesh.
//!
//! Completion answers name the members serving them in the [`ROUTE_HEADER`] extension header,
//! from the engine's [`EngineStream::route`].
//!
//! With `--api-keys`, [`require_api_keys`] puts an [`ApiKeyGuard`] before the routes: a
//! bearer key of its book, within its per-minute limits, or 401/429.
//!
//! `docs/openai-api.md` describes the wire format for clients.

mod engine;
mod error;
mod guard;
mod request;
mod response;
mod route;
mod router;

pub use engine::{
    ChatTurn, CompletionEngine, EngineError, EngineEvent, EngineRequest, EngineStream,
    FinishReason, JsonSchemaFormat, ModelInfo, PromptInput, PromptLogprobs, ResponseFormat,
    RouteMember, TokenLogprob, ToolCallTurn, ToolChoice, ToolRequest, ToolSpec, TopLogprob,
};
pub use error::{ApiError, ErrorBody, ErrorDetail, NOT_COVERED_RETRY_AFTER_SECONDS};
pub use guard::{ApiKeyGuard, require_api_keys};
pub use request::MAX_BODY_BYTES;
pub use request::tools::MAX_TOOLS;
pub use request::{MAX_CHOICES, MAX_STOP_SEQUENCES};
pub use route::ROUTE_HEADER;
pub use router::openai_router;
