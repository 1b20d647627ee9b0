//! Reading GGUF files: the model description from metadata, and single tensors on demand.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use meshnet_types::Quantization;
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::family::{ArchitectureConfig, Family, ShapeFacts, read_config};
use crate::metadata::{get, get_f32, get_optional_usize, get_string, get_usize, metadata_error};

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
    /// The context served: the training context length, or less when the model was opened
    /// with a limit.
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
    /// The format the file stores its layers' matrices in, when they all share one the
    /// project has a name for (`q4_1`, `q8_0`, or `bf16` for 16- and 32-bit floats).
    pub shipped_quantization: Option<Quantization>,
    /// How many tensors of each GGUF type the file holds (a Q4_K_M file mixes several).
    pub tensor_types: BTreeMap<String, usize>,
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
    config: ArchitectureConfig,
}

impl GgufModel {
    /// Reads the header and metadata of a GGUF file and checks it describes a supported model.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with_context(path, None)
    }

    /// Like [`Self::open`], serving sessions of at most `context` positions when given (fewer
    /// than the trained context: LongRoPE models then keep their short-context factors, as
    /// llama.cpp does with a context that small).
    pub fn open_with_context(path: impl AsRef<Path>, context: Option<usize>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let content = crate::gguf_check::read_gguf_header(&mut reader, &path)?;
        let (description, config) = describe(&path, &content, context)?;
        Ok(Self {
            path,
            content,
            description,
            config,
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

    /// What the model's family changes in its spans.
    pub fn config(&self) -> &ArchitectureConfig {
        &self.config
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
    pub(crate) fn data_error(&self, name: &str, error: impl std::fmt::Display) -> ModelError {
        ModelError::TensorData {
            path: self.model.path.clone(),
            tensor: name.to_owned(),
            reason: error.to_string(),
        }
    }

    /// The entry of tensor `name`, which must have exactly `expected` dims (outermost first).
    pub(crate) fn checked_info(&self, name: &str, expected: &[usize]) -> Result<&TensorInfo> {
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
        Ok(info)
    }

    /// Reads the bytes of tensor `name` (of exactly `expected` dims) in pieces of at most
    /// `piece` bytes, each a whole number of the type's blocks when `piece` is one, handing
    /// each to `consume`: a large tensor is never held whole in a buffer of its own.
    pub(crate) fn read_pieces(
        &mut self,
        name: &str,
        expected: &[usize],
        piece: usize,
        consume: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let info = self.checked_info(name, expected)?;
        let length = tensor_bytes(info.ggml_dtype, info.shape.elem_count());
        let start = self.model.content.tensor_data_offset + info.offset;
        let model = self.model;
        let io = |source| ModelError::Io {
            path: model.path.clone(),
            source,
        };
        self.reader.seek(SeekFrom::Start(start)).map_err(io)?;
        let mut buffer = vec![0u8; piece.max(1).min(length as usize)];
        let mut left = length as usize;
        while left > 0 {
            let take = left.min(buffer.len());
            self.reader.read_exact(&mut buffer[..take]).map_err(io)?;
            consume(&buffer[..take])?;
            left -= take;
        }
        Ok(())
    }

    /// Loads the tensor `name`, which must have exactly `expected` dims (outermost first).
    pub(crate) fn load(&mut self, name: &str, expected: &[usize]) -> Result<QTensor> {
        let path = &self.model.path;
        self.checked_info(name, expected)?;
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

/// The most layers a model may declare (the largest models people run have a few hundred).
const MAX_LAYERS: usize = 4096;

/// The head layout read from `<architecture>.attention.*`.
struct AttentionShape {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Heads, key/value heads and head size; the head size is `key_length` when the file gives
/// one (Qwen 3 and Gemma 3 heads are wider than `hidden / heads`), else `hidden / heads`.
fn read_attention(
    path: &Path,
    content: &Content,
    key: &dyn Fn(&str) -> String,
    hidden: usize,
) -> Result<AttentionShape> {
    let heads = get_usize(path, content, &key("attention.head_count"))?;
    let kv_heads =
        get_optional_usize(path, content, &key("attention.head_count_kv"))?.unwrap_or(heads);
    if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || heads > hidden {
        return Err(metadata_error(
            path,
            &key("attention.head_count"),
            format!("{heads} heads and {kv_heads} KV heads do not fit hidden size {hidden}"),
        ));
    }
    let head_dim = match get_optional_usize(path, content, &key("attention.key_length"))? {
        Some(length) if length > 0 && length.is_multiple_of(2) && length <= 4 * hidden => length,
        Some(length) => {
            return Err(metadata_error(
                path,
                &key("attention.key_length"),
                format!("a head size of {length} is not usable"),
            ));
        }
        None if hidden.is_multiple_of(heads) && (hidden / heads).is_multiple_of(2) => {
            hidden / heads
        }
        None => {
            return Err(metadata_error(
                path,
                &key("attention.head_count"),
                format!("{heads} heads do not divide hidden size {hidden} into even heads"),
            ));
        }
    };
    let value_length =
        get_optional_usize(path, content, &key("attention.value_length"))?.unwrap_or(head_dim);
    if value_length != head_dim {
        return Err(metadata_error(
            path,
            &key("attention.value_length"),
            format!("value heads of {value_length} differ from key heads of {head_dim}"),
        ));
    }
    let rope_dims =
        get_optional_usize(path, content, &key("rope.dimension_count"))?.unwrap_or(head_dim);
    if rope_dims != head_dim {
        return Err(metadata_error(
            path,
            &key("rope.dimension_count"),
            format!("partial RoPE ({rope_dims} of {head_dim} dims) is not supported"),
        ));
    }
    Ok(AttentionShape {
        heads,
        kv_heads,
        head_dim,
    })
}

/// What the vocabulary says about special tokens and the chat template.
struct TextFacts {
    bos_token: Option<u32>,
    eos_token: Option<u32>,
    im_start_token: Option<u32>,
    im_end_token: Option<u32>,
    chat_template: Option<String>,
}

fn read_text_facts(path: &Path, content: &Content) -> Result<TextFacts> {
    let tokens = get(path, content, "tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(|error| metadata_error(path, "tokenizer.ggml.tokens", error.to_string()))?;
    let find_token = |text: &str| {
        tokens
            .iter()
            .position(|token| token.to_string().is_ok_and(|t| t == text))
            .and_then(|index| u32::try_from(index).ok())
    };
    let id = |key: &str| -> Result<Option<u32>> {
        Ok(get_optional_usize(path, content, key)?.and_then(|v| u32::try_from(v).ok()))
    };
    Ok(TextFacts {
        bos_token: id("tokenizer.ggml.bos_token_id")?,
        eos_token: id("tokenizer.ggml.eos_token_id")?,
        im_start_token: find_token("<|im_start|>"),
        im_end_token: find_token("<|im_end|>"),
        chat_template: content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|value| value.to_string().ok().cloned()),
    })
}

/// The weight sizes per layer, embedding and head, each tensor measured by `measure`.
fn weight_sizes(
    content: &Content,
    layers: usize,
    measure: &dyn Fn(&TensorInfo) -> u64,
) -> WeightBytes {
    let mut sizes = WeightBytes {
        layers: vec![0; layers],
        embedding: 0,
        head: 0,
    };
    for (name, info) in &content.tensor_infos {
        let bytes = measure(info);
        let layer = name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(index, _)| index.parse::<usize>().ok());
        if let Some(total) = layer.and_then(|layer| sizes.layers.get_mut(layer)) {
            *total += bytes;
        } else if name.starts_with("token_embd.") {
            sizes.embedding += bytes;
        } else if name.starts_with("output_norm.") || name.starts_with("output.") {
            sizes.head += bytes;
        }
    }
    sizes
}

/// How many tensors of each GGUF type the file holds (`"Q4_K": 27`, …).
fn tensor_types(content: &Content) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for info in content.tensor_infos.values() {
        *counts.entry(type_name(info.ggml_dtype)).or_insert(0) += 1;
    }
    counts
}

/// A GGUF tensor type's name as llama.cpp writes it (`Q4_K`, `Q8_0`, `F32`).
pub(crate) fn type_name(dtype: GgmlDType) -> String {
    let name = format!("{dtype:?}");
    match name.strip_suffix('K') {
        Some(stem) => format!("{stem}_K"),
        None => name,
    }
}

/// The format of the layers' matrices, when they all share one the project names, or else
/// the preset `general.file_type` names (a Q4_K_M file mixes Q4_K, Q6_K and others).
fn shipped_quantization(path: &Path, content: &Content) -> Result<Option<Quantization>> {
    let mut formats = content
        .tensor_infos
        .iter()
        .filter(|(name, info)| name.starts_with("blk.") && info.shape.dims().len() == 2)
        .map(|(_, info)| quantization_of(info.ggml_dtype));
    if let Some(Some(first)) = formats.next()
        && formats.all(|format| format == Some(first))
    {
        return Ok(Some(first));
    }
    let file_type = get_optional_usize(path, content, "general.file_type")?;
    Ok(file_type.and_then(|file_type| Quantization::from_gguf_file_type(file_type as u64)))
}

/// The vocabulary size: the token embedding's rows (at least one).
fn read_vocab_size(path: &Path, content: &Content, hidden: usize) -> Result<usize> {
    let embedding_info = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor {
            path: path.to_path_buf(),
            tensor: "token_embd.weight".to_owned(),
        })?;
    match embedding_info.shape.dims().first() {
        Some(&rows) if rows > 0 => Ok(rows),
        _ => Err(ModelError::TensorShape {
            path: path.to_path_buf(),
            tensor: "token_embd.weight".to_owned(),
            expected: vec![1, hidden],
            actual: embedding_info.shape.dims().to_vec(),
        }),
    }
}

fn describe(
    path: &Path,
    content: &Content,
    context: Option<usize>,
) -> Result<(ModelDescription, ArchitectureConfig)> {
    let architecture = get_string(path, content, "general.architecture")?;
    let family = Family::from_architecture(&architecture).ok_or_else(|| {
        ModelError::UnsupportedArchitecture {
            path: path.to_path_buf(),
            architecture: architecture.clone(),
            supported: Family::supported_list(),
        }
    })?;
    let key = |suffix: &str| format!("{architecture}.{suffix}");
    let layers = get_usize(path, content, &key("block_count"))?;
    // The count sizes per-layer tables: an absurd one is a corrupt file, not an allocation.
    if layers == 0 || layers > MAX_LAYERS {
        return Err(metadata_error(
            path,
            &key("block_count"),
            format!("{layers} layers is outside 1..={MAX_LAYERS}"),
        ));
    }
    let hidden = get_usize(path, content, &key("embedding_length"))?;
    let intermediate = get_usize(path, content, &key("feed_forward_length"))?;
    let attention = read_attention(path, content, &key, hidden)?;
    let rms_eps = f64::from(get_f32(
        path,
        content,
        &key("attention.layer_norm_rms_epsilon"),
    )?);
    let trained_context =
        get_optional_usize(path, content, &key("context_length"))?.unwrap_or(2048);
    let context_length = context.map_or(trained_context, |limit| limit.min(trained_context));
    let text = read_text_facts(path, content)?;
    let vocab_size = read_vocab_size(path, content, hidden)?;
    let config = read_config(
        path,
        content,
        family,
        &ShapeFacts {
            layers,
            hidden,
            heads: attention.heads,
            head_dim: attention.head_dim,
            context: context_length,
        },
    )?;
    let shipped = |info: &TensorInfo| tensor_bytes(info.ggml_dtype, info.shape.elem_count());
    let requantised = |info: &TensorInfo| q8_0_bytes(info.shape.dims());
    let description = ModelDescription {
        name: content
            .metadata
            .get("general.name")
            .and_then(|value| value.to_string().ok().cloned()),
        layers,
        hidden,
        intermediate,
        heads: attention.heads,
        kv_heads: attention.kv_heads,
        head_dim: attention.head_dim,
        rope_base: config.global_rope.base,
        rope_dims: attention.head_dim,
        rms_eps,
        context_length,
        vocab_size,
        bos_token: text.bos_token,
        eos_token: text.eos_token,
        im_start_token: text.im_start_token,
        im_end_token: text.im_end_token,
        chat_template: text.chat_template,
        tied_embeddings: !content.tensor_infos.contains_key("output.weight"),
        shipped_quantization: shipped_quantization(path, content)?,
        tensor_types: tensor_types(content),
        bytes_as_shipped: weight_sizes(content, layers, &shipped),
        bytes_q8_0: weight_sizes(content, layers, &requantised),
        architecture,
    };
    Ok((description, config))
}

/// The project's name for a GGUF tensor type, when it has one.
fn quantization_of(dtype: GgmlDType) -> Option<Quantization> {
    match dtype {
        GgmlDType::Q4_0 => Some(Quantization::Q4_0),
        GgmlDType::Q4_1 => Some(Quantization::Q4_1),
        GgmlDType::Q5_0 => Some(Quantization::Q5_0),
        GgmlDType::Q5_1 => Some(Quantization::Q5_1),
        GgmlDType::Q8_0 => Some(Quantization::Q8_0),
        GgmlDType::Q2K => Some(Quantization::Q2K),
        GgmlDType::Q3K => Some(Quantization::Q3KS),
        GgmlDType::Q4K => Some(Quantization::Q4KS),
        GgmlDType::Q5K => Some(Quantization::Q5KS),
        GgmlDType::Q6K => Some(Quantization::Q6K),
        GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 => Some(Quantization::Bf16),
        _ => None,
    }
}
