//! GPT-2 spans from a Hugging Face directory (`config.json` + `model.safetensors`): token
//! embedding → blocks `[a..b)` → final LayerNorm and LM head, with learned absolute position
//! embeddings, LayerNorm, causal multi-head attention and a tanh-GELU MLP, computed in f32 on
//! the CPU.
//!
//! A span reads only the tensors of the parts it holds, straight from their byte ranges in the
//! safetensors file. Its KV caches live in a [`KvStore`] beside the weights, like a Llama
//! span's, so GPT-2 spans are [`Stage`]s, [`TokenEmbedder`]s and [`LogitsHead`]s of the same
//! [`LayerRoute`](crate::LayerRoute).
//!
//! Position embeddings: [`TokenEmbedder::embed`] is not told the chunk's position, so the
//! embedder returns the token embeddings (`wte`) only, and the span that runs block 0 adds the
//! learned position embeddings (`wpe`) at the chunk's absolute positions before its first
//! block. Hidden states entering a span that starts at block 0 are therefore `wte[ids]`; every
//! other boundary carries the residual stream as usual.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use serde_json::Value;

use crate::attention::{causal_mask, check_sub_span, check_token_ids, hidden_tokens};
use crate::error::{ModelError, Result};
use crate::generation::{LogitsHead, Stage, TokenEmbedder};
use meshnet_types::{LayerSpan, Quantization};

use crate::gguf::{ModelDescription, WeightBytes};
use crate::kv_cache::{CACHED_VALUE_BYTES, KvStore, SessionCache, SessionId};
use crate::llama::SpanSpec;

/// The configuration file of a Hugging Face model directory.
pub const GPT2_CONFIG_FILE: &str = "config.json";

/// The weights file of a Hugging Face model directory.
pub const GPT2_WEIGHTS_FILE: &str = "model.safetensors";

/// The activation names that mean the tanh approximation of GELU.
const TANH_GELU_NAMES: &[&str] = &["gelu_new", "gelu_pytorch_tanh"];

/// The largest safetensors header this reader accepts (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The hyper-parameters of a GPT-2 model, read from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    /// Number of transformer blocks (`n_layer`).
    pub layers: usize,
    /// Hidden size (`n_embd`).
    pub hidden: usize,
    /// Attention heads (`n_head`).
    pub heads: usize,
    /// Number of learned positions, the longest context (`n_positions`).
    pub positions: usize,
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// MLP inner size (`n_inner`, or 4 × `n_embd` when null or absent).
    pub inner: usize,
    /// LayerNorm epsilon (`layer_norm_epsilon`, 1e-5 when absent).
    pub layer_norm_epsilon: f64,
    /// The activation as named in the file (`activation_function`); always a tanh GELU.
    pub activation: String,
    /// Whether attention scores are divided by √head_dim (`scale_attn_weights`, default true).
    pub scale_attention: bool,
    /// The dtype the config declares (`dtype`, or `torch_dtype` in older files), if any.
    /// Weights are converted to f32 on load whatever it says.
    pub declared_dtype: Option<String>,
    /// Beginning-of-sequence token id (`bos_token_id`), if any.
    pub bos_token: Option<u32>,
    /// End-of-sequence token id (`eos_token_id`), if any.
    pub eos_token: Option<u32>,
}

impl Gpt2Config {
    /// Reads and checks `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path, &text)
    }

    /// Parses the text of a `config.json`; `path` is only used in error messages.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|error| config_error(path, "(file)", format!("not valid JSON: {error}")))?;
        let object = root
            .as_object()
            .ok_or_else(|| config_error(path, "(file)", "the top level is not an object"))?;
        let fields = ConfigFields { path, object };
        fields.check_model_type()?;
        let sizes = fields.model_sizes()?;
        let inner = match fields.count("n_inner")? {
            Some(inner) => inner,
            None => 4 * sizes.hidden,
        };
        let layer_norm_epsilon = fields.positive_number("layer_norm_epsilon", 1e-5)?;
        let activation = fields.activation()?;
        let scale_attention = fields.flag("scale_attn_weights", true)?;
        fields.refuse_unsupported_attention()?;
        Ok(Self {
            layers: sizes.layers,
            hidden: sizes.hidden,
            heads: sizes.heads,
            positions: sizes.positions,
            vocab_size: sizes.vocab_size,
            inner,
            layer_norm_epsilon,
            activation,
            scale_attention,
            declared_dtype: fields.declared_dtype(),
            bos_token: fields.token("bos_token_id")?,
            eos_token: fields.token("eos_token_id")?,
        })
    }

    /// Size of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

/// The required sizes of a GPT-2 model, each at least 1, with the heads dividing the hidden
/// size.
struct ModelSizes {
    layers: usize,
    hidden: usize,
    heads: usize,
    positions: usize,
    vocab_size: usize,
}

/// The members of a `config.json` object, read with the file's path for error messages.
/// A member that is `null` counts as absent.
struct ConfigFields<'a> {
    path: &'a Path,
    object: &'a serde_json::Map<String, Value>,
}

