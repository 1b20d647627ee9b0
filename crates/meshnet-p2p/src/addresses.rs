//! Small facts about libp2p addresses: the peer id at their end, and whether they are relayed.

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

/// Splits `/…/p2p/<id>` into the peer id and the address before it.
pub(crate) fn split_peer_id(address: &Multiaddr) -> Option<(PeerId, Multiaddr)> {
    let mut rest = address.clone();
    match rest.pop() {
        Some(Protocol::P2p(peer)) => Some((peer, rest)),
        _ => None,
    }
}

/// Whether `address` is a relayed (`/p2p-circuit`) address.
pub(crate) fn is_circuit(address: &Multiaddr) -> bool {
    address
        .iter()
        .any(|part| matches!(part, Protocol::P2pCircuit))
}

/// `address` without a trailing `/p2p/<id>`.
pub(crate) fn without_peer_id(address: &Multiaddr) -> Multiaddr {
    match split_peer_id(address) {
        Some((_, rest)) => rest,
        None => address.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(text: &str) -> Multiaddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_peer_id_at_the_end_is_split_off() {
        let peer = PeerId::random();
        let full = address("/ip4/10.0.0.1/tcp/4001").with(Protocol::P2p(peer));
        assert_eq!(
            split_peer_id(&full),
            Some((peer, address("/ip4/10.0.0.1/tcp/4001")))
        );
        assert_eq!(without_peer_id(&full), address("/ip4/10.0.0.1/tcp/4001"));
        assert_eq!(split_peer_id(&address("/ip4/10.0.0.1/tcp/4001")), None);
        assert_eq!(
            without_peer_id(&address("/ip4/10.0.0.1/tcp/4001")),
            address("/ip4/10.0.0.1/tcp/4001")
        );
    }

    #[test]
    fn only_circuit_addresses_are_relayed() {
        let relay = PeerId::random();
        let circuit = address("/ip4/10.0.0.1/tcp/4001")
            .with(Protocol::P2p(relay))
            .with(Protocol::P2pCircuit);
        assert!(is_circuit(&circuit));
        assert!(!is_circuit(&address("/ip4/10.0.0.1/tcp/4001")));
        assert!(!is_circuit(
            &address("/ip4/10.0.0.1/tcp/4001").with(Protocol::P2p(relay))
        ));
    }
}
