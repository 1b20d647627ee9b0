//! Reading GGUF files: the model description from metadata, and single tensors on demand.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use meshnet_types::Quantization;
use serde::Serialize;

use crate::error::{ModelError, Result};

/// Architectures this crate runs.
const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

/// Bytes the weights of each part of the model take in memory, per quantization.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WeightBytes {
    /// Bytes of each transformer layer, in layer order.
    pub layers: Vec<u64>,
    /// Bytes of the token embedding.
    pub embedding: u64,
    /// Bytes of the final norm and the LM head (zero for the head when it is tied to the
    /// embedding).
    pub head: u64,
}

/// What the planner and the runtime need to know about a model, read from its metadata.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelDescription {
    /// The architecture name from `general.architecture`.
    pub architecture: String,
    /// The model's name from `general.name`, when present.
    pub name: Option<String>,
    /// Number of transformer layers.
    pub layers: usize,
    /// Hidden size (embedding length).
    pub hidden: usize,
    /// Feed-forward inner size.
    pub intermediate: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Size of one attention head.
    pub head_dim: usize,
    /// RoPE frequency base.
    pub rope_base: f32,
    /// Number of dimensions of each head that RoPE rotates.
    pub rope_dims: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Training context length.
    pub context_length: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Beginning-of-sequence token id.
    pub bos_token: Option<u32>,
    /// End-of-sequence token id.
    pub eos_token: Option<u32>,
    /// The id of `<|im_start|>`, when the vocabulary has it.
    pub im_start_token: Option<u32>,
    /// The id of `<|im_end|>`, when the vocabulary has it.
    pub im_end_token: Option<u32>,
    /// The Jinja chat template from `tokenizer.chat_template`, when present.
    pub chat_template: Option<String>,
    /// Whether the LM head reuses the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
    /// The format the file stores its layers' matrices in, when the project has a name for it
    /// (`q4_1`, `q8_0`, or `bf16` for 16- and 32-bit floats).
    pub shipped_quantization: Option<Quantization>,
    /// Bytes of the weights as stored in the file.
    pub bytes_as_shipped: WeightBytes,
    /// Bytes of the weights after requantisation to Q8_0.
    pub bytes_q8_0: WeightBytes,
}

impl ModelDescription {
    /// The formats spans of this model can be held in: the file's own (when it has a name)
    /// and Q8_0, to which every matrix can be requantised on load.
    pub fn quantizations(&self) -> Vec<Quantization> {
        let mut formats: Vec<Quantization> = self.shipped_quantization.into_iter().collect();
        if !formats.contains(&Quantization::Q8_0) {
            formats.push(Quantization::Q8_0);
        }
        formats
    }

    /// Whether holding the weights in `quantization` (`None`: as stored in the file) means
    /// requantising them to Q8_0 on load; a format neither shipped nor Q8_0 is an error.
    pub fn requantises(&self, quantization: Option<Quantization>) -> Result<bool> {
        match quantization {
            None => Ok(false),
            Some(asked) if Some(asked) == self.shipped_quantization => Ok(false),
            Some(Quantization::Q8_0) => Ok(true),
            Some(asked) => Err(ModelError::UnsupportedQuantization {
                asked,
                shipped: self.shipped_quantization,
            }),
        }
    }

    /// The weight sizes when held in `quantization` (`None`: as stored in the file).
    pub fn weight_bytes(&self, quantization: Option<Quantization>) -> Result<&WeightBytes> {
        Ok(if self.requantises(quantization)? {
            &self.bytes_q8_0
        } else {
            &self.bytes_as_shipped
        })
    }
}

/// An opened GGUF model: its parsed header and description. Tensors are read only when a span
/// asks for them.
#[derive(Debug)]
pub struct GgufModel {
    path: PathBuf,
    content: Content,
    description: ModelDescription,
}

impl GgufModel {
    /// Reads the header and metadata of a GGUF file and checks it describes a supported model.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let content = crate::gguf_check::read_gguf_header(&mut reader, &path)?;
        let description = describe(&path, &content)?;
        Ok(Self {
            path,
            content,
            description,
        })
    }

    /// The file this model was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's description.
    pub fn description(&self) -> &ModelDescription {
        &self.description
    }

    /// The parsed GGUF header (metadata and tensor directory).
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// Whether the file has a tensor of that name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A string metadata value.
    pub(crate) fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Opens a reader for loading tensors; one per span load.
    pub(crate) fn tensor_reader(&self) -> Result<TensorReader<'_>> {
        let file = File::open(&self.path).map_err(|source| ModelError::Io {
            path: self.path.clone(),
            source,
        })?;
        Ok(TensorReader {
            model: self,
            reader: BufReader::new(file),
        })
    }
}

