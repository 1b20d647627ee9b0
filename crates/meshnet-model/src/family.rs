//! Model families: what tells a Llama span from a Qwen 2, Qwen 3, Gemma 3 or Phi-3 one, read
//! once from a GGUF file's metadata. The differences are data (a rotation style, an
//! activation, which optional tensors a block has, which layers attend within a window), so
//! one span type runs every family; llama.cpp reads the same keys the same way.

use std::path::Path;

use candle_core::quantized::gguf_file::Content;
use serde::Serialize;

use crate::error::{ModelError, Result};
use crate::metadata::{get_f32, get_optional_usize, get_string, metadata_error};

/// A family of models (GGUF's `general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Llama 2 and 3, Mistral, SmolLM.
    Llama,
    /// Qwen 2 and 2.5: biases on the query, key and value projections.
    Qwen2,
    /// Qwen 3: an RMS norm over each query and key head.
    Qwen3,
    /// Gemma 3: scaled embedding, norms before and after attention and feed-forward, GeGLU,
    /// query/key norms, and layers that attend within a sliding window.
    Gemma3,
    /// Phi-3 and 3.5: fused query/key/value and gate/up matrices.
    Phi3,
}

impl Family {
    /// Every family this crate runs.
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Gemma3,
        Family::Phi3,
    ];

    /// The family of a `general.architecture` value, when this crate runs it.
    pub fn from_architecture(architecture: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|family| family.architecture() == architecture)
    }

    /// The `general.architecture` value of the family.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
        }
    }

    /// The supported architectures, comma-separated (for error messages).
    pub fn supported_list() -> String {
        Self::ALL.map(Family::architecture).join(", ")
    }
}

/// How rotary embeddings pair a head's dimensions (llama.cpp's rope types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])` (llama.cpp's "norm" rope; Llama files store Q and K
    /// permuted for it).
    Interleaved,
    /// Pairs half a head apart, `(x[i], x[i + d/2])` (llama.cpp's "neox" rope).
    Halves,
}

/// The feed-forward gate's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU: `gelu(gate) · up`.
    GeluTanh,
}

/// One set of rotary frequencies (a family may use two: Gemma 3's local layers have their
/// own base).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RopeFrequencies {
    /// The frequency base θ.
    pub base: f32,
    /// Linear position scaling (`1 / rope.scaling.factor`; 1 when unscaled).
    pub position_scale: f32,
    /// The tensor of per-frequency divisors the file ships (Llama 3's `rope_freqs.weight`,
    /// Phi-3.5's `rope_factors_short.weight`), when these frequencies use one.
    pub factors_tensor: Option<String>,
}

impl RopeFrequencies {
    /// `1 / base^(2i/d) · position_scale / factor_i` for each rotated pair of a head of
    /// `head_dim` values; `factors` has one divisor per pair (or is empty).
    pub fn inverse_frequencies(&self, head_dim: usize, factors: &[f32]) -> Vec<f32> {
        (0..head_dim / 2)
            .map(|pair| {
                let exponent = (2 * pair) as f32 / head_dim as f32;
                let divisor = factors.get(pair).copied().unwrap_or(1.0);
                self.position_scale / self.base.powf(exponent) / divisor
            })
            .collect()
    }
}

/// Everything about a family that the span's load and forward code reads.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ArchitectureConfig {
    /// The family.
    pub family: Family,
    /// How heads are rotated.
    pub rope_style: RopeStyle,
    /// The feed-forward activation.
    pub activation: Activation,
    /// What the token embedding is multiplied by (Gemma: √hidden).
    pub embedding_scale: Option<f32>,
    /// What attention scores are multiplied by (usually `1/√head_dim`).
    pub attention_scale: f32,
    /// Whether the query, key and value projections carry biases.
    pub qkv_bias: bool,
    /// Whether each query and key head is RMS-normed before rotation.
    pub qk_norm: bool,
    /// Whether the attention and feed-forward outputs are RMS-normed before the residual add.
    pub post_norms: bool,
    /// Frequencies of the layers that attend to everything before them.
    pub global_rope: RopeFrequencies,
    /// Frequencies and window of the layers that attend within a sliding window, when the
    /// model has such layers.
    pub sliding: Option<SlidingWindow>,
    /// The multiplier of rotated values' cos and sin (Phi-3.5's long-context attention
    /// factor; 1 otherwise).
    pub rope_attention_factor: f32,
    /// `cap · tanh(logit / cap)` on the final logits, when the model caps them.
    pub final_logit_softcap: Option<f32>,
}

