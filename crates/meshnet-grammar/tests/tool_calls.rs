#![allow(clippy::unwrap_used)]
//! Tool-call constraints over the default model's own vocabulary (SmolLM2's): random walks
//! through the allowed tokens always end in calls the parser reads back, of the functions
//! allowed, with arguments valid under their schemas.

use meshnet_grammar::{TokenEnvironment, ToolCallSpec};
use meshnet_model::{ModelTokenizer, TokenConstraint, TokenMask, ToolFormat, parse_answer};
use serde_json::{Value, json};

/// The default model's tokenizer, its grammar environment, and the tokens that end its text.
fn environment() -> (ModelTokenizer, TokenEnvironment, Vec<u32>) {
    let path = meshnet_model::default_model_path();
    assert!(
        path.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh`",
        path.display()
    );
    let tokenizer = ModelTokenizer::from_gguf_file(&path).unwrap();
    let mut ends = tokenizer.end_of_generation().to_vec();
    ends.extend(tokenizer.end_of_turn());
    let environment = TokenEnvironment::new(&tokenizer, &ends).unwrap();
    (tokenizer, environment, ends)
}

fn weather() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}
        },
        "required": ["city"],
        "additionalProperties": false
    })
}

fn time() -> Value {
    json!({
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": false
    })
}

/// Checks `arguments` against [`weather`] or [`time`] by hand.
fn check_arguments(name: &str, arguments: &Value) {
    let object = arguments.as_object().unwrap();
    match name {
        "get_weather" => {
            assert!(["Paris", "Rome", "Tokyo"].contains(&object["city"].as_str().unwrap()));
            if let Some(days) = object.get("days") {
                assert!((1..=7).contains(&days.as_i64().unwrap()), "{arguments}");
            }
            assert!(
                object.keys().all(|k| k == "city" || k == "days"),
                "{arguments}"
            );
        }
        "get_time" => {
            assert!(["UTC", "CET"].contains(&object["zone"].as_str().unwrap()));
            assert_eq!(object.len(), 1);
        }
        other => panic!("{other} was not allowed"),
    }
}

/// A generator for the walks (SplitMix64).
struct Walk(u64);

impl Walk {
    fn pick(&mut self, from: &[u32]) -> u32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        from[((z ^ (z >> 31)) % from.len() as u64) as usize]
    }
}

/// The text of a random walk through `constraint` (ending at completion or at an end token).
fn walk(
    constraint: &mut dyn TokenConstraint,
    tokenizer: &ModelTokenizer,
    ends: &[u32],
    seed: u64,
) -> String {
    let mut walk = Walk(seed);
    let mut mask = TokenMask::default();
    let mut bytes = Vec::new();
    for _ in 0..400 {
        if constraint.is_complete() {
            break;
        }
        constraint.allowed_tokens(&mut mask).unwrap();
        let allowed: Vec<u32> = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| mask.allows(id))
            .collect();
        let token = walk.pick(&allowed);
        constraint.commit(token).unwrap();
        if ends.contains(&token) {
            break;
        }
        bytes.extend(tokenizer.token_bytes(token).unwrap());
    }
    String::from_utf8(bytes).unwrap()
}

#[test]
fn random_walks_end_in_calls_of_the_allowed_functions_with_valid_arguments() {
    let (tokenizer, environment, ends) = environment();
    let (weather, time) = (weather(), time());
    let both = [("get_weather", &weather), ("get_time", &time)];
    for (format, functions, parallel) in [
        (ToolFormat::Generic, &both[..], false),
        (ToolFormat::Hermes, &both[..], true),
        (ToolFormat::Llama3, &both[..], true),
        (ToolFormat::Generic, &both[1..], true),
    ] {
        let spec = ToolCallSpec {
            format,
            functions,
            parallel,
        };
        let compiled = environment.compile_tool_calls(&spec).unwrap();
        let mut names_seen = std::collections::BTreeSet::new();
        for seed in 0..30 {
            let mut constraint = compiled.boxed_clone();
            let text = walk(constraint.as_mut(), &tokenizer, &ends, seed);
            let answer = parse_answer(format, &text, parallel);
            assert_eq!(answer.content, "", "{format:?} seed {seed}: {text:?}");
            assert!(!answer.calls.is_empty(), "{format:?} seed {seed}: {text:?}");
            if !parallel || format == ToolFormat::Llama3 {
                assert_eq!(answer.calls.len(), 1, "{text:?}");
                assert!(constraint.is_complete(), "{text:?}");
            }
            for call in &answer.calls {
                assert!(functions.iter().any(|(name, _)| *name == call.name));
                check_arguments(&call.name, &serde_json::from_str(&call.arguments).unwrap());
                names_seen.insert(call.name.clone());
            }
        }
        // Every allowed function comes up in some walk.
        assert_eq!(names_seen.len(), functions.len(), "{format:?}");
    }
}
