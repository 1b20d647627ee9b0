//! The meshnet control plane over libp2p.
//!
//! meshnet runs one language model split across peers: every peer holds a span
//! of layers, and one peer, the tracker, plans who holds what. This crate is
//! how they talk:
//!
//! - **Messages** ([`messages`], always built, pure): [`PeerAnnouncement`]s
//!   from every peer, the tracker's [`CoverageMessage`] and
//!   [`DirectiveMessage`]s, and the [`TrackerRecord`] kept in the DHT. Each is
//!   encoded with bincode 2 in a `{ schema_version, body }` envelope
//!   ([`encode`] / [`decode`]).
//! - **Transport and behaviour** (feature `network`, on by default): a libp2p
//!   swarm with identify, ping, Kademlia, gossipsub (signed, strictly
//!   validated), AutoNAT, relay client, DCUtR, optional UPnP and a connection
//!   limit, over TCP + QUIC or the in-memory transport ([`TransportChoice`]).
//! - **Event loop** ([`spawn`]): one task owns the swarm; a cloneable
//!   [`P2pHandle`] sends it commands and a bounded channel delivers
//!   [`P2pEvent`]s; [`P2pHandle::gossip_traffic`] reads how much gossip it
//!   published and received.
//!
//! Gossip runs on three topics per model ([`topic_name`]). Every message is
//! validated before it propagates: it must decode, be for our model, an
//! announcement must name its signer, and coverage maps and directives must be
//! signed by the authorised tracker (the node itself for [`Role::Tracker`], the
//! pinned tracker, or the one named by the Kademlia record under
//! [`tracker_record_key`]). Invalid messages are dropped and reported as
//! [`P2pEvent::Rejected`]. An announcement not newer (by its sender's clock) than
//! one already accepted from the same peer is ignored: a replay, not news.

mod error;
pub mod messages;
mod swarm_key;

#[cfg(feature = "network")]
mod addresses;
#[cfg(feature = "network")]
mod behaviour;
#[cfg(feature = "network")]
mod config;
#[cfg(feature = "network")]
mod dialer;
#[cfg(feature = "network")]
mod election;
#[cfg(feature = "network")]
mod events;
#[cfg(feature = "network")]
mod freshness;
#[cfg(feature = "network")]
mod handle;
#[cfg(feature = "network")]
mod identity;
#[cfg(feature = "network")]
mod ids;
#[cfg(feature = "network")]
mod node;
#[cfg(feature = "network")]
mod outbox;
#[cfg(feature = "network")]
mod private;
#[cfg(feature = "network")]
mod reach;
#[cfg(feature = "network")]
mod relays;
#[cfg(feature = "network")]
mod start;
#[cfg(feature = "network")]
mod traffic;
#[cfg(feature = "network")]
mod validation;

pub use error::P2pError;
pub use messages::{
    CoverageMessage, DirectiveMessage, MAX_MESSAGE_BYTES, MAX_RTT_ENTRIES, PeerAnnouncement,
    PeerRtt, SCHEMA_VERSION, SpanStatus, TopicKind, TrackerRecord, decode, encode, topic_name,
    tracker_record_key,
};

pub use swarm_key::{
    MAX_SWARM_KEY_FILE_BYTES, SWARM_KEY_BYTES, SWARM_KEY_ENCODING, SWARM_KEY_TYPE, SwarmKey,
    SwarmKeyProblem, load_swarm_key, write_swarm_key,
};

#[cfg(feature = "network")]
pub use config::RelayLimits;
#[cfg(feature = "network")]
pub use config::{P2pConfig, Role, TransportChoice};
#[cfg(feature = "network")]
pub use events::{Leadership, P2pEvent};
#[cfg(feature = "network")]
pub use handle::{IncomingHttpStreams, P2pHandle, P2pStream};
#[cfg(feature = "network")]
pub use identity::{IDENTITY_FILE_NAME, load_or_create_identity};
#[cfg(feature = "network")]
pub use ids::{libp2p_peer_id, mesh_peer_id, parse_peer_id};
#[cfg(feature = "network")]
pub use private::{is_quic, swarm_key_fingerprint};
#[cfg(feature = "network")]
pub use reach::{P2pPath, Reachability};
#[cfg(feature = "network")]
pub use start::{spawn, spawn_registered};
#[cfg(feature = "network")]
pub use traffic::GossipTraffic;