/// Layers that attend only to the last `window` positions (their own included).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlidingWindow {
    /// How many positions a query sees, its own included.
    pub window: usize,
    /// Every `period`-th layer (the last of each group) attends globally; the rest slide.
    pub period: usize,
    /// The sliding layers' frequencies.
    pub rope: RopeFrequencies,
}

impl ArchitectureConfig {
    /// Whether layer `index` attends within the sliding window.
    pub fn is_sliding(&self, index: usize) -> bool {
        self.sliding
            .as_ref()
            .is_some_and(|sliding| index % sliding.period < sliding.period - 1)
    }

    /// The window of layer `index`, when it has one.
    pub fn window(&self, index: usize) -> Option<usize> {
        self.sliding
            .as_ref()
            .filter(|_| self.is_sliding(index))
            .map(|sliding| sliding.window)
    }

    /// The rotary frequencies of layer `index`.
    pub fn rope(&self, index: usize) -> &RopeFrequencies {
        match &self.sliding {
            Some(sliding) if self.is_sliding(index) => &sliding.rope,
            _ => &self.global_rope,
        }
    }
}

/// Gemma 3's sliding layers: five local layers, then one global (llama.cpp's pattern 6).
const GEMMA3_SLIDING_PERIOD: usize = 6;
/// Gemma 3's local layers' frequency base when the file does not name one.
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
/// The Gemma 3 size (27B, 62 layers) that scales queries by `1/√(hidden/heads)` instead of
/// `1/√head_dim`.
const GEMMA3_27B_LAYERS: usize = 62;

/// The shape facts reading a configuration needs.
pub(crate) struct ShapeFacts {
    pub(crate) layers: usize,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    /// The longest session the model will serve (its trained context unless limited).
    pub(crate) context: usize,
}

/// Reads a family's configuration from the file's metadata under the `<architecture>.` keys.
pub(crate) fn read_config(
    path: &Path,
    content: &Content,
    family: Family,
    shape: &ShapeFacts,
) -> Result<ArchitectureConfig> {
    let key = |suffix: &str| format!("{}.{suffix}", family.architecture());
    let global_rope = read_rope(path, content, &key, shape.context)?;
    let halves = !matches!(family, Family::Llama);
    let gemma = family == Family::Gemma3;
    let attention_scale = if gemma && shape.layers == GEMMA3_27B_LAYERS {
        1.0 / ((shape.hidden / shape.heads) as f32).sqrt()
    } else {
        1.0 / (shape.head_dim as f32).sqrt()
    };
    Ok(ArchitectureConfig {
        family,
        rope_style: if halves {
            RopeStyle::Halves
        } else {
            RopeStyle::Interleaved
        },
        activation: if gemma {
            Activation::GeluTanh
        } else {
            Activation::Silu
        },
        embedding_scale: gemma.then(|| (shape.hidden as f32).sqrt()),
        attention_scale,
        qkv_bias: family == Family::Qwen2,
        qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
        post_norms: gemma,
        sliding: if gemma {
            read_sliding(path, content, &key)?
        } else {
            None
        },
        global_rope,
        rope_attention_factor: optional_f32(path, content, &key("rope.scaling.attn_factor"))?
            .unwrap_or(1.0),
        final_logit_softcap: optional_f32(path, content, &key("final_logit_softcapping"))?
            .filter(|cap| *cap > 0.0),
    })
}

/// A float key, when present.
fn optional_f32(path: &Path, content: &Content, key: &str) -> Result<Option<f32>> {
    if content.metadata.contains_key(key) {
        get_f32(path, content, key).map(Some)
    } else {
        Ok(None)
    }
}

/// The global rotary frequencies: base, linear scaling, and the factors tensor.
fn read_rope(
    path: &Path,
    content: &Content,
    key: &dyn Fn(&str) -> String,
    context: usize,
) -> Result<RopeFrequencies> {
    let base = optional_f32(path, content, &key("rope.freq_base"))?.unwrap_or(10_000.0);
    let scaling_key = key("rope.scaling.type");
    let scaling = if content.metadata.contains_key(&scaling_key) {
        get_string(path, content, &scaling_key)?
    } else {
        "none".to_owned()
    };
    let factor = optional_f32(path, content, &key("rope.scaling.factor"))?;
    let position_scale = match (scaling.as_str(), factor) {
        ("linear", Some(factor)) if factor > 0.0 => 1.0 / factor,
        ("linear", _) => {
            return Err(metadata_error(
                path,
                &key("rope.scaling.factor"),
                "linear rope scaling needs a positive factor",
            ));
        }
        // Llama 3's scaling lives in the rope_freqs tensor; Phi-3.5's in its factor tensors.
        ("none" | "llama3" | "longrope", _) => 1.0,
        (other, _) => {
            return Err(metadata_error(
                path,
                &scaling_key,
                format!("rope scaling {other:?} is not supported (supported: none, linear)"),
            ));
        }
    };
    let factors_tensor = factors_tensor(path, content, key, context)?;
    Ok(RopeFrequencies {
        base,
        position_scale,
        factors_tensor,
    })
}

