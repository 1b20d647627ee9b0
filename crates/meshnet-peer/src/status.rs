//! The JSON of `GET /status`: this peer's own state, and on the tracker the coverage map and
//! the peers it knows (documented in docs/status.md). [`StatusReport::of`] is the one mapping
//! from a running member to it; it only reads.

use std::time::Instant;

use meshnet_metrics::HopPath;
use meshnet_p2p::{CoverageMessage, Reachability, SpanStatus};
use meshnet_types::{PeerId, Quantization, SpanState};
use serde::{Deserialize, Serialize};

use crate::engine::MeshEngine;
use crate::member::{Member, MeshView};
pub use crate::rejections::RejectionReport;
use crate::route_table::{KnownPeer, RouteTable};

/// Everything `GET /status` reports: what a member serializes and what a client of it
/// (`meshnet-peer status`) deserializes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// This peer's id.
    pub peer: PeerId,
    /// `tracker` or `peer`.
    pub role: Role,
    /// The software version.
    pub version: String,
    /// The model served.
    pub model: ModelReport,
    /// This peer's activation-plane base URL.
    pub http: Option<String>,
    /// The libp2p addresses it listens on.
    pub p2p: Vec<String>,
    /// The span serving new sessions.
    pub span: Option<SpanStatus>,
    /// The span being loaded, if any.
    pub loading: Option<SpanStatus>,
    /// Sessions holding KV cache here.
    pub active_sessions: usize,
    /// KV tokens the current span can still take.
    pub free_kv_tokens: u64,
    /// The tracker this peer follows (itself on the tracker).
    pub tracker: Option<PeerId>,
    /// Where that tracker answers the API (where this member passes `/v1` requests).
    pub tracker_http: Option<String>,
    /// That tracker's term: 1 for a tracker started as one, one more per takeover.
    pub term: u64,
    /// Who may take over if the tracker goes silent, in order.
    pub succession: Vec<PeerId>,
    /// How often this member announces itself, in milliseconds: its own interval, or the
    /// longer one its tracker advertises for a large mesh.
    pub announce_interval_ms: u64,
    /// Gossip messages rejected by validation (undecodable, another model, not from the
    /// tracker, spoofed sender).
    pub rejected_messages: u64,
    /// The latest refusals (at most 16), oldest first.
    pub recent_rejections: Vec<RejectionReport>,
    /// Generations that got past a failed hop on a new route (tracker; 0 elsewhere).
    pub failovers: u64,
    /// Checked generations that ended without a disagreement (tracker; 0 elsewhere).
    pub checked_sessions: u64,
    /// Members caught returning wrong activations and banned (tracker; 0 elsewhere).
    pub convictions: u64,
    /// Whether this member is leaving the mesh (it finishes its sessions, takes no new ones).
    pub leaving: bool,
    /// This member's smoothed milliseconds per decode step of its layers (0 before one ran).
    pub forward_latency_ms: f64,
    /// Gossip this member published and received since it started (payload bytes).
    pub gossip: meshnet_p2p::GossipTraffic,
    /// How this member is reached and how it reaches the others.
    pub network: NetworkReport,
    /// Peers kept off routes after failing a generation (tracker only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub banned: Option<Vec<BanReport>>,
    /// What the current span's compute thread has done: passes over the weights and the
    /// sessions' requests they answered together.
    pub batching: Option<crate::batcher::BatchingReport>,
    /// Generation slots and the line for them (tracker only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionReport>,
    /// The coverage map (the tracker's own; on other peers, the last one received).
    pub coverage: Option<CoverageReport>,
    /// The peers the tracker knows (tracker only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<Vec<PeerReport>>,
    /// Where this member answers the OpenAI-style API: the tracker itself, any other member
    /// by passing requests on to the tracker it follows.
    pub openai_base_url: Option<String>,
    /// The span boundaries of the route a generation takes now (tracker only), as
    /// `meshnet-peer generate --boundaries` takes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_boundaries: Option<Vec<u32>>,
}

/// Whether a member is the tracker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The member that keeps the coverage map and answers the API (`tracker`).
    Tracker,
    /// Any other member (`peer`).
    Peer,
}

impl Role {
    /// `tracker` or `peer`, as `/status` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Tracker => "tracker",
            Role::Peer => "peer",
        }
    }
}

