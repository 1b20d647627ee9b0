#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Our tokenizer against llama.cpp's own tokenizer test vectors: the vocabulary-only GGUF
//! files `models/ggml-vocab-*.gguf` of llama.cpp, with `.gguf.inp` (input strings separated by
//! a `__ggml_vocab_test__` line) and `.gguf.out` (the ids llama.cpp's `test-tokenizer-0`
//! expects, one line of space-separated ids per input). Encoded as that test does: no BOS,
//! special tokens as plain text.
//!
//! The files come from the llama-cpp-python source distribution, fetched into a cache by
//! `scripts/fetch-llama-references.sh` (`MESHNET_REFERENCES` overrides the cache directory).

use std::path::PathBuf;

use meshnet_model::{EncodeOptions, ModelTokenizer};

/// The llama.cpp release the fetch script pins.
const LLAMA_CPP_DIR: &str = "llama.cpp-0.3.36";

/// The line separating inputs in a `.gguf.inp` file.
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// The directory holding `ggml-vocab-*.gguf`; fails the test with the command to run when the
/// files are missing.
fn models_dir() -> PathBuf {
    let cache = std::env::var_os("MESHNET_REFERENCES")
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
            PathBuf::from(home).join(".cache/meshnet/references")
        });
    let dir = cache.join(LLAMA_CPP_DIR).join("models");
    assert!(
        dir.join("ggml-vocab-llama-spm.gguf.inp").is_file(),
        "llama.cpp's tokenizer vectors are missing from {}: run \
         `bash scripts/fetch-llama-references.sh` (or set MESHNET_REFERENCES to the directory \
         that holds {LLAMA_CPP_DIR})",
        dir.display()
    );
    dir
}

/// The inputs and expected ids of one vocabulary, read as llama.cpp's test reads them.
fn vectors(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = models_dir();
    let inputs = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp"))).unwrap();
    let outputs = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
    let mut texts = Vec::new();
    let mut rest = inputs.as_str();
    while !rest.is_empty() {
        match rest.find(SEPARATOR) {
            Some(end) => {
                texts.push(rest[..end].to_owned());
                rest = &rest[end + SEPARATOR.len()..];
            }
            None => {
                texts.push(rest.to_owned());
                rest = "";
            }
        }
    }
    let ids: Vec<Vec<u32>> = outputs
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        ids.len(),
        "{name}: inputs and outputs differ in number"
    );
    texts.into_iter().zip(ids).collect()
}

/// Encodes every vector of `name`, prints `name: passed/total`, and fails listing each
/// mismatch.
fn check(name: &str) {
    let path = models_dir().join(format!("ggml-vocab-{name}.gguf"));
    let tokenizer = ModelTokenizer::from_gguf_file(&path).unwrap();
    let vectors = vectors(name);
    let mut failures = Vec::new();
    for (text, expected) in &vectors {
        let ours = tokenizer
            .encode_with(text, EncodeOptions::default())
            .unwrap();
        if &ours != expected {
            failures.push(format!(
                "  {text:?}\n    llama.cpp {expected:?}\n    ours      {ours:?}"
            ));
        }
    }
    let total = vectors.len();
    println!(
        "{name}: {}/{total} vectors equal llama.cpp",
        total - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{name}: {} of {total} vectors differ from llama.cpp:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(total >= 30, "{name}: only {total} vectors");
}

#[test]
fn llama_spm_equals_llama_cpp() {
    check("llama-spm");
}

#[test]
fn phi_3_equals_llama_cpp() {
    check("phi-3");
}

#[test]
fn llama_bpe_equals_llama_cpp() {
    check("llama-bpe");
}

#[test]
fn qwen2_equals_llama_cpp() {
    check("qwen2");
}

#[test]
fn gpt_2_equals_llama_cpp() {
    check("gpt-2");
}

/// The other pre-tokenizers this crate claims, where llama.cpp ships vectors for them.
#[test]
fn other_claimed_pre_tokenizers_equal_llama_cpp() {
    for name in [
        "qwen35",
        "starcoder",
        "refact",
        "command-r",
        "mpt",
        "falcon",
    ] {
        check(name);
    }
}
