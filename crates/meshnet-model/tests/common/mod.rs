//! Shared helpers of the integration tests: finding the default model.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use meshnet_model::{GgufModel, ModelTokenizer};

/// The default model's path; fails the test with instructions when it is absent.
pub fn model_path() -> PathBuf {
    let path = meshnet_model::default_model_path();
    assert!(
        path.is_file(),
        "the default model is missing at {}: run `bash scripts/fetch-model.sh` (or set \
         MESHNET_MODELS to the directory that holds {})",
        path.display(),
        meshnet_model::DEFAULT_MODEL_FILE
    );
    path
}

/// The default model, opened once per test binary.
pub fn model() -> &'static GgufModel {
    static MODEL: OnceLock<GgufModel> = OnceLock::new();
    MODEL.get_or_init(|| GgufModel::open(model_path()).expect("the default model opens"))
}

/// The default model's tokenizer, built once per test binary.
pub fn tokenizer() -> &'static ModelTokenizer {
    static TOKENIZER: OnceLock<ModelTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| ModelTokenizer::from_gguf(model()).expect("the tokenizer builds"))
}

/// Three prompts of different kinds, encoded.
pub fn prompts() -> Vec<Vec<u32>> {
    let template = meshnet_model::ChatTemplate::chatml().expect("ChatML compiles");
    [
        template
            .render(&[meshnet_model::ChatMessage::user(
                "What is the capital of France?",
            )])
            .expect("ChatML renders"),
        "The three primary colors are".to_owned(),
        "def fibonacci(n):\n    ".to_owned(),
    ]
    .iter()
    .map(|text| tokenizer().encode(text).expect("encodes"))
    .collect()
}
