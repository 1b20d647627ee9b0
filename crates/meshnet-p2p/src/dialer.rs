//! Connections on demand, as pure bookkeeping: the addresses each peer announced, the dials
//! made to reach a peer, and who waits for each connection. A waiter is whatever the event
//! loop answers (a reply channel there, a plain value in tests); every waiter is handed back
//! exactly once, when its connection is up or every dial for it failed.

use std::collections::HashMap;

use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};

/// What to do about a request for a connection to a peer.
#[derive(Debug, PartialEq)]
pub(crate) enum ConnectPlan<W> {
    /// A connection is up: answer the waiter now.
    Connected(W),
    /// A dial to the same addresses is under way: the waiter joined it.
    Joined,
    /// Dial these addresses; report the dial with [`Dialer::on_dial_started`] (with the
    /// waiter), or answer the waiter if it cannot start.
    Dial(Vec<Multiaddr>, W),
}

/// The dials made to reach peers on demand and who waits for them.
pub(crate) struct Dialer<W> {
    /// The libp2p addresses each peer announced, for dialing it on demand.
    peer_addresses: HashMap<PeerId, Vec<Multiaddr>>,
    /// Who waits for a connection to a peer to come up.
    waiters: HashMap<PeerId, Vec<W>>,
    /// The dials made for those waiters, each with the addresses it tries.
    dials: HashMap<PeerId, Vec<(ConnectionId, Vec<Multiaddr>)>>,
}

impl<W> Default for Dialer<W> {
    fn default() -> Self {
        Self {
            peer_addresses: HashMap::new(),
            waiters: HashMap::new(),
            dials: HashMap::new(),
        }
    }
}

impl<W> Dialer<W> {
    /// Keeps the libp2p addresses `peer` announced (those that parse), replacing what it
    /// announced before.
    pub(crate) fn note_addresses(&mut self, peer: PeerId, announced: &[String]) {
        let addresses: Vec<Multiaddr> = announced
            .iter()
            .filter_map(|address| address.parse().ok())
            .collect();
        if addresses.is_empty() {
            self.peer_addresses.remove(&peer);
        } else {
            self.peer_addresses.insert(peer, addresses);
        }
    }

    /// `waiter` wants a connection to `peer` (`connected`: one is up). A dial already under
    /// way to the addresses the peer announced last is joined; one to addresses it has since
    /// replaced (say, LAN addresses before its relay reservation came) is not waited for: the
    /// new ones are dialed alongside.
    pub(crate) fn connect(&mut self, peer: PeerId, connected: bool, waiter: W) -> ConnectPlan<W> {
        if connected {
            return ConnectPlan::Connected(waiter);
        }
        let addresses = self.peer_addresses.get(&peer).cloned().unwrap_or_default();
        let dialing = self
            .dials
            .get(&peer)
            .is_some_and(|dials| dials.iter().any(|(_, dialed)| *dialed == addresses));
        if dialing {
            self.waiters.entry(peer).or_default().push(waiter);
            return ConnectPlan::Joined;
        }
        ConnectPlan::Dial(addresses, waiter)
    }

    /// The dial `connection` to `peer` at `addresses`, planned by [`Self::connect`] for
    /// `waiter`, is under way.
    pub(crate) fn on_dial_started(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        addresses: Vec<Multiaddr>,
        waiter: W,
    ) {
        self.dials
            .entry(peer)
            .or_default()
            .push((connection, addresses));
        self.waiters.entry(peer).or_default().push(waiter);
    }

    /// A connection to `peer` is up: the waiters to answer with success.
    pub(crate) fn on_connected(&mut self, peer: PeerId) -> Vec<W> {
        self.dials.remove(&peer);
        self.waiters.remove(&peer).unwrap_or_default()
    }

