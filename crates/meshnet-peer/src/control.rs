//! The control loop: announces this member, applies the tracker's directives (loading off the
//! async workers), reaps idle sessions and drained spans on its timer, and on the tracker
//! also gathers announcements, plans and publishes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshnet_p2p::{DirectiveMessage, Leadership, P2pEvent, P2pHandle, TrackerRecord};
use meshnet_types::{PeerId, Quantization};
use tokio::sync::{mpsc, watch};

use crate::book_routes::{BookCommand, OwnedBook};
use crate::error::PeerError;
use crate::member::{Member, MeshView};
use crate::rejections::RejectionReport;
use crate::span_host::SpanTarget;

/// How long the tracker waits after a change before planning, to batch announcements.
const REPLAN_DEBOUNCE: Duration = Duration::from_millis(150);

/// The longest pause between two reaps of idle sessions and drained spans.
const REAP_INTERVAL: Duration = Duration::from_secs(1);

/// The most a tracker may stretch a member's announcement interval, as a multiple of the
/// member's own (a thousand members at the scaling of [`crate::tracker`]).
const MAX_INTERVAL_STRETCH: u32 = 25;

/// The interval a member announces at when its tracker advertises `advertised_ms`: never
/// below its own `base` (0 means none advertised) and at most [`MAX_INTERVAL_STRETCH`] times it.
fn followed_interval(advertised_ms: u64, base: Duration) -> Duration {
    Duration::from_millis(advertised_ms).clamp(base, base * MAX_INTERVAL_STRETCH)
}

/// One span load at a time; the latest request waits its turn.
#[derive(Default)]
struct Loader {
    busy: bool,
    queued: Option<Option<SpanTarget>>,
}

/// The best speed this member measured per quantization, in layer-tokens per second (tokens
/// per second through a span times its layers). A measurement runs while the machine does
/// other work, which only slows it: the best one is the member's speed, and announcing it
/// keeps the planner from rebalancing on every noisy measurement.
#[derive(Debug, Default)]
struct SpeedRecord {
    best: std::collections::BTreeMap<Quantization, f64>,
}

impl SpeedRecord {
    /// Takes in `tokens_per_s` measured through `target` and returns the throughput to
    /// announce for it: the best rate of its format over its layers.
    fn record(&mut self, target: &SpanTarget, tokens_per_s: f64) -> f64 {
        let layers = f64::from(target.layers.len().max(1));
        let best = self.best.entry(target.quantization).or_insert(0.0);
        if tokens_per_s.is_finite() && tokens_per_s > 0.0 {
            *best = best.max(tokens_per_s * layers);
        }
        if *best > 0.0 {
            *best / layers
        } else {
            tokens_per_s
        }
    }
}

/// What a finished load reports back to the control loop.
struct LoadDone {
    target: SpanTarget,
    outcome: Result<f64, PeerError>,
}

/// The tracker's part of the control loop.
struct Planning {
    /// The book of peers; this loop is its only writer.
    book: OwnedBook,
    /// When to plan next, if a plan is due.
    replan_at: Option<tokio::time::Instant>,
    /// The epoch of the tracker record last stored in the DHT.
    record_epoch: Option<u64>,
    /// Whether the mesh covered the model at the last plan.
    covered: bool,
    /// The coverage map last published, and when.
    published: Option<(meshnet_p2p::CoverageMessage, tokio::time::Instant)>,
}

impl Planning {
    /// Planning over `book`, starting at once.
    fn new(book: OwnedBook) -> Self {
        Planning {
            book,
            replan_at: Some(tokio::time::Instant::now()),
            record_epoch: None,
            covered: false,
            published: None,
        }
    }

    /// Plans at `at` unless a plan is already scheduled.
    fn plan_by(&mut self, at: tokio::time::Instant) {
        self.replan_at.get_or_insert(at);
    }
}

