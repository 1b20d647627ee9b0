//! The tool fields of a chat request: `tools`, `tool_choice` and `parallel_tool_calls`, and
//! the calls and results its messages carry. Every failure names its field.

use serde_json::Value;
use serde_json::value::RawValue;

use super::{Fields, type_error};
use crate::engine::{ChatTurn, ToolCallTurn, ToolChoice, ToolRequest, ToolSpec};
use crate::error::ApiError;

/// The most tools a request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// The longest function name (OpenAI's limit).
const MAX_NAME_LEN: usize = 64;

/// `tool_choice` as written, `"none"` included.
enum Choice {
    None,
    Some(ToolChoice),
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of the chat body `body` (whose fields are
/// `fields`); `None` when it offers no tools or `tool_choice` is `"none"`.
pub(super) fn parse_tool_request(
    fields: &Fields<'_>,
    body: &[u8],
) -> Result<Option<ToolRequest>, ApiError> {
    let tools = parse_tools(fields, body)?;
    let choice = parse_tool_choice(fields, &tools)?;
    let parallel = fields.bool("parallel_tool_calls")?.unwrap_or(true);
    Ok(match choice {
        Choice::Some(choice) if !tools.is_empty() => Some(ToolRequest {
            tools,
            choice,
            parallel,
        }),
        _ => None,
    })
}

/// `tools`: a non-empty array of at most [`MAX_TOOLS`] functions with distinct names, each
/// kept with the JSON text the client wrote for it.
fn parse_tools(fields: &Fields<'_>, body: &[u8]) -> Result<Vec<ToolSpec>, ApiError> {
    let items = match fields.get("tools") {
        None => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(v) => return Err(type_error("tools", "an array", v)),
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            Some("tools"),
            "Invalid 'tools': empty array. Expected an array with minimum length 1, or leave \
             it out.",
        ));
    }
    if items.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            Some("tools"),
            format!(
                "Invalid 'tools': array too long. Expected at most {MAX_TOOLS} tools, but got {}.",
                items.len()
            ),
        ));
    }
    let raw = raw_tools(body)?;
    let mut tools: Vec<ToolSpec> = Vec::with_capacity(items.len());
    for (index, (item, raw)) in items.iter().zip(raw).enumerate() {
        let tool = parse_tool(&format!("tools[{index}]"), item, raw)?;
        if tools.iter().any(|other| other.name == tool.name) {
            let param = format!("tools[{index}].function.name");
            return Err(ApiError::invalid(
                Some(&param),
                format!(
                    "Invalid '{param}': another tool is already named '{}'.",
                    tool.name
                ),
            ));
        }
        tools.push(tool);
    }
    Ok(tools)
}

/// The JSON text of each item of `tools` in `body`, as the client wrote it.
fn raw_tools(body: &[u8]) -> Result<Vec<&RawValue>, ApiError> {
    #[derive(serde::Deserialize)]
    struct RawTools<'a> {
        #[serde(borrow)]
        tools: Option<Vec<&'a RawValue>>,
    }
    serde_json::from_slice::<RawTools<'_>>(body)
        .map(|raw| raw.tools.unwrap_or_default())
        .map_err(|e| ApiError::invalid(Some("tools"), format!("Invalid 'tools': {e}.")))
}

/// One tool: `{"type": "function", "function": {"name", "description"?, "parameters"?,
/// "strict"?}}`.
fn parse_tool(at: &str, tool: &Value, raw: &RawValue) -> Result<ToolSpec, ApiError> {
    let Value::Object(map) = tool else {
        return Err(type_error(at, "an object", tool));
    };
    let fields = Fields(map);
    expect_function_type(&format!("{at}.type"), &fields)?;
    let (function, function_param) = function_object(at, &fields)?;
    let name = required_string(&function, &function_param, "name")?;
    check_function_name(&format!("{function_param}.name"), &name)?;
    let description_param = format!("{function_param}.description");
    if let Some(v) = function.get("description").filter(|v| !v.is_string()) {
        return Err(type_error(&description_param, "a string", v));
    }
    let strict_param = format!("{function_param}.strict");
    if let Some(v) = function.get("strict").filter(|v| !v.is_boolean()) {
        return Err(type_error(&strict_param, "a boolean", v));
    }
    let parameters = match function.get("parameters") {
        None => serde_json::json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(v) => {
            let param = format!("{function_param}.parameters");
            return Err(type_error(&param, "an object (a JSON Schema)", v));
        }
    };
    Ok(ToolSpec {
        name,
        parameters,
        json: raw.get().to_owned(),
    })
}

