//! Control-plane messages and their wire encoding.
//!
//! Pure data: no I/O, no async. Every message travels as an envelope
//! `{ schema_version: u16, body }` encoded with bincode 2 (standard config:
//! little endian, variable-length integers). [`decode`] accepts only the
//! current [`SCHEMA_VERSION`], at most [`MAX_MESSAGE_BYTES`] of input and no
//! trailing bytes.

use meshnet_planner::{CoverageMap, Directive};
use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::P2pError;

/// Version of the control message schema; part of every envelope and topic name.
pub const SCHEMA_VERSION: u16 = 5;

/// Largest encoded control message accepted or produced, in bytes (1 MiB).
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// The span of layers a peer holds and in which state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanStatus {
    /// The layers, half-open `[start, end)`.
    pub layers: LayerSpan,
    /// The format the layers are held in.
    pub quantization: Quantization,
    /// Loading, serving or draining.
    pub state: SpanState,
}

/// The most round-trip times one announcement carries (the sender's nearest members): enough
/// to route around a far member, small enough that a large mesh's gossip stays light.
pub const MAX_RTT_ENTRIES: usize = 16;

/// A round-trip time the sender measured to another member's activation plane.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerRtt {
    /// The member measured.
    pub peer: PeerId,
    /// The smoothed round trip in milliseconds (finite, not negative).
    pub ms: f32,
}

/// What a peer tells the mesh about itself, gossiped periodically.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerAnnouncement {
    /// The sender; must match the message's signed source.
    pub peer: PeerId,
    /// The model the peer serves.
    pub model_id: String,
    /// The sender's software version.
    pub software_version: String,
    /// Version of the activation wire protocol the peer speaks.
    pub wire_version: u32,
    /// HTTP endpoints where the peer serves activations directly (none when others cannot
    /// dial it: then they open libp2p streams to it).
    pub http_endpoints: Vec<String>,
    /// libp2p addresses where the peer can be dialed: its listen addresses when it is
    /// reachable, its relayed (`/p2p-circuit`) addresses otherwise.
    pub p2p_addresses: Vec<String>,
    /// Memory the peer gives the mesh, in bytes (weights plus KV cache).
    pub memory_bytes: u64,
    /// Quantizations the peer can run.
    pub quantizations: Vec<Quantization>,
    /// Measured throughput in tokens per second.
    pub throughput: f64,
    /// Tokens of KV cache reserved for every held layer.
    pub kv_tokens: u64,
    /// The span the peer holds, if any.
    pub span: Option<SpanStatus>,
    /// KV tokens currently free for new sessions.
    pub free_kv_tokens: u64,
    /// Sessions currently running through the peer.
    pub active_sessions: u32,
    /// Whether the sender is the tracker.
    pub is_tracker: bool,
    /// Smoothed milliseconds the sender spends on one decode step of its layers (0 before it
    /// ran one); routing prefers the faster of two holders.
    pub forward_latency_ms: f64,
    /// The sender is shutting down: it finishes its running sessions but takes no new ones,
    /// and the tracker re-covers its layers without it.
    pub leaving: bool,
    /// The sender may take the tracker role if the tracker goes silent.
    pub tracker_capable: bool,
    /// Sender's clock when the announcement was made, in milliseconds since the Unix epoch.
    pub sent_at_unix_ms: u64,
    /// Milliseconds since the sender last heard its tracker's coverage map (`None` when it
    /// follows no tracker yet, or is the tracker). A member takes over from a silent tracker
    /// only when most of the mesh reports the silence too.
    pub tracker_silent_ms: Option<u64>,
    /// Round trips the sender measured to other members' activation planes, nearest first,
    /// at most [`MAX_RTT_ENTRIES`]: the tracker chooses among holders of the same layers the
    /// route with the least total delay.
    pub rtt_ms: Vec<PeerRtt>,
}

