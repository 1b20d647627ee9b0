#![allow(clippy::unwrap_used)]
//! A private mesh over TCP on OS-assigned loopback ports: two members holding one swarm key
//! connect and gossip; a libp2p node without a key and one holding another key cannot
//! connect to a member, and the member counts each refusal. A private node never listens on
//! QUIC. Every wait is bounded by [`DEADLINE`].

mod common;

use std::error::Error;
use std::time::Duration;

use futures::StreamExt;
use libp2p::core::upgrade::Version;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::swarm::{DialError, SwarmEvent, dummy};
use libp2p::{Multiaddr, Swarm, SwarmBuilder, Transport, noise, tcp, yamux};
use meshnet_metrics::Metrics;
use meshnet_p2p::{
    P2pConfig, P2pError, P2pEvent, P2pHandle, PeerAnnouncement, Role, SwarmKey, spawn,
};
use meshnet_types::PeerId;
use tokio::sync::mpsc::Receiver;
use tokio::time::{Instant, timeout};

const MODEL: &str = "private-test-model";

/// Upper bound for every awaited condition.
const DEADLINE: Duration = Duration::from_secs(20);

/// The refusal reason a wrong or missing swarm key is counted under.
const SWARM_KEY: &str = "swarm_key";

struct Member {
    handle: P2pHandle,
    events: Receiver<P2pEvent>,
    /// A listen address with `/p2p/<id>` appended.
    address: Multiaddr,
    id: PeerId,
    metrics: Metrics,
}

fn member_config(key: &SwarmKey, role: Role, bootstrap: Vec<Multiaddr>) -> P2pConfig {
    let mut config = common::tcp_config(MODEL, role, bootstrap);
    config.swarm_key = Some(key.clone());
    config
}

async fn start(config: P2pConfig) -> Member {
    let metrics = config.metrics.clone();
    let (handle, events) = spawn(config).await.unwrap();
    let id = handle.local_peer_id();
    let listening = handle.listen_addrs().await.unwrap();
    assert_eq!(listening.len(), 1, "one TCP listener: {listening:?}");
    let address = listening[0]
        .clone()
        .with(Protocol::P2p(meshnet_p2p::libp2p_peer_id(&id).unwrap()));
    Member {
        handle,
        events,
        address,
        id,
        metrics,
    }
}

fn announcement(peer: &PeerId) -> PeerAnnouncement {
    PeerAnnouncement {
        peer: peer.clone(),
        model_id: MODEL.into(),
        software_version: "0.1.0".into(),
        wire_version: 1,
        http_endpoints: vec!["http://127.0.0.1:9/".into()],
        p2p_addresses: Vec::new(),
        memory_bytes: 1 << 30,
        quantizations: Vec::new(),
        throughput: 1.0,
        kv_tokens: 2048,
        span: None,
        free_kv_tokens: 0,
        active_sessions: 0,
        is_tracker: false,
        forward_latency_ms: 0.0,
        leaving: false,
        tracker_capable: true,
        sent_at_unix_ms: 1_700_000_000_000,
        tracker_silent_ms: None,
        rtt_ms: vec![],
    }
}

/// Publishes `sent` from `from` until `to` delivers it, and returns what arrived.
async fn announcement_arrives(
    from: &Member,
    to: &mut Member,
    sent: &PeerAnnouncement,
) -> (PeerId, PeerAnnouncement) {
    let attempts = async {
        loop {
            from.handle
                .publish_announcement(sent.clone())
                .await
                .unwrap();
            let listen = async {
                loop {
                    match to.events.recv().await.expect("event channel closed") {
                        P2pEvent::Announcement { from, announcement } => {
                            return (from, announcement);
                        }
                        _ => continue,
                    }
                }
            };
            if let Ok(found) = timeout(Duration::from_millis(250), listen).await {
                return found;
            }
        }
    };
    timeout(DEADLINE, attempts)
        .await
        .expect("the announcement never arrived")
}

/// A plain libp2p node as the open mesh builds one: TCP, Noise, Yamux, no swarm key.
fn keyless_stranger() -> Swarm<dummy::Behaviour> {
    SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            tcp::Config::default(),
            noise::Config::new,
            yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| dummy::Behaviour)
        .unwrap()
        .build()
}

