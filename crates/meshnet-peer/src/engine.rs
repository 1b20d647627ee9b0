//! The tracker's completion engine: tokenizes, waits for a session slot (in a bounded line),
//! chooses a route over the mesh, and runs the generation loop on a blocking thread — its own layers in process,
//! the rest through the remote hops — streaming text back as it is produced.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use meshnet_api::{
    ChatTurn, CompletionEngine, EngineError, EngineEvent, EngineRequest, EngineStream,
    FinishReason, ModelInfo, PromptInput, PromptLogprobs, ResponseFormat, RouteMember,
    TokenLogprob, ToolChoice, ToolRequest, TopLogprob,
};
use meshnet_grammar::{JsonConstraint, JsonFormat, TokenEnvironment};
use meshnet_model::{
    BoundaryPolicy, EncodeOptions, FinishReason as ModelFinish, GenerationRequest, LayerRoute,
    ModelError, ModelTokenizer, SessionId, Stage, StopConditions, TextSide, TokenConstraint,
    TokenLogprobs, ToolFormat, decode_observed, generate_observed,
};
use meshnet_node::{ForwardClient, HopFailure, ReturnDesk};
use meshnet_types::PeerId;
use meshnet_wire::Encoding;
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use crate::admission::{Admission, AdmissionLimits};
use crate::remote::{DirectReturn, Failover, RemoteStage, RouteLost};
use crate::route_gates::{RouteGates, RouteKey};
use crate::routing::PlannedHop;
use crate::span_host::{LoadedSpan, SpanHost};
use crate::tool_use::{self, CallReader};

/// Tokens generated when a request sets no `max_tokens` (bounded by the context).
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// Events buffered between the generation thread and the HTTP response.
const EVENT_BUFFER: usize = 64;

/// The OpenAI API's view of the mesh.
pub struct MeshEngine {
    info: ModelInfo,
    /// This member's peer id: the first member of every route.
    local_peer: PeerId,
    text: Arc<TextSide>,
    host: Arc<SpanHost>,
    failover: Failover,
    client: ForwardClient,
    encoding: Encoding,
    admission: Admission,
    prefill_in_flight: usize,
    /// The most tokens drafted per trip (0: no speculative decoding).
    max_draft: usize,
    /// Whether drafts pass the draft gate (ADR-0035).
    gate_drafts: bool,
    /// What the draft gates of earlier generations timed, per route (ADR-0037).
    route_gates: Arc<RouteGates>,
    /// Where the last hops of its routes post their outputs, and the desk that awaits them;
    /// `None` has outputs come back along the routes.
    direct_return: Option<DirectReturn>,
    grants: Option<Arc<crate::grants::GrantSigner>>,
    /// What `response_format` schemas and required tool calls compile against.
    structured: StructuredOutput,
}

/// The token environment of structured output: none until the first request that needs it
/// builds it (on a blocking thread, once), so a tracker that never serves `response_format`
/// or a required tool call pays neither its memory nor its start-up time.
#[derive(Clone)]
enum StructuredOutput {
    /// Not offered; the reason says why.
    Off(String),
    /// Built from the engine's tokenizer on first use (or the reason it cannot be).
    OnDemand(Arc<tokio::sync::OnceCell<Result<TokenEnvironment, String>>>),
}

