//! The JSON shapes of successful answers: model objects, completions and stream chunks.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::engine::{FinishReason, ModelInfo, PromptLogprobs, TokenLogprob};
use crate::request::Endpoint;

/// One entry of `GET /v1/models`, also the body of `GET /v1/models/{id}`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelObject {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: String,
    context_length: usize,
    family: String,
    quantization: String,
    tensor_types: std::collections::BTreeMap<String, usize>,
}

impl From<ModelInfo> for ModelObject {
    fn from(info: ModelInfo) -> Self {
        Self {
            id: info.id,
            object: "model",
            created: info.created,
            owned_by: info.owned_by,
            context_length: info.context_length,
            family: info.family,
            quantization: info.quantization,
            tensor_types: info.tensor_types,
        }
    }
}

/// The answer of `POST /tokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct TokenList {
    pub tokens: Vec<u32>,
}

/// The answer of `POST /detokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct DecodedText {
    pub content: String,
}

/// The body of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub(crate) struct ModelList {
    object: &'static str,
    data: Vec<ModelObject>,
}

impl ModelList {
    pub(crate) fn new(data: Vec<ModelObject>) -> Self {
        Self {
            object: "list",
            data,
        }
    }
}

/// Token accounting, as in every OpenAI completion.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
}

impl Usage {
    pub(crate) fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A whole (non-streamed) answer of either endpoint.
#[derive(Debug, Serialize)]
pub(crate) struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<Choice<'a>>,
    usage: Usage,
}

/// One choice as it ended: its text, its tokens' log-probabilities (when asked for) and why
/// it ended.
#[derive(Debug, Default)]
pub(crate) struct FinishedChoice {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    /// The echoed prompt's log-probabilities, when the prompt was echoed with them.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// The calls the model made (chat with tools), in order.
    pub tool_calls: Vec<ToolCallOut>,
    pub finish_reason: Option<FinishReason>,
}

#[derive(Debug, Serialize)]
struct Choice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    finish_reason: FinishReason,
    logprobs: Option<ChoiceLogprobs<'a>>,
}

/// A choice's `logprobs`: OpenAI's chat shape, or the legacy shape of `/v1/completions`.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum ChoiceLogprobs<'a> {
    /// `{"content": [...], "refusal": null}`.
    Chat {
        content: &'a [TokenLogprob],
        refusal: Option<()>,
    },
    /// `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
    Legacy(LegacyLogprobs),
}

/// The legacy `logprobs` of a completion: per token its text, its log-probability (`null`
/// for a prompt's first token), the most likely tokens at its position with the token itself
/// among them (`null` for the prompt's first token), and where its text starts in the
/// choice's text.
#[derive(Debug, Default, Serialize)]
pub(crate) struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    /// Adds a token that has no log-probability (a prompt's first), its text at `*offset`.
    fn push_unscored(&mut self, token: &str, offset: &mut usize) {
        self.tokens.push(token.to_owned());
        self.token_logprobs.push(None);
        self.top_logprobs.push(None);
        self.text_offset.push(*offset);
        *offset += token.len();
    }

    /// Adds `entry`, its text at `*offset`.
    fn push(&mut self, entry: &TokenLogprob, offset: &mut usize) {
        let mut top: BTreeMap<String, f32> = entry
            .top_logprobs
            .iter()
            .map(|alternative| (alternative.token.clone(), alternative.logprob))
            .collect();
        top.insert(entry.token.clone(), entry.logprob);
        self.tokens.push(entry.token.clone());
        self.token_logprobs.push(Some(entry.logprob));
        self.top_logprobs.push(Some(top));
        self.text_offset.push(*offset);
        *offset += entry.token.len();
    }
}

#[derive(Debug, Serialize)]
struct Message<'a> {
    role: &'static str,
    /// `null` when the answer is only calls.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<&'a [ToolCallOut]>,
}

/// A call the model made, in OpenAI's `message.tool_calls[i]` shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct ToolCallOut {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionOut,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct FunctionOut {
    name: String,
    arguments: String,
}

