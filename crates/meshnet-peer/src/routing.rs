//! Choosing the hops of a generation: which ready peer runs which layers after the entry.

use std::collections::HashMap;
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

/// The one-way delay of each link between two members, in milliseconds: half the round trip
/// either end measured (their mean when both did). A link nobody measured counts as the mean
/// of the measured ones (0 when none is).
#[derive(Clone, Debug, Default)]
pub struct LinkDelays {
    /// Round trips by the pair's ids in order, with how many measurements were averaged.
    round_trips: HashMap<(PeerId, PeerId), (f64, u32)>,
}

impl LinkDelays {
    /// Records a round trip of `rtt_ms` between `a` and `b`, measured by one of them.
    pub fn insert(&mut self, a: &PeerId, b: &PeerId, rtt_ms: f64) {
        if a == b || !rtt_ms.is_finite() || rtt_ms < 0.0 {
            return;
        }
        let key = if a < b {
            (a.clone(), b.clone())
        } else {
            (b.clone(), a.clone())
        };
        let (mean, count) = self.round_trips.entry(key).or_insert((0.0, 0));
        *count += 1;
        *mean += (rtt_ms - *mean) / f64::from(*count);
    }

    /// Whether no link was measured.
    pub fn is_empty(&self) -> bool {
        self.round_trips.is_empty()
    }

    /// The one-way delay from `a` to `b` in milliseconds (0 from a member to itself).
    pub fn one_way(&self, a: &PeerId, b: &PeerId) -> f64 {
        if a == b {
            return 0.0;
        }
        let key = if a < b {
            (a.clone(), b.clone())
        } else {
            (b.clone(), a.clone())
        };
        match self.round_trips.get(&key) {
            Some(&(rtt, _)) => rtt / 2.0,
            None => self.unmeasured(),
        }
    }

    /// What an unmeasured link counts as: the mean one-way delay of the measured ones.
    fn unmeasured(&self) -> f64 {
        if self.round_trips.is_empty() {
            return 0.0;
        }
        let total: f64 = self.round_trips.values().map(|&(rtt, _)| rtt / 2.0).sum();
        total / self.round_trips.len() as f64
    }
}

/// Chooses hops covering `start..end` in order, as [`choose_route_by_delay`] does with no
/// link measured.
pub fn choose_route(
    start: u32,
    end: u32,
    candidates: &[RouteCandidate],
) -> Result<Vec<PlannedHop>, Uncovered> {
    choose_route_by_delay(
        start,
        end,
        candidates,
        &LinkDelays::default(),
        &PeerId::new(""),
    )
}

/// Chooses hops covering `start..end` in order for a route that starts and ends at `entry`.
///
/// The span boundaries come first: at each layer the route takes a holder reaching furthest
/// (fewest hops, and the same boundaries whichever holder is taken). Among the holders of
/// each of those spans it then picks the chain of least total cost: every link's one-way delay
/// (`entry` to the first hop, hop to hop, the last hop back to `entry`) plus each hop's load
/// score (measured step latency times sessions). Equal costs go to the lower load score, then
/// more free KV, then the smaller id (so equal inputs give equal routes); with no link measured
/// each span simply gets its least loaded holder.
pub fn choose_route_by_delay(
    start: u32,
    end: u32,
    candidates: &[RouteCandidate],
    delays: &LinkDelays,
    entry: &PeerId,
) -> Result<Vec<PlannedHop>, Uncovered> {
    let spans = holders_by_span(start, end, candidates)?;
    let Some((_, first_holders)) = spans.first() else {
        return Ok(Vec::new());
    };
    // For each span, the cheapest chain ending at each holder: (cost, holder before it).
    let mut chains: Vec<Vec<(f64, usize)>> = vec![
        first_holders
            .iter()
            .map(|c| (delays.one_way(entry, &c.peer) + c.load_score(), 0))
            .collect(),
    ];
    for (_, holders) in &spans[1..] {
        let before = &spans[chains.len() - 1].1;
        let costs = &chains[chains.len() - 1];
        let next = holders
            .iter()
            .map(|c| {
                let (cost, from) = cheapest(
                    costs
                        .iter()
                        .zip(before.iter())
                        .map(|(&(cost, _), b)| cost + delays.one_way(&b.peer, &c.peer)),
                );
                (cost + c.load_score(), from)
            })
            .collect();
        chains.push(next);
    }
    let last = &spans[spans.len() - 1].1;
    let (_, mut pick) = cheapest(
        chains[chains.len() - 1]
            .iter()
            .zip(last.iter())
            .map(|(&(cost, _), c)| cost + delays.one_way(&c.peer, entry)),
    );
    let mut hops = Vec::with_capacity(spans.len());
    for (index, (layers, holders)) in spans.iter().enumerate().rev() {
        let chosen = holders[pick];
        hops.push(PlannedHop {
            peer: chosen.peer.clone(),
            endpoint: chosen.endpoint.clone(),
            layers: *layers,
        });
        pick = chains[index][pick].1;
    }
    hops.reverse();
    Ok(hops)
}

/// The index and value of the least of `costs` (the first on ties).
fn cheapest(costs: impl Iterator<Item = f64>) -> (f64, usize) {
    costs
        .enumerate()
        .fold((f64::INFINITY, 0), |(best, at), (index, cost)| {
            if cost < best {
                (cost, index)
            } else {
                (best, at)
            }
        })
}