/// The token environment `response_format` schemas compile against, built once per model from
/// its tokenizer with its end-of-text tokens (and end-of-turn token); why not, when the
/// tokenizer cannot back one.
pub fn structured_output_environment(text: &TextSide) -> Result<TokenEnvironment, String> {
    let started = Instant::now();
    let mut ends = text.stop_tokens.clone();
    ends.extend(text.end_of_turn);
    let environment = TokenEnvironment::new(&text.tokenizer, &ends).map_err(|e| e.to_string());
    tracing::info!(
        vocab = text.tokenizer.vocab_size(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        ready = environment.is_ok(),
        "structured output: token environment built"
    );
    environment
}

impl MeshEngine {
    /// An engine of the member `local_peer` generating with the entry span in `host` and
    /// remote hops from the routes of `failover` (which also says how a failed hop is routed
    /// around), running and queueing generations within `limits`. Chats leave out the chat
    /// template's default system prompt, as `meshnet-peer generate --chat` does.
    pub fn new(
        local_peer: PeerId,
        model_id: String,
        mut text: TextSide,
        host: Arc<SpanHost>,
        failover: Failover,
        client: ForwardClient,
        limits: AdmissionLimits,
    ) -> Self {
        let description = host.model().description();
        let context_length = description.context_length;
        let family = description.architecture.clone();
        let tensor_types = description.tensor_types.clone();
        // Ids clients may send must be both the tokenizer's and rows of the embedding.
        let vocab_size = text.tokenizer.vocab_size().min(description.vocab_size);
        let quantization = host.model().shipped_format().name().to_owned();
        text.template = text
            .template
            .take()
            .map(meshnet_model::ChatTemplate::without_default_system);
        MeshEngine {
            info: ModelInfo {
                id: model_id,
                created: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                owned_by: "meshnet".to_owned(),
                context_length,
                family,
                quantization,
                tensor_types,
                vocab_size,
            },
            local_peer,
            text: Arc::new(text),
            host,
            failover,
            client,
            encoding: Encoding::Zstd,
            admission: Admission::new(limits),
            prefill_in_flight: crate::remote::DEFAULT_PREFILL_IN_FLIGHT,
            max_draft: 0,
            gate_drafts: true,
            route_gates: Arc::default(),
            direct_return: None,
            grants: None,
            structured: StructuredOutput::Off(
                "structured output is not set up on this tracker".to_owned(),
            ),
        }
    }

    /// Serves `response_format` and required tool calls, building their token environment
    /// ([`structured_output_environment`]) when the first request needs it.
    pub fn with_structured_output(mut self) -> Self {
        self.structured = StructuredOutput::OnDemand(Arc::default());
        self
    }

    /// The token environment structured output compiles against, built on a blocking thread
    /// the first time it is asked for; why not, when it is off or cannot be built.
    async fn token_environment(&self) -> Result<TokenEnvironment, String> {
        let cell = match &self.structured {
            StructuredOutput::Off(reason) => return Err(reason.clone()),
            StructuredOutput::OnDemand(cell) => cell,
        };
        let text = Arc::clone(&self.text);
        let built = cell
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || structured_output_environment(&text))
                    .await
                    .unwrap_or_else(|e| Err(format!("building it failed: {e}")))
            })
            .await;
        built.clone()
    }

    /// Every frame of its generations carries a grant `signer` signs (members serve none
    /// without one).
    pub fn with_grants(mut self, signer: Arc<crate::grants::GrantSigner>) -> Self {
        self.grants = Some(signer);
        self
    }

    /// Has the last hop of every route post its output to `endpoint` (this member's own
    /// activation plane, serving `desk`) instead of back along the route; `None` keeps the
    /// answers on the route.
    pub fn with_direct_return(
        mut self,
        desk: Arc<ReturnDesk>,
        endpoint: Option<meshnet_wire::Endpoint>,
    ) -> Self {
        self.direct_return = endpoint.map(|endpoint| DirectReturn { desk, endpoint });
        self
    }

    /// Keeps up to `chunks` of a prompt travelling through the remote hops at once (1: each
    /// chunk is answered before the next is computed).
    pub fn with_prefill_in_flight(mut self, chunks: usize) -> Self {
        self.prefill_in_flight = chunks.max(1);
        self
    }

    /// Drafts up to `max_draft` tokens from the context and verifies them in one trip
    /// through the route (speculative decoding, ADR-0032); 0 decodes one token per trip.
    /// With `gate_drafts`, only the drafts whose measured cost they are likely to repay are
    /// sent (ADR-0035).
    pub fn with_speculation(mut self, max_draft: usize, gate_drafts: bool) -> Self {
        self.max_draft = max_draft;
        self.gate_drafts = gate_drafts;
        self
    }

    /// Generations running now.
    pub fn active_sessions(&self) -> usize {
        self.admission.running()
    }

    /// Requests waiting for a generation slot now.
    pub fn queued_sessions(&self) -> usize {
        self.admission.waiting()
    }

    /// How many generations run and wait.
    pub fn limits(&self) -> AdmissionLimits {
        self.admission.limits()
    }

    /// How many tokens `prompt` may be continued by: `max_tokens`, or the default, within
    /// the model's context; a prompt that is empty or fills the context is refused, naming
    /// the request's `prompt_param`.
    fn completion_budget(
        &self,
        prompt: &[u32],
        prompt_param: &str,
        max_tokens: Option<usize>,
    ) -> Result<usize, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest {
                param: Some(prompt_param.to_owned()),
                message: "the prompt encodes to no tokens".to_owned(),
            });
        }
        let context = self.info.context_length;
        if prompt.len() >= context {
            return Err(EngineError::InvalidRequest {
                param: Some(prompt_param.to_owned()),
                message: format!(
                    "the prompt has {} tokens; the model's context is {context}",
                    prompt.len()
                ),
            });
        }
        let room = context - prompt.len();
        let max_tokens = max_tokens.unwrap_or_else(|| DEFAULT_MAX_TOKENS.min(room));
        if max_tokens > room {
            return Err(EngineError::InvalidRequest {
                param: Some("max_tokens".to_owned()),
                message: format!(
                    "max_tokens is {max_tokens}, but the prompt's {} tokens leave room for {room} \
                     in the model's context of {context}",
                    prompt.len()
                ),
            });
        }
        Ok(max_tokens)
    }

    /// Refuses a request whose choices could never fit the entry span's KV cache, even alone:
    /// `n` choices of `prompt + max_tokens` positions each (and the shared prompt once more
    /// while they start).
    fn check_cache_room(
        &self,
        prompt: usize,
        max_tokens: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        let Some(entry) = self.host.current() else {
            return Ok(());
        };
        let store = entry.span.kv_store();
        let shared_prompt = if n > 1 { prompt } else { 0 };
        let positions = n * (prompt + max_tokens) + shared_prompt;
        let needed = positions * store.bytes_per_position();
        if needed <= store.budget_bytes() {
            return Ok(());
        }
        let param = if n > 1 { "n" } else { "max_tokens" };
        Err(EngineError::InvalidRequest {
            param: Some(param.to_owned()),
            message: format!(
                "{n} choice(s) of {prompt} prompt and {max_tokens} completion tokens need \
                 {needed} bytes of KV cache at the entry, which holds {}; ask for fewer",
                store.budget_bytes()
            ),
        })
    }

    /// The prompt's token ids, and whether it is a chat: text is encoded as a sequence starts,
    /// token ids are taken as they are.
    fn prompt_tokens(
        &self,
        prompt: PromptInput,
        tools: Option<&ToolRequest>,
    ) -> Result<(Vec<u32>, bool), EngineError> {
        let (text, chat) = match prompt {
            PromptInput::Chat(turns) => (self.render_chat(turns, tools)?, true),
            PromptInput::Text(text) => (text, false),
            PromptInput::Tokens(ids) => return Ok((ids, false)),
        };
        let ids = self
            .text
            .tokenizer
            .encode_prompt(&text)
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        Ok((ids, chat))
    }

    /// The constraint `format` asks for, compiled on a blocking thread; none for text. A
    /// schema the grammar engine cannot compile is a 400 naming `response_format`.
    async fn constraint(
        &self,
        format: &ResponseFormat,
    ) -> Result<Option<JsonConstraint>, EngineError> {
        let (format, name) = match format {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => (JsonFormat::AnyObject, "json_object".to_owned()),
            ResponseFormat::JsonSchema(schema) => (
                JsonFormat::Schema(schema.schema.clone()),
                schema.name.clone(),
            ),
        };
        let invalid = |message: String| EngineError::InvalidRequest {
            param: Some("response_format".to_owned()),
            message,
        };
        let environment = self.token_environment().await.map_err(|reason| {
            invalid(format!(
                "model {} cannot produce structured output: {reason}",
                self.info.id
            ))
        })?;
        let compiled = tokio::task::spawn_blocking(move || environment.compile(&format))
            .await
            .map_err(|e| EngineError::Internal(e.to_string()))?;
        compiled.map(Some).map_err(|error| {
            invalid(format!(
                "Invalid schema for response_format '{name}': {error}"
            ))
        })
    }

    /// A conversation (offering `tools`, if any) as text in the model's chat format, which it
    /// needs to have.
    fn render_chat(
        &self,
        turns: Vec<ChatTurn>,
        tools: Option<&ToolRequest>,
    ) -> Result<String, EngineError> {
        let template = self
            .text
            .template
            .as_ref()
            .ok_or_else(|| EngineError::InvalidRequest {
                param: Some("messages".to_owned()),
                message: format!(
                    "model {} has no chat format: use /v1/completions with a prompt",
                    self.info.id
                ),
            })?;
        let messages = tool_use::chat_messages(turns);
        let tools = tool_use::tool_definitions(tools)?;
        template
            .render_chat(&messages, &tools, true)
            .map_err(|e| engine_error(&e))
    }

    /// How the model's template writes tool calls (the generic format without a template).
    fn tool_format(&self) -> ToolFormat {
        self.text
            .template
            .as_ref()
            .map_or(ToolFormat::Generic, |template| template.tool_format())
    }

    /// The constraint that makes the model call a tool when `tools` requires one, compiled
    /// on a blocking thread; none when it does not.
    async fn tool_constraint(
        &self,
        tools: Option<&ToolRequest>,
    ) -> Result<Option<JsonConstraint>, EngineError> {
        let Some(tools) = tools.filter(|tools| tools.choice != ToolChoice::Auto) else {
            return Ok(None);
        };
        let environment =
            self.token_environment()
                .await
                .map_err(|reason| EngineError::InvalidRequest {
                    param: Some("tool_choice".to_owned()),
                    message: format!(
                        "model {} cannot be made to call a tool: {reason}",
                        self.info.id
                    ),
                })?;
        let (format, tools) = (self.tool_format(), tools.clone());
        tokio::task::spawn_blocking(move || {
            tool_use::required_call_constraint(&environment, format, &tools)
        })
        .await
        .map_err(|e| EngineError::Internal(e.to_string()))?
    }
}