/// The tracker's coverage map, gossiped to every peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CoverageMessage {
    /// The model the map describes.
    pub model_id: String,
    /// The sender's tracker term: 1 for a tracker started as one, one more for each
    /// takeover. A higher term wins; peers act only on the current term.
    pub term: u64,
    /// Who may take over if the sender goes silent, in order of preference: ready,
    /// reachable peers with the memory for the first layers. A takeover claim from anyone
    /// else is rejected.
    pub succession: Vec<PeerId>,
    /// The sender's HTTP base URL, where it answers the OpenAI-style API: members that
    /// follow it pass API requests there.
    pub tracker_http: String,
    /// Planning epoch of the map.
    pub epoch: u64,
    /// Monotonic publication counter of the tracker, to order messages of one epoch.
    pub sequence: u64,
    /// Number of transformer layers of the model.
    pub num_layers: u32,
    /// Who holds which layers.
    pub map: CoverageMap,
    /// How often the tracker asks members to announce, in milliseconds: longer in a larger
    /// mesh, so the announcements each member hears per second stay bounded.
    pub announce_interval_ms: u64,
}

/// Directives from the tracker to one peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DirectiveMessage {
    /// The model the directives are about.
    pub model_id: String,
    /// The peer that must apply the directives.
    pub target: PeerId,
    /// The sender's tracker term; a directive of an older term is rejected.
    pub term: u64,
    /// Planning epoch the directives belong to.
    pub epoch: u64,
    /// Monotonic publication counter of the tracker.
    pub sequence: u64,
    /// The directives, all addressed to `target`.
    pub directives: Vec<Directive>,
    /// What the target holds once it applied them; `None` means nothing.
    pub span_after: Option<SpanStatus>,
}

/// The record the tracker stores in Kademlia so peers can find it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrackerRecord {
    /// The tracker.
    pub peer: PeerId,
    /// Multiaddrs of the tracker, as strings.
    pub addresses: Vec<String>,
    /// The tracker's HTTP endpoint.
    pub http_endpoint: String,
    /// Planning epoch when the record was written.
    pub epoch: u64,
    /// The tracker's term; a record of an older term than the one followed is ignored.
    pub term: u64,
    /// The model the tracker coordinates.
    pub model_id: String,
}

/// The gossipsub topics of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TopicKind {
    /// Peer announcements ([`PeerAnnouncement`]).
    Announce,
    /// The tracker's coverage map ([`CoverageMessage`]).
    Coverage,
    /// The tracker's directives ([`DirectiveMessage`]).
    Directives,
}

impl TopicKind {
    /// Every topic kind.
    pub const ALL: [TopicKind; 3] = [
        TopicKind::Announce,
        TopicKind::Coverage,
        TopicKind::Directives,
    ];

    /// The last path segment of the topic name.
    pub fn suffix(self) -> &'static str {
        match self {
            TopicKind::Announce => "announce",
            TopicKind::Coverage => "coverage",
            TopicKind::Directives => "directives",
        }
    }
}

/// The gossipsub topic name `meshnet/<schema version>/<model_id>/<kind>`.
pub fn topic_name(model_id: &str, kind: TopicKind) -> String {
    format!("meshnet/{SCHEMA_VERSION}/{model_id}/{}", kind.suffix())
}

/// The Kademlia key of the tracker record: `meshnet/<schema version>/<model_id>/tracker`.
pub fn tracker_record_key(model_id: &str) -> String {
    format!("meshnet/{SCHEMA_VERSION}/{model_id}/tracker")
}

fn wire_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MESSAGE_BYTES>()
}

#[derive(Serialize)]
struct Envelope<'a, T> {
    schema_version: u16,
    body: &'a T,
}

