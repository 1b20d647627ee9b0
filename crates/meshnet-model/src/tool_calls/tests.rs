use proptest::prelude::*;

use super::*;

fn call(name: &str, arguments: &str) -> ParsedCall {
    ParsedCall {
        name: name.to_owned(),
        arguments: arguments.to_owned(),
    }
}

/// Feeds `text` one character at a time and joins what comes out.
fn parse_by_characters(format: ToolFormat, text: &str, parallel: bool) -> ParsedAnswer {
    let mut parser = ToolCallParser::new(format, parallel);
    let mut answer = ParsedAnswer::default();
    for ch in text.chars() {
        for event in parser.push(&ch.to_string()) {
            answer.apply(event);
        }
    }
    for event in parser.finish() {
        answer.apply(event);
    }
    answer
}

#[test]
fn hermes_calls_are_read_out_of_the_text() {
    let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
    let answer = parse_answer(ToolFormat::Hermes, text, true);
    assert_eq!(answer.content, "Let me look.");
    assert_eq!(
        answer.calls,
        [
            call("get_weather", r#"{"city": "Paris"}"#),
            call("get_time", "{}")
        ]
    );
    assert_eq!(parse_by_characters(ToolFormat::Hermes, text, true), answer);
    // Without parallel calls, only the first counts.
    let first = parse_answer(ToolFormat::Hermes, text, false);
    assert_eq!(first.calls, [call("get_weather", r#"{"city": "Paris"}"#)]);
    assert_eq!(first.content, "Let me look.");
}

#[test]
fn a_streamed_call_is_announced_then_its_arguments_come_in_pieces() {
    let mut parser = ToolCallParser::new(ToolFormat::Hermes, true);
    let mut events = Vec::new();
    for piece in [
        "Sure",
        ". <tool",
        "_call>\n{\"name\": \"f\"",
        ", \"arguments\": {\"a\"",
        ": [1, 2]}}\n</tool",
        "_call>",
    ] {
        events.extend(parser.push(piece));
    }
    events.extend(parser.finish());
    assert_eq!(
        events,
        [
            ToolEvent::Content("Sure".into()),
            ToolEvent::Content(".".into()),
            ToolEvent::CallStart {
                index: 0,
                name: "f".into()
            },
            ToolEvent::CallArguments {
                index: 0,
                text: "{\"a\"".into()
            },
            ToolEvent::CallArguments {
                index: 0,
                text: ": [1, 2]}".into()
            },
        ]
    );
    assert_eq!(parser.calls(), 1);
}

#[test]
fn text_that_only_looks_like_a_call_stays_text() {
    for text in [
        "Use <tool_call> tags.",
        "<tool_call>not json</tool_call> after",
        "<tool_call>\n{\"city\": \"Paris\"}\n</tool_call>",
        "<tool_call>{\"name\": 3}</tool_call>",
        "a <tool_ca",
        "Plain answer with trailing space ",
    ] {
        let answer = parse_answer(ToolFormat::Hermes, text, true);
        assert_eq!(answer.content, text, "{text:?}");
        assert!(answer.calls.is_empty(), "{text:?}");
        assert_eq!(parse_by_characters(ToolFormat::Hermes, text, true), answer);
    }
}

#[test]
fn a_llama3_call_is_a_json_object_at_the_start_of_the_answer() {
    let text = " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    let answer = parse_answer(ToolFormat::Llama3, text, true);
    assert_eq!(answer.content, "");
    assert_eq!(answer.calls, [call("get_weather", r#"{"city": "Paris"}"#)]);
}

#[test]
fn llama3_calls_separated_by_a_semicolon_are_all_read() {
    let two = "{\"type\": \"function\", \"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"x\": 1}}";
    assert_eq!(
        parse_answer(ToolFormat::Llama3, two, true).calls,
        [call("a", "{}"), call("b", r#"{"x": 1}"#)]
    );
}

#[test]
fn a_llama3_call_after_the_python_tag_follows_the_text_before_it() {
    let tagged = "Calling.<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}";
    let answer = parse_answer(ToolFormat::Llama3, tagged, true);
    assert_eq!(answer.content, "Calling.");
    assert_eq!(answer.calls, [call("f", r#"{"q": "x"}"#)]);
}

/// Llama 3.x answers with JSON but no call: JSON that is not a call, a call after prose, and
/// an object that breaks off after its name.
const LLAMA3_ANSWERS_WITHOUT_CALLS: [&str; 3] = [
    "{\"answer\": 42}",
    "The call would be {\"name\": \"f\", \"parameters\": {}}",
    "{\"name\": \"f\" oops",
];

#[test]
fn llama3_json_that_is_no_call_and_a_call_after_prose_are_text() {
    for text in LLAMA3_ANSWERS_WITHOUT_CALLS {
        let answer = parse_answer(ToolFormat::Llama3, text, true);
        assert_eq!(answer.content, text);
        assert!(answer.calls.is_empty(), "{text:?}");
        assert_eq!(parse_by_characters(ToolFormat::Llama3, text, true), answer);
    }
}

#[test]
fn arguments_written_as_a_string_are_decoded_and_a_call_without_any_has_none() {
    let text = "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>";
    let answer = parse_answer(ToolFormat::Hermes, text, true);
    assert_eq!(answer.calls, [call("f", r#"{"a": 1}"#)]);
    assert_eq!(parse_by_characters(ToolFormat::Hermes, text, true), answer);
    let bare = parse_answer(
        ToolFormat::Hermes,
        "<tool_call>{\"name\": \"f\"}</tool_call>",
        true,
    );
    assert_eq!(bare.calls, [call("f", "{}")]);
}

/// A Hermes answer whose call is cut off or broken, and what it comes to.
struct CutOffCall {
    text: &'static str,
    /// The call it gives, as name and arguments, if any.
    call: Option<(&'static str, &'static str)>,
    /// The content left.
    content: &'static str,
}

const CALLS_CUT_OFF_OR_BROKEN: [CutOffCall; 3] = [
    // Cut inside the arguments: the call keeps the arguments it has.
    CutOffCall {
        text: "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Pa",
        call: Some(("f", r#"{"city": "Pa"#)),
        content: "",
    },
    // Cut before the arguments: no call, the text is kept.
    CutOffCall {
        text: "Hi <tool_call>{\"name\": \"f\"",
        call: None,
        content: "Hi <tool_call>{\"name\": \"f\"",
    },
    // Broken inside the arguments: the call keeps what came before the break, and the rest of
    // the block up to its closing tag is dropped.
    CutOffCall {
        text: "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1]}</tool_call> Done.",
        call: Some(("f", r#"{"a": 1"#)),
        content: "Done.",
    },
];

#[test]
fn a_call_cut_off_keeps_the_arguments_it_has_and_a_broken_block_is_dropped() {
    for case in CALLS_CUT_OFF_OR_BROKEN {
        let text = case.text;
        let answer = parse_answer(ToolFormat::Hermes, text, true);
        let expected_calls: Vec<ParsedCall> = case
            .call
            .map(|(name, arguments)| call(name, arguments))
            .into_iter()
            .collect();
        assert_eq!(answer.calls, expected_calls, "{text:?}");
        assert_eq!(answer.content, case.content, "{text:?}");
        assert_eq!(
            parse_by_characters(ToolFormat::Hermes, text, true),
            answer,
            "{text:?}"
        );
    }
}

#[test]
fn rendered_calls_have_each_format_s_syntax() {
    assert_eq!(
        ToolFormat::Hermes.render_call("f", r#"{"b":1,"a":[true,null]}"#),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"b\": 1, \"a\": [true, null]}}\n</tool_call>"
    );
    assert_eq!(
        ToolFormat::Llama3.render_call("f", "{}"),
        "{\"name\": \"f\", \"parameters\": {}}"
    );
    assert_eq!(
        ToolFormat::Generic.render_call("f", "not json"),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": not json}\n</tool_call>"
    );
}

fn weather_tool() -> ToolDefinition {
    ToolDefinition::from_json(
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
    )
    .unwrap()
}

/// Tool definitions that are refused: not JSON, without a function, of another type, and
/// with a name that is not a string.
const INVALID_TOOL_DEFINITIONS: [&str; 4] = [
    "{",
    r#"{"type": "function"}"#,
    r#"{"type": "code", "function": {"name": "f"}}"#,
    r#"{"type": "function", "function": {"name": 3}}"#,
];

#[test]
fn tool_definitions_keep_their_key_order_and_need_a_name() {
    let tool = weather_tool();
    assert_eq!(tool.name(), "get_weather");
    assert_eq!(tool.parameters()["required"], serde_json::json!(["city"]));
    assert_eq!(
        to_python_json(tool.template_value()).unwrap(),
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#
    );
    let bare =
        ToolDefinition::from_json(r#"{"type": "function", "function": {"name": "f"}}"#).unwrap();
    assert_eq!(
        bare.parameters(),
        &serde_json::json!({"type": "object", "properties": {}})
    );
    for bad in INVALID_TOOL_DEFINITIONS {
        assert!(
            matches!(ToolDefinition::from_json(bad), Err(ModelError::Tool(_))),
            "{bad}"
        );
    }
}

/// Strings that hold the formats' own tags, JSON escapes and text beyond ASCII.
const AWKWARD_STRINGS: [&str; 4] = [
    "</tool_call>",
    "<tool_call>{\"name\"",
    "\"quoted\" \\ back\\slash\n\t",
    "é 世界 🎉",
];

/// Any JSON value, up to a few levels deep, with strings that hold the formats' own tags.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    // Plain text as often as each awkward string.
    let text = prop_oneof![
        1 => "[a-zA-Z0-9 _.,!?-]{0,12}",
        AWKWARD_STRINGS.len() as u32 => prop::sample::select(AWKWARD_STRINGS.to_vec())
            .prop_map(|text| text.to_owned()),
    ];
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        (-1e12f64..1e12).prop_map(serde_json::Value::from),
        text.clone().prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|pairs| { serde_json::Value::Object(pairs.into_iter().collect()) }),
        ]
    })
}

/// A call's arguments: a JSON object.
fn arguments() -> impl Strategy<Value = serde_json::Value> {
    prop::collection::vec(("[a-z_]{1,8}", json_value()), 0..4)
        .prop_map(|pairs| serde_json::Value::Object(pairs.into_iter().collect()))
}

/// Pieces of the formats' own syntax (and a little text) that answers are made of.
const SYNTAX_PIECES: [&str; 25] = [
    "<tool_call>\n{\"name\": \"f\", \"arguments\": ",
    "{\"name\": \"g\", \"parameters\": ",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "{",
    "}",
    "[",
    "]",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
    ": ",
    ", ",
    "\"f\"",
    "\"",
    "\\",
    "1",
    "tru",
    ";",
    " ",
    "\n",
    "a",
    "é",
    "<tool",
];

/// Pieces of text made of the formats' own syntax, for answers that may be anything.
fn syntax_soup() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(SYNTAX_PIECES.to_vec());
    prop::collection::vec(piece, 0..40).prop_map(|pieces| pieces.concat())
}

fn format() -> impl Strategy<Value = ToolFormat> {
    prop_oneof![
        Just(ToolFormat::Hermes),
        Just(ToolFormat::Llama3),
        Just(ToolFormat::Generic)
    ]
}

/// Splits `text` at the (character-aligned) positions `cuts` points to.
fn split_at(text: &str, cuts: &[usize]) -> Vec<String> {
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let mut points: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
    points.push(0);
    points.push(text.len());
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| text[w[0]..w[1]].to_owned())
        .collect()
}

proptest! {
    #[test]
    fn rendered_calls_parse_back_to_themselves(
        format in format(),
        names in prop::collection::vec("[a-zA-Z0-9_-]{1,64}", 1..4),
        all_arguments in prop::collection::vec(arguments(), 4),
        before in "[a-zA-Z .,!?é\n]{0,20}",
        after in "[a-zA-Z .,!?é\n]{0,20}",
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let calls: Vec<(String, String)> = names
            .iter()
            .zip(&all_arguments)
            .map(|(name, arguments)| (name.clone(), arguments.to_string()))
            .collect();
        let rendered: Vec<String> = calls
            .iter()
            .map(|(name, arguments)| format.render_call(name, arguments))
            .collect();
        // Llama 3.x answers are the calls alone; the tagged formats may have text around them.
        let (text, content) = match format {
            ToolFormat::Llama3 => (rendered.join("; "), String::new()),
            _ => (
                format!("{before}\n{}\n{after}", rendered.join("\n")),
                format!("{}{}", before.trim_end(), after.trim()),
            ),
        };
        let mut parser = ToolCallParser::new(format, true);
        let mut answer = ParsedAnswer::default();
        for piece in split_at(&text, &cuts) {
            for event in parser.push(&piece) {
                answer.apply(event);
            }
        }
        for event in parser.finish() {
            answer.apply(event);
        }
        prop_assert_eq!(&answer.content, &content);
        prop_assert_eq!(answer.calls.len(), calls.len());
        for (found, (name, arguments)) in answer.calls.iter().zip(&calls) {
            prop_assert_eq!(&found.name, name);
            let found: serde_json::Value = serde_json::from_str(&found.arguments).unwrap();
            let expected: serde_json::Value = serde_json::from_str(arguments).unwrap();
            prop_assert_eq!(found, expected);
        }
    }

    #[test]
    fn any_text_parses_the_same_whole_or_in_pieces(
        format in format(),
        parallel in any::<bool>(),
        text in syntax_soup(),
        cuts in prop::collection::vec(any::<usize>(), 0..16),
    ) {
        let whole = parse_answer(format, &text, parallel);
        let mut parser = ToolCallParser::new(format, parallel);
        let mut pieces = ParsedAnswer::default();
        for piece in split_at(&text, &cuts) {
            for event in parser.push(&piece) {
                pieces.apply(event);
            }
        }
        for event in parser.finish() {
            pieces.apply(event);
        }
        prop_assert_eq!(&pieces, &whole);
        prop_assert_eq!(parser.calls(), whole.calls.len());
        if !parallel {
            prop_assert!(whole.calls.len() <= 1);
        }
        // Text with no call in it comes out whole.
        if whole.calls.is_empty() {
            prop_assert_eq!(&whole.content, &text);
        }
    }
}

/// A number in the arguments comes back to its last digit: the arguments are read and written
/// again, and reading a float must give the nearest double (proptest found this one off by a
/// unit in the last place).
#[test]
fn a_number_in_the_arguments_survives_the_round_trip_exactly() {
    let arguments = r#"{"_":{"_":[123958916255.76562]}}"#;
    let rendered = ToolFormat::Hermes.render_call("a", arguments);
    let answer = parse_answer(ToolFormat::Hermes, &rendered, true);
    assert_eq!(answer.calls.len(), 1);
    let found: serde_json::Value = serde_json::from_str(&answer.calls[0].arguments).unwrap();
    let expected: serde_json::Value = serde_json::from_str(arguments).unwrap();
    assert_eq!(found, expected, "{}", answer.calls[0].arguments);
}
