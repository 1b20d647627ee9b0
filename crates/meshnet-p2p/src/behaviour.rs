//! The composed libp2p behaviour and the swarm built around it.

use std::time::Duration;

use libp2p::core::transport::MemoryTransport;
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::kad::store::MemoryStore;
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{
    StreamProtocol, Swarm, SwarmBuilder, Transport, autonat, connection_limits, dcutr, gossipsub,
    identify, kad, noise, ping, relay, tcp, upnp, yamux,
};

use crate::P2pError;
use crate::config::{P2pConfig, TransportChoice};
use crate::messages::MAX_MESSAGE_BYTES;
use crate::private::private_transport;
use crate::reach::ModelPeers;
use crate::swarm_key::SwarmKey;

/// The protocol of the activation plane over libp2p: HTTP/1.1, one request per stream.
pub(crate) const HTTP_PROTOCOL: StreamProtocol = StreamProtocol::new("/meshnet/http/1.1");

/// Kademlia protocol of the meshnet DHT (kept apart from the public IPFS DHT).
pub(crate) const KADEMLIA_PROTOCOL: StreamProtocol = StreamProtocol::new("/meshnet/kad/1.0.0");

/// Identify protocol version string.
const IDENTIFY_PROTOCOL_VERSION: &str = "/meshnet/1.0.0";

/// Connections stay open this long without traffic, so gossip meshes persist.
const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(120);

/// Gossipsub heartbeat: mesh maintenance and gossip emission.
const GOSSIP_HEARTBEAT: Duration = Duration::from_millis(700);

/// Every protocol the node speaks.
#[derive(NetworkBehaviour)]
pub(crate) struct MeshBehaviour {
    pub(crate) connection_limits: connection_limits::Behaviour,
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) kademlia: kad::Behaviour<MemoryStore>,
    pub(crate) gossipsub: gossipsub::Behaviour,
    pub(crate) autonat: Toggle<autonat::Behaviour>,
    pub(crate) relay_client: relay::client::Behaviour,
    pub(crate) relay_server: Toggle<relay::Behaviour>,
    pub(crate) streams: libp2p_stream::Behaviour,
    pub(crate) dcutr: Toggle<dcutr::Behaviour>,
    pub(crate) upnp: Toggle<upnp::tokio::Behaviour>,
}

fn behaviour_error(error: impl std::fmt::Display) -> P2pError {
    P2pError::Behaviour(error.to_string())
}

fn transport_error(error: impl std::fmt::Display) -> P2pError {
    P2pError::Transport(error.to_string())
}

impl MeshBehaviour {
    fn new(
        config: &P2pConfig,
        keypair: &Keypair,
        relay_client: relay::client::Behaviour,
        model_peers: &ModelPeers,
    ) -> Result<Self, P2pError> {
        let local_peer_id = keypair.public().to_peer_id();
        let network = config.transport == TransportChoice::Network;

        let gossip_config = gossipsub::ConfigBuilder::default()
            .heartbeat_interval(GOSSIP_HEARTBEAT)
            .heartbeat_initial_delay(Duration::from_millis(100))
            .validation_mode(gossipsub::ValidationMode::Strict)
            .validate_messages()
            // Room for a 1 MiB control message plus the signature and framing.
            .max_transmit_size(MAX_MESSAGE_BYTES + 64 * 1024)
            .build()
            .map_err(behaviour_error)?;
        let gossipsub = gossipsub::Behaviour::new(
            gossipsub::MessageAuthenticity::Signed(keypair.clone()),
            gossip_config,
        )
        .map_err(behaviour_error)?;

        let mut kad_config = kad::Config::new(KADEMLIA_PROTOCOL);
        kad_config.set_query_timeout(Duration::from_secs(10));
        let mut kademlia =
            kad::Behaviour::with_config(local_peer_id, MemoryStore::new(local_peer_id), kad_config);
        if config.assume_reachable {
            kademlia.set_mode(Some(kad::Mode::Server));
        } else if config.reserve_relays {
            // Reached only through relays: a DHT server must be dialable, and a relayed
            // address counted as external would make it one.
            kademlia.set_mode(Some(kad::Mode::Client));
        }

        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL_VERSION.to_owned(), keypair.public())
                .with_agent_version(agent_version(&config.model_id, &config.role))
                .with_hide_listen_addrs(!config.external_addresses.is_empty()),
        );

        let autonat = autonat_behaviour(config, local_peer_id, network);

        let relay_server = config.relay_server.map(|limits| {
            let mut server =
                relay::Behaviour::new(local_peer_id, relay_config(limits, model_peers));
            // Advertised from the start: whether this node is reachable is the operator's word
            // (or AutoNAT's), not a consequence of the first observed address.
            server.set_status(Some(relay::Status::Enable));
            server
        });

        Ok(MeshBehaviour {
            connection_limits: connection_limits::Behaviour::new(
                connection_limits::ConnectionLimits::default()
                    .with_max_established(Some(config.max_connections)),
            ),
            identify,
            ping: ping::Behaviour::default(),
            kademlia,
            gossipsub,
            autonat: Toggle::from(autonat),
            relay_client,
            relay_server: Toggle::from(relay_server),
            streams: libp2p_stream::Behaviour::new(),
            dcutr: Toggle::from(network.then(|| dcutr::Behaviour::new(local_peer_id))),
            upnp: Toggle::from((network && config.upnp).then(upnp::tokio::Behaviour::default)),
        })
    }
}