impl<'a> ConfigFields<'a> {
    /// The value of `key`, unless it is absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.object.get(key).filter(|value| !value.is_null())
    }

    /// The error for member `key`.
    fn error(&self, key: &str, reason: impl Into<String>) -> ModelError {
        config_error(self.path, key, reason)
    }

    /// Refuses a `model_type` other than `"gpt2"` (an absent one is accepted).
    fn check_model_type(&self) -> Result<()> {
        match self.get("model_type") {
            Some(model_type) if model_type.as_str() != Some("gpt2") => Err(self.error(
                "model_type",
                format!("expected \"gpt2\", found {model_type}"),
            )),
            _ => Ok(()),
        }
    }

    /// A non-negative integer member, if present.
    fn count(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|value| as_count(self.path, key, value))
            .transpose()
    }

    /// A non-negative integer member that must be present.
    fn required_count(&self, key: &str) -> Result<usize> {
        self.count(key)?.ok_or_else(|| self.error(key, "missing"))
    }

    /// Reads the layer, hidden, head, position and vocabulary sizes, all required and
    /// non-zero, and checks that the heads divide the hidden size.
    fn model_sizes(&self) -> Result<ModelSizes> {
        let sizes = ModelSizes {
            layers: self.required_count("n_layer")?,
            hidden: self.required_count("n_embd")?,
            heads: self.required_count("n_head")?,
            positions: self.required_count("n_positions")?,
            vocab_size: self.required_count("vocab_size")?,
        };
        for (key, value) in [
            ("n_layer", sizes.layers),
            ("n_embd", sizes.hidden),
            ("n_head", sizes.heads),
            ("n_positions", sizes.positions),
            ("vocab_size", sizes.vocab_size),
        ] {
            if value == 0 {
                return Err(self.error(key, "must be at least 1"));
            }
        }
        if !sizes.hidden.is_multiple_of(sizes.heads) {
            return Err(self.error(
                "n_head",
                format!(
                    "{} heads do not divide n_embd {}",
                    sizes.heads, sizes.hidden
                ),
            ));
        }
        Ok(sizes)
    }

    /// A positive number member, `default` when absent.
    fn positive_number(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            Some(value) => value
                .as_f64()
                .filter(|number| *number > 0.0)
                .ok_or_else(|| {
                    self.error(key, format!("expected a positive number, found {value}"))
                }),
            None => Ok(default),
        }
    }

    /// The activation (`activation_function`, `gelu_new` when absent), which must be one of
    /// the tanh GELU names.
    fn activation(&self) -> Result<String> {
        const KEY: &str = "activation_function";
        let activation = match self.get(KEY) {
            Some(value) => value
                .as_str()
                .ok_or_else(|| self.error(KEY, format!("expected a string, found {value}")))?
                .to_owned(),
            None => "gelu_new".to_owned(),
        };
        if !TANH_GELU_NAMES.contains(&activation.as_str()) {
            return Err(self.error(
                KEY,
                format!(
                    "unsupported activation {activation:?} (supported: {})",
                    TANH_GELU_NAMES.join(", ")
                ),
            ));
        }
        Ok(activation)
    }

    /// A boolean member, `default` when absent.
    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(value) => value
                .as_bool()
                .ok_or_else(|| self.error(key, format!("expected true or false, found {value}"))),
        }
    }

    /// Refuses the attention variants this implementation does not have: scaling by the
    /// inverse layer index and cross-attention.
    fn refuse_unsupported_attention(&self) -> Result<()> {
        if self.flag("scale_attn_by_inverse_layer_idx", false)? {
            return Err(self.error(
                "scale_attn_by_inverse_layer_idx",
                "scaling attention by the inverse layer index is not supported",
            ));
        }
        if self.flag("add_cross_attention", false)? {
            return Err(self.error("add_cross_attention", "cross-attention is not supported"));
        }
        Ok(())
    }

    /// The declared dtype: `dtype`, or `torch_dtype` in older files; ignored unless a string.
    fn declared_dtype(&self) -> Option<String> {
        ["dtype", "torch_dtype"]
            .iter()
            .find_map(|key| self.get(key).and_then(Value::as_str).map(str::to_owned))
    }

    /// A token id member, if present.
    fn token(&self, key: &str) -> Result<Option<u32>> {
        self.count(key)?
            .map(|id| u32::try_from(id).map_err(|_| self.error(key, "token id too large")))
            .transpose()
    }
}

fn config_error(path: &Path, key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        path: path.to_path_buf(),
        key: key.to_owned(),
        reason: reason.into(),
    }
}

fn as_count(path: &Path, key: &str, value: &Value) -> Result<usize> {
    value
        .as_u64()
        .and_then(|number| usize::try_from(number).ok())
        .ok_or_else(|| {
            config_error(
                path,
                key,
                format!("expected a non-negative integer, found {value}"),
            )
        })
}