/// `type` must be `"function"`, the only kind of tool served.
fn expect_function_type(param: &str, fields: &Fields<'_>) -> Result<(), ApiError> {
    match fields.get("type") {
        Some(Value::String(kind)) if kind == "function" => Ok(()),
        Some(Value::String(kind)) => Err(ApiError::invalid(
            Some(param),
            format!("Invalid value: '{kind}'. Supported values are: 'function'."),
        )),
        Some(v) => Err(type_error(param, "a string", v)),
        None => Err(missing(param)),
    }
}

/// A function name: 1 to 64 letters, digits, underscores or dashes.
fn check_function_name(param: &str, name: &str) -> Result<(), ApiError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        return Ok(());
    }
    Err(ApiError::invalid(
        Some(param),
        format!(
            "Invalid '{param}': '{name}' does not match '^[a-zA-Z0-9_-]{{1,{MAX_NAME_LEN}}}$'."
        ),
    ))
}

/// `tool_choice`: `"none"`, `"auto"` (the default), `"required"`, or
/// `{"type": "function", "function": {"name"}}` naming one of `tools`. Only `"none"` and
/// `"auto"` may come without tools.
fn parse_tool_choice(fields: &Fields<'_>, tools: &[ToolSpec]) -> Result<Choice, ApiError> {
    let choice = match fields.get("tool_choice") {
        None => return Ok(Choice::Some(ToolChoice::Auto)),
        Some(Value::String(choice)) => match choice.as_str() {
            "none" => return Ok(Choice::None),
            "auto" => return Ok(Choice::Some(ToolChoice::Auto)),
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    Some("tool_choice"),
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'none', 'auto', \
                         'required', or an object naming a function."
                    ),
                ));
            }
        },
        Some(Value::Object(map)) => ToolChoice::Function(named_function(&Fields(map))?),
        Some(v) => return Err(type_error("tool_choice", "a string or an object", v)),
    };
    if tools.is_empty() {
        return Err(ApiError::invalid(
            Some("tool_choice"),
            "Invalid value for 'tool_choice': 'tool_choice' other than 'none' and 'auto' is \
             only allowed when 'tools' are specified.",
        ));
    }
    if let ToolChoice::Function(name) = &choice
        && !tools.iter().any(|tool| &tool.name == name)
    {
        return Err(ApiError::invalid(
            Some("tool_choice"),
            format!("Invalid value for 'tool_choice': no function named '{name}' is in 'tools'."),
        ));
    }
    Ok(Choice::Some(choice))
}

/// The name in `{"type": "function", "function": {"name": ...}}`.
fn named_function(fields: &Fields<'_>) -> Result<String, ApiError> {
    expect_function_type("tool_choice.type", fields)?;
    let function = match fields.get("function") {
        Some(Value::Object(function)) => Fields(function),
        Some(v) => return Err(type_error("tool_choice.function", "an object", v)),
        None => return Err(missing("tool_choice.function")),
    };
    match function.get("name") {
        Some(Value::String(name)) => Ok(name.clone()),
        Some(v) => Err(type_error("tool_choice.function.name", "a string", v)),
        None => Err(missing("tool_choice.function.name")),
    }
}

/// The `tool_calls` of message `at` with `role`: only assistant messages carry them, each
/// `{"id", "type": "function", "function": {"name", "arguments"}}` with a distinct id and
/// JSON arguments.
pub(super) fn message_tool_calls(
    at: &str,
    role: &str,
    fields: &Fields<'_>,
) -> Result<Vec<ToolCallTurn>, ApiError> {
    let param = format!("{at}.tool_calls");
    let items = match fields.get("tool_calls") {
        None => return Ok(Vec::new()),
        Some(_) if role != "assistant" => {
            return Err(ApiError::invalid(
                Some(&param),
                format!("Invalid '{param}': only assistant messages carry tool calls."),
            ));
        }
        Some(Value::Array(items)) => items,
        Some(v) => return Err(type_error(&param, "an array", v)),
    };
    let mut calls: Vec<ToolCallTurn> = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let call = parse_tool_call(&format!("{param}[{index}]"), item)?;
        if calls.iter().any(|other| other.id == call.id) {
            let id_param = format!("{param}[{index}].id");
            return Err(ApiError::invalid(
                Some(&id_param),
                format!(
                    "Invalid '{id_param}': another call of this message has id '{}'.",
                    call.id
                ),
            ));
        }
        calls.push(call);
    }
    Ok(calls)
}

