//! The axum router: handlers for the four endpoints, the SSE stream and the per-request log line.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::Serialize;

use crate::engine::{
    CompletionEngine, EngineError, EngineEvent, EngineRequest, EngineStream, FinishReason,
    TokenLogprob,
};
use crate::error::ApiError;
use crate::request::{self, Endpoint};
use crate::response::{DecodedText, Envelope, ModelList, ModelObject, TokenList, Usage};
use crate::route;

/// The largest request body accepted, in bytes; larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// How often an idle stream sends an SSE comment so proxies keep the connection open.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);

type SharedEngine = Arc<dyn CompletionEngine>;

/// The router: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`,
/// `POST /v1/completions`, and llama-server's `POST /tokenize` and `POST /detokenize`.
///
/// Unknown paths answer 404 and wrong methods 405, both in the OpenAI error shape. The router
/// has its own fallback, so routers merged into it must not have one.
pub fn openai_router(engine: Arc<dyn CompletionEngine>) -> Router {
    Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(retrieve_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(unknown_url)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(engine)
}

async fn list_models(State(engine): State<SharedEngine>) -> Json<ModelList> {
    Json(ModelList::new(vec![ModelObject::from(engine.model_info())]))
}

async fn retrieve_model(
    State(engine): State<SharedEngine>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<ModelObject>, ApiError> {
    let Path(id) = path.map_err(|e| ApiError::invalid(Some("model"), e.body_text()))?;
    let info = engine.model_info();
    if id != info.id {
        return Err(ApiError::ModelNotFound(id));
    }
    Ok(Json(ModelObject::from(info)))
}

async fn chat_completions(
    State(engine): State<SharedEngine>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(engine, Endpoint::Chat, body).await
}

async fn completions(
    State(engine): State<SharedEngine>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    complete(engine, Endpoint::Text, body).await
}

/// `{"content", "add_special"}` in, `{"tokens": [...]}` out.
async fn tokenize(
    State(engine): State<SharedEngine>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenList>, ApiError> {
    let (content, add_special) = request::parse_tokenize(&body.map_err(body_error)?)?;
    let tokens = engine.tokenize(&content, add_special)?;
    Ok(Json(TokenList { tokens }))
}

/// `{"tokens": [...]}` in, `{"content"}` out.
async fn detokenize(
    State(engine): State<SharedEngine>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DecodedText>, ApiError> {
    let vocab_size = engine.model_info().vocab_size;
    let tokens = request::parse_detokenize(&body.map_err(body_error)?, vocab_size)?;
    let content = engine.detokenize(&tokens)?;
    Ok(Json(DecodedText { content }))
}

async fn unknown_url(method: Method, uri: Uri) -> ApiError {
    ApiError::UnknownUrl {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// Validates the body, starts the generation and answers whole or streamed.
async fn complete(
    engine: SharedEngine,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = new_request_id(endpoint);
    let mut log = RequestLog::new(id.clone(), endpoint);
    let info = engine.model_info();

    let parsed = match body
        .map_err(body_error)
        .and_then(|body| request::parse(endpoint, &body, &info.id, info.vocab_size))
    {
        Ok(parsed) => parsed,
        Err(error) => return log.reject(error),
    };
    log.stream = parsed.stream;

    let envelope = Envelope {
        endpoint,
        id: id.clone(),
        created: unix_now(),
        model: info.id,
        include_usage: parsed.include_usage,
        logprobs: parsed.logprobs.is_some(),
    };
    let request = EngineRequest {
        request_id: id,
        prompt: parsed.prompt,
        max_tokens: parsed.max_tokens,
        temperature: parsed.temperature,
        top_p: parsed.top_p,
        seed: parsed.seed,
        top_k: parsed.top_k,
        min_p: parsed.min_p,
        presence_penalty: parsed.presence_penalty,
        frequency_penalty: parsed.frequency_penalty,
        logit_bias: parsed.logit_bias,
        logprobs: parsed.logprobs,
        stop: parsed.stop,
    };
    let mut stream = match engine.start(request).await {
        Ok(stream) => stream,
        Err(error) => return log.reject(error.into()),
    };
    log.prompt_tokens = stream.prompt_tokens;
    let route = std::mem::take(&mut stream.route);

    let response = if parsed.stream {
        stream_response(envelope, stream, log)
    } else {
        whole_response(envelope, stream, log).await
    };
    route::with_route(response, &route)
}

/// Collects the generation and answers it in one JSON body. Dropping this future drops the
/// receiver, which cancels the generation.
async fn whole_response(envelope: Envelope, stream: EngineStream, mut log: RequestLog) -> Response {
    let EngineStream {
        prompt_tokens,
        mut events,
        ..
    } = stream;
    let mut text = String::new();
    let mut logprobs = Vec::new();
    loop {
        match events.recv().await {
            Some(EngineEvent::Logprobs(entries)) => logprobs.extend(entries),
            Some(EngineEvent::Delta(delta)) => text.push_str(&delta),
            Some(EngineEvent::Finished {
                reason,
                completion_tokens,
            }) => {
                drop(events);
                log.finish(reason, completion_tokens);
                let usage = Usage::new(prompt_tokens, completion_tokens);
                let answer = envelope.completion(&text, &logprobs, reason, usage);
                return Json(answer).into_response();
            }
            Some(EngineEvent::Failed(error)) => return log.reject(error.into()),
            None => return log.reject(ended_without_finishing()),
        }
    }
}

/// Answers with an SSE stream that owns the receiver: when the client goes away, hyper drops
/// the body, which drops the receiver, which cancels the generation.
fn stream_response(envelope: Envelope, stream: EngineStream, log: RequestLog) -> Response {
    let phase = match envelope.endpoint {
        Endpoint::Chat => Phase::Role,
        Endpoint::Text => Phase::Generating,
    };
    let state = SseState {
        events: Some(stream.events),
        prompt_tokens: stream.prompt_tokens,
        envelope,
        phase,
        pending_logprobs: Vec::new(),
        log,
    };
    let events = futures::stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok::<_, Infallible>(event), state))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE_INTERVAL))
        .into_response()
}

/// Where a stream is in its fixed sequence of events.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Next: the chat role chunk.
    Role,
    /// Next: whatever the engine sends.
    Generating,
    /// Next: the usage chunk.
    Usage(Usage),
    /// Next: `[DONE]`.
    Done,
    /// Nothing more.
    Ended,
}

struct SseState {
    events: Option<tokio::sync::mpsc::Receiver<EngineEvent>>,
    prompt_tokens: usize,
    envelope: Envelope,
    phase: Phase,
    /// Log-probabilities of tokens whose text has not been sent yet.
    pending_logprobs: Vec<TokenLogprob>,
    log: RequestLog,
}

impl SseState {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            match self.phase {
                Phase::Role => {
                    self.phase = Phase::Generating;
                    return Some(json_event(&self.envelope.role_chunk()));
                }
                Phase::Generating => {
                    let events = self.events.as_mut()?;
                    match events.recv().await {
                        Some(EngineEvent::Logprobs(entries)) => {
                            self.pending_logprobs.extend(entries);
                        }
                        Some(EngineEvent::Delta(text)) if text.is_empty() => continue,
                        Some(EngineEvent::Delta(text)) => {
                            let logprobs = std::mem::take(&mut self.pending_logprobs);
                            let chunk = self.envelope.text_chunk(&text, &logprobs);
                            return Some(json_event(&chunk));
                        }
                        Some(EngineEvent::Finished {
                            reason,
                            completion_tokens,
                        }) => {
                            self.events = None;
                            self.log.finish(reason, completion_tokens);
                            self.phase = if self.envelope.include_usage {
                                Phase::Usage(Usage::new(self.prompt_tokens, completion_tokens))
                            } else {
                                Phase::Done
                            };
                            let logprobs = std::mem::take(&mut self.pending_logprobs);
                            let chunk = self.envelope.finish_chunk(reason, &logprobs);
                            return Some(json_event(&chunk));
                        }
                        Some(EngineEvent::Failed(error)) => return Some(self.fail(error.into())),
                        None => return Some(self.fail(ended_without_finishing())),
                    }
                }
                Phase::Usage(usage) => {
                    self.phase = Phase::Done;
                    return Some(json_event(&self.envelope.usage_chunk(usage)));
                }
                Phase::Done => {
                    self.phase = Phase::Ended;
                    return Some(Event::default().data("[DONE]"));
                }
                Phase::Ended => return None,
            }
        }
    }

    /// Ends the stream with an error event (and no `[DONE]`).
    fn fail(&mut self, error: ApiError) -> Event {
        self.events = None;
        self.phase = Phase::Ended;
        let event = json_event(&error.body());
        self.log.fail(&error);
        event
    }
}

