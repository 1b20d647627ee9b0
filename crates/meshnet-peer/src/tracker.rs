//! The tracker's book: what it knows of its members (a [`RouteTable`]), the planner run over
//! them, and the coverage map and directives that come out. Pure bookkeeping: the caller
//! passes the time in and does the publishing. A planning round comes in three steps so the
//! planner itself can run off the caller's thread: [`TrackerBook::plan_round`] takes its
//! inputs, [`PlanRound::run`] plans, [`TrackerBook::apply_plan`] turns the plan into messages.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use meshnet_p2p::{CoverageMessage, DirectiveMessage, PeerAnnouncement, SpanStatus};
use meshnet_planner::{
    CoverageMap, Directive, ModelShape, PeerCapacity, Plan, Planner, PlannerConfig, SpanHolding,
};
use meshnet_types::{PeerId, SpanState};

use crate::error::PeerError;
use crate::routing::PlannedHop;
use crate::verify::Evidence;

pub use crate::route_table::{
    BAN_BACKOFF, Ban, KnownPeer, MAX_ANNOUNCEMENTS_PER_S, RouteTable, SUCCESSION_LENGTH,
    scaled_announce_interval,
};

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

/// The inputs of one planning round, taken from the book: the planner, the map it starts
/// from and the capacities of the peers it may count on. Runs anywhere (it owns its data).
#[derive(Debug)]
pub struct PlanRound {
    planner: Planner,
    current: CoverageMap,
    capacities: Vec<PeerCapacity>,
}

impl PlanRound {
    /// Runs the planner: the slow part of a round.
    pub fn run(&self) -> Result<Plan, PeerError> {
        Ok(self.planner.plan(&self.current, &self.capacities)?)
    }
}

