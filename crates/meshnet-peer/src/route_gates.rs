//! What the draft gates of earlier generations timed, per route (ADR-0037).
//!
//! A draft gate ([`DraftGate`]) learns what a pass through its route costs with and without
//! drafted rows. A gate that starts from nothing sends drafts to time those costs, and on a
//! fast route such drafts cost more than they save. The engine keeps, for each route it has
//! generated over, the gate the last generation on it left, and starts the next generation on
//! that route from it: the same timings, and the acceptance seen so far as a weak prior
//! ([`DraftGate::for_next_generation`]), since that belongs more to a text than to a route.

use std::collections::HashMap;
use std::sync::Mutex;

use meshnet_model::DraftGate;
use meshnet_types::{LayerSpan, PeerId};

use crate::locking::lock;
use crate::routing::PlannedHop;

/// The most routes whose timings are kept; past it, the route used least recently is dropped.
pub const MAX_REMEMBERED_ROUTES: usize = 64;

/// A route as the gate sees it: the entry's layers and each remote hop with its layers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouteKey {
    entry: LayerSpan,
    hops: Vec<(PeerId, LayerSpan)>,
}

impl RouteKey {
    /// The route that runs `entry` locally and then `hops`.
    pub fn new(entry: LayerSpan, hops: &[PlannedHop]) -> Self {
        RouteKey {
            entry,
            hops: hops
                .iter()
                .map(|hop| (hop.peer.clone(), hop.layers))
                .collect(),
        }
    }
}

/// The timings of the routes generations went over, written when a generation ends.
#[derive(Debug, Default)]
pub struct RouteGates {
    routes: Mutex<Remembered>,
}

/// The gates kept, each with the time it was last used (a counter).
#[derive(Debug, Default)]
struct Remembered {
    gates: HashMap<RouteKey, (DraftGate, u64)>,
    clock: u64,
}

impl RouteGates {
    /// A store that remembers no route yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gate a generation over `route` starts from: the timings an earlier one left, or a
    /// new gate.
    pub fn start(&self, route: &RouteKey) -> DraftGate {
        let mut routes = lock(&self.routes);
        routes.clock += 1;
        let now = routes.clock;
        match routes.gates.get_mut(route) {
            Some((gate, used)) => {
                *used = now;
                gate.clone()
            }
            None => DraftGate::new(),
        }
    }

    /// Keeps the timings of `gate`, as a generation over `route` left it, for the next one.
    pub fn keep(&self, route: &RouteKey, gate: &DraftGate) {
        let mut routes = lock(&self.routes);
        routes.clock += 1;
        let now = routes.clock;
        if !routes.gates.contains_key(route) && routes.gates.len() >= MAX_REMEMBERED_ROUTES {
            let oldest = routes
                .gates
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                routes.gates.remove(&oldest);
            }
        }
        routes
            .gates
            .insert(route.clone(), (gate.for_next_generation(), now));
    }

    /// How many routes are remembered.
    pub fn len(&self) -> usize {
        lock(&self.routes).gates.len()
    }

    /// Whether no route is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(peer: &str, layers: (u32, u32)) -> RouteKey {
        let hop = PlannedHop {
            peer: PeerId::new(peer),
            endpoint: "http://127.0.0.1:9".parse().unwrap(),
            layers: LayerSpan::new(layers.0, layers.1),
        };
        RouteKey::new(LayerSpan::new(0, 10), &[hop])
    }

    /// A gate that timed a one-row pass at `single` seconds and learnt some acceptance.
    fn timed(single: f64) -> DraftGate {
        let mut gate = DraftGate::new();
        gate.record_pass(0, single);
        gate.record_pass(2, single + 0.004);
        gate.record_checks(4, 4);
        gate
    }

    #[test]
    fn a_route_starts_from_the_timings_its_last_generation_left() {
        let gates = RouteGates::new();
        let near = route("near", (10, 30));
        assert_eq!(gates.start(&near), DraftGate::new());
        let left = timed(0.010);
        gates.keep(&near, &left);
        let started = gates.start(&near);
        assert_eq!(started, left.for_next_generation());
        assert_eq!(started.acceptance(), left.acceptance());
        // Another peer, or the same peer with other layers, is another route.
        assert_eq!(gates.start(&route("far", (10, 30))), DraftGate::new());
        assert_eq!(gates.start(&route("near", (10, 20))), DraftGate::new());
        // The latest generation's timings replace the earlier ones.
        gates.keep(&near, &timed(0.020));
        assert_eq!(gates.start(&near), timed(0.020).for_next_generation());
        assert_eq!(gates.len(), 1);
    }

    #[test]
    fn past_the_limit_the_route_used_least_recently_is_forgotten() {
        let gates = RouteGates::new();
        let routes: Vec<RouteKey> = (0..=MAX_REMEMBERED_ROUTES)
            .map(|k| route(&format!("peer-{k}"), (10, 30)))
            .collect();
        for key in &routes[..MAX_REMEMBERED_ROUTES] {
            gates.keep(key, &timed(0.010));
        }
        // The first route is used again, so the second is now the one used least recently.
        assert_ne!(gates.start(&routes[0]), DraftGate::new());
        gates.keep(&routes[MAX_REMEMBERED_ROUTES], &timed(0.010));
        assert_eq!(gates.len(), MAX_REMEMBERED_ROUTES);
        assert_eq!(gates.start(&routes[1]), DraftGate::new());
        assert_ne!(gates.start(&routes[0]), DraftGate::new());
        assert_ne!(
            gates.start(&routes[MAX_REMEMBERED_ROUTES]),
            DraftGate::new()
        );
    }
}
