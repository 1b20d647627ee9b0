//! Property tests: the planner against an exhaustive search on small meshes,
//! plus structural invariants (budgets, contiguity, directive consistency,
//! stability, determinism) on random meshes of every size.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use meshnet_planner::{
    CoverageMap, Directive, ModelShape, PeerCapacity, Plan, PlanError, Planner, PlannerConfig,
    SpanHolding,
};

use meshnet_types::{LayerSpan, PeerId, Quantization, SpanState};
use proptest::prelude::*;

const FORMATS: [Quantization; 3] = [Quantization::Nf4, Quantization::Int8, Quantization::Bf16];

#[derive(Debug, Clone)]
struct Mesh {
    model: ModelShape,
    /// Planner hysteresis drawn for this mesh.
    hysteresis: f64,
    peers: Vec<PeerCapacity>,
    map: CoverageMap,
    rotation: usize,
}

fn model_strategy(max_layers: u32) -> impl Strategy<Value = ModelShape> {
    (1..=max_layers, 20u64..200, 0u64..400, 0u64..4).prop_map(
        |(num_layers, nf4, extras, kv_bytes)| ModelShape {
            name: "random".into(),
            num_layers,
            layer_bytes: BTreeMap::from([
                (Quantization::Nf4, nf4),
                (Quantization::Int8, nf4 * 2 - 7),
                (Quantization::Bf16, nf4 * 4),
            ]),
            embedding_bytes: extras / 3,
            head_bytes: extras - extras / 3,
            kv_bytes_per_token_per_layer: kv_bytes,
        },
    )
}

fn peer_strategy() -> impl Strategy<Value = (u64, Vec<bool>, f64, u64)> {
    (
        0u64..1500,
        prop::collection::vec(any::<bool>(), 3),
        // Whole numbers (ties) and arbitrary fractions alike.
        prop_oneof![(0u32..100).prop_map(f64::from), 0.0f64..100.0],
        0u64..40,
    )
}

/// A random holding: whose (live or departed), where, in which format and state.
type HoldingSeed = (prop::sample::Index, u32, u32, usize, bool);

fn holding_strategy(max_layers: u32) -> impl Strategy<Value = HoldingSeed> {
    (
        any::<prop::sample::Index>(),
        0..max_layers,
        1..=max_layers,
        0usize..3,
        any::<bool>(),
    )
}

fn mesh_strategy(max_layers: u32, max_volunteers: usize) -> impl Strategy<Value = Mesh> {
    (
        model_strategy(max_layers),
        0.05f64..1.0,
        peer_strategy(),
        prop::collection::vec(peer_strategy(), 0..=max_volunteers),
        prop::collection::vec(holding_strategy(max_layers), 0..=2 * (max_volunteers + 3)),
        any::<usize>(),
    )
        .prop_map(
            move |(model, hysteresis, tracker, volunteers, holdings, rotation)| {
                let build = |id: String,
                             (memory, formats, throughput, kv): (u64, Vec<bool>, f64, u64),
                             is_tracker| {
                    let mut quantizations: Vec<Quantization> = FORMATS
                        .iter()
                        .zip(&formats)
                        .filter(|(_, on)| **on)
                        .map(|(q, _)| *q)
                        .collect();
                    if is_tracker && quantizations.is_empty() {
                        quantizations.push(Quantization::Nf4);
                    }
                    PeerCapacity {
                        peer: PeerId::new(id),
                        memory_bytes: memory
                            + if is_tracker {
                                model.tracker_extra_bytes()
                            } else {
                                0
                            },
                        quantizations,
                        throughput,
                        kv_tokens: kv,
                        is_tracker,
                    }
                };
                let mut peers = vec![build("tracker".into(), tracker, true)];
                for (i, v) in volunteers.into_iter().enumerate() {
                    peers.push(build(format!("v{i}"), v, false));
                }
                // Holdings for live peers and for two departed ones.
                let mut names: Vec<String> = peers.iter().map(|p| p.peer.to_string()).collect();
                names.push("departed-1".into());
                names.push("departed-2".into());
                let mut map = CoverageMap::empty(5);
                for (whose, start, len, format, ready) in holdings {
                    map.holdings.push(SpanHolding {
                        peer: PeerId::new(whose.get(&names).clone()),
                        layers: LayerSpan::new(start, start + len),
                        quantization: FORMATS[format],
                        state: if ready {
                            SpanState::Ready
                        } else {
                            SpanState::Loading
                        },
                    });
                }
                Mesh {
                    model,
                    hysteresis,
                    peers,
                    map,
                    rotation,
                }
            },
        )
}