/// Encodes `message` in a versioned envelope.
///
/// Fails if the encoding exceeds [`MAX_MESSAGE_BYTES`].
pub fn encode<T: Serialize>(message: &T) -> Result<Vec<u8>, P2pError> {
    let envelope = Envelope {
        schema_version: SCHEMA_VERSION,
        body: message,
    };
    let bytes = bincode::serde::encode_to_vec(&envelope, wire_config())
        .map_err(|error| P2pError::Encode(error.to_string()))?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(P2pError::MessageTooLarge {
            size: bytes.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    Ok(bytes)
}

/// Decodes a message produced by [`encode`].
///
/// Rejects oversize input, another schema version, malformed bodies and trailing bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, P2pError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(P2pError::MessageTooLarge {
            size: bytes.len(),
            limit: MAX_MESSAGE_BYTES,
        });
    }
    let (version, header_len): (u16, usize) =
        bincode::serde::decode_from_slice(bytes, wire_config())
            .map_err(|error| P2pError::Decode(format!("schema version: {error}")))?;
    if version != SCHEMA_VERSION {
        return Err(P2pError::SchemaVersion {
            expected: SCHEMA_VERSION,
            found: version,
        });
    }
    let rest = bytes.get(header_len..).unwrap_or_default();
    let (body, body_len): (T, usize) = bincode::serde::decode_from_slice(rest, wire_config())
        .map_err(|error| P2pError::Decode(error.to_string()))?;
    if body_len != rest.len() {
        return Err(P2pError::TrailingBytes {
            count: rest.len() - body_len,
        });
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshnet_planner::SpanHolding;
    use meshnet_types::{PeerId as PlannerPeerId, SpanState};

    fn record() -> TrackerRecord {
        TrackerRecord {
            peer: "12D3KooWtracker".into(),
            addresses: vec!["/ip4/127.0.0.1/tcp/4001".into()],
            http_endpoint: "http://127.0.0.1:8080".into(),
            epoch: 7,
            term: 2,
            model_id: "smollm2-135m".into(),
        }
    }

    #[test]
    fn topic_names_carry_schema_version_and_model() {
        assert_eq!(topic_name("m", TopicKind::Announce), "meshnet/5/m/announce");
        assert_eq!(topic_name("m", TopicKind::Coverage), "meshnet/5/m/coverage");
        assert_eq!(
            topic_name("m", TopicKind::Directives),
            "meshnet/5/m/directives"
        );
        assert_eq!(tracker_record_key("m"), "meshnet/5/m/tracker");
    }

    #[test]
    fn round_trip_keeps_every_field() {
        let coverage = CoverageMessage {
            model_id: "m".into(),
            term: 4,
            succession: vec![PlannerPeerId::from("b"), PlannerPeerId::from("c")],
            tracker_http: "http://10.0.0.1:8080".into(),
            epoch: 3,
            sequence: 9,
            num_layers: 30,
            map: CoverageMap {
                epoch: 3,
                holdings: vec![SpanHolding {
                    peer: PlannerPeerId::from("a"),
                    layers: LayerSpan::new(0, 12),
                    quantization: Quantization::Q4_1,
                    state: SpanState::Loading,
                }],
            },
            announce_interval_ms: 5000,
        };
        let bytes = encode(&coverage).unwrap();
        assert_eq!(decode::<CoverageMessage>(&bytes).unwrap(), coverage);
        assert_eq!(
            decode::<TrackerRecord>(&encode(&record()).unwrap()).unwrap(),
            record()
        );
    }

    #[test]
    fn other_schema_version_is_named() {
        let mut bytes = encode(&record()).unwrap();
        // Versions below 251 are a single varint byte.
        bytes[0] = SCHEMA_VERSION as u8 + 1;
        let error = decode::<TrackerRecord>(&bytes).unwrap_err();
        assert!(
            matches!(
                error,
                P2pError::SchemaVersion {
                    expected: 5,
                    found: 6
                }
            ),
            "{error}"
        );
        assert!(error.to_string().contains("version 6") && error.to_string().contains("version 5"));
    }

    #[test]
    fn trailing_bytes_are_rejected() {
        let mut bytes = encode(&record()).unwrap();
        bytes.extend_from_slice(&[0, 0]);
        assert!(matches!(
            decode::<TrackerRecord>(&bytes),
            Err(P2pError::TrailingBytes { count: 2 })
        ));
    }

    #[test]
    fn truncated_and_oversize_input_is_rejected() {
        let bytes = encode(&record()).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode::<TrackerRecord>(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let huge = vec![1u8; MAX_MESSAGE_BYTES + 1];
        assert!(matches!(
            decode::<TrackerRecord>(&huge),
            Err(P2pError::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn oversize_message_is_not_encoded() {
        let mut big = record();
        big.http_endpoint = "x".repeat(MAX_MESSAGE_BYTES);
        assert!(matches!(
            encode(&big),
            Err(P2pError::MessageTooLarge { .. })
        ));
    }

    #[test]
    fn huge_claimed_length_does_not_allocate() {
        // The current version, then a string length claiming u64::MAX bytes.
        let mut bytes = vec![SCHEMA_VERSION as u8, 0xFF];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode::<TrackerRecord>(&bytes),
            Err(P2pError::Decode(_))
        ));
    }
}
