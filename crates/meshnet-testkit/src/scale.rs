//! The many-peer scenario: a tracker and `peers` members in one process converge on complete
//! coverage of the real model; gossip is measured per peer over a quiet window; then `leave`
//! random peers stop at once (no goodbye: their connections close and their announcements stop)
//! and the rest must re-cover.

use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

use futures::future::join_all;
use meshnet_p2p::GossipTraffic;
use meshnet_peer::RunningPeer;
use meshnet_types::PeerId;
use rand::SeedableRng;
use rand::seq::SliceRandom;

use crate::{Kit, KitError, covered_by, min_holders, wait_until};

/// The announcement interval the hundred-member scenario starts members with by default: the
/// peers' own default. The tracker stretches it so that a member hears at most 20
/// announcements a second (a hundred members announce every 5 s, 101 every 5.5 s); members
/// start at their own until its first map reaches them.
pub const ANNOUNCE_INTERVAL: Duration = Duration::from_secs(2);

/// The scenario's shape.
#[derive(Clone, Debug)]
pub struct ScaleConfig {
    /// Members besides the tracker.
    pub peers: usize,
    /// Layers the tracker holds (it also holds the embedding and head).
    pub tracker_layers: u32,
    /// Layers each peer's budget holds.
    pub peer_layers: u32,
    /// Peers that stop at once after convergence.
    pub leave: usize,
    /// How long gossip is counted once the mesh has converged.
    pub traffic_window: Duration,
    /// The longest any phase may take.
    pub deadline: Duration,
    /// Seed of the choice of leavers.
    pub seed: u64,
}

impl Default for ScaleConfig {
    /// A hundred peers of one layer each after a tracker of six; ten leave; gossip counted for
    /// ten seconds; five minutes per phase.
    fn default() -> Self {
        ScaleConfig {
            peers: 100,
            tracker_layers: 6,
            peer_layers: 1,
            leave: 10,
            traffic_window: Duration::from_secs(10),
            deadline: Duration::from_secs(300),
            seed: 1,
        }
    }
}

impl ScaleConfig {
    /// The layers after the tracker's in a model of `num_layers` layers: the ones the peers
    /// share.
    pub fn shared_layers(&self, num_layers: u32) -> u32 {
        num_layers.saturating_sub(self.tracker_layers)
    }

    /// The range the holders of the thinnest shared layer (see [`ScaleConfig::shared_layers`])
    /// must fall in once `peers` of this scenario's peers cover a model of `num_layers` layers:
    /// `self.peers` when converged, `self.peers - self.leave` once recovered. A peer's budget
    /// holds exactly `peer_layers` layers (half a layer of slack, one format) and the planner
    /// never gives a peer more than the shared layers, so each peer holds one span of at most
    /// `reach = min(peer_layers, shared)` layers.
    ///
    /// At most: the shared layers have at most `peers × reach` holdings between them, so the
    /// thinnest has at most that divided by the number of shared layers, rounded down (the
    /// even spread).
    ///
    /// At least, when `reach` is every shared layer: all `peers`, so the range is that one
    /// count. The planner places every peer at its full reach (a new or moved peer gets a span
    /// of its whole reach, a kept one keeps its span), a span of every shared layer is the
    /// only one there is, and the scenario waits until the map lists every peer's span as
    /// ready ([`covered_by`]). Otherwise only one holder, the complete coverage that
    /// convergence checks. Free peers go where the fewest holders are, but the planner then
    /// moves a peer to whatever raises the weakest layer's measured throughput by more than
    /// 20 %, whatever that does to holder counts (measurements on a busy machine scatter
    /// widely), and no free peer replaces the ones that leave: a hundred peers of one layer
    /// after a tracker of six (an even spread of 4, then 3) were measured with 3 holders
    /// converged and 2 recovered.
    pub fn min_holders_bounds(&self, num_layers: u32, peers: usize) -> RangeInclusive<usize> {
        let shared = self.shared_layers(num_layers);
        if shared == 0 {
            return 0..=0;
        }
        let reach = self.peer_layers.min(shared);
        let most = peers * reach as usize / shared as usize;
        let least = if reach == shared { peers } else { 1 };
        least.min(most)..=most
    }
}