/// How activations from one member reach another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemberPath {
    /// An HTTP request to its announced endpoint (`direct-http`).
    DirectHttp,
    /// A libp2p stream over a direct connection, dialed or punched through NATs
    /// (`direct-p2p`).
    DirectP2p,
    /// A libp2p stream through a relay (`relayed`).
    Relayed,
    /// A libp2p stream once a connection is made; none is up yet (`not-connected`).
    NotConnected,
}

impl MemberPath {
    /// `direct-http`, `direct-p2p`, `relayed` or `not-connected`, as `/status` writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberPath::DirectHttp => "direct-http",
            MemberPath::DirectP2p => "direct-p2p",
            MemberPath::Relayed => "relayed",
            MemberPath::NotConnected => "not-connected",
        }
    }
}

impl From<HopPath> for MemberPath {
    fn from(path: HopPath) -> Self {
        match path {
            HopPath::DirectHttp => MemberPath::DirectHttp,
            HopPath::DirectP2p => MemberPath::DirectP2p,
            HopPath::Relayed => MemberPath::Relayed,
        }
    }
}

/// The tracker's generation slots and the line for them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionReport {
    /// Generations that run at once.
    pub max_sessions: usize,
    /// Generations running now.
    pub running: usize,
    /// Requests waiting for a slot now.
    pub queued: usize,
    /// Requests that may wait; one more is answered 429.
    pub max_queued: usize,
    /// How long a request may wait before it is answered 429, in milliseconds.
    pub queue_timeout_ms: u64,
}

/// A peer kept off routes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BanReport {
    /// The peer.
    pub peer: PeerId,
    /// How it failed a generation.
    pub cause: String,
    /// Milliseconds since it failed.
    pub since_ms: u64,
    /// Milliseconds until the ban's backoff ends (0 once only a fresh announcement is
    /// awaited).
    pub remaining_ms: u64,
    /// For a member caught returning wrong activations: the step and the three outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<crate::verify::Evidence>,
}

/// The model's identity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    /// Name and content hash.
    pub id: String,
    /// Transformer layers.
    pub layers: u32,
}

/// The coverage map, layer by layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoverageReport {
    /// The map's epoch.
    pub epoch: u64,
    /// Whether every layer has a ready holder.
    pub complete: bool,
    /// Each layer with its holders.
    pub layers: Vec<LayerReport>,
}

/// One layer's holders.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerReport {
    /// The layer index.
    pub layer: u32,
    /// Who holds it.
    pub holders: Vec<HolderReport>,
}

/// One holder of one layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HolderReport {
    /// The holder's id.
    pub peer: PeerId,
    /// `loading` or `ready`.
    pub state: SpanState,
    /// Its weight format.
    pub quantization: Quantization,
}

/// How a member is reached and how it reaches the members it knows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NetworkReport {
    /// Whether others can dial it: `public` (started `--reachable`, or AutoNAT says so),
    /// `private` (AutoNAT says not) or `unknown`. Unless public, it reserves relay slots.
    pub reachability: Reachability,
    /// Its relayed (`/p2p-circuit`) addresses, one per relay holding a reservation for it.
    pub relayed_addresses: Vec<String>,
    /// Every other member it has heard from, and how activations from here reach it:
    /// `direct-http` (its announced HTTP endpoint), `direct-p2p` (a libp2p stream over a
    /// direct connection, dialed or punched through NATs), `relayed` (a libp2p stream through a
    /// relay) or `not-connected` (a libp2p stream once a connection is made).
    pub paths: std::collections::BTreeMap<PeerId, MemberPath>,
}

impl NetworkReport {
    fn of(member: &Member, view: &MeshView) -> Self {
        let paths = view
            .seen
            .iter()
            .filter(|(peer, _)| **peer != member.peer_id)
            .map(|(peer, (announcement, _))| (peer.clone(), path_to(member, announcement)))
            .collect();
        NetworkReport {
            reachability: member.p2p.reachability(),
            relayed_addresses: member
                .p2p
                .circuit_addresses()
                .iter()
                .map(ToString::to_string)
                .collect(),
            paths,
        }
    }
}

/// How activations from `member` reach the sender of `announcement`.
fn path_to(member: &Member, announcement: &meshnet_p2p::PeerAnnouncement) -> MemberPath {
    if !announcement.http_endpoints.is_empty() {
        return MemberPath::DirectHttp;
    }
    match member.p2p.path_to(&announcement.peer) {
        Some(path) => crate::p2p_plane::hop_path(Some(path)).into(),
        None => MemberPath::NotConnected,
    }
}

