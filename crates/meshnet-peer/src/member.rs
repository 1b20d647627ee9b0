//! What a running member shares between its HTTP handlers and its control loop: its
//! identity and settings (fixed), its span slot, what the control loop last published of the
//! mesh and of itself ([`MeshView`]), and its role and leaving (changed only through its
//! methods).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use meshnet_p2p::{CoverageMessage, PeerAnnouncement};
use meshnet_types::{PeerId, Quantization};
use meshnet_wire::WIRE_VERSION;

use crate::book_routes::PublishedRoutes;
use crate::engine::MeshEngine;
use crate::mesh_model::MeshModel;
use crate::rejections::{RejectionReport, Rejections};
use crate::routing::MeshRoutes;
use crate::span_host::SpanHost;
use crate::tracker::route_boundaries;

/// The part a member plays. Only a tracker has a book of peers and an OpenAI engine, so a
/// peer holding either cannot be written down.
pub(crate) enum Role {
    /// Plans the mesh, holds the first layers and answers the OpenAI-style API.
    Tracker(TrackerParts),
    /// Serves the span the tracker assigns.
    Peer,
}

/// What only the tracker has.
#[derive(Clone)]
pub(crate) struct TrackerParts {
    /// What its book of peers last published: routes, bans, peers.
    pub(crate) routes: Arc<PublishedRoutes>,
    /// The completion engine behind the API.
    pub(crate) engine: Arc<MeshEngine>,
    /// The OpenAI-style API over `engine`.
    pub(crate) api: axum::Router,
}

/// The tracker this member follows, as its coverage maps tell.
#[derive(Clone, Debug, Default)]
pub(crate) struct Following {
    /// The tracker.
    pub(crate) tracker: Option<PeerId>,
    /// Its HTTP base URL (where it answers the API), as its coverage map or record names it.
    pub(crate) tracker_http: Option<String>,
    /// Its term.
    pub(crate) term: u64,
    /// Who may take over from it.
    pub(crate) succession: Vec<PeerId>,
    /// When its last coverage map arrived.
    pub(crate) heard_at: Option<Instant>,
}

/// What a member knows of the mesh at one moment: the tracker it follows, that tracker's
/// latest coverage map, and the latest announcement of every member heard. The control loop
/// is its only writer and publishes each change as a new snapshot; everyone else reads
/// snapshots, so a reader never sees a new tracker beside an old map.
#[derive(Clone, Debug, Default)]
pub(crate) struct MeshView {
    /// The tracker followed, its term and succession list.
    pub(crate) following: Following,
    /// The coverage map: the tracker's own, or the last one received.
    pub(crate) coverage: Option<Arc<CoverageMessage>>,
    /// The latest announcement of every member heard, and when it arrived.
    pub(crate) seen: Arc<BTreeMap<PeerId, (PeerAnnouncement, Instant)>>,
    /// How often this member announces: its own interval, or the longer one its tracker
    /// advertises for a large mesh.
    pub(crate) announce_every: Duration,
    /// The libp2p addresses this member listens on.
    pub(crate) listen_addrs: Arc<Vec<String>>,
    /// Tokens per second through the span held now, from the best measurement of its format.
    pub(crate) throughput: f64,
}

impl MeshView {
    /// The view of a member that starts as the tracker (`peer_id`, term 1) or as a peer that
    /// knows nobody yet, announcing every `announce_interval`.
    pub(crate) fn at_start(
        tracker: bool,
        peer_id: &PeerId,
        announce_interval: Duration,
        listen_addrs: Vec<String>,
    ) -> Self {
        MeshView {
            listen_addrs: Arc::new(listen_addrs),
            throughput: 1.0,
            following: Following {
                tracker: tracker.then(|| peer_id.clone()),
                term: u64::from(tracker),
                ..Following::default()
            },
            announce_every: announce_interval,
            ..MeshView::default()
        }
    }
}