    /// The dial `connection` to `peer` failed (`connected`: another connection to it is up
    /// anyway). The waiters to answer with the failure: all of them once no other dial made
    /// for them is under way and no connection is up, else none.
    pub(crate) fn on_dial_failed(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        connected: bool,
    ) -> Vec<W> {
        let Some(dials) = self.dials.get_mut(&peer) else {
            return Vec::new();
        };
        let before = dials.len();
        dials.retain(|(id, _)| *id != connection);
        if dials.len() == before || !dials.is_empty() {
            return Vec::new();
        }
        self.dials.remove(&peer);
        if connected {
            return Vec::new();
        }
        self.waiters.remove(&peer).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    fn connection(id: usize) -> ConnectionId {
        ConnectionId::new_unchecked(id)
    }

    /// A dialer that knows `peer` at one LAN address.
    fn dialer_knowing(peer: PeerId) -> Dialer<u32> {
        let mut dialer = Dialer::default();
        dialer.note_addresses(peer, &["/ip4/192.168.1.2/tcp/4001".to_owned()]);
        dialer
    }

    #[test]
    fn a_connected_peer_is_answered_at_once() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        assert_eq!(dialer.connect(peer, true, 7), ConnectPlan::Connected(7));
        assert_eq!(dialer.on_connected(peer), Vec::<u32>::new());
    }

    #[test]
    fn the_announced_addresses_are_dialed_and_a_second_request_joins_the_dial() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        let lan = vec![address("/ip4/192.168.1.2/tcp/4001")];
        assert_eq!(
            dialer.connect(peer, false, 1),
            ConnectPlan::Dial(lan.clone(), 1)
        );
        dialer.on_dial_started(peer, connection(1), lan, 1);
        assert_eq!(dialer.connect(peer, false, 2), ConnectPlan::Joined);
        assert_eq!(dialer.on_connected(peer), vec![1, 2]);
        assert_eq!(
            dialer.on_connected(peer),
            Vec::<u32>::new(),
            "answered once"
        );
        assert_eq!(
            dialer.on_dial_failed(peer, connection(1), false),
            Vec::new()
        );
    }

    #[test]
    fn replaced_addresses_are_dialed_alongside_the_old_dial() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        let lan = vec![address("/ip4/192.168.1.2/tcp/4001")];
        dialer.on_dial_started(peer, connection(1), lan, 1);
        dialer.note_addresses(
            peer,
            &["/ip4/10.0.0.5/tcp/4001".to_owned(), "junk".to_owned()],
        );
        assert_eq!(
            dialer.connect(peer, false, 2),
            ConnectPlan::Dial(vec![address("/ip4/10.0.0.5/tcp/4001")], 2)
        );
    }

    #[test]
    fn waiters_hear_of_a_failure_once_every_dial_for_them_failed() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        dialer.on_dial_started(peer, connection(1), Vec::new(), 1);
        dialer.on_dial_started(peer, connection(2), Vec::new(), 2);
        assert_eq!(
            dialer.on_dial_failed(peer, connection(1), false),
            Vec::new()
        );
        assert_eq!(
            dialer.on_dial_failed(peer, connection(9), false),
            Vec::new(),
            "a dial made for someone else"
        );
        assert_eq!(
            dialer.on_dial_failed(peer, connection(2), false),
            vec![1, 2]
        );
        assert_eq!(
            dialer.on_dial_failed(peer, connection(2), false),
            Vec::new()
        );
        assert_eq!(
            dialer.on_connected(peer),
            Vec::<u32>::new(),
            "answered once"
        );
    }

    #[test]
    fn a_failed_dial_to_a_peer_connected_anyway_answers_nobody() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        dialer.on_dial_started(peer, connection(1), Vec::new(), 1);
        assert_eq!(dialer.on_dial_failed(peer, connection(1), true), Vec::new());
    }

    #[test]
    fn a_peer_that_announces_nothing_usable_is_dialed_by_id_alone() {
        let peer = PeerId::random();
        let mut dialer = dialer_knowing(peer);
        dialer.note_addresses(peer, &["not an address".to_owned()]);
        assert_eq!(
            dialer.connect(peer, false, 3),
            ConnectPlan::Dial(Vec::new(), 3)
        );
    }
}
