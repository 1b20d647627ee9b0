//! The control loop: announces this member, applies the tracker's directives (loading off the
//! async workers), reaps idle sessions and drained spans on its timer, and on the tracker
//! also gathers announcements, plans and publishes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meshnet_p2p::{DirectiveMessage, P2pEvent, P2pHandle, TrackerRecord};
use meshnet_types::PeerId;
use tokio::sync::{mpsc, watch};

use crate::error::PeerError;
use crate::member::{Member, Role, lock};
use crate::shard::ShardTarget;
use crate::status::RejectionReport;
use crate::tracker::TrackerBook;

/// How long the tracker waits after a change before planning, to batch announcements.
const REPLAN_DEBOUNCE: Duration = Duration::from_millis(150);

/// The longest pause between two reaps of idle sessions and drained spans.
const REAP_INTERVAL: Duration = Duration::from_secs(1);

/// One span load at a time; the latest request waits its turn.
#[derive(Default)]
struct Loader {
    busy: bool,
    queued: Option<Option<ShardTarget>>,
}

/// What a finished load reports back to the control loop.
struct LoadDone {
    target: ShardTarget,
    outcome: Result<f64, PeerError>,
}

/// The tracker's part of the control loop.
struct Planning {
    book: Arc<Mutex<TrackerBook>>,
    /// When to plan next, if a plan is due.
    replan_at: Option<tokio::time::Instant>,
    /// The epoch of the tracker record last stored in the DHT.
    record_epoch: Option<u64>,
    /// Whether the mesh covered the model at the last plan.
    covered: bool,
}

impl Planning {
    /// Plans at `at` unless a plan is already scheduled.
    fn plan_by(&mut self, at: tokio::time::Instant) {
        self.replan_at.get_or_insert(at);
    }
}

/// The control loop of one member.
pub(crate) struct ControlLoop {
    /// Set when the member cannot go on.
    failed: watch::Sender<Option<String>>,
    member: Arc<Member>,
    p2p: P2pHandle,
    announce_interval: Duration,
    loader: Loader,
    /// The tracker and sequence of the last directive applied.
    last_directive: Option<(PeerId, u64)>,
    /// Present on the tracker only.
    planning: Option<Planning>,
}

