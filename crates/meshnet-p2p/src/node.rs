//! The swarm-owning event loop and the handle that drives it.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, PublishError, TopicHash};
use libp2p::kad::{self, GetRecordOk, QueryId, QueryResult, Quorum, RecordKey};
use libp2p::metrics::{Recorder, Registry};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, autonat, dcutr, identify, relay};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Sleep;
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

use crate::P2pError;
use crate::behaviour::{
    HTTP_PROTOCOL, KADEMLIA_PROTOCOL, MeshBehaviour, MeshBehaviourEvent, build_swarm,
};
use crate::config::{P2pConfig, Role};
use crate::events::P2pEvent;
use crate::freshness::AnnouncementFreshness;
use crate::ids::{MeshPeerId, libp2p_peer_id, mesh_peer_id};
use crate::messages::{
    CoverageMessage, DirectiveMessage, PeerAnnouncement, TopicKind, TrackerRecord, decode, encode,
    topic_name, tracker_record_key,
};
use crate::outbox::Outbox;
use crate::private::{is_quic, swarm_key_fingerprint};
use crate::reach::{ActiveStreams, ModelPeers, P2pPath, Reachability, SharedReach, StreamActivity};
use crate::traffic::{GossipTraffic, TrafficCounters};
use crate::validation::{Admission, Verdict};

/// Capacity of the command channel from handles to the event loop.
const COMMAND_CAPACITY: usize = 64;

/// Capacity of the event channel to the application.
const EVENT_CAPACITY: usize = 256;

/// Lifetime of the tracker record in the DHT; the tracker re-stores it well before.
const TRACKER_RECORD_TTL: Duration = Duration::from_secs(300);

/// How long [`P2pHandle::listen_addrs`] waits for the first listener.
const LISTEN_ADDRS_DEADLINE: Duration = Duration::from_secs(5);

/// How long [`P2pHandle::open_http_stream`] may take to connect and open a stream.
const OPEN_STREAM_DEADLINE: Duration = Duration::from_secs(10);

/// How long a relayed connection stays open once a direct one to the same peer exists, so
/// that requests already on it finish.
const RELAYED_GRACE: Duration = Duration::from_secs(5);

/// How many relays a node that others cannot dial keeps a reservation on.
const RELAY_RESERVATIONS: usize = 2;

/// How long after a reservation on a relay failed or was lost it is tried again.
const RESERVATION_RETRY: Duration = Duration::from_secs(2);

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

type Reply<T> = oneshot::Sender<T>;

enum Command {
    ListenAddrs {
        wait: bool,
        reply: Reply<Vec<Multiaddr>>,
    },
    Publish {
        kind: TopicKind,
        data: Vec<u8>,
        reply: Reply<Result<(), P2pError>>,
    },
    SetTrackerRecord {
        record: TrackerRecord,
        reply: Reply<Result<(), P2pError>>,
    },
    Dial {
        address: Multiaddr,
        reply: Reply<Result<(), P2pError>>,
    },
    ConnectedPeers {
        reply: Reply<Vec<PeerId>>,
    },
    Tracker {
        reply: Reply<Option<PeerId>>,
    },
    Connect {
        peer: PeerId,
        reply: Reply<Result<(), P2pError>>,
    },
    TakeTrackerRole {
        term: u64,
        reply: Reply<()>,
    },
    Shutdown {
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

/// Starts a node: builds the swarm, listens, dials the bootstrap addresses,
/// subscribes to the model's topics and spawns the event loop on the current
/// tokio runtime.
///
/// Fails if the swarm cannot be built or no listen address can be bound.
pub async fn spawn(config: P2pConfig) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    start(config, None).await
}

/// [`spawn`], also exporting libp2p's own swarm, gossipsub, Kademlia, identify, ping, relay
/// and DCUtR metrics in `registry` (under `libp2p_`).
pub async fn spawn_registered(
    config: P2pConfig,
    registry: &mut Registry,
) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    let libp2p_metrics = libp2p::metrics::Metrics::new(registry);
    start(config, Some(libp2p_metrics)).await
}

/// Listens on every configured address that can be bound (in a private mesh, none over
/// QUIC); fails only if none can.
fn listen_all(swarm: &mut Swarm<MeshBehaviour>, config: &P2pConfig) -> Result<(), P2pError> {
    let mut listen_failures = Vec::new();
    let mut listening = 0usize;
    if let Some(key) = &config.swarm_key {
        tracing::info!(
            fingerprint = %swarm_key_fingerprint(key),
            "private mesh: only members holding this swarm key can connect; QUIC is off"
        );
    }
    for address in &config.listen {
        if config.swarm_key.is_some() && is_quic(address) {
            listen_failures.push(format!(
                "{address}: QUIC is off in a private mesh (it cannot carry the swarm key)"
            ));
            continue;
        }
        match swarm.listen_on(address.clone()) {
            Ok(_) => listening += 1,
            Err(error) => listen_failures.push(format!("{address}: {error}")),
        }
    }
    if listening == 0 {
        let reason = if listen_failures.is_empty() {
            "no listen address configured".to_owned()
        } else {
            listen_failures.join("; ")
        };
        return Err(P2pError::Listen(reason));
    }
    for failure in &listen_failures {
        tracing::warn!(%failure, "listen address not bound");
    }
    Ok(())
}