/// The `function` object of the tool or call at `at`, and its parameter path.
fn function_object<'a>(at: &str, fields: &Fields<'a>) -> Result<(Fields<'a>, String), ApiError> {
    let function_param = format!("{at}.function");
    match fields.get("function") {
        Some(Value::Object(function)) => Ok((Fields(function), function_param)),
        Some(v) => Err(type_error(&function_param, "an object", v)),
        None => Err(missing(&function_param)),
    }
}

/// One call of an assistant message.
fn parse_tool_call(at: &str, call: &Value) -> Result<ToolCallTurn, ApiError> {
    let Value::Object(map) = call else {
        return Err(type_error(at, "an object", call));
    };
    let fields = Fields(map);
    let id = required_string(&fields, at, "id")?;
    expect_function_type(&format!("{at}.type"), &fields)?;
    let (function, function_param) = function_object(at, &fields)?;
    let name = required_string(&function, &function_param, "name")?;
    let arguments = required_string(&function, &function_param, "arguments")?;
    if serde_json::from_str::<serde::de::IgnoredAny>(&arguments).is_err() {
        let param = format!("{function_param}.arguments");
        return Err(ApiError::invalid(
            Some(&param),
            format!("Invalid '{param}': expected a string holding JSON, as the call gave it."),
        ));
    }
    Ok(ToolCallTurn {
        id,
        name,
        arguments,
    })
}

/// The `tool_call_id` of message `at` with `role`: required on tool messages, refused on
/// others.
pub(super) fn message_tool_call_id(
    at: &str,
    role: &str,
    fields: &Fields<'_>,
) -> Result<Option<String>, ApiError> {
    match (role, fields.get("tool_call_id")) {
        ("tool", _) => required_string(fields, at, "tool_call_id").map(Some),
        (_, None) => Ok(None),
        (_, Some(_)) => {
            let param = format!("{at}.tool_call_id");
            Err(ApiError::invalid(
                Some(&param),
                format!("Invalid '{param}': only tool messages answer a call."),
            ))
        }
    }
}

/// Every tool message answers a call of the assistant message before the run of tool
/// messages it is in, and every call of an assistant message is answered there.
pub(super) fn check_tool_results(turns: &[ChatTurn]) -> Result<(), ApiError> {
    // The assistant message whose calls the following tool messages answer, and the ids of
    // its calls not answered yet.
    let mut open: Option<(usize, Vec<&str>)> = None;
    for (index, turn) in turns.iter().enumerate() {
        if turn.role == "tool" {
            let Some((asked_at, unanswered)) = open.as_mut() else {
                let param = format!("messages[{index}].role");
                return Err(ApiError::invalid(
                    Some(&param),
                    format!(
                        "Invalid '{param}': a 'tool' message must answer a call of an \
                         assistant message with 'tool_calls' right before it."
                    ),
                ));
            };
            let id = turn.tool_call_id.as_deref().unwrap_or_default();
            if !turns[*asked_at].tool_calls.iter().any(|call| call.id == id) {
                let param = format!("messages[{index}].tool_call_id");
                return Err(ApiError::invalid(
                    Some(&param),
                    format!(
                        "Invalid '{param}': '{id}' is not the id of a call of \
                         messages[{asked_at}]."
                    ),
                ));
            }
            unanswered.retain(|pending| *pending != id);
            continue;
        }
        unanswered_calls(open.take())?;
        if !turn.tool_calls.is_empty() {
            let ids = turn
                .tool_calls
                .iter()
                .map(|call| call.id.as_str())
                .collect();
            open = Some((index, ids));
        }
    }
    unanswered_calls(open)
}

