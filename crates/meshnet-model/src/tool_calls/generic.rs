//! The generic tool format, for templates that render no tools (or write calls in a syntax
//! not read here): the tools are described in the system prompt, a past call is written into
//! the assistant's text as a model would write it, and tool results come back as a user turn.

use super::{ToolDefinition, ToolFormat};
use crate::chat::ChatMessage;
use crate::template_env::to_python_json;

/// The tag that opens a tool's result in the generic format.
const TOOL_RESPONSE_OPEN: &str = "<tool_response>";
/// The tag that closes a tool's result in the generic format.
const TOOL_RESPONSE_CLOSE: &str = "</tool_response>";

/// The system prompt text that describes `tools` and how to call them, in the generic
/// format.
pub fn generic_tools_prompt(tools: &[ToolDefinition]) -> String {
    let mut prompt = String::from(
        "You can call functions to help with the request. Each function is described in \
         JSON, one per line, between <tools> and </tools>:\n<tools>\n",
    );
    for tool in tools {
        prompt.push_str(&to_python_json(tool.template_value()).unwrap_or_default());
        prompt.push('\n');
    }
    prompt.push_str(
        "</tools>\nTo call a function, write a JSON object with its name and its arguments \
         between <tool_call> and </tool_call>, and nothing else:\n<tool_call>\n\
         {\"name\": \"the function's name\", \"arguments\": {\"an argument\": \"its value\"}}\n\
         </tool_call>\nWrite one such block per call. The results come back between \
         <tool_response> and </tool_response>.",
    );
    prompt
}

/// `messages` and `tools` as plain turns for a template that knows no tools: the tools'
/// description added to the first system turn (or put in a new one), each assistant turn's
/// calls written after its text, and each run of tool results joined into one user turn.
pub(crate) fn fold_tools_into_turns(
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