impl CompletionEngine for MeshEngine {
    fn model_info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn start(&self, request: EngineRequest) -> BoxFuture<'_, Result<EngineStream, EngineError>> {
        Box::pin(async move {
            // A request that cannot be served is told so before it waits in line.
            let (prompt, chat) =
                self.prompt_tokens(request.prompt.clone(), request.tools.as_ref())?;
            let prompt_param = if chat { "messages" } else { "prompt" };
            let max_tokens = self.completion_budget(&prompt, prompt_param, request.max_tokens)?;
            self.check_cache_room(prompt.len(), max_tokens, request.n)?;
            let constraint = self.constraint(&request.response_format).await?;
            // A required call's grammar takes the place of the answer's format.
            let constraint = match self.tool_constraint(request.tools.as_ref()).await? {
                Some(calls) => Some(calls),
                None => constraint,
            };
            let permit = self.admission.admit().await?;
            self.begin(request, prompt, chat, max_tokens, constraint, permit)
        })
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineError> {
        let options = EncodeOptions {
            add_special,
            parse_special: true,
        };
        self.text
            .tokenizer
            .encode_with(text, options)
            .map_err(|e| EngineError::Internal(e.to_string()))
    }

    fn detokenize(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.text
            .tokenizer
            .decode_with_special(tokens)
            .map_err(|e| EngineError::Internal(e.to_string()))
    }
}

impl MeshEngine {
    /// Starts an admitted generation of `prompt` on the route the mesh offers now.
    fn begin(
        &self,
        request: EngineRequest,
        prompt: Vec<u32>,
        chat: bool,
        max_tokens: usize,
        constraint: Option<JsonConstraint>,
        permit: OwnedSemaphorePermit,
    ) -> Result<EngineStream, EngineError> {
        let admitted = Instant::now();
        let entry = self
            .host
            .current()
            .filter(|held_span| held_span.target.entry)
            .ok_or_else(|| {
                EngineError::NotCovered("the entry layers are still loading".to_owned())
            })?;
        let start = entry.target.layers.end;
        let hops = self
            .failover
            .routes
            .route(start, &[])
            .map_err(|uncovered| {
                EngineError::NotCovered(format!(
                    "the mesh does not cover the model yet: {uncovered}"
                ))
            })?;

        let route = route_members(&self.local_peer, &entry, &hops);
        let route_key = RouteKey::new(entry.target.layers, &hops);
        let remote = self.remote_stage(start, hops)?;
        let request_id = request.request_id.clone();
        let choices = request.n.max(1);
        let echo = self.echo_text(&request, &prompt)?;
        let calls = request
            .tools
            .as_ref()
            .map(|tools| CallReader::new(self.tool_format(), tools.parallel));
        let mut generation = self.generation_request(request, prompt, chat, max_tokens);
        generation.constraint = constraint.map(|c| Box::new(c) as Box<dyn TokenConstraint>);
        generation.draft_gate = self.route_gates.start(&route_key);
        let prompt_tokens = generation.prompt.len();
        let (events, receivers): (Vec<_>, Vec<_>) =
            (0..choices).map(|_| mpsc::channel(EVENT_BUFFER)).unzip();
        let job = GenerationJob {
            admitted,
            metrics: self.client.metrics().clone(),
            request_id,
            text: Arc::clone(&self.text),
            entry,
            remote,
            request: generation,
            echo,
            events,
            calls,
            route_gates: Arc::clone(&self.route_gates),
            route_key,
            _permit: permit,
        };
        tokio::task::spawn_blocking(move || job.run());
        Ok(EngineStream {
            prompt_tokens,
            route,
            choices: receivers,
        })
    }
}

impl MeshEngine {
    /// The text a request that set `echo` echoes: a text prompt as given, token ids as their
    /// text. `None` without `echo`.
    fn echo_text(
        &self,
        request: &EngineRequest,
        prompt: &[u32],
    ) -> Result<Option<String>, EngineError> {
        if !request.echo {
            return Ok(None);
        }
        match &request.prompt {
            PromptInput::Text(text) => Ok(Some(text.clone())),
            _ => self.detokenize(prompt).map(Some),
        }
    }

    /// What to generate: `prompt`, `request`'s sampling settings, stop sequences and draft
    /// length (within the engine's), and the model's end-of-text tokens (with its end-of-turn
    /// token for a chat).
    fn generation_request(
        &self,
        request: EngineRequest,
        prompt: Vec<u32>,
        chat: bool,
        max_tokens: usize,
    ) -> GenerationRequest {
        let mut stop_tokens = self.text.stop_tokens.clone();
        if chat {
            stop_tokens.extend(self.text.end_of_turn);
        }
        GenerationRequest {
            sampling: request.sampling,
            logprobs: request.logprobs,
            stop: StopConditions {
                tokens: stop_tokens,
                strings: request.stop,
            },
            max_draft: request
                .max_draft
                .map_or(self.max_draft, |asked| asked.min(self.max_draft)),
            gate_drafts: self.gate_drafts,
            ..GenerationRequest::greedy(prompt, max_tokens)
        }
    }

    /// The stage that runs the layers from `start` on over `hops` (with grants when this
    /// member signs them); none when the entry's span reaches the end of the model.
    fn remote_stage(
        &self,
        start: u32,
        hops: Vec<PlannedHop>,
    ) -> Result<Option<RemoteStage>, EngineError> {
        if hops.is_empty() {
            return Ok(None);
        }
        let stage = RemoteStage::new(
            start,
            hops,
            self.client.clone(),
            tokio::runtime::Handle::current(),
            self.encoding,
            self.failover.clone(),
        )
        .map_err(|e| EngineError::Internal(e.to_string()))?;
        let stage = match &self.grants {
            Some(signer) => stage.with_grants(Arc::clone(signer)),
            None => stage,
        };
        let stage = match &self.direct_return {
            Some(direct) => stage.with_direct_return(direct.clone()),
            None => stage,
        };
        Ok(Some(stage.with_prefill_in_flight(self.prefill_in_flight)))
    }
}

