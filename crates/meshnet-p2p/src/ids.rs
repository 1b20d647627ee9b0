//! The one place libp2p's peer id meets the project's [`meshnet_types::PeerId`].

use libp2p::PeerId;
pub use meshnet_types::PeerId as MeshPeerId;

use crate::P2pError;

/// The project's id of a libp2p peer.
pub fn mesh_peer_id(peer: &PeerId) -> MeshPeerId {
    MeshPeerId::new(peer.to_base58())
}

/// The libp2p peer id a project id names; fails when it is not a valid libp2p peer id.
pub fn libp2p_peer_id(peer: &MeshPeerId) -> Result<PeerId, P2pError> {
    peer.as_str()
        .parse()
        .map_err(|_| P2pError::InvalidPeerId(peer.to_string()))
}

/// Checks that `text` is a libp2p peer id (as `--tracker-id` takes it) and returns its
/// project form.
pub fn parse_peer_id(text: &str) -> Result<MeshPeerId, P2pError> {
    libp2p_peer_id(&MeshPeerId::new(text.trim())).map(|peer| mesh_peer_id(&peer))
}
