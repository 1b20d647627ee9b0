//! The JSON of `GET /status`: this peer's own state, and on the tracker the coverage map and
//! the peers it knows (documented in docs/status.md).

use meshnet_p2p::{CoverageMessage, SpanState, SpanStatus};
use meshnet_planner::{PeerState, Quantization};
use serde::Serialize;

/// Everything `GET /status` reports.
#[derive(Clone, Debug, Serialize)]
pub struct StatusReport {
    /// This peer's id.
    pub peer: String,
    /// `tracker` or `peer`.
    pub role: &'static str,
    /// The software version.
    pub version: &'static str,
    /// The model served.
    pub model: ModelReport,
    /// This peer's activation-plane base URL.
    pub http: String,
    /// The libp2p addresses it listens on.
    pub p2p: Vec<String>,
    /// The span serving new sessions.
    pub span: Option<SpanReport>,
    /// The span being loaded, if any.
    pub loading: Option<SpanReport>,
    /// Sessions holding KV cache here.
    pub active_sessions: usize,
    /// KV tokens the current span can still take.
    pub free_kv_tokens: u64,
    /// The tracker this peer follows.
    pub tracker: Option<String>,
    /// Gossip messages rejected by validation (undecodable, another model, not from the
    /// tracker, spoofed sender).
    pub rejected_messages: u64,
    /// The coverage map (the tracker's own; on other peers, the last one received).
    pub coverage: Option<CoverageReport>,
    /// The peers the tracker knows (tracker only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<Vec<PeerReport>>,
    /// Where the OpenAI-style API answers (tracker only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub openai_base_url: Option<String>,
    /// The span boundaries of the route a generation takes now (tracker only), as
    /// `meshnet-peer generate --boundaries` takes them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route_boundaries: Option<Vec<u32>>,
}

/// The model's identity.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    /// Name and content hash.
    pub id: String,
    /// Transformer layers.
    pub layers: u32,
}

/// A span and its state.
#[derive(Clone, Debug, Serialize)]
pub struct SpanReport {
    /// `[start, end)` as a pair.
    pub layers: [u32; 2],
    /// Weight format.
    pub quantization: Quantization,
    /// `loading`, `ready` or `draining`.
    pub state: SpanState,
}

impl From<&SpanStatus> for SpanReport {
    fn from(span: &SpanStatus) -> Self {
        SpanReport {
            layers: [span.layers.start, span.layers.end],
            quantization: span.quantization,
            state: span.state,
        }
    }
}

/// The coverage map, layer by layer.
#[derive(Clone, Debug, Serialize)]
pub struct CoverageReport {
    /// The map's epoch.
    pub epoch: u64,
    /// Whether every layer has a ready holder.
    pub complete: bool,
    /// Each layer with its holders.
    pub layers: Vec<LayerReport>,
}

/// One layer's holders.
#[derive(Clone, Debug, Serialize)]
pub struct LayerReport {
    /// The layer index.
    pub layer: u32,
    /// Who holds it.
    pub holders: Vec<HolderReport>,
}

/// One holder of one layer.
#[derive(Clone, Debug, Serialize)]
pub struct HolderReport {
    /// The holder's id.
    pub peer: String,
    /// `loading` or `ready`.
    pub state: PeerState,
    /// Its weight format.
    pub quantization: Quantization,
}

/// A peer as the tracker knows it.
#[derive(Clone, Debug, Serialize)]
pub struct PeerReport {
    /// Its id.
    pub peer: String,
    /// Its activation-plane base URL.
    pub http: Option<String>,
    /// Its announced span.
    pub span: Option<SpanReport>,
    /// Declared memory in bytes.
    pub memory_bytes: u64,
    /// Formats it can run.
    pub quantizations: Vec<Quantization>,
    /// Announced throughput, tokens per second.
    pub throughput: f64,
    /// Sessions it runs.
    pub active_sessions: u32,
    /// KV tokens it can still take.
    pub free_kv_tokens: u64,
    /// Milliseconds since its last announcement.
    pub last_seen_ms: u64,
}

impl CoverageReport {
    /// The per-layer view of a coverage message.
    pub fn from_message(message: &CoverageMessage) -> Self {
        let layers: Vec<LayerReport> = (0..message.num_layers)
            .map(|layer| LayerReport {
                layer,
                holders: message
                    .map
                    .holders(layer)
                    .map(|holder| HolderReport {
                        peer: holder.peer.as_str().to_owned(),
                        state: holder.state,
                        quantization: holder.quantization,
                    })
                    .collect(),
            })
            .collect();
        let complete = layers.iter().all(|layer| {
            layer
                .holders
                .iter()
                .any(|holder| holder.state == PeerState::Ready)
        });
        CoverageReport {
            epoch: message.epoch,
            complete,
            layers,
        }
    }
}