/// One generation, run on a blocking thread.
struct GenerationJob {
    /// When the request got its session slot (time to first token counts from here).
    admitted: Instant,
    /// Where tokens and their latencies are counted.
    metrics: meshnet_metrics::Metrics,
    request_id: String,
    text: Arc<TextSide>,
    entry: Arc<LoadedSpan>,
    remote: Option<RemoteStage>,
    /// What to generate (with the structured-output constraint in its starting state).
    request: GenerationRequest,
    /// The prompt's text, when it is to be echoed before each choice's text.
    echo: Option<String>,
    /// One per choice: choice `i` samples with the request's seed plus `i`.
    events: Vec<mpsc::Sender<EngineEvent>>,
    /// Reads tool calls out of an answer, when the request offered tools: each choice reads
    /// with a copy of this one.
    calls: Option<CallReader>,
    /// Where the draft gate's timings are kept for the next generation over the route.
    route_gates: Arc<RouteGates>,
    /// The route the generation started on.
    route_key: RouteKey,
    /// Held until the generation ends, freeing its session slot.
    _permit: OwnedSemaphorePermit,
}

impl GenerationJob {
    /// Choice `index`'s request: the job's (its constraint copied in its starting state),
    /// seeded with its seed plus `index`.
    fn choice_request(&self, index: usize) -> GenerationRequest {
        let mut request = self.request.clone();
        request.sampling.seed = request.sampling.seed.wrapping_add(index as u64);
        request
    }

    fn run(self) {
        let span: &LoadedSpan = &self.entry;
        let mut stages: Vec<&dyn Stage> = vec![span];
        if let Some(remote) = &self.remote {
            stages.push(remote);
        }
        let route = LayerRoute {
            embedder: span,
            stages,
            head: span,
            boundary: BoundaryPolicy::Bf16,
        };
        tracing::info!(
            request = %self.request_id,
            session = %self.request.session,
            route = %route_description(&self.entry, self.remote.as_ref()),
            prompt_tokens = self.request.prompt.len(),
            choices = self.events.len(),
            "generation started"
        );
        let scoring = self.echo.is_some() && self.request.logprobs.is_some();
        match self.events.as_slice() {
            [events] if !scoring => {
                self.send_echo(events, None);
                let request = self.choice_request(0);
                let outcome = self.stream_choice(&route, &request, None, events);
                self.report(&request, events, outcome);
            }
            _ => self.run_shared_prefill(&route, scoring),
        }
    }

    /// The prompt prefilled once under the request's session (and scored, when its
    /// log-probabilities are to be echoed), then one choice decoding on that session, or
    /// several each on a session that starts as a copy of its caches (locally, and on each
    /// remote hop with its first frame), decoding side by side, batched by the spans.
    fn run_shared_prefill(&self, route: &LayerRoute<'_>, scoring: bool) {
        let prefix = self.request.session;
        let (prompt_logprobs, logits) = match self.prefill(route, scoring) {
            Ok(prefilled) => prefilled,
            Err(error) => {
                route.end_session(prefix);
                for events in &self.events {
                    let _ = events.blocking_send(EngineEvent::Failed(engine_error(&error)));
                }
                return;
            }
        };
        if let [events] = self.events.as_slice() {
            self.send_echo(events, prompt_logprobs);
            let request = self.choice_request(0);
            let outcome = self.stream_choice(route, &request, Some(logits), events);
            self.report(&request, events, outcome);
            return;
        }
        std::thread::scope(|scope| {
            for (index, events) in self.events.iter().enumerate() {
                let logits = logits.clone();
                let prompt_logprobs = prompt_logprobs.clone();
                scope.spawn(move || {
                    self.send_echo(events, prompt_logprobs);
                    self.run_forked_choice(index, prefix, logits, events)
                });
            }
        });
        route.end_session(prefix);
    }

    /// Prefills the prompt under the request's session; returns the logits after it and,
    /// when `scoring`, its tokens' log-probabilities.
    fn prefill(
        &self,
        route: &LayerRoute<'_>,
        scoring: bool,
    ) -> Result<(Option<PromptLogprobs>, Vec<f32>), ModelError> {
        let request = &self.request;
        if !scoring {
            let hidden = route.prefill(request.session, &request.prompt, request.chunk_tokens)?;
            return Ok((None, route.head.logits(&hidden)?));
        }
        let top = request.logprobs.unwrap_or(0);
        let (scored, logits) =
            route.prefill_scoring(request.session, &request.prompt, request.chunk_tokens, top)?;
        let tokenizer = &self.text.tokenizer;
        let first = request.prompt[0];
        let first_token = String::from_utf8_lossy(&tokenizer.token_bytes(first)?).into_owned();
        let scored = scored
            .iter()
            .map(|entry| api_logprob(tokenizer, entry))
            .collect();
        Ok((
            Some(PromptLogprobs {
                first_token,
                scored,
            }),
            logits,
        ))
    }

    /// Echoes the prompt to a choice's receiver, when the request asked for it.
    fn send_echo(&self, events: &mpsc::Sender<EngineEvent>, logprobs: Option<PromptLogprobs>) {
        if let Some(text) = &self.echo {
            let _ = events.blocking_send(EngineEvent::Prompt {
                text: text.clone(),
                logprobs,
            });
        }
    }

    /// Choice `index`, forked from the prompt prefilled under `prefix`.
    fn run_forked_choice(
        &self,
        index: usize,
        prefix: SessionId,
        logits: Vec<f32>,
        events: &mpsc::Sender<EngineEvent>,
    ) {
        let mut request = self.choice_request(index);
        request.session = SessionId::new_v4();
        let forked = self
            .entry
            .fork_session(prefix, request.session, request.prompt.len())
            .and_then(|()| {
                self.remote
                    .as_ref()
                    .map(|remote| remote.forked(prefix))
                    .transpose()
            });
        let outcome = match forked {
            Ok(remote) => {
                let span: &LoadedSpan = &self.entry;
                let mut stages: Vec<&dyn Stage> = vec![span];
                if let Some(remote) = &remote {
                    stages.push(remote);
                }
                let route = LayerRoute {
                    embedder: span,
                    stages,
                    head: span,
                    boundary: BoundaryPolicy::Bf16,
                };
                self.stream_choice(&route, &request, Some(logits), events)
            }
            Err(error) => (Err(error), false),
        };
        self.report(&request, events, outcome);
    }

