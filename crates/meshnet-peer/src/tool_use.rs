//! The tracker's side of tool calls: a chat's calls and results handed to the chat template,
//! the grammar that makes the model call a tool when the request requires it, and the
//! reading of calls out of the answer as it streams.

use meshnet_api::{ChatTurn, EngineError, EngineEvent, ToolChoice, ToolRequest};
use meshnet_grammar::{JsonConstraint, JsonFormat, TokenEnvironment, ToolCallSpec};
use meshnet_model::{ChatMessage, ToolCall, ToolCallParser, ToolDefinition, ToolEvent, ToolFormat};

/// The conversation's turns as the chat template takes them.
pub(crate) fn chat_messages(turns: Vec<ChatTurn>) -> Vec<ChatMessage> {
    turns
        .into_iter()
        .map(|turn| ChatMessage {
            tool_calls: turn
                .tool_calls
                .into_iter()
                .map(|call| ToolCall {
                    id: call.id,
                    name: call.name,
                    arguments: call.arguments,
                })
                .collect(),
            tool_call_id: turn.tool_call_id,
            ..ChatMessage::new(turn.role, turn.content)
        })
        .collect()
}

/// The tools a request offers, as the chat template takes them (none without any).
pub(crate) fn tool_definitions(
    tools: Option<&ToolRequest>,
) -> Result<Vec<ToolDefinition>, EngineError> {
    let Some(tools) = tools else {
        return Ok(Vec::new());
    };
    tools
        .tools
        .iter()
        .enumerate()
        .map(|(index, tool)| {
            ToolDefinition::from_json(&tool.json).map_err(|error| EngineError::InvalidRequest {
                param: Some(format!("tools[{index}]")),
                message: error.to_string(),
            })
        })
        .collect()
}

/// The constraint that makes the model call a tool, in `format`, when `tools` requires one
/// (`tool_choice` `required`: any of them; a named function: that one); `None` for `auto`.
/// Compiling can take a while: call it on a blocking thread. A parameters schema the grammar
/// engine cannot compile is a 400 naming it.
pub(crate) fn required_call_constraint(
    environment: &TokenEnvironment,
    format: ToolFormat,
    tools: &ToolRequest,
) -> Result<Option<JsonConstraint>, EngineError> {
    let functions: Vec<(&str, &serde_json::Value)> = match &tools.choice {
        ToolChoice::Auto => return Ok(None),
        ToolChoice::Required => tools
            .tools
            .iter()
            .map(|tool| (tool.name.as_str(), &tool.parameters))
            .collect(),
        ToolChoice::Function(name) => tools
            .tools
            .iter()
            .filter(|tool| &tool.name == name)
            .map(|tool| (tool.name.as_str(), &tool.parameters))
            .collect(),
    };
    let spec = ToolCallSpec {
        format,
        functions: &functions,
        parallel: tools.parallel,
    };
    environment
        .compile_tool_calls(&spec)
        .map(Some)
        .map_err(|error| schema_error(environment, tools, &error.to_string()))
}

/// The 400 for a tool grammar that did not compile: naming the first offered function whose
/// parameters schema does not compile on its own, else `tool_choice`.
fn schema_error(environment: &TokenEnvironment, tools: &ToolRequest, reason: &str) -> EngineError {
    for (index, tool) in tools.tools.iter().enumerate() {
        if let Err(error) = environment.compile(&JsonFormat::Schema(tool.parameters.clone())) {
            return EngineError::InvalidRequest {
                param: Some(format!("tools[{index}].function.parameters")),
                message: format!("Invalid schema for function '{}': {error}", tool.name),
            };
        }
    }
    EngineError::InvalidRequest {
        param: Some("tool_choice".to_owned()),
        message: format!("the calls 'tool_choice' asks for cannot be enforced: {reason}"),
    }
}

/// Reads calls out of an answer's text as it streams, turning its deltas into the API's
/// events: text, and each call's start (with a new id) and arguments.
#[derive(Debug, Clone)]
pub(crate) struct CallReader {
    parser: ToolCallParser,
    /// The ids given to the calls so far.
    ids: Vec<String>,
}

impl CallReader {
    /// A reader of answers in `format`; without `parallel`, calls after the first are
    /// dropped.
    pub(crate) fn new(format: ToolFormat, parallel: bool) -> Self {
        CallReader {
            parser: ToolCallParser::new(format, parallel),
            ids: Vec::new(),
        }
    }

    /// The events the next piece of text makes known.
    pub(crate) fn read(&mut self, text: &str) -> Vec<EngineEvent> {
        let events = self.parser.push(text);
        self.api_events(events)
    }

    /// The events the end of the answer makes known.
    pub(crate) fn finish(&mut self) -> Vec<EngineEvent> {
        let events = self.parser.finish();
        self.api_events(events)
    }

    /// How many calls were read so far.
    pub(crate) fn calls(&self) -> usize {
        self.parser.calls()
    }

    fn api_events(&mut self, events: Vec<ToolEvent>) -> Vec<EngineEvent> {
        events
            .into_iter()
            .map(|event| match event {
                ToolEvent::Content(text) => EngineEvent::Delta(text),
                ToolEvent::CallStart { index, name } => {
                    let id = call_id();
                    self.ids.push(id.clone());
                    EngineEvent::ToolCallStart { index, id, name }
                }
                ToolEvent::CallArguments { index, text } => {
                    EngineEvent::ToolCallArguments { index, text }
                }
            })
            .collect()
    }
}

/// A new call id: `call_` and 24 random letters and digits.
fn call_id() -> String {
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{}", &random[..24])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_become_text_and_call_events_with_fresh_ids() {
        let mut reader = CallReader::new(ToolFormat::Hermes, true);
        let mut events = reader.read("Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\"");
        events.extend(reader.read(": 1}}\n</tool_call>"));
        events.extend(reader.finish());
        let [
            EngineEvent::Delta(text),
            EngineEvent::ToolCallStart { index: 0, id, name },
            EngineEvent::ToolCallArguments {
                index: 0,
                text: first,
            },
            EngineEvent::ToolCallArguments {
                index: 0,
                text: rest,
            },
        ] = events.as_slice()
        else {
            panic!("{events:?}");
        };
        assert_eq!(text, "Sure.");
        assert_eq!(name, "f");
        assert_eq!(format!("{first}{rest}"), "{\"a\": 1}");
        assert_eq!(id.len(), "call_".len() + 24);
        assert!(id.starts_with("call_") && id[5..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_eq!(reader.calls(), 1);
        let mut other = CallReader::new(ToolFormat::Hermes, true);
        let events = other.read("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
        let EngineEvent::ToolCallStart { id: second, .. } = &events[0] else {
            panic!("{events:?}");
        };
        assert_ne!(id, second);
    }
}
