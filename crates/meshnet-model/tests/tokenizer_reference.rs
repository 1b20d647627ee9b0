#![allow(clippy::unwrap_used)]
//! The default model's tokenizer against an independent implementation: llama.cpp's own
//! tokenizer, reading the same GGUF, gave the ids in `fixtures/tokenizer/smollm2-ids.json`
//! (made by `scripts/make_tokenizer_fixture.py`). Ours must give exactly the same ids for
//! every string (ASCII, digits, emoji, CJK, chat markers, leading and inner whitespace, …)
//! and decode them back to the same text.

mod common;

use serde::Deserialize;

/// The fixture file, as the script writes it.
#[derive(Deserialize)]
struct Fixture {
    model_sha256: String,
    cases: Vec<Case>,
}

/// One string and llama.cpp's ids for it.
#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    pieces: Vec<String>,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer/smollm2-ids.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_fixture_is_for_the_pinned_default_model_and_covers_every_kind_of_text() {
    let fixture = fixture();
    // The pin of scripts/fetch-model.sh: the file the test opens has this hash.
    assert_eq!(
        fixture.model_sha256,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
    let names: Vec<&str> = fixture
        .cases
        .iter()
        .map(|case| case.name.as_str())
        .collect();
    for kind in [
        "ascii_sentence",
        "digits",
        "emoji",
        "cjk",
        "chat_markers",
        "leading_spaces",
        "single_leading_space",
        "tabs_newlines",
    ] {
        assert!(names.contains(&kind), "no {kind} case in {names:?}");
    }
    for case in &fixture.cases {
        assert_eq!(case.ids.len(), case.pieces.len(), "{}", case.name);
    }
}

#[test]
fn token_ids_equal_llama_cpp_for_every_fixture_string() {
    let tokenizer = common::tokenizer();
    let mut mismatches = Vec::new();
    for case in fixture().cases {
        let ours = tokenizer.encode(&case.text).unwrap();
        if ours != case.ids {
            let pieces: Vec<String> = ours
                .iter()
                .map(|&id| tokenizer.token_text(id).unwrap_or_default())
                .collect();
            mismatches.push(format!(
                "{} ({:?}):\n  llama.cpp {:?} {:?}\n  ours      {:?} {:?}",
                case.name, case.text, case.ids, case.pieces, ours, pieces
            ));
        }
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn llama_cpp_ids_decode_back_to_their_text() {
    let tokenizer = common::tokenizer();
    for case in fixture().cases {
        // Special tokens kept: the chat markers are part of the text.
        let text = tokenizer.decode_with_special(&case.ids).unwrap();
        assert_eq!(text, case.text, "{}", case.name);
    }
}