/// Whether `coverage` should go out at `now` after `last` (the map last published, and when):
/// it says something `last` did not (everything but the sequence number compared), or `last`
/// is `heartbeat` old, so followers keep hearing their tracker. Replans while peers load come
/// every few hundred milliseconds; an unchanged map need not reach every member each time.
fn coverage_due<T: Copy + Ord + std::ops::Sub<Output = Duration>>(
    last: Option<&(meshnet_p2p::CoverageMessage, T)>,
    coverage: &meshnet_p2p::CoverageMessage,
    now: T,
    heartbeat: Duration,
) -> bool {
    let Some((last, at)) = last else {
        return true;
    };
    let same = last.term == coverage.term
        && last.epoch == coverage.epoch
        && last.succession == coverage.succession
        && last.tracker_http == coverage.tracker_http
        && last.map == coverage.map;
    !same || now.max(*at) - *at >= heartbeat
}

/// Whether `coverage` from `from` is older than the map `view` holds from the same tracker
/// and term (a lower or equal sequence number: the tracker numbers its publications).
fn is_older_map(view: &MeshView, from: &PeerId, coverage: &meshnet_p2p::CoverageMessage) -> bool {
    view.following.tracker.as_ref() == Some(from)
        && view.coverage.as_ref().is_some_and(|current| {
            current.term == coverage.term && coverage.sequence <= current.sequence
        })
}

/// The next command generations sent the tracker's book; never, on a member that is not the
/// tracker.
async fn next_book_command(planning: &mut Option<Planning>) -> Option<BookCommand> {
    match planning {
        Some(planning) => planning.book.next_command().await,
        None => std::future::pending().await,
    }
}

/// The control loop of one member.
pub(crate) struct ControlLoop {
    /// Set when the member cannot go on.
    failed: watch::Sender<Option<String>>,
    member: Arc<Member>,
    /// Publishes what the member knows of the mesh; this loop is its only writer.
    view: watch::Sender<MeshView>,
    p2p: P2pHandle,
    /// The member's own announcement interval: the tracker's heartbeat and the silence after
    /// which a tracker is missed are counted in it.
    announce_interval: Duration,
    loader: Loader,
    /// The best measured speed per format, behind the announced throughput.
    speed: SpeedRecord,
    /// The tracker and sequence of the last directive applied.
    last_directive: Option<(PeerId, u64)>,
    /// Present on the tracker only.
    planning: Option<Planning>,
    /// The silence (by when the tracker was last heard) for which this member already said it
    /// hears too few others to take over.
    cut_off_warned: Option<Instant>,
}

impl ControlLoop {
    /// A loop for `member`, publishing its view of the mesh on `view` and reporting a fatal
    /// condition on `failed`; on a member that starts as the tracker it owns `book`.
    pub(crate) fn new(
        member: Arc<Member>,
        view: watch::Sender<MeshView>,
        book: Option<OwnedBook>,
        p2p: P2pHandle,
        announce_interval: Duration,
        failed: watch::Sender<Option<String>>,
    ) -> Self {
        let planning = book.map(Planning::new);
        ControlLoop {
            failed,
            member,
            view,
            p2p,
            announce_interval,
            loader: Loader::default(),
            speed: SpeedRecord::default(),
            last_directive: None,
            planning,
            cut_off_warned: None,
        }
    }

