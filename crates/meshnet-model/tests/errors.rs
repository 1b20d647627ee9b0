#![allow(clippy::unwrap_used)]
//! Broken model files give errors that name the file, the metadata key or the tensor.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor};
use meshnet_model::{GgufModel, LlamaSpan, ModelError, SpanSpec};

/// A file in the temporary directory, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str) -> Self {
        Self(std::env::temp_dir().join(format!("meshnet-model-{}-{name}", std::process::id())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes a GGUF file with the default model's metadata (with `overrides`) and the given
/// tensors.
fn write_gguf(
    target: &TempFile,
    overrides: &[(&str, gguf_file::Value)],
    tensors: &[(&str, &QTensor)],
) {
    let mut source = std::fs::File::open(common::model_path()).unwrap();
    let content = gguf_file::Content::read(&mut source).unwrap();
    let mut metadata: HashMap<&str, &gguf_file::Value> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    for (key, value) in overrides {
        metadata.insert(key, value);
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.into_iter().collect();
    let mut file = std::fs::File::create(&target.0).unwrap();
    gguf_file::write(&mut file, &metadata, tensors).unwrap();
}

/// The token embedding and the first layer's tensors of the default model, by name.
fn first_layer_tensors() -> Vec<(String, QTensor)> {
    let mut source = std::fs::File::open(common::model_path()).unwrap();
    let content = gguf_file::Content::read(&mut source).unwrap();
    let mut names: Vec<String> = content
        .tensor_infos
        .keys()
        .filter(|name| name.starts_with("blk.0.") || *name == "token_embd.weight")
        .cloned()
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let tensor = content.tensor(&mut source, &name, &Device::Cpu).unwrap();
            (name, tensor)
        })
        .collect()
}

fn first_layer_spec() -> SpanSpec {
    SpanSpec::layers(meshnet_types::LayerSpan::new(0, 1))
}

#[test]
fn garbage_is_not_a_gguf_file() {
    let file = TempFile::new("garbage.gguf");
    std::fs::write(&file.0, b"this is not a model at all, just some text").unwrap();
    let error = GgufModel::open(&file.0).unwrap_err();
    assert!(matches!(error, ModelError::CorruptFile { .. }), "{error}");
    assert!(error.to_string().contains("garbage.gguf"), "{error}");

    let missing = GgufModel::open("/nonexistent/model.gguf").unwrap_err();
    assert!(
        missing.to_string().contains("/nonexistent/model.gguf"),
        "{missing}"
    );
}

#[test]
fn truncated_tensor_data_names_the_tensor() {
    let mut source = std::fs::File::open(common::model_path()).unwrap();
    let content = gguf_file::Content::read(&mut source).unwrap();
    let bytes = std::fs::read(common::model_path()).unwrap();
    let file = TempFile::new("truncated.gguf");
    std::fs::write(
        &file.0,
        &bytes[..content.tensor_data_offset as usize + 4096],
    )
    .unwrap();
    let model = GgufModel::open(&file.0).unwrap();
    let error = LlamaSpan::load(&model, &SpanSpec::whole(model.description())).unwrap_err();
    assert!(matches!(error, ModelError::TensorData { .. }), "{error}");
    assert!(error.to_string().contains(".weight"), "{error}");
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let layer = first_layer_tensors();
    let without = |skip: &str| -> Vec<(&str, &QTensor)> {
        layer
            .iter()
            .filter(|(name, _)| name != skip)
            .map(|(name, tensor)| (name.as_str(), tensor))
            .collect()
    };

    let file = TempFile::new("missing.gguf");
    write_gguf(&file, &[], &without("blk.0.ffn_up.weight"));
    let model = GgufModel::open(&file.0).unwrap();
    let error = LlamaSpan::load(&model, &first_layer_spec()).unwrap_err();
    assert!(matches!(error, ModelError::MissingTensor { .. }), "{error}");
    assert!(error.to_string().contains("blk.0.ffn_up.weight"), "{error}");

    let wrong = Tensor::zeros((128, 576), DType::F32, &Device::Cpu).unwrap();
    let wrong = QTensor::quantize(&wrong, GgmlDType::F32).unwrap();
    let mut misshapen = without("blk.0.attn_k.weight");
    misshapen.push(("blk.0.attn_k.weight", &wrong));
    let file = TempFile::new("misshapen.gguf");
    write_gguf(&file, &[], &misshapen);
    let model = GgufModel::open(&file.0).unwrap();
    let error = LlamaSpan::load(&model, &first_layer_spec()).unwrap_err();
    assert!(matches!(error, ModelError::TensorShape { .. }), "{error}");
    let message = error.to_string();
    assert!(
        message.contains("blk.0.attn_k.weight") && message.contains("192"),
        "{message}"
    );
}

#[test]
fn unsupported_architecture_and_bad_metadata_are_named() {
    let file = TempFile::new("arch.gguf");
    write_gguf(
        &file,
        &[(
            "general.architecture",
            gguf_file::Value::String("gptneox".into()),
        )],
        &[],
    );
    let error = GgufModel::open(&file.0).unwrap_err();
    assert!(
        matches!(error, ModelError::UnsupportedArchitecture { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("gptneox"), "{error}");

    let file = TempFile::new("heads.gguf");
    write_gguf(
        &file,
        &[("llama.attention.head_count", gguf_file::Value::U32(7))],
        &[],
    );
    let error = GgufModel::open(&file.0).unwrap_err();
    assert!(
        error.to_string().contains("llama.attention.head_count"),
        "{error}"
    );
}