/// A standard libp2p pnet node (no meshnet code) holding `key`.
fn pnet_stranger(key: &SwarmKey) -> Swarm<dummy::Behaviour> {
    let key = PreSharedKey::new(*key.as_bytes());
    SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_other_transport(|keypair| {
            Ok::<_, Box<dyn Error + Send + Sync>>(
                tcp::tokio::Transport::new(tcp::Config::default())
                    .and_then(move |socket, _| PnetConfig::new(key).handshake(socket))
                    .upgrade(Version::V1Lazy)
                    .authenticate(noise::Config::new(keypair)?)
                    .multiplex(yamux::Config::default()),
            )
        })
        .unwrap()
        .with_behaviour(|_| dummy::Behaviour)
        .unwrap()
        .build()
}

/// How a dial from `stranger` to `address` ends: its error, or `None` if it connected.
async fn dial(stranger: &mut Swarm<dummy::Behaviour>, address: &Multiaddr) -> Option<DialError> {
    stranger.dial(address.clone()).unwrap();
    let outcome = async {
        loop {
            match stranger.select_next_some().await {
                SwarmEvent::ConnectionEstablished { .. } => return None,
                SwarmEvent::OutgoingConnectionError { error, .. } => return Some(error),
                _ => {}
            }
        }
    };
    timeout(DEADLINE, outcome)
        .await
        .expect("the dial neither connected nor failed")
}

/// Waits until `member` has counted `count` refusals for the swarm key.
async fn refusals_reach(member: &Member, count: u64) {
    let deadline = Instant::now() + DEADLINE;
    while member.metrics.connections_refused(SWARM_KEY) < count {
        assert!(
            Instant::now() < deadline,
            "refusals stayed at {} below {count}",
            member.metrics.connections_refused(SWARM_KEY)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The stranger's dial failed at the transport (the connection was never established), on
/// the one address it dialed.
fn assert_refused_at_transport(outcome: Option<DialError>, who: &str) {
    match outcome {
        Some(DialError::Transport(errors)) => assert_eq!(errors.len(), 1, "{who}: {errors:?}"),
        Some(other) => panic!("{who}: failed otherwise: {other}"),
        None => panic!("{who}: connected to a private member"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_with_one_key_gossip_and_strangers_are_refused_and_counted() {
    let key = SwarmKey::generate();
    let mut tracker = start(member_config(&key, Role::Tracker, Vec::new())).await;
    let peer = start(member_config(
        &key,
        Role::Peer {
            pinned_tracker: Some(tracker.id.clone()),
        },
        vec![tracker.address.clone()],
    ))
    .await;

    let sent = announcement(&peer.id);
    let (from, received) = announcement_arrives(&peer, &mut tracker, &sent).await;
    assert_eq!(from, peer.id);
    assert_eq!(received, sent);
    assert_eq!(tracker.metrics.connections_refused(SWARM_KEY), 0);

    let outcome = dial(&mut keyless_stranger(), &tracker.address).await;
    assert_refused_at_transport(outcome, "the keyless stranger");
    refusals_reach(&tracker, 1).await;

    let outcome = dial(&mut pnet_stranger(&SwarmKey::generate()), &tracker.address).await;
    assert_refused_at_transport(outcome, "the stranger with another key");
    refusals_reach(&tracker, 2).await;

    // The same standard pnet node holding the mesh's key does connect: the check refuses
    // other keys, not other libp2p implementations.
    assert!(
        dial(&mut pnet_stranger(&key), &tracker.address)
            .await
            .is_none(),
        "a pnet node with the mesh's key connects"
    );
    assert_eq!(tracker.metrics.connections_refused(SWARM_KEY), 2);
    assert_eq!(peer.metrics.connections_refused(SWARM_KEY), 0);
    assert!(
        tracker
            .handle
            .connected_peers()
            .await
            .unwrap()
            .contains(&peer.id)
    );
}

#[tokio::test]
async fn a_private_node_skips_quic_and_fails_with_only_quic() {
    let key = SwarmKey::generate();
    let mut config = member_config(&key, Role::Tracker, Vec::new());
    config
        .listen
        .push("/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap());
    let member = start(config).await;
    assert!(member.address.iter().any(|p| matches!(p, Protocol::Tcp(_))));

    let mut config = member_config(&key, Role::Tracker, Vec::new());
    config.listen = vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap()];
    match spawn(config).await {
        Err(P2pError::Listen(reason)) => {
            assert!(reason.contains("QUIC is off in a private mesh"), "{reason}")
        }
        Err(other) => panic!("failed otherwise: {other}"),
        Ok(_) => panic!("a private node listened on QUIC only"),
    }
}
