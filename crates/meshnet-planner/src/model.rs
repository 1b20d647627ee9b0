//! The model's memory shape: bytes per layer for each quantization, the
//! embedding and LM head, and the KV cache cost per token per layer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use meshnet_types::Quantization;

use crate::error::PlanError;

/// The dimensions of a decoder-only transformer, enough to size its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerDimensions {
    /// Number of transformer layers (blocks).
    pub num_layers: u32,
    /// Hidden (model) width.
    pub hidden: u64,
    /// MLP intermediate width (gate, up and down projections).
    pub intermediate: u64,
    /// Number of attention (query) heads.
    pub attention_heads: u64,
    /// Number of key/value heads (grouped-query attention).
    pub kv_heads: u64,
    /// Width of one attention head.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Whether the LM head shares the embedding matrix.
    pub tied_embeddings: bool,
}

impl TransformerDimensions {
    /// Parameters of one layer: attention, gated MLP and two RMS norms.
    ///
    /// Saturates at `u64::MAX` for dimensions too large to count (no peer can
    /// then hold a layer), instead of overflowing.
    pub fn params_per_layer(&self) -> u64 {
        let q_out = self.attention_heads.saturating_mul(self.head_dim);
        let kv_out = self.kv_heads.saturating_mul(self.head_dim);
        let attention = self
            .hidden
            .saturating_mul(q_out)
            .saturating_add(self.hidden.saturating_mul(kv_out).saturating_mul(2))
            .saturating_add(q_out.saturating_mul(self.hidden));
        let mlp = self
            .hidden
            .saturating_mul(self.intermediate)
            .saturating_mul(3);
        attention
            .saturating_add(mlp)
            .saturating_add(self.hidden.saturating_mul(2))
    }

    /// Output rows of the layer's matrices (one quantization scale each for int8).
    fn output_rows_per_layer(&self) -> u64 {
        let q_out = self.attention_heads.saturating_mul(self.head_dim);
        let kv_out = self.kv_heads.saturating_mul(self.head_dim);
        q_out
            .saturating_add(kv_out.saturating_mul(2))
            .saturating_add(self.hidden)
            .saturating_add(self.intermediate.saturating_mul(2))
            .saturating_add(self.hidden)
    }

    /// Bytes of one layer stored in `quantization`; norms always stay in bf16.
    ///
    /// Saturates at `u64::MAX` like [`Self::params_per_layer`].
    pub fn layer_bytes(&self, quantization: Quantization) -> u64 {
        let norms = self.hidden.saturating_mul(2);
        let matrices = self.params_per_layer().saturating_sub(norms);
        let norm_bytes = norms.saturating_mul(2);
        let matrix_bytes = match quantization {
            Quantization::Bf16 => matrices.saturating_mul(2),
            Quantization::Int8 => {
                matrices.saturating_add(self.output_rows_per_layer().saturating_mul(2))
            }
            Quantization::Nf4 => (matrices / 2).saturating_add(matrices.div_ceil(64) * 2),
            // Block formats: their (average) bytes per 256 weights.
            block => matrices
                .div_ceil(256)
                .saturating_mul(block.bytes_per_256().unwrap_or(512)),
        };
        matrix_bytes.saturating_add(norm_bytes)
    }

    /// Bytes of K and V for one token in one layer, two bytes a value (the peers keep their
    /// caches in half floats).
    ///
    /// Saturates at `u64::MAX` like [`Self::params_per_layer`].
    pub fn kv_bytes_per_token_per_layer(&self) -> u64 {
        self.kv_heads
            .saturating_mul(self.head_dim)
            .saturating_mul(4)
    }
}

/// Largest number of layers a model may have. Real models have at most a few
/// hundred; the cap bounds the planner's per-layer arrays.
pub const MAX_LAYERS: u32 = 65_536;

/// Everything the planner needs to know about the model's memory footprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Human-readable model name.
    pub name: String,
    /// Number of transformer layers; layer indices are `0..num_layers`.
    pub num_layers: u32,
    /// Bytes of one layer for every quantization the model is published in.
    pub layer_bytes: BTreeMap<Quantization, u64>,
    /// Bytes of the token embedding (held by the tracker).
    pub embedding_bytes: u64,
    /// Bytes of the LM head (held by the tracker; zero when tied to the embedding).
    pub head_bytes: u64,
    /// KV cache bytes needed per reserved token per layer.
    pub kv_bytes_per_token_per_layer: u64,
}