/// Loads single tensors from an open GGUF file, checking their shapes.
pub(crate) struct TensorReader<'a> {
    model: &'a GgufModel,
    reader: BufReader<File>,
}

impl TensorReader<'_> {
    /// The error for a tensor whose data could not be converted.
    pub(crate) fn data_error(&self, name: &str, error: candle_core::Error) -> ModelError {
        ModelError::TensorData {
            path: self.model.path.clone(),
            tensor: name.to_owned(),
            reason: error.to_string(),
        }
    }

    /// Loads the tensor `name`, which must have exactly `expected` dims (outermost first).
    pub(crate) fn load(&mut self, name: &str, expected: &[usize]) -> Result<QTensor> {
        let path = &self.model.path;
        let info =
            self.model
                .content
                .tensor_infos
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: path.clone(),
                    tensor: name.to_owned(),
                })?;
        if info.shape.dims() != expected {
            return Err(ModelError::TensorShape {
                path: path.clone(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                actual: info.shape.dims().to_vec(),
            });
        }
        self.model
            .content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|error| ModelError::TensorData {
                path: path.clone(),
                tensor: name.to_owned(),
                reason: error.to_string(),
            })
    }
}

fn metadata_error(path: &Path, key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        path: path.to_path_buf(),
        key: key.to_owned(),
        reason: reason.into(),
    }
}

fn get<'a>(path: &Path, content: &'a Content, key: &str) -> Result<&'a Value> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| metadata_error(path, key, "missing"))
}

fn get_usize(path: &Path, content: &Content, key: &str) -> Result<usize> {
    let value = get(path, content, key)?;
    let number = match value {
        Value::U8(v) => u64::from(*v),
        Value::U16(v) => u64::from(*v),
        Value::U32(v) => u64::from(*v),
        Value::U64(v) => *v,
        Value::I32(v) if *v >= 0 => *v as u64,
        Value::I64(v) if *v >= 0 => *v as u64,
        other => {
            return Err(metadata_error(
                path,
                key,
                format!(
                    "expected an unsigned integer, found {:?}",
                    other.value_type()
                ),
            ));
        }
    };
    usize::try_from(number).map_err(|_| metadata_error(path, key, "value too large"))
}

fn get_optional_usize(path: &Path, content: &Content, key: &str) -> Result<Option<usize>> {
    if content.metadata.contains_key(key) {
        get_usize(path, content, key).map(Some)
    } else {
        Ok(None)
    }
}

fn get_f32(path: &Path, content: &Content, key: &str) -> Result<f32> {
    match get(path, content, key)? {
        Value::F32(v) => Ok(*v),
        Value::F64(v) => Ok(*v as f32),
        other => Err(metadata_error(
            path,
            key,
            format!("expected a float, found {:?}", other.value_type()),
        )),
    }
}

fn get_string(path: &Path, content: &Content, key: &str) -> Result<String> {
    get(path, content, key)?
        .to_string()
        .cloned()
        .map_err(|error| metadata_error(path, key, error.to_string()))
}

/// Bytes a tensor of `elements` values takes in `dtype`.
fn tensor_bytes(dtype: GgmlDType, elements: usize) -> u64 {
    (elements / dtype.block_size() * dtype.type_size()) as u64
}

/// Bytes a tensor takes after requantisation: matrices become Q8_0, vectors stay f32.
fn q8_0_bytes(dims: &[usize]) -> u64 {
    let elements: usize = dims.iter().product();
    if dims.len() >= 2
        && dims
            .last()
            .is_some_and(|&d| d % GgmlDType::Q8_0.block_size() == 0)
    {
        tensor_bytes(GgmlDType::Q8_0, elements)
    } else {
        (elements * 4) as u64
    }
}

