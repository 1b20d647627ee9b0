//! The grammar of the tool calls a chat request asks for: one call (or, with parallel calls,
//! one or more) of the functions allowed, each written in the syntax of the template's family
//! (`<tool_call>` blocks, or Llama 3.x JSON objects) with arguments valid under the
//! function's parameters' JSON Schema, laid out compactly.

use llguidance::api::TopLevelGrammar;
use meshnet_model::ToolFormat;
use serde_json::Value;

use crate::constraint::{JsonConstraint, JsonFormat};
use crate::environment::TokenEnvironment;
use crate::error::GrammarError;

/// The calls a constraint allows.
#[derive(Clone, Copy, Debug)]
pub struct ToolCallSpec<'a> {
    /// The syntax calls are written in.
    pub format: ToolFormat,
    /// The functions that may be called, by name, with their parameters' JSON Schema.
    pub functions: &'a [(&'a str, &'a Value)],
    /// Whether several calls may follow each other (when the format allows it).
    pub parallel: bool,
}

/// A Lark string literal of `text`.
fn lark_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// The grammar (in llguidance's Lark dialect) of the calls `spec` allows: each call the
/// format's opening with the function's name, its arguments (`%json` of its schema, laid
/// out compactly), and the format's closing; calls separated as the format separates them
/// when several are allowed. A schema that is not an object is a [`GrammarError::Schema`]
/// naming the function.
pub fn tool_call_grammar(spec: &ToolCallSpec<'_>) -> Result<String, GrammarError> {
    if spec.functions.is_empty() {
        return Err(GrammarError::Schema("no function may be called".to_owned()));
    }
    let mut rules = Vec::with_capacity(2 * spec.functions.len() + 2);
    let separator = spec.format.call_separator().filter(|_| spec.parallel);
    rules.push(match separator {
        Some(separator) => format!("start: call ({} call)*", lark_string(separator)),
        None => "start: call".to_owned(),
    });
    let alternatives: Vec<String> = (0..spec.functions.len())
        .map(|index| format!("call_{index}"))
        .collect();
    rules.push(format!("call: {}", alternatives.join(" | ")));
    for (index, (name, parameters)) in spec.functions.iter().enumerate() {
        let schema = JsonFormat::Schema((*parameters).clone())
            .layout_schema()
            .map_err(|error| GrammarError::Schema(format!("function {name}: {error}")))?;
        rules.push(format!(
            "call_{index}: {} arguments_{index} {}",
            lark_string(&spec.format.call_opening(name)),
            lark_string(&spec.format.call_closing())
        ));
        rules.push(format!("arguments_{index}: %json {schema}"));
    }
    Ok(rules.join("\n"))
}

impl TokenEnvironment {
    /// Compiles the calls `spec` allows into a constraint at the start of the answer. A
    /// schema the engine cannot compile is a [`GrammarError::Schema`] saying why.
    pub fn compile_tool_calls(
        &self,
        spec: &ToolCallSpec<'_>,
    ) -> Result<JsonConstraint, GrammarError> {
        let grammar = tool_call_grammar(spec)?;
        self.compile_grammar(TopLevelGrammar::from_lark(grammar))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_grammar_has_one_rule_per_function_in_the_formats_syntax() {
        let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}});
        let time = json!({"type": "object"});
        let functions = [("get_weather", &weather), ("get_time", &time)];
        let grammar = tool_call_grammar(&ToolCallSpec {
            format: ToolFormat::Hermes,
            functions: &functions,
            parallel: true,
        })
        .unwrap();
        let lines: Vec<&str> = grammar.lines().collect();
        assert_eq!(lines[0], r#"start: call ("\n" call)*"#);
        assert_eq!(lines[1], "call: call_0 | call_1");
        assert_eq!(
            lines[2],
            r#"call_0: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " arguments_0 "}\n</tool_call>""#
        );
        assert!(lines[3].starts_with("arguments_0: %json {"), "{}", lines[3]);
        let schema: Value = serde_json::from_str(&lines[3]["arguments_0: %json ".len()..]).unwrap();
        assert_eq!(schema["properties"], weather["properties"]);
        assert_eq!(schema["x-guidance"]["whitespace_flexible"], json!(false));
        assert_eq!(lines.len(), 6);

        let single = tool_call_grammar(&ToolCallSpec {
            format: ToolFormat::Llama3,
            functions: &functions[1..],
            parallel: true,
        })
        .unwrap();
        let lines: Vec<&str> = single.lines().collect();
        assert_eq!(lines[0], "start: call");
        assert_eq!(
            lines[2],
            r#"call_0: "{\"name\": \"get_time\", \"parameters\": " arguments_0 "}""#
        );
    }

    #[test]
    fn no_function_or_a_schema_that_is_no_object_is_an_error() {
        let spec = |functions| ToolCallSpec {
            format: ToolFormat::Generic,
            functions,
            parallel: false,
        };
        assert!(matches!(
            tool_call_grammar(&spec(&[])),
            Err(GrammarError::Schema(_))
        ));
        let bad = json!(true);
        let error = tool_call_grammar(&spec(&[("f", &bad)])).unwrap_err();
        assert!(error.to_string().contains("function f"), "{error}");
    }
}