/// An error naming the calls of an assistant message that no tool message answered.
fn unanswered_calls(open: Option<(usize, Vec<&str>)>) -> Result<(), ApiError> {
    match open {
        Some((index, unanswered)) if !unanswered.is_empty() => {
            let param = format!("messages[{index}].tool_calls");
            Err(ApiError::invalid(
                Some(&param),
                format!(
                    "Invalid '{param}': an assistant message with 'tool_calls' must be followed \
                     by tool messages answering each call; none answers {}.",
                    unanswered.join(", ")
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// The string field `name` of the object at `at`, which must be there.
fn required_string(fields: &Fields<'_>, at: &str, name: &str) -> Result<String, ApiError> {
    let param = format!("{at}.{name}");
    match fields.get(name) {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(v) => Err(type_error(&param, "a string", v)),
        None => Err(missing(&param)),
    }
}

fn missing(param: &str) -> ApiError {
    ApiError::invalid(
        Some(param),
        format!("Missing required parameter: '{param}'."),
    )
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::engine::PromptInput;
    use crate::request::{Endpoint, ParsedRequest, parse};

    fn chat_text(body: &str) -> Result<ParsedRequest, ApiError> {
        parse(Endpoint::Chat, body.as_bytes(), "m", 100)
    }

    fn chat(body: &Value) -> Result<ParsedRequest, ApiError> {
        chat_text(&body.to_string())
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn user() -> Value {
        json!([{"role": "user", "content": "Weather in Paris?"}])
    }

    fn with(extra: Value) -> Value {
        let mut body = json!({"model": "m", "messages": user(), "tools": [weather()]});
        for (field, value) in extra.as_object().unwrap() {
            body[field] = value.clone();
        }
        body
    }

    #[test]
    fn tools_keep_the_clients_text_and_calls_and_results_reach_the_turns() {
        // Keys out of order and spacing as a client might write them.
        let tool = r#"{"function": {"parameters": {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}, "name": "f"},  "type": "function"}"#;
        let body = format!(
            r#"{{"model": "m", "tools": [{tool}], "tool_choice": {{"type": "function", "function": {{"name": "f"}}}},
                "parallel_tool_calls": false,
                "messages": [
                  {{"role": "user", "content": "Go"}},
                  {{"role": "assistant", "content": null, "tool_calls": [
                     {{"id": "call_1", "type": "function", "function": {{"name": "f", "arguments": "{{\"z\": 1}}"}}}}]}},
                  {{"role": "tool", "tool_call_id": "call_1", "content": [{{"type": "text", "text": "done"}}]}}
                ]}}"#
        );
        let parsed = chat_text(&body).unwrap();
        let tools = parsed.tools.unwrap();
        assert_eq!(tools.choice, ToolChoice::Function("f".into()));
        assert!(!tools.parallel);
        assert_eq!(tools.tools.len(), 1);
        assert_eq!(tools.tools[0].name, "f");
        assert_eq!(tools.tools[0].json, tool);
        assert_eq!(
            tools.tools[0].parameters,
            json!({"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}})
        );
        let [PromptInput::Chat(turns)] = parsed.prompts.as_slice() else {
            panic!("a chat");
        };
        assert_eq!(
            turns.as_slice(),
            [
                ChatTurn::new("user", "Go"),
                ChatTurn {
                    tool_calls: vec![ToolCallTurn {
                        id: "call_1".into(),
                        name: "f".into(),
                        arguments: r#"{"z": 1}"#.into(),
                    }],
                    ..ChatTurn::new("assistant", "")
                },
                ChatTurn {
                    tool_call_id: Some("call_1".into()),
                    ..ChatTurn::new("tool", "done")
                },
            ]
        );
    }

    #[test]
    fn tool_choice_values() {
        let choice = |value: Value| chat(&with(json!({"tool_choice": value}))).unwrap().tools;
        assert_eq!(choice(Value::Null).unwrap().choice, ToolChoice::Auto);
        assert_eq!(choice(json!("auto")).unwrap().choice, ToolChoice::Auto);
        assert_eq!(
            choice(json!("required")).unwrap().choice,
            ToolChoice::Required
        );
        assert!(choice(json!("none")).is_none());
        let defaults = chat(&with(json!({}))).unwrap().tools.unwrap();
        assert!(defaults.parallel);
        // Without tools, "none" and "auto" change nothing.
        for value in ["none", "auto"] {
            let body = json!({"model": "m", "messages": user(), "tool_choice": value});
            assert!(chat(&body).unwrap().tools.is_none());
        }
    }

    fn param_of(body: &Value) -> Option<String> {
        match chat(body) {
            Err(e) => e.body().error.param,
            Ok(parsed) => panic!("expected an error, parsed {parsed:?}"),
        }
    }

    #[test]
    fn bad_tools_are_refused_naming_the_field() {
        let named = |name: &str| json!({"type": "function", "function": {"name": name}});
        let cases = [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": []}), "tools"),
            (json!({"tools": vec![named("f"); MAX_TOOLS + 1]}), "tools"),
            (json!({"tools": [weather(), 3]}), "tools[1]"),
            (
                json!({"tools": [{"function": {"name": "f"}}]}),
                "tools[0].type",
            ),
            (
                json!({"tools": [{"type": "custom", "function": {"name": "f"}}]}),
                "tools[0].type",
            ),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                json!({"tools": [weather(), {"type": "function", "function": {}}]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [named("get weather")]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [named(&"x".repeat(65))]}),
                "tools[0].function.name",
            ),
            (json!({"tools": [named("")]}), "tools[0].function.name"),
            (
                json!({"tools": [weather(), named("get_weather")]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}),
                "tools[0].function.description",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
                "tools[0].function.strict",
            ),
            (json!({"tool_choice": "any"}), "tool_choice"),
            (json!({"tool_choice": 1}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice",
            ),
            (
                json!({"tool_choice": {"type": "code", "function": {"name": "get_weather"}}}),
                "tool_choice.type",
            ),
            (
                json!({"tool_choice": {"type": "function"}}),
                "tool_choice.function",
            ),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": 3}}}),
                "tool_choice.function.name",
            ),
            (json!({"parallel_tool_calls": "no"}), "parallel_tool_calls"),
        ];
        for (extra, param) in cases {
            assert_eq!(
                param_of(&with(extra.clone())).as_deref(),
                Some(param),
                "{extra}"
            );
        }
        for choice in [
            json!("required"),
            json!({"type": "function", "function": {"name": "f"}}),
        ] {
            let body = json!({"model": "m", "messages": user(), "tool_choice": choice});
            assert_eq!(param_of(&body).as_deref(), Some("tool_choice"));
        }
    }

    #[test]
    fn bad_calls_and_results_are_refused_naming_the_field() {
        let call = |id: &str, arguments: &str| json!({"id": id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}});
        let asked =
            |calls: Value| json!({"role": "assistant", "content": null, "tool_calls": calls});
        let answer = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "18 C"});
        let question = json!({"role": "user", "content": "Weather?"});
        let ok = call("call_1", "{}");
        let cases = [
            (
                json!([question, asked(json!([call("a", "{")])), answer("a")]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([
                    question,
                    asked(json!([call("a", "{}"), call("a", "{}")])),
                    answer("a")
                ]),
                "messages[1].tool_calls[1].id",
            ),
            (
                json!([
                    question,
                    asked(
                        json!([{"type": "function", "function": {"name": "f", "arguments": "{}"}}])
                    )
                ]),
                "messages[1].tool_calls[0].id",
            ),
            (
                json!([
                    question,
                    asked(json!([{"id": "a", "function": {"name": "f", "arguments": "{}"}}]))
                ]),
                "messages[1].tool_calls[0].type",
            ),
            (
                json!([
                    question,
                    asked(
                        json!([{"id": "a", "type": "function", "function": {"arguments": "{}"}}])
                    )
                ]),
                "messages[1].tool_calls[0].function.name",
            ),
            (
                json!([
                    question,
                    asked(
                        json!([{"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}])
                    )
                ]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([question, asked(json!({}))]),
                "messages[1].tool_calls",
            ),
            (
                json!([{"role": "user", "content": "x", "tool_calls": [ok]}]),
                "messages[0].tool_calls",
            ),
            (
                json!([question, {"role": "assistant", "content": null}]),
                "messages[1].content",
            ),
            (
                json!([question, asked(json!([ok])), {"role": "tool", "content": "18 C"}]),
                "messages[2].tool_call_id",
            ),
            (
                json!([question, asked(json!([ok])), {"role": "tool", "tool_call_id": "call_1"}]),
                "messages[2].content",
            ),
            (
                json!([question, asked(json!([ok])), answer("call_9")]),
                "messages[2].tool_call_id",
            ),
            (json!([question, answer("call_1")]), "messages[1].role"),
            (
                json!([
                    question,
                    asked(json!([ok])),
                    answer("call_1"),
                    question.clone(),
                    answer("call_1")
                ]),
                "messages[4].role",
            ),
            (
                json!([
                    question,
                    asked(json!([ok, call("call_2", "{}")])),
                    answer("call_1"),
                    question.clone()
                ]),
                "messages[1].tool_calls",
            ),
            (
                json!([question, asked(json!([ok]))]),
                "messages[1].tool_calls",
            ),
            (
                json!([{"role": "user", "content": "x", "tool_call_id": "a"}]),
                "messages[0].tool_call_id",
            ),
        ];
        for (messages, param) in cases {
            let body = json!({"model": "m", "messages": messages});
            assert_eq!(param_of(&body).as_deref(), Some(param), "{messages}");
        }
        let answered = json!([
            question,
            asked(json!([ok, call("call_2", "[1]")])),
            answer("call_2"),
            answer("call_1")
        ]);
        assert!(chat(&json!({"model": "m", "messages": answered})).is_ok());
    }
}
