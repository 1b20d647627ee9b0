//! Round trips to the other members' activation planes (ADR-0033): measured in the
//! background, smoothed, announced nearest first, and read by the tracker to choose, among
//! holders of the same layers, the route of least total delay.
//!
//! The probe is an empty `GET /ping` on the member's announced endpoint (direct HTTP or a
//! libp2p stream), timed on an open connection, so it crosses the same links as activations.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use meshnet_node::ForwardClient;
use meshnet_p2p::{MAX_RTT_ENTRIES, PeerRtt};
use meshnet_types::PeerId;
use meshnet_wire::Endpoint;

use crate::locking::lock;

/// The shortest time between two probe rounds of a member; a round waits at least the
/// member's announcement interval too, which the tracker lengthens in a large mesh.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// Members probed per round, taken in turn from the members known: the probes one member
/// sends and receives stay bounded however large the mesh.
pub const PROBES_PER_ROUND: usize = 4;

/// How long one probe may take before it counts as lost (and is not recorded).
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The weight of a new sample in the smoothed round trip.
const SMOOTHING: f64 = 0.3;

/// The smoothed round trip to each member probed, in milliseconds. The prober is its only
/// writer; the announcement and the tracker read it.
#[derive(Debug, Default)]
pub struct RttBook {
    smoothed: Mutex<HashMap<PeerId, f64>>,
}

impl RttBook {
    /// Records a round trip of `sample` to `peer`.
    pub fn record(&self, peer: &PeerId, sample: Duration) {
        let ms = sample.as_secs_f64() * 1000.0;
        let mut smoothed = lock(&self.smoothed);
        let entry = smoothed.entry(peer.clone()).or_insert(ms);
        *entry += SMOOTHING * (ms - *entry);
    }

    /// Forgets every member but those in `known`.
    pub fn keep_only(&self, known: &[PeerId]) {
        lock(&self.smoothed).retain(|peer, _| known.contains(peer));
    }

    /// The round trips, nearest first (ties by id), at most [`MAX_RTT_ENTRIES`].
    pub fn nearest(&self) -> Vec<PeerRtt> {
        let mut all: Vec<PeerRtt> = lock(&self.smoothed)
            .iter()
            .map(|(peer, &ms)| PeerRtt {
                peer: peer.clone(),
                ms: ms as f32,
            })
            .collect();
        all.sort_by(|a, b| a.ms.total_cmp(&b.ms).then_with(|| a.peer.cmp(&b.peer)));
        all.truncate(MAX_RTT_ENTRIES);
        all
    }
}

/// The members the round after `cursor` probes: [`PROBES_PER_ROUND`] of `known` in turn,
/// wrapping around; also the cursor for the next round.
pub fn round_targets<T: Clone>(known: &[T], cursor: usize) -> (Vec<T>, usize) {
    if known.is_empty() {
        return (Vec::new(), 0);
    }
    let count = PROBES_PER_ROUND.min(known.len());
    let start = cursor % known.len();
    let chosen = (0..count)
        .map(|offset| known[(start + offset) % known.len()].clone())
        .collect();
    (chosen, (start + count) % known.len())
}

/// Probes each of `targets` once with `client`, at the same time, recording every answered
/// probe into `book`.
pub(crate) async fn probe_round(
    client: &ForwardClient,
    targets: &[(PeerId, Endpoint)],
    book: &RttBook,
) {
    let probes = targets.iter().map(|(peer, endpoint)| async move {
        let timed = tokio::time::timeout(PROBE_TIMEOUT, client.ping(endpoint)).await;
        (peer, timed)
    });
    for (peer, timed) in futures::future::join_all(probes).await {
        match timed {
            Ok(Ok(rtt)) => book.record(peer, rtt),
            Ok(Err(error)) => tracing::debug!(%peer, %error, "a round-trip probe failed"),
            Err(_) => tracing::debug!(%peer, "a round-trip probe timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_take_the_members_in_turn_a_few_at_a_time() {
        let known: Vec<u32> = (0..10).collect();
        let (first, cursor) = round_targets(&known, 0);
        assert_eq!(first, [0, 1, 2, 3]);
        let (second, cursor) = round_targets(&known, cursor);
        assert_eq!(second, [4, 5, 6, 7]);
        let (third, cursor) = round_targets(&known, cursor);
        assert_eq!((third, cursor), (vec![8, 9, 0, 1], 2));
        assert_eq!(round_targets(&known[..2], 7), (vec![1, 0], 1));
        assert_eq!(round_targets::<u32>(&[], 3), (vec![], 0));
    }

    #[test]
    fn round_trips_are_smoothed_sorted_nearest_first_and_forgotten() {
        let book = RttBook::default();
        let (near, far, gone) = (PeerId::new("near"), PeerId::new("far"), PeerId::new("gone"));
        book.record(&far, Duration::from_millis(300));
        book.record(&near, Duration::from_millis(20));
        book.record(&near, Duration::from_millis(30));
        book.record(&gone, Duration::from_millis(5));
        let nearest = book.nearest();
        let listed: Vec<(&str, f32)> = nearest.iter().map(|r| (r.peer.as_str(), r.ms)).collect();
        assert_eq!(listed, [("gone", 5.0), ("near", 23.0), ("far", 300.0)]);
        book.keep_only(&[near.clone(), far.clone()]);
        assert_eq!(book.nearest().len(), 2);
        for index in 0..2 * MAX_RTT_ENTRIES {
            book.record(
                &PeerId::new(format!("p{index:03}")),
                Duration::from_millis(1),
            );
        }
        assert_eq!(book.nearest().len(), MAX_RTT_ENTRIES);
    }
}