/// The tensor of per-frequency divisors: Llama 3's `rope_freqs`, or LongRoPE's short factors
/// for contexts up to `rope.scaling.original_context_length` and its long ones beyond (as
/// llama.cpp chooses by the context it serves).
fn factors_tensor(
    path: &Path,
    content: &Content,
    key: &dyn Fn(&str) -> String,
    context: usize,
) -> Result<Option<String>> {
    let present = |name: &str| content.tensor_infos.contains_key(name);
    if present("rope_freqs.weight") {
        return Ok(Some("rope_freqs.weight".to_owned()));
    }
    if !present("rope_factors_short.weight") && !present("rope_factors_long.weight") {
        return Ok(None);
    }
    let original = get_optional_usize(path, content, &key("rope.scaling.original_context_length"))?;
    let long = original.is_some_and(|original| context > original);
    let name = if long {
        "rope_factors_long.weight"
    } else {
        "rope_factors_short.weight"
    };
    if !present(name) {
        return Err(ModelError::MissingTensor {
            path: path.to_path_buf(),
            tensor: name.to_owned(),
        });
    }
    Ok(Some(name.to_owned()))
}

/// Gemma 3's sliding window: its size from the file, local layers with their own base.
fn read_sliding(
    path: &Path,
    content: &Content,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<SlidingWindow>> {
    let window = get_optional_usize(path, content, &key("attention.sliding_window"))?;
    let Some(window) = window.filter(|window| *window > 0) else {
        return Ok(None);
    };
    let base =
        optional_f32(path, content, &key("rope.freq_base_swa"))?.unwrap_or(GEMMA3_LOCAL_ROPE_BASE);
    Ok(Some(SlidingWindow {
        window,
        period: GEMMA3_SLIDING_PERIOD,
        rope: RopeFrequencies {
            base,
            position_scale: 1.0,
            factors_tensor: None,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_round_trips_its_architecture_name() {
        for family in Family::ALL {
            assert_eq!(
                Family::from_architecture(family.architecture()),
                Some(family)
            );
        }
        assert_eq!(Family::from_architecture("gpt2"), None);
        assert_eq!(
            Family::supported_list(),
            "llama, qwen2, qwen3, gemma3, phi3"
        );
    }

    #[test]
    fn inverse_frequencies_apply_base_scale_and_factors() {
        let rope = RopeFrequencies {
            base: 100.0,
            position_scale: 0.5,
            factors_tensor: None,
        };
        assert_eq!(rope.inverse_frequencies(4, &[]), vec![0.5, 0.05]);
        assert_eq!(rope.inverse_frequencies(4, &[1.0, 4.0]), vec![0.5, 0.0125]);
    }

    #[test]
    fn gemma_slides_five_layers_of_six() {
        let rope = RopeFrequencies {
            base: 1e6,
            position_scale: 1.0,
            factors_tensor: None,
        };
        let local = RopeFrequencies {
            base: 1e4,
            ..rope.clone()
        };
        let config = ArchitectureConfig {
            family: Family::Gemma3,
            rope_style: RopeStyle::Halves,
            activation: Activation::GeluTanh,
            embedding_scale: Some(2.0),
            attention_scale: 1.0,
            qkv_bias: false,
            qk_norm: true,
            post_norms: true,
            global_rope: rope,
            sliding: Some(SlidingWindow {
                window: 8,
                period: 6,
                rope: local,
            }),
            rope_attention_factor: 1.0,
            final_logit_softcap: None,
        };
        let sliding: Vec<bool> = (0..13).map(|layer| config.is_sliding(layer)).collect();
        let expected = [
            true, true, true, true, true, false, true, true, true, true, true, false, true,
        ];
        assert_eq!(sliding, expected);
        assert_eq!(config.window(5), None);
        assert_eq!(config.window(6), Some(8));
        assert_eq!(config.rope(5).base, 1e6);
        assert_eq!(config.rope(4).base, 1e4);
    }
}