    /// Streams one choice over `route` (from `logits` when its session holds the prompt
    /// already); also says whether the answer made tool calls.
    fn stream_choice(
        &self,
        route: &LayerRoute<'_>,
        request: &GenerationRequest,
        logits: Option<Vec<f32>>,
        events: &mpsc::Sender<EngineEvent>,
    ) -> (Result<meshnet_model::Generation, ModelError>, bool) {
        let mut clock = TokenClock {
            metrics: &self.metrics,
            previous: self.admitted,
            counted: 0,
        };
        let mut calls = self.calls.clone();
        let outcome = stream_generation(
            route,
            request,
            logits,
            &self.text.tokenizer,
            events,
            calls.as_mut(),
            &mut clock,
        );
        let called = calls.as_ref().is_some_and(|calls| calls.calls() > 0);
        (outcome, called)
    }

    /// Logs how a choice ended (with tool calls when `called`) and tells its receiver.
    fn report(
        &self,
        request: &GenerationRequest,
        events: &mpsc::Sender<EngineEvent>,
        (outcome, called): (Result<meshnet_model::Generation, ModelError>, bool),
    ) {
        let session = request.session;
        if let Ok(generation) = &outcome
            && request.max_draft > 0
        {
            self.route_gates
                .keep(&self.route_key, &generation.draft_gate);
        }
        match outcome {
            Ok(generation) if generation.finish == ModelFinish::Cancelled => {
                tracing::info!(request = %self.request_id, %session, "generation cancelled: the client went away");
            }
            Ok(generation) => {
                let speculation = generation.speculation;
                self.metrics.count_speculation(
                    speculation.drafted,
                    speculation.accepted,
                    speculation.draft_length,
                );
                let reason = match generation.finish {
                    ModelFinish::Length => FinishReason::Length,
                    _ if called => FinishReason::ToolCalls,
                    _ => FinishReason::Stop,
                };
                tracing::info!(
                    request = %self.request_id,
                    %session,
                    completion_tokens = generation.tokens.len(),
                    drafted = speculation.drafted,
                    accepted_drafts = speculation.accepted,
                    draft_gate = %generation.draft_gate,
                    elapsed_ms = self.admitted.elapsed().as_millis() as u64,
                    "generation finished"
                );
                let _ = events.blocking_send(EngineEvent::Finished {
                    reason,
                    completion_tokens: generation.tokens.len(),
                });
            }
            Err(error) => {
                tracing::warn!(request = %self.request_id, %session, %error, "generation failed");
                let _ = events.blocking_send(EngineEvent::Failed(engine_error(&error)));
            }
        }
    }
}

/// How a model error is reported: a chat template that raised or failed as 400 naming the
/// problem; the entry's KV cache full as 429 (busy); a route that failed beyond repair as 503
/// and any other stage failure as 502, naming the failed hop's peer, endpoint and code when a
/// remote hop failed; anything else as 500.
fn engine_error(error: &ModelError) -> EngineError {
    let source = match error {
        ModelError::Stage { source, .. } => source,
        ModelError::ChatTemplate { .. } => {
            return EngineError::InvalidRequest {
                param: Some("messages".to_owned()),
                message: error.to_string(),
            };
        }
        // The entry's KV cache is full with other sessions now: it frees as they end.
        ModelError::CacheBudget { .. } => {
            return EngineError::Busy {
                reason: error.to_string(),
                retry_after_seconds: 1,
            };
        }
        ModelError::Constraint(_) => {
            return EngineError::InvalidRequest {
                param: Some("response_format".to_owned()),
                message: error.to_string(),
            };
        }
        _ => return EngineError::Internal(error.to_string()),
    };
    if let Some(lost) = source.downcast_ref::<RouteLost>() {
        return EngineError::RouteLost(lost.to_string());
    }
    match source.downcast_ref::<HopFailure>() {
        // The hop or the network failed, not the request: it may succeed if sent again.
        Some(hop) if hop.retryable() => EngineError::Upstream(format!(
            "{hop} (a transient failure; the request may succeed if sent again)"
        )),
        // The hop refused the request itself.
        Some(hop) => EngineError::Upstream(format!(
            "{hop} (final: sending the request again would fail the same way)"
        )),
        None => EngineError::Upstream(error.to_string()),
    }
}

/// The members a generation starts on: this member (`local_peer`) with the `entry` span,
/// then every remote hop, each with the layers it runs.
fn route_members(local_peer: &PeerId, entry: &LoadedSpan, hops: &[PlannedHop]) -> Vec<RouteMember> {
    let layers = entry.target.layers;
    std::iter::once(RouteMember {
        peer: local_peer.as_str().to_owned(),
        layers: layers.start..layers.end,
    })
    .chain(hops.iter().map(|hop| RouteMember {
        peer: hop.peer.as_str().to_owned(),
        layers: hop.layers.start..hop.layers.end,
    }))
    .collect()
}

fn route_description(entry: &LoadedSpan, remote: Option<&RemoteStage>) -> String {
    let local = format!("local (layers {})", entry.target.layers);
    match remote {
        Some(remote) => format!("{local} -> {}", remote.name()),
        None => local,
    }
}

/// How much of `text` may be shown: not a trailing incomplete character (decoded as U+FFFD),
/// not a stop string, and not a tail that could still become one.
fn shown_len(text: &str, stops: &[String]) -> usize {
    let mut safe = text.trim_end_matches('\u{FFFD}').len();
    for stop in stops {
        if let Some(found) = text.find(stop.as_str()) {
            safe = safe.min(found);
        }
        let held = stop
            .char_indices()
            .skip(1)
            .map(|(cut, _)| cut)
            .filter(|&cut| text[..safe].ends_with(&stop[..cut]))
            .max()
            .unwrap_or(0);
        safe -= held;
    }
    safe
}

/// Sends the answer's next `text` to `events`: as it is, or, when `calls` reads tool calls
/// out of the answer, as the text and call events it makes of it. False once the client went
/// away.
fn send_text(
    events: &mpsc::Sender<EngineEvent>,
    calls: Option<&mut CallReader>,
    text: String,
) -> bool {
    match calls {
        None => events.blocking_send(EngineEvent::Delta(text)).is_ok(),
        Some(calls) => {
            let sent = calls
                .read(&text)
                .into_iter()
                .all(|event| events.blocking_send(event).is_ok());
            sent && !events.is_closed()
        }
    }
}

