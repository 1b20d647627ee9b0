//! Relays, as pure bookkeeping: which relays a node that others cannot dial holds a
//! reservation on (and which it could use), and which relayed connections close once a direct
//! one replaces them. The event loop asks what to do and carries it out on the swarm.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::core::transport::ListenerId;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};

use crate::addresses::{is_circuit, without_peer_id};

/// How many relays a node that others cannot dial keeps a reservation on.
pub(crate) const RELAY_RESERVATIONS: usize = 2;

/// How long after a reservation on a relay failed or was lost it is tried again.
pub(crate) const RESERVATION_RETRY: Duration = Duration::from_secs(2);

/// How long a relayed connection stays open once a direct one to the same peer exists, so
/// that requests already on it finish.
pub(crate) const RELAYED_GRACE: Duration = Duration::from_secs(5);

/// The relays this node holds (or asks for) a reservation on, and the relays it could use.
pub(crate) struct RelaySlots {
    /// Whether this node reserves slots on relays at all (others cannot dial it).
    enabled: bool,
    /// Relay peer → the circuit listener reserving a slot there.
    listeners: HashMap<PeerId, ListenerId>,
    /// Connected same-model peers that run a relay server, with an address to reach them at.
    candidates: HashMap<PeerId, Multiaddr>,
    /// No new reservation on a relay before this instant (after a failure).
    retry_after: HashMap<PeerId, Instant>,
    /// The address each connected peer was dialed at (known to work from here).
    dialed_at: HashMap<PeerId, Multiaddr>,
}

impl RelaySlots {
    /// No relay known yet; reservations are asked for only when `enabled`.
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            listeners: HashMap::new(),
            candidates: HashMap::new(),
            retry_after: HashMap::new(),
            dialed_at: HashMap::new(),
        }
    }

    /// The next reservation to ask for: the relay and the circuit address to listen on,
    /// `preferred` (the tracker) first. `None` when reservations are off, enough slots are
    /// held or asked for, or no candidate is usable at `now`.
    pub(crate) fn next_reservation(
        &self,
        preferred: Option<PeerId>,
        now: Instant,
    ) -> Option<(PeerId, Multiaddr)> {
        if !self.enabled || self.listeners.len() >= RELAY_RESERVATIONS {
            return None;
        }
        let usable = |peer: &PeerId| {
            !self.listeners.contains_key(peer)
                && self.retry_after.get(peer).is_none_or(|after| now >= *after)
        };
        let mut candidates: Vec<(&PeerId, &Multiaddr)> = self
            .candidates
            .iter()
            .filter(|(peer, _)| usable(peer))
            .collect();
        candidates.sort_by_key(|(peer, _)| (Some(**peer) != preferred, peer.to_bytes()));
        candidates.first().map(|(relay, address)| {
            let circuit = (*address)
                .clone()
                .with(Protocol::P2p(**relay))
                .with(Protocol::P2pCircuit);
            (**relay, circuit)
        })
    }

    /// The swarm listens through `relay` on `listener`: that reservation is asked for.
    pub(crate) fn on_reserving(&mut self, relay: PeerId, listener: ListenerId) {
        self.listeners.insert(relay, listener);
    }

    /// The swarm could not listen through `relay` at `now`: it is not tried again before the
    /// back-off is over.
    pub(crate) fn on_refused(&mut self, relay: PeerId, now: Instant) {
        self.retry_after.insert(relay, now + RESERVATION_RETRY);
    }

    /// `listener` closed at `now`: the relay whose reservation it held, if any, which is asked
    /// again after the back-off.
    pub(crate) fn on_listener_closed(
        &mut self,
        listener: ListenerId,
        now: Instant,
    ) -> Option<PeerId> {
        let relay = self
            .listeners
            .iter()
            .find_map(|(relay, id)| (*id == listener).then_some(*relay))?;
        self.listeners.remove(&relay);
        self.on_refused(relay, now);
        Some(relay)
    }

    /// A direct connection this node dialed to `peer` at `address` is up: that address is
    /// known to work.
    pub(crate) fn on_dialed(&mut self, peer: PeerId, address: &Multiaddr) {
        self.dialed_at.insert(peer, without_peer_id(address));
    }

    /// `peer`, running this node's model, identified itself as a relay server listening on
    /// `listen_addrs`. Whether it is a candidate now (so reservations are worth asking for):
    /// reached at the address it was dialed at, else at its first direct listen address.
    pub(crate) fn on_relay_identified(&mut self, peer: PeerId, listen_addrs: &[Multiaddr]) -> bool {
        if !self.enabled {
            return false;
        }
        let address = self.dialed_at.get(&peer).cloned().or_else(|| {
            listen_addrs
                .iter()
                .find(|address| !is_circuit(address))
                .map(without_peer_id)
        });
        let Some(address) = address else {
            return false;
        };
        self.candidates.entry(peer).or_insert(address);
        true
    }

    /// The last connection to `peer` closed: it is no relay candidate any more.
    pub(crate) fn on_disconnected(&mut self, peer: &PeerId) {
        self.candidates.remove(peer);
        self.dialed_at.remove(peer);
    }
}

