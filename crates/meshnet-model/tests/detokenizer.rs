#![allow(clippy::unwrap_used)]
//! Incremental decoding with the default model's tokenizer: the pieces add up to decoding
//! every id at once and never split a character, and the generation loop's text and stop
//! strings, built from those pieces, match decoding everything at every step.

mod common;

use std::cell::Cell;

use candle_core::{DType, Device, Tensor};
use meshnet_model::{
    BoundaryPolicy, FinishReason, GenerationRequest, IncrementalDecoder, LayerRoute, LogitsHead,
    Result, SessionId, Stage, StopConditions, TokenEmbedder, generate,
};

/// Emoji, CJK, accented text, and a mix with ASCII.
const TEXTS: &[&str] = &[
    "🦀🚀 ok",
    "日本語のテキスト",
    "Tiếng Việt, żółć, Ørsted, café crème brûlée",
    "Hello, 世界! Ça va? 🎉 fine.\n\tdone 42 — ok",
];

fn encode(text: &str) -> Vec<u32> {
    common::tokenizer().encode(text).unwrap()
}

fn decode(ids: &[u32]) -> String {
    common::tokenizer().decode(ids).unwrap()
}

/// Feeds `ids` one at a time, checking after each that the text given out so far and the
/// decoder's lookahead start the text of every id at once; returns the pieces and what
/// `finish` adds.
fn stream(ids: &[u32]) -> (Vec<String>, String) {
    let whole = decode(ids);
    let mut decoder = IncrementalDecoder::new(common::tokenizer());
    let mut pieces = Vec::new();
    let mut out = String::new();
    for &id in ids {
        let piece = decoder.push(id).unwrap();
        out.push_str(&piece);
        pieces.push(piece);
        let seen = format!("{out}{}", decoder.lookahead());
        assert!(
            whole.starts_with(&seen),
            "after {} ids, {seen:?} does not start {whole:?}",
            pieces.len()
        );
    }
    (pieces, decoder.finish().unwrap())
}

#[test]
fn the_texts_have_characters_spread_over_several_ids() {
    // Otherwise the next test would not tell incremental decoding from decoding each id.
    for text in TEXTS {
        let ids = encode(text);
        assert_eq!(decode(&ids), *text);
        assert!(
            ids.iter().any(|&id| decode(&[id]).contains('\u{FFFD}')),
            "every id of {text:?} is whole characters"
        );
    }
}

#[test]
fn pieces_add_up_to_decoding_everything_and_never_split_a_character() {
    for text in TEXTS {
        let ids = encode(text);
        let (pieces, rest) = stream(&ids);
        assert_eq!(pieces.concat(), decode(&ids), "{text:?}");
        assert_eq!(
            rest, "",
            "{text:?}: complete text is all out by the last id"
        );
        for piece in &pieces {
            assert!(!piece.contains('\u{FFFD}'), "{text:?}: piece {piece:?}");
        }
        // The pieces come as the text does, not all at the end.
        let nonempty = pieces.iter().filter(|piece| !piece.is_empty()).count();
        assert!(nonempty > 1, "{text:?}: {pieces:?}");
    }
}

#[test]
fn an_incomplete_character_at_the_end_comes_out_of_finish() {
    let ids = encode("ok 🦀");
    let ids = &ids[..ids.len() - 1];
    let whole = decode(ids);
    assert!(whole.ends_with('\u{FFFD}'), "{whole:?}");
    let (pieces, rest) = stream(ids);
    assert!(pieces.iter().all(|piece| !piece.contains('\u{FFFD}')));
    assert!(rest.ends_with('\u{FFFD}'), "{rest:?}");
    assert_eq!(pieces.concat() + &rest, whole);
}

#[test]
fn special_tokens_add_no_text() {
    let ids = encode("<|im_start|>assistant\n日本<|im_end|>語🦀<|im_end|>");
    let im_end = common::tokenizer().token_id("<|im_end|>").unwrap();
    assert!(ids.contains(&im_end));
    let (pieces, rest) = stream(&ids);
    assert_eq!(pieces.concat() + &rest, "assistant\n日本語🦀");
    assert!(pieces.iter().all(|piece| !piece.contains('\u{FFFD}')));
}

#[test]
fn a_run_of_invalid_bytes_is_given_out_as_it_comes() {
    // The byte-level token of byte 0x80, a continuation byte: without a leading byte before
    // it its text is U+FFFD, and no number of them becomes a character.
    let invalid = common::tokenizer().token_id("Ģ").unwrap();
    assert_eq!(decode(&[invalid]), "\u{FFFD}");
    let mut ids = vec![invalid; 100];
    ids.extend(encode("🦀 ok"));
    let (pieces, rest) = stream(&ids);
    let before_the_crab: String = pieces[..100].concat();
    assert!(
        before_the_crab.chars().count() >= 100 - 8,
        "only {} of 100 invalid bytes were given out",
        before_the_crab.chars().count()
    );
    assert_eq!(pieces.concat() + &rest, decode(&ids));
    assert!(decode(&ids).ends_with("🦀 ok"));
}

/// A route that produces the scripted ids one after another (then id 0).
struct Script {
    ids: Vec<u32>,
    step: Cell<usize>,
    vocab: usize,
}

impl Script {
    fn new(ids: Vec<u32>) -> Self {
        Script {
            ids,
            step: Cell::new(0),
            vocab: common::tokenizer().vocab_size(),
        }
    }

    fn route(&self) -> LayerRoute<'_> {
        LayerRoute {
            embedder: self,
            stages: vec![self],
            head: self,
            boundary: BoundaryPolicy::F32,
        }
    }
}

