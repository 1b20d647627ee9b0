#![allow(clippy::unwrap_used)]
//! End-to-end behaviour of the control plane over the in-memory transport (and
//! one TCP smoke test). Every wait is bounded by [`DEADLINE`]; messages are
//! re-published until the expected event arrives, as the real announcers do.

mod common;

use common::{DEADLINE, Node, REPUBLISH_EVERY, next_event, publish_until};

use std::collections::HashMap;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use meshnet_p2p::{
    CoverageMessage, DirectiveMessage, P2pConfig, P2pError, P2pEvent, PeerAnnouncement, Role,
    SpanStatus, TopicKind, TrackerRecord, TransportChoice, spawn, topic_name,
};
use meshnet_planner::{CoverageMap, Directive, SpanHolding};
use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use tokio::sync::mpsc::Receiver;
use tokio::time::timeout;

const MODEL: &str = "test-model";

fn config(role: Role, transport: TransportChoice, bootstrap: Vec<Multiaddr>) -> P2pConfig {
    let mut config = P2pConfig::new(Keypair::generate_ed25519(), MODEL, role);
    config.transport = transport;
    config.listen = vec![match transport {
        TransportChoice::Memory => "/memory/0".parse().unwrap(),
        TransportChoice::Network => "/ip4/127.0.0.1/tcp/0".parse().unwrap(),
    }];
    config.bootstrap = bootstrap;
    config.assume_reachable = true;
    config.tracker_lookup_interval = Duration::from_millis(200);
    config
}

async fn start(role: Role, bootstrap: &[&Node]) -> Node {
    let addresses = bootstrap.iter().map(|node| node.address.clone()).collect();
    Node::spawn(config(role, TransportChoice::Memory, addresses)).await
}

fn unpinned() -> Role {
    Role::Peer {
        pinned_tracker: None,
    }
}

fn pinned(tracker: &Node) -> Role {
    Role::Peer {
        pinned_tracker: Some(tracker.id.clone()),
    }
}

/// Publishes `sent` from the tracker until `events` delivers it, and checks it came from the
/// tracker unchanged.
async fn coverage_arrives(tracker: &Node, events: &mut Receiver<P2pEvent>, sent: &CoverageMessage) {
    let (from, received) = publish_until(
        || tracker.handle.publish_coverage(sent.clone()),
        events,
        |event| match event {
            P2pEvent::Coverage { from, coverage } => Some((from, coverage)),
            _ => None,
        },
    )
    .await;
    assert_eq!(from, tracker.id.clone());
    assert_eq!(&received, sent);
}

fn announcement(peer: PeerId) -> PeerAnnouncement {
    PeerAnnouncement {
        peer: peer.clone(),
        model_id: MODEL.into(),
        software_version: "0.1.0".into(),
        wire_version: 1,
        http_endpoints: vec![format!("http://{peer}.invalid:8080")],
        p2p_addresses: Vec::new(),
        memory_bytes: 8 << 30,
        quantizations: vec![Quantization::Nf4, Quantization::Bf16],
        throughput: 42.5,
        kv_tokens: 4096,
        span: Some(SpanStatus {
            layers: LayerSpan::new(4, 12),
            quantization: Quantization::Nf4,
            state: SpanState::Ready,
        }),
        free_kv_tokens: 1024,
        active_sessions: 2,
        is_tracker: false,
        forward_latency_ms: 0.0,
        leaving: false,
        tracker_capable: true,
        sent_at_unix_ms: 1_700_000_000_000,
        tracker_silent_ms: None,
        rtt_ms: vec![],
    }
}

fn coverage(holder: PeerId, epoch: u64) -> CoverageMessage {
    CoverageMessage {
        model_id: MODEL.into(),
        term: 1,
        succession: Vec::new(),
        tracker_http: "http://127.0.0.1:8080".into(),
        epoch,
        sequence: epoch * 10,
        num_layers: 30,
        map: CoverageMap {
            epoch,
            holdings: vec![SpanHolding {
                peer: holder.clone(),
                layers: LayerSpan::new(0, 30),
                quantization: Quantization::Q8_0,
                state: SpanState::Ready,
            }],
        },
        announce_interval_ms: 2000,
    }
}

fn directive(target: PeerId, epoch: u64) -> DirectiveMessage {
    let layers = LayerSpan::new(10, 20);
    DirectiveMessage {
        model_id: MODEL.into(),
        target: target.clone(),
        term: 1,
        epoch,
        sequence: epoch,
        directives: vec![Directive::LoadShard {
            peer: target.clone(),
            layers,
            quantization: Quantization::Int8,
        }],
        span_after: Some(SpanStatus {
            layers,
            quantization: Quantization::Int8,
            state: SpanState::Loading,
        }),
    }
}

