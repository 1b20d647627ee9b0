//! Configuration of a control-plane node.

use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use meshnet_types::PeerId;

/// Which libp2p transports the node uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// TCP and QUIC, secured with Noise (TCP) or TLS (QUIC), multiplexed with Yamux,
    /// plus the relay client transport. No DNS resolution: use `/ip4` or `/ip6` addresses.
    Network,
    /// The in-process libp2p memory transport (`/memory/<port>` addresses), for tests.
    Memory,
}

/// The part this node plays in the mesh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The tracker: publishes the coverage map, directives and the Kademlia tracker record.
    Tracker,
    /// An ordinary peer.
    Peer {
        /// The only tracker whose coverage maps and directives are accepted. `None`
        /// trusts whichever tracker the Kademlia record names.
        pinned_tracker: Option<PeerId>,
    },
}

/// The limits of this node's relay server, which carries activations for peers behind NAT.
///
/// libp2p's defaults (128 KiB and two minutes per circuit) would cut one prompt chunk; a
/// circuit here is limited in time only, never in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayLimits {
    /// Circuits relayed at once, in total.
    pub max_circuits: usize,
    /// Circuits relayed at once for one peer.
    pub max_circuits_per_peer: usize,
    /// How long one circuit may stay open.
    pub circuit_duration: Duration,
    /// Peers that may hold a reservation at once.
    pub max_reservations: usize,
}

impl Default for RelayLimits {
    /// 64 circuits, 16 per peer, 24 hours each, 128 reservations.
    fn default() -> Self {
        RelayLimits {
            max_circuits: 64,
            max_circuits_per_peer: 16,
            circuit_duration: Duration::from_secs(24 * 60 * 60),
            max_reservations: 128,
        }
    }
}

/// Everything [`crate::spawn`] needs to start a node.
#[derive(Debug, Clone)]
pub struct P2pConfig {
    /// The node's identity (see [`crate::load_or_create_identity`]).
    pub keypair: Keypair,
    /// The model this mesh runs; part of every topic name.
    pub model_id: String,
    /// Addresses to listen on (for example `/ip4/0.0.0.0/tcp/0` or `/memory/0`).
    pub listen: Vec<Multiaddr>,
    /// Addresses dialed at start; their peers seed the Kademlia routing table.
    pub bootstrap: Vec<Multiaddr>,
    /// Which transports to use.
    pub transport: TransportChoice,
    /// Tracker or peer.
    pub role: Role,
    /// Whether to ask the gateway for a UPnP port mapping.
    pub upnp: bool,
    /// Treat every listen address as externally reachable: it becomes an external
    /// address and Kademlia serves requests. For public hosts, LANs and loopback testnets.
    pub assume_reachable: bool,
    /// The addresses others reach this node at when they differ from where it listens (a
    /// port forward, or a link emulator's relay in front of it). When any is given, these
    /// are the only addresses the node announces (identify, its tracker record): its listen
    /// addresses are kept to itself, and it runs no AutoNAT (whose probes would have others
    /// dial them).
    pub external_addresses: Vec<Multiaddr>,
    /// Run a relay server with these limits for peers of the same model (`None`: no relay).
    pub relay_server: Option<RelayLimits>,
    /// Reserve a slot on up to two relays of the mesh (the tracker's first) and listen on
    /// the circuit addresses: for a node others cannot dial.
    pub reserve_relays: bool,
    /// Maximum number of established connections.
    pub max_connections: u32,
    /// How often a peer looks up the tracker record until it has found one.
    pub tracker_lookup_interval: Duration,
    /// Once it has a tracker, how often a peer looks the record up again to refresh it.
    pub tracker_refresh_interval: Duration,
    /// How often the tracker re-stores its record in Kademlia.
    pub record_republish_interval: Duration,
    /// How long a follower must have heard no coverage map from its tracker before it
    /// accepts another member's takeover claim.
    pub takeover_silence: Duration,
    /// How long after starting a node started as tracker yields to a later term from anyone
    /// (it may be a restarted tracker whose mesh elected a successor meanwhile); after that,
    /// only members of its own succession list may take over.
    pub tracker_start_grace: Duration,
    /// Where gossip verdicts and refused connections are counted (detached by default:
    /// counted, exported nowhere).
    pub metrics: meshnet_metrics::Metrics,
    /// The pre-shared key of a private mesh (`None`: an open mesh). With one, every
    /// connection (TCP, relayed circuits, the memory transport) runs libp2p's pnet under
    /// Noise; nodes without the same key cannot connect, and QUIC is off.
    pub swarm_key: Option<crate::SwarmKey>,
}

impl P2pConfig {
    /// A configuration with defaults: no listen or bootstrap address, network
    /// transports, no UPnP, reachability not assumed, no relay server or reservations, 256 connections, tracker
    /// lookups every 2 s (every 30 s once a tracker is known), record republication
    /// every 30 s, and an open mesh (no swarm key).
    pub fn new(keypair: Keypair, model_id: impl Into<String>, role: Role) -> Self {
        P2pConfig {
            keypair,
            model_id: model_id.into(),
            listen: Vec::new(),
            bootstrap: Vec::new(),
            transport: TransportChoice::Network,
            role,
            upnp: false,
            assume_reachable: false,
            external_addresses: Vec::new(),
            relay_server: None,
            reserve_relays: false,
            max_connections: 256,
            tracker_lookup_interval: Duration::from_secs(2),
            tracker_refresh_interval: Duration::from_secs(30),
            record_republish_interval: Duration::from_secs(30),
            takeover_silence: Duration::from_secs(6),
            tracker_start_grace: Duration::from_secs(10),
            metrics: meshnet_metrics::Metrics::detached(),
            swarm_key: None,
        }
    }

    /// The node's peer id.
    pub fn local_peer_id(&self) -> PeerId {
        crate::ids::mesh_peer_id(&self.keypair.public().to_peer_id())
    }
}
