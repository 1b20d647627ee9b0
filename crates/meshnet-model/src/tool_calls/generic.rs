//! The generic tool format, for templates that render no tools (or write calls in a syntax
//! not read here): the tools are described in the system prompt (the chat module folds past
//! calls and tool results into plain turns).

use super::ToolDefinition;
use crate::template_env::to_python_json;

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