/// Memory a peer needs for `layers` layers in `q`, computed from first principles.
fn needed(model: &ModelShape, peer: &PeerCapacity, q: Quantization, layers: u32) -> Option<u64> {
    let per_layer =
        model.layer_bytes.get(&q)? + peer.kv_tokens * model.kv_bytes_per_token_per_layer;
    let extras = if peer.is_tracker {
        model.embedding_bytes + model.head_bytes
    } else {
        0
    };
    Some(per_layer * u64::from(layers) + extras)
}

fn fits(model: &ModelShape, peer: &PeerCapacity, layers: u32) -> bool {
    peer.quantizations
        .iter()
        .any(|&q| needed(model, peer, q, layers).is_some_and(|bytes| bytes <= peer.memory_bytes))
}

/// Exhaustive search: can the peers cover every layer with one contiguous span
/// each, the tracker's starting at layer 0? Explores every assignment through
/// the set of reachable coverage masks.
fn cover_exists(model: &ModelShape, peers: &[PeerCapacity], fixed_tracker: Option<u32>) -> bool {
    let layers = model.num_layers;
    let full: u32 = (1u32 << layers) - 1;
    let span_mask = |start: u32, end: u32| ((1u32 << end) - 1) & !((1u32 << start) - 1);
    let tracker = peers.iter().find(|p| p.is_tracker).expect("a tracker");
    let mut reachable: HashSet<u32> = HashSet::new();
    for k in 0..=layers {
        let allowed = match fixed_tracker {
            Some(fixed) => k == fixed,
            None => true,
        };
        if allowed && (k == 0 || fits(model, tracker, k)) {
            reachable.insert(span_mask(0, k));
        }
    }
    for peer in peers.iter().filter(|p| !p.is_tracker) {
        let mut next = reachable.clone();
        for start in 0..layers {
            for end in start + 1..=layers {
                if fits(model, peer, end - start) {
                    for &mask in &reachable {
                        next.insert(mask | span_mask(start, end));
                    }
                }
            }
        }
        reachable = next;
    }
    reachable.contains(&full)
}

/// Every (layer, format) each live peer holds according to the map, layers
/// past the model's end included: a plan must drop those too.
fn layer_sets(
    map: &CoverageMap,
    live: &BTreeSet<PeerId>,
) -> BTreeMap<PeerId, BTreeSet<(u32, Quantization)>> {
    let mut sets: BTreeMap<PeerId, BTreeSet<(u32, Quantization)>> = BTreeMap::new();
    for holding in &map.holdings {
        if live.contains(&holding.peer) {
            sets.entry(holding.peer.clone()).or_default().extend(
                (holding.layers.start..holding.layers.end)
                    .map(|layer| (layer, holding.quantization)),
            );
        }
    }
    sets.retain(|_, set| !set.is_empty());
    sets
}

