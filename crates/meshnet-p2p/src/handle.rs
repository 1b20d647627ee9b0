//! The handle applications hold on a running node, and the commands it sends the event loop.

use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

use crate::P2pError;
use crate::behaviour::HTTP_PROTOCOL;
use crate::ids::{MeshPeerId, libp2p_peer_id, mesh_peer_id};
use crate::messages::{
    CoverageMessage, DirectiveMessage, PeerAnnouncement, TopicKind, TrackerRecord, encode,
};
use crate::reach::{ActiveStreams, P2pPath, Reachability, SharedReach, StreamActivity};
use crate::traffic::{GossipTraffic, TrafficCounters};

/// How long [`P2pHandle::listen_addrs`] waits for the first listener.
const LISTEN_ADDRS_DEADLINE: Duration = Duration::from_secs(5);

/// How long [`P2pHandle::open_http_stream`] may take to connect and open a stream.
const OPEN_STREAM_DEADLINE: Duration = Duration::from_secs(10);

/// A byte stream to a peer for the activation plane, usable with tokio's I/O traits. While
/// it lives, the relayed connections to that peer are not closed under it.
#[derive(Debug)]
pub struct P2pStream {
    inner: Compat<libp2p::Stream>,
    _activity: StreamActivity,
}

impl tokio::io::AsyncRead for P2pStream {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for P2pStream {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Where the event loop sends the answer to a command.
pub(crate) type Reply<T> = oneshot::Sender<T>;

/// A request from a handle to the event loop, with where to answer it.
pub(crate) enum Command {
    /// The listen addresses, once there is one (`wait`) or at once.
    ListenAddrs {
        /// Whether to wait for the first listener.
        wait: bool,
        /// The answer.
        reply: Reply<Vec<Multiaddr>>,
    },
    /// Gossips `data` on the `kind` topic.
    Publish {
        /// The topic.
        kind: TopicKind,
        /// The encoded message.
        data: Vec<u8>,
        /// The answer.
        reply: Reply<Result<(), P2pError>>,
    },
    /// Stores (and keeps re-storing) this node's tracker record.
    SetTrackerRecord {
        /// The record.
        record: TrackerRecord,
        /// The answer.
        reply: Reply<Result<(), P2pError>>,
    },
    /// Dials an address.
    Dial {
        /// The address.
        address: Multiaddr,
        /// The answer.
        reply: Reply<Result<(), P2pError>>,
    },
    /// The peers with a connection up.
    ConnectedPeers {
        /// The answer.
        reply: Reply<Vec<PeerId>>,
    },
    /// The tracker whose messages are accepted.
    Tracker {
        /// The answer.
        reply: Reply<Option<PeerId>>,
    },
    /// Answers once a connection to `peer` is up (dialing it if needed).
    Connect {
        /// The peer.
        peer: PeerId,
        /// The answer.
        reply: Reply<Result<(), P2pError>>,
    },
    /// Makes this node the tracker of `term`.
    TakeTrackerRole {
        /// The term.
        term: u64,
        /// The answer.
        reply: Reply<()>,
    },
    /// Stops the event loop.
    Shutdown {
        /// Answered once the swarm is dropped.
        reply: Reply<()>,
    },
}

/// A cloneable handle to a running control-plane node.
///
/// Every method talks to the event loop over a bounded channel; once the loop
/// has stopped they return [`P2pError::Stopped`].
#[derive(Clone)]
pub struct P2pHandle {
    local_peer_id: PeerId,
    commands: mpsc::Sender<Command>,
    traffic: Arc<TrafficCounters>,
    reach: SharedReach,
    streams: libp2p_stream::Control,
    active_streams: ActiveStreams,
}

impl std::fmt::Debug for P2pHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pHandle")
            .field("local_peer_id", &self.local_peer_id)
            .finish_non_exhaustive()
    }
}

/// Activation-plane streams other peers open to this node, with who opened each (the peer
/// id is authenticated by the connection's handshake).
pub struct IncomingHttpStreams {
    incoming: libp2p_stream::IncomingStreams,
    active: ActiveStreams,
}

