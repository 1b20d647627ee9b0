//! How this node is reached and how it reaches each peer: state the event loop keeps and the
//! handles read without waiting for the loop.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};

/// Whether others can dial this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reachability {
    /// Dialable: started as reachable, or AutoNAT confirmed it.
    Public,
    /// Behind a NAT or firewall (AutoNAT's verdict): reached through relays.
    Private,
    /// Not known yet (AutoNAT has no verdict; it ignores private-range servers, so a node on a
    /// LAN stays here): reached through relays, like a private one.
    Unknown,
}

impl Reachability {
    /// `public`, `private` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reachability::Public => "public",
            Reachability::Private => "private",
            Reachability::Unknown => "unknown",
        }
    }
}

/// How this node is connected to a peer over libp2p.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum P2pPath {
    /// At least one direct connection (dialed, accepted, or punched through NATs).
    Direct,
    /// Only connections through a relay.
    Relayed,
}

/// One open connection to a peer.
#[derive(Debug, Clone, Copy)]
struct OpenConnection {
    id: ConnectionId,
    /// Through a relay.
    relayed: bool,
    /// This node dialed it (the side that closes a relayed connection once superseded).
    dialed: bool,
}

/// The state shared between the event loop and its handles.
#[derive(Debug)]
pub(crate) struct ReachState {
    pub(crate) reachability: Reachability,
    /// Open connections per peer.
    connections: HashMap<PeerId, Vec<OpenConnection>>,
    /// This node's relayed (`/p2p-circuit`) listen addresses.
    circuit_addresses: Vec<Multiaddr>,
}

impl ReachState {
    fn new(reachable: bool) -> Self {
        ReachState {
            reachability: if reachable {
                Reachability::Public
            } else {
                Reachability::Unknown
            },
            connections: HashMap::new(),
            circuit_addresses: Vec::new(),
        }
    }

    pub(crate) fn connection_opened(
        &mut self,
        peer: PeerId,
        id: ConnectionId,
        relayed: bool,
        dialed: bool,
    ) {
        self.connections
            .entry(peer)
            .or_default()
            .push(OpenConnection {
                id,
                relayed,
                dialed,
            });
    }

    pub(crate) fn connection_closed(&mut self, peer: PeerId, id: ConnectionId) {
        if let Some(open) = self.connections.get_mut(&peer) {
            open.retain(|known| known.id != id);
            if open.is_empty() {
                self.connections.remove(&peer);
            }
        }
    }

    /// The relayed connections this node dialed to `peer` when it also has a direct one (those
    /// can go). Only the side that dialed a relayed connection closes it: each side sees only
    /// its own streams, so two closers would double the chance of closing one under a stream
    /// the other just opened.
    pub(crate) fn superseded_relayed(&self, peer: &PeerId) -> Vec<ConnectionId> {
        let Some(open) = self.connections.get(peer) else {
            return Vec::new();
        };
        if open.iter().all(|connection| connection.relayed) {
            return Vec::new();
        }
        open.iter()
            .filter(|connection| connection.relayed && connection.dialed)
            .map(|connection| connection.id)
            .collect()
    }

    pub(crate) fn path_to(&self, peer: &PeerId) -> Option<P2pPath> {
        let open = self.connections.get(peer)?;
        Some(if open.iter().any(|connection| !connection.relayed) {
            P2pPath::Direct
        } else {
            P2pPath::Relayed
        })
    }

    pub(crate) fn add_circuit_address(&mut self, address: Multiaddr) {
        if !self.circuit_addresses.contains(&address) {
            self.circuit_addresses.push(address);
        }
    }

    pub(crate) fn remove_circuit_address(&mut self, address: &Multiaddr) {
        self.circuit_addresses.retain(|known| known != address);
    }

    pub(crate) fn circuit_addresses(&self) -> &[Multiaddr] {
        &self.circuit_addresses
    }
}

/// [`ReachState`] behind a lock, cloned into every handle.
#[derive(Debug, Clone)]
pub(crate) struct SharedReach(Arc<Mutex<ReachState>>);