impl TokenEmbedder for Script {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        Ok(Tensor::zeros(
            (1, tokens.len(), 1),
            DType::F32,
            &Device::Cpu,
        )?)
    }
}

impl Stage for Script {
    fn forward(&self, _: SessionId, _: usize, hidden: Tensor) -> Result<Tensor> {
        Ok(hidden)
    }

    fn end_session(&self, _: SessionId) {}

    fn name(&self) -> String {
        "script".to_owned()
    }
}

impl LogitsHead for Script {
    fn logits(&self, _: &Tensor) -> Result<Vec<f32>> {
        let step = self.step.get();
        self.step.set(step + 1);
        let mut logits = vec![0.0; self.vocab];
        logits[self.ids.get(step).map_or(0, |&id| id as usize)] = 1.0;
        Ok(logits)
    }
}

/// Generates `text`'s ids greedily through a scripted route.
fn generate_text(text: &str, max_tokens: usize, stops: &[&str]) -> meshnet_model::Generation {
    let script = Script::new(encode(text));
    let request = GenerationRequest {
        stop: StopConditions {
            tokens: vec![],
            strings: stops.iter().map(|stop| (*stop).to_owned()).collect(),
        },
        ..GenerationRequest::greedy(encode("Say:"), max_tokens)
    };
    generate(&script.route(), &request, Some(common::tokenizer())).unwrap()
}

#[test]
fn generated_text_is_the_whole_decode_also_when_cut_mid_character() {
    for text in TEXTS {
        let ids = encode(text);
        let generation = generate_text(text, ids.len(), &[]);
        assert_eq!(generation.tokens, ids);
        assert_eq!(generation.text.as_deref(), Some(*text));
        assert_eq!(generation.finish, FinishReason::Length);
        // Stopping after any number of ids gives what decoding them gives, incomplete
        // characters and all.
        for max in 1..ids.len() {
            for stops in [&[][..], &["never there"]] {
                let generation = generate_text(text, max, stops);
                assert_eq!(
                    generation.text,
                    Some(decode(&ids[..max])),
                    "{text:?}, {max}"
                );
            }
        }
    }
}

#[test]
fn stop_strings_cut_the_text_at_the_same_token_as_decoding_everything() {
    // (text, stop strings, whether the first stop string is spread over several ids)
    let cases: [(&str, &[&str], bool); 7] = [
        // Inside multi-byte characters.
        ("日本語のテキストです。続きがある", &["テキ"], true),
        ("Hello, 世界! Ça va? 🎉 fine.", &["界! Ç"], true),
        // ASCII, over several ids.
        (
            "The answer is forty-two, said the computer.",
            &["two, sa"],
            true,
        ),
        // A stop string that ends in an id (" \xE6") which goes on with the start of a
        // character: seen before the character is complete, as decoding everything does.
        ("Answer: 日本語です", &[": "], true),
        ("Say 日本 now", &["Say "], true),
        ("Wow!🦀🚀 and more", &["🚀"], false),
        // Of two stop strings, the one earlier in the text wins.
        ("alpha beta gamma delta", &["delta", "gamma"], false),
    ];
    for (text, stops, split) in cases {
        let ids = encode(text);
        let at = stops
            .iter()
            .filter_map(|stop| text.find(stop))
            .min()
            .unwrap();
        if split {
            assert!(
                ids.iter().all(|&id| !decode(&[id]).contains(stops[0])),
                "{:?} is within one id of {text:?}",
                stops[0]
            );
        }
        // Decoding every id so far after each one stops at the first that shows a stop.
        let stopping = (1..=ids.len())
            .find(|&n| stops.iter().any(|stop| decode(&ids[..n]).contains(stop)))
            .unwrap();
        let generation = generate_text(text, ids.len() + 5, stops);
        assert_eq!(
            generation.text.as_deref(),
            Some(&text[..at]),
            "{text:?} / {stops:?}"
        );
        assert_eq!(generation.finish, FinishReason::StopString);
        assert_eq!(generation.tokens, ids[..stopping], "{text:?} / {stops:?}");
    }
}

#[test]
fn each_generated_token_gets_its_logprob_and_the_top_tokens_and_a_stop_token_none() {
    let ids = encode("Hello there, friend");
    assert!(ids.len() >= 4 && !ids[..3].contains(&0), "{ids:?}");
    let script = Script::new(ids.clone());
    let request = GenerationRequest {
        logprobs: Some(2),
        stop: StopConditions {
            tokens: vec![ids[3]],
            strings: vec![],
        },
        ..GenerationRequest::greedy(encode("Say:"), ids.len())
    };
    let generation = generate(&script.route(), &request, Some(common::tokenizer())).unwrap();
    assert_eq!(generation.tokens, ids[..3]);
    // Each step's logits are 1 for the scripted id and 0 for the other ids.
    let vocab = common::tokenizer().vocab_size() as f64;
    let log_total = (1f64.exp() + vocab - 1.0).ln();
    let (best, rest) = ((1.0 - log_total) as f32, (-log_total) as f32);
    assert_eq!(generation.logprobs.len(), 3);
    for (logprobs, &id) in generation.logprobs.iter().zip(&ids) {
        assert_eq!(logprobs.token, id);
        assert!((logprobs.logprob - best).abs() < 1e-5, "{logprobs:?}");
        assert_eq!(logprobs.top.len(), 2);
        assert_eq!(logprobs.top[0].0, id);
        // The runner-up is the lowest of the equally likely other ids.
        assert_eq!(logprobs.top[1].0, 0);
        assert!((logprobs.top[1].1 - rest).abs() < 1e-5, "{logprobs:?}");
    }
    let without = generate_text("Hello there, friend", 3, &[]);
    assert!(without.logprobs.is_empty());
}