impl IncomingHttpStreams {
    /// The next stream and the peer that opened it; `None` once the node has stopped.
    pub async fn next(&mut self) -> Option<(MeshPeerId, P2pStream)> {
        let (peer, stream) = futures::StreamExt::next(&mut self.incoming).await?;
        Some((
            mesh_peer_id(&peer),
            P2pStream {
                inner: stream.compat(),
                _activity: self.active.begin(peer),
            },
        ))
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Command::ListenAddrs { .. } => "ListenAddrs",
            Command::Publish { .. } => "Publish",
            Command::SetTrackerRecord { .. } => "SetTrackerRecord",
            Command::Dial { .. } => "Dial",
            Command::ConnectedPeers { .. } => "ConnectedPeers",
            Command::Tracker { .. } => "Tracker",
            Command::Connect { .. } => "Connect",
            Command::TakeTrackerRole { .. } => "TakeTrackerRole",
            Command::Shutdown { .. } => "Shutdown",
        };
        f.write_str(name)
    }
}

impl P2pHandle {
    /// A handle on the event loop that reads `commands`, sharing its gossip counters, its
    /// reachability and its stream bookkeeping.
    pub(crate) fn new(
        local_peer_id: PeerId,
        commands: mpsc::Sender<Command>,
        traffic: Arc<TrafficCounters>,
        reach: SharedReach,
        streams: libp2p_stream::Control,
        active_streams: ActiveStreams,
    ) -> Self {
        Self {
            local_peer_id,
            commands,
            traffic,
            reach,
            streams,
            active_streams,
        }
    }

    /// This node's peer id.
    pub fn local_peer_id(&self) -> MeshPeerId {
        mesh_peer_id(&self.local_peer_id)
    }

    /// The gossip this node has published and received so far (payload bytes). Reads
    /// counters; never waits for the event loop.
    pub fn gossip_traffic(&self) -> GossipTraffic {
        self.traffic.snapshot()
    }

    async fn request<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, P2pError> {
        let (reply, response) = oneshot::channel();
        self.commands
            .send(command(reply))
            .await
            .map_err(|_| P2pError::Stopped)?;
        response.await.map_err(|_| P2pError::Stopped)
    }