/// Runs `request` over `route`, sending text deltas to `events` as they become safe to show
/// and, once it has ended (unless cancelled), whatever the final text adds to them: the deltas
/// add up to the generation's text. With `calls`, the text goes through it, and what it held
/// back is sent at the end.
fn stream_generation(
    route: &LayerRoute<'_>,
    request: &GenerationRequest,
    prefilled: Option<Vec<f32>>,
    tokenizer: &ModelTokenizer,
    events: &mpsc::Sender<EngineEvent>,
    mut calls: Option<&mut CallReader>,
    clock: &mut TokenClock<'_>,
) -> Result<meshnet_model::Generation, ModelError> {
    let mut streamer = TextStreamer::new(tokenizer, &request.stop.strings);
    let send_logprobs = |tokens: std::ops::Range<usize>, logprobs: &[TokenLogprobs]| {
        let entries: Vec<TokenLogprob> = logprobs
            .get(tokens)
            .unwrap_or_default()
            .iter()
            .map(|entry| api_logprob(tokenizer, entry))
            .collect();
        entries.is_empty() || events.blocking_send(EngineEvent::Logprobs(entries)).is_ok()
    };
    let mut observer = |generated: &[u32], logprobs: &[TokenLogprobs]| {
        clock.tokens_now(generated.len());
        match streamer.delta(generated) {
            Some(delta) => {
                send_logprobs(streamer.release(), logprobs)
                    && send_text(events, calls.as_deref_mut(), delta)
            }
            None => !events.is_closed(),
        }
    };
    let outcome = match prefilled {
        Some(logits) => decode_observed(route, request, logits, Some(tokenizer), &mut observer),
        None => generate_observed(route, request, Some(tokenizer), &mut observer),
    };
    if let Ok(generation) = &outcome
        && generation.finish != ModelFinish::Cancelled
    {
        let rest = streamer.remainder(generation.text.as_deref().unwrap_or_default());
        // Without a stop string every token is in the text, an unfinished character too.
        let cut = generation.finish == ModelFinish::StopString;
        let tokens = if cut {
            streamer.release()
        } else {
            streamer.release_all()
        };
        send_logprobs(tokens, &generation.logprobs);
        if let Some(rest) = rest {
            send_text(events, calls.as_deref_mut(), rest);
        }
        for event in calls.map(CallReader::finish).unwrap_or_default() {
            let _ = events.blocking_send(event);
        }
    }
    outcome
}

/// A token's log-probability with its text and bytes, in the API's shape.
fn api_logprob(tokenizer: &ModelTokenizer, entry: &TokenLogprobs) -> TokenLogprob {
    let described = |id: u32| {
        let bytes = tokenizer.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let (token, bytes) = described(entry.token);
    let top_logprobs = entry
        .top
        .iter()
        .map(|&(id, logprob)| {
            let (token, bytes) = described(id);
            TopLogprob {
                token,
                logprob,
                bytes,
            }
        })
        .collect();
    TokenLogprob {
        token,
        logprob: entry.logprob,
        bytes,
        top_logprobs,
    }
}

/// Counts a generation's tokens and times them: the first from the admission, each later one
/// from the one before.
struct TokenClock<'a> {
    metrics: &'a meshnet_metrics::Metrics,
    previous: Instant,
    counted: usize,
}

impl TokenClock<'_> {
    /// Notes that `generated` tokens exist now.
    fn tokens_now(&mut self, generated: usize) {
        let now = Instant::now();
        while self.counted < generated {
            let first = self.counted == 0;
            self.metrics
                .record_token(first, now.saturating_duration_since(self.previous));
            self.previous = now;
            self.counted += 1;
        }
    }
}

/// Turns the growing list of generated tokens into text deltas that never split a UTF-8
/// character and never show the start of a stop string that may still complete.
///
/// The tokens are decoded incrementally, and only the text not shown yet (at most a tail that
/// may still become a stop string, and the newest piece) is searched for stop strings, so each
/// token costs the same whatever the length of the text.
struct TextStreamer<'a> {
    decoder: meshnet_model::IncrementalDecoder<'a>,
    stops: &'a [String],
    /// How many of the generated tokens the decoder has been given.
    decoded: usize,
    /// Decoded text not shown yet.
    held: String,
    /// All text shown so far.
    shown: String,
    /// Where each token's text ends in the decoded text (`usize::MAX` while not known).
    ends: Vec<usize>,
    /// How many tokens [`release`](Self::release) has given out.
    released: usize,
}

impl<'a> TextStreamer<'a> {
    fn new(tokenizer: &'a ModelTokenizer, stops: &'a [String]) -> Self {
        TextStreamer {
            decoder: meshnet_model::IncrementalDecoder::new(tokenizer),
            stops,
            decoded: 0,
            held: String::new(),
            shown: String::new(),
            ends: Vec::new(),
            released: 0,
        }
    }

    /// Notes where the newest token's text ends: not known yet when its piece is `empty`
    /// (part of a character, or nothing); else where the text decoded so far ends, which is
    /// also where the text of the tokens before it that were not known yet ends.
    fn note_end(&mut self, empty: bool) {
        if empty {
            self.ends.push(usize::MAX);
            return;
        }
        let end = self.shown.len() + self.held.len();
        for unknown in self.ends.iter_mut().rev() {
            if *unknown != usize::MAX {
                break;
            }
            *unknown = end;
        }
        self.ends.push(end);
    }

    /// Every token not given out before.
    fn release_all(&mut self) -> std::ops::Range<usize> {
        let start = self.released;
        self.released = self.ends.len();
        start..self.released
    }

    /// The tokens not given out before whose text has been shown in full, in order.
    fn release(&mut self) -> std::ops::Range<usize> {
        let start = self.released;
        let shown = self.shown.len();
        self.released += self.ends[start..]
            .iter()
            .take_while(|&&end| end <= shown)
            .count();
        start..self.released
    }

    /// The new text that is safe to show after `generated`, if any.
    fn delta(&mut self, generated: &[u32]) -> Option<String> {
        for &token in generated.get(self.decoded..)? {
            let piece = self.decoder.push(token).ok()?;
            self.held.push_str(&piece);
            self.decoded += 1;
            self.note_end(piece.is_empty());
        }
        let safe = shown_len(&self.held, self.stops);
        if safe == 0 {
            return None;
        }
        let delta: String = self.held.drain(..safe).collect();
        self.shown.push_str(&delta);
        Some(delta)
    }

