//! Members only: the tracker signs a grant for each session and route
//! ([`meshnet_wire::grant`]), and every member serves a `/forward` only with a valid one from the
//! tracker it follows (checked from the headers, before the body is read).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use libp2p::identity::{Keypair, PublicKey};
use meshnet_node::ForwardGate;
use meshnet_types::PeerId;
use meshnet_wire::grant::{Grant, GrantedFrame, SignedGrant};
use meshnet_wire::{Route, WireError};
use uuid::Uuid;

use crate::locking::lock;

/// How long a grant the tracker issues for a generation stays valid. A generation that runs
/// longer gets a fresh grant with its next frame.
pub const GRANT_TTL: Duration = Duration::from_secs(15 * 60);

/// How many verified grants a member remembers (each is verified once, then looked up).
const VERIFIED_GRANTS: usize = 4096;

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

fn refused(reason: impl Into<String>) -> WireError {
    WireError::GrantRefused {
        reason: reason.into(),
    }
}

/// Signs grants with this member's identity key (used while it is the tracker).
pub struct GrantSigner {
    keypair: Keypair,
    peer: PeerId,
}

impl GrantSigner {
    /// A signer with `keypair`.
    pub fn new(keypair: Keypair) -> Self {
        let peer = meshnet_p2p::mesh_peer_id(&keypair.public().to_peer_id());
        GrantSigner { keypair, peer }
    }

    /// The `X-Meshnet-Grant` value for `session` travelling `route` (every hop after the
    /// entry), valid for `ttl`, and when it expires (ms since the Unix epoch).
    pub fn issue(
        &self,
        session: Uuid,
        route: Route,
        ttl: Duration,
    ) -> Result<(String, u64), String> {
        let grant = Grant {
            tracker: self.peer.as_str().to_owned(),
            session,
            expires_unix_ms: now_unix_ms().saturating_add(ttl.as_millis() as u64),
            route,
        };
        let signature = self
            .keypair
            .sign(&grant.payload())
            .map_err(|error| format!("signing a grant failed: {error}"))?;
        Ok((grant.header_value(&signature), grant.expires_unix_ms))
    }
}

/// The public key inside an Ed25519 peer id (such ids embed their key).
fn public_key_of(peer: &str) -> Result<PublicKey, WireError> {
    let id: libp2p::PeerId = peer
        .parse()
        .map_err(|_| refused(format!("{peer:?} is not a peer id")))?;
    let multihash: &libp2p::multihash::Multihash<64> = id.as_ref();
    if multihash.code() != 0 {
        return Err(refused(format!("peer id {peer} does not embed its key")));
    }
    PublicKey::try_decode_protobuf(multihash.digest())
        .map_err(|_| refused(format!("peer id {peer} does not embed a usable key")))
}

/// The tracker a member follows now, as the gate asks for it frame by frame.
pub(crate) type FollowedTracker = Arc<dyn Fn() -> Option<PeerId> + Send + Sync>;

/// Admits a `/forward` only with a grant of the tracker this member follows that covers the
/// frame.
pub(crate) struct MemberGate {
    followed: FollowedTracker,
    /// Grants whose signature checked out, with their expiry.
    verified: Mutex<HashMap<String, u64>>,
}

impl MemberGate {
    /// A gate admitting grants of the tracker `followed` names at each frame.
    pub(crate) fn new(followed: FollowedTracker) -> Self {
        MemberGate {
            followed,
            verified: Mutex::default(),
        }
    }

    fn verify_signature(&self, value: &str, signed: &SignedGrant) -> Result<(), WireError> {
        if lock(&self.verified).contains_key(value) {
            return Ok(());
        }
        let key = public_key_of(&signed.grant.tracker)?;
        if !key.verify(&signed.payload, &signed.signature) {
            return Err(refused("the signature does not match the grant"));
        }
        let mut verified = lock(&self.verified);
        if verified.len() >= VERIFIED_GRANTS {
            let now = now_unix_ms();
            verified.retain(|_, expires| *expires > now);
            if verified.len() >= VERIFIED_GRANTS {
                verified.clear();
            }
        }
        verified.insert(value.to_owned(), signed.grant.expires_unix_ms);
        Ok(())
    }
}

impl ForwardGate for MemberGate {
    fn admit(&self, frame: &GrantedFrame<'_>) -> Result<(), WireError> {
        let value = frame.grant.ok_or(WireError::GrantMissing)?;
        let signed = SignedGrant::parse(value)?;
        let grant = &signed.grant;
        let now = now_unix_ms();
        if grant.expires_unix_ms <= now {
            return Err(refused(format!(
                "the grant expired {} s ago",
                (now - grant.expires_unix_ms) / 1000
            )));
        }
        let tracker = (self.followed)();
        if tracker.as_ref().map(PeerId::as_str) != Some(grant.tracker.as_str()) {
            return Err(refused(format!(
                "the grant is signed by {}, but this member follows {}",
                grant.tracker,
                tracker.map_or_else(|| "no tracker yet".to_owned(), |t| t.to_string())
            )));
        }
        self.verify_signature(value, &signed)?;
        if !grant.covers(frame.session, frame.layers, &frame.ahead) {
            return Err(refused(format!(
                "the grant does not cover this frame: session {} for layers {}-{} with route {:?}",
                frame.session,
                frame.layers.start,
                frame.layers.end,
                frame.ahead.to_string()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use meshnet_types::LayerSpan;
    use meshnet_wire::Hop;

    #[test]
    fn an_issued_grant_verifies_with_the_key_in_the_signers_peer_id() {
        let signer = GrantSigner::new(Keypair::generate_ed25519());
        let route = Route::new(vec![Hop::new(LayerSpan::new(3, 9), "/p2p/x").unwrap()]).unwrap();
        let (value, expires) = signer.issue(Uuid::from_u128(1), route, GRANT_TTL).unwrap();
        assert!(expires > now_unix_ms());
        let signed = SignedGrant::parse(&value).unwrap();
        let key = public_key_of(&signed.grant.tracker).unwrap();
        assert!(key.verify(&signed.payload, &signed.signature));
        let mut forged = signed.payload.clone();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(!key.verify(&forged, &signed.signature));
        let other = GrantSigner::new(Keypair::generate_ed25519());
        assert!(public_key_of(other.peer.as_str()).is_ok());
        assert!(public_key_of("not-a-peer").is_err());
    }
}