/// Settings a member needs if it takes the tracker role later.
pub(crate) struct Settings {
    /// Seconds between announcements; three silent ones end a peer (or the tracker).
    pub(crate) announce_interval: Duration,
    /// Generations the tracker runs and keeps waiting.
    pub(crate) admission: crate::admission::AdmissionLimits,
    /// How generations get past a failed hop.
    pub(crate) failover: crate::remote::FailoverPolicy,
    /// Which of the tracker's sessions are checked against second holders.
    pub(crate) verify: crate::verify::VerifyPolicy,
    /// Chunks of one prompt the tracker keeps travelling through the hops at once.
    pub(crate) prefill_in_flight: usize,
    /// The most tokens the tracker drafts per trip (0: no speculative decoding).
    pub(crate) max_draft: usize,
    /// Whether the tracker's drafts pass the draft gate (ADR-0035).
    pub(crate) gate_drafts: bool,
    /// Whether this member may take over the tracker role.
    pub(crate) tracker_capable: bool,
    /// The activation-plane client the engine sends with.
    pub(crate) client: meshnet_node::ForwardClient,
    /// Signs the grants of the generations it runs as tracker.
    pub(crate) grants: Arc<crate::grants::GrantSigner>,
    /// The chat template file that replaces the model's own, if one was given.
    pub(crate) chat_template: Option<std::path::PathBuf>,
    /// The outputs of routes this member's generations await on `POST /return`.
    pub(crate) returns: Arc<meshnet_node::ReturnDesk>,
    /// Where the last hops of this member's routes post their outputs (its own activation
    /// plane, as others reach it); `None` sends them back along the route.
    pub(crate) return_endpoint: Option<meshnet_wire::Endpoint>,
}

/// What this member offers the mesh, as announced.
pub(crate) struct Offer {
    /// Memory given to the mesh, in bytes.
    pub(crate) memory_bytes: u64,
    /// Formats it may hold layers in.
    pub(crate) quantizations: Vec<Quantization>,
    /// KV tokens reserved per held layer.
    pub(crate) kv_tokens: u64,
}

/// What changes in a member besides its view of the mesh, behind [`Member`]'s methods: its
/// role, whether it is leaving, and its announcements' send times.
pub(crate) struct Lifecycle {
    role: RwLock<Role>,
    /// Set once the member is shutting down: it announces `leaving` and takes no new work.
    leaving: AtomicBool,
    /// Wakes the control loop to announce at once (rather than at its next tick).
    announce_now: tokio::sync::Notify,
    /// The send time of the last announcement (ms since the Unix epoch): each is later than
    /// the one before, since members ignore one not newer than what they accepted.
    last_announced_ms: AtomicU64,
}

impl Lifecycle {
    /// A member starting in `role`, not leaving.
    pub(crate) fn new(role: Role) -> Self {
        Lifecycle {
            role: RwLock::new(role),
            leaving: AtomicBool::new(false),
            announce_now: tokio::sync::Notify::new(),
            last_announced_ms: AtomicU64::new(0),
        }
    }
}

/// State shared by the HTTP handlers and the control loop.
pub(crate) struct Member {
    pub(crate) peer_id: PeerId,
    /// Its role and leaving.
    pub(crate) lifecycle: Lifecycle,
    pub(crate) settings: Settings,
    pub(crate) model: Arc<MeshModel>,
    pub(crate) host: Arc<SpanHost>,
    /// The HTTP base URL others reach this member at directly; `None` when they cannot dial
    /// it (they reach it over libp2p streams).
    pub(crate) http_url: Option<String>,
    /// The HTTP base URL of this member's own listener, as seen from this machine.
    pub(crate) local_url: String,
    pub(crate) offer: Offer,
    /// What it knows of the mesh, as the control loop last published it.
    pub(crate) view: tokio::sync::watch::Receiver<MeshView>,
    /// Gossip messages and peers refused (counted by the control loop).
    pub(crate) rejections: Rejections,
    /// Where this member counts what `/metrics` exports (failovers, tokens, directives...).
    pub(crate) metrics: meshnet_metrics::Metrics,
    /// Passes API requests on to the tracker when this member is not it.
    pub(crate) proxy: reqwest::Client,
    /// The control plane (for its gossip counts).
    pub(crate) p2p: meshnet_p2p::P2pHandle,
    /// Round trips to the other members (the prober is its only writer).
    pub(crate) rtt: crate::latency::RttBook,
}

/// The send time of an announcement made at `now_ms` after the one recorded in `last`, which
/// it replaces: `now_ms`, or one more than the last when the clock has not moved past it (two
/// announcements in one millisecond, a clock stepped back).
fn next_announcement_time(last: &AtomicU64, now_ms: u64) -> u64 {
    let previous = last
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(now_ms.max(last + 1))
        })
        .unwrap_or_default();
    now_ms.max(previous + 1)
}

impl Member {
    /// A snapshot of what this member knows of the mesh now.
    pub(crate) fn view(&self) -> MeshView {
        self.view.borrow().clone()
    }

    /// The tracker's parts, when this member is the tracker.
    pub(crate) fn tracker_parts(&self) -> Option<TrackerParts> {
        match &*self
            .lifecycle
            .role
            .read()
            .unwrap_or_else(PoisonError::into_inner)
        {
            Role::Tracker(parts) => Some(parts.clone()),
            Role::Peer => None,
        }
    }