fn tracker_record(tracker: &Node) -> TrackerRecord {
    common::tracker_record(tracker, MODEL)
}

async fn discovered_tracker(node: &mut Node) -> TrackerRecord {
    next_event(&mut node.events, |event| match event {
        P2pEvent::TrackerDiscovered(record) => Some(record),
        _ => None,
    })
    .await
}

#[tokio::test]
async fn announcements_from_three_peers_reach_the_tracker() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let mut peers = Vec::new();
    for _ in 0..3 {
        peers.push(start(pinned(&tracker), &[&tracker]).await);
    }
    let expected: HashMap<PeerId, PeerAnnouncement> = peers
        .iter()
        .map(|peer| (peer.id.clone(), announcement(peer.id.clone())))
        .collect();
    let mut received = HashMap::new();
    let collect = async {
        while received.len() < peers.len() {
            for peer in &peers {
                peer.handle
                    .publish_announcement(expected[&peer.id].clone())
                    .await
                    .unwrap();
            }
            let listen = async {
                while let Some(event) = tracker.events.recv().await {
                    if let P2pEvent::Announcement { from, announcement } = event {
                        received.insert(from, announcement);
                        if received.len() == peers.len() {
                            break;
                        }
                    }
                }
            };
            let _ = timeout(REPUBLISH_EVERY, listen).await;
        }
    };
    timeout(DEADLINE, collect)
        .await
        .expect("tracker did not hear every peer");
    assert_eq!(received, expected);
    let connected = tracker.handle.connected_peers().await.unwrap();
    for peer in &peers {
        assert!(connected.contains(&peer.id));
    }
}

#[tokio::test]
async fn coverage_reaches_peers_that_found_the_tracker_in_kademlia() {
    let tracker = start(Role::Tracker, &[]).await;
    tracker
        .handle
        .set_tracker_record(tracker_record(&tracker))
        .await
        .unwrap();
    let mut peers = vec![
        start(unpinned(), &[&tracker]).await,
        start(unpinned(), &[&tracker]).await,
    ];
    for peer in &mut peers {
        let record = discovered_tracker(peer).await;
        assert_eq!(record.peer, tracker.id.clone());
        assert_eq!(record.http_endpoint, "http://tracker.invalid:8080");
        assert!(
            !record.addresses.is_empty(),
            "empty addresses are filled in by the tracker"
        );
        assert_eq!(
            peer.handle.tracker().await.unwrap(),
            Some(tracker.id.clone())
        );
    }
    let sent = coverage(tracker.id.clone(), 3);
    for peer in &mut peers {
        coverage_arrives(&tracker, &mut peer.events, &sent).await;
    }
}

#[tokio::test]
async fn forged_directive_is_rejected_and_genuine_one_delivered() {
    let tracker = start(Role::Tracker, &[]).await;
    let mut target = start(pinned(&tracker), &[&tracker]).await;
    let forger = start(pinned(&tracker), &[&tracker, &target]).await;
    const FORGED_EPOCH: u64 = 666;

    let forged = directive(target.id.clone(), FORGED_EPOCH);
    let forger_id = forger.id.clone();
    let (from, topic) = publish_until(
        || forger.handle.publish_directive(forged.clone()),
        &mut target.events,
        |event| match event {
            P2pEvent::Rejected { from, topic, .. } => Some((from, topic)),
            P2pEvent::Directive { directive, .. } => {
                panic!("forged directive was delivered: {directive:?}")
            }
            _ => None,
        },
    )
    .await;
    assert_eq!(from, forger_id);
    assert_eq!(topic, topic_name(MODEL, TopicKind::Directives));

    let genuine = directive(target.id.clone(), 7);
    let (from, delivered) = publish_until(
        || tracker.handle.publish_directive(genuine.clone()),
        &mut target.events,
        |event| match event {
            P2pEvent::Directive { from, directive } => {
                assert_ne!(
                    directive.epoch, FORGED_EPOCH,
                    "forged directive was delivered"
                );
                Some((from, directive))
            }
            _ => None,
        },
    )
    .await;
    assert_eq!(from, tracker.id.clone());
    assert_eq!(delivered, genuine);
}

