//! The tracker's book: the peers it hears from (each forgotten after three silent
//! announcement intervals), the planner run over them, and the coverage map and directives
//! that come out. Pure bookkeeping: the caller passes the time in and does the publishing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use meshnet_p2p::{CoverageMessage, DirectiveMessage, PeerAnnouncement, SpanStatus};
use meshnet_planner::{
    CoverageMap, Directive, ModelShape, PeerCapacity, Planner, PlannerConfig, SpanHolding,
};
use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use meshnet_wire::Endpoint;

use crate::error::PeerError;
use crate::locking::lock;
use crate::routing::{MeshRoutes, PlannedHop, RouteCandidate, Uncovered, choose_route};
use crate::verify::Evidence;

/// How long a peer that failed a generation gets no new traffic; after that it must also have
/// announced since it failed.
pub const BAN_BACKOFF: Duration = Duration::from_secs(10);

/// The most announcements per second a member should hear: every announcement reaches every
/// member, so above `20 × interval` members the tracker stretches the interval.
pub const MAX_ANNOUNCEMENTS_PER_S: u32 = 20;

/// The step the stretched interval moves in, so a mesh that is filling up changes it a few
/// times rather than at every join.
const INTERVAL_STEP: Duration = Duration::from_millis(500);

/// The announcement interval for a mesh of `members` (the tracker included) whose base
/// interval is `base`: long enough that a member hears at most [`MAX_ANNOUNCEMENTS_PER_S`]
/// announcements a second, rounded up to half a second, and never below `base` (a 2 s base
/// holds up to 40 members; 41 to 50 announce every 2.5 s, 91 to 100 every 5 s, 101 to 110
/// every 5.5 s).
pub fn scaled_announce_interval(base: Duration, members: usize) -> Duration {
    let members = u32::try_from(members).unwrap_or(u32::MAX);
    let steps_per_s = (Duration::from_secs(1).as_millis() / INTERVAL_STEP.as_millis()) as u32;
    let steps = members.div_ceil(MAX_ANNOUNCEMENTS_PER_S / steps_per_s);
    base.max(INTERVAL_STEP * steps)
}

/// How many successors a coverage map names.
pub const SUCCESSION_LENGTH: usize = 4;

/// A peer that failed a generation, kept off routes for a while.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ban {
    /// When it failed.
    pub since: Instant,
    /// The earliest it may be routed to again (if it announced after `since`).
    pub until: Instant,
    /// What went wrong, for `/status` and the logs.
    pub cause: String,
    /// For a member caught returning wrong activations: the step and the three outputs.
    pub evidence: Option<Box<Evidence>>,
}

/// A peer the tracker has heard from.
#[derive(Clone, Debug)]
pub struct KnownPeer {
    /// Its latest announcement.
    pub announcement: PeerAnnouncement,
    /// When that announcement arrived.
    pub last_seen: Instant,
}

/// What one planning round decided.
#[derive(Clone, Debug)]
pub struct PlanOutcome {
    /// The map to publish.
    pub coverage: CoverageMessage,
    /// Directives to publish, one message per target peer.
    pub directives: Vec<DirectiveMessage>,
    /// The span the tracker itself must hold, when it differs from what it holds.
    pub own_target: Option<SpanStatus>,
}

/// The tracker's state.
#[derive(Debug)]
pub struct TrackerBook {
    model_id: String,
    planner: Planner,
    own_id: PeerId,
    own_capacity: PeerCapacity,
    own_endpoint: String,
    own_span: Option<SpanStatus>,
    /// How often the tracker's own timer runs (the base announcement interval).
    base_interval: Duration,
    /// The longest interval advertised within its own expiry, and when it was last
    /// advertised: members still announcing at it are not expired after a shrink.
    longest_advertised: (Duration, Instant),
    /// The tracker's own stalls (when each ended, how long it lasted) within the last expiry:
    /// announcements queued while it could not run are not its peers' silence.
    stalls: Vec<(Instant, Duration)>,
    /// When the book last expired silent peers.
    last_expire: Option<Instant>,
    peers: BTreeMap<PeerId, KnownPeer>,
    /// What each peer was last told to hold, and when.
    sent: BTreeMap<PeerId, (Option<SpanStatus>, Instant)>,
    epoch: u64,
    sequence: u64,
    map: CoverageMap,
    bans: BTreeMap<PeerId, Ban>,
    /// Checked sessions each member passed since it joined or was last convicted.
    verified_sessions: BTreeMap<PeerId, u32>,
    /// The tracker term this book plans for.
    term: u64,
}