    /// What the final text adds to what was already shown.
    fn remainder(&mut self, final_text: &str) -> Option<String> {
        let rest = final_text.strip_prefix(self.shown.as_str())?;
        if rest.is_empty() {
            return None;
        }
        self.shown.push_str(rest);
        Some(rest.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use meshnet_api::EngineError;
    use meshnet_model::ModelError;
    use meshnet_node::{HopFailure, HopFailureKind};

    use super::{engine_error, shown_len};

    fn stage_error(source: Box<dyn std::error::Error + Send + Sync>) -> ModelError {
        ModelError::Stage {
            stage: "http://a:1 (layers 10..20) -> http://b:2 (layers 20..30)".to_owned(),
            source,
        }
    }

    #[test]
    fn a_failed_hop_is_a_502_naming_the_peer_its_endpoint_and_code() {
        let mut hop = HopFailure::new(
            "http://b:2",
            HopFailureKind::Rejected {
                status: 503,
                code: "overloaded".to_owned(),
            },
            "no capacity for another session; retry later",
        );
        hop.peer = Some("12D3KooWPeerB".into());
        hop.reported_by = Some("http://a:1".to_owned());
        let EngineError::Upstream(message) = engine_error(&stage_error(Box::new(hop.clone())))
        else {
            panic!("expected an upstream error");
        };
        for needle in [
            "12D3KooWPeerB",
            "http://b:2",
            "503",
            "overloaded",
            "transient",
        ] {
            assert!(message.contains(needle), "{needle} missing from {message}");
        }

        hop.kind = HopFailureKind::Rejected {
            status: 409,
            code: "layers_not_served".to_owned(),
        };
        let EngineError::Upstream(message) = engine_error(&stage_error(Box::new(hop))) else {
            panic!("expected an upstream error");
        };
        for needle in ["12D3KooWPeerB", "http://b:2", "layers_not_served", "final"] {
            assert!(message.contains(needle), "{needle} missing from {message}");
        }
    }

    #[test]
    fn other_stage_failures_are_502_and_the_rest_500() {
        assert!(matches!(
            engine_error(&stage_error("the route has no hop".into())),
            EngineError::Upstream(message) if message.contains("the route has no hop")
        ));
        assert!(matches!(
            engine_error(&ModelError::InvalidSpan("x".to_owned())),
            EngineError::Internal(_)
        ));
    }

    #[test]
    fn a_full_entry_cache_is_busy_not_an_internal_error() {
        let full = ModelError::CacheBudget {
            needed: 10,
            used: 95,
            budget: 100,
        };
        assert!(matches!(
            engine_error(&full),
            EngineError::Busy { reason, retry_after_seconds: 1 } if reason.contains("10 bytes needed")
        ));
    }

    #[test]
    fn a_chat_template_error_is_an_invalid_request_with_its_message() {
        let error = ModelError::ChatTemplate {
            origin: "the model file's tokenizer.chat_template".to_owned(),
            reason: "System role not supported".to_owned(),
        };
        let EngineError::InvalidRequest { param, message } = engine_error(&error) else {
            panic!("expected an invalid request");
        };
        assert_eq!(param.as_deref(), Some("messages"));
        assert!(message.ends_with("System role not supported"), "{message}");
    }

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn incomplete_characters_and_stop_strings_are_held_back() {
        assert_eq!(shown_len("Hello", &[]), 5);
        assert_eq!(shown_len("caf\u{FFFD}", &[]), 3);
        // The stop string itself and what follows it are never shown.
        assert_eq!(shown_len("Hello\nWorld", &stops(&["\n"])), 5);
        // A tail that may still become "END" waits.
        assert_eq!(shown_len("Done. EN", &stops(&["END"])), 6);
        assert_eq!(shown_len("Done. E", &stops(&["END"])), 6);
        assert_eq!(shown_len("Done. X", &stops(&["END"])), 7);
        // Several stops: the earliest cut wins.
        assert_eq!(shown_len("a<b|c", &stops(&["|", "<b"])), 1);
    }
}

#[cfg(test)]
mod streaming_tests {
    use std::cell::Cell;
    use std::sync::OnceLock;

    use candle_core::{DType, Device, Tensor};
    use meshnet_model::{Generation, GgufModel, LogitsHead, TokenEmbedder};

    use super::*;

    /// The default model's tokenizer, built once.
    fn tokenizer() -> &'static ModelTokenizer {
        static TOKENIZER: OnceLock<ModelTokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| {
            let path = meshnet_model::default_model_path();
            assert!(
                path.is_file(),
                "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
                path.display()
            );
            ModelTokenizer::from_gguf(&GgufModel::open(&path).unwrap()).unwrap()
        })
    }

    /// A route whose greedy choices are the scripted ids, one after another (then id 0).
    struct Script {
        ids: Vec<u32>,
        step: Cell<usize>,
    }

    impl TokenEmbedder for Script {
        fn embed(&self, tokens: &[u32]) -> meshnet_model::Result<Tensor> {
            Ok(Tensor::zeros(
                (1, tokens.len(), 1),
                DType::F32,
                &Device::Cpu,
            )?)
        }
    }

    impl Stage for Script {
        fn forward(&self, _: SessionId, _: usize, hidden: Tensor) -> meshnet_model::Result<Tensor> {
            Ok(hidden)
        }

        fn end_session(&self, _: SessionId) {}

        fn name(&self) -> String {
            "script".to_owned()
        }
    }

    impl LogitsHead for Script {
        fn logits(&self, _: &Tensor) -> meshnet_model::Result<Vec<f32>> {
            let step = self.step.get();
            self.step.set(step + 1);
            let mut logits = vec![0.0; tokenizer().vocab_size()];
            logits[self.ids.get(step).map_or(0, |&id| id as usize)] = 1.0;
            Ok(logits)
        }
    }

    /// Streams the generation of `text`'s ids as the engine does: the deltas sent, and the
    /// generation.
    fn stream(text: &str, stops: &[&str]) -> (Vec<String>, Generation) {
        let tokenizer = tokenizer();
        let ids = tokenizer.encode(text).unwrap();
        let script = Script {
            step: Cell::new(0),
            ids: ids.clone(),
        };
        let route = LayerRoute {
            embedder: &script,
            stages: vec![&script],
            head: &script,
            boundary: BoundaryPolicy::F32,
        };
        let request = GenerationRequest {
            stop: StopConditions {
                tokens: vec![],
                strings: stops.iter().map(|stop| (*stop).to_owned()).collect(),
            },
            ..GenerationRequest::greedy(tokenizer.encode("Say:").unwrap(), ids.len())
        };
        let (events, mut received) = mpsc::channel(ids.len() + 2);
        let metrics = meshnet_metrics::Metrics::detached();
        let mut clock = TokenClock {
            metrics: &metrics,
            previous: Instant::now(),
            counted: 0,
        };
        let generation =
            stream_generation(&route, &request, None, tokenizer, &events, None, &mut clock)
                .unwrap();
        // Every generated token is counted once, however the text was cut into deltas.
        assert_eq!(metrics.tokens_generated(), generation.tokens.len() as u64);
        let mut deltas = Vec::new();
        while let Ok(event) = received.try_recv() {
            match event {
                EngineEvent::Delta(delta) => deltas.push(delta),
                _ => panic!("only deltas are sent while generating"),
            }
        }
        (deltas, generation)
    }

