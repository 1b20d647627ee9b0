//! The activation plane over libp2p streams: how this member reaches peers others cannot dial
//! (named `/p2p/<peer id>` in a route), and how it answers such streams, from members of the
//! mesh only.

use std::sync::Arc;

use meshnet_metrics::HopPath;
use meshnet_node::stream::{OpenFuture, OpenedStream, StreamOpener, serve_stream};
use meshnet_p2p::{P2pHandle, P2pPath};
use meshnet_types::PeerId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::PeerError;
use crate::member::Member;
use crate::rejections::RejectionReport;

/// Opens activation-plane streams through the member's libp2p node.
pub(crate) struct LibP2pStreams(pub(crate) P2pHandle);

impl StreamOpener for LibP2pStreams {
    fn open(&self, peer: &str) -> OpenFuture {
        let handle = self.0.clone();
        let peer = PeerId::new(peer);
        Box::pin(async move {
            let stream = handle
                .open_http_stream(&peer)
                .await
                .map_err(|error| error.to_string())?;
            Ok(OpenedStream {
                io: Box::new(stream),
                path: hop_path(handle.path_to(&peer)),
            })
        })
    }
}

/// The path a libp2p stream takes: direct unless only relayed connections are up.
pub(crate) fn hop_path(path: Option<P2pPath>) -> HopPath {
    match path {
        Some(P2pPath::Relayed) => HopPath::Relayed,
        _ => HopPath::DirectP2p,
    }
}

/// Answers the activation-plane streams other members open to this one with `plane` (the
/// `/forward` and `/sessions` routes), until `stop` turns true. A stream from a peer that is
/// not a member of the mesh (neither its tracker nor in its coverage map) is closed unread and
/// counted among the refusals.
pub(crate) fn serve_streams(
    member: Arc<Member>,
    plane: axum::Router,
    mut stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, PeerError> {
    let mut incoming = member.p2p.accept_http_streams()?;
    Ok(tokio::spawn(async move {
        loop {
            let (peer, stream) = tokio::select! {
                next = incoming.next() => match next {
                    Some(next) => next,
                    None => break,
                },
                _ = stop.wait_for(|stopped| *stopped) => break,
            };
            if !member.is_mesh_member(&peer) {
                tracing::warn!(%peer, "refusing an activation stream from a peer outside the coverage map");
                member.count_rejection(RejectionReport {
                    from: peer,
                    topic: "activation-stream".to_owned(),
                    reason: "not a member of the coverage map".to_owned(),
                });
                continue;
            }
            tokio::spawn(serve_stream(stream, plane.clone()));
        }
    }))
}
