//! A tiny byte-level vocabulary for the tests, written as a vocabulary-only GGUF file and read
//! back through the model crate's tokenizer, as a model's would be.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{self, Value};
use meshnet_model::ModelTokenizer;

/// Id of `<|endoftext|>`, the end of text.
pub const END_OF_TEXT: u32 = 0;

/// Id of `<|im_end|>`, a control token that is not an end of text here.
pub const IM_END: u32 = 1;

/// Tokens of more than one byte, after the two control tokens and every printable ASCII
/// character.
const MERGED: &[&str] = &[
    "{\"", "\": ", "\":", ", \"", "\"}", "ab", "true", "false", "null", "12",
];

/// The tokens' bytes by id: the two control tokens' text, then printable ASCII, then
/// [`MERGED`].
pub fn token_texts() -> Vec<String> {
    let mut texts = vec!["<|endoftext|>".to_owned(), "<|im_end|>".to_owned()];
    texts.extend((0x20u8..0x7f).map(|byte| char::from(byte).to_string()));
    texts.extend(MERGED.iter().map(|text| (*text).to_owned()));
    texts
}

/// The ids of tokens by their bytes.
pub fn ids(texts: &[&str]) -> Vec<u32> {
    let all = token_texts();
    let by_text: HashMap<&str, u32> = all
        .iter()
        .enumerate()
        .map(|(id, text)| (text.as_str(), id as u32))
        .collect();
    let mut ids: Vec<u32> = texts.iter().map(|text| by_text[text]).collect();
    ids.sort_unstable();
    ids
}

/// A text as GPT-2's byte-level vocabulary stores it: a space as `Ġ`.
fn byte_level(text: &str) -> String {
    text.replace(' ', "\u{120}")
}

/// The tokenizer of the tiny vocabulary (GPT-2 byte-level BPE with one merge).
pub fn tokenizer() -> ModelTokenizer {
    let texts = token_texts();
    let strings = |items: Vec<String>| Value::Array(items.into_iter().map(Value::String).collect());
    let types = (0..texts.len())
        .map(|id| Value::I32(if id < 2 { 3 } else { 1 }))
        .collect();
    let metadata = [
        ("tokenizer.ggml.model", Value::String("gpt2".to_owned())),
        ("tokenizer.ggml.pre", Value::String("gpt-2".to_owned())),
        (
            "tokenizer.ggml.tokens",
            strings(texts.iter().map(|text| byte_level(text)).collect()),
        ),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", strings(vec!["a b".to_owned()])),
        ("tokenizer.ggml.bos_token_id", Value::U32(END_OF_TEXT)),
        ("tokenizer.ggml.eos_token_id", Value::U32(END_OF_TEXT)),
    ];
    let entries: Vec<(&str, &Value)> = metadata.iter().map(|(key, value)| (*key, value)).collect();
    let path = std::env::temp_dir().join(format!(
        "meshnet-grammar-vocabulary-{}-{:?}.gguf",
        std::process::id(),
        std::thread::current().id()
    ));
    let mut file = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut file, &entries, &[]).unwrap();
    drop(file);
    let tokenizer = ModelTokenizer::from_gguf_file(&path);
    std::fs::remove_file(&path).unwrap();
    tokenizer.unwrap()
}