impl SharedReach {
    pub(crate) fn new(reachable: bool) -> Self {
        SharedReach(Arc::new(Mutex::new(ReachState::new(reachable))))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, ReachState> {
        // The state stays consistent whatever panicked while holding the lock.
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The connected peers that identified themselves as running this node's model: the relay
/// server admits only them.
#[derive(Debug, Clone, Default)]
pub(crate) struct ModelPeers(Arc<Mutex<HashSet<PeerId>>>);

impl ModelPeers {
    fn set(&self) -> MutexGuard<'_, HashSet<PeerId>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn insert(&self, peer: PeerId) {
        self.set().insert(peer);
    }

    pub(crate) fn remove(&self, peer: &PeerId) {
        self.set().remove(peer);
    }

    pub(crate) fn contains(&self, peer: &PeerId) -> bool {
        self.set().contains(peer)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.set().is_empty()
    }
}

/// How many activation streams each peer has open with this node, in either direction. A
/// relayed connection superseded by a direct one is closed only while none is: a stream on a
/// connection closed under it is never told (its reads wait forever), so closing waits for a
/// quiet moment instead.
#[derive(Debug, Clone, Default)]
pub(crate) struct ActiveStreams(Arc<Mutex<HashMap<PeerId, usize>>>);

impl ActiveStreams {
    fn counts(&self) -> MutexGuard<'_, HashMap<PeerId, usize>> {
        // Counts stay consistent whatever panicked while holding the lock.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts one more stream with `peer` until the returned guard is dropped.
    pub(crate) fn begin(&self, peer: PeerId) -> StreamActivity {
        *self.counts().entry(peer).or_default() += 1;
        StreamActivity {
            streams: self.clone(),
            peer,
        }
    }

    /// Whether any stream with `peer` is open.
    pub(crate) fn any_with(&self, peer: &PeerId) -> bool {
        self.counts().get(peer).is_some_and(|count| *count > 0)
    }
}

/// One open stream with a peer, counted in [`ActiveStreams`] while it lives.
#[derive(Debug)]
pub(crate) struct StreamActivity {
    streams: ActiveStreams,
    peer: PeerId,
}

impl Drop for StreamActivity {
    fn drop(&mut self) {
        let mut counts = self.streams.counts();
        if let Some(count) = counts.get_mut(&self.peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_counted_while_their_guards_live() {
        let streams = ActiveStreams::default();
        let (peer, other) = (PeerId::random(), PeerId::random());
        assert!(!streams.any_with(&peer));
        let first = streams.begin(peer);
        let second = streams.begin(peer);
        assert!(streams.any_with(&peer));
        assert!(!streams.any_with(&other));
        drop(first);
        assert!(streams.any_with(&peer));
        drop(second);
        assert!(!streams.any_with(&peer));
    }

    #[test]
    fn only_the_dialer_of_a_relayed_connection_closes_it() {
        let mut state = ReachState::new(false);
        let peer = PeerId::random();
        state.connection_opened(peer, ConnectionId::new_unchecked(1), true, false);
        state.connection_opened(peer, ConnectionId::new_unchecked(2), false, true);
        assert_eq!(state.path_to(&peer), Some(P2pPath::Direct));
        assert!(state.superseded_relayed(&peer).is_empty());
    }

    #[test]
    fn a_direct_connection_supersedes_the_relayed_ones() {
        let mut state = ReachState::new(false);
        let peer = PeerId::random();
        let relayed = ConnectionId::new_unchecked(1);
        let direct = ConnectionId::new_unchecked(2);
        assert_eq!(state.path_to(&peer), None);
        state.connection_opened(peer, relayed, true, true);
        assert_eq!(state.path_to(&peer), Some(P2pPath::Relayed));
        assert!(state.superseded_relayed(&peer).is_empty());
        state.connection_opened(peer, direct, false, false);
        assert_eq!(state.path_to(&peer), Some(P2pPath::Direct));
        assert_eq!(state.superseded_relayed(&peer), vec![relayed]);
        state.connection_closed(peer, relayed);
        assert!(state.superseded_relayed(&peer).is_empty());
        state.connection_closed(peer, direct);
        assert_eq!(state.path_to(&peer), None);
    }
}