/// What the scenario measured.
#[derive(Clone, Debug)]
pub struct ScaleReport {
    /// Members, the tracker included.
    pub members: usize,
    /// From the first peer's start to complete coverage with every peer ready in the map.
    pub converge: Duration,
    /// The fewest ready holders of a non-tracker layer once converged.
    pub min_holders_converged: usize,
    /// Gossip payload bytes a peer received per second over the window (mean over peers).
    pub received_bytes_per_peer_s: f64,
    /// Gossip payload bytes a peer published per second over the window (mean over peers).
    pub published_bytes_per_peer_s: f64,
    /// Gossip payload bytes the tracker published per second over the window.
    pub tracker_published_bytes_s: f64,
    /// Messages a peer received per second over the window (mean over peers).
    pub received_messages_per_peer_s: f64,
    /// The intervals the peers announced at by the end of the window, fewest first, as
    /// their tracker advertised them (each distinct value once).
    pub peer_announce_intervals: Vec<Duration>,
    /// Peers that left.
    pub left: usize,
    /// Whether some layer had no holder left the moment they went.
    pub left_a_gap: bool,
    /// From the leave to complete coverage by the rest, the departed gone from the map.
    pub recover: Duration,
    /// The fewest ready holders of a non-tracker layer once recovered.
    pub min_holders_recovered: usize,
}

/// Runs the scenario with `kit`'s model and settings; the members are shut down at the end.
pub async fn run(kit: &Kit, config: &ScaleConfig) -> Result<ScaleReport, KitError> {
    let tracker = kit.tracker(config.tracker_layers).await?;
    let bootstrap = tracker.p2p_addrs().await?;
    let started = Instant::now();
    let mut peers = Vec::with_capacity(config.peers);
    for started_peers in join_all(
        (0..config.peers)
            .map(|_| meshnet_peer::start(kit.config(false, config.peer_layers, bootstrap.clone()))),
    )
    .await
    {
        peers.push(started_peers?);
    }
    let outcome = measure(config, &tracker, &mut peers, started).await;
    join_all(peers.into_iter().map(RunningPeer::shutdown)).await;
    tracker.shutdown().await;
    outcome
}

async fn measure(
    config: &ScaleConfig,
    tracker: &RunningPeer,
    peers: &mut Vec<RunningPeer>,
    started: Instant,
) -> Result<ScaleReport, KitError> {
    let ids: Vec<PeerId> = peers.iter().map(|p| p.peer_id().clone()).collect();
    let converged = wait_until(
        "every peer ready and complete coverage",
        tracker,
        config.deadline,
        |status| covered_by(status, &ids),
    )
    .await?;
    let converge = started.elapsed();
    let min_holders_converged = min_holders(&converged);

    let window = QuietWindow::measure(config.traffic_window, tracker, peers).await;

    // Some peers stop at once.
    let mut order: Vec<usize> = (0..peers.len()).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(config.seed));
    let mut leaving: Vec<usize> = order.into_iter().take(config.leave).collect();
    leaving.sort_unstable_by(|a, b| b.cmp(a));
    let departed: Vec<PeerId> = leaving.iter().map(|&i| ids[i].clone()).collect();
    let left_a_gap = gap_without(&converged, &departed);
    let gone: Vec<RunningPeer> = leaving.iter().map(|&i| peers.swap_remove(i)).collect();
    let left_at = Instant::now();
    join_all(gone.into_iter().map(RunningPeer::shutdown)).await;
    let remaining: Vec<PeerId> = peers.iter().map(|p| p.peer_id().clone()).collect();
    let recovered = wait_until(
        "complete coverage by the peers left",
        tracker,
        config.deadline,
        |status| covered_by(status, &remaining),
    )
    .await?;
    Ok(ScaleReport {
        members: ids.len() + 1,
        converge,
        min_holders_converged,
        received_bytes_per_peer_s: window.received_bytes_per_peer_s,
        published_bytes_per_peer_s: window.published_bytes_per_peer_s,
        tracker_published_bytes_s: window.tracker_published_bytes_s,
        received_messages_per_peer_s: window.received_messages_per_peer_s,
        peer_announce_intervals: window.peer_announce_intervals,
        left: departed.len(),
        left_a_gap,
        recover: left_at.elapsed(),
        min_holders_recovered: min_holders(&recovered),
    })
}

