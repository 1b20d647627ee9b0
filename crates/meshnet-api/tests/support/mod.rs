//! A scripted engine and HTTP helpers shared by the integration tests.

#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use futures::future::BoxFuture;
use http_body_util::BodyExt;
use meshnet_api::{
    CompletionEngine, EngineError, EngineEvent, EngineRequest, EngineStream, FinishReason,
    ModelInfo, PromptLogprobs, RouteMember, TokenLogprob, TopLogprob, openai_router,
};
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tower::ServiceExt;

/// The model id the scripted engine serves.
pub const MODEL: &str = "test-model";

/// How many token ids the scripted engine's model has.
pub const VOCAB_SIZE: usize = 1000;

/// The scripted tokenizer's beginning-of-sequence id; ids below 256 are bytes.
pub const BOS: u32 = 256;

/// How long a test waits for something that should happen promptly.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// How a scripted generation ends after its deltas.
#[derive(Clone, Copy)]
pub enum End {
    /// `Finished` with this reason and completion token count.
    Finish(FinishReason, usize),
    /// `Failed` with this error.
    Fail(fn() -> EngineError),
    /// Nothing: the sender stays open until the receiver is dropped.
    HoldOpen,
    /// The sender is dropped without a final event.
    Vanish,
}

/// What the engine does with every request.
#[derive(Clone)]
pub enum Script {
    /// `start` fails with this error.
    Refuse(fn() -> EngineError),
    /// `start` succeeds, then these deltas are sent, then `end`.
    Generate {
        prompt_tokens: usize,
        deltas: Vec<&'static str>,
        end: End,
    },
    /// `start` succeeds, then the events `events` makes are sent, then `end` (a `Finish`).
    Events {
        prompt_tokens: usize,
        events: fn() -> Vec<EngineEvent>,
        end: End,
    },
}

impl Script {
    /// Sends "Hello", ", ", "wörld" and finishes with `stop` after 3 tokens; the prompt takes 5.
    pub fn hello() -> Self {
        Self::Generate {
            prompt_tokens: 5,
            deltas: vec!["Hello", ", ", "wörld"],
            end: End::Finish(FinishReason::Stop, 3),
        }
    }
}

/// The route the scripted engine names for its generations unless told another.
pub fn scripted_route() -> Vec<RouteMember> {
    vec![
        RouteMember {
            peer: "12D3KooWEntry".to_owned(),
            layers: 0..12,
        },
        RouteMember {
            peer: "12D3KooWLast".to_owned(),
            layers: 12..24,
        },
    ]
}

/// A `CompletionEngine` that follows a script and records what it saw.
pub struct ScriptedEngine {
    script: Script,
    route: Vec<RouteMember>,
    requests: Mutex<Vec<EngineRequest>>,
    started: watch::Sender<usize>,
    closed: watch::Sender<usize>,
}

impl ScriptedEngine {
    pub fn new(script: Script) -> Arc<Self> {
        Self::with_route(script, scripted_route())
    }

    /// An engine that names `route` for its generations.
    pub fn with_route(script: Script, route: Vec<RouteMember>) -> Arc<Self> {
        Arc::new(Self {
            script,
            route,
            requests: Mutex::new(Vec::new()),
            started: watch::Sender::new(0),
            closed: watch::Sender::new(0),
        })
    }

