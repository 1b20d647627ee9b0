//! The JSON of `GET /status`: this peer's own state, and on the tracker the coverage map and
//! the peers it knows (documented in docs/status.md). [`StatusReport::of`] is the one mapping
//! from a running member to it; it only reads.

use std::sync::atomic::Ordering;
use std::time::Instant;

use meshnet_metrics::HopPath;
use meshnet_p2p::{CoverageMessage, SpanStatus};
use meshnet_types::{PeerId, Quantization, SpanState};
use serde::Serialize;

use crate::engine::MeshEngine;
use crate::locking::lock;
use crate::member::{Member, MeshView};
pub use crate::rejections::RejectionReport;
use crate::tracker::{KnownPeer, TrackerBook};

/// Everything `GET /status` reports.
#[derive(Clone, Debug, Serialize)]
pub struct StatusReport {
    /// This peer's id.
    pub peer: PeerId,
    /// `tracker` or `peer`.
    pub role: &'static str,
    /// The software version.
    pub version: &'static str,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub banned: Option<Vec<BanReport>>,
    /// What the current span's compute thread has done: passes over the weights and the
    /// sessions' requests they answered together.
    pub batching: Option<crate::batcher::BatchingReport>,
    /// Generation slots and the line for them (tracker only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionReport>,
    /// The coverage map (the tracker's own; on other peers, the last one received).
    pub coverage: Option<CoverageReport>,
    /// The peers the tracker knows (tracker only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<Vec<PeerReport>>,
    /// Where this member answers the OpenAI-style API: the tracker itself, any other member
    /// by passing requests on to the tracker it follows.
    pub openai_base_url: Option<String>,
    /// The span boundaries of the route a generation takes now (tracker only), as
    /// `meshnet-peer generate --boundaries` takes them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route_boundaries: Option<Vec<u32>>,
}

/// The tracker's generation slots and the line for them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<crate::verify::Evidence>,
}

/// The model's identity.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    /// Name and content hash.
    pub id: String,
    /// Transformer layers.
    pub layers: u32,
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
    pub peer: PeerId,
    /// `loading` or `ready`.
    pub state: SpanState,
    /// Its weight format.
    pub quantization: Quantization,
}

/// How a member is reached and how it reaches the members it knows.
#[derive(Clone, Debug, Serialize)]
pub struct NetworkReport {
    /// Whether others can dial it: `public` (started `--reachable`, or AutoNAT says so),
    /// `private` (AutoNAT says not) or `unknown`. Unless public, it reserves relay slots.
    pub reachability: &'static str,
    /// Its relayed (`/p2p-circuit`) addresses, one per relay holding a reservation for it.
    pub relayed_addresses: Vec<String>,
    /// Every other member it has heard from, and how activations from here reach it:
    /// `direct-http` (its announced HTTP endpoint), `direct-p2p` (a libp2p stream over a
    /// direct connection, dialed or punched through NATs), `relayed` (a libp2p stream through a
    /// relay) or `not-connected` (a libp2p stream once a connection is made).
    pub paths: std::collections::BTreeMap<PeerId, &'static str>,
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
            reachability: member.p2p.reachability().as_str(),
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
fn path_to(member: &Member, announcement: &meshnet_p2p::PeerAnnouncement) -> &'static str {
    if !announcement.http_endpoints.is_empty() {
        return HopPath::DirectHttp.as_str();
    }
    match member.p2p.path_to(&announcement.peer) {
        Some(path) => crate::p2p_plane::hop_path(Some(path)).as_str(),
        None => "not-connected",
    }
}

/// A peer as the tracker knows it.
#[derive(Clone, Debug, Serialize)]
pub struct PeerReport {
    /// Its id.
    pub peer: PeerId,
    /// Its activation-plane base URL.
    pub http: Option<String>,
    /// How activations reach it from the tracker: `direct-http` to its announced endpoint, or
    /// over libp2p: `direct-p2p`, `relayed` or `not-connected` (see [`NetworkReport::paths`]).
    pub path: &'static str,
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
    /// The bans of `book` running at `now`.
    fn all(book: &TrackerBook, now: Instant) -> Vec<BanReport> {
        book.bans(now)
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
        let peers = tracker.as_ref().map(|parts| {
            let book = lock(&parts.book);
            book.peers()
                .values()
                .map(|known| PeerReport::of(member, known, &book, now))
                .collect()
        });
        let banned = tracker
            .as_ref()
            .map(|parts| BanReport::all(&lock(&parts.book), now));
        let admission = tracker
            .as_ref()
            .map(|parts| AdmissionReport::of(&parts.engine));
        let view = member.view();
        let mut following = view.following.clone();
        if let Some(parts) = &tracker {
            let book = lock(&parts.book);
            following.term = book.term();
            following.succession = book.succession(now);
        }
        StatusReport {
            peer: member.peer_id.clone(),
            role: if tracker.is_some() { "tracker" } else { "peer" },
            version: env!("CARGO_PKG_VERSION"),
            model: ModelReport {
                id: member.model.id().to_owned(),
                layers: member.model.num_layers(),
            },
            http: member.http_url.clone(),
            p2p: lock(&member.p2p_addrs).clone(),
            span: host
                .current()
                .map(|shard| shard.target.status(SpanState::Ready)),
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
            rejected_messages: member.rejected.load(Ordering::Relaxed),
            recent_rejections: lock(&member.recent_rejections).iter().cloned().collect(),
            failovers: member.metrics.failovers(),
            checked_sessions: member.metrics.checked_sessions(),
            convictions: member.metrics.convictions(),
            leaving: member.leaving.load(Ordering::Relaxed),
            forward_latency_ms: host.forward_latency_ms(),
            batching: host.current().map(|shard| shard.batching()),
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
                .map_or(0, |shard| u64::from(shard.target.layers.len())),
        }
    }
}

impl PeerReport {
    /// A known peer as of `now`.
    fn of(member: &Member, known: &KnownPeer, book: &TrackerBook, now: Instant) -> Self {
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
            verified_sessions: book.verified_sessions(&a.peer),
        }
    }
}