    /// The addresses the node listens on (without a `/p2p/<id>` suffix).
    ///
    /// Waits until at least one listener is up, or returns what is known (possibly
    /// nothing) after a short deadline.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, P2pError> {
        let waiting = self.request(|reply| Command::ListenAddrs { wait: true, reply });
        match tokio::time::timeout(LISTEN_ADDRS_DEADLINE, waiting).await {
            Ok(addresses) => addresses,
            Err(_) => {
                self.request(|reply| Command::ListenAddrs { wait: false, reply })
                    .await
            }
        }
    }

    async fn publish(&self, kind: TopicKind, data: Vec<u8>) -> Result<(), P2pError> {
        self.request(|reply| Command::Publish { kind, data, reply })
            .await?
    }

    /// Gossips an announcement on the model's announce topic.
    ///
    /// Succeeds (and sends nothing) while no peer subscribes to the topic.
    pub async fn publish_announcement(
        &self,
        announcement: PeerAnnouncement,
    ) -> Result<(), P2pError> {
        self.publish(TopicKind::Announce, encode(&announcement)?)
            .await
    }

    /// Gossips a coverage map on the model's coverage topic (receivers accept it only from the tracker).
    pub async fn publish_coverage(&self, coverage: CoverageMessage) -> Result<(), P2pError> {
        self.publish(TopicKind::Coverage, encode(&coverage)?).await
    }

    /// Gossips directives on the model's directives topic.
    ///
    /// There is no local authorisation check: receivers accept directives only from the tracker.
    pub async fn publish_directive(&self, directive: DirectiveMessage) -> Result<(), P2pError> {
        self.publish(TopicKind::Directives, encode(&directive)?)
            .await
    }

    /// Stores the tracker record in Kademlia and re-stores it every
    /// `record_republish_interval`. An empty `addresses` list is filled in with the
    /// node's external addresses (or its listen addresses if none is known).
    pub async fn set_tracker_record(&self, record: TrackerRecord) -> Result<(), P2pError> {
        self.request(|reply| Command::SetTrackerRecord { record, reply })
            .await?
    }

    /// Dials `address`; the outcome shows up as [`P2pEvent::PeerConnected`].
    pub async fn dial(&self, address: Multiaddr) -> Result<(), P2pError> {
        self.request(|reply| Command::Dial { address, reply })
            .await?
    }

    /// Peers with at least one established connection.
    pub async fn connected_peers(&self) -> Result<Vec<MeshPeerId>, P2pError> {
        let peers = self
            .request(|reply| Command::ConnectedPeers { reply })
            .await?;
        Ok(peers.iter().map(mesh_peer_id).collect())
    }

    /// The tracker whose coverage maps and directives are currently accepted.
    pub async fn tracker(&self) -> Result<Option<MeshPeerId>, P2pError> {
        let tracker = self.request(|reply| Command::Tracker { reply }).await?;
        Ok(tracker.as_ref().map(mesh_peer_id))
    }

    /// Makes this node the tracker of `term` (a takeover after the tracker went silent): it
    /// authorises itself, stops looking the tracker up, and peers accept its coverage maps
    /// if it is on their succession list. A later claim that beats `term` makes it a follower
    /// again (reported as a [`P2pEvent::Coverage`] from the new tracker).
    pub async fn take_tracker_role(&self, term: u64) -> Result<(), P2pError> {
        self.request(|reply| Command::TakeTrackerRole { term, reply })
            .await
    }

    /// Whether others can dial this node.
    pub fn reachability(&self) -> Reachability {
        self.reach.lock().reachability
    }

    /// How this node is connected to `peer` over libp2p right now (`None`: not connected).
    pub fn path_to(&self, peer: &MeshPeerId) -> Option<P2pPath> {
        let peer = libp2p_peer_id(peer).ok()?;
        self.reach.lock().path_to(&peer)
    }

    /// This node's relayed (`/p2p-circuit`) addresses, where peers reach it when they cannot
    /// dial it: one per relay that holds a reservation for it.
    pub fn circuit_addresses(&self) -> Vec<Multiaddr> {
        self.reach.lock().circuit_addresses().to_vec()
    }

    /// Opens an activation-plane stream to `peer`: over a connection that is already up,
    /// else after dialing the addresses it announced (directly, or through its relays).
    pub async fn open_http_stream(&self, peer: &MeshPeerId) -> Result<P2pStream, P2pError> {
        let target = libp2p_peer_id(peer)?;
        let stream_error = |reason: String| P2pError::Stream {
            peer: peer.to_string(),
            reason,
        };
        // Counted from before the stream exists, so a relayed connection it may land on is not
        // closed under it.
        let activity = self.active_streams.begin(target);
        let opening = async {
            self.request(|reply| Command::Connect {
                peer: target,
                reply,
            })
            .await??;
            let mut control = self.streams.clone();
            control
                .open_stream(target, HTTP_PROTOCOL)
                .await
                .map_err(|error| stream_error(error.to_string()))
        };
        match tokio::time::timeout(OPEN_STREAM_DEADLINE, opening).await {
            Ok(stream) => Ok(P2pStream {
                inner: stream?.compat(),
                _activity: activity,
            }),
            Err(_) => Err(stream_error(format!(
                "not open after {} s",
                OPEN_STREAM_DEADLINE.as_secs()
            ))),
        }
    }

    /// The activation-plane streams other peers open to this node. There is one such
    /// listener per node: a second call fails.
    pub fn accept_http_streams(&self) -> Result<IncomingHttpStreams, P2pError> {
        let mut control = self.streams.clone();
        control
            .accept(HTTP_PROTOCOL)
            .map(|incoming| IncomingHttpStreams {
                incoming,
                active: self.active_streams.clone(),
            })
            .map_err(|_| P2pError::Behaviour(format!("{HTTP_PROTOCOL} is already accepted")))
    }

    /// Stops the event loop and drops the swarm (closing every connection).
    pub async fn shutdown(&self) {
        // An error means the loop has already stopped.
        let _ = self.request(|reply| Command::Shutdown { reply }).await;
    }
}