/// What the members did over a quiet window once converged.
struct QuietWindow {
    received_bytes_per_peer_s: f64,
    published_bytes_per_peer_s: f64,
    tracker_published_bytes_s: f64,
    received_messages_per_peer_s: f64,
    peer_announce_intervals: Vec<Duration>,
}

impl QuietWindow {
    /// Counts the gossip of `tracker` and `peers` over `length`, and the intervals the peers
    /// announce at by its end.
    async fn measure(length: Duration, tracker: &RunningPeer, peers: &[RunningPeer]) -> Self {
        let before: Vec<GossipTraffic> = peers.iter().map(|p| p.status().gossip).collect();
        let tracker_before = tracker.status().gossip;
        let window_started = Instant::now();
        tokio::time::sleep(length).await;
        let window = window_started.elapsed().as_secs_f64();
        let statuses: Vec<_> = peers.iter().map(RunningPeer::status).collect();
        let tracker_after = tracker.status().gossip;
        let per_peer = |field: fn(&GossipTraffic) -> u64| {
            let total: u64 = before
                .iter()
                .zip(&statuses)
                .map(|(b, a)| field(&a.gossip).saturating_sub(field(b)))
                .sum();
            total as f64 / (peers.len().max(1) as f64 * window)
        };
        let mut peer_announce_intervals: Vec<Duration> = statuses
            .iter()
            .map(|s| Duration::from_millis(s.announce_interval_ms))
            .collect();
        peer_announce_intervals.sort_unstable();
        peer_announce_intervals.dedup();
        QuietWindow {
            received_bytes_per_peer_s: per_peer(|t| t.received_bytes),
            published_bytes_per_peer_s: per_peer(|t| t.published_bytes),
            tracker_published_bytes_s: tracker_after
                .published_bytes
                .saturating_sub(tracker_before.published_bytes)
                as f64
                / window,
            received_messages_per_peer_s: per_peer(|t| t.received_messages),
            peer_announce_intervals,
        }
    }
}

/// Whether some layer of `status`'s map is held only by peers in `departed`.
fn gap_without(status: &meshnet_peer::status::StatusReport, departed: &[PeerId]) -> bool {
    status.coverage.as_ref().is_some_and(|coverage| {
        coverage.layers.iter().any(|layer| {
            layer
                .holders
                .iter()
                .all(|holder| departed.contains(&holder.peer))
        })
    })
}

impl ScaleReport {
    /// The report as a markdown table.
    pub fn table(&self) -> String {
        let rows = [
            ("members (tracker included)", self.members.to_string()),
            (
                "time to converge (all ready, coverage complete)",
                format!("{:.1} s", self.converge.as_secs_f64()),
            ),
            (
                "fewest holders of a layer, converged",
                self.min_holders_converged.to_string(),
            ),
            (
                "gossip received per peer",
                format!(
                    "{:.0} B/s ({:.1} messages/s)",
                    self.received_bytes_per_peer_s, self.received_messages_per_peer_s
                ),
            ),
            (
                "peers' announcement interval (as advertised)",
                self.peer_announce_intervals
                    .iter()
                    .map(|interval| format!("{:.2} s", interval.as_secs_f64()))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            (
                "gossip published per peer",
                format!("{:.0} B/s", self.published_bytes_per_peer_s),
            ),
            (
                "gossip published by the tracker",
                format!("{:.0} B/s", self.tracker_published_bytes_s),
            ),
            (
                "peers leaving at once",
                format!(
                    "{}{}",
                    self.left,
                    if self.left_a_gap {
                        " (some layer lost every holder)"
                    } else {
                        ""
                    }
                ),
            ),
            (
                "time to re-cover (complete, departed gone from the map)",
                format!("{:.1} s", self.recover.as_secs_f64()),
            ),
            (
                "fewest holders of a layer, recovered",
                self.min_holders_recovered.to_string(),
            ),
        ];
        let mut out = String::from("| measure | value |\n|---|---|\n");
        for (name, value) in rows {
            out.push_str(&format!("| {name} | {value} |\n"));
        }
        out
    }
}
