//! What a running member shares between its HTTP handlers and its control loop: its
//! identity, its role, its span slot, and what it last heard from the mesh.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use meshnet_p2p::{CoverageMessage, PeerAnnouncement};
use meshnet_types::{PeerId, Quantization};
use meshnet_wire::WIRE_VERSION;

use crate::engine::MeshEngine;
use crate::mesh_model::MeshModel;
use crate::shard::ShardHost;
use crate::status::RejectionReport;
use crate::tracker::{TrackerBook, route_boundaries};

/// The part a member plays. Only a tracker has a book of peers and an OpenAI engine, so a
/// peer holding either cannot be written down.
pub(crate) enum Role {
    /// Plans the mesh, holds the first layers and answers the OpenAI-style API.
    Tracker(TrackerParts),
    /// Serves the span the tracker assigns.
    Peer,
}

/// What only the tracker has.
pub(crate) struct TrackerParts {
    /// The peers it hears from, the plan and the routes.
    pub(crate) book: Arc<Mutex<TrackerBook>>,
    /// The completion engine behind the API.
    pub(crate) engine: Arc<MeshEngine>,
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

/// State shared by the HTTP handlers and the control loop.
pub(crate) struct Member {
    pub(crate) peer_id: PeerId,
    pub(crate) role: Role,
    pub(crate) model: Arc<MeshModel>,
    pub(crate) host: Arc<ShardHost>,
    pub(crate) http_url: String,
    pub(crate) offer: Offer,
    /// Tokens per second measured after the last load.
    pub(crate) throughput: Mutex<f64>,
    /// The coverage map: the tracker's own, or the last one received.
    pub(crate) coverage: Mutex<Option<CoverageMessage>>,
    /// The tracker this member follows.
    pub(crate) tracker: Mutex<Option<PeerId>>,
    /// libp2p addresses it listens on.
    pub(crate) p2p_addrs: Mutex<Vec<String>>,
    /// Gossip messages and peers refused.
    pub(crate) rejected: AtomicU64,
    /// The latest refusals, newest last, at most [`RECENT_REJECTIONS`].
    pub(crate) recent_rejections: Mutex<VecDeque<RejectionReport>>,
}

/// How many refusals `/status` lists.
pub(crate) const RECENT_REJECTIONS: usize = 16;

/// Locks a mutex, taking the data of a poisoned one (a panicked holder leaves it usable).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Member {
    /// The tracker's parts, when this member is the tracker.
    pub(crate) fn tracker_parts(&self) -> Option<&TrackerParts> {
        match &self.role {
            Role::Tracker(parts) => Some(parts),
            Role::Peer => None,
        }
    }

    /// Whether this member is the tracker.
    pub(crate) fn is_tracker(&self) -> bool {
        matches!(self.role, Role::Tracker(_))
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
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let mut recent = lock(&self.recent_rejections);
        if recent.len() == RECENT_REJECTIONS {
            recent.pop_front();
        }
        recent.push_back(rejection);
    }

    /// What this member tells the mesh about itself now.
    pub(crate) fn announcement(&self) -> PeerAnnouncement {
        PeerAnnouncement {
            peer: self.peer_id.clone(),
            model_id: self.model.id().to_owned(),
            software_version: env!("CARGO_PKG_VERSION").to_owned(),
            wire_version: WIRE_VERSION,
            http_endpoints: vec![self.http_url.clone()],
            memory_bytes: self.offer.memory_bytes,
            quantizations: self.offer.quantizations.clone(),
            throughput: *lock(&self.throughput),
            kv_tokens: self.offer.kv_tokens,
            span: self.host.span_status(),
            free_kv_tokens: self.host.free_kv_tokens(),
            active_sessions: u32::try_from(self.active_sessions()).unwrap_or(u32::MAX),
            is_tracker: self.is_tracker(),
            sent_at_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        }
    }

    /// The span boundaries of the route a generation takes now (tracker only, when the mesh
    /// covers the model).
    pub(crate) fn route_boundaries(&self) -> Option<Vec<u32>> {
        let parts = self.tracker_parts()?;
        let entry = self.host.current().filter(|s| s.target.entry)?;
        let start = entry.target.layers.end;
        let hops = lock(&parts.book).route(start).ok()?;
        Some(route_boundaries(start, &hops))
    }

    /// Whether this member does its job now: the tracker when the mesh covers the model, a
    /// peer when it serves a ready span.
    pub(crate) fn health(&self) -> Result<&'static str, &'static str> {
        match &self.role {
            Role::Tracker(_) => match self.route_boundaries() {
                Some(_) => Ok("the mesh covers the model"),
                None => Err("the mesh does not cover the model yet"),
            },
            Role::Peer => match self.host.current() {
                Some(_) => Ok("serving a span"),
                None => Err("no span assigned yet"),
            },
        }
    }
}