    /// Runs until `stop` turns true or the control plane closes.
    pub(crate) async fn run(
        mut self,
        mut events: mpsc::Receiver<P2pEvent>,
        mut stop: watch::Receiver<bool>,
    ) {
        let (load_tx, mut load_rx) = mpsc::channel::<LoadDone>(4);
        let mut announce = tokio::time::interval(self.announce_interval);
        announce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_tick = tokio::time::Instant::now();
        let mut reap = tokio::time::interval(self.announce_interval.min(REAP_INTERVAL));
        reap.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let replan_at = self.planning.as_ref().and_then(|p| p.replan_at);
            let replan = async {
                match replan_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.changed() => break,
                event = events.recv() => match event {
                    Some(event) => self.handle_event(event, &load_tx),
                    None => break,
                },
                Some(done) = load_rx.recv() => {
                    let loaded = self.finish_load(done, &load_tx);
                    self.announce().await;
                    if let Some(planning) = &mut self.planning {
                        // After a failed load of its own span, the tracker waits an interval
                        // before trying again.
                        let delay = if loaded { Duration::ZERO } else { self.announce_interval };
                        planning.replan_at = Some(tokio::time::Instant::now() + delay);
                    }
                }
                tick = announce.tick() => {
                    last_tick = tick;
                    self.announce().await;
                    if let Some(planning) = &mut self.planning {
                        let rtt = self.member.rtt.nearest();
                        planning.book.change(|book| {
                            book.expire(Instant::now());
                            book.set_own_rtt(rtt);
                        });
                        planning.plan_by(tokio::time::Instant::now());
                    }
                }
                _ = reap.tick() => {
                    self.member.host.reap(Instant::now());
                    self.maybe_take_over().await;
                }
                _ = self.member.announce_requested() => self.announce().await,
                Some(command) = next_book_command(&mut self.planning) => {
                    if let Some(planning) = &mut self.planning {
                        planning.book.apply(command);
                    }
                }
                _ = replan => {
                    if let Some(planning) = &mut self.planning {
                        planning.replan_at = None;
                    }
                    self.plan_round(&load_tx).await;
                }
            }
            let every = self.announce_every();
            if announce.period() != every {
                tracing::info!(?every, "announcing at the tracker's interval");
                // The next announcement comes one new interval after the last one, not one
                // interval after the change: a member is never kept silent by changes.
                announce = tokio::time::interval_at(last_tick + every, every);
                announce.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            }
        }
        tracing::debug!(peer = %self.member.peer_id, "control loop stopped");
    }

    /// How often this member announces: its own interval, or the longer one its tracker
    /// advertises for a large mesh.
    fn announce_every(&self) -> Duration {
        self.view.borrow().announce_every
    }

    /// Handles one control-plane event.
    fn handle_event(&mut self, event: P2pEvent, load_tx: &mpsc::Sender<LoadDone>) {
        match event {
            P2pEvent::Announcement { announcement, .. } => self.hear(announcement),
            P2pEvent::Leadership(leadership) => self.on_leadership(leadership),
            P2pEvent::Coverage { from, coverage } => self.follow(from, coverage),
            P2pEvent::Directive { from, directive } => {
                self.apply_directive(from, directive, load_tx)
            }
            P2pEvent::TrackerDiscovered(record) => self.found_tracker(record),
            P2pEvent::Rejected {
                from,
                topic,
                reason,
            } => {
                tracing::warn!(%from, %topic, %reason, "gossip message rejected");
                self.member.count_rejection(RejectionReport {
                    from,
                    topic,
                    reason,
                });
            }
            P2pEvent::ListeningOn(address) => self.listening_on(address.to_string()),
            P2pEvent::PeerConnected(peer) => tracing::debug!(%peer, "connected"),
            P2pEvent::PeerDisconnected(peer) => tracing::debug!(%peer, "disconnected"),
            P2pEvent::Reachability { public } => tracing::info!(public, "reachability"),
            P2pEvent::ModelMismatch {
                peer,
                model,
                decisive,
            } => {
                let ours = self.member.model.id();
                self.member.count_rejection(RejectionReport {
                    from: peer.clone(),
                    topic: "identify".to_owned(),
                    reason: format!("runs model {model}, this mesh runs {ours}"),
                });
                if self.planning.is_none() && decisive {
                    let reason = format!(
                        "the mesh this peer joined runs model {model} (peer {peer}), but this \
                         peer runs {ours}: start it with the same model file as the tracker"
                    );
                    tracing::error!("{reason}");
                    let _ = self.failed.send(Some(reason));
                } else {
                    tracing::warn!(%peer, their_model = %model, our_model = %ours, "refused a peer that runs another model");
                }
            }
        }
    }

    /// Takes in a member's announcement: into the view, and into the book on the tracker
    /// (a change the planner sees schedules a plan).
    fn hear(&mut self, announcement: meshnet_p2p::PeerAnnouncement) {
        let now = Instant::now();
        self.view.send_modify(|view| {
            std::sync::Arc::make_mut(&mut view.seen)
                .insert(announcement.peer.clone(), (announcement.clone(), now));
        });
        if let Some(planning) = &mut self.planning
            && planning.book.change(|book| book.observe(announcement, now))
        {
            planning.plan_by(tokio::time::Instant::now() + REPLAN_DEBOUNCE);
        }
    }

    /// A tracker record found in the DHT: followed when this member follows none yet.
    fn found_tracker(&mut self, record: TrackerRecord) {
        tracing::info!(tracker = %record.peer, term = record.term, http = %record.http_endpoint, "tracker found");
        // A record finds a tracker; only coverage maps set the term.
        self.view.send_if_modified(|view| {
            let following = &mut view.following;
            if following.tracker.is_some() {
                return false;
            }
            following.tracker = Some(record.peer);
            following.tracker_http = Some(record.http_endpoint);
            following.heard_at = Some(Instant::now());
            true
        });
    }

    /// A new listen address of the control plane, kept in the view.
    fn listening_on(&mut self, address: String) {
        self.view.send_if_modified(|view| {
            if view.listen_addrs.contains(&address) {
                return false;
            }
            Arc::make_mut(&mut view.listen_addrs).push(address);
            true
        });
    }

    /// Follows the control plane's decision on who leads: a member that led and was deposed
    /// (another won a later term) stops planning and serves as a peer.
    fn on_leadership(&mut self, leadership: Leadership) {
        match leadership {
            Leadership::Follows {
                tracker,
                term,
                stepped_down: true,
            } if self.planning.is_some() => {
                tracing::warn!(%tracker, term, "another member won a later tracker term: stepping down to peer");
                self.planning = None;
                self.member.set_role(None);
            }
            Leadership::Follows { .. } => {}
            Leadership::Leads { term } => tracing::debug!(term, "the control plane leads"),
        }
    }

    /// Takes in a coverage map the control plane accepted from `from`: the tracker it
    /// follows, or a new one that won a later term (a member that was the tracker stepped
    /// down on the [`Leadership`] event before it).
    fn follow(&mut self, from: PeerId, coverage: meshnet_p2p::CoverageMessage) {
        if from == self.member.peer_id {
            return;
        }
        if is_older_map(&self.view.borrow(), &from, &coverage) {
            // Gossip may deliver a map late, after a newer one of the same tracker.
            tracing::debug!(tracker = %from, sequence = coverage.sequence, "older coverage map ignored");
            return;
        }
        let every = followed_interval(coverage.announce_interval_ms, self.announce_interval);
        self.view.send_modify(|view| {
            let following = &mut view.following;
            if following.tracker.as_ref() != Some(&from) {
                tracing::info!(tracker = %from, term = coverage.term, "following tracker");
            }
            following.tracker = Some(from);
            following.tracker_http = Some(coverage.tracker_http.clone());
            following.term = coverage.term;
            following.succession = coverage.succession.clone();
            following.heard_at = Some(Instant::now());
            view.coverage = Some(Arc::new(coverage));
            view.announce_every = every;
        });
    }

    /// Takes the tracker role when the tracker has been silent long enough and this member
    /// is next in its succession list among the members still heard (see
    /// [`crate::election`]).
    async fn maybe_take_over(&mut self) {
        let member = &self.member;
        if self.planning.is_some() || !member.settings.tracker_capable || member.is_leaving() {
            return;
        }
        let following = self.view.borrow().following.clone();
        let (Some(tracker), Some(heard_at)) = (following.tracker.clone(), following.heard_at)
        else {
            return;
        };
        let now = Instant::now();
        let silence = now.duration_since(heard_at);
        let timeout = self.announce_interval * 3;
        let members = self.members_of_last_map(&tracker);
        let (rank, quorum) = self.standing(&following.succession, &members, now, timeout);
        let Some(rank) = rank else {
            return;
        };
        if !crate::election::claims_now(rank, silence, timeout) {
            return;
        }
        if !quorum {
            self.warn_cut_off(&tracker, heard_at, silence, members.len());
            return;
        }
        let term = following.term + 1;
        tracing::warn!(
            %tracker,
            silent_ms = silence.as_millis() as u64,
            term,
            rank,
            "the tracker went silent: taking over as tracker"
        );
        if let Err(error) = self.take_over(term).await {
            tracing::error!(%error, "taking over as tracker failed");
            // Try again one timeout later, unless someone else claims first.
            self.view
                .send_modify(|view| view.following.heard_at = Some(Instant::now()));
        }
    }

    /// The peers of the tracker's last map, `tracker` aside: who must be heard for a majority.
    fn members_of_last_map(&self, tracker: &PeerId) -> Vec<PeerId> {
        let view = self.view.borrow();
        let mut peers: Vec<PeerId> = view
            .coverage
            .as_ref()
            .map(|c| c.map.holdings.iter().map(|h| h.peer.clone()).collect())
            .unwrap_or_default();
        peers.retain(|peer| peer != tracker);
        peers.sort();
        peers.dedup();
        peers
    }

    /// This member's rank in `succession` among the members heard at `now`, and whether most
    /// of `members` are heard missing the tracker for `timeout` too. A member counts as heard
    /// when its last announcement (at the interval it announces at) is three intervals old at
    /// most.
    fn standing(
        &self,
        succession: &[PeerId],
        members: &[PeerId],
        now: Instant,
        timeout: Duration,
    ) -> (Option<usize>, bool) {
        let member = &self.member;
        let heard_within = self.announce_every() * 3;
        let view = self.view.borrow();
        let seen = &view.seen;
        let alive = |peer: &PeerId| {
            *peer == member.peer_id
                || seen.get(peer).is_some_and(|(announcement, at)| {
                    !announcement.leaving && now.duration_since(*at) <= heard_within
                })
        };
        // The majority must miss the tracker too, not just be heard.
        let backs_the_claim = |peer: &PeerId| {
            alive(peer)
                && (*peer == member.peer_id
                    || seen.get(peer).is_some_and(|(announcement, _)| {
                        crate::election::vouches_for_silence(
                            announcement.tracker_silent_ms.map(Duration::from_millis),
                            timeout,
                        )
                    }))
        };
        (
            crate::election::rank(succession, &member.peer_id, alive),
            crate::election::has_quorum(members, backs_the_claim),
        )
    }

    /// Says once per silence (`heard_at`) that `tracker` went silent but too few of the
    /// `members` are heard missing it for this member to take over.
    fn warn_cut_off(
        &mut self,
        tracker: &PeerId,
        heard_at: Instant,
        silence: Duration,
        members: usize,
    ) {
        if self.cut_off_warned == Some(heard_at) {
            return;
        }
        self.cut_off_warned = Some(heard_at);
        tracing::warn!(
            %tracker,
            silent_ms = silence.as_millis() as u64,
            members,
            "the tracker went silent, but too few of the others are heard missing it \
             too for this member to take over (cut off from the mesh?)"
        );
    }

    /// Becomes the tracker of `term`: a book rebuilt from the announcements heard, an engine
    /// and API over it, the control plane told, and a plan at once.
    async fn take_over(&mut self, term: u64) -> Result<(), PeerError> {
        let member = Arc::clone(&self.member);
        let own = member.capacity(true);
        let parts = crate::tracker_role::build_tracker_parts(
            &member.host,
            own,
            &member.public_url(),
            &member.settings,
        )
        .await?;
        let (parts, mut book) = parts;
        book.change(|book| {
            book.set_term(term);
            book.set_own_span(member.host.entry_span_status());
            let view = self.view.borrow();
            for (peer, (announcement, at)) in view.seen.iter() {
                if Some(peer) != view.following.tracker.as_ref() {
                    book.observe(announcement.clone(), *at);
                }
            }
        });
        self.p2p.take_tracker_role(term).await?;
        self.view.send_modify(|view| {
            let following = &mut view.following;
            following.tracker = Some(member.peer_id.clone());
            following.tracker_http = Some(member.public_url());
            following.term = term;
            following.heard_at = Some(Instant::now());
        });
        self.planning = Some(Planning::new(book));
        // The tracker's timer runs at the base interval: it plans, expires and sends its
        // heartbeat on it.
        let base = self.announce_interval;
        self.view.send_modify(|view| view.announce_every = base);
        member.set_role(Some(parts));
        // Directives from the old tracker no longer apply; the new one's sequence numbers
        // start from its own clock.
        self.last_directive = None;
        tracing::info!(term, "this member is the tracker now");
        Ok(())
    }

    fn apply_directive(
        &mut self,
        from: PeerId,
        directive: DirectiveMessage,
        load_tx: &mpsc::Sender<LoadDone>,
    ) {
        if let Some((tracker, sequence)) = &self.last_directive
            && *tracker == from
            && directive.sequence <= *sequence
        {
            tracing::debug!(sequence = directive.sequence, "stale directive ignored");
            return;
        }
        self.last_directive = Some((from, directive.sequence));
        tracing::info!(
            epoch = directive.epoch,
            sequence = directive.sequence,
            directives = ?directive.directives,
            "directive received"
        );
        self.member
            .metrics
            .count_directives_applied(directive.directives.len());
        let target = directive.span_after.map(|span| SpanTarget {
            layers: span.layers,
            quantization: span.quantization,
            entry: false,
        });
        self.request_span(target, load_tx);
    }

    /// Moves this member towards holding `target` (nothing when `None`).
    fn request_span(&mut self, target: Option<SpanTarget>, load_tx: &mpsc::Sender<LoadDone>) {
        if self.loader.busy {
            self.loader.queued = Some(target);
            return;
        }
        let host = Arc::clone(&self.member.host);
        let Some(target) = target else {
            host.unload();
            return;
        };
        if host
            .current()
            .is_some_and(|held_span| held_span.target == target)
        {
            return;
        }
        self.loader.busy = true;
        let hidden = self.member.model.description().hidden;
        let load_tx = load_tx.clone();
        tokio::spawn(async move {
            let outcome = tokio::task::spawn_blocking(move || {
                let held_span = host.load(target)?;
                Ok(held_span.measure_throughput(hidden))
            })
            .await
            .unwrap_or_else(|e| Err(PeerError::Internal(e.to_string())));
            let _ = load_tx.send(LoadDone { target, outcome }).await;
        });
    }

    /// Records a finished load and starts the queued one; returns whether the load worked.
    fn finish_load(&mut self, done: LoadDone, load_tx: &mpsc::Sender<LoadDone>) -> bool {
        self.loader.busy = false;
        let loaded = done.outcome.is_ok();
        match done.outcome {
            Ok(measured) => {
                let throughput = self.speed.record(&done.target, measured);
                self.view.send_modify(|view| view.throughput = throughput);
            }
            Err(error) => {
                tracing::error!(layers = %done.target.layers, %error, "loading a span failed");
            }
        }
        if let Some(planning) = &mut self.planning {
            let span = self.member.host.entry_span_status();
            planning.book.change(|book| book.set_own_span(span));
        }
        if let Some(next) = self.loader.queued.take() {
            self.request_span(next, load_tx);
        }
        loaded
    }

    async fn announce(&self) {
        let announcement = self.member.announcement();
        if let Err(error) = self.p2p.publish_announcement(announcement).await {
            tracing::warn!(%error, "announcing failed");
        }
    }

    /// The tracker's planning round: plan, publish, load its own span if it changed.
    async fn plan_round(&mut self, load_tx: &mpsc::Sender<LoadDone>) {
        let outcome = match self.plan().await {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::error!(%error, "planning failed");
                return;
            }
        };
        if let Some(target) = outcome.own_target {
            let entry = SpanTarget {
                layers: target.layers,
                quantization: target.quantization,
                entry: true,
            };
            self.request_span(Some(entry), load_tx);
        }
        let epoch = outcome.coverage.epoch;
        let published = Arc::new(outcome.coverage.clone());
        self.view
            .send_modify(|view| view.coverage = Some(published));
        let now = tokio::time::Instant::now();
        // A tick comes every announcement interval; the heartbeat allows a little jitter.
        let heartbeat = self.announce_interval.mul_f64(0.9);
        let due = self.planning.as_ref().is_some_and(|planning| {
            coverage_due(
                planning.published.as_ref(),
                &outcome.coverage,
                now,
                heartbeat,
            )
        });
        if due {
            if let Some(planning) = &mut self.planning {
                planning.published = Some((outcome.coverage.clone(), now));
            }
            if let Err(error) = self.p2p.publish_coverage(outcome.coverage).await {
                tracing::warn!(%error, "publishing the coverage map failed");
            }
        }
        self.publish_directives(outcome.directives).await;
        self.store_record(epoch).await;
        let covered = self.member.route_boundaries().is_some();
        let Some(planning) = &mut self.planning else {
            return;
        };
        if covered && !planning.covered {
            tracing::info!(
                "the mesh covers the model; OpenAI base URL: {}/v1",
                self.member.public_url()
            );
        } else if !covered && planning.covered {
            tracing::warn!("the mesh no longer covers the model");
        }
        planning.covered = covered;
    }

    /// Runs a planning round over the book, the planner itself off the async workers (this
    /// loop waits for it: nothing changes the book meanwhile).
    async fn plan(&mut self) -> Result<crate::tracker::PlanOutcome, PeerError> {
        let planning = self
            .planning
            .as_mut()
            .ok_or_else(|| PeerError::Internal("planning without a book".to_owned()))?;
        let span = self.member.host.entry_span_status();
        let now = Instant::now();
        let round = planning.book.change(|book| {
            book.set_own_span(span);
            book.plan_round(now)
        });
        let plan = tokio::task::spawn_blocking(move || round.run())
            .await
            .map_err(|e| PeerError::Internal(e.to_string()))??;
        Ok(planning.book.change(|book| book.apply_plan(plan, now)))
    }

    /// Publishes a planning round's directives, all handed to the control plane at once: one
    /// at a time, each waiting for its reply, a hundred took the tracker's loop tens of seconds
    /// when the control plane was busy, and announcements queued up unread meanwhile.
    async fn publish_directives(&self, directives: Vec<DirectiveMessage>) {
        let sends = directives.into_iter().map(|directive| {
            tracing::info!(
                target = %directive.target,
                epoch = directive.epoch,
                sequence = directive.sequence,
                span_after = ?directive.span_after.as_ref().map(|s| s.layers.to_string()),
                "directive published"
            );
            let count = directive.directives.len();
            async move { (count, self.p2p.publish_directive(directive).await) }
        });
        for (count, sent) in futures::future::join_all(sends).await {
            match sent {
                Ok(()) => self.member.metrics.count_directives_issued(count),
                Err(error) => tracing::warn!(%error, "publishing a directive failed"),
            }
        }
    }

    /// Stores the tracker record for `epoch` in the DHT, once per epoch.
    async fn store_record(&mut self, epoch: u64) {
        let Some(planning) = &mut self.planning else {
            return;
        };
        if planning.record_epoch == Some(epoch) {
            return;
        }
        planning.record_epoch = Some(epoch);
        let member = &self.member;
        let term = planning.book.book().table().term();
        let record = TrackerRecord {
            peer: member.peer_id.clone(),
            addresses: member.view.borrow().listen_addrs.to_vec(),
            http_endpoint: member.public_url(),
            epoch,
            term,
            model_id: member.model.id().to_owned(),
        };
        if let Err(error) = self.p2p.set_tracker_record(record).await {
            tracing::warn!(%error, "storing the tracker record failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use meshnet_planner::CoverageMap;

    use super::*;

    fn coverage(epoch: u64, sequence: u64) -> meshnet_p2p::CoverageMessage {
        meshnet_p2p::CoverageMessage {
            model_id: "m".into(),
            term: 1,
            succession: Vec::new(),
            tracker_http: "http://t".into(),
            epoch,
            sequence,
            num_layers: 30,
            map: CoverageMap::empty(epoch),
            announce_interval_ms: 2000,
        }
    }

    #[test]
    fn a_map_delivered_late_is_older_only_from_the_same_tracker_and_term() {
        let tracker = PeerId::new("t");
        let mut view = MeshView::default();
        view.following.tracker = Some(tracker.clone());
        view.coverage = Some(Arc::new(coverage(1, 10)));
        assert!(is_older_map(&view, &tracker, &coverage(1, 9)));
        assert!(is_older_map(&view, &tracker, &coverage(1, 10)));
        assert!(!is_older_map(&view, &tracker, &coverage(1, 11)));
        let mut next_term = coverage(1, 3);
        next_term.term = 2;
        assert!(!is_older_map(&view, &tracker, &next_term), "a new term");
        assert!(
            !is_older_map(&view, &PeerId::new("u"), &coverage(1, 3)),
            "another tracker"
        );
        assert!(
            !is_older_map(&MeshView::default(), &tracker, &coverage(1, 3)),
            "no map yet"
        );
    }

    #[test]
    fn an_unchanged_map_goes_out_once_per_heartbeat_and_a_changed_one_at_once() {
        let start = Instant::now();
        let heartbeat = Duration::from_secs(2);
        let sent = (coverage(5, 1), start);
        assert!(coverage_due(None, &coverage(5, 1), start, heartbeat));
        // Only the sequence moved: not yet.
        let soon = start + Duration::from_millis(300);
        assert!(!coverage_due(Some(&sent), &coverage(5, 2), soon, heartbeat));
        // A new epoch (the holdings changed): at once.
        assert!(coverage_due(Some(&sent), &coverage(6, 2), soon, heartbeat));
        // Another succession list or term: at once.
        let mut listed = coverage(5, 2);
        listed.succession = vec![PeerId::new("heir")];
        assert!(coverage_due(Some(&sent), &listed, soon, heartbeat));
        let mut later_term = coverage(5, 2);
        later_term.term = 2;
        assert!(coverage_due(Some(&sent), &later_term, soon, heartbeat));
        // The heartbeat.
        assert!(coverage_due(
            Some(&sent),
            &coverage(5, 9),
            start + heartbeat,
            heartbeat
        ));
    }

    #[test]
    fn the_announced_speed_is_the_best_measured_per_layer_of_the_format() {
        let span = |start, end, quantization| SpanTarget {
            layers: meshnet_types::LayerSpan::new(start, end),
            quantization,
            entry: false,
        };
        let mut speed = SpeedRecord::default();
        assert_eq!(speed.record(&span(0, 2, Quantization::Q4_1), 100.0), 100.0);
        // A slower measurement (a busy machine) does not lower it.
        assert_eq!(speed.record(&span(0, 2, Quantization::Q4_1), 40.0), 100.0);
        // Twice the layers at the same rate per layer: half the tokens per second.
        assert_eq!(speed.record(&span(4, 8, Quantization::Q4_1), 30.0), 50.0);
        // A faster one raises it; another format keeps its own record.
        assert_eq!(speed.record(&span(0, 1, Quantization::Q4_1), 300.0), 300.0);
        assert_eq!(speed.record(&span(0, 1, Quantization::Q8_0), 80.0), 80.0);
        // A measurement that means nothing keeps the record.
        assert_eq!(speed.record(&span(0, 1, Quantization::Q8_0), 0.0), 80.0);
        assert_eq!(
            speed.record(&span(0, 1, Quantization::Q8_0), f64::NAN),
            80.0
        );
    }
}