impl TrackerBook {
    /// A book for the tracker `own_id` (reachable at `own_endpoint`, offering `own_capacity`)
    /// of model `model_id` shaped `shape`, whose members announce every `base_interval` (more
    /// seldom in a large mesh, see [`scaled_announce_interval`]); peers are forgotten after
    /// three silent intervals.
    pub fn new(
        model_id: String,
        shape: ModelShape,
        own_id: PeerId,
        own_capacity: PeerCapacity,
        own_endpoint: String,
        base_interval: Duration,
    ) -> Result<Self, PeerError> {
        shape.validate()?;
        // Epochs and sequence numbers start from the clock, so a restarted tracker (same peer
        // id, kept in its data directory) continues above what peers saw before: epochs change
        // at most once per planning round and sequence numbers by far less than once per
        // microsecond.
        let boot = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Ok(TrackerBook {
            model_id,
            planner: Planner::new(shape, PlannerConfig::default()),
            own_id,
            own_capacity,
            own_endpoint,
            own_span: None,
            base_interval,
            longest_advertised: (base_interval, Instant::now()),
            stalls: Vec::new(),
            last_expire: None,
            peers: BTreeMap::new(),
            sent: BTreeMap::new(),
            epoch: boot.as_millis() as u64,
            sequence: boot.as_micros() as u64,
            map: CoverageMap::empty(0),
            bans: BTreeMap::new(),
            verified_sessions: BTreeMap::new(),
            term: 1,
        })
    }

    /// Records an announcement. Returns whether it changes what the planner sees (a new peer,
    /// or another span, state or capacity).
    pub fn observe(&mut self, announcement: PeerAnnouncement, now: Instant) -> bool {
        if announcement.peer == self.own_id {
            return false;
        }
        let peer = announcement.peer.clone();
        let changed = match self.peers.get(&peer) {
            None => {
                tracing::info!(%peer, http = ?announcement.http_endpoints, "peer joined");
                true
            }
            Some(known) => planning_view(&known.announcement) != planning_view(&announcement),
        };
        self.peers.insert(
            peer,
            KnownPeer {
                announcement,
                last_seen: now,
            },
        );
        changed
    }

    /// How often members should announce now: the base interval scaled by the members known.
    pub fn announce_every(&self) -> Duration {
        scaled_announce_interval(self.base_interval, self.peers.len() + 1)
    }

    /// How long a peer may stay silent before it is forgotten: three of the longest intervals
    /// advertised lately.
    fn expiry(&self) -> Duration {
        self.announce_every().max(self.longest_advertised.0) * 3
    }

    /// Remembers the interval advertised at `now` if it is the longest lately.
    fn note_advertised(&mut self, now: Instant) {
        let current = self.announce_every();
        let (longest, at) = self.longest_advertised;
        if current >= longest || now.saturating_duration_since(at) > longest * 3 {
            self.longest_advertised = (current, now);
        }
    }

    /// A directive not yet reflected in its target's announcements is sent again after this
    /// long: one and a half announcement intervals, so the target had one chance to answer.
    pub fn directive_resend_after(&self) -> Duration {
        self.announce_every() * 3 / 2
    }

    /// How long `known` has been silent at `now`, not counting the time this tracker itself
    /// was stalled since it last heard from it.
    fn silence(&self, known: &KnownPeer, now: Instant) -> Duration {
        let stalled: Duration = self
            .stalls
            .iter()
            .filter(|(ended, _)| *ended > known.last_seen)
            .map(|(_, length)| *length)
            .sum();
        now.saturating_duration_since(known.last_seen)
            .saturating_sub(stalled)
    }

    /// Notes a stall of this tracker: expiry runs once per base announcement interval, so the
    /// gap since the last run beyond one interval is time the tracker could not run (an
    /// overloaded or paused machine), when its peers' announcements queued up unread.
    fn note_own_stall(&mut self, now: Instant) {
        if let Some(previous) = self.last_expire.replace(now) {
            let stall = now
                .saturating_duration_since(previous)
                .saturating_sub(self.base_interval);
            if !stall.is_zero() {
                tracing::warn!(
                    ?stall,
                    "the tracker stalled: not counted as its peers' silence"
                );
                self.stalls.push((now, stall));
            }
        }
        let expiry = self.expiry();
        let total: Duration = self.stalls.iter().map(|(_, length)| *length).sum();
        // A stall matters to peers last heard before it ended, at most expiry + stalls ago.
        self.stalls
            .retain(|(ended, _)| now.saturating_duration_since(*ended) <= expiry + total);
    }

