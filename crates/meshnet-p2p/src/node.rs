//! The swarm-owning event loop: it reads the handles' commands and the swarm's events, asks
//! the pure bookkeeping (tracker election, relay slots, the dialer) what each one means, and
//! carries the decisions out on the swarm.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, PublishError, TopicHash};
use libp2p::kad::{self, GetRecordOk, QueryId, QueryResult, Quorum, RecordKey};
use libp2p::metrics::Recorder;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, autonat, dcutr, identify, relay};
use tokio::sync::mpsc;
use tokio::time::Sleep;

use crate::P2pError;
use crate::addresses::is_circuit;
use crate::behaviour::{KADEMLIA_PROTOCOL, MeshBehaviour, MeshBehaviourEvent};
use crate::config::{P2pConfig, Role};
use crate::dialer::{ConnectPlan, Dialer};
use crate::election::{Following, RecordDecision, TRACKER_RECORD_TOPIC, TrackerElection};
use crate::events::{Leadership, P2pEvent};
use crate::freshness::AnnouncementFreshness;
use crate::handle::{Command, Reply};
use crate::ids::{libp2p_peer_id, mesh_peer_id};
use crate::messages::{
    CoverageMessage, TopicKind, TrackerRecord, decode, encode, tracker_record_key,
};
use crate::outbox::Outbox;
use crate::reach::{ActiveStreams, ModelPeers, Reachability, SharedReach};
use crate::relays::{RelaySlots, RelayedCloses};
use crate::traffic::TrafficCounters;
use crate::validation::Verdict;

/// Lifetime of the tracker record in the DHT; the tracker re-stores it well before.
const TRACKER_RECORD_TTL: Duration = Duration::from_secs(300);

/// How often a node with no connection dials its bootstrap addresses again.
const BOOTSTRAP_REDIAL_INTERVAL: Duration = Duration::from_secs(1);

/// Whoever waits for a connection to a peer: answered once it is up or cannot be.
type ConnectReply = Reply<Result<(), P2pError>>;

/// What the event loop is started with: the swarm, ready and listening, the channels to and
/// from the handles, and what it shares with them.
pub(crate) struct Wiring {
    /// The swarm, listening and subscribed.
    pub(crate) swarm: Swarm<MeshBehaviour>,
    /// The gossip topics subscribed to, by kind.
    pub(crate) topics: HashMap<TopicKind, IdentTopic>,
    /// The handles' commands.
    pub(crate) commands: mpsc::Receiver<Command>,
    /// Where events for the application go.
    pub(crate) events: mpsc::Sender<P2pEvent>,
    /// Gossip published and received, read by the handles.
    pub(crate) traffic: Arc<TrafficCounters>,
    /// Reachability, connections and circuit addresses, read by the handles.
    pub(crate) reach: SharedReach,
    /// Connected peers running this node's model (shared with the relay server's policy).
    pub(crate) model_peers: ModelPeers,
    /// The activation streams open with each peer (shared with the handles).
    pub(crate) active_streams: ActiveStreams,
    /// libp2p's own metrics, when the application exports them.
    pub(crate) libp2p_metrics: Option<libp2p::metrics::Metrics>,
}

/// The one task that owns the swarm.
pub(crate) struct EventLoop {
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
    /// Who the tracker is, its term and succession, and this node's own record.
    election: TrackerElection,
    assume_reachable: bool,
    /// Whether the node was given the addresses others reach it at: its listen addresses
    /// then never become external ones.
    announces_given_addresses: bool,
    topics: HashMap<TopicKind, IdentTopic>,
    topic_kinds: HashMap<TopicHash, TopicKind>,
    tracker_query: Option<QueryId>,
    tracker_lookup_interval: Duration,
    tracker_refresh_interval: Duration,
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
    /// The relays this node reserves slots on, and those it could use.
    relays: RelaySlots,
    /// Relayed connections to close once a direct one replaced them.
    relayed_closes: RelayedCloses,
    /// Dials made for handles that want a connection to a peer, and who waits for them.
    dialer: Dialer<ConnectReply>,
    /// The activation streams open with each peer (shared with the handles).
    active_streams: ActiveStreams,
}