async fn start(
    config: P2pConfig,
    libp2p_metrics: Option<libp2p::metrics::Metrics>,
) -> Result<(P2pHandle, mpsc::Receiver<P2pEvent>), P2pError> {
    let model_peers = ModelPeers::default();
    let mut swarm = build_swarm(&config, &model_peers)?;
    let streams = swarm.behaviour().streams.new_control();
    let reach = SharedReach::new(config.assume_reachable);
    let active_streams = ActiveStreams::default();
    let local_peer_id = *swarm.local_peer_id();

    listen_all(&mut swarm, &config)?;

    let mut topics = HashMap::new();
    for kind in TopicKind::ALL {
        let topic = IdentTopic::new(topic_name(&config.model_id, kind));
        swarm
            .behaviour_mut()
            .gossipsub
            .subscribe(&topic)
            .map_err(|error| P2pError::Behaviour(format!("subscribing to {topic}: {error}")))?;
        topics.insert(kind, topic);
    }

    for address in &config.bootstrap {
        if let Some((peer, peer_address)) = split_peer_id(address) {
            swarm
                .behaviour_mut()
                .kademlia
                .add_address(&peer, peer_address);
        }
        if let Err(error) = swarm.dial(address.clone()) {
            tracing::warn!(%address, %error, "bootstrap dial failed");
        }
    }

    let pinned_tracker = match &config.role {
        Role::Peer {
            pinned_tracker: Some(pinned),
        } => Some(libp2p_peer_id(pinned)?),
        _ => None,
    };
    let tracker = match config.role {
        Role::Tracker => Some(local_peer_id),
        Role::Peer { .. } => pinned_tracker,
    };
    let (command_sender, commands) = mpsc::channel(COMMAND_CAPACITY);
    let (event_sender, events) = mpsc::channel(EVENT_CAPACITY);
    let traffic = Arc::new(TrafficCounters::default());
    let event_loop = EventLoop {
        traffic: Arc::clone(&traffic),
        metrics: config.metrics.clone(),
        libp2p_metrics,
        outbox: Outbox::default(),
        announcement_freshness: AnnouncementFreshness::default(),
        topic_kinds: topics
            .iter()
            .map(|(kind, topic)| (topic.hash(), *kind))
            .collect(),
        topics,
        swarm,
        commands,
        events: event_sender,
        local_peer_id,
        model_id: config.model_id,
        is_tracker: matches!(config.role, Role::Tracker),
        term: u64::from(matches!(config.role, Role::Tracker)),
        succession: Vec::new(),
        heard_tracker_at: None,
        takeover_silence: config.takeover_silence,
        start_grace_until: matches!(config.role, Role::Tracker)
            .then(|| Instant::now() + config.tracker_start_grace),
        followed_another: false,
        pinned_tracker,
        assume_reachable: config.assume_reachable,
        tracker,
        discovered_record: None,
        tracker_query: None,
        tracker_lookup_interval: config.tracker_lookup_interval,
        tracker_refresh_interval: config.tracker_refresh_interval,
        own_record: None,
        record_republish_interval: config.record_republish_interval,
        listen_addrs: Vec::new(),
        listen_waiters: Vec::new(),
        bootstrapped: false,
        bootstrap: config.bootstrap.clone(),
        same_model_peers: model_peers,
        reach: reach.clone(),
        reserve_relays: config.reserve_relays,
        relays: RelaySlots::default(),
        peer_addresses: HashMap::new(),
        connect_waiters: HashMap::new(),
        connect_dials: HashMap::new(),
        relayed_closes: Vec::new(),
        active_streams: active_streams.clone(),
    };
    tokio::spawn(event_loop.run());
    Ok((
        P2pHandle {
            local_peer_id,
            commands: command_sender,
            traffic,
            reach,
            streams,
            active_streams,
        },
        events,
    ))
}

/// The libp2p ids of a succession list (ids that do not parse are left out).
fn parse_succession(list: &[meshnet_types::PeerId]) -> Vec<PeerId> {
    list.iter()
        .filter_map(|peer| libp2p_peer_id(peer).ok())
        .collect()
}

/// Splits `/…/p2p/<id>` into the peer id and the address before it.
fn split_peer_id(address: &Multiaddr) -> Option<(PeerId, Multiaddr)> {
    let mut rest = address.clone();
    match rest.pop() {
        Some(Protocol::P2p(peer)) => Some((peer, rest)),
        _ => None,
    }
}

/// How often a node with no connection dials its bootstrap addresses again.
const BOOTSTRAP_REDIAL_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

