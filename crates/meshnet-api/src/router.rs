//! The axum router: handlers for the four endpoints, the SSE stream and the per-request log line.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::Serialize;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{StreamExt, StreamMap};

use crate::engine::{
    CompletionEngine, EngineError, EngineEvent, EngineRequest, EngineStream, FinishReason,
    TokenLogprob,
};
use crate::error::ApiError;
use crate::guard::Charge;
use crate::request::{self, Endpoint, MAX_BODY_BYTES};
use crate::response::{
    DecodedText, Envelope, FinishedChoice, ModelList, ModelObject, TokenList, ToolCallOut, Usage,
};
use crate::route;

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
    charge: Option<Extension<Charge>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let charge = charge.map(|Extension(charge)| charge);
    complete(engine, Endpoint::Chat, body, charge).await
}

async fn completions(
    State(engine): State<SharedEngine>,
    charge: Option<Extension<Charge>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let charge = charge.map(|Extension(charge)| charge);
    complete(engine, Endpoint::Text, body, charge).await
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

/// Validates the body, starts the generation and answers whole or streamed; the usage goes to
/// the API key's `charge`, if any, when the request ends.
async fn complete(
    engine: SharedEngine,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
    charge: Option<Charge>,
) -> Response {
    let id = new_request_id(endpoint);
    let mut log = RequestLog::new(id.clone(), endpoint, charge);
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
    let mut stream = match start_all(engine.as_ref(), id, &parsed).await {
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

/// Starts a generation of `parsed.n` choices for each prompt, in order: the choices of all of
/// them as one stream (prompt `p`'s choice `i` at index `p × n + i`), their prompt tokens
/// added up, the first prompt's route. A refusal of any prompt refuses the request (dropping
/// the ones started).
async fn start_all(
    engine: &dyn CompletionEngine,
    request_id: String,
    parsed: &request::ParsedRequest,
) -> Result<EngineStream, EngineError> {
    let mut all = EngineStream {
        prompt_tokens: 0,
        route: Vec::new(),
        choices: Vec::with_capacity(parsed.prompts.len() * parsed.n),
    };
    for prompt in &parsed.prompts {
        let request = EngineRequest {
            request_id: request_id.clone(),
            prompt: prompt.clone(),
            max_tokens: parsed.max_tokens,
            sampling: parsed.sampling.clone(),
            logprobs: parsed.logprobs,
            echo: parsed.echo,
            n: parsed.n,
            stop: parsed.stop.clone(),
            tools: parsed.tools.clone(),
            response_format: parsed.response_format.clone(),
            max_draft: parsed.max_draft,
        };
        let stream = engine.start(request).await?;
        if all.route.is_empty() {
            all.route = stream.route;
        }
        all.prompt_tokens += stream.prompt_tokens;
        all.choices.extend(stream.choices);
    }
    Ok(all)
}

/// Collects every choice and answers them in one JSON body. Dropping this future drops the
/// receivers, which cancels the generations.
async fn whole_response(envelope: Envelope, stream: EngineStream, mut log: RequestLog) -> Response {
    let EngineStream {
        prompt_tokens,
        choices,
        ..
    } = stream;
    let collected = futures::future::join_all(choices.into_iter().map(collect_choice)).await;
    let mut finished = Vec::with_capacity(collected.len());
    let mut completion_tokens = 0;
    for outcome in collected {
        match outcome {
            Ok((choice, tokens)) => {
                completion_tokens += tokens;
                finished.push(choice);
            }
            Err(error) => return log.reject(error),
        }
    }
    let reason = finished
        .first()
        .and_then(|choice| choice.finish_reason)
        .unwrap_or(FinishReason::Stop);
    log.finish(reason, completion_tokens);
    let usage = Usage::new(prompt_tokens, completion_tokens);
    Json(envelope.completion(&finished, usage)).into_response()
}

/// One choice's text, log-probabilities and finish reason, and how many tokens it generated.
async fn collect_choice(
    mut events: tokio::sync::mpsc::Receiver<EngineEvent>,
) -> Result<(FinishedChoice, usize), ApiError> {
    let mut choice = FinishedChoice::default();
    loop {
        match events.recv().await {
            Some(EngineEvent::Prompt { text, logprobs }) => {
                choice.text.insert_str(0, &text);
                choice.prompt_logprobs = logprobs;
            }
            Some(EngineEvent::Logprobs(entries)) => choice.logprobs.extend(entries),
            Some(EngineEvent::Delta(delta)) => choice.text.push_str(&delta),
            Some(EngineEvent::ToolCallStart { id, name, .. }) => {
                choice.tool_calls.push(ToolCallOut::new(id, name));
            }
            Some(EngineEvent::ToolCallArguments { index, text }) => {
                if let Some(call) = choice.tool_calls.get_mut(index) {
                    call.push_arguments(&text);
                }
            }
            Some(EngineEvent::Finished {
                reason,
                completion_tokens,
            }) => {
                choice.finish_reason = Some(reason);
                return Ok((choice, completion_tokens));
            }
            Some(EngineEvent::Failed(error)) => return Err(error.into()),
            None => return Err(ended_without_finishing()),
        }
    }
}

/// Answers with an SSE stream that owns the receivers: when the client goes away, hyper drops
/// the body, which drops the receivers, which cancels the generations. The choices' chunks
/// interleave as their tokens come, each naming its choice's index.
fn stream_response(envelope: Envelope, stream: EngineStream, log: RequestLog) -> Response {
    let choice_count = stream.choices.len();
    let mut events = StreamMap::new();
    for (index, receiver) in stream.choices.into_iter().enumerate() {
        events.insert(index as u32, choice_events(receiver));
    }
    let phase = match envelope.endpoint {
        Endpoint::Chat => Phase::Role(0),
        Endpoint::Text => Phase::Generating,
    };
    let state = SseState {
        events,
        choice_count,
        prompt_tokens: stream.prompt_tokens,
        completion_tokens: 0,
        envelope,
        phase,
        pending_logprobs: vec![Vec::new(); choice_count],
        text_offsets: vec![0; choice_count],
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
    /// Next: the chat role chunk of this choice.
    Role(u32),
    /// Next: whatever the engine sends.
    Generating,
    /// Next: the usage chunk.
    Usage(Usage),
    /// Next: `[DONE]`.
    Done,
    /// Nothing more.
    Ended,
}

/// A choice's engine events, then `None` when its sender is gone (a choice that finished is
/// taken out of the stream map before that).
type ChoiceEvents = Pin<Box<dyn futures::Stream<Item = Option<EngineEvent>> + Send>>;

fn choice_events(receiver: tokio::sync::mpsc::Receiver<EngineEvent>) -> ChoiceEvents {
    Box::pin(
        ReceiverStream::new(receiver)
            .map(Some)
            .chain(tokio_stream::once(None)),
    )
}

struct SseState {
    /// The choices still generating, by index.
    events: StreamMap<u32, ChoiceEvents>,
    choice_count: usize,
    prompt_tokens: usize,
    /// Tokens of the choices finished so far.
    completion_tokens: usize,
    envelope: Envelope,
    phase: Phase,
    /// Per choice: log-probabilities of tokens whose text has not been sent yet.
    pending_logprobs: Vec<Vec<TokenLogprob>>,
    /// Per choice: where the next token's text starts (completions' legacy `text_offset`).
    text_offsets: Vec<usize>,
    log: RequestLog,
}

impl SseState {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            match self.phase {
                Phase::Role(index) => {
                    self.phase = if index as usize + 1 < self.choice_count {
                        Phase::Role(index + 1)
                    } else {
                        Phase::Generating
                    };
                    return Some(json_event(&self.envelope.role_chunk(index)));
                }
                Phase::Generating => {
                    let Some((index, Some(event))) = self.events.next().await else {
                        return Some(self.fail(ended_without_finishing()));
                    };
                    if let Some(event) = self.on_engine_event(index, event) {
                        return Some(event);
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

    /// The SSE event for choice `index`'s engine event, if it makes one.
    fn on_engine_event(&mut self, index: u32, event: EngineEvent) -> Option<Event> {
        let choice = index as usize;
        match event {
            EngineEvent::Prompt { text, logprobs } => {
                let offset = &mut self.text_offsets[choice];
                let logprobs = match &logprobs {
                    Some(prompt) => self.envelope.choice_logprobs(Some(prompt), &[], offset),
                    None => None,
                };
                Some(json_event(
                    &self.envelope.text_chunk(index, &text, logprobs),
                ))
            }
            EngineEvent::Logprobs(entries) => {
                self.pending_logprobs[choice].extend(entries);
                None
            }
            EngineEvent::Delta(text) if text.is_empty() => None,
            EngineEvent::Delta(text) => {
                let entries = std::mem::take(&mut self.pending_logprobs[choice]);
                let offset = &mut self.text_offsets[choice];
                let logprobs = self.envelope.choice_logprobs(None, &entries, offset);
                Some(json_event(
                    &self.envelope.text_chunk(index, &text, logprobs),
                ))
            }
            EngineEvent::ToolCallStart {
                index: call,
                id,
                name,
            } => {
                let chunk = self.envelope.tool_call_start_chunk(index, call, &id, &name);
                Some(json_event(&chunk))
            }
            EngineEvent::ToolCallArguments { index: call, text } => {
                let chunk = self.envelope.tool_call_arguments_chunk(index, call, &text);
                Some(json_event(&chunk))
            }
            EngineEvent::Finished {
                reason,
                completion_tokens,
            } => Some(self.on_finished(index, reason, completion_tokens)),
            EngineEvent::Failed(error) => Some(self.fail(error.into())),
        }
    }

    /// Choice `index` finished: its finish chunk, and the usage and `[DONE]` to come once it
    /// was the last.
    fn on_finished(&mut self, index: u32, reason: FinishReason, completion_tokens: usize) -> Event {
        let choice = index as usize;
        self.events.remove(&index);
        self.completion_tokens += completion_tokens;
        if self.events.is_empty() {
            self.log.finish(reason, self.completion_tokens);
            self.phase = if self.envelope.include_usage {
                Phase::Usage(Usage::new(self.prompt_tokens, self.completion_tokens))
            } else {
                Phase::Done
            };
        }
        let entries = std::mem::take(&mut self.pending_logprobs[choice]);
        let offset = &mut self.text_offsets[choice];
        let logprobs = if entries.is_empty() {
            None
        } else {
            self.envelope.choice_logprobs(None, &entries, offset)
        };
        json_event(&self.envelope.finish_chunk(index, reason, logprobs))
    }

    /// Ends the stream with an error event (and no `[DONE]`), cancelling every choice.
    fn fail(&mut self, error: ApiError) -> Event {
        self.events.clear();
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
/// rejected, failed, or cancelled by the client going away; and reports its usage (prompt
/// tokens once started, completion tokens of finished choices) to its API key's charge.
struct RequestLog {
    id: String,
    endpoint: Endpoint,
    stream: bool,
    started: Instant,
    prompt_tokens: usize,
    completion_tokens: usize,
    outcome: String,
    charge: Option<Charge>,
}

impl RequestLog {
    fn new(id: String, endpoint: Endpoint, charge: Option<Charge>) -> Self {
        Self {
            id,
            endpoint,
            stream: false,
            started: Instant::now(),
            prompt_tokens: 0,
            completion_tokens: 0,
            outcome: "cancelled".to_owned(),
            charge,
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
        if let Some(charge) = &self.charge {
            charge.report(self.prompt_tokens, self.completion_tokens);
        }
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
