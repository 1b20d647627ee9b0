#![allow(clippy::unwrap_used)]
//! Tool use through real chat templates. Python's jinja2, set up as Hugging Face's
//! `apply_chat_template` sets it up, rendered every template of llama.cpp's
//! `models/templates/` that shows the tools it is offered, for conversations that offer tools
//! and hold calls and their results, into `fixtures/templates/tools.json` (made by
//! `scripts/make_tool_template_fixture.py`). Every template whose call format meshnet reads
//! must render each case byte for byte as jinja2 did (tools in the client's key order, call
//! arguments as mappings); calls written by a real template must parse back to themselves;
//! and the families must be told apart as documented.
//!
//! The templates are not committed: `scripts/fetch-llama-references.sh` puts them in a
//! cache. Without the cache these tests say so loudly and check nothing else.

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshnet_model::{
    ChatMessage, ChatTemplate, ModelError, SpecialTokens, TemplateSource, ToolCall, ToolDefinition,
    ToolFormat, parse_answer,
};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The release of llama-cpp-python whose sdist the fetch script takes the templates from.
const REFERENCE_VERSION: &str = "0.3.36";
/// The moment `strftime_now` formats in the fixture: 2025-01-02T03:04:05 UTC.
const FIXED_NOW: i64 = 1_735_787_045;

/// Where templates of a format meshnet reads render differently from jinja2, and why.
const KNOWN_DIFFERENT: &[(&str, &str, &str)] = &[
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "history_without_tools",
        "iterates tools=None: jinja2 raises TypeError, minijinja loops zero times",
    ),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "history_without_tools",
        "iterates tools=None: jinja2 raises TypeError, minijinja loops zero times",
    ),
];

#[derive(Deserialize)]
struct Fixture {
    bos_token: String,
    eos_token: String,
    conversations: BTreeMap<String, Conversation>,
    templates: Vec<TemplateCases>,
}

#[derive(Deserialize)]
struct Conversation {
    tools: Option<Vec<String>>,
    messages: Vec<Message>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<Call>,
    tool_call_id: Option<String>,
}

#[derive(Deserialize)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct TemplateCases {
    file: String,
    sha256: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    conversation: String,
    add_generation_prompt: bool,
    text: Option<String>,
    error: Option<PythonError>,
}

#[derive(Deserialize)]
struct PythonError {
    #[serde(rename = "type")]
    kind: String,
    message: String,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/templates/tools.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The cached templates directory, or `None` (said loudly) when it is absent.
fn templates_dir() -> Option<PathBuf> {
    let cache = std::env::var_os("MESHNET_REFERENCES")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
            PathBuf::from(home).join(".cache/meshnet/references")
        });
    let dir = cache.join(format!("llama.cpp-{REFERENCE_VERSION}/models/templates"));
    if dir.is_dir() {
        return Some(dir);
    }
    eprintln!(
        "\n*** SKIPPED: llama.cpp's chat templates are missing at {}: run \
         `bash scripts/fetch-llama-references.sh` (or set MESHNET_REFERENCES to the directory \
         that holds llama.cpp-{REFERENCE_VERSION}) ***\n",
        dir.display()
    );
    None
}

fn tokens(fixture: &Fixture) -> SpecialTokens {
    SpecialTokens {
        bos: fixture.bos_token.clone(),
        eos: fixture.eos_token.clone(),
    }
}

/// The template in `file`, checked to be the one the fixture was made from when `sha256` is
/// given.
fn template(
    dir: &std::path::Path,
    file: &str,
    sha256: Option<&str>,
    tokens: SpecialTokens,
) -> ChatTemplate {
    let bytes = std::fs::read(dir.join(file)).unwrap();
    if let Some(sha256) = sha256 {
        assert_eq!(
            format!("{:x}", Sha256::digest(&bytes)),
            sha256,
            "{file} is not the file the fixture was made from"
        );
    }
    ChatTemplate::new(
        &String::from_utf8(bytes).unwrap(),
        TemplateSource::File,
        tokens,
    )
    .and_then(|template| template.with_fixed_time(FIXED_NOW))
    .unwrap()
}

fn messages(conversation: &Conversation) -> Vec<ChatMessage> {
    conversation
        .messages
        .iter()
        .map(|m| ChatMessage {
            role: m.role.clone(),
            content: m.content.clone().unwrap_or_default(),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| ToolCall {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                })
                .collect(),
            tool_call_id: m.tool_call_id.clone(),
        })
        .collect()
}

fn tools(conversation: &Conversation) -> Vec<ToolDefinition> {
    conversation
        .tools
        .iter()
        .flatten()
        .map(|json| ToolDefinition::from_json(json).unwrap())
        .collect()
}

/// Why our rendering of `case` differs from jinja2's, if it does.
fn case_difference(case: &Case, ours: Result<String, ModelError>) -> Option<String> {
    match (ours, &case.text, &case.error) {
        (Ok(text), Some(expected), _) if &text == expected => None,
        (Ok(text), Some(expected), _) => {
            let at = text
                .bytes()
                .zip(expected.bytes())
                .take_while(|(a, b)| a == b)
                .count();
            let snippet = |s: &str| {
                s.get(at.saturating_sub(30)..(at + 50).min(s.len()))
                    .map(str::to_owned)
            };
            Some(format!(
                "texts differ at byte {at}: expected {:?}, got {:?}",
                snippet(expected),
                snippet(&text)
            ))
        }
        (Err(ModelError::ChatTemplate { reason, .. }), None, Some(python))
            if python.kind != "TemplateError" || reason == python.message =>
        {
            None
        }
        (Ok(_), None, Some(python)) => Some(format!(
            "renders, but jinja2 raised {}: {}",
            python.kind, python.message
        )),
        (Err(error), _, _) => Some(format!("fails: {error}")),
        (Ok(_), None, None) => Some("the fixture case has neither text nor error".to_owned()),
    }
}