struct EventLoop {
    /// Gossip published and received, read by the handles.
    traffic: Arc<TrafficCounters>,
    /// Gossip verdicts, exported by the application.
    metrics: meshnet_metrics::Metrics,
    /// libp2p's own metrics, when the application exports them.
    libp2p_metrics: Option<libp2p::metrics::Metrics>,
    /// Events waiting while the application's channel is full.
    outbox: Outbox,
    /// The newest announcement accepted from each peer: older ones are replays.
    announcement_freshness: AnnouncementFreshness,
    swarm: Swarm<MeshBehaviour>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<P2pEvent>,
    local_peer_id: PeerId,
    model_id: String,
    /// Whether this node is the tracker now.
    is_tracker: bool,
    /// The current tracker's term (0 before one is known).
    term: u64,
    /// Who may take over from the tracker: the list of the tracker this node follows, or its
    /// own while it is the tracker (empty before the first map, and on a pinned peer).
    succession: Vec<PeerId>,
    /// When the last coverage map of the followed tracker arrived.
    heard_tracker_at: Option<Instant>,
    /// A follower accepts a takeover only after this long without its tracker's maps.
    takeover_silence: Duration,
    /// Until when a node started as tracker yields to a later term from anyone.
    start_grace_until: Option<Instant>,
    /// Whether this node ever followed a tracker other than itself.
    followed_another: bool,
    /// The only tracker a peer accepts, when pinned.
    pinned_tracker: Option<PeerId>,
    assume_reachable: bool,
    topics: HashMap<TopicKind, IdentTopic>,
    topic_kinds: HashMap<TopicHash, TopicKind>,
    /// The tracker whose coverage and directives are accepted.
    tracker: Option<PeerId>,
    /// The last tracker record reported to the application.
    discovered_record: Option<TrackerRecord>,
    tracker_query: Option<QueryId>,
    tracker_lookup_interval: Duration,
    tracker_refresh_interval: Duration,
    /// The record this node (as tracker) keeps in the DHT.
    own_record: Option<TrackerRecord>,
    record_republish_interval: Duration,
    listen_addrs: Vec<Multiaddr>,
    listen_waiters: Vec<Reply<Vec<Multiaddr>>>,
    bootstrapped: bool,
    /// The configured bootstrap addresses, dialed again while no connection is up.
    bootstrap: Vec<Multiaddr>,
    /// Connected peers that identified themselves as running this node's model.
    same_model_peers: ModelPeers,
    /// Reachability, connections and circuit addresses, read by the handles.
    reach: SharedReach,
    /// Whether this node reserves slots on relays (others cannot dial it).
    reserve_relays: bool,
    relays: RelaySlots,
    /// The libp2p addresses each peer announced, for dialing it on demand.
    peer_addresses: HashMap<PeerId, Vec<Multiaddr>>,
    /// Who waits for a connection to a peer to come up.
    connect_waiters: HashMap<PeerId, Vec<Reply<Result<(), P2pError>>>>,
    /// The dials made for those waiters, each with the addresses it tries.
    connect_dials: HashMap<PeerId, Vec<(ConnectionId, Vec<Multiaddr>)>>,
    /// Relayed connections to close once their grace is over (a direct one supersedes them).
    relayed_closes: Vec<(Instant, PeerId, ConnectionId)>,
    /// The activation streams open with each peer (shared with the handles).
    active_streams: ActiveStreams,
}

/// The relays this node holds (or asks for) a reservation on, and the relays it could use.
#[derive(Default)]
struct RelaySlots {
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
    /// The next relay to reserve a slot on, `preferred` (the tracker) first; `None` when
    /// enough slots are held or asked for, or no candidate is left.
    fn next_relay(&self, preferred: Option<PeerId>, now: Instant) -> Option<(PeerId, Multiaddr)> {
        if self.listeners.len() >= RELAY_RESERVATIONS {
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
        candidates
            .first()
            .map(|(peer, address)| (**peer, (*address).clone()))
    }
}

/// Whether `address` is a relayed (`/p2p-circuit`) address.
fn is_circuit(address: &Multiaddr) -> bool {
    address
        .iter()
        .any(|part| matches!(part, Protocol::P2pCircuit))
}

/// `address` without a trailing `/p2p/<id>`.
fn without_peer_id(address: &Multiaddr) -> Multiaddr {
    match split_peer_id(address) {
        Some((_, rest)) => rest,
        None => address.clone(),
    }
}

impl EventLoop {
    async fn run(mut self) {
        let mut lookup_timer: Pin<Box<Sleep>> = Box::pin(tokio::time::sleep(Duration::ZERO));
        let republish_period = self
            .record_republish_interval
            .max(Duration::from_millis(100));
        let mut republish_timer = tokio::time::interval_at(
            tokio::time::Instant::now() + republish_period,
            republish_period,
        );
        republish_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut redial_timer = tokio::time::interval(BOOTSTRAP_REDIAL_INTERVAL);
        redial_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let redials = !self.bootstrap.is_empty();
        // Its own sender, so a permit to send does not borrow the loop.
        let events = self.events.clone();

        let shutdown_reply = loop {
            let looks_up_tracker = !self.is_tracker;
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.recv() => match command {
                    None => break None,
                    Some(Command::Shutdown { reply }) => break Some(reply),
                    Some(command) => self.on_command(command),
                },
                () = &mut lookup_timer, if looks_up_tracker => {
                    self.look_up_tracker();
                    let next = if self.reaches_tracker() {
                        self.tracker_refresh_interval
                    } else {
                        self.tracker_lookup_interval
                    };
                    lookup_timer.as_mut().reset(tokio::time::Instant::now() + next);
                }
                permit = events.reserve(), if !self.outbox.is_empty() => {
                    if let (Ok(permit), Some(event)) = (permit, self.outbox.pop()) {
                        permit.send(event);
                    }
                }
                _ = redial_timer.tick() => {
                    if redials {
                        self.redial_bootstrap();
                    }
                    self.close_superseded_relayed();
                    self.reserve_relays();
                }
                _ = republish_timer.tick(), if self.own_record.is_some() => {
                    if let Err(error) = self.store_own_record() {
                        tracing::warn!(%error, "re-storing the tracker record failed");
                    }
                }
            }
        };
        tracing::debug!(peer = %self.local_peer_id, "p2p event loop stopping");
        drop(self.swarm);
        if let Some(reply) = shutdown_reply {
            let _ = reply.send(());
        }
    }