fn describe(path: &Path, content: &Content) -> Result<ModelDescription> {
    let architecture = get_string(path, content, "general.architecture")?;
    if !SUPPORTED_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(ModelError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            architecture,
        });
    }
    let key = |suffix: &str| format!("{architecture}.{suffix}");
    let layers = get_usize(path, content, &key("block_count"))?;
    let hidden = get_usize(path, content, &key("embedding_length"))?;
    let intermediate = get_usize(path, content, &key("feed_forward_length"))?;
    let heads = get_usize(path, content, &key("attention.head_count"))?;
    let kv_heads =
        get_optional_usize(path, content, &key("attention.head_count_kv"))?.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || hidden % heads != 0 || heads % kv_heads != 0 {
        return Err(metadata_error(
            path,
            &key("attention.head_count"),
            format!("{heads} heads and {kv_heads} KV heads do not divide hidden size {hidden}"),
        ));
    }
    let head_dim = hidden / heads;
    let rope_dims =
        get_optional_usize(path, content, &key("rope.dimension_count"))?.unwrap_or(head_dim);
    if rope_dims != head_dim {
        return Err(metadata_error(
            path,
            &key("rope.dimension_count"),
            format!("partial RoPE ({rope_dims} of {head_dim} dims) is not supported"),
        ));
    }
    let rope_base = if content.metadata.contains_key(&key("rope.freq_base")) {
        get_f32(path, content, &key("rope.freq_base"))?
    } else {
        10_000.0
    };
    let rms_eps = f64::from(get_f32(
        path,
        content,
        &key("attention.layer_norm_rms_epsilon"),
    )?);
    let context_length = get_optional_usize(path, content, &key("context_length"))?.unwrap_or(2048);
    let tokens = get(path, content, "tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(|error| metadata_error(path, "tokenizer.ggml.tokens", error.to_string()))?;
    let find_token = |text: &str| {
        tokens
            .iter()
            .position(|token| token.to_string().is_ok_and(|t| t == text))
            .and_then(|index| u32::try_from(index).ok())
    };
    let to_u32 = |value: Option<usize>| value.and_then(|v| u32::try_from(v).ok());
    let bos_token = to_u32(get_optional_usize(
        path,
        content,
        "tokenizer.ggml.bos_token_id",
    )?);
    let eos_token = to_u32(get_optional_usize(
        path,
        content,
        "tokenizer.ggml.eos_token_id",
    )?);
    let chat_template = content
        .metadata
        .get("tokenizer.chat_template")
        .and_then(|value| value.to_string().ok().cloned());

    let embedding_info = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor {
            path: path.to_path_buf(),
            tensor: "token_embd.weight".to_owned(),
        })?;
    let vocab_size = embedding_info.shape.dims().first().copied().unwrap_or(0);
    let tied_embeddings = !content.tensor_infos.contains_key("output.weight");

    let sum_bytes =
        |prefix: &str, measure: &dyn Fn(&candle_core::quantized::gguf_file::TensorInfo) -> u64| {
            content
                .tensor_infos
                .iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(_, info)| measure(info))
                .sum::<u64>()
        };
    let shipped = |info: &candle_core::quantized::gguf_file::TensorInfo| {
        tensor_bytes(info.ggml_dtype, info.shape.elem_count())
    };
    let requantised =
        |info: &candle_core::quantized::gguf_file::TensorInfo| q8_0_bytes(info.shape.dims());
    let weight_bytes =
        |measure: &dyn Fn(&candle_core::quantized::gguf_file::TensorInfo) -> u64| WeightBytes {
            layers: (0..layers)
                .map(|layer| sum_bytes(&format!("blk.{layer}."), measure))
                .collect(),
            embedding: sum_bytes("token_embd.", measure),
            head: sum_bytes("output_norm.", measure) + sum_bytes("output.", measure),
        };

    Ok(ModelDescription {
        name: content
            .metadata
            .get("general.name")
            .and_then(|value| value.to_string().ok().cloned()),
        architecture,
        layers,
        hidden,
        intermediate,
        heads,
        kv_heads,
        head_dim,
        rope_base,
        rope_dims,
        rms_eps,
        context_length,
        vocab_size,
        bos_token,
        eos_token,
        im_start_token: find_token("<|im_start|>"),
        im_end_token: find_token("<|im_end|>"),
        chat_template,
        tied_embeddings,
        shipped_quantization: content
            .tensor_infos
            .get("blk.0.attn_q.weight")
            .and_then(|info| quantization_of(info.ggml_dtype)),
        bytes_as_shipped: weight_bytes(&shipped),
        bytes_q8_0: weight_bytes(&requantised),
    })
}

/// The project's name for a GGUF tensor type, when it has one.
fn quantization_of(dtype: GgmlDType) -> Option<Quantization> {
    match dtype {
        GgmlDType::Q4_1 => Some(Quantization::Q4_1),
        GgmlDType::Q8_0 => Some(Quantization::Q8_0),
        GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 => Some(Quantization::Bf16),
        _ => None,
    }
}