/// AutoNAT, when the node has something to learn from it. Its probes need dial-backs over
/// real IP transports (in-memory meshes skip it); servers only dial back global IPs unless
/// reachability is assumed (LAN, loopback). A node told the addresses it is reached at has
/// nothing to learn, and its probes would have others dial its listen addresses, which it
/// keeps to itself.
fn autonat_behaviour(
    config: &P2pConfig,
    local_peer_id: libp2p::PeerId,
    network: bool,
) -> Option<autonat::Behaviour> {
    (network && config.external_addresses.is_empty()).then(|| {
        autonat::Behaviour::new(
            local_peer_id,
            autonat::Config {
                only_global_ips: !config.assume_reachable,
                ..autonat::Config::default()
            },
        )
    })
}

/// The relay server's configuration: `limits`, no byte limit per circuit, and only peers that
/// identified themselves as running this node's model may reserve or open circuits.
fn relay_config(limits: crate::config::RelayLimits, model_peers: &ModelPeers) -> relay::Config {
    let same_model = |peers: ModelPeers| {
        move |peer: libp2p::PeerId, _: &libp2p::Multiaddr, _: std::time::Instant| {
            peers.contains(&peer)
        }
    };
    let mut config = relay::Config {
        max_reservations: limits.max_reservations,
        max_circuits: limits.max_circuits,
        max_circuits_per_peer: limits.max_circuits_per_peer,
        max_circuit_duration: limits.circuit_duration,
        // Zero: no byte limit (activations of a long prompt are megabytes).
        max_circuit_bytes: 0,
        ..relay::Config::default()
    };
    config
        .reservation_rate_limiters
        .insert(0, Box::new(same_model(model_peers.clone())));
    config
        .circuit_src_rate_limiters
        .insert(0, Box::new(same_model(model_peers.clone())));
    config
}

/// The error shape `SwarmBuilder::with_behaviour` accepts.
fn boxed(
    behaviour: Result<MeshBehaviour, P2pError>,
) -> Result<MeshBehaviour, Box<dyn std::error::Error + Send + Sync>> {
    behaviour.map_err(Box::from)
}