/// A peer as the tracker knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerReport {
    /// Its id.
    pub peer: PeerId,
    /// Its activation-plane base URL.
    pub http: Option<String>,
    /// How activations reach it from the tracker: `direct-http` to its announced endpoint, or
    /// over libp2p: `direct-p2p`, `relayed` or `not-connected` (see [`NetworkReport::paths`]).
    pub path: MemberPath,
    /// Its announced span.
    pub span: Option<SpanStatus>,
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
    /// Its announced milliseconds per decode step.
    pub forward_latency_ms: f64,
    /// Whether it announced that it is leaving.
    pub leaving: bool,
    /// Checked sessions it passed since it joined or was last convicted (ADR-0026): below
    /// the probation count, every session it serves is checked.
    pub verified_sessions: u32,
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
                        peer: holder.peer.clone(),
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
                .any(|holder| holder.state == SpanState::Ready)
        });
        CoverageReport {
            epoch: message.epoch,
            complete,
            layers,
        }
    }
}

impl BanReport {
    /// The bans of `table` running at `now`.
    fn all(table: &RouteTable, now: Instant) -> Vec<BanReport> {
        table
            .bans(now)
            .into_iter()
            .map(|(peer, ban)| BanReport {
                peer,
                cause: ban.cause,
                since_ms: now.saturating_duration_since(ban.since).as_millis() as u64,
                remaining_ms: ban.until.saturating_duration_since(now).as_millis() as u64,
                evidence: ban.evidence.map(|evidence| *evidence),
            })
            .collect()
    }
}

impl AdmissionReport {
    /// The admission limits and queue of the tracker's `engine`.
    fn of(engine: &MeshEngine) -> Self {
        let limits = engine.limits();
        AdmissionReport {
            max_sessions: limits.max_running,
            running: engine.active_sessions(),
            queued: engine.queued_sessions(),
            max_queued: limits.max_waiting,
            queue_timeout_ms: limits.max_wait.as_millis() as u64,
        }
    }
}

impl StatusReport {
    /// What `GET /status` answers for `member` now.
    pub(crate) fn of(member: &Member) -> Self {
        let host = &member.host;
        let tracker = member.tracker_parts();
        let now = Instant::now();
        let table = tracker.as_ref().map(|parts| parts.routes.table());
        let peers = table.as_ref().map(|table| {
            table
                .peers()
                .values()
                .map(|known| PeerReport::of(member, known, table, now))
                .collect()
        });
        let banned = table.as_ref().map(|table| BanReport::all(table, now));
        let admission = tracker
            .as_ref()
            .map(|parts| AdmissionReport::of(&parts.engine));
        let view = member.view();
        let (rejected_messages, recent_rejections) = member.rejections.snapshot();
        let mut following = view.following.clone();
        if let Some(table) = &table {
            following.term = table.term();
            following.succession = table.succession(now);
        }
        StatusReport {
            peer: member.peer_id.clone(),
            role: if tracker.is_some() {
                Role::Tracker
            } else {
                Role::Peer
            },
            version: env!("CARGO_PKG_VERSION").to_owned(),
            model: ModelReport {
                id: member.model.id().to_owned(),
                layers: member.model.num_layers(),
            },
            http: member.http_url.clone(),
            p2p: view.listen_addrs.to_vec(),
            span: host
                .current()
                .map(|held_span| held_span.target.status(SpanState::Ready)),
            loading: host
                .loading()
                .map(|target| target.status(SpanState::Loading)),
            active_sessions: member.active_sessions(),
            free_kv_tokens: host.free_kv_tokens(),
            tracker_http: member.tracker_url(),
            tracker: following.tracker,
            term: following.term,
            succession: following.succession,
            announce_interval_ms: view.announce_every.as_millis() as u64,
            rejected_messages,
            recent_rejections,
            failovers: member.metrics.failovers(),
            checked_sessions: member.metrics.checked_sessions(),
            convictions: member.metrics.convictions(),
            leaving: member.is_leaving(),
            forward_latency_ms: host.forward_latency_ms(),
            batching: host.current().map(|held_span| held_span.batching()),
            gossip: member.p2p.gossip_traffic(),
            network: NetworkReport::of(member, &view),
            banned,
            admission,
            coverage: view.coverage.as_deref().map(CoverageReport::from_message),
            peers,
            openai_base_url: Some(format!("{}/v1", member.public_url())),
            route_boundaries: member.route_boundaries(),
        }
    }
}

/// The member's state as `/metrics` reads it at each scrape.
pub(crate) struct MemberGauges(pub(crate) std::sync::Arc<Member>);

