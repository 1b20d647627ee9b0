//! Tool calls in a model's own words: the formats of the template families meshnet knows
//! (told apart by rendering probes through the template), the tools and calls a conversation
//! hands to a template, the rewriting of a conversation for templates that know no tools,
//! and the parser that finds calls in generated text as it streams.
//!
//! | Format                  | An answer calling `f`                                           |
//! |-------------------------|-----------------------------------------------------------------|
//! | [`ToolFormat::Hermes`]  | `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`  |
//! | [`ToolFormat::Llama3`]  | `{"name": "f", "parameters": {...}}` (or after `<\|python_tag\|>`) |
//! | [`ToolFormat::Generic`] | as Hermes; the tools are described in the system prompt         |

mod generic;
mod parser;
mod scan;

use minijinja::Value;

use crate::error::{ModelError, Result};
use crate::template_env::{to_python_json, value_from_json};

pub use generic::generic_tools_prompt;
pub use parser::ToolCallParser;
use parser::{PYTHON_TAG, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};

/// How a template's family writes tool calls, and so how answers are read for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, one block per call
    /// (Qwen 2.5 and 3, NousResearch Hermes 2 Pro and 3, and other templates writing calls
    /// so). The template renders the tools itself.
    Hermes,
    /// A JSON object `{"name": ..., "parameters": ...}` as the whole answer, or after
    /// `<|python_tag|>` (Llama 3.1, 3.2, 3.3). The template renders the tools itself.
    Llama3,
    /// Any other template, which renders no tools or writes calls in a syntax not read here:
    /// the tools are described in the system prompt ([`generic_tools_prompt`]), past calls
    /// and results become ordinary turns, and answers are read as [`ToolFormat::Hermes`].
    Generic,
}

/// The two ways of writing a call the parser reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallSyntax {
    /// Each call in `<tool_call>` … `</tool_call>`.
    Tagged,
    /// Each call a bare JSON object.
    Json,
}

impl CallSyntax {
    /// The text that opens a call anywhere in an answer.
    fn opener(self) -> &'static str {
        match self {
            CallSyntax::Tagged => TOOL_CALL_OPEN,
            CallSyntax::Json => PYTHON_TAG,
        }
    }
}

impl ToolFormat {
    /// The format's name, as `/status` and the docs spell it.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Generic => "generic",
        }
    }

    pub(crate) fn syntax(self) -> CallSyntax {
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => CallSyntax::Tagged,
            ToolFormat::Llama3 => CallSyntax::Json,
        }
    }

    /// One call of `name` with `arguments` (JSON text) as a model of this format writes it,
    /// the arguments laid out as a template's `tojson` lays them out (kept as they are when
    /// they are not JSON).
    pub fn render_call(self, name: &str, arguments: &str) -> String {
        let arguments = value_from_json(arguments)
            .ok()
            .and_then(|value| to_python_json(&value).ok())
            .unwrap_or_else(|| arguments.to_owned());
        format!(
            "{}{arguments}{}",
            self.call_opening(name),
            self.call_closing()
        )
    }

    /// The text a call of `name` starts with, up to its arguments.
    pub fn call_opening(self, name: &str) -> String {
        let name = serde_json::to_string(name).unwrap_or_default();
        match self.syntax() {
            CallSyntax::Tagged => format!("{TOOL_CALL_OPEN}\n{{\"name\": {name}, \"arguments\": "),
            CallSyntax::Json => format!("{{\"name\": {name}, \"parameters\": "),
        }
    }

    /// The text a call ends with, after its arguments.
    pub fn call_closing(self) -> String {
        match self.syntax() {
            CallSyntax::Tagged => format!("}}\n{TOOL_CALL_CLOSE}"),
            CallSyntax::Json => "}".to_owned(),
        }
    }

    /// The text between two calls of one answer; `None` when the format's templates take one
    /// call per answer (Llama 3.x).
    pub fn call_separator(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::Generic => Some("\n"),
            ToolFormat::Llama3 => None,
        }
    }
}

/// A call the assistant made in an earlier turn, as a conversation carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The call's id, which the tool's answer refers to.
    pub id: String,
    /// The function called.
    pub name: String,
    /// Its arguments as JSON text (a template sees them as a mapping, as Hugging Face
    /// templates expect; text that is not JSON is passed as a string).
    pub arguments: String,
}

impl ToolCall {
    /// The call as a template sees it: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}`.
    pub(crate) fn template_value(&self) -> Value {
        let arguments = value_from_json(&self.arguments)
            .unwrap_or_else(|_| Value::from(self.arguments.as_str()));
        let function = Value::from_pairs([
            ("name", Value::from(self.name.as_str())),
            ("arguments", arguments),
        ]);
        Value::from_pairs([
            ("id", Value::from(self.id.as_str())),
            ("type", Value::from("function")),
            ("function", function),
        ])
    }
}

/// A function a conversation offers the model, in OpenAI's (and Hugging Face's) shape
/// `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Clone, Debug)]
pub struct ToolDefinition {
    name: String,
    parameters: serde_json::Value,
    value: Value,
}