/// Invariants every plan must satisfy, whatever the mesh.
fn check_plan_invariants(mesh: &Mesh, planner: &Planner, plan: &Plan) -> Result<(), TestCaseError> {
    let model = &mesh.model;
    let live: BTreeSet<PeerId> = mesh.peers.iter().map(|p| p.peer.clone()).collect();
    let by_id: BTreeMap<&PeerId, &PeerCapacity> = mesh.peers.iter().map(|p| (&p.peer, p)).collect();

    // Every holder is live, runs a format it supports, and stays within budget;
    // each peer holds one contiguous span in one format.
    let mut spans: BTreeMap<&PeerId, (LayerSpan, Quantization)> = BTreeMap::new();
    for holding in &plan.map.holdings {
        let peer = by_id.get(&holding.peer);
        prop_assert!(peer.is_some(), "holder {} is not live", holding.peer);
        prop_assert!(!holding.layers.is_empty() && holding.layers.end <= model.num_layers);
        match spans.get_mut(&holding.peer) {
            None => {
                spans.insert(&holding.peer, (holding.layers, holding.quantization));
            }
            Some((span, q)) => {
                prop_assert_eq!(*q, holding.quantization);
                prop_assert_eq!(span.end, holding.layers.start, "pieces must be adjacent");
                span.end = holding.layers.end;
            }
        }
    }
    for (peer_id, (span, q)) in &spans {
        let peer = by_id[peer_id];
        prop_assert!(peer.quantizations.contains(q));
        let bytes = needed(model, peer, *q, span.len());
        prop_assert!(
            bytes.is_some_and(|b| b <= peer.memory_bytes),
            "{peer_id} over budget"
        );
        if peer.is_tracker {
            prop_assert_eq!(span.start, 0);
            prop_assert_eq!(span.len(), plan.tracker_layers);
        } else {
            prop_assert!(span.start >= plan.tracker_layers);
            // Nobody could have used a better format for the same length...
            // unless the peer kept its existing span and format.
            let kept = mesh
                .map
                .holdings
                .iter()
                .any(|h| &h.peer == *peer_id && h.quantization == *q);
            if !kept {
                for better in FORMATS.iter().filter(|b| *b > q) {
                    let fits_better = peer.quantizations.contains(better)
                        && needed(model, peer, *better, span.len())
                            .is_some_and(|b| b <= peer.memory_bytes);
                    prop_assert!(!fits_better, "{peer_id} could run {better}");
                }
            }
        }
    }

    // The report matches the map.
    let counts = plan.map.holder_counts(model.num_layers);
    prop_assert_eq!(&counts, &plan.report.holders_per_layer);
    prop_assert_eq!(plan.report.is_complete(), !counts.contains(&0));
    prop_assert_eq!(
        plan.report.missing_memory_bytes == 0,
        plan.report.is_complete()
    );
    // Missing memory is the volunteers' reach shortfall at the cheapest cost.
    if !plan.report.is_complete() {
        let volunteers: Vec<&PeerCapacity> = mesh.peers.iter().filter(|p| !p.is_tracker).collect();
        let range = model.num_layers - plan.tracker_layers;
        let reach = |peer: &PeerCapacity| {
            (0..=range)
                .rev()
                .find(|&l| l == 0 || fits(model, peer, l))
                .unwrap_or(0)
        };
        let shortfall =
            u64::from(range).saturating_sub(volunteers.iter().map(|p| u64::from(reach(p))).sum());
        let smallest_kv = volunteers.iter().map(|p| p.kv_tokens).min().unwrap_or(0);
        let cheapest = model
            .layer_bytes
            .values()
            .map(|bytes| bytes + smallest_kv * model.kv_bytes_per_token_per_layer)
            .min()
            .unwrap_or(0);
        prop_assert_eq!(plan.report.missing_memory_bytes, shortfall * cheapest);
    }

    // Applying the directives to what live peers held gives the planned map.
    let mut held = layer_sets(&mesh.map, &live);
    for directive in &plan.directives {
        match directive {
            Directive::DropShard {
                peer,
                layers,
                quantization,
            } => {
                let set = held.entry(peer.clone()).or_default();
                for layer in layers.start..layers.end {
                    prop_assert!(
                        set.remove(&(layer, *quantization)),
                        "{peer} drops {layer} ({quantization}) it does not hold"
                    );
                }
            }
            Directive::LoadShard {
                peer,
                layers,
                quantization,
            } => {
                prop_assert_eq!(Some(quantization), spans.get(peer).map(|(_, q)| q));
                let set = held.entry(peer.clone()).or_default();
                for layer in layers.start..layers.end {
                    prop_assert!(
                        set.insert((layer, *quantization)),
                        "{peer} loads {layer} twice"
                    );
                }
            }
        }
    }
    held.retain(|_, set| !set.is_empty());
    prop_assert_eq!(held, layer_sets(&plan.map, &live));

    // Replanning the planned mesh, loading or ready, changes nothing.
    let again = planner
        .plan(&plan.map, &mesh.peers)
        .expect("replan succeeds");
    prop_assert!(
        again.directives.is_empty(),
        "replan moved: {:?}",
        again.directives
    );
    let mut ready = plan.map.clone();
    ready.mark_all_ready();
    let settled = planner.plan(&ready, &mesh.peers).expect("replan succeeds");
    prop_assert!(
        settled.directives.is_empty(),
        "replan moved: {:?}",
        settled.directives
    );

    // Determinism, also under a different input order.
    prop_assert_eq!(
        plan,
        &planner.plan(&mesh.map, &mesh.peers).expect("plan succeeds")
    );
    let mut shuffled = mesh.peers.clone();
    shuffled.reverse();
    let rotation = mesh.rotation % shuffled.len().max(1);
    shuffled.rotate_left(rotation);
    prop_assert_eq!(
        plan,
        &planner.plan(&mesh.map, &shuffled).expect("plan succeeds")
    );
    Ok(())
}

