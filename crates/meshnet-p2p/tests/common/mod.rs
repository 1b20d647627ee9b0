//! What the control-plane tests share: a started node with its address, and publishing until
//! an expected event arrives.

#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use meshnet_p2p::{
    P2pConfig, P2pError, P2pEvent, P2pHandle, Role, TrackerRecord, TransportChoice, spawn,
};
use meshnet_types::PeerId;
use tokio::sync::mpsc::Receiver;
use tokio::time::timeout;

/// Upper bound for every awaited condition.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// How often a message is published again until the expected event arrives: gossipsub drops
/// messages published before the mesh has formed.
pub const REPUBLISH_EVERY: Duration = Duration::from_millis(250);

/// A started node.
pub struct Node {
    pub handle: P2pHandle,
    pub events: Receiver<P2pEvent>,
    /// A listen address with `/p2p/<id>` appended.
    pub address: Multiaddr,
    pub id: PeerId,
}

impl Node {
    /// Starts a node with `config` and notes its first listen address.
    pub async fn spawn(config: P2pConfig) -> Node {
        let (handle, events) = spawn(config).await.unwrap();
        let id = handle.local_peer_id();
        let listening = handle.listen_addrs().await.unwrap();
        assert!(!listening.is_empty(), "node reported no listen address");
        let address = listening[0]
            .clone()
            .with(Protocol::P2p(meshnet_p2p::libp2p_peer_id(&id).unwrap()));
        Node {
            handle,
            events,
            address,
            id,
        }
    }
}

/// A node of `model` in `role` on TCP at 127.0.0.1 (a port the system picks), reachable,
/// dialing `bootstrap`, looking its tracker up every 200 ms.
pub fn tcp_config(model: &str, role: Role, bootstrap: Vec<Multiaddr>) -> P2pConfig {
    let mut config = P2pConfig::new(Keypair::generate_ed25519(), model, role);
    config.transport = TransportChoice::Network;
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    config.bootstrap = bootstrap;
    config.assume_reachable = true;
    config.tracker_lookup_interval = Duration::from_millis(200);
    config
}

/// The record `tracker` stores for `model`: itself, epoch and term 1 (its addresses are
/// filled in when it is stored).
pub fn tracker_record(tracker: &Node, model: &str) -> TrackerRecord {
    TrackerRecord {
        peer: tracker.id.clone(),
        addresses: Vec::new(),
        http_endpoint: "http://tracker.invalid:8080".into(),
        epoch: 1,
        term: 1,
        model_id: model.into(),
    }
}

/// Waits for the first event `select` maps to `Some`, discarding the others (`select` may fail
/// the test on a forbidden one).
pub async fn next_event<T>(
    events: &mut Receiver<P2pEvent>,
    mut select: impl FnMut(P2pEvent) -> Option<T>,
) -> T {
    let wait = async {
        loop {
            let event = events.recv().await.expect("event channel closed");
            if let Some(found) = select(event) {
                return found;
            }
        }
    };
    timeout(DEADLINE, wait)
        .await
        .expect("expected event did not arrive before the deadline")
}

/// Publishes with `publish` until `events` yields an event `select` maps to `Some`.
pub async fn publish_until<T, F, Fut>(
    mut publish: F,
    events: &mut Receiver<P2pEvent>,
    mut select: impl FnMut(P2pEvent) -> Option<T>,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), P2pError>>,
{
    let attempts = async {
        loop {
            publish().await.unwrap();
            let listen = async {
                loop {
                    let event = events.recv().await.expect("event channel closed");
                    if let Some(found) = select(event) {
                        return found;
                    }
                }
            };
            if let Ok(found) = timeout(REPUBLISH_EVERY, listen).await {
                return found;
            }
        }
    };
    timeout(DEADLINE, attempts)
        .await
        .expect("published message never produced the expected event")
}
