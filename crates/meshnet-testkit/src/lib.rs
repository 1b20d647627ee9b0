//! Whole meshnet meshes in one process, for tests and benchmarks.
//!
//! Every member is the real thing — [`meshnet_peer::start`], with its control loop, planner,
//! HTTP server and span slot — on the libp2p memory transport, with HTTP on port 0 and one
//! opened model shared by all of them ([`Kit`]). [`scale`] runs the many-peer scenario: a
//! hundred members converge on complete coverage, ten leave at once, the rest re-cover.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use meshnet_p2p::TransportChoice;
use meshnet_peer::mesh_model::MeshModel;
use meshnet_peer::status::StatusReport;
use meshnet_peer::{PeerConfig, PeerError, RunningPeer};
use meshnet_types::SpanState;

pub mod scale;

/// What can go wrong running a mesh in one process.
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    /// The default model is not on disk.
    #[error("the default model is missing at {0}: run `bash scripts/fetch-model.sh`")]
    ModelMissing(PathBuf),
    /// A member failed to open the model or start.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// A condition did not come true in time.
    #[error("timed out after {waited:?} waiting for {what}: {last}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        waited: Duration,
        /// Why the last check said no.
        last: String,
    },
}

/// Members of one mesh in this process share one opened model and these settings.
#[derive(Clone)]
pub struct Kit {
    /// The model every member serves.
    pub model: Arc<MeshModel>,
    /// Announcement interval; members are forgotten after three silent ones.
    pub announce_interval: Duration,
    /// KV tokens reserved per held layer.
    pub kv_tokens: u64,
}

impl Kit {
    /// A kit over the default model (`scripts/fetch-model.sh` puts it in place). Blocking: it
    /// reads and hashes the model file once.
    pub fn with_default_model(announce_interval: Duration) -> Result<Self, KitError> {
        let path = meshnet_model::default_model_path();
        if !path.is_file() {
            return Err(KitError::ModelMissing(path));
        }
        Ok(Kit {
            model: Arc::new(MeshModel::open(&path)?),
            announce_interval,
            kv_tokens: 1024,
        })
    }

    /// The `--memory` that holds exactly `layers` layers (with `tracker`, also the embedding
    /// and head), as `meshnet-peer model-info --layers` sizes it.
    pub fn memory_for(&self, layers: u32, tracker: bool) -> u64 {
        self.model
            .shape()
            .budget_for_layers(self.model.shipped_format(), self.kv_tokens, layers, tracker)
            .unwrap_or(u64::MAX)
    }

    /// The config of an in-process member holding at most `layers` layers, joining through
    /// `bootstrap`.
    pub fn config(&self, tracker: bool, layers: u32, bootstrap: Vec<Multiaddr>) -> PeerConfig {
        let mut config = PeerConfig::new(self.model.path(), std::env::temp_dir());
        config.model = Some(Arc::clone(&self.model));
        config.tracker = tracker;
        config.keypair = Some(Keypair::generate_ed25519());
        config.transport = TransportChoice::Memory;
        config.p2p_listen = vec![memory_addr()];
        config.bootstrap = bootstrap;
        config.memory_bytes = self.memory_for(layers, tracker);
        config.announce_interval = self.announce_interval;
        config.kv_tokens = self.kv_tokens;
        config.assume_reachable = true;
        config
    }

    /// Starts a tracker able to hold `layers` layers.
    pub async fn tracker(&self, layers: u32) -> Result<RunningPeer, KitError> {
        Ok(meshnet_peer::start(self.config(true, layers, Vec::new())).await?)
    }

    /// Starts a peer able to hold `layers` layers, joining through `via`.
    pub async fn peer(&self, layers: u32, via: &RunningPeer) -> Result<RunningPeer, KitError> {
        let bootstrap = via.p2p_addrs().await?;
        Ok(meshnet_peer::start(self.config(false, layers, bootstrap)).await?)
    }
}