impl ControlLoop {
    /// A loop for `member`, reporting a fatal condition on `failed`.
    pub(crate) fn new(
        member: Arc<Member>,
        p2p: P2pHandle,
        announce_interval: Duration,
        failed: watch::Sender<Option<String>>,
    ) -> Self {
        let planning = match &member.role {
            Role::Tracker(parts) => Some(Planning {
                book: Arc::clone(&parts.book),
                replan_at: Some(tokio::time::Instant::now()),
                record_epoch: None,
                covered: false,
            }),
            Role::Peer => None,
        };
        ControlLoop {
            failed,
            member,
            p2p,
            announce_interval,
            loader: Loader::default(),
            last_directive: None,
            planning,
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
                _ = announce.tick() => {
                    self.announce().await;
                    if let Some(planning) = &mut self.planning {
                        lock(&planning.book).expire(Instant::now());
                        planning.plan_by(tokio::time::Instant::now());
                    }
                }
                _ = reap.tick() => self.member.host.reap(Instant::now()),
                _ = replan => {
                    if let Some(planning) = &mut self.planning {
                        planning.replan_at = None;
                    }
                    self.plan_round(&load_tx).await;
                }
            }
        }
        tracing::debug!(peer = %self.member.peer_id, "control loop stopped");
    }

    /// Handles one control-plane event.
    fn handle_event(&mut self, event: P2pEvent, load_tx: &mpsc::Sender<LoadDone>) {
        match event {
            P2pEvent::Announcement { announcement, .. } => {
                if let Some(planning) = &mut self.planning
                    && lock(&planning.book).observe(announcement, Instant::now())
                {
                    planning.plan_by(tokio::time::Instant::now() + REPLAN_DEBOUNCE);
                }
            }
            P2pEvent::Coverage { coverage, .. } => {
                if self.planning.is_none() {
                    *lock(&self.member.coverage) = Some(coverage);
                }
            }
            P2pEvent::Directive { from, directive } => {
                self.apply_directive(from, directive, load_tx)
            }
            P2pEvent::TrackerDiscovered(record) => {
                tracing::info!(tracker = %record.peer, http = %record.http_endpoint, "tracker found");
                *lock(&self.member.tracker) = Some(record.peer);
            }
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
            P2pEvent::ListeningOn(address) => {
                let address = address.to_string();
                let mut addrs = lock(&self.member.p2p_addrs);
                if !addrs.contains(&address) {
                    addrs.push(address);
                }
            }
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
        let target = directive.span_after.map(|span| ShardTarget {
            layers: span.layers,
            quantization: span.quantization,
            entry: false,
        });
        self.request_span(target, load_tx);
    }

    /// Moves this member towards holding `target` (nothing when `None`).
    fn request_span(&mut self, target: Option<ShardTarget>, load_tx: &mpsc::Sender<LoadDone>) {
        if self.loader.busy {
            self.loader.queued = Some(target);
            return;
        }
        let host = Arc::clone(&self.member.host);
        let Some(target) = target else {
            host.unload();
            return;
        };
        if host.current().is_some_and(|shard| shard.target == target) {
            return;
        }
        self.loader.busy = true;
        let hidden = self.member.model.description().hidden;
        let load_tx = load_tx.clone();
        tokio::spawn(async move {
            let outcome = tokio::task::spawn_blocking(move || {
                let shard = host.load(target)?;
                Ok(shard.measure_throughput(hidden))
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
            Ok(throughput) => *lock(&self.member.throughput) = throughput,
            Err(error) => {
                tracing::error!(layers = %done.target.layers, %error, "loading a span failed");
            }
        }
        if let Some(planning) = &self.planning {
            lock(&planning.book).set_own_span(self.member.host.span_status());
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
        let Some(book) = self.planning.as_ref().map(|p| Arc::clone(&p.book)) else {
            return;
        };
        let outcome = {
            let mut book = lock(&book);
            book.set_own_span(self.member.host.span_status());
            book.plan(Instant::now())
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::error!(%error, "planning failed");
                return;
            }
        };
        if let Some(target) = outcome.own_target {
            let entry = ShardTarget {
                layers: target.layers,
                quantization: target.quantization,
                entry: true,
            };
            self.request_span(Some(entry), load_tx);
        }
        let epoch = outcome.coverage.epoch;
        *lock(&self.member.coverage) = Some(outcome.coverage.clone());
        if let Err(error) = self.p2p.publish_coverage(outcome.coverage).await {
            tracing::warn!(%error, "publishing the coverage map failed");
        }
        for directive in outcome.directives {
            tracing::info!(
                target = %directive.target,
                epoch = directive.epoch,
                sequence = directive.sequence,
                span_after = ?directive.span_after.as_ref().map(|s| s.layers.to_string()),
                "directive published"
            );
            if let Err(error) = self.p2p.publish_directive(directive).await {
                tracing::warn!(%error, "publishing a directive failed");
            }
        }
        self.store_record(epoch).await;
        let covered = self.member.route_boundaries().is_some();
        let Some(planning) = &mut self.planning else {
            return;
        };
        if covered && !planning.covered {
            tracing::info!(
                "the mesh covers the model; OpenAI base URL: {}/v1",
                self.member.http_url
            );
        } else if !covered && planning.covered {
            tracing::warn!("the mesh no longer covers the model");
        }
        planning.covered = covered;
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
        let record = TrackerRecord {
            peer: member.peer_id.clone(),
            addresses: lock(&member.p2p_addrs).clone(),
            http_endpoint: member.http_url.clone(),
            epoch,
            model_id: member.model.id().to_owned(),
        };
        if let Err(error) = self.p2p.set_tracker_record(record).await {
            tracing::warn!(%error, "storing the tracker record failed");
        }
    }
}