    /// Every request `start` was called with, in order.
    pub fn requests(&self) -> Vec<EngineRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// Waits (up to [`DEADLINE`]) until `count` generations were started; false if that did
    /// not happen in time.
    pub async fn wait_started(&self, count: usize) -> bool {
        let mut started = self.started.subscribe();
        tokio::time::timeout(DEADLINE, started.wait_for(|n| *n >= count))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits (up to [`DEADLINE`]) until `count` generations saw their receiver dropped before
    /// they ended; false if that did not happen in time.
    pub async fn wait_closed(&self, count: usize) -> bool {
        let mut closed = self.closed.subscribe();
        tokio::time::timeout(DEADLINE, closed.wait_for(|n| *n >= count))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// How many generations saw their receiver dropped so far.
    pub fn closed_count(&self) -> usize {
        *self.closed.borrow()
    }
}

impl CompletionEngine for ScriptedEngine {
    fn start(&self, request: EngineRequest) -> BoxFuture<'_, Result<EngineStream, EngineError>> {
        Box::pin(std::future::ready(self.begin(request)))
    }

    /// One id per byte.
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, EngineError> {
        let bos = add_special.then_some(BOS);
        Ok(bos.into_iter().chain(text.bytes().map(u32::from)).collect())
    }

    /// The bytes of the ids below 256, `BOS` as `<s>`.
    fn detokenize(&self, tokens: &[u32]) -> Result<String, EngineError> {
        let mut bytes = Vec::new();
        for &token in tokens {
            match u8::try_from(token) {
                Ok(byte) => bytes.push(byte),
                Err(_) if token == BOS => bytes.extend_from_slice(b"<s>"),
                Err(_) => return Err(EngineError::Internal(format!("no token {token}"))),
            }
        }
        String::from_utf8(bytes).map_err(|e| EngineError::Internal(e.to_string()))
    }

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            id: MODEL.to_owned(),
            created: 1_700_000_000,
            owned_by: "meshnet".to_owned(),
            context_length: 1024,
            family: "llama".to_owned(),
            quantization: "q4_1".to_owned(),
            tensor_types: [("F32".to_owned(), 61), ("Q4_1".to_owned(), 211)].into(),
            vocab_size: VOCAB_SIZE,
        }
    }
}

impl ScriptedEngine {
    /// Starts the scripted generation at once. With log-probabilities asked for, each delta
    /// comes after [`scripted_logprob`] of its text, and the finish after that of `""` (a
    /// token without text).
    fn begin(&self, request: EngineRequest) -> Result<EngineStream, EngineError> {
        let logprobs = request.logprobs.is_some();
        let echo = request.echo;
        let choice_count = request.n;
        self.requests.lock().unwrap().push(request);
        let (prompt_tokens, deltas, end) = match &self.script {
            Script::Refuse(error) => return Err(error()),
            Script::Events {
                prompt_tokens,
                events,
                end,
            } => return Ok(self.send_events(*prompt_tokens, events(), *end)),
            Script::Generate {
                prompt_tokens,
                deltas,
                end,
            } => (*prompt_tokens, deltas.clone(), *end),
        };
        let choices = (0..choice_count)
            .map(|index| {
                // Choice 0 says the script's deltas; choice i > 0 says each with `#i` added.
                let deltas: Vec<String> = deltas
                    .iter()
                    .map(|delta| match index {
                        0 => (*delta).to_owned(),
                        _ => format!("{delta}#{index}"),
                    })
                    .collect();
                let prompt = echo.then(|| scripted_prompt(logprobs));
                self.play(prompt, deltas, end, logprobs)
            })
            .collect();
        self.started.send_modify(|n| *n += 1);
        Ok(EngineStream {
            prompt_tokens,
            route: self.route.clone(),
            choices,
        })
    }

    /// Plays one choice's script on a task of its own; returns its receiver.
    fn play(
        &self,
        prompt: Option<EngineEvent>,
        deltas: Vec<String>,
        end: End,
        logprobs: bool,
    ) -> mpsc::Receiver<EngineEvent> {
        let (tx, rx) = mpsc::channel(4);
        let closed = self.closed.clone();
        tokio::spawn(async move {
            let record_closed = || closed.send_modify(|n| *n += 1);
            if let Some(prompt) = prompt
                && tx.send(prompt).await.is_err()
            {
                record_closed();
                return;
            }
            let entries = |text: &str| EngineEvent::Logprobs(vec![scripted_logprob(text)]);
            for delta in &deltas {
                if logprobs && tx.send(entries(delta)).await.is_err() {
                    record_closed();
                    return;
                }
                if tx.send(EngineEvent::Delta(delta.clone())).await.is_err() {
                    record_closed();
                    return;
                }
            }
            if logprobs && tx.send(entries("")).await.is_err() {
                record_closed();
                return;
            }
            let last = match end {
                End::Finish(reason, completion_tokens) => EngineEvent::Finished {
                    reason,
                    completion_tokens,
                },
                End::Fail(error) => EngineEvent::Failed(error()),
                End::HoldOpen => {
                    tx.closed().await;
                    record_closed();
                    return;
                }
                End::Vanish => return,
            };
            if tx.send(last).await.is_err() {
                record_closed();
            }
        });
        rx
    }
}

