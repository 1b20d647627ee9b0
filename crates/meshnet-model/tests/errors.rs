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
    let cut = content.tensor_data_offset + 4096;
    std::fs::write(&file.0, &bytes[..cut as usize]).unwrap();
    // The first tensor in file order whose data does not end by the cut.
    let first_cut = content
        .tensor_infos
        .iter()
        .filter(|(_, info)| {
            let bytes = info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size();
            content.tensor_data_offset + info.offset + bytes as u64 > cut
        })
        .min_by_key(|(_, info)| info.offset)
        .map(|(name, _)| name.clone())
        .unwrap();
    let error = GgufModel::open(&file.0).unwrap_err();
    match &error {
        ModelError::TensorData { tensor, .. } => assert_eq!(*tensor, first_cut),
        other => panic!("expected a tensor data error, got {other}"),
    }
    assert!(
        error.to_string().contains("past the end of the file"),
        "{error}"
    );
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

    // The file holds one layer's tensors, so it declares one layer (a file declaring more
    // layers than it has tensors is refused at open).
    let one_layer = [("llama.block_count", gguf_file::Value::U32(1))];
    let file = TempFile::new("missing.gguf");
    write_gguf(&file, &one_layer, &without("blk.0.ffn_up.weight"));
    let model = GgufModel::open(&file.0).unwrap();
    let error = LlamaSpan::load(&model, &first_layer_spec()).unwrap_err();
    assert!(matches!(error, ModelError::MissingTensor { .. }), "{error}");
    assert!(error.to_string().contains("blk.0.ffn_up.weight"), "{error}");

    let wrong = Tensor::zeros((128, 576), DType::F32, &Device::Cpu).unwrap();
    let wrong = QTensor::quantize(&wrong, GgmlDType::F32).unwrap();
    let mut misshapen = without("blk.0.attn_k.weight");
    misshapen.push(("blk.0.attn_k.weight", &wrong));
    let file = TempFile::new("misshapen.gguf");
    write_gguf(&file, &one_layer, &misshapen);
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

/// A GGUF metadata value for [`gguf_bytes`].
enum Meta {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(&'static str),
    Strings(Vec<String>),
    /// A string whose length prefix claims `claimed` bytes, followed by `bytes`.
    LyingString {
        claimed: u64,
        bytes: &'static [u8],
    },
}

/// A tensor entry for [`gguf_bytes`]: dims outermost first (as candle and the span loader
/// give them), a ggml type id, and its data. `offset`, when set, replaces the real offset.
struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
    offset: Option<u64>,
}

impl TensorSpec {
    /// An f32 tensor of zeros.
    fn zeros(name: &str, dims: &[u64]) -> Self {
        let elements: u64 = dims.iter().product();
        Self {
            name: name.to_owned(),
            dims: dims.to_vec(),
            type_id: 0,
            data: vec![0; elements as usize * 4],
            offset: None,
        }
    }
}

