//! Events the control plane reports to the application.

use libp2p::Multiaddr;
use meshnet_types::PeerId;

use crate::messages::{CoverageMessage, DirectiveMessage, PeerAnnouncement, TrackerRecord};

/// A domain event from the control plane (never a raw libp2p event).
#[derive(Debug, Clone, PartialEq)]
pub enum P2pEvent {
    /// A validated announcement from another peer.
    Announcement {
        /// The signed originator (equal to `announcement.peer`).
        from: PeerId,
        /// What the peer announced.
        announcement: PeerAnnouncement,
    },
    /// A coverage map published by the authorised tracker.
    Coverage {
        /// The tracker that signed it.
        from: PeerId,
        /// The map.
        coverage: CoverageMessage,
    },
    /// Directives from the authorised tracker addressed to this node.
    Directive {
        /// The tracker that signed them.
        from: PeerId,
        /// The directives.
        directive: DirectiveMessage,
    },
    /// The Kademlia tracker record was found or names a new tracker.
    TrackerDiscovered(TrackerRecord),
    /// A gossip message failed validation and was not propagated.
    Rejected {
        /// The signed originator (or the forwarding peer if unsigned).
        from: PeerId,
        /// The gossipsub topic it arrived on.
        topic: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The first connection to a peer was established.
    PeerConnected(PeerId),
    /// The last connection to a peer was closed.
    PeerDisconnected(PeerId),
    /// The node listens on a new address.
    ListeningOn(Multiaddr),
    /// A peer runs another model (its model id differs); it was disconnected.
    ModelMismatch {
        /// The peer.
        peer: PeerId,
        /// The model id it runs.
        model: String,
        /// Whether this node cannot join its mesh because of it: the peer is this node's
        /// tracker, or this node has no contact running its own model yet.
        decisive: bool,
    },
    /// This node's election changed who leads the mesh. Reported before the coverage map
    /// that changed it.
    Leadership(Leadership),
    /// AutoNAT's verdict on whether this node is reachable from the internet.
    Reachability {
        /// `true` when reachable.
        public: bool,
    },
}

/// Who leads the mesh, as this node's election decides: the only place a member learns that
/// it leads or must stop leading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// This node leads the mesh as the tracker of `term` (it claimed the role).
    Leads {
        /// The term it leads.
        term: u64,
    },
    /// This node follows `tracker`, whose coverage map of `term` it accepted.
    Follows {
        /// The tracker.
        tracker: PeerId,
        /// Its term.
        term: u64,
        /// Whether this node led until now: it must stop planning.
        stepped_down: bool,
    },
}

#[cfg(test)]
impl P2pEvent {
    /// The event of an announcement by `peer` (a minimal one) sent at `sent_at` on its clock.
    pub(crate) fn announcement_for_tests(peer: &str, sent_at: u64) -> Self {
        P2pEvent::Announcement {
            from: PeerId::new(peer),
            announcement: PeerAnnouncement {
                peer: PeerId::new(peer),
                model_id: "m".into(),
                software_version: "0".into(),
                wire_version: 1,
                http_endpoints: Vec::new(),
                p2p_addresses: Vec::new(),
                memory_bytes: 1,
                quantizations: Vec::new(),
                throughput: 1.0,
                kv_tokens: 1,
                span: None,
                free_kv_tokens: 0,
                active_sessions: 0,
                is_tracker: false,
                forward_latency_ms: 0.0,
                leaving: false,
                tracker_capable: false,
                sent_at_unix_ms: sent_at,
                tracker_silent_ms: None,
                rtt_ms: vec![],
            },
        }
    }
}