fn config(mesh: &Mesh, tracker_layers: Option<u32>) -> PlannerConfig {
    PlannerConfig {
        tracker_layers,
        hysteresis: mesh.hysteresis,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Up to 6 peers × 8 layers: the plan covers the model exactly when an
    /// exhaustive search finds a contiguous cover.
    #[test]
    fn covers_whenever_a_cover_exists(mesh in mesh_strategy(8, 5)) {
        let planner = Planner::new(mesh.model.clone(), config(&mesh, None));
        let plan = planner.plan(&mesh.map, &mesh.peers).expect("valid mesh");
        let exists = cover_exists(&mesh.model, &mesh.peers, None);
        prop_assert_eq!(plan.report.is_complete(), exists, "report {:?}", plan.report);
        check_plan_invariants(&mesh, &planner, &plan)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// With a configured tracker span, coverage is still exact, and a span the
    /// tracker cannot hold is rejected.
    #[test]
    fn fixed_tracker_span_is_exact(mesh in mesh_strategy(8, 5), requested in 0u32..9) {
        let planner = Planner::new(mesh.model.clone(), config(&mesh, Some(requested)));
        let tracker = &mesh.peers[0];
        let tracker_fits = requested <= mesh.model.num_layers
            && (requested == 0 || fits(&mesh.model, tracker, requested));
        match planner.plan(&mesh.map, &mesh.peers) {
            Ok(plan) => {
                prop_assert!(tracker_fits);
                prop_assert_eq!(plan.tracker_layers, requested);
                let exists = cover_exists(&mesh.model, &mesh.peers, Some(requested));
                prop_assert_eq!(plan.report.is_complete(), exists);
                check_plan_invariants(&mesh, &planner, &plan)?;
            }
            Err(PlanError::TrackerSpanDoesNotFit { .. } | PlanError::InvalidConfig(_)) => {
                prop_assert!(!tracker_fits);
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Larger meshes (up to 60 peers × 40 layers): the same invariants, and
    /// coverage whenever the peers' reaches laid end to end span the model.
    #[test]
    fn larger_meshes_keep_every_invariant(mesh in mesh_strategy(40, 60)) {
        let planner = Planner::new(mesh.model.clone(), config(&mesh, None));
        let plan = planner.plan(&mesh.map, &mesh.peers).expect("valid mesh");
        let reach = |peer: &PeerCapacity| {
            (0..=mesh.model.num_layers).rev().find(|&l| l == 0 || fits(&mesh.model, peer, l)).unwrap_or(0)
        };
        let tracker_reach = reach(&mesh.peers[0]);
        let volunteer_reach: u32 = mesh.peers[1..].iter().map(reach).sum();
        let enough = tracker_reach + volunteer_reach >= mesh.model.num_layers;
        prop_assert_eq!(plan.report.is_complete(), enough);
        check_plan_invariants(&mesh, &planner, &plan)?;
    }
}