/// Where one tensor lies in a safetensors file.
#[derive(Clone, Debug)]
struct TensorEntry {
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range inside the data section.
    bytes: Range<u64>,
}

/// The header of a safetensors file: every tensor's dtype, shape and byte range.
#[derive(Debug)]
struct SafetensorsIndex {
    entries: HashMap<String, TensorEntry>,
    /// Offset of the data section from the start of the file.
    data_start: u64,
}

impl SafetensorsIndex {
    fn read(path: &Path) -> Result<Self> {
        let corrupt = |reason: String| ModelError::TensorData {
            path: path.to_path_buf(),
            tensor: "(safetensors header)".to_owned(),
            reason,
        };
        let io_error = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(io_error)?;
        let mut length_bytes = [0_u8; 8];
        file.read_exact(&mut length_bytes).map_err(io_error)?;
        let header_length = u64::from_le_bytes(length_bytes);
        if header_length > MAX_HEADER_BYTES {
            return Err(corrupt(format!(
                "header length {header_length} is implausible"
            )));
        }
        let mut header = vec![0_u8; header_length as usize];
        file.read_exact(&mut header).map_err(io_error)?;
        let header: HashMap<String, Value> = serde_json::from_slice(&header)
            .map_err(|error| corrupt(format!("header is not a JSON object: {error}")))?;
        let mut entries = HashMap::with_capacity(header.len());
        for (name, value) in header {
            if name == "__metadata__" {
                continue;
            }
            let entry = parse_entry(&value)
                .map_err(|reason| corrupt(format!("entry for {name}: {reason}")))?;
            entries.insert(name, entry);
        }
        Ok(Self {
            entries,
            data_start: 8 + header_length,
        })
    }
}

fn parse_entry(value: &Value) -> std::result::Result<TensorEntry, String> {
    let dtype = match value.get("dtype").and_then(Value::as_str) {
        Some("F32") => DType::F32,
        Some("F16") => DType::F16,
        Some("BF16") => DType::BF16,
        Some("F64") => DType::F64,
        Some(other) => return Err(format!("unsupported dtype {other}")),
        None => return Err("no dtype".to_owned()),
    };
    let shape = value
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("no shape")?
        .iter()
        .map(|dim| dim.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or("shape is not a list of sizes")?;
    let offsets = value
        .get("data_offsets")
        .and_then(Value::as_array)
        .and_then(|pair| match pair.as_slice() {
            [start, end] => Some((start.as_u64()?, end.as_u64()?)),
            _ => None,
        })
        .ok_or("data_offsets is not a pair of offsets")?;
    let expected_bytes = shape
        .iter()
        .try_fold(dtype.size_in_bytes(), |bytes, &dim| bytes.checked_mul(dim))
        .ok_or_else(|| format!("shape {shape:?} is too large"))?;
    if offsets.1 < offsets.0 || (offsets.1 - offsets.0) != expected_bytes as u64 {
        return Err(format!(
            "data_offsets {offsets:?} do not hold {expected_bytes} bytes for shape {shape:?}"
        ));
    }
    Ok(TensorEntry {
        dtype,
        shape,
        bytes: offsets.0..offsets.1,
    })
}

/// An opened GPT-2 model directory: its configuration, the tensor directory of its weights
/// and its description. Tensors are read only when a span asks for them.
#[derive(Debug)]
pub struct Gpt2Model {
    directory: PathBuf,
    weights: WeightsLayout,
    description: ModelDescription,
}

/// The configuration and the weights file's directory, which together say where every
/// tensor is and how large it becomes once loaded.
#[derive(Debug)]
struct WeightsLayout {
    path: PathBuf,
    config: Gpt2Config,
    index: SafetensorsIndex,
    /// `"transformer."` when the tensor names carry it (saved from `GPT2LMHeadModel`), `""`
    /// when they do not (saved from the bare `GPT2Model`).
    prefix: &'static str,
    /// Whether the LM head reuses `wte` (no `lm_head.weight` in the file).
    tied_embeddings: bool,
}

impl Gpt2Model {
    /// Reads `config.json` and the header of `model.safetensors` in `directory`.
    pub fn open(directory: impl AsRef<Path>) -> Result<Self> {
        let directory = directory.as_ref().to_path_buf();
        let config = Gpt2Config::from_file(directory.join(GPT2_CONFIG_FILE))?;
        let path = directory.join(GPT2_WEIGHTS_FILE);
        let index = SafetensorsIndex::read(&path)?;
        let prefix = if index
            .entries
            .keys()
            .any(|name| name.starts_with("transformer."))
        {
            "transformer."
        } else {
            ""
        };
        let tied_embeddings = !index.entries.contains_key("lm_head.weight");
        let weights = WeightsLayout {
            path,
            config,
            index,
            prefix,
            tied_embeddings,
        };
        let description = weights.describe(&directory)?;
        Ok(Self {
            directory,
            weights,
            description,
        })
    }

    /// The directory the model was read from.
    pub fn directory(&self) -> &Path {
        &self.directory
    }

    /// The model's configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.weights.config
    }

    /// The model's description for the planner.
    pub fn description(&self) -> &ModelDescription {
        &self.description
    }

    /// Whether the tensor names carry the `transformer.` prefix.
    pub fn has_transformer_prefix(&self) -> bool {
        !self.weights.prefix.is_empty()
    }

    /// Whether the LM head reuses the token embedding.
    pub fn tied_embeddings(&self) -> bool {
        self.weights.tied_embeddings
    }

    /// Bytes of the weights per part once loaded with linear weights (and an untied or tied
    /// LM head) quantized to `dtype`; biases, norms and embeddings stay f32. `GgmlDType::F32`
    /// gives the unquantized sizes. Fails when a linear weight's input dimension is not a
    /// multiple of the dtype's block size, as loading would.
    ///
    /// The position embedding counts towards layer 0, whose span adds it. With a tied head
    /// in f32 the head shares the embedding table and counts only its LayerNorm; quantized,
    /// it holds its own quantized copy of the table.
    pub fn weight_bytes(&self, dtype: GgmlDType) -> Result<WeightBytes> {
        self.weights.weight_bytes(dtype)
    }

    /// Opens the weights file for reading tensors; one per span load.
    fn tensor_reader(&self) -> Result<TensorReader<'_>> {
        let file = File::open(&self.weights.path).map_err(|source| ModelError::Io {
            path: self.weights.path.clone(),
            source,
        })?;
        Ok(TensorReader {
            weights: &self.weights,
            file,
        })
    }
}

