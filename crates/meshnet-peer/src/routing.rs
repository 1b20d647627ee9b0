//! Choosing the hops of a generation: which ready peer runs which layers after the entry.

use std::time::Duration;

use meshnet_types::{LayerSpan, PeerId};
use meshnet_wire::Endpoint;

use crate::verify::Evidence;

/// A peer that could run part of a route, as the tracker last heard from it.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteCandidate {
    /// The peer's id.
    pub peer: PeerId,
    /// Where its activation plane is reached.
    pub endpoint: Endpoint,
    /// The layers it serves.
    pub layers: LayerSpan,
    /// Sessions it is running.
    pub active_sessions: u32,
    /// KV tokens it can still take.
    pub free_kv_tokens: u64,
    /// Its smoothed milliseconds per decode step (0 when not measured yet).
    pub forward_latency_ms: f64,
}

impl RouteCandidate {
    /// How long a new session would expect to wait per step here, in relative units: the
    /// measured step time (plus 1 ms, so an unmeasured peer still counts its sessions) times
    /// the sessions sharing it, this one included. Lower is better.
    fn load_score(&self) -> f64 {
        let latency = if self.forward_latency_ms.is_finite() {
            self.forward_latency_ms.max(0.0)
        } else {
            f64::MAX / 4.0
        };
        (latency + 1.0) * (f64::from(self.active_sessions) + 1.0)
    }
}

/// One hop of a chosen route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedHop {
    /// The peer's id.
    pub peer: PeerId,
    /// Where its activation plane is reached.
    pub endpoint: Endpoint,
    /// The layers it runs for this route (within what it serves).
    pub layers: LayerSpan,
}

/// Where generations get their remote hops, and where they report a peer that failed them.
pub trait MeshRoutes: Send + Sync {
    /// The hops from layer `start` to the model's last layer, through none of `avoid`.
    fn route(&self, start: u32, avoid: &[PeerId]) -> Result<Vec<PlannedHop>, Uncovered>;

    /// Keeps `peer` off routes for a while: it failed a generation because of `cause`.
    fn ban(&self, peer: &PeerId, cause: &str);

    /// The first of `peers` that stopped announcing itself (or is no longer known): a hop
    /// whose answer may never come.
    fn first_silent(&self, peers: &[PeerId]) -> Option<PeerId>;

    /// Ready holders of every layer of `layers`, none of `avoid`, each to run exactly
    /// `layers`: candidates for checking a hop. Fewest checked sessions first.
    fn holders(&self, _layers: LayerSpan, _avoid: &[PeerId]) -> Vec<PlannedHop> {
        Vec::new()
    }

    /// The checked sessions `peer` passed since it joined or was last convicted.
    fn verified_sessions(&self, _peer: &PeerId) -> u32 {
        0
    }

    /// Counts a checked session `peer` passed.
    fn record_verified(&self, _peer: &PeerId) {}

    /// Keeps `peer`, caught returning wrong activations, off routes for `duration`, with the
    /// evidence.
    fn convict(&self, _peer: &PeerId, _evidence: Evidence, _duration: Duration) {}
}

/// Why no route exists.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no ready peer serves layer {layer}")]
pub struct Uncovered {
    /// The first layer nobody ready serves.
    pub layer: u32,
}

/// Chooses hops covering `start..end` in order. At each layer it takes, among the peers
/// serving it, the one reaching furthest (fewest hops, and the same span boundaries whichever
/// holder is taken); ties go to the lower load score (measured step latency times sessions),
/// then more free KV, then the smaller id (so equal inputs give equal routes).
pub fn choose_route(
    start: u32,
    end: u32,
    candidates: &[RouteCandidate],
) -> Result<Vec<PlannedHop>, Uncovered> {
    let mut hops = Vec::new();
    let mut layer = start;
    while layer < end {
        let best = candidates
            .iter()
            .filter(|c| c.layers.contains(layer))
            .max_by(|a, b| {
                a.layers
                    .end
                    .min(end)
                    .cmp(&b.layers.end.min(end))
                    .then(b.load_score().total_cmp(&a.load_score()))
                    .then(a.free_kv_tokens.cmp(&b.free_kv_tokens))
                    .then(b.peer.cmp(&a.peer))
            })
            .ok_or(Uncovered { layer })?;
        let stop = best.layers.end.min(end);
        hops.push(PlannedHop {
            peer: best.peer.clone(),
            endpoint: best.endpoint.clone(),
            layers: LayerSpan::new(layer, stop),
        });
        layer = stop;
    }
    Ok(hops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(peer: &str, start: u32, end: u32, sessions: u32) -> RouteCandidate {
        RouteCandidate {
            peer: PeerId::new(peer),
            endpoint: Endpoint::Http(format!("http://{peer}")),
            layers: LayerSpan::new(start, end),
            active_sessions: sessions,
            free_kv_tokens: 1000,
            forward_latency_ms: 0.0,
        }
    }

    #[test]
    fn prefers_the_faster_holder_unless_it_is_much_busier() {
        let mut fast = candidate("a", 10, 30, 0);
        fast.forward_latency_ms = 5.0;
        let mut slow = candidate("b", 10, 30, 0);
        slow.forward_latency_ms = 20.0;
        let peers = [slow.clone(), fast.clone()];
        assert_eq!(choose_route(10, 30, &peers).unwrap()[0].peer, "a");
        // Four sessions on the fast one: 6 ms x 5 = 30 > 21 ms x 1.
        fast.active_sessions = 4;
        assert_eq!(choose_route(10, 30, &[slow, fast]).unwrap()[0].peer, "b");
    }

    #[test]
    fn reach_comes_before_load() {
        let mut busy_long = candidate("a", 10, 30, 9);
        busy_long.forward_latency_ms = 50.0;
        let idle_short = candidate("b", 10, 20, 0);
        let tail = candidate("c", 20, 30, 0);
        let route = choose_route(10, 30, &[idle_short, tail, busy_long]).unwrap();
        assert_eq!(route.len(), 1);
        assert_eq!(route[0].peer, "a");
    }

    #[test]
    fn chains_spans_end_to_end() {
        let peers = [candidate("b", 20, 30, 0), candidate("a", 10, 20, 0)];
        let route = choose_route(10, 30, &peers).unwrap();
        let spans: Vec<_> = route.iter().map(|h| (h.peer.as_str(), h.layers)).collect();
        assert_eq!(
            spans,
            vec![("a", LayerSpan::new(10, 20)), ("b", LayerSpan::new(20, 30))]
        );
    }

    #[test]
    fn overlapping_spans_are_entered_mid_span() {
        let peers = [candidate("a", 10, 22, 0), candidate("b", 15, 30, 0)];
        let route = choose_route(10, 30, &peers).unwrap();
        assert_eq!(route[1].layers, LayerSpan::new(22, 30));
        assert_eq!(route.len(), 2);
    }

    #[test]
    fn prefers_the_less_loaded_of_equal_reach() {
        let peers = [candidate("a", 10, 30, 3), candidate("b", 10, 30, 1)];
        assert_eq!(choose_route(10, 30, &peers).unwrap()[0].peer, "b");
    }

    #[test]
    fn a_gap_names_its_first_layer() {
        let peers = [candidate("a", 10, 18, 0), candidate("b", 20, 30, 0)];
        assert_eq!(choose_route(10, 30, &peers), Err(Uncovered { layer: 18 }));
        assert_eq!(choose_route(10, 30, &[]), Err(Uncovered { layer: 10 }));
    }

    #[test]
    fn an_empty_range_needs_no_hop() {
        assert_eq!(choose_route(30, 30, &[]).unwrap(), vec![]);
    }
}