/// Relayed connections to close once their grace is over (a direct one supersedes them).
#[derive(Default)]
pub(crate) struct RelayedCloses {
    /// When each may close, the peer and the connection.
    pending: Vec<(Instant, PeerId, ConnectionId)>,
}

impl RelayedCloses {
    /// A direct connection to `peer` came up at `now`: its relayed `superseded` connections
    /// close after [`RELAYED_GRACE`] (each is scheduled once).
    pub(crate) fn schedule(&mut self, peer: PeerId, superseded: &[ConnectionId], now: Instant) {
        let at = now + RELAYED_GRACE;
        for id in superseded {
            if !self.pending.iter().any(|(_, _, known)| known == id) {
                self.pending.push((at, peer, *id));
            }
        }
    }

    /// The connections to close at `now`: their grace is over and `streams_open` says no
    /// stream is open with their peer (a stream on a connection closed under it would never
    /// hear of it). The others wait for a later check.
    pub(crate) fn take_due(
        &mut self,
        now: Instant,
        streams_open: impl Fn(&PeerId) -> bool,
    ) -> Vec<(PeerId, ConnectionId)> {
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.pending)
            .into_iter()
            .partition(|(at, peer, _)| *at <= now && !streams_open(peer));
        self.pending = waiting;
        due.into_iter()
            .map(|(_, peer, connection)| (peer, connection))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    fn circuit(relay: PeerId, at: &str) -> Multiaddr {
        address(at)
            .with(Protocol::P2p(relay))
            .with(Protocol::P2pCircuit)
    }

    /// Slots with `relays` as candidates, each at its own address.
    fn slots_with(relays: &[PeerId]) -> RelaySlots {
        let mut slots = RelaySlots::new(true);
        for (index, relay) in relays.iter().enumerate() {
            let at = address(&format!("/ip4/10.0.0.{}/tcp/4001", index + 1));
            assert!(slots.on_relay_identified(*relay, &[at]));
        }
        slots
    }

    #[test]
    fn the_preferred_relay_is_asked_first_through_its_circuit_address() {
        let (first, second) = (PeerId::random(), PeerId::random());
        let slots = slots_with(&[first, second]);
        let now = Instant::now();
        assert_eq!(
            slots.next_reservation(Some(second), now),
            Some((second, circuit(second, "/ip4/10.0.0.2/tcp/4001")))
        );
        assert_eq!(
            slots.next_reservation(Some(first), now),
            Some((first, circuit(first, "/ip4/10.0.0.1/tcp/4001")))
        );
    }

    #[test]
    fn a_refused_relay_is_not_retried_before_its_back_off() {
        let relay = PeerId::random();
        let mut slots = slots_with(&[relay]);
        let now = Instant::now();
        slots.on_refused(relay, now);
        assert_eq!(slots.next_reservation(None, now), None);
        assert_eq!(
            slots.next_reservation(None, now + RESERVATION_RETRY - Duration::from_millis(1)),
            None
        );
        assert_eq!(
            slots.next_reservation(None, now + RESERVATION_RETRY),
            Some((relay, circuit(relay, "/ip4/10.0.0.1/tcp/4001")))
        );
    }