impl ToolCallOut {
    /// A call of `name` with id `id` and no arguments yet.
    pub(crate) fn new(id: String, name: String) -> Self {
        Self {
            id,
            kind: "function",
            function: FunctionOut {
                name,
                arguments: String::new(),
            },
        }
    }

    /// Appends `text` to the call's arguments.
    pub(crate) fn push_arguments(&mut self, text: &str) {
        self.function.arguments.push_str(text);
    }
}

/// A piece of a streamed call, in OpenAI's `delta.tool_calls[i]` shape: the first has the
/// id, type and name (and empty arguments), the others more arguments.
#[derive(Debug, Serialize)]
struct ToolCallDelta<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Debug, Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// One `data:` event of a streamed answer.
#[derive(Debug, Serialize)]
pub(crate) struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice<'a>>,
    /// Absent unless usage was requested; then `null` on every chunk but the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<Delta<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: Option<ChoiceLogprobs<'a>>,
    finish_reason: Option<FinishReason>,
}

#[derive(Debug, Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallDelta<'a>; 1]>,
}

/// What every answer to one request shares: endpoint, id, timestamp and model.
#[derive(Debug, Clone)]
pub(crate) struct Envelope {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub include_usage: bool,
    /// Whether the choices carry the tokens' log-probabilities.
    pub logprobs: bool,
}

