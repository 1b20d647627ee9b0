//! The planner's vocabulary: peer capacities, the coverage map and directives.

use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use serde::{Deserialize, Serialize};

use crate::model::ModelShape;

/// What a live peer offers the mesh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerCapacity {
    /// The peer's identity.
    pub peer: PeerId,
    /// Memory the peer gives the mesh, in bytes (weights plus KV cache).
    pub memory_bytes: u64,
    /// Quantizations the peer can run.
    pub quantizations: Vec<Quantization>,
    /// Measured throughput in tokens per second through its span.
    pub throughput: f64,
    /// Tokens of KV cache the peer reserves for every layer it holds.
    pub kv_tokens: u64,
    /// Whether this peer is the tracker (holds `[0..k)`, embedding and head).
    pub is_tracker: bool,
}

impl PeerCapacity {
    /// The longest span this peer can hold in `quantization` within its memory,
    /// or `None` if it cannot run that quantization (capped at `model.num_layers`).
    pub fn max_layers(&self, model: &ModelShape, quantization: Quantization) -> Option<u32> {
        if !self.quantizations.contains(&quantization) {
            return None;
        }
        let cost = model.layer_cost(quantization, self.kv_tokens)?;
        let extra = if self.is_tracker {
            model.tracker_extra_bytes()
        } else {
            0
        };
        let available = self.memory_bytes.checked_sub(extra)?;
        let layers = available / cost.max(1);
        Some(u32::try_from(layers).map_or(model.num_layers, |l| l.min(model.num_layers)))
    }

    /// Bytes this peer needs to hold `layers` layers in `quantization`, KV
    /// reservation (and the tracker's embedding and head) included.
    pub fn memory_needed(
        &self,
        model: &ModelShape,
        quantization: Quantization,
        layers: u32,
    ) -> u64 {
        model
            .memory_needed(quantization, self.kv_tokens, layers, self.is_tracker)
            .unwrap_or(u64::MAX)
    }
}

/// One peer holding one contiguous span in the coverage map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanHolding {
    /// The holder.
    pub peer: PeerId,
    /// The layers it holds.
    pub layers: LayerSpan,
    /// The format it holds them in.
    pub quantization: Quantization,
    /// Whether it is loading or serving them.
    pub state: SpanState,
}

/// One holder of one layer, as seen from that layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerHolder<'a> {
    /// The holder.
    pub peer: &'a PeerId,
    /// The format it holds the layer in.
    pub quantization: Quantization,
    /// Whether it is loading or serving the layer.
    pub state: SpanState,
}

/// Who holds which layers, as published by the tracker.
///
/// Holdings are stored per span (a peer's layers are contiguous), which
/// answers "who holds layer `l`, in which format and state" for every layer
/// while staying small enough to gossip for ten thousand peers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoverageMap {
    /// Version of the map; bumped every time a plan changes it.
    pub epoch: u64,
    /// Every holding, sorted by peer id.
    pub holdings: Vec<SpanHolding>,
}

impl CoverageMap {
    /// An empty map at `epoch`.
    pub fn empty(epoch: u64) -> Self {
        CoverageMap {
            epoch,
            holdings: Vec::new(),
        }
    }

    /// Holders of `layer` with their quantization and state.
    pub fn holders(&self, layer: u32) -> impl Iterator<Item = LayerHolder<'_>> {
        self.holdings
            .iter()
            .filter(move |holding| holding.layers.contains(layer))
            .map(|holding| LayerHolder {
                peer: &holding.peer,
                quantization: holding.quantization,
                state: holding.state,
            })
    }

    /// Number of holders of each layer in `0..num_layers`.
    pub fn holder_counts(&self, num_layers: u32) -> Vec<u32> {
        let mut delta = vec![0i64; num_layers as usize + 1];
        for holding in &self.holdings {
            let span = holding.layers.intersection(LayerSpan::new(0, num_layers));
            if !span.is_empty() {
                delta[span.start as usize] += 1;
                delta[span.end as usize] -= 1;
            }
        }
        let mut running = 0i64;
        delta[..num_layers as usize]
            .iter()
            .map(|d| {
                running += d;
                u32::try_from(running).unwrap_or(0)
            })
            .collect()
    }

    /// Maximal runs of layers in `0..num_layers` that nobody holds.
    pub fn uncovered(&self, num_layers: u32) -> Vec<LayerSpan> {
        spans_where(&self.holder_counts(num_layers), |count| count == 0)
    }

    /// Marks every holding `Ready` (all loads finished) and merges the
    /// adjacent pieces of each peer's span.
    pub fn mark_all_ready(&mut self) {
        let mut merged: Vec<SpanHolding> = Vec::with_capacity(self.holdings.len());
        for mut holding in std::mem::take(&mut self.holdings) {
            holding.state = SpanState::Ready;
            match merged.last_mut() {
                Some(last)
                    if last.peer == holding.peer
                        && last.quantization == holding.quantization
                        && last.layers.end == holding.layers.start =>
                {
                    last.layers.end = holding.layers.end;
                }
                _ => merged.push(holding),
            }
        }
        self.holdings = merged;
    }

    /// Removes every holding of `peer` (for example after it crashed).
    pub fn remove_peer(&mut self, peer: &PeerId) {
        self.holdings.retain(|holding| &holding.peer != peer);
    }

    /// The holding of `peer`, if it holds anything.
    pub fn holding_of(&self, peer: &PeerId) -> Option<&SpanHolding> {
        self.holdings.iter().find(|holding| &holding.peer == peer)
    }
}