impl WeightsLayout {
    /// How many tensors of each dtype the safetensors file holds (`"F32": 148`).
    fn tensor_types(&self) -> std::collections::BTreeMap<String, usize> {
        let mut counts = std::collections::BTreeMap::new();
        for entry in self.index.entries.values() {
            *counts
                .entry(format!("{:?}", entry.dtype).to_uppercase())
                .or_insert(0) += 1;
        }
        counts
    }

    fn weight_bytes(&self, dtype: GgmlDType) -> Result<WeightBytes> {
        let config = &self.config;
        let (hidden, inner) = (config.hidden, config.inner);
        let f32_bytes = |elements: usize| (elements * DType::F32.size_in_bytes()) as u64;
        let matrix = |name: String, input: usize, output: usize| -> Result<u64> {
            if dtype == GgmlDType::F32 {
                return Ok(f32_bytes(input * output));
            }
            check_block(&self.path, &name, input, dtype)?;
            Ok((input * output / dtype.block_size() * dtype.type_size()) as u64)
        };
        let mut layers = Vec::with_capacity(config.layers);
        for layer in 0..config.layers {
            let name = |suffix: &str| self.block_tensor_name(layer, suffix);
            let mut bytes = matrix(name("attn.c_attn.weight"), hidden, 3 * hidden)?
                + matrix(name("attn.c_proj.weight"), hidden, hidden)?
                + matrix(name("mlp.c_fc.weight"), hidden, inner)?
                + matrix(name("mlp.c_proj.weight"), inner, hidden)?
                // Biases of the four projections and both LayerNorms.
                + f32_bytes(3 * hidden + hidden + inner + hidden + 4 * hidden);
            if layer == 0 {
                bytes += f32_bytes(config.positions * hidden);
            }
            layers.push(bytes);
        }
        let head_output = if self.tied_embeddings && dtype == GgmlDType::F32 {
            0
        } else {
            matrix(self.head_tensor_name(), hidden, config.vocab_size)?
        };
        Ok(WeightBytes {
            layers,
            embedding: f32_bytes(config.vocab_size * hidden),
            head: f32_bytes(2 * hidden) + head_output,
        })
    }

    fn describe(&self, directory: &Path) -> Result<ModelDescription> {
        let config = &self.config;
        let bytes_as_shipped = self.weight_bytes(GgmlDType::F32)?;
        // A model whose sizes do not allow Q8_0 cannot be loaded that way; the planner sees
        // its f32 sizes.
        let bytes_q8_0 = self
            .weight_bytes(GgmlDType::Q8_0)
            .unwrap_or_else(|_| bytes_as_shipped.clone());
        Ok(ModelDescription {
            architecture: "gpt2".to_owned(),
            name: directory
                .file_name()
                .map(|name| name.to_string_lossy().into_owned()),
            layers: config.layers,
            hidden: config.hidden,
            intermediate: config.inner,
            heads: config.heads,
            kv_heads: config.heads,
            head_dim: config.head_dim(),
            // Learned absolute positions: no rotary embedding.
            rope_base: 0.0,
            rope_dims: 0,
            // The LayerNorm epsilon; GPT-2 has no RMSNorm.
            rms_eps: config.layer_norm_epsilon,
            context_length: config.positions,
            vocab_size: config.vocab_size,
            bos_token: config.bos_token,
            eos_token: config.eos_token,
            im_start_token: None,
            im_end_token: None,
            chat_template: None,
            tied_embeddings: self.tied_embeddings,
            // Safetensors checkpoints hold float weights.
            shipped_quantization: Some(Quantization::Bf16),
            tensor_types: self.tensor_types(),
            bytes_as_shipped,
            bytes_q8_0,
        })
    }