#[tokio::test]
async fn announcement_naming_another_peer_is_rejected() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let spoofer = start(pinned(&tracker), &[&tracker]).await;
    let victim = start(pinned(&tracker), &[&tracker]).await;

    let spoofed = announcement(victim.id.clone());
    let reason = publish_until(
        || spoofer.handle.publish_announcement(spoofed.clone()),
        &mut tracker.events,
        |event| match event {
            P2pEvent::Rejected { from, reason, .. } if from == spoofer.id.clone() => Some(reason),
            P2pEvent::Announcement { from, .. } if from == spoofer.id.clone() => {
                panic!("spoofed announcement was accepted")
            }
            _ => None,
        },
    )
    .await;
    assert!(reason.contains(victim.id.as_str()), "{reason}");

    // The same peer announcing itself is accepted.
    let honest = announcement(spoofer.id.clone());
    let received = publish_until(
        || spoofer.handle.publish_announcement(honest.clone()),
        &mut tracker.events,
        |event| match event {
            P2pEvent::Announcement { from, announcement } if from == spoofer.id.clone() => {
                Some(announcement)
            }
            _ => None,
        },
    )
    .await;
    assert_eq!(received, honest);
}

#[tokio::test]
async fn an_announcement_not_newer_than_the_last_accepted_is_ignored() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let peer = start(pinned(&tracker), &[&tracker]).await;
    let first = announcement(peer.id.clone());
    let is_from_peer = |event: P2pEvent| match event {
        P2pEvent::Announcement { from, announcement } if from == peer.id.clone() => {
            Some(announcement)
        }
        _ => None,
    };
    let received = publish_until(
        || peer.handle.publish_announcement(first.clone()),
        &mut tracker.events,
        is_from_peer,
    )
    .await;
    assert_eq!(received, first);

    // The same state sent again (a new gossip message, so gossipsub does not drop it as a
    // duplicate) and an older one are replays; the next delivered is the later one.
    let mut replay = first.clone();
    replay.active_sessions += 1;
    let mut older = replay.clone();
    older.sent_at_unix_ms -= 1;
    peer.handle.publish_announcement(replay).await.unwrap();
    peer.handle.publish_announcement(older).await.unwrap();
    let mut later = first.clone();
    later.sent_at_unix_ms += 1;
    let received = publish_until(
        || peer.handle.publish_announcement(later.clone()),
        &mut tracker.events,
        is_from_peer,
    )
    .await;
    assert_eq!(received, later);
}

#[tokio::test]
async fn new_peer_finds_the_tracker_through_an_intermediate_peer() {
    let tracker = start(Role::Tracker, &[]).await;
    tracker
        .handle
        .set_tracker_record(tracker_record(&tracker))
        .await
        .unwrap();
    let mut intermediate = start(unpinned(), &[&tracker]).await;
    assert_eq!(
        discovered_tracker(&mut intermediate).await.peer,
        tracker.id.clone()
    );

    // The newcomer knows only the intermediate peer.
    let mut newcomer = start(unpinned(), &[&intermediate]).await;
    let record = discovered_tracker(&mut newcomer).await;
    assert_eq!(record.peer, tracker.id.clone());
    assert_eq!(
        newcomer.handle.tracker().await.unwrap(),
        Some(tracker.id.clone())
    );

    let sent = coverage(intermediate.id.clone(), 5);
    coverage_arrives(&tracker, &mut newcomer.events, &sent).await;
}

/// A record a hostile member stores under the tracker key: it names `named` (not the
/// tracker) with a term far above the mesh's.
fn forged_record(named: &PeerId) -> TrackerRecord {
    TrackerRecord {
        peer: named.clone(),
        addresses: Vec::new(),
        http_endpoint: "http://forged.invalid:8080".into(),
        epoch: 7,
        term: 99,
        model_id: MODEL.into(),
    }
}

/// Waits for `node` to reject a tracker record naming `named`, and returns the reason.
async fn rejects_record_naming(node: &mut Node, named: &PeerId) -> String {
    next_event(&mut node.events, |event| match event {
        P2pEvent::Rejected {
            from,
            topic,
            reason,
        } if topic == "tracker-record" && &from == named => Some(reason),
        _ => None,
    })
    .await
}

/// A tracker with its record stored, and a hostile member that joined through it and stored
/// a forged record naming another peer (one that does not exist).
async fn mesh_with_a_forged_record() -> (Node, Node, PeerId) {
    let tracker = start(Role::Tracker, &[]).await;
    tracker
        .handle
        .set_tracker_record(tracker_record(&tracker))
        .await
        .unwrap();
    let forger = start(unpinned(), &[&tracker]).await;
    let named = meshnet_p2p::mesh_peer_id(&Keypair::generate_ed25519().public().to_peer_id());
    forger
        .handle
        .set_tracker_record(forged_record(&named))
        .await
        .unwrap();
    (tracker, forger, named)
}