/// Builds the swarm with the transports chosen in `config`: a private one when it has a
/// swarm key.
pub(crate) fn build_swarm(
    config: &P2pConfig,
    model_peers: &ModelPeers,
) -> Result<Swarm<MeshBehaviour>, P2pError> {
    if let Some(key) = &config.swarm_key {
        return build_private_swarm(config, key, model_peers);
    }
    let builder = SwarmBuilder::with_existing_identity(config.keypair.clone()).with_tokio();
    let swarm = match config.transport {
        TransportChoice::Network => builder
            .with_tcp(
                tcp::Config::default().nodelay(true),
                noise::Config::new,
                yamux::Config::default,
            )
            .map_err(transport_error)?
            .with_quic()
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(transport_error)?
            .with_behaviour(|keypair, relay_client| {
                boxed(MeshBehaviour::new(
                    config,
                    keypair,
                    relay_client,
                    model_peers,
                ))
            })
            .map_err(behaviour_error)?
            .with_swarm_config(|swarm_config| {
                swarm_config.with_idle_connection_timeout(IDLE_CONNECTION_TIMEOUT)
            })
            .build(),
        TransportChoice::Memory => builder
            .with_other_transport(|keypair| {
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                    MemoryTransport::default()
                        .upgrade(Version::V1)
                        .authenticate(noise::Config::new(keypair)?)
                        .multiplex(yamux::Config::default()),
                )
            })
            .map_err(transport_error)?
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(transport_error)?
            .with_behaviour(|keypair, relay_client| {
                boxed(MeshBehaviour::new(
                    config,
                    keypair,
                    relay_client,
                    model_peers,
                ))
            })
            .map_err(behaviour_error)?
            .with_swarm_config(|swarm_config| {
                swarm_config.with_idle_connection_timeout(IDLE_CONNECTION_TIMEOUT)
            })
            .build(),
    };
    Ok(swarm)
}

/// The swarm of a private mesh: TCP (or the memory transport) and the relay client's
/// circuits, each behind the swarm key ([`crate::private`]); no QUIC, which has no place for
/// a pre-shared key.
fn build_private_swarm(
    config: &P2pConfig,
    key: &SwarmKey,
    model_peers: &ModelPeers,
) -> Result<Swarm<MeshBehaviour>, P2pError> {
    let (relay_transport, relay_client) = relay::client::new(config.keypair.public().to_peer_id());
    // The relay transport first, as libp2p's builder has it: it takes only circuit addresses,
    // which the memory transport would otherwise take for its own (`/memory/N/p2p/…`).
    let swarm = SwarmBuilder::with_existing_identity(config.keypair.clone())
        .with_tokio()
        .with_other_transport(|keypair| {
            private_transport(relay_transport, keypair, key, &config.metrics)
        })
        .map_err(transport_error)?
        .with_other_transport(|keypair| match config.transport {
            TransportChoice::Network => private_transport(
                tcp::tokio::Transport::new(tcp::Config::default().nodelay(true)),
                keypair,
                key,
                &config.metrics,
            ),
            TransportChoice::Memory => {
                private_transport(MemoryTransport::default(), keypair, key, &config.metrics)
            }
        })
        .map_err(transport_error)?
        .with_behaviour(|keypair| {
            boxed(MeshBehaviour::new(
                config,
                keypair,
                relay_client,
                model_peers,
            ))
        })
        .map_err(behaviour_error)?
        .with_swarm_config(|swarm_config| {
            swarm_config.with_idle_connection_timeout(IDLE_CONNECTION_TIMEOUT)
        })
        .build();
    Ok(swarm)
}

/// The identify agent string: software version, the model this node runs and its role, so
/// that peers of another model are recognised and refused at the first exchange.
pub(crate) fn agent_version(model_id: &str, role: &crate::config::Role) -> String {
    let role = match role {
        crate::config::Role::Tracker => "tracker",
        crate::config::Role::Peer { .. } => "peer",
    };
    format!(
        "meshnet-p2p/{} model={model_id} role={role}",
        env!("CARGO_PKG_VERSION")
    )
}

/// The model id and whether the sender is a tracker, from a remote agent string; `None` for
/// agents that do not say (not a meshnet node, or an older one).
pub(crate) fn parse_agent_version(agent: &str) -> Option<(&str, bool)> {
    let mut model = None;
    let mut tracker = false;
    for part in agent.split_whitespace() {
        if let Some(id) = part.strip_prefix("model=") {
            model = Some(id);
        } else if part == "role=tracker" {
            tracker = true;
        }
    }
    model.map(|model| (model, tracker))
}

#[cfg(test)]
mod agent_tests {
    use super::*;

    #[test]
    fn the_agent_string_carries_model_and_role() {
        let agent = agent_version("smol-abc", &crate::config::Role::Tracker);
        assert_eq!(parse_agent_version(&agent), Some(("smol-abc", true)));
        let agent = agent_version(
            "m",
            &crate::config::Role::Peer {
                pinned_tracker: None,
            },
        );
        assert_eq!(parse_agent_version(&agent), Some(("m", false)));
        assert_eq!(parse_agent_version("rust-libp2p/0.57"), None);
    }
}
