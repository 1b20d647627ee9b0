#![allow(clippy::unwrap_used)]
//! Real chat templates rendered by our engine against an independent implementation:
//! Python's jinja2 set up as Hugging Face's `apply_chat_template` sets it up rendered every
//! template of llama.cpp's `models/templates/` (Llama 3.x, Qwen, Gemma, Phi-3.5, Mistral,
//! DeepSeek, ...) for a fixed set of conversations, with and without a generation prompt,
//! into `fixtures/templates/expected.json` (made by `scripts/make_template_fixture.py`).
//! The templates themselves are not committed: `scripts/fetch-llama-references.sh` puts them
//! in a cache. A template counts as identical when every case renders byte for byte the same
//! text, or fails where jinja2 failed (with the same message when the template raised it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use meshnet_model::{ChatMessage, ChatTemplate, ModelError, SpecialTokens, TemplateSource};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Templates known to render identically to jinja2 in every case. The test fails when fewer
/// do.
const KNOWN_IDENTICAL: usize = 67;

/// Python raises `TypeError: 'NoneType' object is not iterable` at `{% for tool in tools %}`
/// when no tools are given (`tools=None`, as `apply_chat_template` passes them); minijinja
/// iterates `none` as an empty sequence, so we render the conversation instead of failing.
/// These tool-use variants are meant to be rendered with tools only.
const NONE_ITERATED: &str =
    "iterates tools=None: jinja2 raises TypeError, minijinja loops zero times";

/// The templates known to differ, and why.
const KNOWN_DIFFERENT: &[(&str, &str)] = &[
    (
        "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
        NONE_ITERATED,
    ),
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        NONE_ITERATED,
    ),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        NONE_ITERATED,
    ),
];

/// The release of llama-cpp-python whose sdist the fetch script takes the templates from.
const REFERENCE_VERSION: &str = "0.3.36";
/// The moment `strftime_now` formats in the fixture: 2025-01-02T03:04:05 UTC.
const FIXED_NOW: i64 = 1_735_787_045;

#[derive(Deserialize)]
struct Fixture {
    bos_token: String,
    eos_token: String,
    now: String,
    conversations: BTreeMap<String, Vec<Message>>,
    templates: Vec<TemplateCases>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: String,
}

#[derive(Deserialize)]
struct TemplateCases {
    file: String,
    sha256: String,
    compile_error: Option<PythonError>,
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
        "/tests/fixtures/templates/expected.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The cached templates directory; fails the test with the command that fetches it.
fn templates_dir() -> PathBuf {
    let cache = std::env::var_os("MESHNET_REFERENCES")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
            PathBuf::from(home).join(".cache/meshnet/references")
        });
    let dir = cache.join(format!("llama.cpp-{REFERENCE_VERSION}/models/templates"));
    assert!(
        dir.is_dir(),
        "llama.cpp's chat templates are missing at {}: run `bash scripts/fetch-llama-references.sh` \
         (or set MESHNET_REFERENCES to the directory that holds llama.cpp-{REFERENCE_VERSION})",
        dir.display()
    );
    dir
}

/// Why `template` renders differently from jinja2, or `None` when every case is the same.
fn difference(
    fixture: &Fixture,
    expected: &TemplateCases,
    template: Result<ChatTemplate, ModelError>,
) -> Option<String> {
    let template = match (template, &expected.compile_error) {
        (Err(_), Some(_)) => return None,
        (Ok(_), Some(python)) => {
            return Some(format!("jinja2 does not compile it: {}", python.message));
        }
        (Err(error), None) => return Some(format!("does not compile: {error}")),
        (Ok(template), None) => template,
    };
    expected.cases.iter().find_map(|case| {
        let messages: Vec<ChatMessage> = fixture.conversations[&case.conversation]
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
            .collect();
        let ours = template.render_with(&messages, case.add_generation_prompt);
        let what = format!(
            "{} (add_generation_prompt={})",
            case.conversation, case.add_generation_prompt
        );
        case_difference(case, ours).map(|why| format!("{what}: {why}"))
    })
}

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
                s.get(at.saturating_sub(20)..(at + 40).min(s.len()))
                    .map(str::to_owned)
            };
            Some(format!(
                "texts differ at byte {at}: expected {:?}, got {:?}",
                snippet(expected),
                snippet(&text)
            ))
        }
        (Ok(_), None, Some(python)) => Some(format!(
            "renders, but jinja2 raised {}: {}",
            python.kind, python.message
        )),
        (Err(error), None, Some(python)) => match &error {
            ModelError::ChatTemplate { reason, .. }
                if python.kind != "TemplateError" || reason == &python.message =>
            {
                None
            }
            _ => Some(format!(
                "fails with {error}, jinja2 with {}: {}",
                python.kind, python.message
            )),
        },
        (Err(error), _, _) => Some(format!("fails: {error}")),
        (Ok(_), None, None) => Some("the fixture case has neither text nor error".to_owned()),
    }
}

#[test]
fn real_chat_templates_render_as_jinja2_renders_them() {
    let fixture = fixture();
    assert_eq!(fixture.now, "2025-01-02T03:04:05");
    let dir = templates_dir();
    let tokens = SpecialTokens {
        bos: fixture.bos_token.clone(),
        eos: fixture.eos_token.clone(),
    };
    let mut differing = Vec::new();
    for expected in &fixture.templates {
        let path = dir.join(&expected.file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}: run `bash scripts/fetch-llama-references.sh`",
                path.display()
            )
        });
        let sha256 = format!("{:x}", Sha256::digest(&bytes));
        assert_eq!(
            sha256, expected.sha256,
            "{} is not the file the fixture was made from",
            expected.file
        );
        let jinja = String::from_utf8(bytes).unwrap();
        let template = ChatTemplate::new(&jinja, TemplateSource::File, tokens.clone())
            .and_then(|template| template.with_fixed_time(FIXED_NOW));
        if let Some(why) = difference(&fixture, expected, template) {
            differing.push((expected.file.clone(), why));
        }
    }
    let total = fixture.templates.len();
    let identical = total - differing.len();
    println!("{identical}/{total} templates render identically to jinja2");
    for (file, why) in &differing {
        let known = KNOWN_DIFFERENT.iter().find(|(known, _)| known == file);
        let reason = known.map_or("not a known difference", |(_, reason)| reason);
        println!("  differs: {file} ({reason}): {why}");
    }
    assert!(
        identical >= KNOWN_IDENTICAL,
        "{identical}/{total} templates identical, fewer than the known {KNOWN_IDENTICAL}"
    );
    let unexpected: Vec<&str> = differing
        .iter()
        .map(|(file, _)| file.as_str())
        .filter(|file| !KNOWN_DIFFERENT.iter().any(|(known, _)| known == file))
        .collect();
    assert!(
        unexpected.is_empty(),
        "templates that newly differ: {unexpected:?}"
    );
}

#[test]
fn the_fixture_covers_the_conversations_and_real_families() {
    let fixture = fixture();
    for name in [
        "system_user",
        "user_only",
        "several_turns",
        "several_turns_no_system",
    ] {
        assert!(
            fixture.conversations.contains_key(name),
            "no conversation {name}"
        );
    }
    for family in [
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "Qwen-Qwen3-0.6B.jinja",
        "google-gemma-2-2b-it.jinja",
        "microsoft-Phi-3.5-mini-instruct.jinja",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    ] {
        let cases = fixture.templates.iter().find(|t| t.file == family);
        assert!(cases.is_some_and(|t| t.cases.len() == 8), "{family}");
    }
    assert!(fixture.templates.len() >= 60);
}