    /// Forgets peers silent for longer than the expiry (the tracker's own stalls not
    /// counted); returns their ids. Meant to run once per base announcement interval.
    pub fn expire(&mut self, now: Instant) -> Vec<PeerId> {
        self.note_own_stall(now);
        let expiry = self.expiry();
        let gone: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, known)| self.silence(known, now) > expiry)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in &gone {
            tracing::warn!(%peer, "peer silent for {expiry:?}: removed from the map");
            self.peers.remove(peer);
            self.sent.remove(peer);
        }
        // A ban outlives its peer's expiry only while it runs.
        self.bans
            .retain(|peer, ban| self.peers.contains_key(peer) || now < ban.until);
        gone
    }

    /// Keeps `peer` off new routes for [`BAN_BACKOFF`], and after that until it announces
    /// again: it failed a generation because of `cause`.
    /// A longer ban already running (a conviction) is kept as it is.
    pub fn ban(&mut self, peer: &PeerId, cause: &str, now: Instant) {
        let until = now + BAN_BACKOFF;
        if self.bans.get(peer).is_some_and(|ban| ban.until > until) {
            return;
        }
        tracing::warn!(%peer, cause, backoff = ?BAN_BACKOFF, "peer banned from routes");
        self.bans.insert(
            peer.clone(),
            Ban {
                since: now,
                until,
                cause: cause.to_owned(),
                evidence: None,
            },
        );
    }

    /// Keeps `peer`, caught returning wrong activations, off routes for `duration` whatever
    /// it announces, with the `evidence`; it starts its probation again afterwards.
    pub fn convict(&mut self, peer: &PeerId, evidence: Evidence, duration: Duration, now: Instant) {
        tracing::error!(
            %peer,
            layers = %evidence.layers,
            position = evidence.position,
            arbiter = %evidence.arbiter.peer,
            ban = ?duration,
            "a member returned wrong activations: banned"
        );
        self.verified_sessions.remove(peer);
        self.bans.insert(
            peer.clone(),
            Ban {
                since: now,
                until: now + duration,
                cause: format!(
                    "returned wrong activations for layers {} (arbiter {})",
                    evidence.layers, evidence.arbiter.peer
                ),
                evidence: Some(Box::new(evidence)),
            },
        );
    }

    /// Counts a checked session `peer` passed.
    pub fn record_verified(&mut self, peer: &PeerId) {
        let count = self.verified_sessions.entry(peer.clone()).or_default();
        *count = count.saturating_add(1);
    }

    /// The checked sessions `peer` passed since it joined or was last convicted.
    pub fn verified_sessions(&self, peer: &PeerId) -> u32 {
        self.verified_sessions.get(peer).copied().unwrap_or(0)
    }

    /// Ready holders (as for routes) of every layer of `layers`, none of `avoid`, fewest
    /// checked sessions first (then fewer sessions running, then by id), each to run exactly
    /// `layers`.
    pub fn holders(&self, layers: LayerSpan, avoid: &[PeerId], now: Instant) -> Vec<PlannedHop> {
        let mut holders: Vec<_> = self
            .route_candidates(now)
            .into_iter()
            .filter(|candidate| {
                candidate.layers.start <= layers.start
                    && candidate.layers.end >= layers.end
                    && !avoid.contains(&candidate.peer)
            })
            .collect();
        holders.sort_by(|a, b| {
            self.verified_sessions(&a.peer)
                .cmp(&self.verified_sessions(&b.peer))
                .then(a.active_sessions.cmp(&b.active_sessions))
                .then(a.peer.cmp(&b.peer))
        });
        holders
            .into_iter()
            .map(|candidate| PlannedHop {
                peer: candidate.peer,
                endpoint: candidate.endpoint,
                layers,
            })
            .collect()
    }

    /// Whether `peer` was convicted of returning wrong activations and its ban runs at `now`:
    /// the planner counts on it for no layer until the ban ends.
    pub fn is_convicted(&self, peer: &PeerId, now: Instant) -> bool {
        self.bans
            .get(peer)
            .is_some_and(|ban| ban.evidence.is_some() && now < ban.until)
    }

    /// Whether the planner counts on the peer behind `announcement` at `now`: it is neither
    /// leaving nor convicted.
    fn is_plannable(&self, announcement: &PeerAnnouncement, now: Instant) -> bool {
        !announcement.leaving && !self.is_convicted(&announcement.peer, now)
    }

    /// Whether `peer` is kept off routes at `now`.
    pub fn is_banned(&self, peer: &PeerId, now: Instant) -> bool {
        self.bans.get(peer).is_some_and(|ban| {
            let announced_since = self
                .peers
                .get(peer)
                .is_some_and(|known| known.last_seen > ban.since);
            now < ban.until || !announced_since
        })
    }

    /// The peers kept off routes at `now`, with their bans.
    pub fn bans(&self, now: Instant) -> Vec<(PeerId, Ban)> {
        self.bans
            .iter()
            .filter(|(peer, _)| self.is_banned(peer, now))
            .map(|(peer, ban)| (peer.clone(), ban.clone()))
            .collect()
    }

    /// Tells the book what the tracker itself holds now.
    pub fn set_own_span(&mut self, span: Option<SpanStatus>) {
        self.own_span = span;
    }

    /// The peers currently known.
    pub fn peers(&self) -> &BTreeMap<PeerId, KnownPeer> {
        &self.peers
    }

    /// The latest planned map, with each holding `Ready` only once its peer announced it so.
    pub fn map(&self) -> &CoverageMap {
        &self.map
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The tracker term this book plans for (1 unless it took over).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Plans for tracker term `term` from now on (a takeover).
    pub fn set_term(&mut self, term: u64) {
        self.term = term;
    }

    /// Who may take over from this tracker at `now`, in order of preference: peers that are
    /// tracker-capable, not leaving, heard from lately, not banned, serve a ready span, and
    /// declare the memory for the layers the tracker holds plus the embedding and head; the
    /// ones with the most memory first (then by id), at most [`SUCCESSION_LENGTH`].
    pub fn succession(&self, now: Instant) -> Vec<PeerId> {
        let own = self
            .own_span
            .as_ref()
            .map(|span| (span.layers.len(), span.quantization))
            .or_else(|| {
                self.map
                    .holding_of(&self.own_id)
                    .map(|h| (h.layers.len(), h.quantization))
            });
        let Some((layers, quantization)) = own else {
            return Vec::new();
        };
        let silent_after = self.expiry() * 2 / 3;
        let mut candidates: Vec<(u64, &PeerId)> = self
            .peers
            .values()
            .filter(|known| {
                let a = &known.announcement;
                a.tracker_capable
                    && !a.leaving
                    && self.silence(known, now) <= silent_after
                    && !self.is_banned(&a.peer, now)
                    && a.span.as_ref().is_some_and(|s| s.state == SpanState::Ready)
                    && self
                        .planner
                        .model()
                        .memory_needed(quantization, a.kv_tokens, layers, true)
                        .is_some_and(|needed| a.memory_bytes >= needed)
            })
            .map(|known| (known.announcement.memory_bytes, &known.announcement.peer))
            .collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        candidates
            .into_iter()
            .take(SUCCESSION_LENGTH)
            .map(|(_, peer)| peer.clone())
            .collect()
    }

    /// The number of layers of the model.
    pub fn num_layers(&self) -> u32 {
        self.planner.model().num_layers
    }

    /// Runs the planner over what the tracker knows at `now` and returns what to publish.
    pub fn plan(&mut self, now: Instant) -> Result<PlanOutcome, PeerError> {
        let current = self.current_map(now);
        let mut capacities = vec![self.own_capacity.clone()];
        capacities.extend(
            self.peers
                .values()
                .filter(|known| self.is_plannable(&known.announcement, now))
                .map(|known| capacity(&known.announcement)),
        );
        let plan = self.planner.plan(&current, &capacities)?;

        let mut by_peer: BTreeMap<PeerId, Vec<Directive>> = BTreeMap::new();
        for directive in &plan.directives {
            by_peer
                .entry(directive.peer().clone())
                .or_default()
                .push(directive.clone());
        }
        if !plan.directives.is_empty() || !same_holdings(&plan.map, &self.map) {
            self.epoch += 1;
        }

        let mut own_target = None;
        let intended_of = |peer: &PeerId| {
            plan.map.holding_of(peer).map(|h| SpanStatus {
                layers: h.layers,
                quantization: h.quantization,
                state: SpanState::Loading,
            })
        };
        let own_intended = intended_of(&self.own_id);
        if !same_span(own_intended.as_ref(), self.own_span.as_ref()) {
            own_target = own_intended;
        }
        // A leaving peer keeps what it holds until it is gone: no directive moves it. A
        // convicted one is planned nothing, so it is told to drop what it holds.
        let targets: Vec<(PeerId, Option<SpanStatus>)> = self
            .peers
            .iter()
            .filter(|(_, known)| !known.announcement.leaving)
            .map(|(peer, _)| (peer.clone(), intended_of(peer)))
            .collect();
        let directives = targets
            .into_iter()
            .filter_map(|(peer, intended)| {
                let planned = by_peer.remove(&peer);
                self.directive_for(peer, intended, planned, now)
            })
            .collect();

        self.map = self.with_live_states(plan.map);
        self.sequence += 1;
        self.note_advertised(now);
        Ok(PlanOutcome {
            coverage: CoverageMessage {
                model_id: self.model_id.clone(),
                term: self.term,
                succession: self.succession(now),
                tracker_http: self.own_endpoint.clone(),
                epoch: self.epoch,
                sequence: self.sequence,
                num_layers: self.num_layers(),
                map: self.map.clone(),
                announce_interval_ms: self.announce_every().as_millis() as u64,
            },
            directives,
            own_target,
        })
    }

    /// The directive message that moves `peer` to `intended` (the planner's own directives
    /// when it made some, else a restatement), or `None` when the peer already announces it
    /// or was told recently.
    fn directive_for(
        &mut self,
        peer: PeerId,
        intended: Option<SpanStatus>,
        planned: Option<Vec<Directive>>,
        now: Instant,
    ) -> Option<DirectiveMessage> {
        let announced = self
            .peers
            .get(&peer)
            .and_then(|known| known.announcement.span.clone())
            .filter(|span| span.state != SpanState::Draining);
        if same_span(intended.as_ref(), announced.as_ref()) {
            self.sent.remove(&peer);
            return None;
        }
        let recently_sent = self.sent.get(&peer).is_some_and(|(target, at)| {
            same_span(target.as_ref(), intended.as_ref())
                && now.duration_since(*at) < self.directive_resend_after()
        });
        if planned.is_none() && recently_sent {
            return None;
        }
        let list = planned.unwrap_or_else(|| restate(&peer, announced.as_ref(), intended.as_ref()));
        self.sequence += 1;
        self.sent.insert(peer.clone(), (intended.clone(), now));
        Some(DirectiveMessage {
            model_id: self.model_id.clone(),
            target: peer,
            term: self.term,
            epoch: self.epoch,
            sequence: self.sequence,
            directives: list,
            span_after: intended,
        })
    }

    /// Ready holders that could serve a route at `now`, with their endpoints and load: peers
    /// that announce, ready, exactly the span the plan gave them (a peer claiming other layers
    /// is not trusted with traffic), and are neither banned, leaving, nor silent for two thirds
    /// of the expiry.
    pub fn route_candidates(&self, now: Instant) -> Vec<RouteCandidate> {
        let silent_after = self.expiry() * 2 / 3;
        self.peers
            .values()
            .filter(|known| {
                !known.announcement.leaving
                    && self.silence(known, now) <= silent_after
                    && !self.is_banned(&known.announcement.peer, now)
            })
            .filter_map(|known| {
                let a = &known.announcement;
                let span = a.span.as_ref()?;
                // Direct HTTP when it announced an endpoint, else a libp2p stream to its id.
                let endpoint = a
                    .http_endpoints
                    .first()
                    .and_then(|url| url.parse().ok())
                    .unwrap_or_else(|| Endpoint::Peer(a.peer.clone()));
                let planned = self.map.holding_of(&a.peer)?;
                let as_planned =
                    planned.layers == span.layers && planned.quantization == span.quantization;
                (span.state == SpanState::Ready && as_planned).then(|| RouteCandidate {
                    peer: a.peer.clone(),
                    endpoint,
                    layers: span.layers,
                    active_sessions: a.active_sessions,
                    free_kv_tokens: a.free_kv_tokens,
                    forward_latency_ms: a.forward_latency_ms,
                })
            })
            .collect()
    }

    /// The first of `peers` not heard from for the expiry at `now`, or not known at all.
    pub fn first_silent(&self, peers: &[PeerId], now: Instant) -> Option<PeerId> {
        peers
            .iter()
            .find(|peer| {
                self.peers
                    .get(*peer)
                    .is_none_or(|known| self.silence(known, now) > self.expiry())
            })
            .cloned()
    }

    /// The hops a generation would take after the tracker's own span, which ends at `start`.
    pub fn route(&self, start: u32) -> Result<Vec<PlannedHop>, Uncovered> {
        self.route_avoiding(start, &[], Instant::now())
    }

    /// The hops from layer `start` at `now`, through none of the peers in `avoid`.
    pub fn route_avoiding(
        &self,
        start: u32,
        avoid: &[PeerId],
        now: Instant,
    ) -> Result<Vec<PlannedHop>, Uncovered> {
        let mut candidates = self.route_candidates(now);
        candidates.retain(|candidate| !avoid.contains(&candidate.peer));
        choose_route(start, self.num_layers(), &candidates)
    }

    /// The tracker's own HTTP endpoint.
    pub fn own_endpoint(&self) -> &str {
        &self.own_endpoint
    }

    /// The map the planner starts from: every live peer's announced span (or the span it was
    /// just told to load), plus the tracker's own.
    fn current_map(&self, now: Instant) -> CoverageMap {
        let mut holdings = Vec::new();
        let mut push = |peer: &PeerId, span: &SpanStatus| {
            holdings.push(SpanHolding {
                peer: peer.clone(),
                layers: span.layers,
                quantization: span.quantization,
                state: match span.state {
                    SpanState::Ready => SpanState::Ready,
                    _ => SpanState::Loading,
                },
            });
        };
        if let Some(span) = &self.own_span {
            push(&self.own_id, span);
        }
        for (peer, known) in &self.peers {
            let pending = self
                .sent
                .get(peer)
                .filter(|(_, at)| now.duration_since(*at) < self.directive_resend_after() * 4);
            if !self.is_plannable(&known.announcement, now) {
                continue;
            }
            match (pending, &known.announcement.span) {
                (Some((Some(target), _)), _) => push(peer, target),
                (Some((None, _)), _) => {}
                (None, Some(span)) if span.state != SpanState::Draining => push(peer, span),
                (None, _) => {}
            }
        }
        holdings.sort_by(|a, b| a.peer.cmp(&b.peer));
        CoverageMap {
            epoch: self.epoch,
            holdings,
        }
    }

    /// The planned map with a holding `Ready` only when its peer holds exactly that, ready.
    fn with_live_states(&self, mut map: CoverageMap) -> CoverageMap {
        map.epoch = self.epoch;
        for holding in &mut map.holdings {
            let actual = if holding.peer == self.own_id {
                self.own_span.clone()
            } else {
                self.peers
                    .get(&holding.peer)
                    .and_then(|known| known.announcement.span.clone())
            };
            let ready = actual.is_some_and(|span| {
                span.state == SpanState::Ready
                    && span.layers == holding.layers
                    && span.quantization == holding.quantization
            });
            holding.state = if ready {
                SpanState::Ready
            } else {
                SpanState::Loading
            };
        }
        map
    }
}

