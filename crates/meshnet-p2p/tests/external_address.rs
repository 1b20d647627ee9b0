#![allow(clippy::unwrap_used)]
//! A node given the addresses others reach it at (`P2pConfig::external_addresses`) announces
//! those, not its listen address, and members reach it there. Shown with a TCP forwarder in
//! front of a tracker over real TCP.

mod common;

use common::{Node, next_event, tcp_config, tracker_record};

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use meshnet_p2p::{P2pConfig, P2pEvent, Role, spawn};
use meshnet_types::PeerId;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

const MODEL: &str = "test-model";

fn config(role: Role, bootstrap: Vec<Multiaddr>) -> P2pConfig {
    tcp_config(MODEL, role, bootstrap)
}

fn unpinned() -> Role {
    Role::Peer {
        pinned_tracker: None,
    }
}

/// Relays every connection `listener` accepts to `target`, both ways, until aborted (which
/// closes every relayed connection).
async fn forward(listener: TcpListener, target: std::net::SocketAddr) {
    let mut connections = JoinSet::new();
    loop {
        let (mut inbound, _) = listener.accept().await.unwrap();
        connections.spawn(async move {
            let mut outbound = TcpStream::connect(target).await.unwrap();
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
    }
}

/// The TCP socket address of a `/ip4/…/tcp/…` multiaddr.
fn socket_address(address: &Multiaddr) -> std::net::SocketAddr {
    let mut ip = None;
    let mut port = None;
    for protocol in address {
        match protocol {
            Protocol::Ip4(found) => ip = Some(found),
            Protocol::Tcp(found) => port = Some(found),
            _ => {}
        }
    }
    (ip.unwrap(), port.unwrap()).into()
}

fn disconnected_from(peer: &PeerId) -> impl FnMut(P2pEvent) -> Option<()> + '_ {
    move |event| matches!(event, P2pEvent::PeerDisconnected(gone) if &gone == peer).then_some(())
}

#[tokio::test]
async fn members_reach_a_node_only_at_the_addresses_it_was_given() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let forwarder: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let mut tracker_config = config(Role::Tracker, Vec::new());
    tracker_config.external_addresses = vec![forwarder.clone()];
    let tracker = Node::spawn(tracker_config).await;
    let record = tracker_record(&tracker, MODEL);
    tracker.handle.set_tracker_record(record).await.unwrap();
    let _incoming = tracker.handle.accept_http_streams().unwrap();
    let relay = tokio::spawn(forward(listener, socket_address(&tracker.address)));

    // A member told only the forwarder.
    let tracker_id = meshnet_p2p::libp2p_peer_id(&tracker.id).unwrap();
    let bootstrap = forwarder.clone().with(Protocol::P2p(tracker_id));
    let (member, mut events) = spawn(config(unpinned(), vec![bootstrap])).await.unwrap();
    let discovered = next_event(&mut events, |event| match event {
        P2pEvent::TrackerDiscovered(record) => Some(record),
        _ => None,
    })
    .await;
    assert_eq!(discovered.addresses, vec![forwarder.to_string()]);
    member.open_http_stream(&tracker.id).await.unwrap();

    // The connection went through the forwarder: it goes with it.
    relay.abort();
    let _ = relay.await;
    next_event(&mut events, disconnected_from(&tracker.id)).await;
}