    /// Hands `event` to the application, or keeps it in the outbox while the channel is full
    /// (or older events wait there).
    fn emit(&mut self, event: P2pEvent) {
        let event = if self.outbox.is_empty() {
            match self.events.try_send(event) {
                Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => return,
                Err(mpsc::error::TrySendError::Full(event)) => event,
            }
        } else {
            event
        };
        if !self.outbox.push(event) {
            tracing::warn!(
                dropped = self.outbox.dropped(),
                "p2p event consumer is too slow and the outbox is full: event dropped"
            );
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs { wait, reply } => {
                if wait && self.listen_addrs.is_empty() {
                    self.listen_waiters.push(reply);
                } else {
                    let _ = reply.send(self.listen_addrs.clone());
                }
            }
            Command::Publish { kind, data, reply } => {
                if kind == TopicKind::Coverage
                    && self.is_tracker
                    && let Ok(own) = decode::<CoverageMessage>(&data)
                {
                    // Who may take over from this node is the list it publishes.
                    self.succession = parse_succession(&own.succession);
                    self.term = self.term.max(own.term);
                }
                let _ = reply.send(self.publish(kind, data));
            }
            Command::SetTrackerRecord { mut record, reply } => {
                if record.addresses.is_empty() {
                    record.addresses = self.advertised_addresses();
                }
                self.own_record = Some(record);
                let _ = reply.send(self.store_own_record());
            }
            Command::Dial { address, reply } => {
                let result = self
                    .swarm
                    .dial(address.clone())
                    .map_err(|error| P2pError::Dial {
                        address: address.to_string(),
                        reason: error.to_string(),
                    });
                let _ = reply.send(result);
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Tracker { reply } => {
                let _ = reply.send(self.tracker);
            }
            Command::Connect { peer, reply } => self.connect(peer, reply),
            Command::TakeTrackerRole { term, reply } => {
                tracing::info!(term, "taking the tracker role");
                self.is_tracker = true;
                self.tracker = Some(self.local_peer_id);
                self.term = term;
                let _ = reply.send(());
            }
            Command::Shutdown { reply } => {
                // Handled by the loop itself; answered here only for completeness.
                let _ = reply.send(());
            }
        }
    }

    fn publish(&mut self, kind: TopicKind, data: Vec<u8>) -> Result<(), P2pError> {
        let Some(topic) = self.topics.get(&kind) else {
            return Err(P2pError::Publish {
                topic: kind.suffix().to_owned(),
                reason: "not subscribed".to_owned(),
            });
        };
        let bytes = data.len();
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(topic.clone(), data)
        {
            Ok(_) => {
                self.traffic.published(bytes);
                Ok(())
            }
            Err(PublishError::NoPeersSubscribedToTopic) => {
                tracing::debug!(%topic, "no subscriber yet, message not sent");
                Ok(())
            }
            Err(PublishError::Duplicate) => Ok(()),
            Err(error) => Err(P2pError::Publish {
                topic: topic.to_string(),
                reason: error.to_string(),
            }),
        }
    }

    fn advertised_addresses(&self) -> Vec<String> {
        let external: Vec<String> = self
            .swarm
            .external_addresses()
            .map(ToString::to_string)
            .collect();
        if external.is_empty() {
            self.listen_addrs.iter().map(ToString::to_string).collect()
        } else {
            external
        }
    }

    fn store_own_record(&mut self) -> Result<(), P2pError> {
        let Some(record) = &self.own_record else {
            return Ok(());
        };
        let mut dht_record = kad::Record::new(
            RecordKey::new(&tracker_record_key(&self.model_id)),
            encode(record)?,
        );
        dht_record.expires = Some(Instant::now() + TRACKER_RECORD_TTL);
        self.swarm
            .behaviour_mut()
            .kademlia
            .put_record(dht_record, Quorum::One)
            .map(|_| ())
            .map_err(|error| P2pError::RecordStore(error.to_string()))
    }

    /// Dials the bootstrap addresses again while this node has no connection at all (for
    /// example, it started before the node it bootstraps from was listening).
    fn on_connection_established(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        endpoint: &libp2p::core::ConnectedPoint,
        relayed: bool,
    ) {
        let superseded = {
            let mut reach = self.reach.lock();
            reach.connection_opened(peer, connection, relayed, endpoint.is_dialer());
            reach.superseded_relayed(&peer)
        };
        if !superseded.is_empty() {
            tracing::info!(%peer, "direct connection up: relayed connections close after a grace period");
            let at = Instant::now() + RELAYED_GRACE;
            for id in superseded {
                if !self.relayed_closes.iter().any(|(_, _, known)| *known == id) {
                    self.relayed_closes.push((at, peer, id));
                }
            }
        }
        if let libp2p::core::ConnectedPoint::Dialer { address, .. } = endpoint
            && !relayed
        {
            self.relays.dialed_at.insert(peer, without_peer_id(address));
        }
        self.connect_dials.remove(&peer);
        self.answer_connect_waiters(peer, Ok(()));
    }

    /// Closes the relayed connections whose grace is over (a direct connection to the same
    /// peer replaced them).
    fn close_superseded_relayed(&mut self) {
        let now = Instant::now();
        // A peer with a stream open waits for the next check (every second): a stream on a
        // connection closed under it would never hear of it.
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.relayed_closes)
            .into_iter()
            .partition(|(at, peer, _)| *at <= now && !self.active_streams.any_with(peer));
        self.relayed_closes = waiting;
        for (_, peer, connection) in due {
            if self.swarm.close_connection(connection) {
                tracing::info!(%peer, "relayed connection closed: traffic goes direct");
            }
        }
    }