impl MeshRoutes for std::sync::Mutex<TrackerBook> {
    fn route(&self, start: u32, avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered> {
        lock(self).route_avoiding(start, avoid, Instant::now())
    }

    fn ban(&self, peer: &PeerId, cause: &str) {
        lock(self).ban(peer, cause, Instant::now());
    }

    fn first_silent(&self, peers: &[PeerId]) -> Option<PeerId> {
        lock(self).first_silent(peers, Instant::now())
    }

    fn holders(&self, layers: LayerSpan, avoid: &[PeerId]) -> Vec<PlannedHop> {
        lock(self).holders(layers, avoid, Instant::now())
    }

    fn verified_sessions(&self, peer: &PeerId) -> u32 {
        lock(self).verified_sessions(peer)
    }

    fn record_verified(&self, peer: &PeerId) {
        lock(self).record_verified(peer);
    }

    fn convict(&self, peer: &PeerId, evidence: Evidence, duration: Duration) {
        lock(self).convict(peer, evidence, duration, Instant::now());
    }
}

/// The parts of an announcement the planner depends on.
fn planning_view(
    a: &PeerAnnouncement,
) -> (
    u64,
    Vec<Quantization>,
    u64,
    Option<SpanStatus>,
    Vec<String>,
    bool,
) {
    (
        a.memory_bytes,
        a.quantizations.clone(),
        a.kv_tokens,
        a.span.clone(),
        a.http_endpoints.clone(),
        a.leaving,
    )
}

fn capacity(a: &PeerAnnouncement) -> PeerCapacity {
    PeerCapacity {
        peer: a.peer.clone(),
        memory_bytes: a.memory_bytes,
        quantizations: a.quantizations.clone(),
        throughput: if a.throughput.is_finite() && a.throughput > 0.0 {
            a.throughput
        } else {
            1.0
        },
        kv_tokens: a.kv_tokens,
        is_tracker: false,
    }
}

/// Whether two maps list the same peers on the same layers in the same formats.
fn same_holdings(a: &CoverageMap, b: &CoverageMap) -> bool {
    let key = |map: &CoverageMap| {
        let mut list: Vec<_> = map
            .holdings
            .iter()
            .map(|h| (h.peer.clone(), h.layers, h.quantization))
            .collect();
        list.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.start.cmp(&y.1.start)));
        list
    };
    key(a) == key(b)
}

