//! The JSON shapes of successful answers: model objects, completions and stream chunks.

use serde::Serialize;

use crate::engine::{FinishReason, ModelInfo, TokenLogprob};
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
    choices: [Choice<'a>; 1],
    usage: Usage,
}

impl<'a> Completion<'a> {
    /// Gives a chat answer the calls the model made: `message.tool_calls`, and `null`
    /// content when there is no text besides them.
    pub(crate) fn with_tool_calls(mut self, calls: &'a [ToolCallOut]) -> Self {
        if calls.is_empty() {
            return self;
        }
        for choice in &mut self.choices {
            if let Some(message) = &mut choice.message {
                message.tool_calls = Some(calls);
                message.content = message.content.filter(|text| !text.is_empty());
            }
        }
        self
    }
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

/// A choice's `logprobs`, as OpenAI's chat answers have it.
#[derive(Debug, Serialize)]
struct ChoiceLogprobs<'a> {
    content: &'a [TokenLogprob],
    refusal: Option<()>,
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
    /// The whole answer, with `logprobs` when they were asked for.
    pub(crate) fn completion<'a>(
        &'a self,
        text: &'a str,
        logprobs: &'a [TokenLogprob],
        finish_reason: FinishReason,
        usage: Usage,
    ) -> Completion<'a> {
        let (object, message, text) = match self.endpoint {
            Endpoint::Chat => (
                "chat.completion",
                Some(Message {
                    role: "assistant",
                    content: Some(text),
                    tool_calls: None,
                }),
                None,
            ),
            Endpoint::Text => ("text_completion", None, Some(text)),
        };
        Completion {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices: [Choice {
                index: 0,
                message,
                text,
                finish_reason,
                logprobs: self.choice_logprobs(logprobs),
            }],
            usage,
        }
    }

    /// The chat stream's opening chunk, announcing the assistant role.
    pub(crate) fn role_chunk(&self) -> Chunk<'_> {
        self.chunk(vec![ChunkChoice {
            index: 0,
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

    /// A chunk carrying new text, with the log-probabilities of the tokens it completes when
    /// they were asked for.
    pub(crate) fn text_chunk<'a>(
        &'a self,
        text: &'a str,
        logprobs: &'a [TokenLogprob],
    ) -> Chunk<'a> {
        self.choice_chunk(Some(text), self.choice_logprobs(logprobs), None)
    }

    /// The chunk with the finish reason and no new text; `logprobs` are those of tokens no
    /// text chunk carried (`null` when there are none).
    pub(crate) fn finish_chunk<'a>(
        &'a self,
        reason: FinishReason,
        logprobs: &'a [TokenLogprob],
    ) -> Chunk<'a> {
        let logprobs = if logprobs.is_empty() {
            None
        } else {
            self.choice_logprobs(logprobs)
        };
        self.choice_chunk(None, logprobs, Some(reason))
    }

    fn choice_logprobs<'a>(&self, content: &'a [TokenLogprob]) -> Option<ChoiceLogprobs<'a>> {
        self.logprobs.then_some(ChoiceLogprobs {
            content,
            refusal: None,
        })
    }

    /// The chunk that starts call `index` of function `name` with id `id` (chat only).
    pub(crate) fn tool_call_start_chunk<'a>(
        &'a self,
        index: usize,
        id: &'a str,
        name: &'a str,
    ) -> Chunk<'a> {
        self.tool_call_chunk(ToolCallDelta {
            index,
            id: Some(id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: "",
            },
        })
    }

    /// A chunk with more of call `index`'s arguments (chat only).
    pub(crate) fn tool_call_arguments_chunk<'a>(
        &'a self,
        index: usize,
        text: &'a str,
    ) -> Chunk<'a> {
        self.tool_call_chunk(ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: text,
            },
        })
    }

    fn tool_call_chunk<'a>(&'a self, call: ToolCallDelta<'a>) -> Chunk<'a> {
        self.chunk(vec![ChunkChoice {
            index: 0,
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
        text: Option<&'a str>,
        logprobs: Option<ChoiceLogprobs<'a>>,
        finish_reason: Option<FinishReason>,
    ) -> Chunk<'a> {
        let choice = match self.endpoint {
            Endpoint::Chat => ChunkChoice {
                index: 0,
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
                index: 0,
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
            to_value(env.role_chunk()),
            json!({"id": "x-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": null, "finish_reason": null}]})
        );
        assert_eq!(
            to_value(env.text_chunk("hé", &[]))["choices"][0]["delta"],
            json!({"content": "hé"})
        );
        let finish = to_value(env.finish_chunk(FinishReason::Length, &[]));
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
        let chunk = to_value(env.text_chunk("hé", &entries));
        assert_eq!(chunk["choices"][0]["logprobs"], expected);
        let whole = to_value(env.completion("hé", &entries, FinishReason::Stop, Usage::new(1, 1)));
        assert_eq!(whole["choices"][0]["logprobs"], expected);
        let finish = to_value(env.finish_chunk(FinishReason::Stop, &entries));
        assert_eq!(finish["choices"][0]["logprobs"], expected);
        let finish = to_value(env.finish_chunk(FinishReason::Stop, &[]));
        assert_eq!(finish["choices"][0]["logprobs"], Value::Null);
        assert_eq!(
            to_value(env.role_chunk())["choices"][0]["logprobs"],
            Value::Null
        );
        // Not asked for: null everywhere.
        let plain = envelope(Endpoint::Chat, false);
        let chunk = to_value(plain.text_chunk("hé", &entries));
        assert_eq!(chunk["choices"][0]["logprobs"], Value::Null);
    }

    #[test]
    fn tool_calls_have_openais_shape_whole_and_streamed() {
        let env = envelope(Endpoint::Chat, false);
        let mut call = ToolCallOut::new("call_1".into(), "get_weather".into());
        call.push_arguments("{\"city\"");
        call.push_arguments(": \"Paris\"}");
        let calls = [call];
        let whole = to_value(
            env.completion("", &[], FinishReason::ToolCalls, Usage::new(1, 2))
                .with_tool_calls(&calls),
        );
        assert_eq!(
            whole["choices"][0]["message"],
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
            ]})
        );
        assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
        // Text beside the calls stays; without calls the message has no tool_calls.
        let both = to_value(
            env.completion("Hi.", &[], FinishReason::ToolCalls, Usage::new(1, 2))
                .with_tool_calls(&calls),
        );
        assert_eq!(both["choices"][0]["message"]["content"], "Hi.");
        let plain = to_value(
            env.completion("", &[], FinishReason::Stop, Usage::new(1, 2))
                .with_tool_calls(&[]),
        );
        assert_eq!(
            plain["choices"][0]["message"],
            json!({"role": "assistant", "content": ""})
        );

        let start = to_value(env.tool_call_start_chunk(0, "call_1", "get_weather"));
        assert_eq!(
            start["choices"][0],
            json!({"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": ""}}
            ]}, "logprobs": null, "finish_reason": null})
        );
        let more = to_value(env.tool_call_arguments_chunk(1, "{\"a\""));
        assert_eq!(
            more["choices"][0]["delta"],
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\""}}]})
        );
    }

    #[test]
    fn usage_is_null_until_the_usage_chunk() {
        let env = envelope(Endpoint::Text, true);
        let text = to_value(env.text_chunk("a", &[]));
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
}