    #[test]
    fn a_lost_reservation_is_asked_again_after_its_back_off() {
        let relay = PeerId::random();
        let mut slots = slots_with(&[relay]);
        let now = Instant::now();
        let listener = ListenerId::next();
        slots.on_reserving(relay, listener);
        assert_eq!(slots.next_reservation(None, now), None, "already reserving");
        assert_eq!(slots.on_listener_closed(ListenerId::next(), now), None);
        assert_eq!(slots.on_listener_closed(listener, now), Some(relay));
        assert_eq!(slots.next_reservation(None, now), None);
        assert_eq!(
            slots
                .next_reservation(None, now + RESERVATION_RETRY)
                .map(|(peer, _)| peer),
            Some(relay)
        );
    }

    #[test]
    fn no_more_than_the_wanted_number_of_slots_is_asked_for() {
        let relays: Vec<PeerId> = (0..RELAY_RESERVATIONS + 1)
            .map(|_| PeerId::random())
            .collect();
        let mut slots = slots_with(&relays);
        let now = Instant::now();
        for _ in 0..RELAY_RESERVATIONS {
            let (relay, _) = slots.next_reservation(None, now).unwrap();
            slots.on_reserving(relay, ListenerId::next());
        }
        assert_eq!(slots.next_reservation(None, now), None);
    }

    #[test]
    fn a_relay_is_reached_where_it_was_dialed_and_forgotten_when_it_leaves() {
        let relay = PeerId::random();
        let mut slots = RelaySlots::new(true);
        let dialed = address("/ip4/192.168.1.9/tcp/4001").with(Protocol::P2p(relay));
        slots.on_dialed(relay, &dialed);
        let announced = [
            circuit(PeerId::random(), "/ip4/10.0.0.7/tcp/4001"),
            address("/ip4/10.0.0.8/tcp/4001"),
        ];
        assert!(slots.on_relay_identified(relay, &announced));
        assert_eq!(
            slots.next_reservation(None, Instant::now()),
            Some((relay, circuit(relay, "/ip4/192.168.1.9/tcp/4001")))
        );
        slots.on_disconnected(&relay);
        assert_eq!(slots.next_reservation(None, Instant::now()), None);
    }

    #[test]
    fn a_relay_announcing_only_circuits_or_a_disabled_node_reserves_nothing() {
        let relay = PeerId::random();
        let only_circuits = [circuit(PeerId::random(), "/ip4/10.0.0.7/tcp/4001")];
        assert!(!RelaySlots::new(true).on_relay_identified(relay, &only_circuits));
        let mut disabled = RelaySlots::new(false);
        assert!(!disabled.on_relay_identified(relay, &[address("/ip4/10.0.0.8/tcp/4001")]));
        assert_eq!(disabled.next_reservation(None, Instant::now()), None);
    }

    #[test]
    fn superseded_relayed_connections_close_after_their_grace_and_their_streams() {
        let (peer, other) = (PeerId::random(), PeerId::random());
        let (first, second) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
        );
        let mut closes = RelayedCloses::default();
        let now = Instant::now();
        closes.schedule(peer, &[first], now);
        closes.schedule(peer, &[first], now + Duration::from_secs(3));
        closes.schedule(other, &[second], now);
        assert_eq!(closes.take_due(now, |_| false), Vec::new());
        let after_grace = now + RELAYED_GRACE;
        assert_eq!(
            closes.take_due(after_grace, |busy| *busy == other),
            vec![(peer, first)]
        );
        assert_eq!(
            closes.take_due(after_grace, |busy| *busy == other),
            Vec::new()
        );
        assert_eq!(
            closes.take_due(after_grace, |_| false),
            vec![(other, second)]
        );
        assert_eq!(closes.take_due(after_grace, |_| false), Vec::new());
    }
}