/// Publishes a map of `epoch` from `tracker` until `node` takes it, then checks that `node`
/// follows `tracker`.
async fn follows_after_a_map(node: &mut Node, tracker: &Node, epoch: u64) {
    coverage_arrives(
        tracker,
        &mut node.events,
        &coverage(tracker.id.clone(), epoch),
    )
    .await;
    assert_eq!(
        node.handle.tracker().await.unwrap(),
        Some(tracker.id.clone())
    );
}

#[tokio::test]
async fn a_forged_tracker_record_moves_no_follower_and_strands_no_newcomer() {
    let (tracker, forger, named) = mesh_with_a_forged_record().await;

    // A member that follows the tracker's maps and looks the record up often.
    let mut follower_config = config(
        unpinned(),
        TransportChoice::Memory,
        vec![tracker.address.clone()],
    );
    follower_config.tracker_refresh_interval = Duration::from_millis(200);
    let mut follower = Node::spawn(follower_config).await;
    coverage_arrives(
        &tracker,
        &mut follower.events,
        &coverage(tracker.id.clone(), 1),
    )
    .await;
    let reason = rejects_record_naming(&mut follower, &named).await;
    assert!(reason.contains("only signed coverage maps"), "{reason}");
    follows_after_a_map(&mut follower, &tracker, 2).await;

    // A newcomer that knows only the forger finds the forged record first, yet follows the
    // tracker as soon as it hears a signed map.
    let mut newcomer = start(unpinned(), &[&forger]).await;
    let record = discovered_tracker(&mut newcomer).await;
    assert_eq!(
        record.peer, named,
        "the newcomer is handed the forged record"
    );
    follows_after_a_map(&mut newcomer, &tracker, 3).await;
}

#[tokio::test]
async fn a_pinned_peer_rejects_a_tracker_record_naming_another_peer() {
    let (tracker, forger, named) = mesh_with_a_forged_record().await;
    let mut pinned_peer = start(pinned(&tracker), &[&forger]).await;
    let reason = rejects_record_naming(&mut pinned_peer, &named).await;
    assert!(reason.contains("pinned"), "{reason}");
    follows_after_a_map(&mut pinned_peer, &tracker, 1).await;
}

#[tokio::test]
async fn message_for_another_model_is_rejected() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let peer = start(pinned(&tracker), &[&tracker]).await;

    let mut foreign = announcement(peer.id.clone());
    foreign.model_id = "another-model".into();
    let reason = publish_until(
        || peer.handle.publish_announcement(foreign.clone()),
        &mut tracker.events,
        |event| match event {
            P2pEvent::Rejected { from, reason, .. } if from == peer.id.clone() => Some(reason),
            P2pEvent::Announcement { .. } => panic!("foreign-model announcement was accepted"),
            _ => None,
        },
    )
    .await;
    assert!(reason.contains("another-model"), "{reason}");
}

#[tokio::test]
async fn shutdown_stops_the_node_and_disconnects_it() {
    let mut tracker = start(Role::Tracker, &[]).await;
    let peer = start(pinned(&tracker), &[&tracker]).await;
    next_event(&mut tracker.events, |event| {
        matches!(event, P2pEvent::PeerConnected(id) if id == peer.id.clone()).then_some(())
    })
    .await;
    peer.handle.shutdown().await;
    assert!(matches!(
        peer.handle.connected_peers().await,
        Err(P2pError::Stopped)
    ));
    next_event(&mut tracker.events, |event| {
        matches!(event, P2pEvent::PeerDisconnected(id) if id == peer.id.clone()).then_some(())
    })
    .await;
}

#[tokio::test]
async fn spawning_without_a_listen_address_fails() {
    let mut config = config(Role::Tracker, TransportChoice::Memory, Vec::new());
    config.listen.clear();
    assert!(matches!(spawn(config).await, Err(P2pError::Listen(_))));
}

#[tokio::test]
async fn announcement_travels_over_tcp() {
    let mut tracker =
        Node::spawn(config(Role::Tracker, TransportChoice::Network, Vec::new())).await;
    let peer = Node::spawn(config(
        pinned(&tracker),
        TransportChoice::Network,
        vec![tracker.address.clone()],
    ))
    .await;
    let sent = announcement(peer.id.clone());
    let (from, received) = publish_until(
        || peer.handle.publish_announcement(sent.clone()),
        &mut tracker.events,
        |event| match event {
            P2pEvent::Announcement { from, announcement } => Some((from, announcement)),
            _ => None,
        },
    )
    .await;
    assert_eq!(from, peer.id.clone());
    assert_eq!(received, sent);
}