fn put_u32(out: &mut Vec<u8>, value: u32) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_string(out: &mut Vec<u8>, text: &str) {
    put_u64(out, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Meta) {
    match value {
        Meta::U32(v) => {
            put_u32(out, 4);
            put_u32(out, *v);
        }
        Meta::U64(v) => {
            put_u32(out, 10);
            put_u64(out, *v);
        }
        Meta::F32(v) => {
            put_u32(out, 6);
            out.extend_from_slice(&v.to_le_bytes());
        }
        Meta::Str(text) => {
            put_u32(out, 8);
            put_string(out, text);
        }
        Meta::Strings(texts) => {
            put_u32(out, 9);
            put_u32(out, 8);
            put_u64(out, texts.len() as u64);
            texts.iter().for_each(|text| put_string(out, text));
        }
        Meta::LyingString { claimed, bytes } => {
            put_u32(out, 8);
            put_u64(out, *claimed);
            out.extend_from_slice(bytes);
        }
    }
}

/// The bytes of a GGUF v3 file, written here independently of candle's writer so a test can
/// lie in any field.
fn gguf_bytes(metadata: &[(&str, Meta)], tensors: &[TensorSpec]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    put_u32(&mut out, 3);
    put_u64(&mut out, tensors.len() as u64);
    put_u64(&mut out, metadata.len() as u64);
    for (key, value) in metadata {
        put_string(&mut out, key);
        put_value(&mut out, value);
    }
    let mut next = 0u64;
    for tensor in tensors {
        put_string(&mut out, &tensor.name);
        put_u32(&mut out, tensor.dims.len() as u32);
        tensor
            .dims
            .iter()
            .rev()
            .for_each(|&dim| put_u64(&mut out, dim));
        put_u32(&mut out, tensor.type_id);
        put_u64(&mut out, tensor.offset.unwrap_or(next));
        next += (tensor.data.len() as u64).div_ceil(32) * 32;
    }
    for tensor in tensors {
        out.resize(out.len().div_ceil(32) * 32, 0);
        out.extend_from_slice(&tensor.data);
    }
    out
}

const TINY_HIDDEN: u64 = 64;
const TINY_KV_WIDTH: u64 = 32;
const TINY_FFN: u64 = 128;
const TINY_VOCAB: u64 = 8;

/// The metadata of a one-layer Llama model: hidden 64, two heads sharing one KV head of 32,
/// feed-forward 128, eight tokens.
fn tiny_metadata() -> Vec<(&'static str, Meta)> {
    vec![
        ("general.architecture", Meta::Str("llama")),
        ("general.name", Meta::Str("tiny")),
        ("llama.block_count", Meta::U32(1)),
        ("llama.context_length", Meta::U32(256)),
        ("llama.embedding_length", Meta::U32(TINY_HIDDEN as u32)),
        ("llama.feed_forward_length", Meta::U32(TINY_FFN as u32)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(1)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        (
            "tokenizer.ggml.tokens",
            Meta::Strings((0..TINY_VOCAB).map(|i| format!("t{i}")).collect()),
        ),
        ("tokenizer.ggml.bos_token_id", Meta::U32(0)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(1)),
    ]
}

/// The tensors of that model, all f32 zeros.
fn tiny_tensors() -> Vec<TensorSpec> {
    let (h, kv, ffn) = (TINY_HIDDEN, TINY_KV_WIDTH, TINY_FFN);
    vec![
        TensorSpec::zeros("token_embd.weight", &[TINY_VOCAB, h]),
        TensorSpec::zeros("blk.0.attn_norm.weight", &[h]),
        TensorSpec::zeros("blk.0.attn_q.weight", &[h, h]),
        TensorSpec::zeros("blk.0.attn_k.weight", &[kv, h]),
        TensorSpec::zeros("blk.0.attn_v.weight", &[kv, h]),
        TensorSpec::zeros("blk.0.attn_output.weight", &[h, h]),
        TensorSpec::zeros("blk.0.ffn_norm.weight", &[h]),
        TensorSpec::zeros("blk.0.ffn_gate.weight", &[ffn, h]),
        TensorSpec::zeros("blk.0.ffn_up.weight", &[ffn, h]),
        TensorSpec::zeros("blk.0.ffn_down.weight", &[h, ffn]),
        TensorSpec::zeros("output_norm.weight", &[h]),
    ]
}

/// The tiny model with `key` set to `value` (added when absent).
fn tiny_metadata_with(key: &'static str, value: Meta) -> Vec<(&'static str, Meta)> {
    let mut metadata = tiny_metadata();
    match metadata.iter_mut().find(|(k, _)| *k == key) {
        Some(entry) => entry.1 = value,
        None => metadata.push((key, value)),
    }
    metadata
}

/// The tiny model's tensors with `name` changed by `change`.
fn tiny_tensors_with(name: &str, change: impl FnOnce(&mut TensorSpec)) -> Vec<TensorSpec> {
    let mut tensors = tiny_tensors();
    change(tensors.iter_mut().find(|t| t.name == name).unwrap());
    tensors
}

/// Writes `bytes` to a temporary file and opens it as a model.
fn open_bytes(name: &str, bytes: &[u8]) -> (TempFile, Result<GgufModel, ModelError>) {
    let file = TempFile::new(name);
    std::fs::write(&file.0, bytes).unwrap();
    let result = GgufModel::open(&file.0);
    (file, result)
}

fn assert_metadata_key(result: Result<GgufModel, ModelError>, expected: &str) {
    match result {
        Err(ModelError::Metadata { key, reason, .. }) => {
            assert_eq!(key, expected, "{reason}");
        }
        Err(other) => panic!("expected a metadata error on {expected}, got {other}"),
        Ok(_) => panic!("expected a metadata error on {expected}, the file opened"),
    }
}

fn assert_tensor_data(result: Result<GgufModel, ModelError>, expected: &str, says: &str) {
    match result {
        Err(error @ ModelError::TensorData { .. }) => {
            let message = error.to_string();
            assert!(
                message.contains(expected) && message.contains(says),
                "{message}"
            );
        }
        Err(other) => panic!("expected a tensor data error on {expected}, got {other}"),
        Ok(_) => panic!("expected a tensor data error on {expected}, the file opened"),
    }
}

#[test]
fn the_tiny_model_opens_and_loads() {
    let (_file, model) = open_bytes("tiny.gguf", &gguf_bytes(&tiny_metadata(), &tiny_tensors()));
    let model = model.unwrap();
    let description = model.description();
    assert_eq!(
        (
            description.layers,
            description.hidden,
            description.vocab_size
        ),
        (1, 64, 8)
    );
    LlamaSpan::load(&model, &SpanSpec::whole(description)).unwrap();
}

#[test]
fn a_file_cut_in_its_metadata_names_the_key() {
    let bytes = gguf_bytes(&tiny_metadata(), &tiny_tensors());
    // Cut two bytes into the last key's u32 value.
    let key = b"tokenizer.ggml.eos_token_id";
    let key_at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let cut = key_at + key.len() + 4 + 2;
    let (_file, result) = open_bytes("cut-metadata.gguf", &bytes[..cut]);
    assert_metadata_key(result, "tokenizer.ggml.eos_token_id");

    // Cut early, the file cannot even hold the entries its header counts.
    let name_at = bytes.windows(4).position(|w| w == b"tiny").unwrap();
    let (_file, result) = open_bytes("cut-early.gguf", &bytes[..name_at + 2]);
    match result {
        Err(error @ ModelError::CorruptFile { .. }) => {
            let message = error.to_string();
            assert!(
                message.contains("13 metadata entries and 11 tensors"),
                "{message}"
            );
        }
        Err(other) => panic!("expected a corrupt file, got {other}"),
        Ok(_) => panic!("a file cut in its metadata opened"),
    }
}

#[test]
fn a_file_cut_in_its_tensor_data_names_the_tensor() {
    let bytes = gguf_bytes(&tiny_metadata(), &tiny_tensors());
    // The last tensor, output_norm.weight, is 256 bytes at the end of the file.
    let (_file, result) = open_bytes("cut-data.gguf", &bytes[..bytes.len() - 100]);
    assert_tensor_data(result, "output_norm.weight", "past the end of the file");
}

#[test]
fn an_unsupported_architecture_is_named() {
    let metadata = tiny_metadata_with("general.architecture", Meta::Str("gptneox"));
    let (_file, result) = open_bytes("neox.gguf", &gguf_bytes(&metadata, &tiny_tensors()));
    match result {
        Err(ModelError::UnsupportedArchitecture { architecture, .. }) => {
            assert_eq!(architecture, "gptneox");
        }
        Err(other) => panic!("expected an unsupported architecture, got {other}"),
        Ok(_) => panic!("a gptneox file opened"),
    }
}

#[test]
fn an_unsupported_tensor_type_is_named() {
    // IQ2_XXS (ggml type 16): 66 bytes per 256 values.
    let tensors = tiny_tensors_with("blk.0.ffn_up.weight", |tensor| {
        tensor.dims = vec![TINY_FFN, 256];
        tensor.type_id = 16;
        tensor.data = vec![0; TINY_FFN as usize * 66];
    });
    let (_file, result) = open_bytes("iq2.gguf", &gguf_bytes(&tiny_metadata(), &tensors));
    match result {
        Err(error @ ModelError::UnsupportedTensorType { .. }) => {
            let message = error.to_string();
            assert!(
                message.contains("blk.0.ffn_up.weight") && message.contains("IQ2_XXS"),
                "{message}"
            );
        }
        Err(other) => panic!("expected an unsupported tensor type, got {other}"),
        Ok(_) => panic!("an IQ2_XXS tensor was accepted"),
    }
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named_when_loaded() {
    let tensors = tiny_tensors_with("blk.0.attn_k.weight", |tensor| {
        *tensor = TensorSpec::zeros("blk.0.attn_k.weight", &[TINY_HIDDEN, TINY_HIDDEN]);
    });
    let (_file, model) = open_bytes("shape.gguf", &gguf_bytes(&tiny_metadata(), &tensors));
    let model = model.unwrap();
    match LlamaSpan::load(&model, &SpanSpec::whole(model.description())) {
        Err(ModelError::TensorShape {
            tensor,
            expected,
            actual,
            ..
        }) => {
            assert_eq!(tensor, "blk.0.attn_k.weight");
            assert_eq!((expected, actual), (vec![32, 64], vec![64, 64]));
        }
        Err(other) => panic!("expected a tensor shape error, got {other}"),
        Ok(_) => panic!("a misshapen attn_k loaded"),
    }
}

#[test]
fn an_absurd_layer_count_is_refused_by_name() {
    let metadata = tiny_metadata_with("llama.block_count", Meta::U64(1_000_000_000_000));
    let (_file, result) = open_bytes("layers.gguf", &gguf_bytes(&metadata, &tiny_tensors()));
    assert_metadata_key(result, "llama.block_count");
}

#[test]
fn an_empty_vocabulary_is_refused_by_name() {
    let metadata = tiny_metadata_with("tokenizer.ggml.tokens", Meta::Strings(Vec::new()));
    let (_file, result) = open_bytes("vocab.gguf", &gguf_bytes(&metadata, &tiny_tensors()));
    assert_metadata_key(result, "tokenizer.ggml.tokens");
}

#[test]
fn an_embedding_without_one_row_per_token_is_named() {
    let tensors = tiny_tensors_with("token_embd.weight", |tensor| {
        *tensor = TensorSpec::zeros("token_embd.weight", &[TINY_VOCAB + 1, TINY_HIDDEN]);
    });
    let (_file, result) = open_bytes("embd.gguf", &gguf_bytes(&tiny_metadata(), &tensors));
    match result {
        Err(ModelError::TensorShape {
            tensor,
            expected,
            actual,
            ..
        }) => {
            assert_eq!(tensor, "token_embd.weight");
            assert_eq!((expected, actual), (vec![8, 64], vec![9, 64]));
        }
        Err(other) => panic!("expected a tensor shape error, got {other}"),
        Ok(_) => panic!("a nine-row embedding for eight tokens was accepted"),
    }
}

#[test]
fn a_tensor_offset_past_the_end_is_named() {
    let tensors = tiny_tensors_with("blk.0.ffn_gate.weight", |tensor| {
        tensor.offset = Some(1 << 40);
    });
    let (_file, result) = open_bytes("offset.gguf", &gguf_bytes(&tiny_metadata(), &tensors));
    assert_tensor_data(result, "blk.0.ffn_gate.weight", "past the end of the file");
}

#[test]
fn dims_whose_product_overflows_are_named() {
    let tensors = tiny_tensors_with("blk.0.attn_q.weight", |tensor| {
        tensor.dims = vec![1 << 40, 1 << 40];
    });
    let (_file, result) = open_bytes("dims.gguf", &gguf_bytes(&tiny_metadata(), &tensors));
    assert_tensor_data(result, "blk.0.attn_q.weight", "more elements");
}

#[test]
fn a_string_length_past_the_end_names_the_key() {
    let lying = Meta::LyingString {
        claimed: 1_000_000,
        bytes: b"tiny",
    };
    let metadata = tiny_metadata_with("general.name", lying);
    let (_file, result) = open_bytes("string.gguf", &gguf_bytes(&metadata, &tiny_tensors()));
    assert_metadata_key(result, "general.name");
}

#[test]
fn a_zero_alignment_is_refused_by_name() {
    // Candle's reader divides by this value.
    let metadata = tiny_metadata_with("general.alignment", Meta::U32(0));
    let (_file, result) = open_bytes("align.gguf", &gguf_bytes(&metadata, &tiny_tensors()));
    assert_metadata_key(result, "general.alignment");
}

#[test]
fn the_known_models_pass_the_header_checks() {
    for known in meshnet_model::KNOWN_MODELS {
        let path = known.path();
        assert!(
            path.is_file(),
            "{} is missing at {}: run `bash scripts/fetch-model.sh {}`",
            known.name,
            path.display(),
            known.name
        );
        let mut file = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
        let content = meshnet_model::read_gguf_header(&mut file, &path).unwrap();
        assert!(content.tensor_infos.len() > 100, "{}", known.name);
    }
}