    /// The full name of a tensor outside the blocks (`wte.weight`, `ln_f.bias`, ...).
    fn tensor_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The full name of a tensor of block `layer` (`attn.c_attn.weight`, ...).
    fn block_tensor_name(&self, layer: usize, suffix: &str) -> String {
        format!("{}h.{layer}.{suffix}", self.prefix)
    }

    /// The name of the LM head's matrix: the token embedding when tied.
    fn head_tensor_name(&self) -> String {
        if self.tied_embeddings {
            self.tensor_name("wte.weight")
        } else {
            "lm_head.weight".to_owned()
        }
    }
}

/// The error for a matrix whose input dimension does not fit the quantization's blocks.
fn check_block(path: &Path, tensor: &str, input: usize, dtype: GgmlDType) -> Result<()> {
    if input.is_multiple_of(dtype.block_size()) {
        return Ok(());
    }
    Err(ModelError::TensorData {
        path: path.to_path_buf(),
        tensor: tensor.to_owned(),
        reason: format!(
            "cannot quantize to {dtype:?}: its input dimension {input} is not a multiple of the \
             block size {}",
            dtype.block_size()
        ),
    })
}

/// Refuses a span whose layers run past the model's `layers`, or that holds nothing.
fn check_span_fits(spec: &SpanSpec, layers: usize) -> Result<()> {
    if spec.layers.end as usize > layers {
        return Err(ModelError::InvalidSpan(format!(
            "layers {}..{} do not fit a model of {} layers",
            spec.layers.start, spec.layers.end, layers
        )));
    }
    if spec.layers.is_empty() && !spec.embedding && !spec.head {
        return Err(ModelError::InvalidSpan(
            "a span must hold at least one layer, the embedding or the head".into(),
        ));
    }
    Ok(())
}

/// Reads single tensors from the weights file, checking names and shapes.
struct TensorReader<'a> {
    weights: &'a WeightsLayout,
    file: File,
}

