#![allow(clippy::unwrap_used)]
//! Peers others cannot dial, over the in-memory transport: they reserve a slot on the tracker's
//! relay, announce their circuit address, and another peer opens a stream to them through the
//! relay that carries more than libp2p's default circuit limit. A node of another model gets
//! no slot. The same holds in a private mesh, where every connection (the relayed circuit
//! too) runs under the swarm key. Every wait is bounded by [`DEADLINE`].

mod common;

use common::{DEADLINE, Node};

use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use meshnet_p2p::{
    P2pConfig, P2pEvent, P2pPath, PeerAnnouncement, RelayLimits, Role, SwarmKey, TransportChoice,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{Instant, timeout};

const MODEL: &str = "relay-test-model";

/// More than libp2p's default limit of 128 KiB per relayed circuit.
const PAYLOAD_BYTES: usize = 1 << 20;

async fn start(
    model: &str,
    role: Role,
    reachable: bool,
    bootstrap: &[&Node],
    swarm_key: &Option<SwarmKey>,
) -> Node {
    let mut config = P2pConfig::new(Keypair::generate_ed25519(), model, role);
    config.swarm_key = swarm_key.clone();
    config.transport = TransportChoice::Memory;
    config.listen = vec!["/memory/0".parse().unwrap()];
    config.bootstrap = bootstrap.iter().map(|node| node.address.clone()).collect();
    config.assume_reachable = reachable;
    config.relay_server = reachable.then(RelayLimits::default);
    config.reserve_relays = !reachable;
    config.tracker_lookup_interval = Duration::from_millis(200);
    Node::spawn(config).await
}

fn peer() -> Role {
    Role::Peer {
        pinned_tracker: None,
    }
}

/// Polls `condition` until it holds, failing the test at the deadline.
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn announcement(node: &Node) -> PeerAnnouncement {
    PeerAnnouncement {
        peer: node.id.clone(),
        model_id: MODEL.to_owned(),
        software_version: "test".to_owned(),
        wire_version: 1,
        http_endpoints: Vec::new(),
        p2p_addresses: node
            .handle
            .circuit_addresses()
            .iter()
            .map(ToString::to_string)
            .collect(),
        memory_bytes: 0,
        quantizations: Vec::new(),
        throughput: 1.0,
        kv_tokens: 0,
        span: None,
        free_kv_tokens: 0,
        active_sessions: 0,
        is_tracker: false,
        forward_latency_ms: 0.0,
        leaving: false,
        tracker_capable: false,
        sent_at_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64,
        tracker_silent_ms: None,
        rtt_ms: vec![],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_behind_nat_is_reached_through_the_trackers_relay_and_strangers_get_no_slot() {
    relay_scenario(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_private_mesh_the_relay_works_the_same() {
    relay_scenario(Some(SwarmKey::generate())).await;
}

/// A tracker with a relay, a peer others cannot dial, a sender and a node of another model,
/// all holding `swarm_key` (or none).
async fn relay_scenario(key: Option<SwarmKey>) {
    let tracker = start(MODEL, Role::Tracker, true, &[], &key).await;
    let hidden = start(MODEL, peer(), false, &[&tracker], &key).await;
    let mut sender = start(MODEL, peer(), false, &[&tracker], &key).await;
    let mut stranger = start("another-model", peer(), false, &[&tracker], &key).await;

    eventually(
        "the hidden peer holds a reservation on the tracker's relay",
        || {
            let circuits = hidden.handle.circuit_addresses();
            !circuits.is_empty()
                && circuits.iter().all(|address| {
                    address
                        .iter()
                        .any(|part| matches!(part, Protocol::P2pCircuit))
                })
        },
    )
    .await;
    assert_eq!(
        hidden.handle.reachability().as_str(),
        "unknown",
        "a node not started as reachable waits for AutoNAT, which the memory transport lacks"
    );

    // The stranger is refused by the tracker for its model, and never holds a slot.
    timeout(DEADLINE, async {
        loop {
            match stranger.events.recv().await {
                Some(P2pEvent::ModelMismatch { .. }) => break,
                Some(_) => {}
                None => panic!("the stranger's node stopped"),
            }
        }
    })
    .await
    .expect("the stranger was not told it runs another model");
    assert!(stranger.handle.circuit_addresses().is_empty());

    // The hidden peer's announcement tells the sender where to find it.
    let wanted = hidden.id.clone();
    timeout(DEADLINE, async {
        loop {
            hidden
                .handle
                .publish_announcement(announcement(&hidden))
                .await
                .unwrap();
            let heard = timeout(Duration::from_millis(250), async {
                loop {
                    if let Some(P2pEvent::Announcement { from, .. }) = sender.events.recv().await
                        && from == wanted
                    {
                        return;
                    }
                }
            })
            .await;
            if heard.is_ok() {
                break;
            }
        }
    })
    .await
    .expect("the sender never heard the hidden peer's announcement");

    let mut incoming = hidden.handle.accept_http_streams().unwrap();
    assert!(
        hidden.handle.accept_http_streams().is_err(),
        "a second listener is refused"
    );
    let echo = tokio::spawn(async move {
        let (from, mut stream) = incoming.next().await.unwrap();
        let mut received = Vec::new();
        stream.read_to_end(&mut received).await.unwrap();
        stream.write_all(&received).await.unwrap();
        stream.shutdown().await.unwrap();
        (from, received.len())
    });

    let payload: Vec<u8> = (0..PAYLOAD_BYTES).map(|i| (i % 251) as u8).collect();
    let mut stream = sender.handle.open_http_stream(&hidden.id).await.unwrap();
    assert_eq!(
        sender.handle.path_to(&hidden.id),
        Some(P2pPath::Relayed),
        "the memory transport cannot punch holes: the stream goes through the relay"
    );
    let (mut read_half, mut write_half) = tokio::io::split(&mut stream);
    let writing = async {
        write_half.write_all(&payload).await.unwrap();
        write_half.shutdown().await.unwrap();
    };
    let mut echoed = Vec::new();
    let reading = read_half.read_to_end(&mut echoed);
    let (_, read) = timeout(DEADLINE, async { tokio::join!(writing, reading) })
        .await
        .expect("the echo did not come back");
    read.unwrap();
    assert_eq!(echoed.len(), PAYLOAD_BYTES);
    assert!(echoed == payload, "the echo differs from what was sent");
    let (from, received) = echo.await.unwrap();
    assert_eq!(from, sender.id);
    assert_eq!(received, PAYLOAD_BYTES);

    for node in [&tracker, &hidden, &sender, &stranger] {
        node.handle.shutdown().await;
    }
    drop(hidden.events);
}