/// The tracker's state.
#[derive(Debug)]
pub struct TrackerBook {
    model_id: String,
    planner: Planner,
    own_capacity: PeerCapacity,
    own_endpoint: String,
    /// What it knows of its members: the value it publishes for routes and `/status`.
    table: RouteTable,
    /// What each peer was last told to hold, and when.
    sent: BTreeMap<PeerId, (Option<SpanStatus>, Instant)>,
    epoch: u64,
    sequence: u64,
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
            table: RouteTable::new(own_id, shape.clone(), base_interval),
            planner: Planner::new(shape, PlannerConfig::default()),
            own_capacity,
            own_endpoint,
            sent: BTreeMap::new(),
            epoch: boot.as_millis() as u64,
            sequence: boot.as_micros() as u64,
        })
    }

    /// What the book knows of the members, to read routes, bans and peers from.
    pub fn table(&self) -> &RouteTable {
        &self.table
    }

    /// Records an announcement. Returns whether it changes what the planner sees (a new peer,
    /// or another span, state or capacity).
    pub fn observe(&mut self, announcement: PeerAnnouncement, now: Instant) -> bool {
        self.table.observe(announcement, now)
    }

    /// Forgets peers silent for longer than the expiry (the tracker's own stalls not
    /// counted); returns their ids. Meant to run once per base announcement interval.
    pub fn expire(&mut self, now: Instant) -> Vec<PeerId> {
        let gone = self.table.expire(now);
        for peer in &gone {
            self.sent.remove(peer);
        }
        gone
    }

    /// Keeps `peer` off routes for a while: it failed a generation because of `cause`.
    pub fn ban(&mut self, peer: &PeerId, cause: &str, now: Instant) {
        self.table.ban(peer, cause, now);
    }

    /// Keeps `peer`, caught returning wrong activations, off routes for `duration`.
    pub fn convict(&mut self, peer: &PeerId, evidence: Evidence, duration: Duration, now: Instant) {
        self.table.convict(peer, evidence, duration, now);
    }

    /// Counts a checked session `peer` passed.
    pub fn record_verified(&mut self, peer: &PeerId) {
        self.table.record_verified(peer);
    }

    /// Tells the book the tracker's own round trips to members, nearest first.
    pub fn set_own_rtt(&mut self, rtt: Vec<meshnet_p2p::PeerRtt>) {
        self.table.set_own_rtt(rtt);
    }

    /// Tells the book what the tracker itself holds now.
    pub fn set_own_span(&mut self, span: Option<SpanStatus>) {
        self.table.set_own_span(span);
    }

    /// Plans for tracker term `term` from now on (a takeover).
    pub fn set_term(&mut self, term: u64) {
        self.table.set_term(term);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Runs a whole planning round at `now` on this thread and returns what to publish.
    pub fn plan(&mut self, now: Instant) -> Result<PlanOutcome, PeerError> {
        let plan = self.plan_round(now).run()?;
        Ok(self.apply_plan(plan, now))
    }

    /// The inputs of a planning round at `now`.
    pub fn plan_round(&self, now: Instant) -> PlanRound {
        let mut capacities = vec![self.own_capacity.clone()];
        capacities.extend(
            self.table
                .peers()
                .values()
                .filter(|known| self.table.is_plannable(&known.announcement, now))
                .map(|known| capacity(&known.announcement)),
        );
        PlanRound {
            planner: self.planner.clone(),
            current: self.current_map(now),
            capacities,
        }
    }

    /// Takes in the `plan` of the round started at `now` (with nothing observed since) and
    /// returns what to publish.
    pub fn apply_plan(&mut self, plan: Plan, now: Instant) -> PlanOutcome {
        let mut by_peer: BTreeMap<PeerId, Vec<Directive>> = BTreeMap::new();
        for directive in &plan.directives {
            by_peer
                .entry(directive.peer().clone())
                .or_default()
                .push(directive.clone());
        }
        if !plan.directives.is_empty() || !same_holdings(&plan.map, self.table.map()) {
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
        let own_intended = intended_of(self.table.own_id());
        if !same_span(own_intended.as_ref(), self.table.own_span()) {
            own_target = own_intended;
        }
        // A leaving peer keeps what it holds until it is gone: no directive moves it. A
        // convicted one is planned nothing, so it is told to drop what it holds.
        let targets: Vec<(PeerId, Option<SpanStatus>)> = self
            .table
            .peers()
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

        let map = self.with_live_states(plan.map);
        self.table.set_map(map);
        self.sequence += 1;
        self.table.note_advertised(now);
        let table = &self.table;
        PlanOutcome {
            coverage: CoverageMessage {
                model_id: self.model_id.clone(),
                term: table.term(),
                succession: table.succession(now),
                tracker_http: self.own_endpoint.clone(),
                epoch: self.epoch,
                sequence: self.sequence,
                num_layers: table.num_layers(),
                map: table.map().clone(),
                announce_interval_ms: table.announce_every().as_millis() as u64,
            },
            directives,
            own_target,
        }
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
            .table
            .peers()
            .get(&peer)
            .and_then(|known| known.announcement.span.clone())
            .filter(|span| span.state != SpanState::Draining);
        if same_span(intended.as_ref(), announced.as_ref()) {
            self.sent.remove(&peer);
            return None;
        }
        let recently_sent = self.sent.get(&peer).is_some_and(|(target, at)| {
            same_span(target.as_ref(), intended.as_ref())
                && now.duration_since(*at) < self.table.directive_resend_after()
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
            term: self.table.term(),
            epoch: self.epoch,
            sequence: self.sequence,
            directives: list,
            span_after: intended,
        })
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
        let table = &self.table;
        if let Some(span) = table.own_span() {
            push(table.own_id(), span);
        }
        let remembered = table.directive_resend_after() * 4;
        for (peer, known) in table.peers() {
            let pending = self
                .sent
                .get(peer)
                .filter(|(_, at)| now.duration_since(*at) < remembered);
            if !table.is_plannable(&known.announcement, now) {
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
            let actual = if &holding.peer == self.table.own_id() {
                self.table.own_span().cloned()
            } else {
                self.table
                    .peers()
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
pub(crate) mod fixtures {
    //! A book of the real model's shape and the announcements and evidence its tests feed it.

    use super::*;
    use meshnet_types::{LayerSpan, Quantization};

    pub(crate) const FORMAT: Quantization = Quantization::Q4_1;
    pub(crate) const KV_TOKENS: u64 = 256;

    pub(crate) fn shape() -> ModelShape {
        ModelShape::smollm2_135m()
    }

    pub(crate) fn memory(layers: u32, tracker: bool) -> u64 {
        shape()
            .budget_for_layers(FORMAT, KV_TOKENS, layers, tracker)
            .unwrap()
    }

    pub(crate) fn book() -> TrackerBook {
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

    pub(crate) fn announcement(peer: &str, span: Option<SpanStatus>) -> PeerAnnouncement {
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
            rtt_ms: vec![],
        }
    }

    pub(crate) fn ready(span: &SpanStatus) -> SpanStatus {
        SpanStatus {
            state: SpanState::Ready,
            ..span.clone()
        }
    }

    pub(crate) fn evidence(layers: LayerSpan) -> Evidence {
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
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use meshnet_types::LayerSpan;

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
        assert!(book.table().route(10).is_err(), "nothing is ready yet");

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
        let hops = book.table().route(10).unwrap();
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

    #[test]
    fn holders_cover_the_layers_asked_and_run_exactly_those() {
        let now = Instant::now();
        let book = settled_book(now);
        let route = book.table().route(10).unwrap();
        assert_eq!(route_boundaries(10, &route), vec![10, 20]);
        let within = book.table().holders(LayerSpan::new(12, 15), &[], now);
        assert_eq!(within.len(), 1);
        assert_eq!(within[0].peer, route[0].peer);
        assert_eq!(within[0].layers, LayerSpan::new(12, 15));
        assert!(
            book.table()
                .holders(LayerSpan::new(15, 25), &[], now)
                .is_empty(),
            "nobody holds both"
        );
        assert!(
            book.table()
                .holders(route[1].layers, &[route[1].peer.clone()], now)
                .is_empty()
        );
    }

    #[test]
    fn a_conviction_outlasts_announcements_and_short_bans_and_resets_probation() {
        let now = Instant::now();
        let mut book = settled_book(now);
        let hop = book.table().route(10).unwrap().remove(0);
        let liar = hop.peer.clone();
        book.record_verified(&liar);
        book.record_verified(&liar);
        assert_eq!(book.table().verified_sessions(&liar), 2);
        let day = Duration::from_secs(86_400);
        book.convict(&liar, evidence(hop.layers), day, now);
        assert_eq!(book.table().verified_sessions(&liar), 0);
        // A failover's short ban does not replace it, nor does announcing again.
        book.ban(&liar, "timed out", now);
        let later = now + BAN_BACKOFF * 3;
        let span = book.table().peers()[&liar].announcement.span.clone();
        book.observe(announcement(liar.as_str(), span), later);
        assert!(book.table().is_banned(&liar, later));
        assert!(book.table().holders(hop.layers, &[], later).is_empty());
        let bans = book.table().bans(later);
        assert_eq!(bans.len(), 1);
        assert_eq!(bans[0].1.until, now + day);
        assert_eq!(bans[0].1.evidence.as_deref(), Some(&evidence(hop.layers)));
        assert!(!book.table().is_banned(&liar, now + day + BAN_BACKOFF));
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
            .table()
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
        assert!(
            book.table()
                .is_convicted(&liar.peer, now + Duration::from_secs(59))
        );
        assert!(
            !book
                .table()
                .is_convicted(&liar.peer, now + Duration::from_secs(61))
        );
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
        assert_eq!(
            book.table().directive_resend_after(),
            Duration::from_millis(1500)
        );
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
        assert_eq!(book.table().peers().len(), 1);
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
        assert_eq!(
            book.table().first_silent(&[PeerId::new("leaver")], at(30)),
            None
        );
        // "steady" goes on announcing; "leaver" stopped at 2 s and is gone after three
        // intervals of the tracker's own running time.
        for second in 30..=32 {
            book.observe(announcement("steady", None), at(second));
            assert!(book.expire(at(second)).is_empty(), "at {second} s");
        }
        book.observe(announcement("steady", None), at(33));
        assert_eq!(book.expire(at(33)), vec![PeerId::new("leaver")]);
        assert_eq!(book.table().peers().len(), 1);
    }

    #[test]
    fn a_late_expiry_credits_only_the_part_of_the_stall_after_a_peers_last_announcement() {
        let mut book = book();
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let leaver = PeerId::new("leaver");
        book.observe(announcement("leaver", None), at(0));
        assert!(book.expire(at(0)).is_empty());
        // The loop reads the leaver's last announcement at 9 s, but its expiry runs only at
        // 10 s: nine seconds of stall, of which one came after that announcement.
        book.observe(announcement("leaver", None), at(9_000));
        assert!(book.expire(at(10_000)).is_empty());
        // Silent for the expiry (three 1 s intervals) plus that one second: from 13 s on.
        let table = book.table();
        assert_eq!(
            table.first_silent(std::slice::from_ref(&leaver), at(12_999)),
            None
        );
        assert_eq!(
            table.first_silent(std::slice::from_ref(&leaver), at(13_001)),
            Some(leaver)
        );
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