impl ModelShape {
    /// Builds a shape from transformer dimensions, with all five quantizations
    /// and the embedding and head kept in bf16.
    pub fn from_dimensions(name: impl Into<String>, dims: &TransformerDimensions) -> Self {
        let layer_bytes = Quantization::ALL
            .iter()
            .map(|&quantization| (quantization, dims.layer_bytes(quantization)))
            .collect();
        let embedding_bytes = dims.vocab.saturating_mul(dims.hidden).saturating_mul(2);
        ModelShape {
            name: name.into(),
            num_layers: dims.num_layers,
            layer_bytes,
            embedding_bytes,
            head_bytes: if dims.tied_embeddings {
                0
            } else {
                embedding_bytes
            },
            kv_bytes_per_token_per_layer: dims.kv_bytes_per_token_per_layer(),
        }
    }

    /// Dimensions of Llama 3 70B.
    pub const LLAMA_70B: TransformerDimensions = TransformerDimensions {
        num_layers: 80,
        hidden: 8192,
        intermediate: 28672,
        attention_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        vocab: 128_256,
        tied_embeddings: false,
    };

    /// Dimensions of SmolLM2-135M.
    pub const SMOLLM2_135M: TransformerDimensions = TransformerDimensions {
        num_layers: 30,
        hidden: 576,
        intermediate: 1536,
        attention_heads: 9,
        kv_heads: 3,
        head_dim: 64,
        vocab: 49_152,
        tied_embeddings: true,
    };

    /// The shape of Llama 3 70B (80 layers).
    pub fn llama_70b() -> Self {
        Self::from_dimensions("llama-70b", &Self::LLAMA_70B)
    }

    /// The shape of SmolLM2-135M (30 layers, tied embeddings).
    pub fn smollm2_135m() -> Self {
        Self::from_dimensions("smollm2-135m", &Self::SMOLLM2_135M)
    }

    /// Bytes of one layer in `quantization`, if the model is published in it.
    pub fn bytes_per_layer(&self, quantization: Quantization) -> Option<u64> {
        self.layer_bytes.get(&quantization).copied()
    }

    /// Bytes of `layers` consecutive layers in `quantization` (zero if unknown).
    pub fn span_bytes(&self, quantization: Quantization, layers: u32) -> u64 {
        self.bytes_per_layer(quantization)
            .unwrap_or(0)
            .saturating_mul(u64::from(layers))
    }

    /// Bytes the tracker holds on top of its layers: embedding plus LM head.
    pub fn tracker_extra_bytes(&self) -> u64 {
        self.embedding_bytes.saturating_add(self.head_bytes)
    }

    /// Memory one layer costs a peer in `quantization`, KV reservation included.
    pub fn layer_cost(&self, quantization: Quantization, kv_tokens: u64) -> Option<u64> {
        let weights = self.bytes_per_layer(quantization)?;
        Some(weights.saturating_add(kv_tokens.saturating_mul(self.kv_bytes_per_token_per_layer)))
    }

    /// Bytes a peer needs to hold `layers` layers in `quantization` with `kv_tokens` of KV
    /// reserved per layer, plus the embedding and head when it is the tracker; saturating.
    /// `None` when the model has no size for that format.
    pub fn memory_needed(
        &self,
        quantization: Quantization,
        kv_tokens: u64,
        layers: u32,
        tracker: bool,
    ) -> Option<u64> {
        let extra = if tracker {
            self.tracker_extra_bytes()
        } else {
            0
        };
        Some(
            self.layer_cost(quantization, kv_tokens)?
                .saturating_mul(u64::from(layers))
                .saturating_add(extra),
        )
    }

    /// The `--memory` that holds exactly `layers` layers: [`Self::memory_needed`] plus half a
    /// layer of slack, so rounding can neither lose a layer nor gain one.
    pub fn budget_for_layers(
        &self,
        quantization: Quantization,
        kv_tokens: u64,
        layers: u32,
        tracker: bool,
    ) -> Option<u64> {
        let slack = self.layer_cost(quantization, kv_tokens)? / 2;
        Some(
            self.memory_needed(quantization, kv_tokens, layers, tracker)?
                .saturating_add(slack),
        )
    }