fn json_event(value: &impl Serialize) -> Event {
    match serde_json::to_string(value) {
        Ok(json) => Event::default().data(json),
        Err(error) => {
            tracing::error!(%error, "could not serialise a stream event");
            Event::default().data(
                r#"{"error":{"message":"could not serialise a stream event","type":"server_error","param":null,"code":"internal_error"}}"#,
            )
        }
    }
}

fn body_error(rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge {
            limit: MAX_BODY_BYTES,
        }
    } else {
        ApiError::invalid(None, rejection.body_text())
    }
}

fn ended_without_finishing() -> ApiError {
    EngineError::Internal("the generation ended without finishing".to_owned()).into()
}

fn new_request_id(endpoint: Endpoint) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Text => "cmpl",
    };
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// Writes the request's one info line when dropped, however the request ended: finished,
/// rejected, failed, or cancelled by the client going away.
struct RequestLog {
    id: String,
    endpoint: Endpoint,
    stream: bool,
    started: Instant,
    prompt_tokens: usize,
    completion_tokens: usize,
    outcome: String,
}

impl RequestLog {
    fn new(id: String, endpoint: Endpoint) -> Self {
        Self {
            id,
            endpoint,
            stream: false,
            started: Instant::now(),
            prompt_tokens: 0,
            completion_tokens: 0,
            outcome: "cancelled".to_owned(),
        }
    }

    fn finish(&mut self, reason: FinishReason, completion_tokens: usize) {
        reason.as_str().clone_into(&mut self.outcome);
        self.completion_tokens = completion_tokens;
    }

    fn fail(&mut self, error: &ApiError) {
        self.outcome = format!("error {}", error.status().as_u16());
    }

    /// Records the error and answers with it.
    fn reject(mut self, error: ApiError) -> Response {
        self.fail(&error);
        error.into_response()
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let endpoint = match self.endpoint {
            Endpoint::Chat => "chat",
            Endpoint::Text => "completions",
        };
        tracing::info!(
            id = %self.id,
            endpoint,
            stream = self.stream,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            finish_reason = %self.outcome,
            elapsed_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            "completion request"
        );
    }
}