    /// One of the dials [`Self::connect`] made failed: its waiters hear so once no other such
    /// dial to the peer is under way.
    fn on_connect_dial_failed(&mut self, peer: PeerId, connection: ConnectionId, error: String) {
        let Some(dials) = self.connect_dials.get_mut(&peer) else {
            return;
        };
        let before = dials.len();
        dials.retain(|(id, _)| *id != connection);
        if dials.len() == before || !dials.is_empty() {
            return;
        }
        self.connect_dials.remove(&peer);
        if !self.swarm.is_connected(&peer) {
            self.answer_connect_waiters(peer, Err(error));
        }
    }

    /// Answers whoever waits for a connection to `peer`.
    fn answer_connect_waiters(&mut self, peer: PeerId, outcome: Result<(), String>) {
        for waiter in self.connect_waiters.remove(&peer).unwrap_or_default() {
            let _ = waiter.send(outcome.clone().map_err(|reason| P2pError::Stream {
                peer: peer.to_string(),
                reason,
            }));
        }
    }

    /// Answers `reply` once a connection to `peer` is up: at once if one is, else after
    /// dialing the addresses it announced. A dial already under way to the same addresses is
    /// joined; one to addresses the peer has since replaced (say, LAN addresses before its
    /// relay reservation came) is not waited for: the new ones are dialed alongside.
    fn connect(&mut self, peer: PeerId, reply: Reply<Result<(), P2pError>>) {
        if self.swarm.is_connected(&peer) {
            let _ = reply.send(Ok(()));
            return;
        }
        let addresses = self.peer_addresses.get(&peer).cloned().unwrap_or_default();
        let dialing = self
            .connect_dials
            .get(&peer)
            .is_some_and(|dials| dials.iter().any(|(_, dialed)| *dialed == addresses));
        if dialing {
            self.connect_waiters.entry(peer).or_default().push(reply);
            return;
        }
        let dial = DialOpts::peer_id(peer)
            .addresses(addresses.clone())
            .condition(PeerCondition::Disconnected)
            .build();
        let connection = dial.connection_id();
        match self.swarm.dial(dial) {
            Ok(()) => {
                self.connect_dials
                    .entry(peer)
                    .or_default()
                    .push((connection, addresses));
                self.connect_waiters.entry(peer).or_default().push(reply);
            }
            Err(error) => {
                let _ = reply.send(Err(P2pError::Stream {
                    peer: peer.to_string(),
                    reason: error.to_string(),
                }));
            }
        }
    }