    /// Every event streaming the generation of the first `max_tokens` of `text`'s ids sends,
    /// with log-probabilities.
    fn events_with_logprobs(text: &str, max_tokens: usize, stops: &[&str]) -> Vec<EngineEvent> {
        let tokenizer = tokenizer();
        let ids = tokenizer.encode(text).unwrap();
        let script = Script {
            step: Cell::new(0),
            ids: ids.clone(),
        };
        let route = LayerRoute {
            embedder: &script,
            stages: vec![&script],
            head: &script,
            boundary: BoundaryPolicy::F32,
        };
        let request = GenerationRequest {
            logprobs: Some(1),
            stop: StopConditions {
                tokens: vec![],
                strings: stops.iter().map(|stop| (*stop).to_owned()).collect(),
            },
            ..GenerationRequest::greedy(tokenizer.encode("Say:").unwrap(), max_tokens)
        };
        let (events, mut received) = mpsc::channel(2 * ids.len() + 4);
        let metrics = meshnet_metrics::Metrics::detached();
        let mut clock = TokenClock {
            metrics: &metrics,
            previous: Instant::now(),
            counted: 0,
        };
        stream_generation(&route, &request, None, tokenizer, &events, None, &mut clock).unwrap();
        let mut sent = Vec::new();
        while let Ok(event) = received.try_recv() {
            sent.push(event);
        }
        sent
    }

    #[test]
    fn logprobs_come_with_the_delta_that_completes_their_tokens() {
        let tokenizer = tokenizer();
        let party = "Hello, 世界! Ça va? 🎉";
        let party_ids = tokenizer.encode(party).unwrap();
        let cut_emoji = &party_ids[..party_ids.len() - 1];
        assert!(
            tokenizer.decode(cut_emoji).unwrap().ends_with('\u{FFFD}'),
            "the emoji takes several tokens"
        );
        // The space before the emoji shares a token with its first byte.
        let before_emoji = &party_ids[..party_ids.len() - 3];
        assert_eq!(
            tokenizer.decode(before_emoji).unwrap(),
            "Hello, 世界! Ça va?"
        );
        let answer = "The answer is forty-two, said the computer.";
        let before_stop = tokenizer.encode("The answer is forty-").unwrap();
        assert!(tokenizer.encode(answer).unwrap().starts_with(&before_stop));
        // (text, tokens generated, stop string, the tokens whose logprobs are sent)
        let cases: [(&str, usize, Option<&str>, &[u32]); 4] = [
            (party, party_ids.len(), None, &party_ids),
            // An unfinished character ends the text: its tokens are in it.
            (party, cut_emoji.len(), None, cut_emoji),
            // A stop string cuts the text: only the tokens wholly before it.
            (answer, 20, Some("two, sa"), &before_stop),
            // ... also when it starts in a character spread over tokens.
            (party, party_ids.len(), Some("🎉"), before_emoji),
        ];
        for (text, max_tokens, stop, expected) in cases {
            let events = events_with_logprobs(text, max_tokens, stop.as_slice());
            let (mut deltas, mut bytes) = (String::new(), Vec::new());
            for (index, event) in events.iter().enumerate() {
                match event {
                    EngineEvent::Logprobs(entries) => {
                        let next = events.get(index + 1);
                        assert!(
                            next.is_none() || matches!(next, Some(EngineEvent::Delta(_))),
                            "{text:?}: logprobs not followed by their text"
                        );
                        for entry in entries {
                            // The scripted logits make the chosen token the most likely.
                            assert_eq!(entry.top_logprobs[0].bytes, entry.bytes);
                            bytes.extend_from_slice(&entry.bytes);
                        }
                    }
                    EngineEvent::Delta(delta) => {
                        deltas.push_str(delta);
                        if !delta.contains('\u{FFFD}') {
                            // The tokens sent so far are never ahead of the text shown.
                            assert!(deltas.as_bytes().starts_with(&bytes), "{text:?}");
                        }
                    }
                    _ => panic!("only logprobs and deltas are sent while generating"),
                }
            }
            let expected_bytes: Vec<u8> = expected
                .iter()
                .flat_map(|&id| tokenizer.token_bytes(id).unwrap())
                .collect();
            assert_eq!(bytes, expected_bytes, "{text:?} {max_tokens} {stop:?}");
            assert!(events.len() > 4, "{text:?} came in one piece");
        }
    }

    #[test]
    fn streamed_multi_byte_text_equals_the_generated_text() {
        for text in [
            "🦀🚀 ok",
            "日本語のテキスト",
            "Tiếng Việt, żółć, café crème brûlée",
            "Hello, 世界! Ça va? 🎉 fine.",
        ] {
            let (deltas, generation) = stream(text, &[]);
            assert_eq!(generation.text.as_deref(), Some(text));
            assert_eq!(deltas.concat(), text);
            assert!(deltas.len() > 1, "{text:?} came in one piece: {deltas:?}");
            for delta in &deltas {
                assert!(!delta.contains('\u{FFFD}'), "{text:?}: delta {delta:?}");
            }
        }
    }

    #[test]
    fn a_stop_string_spread_over_tokens_is_never_streamed() {
        let tokenizer = tokenizer();
        for (text, stop) in [
            ("日本語のテキストです。続きがある", "テキ"),
            ("Hello, 世界! Ça va? 🎉 fine.", "界! Ç"),
            ("The answer is forty-two, said the computer.", "two, sa"),
            ("Wow!🦀🚀 and more", "🚀"),
            ("Answer: 日本語です", ": "),
        ] {
            let ids = tokenizer.encode(text).unwrap();
            assert!(
                ids.iter()
                    .all(|&id| !tokenizer.decode(&[id]).unwrap().contains(stop)),
                "{stop:?} is within one token of {text:?}"
            );
            let expected = &text[..text.find(stop).unwrap()];
            let (deltas, generation) = stream(text, &[stop]);
            assert_eq!(generation.finish, ModelFinish::StopString);
            assert_eq!(generation.text.as_deref(), Some(expected));
            assert_eq!(deltas.concat(), expected, "{text:?} / {stop:?}: {deltas:?}");
            if tokenizer.encode(expected).unwrap().len() > 1 {
                assert!(deltas.len() > 1, "{text:?} came in one piece: {deltas:?}");
            }
            for delta in &deltas {
                assert!(!delta.contains('\u{FFFD}'), "{text:?}: delta {delta:?}");
            }
        }
    }

    #[test]
    fn a_held_back_start_of_a_stop_string_is_shown_once_it_cannot_complete() {
        let text = "日本語のテキストです。";
        // "テキス" waits for a "X" that never comes, and is shown when "ト" follows it.
        let (deltas, generation) = stream(text, &["テキスX"]);
        assert_eq!(generation.finish, ModelFinish::Length);
        assert_eq!(generation.text.as_deref(), Some(text));
        assert_eq!(deltas.concat(), text);
        // At the very end, the held-back tail is sent with what the final text adds.
        let (deltas, generation) = stream("日本語のテキス", &["テキスX"]);
        assert_eq!(generation.text.as_deref(), Some("日本語のテキス"));
        assert_eq!(deltas.concat(), "日本語のテキス");
        assert_eq!(deltas.last().map(String::as_str), Some("テキス"));
    }
}