impl EventLoop {
    /// The event loop of a node configured by `config`, owning `wiring`'s swarm.
    ///
    /// Fails if the pinned tracker is no valid peer id.
    pub(crate) fn new(config: P2pConfig, wiring: Wiring) -> Result<Self, P2pError> {
        let local_peer_id = *wiring.swarm.local_peer_id();
        let election = match &config.role {
            Role::Tracker => TrackerElection::started_as_tracker(
                local_peer_id,
                config.takeover_silence,
                Instant::now() + config.tracker_start_grace,
            ),
            Role::Peer { pinned_tracker } => {
                let pinned = pinned_tracker.as_ref().map(libp2p_peer_id).transpose()?;
                TrackerElection::started_as_peer(local_peer_id, pinned, config.takeover_silence)
            }
        };
        Ok(Self {
            traffic: wiring.traffic,
            metrics: config.metrics,
            libp2p_metrics: wiring.libp2p_metrics,
            outbox: Outbox::default(),
            announcement_freshness: AnnouncementFreshness::default(),
            topic_kinds: wiring
                .topics
                .iter()
                .map(|(kind, topic)| (topic.hash(), *kind))
                .collect(),
            topics: wiring.topics,
            swarm: wiring.swarm,
            commands: wiring.commands,
            events: wiring.events,
            local_peer_id,
            model_id: config.model_id,
            election,
            assume_reachable: config.assume_reachable,
            announces_given_addresses: !config.external_addresses.is_empty(),
            tracker_query: None,
            tracker_lookup_interval: config.tracker_lookup_interval,
            tracker_refresh_interval: config.tracker_refresh_interval,
            record_republish_interval: config.record_republish_interval,
            listen_addrs: Vec::new(),
            listen_waiters: Vec::new(),
            bootstrapped: false,
            bootstrap: config.bootstrap,
            same_model_peers: wiring.model_peers,
            reach: wiring.reach,
            relays: RelaySlots::new(config.reserve_relays),
            relayed_closes: RelayedCloses::default(),
            dialer: Dialer::default(),
            active_streams: wiring.active_streams,
        })
    }