impl ToolDefinition {
    /// A tool from its JSON text, kept in the text's key order (as a template would see
    /// Python's dict); [`ModelError::Tool`] when it is not such an object with a name.
    pub fn from_json(text: &str) -> Result<Self> {
        let invalid = |reason: String| ModelError::Tool(reason);
        let parsed: serde_json::Value =
            serde_json::from_str(text).map_err(|e| invalid(format!("not JSON: {e}")))?;
        let function = parsed
            .get("function")
            .filter(|_| parsed.get("type").and_then(|t| t.as_str()) == Some("function"))
            .ok_or_else(|| {
                invalid("expected {\"type\": \"function\", \"function\": {...}}".into())
            })?;
        let name = function
            .get("name")
            .and_then(|name| name.as_str())
            .ok_or_else(|| invalid("the function has no name".into()))?
            .to_owned();
        let parameters = function
            .get("parameters")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}}));
        let value = value_from_json(text).map_err(|e| invalid(format!("not JSON: {e}")))?;
        Ok(ToolDefinition {
            name,
            parameters,
            value,
        })
    }

    /// The function's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The JSON Schema of its arguments (an empty object schema when it declares none).
    pub fn parameters(&self) -> &serde_json::Value {
        &self.parameters
    }

    /// The tool as a template sees it.
    pub(crate) fn template_value(&self) -> &Value {
        &self.value
    }
}

/// What the parser makes known about an answer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text of the answer that is not part of a call.
    Content(String),
    /// A call begins: its place among the answer's calls (from 0) and the function's name.
    CallStart {
        /// The call's place among the answer's calls.
        index: usize,
        /// The function called.
        name: String,
    },
    /// More of a call's arguments (JSON text), to append to what came before.
    CallArguments {
        /// The call's place among the answer's calls.
        index: usize,
        /// The next piece of its arguments.
        text: String,
    },
}

/// A call found in an answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedCall {
    /// The function called.
    pub name: String,
    /// Its arguments as JSON text, as the model wrote them.
    pub arguments: String,
}

/// An answer read for calls: its text without them, and the calls.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedAnswer {
    /// The text that is not part of a call.
    pub content: String,
    /// The calls, in order.
    pub calls: Vec<ParsedCall>,
}

impl ParsedAnswer {
    /// Adds what `event` makes known.
    pub fn apply(&mut self, event: ToolEvent) {
        match event {
            ToolEvent::Content(text) => self.content.push_str(&text),
            ToolEvent::CallStart { index, name } => {
                self.calls.resize_with(index + 1, ParsedCall::default);
                self.calls[index].name = name;
            }
            ToolEvent::CallArguments { index, text } => {
                if let Some(call) = self.calls.get_mut(index) {
                    call.arguments.push_str(&text);
                }
            }
        }
    }
}

/// Reads a whole answer in `format` for calls (without `parallel`, only the first counts).
pub fn parse_answer(format: ToolFormat, text: &str, parallel: bool) -> ParsedAnswer {
    let mut parser = ToolCallParser::new(format, parallel);
    let mut answer = ParsedAnswer::default();
    for event in parser.push(text).into_iter().chain(parser.finish()) {
        answer.apply(event);
    }
    answer
}

/// The name of the function the format probes use.
const PROBE_NAME: &str = "meshnet_probe_function";
/// The arguments of the probe call.
const PROBE_ARGUMENTS: &str = r#"{"probe_argument": 1}"#;

/// The format of a template, found by rendering probes through `render` (a conversation
/// and tools in, the text out): a template that shows an offered tool's name and writes a
/// past call as [`ToolFormat::Hermes`] or [`ToolFormat::Llama3`] does is of that format;
/// any other is [`ToolFormat::Generic`].
pub(crate) fn probe_format(
    render: impl Fn(&[crate::ChatMessage], &[ToolDefinition]) -> Result<String>,
) -> ToolFormat {
    let probe_tool = format!(
        r#"{{"type": "function", "function": {{"name": "{PROBE_NAME}", "description": "A probe.", "parameters": {{"type": "object", "properties": {{"probe_argument": {{"type": "integer", "description": "A number."}}}}, "required": ["probe_argument"]}}}}}}"#
    );
    let Ok(tool) = ToolDefinition::from_json(&probe_tool) else {
        return ToolFormat::Generic;
    };
    let question = crate::ChatMessage::user("Probe?");
    let shows_tools = render(std::slice::from_ref(&question), std::slice::from_ref(&tool))
        .is_ok_and(|text| text.contains(PROBE_NAME));
    if !shows_tools {
        return ToolFormat::Generic;
    }
    let call = ToolCall {
        // Nine letters and digits: Mistral templates refuse other ids.
        id: "probe0001".to_owned(),
        name: PROBE_NAME.to_owned(),
        arguments: PROBE_ARGUMENTS.to_owned(),
    };
    let conversation = [
        question,
        crate::ChatMessage::assistant_calls("", vec![call]),
    ];
    let Ok(text) = render(&conversation, std::slice::from_ref(&tool)) else {
        return ToolFormat::Generic;
    };
    let expected = [ParsedCall {
        name: PROBE_NAME.to_owned(),
        arguments: PROBE_ARGUMENTS.to_owned(),
    }];
    let same_calls = |answer: ParsedAnswer| {
        answer.calls.len() == 1
            && answer.calls[0].name == expected[0].name
            && value_from_json(&answer.calls[0].arguments).ok()
                == value_from_json(&expected[0].arguments).ok()
    };
    if same_calls(parse_answer(ToolFormat::Hermes, &text, true)) {
        return ToolFormat::Hermes;
    }
    let llama_call = format!(r#"{{"name": "{PROBE_NAME}", "parameters": "#);
    if let Some(at) = text.find(&llama_call)
        && same_calls(parse_answer(ToolFormat::Llama3, &text[at..], true))
    {
        return ToolFormat::Llama3;
    }
    ToolFormat::Generic
}

#[cfg(test)]
mod tests;
