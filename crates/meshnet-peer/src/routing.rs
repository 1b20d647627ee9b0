//! Choosing the hops of a generation: which ready peer runs which layers after the entry.

use meshnet_types::{LayerSpan, PeerId};

/// A peer that could run part of a route, as the tracker last heard from it.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteCandidate {
    /// The peer's id.
    pub peer: PeerId,
    /// Its activation-plane base URL.
    pub endpoint: String,
    /// The layers it serves.
    pub layers: LayerSpan,
    /// Sessions it is running.
    pub active_sessions: u32,
    /// KV tokens it can still take.
    pub free_kv_tokens: u64,
}

/// One hop of a chosen route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedHop {
    /// The peer's id.
    pub peer: PeerId,
    /// Its activation-plane base URL.
    pub endpoint: String,
    /// The layers it runs for this route (within what it serves).
    pub layers: LayerSpan,
}

/// Why no route exists.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no ready peer serves layer {layer}")]
pub struct Uncovered {
    /// The first layer nobody ready serves.
    pub layer: u32,
}

/// Chooses hops covering `start..end` in order. At each layer it takes, among the peers
/// serving it, the one reaching furthest (fewest hops); ties go to the peer with fewer active
/// sessions, then more free KV, then the smaller id (so equal inputs give equal routes).
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
                    .then(b.active_sessions.cmp(&a.active_sessions))
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
            endpoint: format!("http://{peer}"),
            layers: LayerSpan::new(start, end),
            active_sessions: sessions,
            free_kv_tokens: 1000,
        }
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