    /// Whether this member is the tracker.
    pub(crate) fn is_tracker(&self) -> bool {
        self.tracker_parts().is_some()
    }

    /// Takes the tracker role with `parts`, or gives it up (`None`).
    pub(crate) fn set_role(&self, parts: Option<TrackerParts>) {
        *self
            .lifecycle
            .role
            .write()
            .unwrap_or_else(PoisonError::into_inner) = match parts {
            Some(parts) => Role::Tracker(parts),
            None => Role::Peer,
        };
    }

    /// What this member offers the planner (as the tracker when `is_tracker`).
    pub(crate) fn capacity(&self, is_tracker: bool) -> meshnet_planner::PeerCapacity {
        meshnet_planner::PeerCapacity {
            peer: self.peer_id.clone(),
            memory_bytes: self.offer.memory_bytes,
            quantizations: self.offer.quantizations.clone(),
            throughput: self.view.borrow().throughput.max(f64::MIN_POSITIVE),
            kv_tokens: self.offer.kv_tokens,
            is_tracker,
        }
    }

    /// The tracker's HTTP base URL: this member's own on the tracker, else the one the
    /// followed tracker's coverage map (or record) names, else its latest announcement's.
    pub(crate) fn tracker_url(&self) -> Option<String> {
        if self.is_tracker() {
            return Some(self.public_url());
        }
        let view = self.view.borrow();
        let tracker = view.following.tracker.as_ref()?;
        if let Some(url) = view
            .following
            .tracker_http
            .as_ref()
            .filter(|url| !url.is_empty())
        {
            return Some(url.clone());
        }
        let (announcement, _) = view.seen.get(tracker)?;
        announcement.http_endpoints.first().cloned()
    }

    /// Where clients and members reach this member's HTTP server: its announced URL, else its
    /// own listener's (on a member nobody can dial, only this machine can use it).
    pub(crate) fn public_url(&self) -> String {
        self.http_url
            .clone()
            .unwrap_or_else(|| self.local_url.clone())
    }

    /// The libp2p addresses this member announces: its relayed addresses when others cannot
    /// dial it, else where it listens.
    pub(crate) fn p2p_addresses(&self) -> Vec<String> {
        let circuits = self.p2p.circuit_addresses();
        if self.p2p.reachability() != meshnet_p2p::Reachability::Public && !circuits.is_empty() {
            return circuits.iter().map(ToString::to_string).collect();
        }
        self.view.borrow().listen_addrs.to_vec()
    }

    /// The tracker this member follows now, if it found one.
    pub(crate) fn followed_tracker(&self) -> Option<PeerId> {
        self.view.borrow().following.tracker.clone()
    }

    /// Whether `peer` is a member of the mesh: this member's tracker, or a holder in the
    /// latest coverage map. Only members may send activations over libp2p.
    pub(crate) fn is_mesh_member(&self, peer: &PeerId) -> bool {
        let view = self.view.borrow();
        if view.following.tracker.as_ref() == Some(peer) {
            return true;
        }
        view.coverage.as_ref().is_some_and(|coverage| {
            coverage
                .map
                .holdings
                .iter()
                .any(|holding| &holding.peer == peer)
        })
    }

    /// Sessions running here: generations on the tracker, KV sessions on any span.
    pub(crate) fn active_sessions(&self) -> usize {
        let generations = self
            .tracker_parts()
            .map_or(0, |parts| parts.engine.active_sessions());
        generations.max(self.host.active_sessions())
    }

    /// Counts a refused gossip message or peer and keeps it among the recent ones (both shown
    /// in `/status`).
    pub(crate) fn count_rejection(&self, rejection: RejectionReport) {
        self.rejections.count(rejection);
    }

    /// Whether this member is leaving the mesh.
    pub(crate) fn is_leaving(&self) -> bool {
        self.lifecycle.leaving.load(Ordering::Relaxed)
    }

    /// Starts leaving the mesh: from now on it announces `leaving`, the first time at once.
    pub(crate) fn start_leaving(&self) {
        self.lifecycle.leaving.store(true, Ordering::Relaxed);
        self.lifecycle.announce_now.notify_one();
    }

    /// Waits until someone asks for an announcement before the next tick.
    pub(crate) async fn announce_requested(&self) {
        self.lifecycle.announce_now.notified().await;
    }