/// Maximal runs of indices whose value satisfies `predicate`.
pub(crate) fn spans_where(values: &[u32], predicate: impl Fn(u32) -> bool) -> Vec<LayerSpan> {
    let mut spans = Vec::new();
    let mut run_start: Option<u32> = None;
    for (index, &value) in values.iter().enumerate() {
        let index = index as u32;
        match (predicate(value), run_start) {
            (true, None) => run_start = Some(index),
            (false, Some(start)) => {
                spans.push(LayerSpan::new(start, index));
                run_start = None;
            }
            _ => {}
        }
    }
    if let Some(start) = run_start {
        spans.push(LayerSpan::new(start, values.len() as u32));
    }
    spans
}

/// An instruction the tracker publishes to one peer.
///
/// A peer applies its drops before its loads; after applying all of its
/// directives it holds exactly one contiguous span (or nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Directive {
    /// Load `layers` in `quantization`, extending (or starting) the peer's span.
    LoadShard {
        /// The peer that loads.
        peer: PeerId,
        /// The layers to load.
        layers: LayerSpan,
        /// The format to load them in.
        quantization: Quantization,
    },
    /// Unload `layers`, held in `quantization`, from the peer.
    DropShard {
        /// The peer that unloads.
        peer: PeerId,
        /// The layers to unload.
        layers: LayerSpan,
        /// The format the peer holds those layers in (a peer may hold the same
        /// layer in two formats in a stale map; only this copy is dropped).
        quantization: Quantization,
    },
}

impl Directive {
    /// The peer the directive is addressed to.
    pub fn peer(&self) -> &PeerId {
        match self {
            Directive::LoadShard { peer, .. } | Directive::DropShard { peer, .. } => peer,
        }
    }

    /// Weight bytes this directive makes its peer load (zero for a drop).
    pub fn bytes_loaded(&self, model: &ModelShape) -> u64 {
        match self {
            Directive::LoadShard {
                layers,
                quantization,
                ..
            } => model.span_bytes(*quantization, layers.len()),
            Directive::DropShard { .. } => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_where_finds_maximal_runs() {
        let values = [0, 1, 0, 0, 2, 0];
        assert_eq!(
            spans_where(&values, |v| v == 0),
            vec![
                LayerSpan::new(0, 1),
                LayerSpan::new(2, 4),
                LayerSpan::new(5, 6)
            ]
        );
        assert!(spans_where(&[1, 1], |v| v == 0).is_empty());
    }

    #[test]
    fn holder_counts_and_holders_agree() {
        let holding = |peer: &str, start, end| SpanHolding {
            peer: PeerId::from(peer),
            layers: LayerSpan::new(start, end),
            quantization: Quantization::Nf4,
            state: SpanState::Ready,
        };
        let map = CoverageMap {
            epoch: 3,
            holdings: vec![holding("a", 0, 3), holding("b", 2, 5)],
        };
        let counts = map.holder_counts(6);
        for layer in 0..6 {
            assert_eq!(counts[layer as usize] as usize, map.holders(layer).count());
        }
        assert_eq!(map.uncovered(6), vec![LayerSpan::new(5, 6)]);
    }

    #[test]
    fn max_layers_accounts_for_kv_and_tracker_extras() {
        let model = ModelShape::smollm2_135m();
        let per_layer = model.layer_cost(Quantization::Bf16, 100).unwrap();
        let mut peer = PeerCapacity {
            peer: PeerId::from("p"),
            memory_bytes: per_layer * 4 + per_layer / 2,
            quantizations: vec![Quantization::Bf16],
            throughput: 1.0,
            kv_tokens: 100,
            is_tracker: false,
        };
        assert_eq!(peer.max_layers(&model, Quantization::Bf16), Some(4));
        assert_eq!(peer.max_layers(&model, Quantization::Nf4), None);
        peer.is_tracker = true;
        peer.memory_bytes += model.tracker_extra_bytes();
        assert_eq!(peer.max_layers(&model, Quantization::Bf16), Some(4));
        assert!(peer.memory_needed(&model, Quantization::Bf16, 4) <= peer.memory_bytes);
        assert!(peer.memory_needed(&model, Quantization::Bf16, 5) > peer.memory_bytes);
    }

    #[test]
    fn directives_serialize_under_their_wire_names() {
        let directive = Directive::DropShard {
            peer: PeerId::from("p"),
            layers: LayerSpan::new(1, 2),
            quantization: Quantization::Int8,
        };
        let json = serde_json::to_string(&directive).unwrap();
        assert_eq!(
            json,
            "{\"DROP_SHARD\":{\"peer\":\"p\",\"layers\":[1,2],\"quantization\":\"int8\"}}"
        );
        let back: Directive = serde_json::from_str(&json).unwrap();
        assert_eq!(back, directive);
    }
}