#[test]
fn templates_of_a_read_format_render_tools_and_calls_as_jinja2_does() {
    let Some(dir) = templates_dir() else { return };
    let fixture = fixture();
    let mut compared = 0;
    let mut differing = Vec::new();
    for expected in &fixture.templates {
        let template = template(
            &dir,
            &expected.file,
            Some(&expected.sha256),
            tokens(&fixture),
        );
        if template.tool_format() == ToolFormat::Generic {
            continue;
        }
        compared += 1;
        for case in &expected.cases {
            let conversation = &fixture.conversations[&case.conversation];
            let ours = template.render_chat(
                &messages(conversation),
                &tools(conversation),
                case.add_generation_prompt,
            );
            if let Some(why) = case_difference(case, ours) {
                let known = KNOWN_DIFFERENT
                    .iter()
                    .any(|(file, name, _)| file == &expected.file && name == &case.conversation);
                if !known {
                    differing.push(format!(
                        "{} {} (add_generation_prompt={}): {why}",
                        expected.file, case.conversation, case.add_generation_prompt
                    ));
                }
            }
        }
    }
    println!("{compared} templates of a read format compared with jinja2");
    assert!(differing.is_empty(), "{differing:#?}");
    assert!(compared >= 8, "only {compared} templates compared");
}

#[test]
fn families_are_told_apart_by_how_their_templates_write_calls() {
    let Some(dir) = templates_dir() else { return };
    let expected = [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat::Hermes),
        ("Qwen-Qwen3-0.6B.jinja", ToolFormat::Hermes),
        ("Qwen-QwQ-32B.jinja", ToolFormat::Hermes),
        (
            "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
            ToolFormat::Hermes,
        ),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
            ToolFormat::Hermes,
        ),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", ToolFormat::Llama3),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", ToolFormat::Llama3),
        (
            "meta-llama-Llama-3.3-70B-Instruct.jinja",
            ToolFormat::Llama3,
        ),
        // Mistral writes calls after a control token, as a JSON array; Qwen3-Coder and GLM
        // in XML-like tags; Gemma 2 and Phi-3.5 render no tools.
        (
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            ToolFormat::Generic,
        ),
        (
            "Mistral-Small-3.2-24B-Instruct-2506.jinja",
            ToolFormat::Generic,
        ),
        ("Qwen3-Coder.jinja", ToolFormat::Generic),
        ("GLM-4.6.jinja", ToolFormat::Generic),
        ("google-gemma-2-2b-it.jinja", ToolFormat::Generic),
        ("microsoft-Phi-3.5-mini-instruct.jinja", ToolFormat::Generic),
    ];
    let tokens = SpecialTokens {
        bos: "<s>".into(),
        eos: "</s>".into(),
    };
    for (file, format) in expected {
        let found = template(&dir, file, None, tokens.clone()).tool_format();
        assert_eq!(found, format, "{file}");
    }
    let mut by_format: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jinja"))
        .collect();
    files.sort();
    for path in files {
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        if let Ok(template) = ChatTemplate::new(&text, TemplateSource::File, tokens.clone()) {
            by_format
                .entry(template.tool_format().name())
                .or_default()
                .push(file);
        }
    }
    for (format, files) in &by_format {
        println!("{format} ({}): {}", files.len(), files.join(", "));
    }
}

/// The text `template` renders for the assistant turn `answer` after `question`.
fn answer_text(template: &ChatTemplate, question: &ChatMessage, answer: ChatMessage) -> String {
    let prompt = template
        .render_chat(std::slice::from_ref(question), &[], true)
        .unwrap();
    let whole = template
        .render_chat(&[question.clone(), answer], &[], false)
        .unwrap();
    whole
        .strip_prefix(prompt.as_str())
        .unwrap_or_else(|| panic!("{whole:?} does not continue {prompt:?}"))
        .to_owned()
}

#[test]
fn calls_a_real_template_writes_parse_back_to_themselves() {
    let Some(dir) = templates_dir() else { return };
    let tokens = SpecialTokens {
        bos: "<s>".into(),
        eos: "</s>".into(),
    };
    let question = ChatMessage::user("Weather in Paris and Rome?");
    let paris = ToolCall {
        id: "call_1".into(),
        name: "get_weather".into(),
        arguments: r#"{"unit": "celsius", "city": "Paris", "days": [1, 2.5], "note": "say \"hi\" </tool_call>"}"#
            .into(),
    };
    let rome = ToolCall {
        id: "call_2".into(),
        name: "get_time".into(),
        arguments: "{}".into(),
    };
    for file in [
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
    ] {
        let template = template(&dir, file, None, tokens.clone());
        let format = template.tool_format();
        // Llama 3.x templates take one call per turn.
        let calls = match format {
            ToolFormat::Llama3 => vec![paris.clone()],
            _ => vec![paris.clone(), rome.clone()],
        };
        let text = answer_text(
            &template,
            &question,
            ChatMessage::assistant_calls("", calls.clone()),
        );
        let answer = parse_answer(format, &text, true);
        assert_eq!(answer.calls.len(), calls.len(), "{file}: {text:?}");
        for (found, call) in answer.calls.iter().zip(&calls) {
            assert_eq!(found.name, call.name, "{file}");
            let found: serde_json::Value = serde_json::from_str(&found.arguments).unwrap();
            let sent: serde_json::Value = serde_json::from_str(&call.arguments).unwrap();
            assert_eq!(found, sent, "{file}");
        }
        assert!(
            !answer.content.contains("get_weather") && !answer.content.contains("Paris"),
            "{file}: the call was left in the text {:?}",
            answer.content
        );
    }
}