impl meshnet_metrics::LiveSource for MemberGauges {
    fn sample(&self) -> meshnet_metrics::LiveSample {
        let member = &self.0;
        let host = &member.host;
        let (kv_used_bytes, kv_free_bytes) = host.kv_bytes();
        let load_progress = match host.progress().get() {
            Some((done, total)) => done as f64 / total.max(1) as f64,
            None => 1.0,
        };
        meshnet_metrics::LiveSample {
            active_sessions: member.active_sessions() as u64,
            queued_sessions: member
                .tracker_parts()
                .map_or(0, |parts| parts.engine.queued_sessions() as u64),
            kv_used_bytes,
            kv_free_bytes,
            load_progress,
            served_layers: host
                .current()
                .map_or(0, |held_span| u64::from(held_span.target.layers.len())),
        }
    }
}

impl PeerReport {
    /// A known peer as of `now`.
    fn of(member: &Member, known: &KnownPeer, table: &RouteTable, now: Instant) -> Self {
        let a = &known.announcement;
        PeerReport {
            peer: a.peer.clone(),
            http: a.http_endpoints.first().cloned(),
            path: path_to(member, a),
            span: a.span.clone(),
            memory_bytes: a.memory_bytes,
            quantizations: a.quantizations.clone(),
            throughput: a.throughput,
            active_sessions: a.active_sessions,
            free_kv_tokens: a.free_kv_tokens,
            last_seen_ms: now.saturating_duration_since(known.last_seen).as_millis() as u64,
            forward_latency_ms: a.forward_latency_ms,
            leaving: a.leaving,
            verified_sessions: table.verified_sessions(&a.peer),
        }
    }
}

#[cfg(test)]
mod tests {
    use meshnet_types::LayerSpan;

    use super::*;
    use crate::batcher::BatchingReport;
    use crate::verify::{Evidence, Testimony};

    fn span(start: u32, end: u32, state: SpanState) -> SpanStatus {
        SpanStatus {
            layers: LayerSpan::new(start, end),
            quantization: Quantization::Q4_1,
            state,
        }
    }

    fn holder(peer: &str, state: SpanState) -> HolderReport {
        HolderReport {
            peer: peer.into(),
            state,
            quantization: Quantization::Q8_0,
        }
    }

    /// A tracker's report with every optional part present.
    fn tracker_report() -> StatusReport {
        let testimony = |peer: &str, digest: &str| Testimony {
            peer: peer.into(),
            output_sha256: digest.to_owned(),
        };
        StatusReport {
            peer: "tracker".into(),
            role: Role::Tracker,
            version: "0.1.0".to_owned(),
            model: ModelReport {
                id: "tiny-0123".to_owned(),
                layers: 4,
            },
            http: Some("http://127.0.0.1:8080".to_owned()),
            p2p: vec!["/ip4/127.0.0.1/tcp/4001".to_owned()],
            span: Some(span(0, 2, SpanState::Ready)),
            loading: Some(span(0, 4, SpanState::Loading)),
            active_sessions: 3,
            free_kv_tokens: 2048,
            tracker: Some("tracker".into()),
            tracker_http: Some("http://127.0.0.1:8080".to_owned()),
            term: 2,
            succession: vec!["a".into(), "b".into()],
            announce_interval_ms: 2000,
            rejected_messages: 1,
            recent_rejections: vec![RejectionReport {
                from: "stranger".into(),
                topic: "identify".to_owned(),
                reason: "serves another model".to_owned(),
            }],
            failovers: 4,
            checked_sessions: 12,
            convictions: 1,
            leaving: true,
            forward_latency_ms: 3.4,
            gossip: meshnet_p2p::GossipTraffic {
                published_messages: 120,
                published_bytes: 31_200,
                received_messages: 480,
                received_bytes: 98_400,
            },
            network: NetworkReport {
                reachability: Reachability::Private,
                relayed_addresses: vec!["/ip4/10.0.0.1/tcp/4001/p2p-circuit".to_owned()],
                paths: [
                    ("a", MemberPath::DirectHttp),
                    ("b", MemberPath::DirectP2p),
                    ("c", MemberPath::Relayed),
                    ("d", MemberPath::NotConnected),
                ]
                .into_iter()
                .map(|(peer, path)| (peer.into(), path))
                .collect(),
            },
            banned: Some(vec![BanReport {
                peer: "cheat".into(),
                cause: "returned wrong activations".to_owned(),
                since_ms: 5000,
                remaining_ms: 86_395_000,
                evidence: Some(Evidence {
                    session: "5f0c".to_owned(),
                    position: 37,
                    tokens: 1,
                    layers: LayerSpan::new(2, 4),
                    convicted: testimony("cheat", "9b1e"),
                    witness: testimony("a", "41c7"),
                    arbiter: testimony("b", "41c7"),
                }),
            }]),
            batching: Some(BatchingReport {
                passes: 5120,
                requests: 31_870,
                largest_pass: 8,
                max_batch_tokens: 256,
            }),
            admission: Some(AdmissionReport {
                max_sessions: 8,
                running: 3,
                queued: 2,
                max_queued: 32,
                queue_timeout_ms: 60_000,
            }),
            coverage: Some(CoverageReport {
                epoch: 1_796_014_421_873,
                complete: true,
                layers: vec![
                    LayerReport {
                        layer: 0,
                        holders: vec![holder("tracker", SpanState::Ready)],
                    },
                    LayerReport {
                        layer: 1,
                        holders: vec![
                            holder("a", SpanState::Ready),
                            holder("b", SpanState::Loading),
                        ],
                    },
                ],
            }),
            peers: Some(vec![PeerReport {
                peer: "a".into(),
                http: None,
                path: MemberPath::DirectP2p,
                span: Some(span(2, 4, SpanState::Ready)),
                memory_bytes: 67_108_864,
                quantizations: vec![Quantization::Q4_1, Quantization::Bf16],
                throughput: 1830.5,
                active_sessions: 2,
                free_kv_tokens: 20_480,
                last_seen_ms: 212,
                forward_latency_ms: 2.25,
                leaving: false,
                verified_sessions: 12,
            }]),
            openai_base_url: Some("http://127.0.0.1:8080/v1".to_owned()),
            route_boundaries: Some(vec![2, 4]),
        }
    }