impl TensorReader<'_> {
    /// Reads tensor `name`, which must have exactly `expected` dims, as f32.
    fn load(&mut self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let path = &self.weights.path;
        let entry =
            self.weights
                .index
                .entries
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: path.clone(),
                    tensor: name.to_owned(),
                })?;
        if entry.shape != expected {
            return Err(ModelError::TensorShape {
                path: path.clone(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                actual: entry.shape.clone(),
            });
        }
        let data_error = |reason: String| ModelError::TensorData {
            path: path.clone(),
            tensor: name.to_owned(),
            reason,
        };
        let length = usize::try_from(entry.bytes.end - entry.bytes.start)
            .map_err(|_| data_error("too large for this machine".to_owned()))?;
        let mut bytes = vec![0_u8; length];
        let start = self
            .weights
            .index
            .data_start
            .checked_add(entry.bytes.start)
            .ok_or_else(|| data_error("its data offset is past any file".to_owned()))?;
        self.file
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.file.read_exact(&mut bytes))
            .map_err(|error| data_error(format!("reading its bytes: {error}")))?;
        Tensor::from_raw_buffer(&bytes, entry.dtype, &entry.shape, &Device::Cpu)
            .and_then(|tensor| tensor.to_dtype(DType::F32))
            .map_err(|error| data_error(error.to_string()))
    }

    /// Reads a Conv1D weight stored `[input, output]` and makes it a projection.
    fn load_conv1d(
        &mut self,
        name: &str,
        input: usize,
        output: usize,
        quantize_to: Option<GgmlDType>,
    ) -> Result<Projection> {
        let weight = self.load(name, &[input, output])?;
        match quantize_to {
            None => Ok(Projection::InputOutput(weight)),
            Some(dtype) => {
                // QMatMul wants `[output, input]` with the input dimension in whole blocks.
                check_block(&self.weights.path, name, input, dtype)?;
                self.quantize(name, &weight.t()?, dtype)
            }
        }
    }

    /// Quantizes an `[output, input]` matrix into a matmul.
    fn quantize(&self, name: &str, weight: &Tensor, dtype: GgmlDType) -> Result<Projection> {
        weight
            .contiguous()
            .and_then(|weight| QTensor::quantize(&weight, dtype))
            .and_then(QMatMul::from_qtensor)
            .map(Projection::Quantized)
            .map_err(|error| ModelError::TensorData {
                path: self.weights.path.clone(),
                tensor: name.to_owned(),
                reason: format!("quantizing to {dtype:?}: {error}"),
            })
    }

    /// Reads a LayerNorm's weight and bias.
    fn load_layer_norm(
        &mut self,
        weight_name: &str,
        bias_name: &str,
        width: usize,
    ) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.load(weight_name, &[width])?,
            bias: self.load(bias_name, &[width])?,
        })
    }

    /// Reads a Conv1D layer (weight and bias).
    fn load_linear(
        &mut self,
        prefix: &str,
        input: usize,
        output: usize,
        quantize_to: Option<GgmlDType>,
    ) -> Result<Linear> {
        Ok(Linear {
            projection: self.load_conv1d(
                &format!("{prefix}.weight"),
                input,
                output,
                quantize_to,
            )?,
            bias: self.load(&format!("{prefix}.bias"), &[output])?,
        })
    }

    /// Reads the LayerNorms and the four Conv1D layers of block `layer`.
    fn load_block(&mut self, layer: usize, quantize_to: Option<GgmlDType>) -> Result<Block> {
        let weights = self.weights;
        let (hidden, inner) = (weights.config.hidden, weights.config.inner);
        let name = |suffix: &str| weights.block_tensor_name(layer, suffix);
        Ok(Block {
            attention_norm: self.load_layer_norm(
                &name("ln_1.weight"),
                &name("ln_1.bias"),
                hidden,
            )?,
            attention_input: self.load_linear(
                &name("attn.c_attn"),
                hidden,
                3 * hidden,
                quantize_to,
            )?,
            attention_output: self.load_linear(
                &name("attn.c_proj"),
                hidden,
                hidden,
                quantize_to,
            )?,
            mlp_norm: self.load_layer_norm(&name("ln_2.weight"), &name("ln_2.bias"), hidden)?,
            mlp_input: self.load_linear(&name("mlp.c_fc"), hidden, inner, quantize_to)?,
            mlp_output: self.load_linear(&name("mlp.c_proj"), inner, hidden, quantize_to)?,
        })
    }

    /// Reads the final LayerNorm and the LM head. A tied head reuses `token_table` (the
    /// embedding already read) when given; otherwise its matrix is read from the file.
    fn load_head(
        &mut self,
        token_table: Option<&Tensor>,
        quantize_to: Option<GgmlDType>,
    ) -> Result<Head> {
        let weights = self.weights;
        let (hidden, vocab) = (weights.config.hidden, weights.config.vocab_size);
        let norm = self.load_layer_norm(
            &weights.tensor_name("ln_f.weight"),
            &weights.tensor_name("ln_f.bias"),
            hidden,
        )?;
        // The head's matrix is `[vocab, hidden]` (= `[output, input]`) whether it is the
        // embedding table or a separate `lm_head.weight`.
        let (name, table) = match (token_table, weights.tied_embeddings) {
            (Some(table), true) => (weights.tensor_name("wte.weight"), table.clone()),
            _ => {
                let name = weights.head_tensor_name();
                let table = self.load(&name, &[vocab, hidden])?;
                (name, table)
            }
        };
        let output = match quantize_to {
            None => Projection::InputOutput(table.t()?),
            Some(dtype) => {
                check_block(&weights.path, &name, hidden, dtype)?;
                self.quantize(&name, &table, dtype)?
            }
        };
        Ok(Head { norm, output })
    }
}

/// A weight matrix and how it multiplies.
#[derive(Debug)]
enum Projection {
    /// f32 `[input, output]`: y = x @ W (may be a transposed view).
    InputOutput(Tensor),
    /// Quantized `[output, input]`.
    Quantized(QMatMul),
}

impl Projection {
    fn apply(&self, input: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::InputOutput(weight) => input.broadcast_matmul(weight)?,
            Self::Quantized(matmul) => matmul.forward(input)?,
        })
    }
}

/// A Conv1D layer: y = x @ W + b.
#[derive(Debug)]
struct Linear {
    projection: Projection,
    bias: Tensor,
}

impl Linear {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        Ok(self.projection.apply(input)?.broadcast_add(&self.bias)?)
    }
}

/// A LayerNorm's scale and shift.
#[derive(Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl LayerNorm {
    fn forward(&self, input: &Tensor, epsilon: f32) -> Result<Tensor> {
        Ok(candle_nn::ops::layer_norm(
            input,
            &self.weight,
            &self.bias,
            epsilon,
        )?)
    }
}

/// One transformer block's weights.
#[derive(Debug)]
struct Block {
    attention_norm: LayerNorm,
    /// Queries, keys and values concatenated along the output.
    attention_input: Linear,
    attention_output: Linear,
    mlp_norm: LayerNorm,
    mlp_input: Linear,
    mlp_output: Linear,
}

/// The final LayerNorm and the LM head.
#[derive(Debug)]
struct Head {
    norm: LayerNorm,
    output: Projection,
}

/// A contiguous span of a GPT-2 model, loaded from a Hugging Face directory.
///
/// Load it with a [`SpanSpec`]. A span whose layers start at block 0 also holds the position
/// embeddings and adds them before its first block (see the module documentation).
#[derive(Debug)]
pub struct Gpt2Span {
    hidden: usize,
    heads: usize,
    head_dim: usize,
    positions: usize,
    vocab_size: usize,
    layer_norm_epsilon: f32,
    attention_scale: f64,
    layer_range: LayerSpan,
    token_embedding: Option<Tensor>,
    position_embedding: Option<Tensor>,
    blocks: Vec<Block>,
    head: Option<Head>,
    cache: KvStore,
    quantization: Option<Quantization>,
}

