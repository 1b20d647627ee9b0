//! Starting a node: the swarm is built, listens, subscribes to the model's topics and dials
//! the bootstrap addresses; then one event loop task owns it, driven through a [`P2pHandle`].

use std::collections::HashMap;
use std::sync::Arc;

use libp2p::gossipsub::IdentTopic;
use libp2p::metrics::Registry;
use libp2p::{Multiaddr, Swarm};
use tokio::sync::mpsc;

use crate::P2pError;
use crate::addresses::split_peer_id;
use crate::behaviour::{MeshBehaviour, build_swarm};
use crate::config::P2pConfig;
use crate::events::P2pEvent;
use crate::handle::P2pHandle;
use crate::messages::{TopicKind, topic_name};
use crate::node::{EventLoop, Wiring};
use crate::private::{is_quic, swarm_key_fingerprint};
use crate::reach::{ActiveStreams, ModelPeers, SharedReach};
use crate::traffic::TrafficCounters;

/// Capacity of the command channel from handles to the event loop.
const COMMAND_CAPACITY: usize = 64;

/// Capacity of the event channel to the application.
const EVENT_CAPACITY: usize = 256;

/// Starts a node: builds the swarm, listens, dials the bootstrap addresses,
/// subscribes to the model's topics and spawns the event loop on the current
/// tokio runtime.
///
/// Fails if the swarm cannot be built or no listen address can be bound.
pub async fn spawn(config: P2pConfig) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    start(config, None).await
}

/// [`spawn`], also exporting libp2p's own swarm, gossipsub, Kademlia, identify, ping, relay
/// and DCUtR metrics in `registry` (under `libp2p_`).
pub async fn spawn_registered(
    config: P2pConfig,
    registry: &mut Registry,
) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    let libp2p_metrics = libp2p::metrics::Metrics::new(registry);
    start(config, Some(libp2p_metrics)).await
}

/// Listens on every configured address that can be bound (in a private mesh, none over
/// QUIC); fails only if none can.
fn listen_all(swarm: &mut Swarm<MeshBehaviour>, config: &P2pConfig) -> Result<(), P2pError> {
    let mut listen_failures = Vec::new();
    let mut listening = 0usize;
    if let Some(key) = &config.swarm_key {
        tracing::info!(
            fingerprint = %swarm_key_fingerprint(key),
            "private mesh: only members holding this swarm key can connect; QUIC is off"
        );
    }
    for address in &config.listen {
        if config.swarm_key.is_some() && is_quic(address) {
            listen_failures.push(format!(
                "{address}: QUIC is off in a private mesh (it cannot carry the swarm key)"
            ));
            continue;
        }
        match swarm.listen_on(address.clone()) {
            Ok(_) => listening += 1,
            Err(error) => listen_failures.push(format!("{address}: {error}")),
        }
    }
    if listening == 0 {
        let reason = if listen_failures.is_empty() {
            "no listen address configured".to_owned()
        } else {
            listen_failures.join("; ")
        };
        return Err(P2pError::Listen(reason));
    }
    for failure in &listen_failures {
        tracing::warn!(%failure, "listen address not bound");
    }
    Ok(())
}

/// Subscribes to the gossip topics of `model_id`, each kept by its kind.
fn subscribe_all(
    swarm: &mut Swarm<MeshBehaviour>,
    model_id: &str,
) -> Result<HashMap<TopicKind, IdentTopic>, P2pError> {
    let mut topics = HashMap::new();
    for kind in TopicKind::ALL {
        let topic = IdentTopic::new(topic_name(model_id, kind));
        swarm
            .behaviour_mut()
            .gossipsub
            .subscribe(&topic)
            .map_err(|error| P2pError::Behaviour(format!("subscribing to {topic}: {error}")))?;
        topics.insert(kind, topic);
    }
    Ok(topics)
}

/// Dials every bootstrap address, adding those that name their peer to Kademlia.
fn dial_bootstrap(swarm: &mut Swarm<MeshBehaviour>, bootstrap: &[Multiaddr]) {
    for address in bootstrap {
        if let Some((peer, peer_address)) = split_peer_id(address) {
            swarm
                .behaviour_mut()
                .kademlia
                .add_address(&peer, peer_address);
        }
        if let Err(error) = swarm.dial(address.clone()) {
            tracing::warn!(%address, %error, "bootstrap dial failed");
        }
    }
}

/// Builds and starts the swarm, spawns its event loop, and returns the handle on it with the
/// channel of its events.
async fn start(
    config: P2pConfig,
    libp2p_metrics: Option<libp2p::metrics::Metrics>,
) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    let model_peers = ModelPeers::default();
    let mut swarm = build_swarm(&config, &model_peers)?;
    let streams = swarm.behaviour().streams.new_control();
    let reach = SharedReach::new(config.assume_reachable);
    let active_streams = ActiveStreams::default();
    let local_peer_id = *swarm.local_peer_id();

    listen_all(&mut swarm, &config)?;
    for address in &config.external_addresses {
        swarm.add_external_address(address.clone());
    }
    let topics = subscribe_all(&mut swarm, &config.model_id)?;
    dial_bootstrap(&mut swarm, &config.bootstrap);

    let (command_sender, commands) = mpsc::channel(COMMAND_CAPACITY);
    let (event_sender, events) = mpsc::channel(EVENT_CAPACITY);
    let traffic = Arc::new(TrafficCounters::default());
    let wiring = Wiring {
        swarm,
        topics,
        commands,
        events: event_sender,
        traffic: Arc::clone(&traffic),
        reach: reach.clone(),
        model_peers,
        active_streams: active_streams.clone(),
        libp2p_metrics,
    };
    let event_loop = EventLoop::new(config, wiring)?;
    tokio::spawn(event_loop.run());
    let handle = P2pHandle::new(
        local_peer_id,
        command_sender,
        traffic,
        reach,
        streams,
        active_streams,
    );
    Ok((handle, events))
}
