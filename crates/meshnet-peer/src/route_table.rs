//! What the tracker knows of its members, as one value: the peers heard (each forgotten
//! after three silent announcement intervals), their bans and checked sessions, the planned
//! map and the tracker's own span and term. The tracker's book owns one and changes it; the
//! control loop publishes a copy after every change, from which generations take their routes
//! and `/status` its peers, so nobody reads the book itself. Pure: the caller passes the time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshnet_p2p::{PeerAnnouncement, PeerRtt, SpanStatus};
use meshnet_planner::{CoverageMap, ModelShape};
use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use meshnet_wire::Endpoint;

use crate::routing::{LinkDelays, PlannedHop, RouteCandidate, Uncovered, choose_route_by_delay};
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

/// What the tracker knows of the mesh's members and routes through them.
#[derive(Clone, Debug)]
pub struct RouteTable {
    own_id: PeerId,
    own_span: Option<SpanStatus>,
    /// The tracker's own round trips to members, nearest first.
    own_rtt: Vec<PeerRtt>,
    shape: Arc<ModelShape>,
    /// How often the tracker's own timer runs (the base announcement interval).
    base_interval: Duration,
    /// The longest interval advertised within its own expiry, and when it was last
    /// advertised: members still announcing at it are not expired after a shrink.
    longest_advertised: (Duration, Instant),
    /// The tracker's own stalls (when each ended, how long it lasted) within the last expiry:
    /// announcements queued while it could not run are not its peers' silence.
    stalls: Vec<(Instant, Duration)>,
    /// When silent peers were last expired.
    last_expire: Option<Instant>,
    peers: BTreeMap<PeerId, KnownPeer>,
    map: CoverageMap,
    bans: BTreeMap<PeerId, Ban>,
    /// Checked sessions each member passed since it joined or was last convicted.
    verified_sessions: BTreeMap<PeerId, u32>,
    /// The tracker term planned for.
    term: u64,
}

impl RouteTable {
    /// The table of the tracker `own_id` of a model shaped `shape`, whose members announce
    /// every `base_interval` (more seldom in a large mesh), at term 1 with nobody heard yet.
    pub fn new(own_id: PeerId, shape: ModelShape, base_interval: Duration) -> Self {
        RouteTable {
            own_id,
            own_span: None,
            own_rtt: Vec::new(),
            shape: Arc::new(shape),
            base_interval,
            longest_advertised: (base_interval, Instant::now()),
            stalls: Vec::new(),
            last_expire: None,
            peers: BTreeMap::new(),
            map: CoverageMap::empty(0),
            bans: BTreeMap::new(),
            verified_sessions: BTreeMap::new(),
            term: 1,
        }
    }

    /// The tracker's own id.
    pub fn own_id(&self) -> &PeerId {
        &self.own_id
    }

    /// The tracker's own span, as last told.
    pub fn own_span(&self) -> Option<&SpanStatus> {
        self.own_span.as_ref()
    }

    /// Replaces the planned map (a planning round's, with live states).
    pub(crate) fn set_map(&mut self, map: CoverageMap) {
        self.map = map;
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
    pub(crate) fn note_advertised(&mut self, now: Instant) {
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
    /// was stalled since it last heard from it: only the part of a stall after that.
    fn silence(&self, known: &KnownPeer, now: Instant) -> Duration {
        let stalled: Duration = self
            .stalls
            .iter()
            .map(|(ended, length)| {
                let began = ended.checked_sub(*length).unwrap_or(known.last_seen);
                ended.saturating_duration_since(began.max(known.last_seen))
            })
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
    pub(crate) fn is_plannable(&self, announcement: &PeerAnnouncement, now: Instant) -> bool {
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

    /// Records the tracker's own round trips to members (nearest first).
    pub fn set_own_rtt(&mut self, rtt: Vec<PeerRtt>) {
        self.own_rtt = rtt;
    }

    /// The one-way delays between members as the tracker and the members measured them.
    pub fn link_delays(&self) -> LinkDelays {
        let mut delays = LinkDelays::default();
        for rtt in &self.own_rtt {
            delays.insert(&self.own_id, &rtt.peer, f64::from(rtt.ms));
        }
        for (peer, known) in &self.peers {
            for rtt in &known.announcement.rtt_ms {
                delays.insert(peer, &rtt.peer, f64::from(rtt.ms));
            }
        }
        delays
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
                        .shape
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
        self.shape.num_layers
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
        choose_route_by_delay(
            start,
            self.num_layers(),
            &candidates,
            &self.link_delays(),
            &self.own_id,
        )
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
