//! The model a mesh runs: its identity (name plus content hash), its memory shape for the
//! planner, and the mapping between the planner's weight formats and the loader's.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use meshnet_model::{GgufModel, ModelDescription, Quantization as LoadFormat};
use meshnet_planner::{ModelShape, Quantization};
use sha2::{Digest, Sha256};

use crate::error::PeerError;

/// Hex digits of the content hash kept in the model id.
const HASH_DIGITS: usize = 16;

/// A GGUF model opened for serving in a mesh.
#[derive(Debug)]
pub struct MeshModel {
    gguf: Arc<GgufModel>,
    id: String,
    shape: ModelShape,
    shipped: Quantization,
}

impl MeshModel {
    /// Opens the GGUF file at `path`, hashes its content and sizes it. Blocking: it reads the
    /// whole file once.
    pub fn open(path: &Path) -> Result<Self, PeerError> {
        let gguf = GgufModel::open(path)?;
        let shipped = shipped_format(&gguf)?;
        let id = model_id(path)?;
        let shape = model_shape(&id, gguf.description(), shipped);
        Ok(MeshModel {
            gguf: Arc::new(gguf),
            id,
            shape,
            shipped,
        })
    }

    /// The model id every member of the mesh must share: the file name's stem and the first
    /// 16 hex digits of the file's SHA-256, e.g. `smollm2-135m-instruct.q4_1-3f1c…`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The opened file.
    pub fn gguf(&self) -> &Arc<GgufModel> {
        &self.gguf
    }

    /// What the file says about the model.
    pub fn description(&self) -> &ModelDescription {
        self.gguf.description()
    }

    /// The file's path.
    pub fn path(&self) -> PathBuf {
        self.gguf.path().to_path_buf()
    }

    /// The memory shape the planner works with.
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// The format the file's layers are stored in.
    pub fn shipped_format(&self) -> Quantization {
        self.shipped
    }

    /// Number of transformer layers.
    pub fn num_layers(&self) -> u32 {
        self.shape.num_layers
    }

    /// How the loader must treat the weights to serve them in `format`.
    pub fn load_format(&self, format: Quantization) -> Result<LoadFormat, PeerError> {
        if format == self.shipped {
            Ok(LoadFormat::AsShipped)
        } else if format == Quantization::Q8_0 {
            Ok(LoadFormat::Q8_0)
        } else {
            Err(PeerError::Config(format!(
                "this model can be served as {} (as shipped) or q8_0, not {format}",
                self.shipped
            )))
        }
    }

    /// Formats this model can be served in.
    pub fn formats(&self) -> Vec<Quantization> {
        let mut formats = vec![self.shipped];
        if self.shipped != Quantization::Q8_0 {
            formats.push(Quantization::Q8_0);
        }
        formats
    }

    /// KV-cache bytes one token takes in one layer (keys and values, f32).
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        self.shape.kv_bytes_per_token_per_layer
    }
}

/// The planner's name for the format of the file's layer weights (read from the first
/// layer's query matrix).
fn shipped_format(gguf: &GgufModel) -> Result<Quantization, PeerError> {
    let name = "blk.0.attn_q.weight";
    let dtype = gguf
        .content()
        .tensor_infos
        .get(name)
        .map(|info| info.ggml_dtype)
        .ok_or_else(|| {
            PeerError::Config(format!("{}: missing tensor {name}", gguf.path().display()))
        })?;
    match dtype {
        GgmlDType::Q4_1 => Ok(Quantization::Q4_1),
        GgmlDType::Q8_0 => Ok(Quantization::Q8_0),
        GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::F32 => Ok(Quantization::Bf16),
        other => Err(PeerError::Config(format!(
            "{}: layers stored as {other:?}; a mesh serves GGUF files whose layers are q4_1, \
             q8_0 or 16/32-bit floats",
            gguf.path().display()
        ))),
    }
}

/// `<lowercase file stem>-<first 16 hex digits of the file's SHA-256>`.
fn model_id(path: &Path) -> Result<String, PeerError> {
    let io_error = |source| PeerError::Io {
        what: format!("reading {}", path.display()),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = file.read(&mut buffer).map_err(io_error)?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    let digest = hasher.finalize();
    let hex: String = digest
        .iter()
        .take(HASH_DIGITS / 2)
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_else(|| "model".to_owned());
    let stem: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    Ok(format!("{stem}-{hex}"))
}

/// The planner's view of the model: the largest layer in each servable format, embedding and
/// head as shipped, and f32 keys and values per token per layer.
fn model_shape(id: &str, description: &ModelDescription, shipped: Quantization) -> ModelShape {
    let largest = |bytes: &[u64]| bytes.iter().copied().max().unwrap_or(0).max(1);
    let mut layer_bytes = std::collections::BTreeMap::new();
    layer_bytes.insert(shipped, largest(&description.bytes_as_shipped.layers));
    if shipped != Quantization::Q8_0 {
        layer_bytes.insert(Quantization::Q8_0, largest(&description.bytes_q8_0.layers));
    }
    let kv_width = (description.kv_heads * description.head_dim) as u64;
    ModelShape {
        name: id.to_owned(),
        num_layers: description.layers as u32,
        layer_bytes,
        embedding_bytes: description.bytes_as_shipped.embedding,
        head_bytes: description.bytes_as_shipped.head,
        kv_bytes_per_token_per_layer: 2 * kv_width * 4,
    }
}