/// What the scripted engine echoes of any prompt: `"Once"`, as the tokens `"On"` and `"ce"`
/// (the latter's entry is [`scripted_logprob`]`("ce")`).
pub fn scripted_prompt(logprobs: bool) -> EngineEvent {
    EngineEvent::Prompt {
        text: "Once".to_owned(),
        logprobs: logprobs.then(|| PromptLogprobs {
            first_token: "On".to_owned(),
            scored: vec![scripted_logprob("ce")],
        }),
    }
}

impl ScriptedEngine {
    /// Starts a generation that sends `events`, then finishes as `end` says (`Finish` only).
    fn send_events(
        &self,
        prompt_tokens: usize,
        events: Vec<EngineEvent>,
        end: End,
    ) -> EngineStream {
        let (tx, rx) = mpsc::channel(events.len() + 1);
        for event in events {
            tx.try_send(event).unwrap();
        }
        if let End::Finish(reason, completion_tokens) = end {
            tx.try_send(EngineEvent::Finished {
                reason,
                completion_tokens,
            })
            .unwrap();
        }
        self.started.send_modify(|n| *n += 1);
        EngineStream {
            prompt_tokens,
            route: self.route.clone(),
            choices: vec![rx],
        }
    }
}

/// The log-probability entry the scripted engine sends for a token of `text`.
pub fn scripted_logprob(text: &str) -> TokenLogprob {
    TokenLogprob {
        token: text.to_owned(),
        logprob: -1.5,
        bytes: text.as_bytes().to_vec(),
        top_logprobs: vec![TopLogprob {
            token: "x".to_owned(),
            logprob: -0.25,
            bytes: vec![120],
        }],
    }
}

/// The router over `engine`.
pub fn app(engine: &Arc<ScriptedEngine>) -> Router {
    openai_router(engine.clone())
}

/// A response as the tests look at it.
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

/// Sends one request through the router in-process; `body` is sent verbatim.
pub async fn call(router: Router, method: &str, path: &str, body: Option<&str>) -> Answer {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_owned())))
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        panic!(
            "body is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&bytes)
        )
    });
    Answer {
        status,
        headers,
        body,
    }
}

/// POSTs a JSON value.
pub async fn post(router: Router, path: &str, body: &Value) -> Answer {
    call(router, "POST", path, Some(&body.to_string())).await
}

/// Asserts `body` is an OpenAI error envelope with this type, param and code.
pub fn assert_error(body: &Value, kind: &str, param: Option<&str>, code: Option<&str>) {
    let error = &body["error"];
    assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "no message in {body}"
    );
    assert_eq!(error["type"], kind, "type in {body}");
    assert_eq!(error["param"].as_str(), param, "param in {body}");
    assert_eq!(error["code"].as_str(), code, "code in {body}");
    assert_eq!(error.as_object().unwrap().len(), 4, "fields in {body}");
}

/// Serves `engine` on an ephemeral local port; returns `http://127.0.0.1:PORT`.
pub async fn serve(engine: &Arc<ScriptedEngine>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let router = app(engine);
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

/// The `data:` payloads of an SSE body, in order; panics on anything but data lines and
/// comments.
pub fn sse_data(text: &str) -> Vec<String> {
    assert!(
        text.ends_with("\n\n"),
        "stream does not end an event: {text:?}"
    );
    text.split_terminator("\n\n")
        .filter_map(|event| {
            let mut data = None;
            for line in event.lines() {
                if line.starts_with(':') {
                    continue;
                }
                let payload = line
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("not a data line: {line:?}"));
                assert!(data.is_none(), "multi-line data in {event:?}");
                data = Some(payload.to_owned());
            }
            data
        })
        .collect()
}
