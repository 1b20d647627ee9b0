//! Conversations with tools for templates that render none (the generic tool format): the
//! tools are described in the system prompt, a past call is written into the assistant's text
//! as a model would write it, and tool results come back as a user turn.

use super::ChatMessage;
use crate::tool_calls::{ToolDefinition, ToolFormat, generic_tools_prompt};

/// The tag that opens a tool's result in the generic format.
const TOOL_RESPONSE_OPEN: &str = "<tool_response>";
/// The tag that closes a tool's result in the generic format.
const TOOL_RESPONSE_CLOSE: &str = "</tool_response>";

/// `messages` and `tools` as plain turns for a template that knows no tools: the tools'
/// description added to the first system turn (or put in a new one), each assistant turn's
/// calls written after its text, and each run of tool results joined into one user turn.
pub(super) fn fold_tools_into_turns(
    messages: &[ChatMessage],
    tools: &[ToolDefinition],
) -> Vec<ChatMessage> {
    let mut turns: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    if !tools.is_empty() {
        let prompt = generic_tools_prompt(tools);
        match messages.first() {
            Some(first) if first.role == "system" => {
                turns.push(ChatMessage::system(format!(
                    "{}\n\n{prompt}",
                    first.content
                )));
            }
            _ => turns.push(ChatMessage::system(prompt)),
        }
    }
    let skip =
        usize::from(!tools.is_empty() && messages.first().is_some_and(|m| m.role == "system"));
    let mut previous_was_tool = false;
    for message in &messages[skip..] {
        let is_tool = message.role == "tool";
        match turns.last_mut() {
            Some(last) if is_tool && previous_was_tool => {
                last.content.push('\n');
                last.content.push_str(&tool_result(message));
            }
            _ if is_tool => turns.push(ChatMessage::user(tool_result(message))),
            _ if !message.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !message.content.is_empty() {
                    parts.push(message.content.clone());
                }
                for call in &message.tool_calls {
                    parts.push(ToolFormat::Generic.render_call(&call.name, &call.arguments));
                }
                turns.push(ChatMessage::new(message.role.clone(), parts.join("\n")));
            }
            _ => turns.push(ChatMessage::new(
                message.role.clone(),
                message.content.clone(),
            )),
        }
        previous_was_tool = is_tool;
    }
    turns
}

/// A tool's result as the generic format writes it.
fn tool_result(message: &ChatMessage) -> String {
    format!(
        "{TOOL_RESPONSE_OPEN}\n{}\n{TOOL_RESPONSE_CLOSE}",
        message.content
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::ToolCall;

    fn weather_tool() -> ToolDefinition {
        ToolDefinition::from_json(
            r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#,
        )
        .unwrap()
    }

    #[test]
    fn the_generic_format_folds_tools_calls_and_results_into_plain_turns() {
        let messages = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Weather in Paris and Rome?"),
            ChatMessage::assistant_calls(
                "",
                vec![
                    ToolCall {
                        id: "call_1".into(),
                        name: "get_weather".into(),
                        arguments: r#"{"city": "Paris"}"#.into(),
                    },
                    ToolCall {
                        id: "call_2".into(),
                        name: "get_weather".into(),
                        arguments: r#"{"city": "Rome"}"#.into(),
                    },
                ],
            ),
            ChatMessage::tool("call_1", "18 C"),
            ChatMessage::tool("call_2", "25 C"),
        ];
        let turns = fold_tools_into_turns(&messages, &[weather_tool()]);
        let expected_system = format!("Be brief.\n\n{}", generic_tools_prompt(&[weather_tool()]));
        assert_eq!(
            turns,
            [
                ChatMessage::system(expected_system),
                ChatMessage::user("Weather in Paris and Rome?"),
                ChatMessage::assistant(
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                     <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
                ),
                ChatMessage::user(
                    "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
                ),
            ]
        );
        assert!(generic_tools_prompt(&[weather_tool()]).contains(
            "\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""
        ));
        // Without tools, nothing is added, and a conversation without a system turn gets one
        // when tools are offered.
        assert_eq!(fold_tools_into_turns(&messages[1..2], &[]), &messages[1..2]);
        assert_eq!(
            fold_tools_into_turns(&messages[1..2], &[weather_tool()])[0].role,
            "system"
        );
    }
}
