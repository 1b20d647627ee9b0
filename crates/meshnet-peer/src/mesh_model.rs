//! The model a mesh runs: its identity (name plus content hash), its memory shape for the
//! planner, and the weight formats its spans can be held in. Either family: a Llama GGUF file
//! or a Hugging Face GPT-2 directory.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use meshnet_model::{CACHED_VALUE_BYTES, Model, ModelDescription};
use meshnet_planner::{ModelShape, PeerCapacity};
use meshnet_types::Quantization;
use sha2::{Digest, Sha256};

use crate::error::PeerError;

/// Hex digits of the content hash kept in the model id.
const HASH_DIGITS: usize = 16;

/// A model opened for serving in a mesh.
#[derive(Debug)]
pub struct MeshModel {
    model: Arc<Model>,
    id: String,
    shape: ModelShape,
    shipped: Quantization,
}

impl MeshModel {
    /// Opens the GGUF file or GPT-2 directory at `path`, hashes its content and sizes it.
    /// Blocking: it reads the model's files once.
    pub fn open(path: &Path) -> Result<Self, PeerError> {
        let model = Model::open(path)?;
        let shipped = model.description().shipped_quantization.ok_or_else(|| {
            PeerError::Config(format!(
                "{}: a mesh serves models whose layers share one GGUF type or whose \
                 general.file_type names a llama-quantize preset (Q2_K … Q8_0, F16, BF16, F32)",
                path.display()
            ))
        })?;
        let id = model_id(path, &model.content_files())?;
        let shape = model_shape(&id, model.description(), shipped);
        Ok(MeshModel {
            model: Arc::new(model),
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

    /// The opened model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// What the model's metadata says about it.
    pub fn description(&self) -> &ModelDescription {
        self.model.description()
    }

    /// The model's file or directory.
    pub fn path(&self) -> PathBuf {
        self.model.path().to_path_buf()
    }

    /// The memory shape the planner works with.
    pub fn shape(&self) -> &ModelShape {
        &self.shape
    }

    /// The format the model's layers are stored in.
    pub fn shipped_format(&self) -> Quantization {
        self.shipped
    }

    /// Number of transformer layers.
    pub fn num_layers(&self) -> u32 {
        self.shape.num_layers
    }

    /// Refuses a format this model cannot be served in, naming the ones it can.
    pub fn check_format(&self, format: Quantization) -> Result<(), PeerError> {
        if self.formats().contains(&format) {
            Ok(())
        } else {
            Err(PeerError::Config(format!(
                "this model can be served as {} (as shipped) or q8_0, not {format}",
                self.shipped
            )))
        }
    }

    /// Formats this model can be served in.
    pub fn formats(&self) -> Vec<Quantization> {
        self.description().quantizations()
    }

    /// Refuses a memory budget that cannot hold a single layer (plus, on the tracker, the
    /// embedding and head), naming the sizes involved.
    pub fn check_memory(&self, capacity: &PeerCapacity) -> Result<(), PeerError> {
        let shape = self.shape();
        let formats: &[Quantization] = &capacity.quantizations;
        if formats
            .iter()
            .any(|q| capacity.max_layers(shape, *q).unwrap_or(0) > 0)
        {
            return Ok(());
        }
        let cheapest = formats
            .iter()
            .filter_map(|q| shape.layer_cost(*q, capacity.kv_tokens))
            .min()
            .unwrap_or(0);
        let extra = if capacity.is_tracker {
            format!(
                " plus {} bytes for the embedding and head the tracker holds",
                shape.tracker_extra_bytes()
            )
        } else {
            String::new()
        };
        Err(PeerError::Config(format!(
            "--memory {} bytes holds no layer of {}: one layer with its KV reserve ({} tokens) takes \
             {cheapest} bytes{extra}",
            capacity.memory_bytes,
            self.id(),
            capacity.kv_tokens
        )))
    }

    /// KV-cache bytes one token takes in one layer (keys and values, half floats).
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        self.shape.kv_bytes_per_token_per_layer
    }
}

/// The lowercase hex SHA-256 of `files`' contents, read one after another.
pub fn files_sha256(files: &[PathBuf]) -> Result<String, PeerError> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    for file_path in files {
        let io_error = |source| PeerError::Io {
            what: format!("reading {}", file_path.display()),
            source,
        };
        let mut file = std::fs::File::open(file_path).map_err(io_error)?;
        loop {
            let read = file.read(&mut buffer).map_err(io_error)?;
            if read == 0 {
                break;
            }
            hasher.update(&buffer[..read]);
        }
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect())
}

/// `<lowercase file stem>-<first 16 hex digits of the SHA-256 of the model's files>`.
fn model_id(path: &Path, files: &[PathBuf]) -> Result<String, PeerError> {
    let mut hex = files_sha256(files)?;
    hex.truncate(HASH_DIGITS);
    let stem = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    let stem = stem
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
/// head as shipped, and half-float keys and values per token per layer.
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
        kv_bytes_per_token_per_layer: 2 * kv_width * CACHED_VALUE_BYTES as u64,
    }
}