    /// Whether every layer this member serves is also served, ready, by another member in
    /// the latest coverage map (true when it serves none): it can leave without a gap.
    pub(crate) fn covered_by_others(&self) -> bool {
        let Some(mine) = self.host.current().map(|held_span| held_span.target.layers) else {
            return true;
        };
        let view = self.view.borrow();
        let Some(coverage) = view.coverage.as_ref() else {
            return false;
        };
        (mine.start..mine.end).all(|layer| {
            coverage.map.holdings.iter().any(|holding| {
                holding.peer != self.peer_id
                    && holding.state == meshnet_types::SpanState::Ready
                    && holding.layers.contains(layer)
            })
        })
    }

    /// The members whose round trips this member measures: every other member heard from
    /// that is not leaving, at its announced activation plane (HTTP when it gave one, else a
    /// libp2p stream).
    pub(crate) fn probe_targets(&self) -> Vec<(PeerId, meshnet_wire::Endpoint)> {
        let view = self.view.borrow();
        view.seen
            .values()
            .filter(|(announcement, _)| announcement.peer != self.peer_id && !announcement.leaving)
            .map(|(announcement, _)| {
                let endpoint = announcement
                    .http_endpoints
                    .first()
                    .and_then(|url| url.parse().ok())
                    .unwrap_or_else(|| meshnet_wire::Endpoint::Peer(announcement.peer.clone()));
                (announcement.peer.clone(), endpoint)
            })
            .collect()
    }

    /// What this member tells the mesh about itself now.
    pub(crate) fn announcement(&self) -> PeerAnnouncement {
        let throughput = self.view.borrow().throughput;
        PeerAnnouncement {
            peer: self.peer_id.clone(),
            model_id: self.model.id().to_owned(),
            software_version: env!("CARGO_PKG_VERSION").to_owned(),
            wire_version: WIRE_VERSION,
            http_endpoints: self.http_url.iter().cloned().collect(),
            p2p_addresses: self.p2p_addresses(),
            memory_bytes: self.offer.memory_bytes,
            quantizations: self.offer.quantizations.clone(),
            throughput,
            kv_tokens: self.offer.kv_tokens,
            span: self.host.span_status(),
            free_kv_tokens: self.host.free_kv_tokens(),
            active_sessions: u32::try_from(self.active_sessions()).unwrap_or(u32::MAX),
            is_tracker: self.is_tracker(),
            tracker_capable: self.settings.tracker_capable,
            forward_latency_ms: self.host.forward_latency_ms(),
            leaving: self.is_leaving(),
            sent_at_unix_ms: self.announcement_time(),
            tracker_silent_ms: self
                .tracker_silence()
                .map(|silence| silence.as_millis() as u64),
            rtt_ms: self.rtt.nearest(),
        }
    }

    /// How long since this member last heard its tracker's coverage map (`None` on the tracker,
    /// or while it follows none).
    fn tracker_silence(&self) -> Option<Duration> {
        if self.is_tracker() {
            return None;
        }
        self.view.borrow().following.heard_at.map(|at| at.elapsed())
    }

    /// The send time of a new announcement: the clock in ms since the Unix epoch.
    fn announcement_time(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        next_announcement_time(&self.lifecycle.last_announced_ms, now)
    }

    /// The span boundaries of the route a generation takes now (tracker only, when the mesh
    /// covers the model).
    pub(crate) fn route_boundaries(&self) -> Option<Vec<u32>> {
        let parts = self.tracker_parts()?;
        let entry = self.host.current().filter(|s| s.target.entry)?;
        let start = entry.target.layers.end;
        let hops = parts.routes.route(start, &[]).ok()?;
        Some(route_boundaries(start, &hops))
    }

    /// Whether this member does its job now: the tracker when the mesh covers the model, a
    /// peer when it serves a ready span.
    pub(crate) fn health(&self) -> Result<&'static str, &'static str> {
        if self.is_tracker() {
            match self.route_boundaries() {
                Some(_) => Ok("the mesh covers the model"),
                None => Err("the mesh does not cover the model yet"),
            }
        } else {
            match self.host.current() {
                Some(_) => Ok("serving a span"),
                None => Err("no span assigned yet"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_announcement_is_sent_later_than_the_one_before() {
        let last = AtomicU64::new(0);
        assert_eq!(next_announcement_time(&last, 1_000), 1_000);
        // Same millisecond, then a clock that stepped back: still later each time.
        assert_eq!(next_announcement_time(&last, 1_000), 1_001);
        assert_eq!(next_announcement_time(&last, 900), 1_002);
        assert_eq!(next_announcement_time(&last, 5_000), 5_000);
        assert_eq!(last.load(Ordering::Relaxed), 5_000);
    }
}