/// The spans a route over `candidates` from `start` to `end` takes, each with its holders
/// reaching exactly its end, most preferred first (lower load score, more free KV, smaller
/// id).
fn holders_by_span(
    start: u32,
    end: u32,
    candidates: &[RouteCandidate],
) -> Result<Vec<(LayerSpan, Vec<&RouteCandidate>)>, Uncovered> {
    let mut spans = Vec::new();
    let mut layer = start;
    while layer < end {
        let serving = || candidates.iter().filter(|c| c.layers.contains(layer));
        let stop = serving()
            .map(|c| c.layers.end.min(end))
            .max()
            .ok_or(Uncovered { layer })?;
        let mut holders: Vec<&RouteCandidate> = serving()
            .filter(|c| c.layers.end.min(end) == stop)
            .collect();
        holders.sort_by(|a, b| {
            a.load_score()
                .total_cmp(&b.load_score())
                .then(b.free_kv_tokens.cmp(&a.free_kv_tokens))
                .then(a.peer.cmp(&b.peer))
        });
        spans.push((LayerSpan::new(layer, stop), holders));
        layer = stop;
    }
    Ok(spans)
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

    /// Round trips in ms between the named members.
    fn delays(links: &[(&str, &str, f64)]) -> LinkDelays {
        let mut delays = LinkDelays::default();
        for &(a, b, rtt) in links {
            delays.insert(&PeerId::new(a), &PeerId::new(b), rtt);
        }
        delays
    }

    fn peers_of(route: &[PlannedHop]) -> Vec<&str> {
        route.iter().map(|hop| hop.peer.as_str()).collect()
    }

    #[test]
    fn of_two_holders_the_route_takes_the_near_one_and_the_far_one_without_it() {
        let (near, far) = (candidate("near", 10, 30, 0), candidate("far", 10, 30, 0));
        let delays = delays(&[("entry", "near", 20.0), ("entry", "far", 300.0)]);
        let entry = PeerId::new("entry");
        let both = [far.clone(), near.clone()];
        let route = choose_route_by_delay(10, 30, &both, &delays, &entry).unwrap();
        assert_eq!(peers_of(&route), ["near"]);
        let route = choose_route_by_delay(10, 30, &[far], &delays, &entry).unwrap();
        assert_eq!(peers_of(&route), ["far"]);
        // Unmeasured, "far" wins on its id's order, as before.
        let route = choose_route(10, 30, &both).unwrap();
        assert_eq!(peers_of(&route), ["far"]);
    }

    #[test]
    fn a_member_far_from_everyone_stays_out_of_the_middle_of_a_route() {
        let peers = [
            candidate("a", 10, 20, 0),
            candidate("aa", 20, 30, 0),
            candidate("b", 20, 30, 0),
            candidate("c", 30, 40, 0),
        ];
        // "aa" is far from everyone (it sorts first, so it wins when nothing is measured).
        let delays = delays(&[
            ("entry", "a", 10.0),
            ("a", "aa", 400.0),
            ("aa", "c", 400.0),
            ("a", "b", 10.0),
            ("b", "c", 10.0),
            ("c", "entry", 10.0),
        ]);
        let entry = PeerId::new("entry");
        let route = choose_route_by_delay(10, 40, &peers, &delays, &entry).unwrap();
        assert_eq!(peers_of(&route), ["a", "b", "c"]);
        assert_eq!(
            peers_of(&choose_route(10, 40, &peers).unwrap()),
            ["a", "aa", "c"]
        );
    }

    #[test]
    fn the_first_hop_is_chosen_for_the_whole_route_not_for_its_own_link() {
        let peers = [
            candidate("x", 10, 20, 0),
            candidate("y", 10, 20, 0),
            candidate("z", 20, 30, 0),
        ];
        // x is nearer the entry, but y is much nearer the only holder of the rest.
        let delays = delays(&[
            ("entry", "x", 10.0),
            ("x", "z", 200.0),
            ("entry", "y", 50.0),
            ("y", "z", 10.0),
            ("z", "entry", 20.0),
        ]);
        let entry = PeerId::new("entry");
        let route = choose_route_by_delay(10, 30, &peers, &delays, &entry).unwrap();
        assert_eq!(peers_of(&route), ["y", "z"]);
        assert_eq!(route[1].layers, LayerSpan::new(20, 30));
    }

    #[test]
    fn a_link_is_half_its_round_trip_and_an_unmeasured_one_the_mean() {
        let mut delays = delays(&[("a", "b", 100.0), ("c", "d", 20.0)]);
        let (a, b, c, e) = (
            PeerId::new("a"),
            PeerId::new("b"),
            PeerId::new("c"),
            PeerId::new("e"),
        );
        assert_eq!(delays.one_way(&a, &b), 50.0);
        assert_eq!(delays.one_way(&b, &a), 50.0);
        assert_eq!(delays.one_way(&a, &a), 0.0);
        assert_eq!(delays.one_way(&c, &e), 30.0);
        // Both ends measured: their mean.
        delays.insert(&b, &a, 60.0);
        assert_eq!(delays.one_way(&a, &b), 40.0);
        delays.insert(&a, &b, f64::NAN);
        assert_eq!(delays.one_way(&a, &b), 40.0);
        assert!(LinkDelays::default().is_empty());
        assert_eq!(LinkDelays::default().one_way(&a, &b), 0.0);
    }

    #[test]
    fn an_empty_range_needs_no_hop() {
        assert_eq!(choose_route(30, 30, &[]).unwrap(), vec![]);
    }
}
