//! What a member reports of the gossip messages and peers it refused (listed in `/status`).

use meshnet_types::PeerId;
use serde::{Deserialize, Serialize};

/// One refused gossip message or peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectionReport {
    /// The signed sender (or the peer refused).
    pub from: PeerId,
    /// The gossip topic it came on (`identify` for a peer of another model).
    pub topic: String,
    /// Why it was refused.
    pub reason: String,
}