    fn round_trip(report: &StatusReport) -> StatusReport {
        let json = serde_json::to_string(report).unwrap();
        serde_json::from_str(&json).unwrap_or_else(|error| panic!("{error} in {json}"))
    }

    #[test]
    fn a_report_comes_back_from_its_json_unchanged() {
        let tracker = tracker_report();
        assert_eq!(round_trip(&tracker), tracker);

        // A peer's report: the tracker-only parts are left out of the JSON and come back
        // absent.
        let peer = StatusReport {
            role: Role::Peer,
            tracker: Some("elsewhere".into()),
            banned: None,
            admission: None,
            peers: None,
            route_boundaries: None,
            loading: None,
            batching: None,
            coverage: None,
            ..tracker
        };
        let json = serde_json::to_value(&peer).unwrap();
        for absent in ["banned", "admission", "peers", "route_boundaries"] {
            assert!(json.get(absent).is_none(), "{absent} in {json}");
        }
        assert_eq!(round_trip(&peer), peer);
    }

    #[test]
    fn names_in_the_json_are_the_documented_ones() {
        let json = serde_json::to_value(tracker_report()).unwrap();
        assert_eq!(json["role"], "tracker");
        assert_eq!(json["version"], "0.1.0");
        assert_eq!(json["network"]["reachability"], "private");
        assert_eq!(
            json["network"]["paths"],
            serde_json::json!({"a": "direct-http", "b": "direct-p2p", "c": "relayed",
                               "d": "not-connected"})
        );
        assert_eq!(json["peers"][0]["path"], "direct-p2p");
        for (role, name) in [(Role::Tracker, "tracker"), (Role::Peer, "peer")] {
            assert_eq!(serde_json::to_value(role).unwrap(), name);
            assert_eq!(role.as_str(), name);
        }
        for path in [
            MemberPath::DirectHttp,
            MemberPath::DirectP2p,
            MemberPath::Relayed,
            MemberPath::NotConnected,
        ] {
            assert_eq!(serde_json::to_value(path).unwrap(), path.as_str());
        }
        for hop in [HopPath::DirectHttp, HopPath::DirectP2p, HopPath::Relayed] {
            assert_eq!(MemberPath::from(hop).as_str(), hop.as_str());
        }
    }

    #[test]
    fn a_report_missing_a_field_is_refused() {
        let mut json = serde_json::to_value(tracker_report()).unwrap();
        json.as_object_mut().unwrap().remove("term");
        let error = serde_json::from_value::<StatusReport>(json).unwrap_err();
        assert!(
            error.to_string().contains("missing field `term`"),
            "{error}"
        );
    }
}