    /// Asks for reservations on relays until [`RELAY_RESERVATIONS`] are held or asked for.
    fn reserve_relays(&mut self) {
        if !self.reserve_relays {
            return;
        }
        let now = Instant::now();
        while let Some((relay, address)) = self.relays.next_relay(self.tracker, now) {
            let circuit = address
                .with(Protocol::P2p(relay))
                .with(Protocol::P2pCircuit);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    tracing::debug!(%relay, %circuit, "asking the relay for a reservation");
                    self.relays.listeners.insert(relay, listener);
                }
                Err(error) => {
                    tracing::warn!(%relay, %circuit, %error, "cannot listen through the relay");
                    self.relays
                        .retry_after
                        .insert(relay, now + RESERVATION_RETRY);
                }
            }
        }
    }

    /// A listener closed: when it held a relay reservation, another is asked for shortly.
    fn on_listener_closed(&mut self, listener: ListenerId, reason: Result<(), std::io::Error>) {
        let Some(relay) = self
            .relays
            .listeners
            .iter()
            .find_map(|(relay, id)| (*id == listener).then_some(*relay))
        else {
            return;
        };
        self.relays.listeners.remove(&relay);
        self.relays
            .retry_after
            .insert(relay, Instant::now() + RESERVATION_RETRY);
        match reason {
            Ok(()) => tracing::info!(%relay, "relay reservation ended: asking again"),
            Err(error) => {
                tracing::info!(%relay, %error, "relay reservation failed or was lost: asking again")
            }
        }
    }

    /// Keeps the libp2p addresses `peer` announced, to dial it when a stream to it is wanted.
    fn note_addresses(&mut self, peer: PeerId, announced: &[String]) {
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

    fn redial_bootstrap(&mut self) {
        if self.swarm.connected_peers().next().is_some() {
            return;
        }
        for address in self.bootstrap.clone() {
            if let Err(error) = self.swarm.dial(address.clone()) {
                tracing::debug!(%address, %error, "bootstrap redial failed");
            }
        }
    }

    /// Whether this node has its tracker: it found the record, or it hears the tracker's
    /// coverage maps. Until then it looks the record up every few seconds (and whenever a new
    /// DHT neighbour appears); after, only to refresh it, so a hundred members do not keep
    /// the DHT busy with queries whose answer they have.
    fn reaches_tracker(&self) -> bool {
        self.discovered_record.is_some() || self.heard_tracker_at.is_some()
    }

    fn look_up_tracker(&mut self) {
        if self.tracker_query.is_some() {
            return;
        }
        let key = RecordKey::new(&tracker_record_key(&self.model_id));
        self.tracker_query = Some(self.swarm.behaviour_mut().kademlia.get_record(key));
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<MeshBehaviourEvent>) {
        if let Some(metrics) = &self.libp2p_metrics {
            metrics.record(&event);
        }
        match event {
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            SwarmEvent::NewListenAddr { address, .. } if is_circuit(&address) => {
                tracing::info!(%address, "reachable through a relay");
                self.reach.lock().add_circuit_address(address);
            }
            SwarmEvent::ExpiredListenAddr { address, .. } if is_circuit(&address) => {
                self.reach.lock().remove_circuit_address(&address);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                addresses,
            } => {
                for address in &addresses {
                    self.reach.lock().remove_circuit_address(address);
                }
                self.on_listener_closed(listener_id, reason);
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
                if self.assume_reachable {
                    self.swarm.add_external_address(address.clone());
                }
                self.listen_addrs.push(address.clone());
                for waiter in self.listen_waiters.drain(..) {
                    let _ = waiter.send(self.listen_addrs.clone());
                }
                self.emit(P2pEvent::ListeningOn(address));
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|known| known != &address);
                if self.assume_reachable {
                    self.swarm.remove_external_address(&address);
                }
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                let relayed = endpoint.is_relayed();
                self.on_connection_established(peer_id, connection_id, &endpoint, relayed);
                if num_established.get() == 1 {
                    tracing::debug!(peer = %peer_id, relayed, "connected");
                    self.emit(P2pEvent::PeerConnected(mesh_peer_id(&peer_id)));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                self.reach.lock().connection_closed(peer_id, connection_id);
                if num_established == 0 {
                    tracing::debug!(peer = %peer_id, "disconnected");
                    self.same_model_peers.remove(&peer_id);
                    self.relays.candidates.remove(&peer_id);
                    self.relays.dialed_at.remove(&peer_id);
                    self.emit(P2pEvent::PeerDisconnected(mesh_peer_id(&peer_id)));
                }
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id,
                connection_id,
                error,
            } => {
                tracing::debug!(peer = ?peer_id, %error, "outgoing connection failed");
                if let Some(peer) = peer_id {
                    self.on_connect_dial_failed(peer, connection_id, error.to_string());
                }
            }
            _ => {}
        }
    }

    fn on_behaviour_event(&mut self, event: MeshBehaviourEvent) {
        if let Some(metrics) = &self.libp2p_metrics {
            match &event {
                MeshBehaviourEvent::Gossipsub(event) => metrics.record(event),
                MeshBehaviourEvent::Identify(event) => metrics.record(event),
                MeshBehaviourEvent::Kademlia(event) => metrics.record(event),
                MeshBehaviourEvent::Ping(event) => metrics.record(event),
                MeshBehaviourEvent::Dcutr(event) => metrics.record(event),
                _ => {}
            }
        }
        match event {
            MeshBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            }) => self.on_gossip_message(propagation_source, &message_id, message),
            MeshBehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                self.on_identified(peer_id, info);
            }
            MeshBehaviourEvent::Kademlia(kad::Event::OutboundQueryProgressed {
                id,
                result,
                step,
                ..
            }) => {
                if step.last && self.tracker_query == Some(id) {
                    self.tracker_query = None;
                }
                self.on_query_result(result);
            }
            MeshBehaviourEvent::Autonat(autonat::Event::StatusChanged { new, .. }) => {
                let public = matches!(new, autonat::NatStatus::Public(_));
                tracing::info!(?new, "reachability changed");
                if !self.assume_reachable {
                    self.reach.lock().reachability = match new {
                        autonat::NatStatus::Public(_) => Reachability::Public,
                        autonat::NatStatus::Private => Reachability::Private,
                        autonat::NatStatus::Unknown => Reachability::Unknown,
                    };
                }
                self.emit(P2pEvent::Reachability { public });
            }
            MeshBehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal: false,
                ..
            }) => {
                tracing::info!(relay = %relay_peer_id, "relay reservation accepted");
            }
            MeshBehaviourEvent::RelayServer(relay::Event::ReservationReqDenied {
                src_peer_id,
                ..
            }) => {
                tracing::info!(peer = %src_peer_id, "relay reservation refused (not a peer of this model, or no slot free)");
            }
            MeshBehaviourEvent::RelayServer(relay::Event::CircuitReqDenied {
                src_peer_id,
                dst_peer_id,
                ..
            }) => {
                tracing::info!(from = %src_peer_id, to = %dst_peer_id, "relay circuit refused");
            }
            MeshBehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(_) => {
                    tracing::info!(peer = %remote_peer_id, "hole punch succeeded: direct connection")
                }
                Err(error) => tracing::info!(
                    peer = %remote_peer_id,
                    %error,
                    "hole punch failed: traffic stays relayed"
                ),
            },
            _ => {}
        }
    }

    fn on_identified(&mut self, peer: PeerId, info: identify::Info) {
        let agent = crate::behaviour::parse_agent_version(&info.agent_version);
        if agent.is_some_and(|(model, _)| model == self.model_id) {
            self.same_model_peers.insert(peer);
            if self.reserve_relays && info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
                let address = self.relays.dialed_at.get(&peer).cloned().or_else(|| {
                    info.listen_addrs
                        .iter()
                        .find(|address| !is_circuit(address))
                        .map(without_peer_id)
                });
                if let Some(address) = address {
                    self.relays.candidates.entry(peer).or_insert(address);
                    self.reserve_relays();
                }
            }
        }
        if let Some((model, _)) = agent
            && model != self.model_id
        {
            // Decided from what this node knows, not from what the stranger claims to be.
            let decisive = self.tracker == Some(peer)
                || (self.tracker.is_none() && self.same_model_peers.is_empty());
            self.metrics
                .count_gossip_rejected("identify", "other_model");
            tracing::error!(
                %peer,
                their_model = model,
                our_model = %self.model_id,
                "refusing a peer that runs another model: every member of a mesh must run the same model file"
            );
            let _ = self.swarm.disconnect_peer_id(peer);
            self.emit(P2pEvent::ModelMismatch {
                peer: mesh_peer_id(&peer),
                model: model.to_owned(),
                decisive,
            });
            return;
        }
        if !info.protocols.contains(&KADEMLIA_PROTOCOL) {
            return;
        }
        let kademlia = &mut self.swarm.behaviour_mut().kademlia;
        for address in info.listen_addrs {
            kademlia.add_address(&peer, address);
        }
        if !self.bootstrapped {
            match kademlia.bootstrap() {
                Ok(_) => self.bootstrapped = true,
                Err(error) => tracing::debug!(%error, "kademlia bootstrap deferred"),
            }
        }
        // A new DHT neighbour may know the tracker: ask at once rather than at the next tick.
        if !self.is_tracker && !self.reaches_tracker() {
            self.look_up_tracker();
        }
    }

    fn on_query_result(&mut self, result: QueryResult) {
        match result {
            QueryResult::GetRecord(Ok(GetRecordOk::FoundRecord(found))) => {
                match decode::<TrackerRecord>(&found.record.value) {
                    Ok(record) => self.on_tracker_record(record),
                    Err(error) => {
                        tracing::warn!(from = ?found.peer, %error, "undecodable tracker record");
                    }
                }
            }
            QueryResult::GetRecord(Ok(GetRecordOk::FinishedWithNoAdditionalRecord { .. })) => {}
            QueryResult::GetRecord(Err(error)) => {
                tracing::debug!(%error, "tracker record lookup found nothing");
            }
            QueryResult::PutRecord(Ok(_)) => tracing::debug!("tracker record stored"),
            QueryResult::PutRecord(Err(error)) => {
                tracing::debug!(%error, "tracker record stored locally only");
            }
            QueryResult::Bootstrap(Err(error)) => {
                tracing::debug!(%error, "kademlia bootstrap failed");
            }
            _ => {}
        }
    }

    fn on_tracker_record(&mut self, record: TrackerRecord) {
        if record.model_id != self.model_id {
            tracing::warn!(model = %record.model_id, "tracker record for another model ignored");
            return;
        }
        let peer: PeerId = match record.peer.as_str().parse() {
            Ok(peer) => peer,
            Err(error) => {
                tracing::warn!(peer = %record.peer, %error, "tracker record names no valid peer id");
                return;
            }
        };
        if let Some(pinned) = self.pinned_tracker
            && pinned != peer
        {
            let reason = format!(
                "a tracker record names {peer}, but this member is pinned to tracker {pinned}"
            );
            tracing::warn!(record = %peer, %reason, "tracker record rejected");
            self.metrics
                .count_gossip_rejected("tracker-record", "not_pinned_tracker");
            self.emit(P2pEvent::Rejected {
                from: mesh_peer_id(&peer),
                topic: "tracker-record".to_owned(),
                reason,
            });
            return;
        }
        if let Some(previous) = &self.discovered_record {
            // Stale copies elsewhere in the DHT must not roll the record back.
            if previous == &record
                || (previous.peer == record.peer && record.epoch < previous.epoch)
            {
                return;
            }
        }
        // Records are unsigned: they help a member find a tracker, never move it from the one
        // it follows (only that tracker's signed coverage maps and a listed successor's do),
        // and never set a term.
        if let Some(current) = self.tracker
            && current != peer
        {
            if record.term > self.term {
                let reason = format!(
                    "a tracker record names {peer} with term {}, but this member follows \
                     {current} (term {}); only signed coverage maps change the tracker",
                    record.term, self.term
                );
                tracing::warn!(record = %peer, %reason, "tracker record rejected");
                self.metrics
                    .count_gossip_rejected("tracker-record", "not_followed_tracker");
                self.emit(P2pEvent::Rejected {
                    from: mesh_peer_id(&peer),
                    topic: "tracker-record".to_owned(),
                    reason,
                });
            } else {
                // A copy left behind by an earlier tracker.
                tracing::debug!(record = %peer, term = record.term, "stale tracker record ignored");
            }
            return;
        }
        let addresses: Vec<Multiaddr> = record
            .addresses
            .iter()
            .filter_map(|address| address.parse().ok())
            .collect();
        if !self.swarm.is_connected(&peer) && !addresses.is_empty() {
            let dial = DialOpts::peer_id(peer)
                .addresses(addresses)
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .build();
            if let Err(error) = self.swarm.dial(dial) {
                tracing::debug!(%peer, %error, "dialing the tracker failed");
            }
        }
        if self.tracker != Some(peer) {
            tracing::info!(tracker = %peer, "tracker discovered");
        }
        self.tracker = Some(peer);
        self.discovered_record = Some(record.clone());
        self.emit(P2pEvent::TrackerDiscovered(record));
    }

    /// What this node knows when it judges a tracker message.
    fn admission(&self) -> Admission<'_> {
        Admission {
            model_id: &self.model_id,
            local_peer: self.local_peer_id,
            tracker: self.tracker,
            term: self.term,
            succession: if self.yields_to_any_claim() || self.knows_tracker_by_record_only() {
                None
            } else {
                Some(&self.succession)
            },
            tracker_silent: self.is_tracker
                || self
                    .heard_tracker_at
                    .is_none_or(|at| at.elapsed() >= self.takeover_silence),
        }
    }

    /// Whether this unpinned peer knows its tracker only from a Kademlia record and has
    /// accepted no coverage map yet. Records are unsigned and anyone can store one, so a
    /// record names whom to dial, not whom to trust: until a first signed map settles the
    /// tracker (and its succession list), a map from another claimant of a later term is
    /// judged without a list, or a forged record would strand the newcomer.
    fn knows_tracker_by_record_only(&self) -> bool {
        !self.is_tracker && self.pinned_tracker.is_none() && self.heard_tracker_at.is_none()
    }

    /// Whether this node was started as tracker moments ago and has followed nobody: it may be
    /// a restarted tracker whose mesh has elected a successor, so a later term wins whoever
    /// claims it.
    fn yields_to_any_claim(&self) -> bool {
        self.is_tracker
            && !self.followed_another
            && self
                .start_grace_until
                .is_some_and(|until| Instant::now() < until)
    }

    /// Records an accepted coverage map of `term` from `tracker`, naming `succession`: a new
    /// tracker (a takeover this node accepted) is followed from now on, and a node that was
    /// the tracker steps down.
    fn follow(&mut self, tracker: PeerId, term: u64, succession: &[meshnet_types::PeerId]) {
        if self.tracker != Some(tracker) {
            tracing::info!(%tracker, term, previous = ?self.tracker, "following a new tracker");
            if self.is_tracker {
                tracing::warn!(%tracker, term, "another tracker won a later term: stepping down");
                self.is_tracker = false;
                self.own_record = None;
            }
            self.tracker = Some(tracker);
            self.discovered_record = None;
            self.followed_another = true;
        }
        self.heard_tracker_at = Some(Instant::now());
        self.term = self.term.max(term);
        self.succession = if self.pinned_tracker.is_some() {
            Vec::new()
        } else {
            parse_succession(succession)
        };
    }

    /// `verdict`, unless it accepts an announcement not newer than one already accepted from
    /// the same peer: that one is ignored (neither delivered nor propagated).
    fn unless_stale(&mut self, verdict: Verdict) -> Verdict {
        if let Verdict::Accept(Some(event)) = &verdict
            && let P2pEvent::Announcement { from, announcement } = event.as_ref()
        {
            let sent_at = announcement.sent_at_unix_ms;
            if !self.announcement_freshness.admit(from, sent_at) {
                let newest = self.announcement_freshness.newest(from).unwrap_or_default();
                return Verdict::Ignore(format!(
                    "stale announcement: sent at {sent_at} ms, one sent at {newest} ms was accepted"
                ));
            }
        }
        verdict
    }

    fn on_gossip_message(
        &mut self,
        propagation_source: PeerId,
        message_id: &gossipsub::MessageId,
        message: gossipsub::Message,
    ) {
        self.traffic.received(message.data.len());
        let topic = message.topic.as_str().to_owned();
        let kind = self
            .topic_kinds
            .get(&message.topic)
            .map_or("unsubscribed", |kind| kind.suffix());
        let verdict = match (self.topic_kinds.get(&message.topic), message.source) {
            (None, _) => Verdict::Ignore(format!("not subscribed to {topic}")),
            (Some(_), None) => Verdict::Reject("unsigned", "unsigned message".to_owned()),
            (Some(kind), Some(source)) => self.admission().judge(*kind, source, &message.data),
        };
        let verdict = self.unless_stale(verdict);
        let from = message.source.unwrap_or(propagation_source);
        let acceptance = match verdict {
            Verdict::Accept(event) => {
                self.metrics.count_gossip_accepted(kind);
                if let Some(event) = event {
                    if let P2pEvent::Coverage { coverage, .. } = event.as_ref() {
                        self.follow(from, coverage.term, &coverage.succession);
                    }
                    if let P2pEvent::Announcement { announcement, .. } = event.as_ref() {
                        self.note_addresses(from, &announcement.p2p_addresses);
                    }
                    self.emit(*event);
                }
                MessageAcceptance::Accept
            }
            Verdict::Ignore(reason) => {
                tracing::debug!(%from, %topic, %reason, "gossip message ignored");
                MessageAcceptance::Ignore
            }
            Verdict::Reject(code, reason) => {
                tracing::warn!(%from, via = %propagation_source, %topic, %reason, "gossip message rejected");
                self.metrics.count_gossip_rejected(kind, code);
                self.emit(P2pEvent::Rejected {
                    from: mesh_peer_id(&from),
                    topic,
                    reason,
                });
                MessageAcceptance::Reject
            }
        };
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(message_id, &propagation_source, acceptance);
    }
}