impl Envelope {
    /// The whole answer, one entry per choice in order, with `logprobs` when they were asked
    /// for.
    pub(crate) fn completion<'a>(
        &'a self,
        finished: &'a [FinishedChoice],
        usage: Usage,
    ) -> Completion<'a> {
        let choices = finished
            .iter()
            .enumerate()
            .map(|(index, choice)| self.choice(index as u32, choice))
            .collect();
        Completion {
            id: &self.id,
            object: match self.endpoint {
                Endpoint::Chat => "chat.completion",
                Endpoint::Text => "text_completion",
            },
            created: self.created,
            model: &self.model,
            choices,
            usage,
        }
    }

    fn choice<'a>(&'a self, index: u32, finished: &'a FinishedChoice) -> Choice<'a> {
        let text = finished.text.as_str();
        let calls = &finished.tool_calls;
        let (message, text) = match self.endpoint {
            // An answer that is only calls has `null` content.
            Endpoint::Chat => (
                Some(Message {
                    role: "assistant",
                    content: Some(text).filter(|text| calls.is_empty() || !text.is_empty()),
                    tool_calls: (!calls.is_empty()).then_some(calls.as_slice()),
                }),
                None,
            ),
            Endpoint::Text => (None, Some(text)),
        };
        Choice {
            index,
            message,
            text,
            finish_reason: finished.finish_reason.unwrap_or(FinishReason::Stop),
            logprobs: self.choice_logprobs(
                finished.prompt_logprobs.as_ref(),
                &finished.logprobs,
                &mut 0,
            ),
        }
    }

    /// The chat stream's opening chunk of choice `index`, announcing the assistant role.
    pub(crate) fn role_chunk(&self, index: u32) -> Chunk<'_> {
        self.chunk(vec![ChunkChoice {
            index,
            delta: Some(Delta {
                role: Some("assistant"),
                content: Some(""),
                tool_calls: None,
            }),
            text: None,
            logprobs: None,
            finish_reason: None,
        }])
    }

    /// A chunk carrying new text of choice `index`, with the log-probabilities of the tokens
    /// it completes when they were asked for.
    pub(crate) fn text_chunk<'a>(
        &'a self,
        index: u32,
        text: &'a str,
        logprobs: Option<ChoiceLogprobs<'a>>,
    ) -> Chunk<'a> {
        self.choice_chunk(index, Some(text), logprobs, None)
    }

    /// The chunk with choice `index`'s finish reason and no new text; `logprobs` are those of
    /// tokens no text chunk carried (give `None` when there are none).
    pub(crate) fn finish_chunk<'a>(
        &'a self,
        index: u32,
        reason: FinishReason,
        logprobs: Option<ChoiceLogprobs<'a>>,
    ) -> Chunk<'a> {
        self.choice_chunk(index, None, logprobs, Some(reason))
    }

    /// The `logprobs` of a choice (or of one chunk of it) when they were asked for: the chat
    /// shape of `content`, or for completions the legacy shape of the echoed `prompt`'s tokens
    /// and then `content`'s, their text offsets counted on from `*offset`.
    pub(crate) fn choice_logprobs<'a>(
        &self,
        prompt: Option<&PromptLogprobs>,
        content: &'a [TokenLogprob],
        offset: &mut usize,
    ) -> Option<ChoiceLogprobs<'a>> {
        if !self.logprobs {
            return None;
        }
        if self.endpoint == Endpoint::Chat {
            return Some(ChoiceLogprobs::Chat {
                content,
                refusal: None,
            });
        }
        let mut legacy = LegacyLogprobs::default();
        if let Some(prompt) = prompt {
            legacy.push_unscored(&prompt.first_token, offset);
            for entry in &prompt.scored {
                legacy.push(entry, offset);
            }
        }
        for entry in content {
            legacy.push(entry, offset);
        }
        Some(ChoiceLogprobs::Legacy(legacy))
    }

    /// The chunk that starts choice `choice`'s call `index` of function `name` with id `id`
    /// (chat only).
    pub(crate) fn tool_call_start_chunk<'a>(
        &'a self,
        choice: u32,
        index: usize,
        id: &'a str,
        name: &'a str,
    ) -> Chunk<'a> {
        self.tool_call_chunk(
            choice,
            ToolCallDelta {
                index,
                id: Some(id),
                kind: Some("function"),
                function: FunctionDelta {
                    name: Some(name),
                    arguments: "",
                },
            },
        )
    }

    /// A chunk with more of choice `choice`'s call `index`'s arguments (chat only).
    pub(crate) fn tool_call_arguments_chunk<'a>(
        &'a self,
        choice: u32,
        index: usize,
        text: &'a str,
    ) -> Chunk<'a> {
        self.tool_call_chunk(
            choice,
            ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionDelta {
                    name: None,
                    arguments: text,
                },
            },
        )
    }

    fn tool_call_chunk<'a>(&'a self, choice: u32, call: ToolCallDelta<'a>) -> Chunk<'a> {
        self.chunk(vec![ChunkChoice {
            index: choice,
            delta: Some(Delta {
                role: None,
                content: None,
                tool_calls: Some([call]),
            }),
            text: None,
            logprobs: None,
            finish_reason: None,
        }])
    }

    /// The final chunk with no choices and the token usage.
    pub(crate) fn usage_chunk(&self, usage: Usage) -> Chunk<'_> {
        let mut chunk = self.chunk(Vec::new());
        chunk.usage = Some(Some(usage));
        chunk
    }

    fn choice_chunk<'a>(
        &'a self,
        index: u32,
        text: Option<&'a str>,
        logprobs: Option<ChoiceLogprobs<'a>>,
        finish_reason: Option<FinishReason>,
    ) -> Chunk<'a> {
        let choice = match self.endpoint {
            Endpoint::Chat => ChunkChoice {
                index,
                delta: Some(Delta {
                    role: None,
                    content: text,
                    tool_calls: None,
                }),
                text: None,
                logprobs,
                finish_reason,
            },
            Endpoint::Text => ChunkChoice {
                index,
                delta: None,
                text: Some(text.unwrap_or("")),
                logprobs,
                finish_reason,
            },
        };
        self.chunk(vec![choice])
    }

    fn chunk<'a>(&'a self, choices: Vec<ChunkChoice<'a>>) -> Chunk<'a> {
        Chunk {
            id: &self.id,
            object: match self.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Text => "text_completion",
            },
            created: self.created,
            model: &self.model,
            choices,
            usage: self.include_usage.then_some(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn envelope(endpoint: Endpoint, include_usage: bool) -> Envelope {
        Envelope {
            endpoint,
            id: "x-1".into(),
            created: 7,
            model: "m".into(),
            include_usage,
            logprobs: false,
        }
    }

    fn to_value(value: impl Serialize) -> Value {
        serde_json::to_value(value).unwrap()
    }

    #[test]
    fn chat_chunks() {
        let env = envelope(Endpoint::Chat, false);
        assert_eq!(
            to_value(env.role_chunk(0)),
            json!({"id": "x-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": null, "finish_reason": null}]})
        );
        assert_eq!(
            to_value(env.text_chunk(0, "hé", None))["choices"][0]["delta"],
            json!({"content": "hé"})
        );
        let finish = to_value(env.finish_chunk(0, FinishReason::Length, None));
        assert_eq!(finish["choices"][0]["delta"], json!({}));
        assert_eq!(finish["choices"][0]["finish_reason"], "length");
        assert!(finish.get("usage").is_none());
    }

    #[test]
    fn logprobs_have_openais_chat_shape_where_asked_for() {
        let env = Envelope {
            logprobs: true,
            ..envelope(Endpoint::Chat, false)
        };
        let entry = TokenLogprob {
            token: "hé".into(),
            logprob: -0.5,
            bytes: "hé".as_bytes().to_vec(),
            top_logprobs: vec![crate::engine::TopLogprob {
                token: "a".into(),
                logprob: -0.25,
                bytes: vec![97],
            }],
        };
        let expected = json!({
            "content": [{"token": "hé", "logprob": -0.5, "bytes": [104, 195, 169],
                         "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]}],
            "refusal": null
        });
        let entries = [entry];
        let finished = [FinishedChoice {
            text: "hé".into(),
            logprobs: entries.to_vec(),
            prompt_logprobs: None,
            tool_calls: Vec::new(),
            finish_reason: Some(FinishReason::Stop),
        }];
        let chunk = to_value(env.text_chunk(0, "hé", env.choice_logprobs(None, &entries, &mut 0)));
        assert_eq!(chunk["choices"][0]["logprobs"], expected);
        let whole = to_value(env.completion(&finished, Usage::new(1, 1)));
        assert_eq!(whole["choices"][0]["logprobs"], expected);
        let finish = to_value(env.finish_chunk(
            0,
            FinishReason::Stop,
            env.choice_logprobs(None, &entries, &mut 0),
        ));
        assert_eq!(finish["choices"][0]["logprobs"], expected);
        let finish = to_value(env.finish_chunk(0, FinishReason::Stop, None));
        assert_eq!(finish["choices"][0]["logprobs"], Value::Null);
        assert_eq!(
            to_value(env.role_chunk(0))["choices"][0]["logprobs"],
            Value::Null
        );
        // Not asked for: null everywhere.
        let plain = envelope(Endpoint::Chat, false);
        let chunk =
            to_value(plain.text_chunk(0, "hé", plain.choice_logprobs(None, &entries, &mut 0)));
        assert_eq!(chunk["choices"][0]["logprobs"], Value::Null);
    }

    #[test]
    fn tool_calls_have_openais_shape_whole_and_streamed() {
        let env = envelope(Endpoint::Chat, false);
        let mut call = ToolCallOut::new("call_1".into(), "get_weather".into());
        call.push_arguments("{\"city\"");
        call.push_arguments(": \"Paris\"}");
        let calls = vec![call];
        let finished = |text: &str, tool_calls: Vec<ToolCallOut>, reason| FinishedChoice {
            text: text.into(),
            tool_calls,
            finish_reason: Some(reason),
            ..FinishedChoice::default()
        };
        let whole = to_value(env.completion(
            &[finished("", calls.clone(), FinishReason::ToolCalls)],
            Usage::new(1, 2),
        ));
        assert_eq!(
            whole["choices"][0]["message"],
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
            ]})
        );
        assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
        // Text beside the calls stays; without calls the message has no tool_calls.
        let both = to_value(env.completion(
            &[finished("Hi.", calls.clone(), FinishReason::ToolCalls)],
            Usage::new(1, 2),
        ));
        assert_eq!(both["choices"][0]["message"]["content"], "Hi.");
        let plain = to_value(env.completion(
            &[finished("", Vec::new(), FinishReason::Stop)],
            Usage::new(1, 2),
        ));
        assert_eq!(
            plain["choices"][0]["message"],
            json!({"role": "assistant", "content": ""})
        );

        let start = to_value(env.tool_call_start_chunk(2, 0, "call_1", "get_weather"));
        assert_eq!(
            start["choices"][0],
            json!({"index": 2, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": ""}}
            ]}, "logprobs": null, "finish_reason": null})
        );
        let more = to_value(env.tool_call_arguments_chunk(0, 1, "{\"a\""));
        assert_eq!(
            more["choices"][0]["delta"],
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\""}}]})
        );
    }

    #[test]
    fn usage_is_null_until_the_usage_chunk() {
        let env = envelope(Endpoint::Text, true);
        let text = to_value(env.text_chunk(0, "a", None));
        assert_eq!(text["usage"], Value::Null);
        assert!(text.get("usage").is_some());
        assert_eq!(text["choices"][0]["text"], "a");
        assert_eq!(text["object"], "text_completion");
        let usage = to_value(env.usage_chunk(Usage::new(3, 4)));
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
        );
    }

    #[test]
    fn every_choice_keeps_its_index_whole_and_streamed() {
        let env = envelope(Endpoint::Text, false);
        let finished: Vec<FinishedChoice> = ["a", "b", "c"]
            .iter()
            .map(|text| FinishedChoice {
                text: (*text).into(),
                logprobs: Vec::new(),
                prompt_logprobs: None,
                tool_calls: Vec::new(),
                finish_reason: Some(FinishReason::Length),
            })
            .collect();
        let whole = to_value(env.completion(&finished, Usage::new(2, 3)));
        assert_eq!(
            whole["choices"],
            json!([
                {"index": 0, "text": "a", "finish_reason": "length", "logprobs": null},
                {"index": 1, "text": "b", "finish_reason": "length", "logprobs": null},
                {"index": 2, "text": "c", "finish_reason": "length", "logprobs": null}
            ])
        );
        let chat = envelope(Endpoint::Chat, false);
        assert_eq!(to_value(chat.role_chunk(2))["choices"][0]["index"], 2);
        assert_eq!(
            to_value(chat.text_chunk(5, "x", None))["choices"][0]["index"],
            5
        );
        let finish = to_value(chat.finish_chunk(7, FinishReason::Stop, None));
        assert_eq!(finish["choices"][0]["index"], 7);
    }

    fn entry(token: &str, logprob: f32, alternatives: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token: token.into(),
            logprob,
            bytes: token.as_bytes().to_vec(),
            top_logprobs: alternatives
                .iter()
                .map(|&(token, logprob)| crate::engine::TopLogprob {
                    token: token.into(),
                    logprob,
                    bytes: token.as_bytes().to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn completions_logprobs_have_the_legacy_shape_with_the_echoed_prompt_first() {
        let env = Envelope {
            logprobs: true,
            ..envelope(Endpoint::Text, false)
        };
        let prompt = PromptLogprobs {
            first_token: "Once".into(),
            scored: vec![entry(" upon", -0.5, &[(" upon", -0.5), (" more", -1.0)])],
        };
        let generated = [entry(" a", -0.25, &[(" the", -0.125)])];
        let finished = [FinishedChoice {
            text: "Once upon a".into(),
            logprobs: generated.to_vec(),
            prompt_logprobs: Some(prompt.clone()),
            tool_calls: Vec::new(),
            finish_reason: Some(FinishReason::Length),
        }];
        let whole = to_value(env.completion(&finished, Usage::new(2, 1)));
        assert_eq!(
            whole["choices"][0]["logprobs"],
            json!({
                "tokens": ["Once", " upon", " a"],
                "token_logprobs": [null, -0.5, -0.25],
                "top_logprobs": [null, {" upon": -0.5, " more": -1.0}, {" a": -0.25, " the": -0.125}],
                "text_offset": [0, 4, 9]
            })
        );
        // Streamed, the offsets run on from chunk to chunk.
        let mut offset = 0;
        let first = env.choice_logprobs(Some(&prompt), &[], &mut offset);
        assert_eq!(offset, 9);
        let second = env.choice_logprobs(None, &generated, &mut offset);
        let chunk = to_value(env.text_chunk(0, " a", second));
        assert_eq!(chunk["choices"][0]["logprobs"]["text_offset"], json!([9]));
        assert_eq!(to_value(first.unwrap())["tokens"], json!(["Once", " upon"]));
        // Not asked for: null.
        let plain = envelope(Endpoint::Text, false);
        assert!(
            plain
                .choice_logprobs(Some(&prompt), &generated, &mut 0)
                .is_none()
        );
    }
}