impl Gpt2Span {
    /// Loads the parts of `model` that `spec` names, and nothing else. With
    /// `Some(Quantization::Q8_0)` the linear weights of the blocks and the LM head are quantized to
    /// Q8_0 on load (their input dimensions must be multiples of 32); biases, norms and
    /// embeddings stay f32.
    pub fn load(model: &Gpt2Model, spec: &SpanSpec) -> Result<Self> {
        let config = model.config();
        check_span_fits(spec, config.layers)?;
        let quantize_to = model
            .description()
            .requantises(spec.quantization)?
            .then_some(GgmlDType::Q8_0);
        let (hidden, vocab) = (config.hidden, config.vocab_size);
        let weights = &model.weights;
        let mut reader = model.tensor_reader()?;

        let needs_token_table = spec.embedding || (spec.head && weights.tied_embeddings);
        let token_table = if needs_token_table {
            Some(reader.load(&weights.tensor_name("wte.weight"), &[vocab, hidden])?)
        } else {
            None
        };
        let holds_block_zero = spec.layers.start == 0 && !spec.layers.is_empty();
        let position_embedding = if holds_block_zero {
            Some(reader.load(
                &weights.tensor_name("wpe.weight"),
                &[config.positions, hidden],
            )?)
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(spec.layers.len() as usize);
        for layer in spec.layers.as_range() {
            blocks.push(reader.load_block(layer, quantize_to)?);
        }
        let head = if spec.head {
            Some(reader.load_head(token_table.as_ref(), quantize_to)?)
        } else {
            None
        };
        // A head-only span of a tied model borrowed the table for its output.
        let token_embedding = if spec.embedding { token_table } else { None };

        let span_layers = spec.layers.len() as usize;
        let bytes_per_position = span_layers * 2 * hidden * CACHED_VALUE_BYTES;
        let attention_scale = if config.scale_attention {
            1.0 / (config.head_dim() as f64).sqrt()
        } else {
            1.0
        };
        Ok(Self {
            hidden,
            heads: config.heads,
            head_dim: config.head_dim(),
            positions: config.positions,
            vocab_size: vocab,
            layer_norm_epsilon: config.layer_norm_epsilon as f32,
            attention_scale,
            layer_range: spec.layers,
            token_embedding,
            position_embedding,
            blocks,
            head,
            cache: KvStore::new(span_layers, bytes_per_position, spec.kv_budget_bytes),
            quantization: spec.quantization,
        })
    }

    /// The blocks this span runs.
    pub fn layers(&self) -> LayerSpan {
        self.layer_range
    }

    /// Whether the span holds the token embedding.
    pub fn has_embedding(&self) -> bool {
        self.token_embedding.is_some()
    }

    /// Whether the span holds the final LayerNorm and LM head.
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// How the span's linear weights are stored.
    pub fn quantization(&self) -> Option<Quantization> {
        self.quantization
    }

    /// The span's KV caches.
    pub fn kv_store(&self) -> &KvStore {
        &self.cache
    }

    /// Runs the span's blocks on `hidden` (`[1, tokens, hidden]`, any float dtype) for the
    /// chunk starting at absolute `position`, appending to the session's KV cache. A span
    /// holding block 0 first adds the position embeddings. Returns f32 hidden states of the
    /// same shape.
    pub fn forward_layers(
        &self,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
    ) -> Result<Tensor> {
        self.forward_range(session, position, hidden, self.layer_range)
    }

    /// Like [`Self::forward_layers`], but runs only `layers` (absolute indices, within the
    /// span's own range). A session must use the same range on every chunk: the blocks it
    /// skips keep no cache for it.
    pub fn forward_range(
        &self,
        session: SessionId,
        position: usize,
        hidden: &Tensor,
        layers: LayerSpan,
    ) -> Result<Tensor> {
        check_sub_span(self.layer_range, layers)?;
        let tokens = hidden_tokens(hidden, self.hidden)?;
        if position + tokens > self.positions {
            return Err(ModelError::InvalidSpan(format!(
                "positions {position}..{} exceed the model's {} learned positions",
                position + tokens,
                self.positions
            )));
        }
        let mut hidden = hidden.to_dtype(DType::F32)?.contiguous()?;
        if layers.is_empty() {
            return Ok(hidden);
        }
        if let Some(table) = &self.position_embedding
            && layers.start == 0
        {
            let rows = table.narrow(0, position, tokens)?.unsqueeze(0)?;
            hidden = (hidden + rows)?;
        }
        let first = (layers.start - self.layer_range.start) as usize;
        let selected = &self.blocks[first..first + layers.len() as usize];
        let mask = causal_mask(position, tokens)?;
        self.cache
            .with_session(session, position, tokens, |cache| {
                for (offset, block) in selected.iter().enumerate() {
                    let index = first + offset;
                    hidden = self.block_forward(block, index, cache, &hidden, mask.as_ref())?;
                }
                Ok(())
            })?;
        Ok(hidden)
    }

    fn block_forward(
        &self,
        block: &Block,
        index: usize,
        cache: &mut SessionCache,
        input: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (_, tokens, _) = input.dims3()?;
        let hidden = self.hidden;
        let normed = block
            .attention_norm
            .forward(input, self.layer_norm_epsilon)?;
        let packed = block.attention_input.forward(&normed)?;
        let heads_first = |part: usize| -> Result<Tensor> {
            Ok(packed
                .narrow(2, part * hidden, hidden)?
                .reshape((1, tokens, self.heads, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let query = heads_first(0)?;
        let key = heads_first(1)?;
        let value = heads_first(2)?;
        let (keys, values) = cache.append(index, key, value)?;
        let scores = (query.matmul(&keys.t()?)? * self.attention_scale)?;
        let scores = match mask {
            Some(mask) => scores.broadcast_add(mask)?,
            None => scores,
        };
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let attended = weights
            .matmul(&values)?
            .transpose(1, 2)?
            .reshape((1, tokens, hidden))?;
        let residual = (input + block.attention_output.forward(&attended)?)?;

        let normed = block.mlp_norm.forward(&residual, self.layer_norm_epsilon)?;
        let activated = block.mlp_input.forward(&normed)?.gelu()?;
        let output = block.mlp_output.forward(&activated)?;
        Ok((residual + output)?)
    }

    /// Applies the final LayerNorm to every position of `hidden` (`[1, tokens, hidden]`).
    pub fn final_norm(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self
            .head
            .as_ref()
            .ok_or(ModelError::PartNotLoaded("LM head"))?;
        self.check_hidden(hidden)?;
        head.norm
            .forward(&hidden.to_dtype(DType::F32)?, self.layer_norm_epsilon)
    }

    /// The logits of every position of `hidden` (`[1, tokens, hidden]`), as `[tokens, vocab]`.
    pub fn all_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self
            .head
            .as_ref()
            .ok_or(ModelError::PartNotLoaded("LM head"))?;
        let normed = self.final_norm(hidden)?;
        let logits = head.output.apply(&normed)?;
        Ok(logits.squeeze(0)?)
    }

    fn check_hidden(&self, hidden: &Tensor) -> Result<usize> {
        hidden_tokens(hidden, self.hidden)
    }
}

impl TokenEmbedder for Gpt2Span {
    /// The token embeddings `wte[tokens]` only; the span holding block 0 adds the position
    /// embeddings, since the chunk's position is not known here.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let table = self
            .token_embedding
            .as_ref()
            .ok_or(ModelError::PartNotLoaded("token embedding"))?;
        check_token_ids(tokens, self.vocab_size)?;
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        Ok(table
            .index_select(&ids, 0)?
            .reshape((1, tokens.len(), self.hidden))?)
    }
}

impl LogitsHead for Gpt2Span {
    fn logits(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let tokens = self.check_hidden(hidden)?;
        let last = hidden.i((.., tokens - 1..tokens, ..))?.contiguous()?;
        Ok(self.all_logits(&last)?.flatten_all()?.to_vec1::<f32>()?)
    }
}

impl Stage for Gpt2Span {
    fn forward(&self, session: SessionId, position: usize, hidden: Tensor) -> Result<Tensor> {
        self.forward_layers(session, position, &hidden)
    }

    fn end_session(&self, session: SessionId) {
        self.cache.end_session(session);
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn rewind(&self, session: SessionId, len: usize) -> Result<()> {
        self.cache.rewind(session, len)
    }

    fn name(&self) -> String {
        format!("GPT-2 layers {}", self.layer_range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_header_entries_are_errors_not_overflows() {
        let entry = |json: &str| parse_entry(&serde_json::from_str(json).unwrap());
        let huge =
            r#"{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}"#;
        assert!(entry(huge).unwrap_err().contains("too large"));
        let short = r#"{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}"#;
        assert!(entry(short).unwrap_err().contains("do not hold 24 bytes"));
        let reversed = r#"{"dtype":"F32","shape":[1],"data_offsets":[8,4]}"#;
        assert!(entry(reversed).is_err());
        let fine = r#"{"dtype":"BF16","shape":[2,3],"data_offsets":[10,22]}"#;
        assert_eq!(entry(fine).unwrap().bytes, 10..22);
    }

    #[test]
    fn garbage_files_are_named_errors() {
        let dir = std::env::temp_dir().join(format!("meshnet-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.safetensors");
        let cases: [(&[u8], &str); 3] = [
            (&u64::MAX.to_le_bytes(), "implausible"),
            (b"\x05\0\0\0\0\0\0\0[1,2]", "not a JSON object"),
            (b"\x02\0", "model.safetensors"),
        ];
        for (bytes, needle) in cases {
            std::fs::write(&path, bytes).unwrap();
            let err = SafetensorsIndex::read(&path).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