    /// Runs until a handle asks it to stop or every handle is gone; then drops the swarm.
    pub(crate) async fn run(mut self) {
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
            let looks_up_tracker = !self.election.is_tracker();
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.recv() => match command {
                    None => break None,
                    Some(Command::Shutdown { reply }) => break Some(reply),
                    Some(command) => self.on_command(command),
                },
                () = &mut lookup_timer, if looks_up_tracker => {
                    self.look_up_tracker();
                    let next = if self.election.reaches_tracker() {
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
                _ = republish_timer.tick(), if self.election.own_record().is_some() => {
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
                    && self.election.is_tracker()
                    && let Ok(own) = decode::<CoverageMessage>(&data)
                {
                    // Who may take over from this node is the list it publishes.
                    self.election.on_own_coverage(own.term, &own.succession);
                }
                let _ = reply.send(self.publish(kind, data));
            }
            Command::SetTrackerRecord { mut record, reply } => {
                if record.addresses.is_empty() {
                    record.addresses = self.advertised_addresses();
                }
                self.election.set_own_record(record);
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
                let _ = reply.send(self.election.tracker());
            }
            Command::Connect { peer, reply } => self.connect(peer, reply),
            Command::TakeTrackerRole { term, reply } => {
                tracing::info!(term, "taking the tracker role");
                self.election.take_role(term);
                self.emit(P2pEvent::Leadership(Leadership::Leads { term }));
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
        let Some(record) = self.election.own_record() else {
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

    /// A connection to `peer` is up: relayed ones it supersedes close after a grace period,
    /// the address a direct dial reached is kept for relaying, and whoever waits for a
    /// connection to `peer` hears of it.
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
            self.relayed_closes
                .schedule(peer, &superseded, Instant::now());
        }
        if let libp2p::core::ConnectedPoint::Dialer { address, .. } = endpoint
            && !relayed
        {
            self.relays.on_dialed(peer, address);
        }
        let waiters = self.dialer.on_connected(peer);
        answer_connect_waiters(peer, waiters, &Ok(()));
    }

    /// Closes the relayed connections whose grace is over (a direct connection to the same
    /// peer replaced them).
    fn close_superseded_relayed(&mut self) {
        // A peer with a stream open waits for the next check (every second): a stream on a
        // connection closed under it would never hear of it.
        let active_streams = &self.active_streams;
        let due = self
            .relayed_closes
            .take_due(Instant::now(), |peer| active_streams.any_with(peer));
        for (peer, connection) in due {
            if self.swarm.close_connection(connection) {
                tracing::info!(%peer, "relayed connection closed: traffic goes direct");
            }
        }
    }

    /// One of the dials [`Self::connect`] made failed: its waiters hear so once no other such
    /// dial to the peer is under way.
    fn on_connect_dial_failed(&mut self, peer: PeerId, connection: ConnectionId, error: String) {
        let connected = self.swarm.is_connected(&peer);
        let waiters = self.dialer.on_dial_failed(peer, connection, connected);
        answer_connect_waiters(peer, waiters, &Err(error));
    }

    /// Answers `reply` once a connection to `peer` is up: at once if one is, else after
    /// dialing the addresses it announced (see [`Dialer::connect`]).
    fn connect(&mut self, peer: PeerId, reply: ConnectReply) {
        let connected = self.swarm.is_connected(&peer);
        let (addresses, reply) = match self.dialer.connect(peer, connected, reply) {
            ConnectPlan::Connected(reply) => {
                let _ = reply.send(Ok(()));
                return;
            }
            ConnectPlan::Joined => return,
            ConnectPlan::Dial(addresses, reply) => (addresses, reply),
        };
        let dial = DialOpts::peer_id(peer)
            .addresses(addresses.clone())
            .condition(PeerCondition::Disconnected)
            .build();
        let connection = dial.connection_id();
        match self.swarm.dial(dial) {
            Ok(()) => self
                .dialer
                .on_dial_started(peer, connection, addresses, reply),
            Err(error) => {
                let _ = reply.send(Err(P2pError::Stream {
                    peer: peer.to_string(),
                    reason: error.to_string(),
                }));
            }
        }
    }

    /// Asks for reservations on relays until enough are held or asked for (the tracker's
    /// first), as [`RelaySlots::next_reservation`] proposes them.
    fn reserve_relays(&mut self) {
        let now = Instant::now();
        while let Some((relay, circuit)) =
            self.relays.next_reservation(self.election.tracker(), now)
        {
            match self.swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    tracing::debug!(%relay, %circuit, "asking the relay for a reservation");
                    self.relays.on_reserving(relay, listener);
                }
                Err(error) => {
                    tracing::warn!(%relay, %circuit, %error, "cannot listen through the relay");
                    self.relays.on_refused(relay, now);
                }
            }
        }
    }

    /// A listener closed: when it held a relay reservation, another is asked for shortly.
    fn on_listener_closed(&mut self, listener: ListenerId, reason: Result<(), std::io::Error>) {
        let Some(relay) = self.relays.on_listener_closed(listener, Instant::now()) else {
            return;
        };
        match reason {
            Ok(()) => tracing::info!(%relay, "relay reservation ended: asking again"),
            Err(error) => {
                tracing::info!(%relay, %error, "relay reservation failed or was lost: asking again")
            }
        }
    }

    /// Dials the bootstrap addresses again while this node has no connection at all (for
    /// example, it started before the node it bootstraps from was listening).
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
            SwarmEvent::NewListenAddr { address, .. } => self.on_new_listen_addr(address),
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.retain(|known| known != &address);
                if self.listen_is_external() {
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
                    self.relays.on_disconnected(&peer_id);
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

    /// Whether a listen address is one others reach this node at.
    fn listen_is_external(&self) -> bool {
        self.assume_reachable && !self.announces_given_addresses
    }

    /// The node listens on a new direct `address`: whoever waits for a listener hears of it.
    fn on_new_listen_addr(&mut self, address: Multiaddr) {
        tracing::info!(%address, "listening");
        if self.listen_is_external() {
            self.swarm.add_external_address(address.clone());
        }
        self.listen_addrs.push(address.clone());
        for waiter in self.listen_waiters.drain(..) {
            let _ = waiter.send(self.listen_addrs.clone());
        }
        self.emit(P2pEvent::ListeningOn(address));
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
            if info.protocols.contains(&relay::HOP_PROTOCOL_NAME)
                && self.relays.on_relay_identified(peer, &info.listen_addrs)
            {
                self.reserve_relays();
            }
        }
        if let Some((model, _)) = agent
            && model != self.model_id
        {
            // Decided from what this node knows, not from what the stranger claims to be.
            let tracker = self.election.tracker();
            let decisive =
                tracker == Some(peer) || (tracker.is_none() && self.same_model_peers.is_empty());
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
        if !self.election.is_tracker() && !self.election.reaches_tracker() {
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

    /// Carries out what the election decides about a tracker record found in the DHT.
    fn on_tracker_record(&mut self, record: TrackerRecord) {
        match self.election.on_tracker_record(&self.model_id, record) {
            RecordDecision::OtherModel(model) => {
                tracing::warn!(%model, "tracker record for another model ignored");
            }
            RecordDecision::InvalidPeer { peer, error } => {
                tracing::warn!(%peer, %error, "tracker record names no valid peer id");
            }
            RecordDecision::Rejected { peer, code, reason } => {
                tracing::warn!(record = %peer, %reason, "tracker record rejected");
                self.metrics
                    .count_gossip_rejected(TRACKER_RECORD_TOPIC, code);
                self.emit(P2pEvent::Rejected {
                    from: mesh_peer_id(&peer),
                    topic: TRACKER_RECORD_TOPIC.to_owned(),
                    reason,
                });
            }
            RecordDecision::AlreadyKnown => {}
            RecordDecision::Stale { peer, term } => {
                // A copy left behind by an earlier tracker.
                tracing::debug!(record = %peer, term, "stale tracker record ignored");
            }
            RecordDecision::Follow {
                peer,
                addresses,
                newly_discovered,
                record,
            } => {
                if !self.swarm.is_connected(&peer) && !addresses.is_empty() {
                    let dial = DialOpts::peer_id(peer)
                        .addresses(addresses)
                        .condition(PeerCondition::DisconnectedAndNotDialing)
                        .build();
                    if let Err(error) = self.swarm.dial(dial) {
                        tracing::debug!(%peer, %error, "dialing the tracker failed");
                    }
                }
                if newly_discovered {
                    tracing::info!(tracker = %peer, "tracker discovered");
                }
                self.emit(P2pEvent::TrackerDiscovered(record));
            }
        }
    }

    /// Follows the tracker of an accepted coverage map of `term` naming `succession`.
    fn follow(&mut self, tracker: PeerId, term: u64, succession: &[meshnet_types::PeerId]) {
        let following = self
            .election
            .on_coverage(tracker, term, succession, Instant::now());
        if let Following::NewTracker {
            previous,
            stepped_down,
        } = following
        {
            tracing::info!(%tracker, term, ?previous, "following a new tracker");
            if stepped_down {
                tracing::warn!(%tracker, term, "another tracker won a later term: stepping down");
            }
            self.emit(P2pEvent::Leadership(Leadership::Follows {
                tracker: mesh_peer_id(&tracker),
                term,
                stepped_down,
            }));
        }
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
            (Some(kind), Some(source)) => self
                .election
                .publish_rules(&self.model_id, Instant::now())
                .judge(*kind, source, &message.data),
        };
        let verdict = self.announcement_freshness.screen(verdict);
        let from = message.source.unwrap_or(propagation_source);
        let acceptance = match verdict {
            Verdict::Accept(event) => {
                self.metrics.count_gossip_accepted(kind);
                if let Some(event) = event {
                    if let P2pEvent::Coverage { coverage, .. } = event.as_ref() {
                        self.follow(from, coverage.term, &coverage.succession);
                    }
                    if let P2pEvent::Announcement { announcement, .. } = event.as_ref() {
                        self.dialer
                            .note_addresses(from, &announcement.p2p_addresses);
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

/// Answers every one of `waiters` for a connection to `peer` with `outcome`.
fn answer_connect_waiters(peer: PeerId, waiters: Vec<ConnectReply>, outcome: &Result<(), String>) {
    for waiter in waiters {
        let _ = waiter.send(outcome.clone().map_err(|reason| P2pError::Stream {
            peer: peer.to_string(),
            reason,
        }));
    }
}