/// A fresh memory-transport address.
pub fn memory_addr() -> Multiaddr {
    let (a, b) = uuid::Uuid::new_v4().as_u64_pair();
    let port = (a ^ b) >> 1;
    format!("/memory/{port}")
        .parse()
        .unwrap_or_else(|_| Multiaddr::empty())
}

/// Polls `member`'s status every 50 ms until `check` says yes (`Ok`), or fails with the last
/// `Err` reason after `deadline`; returns the status that passed.
pub async fn wait_until(
    what: &str,
    member: &RunningPeer,
    deadline: Duration,
    mut check: impl FnMut(&StatusReport) -> Result<(), String>,
) -> Result<StatusReport, KitError> {
    let started = Instant::now();
    loop {
        let status = member.status();
        let last = match check(&status) {
            Ok(()) => return Ok(status),
            Err(reason) => reason,
        };
        if started.elapsed() >= deadline {
            return Err(KitError::Timeout {
                what: what.to_owned(),
                waited: started.elapsed(),
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the tracker's `status` shows complete coverage by ready holders and exactly the
/// peers `expected` (by id) in its book, each with a ready span that the map lists as ready;
/// the reason when not.
pub fn covered_by(status: &StatusReport, expected: &[meshnet_types::PeerId]) -> Result<(), String> {
    let coverage = status.coverage.as_ref().ok_or("no coverage map yet")?;
    if !coverage.complete {
        let short = coverage
            .layers
            .iter()
            .filter(|layer| !layer.holders.iter().any(|h| h.state == SpanState::Ready))
            .count();
        return Err(format!("{short} layers have no ready holder"));
    }
    let peers = status.peers.as_deref().ok_or("not the tracker")?;
    let mut listed: Vec<_> = peers.iter().map(|p| p.peer.clone()).collect();
    listed.sort();
    let mut wanted = expected.to_vec();
    wanted.sort();
    if listed != wanted {
        let extra = listed.iter().filter(|p| !wanted.contains(p)).count();
        let missing = wanted.iter().filter(|p| !listed.contains(p)).count();
        return Err(format!(
            "the book lists {} peers ({extra} not expected, {missing} missing)",
            listed.len()
        ));
    }
    let unready = peers
        .iter()
        .filter(|p| p.span.as_ref().is_none_or(|s| s.state != SpanState::Ready))
        .count();
    if unready > 0 {
        return Err(format!("{unready} peers hold no ready span"));
    }
    // The map is replanned a little after the announcements that change it (a debounce, then
    // the plan), so for a moment the book can show a peer ready while the map still lists it
    // loading, or at the span it was last told to take.
    let unlisted = peers
        .iter()
        .filter(|p| {
            p.span.as_ref().is_some_and(|span| {
                (span.layers.start..span.layers.end).any(|layer| {
                    !coverage.layers.iter().any(|listed| {
                        listed.layer == layer
                            && listed
                                .holders
                                .iter()
                                .any(|h| h.peer == p.peer && h.state == SpanState::Ready)
                    })
                })
            })
        })
        .count();
    if unlisted > 0 {
        return Err(format!(
            "the map does not list the ready spans of {unlisted} peers as ready"
        ));
    }
    let stale = coverage
        .layers
        .iter()
        .flat_map(|layer| &layer.holders)
        .filter(|holder| holder.peer != status.peer && !wanted.contains(&holder.peer))
        .count();
    if stale > 0 {
        return Err(format!("the map lists {stale} holdings of departed peers"));
    }
    Ok(())
}

/// The fewest ready holders of any layer after the tracker's own span in `status`'s map.
pub fn min_holders(status: &StatusReport) -> usize {
    let own_end = status.span.as_ref().map_or(0, |span| span.layers.end);
    status
        .coverage
        .as_ref()
        .map(|coverage| {
            coverage
                .layers
                .iter()
                .filter(|layer| layer.layer >= own_end)
                .map(|layer| {
                    layer
                        .holders
                        .iter()
                        .filter(|h| h.state == SpanState::Ready)
                        .count()
                })
                .min()
                .unwrap_or(0)
        })
        .unwrap_or(0)
}