    /// Checks that the shape can be planned at all.
    pub fn validate(&self) -> Result<(), PlanError> {
        if self.num_layers == 0 {
            return Err(PlanError::InvalidModel("the model has no layers".into()));
        }
        if self.num_layers > MAX_LAYERS {
            return Err(PlanError::InvalidModel(format!(
                "the model has {} layers; at most {MAX_LAYERS} are supported",
                self.num_layers
            )));
        }
        if self.layer_bytes.is_empty() {
            return Err(PlanError::InvalidModel(
                "the model lists no quantization".into(),
            ));
        }
        if self.layer_bytes.values().any(|&bytes| bytes == 0) {
            return Err(PlanError::InvalidModel(
                "a quantization has zero bytes per layer".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_70b_layer_sizes_follow_its_dimensions() {
        let dims = ModelShape::LLAMA_70B;
        assert_eq!(dims.params_per_layer(), 855_654_400);
        let shape = ModelShape::llama_70b();
        let bf16 = shape.bytes_per_layer(Quantization::Bf16).unwrap();
        assert_eq!(bf16, 2 * 855_654_400);
        let int8 = shape.bytes_per_layer(Quantization::Int8).unwrap();
        let nf4 = shape.bytes_per_layer(Quantization::Nf4).unwrap();
        assert!(int8 > bf16 / 2 && int8 < bf16 / 2 + bf16 / 100);
        assert!(nf4 > bf16 / 4 && nf4 < bf16 / 4 + bf16 / 50);
        assert_eq!(shape.kv_bytes_per_token_per_layer, 4096);
        assert_eq!(shape.embedding_bytes, 128_256 * 8192 * 2);
        assert_eq!(shape.head_bytes, shape.embedding_bytes);
    }

    #[test]
    fn smollm2_has_tied_head_and_small_kv() {
        let shape = ModelShape::smollm2_135m();
        assert_eq!(shape.num_layers, 30);
        assert_eq!(shape.head_bytes, 0);
        assert_eq!(shape.kv_bytes_per_token_per_layer, 768);
    }

    #[test]
    fn quality_order_matches_bits_per_weight() {
        let shape = ModelShape::llama_70b();
        for pair in Quantization::ALL.windows(2) {
            assert!(pair[0] < pair[1]);
            assert!(shape.bytes_per_layer(pair[0]) < shape.bytes_per_layer(pair[1]));
        }
    }

    #[test]
    fn absurd_dimensions_saturate_instead_of_overflowing() {
        let dims = TransformerDimensions {
            hidden: u64::MAX / 2,
            intermediate: u64::MAX,
            vocab: u64::MAX,
            ..ModelShape::LLAMA_70B
        };
        assert_eq!(dims.params_per_layer(), u64::MAX);
        for quantization in Quantization::ALL {
            assert!(dims.layer_bytes(quantization) > u64::MAX / 64);
        }
        let shape = ModelShape::from_dimensions("huge", &dims);
        assert_eq!(shape.embedding_bytes, u64::MAX);
        assert_eq!(shape.tracker_extra_bytes(), u64::MAX);
    }

    #[test]
    fn layer_counts_are_capped() {
        let mut shape = ModelShape::smollm2_135m();
        shape.num_layers = MAX_LAYERS;
        assert_eq!(shape.validate(), Ok(()));
        shape.num_layers = MAX_LAYERS + 1;
        assert!(matches!(shape.validate(), Err(PlanError::InvalidModel(_))));
        shape.num_layers = u32::MAX;
        assert!(matches!(shape.validate(), Err(PlanError::InvalidModel(_))));
    }

    #[test]
    fn quantization_names_round_trip_through_json() {
        for quantization in Quantization::ALL {
            let json = serde_json::to_string(&quantization).unwrap();
            assert_eq!(json, format!("\"{}\"", quantization.name()));
            let back: Quantization = serde_json::from_str(&json).unwrap();
            assert_eq!(back, quantization);
        }
    }
}