/// Whether two spans name the same layers in the same format (state aside).
fn same_span(a: Option<&SpanStatus>, b: Option<&SpanStatus>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.layers == b.layers && a.quantization == b.quantization,
        _ => false,
    }
}

/// Directives that take a peer from `announced` to `intended`, for a peer that missed (or
/// has not yet acted on) the planner's own.
fn restate(
    peer: &PeerId,
    announced: Option<&SpanStatus>,
    intended: Option<&SpanStatus>,
) -> Vec<Directive> {
    let peer_id = peer.clone();
    let mut list = Vec::new();
    if let Some(old) = announced {
        list.push(Directive::DropShard {
            peer: peer_id.clone(),
            layers: old.layers,
            quantization: old.quantization,
        });
    }
    if let Some(new) = intended {
        list.push(Directive::LoadShard {
            peer: peer_id,
            layers: new.layers,
            quantization: new.quantization,
        });
    }
    list
}

/// The layer boundaries between consecutive spans of a route, as `generate --boundaries`
/// takes them: the end of the entry span and of every hop but the last.
pub fn route_boundaries(entry_end: u32, hops: &[PlannedHop]) -> Vec<u32> {
    let mut boundaries = Vec::new();
    if !hops.is_empty() {
        boundaries.push(entry_end);
    }
    for hop in hops.iter().take(hops.len().saturating_sub(1)) {
        boundaries.push(hop.layers.end);
    }
    boundaries
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshnet_types::LayerSpan;

    const FORMAT: Quantization = Quantization::Q4_1;
    const KV_TOKENS: u64 = 256;

    fn shape() -> ModelShape {
        ModelShape::smollm2_135m()
    }

    fn memory(layers: u32, tracker: bool) -> u64 {
        shape()
            .budget_for_layers(FORMAT, KV_TOKENS, layers, tracker)
            .unwrap()
    }

    fn book() -> TrackerBook {
        let capacity = PeerCapacity {
            peer: PeerId::new("tracker"),
            memory_bytes: memory(10, true),
            quantizations: vec![FORMAT],
            throughput: 1.0,
            kv_tokens: KV_TOKENS,
            is_tracker: true,
        };
        TrackerBook::new(
            "model".into(),
            shape(),
            "tracker".into(),
            capacity,
            "http://t".into(),
            Duration::from_secs(1),
        )
        .unwrap()
    }

    fn announcement(peer: &str, span: Option<SpanStatus>) -> PeerAnnouncement {
        PeerAnnouncement {
            peer: peer.into(),
            model_id: "model".into(),
            software_version: "0".into(),
            wire_version: 1,
            http_endpoints: vec![format!("http://{peer}")],
            p2p_addresses: Vec::new(),
            memory_bytes: memory(10, false),
            quantizations: vec![FORMAT],
            throughput: 100.0,
            kv_tokens: KV_TOKENS,
            span,
            free_kv_tokens: 1000,
            active_sessions: 0,
            is_tracker: false,
            forward_latency_ms: 0.0,
            leaving: false,
            tracker_capable: true,
            sent_at_unix_ms: 0,
            tracker_silent_ms: None,
        }
    }

    fn ready(span: &SpanStatus) -> SpanStatus {
        SpanStatus {
            state: SpanState::Ready,
            ..span.clone()
        }
    }

    #[test]
    fn a_split_is_planned_then_confirmed_and_then_quiet() {
        let mut book = book();
        let now = Instant::now();
        assert!(book.observe(announcement("a", None), now));
        assert!(book.observe(announcement("b", None), now));
        let first = book.plan(now).unwrap();
        let own = first
            .own_target
            .clone()
            .expect("the tracker takes the first layers");
        assert_eq!(own.layers, LayerSpan::new(0, 10));
        assert_eq!(first.directives.len(), 2);
        let mut spans: Vec<LayerSpan> = first
            .directives
            .iter()
            .map(|d| d.span_after.as_ref().unwrap().layers)
            .collect();
        spans.sort_by_key(|s| s.start);
        assert_eq!(spans, vec![LayerSpan::new(10, 20), LayerSpan::new(20, 30)]);
        assert!(book.route(10).is_err(), "nothing is ready yet");

        // Everyone loads what they were told and says so.
        book.set_own_span(Some(ready(&own)));
        for directive in &first.directives {
            let span = ready(directive.span_after.as_ref().unwrap());
            book.observe(announcement(directive.target.as_str(), Some(span)), now);
        }
        let settled = book.plan(now).unwrap();
        assert!(settled.directives.is_empty());
        assert!(settled.own_target.is_none());
        assert!(
            settled
                .coverage
                .map
                .holdings
                .iter()
                .all(|h| h.state == SpanState::Ready)
        );
        let hops = book.route(10).unwrap();
        assert_eq!(route_boundaries(10, &hops), vec![10, 20]);
    }

    /// A book whose plan (tracker 0-10, `a` 10-20, `b` 20-30) every peer carried out.
    fn settled_book(now: Instant) -> TrackerBook {
        let mut book = book();
        book.observe(announcement("a", None), now);
        book.observe(announcement("b", None), now);
        let plan = book.plan(now).unwrap();
        book.set_own_span(plan.own_target.as_ref().map(ready));
        for directive in &plan.directives {
            let span = ready(directive.span_after.as_ref().unwrap());
            book.observe(announcement(directive.target.as_str(), Some(span)), now);
        }
        book.plan(now).unwrap();
        book
    }

    fn evidence(layers: LayerSpan) -> Evidence {
        let testimony = |peer: &str| crate::verify::Testimony {
            peer: peer.into(),
            output_sha256: format!("{peer:0>64}"),
        };
        Evidence {
            session: "s".into(),
            position: 4,
            tokens: 1,
            layers,
            convicted: testimony("a"),
            witness: testimony("c"),
            arbiter: testimony("d"),
        }
    }

    #[test]
    fn holders_cover_the_layers_asked_and_run_exactly_those() {
        let now = Instant::now();
        let book = settled_book(now);
        let route = book.route(10).unwrap();
        assert_eq!(route_boundaries(10, &route), vec![10, 20]);
        let within = book.holders(LayerSpan::new(12, 15), &[], now);
        assert_eq!(within.len(), 1);
        assert_eq!(within[0].peer, route[0].peer);
        assert_eq!(within[0].layers, LayerSpan::new(12, 15));
        assert!(
            book.holders(LayerSpan::new(15, 25), &[], now).is_empty(),
            "nobody holds both"
        );
        assert!(
            book.holders(route[1].layers, &[route[1].peer.clone()], now)
                .is_empty()
        );
    }

    #[test]
    fn a_conviction_outlasts_announcements_and_short_bans_and_resets_probation() {
        let now = Instant::now();
        let mut book = settled_book(now);
        let hop = book.route(10).unwrap().remove(0);
        let liar = hop.peer.clone();
        book.record_verified(&liar);
        book.record_verified(&liar);
        assert_eq!(book.verified_sessions(&liar), 2);
        let day = Duration::from_secs(86_400);
        book.convict(&liar, evidence(hop.layers), day, now);
        assert_eq!(book.verified_sessions(&liar), 0);
        // A failover's short ban does not replace it, nor does announcing again.
        book.ban(&liar, "timed out", now);
        let later = now + BAN_BACKOFF * 3;
        let span = book.peers()[&liar].announcement.span.clone();
        book.observe(announcement(liar.as_str(), span), later);
        assert!(book.is_banned(&liar, later));
        assert!(book.holders(hop.layers, &[], later).is_empty());
        let bans = book.bans(later);
        assert_eq!(bans.len(), 1);
        assert_eq!(bans[0].1.until, now + day);
        assert_eq!(bans[0].1.evidence.as_deref(), Some(&evidence(hop.layers)));
        assert!(!book.is_banned(&liar, now + day + BAN_BACKOFF));
    }

    #[test]
    fn a_convicted_holder_is_planned_nothing_and_its_layers_go_to_another() {
        let now = Instant::now();
        let mut book = settled_book(now);
        // A spare member joins and is planned a second copy of one span; it loads it.
        book.observe(announcement("spare", None), now);
        let plan = book.plan(now).unwrap();
        let spare = plan
            .coverage
            .map
            .holding_of(&"spare".into())
            .unwrap()
            .clone();
        let span = SpanStatus {
            layers: spare.layers,
            quantization: FORMAT,
            state: SpanState::Ready,
        };
        book.observe(announcement("spare", Some(span)), now);
        // The holder of the other span is the only one of its layers: convict it.
        let liar = book
            .route(10)
            .unwrap()
            .into_iter()
            .find(|hop| hop.layers != spare.layers)
            .unwrap();
        book.convict(
            &liar.peer,
            evidence(liar.layers),
            Duration::from_secs(60),
            now,
        );
        let after = book.plan(now).unwrap();

        let map = &after.coverage.map;
        assert!(map.holding_of(&liar.peer).is_none(), "{map:?}");
        assert!(
            map.holdings
                .iter()
                .any(|h| h.layers.start <= liar.layers.start && h.layers.end >= liar.layers.end),
            "nobody was planned the convicted member's layers: {map:?}"
        );
        let told_liar = after
            .directives
            .iter()
            .find(|message| message.target == liar.peer)
            .expect("the convicted holder is told to drop its span");
        assert_eq!(told_liar.span_after, None);
        assert!(matches!(
            told_liar.directives[..],
            [Directive::DropShard { layers, .. }] if layers == liar.layers
        ));
        // Once the ban has run out the planner may count on it again.
        assert!(book.is_convicted(&liar.peer, now + Duration::from_secs(59)));
        assert!(!book.is_convicted(&liar.peer, now + Duration::from_secs(61)));
    }

    #[test]
    fn an_unacknowledged_directive_is_sent_again_after_a_while() {
        let mut book = book();
        let start = Instant::now();
        book.observe(announcement("a", None), start);
        book.observe(announcement("b", None), start);
        let first = book.plan(start).unwrap();
        book.set_own_span(first.own_target.as_ref().map(ready));
        let soon = book.plan(start + Duration::from_millis(500)).unwrap();
        assert!(soon.directives.is_empty(), "not re-sent at once");
        // One and a half announcement intervals (1 s in this book).
        assert_eq!(book.directive_resend_after(), Duration::from_millis(1500));
        let before = book.plan(start + Duration::from_millis(1499)).unwrap();
        assert!(before.directives.is_empty(), "not re-sent before 1.5 s");
        let later = book.plan(start + Duration::from_millis(1501)).unwrap();
        assert_eq!(later.directives.len(), 2, "re-sent to both silent targets");
        assert!(later.directives[0].sequence > first.directives[1].sequence);
    }

    #[test]
    fn silent_peers_expire_and_only_they() {
        let mut book = book();
        let start = Instant::now();
        book.observe(announcement("old", None), start);
        book.observe(announcement("fresh", None), start + Duration::from_secs(2));
        assert!(book.expire(start + Duration::from_secs(3)).is_empty());
        let gone = book.expire(start + Duration::from_millis(3001));
        assert_eq!(gone, vec![PeerId::new("old")]);
        assert_eq!(book.peers().len(), 1);
    }

    #[test]
    fn the_advertised_interval_keeps_twenty_announcements_a_second_in_half_seconds() {
        let base = Duration::from_secs(2);
        let at = |members| scaled_announce_interval(base, members).as_millis();
        assert_eq!(
            [at(1), at(40), at(41), at(50), at(51)],
            [2000, 2000, 2500, 2500, 3000]
        );
        assert_eq!([at(100), at(101), at(1000)], [5000, 5500, 50_000]);
        assert_eq!(
            scaled_announce_interval(Duration::from_secs(9), 101),
            Duration::from_secs(9),
            "never below the base"
        );
    }

    #[test]
    fn a_stall_of_the_tracker_is_not_counted_as_its_peers_silence() {
        let mut book = book();
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        for second in 0..=2 {
            book.observe(announcement("steady", None), at(second));
            book.observe(announcement("leaver", None), at(second));
            assert!(book.expire(at(second)).is_empty());
        }
        // The tracker could not run from 2 s to 30 s; its expiry runs before it reads the
        // announcements that queued up meanwhile.
        assert!(
            book.expire(at(30)).is_empty(),
            "nobody expires for the stall"
        );
        assert_eq!(book.first_silent(&[PeerId::new("leaver")], at(30)), None);
        // "steady" goes on announcing; "leaver" stopped at 2 s and is gone after three
        // intervals of the tracker's own running time.
        for second in 30..=32 {
            book.observe(announcement("steady", None), at(second));
            assert!(book.expire(at(second)).is_empty(), "at {second} s");
        }
        book.observe(announcement("steady", None), at(33));
        assert_eq!(book.expire(at(33)), vec![PeerId::new("leaver")]);
        assert_eq!(book.peers().len(), 1);
    }

    #[test]
    fn repeated_announcements_do_not_trigger_replanning() {
        let mut book = book();
        let now = Instant::now();
        assert!(book.observe(announcement("a", None), now));
        assert!(!book.observe(announcement("a", None), now));
        let span = SpanStatus {
            layers: LayerSpan::new(10, 20),
            quantization: FORMAT,
            state: SpanState::Ready,
        };
        assert!(book.observe(announcement("a", Some(span)), now));
        assert!(
            !book.observe(announcement("tracker", None), now),
            "its own voice"
        );
    }
}
